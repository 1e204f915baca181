#!/usr/bin/env bash
# The kernel matrix's guests, built once and cached outside the checkout (nothing of it is
# committed): a Debian 12 root file system made by debootstrap from the machine's own Debian
# mirror, with what the tests need inside a guest, Debian's kernels of the matrix and their
# headers, and an initramfs per kernel (virtio-blk, ext4; 9p loads from the disk).
# scripts/kernel-matrix.sh and tests/datapath/test_kernel_guest.py boot them under qemu
# (cozylab/kmatrix.py). Runs as root (debootstrap, chroot, mounts).
#
#   scripts/kernel-guests.sh            build what is missing or out of date (a few seconds when
#                                       the cache is current; 3 to 5 minutes from nothing)
#   scripts/kernel-guests.sh --check    say whether the cache is current; exit 1 when not
#   scripts/kernel-guests.sh --rebuild  build again from nothing
#
# The cache ($COZYEBPF_GUEST_CACHE, default /var/cache/cozyebpf/kernel-matrix):
#   rootfs.img           ext4, the guests' root file system; qemu opens it with snapshot=on,
#                        so guests never change it and several may boot from it at once
#   boot/vmlinuz-K, boot/initrd.img-K   each kernel K of the matrix
#   kernels              one line per kernel: release, its headers' two directories in the
#                        guest, the fallback headers' two directories (the image's)
#   recipe               what the cache was built from (the kernels Debian resolved, the
#                        packages, RECIPE_VERSION below); a different recipe rebuilds
#   build.log            the last build's output
#
# The kernels of the matrix, resolved from Debian's package lists when the cache is built:
#   - Debian 12's own: what linux-image-amd64 depends on (6.1.0-N-amd64); its headers are the
#     image's fallback headers too (the Dockerfile unpacks linux-headers-amd64's)
#   - the 6.12 line of bookworm-security (Talos 1.9-1.11 run 6.12): the newest
#     linux-image-6.12.*+deb12-amd64 that has linux-headers of the same version
# The packages: those scripts/setup.sh installs that the tests run inside a guest (the
# checkout's .venv is shared in with the checkout, so pip never runs in the guest).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/as-root.sh" "$@" # as root, or again through sudo

RECIPE_VERSION=2 # raise it with every change to what the build below puts in the cache
CACHE="${COZYEBPF_GUEST_CACHE:-/var/cache/cozyebpf/kernel-matrix}"
ARCH=amd64
GUEST_PACKAGES=(
	python3 python3-bpfcc libbpfcc iproute2 iputils-ping nftables curl netcat-openbsd procps
	ethtool libcap2-bin python3-seccomp kmod util-linux
	# the .venv (--system-site-packages) takes these of its tests' dependencies from Debian's
	# packages where the machine has them (hypothesis: sortedcontainers; kubernetes' auth)
	python3-sortedcontainers python3-cryptography
	initramfs-tools zstd
)
# the modules the initramfs needs to reach the root file system
INITRAMFS_MODULES=(virtio_pci virtio_blk ext4)

log() { printf '==> kernel-guests: %s\n' "$*"; }
die() {
	printf 'kernel-guests.sh: ERROR: %s\n' "$*" >&2
	exit 1
}

MODE=build
case "${1:-}" in
"") ;;
--check) MODE=check ;;
--rebuild) MODE=rebuild ;;
-h | --help)
	sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
	exit 0
	;;
*) die "unknown argument $1 (--check, --rebuild or none)" ;;
esac

# --- the host's tools ---------------------------------------------------------------------
HOST_PACKAGES=(debootstrap qemu-system-x86 e2fsprogs)
missing_host_packages() {
	local pkg status
	for pkg in "${HOST_PACKAGES[@]}"; do
		status="$(dpkg-query -W -f='${db:Status-Abbrev}' "$pkg" 2>/dev/null || true)"
		[[ $status == ii* ]] || printf '%s\n' "$pkg"
	done
}
mapfile -t MISSING < <(missing_host_packages)
if ((${#MISSING[@]} > 0)); then
	[[ $MODE == check ]] && die "missing on this machine: ${MISSING[*]} (scripts/kernel-guests.sh installs them)"
	log "installing ${MISSING[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get -o Acquire::Retries=3 -o DPkg::Lock::Timeout=300 update -q
	apt-get -o Acquire::Retries=3 -o DPkg::Lock::Timeout=300 install -y -q "${MISSING[@]}" </dev/null
fi

# --- the recipe: the kernels Debian has now -------------------------------------------------
# The quick answer: a whole cache of this recipe version, and no package list newer than it
# (Debian's kernels cannot have changed since): no need to ask apt (a few seconds).
if [[ $MODE != rebuild && -f $CACHE/recipe && -f $CACHE/rootfs.img && -f $CACHE/kernels ]] &&
	grep -qx "version $RECIPE_VERSION" "$CACHE/recipe" &&
	[[ -z "$(find /var/lib/apt/lists -maxdepth 1 -newer "$CACHE/recipe" -print -quit 2>/dev/null)" ]]; then
	log "the cache in $CACHE is current ($(cut -d' ' -f1 "$CACHE/kernels" | paste -sd' ' -); no apt list changed since it was built)"
	exit 0
fi

# The machine's Debian mirrors: the sites of its bookworm and bookworm-security lists.
TARGETS="$(apt-get indextargets --format '$(SITE) $(RELEASE)' 2>/dev/null || true)"
site_of() { awk -v r="$1" '$2 == r { print $1; exit }' <<<"$TARGETS"; }
MIRROR="$(site_of bookworm)"
SECURITY="$(site_of bookworm-security)"
[[ -n $MIRROR ]] || die "this machine's apt sources have no bookworm suite (a Debian 12 machine is needed: debootstrap takes its mirror from there)"
[[ -n $SECURITY ]] || die "this machine's apt sources have no bookworm-security suite (Debian's kernels come from there); add it to /etc/apt/sources.list.d/ and run apt-get update"

DEPENDS="$(apt-cache depends "linux-image-$ARCH" "linux-headers-$ARCH" 2>/dev/null || true)"
IMG61="$(sed -n "s/^ *Depends: \(linux-image-[0-9.-]*-$ARCH\)$/\1/p" <<<"$DEPENDS" | head -n1)"
HDR_FALLBACK="$(sed -n "s/^ *Depends: \(linux-headers-[0-9.-]*-$ARCH\)$/\1/p" <<<"$DEPENDS" | head -n1)"
[[ -n $IMG61 && -n $HDR_FALLBACK ]] || die "apt-cache knows no linux-image-$ARCH or linux-headers-$ARCH (run apt-get update)"
K61="${IMG61#linux-image-}"
NAMES="$(apt-cache pkgnames linux- 2>/dev/null || true)"
K612=""
while read -r k; do
	if grep -qx "linux-headers-$k" <<<"$NAMES"; then
		K612=$k
	fi
done < <(sed -n "s/^linux-image-\(6\.12\.[0-9]*+deb12-$ARCH\)$/\1/p" <<<"$NAMES" | sort -V)
[[ -n $K612 ]] || die "apt-cache knows no linux-image-6.12.*+deb12-$ARCH with headers of the same version (bookworm-security carries them; run apt-get update)"
KERNELS=("$K61" "$K612")

RECIPE="$(
	printf 'version %s\nmirror %s\nsecurity %s\nkernels %s\nfallback %s\npackages %s\nmodules %s\n' \
		"$RECIPE_VERSION" "$MIRROR" "$SECURITY" "${KERNELS[*]}" "$HDR_FALLBACK" \
		"${GUEST_PACKAGES[*]}" "${INITRAMFS_MODULES[*]}"
)"

current() {
	[[ -f $CACHE/recipe && -f $CACHE/rootfs.img && -f $CACHE/kernels ]] || return 1
	[[ "$(cat "$CACHE/recipe")" == "$RECIPE" ]] || return 1
	local k
	for k in "${KERNELS[@]}"; do
		[[ -f $CACHE/boot/vmlinuz-$k && -f $CACHE/boot/initrd.img-$k ]] || return 1
	done
}

if [[ $MODE != rebuild ]] && current; then
	touch "$CACHE/recipe" # the package lists changed, Debian's kernels did not
	log "the cache in $CACHE is current (kernels ${KERNELS[*]}; fallback headers ${HDR_FALLBACK#linux-headers-})"
	exit 0
fi
if [[ $MODE == check ]]; then
	if [[ -f $CACHE/recipe ]]; then
		echo "kernel-guests: the cache in $CACHE is out of date (Debian's kernels or this script changed); run scripts/kernel-guests.sh" >&2
	else
		echo "kernel-guests: no cache in $CACHE; run scripts/kernel-guests.sh (3 to 5 minutes)" >&2
	fi
	exit 1
fi

# --- the build ------------------------------------------------------------------------------
START=$SECONDS
mkdir -p "$CACHE"
exec > >(tee "$CACHE/build.log") 2>&1
WORK="$(mktemp -d "$CACHE/build.XXXXXX")"
ROOT="$WORK/root"
# Every mount under $WORK, deepest first: ours (proc, sys, dev) and any debootstrap left behind.
mounts_under_work() { awk -v w="$WORK/" 'index($2, w) == 1 { print $2 }' /proc/self/mounts | sort -r; }
cleanup() {
	local m
	while read -r m; do
		umount -l "$m" 2>/dev/null || true
	done < <(mounts_under_work)
	if [[ -n "$(mounts_under_work)" ]]; then
		printf 'kernel-guests.sh: %s still has mounts (%s); not removing it\n' "$WORK" \
			"$(mounts_under_work | paste -sd' ' -)" >&2
		return
	fi
	# --one-file-system: never into a bind mount of the host's /dev, /sys or /proc
	rm -rf --one-file-system "$WORK"
}
trap cleanup EXIT

step() { log "[$((SECONDS - START))s] $*"; }

step "debootstrap bookworm (minbase) from $MIRROR into $ROOT"
debootstrap --variant=minbase --arch="$ARCH" bookworm "$ROOT" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 ||
	die "debootstrap failed; its log: $(tail -n 20 "$WORK/debootstrap.log")"

cat >"$ROOT/etc/apt/sources.list" <<EOF
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb $SECURITY bookworm-security main
EOF
printf '#!/bin/sh\nexit 101\n' >"$ROOT/usr/sbin/policy-rc.d" # no daemon starts in the chroot
chmod 0755 "$ROOT/usr/sbin/policy-rc.d"
for m in proc sys dev; do
	mount --rbind "/$m" "$ROOT/$m"
	mount --make-rslave "$ROOT/$m"
done
in_root() { chroot "$ROOT" env DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8 "$@"; }

# the initramfs: the listed modules only, zstd (set before any kernel is installed)
mkdir -p "$ROOT/etc/initramfs-tools/conf.d"
printf 'MODULES=list\nCOMPRESS=zstd\n' >"$ROOT/etc/initramfs-tools/conf.d/cozyebpf.conf"
printf '%s\n' "${INITRAMFS_MODULES[@]}" >>"$ROOT/etc/initramfs-tools/modules"

APT=(apt-get -o Acquire::Retries=3 -o Dpkg::Use-Pty=0 -y -q --no-install-recommends)
step "apt-get update in the guest's root (bookworm, -updates, -security)"
in_root apt-get -q update >"$WORK/apt.log" 2>&1 || die "apt-get update in the chroot failed: $(tail -n 20 "$WORK/apt.log")"
step "installing the guest's packages: ${GUEST_PACKAGES[*]}"
in_root "${APT[@]}" install "${GUEST_PACKAGES[@]}" >>"$WORK/apt.log" 2>&1 ||
	die "installing the guest's packages failed: $(tail -n 20 "$WORK/apt.log")"
PKGS=()
for k in "${KERNELS[@]}"; do
	PKGS+=("linux-image-$k" "linux-headers-$k")
done
PKGS+=("$HDR_FALLBACK")
step "installing the kernels and their headers: ${PKGS[*]}"
in_root "${APT[@]}" install "${PKGS[@]}" >>"$WORK/apt.log" 2>&1 ||
	die "installing the kernels failed: $(tail -n 20 "$WORK/apt.log")"
in_root apt-get clean

# every kernel's headers, as the guest sees them: /usr/src/linux-headers-K and its -common
headers_of() {
	# Debian's linux-headers-K-amd64 holds the configuration; its Makefile includes the
	# -common package's, which holds the rest
	local arch_dir="/usr/src/linux-headers-$1" common
	common="$(sed -n 's#^include \(/usr/src/linux-headers-.*-common\)/Makefile$#\1#p' "$ROOT$arch_dir/Makefile" 2>/dev/null || true)"
	[[ -n $common && -f $ROOT$common/include/linux/kconfig.h ]] ||
		die "the headers of $1 are not where Debian puts them ($arch_dir, and the -common directory its Makefile includes)"
	printf '%s %s' "$arch_dir" "$common"
}
FALLBACK_DIRS="$(headers_of "${HDR_FALLBACK#linux-headers-}")"

mkdir -p "$WORK/boot"
: >"$WORK/kernels"
for k in "${KERNELS[@]}"; do
	[[ -f $ROOT/boot/vmlinuz-$k && -f $ROOT/boot/initrd.img-$k ]] ||
		die "the chroot has no /boot/vmlinuz-$k and /boot/initrd.img-$k after installing linux-image-$k"
	cp "$ROOT/boot/vmlinuz-$k" "$ROOT/boot/initrd.img-$k" "$WORK/boot/"
	own="$(headers_of "$k")"
	printf '%s %s %s\n' "$k" "$own" "$FALLBACK_DIRS" >>"$WORK/kernels"
done

# PID 1 of a guest: mounts what the tests need, the two 9p shares (the checkout, read-only,
# at the path the host has it: cz.repo= on the kernel's command line; and /results), runs
# /results/run.sh (cozylab/kmatrix.py writes it) and powers off
cat >"$ROOT/sbin/cz-guest-init" <<'EOF'
#!/bin/sh
# PID 1 of a kernel-matrix guest (scripts/kernel-guests.sh wrote it; cozylab/kmatrix.py boots it)
PATH=/usr/sbin:/usr/bin:/sbin:/bin
export PATH
# the initramfs moved /proc, /sys and /dev here already; the rest is ours
fs() { mountpoint -q "$3" || mount -t "$1" "$2" "$3"; }
fs proc proc /proc
fs sysfs sysfs /sys
fs devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
fs devpts devpts /dev/pts
fs tmpfs tmpfs /dev/shm
fs tmpfs tmpfs /run
fs tmpfs tmpfs /tmp
fs bpf bpf /sys/fs/bpf
fs debugfs debugfs /sys/kernel/debug 2>/dev/null
fs tracefs tracefs /sys/kernel/tracing 2>/dev/null
fs cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null
ip link set lo up
hostname czguest
repo=""
for arg in $(cat /proc/cmdline); do
	case $arg in cz.repo=*) repo=${arg#cz.repo=} ;; esac
done
modprobe 9pnet_virtio
mkdir -p /results
if ! mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 results /results; then
	echo "cz-guest-init: could not mount the results share" >&2
elif [ -z "$repo" ] || ! { mkdir -p "$repo" && mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,cache=loose,ro repo "$repo"; }; then
	echo "cz-guest-init: could not mount the checkout at '$repo' (cz.repo= on the kernel's command line)" >&2
else
	echo "cz-guest-init: up in $(cut -d' ' -f1 /proc/uptime) s, kernel $(uname -r)"
	sh /results/run.sh
	echo "cz-guest-init: run.sh exited $?"
fi
sync
echo o >/proc/sysrq-trigger
sleep 60
EOF
chmod 0755 "$ROOT/sbin/cz-guest-init"
echo czguest >"$ROOT/etc/hostname"
: >"$ROOT/etc/fstab"
rm -f "$ROOT/usr/sbin/policy-rc.d"

while read -r m; do
	umount -l "$m"
done < <(mounts_under_work)
[[ -z "$(mounts_under_work)" ]] || die "could not unmount $(mounts_under_work | paste -sd' ' -)"

SIZE_MB=$(($(du -sm "$ROOT" | cut -f1) * 5 / 4 + 512))
step "making the disk image ($SIZE_MB MB, ext4) from the root"
mkfs.ext4 -q -F -L czroot -d "$ROOT" "$WORK/rootfs.img" "${SIZE_MB}M" ||
	die "mkfs.ext4 -d failed (e2fsprogs 1.43 or later is needed)"

# into place: the image and kernels first, the recipe last (it says the cache is whole)
rm -f "$CACHE/recipe"
rm -rf "$CACHE/boot"
mv "$WORK/rootfs.img" "$CACHE/rootfs.img"
mv "$WORK/boot" "$CACHE/boot"
mv "$WORK/kernels" "$CACHE/kernels"
printf '%s\n' "$RECIPE" >"$CACHE/recipe"
step "done: $CACHE (kernels ${KERNELS[*]}; fallback headers ${HDR_FALLBACK#linux-headers-}; $(du -sh "$CACHE/rootfs.img" | cut -f1) on disk)"
