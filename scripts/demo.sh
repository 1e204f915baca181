#!/usr/bin/env bash
# The project's main job (README):
#   sudo bash scripts/demo.sh [demo args...]
# Sets the machine up (scripts/setup.sh, idempotent), then runs the demo
# module with the project's venv. Set-up messages go to stderr so that the
# demo's own stdout stays clean; relative paths in the arguments are resolved
# from the caller's directory.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

bash "$REPO_ROOT/scripts/setup.sh" >&2
exec "$REPO_ROOT/.venv/bin/python" -m cozyebpf.demo "$@"
