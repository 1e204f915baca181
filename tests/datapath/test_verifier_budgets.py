"""Every program against its verifier budget, from bpf/verifier-budgets.json (data the
kernel matrix measured; docs/design.md, *Verifier budgets*): the programs loaded as the agent
loads them (bpf/cozyebpf.c, one compilation), each entry program with the full path and the
other programs it hands frames to.

The verifier counts differently on each kernel, so the file has a column per kernel line the
kernel matrix runs (cozylab/kmatrix.py: 6.1, 6.12, 6.18) and the running kernel is held to
its own. A kernel between two lines is held to the older line's column (its verifier grew from
that one; the test says so and asks for a column of its own), and a kernel older than every
column fails: nothing older is proven."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from cozyebpf.datapath import bpfsys, loader
from cozyebpf.datapath.attach import detach_all
from cozyebpf.datapath.maps import PinnedMaps
from cozylab.kmatrix import kernel_line
from tests.support.env import unique_prefix

#: the entry programs of bpf/cozyebpf.c and their program types
ENTRIES = {
    "cz_ingress": "xdp",
    "cz_ingress_tc": "sched_cls",
    "cz_egress": "sched_cls",
    "cz_pod_ingress": "sched_cls",
    "cz_route_tc": "sched_cls",
}
BUDGETS = "bpf/verifier-budgets.json"


def budgets(repo_root: Path) -> dict[str, dict[str, int]]:
    """bpf/verifier-budgets.json as kernel line (6.1) -> program -> verified instructions."""
    data = json.loads((repo_root / BUDGETS).read_text())
    lines = list(data["kernels"])
    assert lines, f"{BUDGETS} names no kernel line"
    table: dict[str, dict[str, int]] = {line: {} for line in lines}
    for name, row in data["programs"].items():
        missing = [line for line in lines if not isinstance(row.get(line), int)]
        assert not missing, f"{BUDGETS}: {name} has no budget for Linux {', '.join(missing)}"
        for line in lines:
            table[line][name] = row[line]
    return table


def _version(line: str) -> tuple[int, ...]:
    return tuple(int(x) for x in line.split("."))


def column(table: dict[str, dict[str, int]], release: str) -> tuple[str, str]:
    """The column the kernel `release` is held to, and why that one."""
    line = kernel_line(release)
    if line in table:
        return line, f"Linux {release}: the column of Linux {line}"
    older = [c for c in table if _version(c) < _version(line)]
    if not older:
        pytest.fail(
            f"Linux {release} is older than every column of {BUDGETS} "
            f"({', '.join(table)}): cozyebpf is proven on none older (cozylab/kmatrix.py)"
        )
    nearest = max(older, key=_version)
    return nearest, (
        f"Linux {release} has no column: held to Linux {nearest}'s, the nearest older line; "
        f"measure it (the test prints the counts) and add a column for {line}"
    )


@pytest.fixture(scope="module")
def counts() -> Iterator[dict[str, int]]:
    """Verified instructions of every program the entry programs load, by name."""
    pin = f"/sys/fs/bpf/{unique_prefix('verif')}"
    maps = PinnedMaps.ensure(pin)
    try:
        module = loader.compile_source("cozyebpf.c", pin)
        out = {}
        for entry, kind in ENTRIES.items():
            prog = loader.load_from(module, entry, kind)
            out[entry] = bpfsys.prog_info(prog.fd).verified_insns
            more = [m for m, _, _ in loader.MORE_PATHS.get(entry, ())]
            slow = [loader.SLOW_PATHS[entry][0]] if entry in loader.SLOW_PATHS else []
            for name in (*slow, *more):
                fd = loader.slow_program_fd(prog, name)
                assert fd is not None, f"{entry} loaded no {name}"
                out[name] = bpfsys.prog_info(fd).verified_insns
        report = os.environ.get("COZYEBPF_VERIFIER_COUNTS")
        if report:  # the kernel matrix's table (cozylab/kmatrix.py)
            Path(report).write_text(json.dumps({"kernel": os.uname().release, "counts": out}))
        yield out
    finally:
        maps.close()
        detach_all(pin)


def test_every_program_is_within_its_budget(
    counts: dict[str, int], repo_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line, why = column(budgets(repo_root), os.uname().release)
    table = budgets(repo_root)[line]
    with capsys.disabled():
        print(f"\nverifier: {why}")
        for name, n in counts.items():
            print(f"verifier: {name}: {n:,} verified instructions (budget {table.get(name, 0):,})")
    assert set(counts) == set(table), f"programs and rows of {BUDGETS} differ"
    over = {name: (n, table[name]) for name, n in counts.items() if n > table[name]}
    assert not over, (
        f"over budget (verified, budget): {over}. {why}. A change that needs more raises its "
        f"rows in {BUDGETS} on every kernel it grows on (make kernel-matrix measures them) and "
        f"says why in the commit."
    )


def test_a_kernel_is_held_to_its_own_column_or_the_nearest_older_one(repo_root: Path) -> None:
    table = budgets(repo_root)
    assert set(table) >= {"6.1", "6.12", "6.18"}, "the kernel matrix's lines have columns"
    assert column(table, "6.12.118+deb12-amd64")[0] == "6.12"
    assert column(table, "6.1.0-57-amd64")[0] == "6.1"
    assert column(table, "6.18.44-fc-v1272")[0] == "6.18"
    assert column(table, "6.8.0-45-generic")[0] == "6.1"  # Ubuntu 24.04
    assert column(table, "6.19.1")[0] == "6.18"
    with pytest.raises(pytest.fail.Exception, match="older than every column"):
        column(table, "5.15.0-1-amd64")


def test_the_tc_entry_verifies_no_more_than_the_xdp_entry(
    counts: dict[str, int], repo_root: Path
) -> None:
    """The tc ingress entry decides what the XDP entry decides, with its rare paths (IPv6, host
    routing) behind tail calls as XDP's are: it may take the verifier no more work, on the
    running kernel and in every kernel line's measured column (issue 46)."""
    assert counts["cz_ingress_tc"] <= counts["cz_ingress"], (
        f"Linux {os.uname().release}: tc entry {counts['cz_ingress_tc']:,}, XDP entry "
        f"{counts['cz_ingress']:,}"
    )
    over = {
        line: (row["cz_ingress_tc"], row["cz_ingress"])
        for line, row in budgets(repo_root).items()
        if row["cz_ingress_tc"] > row["cz_ingress"]
    }
    assert not over, f"{BUDGETS}: the tc entry above the XDP entry (tc, XDP): {over}"
