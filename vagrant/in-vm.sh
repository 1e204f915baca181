#!/usr/bin/env bash
# What the Vagrantfile's test and demo provisioners run in the VM, as root, in the synced
# checkout (/cozyebpf):
#   bash /cozyebpf/vagrant/in-vm.sh test   the packet tests: pytest -m packet (the marker is
#                                          given in ONE place: tests/conftest.py, PACKET_TESTS)
#                                          with CI=true (a missing prerequisite fails, never
#                                          skips), $COZYEBPF_PACKET_ARGS appended
#   bash /cozyebpf/vagrant/in-vm.sh demo   the demo (python -m cozylab.demo)
# The box built here (scripts/vagrant-box.sh) carries everything in /opt/cozyebpf/venv, which
# imports cozyebpf from /cozyebpf: nothing is installed, so no network is needed. Another box
# (debian/bookworm64) is set up by scripts/setup.sh first (apt and PyPI: the Internet).
set -euo pipefail
REPO=/cozyebpf
cd "$REPO"
if [[ -x /opt/cozyebpf/venv/bin/python ]]; then
	PY=/opt/cozyebpf/venv/bin/python
	mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf
else
	bash scripts/setup.sh >&2
	PY="$REPO/.venv/bin/python"
fi
export PYTHONPATH="$REPO"
export COZYEBPF_TEST_CMD="$PY -m cozyebpf" # the tests' cozyebpf command (tests/support/env.py)
case "${1:-}" in
test)
	printf '==> in-vm: kernel %s, %s; pytest -m packet %s\n' "$(uname -r)" "$("$PY" --version)" \
		"${COZYEBPF_PACKET_ARGS:-}"
	start=$SECONDS
	rc=0
	# the files of PACKET_TESTS only: collecting the whole suite takes minutes under emulation
	mapfile -t files < <("$PY" -c 'from tests.conftest import DATAPATH_DIR, PACKET_TESTS
for name in PACKET_TESTS: print(DATAPATH_DIR.relative_to(DATAPATH_DIR.parents[1]) / name)')
	# shellcheck disable=SC2086 # COZYEBPF_PACKET_ARGS is pytest's words
	CI=true "$PY" -m pytest -p no:cacheprovider -v -m packet "${files[@]}" ${COZYEBPF_PACKET_ARGS:-} || rc=$?
	printf '==> in-vm: the packet tests took %ss (exit %s)\n' "$((SECONDS - start))" "$rc"
	exit "$rc"
	;;
demo)
	start=$SECONDS
	"$PY" -m cozylab.demo
	printf '==> in-vm: the demo took %ss\n' "$((SECONDS - start))"
	;;
*)
	echo "usage: in-vm.sh test|demo" >&2
	exit 2
	;;
esac
