# Sourced first by the scripts that need root (setup.sh, demo.sh, test.sh):
#   source "$(dirname "${BASH_SOURCE[0]}")/as-root.sh" "$@"
# As root the script goes on as it is: a root-only machine has no sudo and needs none.
# Otherwise it runs itself again through sudo with the same arguments, keeping CI and the
# COZYEBPF_* variables that the scripts and the tests read (sudo drops the rest of the
# environment).
if [[ $(id -u) -ne 0 ]]; then
	if ! command -v sudo >/dev/null; then
		printf '%s: must run as root (apt packages, kernel headers, bpffs, BPF), and sudo is not installed\n' \
			"${BASH_SOURCE[1]}" >&2
		exit 1
	fi
	_keep="$(compgen -e | grep -E '^(CI|COZYEBPF_[A-Za-z0-9_]*)$' | paste -sd, - || true)"
	exec sudo ${_keep:+"--preserve-env=$_keep"} -- bash "${BASH_SOURCE[1]}" "$@"
fi
