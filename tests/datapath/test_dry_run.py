"""Explain's dry runs at the program level (bpf/lib/dryrun.h), for each program: the verdict
and the output a real run gives, the decision recorded with the nonce, and nothing else
changed -- no counter (node-wide or per Service), flow, fragment entry or monitor event --
where the same frame without the marker changes them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Dot1Q, Ether
from scapy.packet import Packet

from cozyebpf.datapath import bpfsys, layout, loader
from cozyebpf.datapath.maps import PinnedMaps
from cozyebpf.datapath.reasons import REASONS
from cozyebpf.explain import NOT_OURS, dry_run
from cozyebpf.state import diff
from tests.fixtures.dry_run import CASES, STATE, VM2
from tests.support.labtools import dry_run_witness
from tests.support.packets import (
    CLIENT,
    MAC_A,
    MAC_B,
    POD_FILT,
    assert_frame,
)


@dataclass
class Progs:
    maps: PinnedMaps
    fds: dict[str, int]
    loaded: tuple[loader.Program, ...]

    def everything(self) -> tuple[Any, ...]:
        return dry_run_witness(self.maps)


@pytest.fixture(scope="module")
def progs() -> Iterator[Progs]:
    from cozyebpf.datapath.attach import detach_all
    from tests.support.env import unique_prefix
    from tests.support.labtools import load_programs

    pin = f"/sys/fs/bpf/{unique_prefix('dry')}"
    maps = PinnedMaps.ensure(pin, max_services=8)
    try:
        maps.apply(diff(maps.read_state(), STATE))
        loaded = load_programs(pin)
        yield Progs(maps, {k: prog.fd for k, prog in loaded.items()}, tuple(loaded.values()))
    finally:
        maps.close()
        detach_all(pin)


@pytest.mark.parametrize("monitor", [False, True], ids=["", "monitor-on"])
@pytest.mark.parametrize(
    ("prog", "packet", "drop", "reason", "service", "leaves"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_a_dry_run_decides_and_changes_nothing(
    progs: Progs,
    prog: str,
    packet: Packet,
    drop: bool,
    reason: str | None,
    service: str | None,
    leaves: Packet | None,
    monitor: bool,
) -> None:
    if monitor:
        progs.maps.set_monitor(layout.MON_ALL, 1000, 1_000_000)
    try:
        before = progs.everything()
        run = dry_run(progs.maps, progs.fds[prog], prog == "xdp", bytes(packet))
        assert progs.everything() == before, "the dry run changed something"
    finally:
        progs.maps.set_monitor(layout.MON_OFF)
    assert run.drop == drop
    assert run.result is not None, "the full path recorded no decision"
    got = None if run.result.reason == NOT_OURS else REASONS[run.result.reason]
    assert got == reason
    assert progs.maps.service_of_slot(run.result.slot) == (service or "")
    if leaves is not None:
        eth = Ether(dst="02:00:00:00:00:02", src="02:00:00:00:00:01")  # explain's
        assert_frame(run.frame, eth / leaves, "the packet as it leaves")


def test_the_same_tagged_frame_without_the_marker_is_real(progs: Progs) -> None:
    """The tag alone changes nothing: a real tagged frame is counted and recorded (the flow)."""
    frame = Ether(dst=MAC_B, src=MAC_A) / Dot1Q(vlan=0) / IP(src=POD_FILT, dst=CLIENT)
    frame = frame / UDP(sport=40001, dport=53)
    before = progs.maps.service_counters()
    assert bpfsys.prog_test_run(progs.fds["egress"], bytes(frame)).retval == -1
    after = {c.service: c for c in progs.maps.service_counters()}
    was = {c.service: c for c in before}
    assert after[VM2].out_packets == was[VM2].out_packets + 1
    assert any(f.pod_port == 40001 for f in progs.maps.flows())
