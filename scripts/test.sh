#!/usr/bin/env bash
# The project's test command (README; also what CI runs through .ci/run):
#   ./scripts/test.sh [pytest args...]      (default pytest args: -q)
# as root, or as a user who may sudo: it runs itself again through sudo then.
#
# 1. scripts/setup.sh --kube --kernel-guests --real-node --vagrant (idempotent; fast when
#    everything is in place; the first time it also builds the labs' Kubernetes, about 12
#    minutes, the kernel matrix's guests, 3 to 5 minutes, which tests/datapath/test_kernel_guest.py
#    boots, the real-node lab's runtime and images, about 10 minutes, which
#    tests/datapath/test_real_node.py runs, and installs Vagrant with libvirt, about 2 minutes,
#    for tests/datapath/test_vagrant_vm.py: the VM's box, vagrant up, one packet test in it,
#    about 20 minutes; a local run leaves that test out with COZYEBPF_VM_LAB=0)
# 2. lint: ruff check, ruff format --check, mypy, clang-format on bpf/ and cozylab/bpf/
# 3. pytest: tests/unit (no kernel needed) and tests/datapath (real BPF), pyproject.toml's
#    testpaths (tests/unit/test_chart.py too: helm from step 1 lints and renders the chart;
#    under CI=true a missing helm fails those tests, never skips them). The test files run on
#    parallel workers, one per CPU (pytest-xdist, --dist loadfile: a file's tests and its
#    module fixtures stay in one worker; every test has namespace and pin prefixes of its own
#    process); COZYEBPF_TEST_WORKERS=N sets how many, 0 runs them in this process.
# The tests run even when lint fails; the script exits non-zero when either
# failed. pytest's exit code 5 (no tests collected) counts as a failure.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/as-root.sh" "$@"  # as root, or again through sudo

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT" || exit 1

section() { printf '\n======== %s ========\n' "$*"; }

section "setup"
if ! bash scripts/setup.sh --kube --kernel-guests --real-node --vagrant; then
	echo "test.sh: setup failed, not running lint or tests" >&2
	exit 1
fi

section "lint"
LINT_FAILED=()
lint() {
	local name=$1
	shift
	printf -- '--> %s\n' "$*"
	if "$@"; then
		printf -- '--> %s: ok\n' "$name"
	else
		printf -- '--> %s: FAILED\n' "$name"
		LINT_FAILED+=("$name")
	fi
}
lint "ruff check" .venv/bin/ruff check cozyebpf cozylab bench tests
lint "ruff format" .venv/bin/ruff format --check cozyebpf cozylab bench tests
lint "mypy" .venv/bin/mypy
shopt -s nullglob
BPF_SOURCES=(bpf/*.c bpf/lib/*.h cozylab/bpf/*.c)
shopt -u nullglob
if ((${#BPF_SOURCES[@]} > 0)); then
	lint "clang-format" clang-format --dry-run -Werror "${BPF_SOURCES[@]}"
else
	echo "--> clang-format: no bpf/*.c, bpf/lib/*.h or cozylab/bpf/*.c, skipped"
fi

if ((${#LINT_FAILED[@]} == 0)); then
	echo "lint: passed"
else
	echo "lint: FAILED (${LINT_FAILED[*]}); running the tests anyway"
fi

# pytest's own closing line stays the last line of a green run.
section "tests"
if (($# == 0)); then
	set -- -q -n "${COZYEBPF_TEST_WORKERS:-auto}" --dist loadfile
fi
printf -- '--> .venv/bin/pytest %s\n' "$*"
.venv/bin/pytest "$@"
PYTEST_RC=$?

FAILED=()
if ((${#LINT_FAILED[@]} > 0)); then
	FAILED+=("lint (${LINT_FAILED[*]})")
fi
case $PYTEST_RC in
0) ;;
5) FAILED+=("tests (pytest exit 5: no tests were collected)") ;;
*) FAILED+=("tests (pytest exit $PYTEST_RC)") ;;
esac
if ((${#FAILED[@]} > 0)); then
	section "FAILED"
	printf 'test.sh: FAILED: %s\n' "${FAILED[@]}"
	exit 1
fi
exit 0
