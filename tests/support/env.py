"""What the test run is given: CI=true, the cozyebpf command (COZYEBPF_TEST_CMD), how much
slower than usual it runs (COZYEBPF_TEST_SLOWDOWN), and names unique to this test process."""

from __future__ import annotations

import os
import shlex

IN_CI = os.environ.get("CI", "").lower() == "true"

#: Shell words that replace `python -m cozyebpf` wherever the tests run cozyebpf (the
#: `cozyebpf_cmd` fixture). `make image-test` points it at scripts/image-exec.sh, which runs
#: each command from the DaemonSet image's root filesystem, Env and Entrypoint.
TEST_CMD = shlex.split(os.environ.get("COZYEBPF_TEST_CMD", ""))


#: How many times slower than a machine like CI's the tests run: a kernel-matrix guest under
#: software emulation (cozylab/kmatrix.py) sets it to about 20. It scales the bounds the tests
#: wait for a hang (`hang_bound`: an agent's start compiles the programs), never a time a test
#: expects something within.
SLOWDOWN = float(os.environ.get("COZYEBPF_TEST_SLOWDOWN", "1"))


def hang_bound(seconds: float) -> float:
    """`seconds`, a bound for a hang on a machine like CI's, on this one (SLOWDOWN)."""
    return seconds * max(1.0, SLOWDOWN)


def unique_prefix(tag: str) -> str:
    """Namespace/pin prefix unique to this test process (parallel runs do not collide)."""
    return f"cz{tag}{os.getpid() % 100000}"
