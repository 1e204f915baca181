#!/usr/bin/env bash
# Runs one cozyebpf command from the image, as its container would run it:
#   bash scripts/image-exec.sh IMAGE_CONF [cozyebpf args...]
#
# scripts/image-test.sh writes IMAGE_CONF (the image's mounted root filesystem,
# its Env and its Entrypoint from `podman image inspect`) and points the tests
# at this script through COZYEBPF_TEST_CMD. No OCI runtime is used (they cannot
# start containers on every machine, e.g. in a sandboxed VM); instead, in a
# mount namespace of the command's own, which ends with it:
#   - the image's root filesystem under a tmpfs layer (overlayfs), as a runtime's
#     writable layer, where the mount points the image lacks (/host/...) are
#     made; then read-only (DS_READONLY_ROOT: readOnlyRootFilesystem);
#   - /proc, /sys and /dev of the host;
#   - the volumeMounts of the DaemonSet the chart renders (DS_MOUNTS, written by
#     image-test.sh from `helm template`): hostPath as a bind mount of the host's
#     path (read-only where readOnly), emptyDir as a tmpfs of its sizeLimit. So
#     the host's bpffs is at /sys/fs/bpf, its /lib/modules and /usr/src at
#     /host/..., and the entrypoint links kernel headers as it does in a pod on
#     this node. One exception: /tmp is the host's, not the DaemonSet's emptyDir,
#     because the tests keep the manifests and kubeconfigs they pass by path there;
#   - the caller's /var/run/secrets/kubernetes.io/serviceaccount, read-only, when it
#     holds a token: the ServiceAccount volume the kubelet mounts in every pod;
# then chroot, an environment of exactly the image's Env plus the caller's
# COZYEBPF_* variables (`docker run -e`; COZYEBPF_TEST_* excepted) and
# KUBERNETES_SERVICE_HOST/PORT (what the kubelet sets in every container), and the
# image's Entrypoint with the arguments (none: the image's Cmd). The process keeps its PID through
# every exec, so signals reach the agent itself. The network namespace is the
# caller's (the tests enter a lab node's with nsenter first, the DaemonSet uses
# the host's).
#
# COZYEBPF_TEST_CAPS=cap_a,cap_b (set and empty: none): run with exactly these
# capabilities (bounding, permitted and effective sets), dropped after the
# chroot, which needs others; tests/datapath/test_capabilities.py sets it.
set -euo pipefail

die() {
	printf 'image-exec.sh: %s\n' "$*" >&2
	exit 125
}

if [[ ${1:-} != --in-namespace ]]; then
	(($# >= 1)) || die "usage: image-exec.sh IMAGE_CONF [cozyebpf args...]"
	[[ $(id -u) -eq 0 ]] || die "must run as root (mounts, chroot)"
	exec unshare --mount --propagation private -- bash "${BASH_SOURCE[0]}" --in-namespace "$@"
fi
shift
conf=$1
shift

ROOTFS="" IMAGE_ENV=() IMAGE_ENTRYPOINT=() IMAGE_CMD=() IMAGE_WORKDIR=""
DS_MOUNTS=() DS_READONLY_ROOT=1
# shellcheck source=/dev/null
source "$conf"
[[ -d $ROOTFS/usr ]] || die "$ROOTFS is not a root filesystem (from $conf)"
((${#IMAGE_ENTRYPOINT[@]} > 0)) || die "the image has no Entrypoint (from $conf)"
((${#DS_MOUNTS[@]} > 0)) || die "no DS_MOUNTS in $conf (the chart's DaemonSet; image-test.sh writes them)"
(($# > 0)) || set -- "${IMAGE_CMD[@]}" # no arguments: the image's Cmd, as a runtime does

# the image under a writable layer of this namespace's own (the directory stays, empty)
layer=/run/cozyebpf-image-exec
mkdir -p "$layer"
mount -t tmpfs -o mode=0700 layer "$layer"
mkdir "$layer/upper" "$layer/work" "$layer/root"
mount -t overlay overlay -o "lowerdir=$ROOTFS,upperdir=$layer/upper,workdir=$layer/work" "$layer/root"
ROOTFS=$layer/root
for m in "${DS_MOUNTS[@]}"; do
	IFS='|' read -r _ _ target _ _ <<<"$m"
	mkdir -p "$ROOTFS$target"
done
# the pod's ServiceAccount volume, as the kubelet mounts it, when the caller has one (the labs
# bind-mount an agent's token and CA there: cozylab/cluster/agents.py in_cluster_wrapper)
SA_DIR=/run/secrets/kubernetes.io/serviceaccount # /var/run is /run, here and in the image
sa_mount=0
if [[ -f $SA_DIR/token ]]; then
	mkdir -p "$ROOTFS$SA_DIR"
	sa_mount=1
fi
((!DS_READONLY_ROOT)) || mount -o remount,bind,ro "$ROOTFS"
((!sa_mount)) || mount --bind -o ro "$SA_DIR" "$ROOTFS$SA_DIR"
for dir in proc sys dev; do
	mount --rbind "/$dir" "$ROOTFS/$dir"
done
for m in "${DS_MOUNTS[@]}"; do
	IFS='|' read -r kind source target mode size <<<"$m"
	if [[ $target == /tmp ]]; then # the tests' files, by path (see above)
		mount --rbind /tmp "$ROOTFS/tmp"
		continue
	fi
	case $kind in
	emptyDir) mount -t tmpfs -o "mode=0777,size=$size" "$kind" "$ROOTFS$target" ;;
	hostPath)
		mount --rbind "$source" "$ROOTFS$target"
		[[ $mode == rw ]] || mount -o remount,bind,ro "$ROOTFS$target"
		;;
	*) die "volume kind $kind (from $conf)" ;;
	esac
done

env_args=("${IMAGE_ENV[@]}")
while IFS= read -r -d '' var; do
	case $var in
	COZYEBPF_TEST_*) ;;
	COZYEBPF_* | KUBERNETES_SERVICE_HOST=* | KUBERNETES_SERVICE_PORT=*) env_args+=("$var") ;;
	esac
done < <(env -0)
run=(/usr/bin/env -i "${env_args[@]}")
[[ -z $IMAGE_WORKDIR ]] || run=(/usr/bin/env -C "$IMAGE_WORKDIR" -i "${env_args[@]}")
run+=("${IMAGE_ENTRYPOINT[@]}" "$@")

if [[ ! -v COZYEBPF_TEST_CAPS ]]; then
	exec chroot "$ROOTFS" "${run[@]}"
fi
# capsh (the host's) chroots, drops the rest of the bounding set, then runs
# the image's /bin/bash, which execs the command: for uid 0 an exec makes
# permitted = effective = the bounding set, as with a runtime's drop: [ALL].
keep=",${COZYEBPF_TEST_CAPS,,},"
bounding="$(capsh --decode="$(awk '/^CapBnd:/ {print $2}' /proc/self/status)")"
drop=()
IFS=, read -r -a all <<<"${bounding#*=}"
for cap in "${all[@]}"; do
	[[ $keep == *",$cap,"* ]] || drop+=("$cap")
done
exec capsh --chroot="$ROOTFS" --drop="$(
	IFS=,
	echo "${drop[*]}"
)" -- -c 'exec "$@"' capsh-exec "${run[@]}"
