#!/usr/bin/env bash
# The Vagrant box of vagrant/ built here from Debian's packages (issue 47), in vagrant-libvirt's
# box format (a qcow2 disk, metadata.json, a Vagrantfile; tar), for machines that cannot reach
# Vagrant's box registry (debian/bookworm64) or that should not wait on apt in an emulated VM.
# It starts from the kernel matrix's root file system (scripts/kernel-guests.sh: debootstrap
# of bookworm from the machine's own mirror, Debian's 6.1 kernel and headers, bcc, iproute2,
# nftables, ...), drops the matrix's 6.12 kernel and its guest init, and adds what a Vagrant
# box needs (systemd, udev, sshd, sudo, rsync, the vagrant user with Vagrant's insecure key,
# DHCP on the first NIC, GRUB on the disk) and what the packet tests and the demo need that
# the matrix shares in from this machine instead: a venv at /opt/cozyebpf/venv
# (--system-site-packages, bcc from Debian) with pyproject.toml's dependencies and test extras
# from PyPI, which imports cozyebpf from the synced checkout (/cozyebpf, a .pth file). So the VM
# needs no network beyond the lab's own to run the tests. Runs as root (loop mount, chroot).
#
#   scripts/vagrant-box.sh            build the box when it is missing or out of date
#   scripts/vagrant-box.sh --add      build it when needed, then `vagrant box add` it (again
#                                     when the box file is newer than the added box)
#   scripts/vagrant-box.sh --rebuild  build it again from the matrix's root
#   scripts/vagrant-box.sh --print    print the box file's path and name
#
# Into $COZYEBPF_BOX_CACHE (default /var/cache/cozyebpf/vagrant-box): cozyebpf-bookworm.box,
# recipe (what it was built from), build.log. The box's name in Vagrant: cozyebpf/bookworm-local
# ($COZYEBPF_BOX_NAME). About 4 minutes from the matrix's cache; a second when current.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/as-root.sh" "$@" # as root, or again through sudo

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/lib/image.sh
source "$REPO_ROOT/scripts/lib/image.sh" # pip_secrets: this machine's pip settings for pip in the chroot
RECIPE_VERSION=1 # raise it with every change to what the build below puts in the box
CACHE="${COZYEBPF_BOX_CACHE:-/var/cache/cozyebpf/vagrant-box}"
MATRIX="${COZYEBPF_GUEST_CACHE:-/var/cache/cozyebpf/kernel-matrix}"
BOX="$CACHE/cozyebpf-bookworm.box"
BOX_NAME="${COZYEBPF_BOX_NAME:-cozyebpf/bookworm-local}"
DISK_GB=16 # the disk's virtual size; qcow2 stores only what is written
BOX_PACKAGES=(
	systemd-sysv udev openssh-server sudo rsync python3-venv ca-certificates grub-pc-bin
	less iptables
)

log() { printf '==> vagrant-box: %s\n' "$*"; }
die() {
	printf 'vagrant-box.sh: ERROR: %s\n' "$*" >&2
	exit 1
}

MODE=build ADD=0
case "${1:-}" in
"") ;;
--add) ADD=1 ;;
--rebuild) MODE=rebuild ;;
--print)
	printf '%s %s\n' "$BOX" "$BOX_NAME"
	exit 0
	;;
-h | --help)
	sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
	exit 0
	;;
*) die "unknown argument $1 (--add, --rebuild, --print or none)" ;;
esac

bash "$REPO_ROOT/scripts/kernel-guests.sh" || die "the kernel matrix's root file system could not be built (scripts/kernel-guests.sh)"

# The Python dependencies: pyproject.toml's, and its test extras
mapfile -t PY_DEPS < <(python3 - "$REPO_ROOT/pyproject.toml" <<-'EOF'
	import sys, tomllib
	p = tomllib.load(open(sys.argv[1], "rb"))["project"]
	print("\n".join(p["dependencies"] + p["optional-dependencies"]["test"]))
EOF
)
RECIPE="$(
	printf 'version %s\nmatrix %s\npackages %s\npython %s\nscript %s\n' "$RECIPE_VERSION" \
		"$(sha256sum <"$MATRIX/recipe" | cut -d' ' -f1)" "${BOX_PACKAGES[*]}" "${PY_DEPS[*]}" \
		"$(sha256sum <"${BASH_SOURCE[0]}" | cut -d' ' -f1)"
)"

add_box() {
	# vagrant box add again when the box file is newer than the added box
	local added
	added="$(find "${VAGRANT_HOME:-$HOME/.vagrant.d}/boxes/${BOX_NAME//\//-VAGRANTSLASH-}" \
		-name metadata.json -newer "$BOX" -print -quit 2>/dev/null || true)"
	if [[ -n $added ]]; then
		log "$BOX_NAME is added already ($(vagrant box list | grep "^$BOX_NAME " || true))"
		return
	fi
	log "vagrant box add --force --name $BOX_NAME $BOX"
	local t=$SECONDS
	vagrant box add --force --name "$BOX_NAME" "$BOX"
	log "added in $((SECONDS - t))s"
}

if [[ $MODE != rebuild && -f $BOX && -f $CACHE/recipe && "$(cat "$CACHE/recipe")" == "$RECIPE" ]]; then
	log "the box in $BOX is current"
	((ADD)) && add_box
	exit 0
fi

# --- the build ------------------------------------------------------------------------------
START=$SECONDS
mkdir -p "$CACHE"
exec > >(tee "$CACHE/build.log") 2>&1
WORK="$(mktemp -d "$CACHE/build.XXXXXX")"
ROOT="$WORK/root"
mounts_under_work() { awk -v w="$WORK/" 'index($2, w) == 1 { print $2 }' /proc/self/mounts | sort -r; }
cleanup() {
	local m
	while read -r m; do
		umount -l "$m" 2>/dev/null || true
	done < <(mounts_under_work)
	if [[ -n "$(mounts_under_work)" ]]; then
		printf 'vagrant-box.sh: %s still has mounts; not removing it\n' "$WORK" >&2
		return
	fi
	rm -rf --one-file-system "$WORK"
}
trap cleanup EXIT
step() { log "[$((SECONDS - START))s] $*"; }

step "copying the kernel matrix's root ($MATRIX/rootfs.img, mounted read-only)"
mkdir -p "$WORK/matrix" "$ROOT"
mount -o loop,ro "$MATRIX/rootfs.img" "$WORK/matrix"
cp -a "$WORK/matrix/." "$ROOT/"
umount "$WORK/matrix"

printf '#!/bin/sh\nexit 101\n' >"$ROOT/usr/sbin/policy-rc.d" # no daemon starts in the chroot
chmod 0755 "$ROOT/usr/sbin/policy-rc.d"
for m in proc sys dev; do
	mount --rbind "/$m" "$ROOT/$m"
	mount --make-rslave "$ROOT/$m"
done
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
in_root() { chroot "$ROOT" env DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8 "$@"; }
APT=(apt-get -o Acquire::Retries=3 -o Dpkg::Use-Pty=0 -y -q --no-install-recommends)

# the box boots Debian's 6.1 (the kernel linux-image-amd64 depends on); not the matrix's 6.12
K61="$(sed -n 1p "$MATRIX/kernels" | cut -d' ' -f1)"
mapfile -t OTHER < <(in_root dpkg-query -W -f='${Package}\n' 'linux-image-*' 'linux-headers-*' |
	grep -v -e "$K61" -e '-common$' || true)
mapfile -t OTHER_COMMON < <(in_root dpkg-query -W -f='${Package}\n' 'linux-headers-*-common' |
	grep -v -e "${K61%-amd64}" || true)
step "apt-get update; removing ${OTHER[*]} ${OTHER_COMMON[*]}"
in_root apt-get -q update >"$WORK/apt.log" 2>&1 || die "apt-get update in the chroot failed: $(tail -n 20 "$WORK/apt.log")"
if ((${#OTHER[@]} + ${#OTHER_COMMON[@]} > 0)); then
	in_root "${APT[@]}" purge "${OTHER[@]}" "${OTHER_COMMON[@]}" >>"$WORK/apt.log" 2>&1 ||
		die "removing the 6.12 kernel failed: $(tail -n 20 "$WORK/apt.log")"
	in_root "${APT[@]}" autoremove --purge >>"$WORK/apt.log" 2>&1 || die "apt-get autoremove failed"
fi
step "installing ${BOX_PACKAGES[*]}"
in_root "${APT[@]}" install "${BOX_PACKAGES[@]}" "linux-image-amd64" >>"$WORK/apt.log" 2>&1 ||
	die "installing the box's packages failed: $(tail -n 20 "$WORK/apt.log")"

step "the venv /opt/cozyebpf/venv: ${PY_DEPS[*]}"
# pip in the chroot reaches the package index as this machine's pip does (its index settings
# and CA bundle: scripts/lib/image.sh's pip_secrets), for the build only: not left in the box
cd "$REPO_ROOT"
pip_secrets "$WORK"
# (a clean environment: this machine's PIP_*, REQUESTS_CA_BUNDLE, ... name its own files)
PIP_ENV=(PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LC_ALL=C.UTF-8 PIP_NO_INPUT=1
	PIP_CONFIG_FILE=/tmp/cz-pip.conf)
cp "$WORK/pip.conf" "$ROOT/tmp/cz-pip.conf"
if [[ -n $ca_bundle ]]; then
	cp "$ca_bundle" "$ROOT/tmp/cz-ca.pem"
	PIP_ENV+=(PIP_CERT=/tmp/cz-ca.pem REQUESTS_CA_BUNDLE=/tmp/cz-ca.pem SSL_CERT_FILE=/tmp/cz-ca.pem)
fi
in_root python3 -m venv --system-site-packages /opt/cozyebpf/venv
chroot "$ROOT" env -i "${PIP_ENV[@]}" /opt/cozyebpf/venv/bin/pip install -q --disable-pip-version-check \
	--progress-bar off --no-cache-dir "${PY_DEPS[@]}" >"$WORK/pip.log" 2>&1 ||
	die "pip install in the box's venv failed: $(tail -n 20 "$WORK/pip.log")"
rm -f "$ROOT/tmp/cz-pip.conf" "$ROOT/tmp/cz-ca.pem"
# the package itself is the synced checkout's (and its labs, tests: the repository root)
SITE="$(in_root /opt/cozyebpf/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo /cozyebpf >"$ROOT$SITE/cozyebpf-checkout.pth"

step "the box's configuration: vagrant user, sshd, DHCP, fstab, GRUB"
in_root useradd -m -s /bin/bash -G sudo vagrant 2>/dev/null || true
install -d -m 0700 -o 1000 -g 1000 "$ROOT/home/vagrant/.ssh"
KEY="$(find /usr/share/rubygems-integration /usr/share/vagrant /opt/vagrant -path '*keys/vagrant.pub' -print -quit 2>/dev/null || true)"
[[ -n $KEY ]] || die "Vagrant's insecure public key (keys/vagrant.pub) is not on this machine (scripts/setup.sh --vagrant installs vagrant)"
install -m 0600 -o "$(in_root id -u vagrant)" -g "$(in_root id -g vagrant)" "$KEY" "$ROOT/home/vagrant/.ssh/authorized_keys"
chown "$(in_root id -u vagrant):$(in_root id -g vagrant)" "$ROOT/home/vagrant/.ssh"
printf 'vagrant ALL=(ALL) NOPASSWD: ALL\nDefaults:vagrant !requiretty\n' >"$ROOT/etc/sudoers.d/vagrant"
chmod 0440 "$ROOT/etc/sudoers.d/vagrant"
printf 'UseDNS no\n' >"$ROOT/etc/ssh/sshd_config.d/vagrant.conf"
# every VM makes its own host keys at its first boot
rm -f "$ROOT"/etc/ssh/ssh_host_*
mkdir -p "$ROOT/etc/systemd/system/ssh.service.d"
printf '[Service]\nExecStartPre=\nExecStartPre=/usr/bin/ssh-keygen -A\nExecStartPre=/usr/sbin/sshd -t\n' \
	>"$ROOT/etc/systemd/system/ssh.service.d/host-keys.conf"
: >"$ROOT/etc/machine-id"
printf '[Match]\nName=en* eth*\n\n[Network]\nDHCP=yes\n' >"$ROOT/etc/systemd/network/50-dhcp.network"
in_root systemctl enable systemd-networkd ssh >/dev/null 2>&1 || die "systemctl enable systemd-networkd ssh failed"
echo cozyebpf >"$ROOT/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 cozyebpf\n::1 localhost ip6-localhost ip6-loopback\n' >"$ROOT/etc/hosts"
printf '/dev/vda1 / ext4 errors=remount-ro 0 1\n' >"$ROOT/etc/fstab"
rm -f "$ROOT/sbin/cz-guest-init"
# the initramfs: the matrix's list (virtio_pci, virtio_blk, ext4) is what root=/dev/vda1 needs
in_root update-initramfs -u -k "$K61" >>"$WORK/apt.log" 2>&1 || die "update-initramfs failed"

# GRUB (BIOS) without a loop device: core.img (its prefix the partition's /boot/grub) in the
# gap after the MBR, boot.img's code in the MBR; grub.cfg boots /vmlinuz (Debian's link to the
# newest kernel, so a kernel installed in the VM boots after a reboot)
mkdir -p "$ROOT/boot/grub/i386-pc"
cp "$ROOT"/usr/lib/grub/i386-pc/*.mod "$ROOT"/usr/lib/grub/i386-pc/*.lst "$ROOT/boot/grub/i386-pc/"
cat >"$ROOT/boot/grub/grub.cfg" <<'EOF'
# written by cozyebpf's scripts/vagrant-box.sh: boots Debian's newest kernel (/vmlinuz)
set timeout=1
serial --unit=0 --speed=115200
terminal_input serial console
terminal_output serial console
menuentry "Debian GNU/Linux" {
	insmod ext2
	linux /vmlinuz root=/dev/vda1 ro console=tty0 console=ttyS0,115200 net.ifnames=0
	initrd /initrd.img
}
EOF
in_root grub-mkimage -O i386-pc -o /tmp/core.img -p '(hd0,msdos1)/boot/grub' biosdisk part_msdos ext2
mv "$ROOT/tmp/core.img" "$WORK/core.img"
cp "$ROOT/usr/lib/grub/i386-pc/boot.img" "$WORK/boot.img"
[[ -e $ROOT/vmlinuz && -e $ROOT/initrd.img ]] || die "the root has no /vmlinuz and /initrd.img links"

in_root apt-get clean
rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT/usr/sbin/policy-rc.d"
while read -r m; do
	umount -l "$m"
done < <(mounts_under_work)
[[ -z "$(mounts_under_work)" ]] || die "could not unmount $(mounts_under_work | paste -sd' ' -)"

step "the disk: MBR, GRUB, ext4 from the root (${DISK_GB} GB virtual)"
DISK="$WORK/disk.raw"
truncate -s "${DISK_GB}G" "$DISK"
printf 'label: dos\nstart=2048, type=83, bootable\n' | sfdisk -q "$DISK"
mkfs.ext4 -q -F -L czbox -E offset=$((2048 * 512)) -d "$ROOT" "$DISK" $((DISK_GB * 1024 - 1))M ||
	die "mkfs.ext4 -d failed"
dd if="$WORK/boot.img" of="$DISK" bs=440 count=1 conv=notrunc status=none
CORE_SECTORS=$((($(stat -c %s "$WORK/core.img") + 511) / 512))
((CORE_SECTORS < 2047)) || die "GRUB's core.img ($CORE_SECTORS sectors) does not fit before the partition"
dd if="$WORK/core.img" of="$DISK" bs=512 seek=1 conv=notrunc status=none

step "the box: qcow2, metadata.json, Vagrantfile"
mkdir -p "$WORK/box"
qemu-img convert -f raw -O qcow2 "$DISK" "$WORK/box/box.img"
rm -f "$DISK"
printf '{"provider": "libvirt", "format": "qcow2", "virtual_size": %s}\n' "$DISK_GB" >"$WORK/box/metadata.json"
cat >"$WORK/box/Vagrantfile" <<'EOF'
# the box of cozyebpf's scripts/vagrant-box.sh: Debian 12, its 6.1 kernel, GRUB on virtio
Vagrant.configure("2") do |config|
  config.vm.provider :libvirt do |lv|
    lv.disk_bus = "virtio"
  end
end
EOF
tar -C "$WORK/box" -cf "$WORK/box.tar" metadata.json Vagrantfile box.img
rm -f "$CACHE/recipe"
mv "$WORK/box.tar" "$BOX"
printf '%s\n' "$RECIPE" >"$CACHE/recipe"
step "done: $BOX ($(du -h "$BOX" | cut -f1); kernel $K61)"
((ADD)) && add_box
exit 0
