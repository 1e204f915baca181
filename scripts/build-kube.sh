#!/usr/bin/env bash
# Builds the labs' Kubernetes from the Go module proxy, once per machine:
#   bash scripts/build-kube.sh            (setup.sh calls it)
#   bash scripts/build-kube.sh --print-dir  (the directory the binaries are in, and nothing else)
#
# kube-apiserver, kube-controller-manager and kube-scheduler of the release
# cozylab/controlplane/kube/go.mod pins (the Kubernetes that Cozystack installs: README, "The
# real control plane"), the node's kubelet and kube-proxy and the client kubectl of the same
# release (the real-node lab, cozylab/realnode/), and etcd (cozylab/controlplane/etcd/, a main
# calling etcdmain.Main), into
#   ${COZYEBPF_KUBE_CACHE:-/var/cache/cozyebpf/kube}/<kubernetes version>-<stamp>/
# (the stamp below, in short: two checkouts that pin different modules, worktrees say, keep a
# directory each instead of building over each other's)
# which is outside the repository: the binaries are never committed. go.sum is committed, so
# the build fetches exactly those modules (-mod=readonly) through the machine's GOPROXY (the Go
# module proxy); Go keeps them in its module and build caches (GOMODCACHE, GOCACHE), so a build
# after a change of the pins is quicker than the first one.
#
# Idempotent: the directory holds a stamp of everything the build read (go.mod, go.sum, main.go,
# this script, the Go version); when the stamp matches and the three binaries run, nothing is
# built (a second run takes well under a second). The build is lean for CI's fresh machine:
# -trimpath, stripped (-s -w), CGO off, only the three binaries, `-p` = the CPUs. Concurrent
# runs (two worktrees) wait for each other on a lock in the cache directory.
#
# The Go it needs is read from the same place Go reads it: the `go` lines of the two go.mod
# files, the higher one (etcd's today); an older Go is refused here with that version, before
# anything is built, and GOTOOLCHAIN=local keeps Go from downloading a newer toolchain itself.
#
# Environment:
#   COZYEBPF_KUBE_CACHE  where the versions' directories go (default /var/cache/cozyebpf/kube)
#   GO                   the go command (default: go on PATH, else /usr/local/go/bin/go)
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KUBE_MOD="$REPO_ROOT/cozylab/controlplane/kube"
ETCD_MOD="$REPO_ROOT/cozylab/controlplane/etcd"
CACHE="${COZYEBPF_KUBE_CACHE:-/var/cache/cozyebpf/kube}"

log() { printf '==> %s\n' "$*"; }
die() {
	printf 'build-kube.sh: ERROR: %s\n' "$*" >&2
	exit 1
}

# The pinned release, from the one place that names it.
KUBE_VERSION="$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v[0-9]/ {print $2; exit}' "$KUBE_MOD/go.mod")"
[[ $KUBE_VERSION =~ ^v1\.([0-9]+)\.([0-9]+)$ ]] ||
	die "no k8s.io/kubernetes vX.Y.Z requirement in $KUBE_MOD/go.mod (found '${KUBE_VERSION}')"
KUBE_MINOR="${BASH_REMATCH[1]}"
KUBE_BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl)
BINARIES=(etcd "${KUBE_BINARIES[@]}")

PRINT_DIR=0
case ${1:-} in
--print-dir) PRINT_DIR=1 ;;
"") ;;
*) die "unknown arguments: $* (usage: build-kube.sh [--print-dir])" ;;
esac

# The Go the modules need: the higher of their `go` lines (1.26.0 -> 1.26.0), and which file.
GO_NEED="" GO_NEED_FROM=""
for mod in "$KUBE_MOD/go.mod" "$ETCD_MOD/go.mod"; do
	v="$(awk '$1 == "go" {print $2; exit}' "$mod")"
	[[ $v =~ ^1\.[0-9]+(\.[0-9]+)?$ ]] || die "no go 1.N line in $mod (found '$v')"
	if [[ -z $GO_NEED || $(printf '%s\n%s\n' "$GO_NEED" "$v" | sort -V | tail -1) != "$GO_NEED" ]]; then
		GO_NEED="$v" GO_NEED_FROM="${mod#"$REPO_ROOT"/}"
	fi
done
export GOTOOLCHAIN=local # the Go found here builds, or the build stops: no toolchain download

GO="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"
[[ -x $GO ]] || die "Go is missing ($GO): the labs' control plane is built with Go from the module proxy; install Go $GO_NEED or newer ($GO_NEED_FROM) at /usr/local/go or set GO=/path/to/go"
GO_VERSION="$("$GO" env GOVERSION)" || die "$GO does not run"
have="${GO_VERSION#go}"
have="${have%%[!0-9.]*}" # go1.26.8 -> 1.26.8 (a pre-release's suffix dropped)
[[ $(printf '%s\n%s\n' "$GO_NEED" "$have" | sort -V | head -1) == "$GO_NEED" ]] ||
	die "$GO is $GO_VERSION, older than the Go $GO_NEED that $GO_NEED_FROM needs: install Go $GO_NEED or newer at /usr/local/go or set GO=/path/to/go"

stamp() {
	{
		printf 'go=%s\n' "$GO_VERSION"
		sha256sum "$KUBE_MOD/go.mod" "$KUBE_MOD/go.sum" "$ETCD_MOD/go.mod" "$ETCD_MOD/go.sum" \
			"$ETCD_MOD/main.go" "${BASH_SOURCE[0]}" | cut -c1-64
	} | sha256sum | cut -c1-64
}
WANT="$(stamp)"
DEST="$CACHE/$KUBE_VERSION-${WANT:0:12}"
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
	"$DEST/kube-apiserver" --version >/dev/null 2>&1 && "$DEST/etcd" --version >/dev/null 2>&1
}

if built; then
	log "kube: $KUBE_VERSION and etcd in $DEST (built before)"
	exit 0
fi

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9
if built; then # another run built it while this one waited
	log "kube: $KUBE_VERSION and etcd in $DEST (built by a concurrent run)"
	exit 0
fi

START=$SECONDS
WORK="$(mktemp -d "$CACHE/.build.XXXXXX")"
trap 'rm -rf --one-file-system "$WORK"' EXIT
export CGO_ENABLED=0
JOBS="$(nproc)"
BUILD=("$GO" build -mod=readonly -trimpath -p "$JOBS")

# What kubernetes' own build stamps into its binaries (hack/lib/version.sh), so that /version
# and the components' --version name the release.
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
	ldflags+=" -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$KUBE_MINOR"
	ldflags+=" -X $pkg.gitTreeState=clean"
done

log "kube: building ${KUBE_BINARIES[*]} $KUBE_VERSION with $GO_VERSION (-p $JOBS; the first build on a machine takes many minutes: README)"
(cd "$KUBE_MOD" && "${BUILD[@]}" -ldflags "$ldflags" -o "$WORK/" \
	"${KUBE_BINARIES[@]/#/k8s.io/kubernetes/cmd/}") ||
	die "go build of ${KUBE_BINARIES[*]} $KUBE_VERSION failed (in $KUBE_MOD)"
log "kube: building etcd ($(awk '$1 == "require" && $2 == "go.etcd.io/etcd/server/v3" {print $3}' "$ETCD_MOD/go.mod"))"
(cd "$ETCD_MOD" && "${BUILD[@]}" -ldflags "-s -w" -o "$WORK/etcd" .) ||
	die "go build of etcd failed (in $ETCD_MOD)"

have="$("$WORK/kube-apiserver" --version)" || die "the built kube-apiserver does not run"
[[ $have == "Kubernetes $KUBE_VERSION" ]] || die "the built kube-apiserver says '$have', expected 'Kubernetes $KUBE_VERSION'"
"$WORK/etcd" --version >/dev/null || die "the built etcd does not run"
for bin in kube-scheduler kubelet kube-proxy; do
	have="$("$WORK/$bin" --version)" || die "the built $bin does not run"
	[[ $have == "Kubernetes $KUBE_VERSION" ]] || die "the built $bin says '$have', expected 'Kubernetes $KUBE_VERSION'"
done
printf '%s\n' "$WANT" >"$WORK/stamp"
rm -rf --one-file-system "$DEST"
mv "$WORK" "$DEST"
chmod 0755 "$DEST"
log "kube: built $KUBE_VERSION and etcd into $DEST in $((SECONDS - START))s"
