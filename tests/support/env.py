"""What the test run is given: CI=true, the cozyebpf command (COZYEBPF_TEST_CMD), and names
unique to this test process."""

from __future__ import annotations

import os
import shlex

IN_CI = os.environ.get("CI", "").lower() == "true"

#: Shell words that replace `python -m cozyebpf` wherever the tests run cozyebpf (the
#: `cozyebpf_cmd` fixture). `make image-test` points it at scripts/image-exec.sh, which runs
#: each command from the DaemonSet image's root filesystem, Env and Entrypoint.
TEST_CMD = shlex.split(os.environ.get("COZYEBPF_TEST_CMD", ""))


def unique_prefix(tag: str) -> str:
    """Namespace/pin prefix unique to this test process (parallel runs do not collide)."""
    return f"cz{tag}{os.getpid() % 100000}"
