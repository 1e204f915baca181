#!/usr/bin/env bash
# Builds what the real-node lab's nodes run besides Kubernetes' own binaries (scripts/build-kube.sh
# builds kubelet, kube-proxy, kube-scheduler and kubectl), once per machine:
#   bash scripts/build-node.sh               (setup.sh --real-node calls it)
#   bash scripts/build-node.sh --print-dir   (the directory the binaries are in, and nothing else)
#
# From the Go module proxy (go.mod and go.sum committed, -mod=readonly):
#   - containerd, containerd-shim-runc-v2 and ctr of the release cozylab/controlplane/containerd/
#     go.mod pins (CGO off; no btrfs, devmapper or zfs snapshotter: the lab uses overlayfs);
#   - runc of the release cozylab/controlplane/runc/go.mod pins, with cgo and libseccomp (Debian's
#     libseccomp-dev): containerd hands runc the RuntimeDefault seccomp profile, which a runc
#     without seccomp refuses;
#   - echo, the backends' server (cozylab/images/echo, the standard library only);
# and with gcc: pause, Kubernetes' own build/pause/linux/pause.c of the pinned Kubernetes release
# (from the module cache, as its Makefile builds it: -Os -static).
# Into ${COZYEBPF_NODE_CACHE:-/var/cache/cozyebpf/node}/<stamp>/, outside the repository.
# Idempotent like build-kube.sh: a stamp of everything the build reads; a second run takes well
# under a second. The images made of these binaries are written by the lab itself
# (cozylab/realnode/oci.py); the agent's images by scripts/build-agent-image.sh.
#
# Environment:
#   COZYEBPF_NODE_CACHE  where the stamped directories go (default /var/cache/cozyebpf/node)
#   GO                   the go command (default: go on PATH, else /usr/local/go/bin/go)
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CTRD_MOD="$REPO_ROOT/cozylab/controlplane/containerd"
RUNC_MOD="$REPO_ROOT/cozylab/controlplane/runc"
ECHO_MOD="$REPO_ROOT/cozylab/images/echo"
KUBE_MOD="$REPO_ROOT/cozylab/controlplane/kube"
CACHE="${COZYEBPF_NODE_CACHE:-/var/cache/cozyebpf/node}"
BINARIES=(containerd containerd-shim-runc-v2 ctr runc pause echo)

log() { printf '==> %s\n' "$*"; }
die() {
	printf 'build-node.sh: ERROR: %s\n' "$*" >&2
	exit 1
}

PRINT_DIR=0
case ${1:-} in
--print-dir) PRINT_DIR=1 ;;
"") ;;
*) die "unknown arguments: $* (usage: build-node.sh [--print-dir])" ;;
esac

GO="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"
[[ -x $GO ]] || die "Go is missing ($GO): install Go 1.26 (/usr/local/go) or set GO=/path/to/go"
GO_VERSION="$("$GO" env GOVERSION)" || die "$GO does not run"

version_of() { awk -v m="$2" '$1 == m && $2 ~ /^v[0-9]/ {print $2; exit}' "$1/go.mod"; }
CTRD_VERSION="$(version_of "$CTRD_MOD" github.com/containerd/containerd/v2)"
RUNC_VERSION="$(version_of "$RUNC_MOD" github.com/opencontainers/runc)"
KUBE_VERSION="$(version_of "$KUBE_MOD" k8s.io/kubernetes)"
[[ -n $CTRD_VERSION && -n $RUNC_VERSION && -n $KUBE_VERSION ]] ||
	die "no containerd, runc or kubernetes version in the modules' go.mod"

stamp() {
	{
		printf 'go=%s gcc=%s\n' "$GO_VERSION" "$(gcc -dumpfullversion 2>/dev/null || echo none)"
		sha256sum "$CTRD_MOD"/go.{mod,sum} "$RUNC_MOD"/go.{mod,sum} "$ECHO_MOD"/go.mod \
			"$ECHO_MOD"/main.go "$KUBE_MOD/go.mod" "${BASH_SOURCE[0]}" | cut -c1-64
	} | sha256sum | cut -c1-64
}
WANT="$(stamp)"
DEST="$CACHE/${WANT:0:12}"
if ((PRINT_DIR)); then
	printf '%s\n' "$DEST"
	exit 0
fi

built() {
	[[ -f $DEST/stamp && $(<"$DEST/stamp") == "$WANT" ]] || return 1
	local bin
	for bin in "${BINARIES[@]}"; do
		[[ -x $DEST/$bin ]] || return 1
	done
	"$DEST/containerd" --version >/dev/null 2>&1 && "$DEST/runc" --version >/dev/null 2>&1
}

if built; then
	log "node: containerd $CTRD_VERSION, runc $RUNC_VERSION, pause and echo in $DEST (built before)"
	exit 0
fi
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9
if built; then
	log "node: containerd $CTRD_VERSION, runc $RUNC_VERSION in $DEST (built by a concurrent run)"
	exit 0
fi

START=$SECONDS
WORK="$(mktemp -d "$CACHE/.build.XXXXXX")"
trap 'rm -rf --one-file-system "$WORK"' EXIT
JOBS="$(nproc)"
BUILD=("$GO" build -mod=readonly -trimpath -p "$JOBS")

log "node: building containerd $CTRD_VERSION (containerd, containerd-shim-runc-v2, ctr) with $GO_VERSION"
pkg=github.com/containerd/containerd/v2
(cd "$CTRD_MOD" && CGO_ENABLED=0 "${BUILD[@]}" -tags "no_btrfs no_devmapper no_zfs" \
	-ldflags "-s -w -X $pkg/version.Version=$CTRD_VERSION -X $pkg/version.Package=$pkg" \
	-o "$WORK/" "$pkg/cmd/containerd" "$pkg/cmd/containerd-shim-runc-v2" "$pkg/cmd/ctr") ||
	die "go build of containerd $CTRD_VERSION failed (in $CTRD_MOD)"

log "node: building runc $RUNC_VERSION (cgo, seccomp)"
[[ -f /usr/include/seccomp.h ]] || die "runc needs libseccomp's headers: apt-get install libseccomp-dev (setup.sh --real-node installs it)"
(cd "$RUNC_MOD" && CGO_ENABLED=1 "${BUILD[@]}" -tags seccomp \
	-ldflags "-s -w -X main.version=${RUNC_VERSION#v}" -o "$WORK/runc" github.com/opencontainers/runc) ||
	die "go build of runc $RUNC_VERSION failed (in $RUNC_MOD)"

log "node: building echo (cozylab/images/echo)"
(cd "$ECHO_MOD" && CGO_ENABLED=0 "${BUILD[@]}" -ldflags "-s -w" -o "$WORK/echo" .) ||
	die "go build of echo failed (in $ECHO_MOD)"

log "node: building pause from Kubernetes $KUBE_VERSION's build/pause/linux/pause.c"
kube_dir="$(cd "$KUBE_MOD" && "$GO" mod download -json "k8s.io/kubernetes@$KUBE_VERSION" |
	awk -F'"' '$2 == "Dir" {print $4}')"
pause_c="$kube_dir/build/pause/linux/pause.c"
[[ -f $pause_c ]] || die "no $pause_c in the module cache"
pause_tag="$(awk '$1 == "TAG" && $2 == "?=" {print $3}' "$kube_dir/build/pause/Makefile")"
gcc -Os -Wall -Werror -static -DVERSION="v$pause_tag-$KUBE_VERSION" -o "$WORK/pause" "$pause_c" ||
	die "gcc could not build pause (a static glibc: libc6-dev)"
strip "$WORK/pause"

"$WORK/containerd" --version | grep -qF "$CTRD_VERSION" || die "the built containerd does not say $CTRD_VERSION"
"$WORK/runc" --version | grep -q seccomp || die "the built runc has no seccomp"
printf '%s\n' "$WANT" >"$WORK/stamp"
printf 'containerd=%s\nrunc=%s\npause=%s\n' "$CTRD_VERSION" "$RUNC_VERSION" "$pause_tag" >"$WORK/versions"
rm -rf --one-file-system "$DEST"
mv "$WORK" "$DEST"
chmod 0755 "$DEST"
log "node: built containerd $CTRD_VERSION, runc $RUNC_VERSION, pause $pause_tag and echo into $DEST in $((SECONDS - START))s"
