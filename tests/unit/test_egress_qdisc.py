"""What the agent decides shaping on (cozyebpf/datapath/bpf.py, egress_qdisc), from the qdiscs
a device has as rtnl.qdiscs gives them: fq holds the egress when it is the root, or every child
of an mq root. tests/datapath/test_rtnl.py reads real devices' qdiscs (this kernel has no fq);
tests/datapath/test_shaping.py shapes behind a real fq root in the CI guest."""

from __future__ import annotations

import pytest

from cozyebpf.datapath import bpf, rtnl

ROOT, CLSACT = rtnl.TC_H_ROOT, 0xFFFFFFF1


@pytest.mark.parametrize(
    ("qdiscs", "held"),
    [
        ([("fq", 0x80010000, ROOT)], (True, "fq")),
        ([("fq", 0x80010000, ROOT), ("clsact", 0xFFFF0000, CLSACT)], (True, "fq")),
        ([("mq", 0x10000, ROOT), ("fq", 0, 0x10001), ("fq", 0, 0x10002)], (True, "mq of 2 fq")),
        (
            [("mq", 0x10000, ROOT), ("fq", 0, 0x10001), ("fq_codel", 0, 0x10002)],
            (False, "mq of fq, fq_codel"),
        ),
        (
            [("mq", 0, ROOT), ("pfifo_fast", 0, 1), ("pfifo_fast", 0, 2)],
            (False, "mq of pfifo_fast"),
        ),
        ([("mq", 0x10000, ROOT)], (False, "mq of nothing")),
        ([("noqueue", 0, ROOT), ("clsact", 0xFFFF0000, CLSACT)], (False, "noqueue")),
        ([("fq", 0x80010000, CLSACT)], (False, "no qdisc")),  # (not a root)
        ([], (False, "no qdisc")),
    ],
)
def test_fq_holds_the_egress_as_root_or_every_child_of_mq(
    monkeypatch: pytest.MonkeyPatch, qdiscs: list[tuple[str, int, int]], held: tuple[bool, str]
) -> None:
    monkeypatch.setattr(rtnl, "qdiscs", lambda _ifindex: [rtnl.Qdisc(*q) for q in qdiscs])
    assert bpf.egress_qdisc(7) == held
