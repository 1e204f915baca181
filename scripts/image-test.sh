#!/usr/bin/env bash
# `make image-test`: build the DaemonSet image from the Dockerfile and run the
# end-to-end lab tests with every cozyebpf command executed from the image.
#
#   sudo bash scripts/image-test.sh [options] [-- pytest args]
#
# 1. tools: podman and debootstrap from apt if missing; scripts/setup.sh (the
#    tests themselves run from the repository's .venv, as in CI).
# 2. base: a local debian:bookworm-slim, bootstrapped once with
#    `debootstrap --variant=minbase bookworm`, slimmed as Debian's official
#    slim image is, cached as a tarball and imported into a podman store of
#    this script's own (vfs), both under $COZYEBPF_IMAGE_TEST_DIR.
# 3. build: `podman build --pull=never --network host --isolation chroot` of
#    the Dockerfile, with the machine's pip settings and CA bundle as build
#    secrets (never stored in the image).
# 4. the image's size and the versions inside it.
# 5. tests: the image's root filesystem is mounted (`podman image mount`) and
#    COZYEBPF_TEST_CMD points the tests' `cozyebpf_cmd` fixture at
#    scripts/image-exec.sh, which runs each cozyebpf command there with the
#    image's Env and Entrypoint (no OCI runtime needed) and the volume mounts
#    and read-only root of the DaemonSet the chart renders for this image
#    (`helm template charts/cozyebpf`); the cluster lab's agents run with that
#    DaemonSet's args and env (COZYEBPF_TEST_DAEMONSET). CI=true: a datapath
#    test that cannot run fails instead of being skipped.
# 6. clean-up, also on failure and Ctrl-C: the mount, the built image and
#    whatever the build left in the store. The cached base stays (--purge
#    removes it too).
#
# Options:
#   --dockerfile FILE  build FILE instead of ./Dockerfile (the context is still
#                      the repository)
#   --keep-image       keep the built image (cozyebpf:image-test) in the store
#   --refresh-base     bootstrap the base again
#   --no-tests         stop after the versions (build and inspect only)
#   --purge            remove $COZYEBPF_IMAGE_TEST_DIR (cache and store), then exit
#   -- ARGS            pytest arguments instead of the default selection
#
# Environment:
#   COZYEBPF_IMAGE_TEST_DIR  cache and store (default /var/lib/cozyebpf-image-test)
#   COZYEBPF_DEBIAN_MIRROR   Debian mirror for the base (default
#                            http://deb.debian.org/debian, as the official image)
#
# The default test selection covers the demo (traffic, egress, maps dump,
# detach), the lab (whole-IP, port filter, maps dump --json), restarts, a kill
# and an upgrade without one lost packet, detach and the lifecycle, the
# Kubernetes source against the API double (a burst of 1,000 changes too), the
# two capabilities (explain, status and monitor with them too), the metrics,
# explain, monitor and status against known traffic, the CLI's errors, and the
# cluster lab (three nodes, Kube-OVN-like and per-pod veths, agents started
# with the DaemonSet's environment).

# dpkg-query's formats below are ${Field}s of its own, not the shell's.
# shellcheck disable=SC2016
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

DEFAULT_TESTS=(
	tests/datapath/test_demo.py
	tests/datapath/test_lab.py
	tests/datapath/test_zero_downtime.py
	tests/datapath/test_lifecycle.py
	tests/datapath/test_kube_e2e.py
	tests/datapath/test_burst.py
	tests/datapath/test_capabilities.py
	tests/datapath/test_observability.py
	tests/unit/test_cli.py
	tests/datapath/test_cluster_lab.py
)
IMAGE_REF=localhost/cozyebpf:image-test
# shellcheck source=scripts/lib/image.sh
source "$REPO_ROOT/scripts/lib/image.sh"

log() { printf '==> %s\n' "$*"; }
die() {
	printf 'image-test.sh: ERROR: %s\n' "$*" >&2
	exit 1
}

DOCKERFILE="$REPO_ROOT/Dockerfile" KEEP_IMAGE=0 REFRESH_BASE=0 RUN_TESTS=1 PURGE=0
PYTEST_ARGS=()
while (($# > 0)); do
	case $1 in
	--dockerfile)
		(($# >= 2)) || die "--dockerfile needs a file"
		DOCKERFILE="$(realpath "$2")"
		shift
		;;
	--keep-image) KEEP_IMAGE=1 ;;
	--refresh-base) REFRESH_BASE=1 ;;
	--no-tests) RUN_TESTS=0 ;;
	--purge) PURGE=1 ;;
	--)
		shift
		PYTEST_ARGS=("$@")
		break
		;;
	-h | --help)
		sed -n '2,/^$/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
		exit 0
		;;
	*) die "unknown argument $1 (see --help)" ;;
	esac
	shift
done
((${#PYTEST_ARGS[@]} > 0)) || PYTEST_ARGS=(-q "${DEFAULT_TESTS[@]}")

[[ $(id -u) -eq 0 ]] || die "must run as root (debootstrap, podman's store, mounts, BPF); try: sudo make image-test"
[[ -f $DOCKERFILE ]] || die "no Dockerfile at $DOCKERFILE"

if ((PURGE)); then
	if [[ -d $STORE ]] && command -v podman >/dev/null; then
		podman --root "$STORE" --runroot "$RUNROOT" --storage-driver vfs system reset --force >/dev/null 2>&1 || true
	fi
	rm -rf --one-file-system "$TOP" "$RUNROOT"
	log "removed $TOP"
	exit 0
fi

T0=$SECONDS
PHASE_START=$SECONDS
TIMES=()
phase_times() {
	local IFS=, joined
	joined="${TIMES[*]:-}"
	echo "${joined//,/, }"
}
phase_done() {
	TIMES+=("$1 $((SECONDS - PHASE_START))s")
	log "$1: done in $((SECONDS - PHASE_START))s"
	PHASE_START=$SECONDS
}


# --- clean-up, whatever happens --------------------------------------------------
WORK="$(mktemp -d /tmp/cozyebpf-image-test.XXXXXX)"
MOUNTED=0
BUILT=0
cleanup() {
	local rc=$?
	trap - EXIT INT TERM
	set +e
	if ((MOUNTED)); then
		podman_ image unmount "$IMAGE_REF" >/dev/null
	fi
	if ((BUILT)) && ((!KEEP_IMAGE)); then
		podman_ rmi --force "$IMAGE_REF" >/dev/null 2>&1
	fi
	if [[ -d $STORE ]]; then
		# a build that failed or was interrupted leaves its working containers
		# (buildah's, listed with --external) and the images of its stages
		mapfile -t leftovers < <(podman_ ps --all --external --quiet 2>/dev/null)
		((${#leftovers[@]} == 0)) || podman_ rm --force "${leftovers[@]}" >/dev/null 2>&1
		podman_ image prune --force >/dev/null 2>&1
	fi
	image_cleanup_bootstrap # debootstrap mounts /proc and /sys inside its target
	rm -rf --one-file-system "$WORK"
	rmdir /run/cozyebpf-image-exec 2>/dev/null # image-exec.sh's mount point
	if ((rc == 0)); then
		log "image-test passed in $((SECONDS - T0))s ($(phase_times))"
	else
		printf 'image-test.sh: FAILED (exit %d) after %ds (%s)\n' "$rc" "$((SECONDS - T0))" "$(phase_times)" >&2
	fi
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- 1. tools --------------------------------------------------------------------
missing=()
command -v podman >/dev/null || missing+=(podman)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if ((${#missing[@]} > 0)); then
	log "installing ${missing[*]} (apt)"
	export DEBIAN_FRONTEND=noninteractive
	apt-get -o Acquire::Retries=3 -o DPkg::Lock::Timeout=300 update -q
	apt-get -o Acquire::Retries=3 -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends \
		"${missing[@]}" </dev/null
fi
bash scripts/setup.sh --kube >"$WORK/setup.log" 2>&1 || {
	cat "$WORK/setup.log" >&2
	die "scripts/setup.sh failed"
}
tail -n1 "$WORK/setup.log"
log "$(podman --version), $(debootstrap --version)"
phase_done tools

# --- 2. the base: a local debian:bookworm-slim -----------------------------------
# As debuerreotype makes the official slim variant (scripts/lib/image.sh).
ensure_base "$WORK"
base_size="$(podman_ image inspect --format '{{.Size}}' "$BASE_REF")"
log "base $BASE_REF: $(((base_size + 500000) / 1000000)) MB (cached: $BASE_TAR)"
phase_done base

# --- 3. build ----------------------------------------------------------------------
pip_secrets "$WORK"

log "podman build -f ${DOCKERFILE#"$REPO_ROOT"/} -t $IMAGE_REF (a few minutes; log: $WORK/build.log)"
BUILT=1
build_rc=0
nice -n 10 "${PODMAN[@]}" build --pull=never --network host --isolation chroot \
	--layers=false --force-rm -f "$DOCKERFILE" -t "$IMAGE_REF" "${SECRETS[@]}" . \
	>"$WORK/build.log" 2>&1 || build_rc=$?
if ((build_rc != 0)); then
	((build_rc < 128)) || exit "$build_rc" # interrupted: no build error to show
	tail -n 40 "$WORK/build.log" >&2
	die "the image did not build"
fi
phase_done build

# --- 4. size and versions ------------------------------------------------------------
fmt() { podman_ image inspect --format "$1" "$IMAGE_REF"; }
size="$(fmt '{{.Size}}')"
user="$(fmt '{{.Config.User}}')"
[[ -z $user || $user == root || $user == 0 ]] || die "the image runs as user $user; image-exec.sh runs root only"
ROOTFS="$(podman_ image mount "$IMAGE_REF")"
MOUNTED=1
{
	printf 'ROOTFS=%q\n' "$ROOTFS"
	printf 'IMAGE_WORKDIR=%q\n' "$(fmt '{{.Config.WorkingDir}}')"
	for field in Env Entrypoint Cmd; do
		printf 'IMAGE_%s=(' "${field^^}"
		while IFS= read -r item; do
			[[ -z $item ]] || printf '%q ' "$item"
		done < <(fmt "{{range .Config.$field}}{{println .}}{{end}}")
		printf ')\n'
	done
} >"$WORK/image.conf"
in_image() { chroot "$ROOTFS" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin "$@"; }
echo "---- $IMAGE_REF"
printf 'size:        %d MB (%d bytes; base %d MB)\n' $(((size + 500000) / 1000000)) "$size" \
	$(((base_size + 500000) / 1000000))
printf 'entrypoint:  %s\n' "$(fmt '{{json .Config.Entrypoint}}') cmd $(fmt '{{json .Config.Cmd}}')"
printf 'env:         %s\n' "$(fmt '{{json .Config.Env}}')"
printf 'python:      %s\n' "$(in_image /opt/venv/bin/python --version 2>&1)"
printf 'debian:      %s\n' "$(in_image dpkg-query -W -f '${Package} ${Version}, ' \
	python3-bpfcc libbpfcc libllvm14 libclang-cpp14 nftables iproute2 | sed 's/, $//')"
if [[ -f $ROOTFS/usr/src/cozyebpf-fallback-headers.txt ]]; then
	printf 'headers:     %s\n' "$(paste -sd ',' "$ROOTFS/usr/src/cozyebpf-fallback-headers.txt" | sed 's/,/, /g')"
else
	printf 'headers:     %s\n' "$(cd "$ROOTFS/usr/src" && echo *)"
fi
printf 'venv:        %s\n' "$(in_image /opt/venv/bin/python -c '
import importlib.metadata as m, sys
print(", ".join(sorted(f"{d.name} {d.version}" for d in m.distributions(path=[p for p in sys.path if p.startswith("/opt/venv")]))))')"
# what a build leaves behind when nothing takes it out again
tools="$({ in_image dpkg-query -W -f '${db:Status-Abbrev} ${Package}\n' gcc-12 cpp-12 binutils \
	make python3-pip python3-setuptools python3-venv 2>/dev/null || true; } | awk '$1 == "ii" {printf "%s ", $2}')"
[[ ! -e $ROOTFS/opt/venv/bin/pip ]] || tools+="/opt/venv/bin/pip"
printf 'build tools: %s\n' "${tools:-none (no gcc, binutils, make, pip, setuptools or venv)}"
printf 'largest:     %s\n' "$(
	cd "$ROOTFS"
	du -s --apparent-size --block-size=1M opt/venv usr/src | awk '{printf "%s %d MB, ", $2, $1}'
	in_image dpkg-query -W -f '${Installed-Size} ${Package}\n' | sort -rn | head -n 6 |
		awk '{printf "%s %d MB, ", $2, $1 / 1024}' | sed 's/, $//'
)"
echo "----"
phase_done inspect

((RUN_TESTS)) || exit 0

# --- 5. the tests, with every cozyebpf command from the image -------------------------
# The DaemonSet as the chart renders it for this image: image-exec.sh makes its container's
# volumeMounts and read-only root (DS_* in image.conf), and the cluster lab's agents run with
# its container's args and env (COZYEBPF_TEST_DAEMONSET, read by cozylab/cluster/agents.py).
[[ -x .venv/bin/helm ]] || die "no helm in .venv/bin (scripts/setup.sh installs it)"
.venv/bin/helm template cozyebpf charts/cozyebpf --namespace cozy-system \
	--set "image.repository=${IMAGE_REF%:*}" --set "image.tag=${IMAGE_REF##*:}" \
	--show-only templates/daemonset.yaml >"$WORK/daemonset.yaml" || die "helm template failed"
.venv/bin/python - "$WORK/daemonset.yaml" "$IMAGE_REF" >>"$WORK/image.conf" <<-'EOF' ||
	import re, shlex, sys, yaml
	ds = yaml.safe_load(open(sys.argv[1]))
	pod = ds["spec"]["template"]["spec"]
	(c,) = pod["containers"]
	assert c["image"] == sys.argv[2], f"the chart renders {c['image']}, not {sys.argv[2]}"
	assert c["args"][0] == "run", c["args"]
	units = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
	volumes = {v["name"]: v for v in pod["volumes"]}
	mounts = []
	for m in c["volumeMounts"]:  # kind|source|target|ro or rw|tmpfs bytes, in the pod's order
	    v = volumes[m["name"]]
	    if "hostPath" in v:
	        kind, source, size = "hostPath", v["hostPath"]["path"], ""
	    elif "emptyDir" in v:
	        limit = v["emptyDir"].get("sizeLimit", "64Mi")
	        num, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi|)", limit).groups()
	        kind, source, size = "emptyDir", "", str(int(num) * units[unit])
	    else:
	        sys.exit(f"volume {m['name']}: neither hostPath nor emptyDir")
	    ro = "ro" if m.get("readOnly") else "rw"
	    mounts.append(f"{kind}|{source}|{m['mountPath']}|{ro}|{size}")
	print("DS_MOUNTS=(" + " ".join(shlex.quote(x) for x in mounts) + ")")
	print(f"DS_READONLY_ROOT={int(c['securityContext'].get('readOnlyRootFilesystem', False))}")
EOF
	die "the chart's DaemonSet does not fit the image test (see above)"
export COZYEBPF_TEST_DAEMONSET="$WORK/daemonset.yaml"
log "the chart's DaemonSet for $IMAGE_REF: $(grep '^DS_MOUNTS=' "$WORK/image.conf")"
EXEC=(bash "$REPO_ROOT/scripts/image-exec.sh" "$WORK/image.conf")
log "smoke: ${EXEC[*]} --version"
"${EXEC[@]}" --version
export COZYEBPF_TEST_CMD="${EXEC[*]@Q}"
log "COZYEBPF_TEST_CMD=$COZYEBPF_TEST_CMD CI=true .venv/bin/pytest ${PYTEST_ARGS[*]}"
CI=true .venv/bin/pytest -p no:cacheprovider "${PYTEST_ARGS[@]}"
phase_done tests
