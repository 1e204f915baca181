#!/bin/bash
# Entrypoint of the cozyebpf DaemonSet image.
#
# 1. Kernel headers for bcc, in this order:
#    a. /lib/modules/$(uname -r) already has usable headers (an image run by
#       hand with the host's /lib/modules mounted there): used as they are.
#    b. The host's headers, mounted read-only at /host/lib/modules and
#       /host/usr/src (deploy/daemonset.yaml): /lib/modules/$(uname -r)/{build,
#       source} are linked to them. The host's own links point to /usr/src/...;
#       they are followed inside /host.
#    c. The image's fallback Debian headers (linux-headers-<arch>).
#    The links are written into the container's /lib/modules (an emptyDir in
#    the DaemonSet, so the root filesystem can stay read-only), never into a
#    host directory.
# 2. bpffs on /sys/fs/bpf (usually a hostPath mount, so pins outlive the pod).
# 3. exec cozyebpf with the container's arguments (default: run --help).
#
# Failures in 1 and 2 are reported but do not stop the container: cozyebpf
# then fails with its own error when it needs them (and `--help` still works).
set -uo pipefail

log() { printf 'entrypoint: %s\n' "$*" >&2; }

krel="$(uname -r)"
moddir="/lib/modules/${krel}"
host_root="${COZYEBPF_HOST_ROOT:-/host}"
arch="$(dpkg --print-architecture 2>/dev/null || echo amd64)"

# Same test as bcc: with both build/ and source/ it compiles in source/,
# else in build/; include/linux/kconfig.h must be there.
headers_ok() {
	if [[ -d ${moddir}/build && -d ${moddir}/source ]]; then
		[[ -f ${moddir}/source/include/linux/kconfig.h ]]
	else
		[[ -f ${moddir}/build/include/linux/kconfig.h ]]
	fi
}

# link_headers BUILD [SOURCE]: point ${moddir}/build (and source) at them.
link_headers() {
	local name target link
	mkdir -p "${moddir}" || return 1
	for name in build source; do
		link="${moddir}/${name}"
		target=$1
		[[ ${name} == source ]] && target=${2:-}
		if [[ -d ${link} && ! -L ${link} ]] && ! rmdir "${link}" 2>/dev/null; then
			log "WARNING: ${link} is a non-empty directory without usable headers; not replacing it"
			return 1
		fi
		if [[ -n ${target} ]]; then
			ln -sfn "${target}" "${link}" || return 1
		else
			rm -f "${link}" || return 1
		fi
	done
	headers_ok
}

# The host's ${host_root}/lib/modules/<krel>/<name> as a path inside the
# container: a link to /usr/src/... (Debian, Ubuntu, Fedora) is followed inside
# ${host_root}; a relative link or a real directory stays where it is.
host_headers_dir() {
	local path="${host_root}/lib/modules/${krel}/$1" target
	if [[ -L ${path} ]]; then
		target="$(readlink "${path}")" || return 1
		[[ ${target} == /* ]] && path="${host_root}${target}"
	fi
	[[ -d ${path} ]] && printf '%s\n' "${path}"
}

link_host_headers() {
	local build source
	build="$(host_headers_dir build)" || return 1
	source="$(host_headers_dir source)" || source=""
	log "linking ${moddir}/{build,source} to the host's headers ${build}${source:+, ${source}}"
	link_headers "${build}" "${source}"
}

link_fallback_headers() {
	local candidate common arch_hdrs="" common_hdrs=""
	while IFS= read -r candidate; do
		[[ -n ${candidate} ]] || continue
		common="${candidate%-"${arch}"}-common"
		if [[ -f ${candidate}/Makefile && -f ${common}/include/linux/kconfig.h ]]; then
			arch_hdrs=${candidate}
			common_hdrs=${common}
		fi
	done < <(compgen -G "/usr/src/linux-headers-*-${arch}" | sort -V)
	if [[ -z ${arch_hdrs} ]]; then
		log "WARNING: no usable kernel headers for ${krel} and no fallback headers in the image"
		return 1
	fi
	log "no usable host kernel headers for ${krel}: linking ${moddir}/{build,source} to fallback ${arch_hdrs}, ${common_hdrs}"
	link_headers "${arch_hdrs}" "${common_hdrs}"
}

if headers_ok; then
	log "using kernel headers in ${moddir}"
elif link_host_headers; then
	log "using the host's kernel headers"
elif ! link_fallback_headers; then
	log "WARNING: could not set up kernel headers in ${moddir}; bcc will fail to compile the datapath"
fi

if ! mountpoint -q /sys/fs/bpf; then
	if mkdir -p /sys/fs/bpf && mount -t bpf bpf /sys/fs/bpf; then
		log "mounted bpffs on /sys/fs/bpf"
	else
		log "WARNING: could not mount bpffs on /sys/fs/bpf (needs a privileged container)"
	fi
fi

exec "${COZYEBPF_EXEC:-/opt/venv/bin/cozyebpf}" "$@"
