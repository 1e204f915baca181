"""Explain's dry runs at the program level (bpf/lib/dryrun.h), for each program: the verdict
and the output a real run gives, the decision recorded with the nonce, and nothing else
changed -- no counter (node-wide or per Service), flow, fragment entry or monitor event --
where the same frame without the marker changes them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from ipaddress import IPv4Address as A
from ipaddress import ip_network
from typing import Any

import pytest
from scapy.layers.inet import ICMP, IP, TCP, UDP
from scapy.layers.l2 import Dot1Q, Ether
from scapy.packet import Packet, Raw

from cozyebpf.datapath import bpfsys, layout, loader
from cozyebpf.datapath.maps import PinnedMaps
from cozyebpf.datapath.reasons import REASONS
from cozyebpf.explain import NOT_OURS, dry_run
from cozyebpf.state import AllowedPort, MapState, PodEntry, Proto, ServiceEntry, diff
from tests.support.packets import (
    CLIENT,
    LB_FILT,
    LB_UNKNOWN,
    LB_WHOLE,
    MAC_A,
    MAC_B,
    OTHER_CLIENT,
    POD_FILT,
    POD_WHOLE,
    assert_frame,
)

VM1, VM2, VM3 = "default/vm1", "default/vm2", "default/vm3"
LB_RANGED, POD_RANGED = "203.0.113.40", "10.244.1.50"  # whole-IP, CLIENT only
STATE = MapState(
    services={
        A(LB_WHOLE): ServiceEntry(A(POD_WHOLE), False, False, VM1),
        A(LB_FILT): ServiceEntry(A(POD_FILT), True, False, VM2),
        A(LB_RANGED): ServiceEntry(A(POD_RANGED), False, False, VM3),
    },
    pods={
        A(POD_WHOLE): PodEntry(A(LB_WHOLE), False, False, VM1),
        A(POD_FILT): PodEntry(A(LB_FILT), True, False, VM2),
        A(POD_RANGED): PodEntry(A(LB_RANGED), False, False, VM3),
    },
    allowed={AllowedPort(A(POD_FILT), Proto.TCP, 80)},
    ranges={A(POD_RANGED): frozenset({ip_network(f"{CLIENT}/32")})},
)


@dataclass
class Progs:
    maps: PinnedMaps
    fds: dict[str, int]
    loaded: tuple[loader.Program, ...]

    def everything(self) -> tuple[Any, ...]:
        m = self.maps
        return (
            m.counters(),
            [c.__dict__ for c in m.service_counters()],
            m.flows(),
            m.entries()["frag4"],
            m.monitor_state(),
        )


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


ING = IP(src=CLIENT, dst=LB_FILT)
# (id, program, IP packet, verdict (drop?), reason or None, the Service, the packet as it leaves)
CASES: list[tuple[str, str, Packet, bool, str | None, str | None, Packet | None]] = [
    ("xdp whole-ip", "xdp", IP(src=CLIENT, dst=LB_WHOLE) / UDP(sport=1, dport=2), False,
     "nat_ingress", VM1, IP(src=CLIENT, dst=POD_WHOLE) / UDP(sport=1, dport=2)),
    ("xdp listed port", "xdp", ING / TCP(sport=3, dport=80), False, "pass_port", VM2,
     IP(src=CLIENT, dst=POD_FILT) / TCP(sport=3, dport=80)),
    ("xdp unlisted port", "xdp", ING / TCP(sport=3, dport=81), True, "drop_port", VM2, None),
    ("xdp icmp", "xdp", ING / ICMP(), True, "drop_icmp", VM2, None),
    ("xdp first fragment", "xdp", IP(src=CLIENT, dst=LB_FILT, id=9, flags="MF") / UDP(dport=80)
     / Raw(b"f" * 16), True, "drop_port", VM2, None),
    ("xdp not ours", "xdp", IP(src=CLIENT, dst=LB_UNKNOWN) / TCP(dport=80), False, None, None,
     IP(src=CLIENT, dst=LB_UNKNOWN) / TCP(dport=80)),
    ("tc listed port", "tc", ING / TCP(sport=3, dport=80), False, "pass_port", VM2,
     IP(src=CLIENT, dst=POD_FILT) / TCP(sport=3, dport=80)),
    ("tc unlisted port", "tc", ING / UDP(sport=3, dport=81), True, "drop_port", VM2, None),
    ("tc first fragment", "tc", IP(src=CLIENT, dst=LB_FILT, id=9, flags="MF") / TCP(dport=80)
     / Raw(b"f" * 16), False, "pass_port", VM2, None),
    ("egress of a port-filter pod (no flow recorded)", "egress",
     IP(src=POD_FILT, dst=CLIENT) / UDP(sport=40000, dport=53), False, "nat_egress", VM2,
     IP(src=LB_FILT, dst=CLIENT) / UDP(sport=40000, dport=53)),
    ("xdp inside the source ranges", "xdp", IP(src=CLIENT, dst=LB_RANGED) / TCP(dport=5),
     False, "nat_ingress", VM3, IP(src=CLIENT, dst=POD_RANGED) / TCP(dport=5)),
    ("xdp outside the source ranges (the outside program)", "xdp",
     IP(src=OTHER_CLIENT, dst=LB_RANGED) / TCP(dport=5), True, "drop_source", VM3, None),
    ("tc outside the source ranges, to the pod IP", "tc",
     IP(src=OTHER_CLIENT, dst=POD_RANGED) / UDP(dport=5), True, "drop_source", VM3, None),
    ("egress of a whole-ip pod", "egress", IP(src=POD_WHOLE, dst=CLIENT) / TCP(dport=53), False,
     "nat_egress", VM1, IP(src=LB_WHOLE, dst=CLIENT) / TCP(dport=53)),
]  # fmt: skip


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
