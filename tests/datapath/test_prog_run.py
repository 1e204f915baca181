"""Program-level cases with BPF_PROG_RUN: input frame -> expected verdict and output bytes.

The real programs are compiled and loaded into the kernel with their pinned maps seeded through
the same code the agent uses (PinnedMaps.apply); no namespace is needed."""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from dataclasses import dataclass
from ipaddress import IPv4Address as A
from ipaddress import IPv6Address

import pytest
from scapy.layers.inet import ICMP, IP, TCP, UDP
from scapy.layers.inet6 import ICMPv6EchoReply, ICMPv6EchoRequest, IPv6, IPv6ExtHdrFragment
from scapy.layers.l2 import Dot1Q, Ether
from scapy.packet import Packet, Raw

from cozyebpf.datapath import bpfsys, layout, loader
from cozyebpf.datapath.layout import be16, be32
from cozyebpf.datapath.maps import Flow, FlowEntry, PinnedMaps, coarse_now_ns
from cozyebpf.datapath.reasons import REASONS
from cozyebpf.state import PodEntry, ServiceEntry, diff
from tests.fixtures.prog_run import (
    EGRESS_CASES,
    INGRESS_CASES,
    SEED,
    TC_NEXT,
    TC_SHOT,
    XDP_DROP,
    XDP_PASS,
    eth,
)
from tests.support.clock import age_flows
from tests.support.packets import (
    CLIENT,
    LB_FILT,
    LB_WHOLE,
    MAC_A,
    MAC_B,
    OTHER_CLIENT,
    POD_FILT,
    POD_WHOLE,
    assert_frame,
    checksums_ok,
)


def map_name(map_id: int) -> str:
    import os

    attr = bpfsys._GetFdById(id=map_id)
    fd = bpfsys._sys_bpf(14, attr, "open map by id")  # BPF_MAP_GET_FD_BY_ID
    try:
        return bpfsys.map_info(fd).name
    finally:
        os.close(fd)


@dataclass
class Progs:
    maps: PinnedMaps
    ingress: int
    ingress_tc: int
    egress: int
    loaded: tuple[loader.Program, ...] = ()

    def xdp(self, frame: bytes) -> tuple[int, bytes]:
        r = bpfsys.prog_test_run(self.ingress, frame)
        return r.retval, r.data

    def tc_ingress(self, frame: bytes) -> tuple[int, bytes]:
        """The tc ingress program, its verdict mapped to XDP's (TC_NEXT -> PASS, drop)."""
        r = bpfsys.prog_test_run(self.ingress_tc, frame)
        verdict = {TC_NEXT: XDP_PASS, TC_SHOT: XDP_DROP}.get(r.retval, 1000 + r.retval)
        return verdict, r.data

    def tc(self, frame: bytes) -> tuple[int, bytes]:
        r = bpfsys.prog_test_run(self.egress, frame)
        return r.retval, r.data


@pytest.fixture(scope="module")
def progs(pin_dir_module: str) -> Iterator[Progs]:
    maps = PinnedMaps.ensure(pin_dir_module)
    ing = loader.load("ingress.c", "cz_ingress", "xdp", pin_dir_module)
    ing_tc = loader.load("ingress_tc.c", "cz_ingress_tc", "sched_cls", pin_dir_module)
    eg = loader.load("egress.c", "cz_egress", "sched_cls", pin_dir_module)
    maps.apply(diff(maps.read_state(), SEED))
    yield Progs(maps, ing.fd, ing_tc.fd, eg.fd, (ing, ing_tc, eg))
    maps.close()


@pytest.fixture(scope="module")
def pin_dir_module() -> Iterator[str]:
    from cozyebpf.datapath.attach import detach_all
    from tests.support.env import unique_prefix

    path = f"/sys/fs/bpf/{unique_prefix('run')}"
    yield path
    detach_all(path)


@pytest.mark.parametrize("hook", ["xdp", "tc"])
@pytest.mark.parametrize(
    ("frame", "verdict", "expected"),
    [c[1:] for c in INGRESS_CASES],
    ids=[c[0] for c in INGRESS_CASES],
)
def test_ingress(
    progs: Progs, hook: str, frame: Packet, verdict: int, expected: Packet | None
) -> None:
    """The XDP program and the tc ingress program must give the same verdict and bytes."""
    ret, out = (progs.xdp if hook == "xdp" else progs.tc_ingress)(bytes(frame))
    assert ret == verdict
    assert_frame(out, expected if expected is not None else frame, "XDP output")
    if verdict == XDP_PASS and expected is not None and IPv6 not in frame:
        assert checksums_ok(out) == []


@pytest.mark.parametrize(
    ("frame", "expected"), [c[1:] for c in EGRESS_CASES], ids=[c[0] for c in EGRESS_CASES]
)
def test_egress(progs: Progs, frame: Packet, expected: Packet | None) -> None:
    ret, out = progs.tc(bytes(frame))
    assert ret == TC_NEXT  # never ends the tcx chain: Cilium's programs still run
    assert_frame(out, expected if expected is not None else frame, "TC output")
    if expected is not None:
        assert checksums_ok(out) == []


@pytest.mark.parametrize(
    ("out_pkt", "reply"),
    [
        (
            IP(src=POD_FILT, dst=CLIENT) / TCP(sport=34000, dport=443, flags="S"),
            IP(src=CLIENT, dst=LB_FILT) / TCP(sport=443, dport=34000, flags="SA"),
        ),
        (
            IP(src=POD_FILT, dst=CLIENT) / UDP(sport=34001, dport=123),
            IP(src=CLIENT, dst=LB_FILT) / UDP(sport=123, dport=34001),
        ),
        (
            IP(src=POD_FILT, dst=CLIENT) / ICMP(type=8, id=4242),
            IP(src=CLIENT, dst=LB_FILT) / ICMP(type=0, id=4242),
        ),
    ],
    ids=["tcp", "udp", "icmp-echo"],
)
def test_replies_to_pod_flows_pass(progs: Progs, out_pkt: Packet, reply: Packet) -> None:
    reply_frame = bytes(eth() / reply)
    ret, _ = progs.xdp(reply_frame)
    assert ret == XDP_DROP, "before the pod opened the flow, the reply must be dropped"
    ret, _ = progs.tc(bytes(eth() / out_pkt))
    assert ret == TC_NEXT
    ret, out = progs.xdp(reply_frame)
    assert ret == XDP_PASS
    want = reply.copy()
    want[IP].dst = POD_FILT
    assert_frame(out, eth() / IP(bytes(want)), "reply")
    # another peer, same ports: not a reply
    other = reply.copy()
    other[IP].src = OTHER_CLIENT
    ret, _ = progs.xdp(bytes(eth() / IP(bytes(other))))
    assert ret == XDP_DROP
    assert progs.maps.flows_by_pod().get(A(POD_FILT), 0) >= 1


def test_whole_ip_pods_record_no_flows(progs: Progs) -> None:
    before = progs.maps.flows_by_pod().get(A(POD_WHOLE), 0)
    progs.tc(bytes(eth() / IP(src=POD_WHOLE, dst=CLIENT) / TCP(sport=35000, dport=80)))
    assert progs.maps.flows_by_pod().get(A(POD_WHOLE), 0) == before == 0


def test_counters_count_each_verdict(progs: Progs) -> None:
    def snap() -> dict[str, int]:
        return {k: v["packets"] for k, v in progs.maps.counters().items()}

    before = snap()
    frame = eth() / IP(src=CLIENT, dst=LB_FILT) / TCP(sport=1, dport=81)
    for _ in range(3):
        progs.xdp(bytes(frame))
    progs.xdp(bytes(eth() / IP(src=CLIENT, dst=LB_FILT) / ICMP()))
    progs.xdp(bytes(eth() / IP(src=CLIENT, dst=LB_WHOLE) / UDP(dport=1)))
    progs.tc(bytes(eth() / IP(src=POD_WHOLE, dst=CLIENT) / UDP(dport=1)))
    after = snap()
    delta = {k: after[k] - before.get(k, 0) for k in REASONS if after[k] != before.get(k, 0)}
    assert delta == {"drop_port": 3, "drop_icmp": 1, "nat_ingress": 1, "nat_egress": 1}
    assert progs.maps.counters()["drop_port"]["bytes"] >= 3 * len(frame)


def test_the_monitor_counts_every_event_it_writes_refuses_or_loses(progs: Progs) -> None:
    """With the monitor on, each counted packet is an event: written to the ring buffer whole,
    refused by the token bucket once it is empty, or lost to a full ring buffer; monstats counts
    each kind (what `cozyebpf monitor` reports as lost). The bucket's rate is one event in
    1,000 s and its burst two intervals: three events pass, then none for the whole test."""
    from cozyebpf.monitor import RingBuffer

    m = progs.maps
    frame = bytes(eth() / IP(src=CLIENT, dst=LB_FILT) / TCP(sport=1, dport=81))  # drop_port
    ring = RingBuffer(m.fds[m.layout.events.name], m.layout.events.max_entries)
    ring.skip()
    before = m.monitor_state()
    interval = 1000 * 10**9
    try:
        m.set_monitor(layout.MON_DROPS, interval, 2 * interval)
        assert bpfsys.prog_test_run(progs.ingress, frame, repeat=5).retval == XDP_DROP
        limited = m.monitor_state()
        records = list(ring.records())
        # every event admitted: the ring buffer (256 KiB, ~3,600 records) overflows
        m.set_monitor(layout.MON_DROPS, 1, 10**15)
        n = 2 * m.layout.events.max_entries // ctypes.sizeof(layout.CzEvent)
        bpfsys.prog_test_run(progs.ingress, frame, repeat=n)
        full = m.monitor_state()
    finally:
        m.set_monitor(layout.MON_OFF)
        ring.skip()
        ring.close()
    assert (limited.events - before.events, limited.lost_limit - before.lost_limit) == (3, 2)
    assert limited.lost_full == before.lost_full
    assert len(records) == 3
    for raw in records:
        ev = layout.CzEvent.from_buffer_copy(raw)
        assert (REASONS[ev.reason], ev.proto, ev.v6, ev.len) == ("drop_port", 6, 0, len(frame))
        assert (ev.src.a[0], ev.dst.a[0]) == (be32(A(CLIENT)), be32(A(LB_FILT)))
        assert (ev.sport, ev.dport) == (be16(1), be16(81))
    written, lost = full.events - limited.events, full.lost_full - limited.lost_full
    assert written + lost == n and full.lost_limit == limited.lost_limit
    assert 0 < written < n and lost > 0, (written, lost)


def test_programs_use_the_pinned_maps(progs: Progs) -> None:
    """bcc opened our pins rather than making maps of its own (but the per-CPU scratch slot of
    a full path and the cached FIB answers, which each compilation has for itself); the entry
    programs reach their full paths through the pinned prog arrays (bpf/lib/tail.h)."""
    import ctypes

    def used_maps(fd: int) -> set[int]:
        ids = (ctypes.c_uint32 * 64)()
        i = bpfsys._ProgInfo()
        i.nr_map_ids = 64
        i.map_ids = ctypes.addressof(ids)
        bpfsys._info(fd, i, "prog")
        return set(ids[: i.nr_map_ids])

    pinned = {bpfsys.map_info(fd).id for fd in progs.maps.fds.values()}
    for prog in progs.loaded:
        slow = loader.slow_program_fd(prog)
        assert slow is not None
        array = loader.SLOW_PATHS[prog.name][1].removeprefix("cz_")
        assert bpfsys.map_info(progs.maps.fds[array]).id in used_maps(prog.fd)
        cached = {m for m in used_maps(prog.fd) - pinned if map_name(m) == "cz_fibc4"}
        assert used_maps(prog.fd) - cached <= pinned, prog.name
        used = used_maps(slow)
        own = {m for m in used - pinned if map_name(m) == "cz_scratch"}
        assert len(own) == 1 and used - own <= pinned, (prog.name, used, pinned)


def test_fragments_follow_their_first_fragment(progs: Progs) -> None:
    """Port filter: the first fragment's verdict decides for the fragments after it."""

    def frag_udp(dport: int, ident: int, offset: int, mf: bool, dst: str = LB_FILT) -> Packet:
        ip = IP(src=CLIENT, dst=dst, id=ident, flags="MF" if mf else 0, frag=offset, proto=17)
        if offset == 0:
            return eth() / ip / UDP(sport=4000, dport=dport, len=8 + 40, chksum=0) / (b"a" * 16)
        return eth() / ip / Raw(b"b" * 24)

    def counted(frame: Packet) -> tuple[int, list[str]]:
        before = {k: v["packets"] for k, v in progs.maps.counters().items()}
        ret, _ = progs.xdp(bytes(frame))
        after = {k: v["packets"] for k, v in progs.maps.counters().items()}
        return ret, sorted(k for k in after if after[k] != before.get(k, 0))

    # an allowed port: the first passes, the rest follow, translated
    assert counted(frag_udp(53, 7001, 0, True)) == (XDP_PASS, ["pass_port"])
    ret, out = progs.xdp(bytes(frag_udp(53, 7001, 2, True)))
    assert ret == XDP_PASS
    assert_frame(out, frag_udp(53, 7001, 2, True, dst=POD_FILT), "middle fragment")
    assert counted(frag_udp(53, 7001, 5, False)) == (XDP_PASS, ["pass_fragment"])
    # an unlisted port: the first is dropped and so is the rest
    assert counted(frag_udp(99, 7002, 0, True)) == (XDP_DROP, ["drop_port"])
    assert counted(frag_udp(99, 7002, 2, False)) == (XDP_DROP, ["drop_fragment"])
    # out of order: a fragment before its first one is dropped
    assert counted(frag_udp(53, 7003, 2, False)) == (XDP_DROP, ["drop_frag_orphan"])


def icmp_error_about(inner: Packet, outer_dst: str, **icmp: int) -> Packet:
    """An ICMP error from OTHER_CLIENT about `inner` (first 28+ bytes of it)."""
    quoted = bytes(inner)[:48]
    return eth() / IP(src=OTHER_CLIENT, dst=outer_dst) / ICMP(**icmp) / Raw(quoted)


@pytest.mark.parametrize("hook", ["xdp", "tc"])
def test_icmp_errors_translate_the_inner_packet(progs: Progs, hook: str) -> None:
    """Fragmentation needed about the pod's own packet (it left as the LB IP): the outer and the
    inner header are translated, with every checksum right (PMTU discovery works)."""
    run = progs.xdp if hook == "xdp" else progs.tc_ingress
    sent = IP(src=LB_WHOLE, dst=CLIENT, id=55) / UDP(sport=40000, dport=53) / (b"q" * 20)
    frame = icmp_error_about(sent, LB_WHOLE, type=3, code=4, nexthopmtu=1280)
    ret, out = run(bytes(frame))
    assert ret == XDP_PASS
    as_sent = IP(src=POD_WHOLE, dst=CLIENT, id=55) / UDP(sport=40000, dport=53) / (b"q" * 20)
    want = icmp_error_about(as_sent, POD_WHOLE, type=3, code=4, nexthopmtu=1280)
    assert_frame(out, want, "ICMP error")
    assert checksums_ok(out) == []
    inner = IP(bytes(Ether(out)[ICMP].payload))
    assert inner.src == POD_WHOLE and inner[UDP].chksum == IP(bytes(as_sent))[UDP].chksum


def test_icmp_errors_about_allowed_flows_pass_the_filter(progs: Progs) -> None:
    """Port filter without allowICMP: an error about a flow the pod opened passes (related);
    one about nothing the pod did is dropped; an error about an error is malformed."""
    progs.tc(bytes(eth() / IP(src=POD_FILT, dst=CLIENT) / TCP(sport=36000, dport=443)))
    related = IP(src=LB_FILT, dst=CLIENT) / TCP(sport=36000, dport=443)
    ret, out = progs.xdp(bytes(icmp_error_about(related, LB_FILT, type=3, code=4)))
    assert ret == XDP_PASS and checksums_ok(out) == []
    unrelated = IP(src=LB_FILT, dst=CLIENT) / TCP(sport=36001, dport=443)
    ret, _ = progs.xdp(bytes(icmp_error_about(unrelated, LB_FILT, type=3, code=4)))
    assert ret == XDP_DROP
    nested = IP(src=LB_FILT, dst=CLIENT) / ICMP(type=3, code=1) / (b"z" * 28)
    before = progs.maps.counters()["drop_icmp_inner"]["packets"]
    ret, _ = progs.xdp(bytes(icmp_error_about(nested, LB_FILT, type=11)))
    assert ret == XDP_DROP
    assert progs.maps.counters()["drop_icmp_inner"]["packets"] == before + 1


def test_pod_icmp_errors_translate_the_inner_destination(progs: Progs) -> None:
    """Egress: the pod says port unreachable about a packet it received as its pod IP; the
    outside must see the LB IP in both headers."""
    got = IP(src=CLIENT, dst=POD_WHOLE, id=9) / UDP(sport=5000, dport=6000) / b"x"
    err = eth() / IP(src=POD_WHOLE, dst=CLIENT) / ICMP(type=3, code=3) / Raw(bytes(got))
    ret, out = progs.tc(bytes(err))
    assert ret == TC_NEXT
    as_seen = IP(src=CLIENT, dst=LB_WHOLE, id=9) / UDP(sport=5000, dport=6000) / b"x"
    want = eth() / IP(src=LB_WHOLE, dst=CLIENT) / ICMP(type=3, code=3) / Raw(bytes(as_seen))
    assert_frame(out, want, "egress ICMP error")


@contextlib.contextmanager
def one_cpu() -> Iterator[None]:
    """Run every BPF_PROG_RUN of the block on one CPU (the seen slots are per CPU)."""
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(old)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


def test_egress_looks_a_busy_flow_up_only_now_and_then(progs: Progs) -> None:
    """The egress fast path keeps the flow it last looked up in its CPU's seen slot: a packet
    of that flow within CZ_SEEN_NS (100 ms) looks nothing up -- shown by deleting the entry
    behind its back, as an LRU eviction would: it is not added again at once, but after the
    window. A FIN is always looked up (it may change the entry), and user space that writes
    flows (add_flows) or forgets the slots (forget_seen) makes the next packet look its flow
    up."""
    m = progs.maps
    pod, remote, pod_port, remote_port = A(POD_FILT), A(CLIENT), 36001, 443
    flow = Flow(pod, remote, pod_port, remote_port, 6)
    key = layout.Flow4Key(be32(pod), be32(remote), be16(pod_port), be16(remote_port), 6)

    def send(flags: str) -> None:
        frame = eth() / IP(src=POD_FILT, dst=CLIENT) / TCP(sport=pod_port, dport=remote_port)
        frame[TCP].flags = flags
        assert progs.tc(bytes(frame))[0] == TC_NEXT

    def entry() -> FlowEntry | None:
        return next((e for e in m.flow_entries() if e.flow == flow), None)

    def new_flows() -> int:
        return int(m.counters()["flow_new"]["packets"])

    with one_cpu():
        m.forget_seen()
        n0 = new_flows()
        send("S")
        assert entry() is not None and new_flows() == n0 + 1
        m.forget_seen()
        send("A")  # looked up: the slot holds the flow from now
        bpfsys.map_delete(m.fds["flow4"], key)
        send("A")  # within the window: not looked up, so not added again
        assert entry() is None and new_flows() == n0 + 1
        age_flows(m, 150_000_000)  # past CZ_SEEN_NS
        send("A")
        assert entry() is not None and new_flows() == n0 + 2
        bpfsys.map_delete(m.fds["flow4"], key)
        m.forget_seen()
        send("A")
        e = entry()
        assert e is not None and not e.closing and new_flows() == n0 + 3
        send("FA")  # a FIN may change the entry: looked up, closing at once
        e = entry()
        assert e is not None and e.closing
        # flows user space writes: the next packet looks its flow up (and refreshes it)
        old = coarse_now_ns() - 5 * 10**9
        m.add_flows([flow], last_seen_ns=old)
        send("A")
        e = entry()
        assert e is not None and e.last_seen_ns > old + 4 * 10**9


@pytest.mark.parametrize("hook", ["xdp", "tc_ingress"])
def test_replies_of_a_busy_flow_are_looked_up_only_now_and_then(progs: Progs, hook: str) -> None:
    """A reply found fresh leaves its flow in the CPU's seen slot: the next replies within
    CZ_SEEN_NS (100 ms) pass without a flow-table lookup -- shown by deleting the entry behind
    its back, as an LRU eviction would: they still pass for the window, not after it. The slot
    never admits a reply the entry would not: with a UDP timeout shorter than the window, a
    reply after it is dropped; and user space's writes (add_flows) are seen at once."""
    m = progs.maps
    run = progs.xdp if hook == "xdp" else progs.tc_ingress
    pod, remote, pod_port, remote_port = A(POD_FILT), A(CLIENT), 34777, 5353
    flow = Flow(pod, remote, pod_port, remote_port, 17)
    key = layout.Flow4Key(be32(pod), be32(remote), be16(pod_port), be16(remote_port), 17)
    out = bytes(eth() / IP(src=POD_FILT, dst=CLIENT) / UDP(sport=pod_port, dport=remote_port))
    reply = bytes(eth() / IP(src=CLIENT, dst=LB_FILT) / UDP(sport=remote_port, dport=pod_port))
    timeouts = m.flow_timeouts()
    with one_cpu():
        try:
            with contextlib.suppress(bpfsys.BpfError):  # another case's
                bpfsys.map_delete(m.fds["flow4"], key)
            m.forget_seen()
            assert run(reply)[0] == XDP_DROP
            assert progs.tc(out)[0] == TC_NEXT  # the pod opens the flow
            assert run(reply)[0] == XDP_PASS  # looked up, now in the slot
            bpfsys.map_delete(m.fds["flow4"], key)
            assert run(reply)[0] == XDP_PASS  # the slot vouches for it
            age_flows(m, 150_000_000)  # past CZ_SEEN_NS
            assert run(reply)[0] == XDP_DROP
            # an entry user space writes, expired: seen at once. Expired by a second past a UDP
            # timeout of one: a fixed age of minutes is no time at all on a machine up for
            # less (a guest of the kernel matrix), where the subtraction went below zero
            m.set_flow_timeouts(1, 30, 432000, 10)
            assert progs.tc(out)[0] == TC_NEXT
            assert run(reply)[0] == XDP_PASS
            m.add_flows([flow], last_seen_ns=coarse_now_ns() - 2 * 10**9)
            assert run(reply)[0] == XDP_DROP
            # a UDP timeout shorter than the window: the slot's time is checked against it
            m.set_flow_timeouts(0.05, 30, 432000, 10)
            m.forget_seen()
            assert progs.tc(out)[0] == TC_NEXT
            assert run(reply)[0] == XDP_PASS
            age_flows(m, 70_000_000)  # within CZ_SEEN_NS, past the UDP timeout
            assert run(reply)[0] == XDP_DROP
        finally:
            t = timeouts
            m.set_flow_timeouts(t["udp"], t["icmp"], t["tcp"], t["tcp_closing"])


LB6_C, POD6_C = "2001:db8:10::10", "fd00:10:244::20"
REMOTE6_C = "2001:db8:20::1"


@pytest.fixture
def with_ipv6(progs: Progs) -> Iterator[None]:
    """A whole-IP IPv6 Service beside the module's IPv4 ones, for one test."""
    before = progs.maps.read_state()
    state = before.copy()
    state.services[IPv6Address(LB6_C)] = ServiceEntry(IPv6Address(POD6_C), False, False)
    state.pods[IPv6Address(POD6_C)] = PodEntry(IPv6Address(LB6_C), False, False)
    progs.maps.apply(diff(before, state))
    yield
    progs.maps.apply(diff(progs.maps.read_state(), before))


@pytest.mark.parametrize(
    "program,frame,rewritten",
    [
        ("ingress_tc", IP(src=CLIENT, dst=LB_WHOLE) / TCP(sport=1000, dport=22), POD_WHOLE),
        ("ingress_tc", IP(src=CLIENT, dst=LB_WHOLE) / UDP(sport=1000, dport=53), POD_WHOLE),
        ("ingress_tc", IPv6(src=REMOTE6_C, dst=LB6_C) / TCP(sport=1000, dport=22), POD6_C),
        ("ingress_tc", IPv6(src=REMOTE6_C, dst=LB6_C) / UDP(sport=1000, dport=53), POD6_C),
        ("ingress_tc", IPv6(src=REMOTE6_C, dst=LB6_C) / ICMPv6EchoRequest(id=7), POD6_C),
        ("egress", IP(src=POD_WHOLE, dst=CLIENT) / TCP(sport=22, dport=1000), LB_WHOLE),
        ("egress", IPv6(src=POD6_C, dst=REMOTE6_C) / TCP(sport=22, dport=1000), LB6_C),
        ("egress", IPv6(src=POD6_C, dst=REMOTE6_C) / UDP(sport=53, dport=1000), LB6_C),
        ("egress", IPv6(src=POD6_C, dst=REMOTE6_C) / ICMPv6EchoReply(id=7), LB6_C),
        # the full paths (a VLAN tag), and a packet with no L4 checksum to follow the address
        (
            "ingress_tc",
            Dot1Q(vlan=5) / IPv6(src=REMOTE6_C, dst=LB6_C) / UDP(sport=1000, dport=53),
            POD6_C,
        ),
        ("egress", Dot1Q(vlan=5) / IPv6(src=POD6_C, dst=REMOTE6_C) / TCP(sport=22), LB6_C),
        (
            "ingress_tc",
            IPv6(src=REMOTE6_C, dst=LB6_C)
            / IPv6ExtHdrFragment(offset=100, id=9, nh=17)
            / Raw(b"x" * 64),
            POD6_C,
        ),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_tc_rewrites_keep_checksum_complete_skbs_right(
    progs: Progs, with_ipv6: None, program: str, frame: Packet, rewritten: str
) -> None:
    """An skb a NIC checksummed whole (CHECKSUM_COMPLETE: skb->csum is the sum of the packet)
    keeps a skb->csum that matches the packet after the rewrite; else the stack reports "hw
    csum failure" and checks every such packet again in software. The kernel's test run checks
    skb->csum after the program (EBADMSG when it disagrees)."""
    fd = progs.ingress_tc if program == "ingress_tc" else progs.egress
    data = bytes(eth() / frame)
    r = bpfsys.prog_test_run(fd, data, flags=bpfsys.BPF_F_TEST_SKB_CHECKSUM_COMPLETE)
    assert r.retval == TC_NEXT
    out = Ether(r.data)
    l3 = out[IPv6] if IPv6 in out else out[IP]
    assert (l3.dst if program == "ingress_tc" else l3.src) == rewritten
    if IP in out:
        assert checksums_ok(r.data) == []
    elif TCP in out or UDP in out or ICMPv6EchoRequest in out or ICMPv6EchoReply in out:
        # the L4 checksum as scapy computes it for the rewritten packet
        field = "chksum" if TCP in out or UDP in out else "cksum"  # ICMPv6
        again = l3.copy()
        delattr(again.payload, field)
        assert getattr(l3.payload, field) == getattr(IPv6(bytes(again)).payload, field)


def test_egress_trusts_the_address_hint(progs: Progs) -> None:
    """rolehint (bpf/lib/types.h): an address whose bit is clear is in no addr4 entry, and the
    egress program lets its packet go without a lookup. Clearing a managed pod's bit by hand
    (which user space never does while the pod is in addr4) shows the program reads it: the
    pod's packet then leaves untranslated; with the bit back, translated again."""
    from ipaddress import IPv4Address

    spec = progs.maps.layout.rolehint
    bit = layout.addr_hint_bit(IPv4Address(POD_WHOLE).packed, progs.maps.layout.role_hint_log2)
    key = (bit >> 6).to_bytes(4, "little")  # in the pod IPs' half, the first
    frame = bytes(
        Ether(src=MAC_A, dst=MAC_B) / IP(src=POD_WHOLE, dst=CLIENT) / UDP(sport=5, dport=6) / b"h"
    )
    word = progs.maps._lookup(spec, key)
    assert word is not None and int.from_bytes(word, "little") >> (bit & 63) & 1
    assert IP(progs.tc(frame)[1][14:]).src == LB_WHOLE
    cleared = int.from_bytes(word, "little") & ~(1 << (bit & 63))
    progs.maps._update_batch(spec, [key], [cleared.to_bytes(8, "little")])
    try:
        ret, out = progs.tc(frame)
        assert ret == TC_NEXT and out == frame, "translated without its hint bit"
    finally:
        progs.maps._update_batch(spec, [key], [word])
    assert IP(progs.tc(frame)[1][14:]).src == LB_WHOLE


@pytest.mark.parametrize(
    "name", ["cz_ingress", "cz_ingress_tc", "cz_egress", "cz_egress_to_lb", "cz_ingress_tc6"]
)
def test_a_missing_full_path_drops_and_counts(progs: Progs, name: str) -> None:
    """A tail call that fails (its slot emptied, as only a hand or a bug could: the loader fills
    it before it returns the entry program) drops the frame the fast path left to the full path,
    whole and untranslated, and counts it as drop_missed_tail_call and nothing else (it let the
    frame through untranslated and uncounted before issue 37); a running monitor gets the event,
    and explain's dry run the reason without a count. The slot refilled, the same frame is the
    full path's again. The same for a rare path (cz_egress_to_lb: the node's own packet to an LB
    IP, which the egress entry hands on untagged; explain's tagged frames go to the full path;
    cz_ingress_tc6: tc ingress's IPv6, which its entry hands on)."""
    from cozyebpf.explain import dry_run
    from cozyebpf.monitor import RingBuffer

    rare = name in ("cz_egress_to_lb", "cz_ingress_tc6")
    entry = {"cz_egress_to_lb": "cz_egress", "cz_ingress_tc6": "cz_ingress_tc"}.get(name, name)
    prog = next(p for p in progs.loaded if p.name == entry)
    xdp = name == "cz_ingress"
    more = {m[0]: m for m in loader.MORE_PATHS.get(entry, ())}
    slow, array, slot = more[name] if rare else loader.SLOW_PATHS[name]
    fd = progs.maps.fds[array.removeprefix("cz_")]
    if name == "cz_egress":
        ip = IP(src=POD_WHOLE, dst=CLIENT) / UDP(sport=4000, dport=53) / b"x"
    elif name == "cz_ingress_tc6":
        ip = IPv6(src="2001:db8:1::2", dst="2001:db8:2::10") / UDP(sport=4000, dport=53) / b"x"
    else:  # (from no pod IP to an LB IP: the egress entry's rare path)
        ip = IP(src=CLIENT, dst=LB_WHOLE) / UDP(sport=4000, dport=53) / b"x"
    eth_ = Ether(src=MAC_A, dst=MAC_B)
    frame = bytes(eth_ / ip if rare else eth_ / Dot1Q(vlan=0) / ip)  # tagged: the full path's
    drop, full = (XDP_DROP, XDP_PASS) if xdp else (TC_SHOT, TC_NEXT)
    m = progs.maps
    ring = RingBuffer(m.fds[m.layout.events.name], m.layout.events.max_entries)
    ring.skip()
    before = {k: v["packets"] for k, v in m.counters().items()}
    try:
        assert bpfsys.map_delete(fd, ctypes.c_uint32(slot))
        m.set_monitor(layout.MON_DROPS, 1, 10**15)
        r = bpfsys.prog_test_run(prog.fd, frame)
        m.set_monitor(layout.MON_OFF)
        records = [layout.CzEvent.from_buffer_copy(raw) for raw in ring.records()]
        after = {k: v["packets"] for k, v in m.counters().items()}
        dry = None if rare else dry_run(m, prog.fd, xdp, bytes(ip))
        dried = {k: v["packets"] for k, v in m.counters().items()}
    finally:
        m.set_monitor(layout.MON_OFF)
        ring.close()
        refill = loader.slow_program_fd(prog, slow)
        assert refill is not None
        bpfsys.map_update(fd, ctypes.c_uint32(slot), ctypes.c_uint32(refill))
    assert (r.retval, r.data) == (drop, frame)
    changed = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert changed == {"drop_missed_tail_call": 1}
    assert [(REASONS[e.reason], e.len, e.dir) for e in records] == [
        ("drop_missed_tail_call", len(frame), int(entry == "cz_egress"))
    ]
    if dry is not None:
        assert dry.drop and dry.result is not None
        assert REASONS[dry.result.reason] == "drop_missed_tail_call"
    assert dried == after
    again = bpfsys.prog_test_run(prog.fd, frame)
    assert again.retval == full, "the refilled slot's full path did not take the frame"
    assert {k: v["packets"] for k, v in m.counters().items()}["drop_missed_tail_call"] == (
        after["drop_missed_tail_call"]
    )


def test_a_missing_host_route_leaves_the_translated_frame_to_the_stack(progs: Progs) -> None:
    """With host routing on, the tc ingress entry hands what it let in to cz_ingress_tc_route
    (tail_rare, CZ_RARE_ROUTE_IN). The frame is decided, counted and translated before that: a
    tail call that fails (the slot emptied) leaves it to the stack as it is (TCX_NEXT, the pod
    IP as destination), counted once as translated and never as drop_missed_tail_call."""
    slow, array, slot = next(
        m for m in loader.MORE_PATHS["cz_ingress_tc"] if m[0] == "cz_ingress_tc_route"
    )
    prog = next(p for p in progs.loaded if p.name == "cz_ingress_tc")
    fd = progs.maps.fds[array.removeprefix("cz_")]
    frame = eth() / IP(src=CLIENT, dst=LB_WHOLE) / UDP(sport=4000, dport=53) / b"x"
    m = progs.maps
    before = {k: v["packets"] for k, v in m.counters().items()}
    try:
        m.set_node([1], False, True)
        assert bpfsys.map_delete(fd, ctypes.c_uint32(slot))
        r = bpfsys.prog_test_run(prog.fd, bytes(frame))
    finally:
        m.set_node([], False, False)
        refill = loader.slow_program_fd(prog, slow)
        assert refill is not None
        bpfsys.map_update(fd, ctypes.c_uint32(slot), ctypes.c_uint32(refill))
    after = {k: v["packets"] for k, v in m.counters().items()}
    assert r.retval == TC_NEXT
    assert IP(r.data[14:]).dst == POD_WHOLE and checksums_ok(r.data) == []
    changed = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert changed == {"nat_ingress": 1}
