#!/usr/bin/env bash
# The agent's image as a user gets it, for the real-node lab's nodes (cozylab/realnode/):
#   bash scripts/build-agent-image.sh --tree DIR --ref NAME:TAG --version X.Y.Z
# builds DIR/Dockerfile with DIR as the context, as `make release` does (podman build,
# --build-arg VERSION), from the local debian:bookworm-slim base that `make image-test` uses
# (scripts/lib/image.sh: bootstrapped once), tags it NAME:TAG, saves it as a docker archive and
# prints the archive's path (the last line). DIR is this checkout, or a release's tree from
# git (its release commit: `git archive`). The archive is cached under
#   ${COZYEBPF_NODE_CACHE:-/var/cache/cozyebpf/node}/images/<key>.tar
# keyed by what the build reads (the Dockerfile and every file it copies, the base, the tag and
# the version): a second run with the same inputs takes a second. Layers are kept in the
# store, so a build that changes only cozyebpf/ reuses the base's, the headers' and the
# packages' layers.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
# shellcheck source=scripts/lib/image.sh
source "$REPO_ROOT/scripts/lib/image.sh"
CACHE="${COZYEBPF_NODE_CACHE:-/var/cache/cozyebpf/node}/images"

log() { printf '==> %s\n' "$*" >&2; }
die() {
	printf 'build-agent-image.sh: ERROR: %s\n' "$*" >&2
	exit 1
}

TREE="" REF="" VERSION=""
while (($# > 0)); do
	case $1 in
	--tree) TREE="$(realpath "$2")" && shift ;;
	--ref) REF=$2 && shift ;;
	--version) VERSION=$2 && shift ;;
	*) die "unknown argument $1 (usage: --tree DIR --ref NAME:TAG --version X.Y.Z)" ;;
	esac
	shift
done
[[ -n $TREE && -n $REF && -n $VERSION ]] || die "usage: --tree DIR --ref NAME:TAG --version X.Y.Z"
[[ -f $TREE/Dockerfile ]] || die "no Dockerfile in $TREE"
[[ $(id -u) -eq 0 ]] || die "must run as root (podman's store)"
command -v podman >/dev/null || die "podman is missing (scripts/setup.sh --real-node installs it)"
command -v debootstrap >/dev/null || die "debootstrap is missing (scripts/setup.sh --real-node installs it)"

# what the build reads: the Dockerfile and the paths its COPY lines name
mapfile -t SOURCES < <(awk '$1 == "COPY" && $2 !~ /^--from/ {for (i = 2; i < NF; i++) print $i}' "$TREE/Dockerfile")
((${#SOURCES[@]} > 0)) || die "no COPY in $TREE/Dockerfile"
key="$(
	cd "$TREE"
	{
		printf 'ref=%s version=%s\n' "$REF" "$VERSION"
		[[ -s $BASE_TAR ]] && sha256sum "$BASE_TAR" | cut -c1-64
		find Dockerfile "${SOURCES[@]%/}" -type f -not -name '*.pyc' -not -path '*/__pycache__/*' -print0 |
			sort -z | xargs -0 sha256sum
	} | sha256sum | cut -c1-16
)"
ARCHIVE="$CACHE/$key.tar"
if [[ -s $ARCHIVE ]]; then
	log "agent image $REF of $TREE: cached ($ARCHIVE)"
	printf '%s\n' "$ARCHIVE"
	exit 0
fi

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9
WORK="$(mktemp -d /tmp/cozyebpf-agent-image.XXXXXX)"
cleanup() {
	image_cleanup_bootstrap
	rm -rf --one-file-system "$WORK"
}
trap cleanup EXIT
T0=$SECONDS
ensure_base "$WORK"
pip_secrets "$WORK"
log "podman build of $TREE/Dockerfile as $REF (VERSION=$VERSION; log: $WORK/build.log)"
nice -n 10 "${PODMAN[@]}" build --pull=never --network host --isolation chroot --layers=true \
	-f "$TREE/Dockerfile" -t "$REF" --build-arg "VERSION=$VERSION" "${SECRETS[@]}" "$TREE" \
	>"$WORK/build.log" 2>&1 || {
	tail -n 40 "$WORK/build.log" >&2
	die "the image $REF did not build from $TREE"
}
podman_ save --format docker-archive -o "$ARCHIVE.new" "$REF" >/dev/null || die "podman save $REF failed"
mv "$ARCHIVE.new" "$ARCHIVE"
podman_ rmi "$REF" >/dev/null 2>&1 || true # the tag; its layers stay as the next build's cache
log "agent image $REF built in $((SECONDS - T0))s: $ARCHIVE ($(du -m "$ARCHIVE" | cut -f1) MB)"
printf '%s\n' "$ARCHIVE"
