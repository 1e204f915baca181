"""Every program against its verifier budget, from the table in docs/design.md (*Verifier
budgets*): the programs loaded as the agent loads them (bpf/cozyebpf.c, one compilation), each
entry program with the full path and the other programs it hands frames to."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from cozyebpf.datapath import bpfsys, loader
from cozyebpf.datapath.attach import detach_all
from cozyebpf.datapath.maps import PinnedMaps
from tests.support.env import unique_prefix

#: the entry programs of bpf/cozyebpf.c and their program types
ENTRIES = {
    "cz_ingress": "xdp",
    "cz_ingress_tc": "sched_cls",
    "cz_egress": "sched_cls",
    "cz_pod_ingress": "sched_cls",
    "cz_route_tc": "sched_cls",
}
README_HOOKS = {  # README's per-hook figures: the largest of these programs' budgets
    "XDP": ("cz_ingress", "cz_ingress_slow", "cz_ingress_outside"),
    "tc ingress": ("cz_ingress_tc", "cz_ingress_tc_slow", "cz_ingress_tc_outside"),
    "egress": ("cz_egress", "cz_egress_slow"),
}


def budgets(repo_root: Path) -> dict[str, int]:
    """The table of docs/design.md's *Verifier budgets*: program -> verified instructions."""
    text = (repo_root / "docs" / "design.md").read_text()
    section = text.partition("### Verifier budgets\n")[2].partition("\n#")[0]
    rows = re.findall(r"^\| `(\w+)` \| [^|]+ \| ([\d,]+) \|$", section, re.M)
    assert rows, "docs/design.md has no table under '### Verifier budgets'"
    return {name: int(n.replace(",", "")) for name, n in rows}


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
    table = budgets(repo_root)
    with capsys.disabled():
        print()
        for name, n in counts.items():
            print(f"verifier: {name}: {n:,} verified instructions (budget {table.get(name, 0):,})")
    assert set(counts) == set(table), "programs and rows of docs/design.md's budgets differ"
    over = {name: (n, table[name]) for name, n in counts.items() if n > table[name]}
    assert not over, (
        f"over budget (verified, budget): {over}. The budgets were measured on Linux 6.18; this "
        f"is Linux {os.uname().release}. On another kernel the verifier may count differently: "
        f"re-measure there before changing code. Otherwise raise the row in docs/design.md and "
        f"say why in the commit."
    )


def test_the_readme_quotes_the_largest_budget_of_each_hook(repo_root: Path) -> None:
    table = budgets(repo_root)
    readme = " ".join((repo_root / "README.md").read_text().split())
    m = re.search(
        r"verifier processes at most ([\d,]+) instructions for an XDP program, ([\d,]+) for tc "
        r"ingress and ([\d,]+) for egress",
        readme,
    )
    assert m, "README no longer quotes the verifier's figures as this test expects"
    quoted = [int(g.replace(",", "")) for g in m.groups()]
    assert quoted == [max(table[p] for p in progs) for progs in README_HOOKS.values()]
