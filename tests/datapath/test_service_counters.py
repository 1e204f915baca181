"""Per-Service counters with BPF_PROG_RUN: each packet is counted once more for the Service of
the address it is for (its LB IP's, or for traffic sent to a pod IP directly and the pod's
egress, the Service whose LB IP the pod's egress uses), accepted ones by direction and dropped
ones by reason, in the fast paths and the full paths alike; and the slots behind them: given
by the control plane, named in svcnames, parked and given back, cleared when reused."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from dataclasses import dataclass, replace
from ipaddress import IPv4Address as A
from ipaddress import ip_address

import pytest
from scapy.layers.inet import ICMP, IP, TCP, UDP
from scapy.layers.l2 import Dot1Q, Ether
from scapy.packet import Packet, Raw

from cozyebpf.datapath import bpfsys, loader
from cozyebpf.datapath.buckets import default_burst_packets
from cozyebpf.datapath.layout import SVC_DROPS, BucketVal
from cozyebpf.datapath.maps import PinnedMaps, ServiceCounters
from cozyebpf.datapath.reasons import REASONS, SVC_DROP_REASONS, drop_index
from cozyebpf.state import AllowedPort, Limits, MapState, PodEntry, Proto, ServiceEntry, diff
from tests.support.packets import CLIENT, LB_FILT, LB_WHOLE, MAC_A, MAC_B, POD_FILT, POD_WHOLE

XDP_DROP, XDP_PASS = 1, 2
TC_NEXT, TC_SHOT = -1, 2
VM1, VM2, VM3 = "default/vm1", "default/vm2", "other/vm3"
LB3, POD3 = "2001:db8:1b::40", "fd00:10:244::50"  # IPv6: addr6 has room when addr4 is full


def state(*services: str) -> MapState:
    """vm1 (whole-IP), vm2 (port filter, TCP 80), vm3 (whole-IP, IPv6): those named."""
    st = MapState()
    shapes = {
        VM1: (LB_WHOLE, POD_WHOLE, False),
        VM2: (LB_FILT, POD_FILT, True),
        VM3: (LB3, POD3, False),
    }
    for name in services:
        lb, pod, pf = shapes[name]
        st.services[ip_address(lb)] = ServiceEntry(ip_address(pod), pf, False, name)
        st.pods[ip_address(pod)] = PodEntry(ip_address(lb), pf, False, name)
        if pf:
            st.allowed.add(AllowedPort(ip_address(pod), Proto.TCP, 80))
    return st


@dataclass
class Progs:
    maps: PinnedMaps
    fds: dict[str, int]
    loaded: tuple[loader.Program, ...]

    def run(self, prog: str, frame: Packet) -> int:
        return bpfsys.prog_test_run(self.fds[prog], bytes(frame)).retval

    def set(self, st: MapState) -> None:
        self.maps.apply(diff(self.maps.read_state(), st))

    def of(self, service: str) -> ServiceCounters | None:
        return next((c for c in self.maps.service_counters() if c.service == service), None)


@pytest.fixture(scope="module")
def progs() -> Iterator[Progs]:
    from cozyebpf.datapath.attach import detach_all
    from tests.support.env import unique_prefix
    from tests.support.labtools import load_programs

    pin = f"/sys/fs/bpf/{unique_prefix('svc')}"
    maps = PinnedMaps.ensure(pin, max_services=2)  # slots 1 and 2
    try:
        loaded = load_programs(pin)
        yield Progs(maps, {k: prog.fd for k, prog in loaded.items()}, tuple(loaded.values()))
    finally:
        maps.close()
        detach_all(pin)


@pytest.fixture
def p(progs: Progs) -> Progs:
    """vm1 and vm2 programmed, from counters that start at zero (the slots are cleared)."""
    progs.set(MapState())
    progs.maps.slots._clear(list(range(progs.maps.layout.svcstats.max_entries)))
    return progs


def eth() -> Packet:
    return Ether(src=MAC_A, dst=MAC_B)


def tagged() -> Packet:
    """A frame with an 802.1Q tag: the fast paths leave it to the full path."""
    return Ether(src=MAC_A, dst=MAC_B) / Dot1Q(vlan=5)


def counts(c: ServiceCounters | None) -> tuple[int, int, int, int, dict[str, int]]:
    assert c is not None
    return (
        c.in_packets,
        c.in_bytes,
        c.out_packets,
        c.out_bytes,
        {k: v for k, v in c.drops.items() if v},
    )


def test_drop_index_matches_the_order_of_the_drop_reasons() -> None:
    assert SVC_DROP_REASONS == (
        "drop_port",
        "drop_icmp",
        "drop_proto",
        "drop_malformed",
        "drop_fragment",
        "drop_frag_orphan",
        "drop_icmp_inner",
        "drop_source",
        "drop_spoofed",
        "drop_missed_tail_call",  # counted node-wide only (bpf/lib/tail.h)
        "drop_limit",
    )
    assert len(SVC_DROP_REASONS) <= SVC_DROPS  # layout 6 made room for 16
    for i, r in enumerate(SVC_DROP_REASONS):
        assert drop_index(REASONS.index(r)) == i


def test_each_packet_counts_once_for_its_service(p: Progs) -> None:
    p.set(state(VM1, VM2))
    whole = eth() / IP(src=CLIENT, dst=LB_WHOLE) / UDP(sport=1000, dport=5000) / b"w"
    listed = eth() / IP(src=CLIENT, dst=LB_FILT) / TCP(sport=1000, dport=80)
    unlisted = eth() / IP(src=CLIENT, dst=LB_FILT) / TCP(sport=1000, dport=443)
    direct = eth() / IP(src=CLIENT, dst=POD_FILT) / TCP(sport=1000, dport=80)
    out = eth() / IP(src=POD_FILT, dst=CLIENT) / UDP(sport=40000, dport=53) / b"q"
    icmp = eth() / IP(src=CLIENT, dst=LB_FILT) / ICMP()  # full path: drop_icmp
    frag = tagged() / IP(src=CLIENT, dst=LB_WHOLE, id=7, frag=3, proto=17) / Raw(b"x" * 8)
    n, m, k = 5, 3, 4
    for _ in range(n):
        assert p.run("xdp", whole) == XDP_PASS
    for _ in range(m):
        assert p.run("xdp", unlisted) == XDP_DROP
    for _ in range(k):
        assert p.run("tc", listed) == TC_NEXT
    assert p.run("xdp", direct) == XDP_PASS  # sent to vm2's pod IP: vm2's
    assert p.run("egress", out) == TC_NEXT  # vm2's pod leaves as vm2
    assert p.run("tc", icmp) == TC_SHOT
    assert p.run("xdp", frag) == XDP_PASS  # whole-IP fragment, full path
    assert counts(p.of(VM1)) == (n + 1, n * len(whole) + len(frag), 0, 0, {})
    assert counts(p.of(VM2)) == (
        k + 1,
        k * len(listed) + len(direct),
        1,
        len(out),
        {"drop_port": m, "drop_icmp": 1},
    )
    node = p.maps.counters()
    assert node["nat_ingress"]["packets"] == n + 1
    assert node["drop_port"]["packets"] == m


def test_an_address_that_is_also_a_pod_ip_counts_each_role(p: Progs) -> None:
    """vm1's LB IP is also vm3's pod IP: traffic to it counts for vm1 (the LB role), its
    egress as vm3's pod for vm3."""
    lb3 = A("203.0.113.40")
    st = state(VM1)
    st.services[lb3] = ServiceEntry(A(LB_WHOLE), False, False, VM3)
    st.pods[A(LB_WHOLE)] = PodEntry(lb3, False, False, VM3)
    st.pods[A(POD_WHOLE)] = PodEntry(A(LB_WHOLE), False, False, VM1)
    p.set(st)
    to_lb = eth() / IP(src=CLIENT, dst=LB_WHOLE) / UDP(sport=1, dport=2)
    from_it = eth() / IP(src=LB_WHOLE, dst=CLIENT) / UDP(sport=2, dport=1)
    assert p.run("xdp", to_lb) == XDP_PASS
    assert p.run("egress", from_it) == TC_NEXT
    assert counts(p.of(VM1))[:4] == (1, len(to_lb), 0, 0)
    assert counts(p.of(VM3))[:4] == (0, 0, 1, len(from_it))


def test_slots_are_parked_given_back_and_cleared_when_reused(p: Progs) -> None:
    p.set(state(VM1, VM2))
    slots = {c.service: c.slot for c in p.maps.service_counters()}
    assert sorted(slots.values()) == [1, 2]
    to_vm1 = eth() / IP(src=CLIENT, dst=LB_WHOLE) / UDP(sport=1, dport=2)
    p.run("xdp", to_vm1)
    # vm1 goes (no ready pod): its series go, its slot and counters are parked
    p.set(state(VM2))
    assert [c.service for c in p.maps.service_counters()] == [VM2]
    assert p.maps.service_of_slot(slots[VM1]) == VM1
    # and comes back: the same slot, counting on
    p.set(state(VM1, VM2))
    assert p.of(VM1) is not None and p.of(VM1).slot == slots[VM1]  # type: ignore[union-attr]
    assert p.of(VM1).in_packets == 1  # type: ignore[union-attr]
    # vm1 goes again, vm3 comes: no slot was never named, so vm3 takes vm1's, from zero
    p.set(state(VM2))
    p.set(state(VM2, VM3))
    assert p.of(VM3) is not None and p.of(VM3).slot == slots[VM1]  # type: ignore[union-attr]
    assert counts(p.of(VM3)) == (0, 0, 0, 0, {})
    assert p.maps.uncounted() == (set(), 2)
    # with every slot taken, vm1 is counted node-wide only (and its addresses carry slot 0):
    # uncounted (the agent reports its own limits as not enforced)
    p.set(state(VM1, VM2, VM3))
    assert p.of(VM1) is None
    assert p.maps.lookup_service(A(LB_WHOLE)) == ServiceEntry(A(POD_WHOLE), False, False)
    assert p.maps.lookup_service(A(LB_WHOLE)).service == ""  # type: ignore[union-attr]
    assert p.maps.uncounted() == ({VM1}, 2)
    p.set(state(VM2, VM3))  # gone: no longer uncounted
    assert p.maps.uncounted() == (set(), 2)


def test_a_new_reader_names_every_slot(p: Progs) -> None:
    p.set(state(VM1, VM2))
    with PinnedMaps.open(p.maps.pin_dir) as reader:
        st = reader.read_state()
        assert {str(k): v.service for k, v in st.services.items()} == {
            LB_WHOLE: VM1,
            LB_FILT: VM2,
        }
        assert {str(k): v.service for k, v in st.pods.items()} == {POD_WHOLE: VM1, POD_FILT: VM2}
        assert sorted(reader.service_names().values()) == [VM1, VM2]


def test_an_owner_change_is_written(p: Progs) -> None:
    """Only the Service changes (same pod, same mode): diff() sees it, the slot follows."""
    p.set(state(VM1))
    moved = state(VM1)
    moved.services[A(LB_WHOLE)] = ServiceEntry(A(POD_WHOLE), False, False, VM3)
    moved.pods[A(POD_WHOLE)] = PodEntry(A(LB_WHOLE), False, False, VM3)
    assert moved == state(VM1)  # equal as forwarding goes
    d = diff(p.maps.read_state(), moved)
    assert set(d.services_set) == {A(LB_WHOLE)} and set(d.pods_set) == {A(POD_WHOLE)}
    p.maps.apply(d)
    p.run("xdp", eth() / IP(src=CLIENT, dst=LB_WHOLE) / UDP(sport=1, dport=2))
    assert [c.service for c in p.maps.service_counters()] == [VM3]
    assert p.of(VM3).in_packets == 1  # type: ignore[union-attr]


def test_a_service_without_a_slot_shares_the_guards_bucket_at_slot_0(p: Progs) -> None:
    """Every counter slot taken, a Service's addresses carry slot 0 (issue 45): the node's
    guard is slot 0's limit (set_guard, at the agent's start), so the Services without a slot
    share the guard's one bucket; before, slot 0 had no limit and such a Service had no guard at
    all. Here a guard of 1 packet/s: a burst of 64 passes, the rest is drop_limit."""
    guard = Limits(ingress_pps=1, guard=True)

    def limited(*names: str) -> MapState:
        st = state(*names)
        st.services = {k: replace(v, limited=True) for k, v in st.services.items()}
        st.limits = dict.fromkeys(names, guard)
        return st

    p.set(limited(VM2, VM3))
    p.set(limited(VM1, VM2, VM3))
    assert p.maps.uncounted() == ({VM1}, 2)
    bpfsys.map_update(p.maps.fds["buckets"], ctypes.c_uint32(0), BucketVal())  # full
    p.maps.set_guard(1)
    try:
        assert p.maps.guard_slot() == guard
        before = p.maps.counters()["drop_limit"]["packets"]
        frame = eth() / IP(src=CLIENT, dst=LB_WHOLE) / UDP(sport=1, dport=2)
        verdicts = [p.run("xdp", frame) for _ in range(100)]
        burst = default_burst_packets(1)
        assert burst <= verdicts.count(XDP_PASS) <= burst + 1, verdicts.count(XDP_PASS)
        dropped = p.maps.counters()["drop_limit"]["packets"] - before
        assert dropped == verdicts.count(XDP_DROP) == 100 - verdicts.count(XDP_PASS)
    finally:
        p.maps.set_guard(None)
    assert p.maps.guard_slot() == Limits()


def test_slots_are_named_and_cleared_batch_by_batch(
    p: Progs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cold start names (and clears) its slots a batch of CHUNK at a time (slots.py): with a
    batch of one, every Service still gets its name, and a reused slot its zeroed counters."""
    from cozyebpf.datapath import slots as slots_module

    monkeypatch.setattr(slots_module, "CHUNK", 1)
    p.set(state(VM1, VM2))
    assert sorted(c.service for c in p.maps.service_counters()) == [VM1, VM2]
    vm1 = p.of(VM1)
    assert vm1 is not None
    p.run("xdp", eth() / IP(src=CLIENT, dst=LB_WHOLE) / UDP(sport=1, dport=2))
    assert counts(p.of(VM1))[0] == 1
    p.set(state(VM2))
    p.set(state(VM2, VM3))  # vm3 takes vm1's slot, from zero
    vm3 = p.of(VM3)
    assert vm3 is not None and vm3.slot == vm1.slot
    assert counts(vm3) == (0, 0, 0, 0, {})
    with PinnedMaps.open(p.maps.pin_dir) as reader:
        assert sorted(reader.service_names().values()) == [VM2, VM3]
