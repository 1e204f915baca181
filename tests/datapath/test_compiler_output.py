"""The compiler child's output in the agent's log (issue 37, item 6): what clang says of this
tree's programs goes to the agent's stderr, but for the "loop not unrolled" warnings
(`cozyebpf/datapath/compiler.py`, UNROLL_WARNING), which one DEBUG line counts."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest

from cozyebpf.datapath.compiler import Compilation, Request
from cozyebpf.datapath.maps import PinnedMaps
from tests.support.env import unique_prefix


@pytest.fixture
def pin_dir() -> Iterator[str]:
    from cozyebpf.datapath.attach import detach_all

    path = f"/sys/fs/bpf/{unique_prefix('cc')}"
    PinnedMaps.ensure(path).close()
    try:
        yield path
    finally:
        detach_all(path)


def test_a_real_compilation_leaves_no_unroll_warning_on_stderr(
    pin_dir: str, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="cozyebpf.datapath.compiler")
    got = Compilation(pin_dir, [Request("cz_egress", "sched_cls")]).result()
    for _, _, fd in got:
        os.close(fd)
    assert [(name, kind) for name, kind, _ in got] == [("cz_egress", "sched_cls")]
    err = capfd.readouterr().err
    assert "loop not unrolled" not in err, err
    notes = [r for r in caplog.records if "'loop not unrolled' warning(s) left out" in r.message]
    # this tree's flow.h gave five at every start; none since its pragma went (bpf/lib/flow.h)
    assert all(r.levelname == "DEBUG" for r in notes) and len(notes) <= 1
