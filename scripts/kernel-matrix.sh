#!/usr/bin/env bash
# The kernel matrix (issue 36; `make kernel-matrix`): the datapath's tests on Debian 12's
# Linux 6.1 and on 6.12 (the line of Talos 1.9-1.11), each booted from Debian's packages under
# qemu (software emulation), and on this machine's kernel (6.18, the line of Talos 1.12 and
# 1.13; not a Debian package, so it runs here); then one table: kernel, headers, tests passed
# and failed, each program's verified instructions beside this machine's, time.
#
#   scripts/kernel-matrix.sh [ARGS]     ARGS go to `python -m cozylab.kmatrix` (--help), e.g.
#                                       --kernels 6.1,host, --plan ci
#
# 1. scripts/setup.sh (the .venv the guests run from the shared checkout)
# 2. scripts/kernel-guests.sh: the guests' root file system and kernels, built once into
#    /var/cache/cozyebpf/kernel-matrix (3 to 5 minutes the first time; a second after)
# 3. cozylab/kmatrix.py: each guest in turn, then this machine; each guest's console log, JUnit
#    reports and the rows as JSON are kept in build/kernel-matrix/ (git ignores build/)
# About 40 minutes in all on 2 quiet cores (docs/design.md, *The kernel matrix*).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/as-root.sh" "$@" # as root, or again through sudo

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

printf '==> kernel-matrix: setup\n'
bash scripts/setup.sh
printf '==> kernel-matrix: the guests (scripts/kernel-guests.sh)\n'
bash scripts/kernel-guests.sh
OUT="$REPO_ROOT/build/kernel-matrix"
rm -rf "$OUT"
mkdir -p "$OUT"
printf '==> kernel-matrix: the runs (results in %s)\n' "$OUT"
exec env PYTHONPATH="$REPO_ROOT" .venv/bin/python -m cozylab.kmatrix --keep "$OUT" --json "$OUT/rows.json" "$@"
