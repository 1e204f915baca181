"""The control-plane bench measures the agent as it runs (bench/control.py): a cold sync from a
manifest waits until the pinned maps hold exactly what the agent programs with its defaults.
That expectation is the bench's own (Cluster.state); when the agent's defaults moved (the
node's guard on every Service, issue 38) and the bench's did not, every run timed out after two
minutes, unnoticed until a full run. Here one small cold sync runs through the real agent
(about 20 s: two starts, each compiling the programs)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.common import Params
from bench.control import ControlBench


@pytest.fixture
def bench() -> Iterator[ControlBench]:
    b = ControlBench(Params.make(quick=True))
    b.lab.up()
    try:
        yield b
    finally:
        b.teardown()


def test_a_cold_sync_from_a_manifest_reaches_the_state_the_bench_expects(
    bench: ControlBench,
) -> None:
    res = bench.manifest_cold_sync(50)
    assert res["n"] == 50
    assert res["ready_to_maps_s"] >= 0 and res["file_to_maps_s"] >= 0
