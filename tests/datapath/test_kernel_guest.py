"""The kernel matrix's 6.12 guest on every run (issue 36): Debian's Linux 6.12, the line of
Talos 1.9-1.11, booted under qemu (software emulation, one CPU), the checkout shared in; inside,
bcc compiles bpf/cozyebpf.c against the image's fallback headers, the kernel loads every program
and test_verifier_budgets holds each to 6.12's column (cozylab/kmatrix.py, plan "ci"); and
test_shaping runs there, whose fq this machine's kernel lacks. What the
whole matrix runs, on 6.1 and 6.12 and here, `make kernel-matrix` does (docs/design.md, *The
kernel matrix*)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cozylab import kmatrix
from tests.datapath.test_verifier_budgets import budgets
from tests.support.env import hang_bound

pytestmark = [
    pytest.mark.requires("kernel-guest"),
    pytest.mark.usefixtures("alone_with_qemu_and_the_nodes"),
]


def test_every_program_compiles_loads_and_keeps_its_budget_on_linux_6_12(
    repo_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kernel = next((k for k in kmatrix.guest_kernels() if k.line == "6.12"), None)
    assert kernel is not None, f"no 6.12 guest in {kmatrix.CACHE}: {kmatrix.BUILD_HINT}"
    said: list[str] = []
    plan = kmatrix.phases(kernel, "ci")
    (row,) = kmatrix.run_guest(kernel, plan, smp=1, timeout=hang_bound(1200), say=said.append)
    with capsys.disabled():
        print(f"\n{kmatrix.table([row])}")
    log = "\n".join(said)
    assert row.complete, f"the guest did not finish its run: {row.note}\n{log}"
    assert row.failed == 0 and row.passed >= 3, f"{kmatrix.failures([row])}\n{log}"
    assert row.counts.keys() == budgets(repo_root)["6.12"].keys(), row.counts
    # shaped egress needs fq, which this machine's kernel lacks: the guest is where it runs
    shaped = [t for t in row.passed_tests if "test_shaping" in t]
    assert shaped, f"test_shaping.py did not pass in the guest: {row.passed_tests}\n{log}"
