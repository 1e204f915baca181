#!/bin/bash
# Entrypoint of the cozyebpf DaemonSet image.
#
# 1. Kernel headers for bcc. If the host's headers are mounted at
#    /lib/modules/$(uname -r) (hostPath /lib/modules) and usable, they are
#    used as they are. Otherwise /lib/modules/$(uname -r)/{build,source} are
#    linked to the image's fallback Debian headers (linux-headers-<arch>).
#    Do not mount the host's /lib/modules into the container on hosts without
#    headers: the links would then be written into the host's filesystem (or
#    fail on a read-only mount) - without the mount they stay in the container.
# 2. bpffs on /sys/fs/bpf (usually a hostPath mount, so pins outlive the pod).
# 3. exec cozyebpf with the container's arguments (default: run --help).
#
# Failures in 1 and 2 are reported but do not stop the container: cozyebpf
# then fails with its own error when it needs them (and `--help` still works).
set -uo pipefail

log() { printf 'entrypoint: %s\n' "$*" >&2; }

krel="$(uname -r)"
moddir="/lib/modules/${krel}"
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

link_fallback_headers() {
	local candidate common arch_hdrs="" common_hdrs="" name target link
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
	mkdir -p "${moddir}" || return 1
	for name in build source; do
		link="${moddir}/${name}"
		target=${arch_hdrs}
		[[ ${name} == source ]] && target=${common_hdrs}
		if [[ -d ${link} && ! -L ${link} ]] && ! rmdir "${link}" 2>/dev/null; then
			log "WARNING: ${link} is a non-empty directory without usable headers; not replacing it"
			return 1
		fi
		ln -sfn "${target}" "${link}" || return 1
	done
	headers_ok
}

if headers_ok; then
	log "using kernel headers in ${moddir}"
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

exec /opt/venv/bin/cozyebpf "$@"
