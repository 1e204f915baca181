#!/usr/bin/env bash
# The project's main job (README):
#   ./scripts/demo.sh [demo args...]
# as root, or as a user who may sudo: it runs itself again through sudo then.
# Sets the machine up (scripts/setup.sh, idempotent), then runs the demo
# module with the project's venv. Set-up messages go to stderr so that the
# demo's own stdout stays clean; relative paths in the arguments are resolved
# from the caller's directory.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/as-root.sh" "$@"  # as root, or again through sudo

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

bash "$REPO_ROOT/scripts/setup.sh" >&2
# the demo is a lab (cozylab/, not installed): from the checkout, whatever the caller's directory
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$REPO_ROOT/.venv/bin/python" -m cozylab.demo "$@"
