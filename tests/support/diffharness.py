"""The differential test's harness (tests/datapath/test_differential.py): the three programs
loaded with their pinned maps (seed a RefState, run a frame, read the tables and counters back)
and the comparison of each run with the reference model, reported with scapy and a hexdump
when they differ.

The clock. The programs read the clock of the Services' buckets themselves (the coarse one, or
jiffies times the tick's length: a clock that steps with CLOCK_MONOTONIC_COARSE at each tick,
at an offset), so each run is bracketed by two readings of CLOCK_MONOTONIC_COARSE, [lo, hi]
(usually within one tick: lo == hi), moved onto the buckets' clock by the offset that the
harness measures with the programs themselves after each clear (`Datapath.calibrate`: a probe
Service's new bucket starts at the program's `now`), give or take CLOCK_SLACK_NS, and a tick
more at each end (TICK_NS: the two clocks step at each tick, not at once). The model
answers for that window (`answers`): a bucket only admits more as the clock moves and its new
time only grows with it, so the window holds at most two stretches of one verdict each, refused
up to a boundary and admitted from it (found by bisection). The program's verdict must be one
stretch's (either, when the boundary falls inside the window), its output bytes and counters
exactly that stretch's, and each bucket time it leaves between the stretch's answers at its two
ends (exact for a busy bucket, whose time moves by the frame's cost; an idle one starts at the
program's own `now`). The model then takes the kernel's bucket times, so that the next frame
starts from the same ones. An ingress frame runs through XDP and then tc ingress, each against
the same buckets: the XDP run's charge is undone (the buckets written back) before the tc run.

Shaped egress (the model's `shaped`, flowcfg's CZ_CFG_SHAPED) reads CLOCK_MONOTONIC
(bpf_ktime_get_ns), which user space reads too: a shaped egress run's window is two readings of
time.monotonic_ns() around it (MONO_SLACK_NS either side), no offset. There the decision may
change twice inside the window (refused beyond the horizon, then the busy shaper's departure
time, then the idle one's: the frame's own skb->tstamp); the departure time is part of the
decision, and the program's skb->tstamp (read back from the context, BPF_PROG_RUN's ctx_out)
must be its stretch's. The tc programs run with a full struct __sk_buff as their context
(`Skb`): the device the frame entered by, skb->tstamp, and a GSO packet's wire_len and
gso_segs.
"""

from __future__ import annotations

import ctypes
import functools
import socket
import struct
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from ipaddress import IPv4Address, ip_network
from typing import Any

import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from cozyebpf.datapath import bpfsys, kernel, layout, loader
from cozyebpf.datapath.buckets import limit_clock_ns
from cozyebpf.datapath.layout import FLOW4, FLOW6, FRAG4, FRAG6, MapSpec
from cozyebpf.datapath.maps import Flow, PinnedMaps, coarse_now_ns, possible_cpus
from cozyebpf.datapath.reasons import EVENT_REASONS, REASONS, SVC_DROP_REASONS
from cozyebpf.state import (
    AllowedPort,
    Limits,
    MapState,
    PodEntry,
    Proto,
    ServiceEntry,
    diff,
)
from cozylab.netns import in_netns, run
from tests.support import refmodel as rm
from tests.support.refmodel import (
    ALLOW_ICMP,
    LEARN,
    LIMIT,
    PORT_FILTER,
    Addr,
    FlowKey,
    FlowVal,
    FragKey,
    RefState,
    Result,
    Tats,
    ToLb,
)

# -- the programs ------------------------------------------------------------------------------


def _be32_int(n: int) -> int:
    """The c_uint32 whose memory holds `n` in network byte order."""
    return int.from_bytes(n.to_bytes(4, "big"), sys.byteorder)


def _addr(ip: Addr) -> int | layout.Ip6:
    return layout.be32(ip) if isinstance(ip, IPv4Address) else layout.ip6(ip)


def _addr_of(v: int | layout.Ip6) -> Addr:
    return layout.ip_of(v) if isinstance(v, int) else layout.ip6_of(v)


def _entry(addr: Addr, flags: int, service: str) -> tuple[Addr, bool, bool, str, bool, bool]:
    """ServiceEntry/PodEntry arguments of a model entry's address, flags and Service."""
    pf, icmp = bool(flags & PORT_FILTER), bool(flags & ALLOW_ICMP)
    return addr, pf, icmp, service, bool(flags & LEARN), bool(flags & LIMIT)


def map_state(state: RefState) -> MapState:
    """The model's svc, pod and allow tables and limits as the control plane's MapState
    (PinnedMaps encodes it into addr4/addr6, allow4/allow6 and limits, as the agent does)."""
    return MapState(
        {lb: ServiceEntry(*_entry(s.pod_ip, s.flags, s.service)) for lb, s in state.svc.items()},
        {p: PodEntry(*_entry(e.lb_ip, e.flags, e.service)) for p, e in state.pod.items()},
        {AllowedPort(a.pod_ip, Proto(a.proto), a.port) for a in state.allow},
        dict(state.ranges),
        dict(state.limits),
    )


def services(state: RefState) -> set[str]:
    """The Services the model's entries name (each has a slot: counters, limits, buckets)."""
    named = {s.service for s in state.svc.values()} | {p.service for p in state.pod.values()}
    return named - {""}


#: the probe of the buckets' clock (Datapath.calibrate): a limited Service no frame of the
#: differential test meets, its new packet bucket charged 1 us by a packet
PROBE_SVC, PROBE_LB, PROBE_POD = "diff/clock-probe", "192.0.2.250", "192.0.2.251"
PROBE_LIMITS = Limits(ingress_pps=1_000_000)
#: how far the buckets' clock may wander from the offset measured (the jiffies clock wobbles by
#: some hundred ns against the coarse one; the coarse clock against itself by nothing)
CLOCK_SLACK_NS = 20_000
#: and a tick more at the window's end: the kernel moves jiffies on before the coarse clock in
#: the same tick (tick_do_update_jiffies64, then the timekeeper), so a program can read the next
#: tick's jiffies while user space still reads the last tick's coarse time (a CI run met it: the
#: program's `now` one tick past the window); and a tick more at its start (a CI run under load
#: met tc ingress's `now` one tick before the window, the XDP run before it inside): the
#: calibration's probes can meet that moment too, and under a late tick the two clocks, which
#: count ticks by different arithmetic, may step in the other order
TICK_NS = 1_000_000_000 // (kernel.hz() or 100)
#: shaped egress's clock is CLOCK_MONOTONIC (bpf_ktime_get_ns), which user space reads too
#: (time.monotonic_ns): a run's window is its two readings, give or take this (the kernel's
#: fast accessor and the vDSO read the same timekeeper; the slack only guards their rounding)
MONO_SLACK_NS = 1_000


@functools.cache
def _probe_frame() -> bytes:
    """UDP from a remote to the probe's LB IP."""
    eth = Ether(src="02:00:00:00:00:aa", dst="02:00:00:00:00:bb")
    return bytes(eth / IP(src="198.51.100.1", dst=PROBE_LB) / UDP(sport=1, dport=2))


def probe_state() -> MapState:
    """The probe's entry and limits, which the maps hold between examples too."""
    lb, pod = IPv4Address(PROBE_LB), IPv4Address(PROBE_POD)
    st = MapState()
    st.services[lb] = ServiceEntry(pod, False, False, PROBE_SVC, limited=True)
    st.limits[PROBE_SVC] = PROBE_LIMITS
    return st


@dataclass(frozen=True)
class ToLbNet:
    """A network namespace whose routes are the model's FIB of the node's packets to LB IPs
    (refmodel.ToLb): the uplink (a veth, the node's addresses on it, the default route by it)
    and a pod-facing device (a veth, the pods' prefix routed to it, its MTU the model's)."""

    name: str
    uplink: int  # the uplink's ifindex there


@contextmanager
def to_lb_netns(name: str, fib: ToLb) -> Iterator[ToLbNet]:
    """The namespace of ToLbNet, removed on exit."""
    ip = ("ip", "-n", name)
    run("ip", "netns", "add", name)
    try:
        run(*ip, "link", "set", "lo", "up")
        run(*ip, "link", "add", "up0", "type", "veth", "peer", "name", "up1")
        mtu = str(fib.pod_mtu)
        run(
            *ip,
            "link",
            "add",
            "pod0",
            "mtu",
            mtu,
            "type",
            "veth",
            "peer",
            "name",
            "pod1",
            "mtu",
            mtu,
        )
        for dev in ("up0", "up1", "pod0", "pod1"):
            run(*ip, "link", "set", dev, "up")
        for addr in sorted(fib.node_ips):
            run(*ip, "addr", "add", f"{addr}/24", "dev", "up0")
        run(*ip, "route", "add", str(fib.pod_net), "dev", "pod0")
        gateway = ip_network(f"{min(fib.node_ips)}/24", strict=False).broadcast_address - 1
        run(*ip, "route", "add", "default", "via", str(gateway), "dev", "up0")
        run("ip", "netns", "exec", name, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        yield ToLbNet(name, in_netns(name, lambda: socket.if_nametoindex("up0")))
    finally:
        run("ip", "netns", "del", name, check=False)


class Datapath:
    """The three loaded programs and their pinned maps: seed, run, read back."""

    RAW_MAPS = (FLOW4, FRAG4, FLOW6, FRAG6)  # the tables the programs write

    def __init__(
        self, maps: PinnedMaps, progs: dict[str, loader.Program], net: ToLbNet | None = None
    ) -> None:
        self.maps = maps
        #: the namespace the egress program runs in, for the node's packets to LB IPs (to_lb4
        #: asks its FIB); None: the test's own, and the cluster paths off
        self.net = net
        self.progs = progs
        self.fds = {name: p.fd for name, p in progs.items()}
        self.frames = 0  # checked against the model
        self.runs = 0  # program runs
        #: what the runs met of the limits: "<prog> refused", "charged", "boundary" (a window
        #: in which the model's verdict changes), "ticked" (a window of more than one tick)
        self.met: Counter[str] = Counter()
        #: the buckets' clock minus CLOCK_MONOTONIC_COARSE: its least and greatest (calibrate)
        self.offset = (0, 0)

    def _fd(self, spec: MapSpec) -> int:
        return self.maps.fds[spec.name]

    def clear(self) -> None:
        """Empty the maps (but for the clock's probe), and measure the buckets' clock."""
        self.maps.apply(diff(self.maps.read_state(), probe_state()))
        for spec in self.RAW_MAPS:
            for raw in bpfsys.map_keys(self._fd(spec), spec.key_size):
                bpfsys.map_delete(self._fd(spec), ctypes.create_string_buffer(raw, len(raw)))
        self.maps.forget_seen()
        self.maps.set_shaped(False)
        self.calibrate()

    def calibrate(self) -> None:
        """Measure the offset of the buckets' clock from CLOCK_MONOTONIC_COARSE with the XDP
        program: a new bucket starts at the program's `now`, so the probe's time less its cost
        is that `now`, read within one tick of the coarse clock (two runs that agree on it).
        Without an XDP program loaded (tests of the egress programs alone), the clock as user
        space reads it (limit_clock_ns), within a tick: such tests limit nothing."""
        if "xdp" not in self.fds:
            ours = limit_clock_ns()
            assert ours is not None, "the buckets' clock cannot be read (run as root)"
            offset = ours - coarse_now_ns()
            self.offset = (offset - 10**7, offset + 10**7)
            return
        frame, cost = _probe_frame(), rm.limit_buckets(PROBE_LIMITS)[1]
        assert cost is not None
        points: list[int] = []
        for _ in range(50):
            self.set_buckets(PROBE_SVC, Tats())
            lo = coarse_now_ns()
            code, _ = self.run("xdp", frame)
            hi = coarse_now_ns()
            assert code == rm.XDP_PASS, f"the clock's probe: XDP verdict {code}"
            if lo == hi:
                points.append(self.buckets(PROBE_SVC).in_pkts - cost.cost_ns(1) - lo)
                if len(points) == 2:
                    break
        assert points, "the buckets' clock: no probe ran within one tick of the coarse clock"
        self.offset = (min(points) - CLOCK_SLACK_NS, max(points) + CLOCK_SLACK_NS)

    def limit_now(self) -> int:
        """Now on the buckets' clock (to seed them), as calibrated."""
        return coarse_now_ns() + sum(self.offset) // 2

    def seed(self, state: RefState, now_ns: int) -> None:
        st = map_state(state)
        st.services.update(probe_state().services)
        st.limits.update(probe_state().limits)
        self.maps.apply(diff(probe_state(), st))
        self.maps.set_shaped(state.shaped)
        if self.net is not None:  # the cluster paths (to_lb4) on where the model's FIB is
            self.maps.set_node([self.net.uplink], state.to_lb is not None)
        for pod_ip, dev in state.dev.items():  # the programs' cache: user space writes 0
            if pod_ip in state.pod:
                self.set_dev(pod_ip, dev)
        for f in state.flow:
            v = state.flow_val.get(f, FlowVal(now_ns))
            self.maps.add_flows([Flow(*f)], v.seen_ns, v.closing)
        for service in services(state):  # the buckets: the model's (0: new, full)
            self.set_buckets(service, state.buckets.get(service, Tats()))
        for k, v in state.frag.items():
            if k.pod_ip.version == 4:
                gkey: ctypes.Structure = layout.Frag4Key(
                    _addr(k.remote_ip), _addr(k.pod_ip), layout.be16(k.id), k.proto
                )
            else:
                gkey = layout.Frag6Key(
                    _addr(k.remote_ip), _addr(k.pod_ip), _be32_int(k.id), k.proto
                )
            bpfsys.map_update(
                self._fd(FRAG4 if k.pod_ip.version == 4 else FRAG6), gkey, layout.FragVal(*v)
            )

    def _addr_val(self, ip: Addr) -> tuple[int, ctypes.Array[ctypes.c_char], Any]:
        fd = self.maps.fds["addr4" if ip.version == 4 else "addr6"]
        val = layout.Addr4Val() if ip.version == 4 else layout.Addr6Val()
        key = ctypes.create_string_buffer(ip.packed, len(ip.packed))
        assert bpfsys.map_lookup(fd, key, val), f"no addr value for {ip}"
        return fd, key, val

    def dev(self, ip: Addr) -> int:
        """The `dev` of the addr value of `ip`: the device the programs cached for the pod."""
        return int(self._addr_val(ip)[2].dev)

    def set_dev(self, ip: Addr, dev: int) -> None:
        """Write the programs' cache of the pod `ip` into its addr value, as they would."""
        fd, key, val = self._addr_val(ip)
        val.dev = dev
        bpfsys.map_update(fd, key, val)

    def _slot(self, service: str) -> ctypes.c_uint32:
        slot = self.maps.slots.slot(service)
        assert slot, f"the Service {service} has no slot"
        return ctypes.c_uint32(slot)

    def buckets(self, service: str) -> Tats:
        """The times of the Service's buckets, as the programs left them."""
        v = layout.BucketVal()
        assert bpfsys.map_lookup(self.maps.fds["buckets"], self._slot(service), v)
        return Tats(int(v.in_bytes), int(v.in_pkts), int(v.out_bytes), int(v.out_edt))

    def set_buckets(self, service: str, tats: Tats) -> None:
        v = layout.BucketVal(
            in_bytes=tats.in_bytes,
            in_pkts=tats.in_pkts,
            out_bytes=tats.out_bytes,
            out_edt=tats.out_edt,
        )
        bpfsys.map_update(self.maps.fds["buckets"], self._slot(service), v)

    def flows(self) -> dict[FlowKey, bool]:
        """The flows, and whether each is closing."""
        return {FlowKey(*e.flow): e.closing for e in self.maps.flow_entries()}

    def frags(self) -> dict[FragKey, bool]:
        out = {}
        for spec in (FRAG4, FRAG6):
            fd = self._fd(spec)
            for raw in bpfsys.map_keys(fd, spec.key_size):
                k: Any = spec.key.from_buffer_copy(raw)
                val = layout.FragVal()
                if not bpfsys.map_lookup(fd, k, val):
                    continue
                ident = layout.port_of(k.id) if spec is FRAG4 else _be32_int(k.id)
                key = FragKey(_addr_of(k.remote_ip), _addr_of(k.pod_ip), ident, k.proto)
                out[key] = bool(val.passed)
        return out

    def counters(self) -> dict[str, tuple[int, int]]:
        """(packets, bytes) per reason, summed over CPUs: what `maps.counters()` reads, in one
        batch lookup of the per-CPU array (read after every program run: the lookup per reason
        and CPU was most of the test's time)."""
        ncpu, stride = possible_cpus(), ctypes.sizeof(layout.StatVal)
        items = bpfsys.map_items_batch(
            self.maps.fds["stats"], 4, stride * ncpu, chunk=layout.STATS_MAX + 1
        )
        out = {}
        for key, value in items:
            idx = int.from_bytes(key, sys.byteorder)
            if idx < len(REASONS):
                per_cpu = list(struct.iter_unpack("=QQ", value))
                out[REASONS[idx]] = (sum(v[0] for v in per_cpu), sum(v[1] for v in per_cpu))
        return out

    @functools.cached_property
    def _svc0(self) -> tuple[int, ctypes.Array[ctypes.c_char], struct.Struct, int]:
        ncpu = possible_cpus()
        size = ctypes.sizeof(layout.SvcStat)
        return ncpu, ctypes.create_string_buffer(size * ncpu), struct.Struct(f"={size // 8}Q"), size

    def svc_stats(self, service: str) -> tuple[int, ...]:
        """The Service's counters in svcstats (slot 0 for "": the Services the seeds leave
        unnamed); in_packets, in_bytes, out_packets, out_bytes, drops[]."""
        ncpu, buf, fmt, size = self._svc0
        slot = self._slot(service) if service else ctypes.c_uint32(0)
        assert bpfsys.map_lookup(self.maps.fds["svcstats"], slot, buf)
        raw = buf.raw
        per_cpu = [fmt.unpack_from(raw, c * size) for c in range(ncpu)]
        return tuple(sum(col) for col in zip(*per_cpu, strict=True))

    def run(self, prog: str, frame: bytes, in_dev: int = 0) -> tuple[int, bytes]:
        """Run `prog` on `frame`; a tc program's frame as if it entered by device `in_dev`."""
        r = bpfsys.prog_test_run(self.fds[prog], frame, ctx=skb_ctx(in_dev) if in_dev else None)
        self.runs += 1
        return r.retval, r.data

    def run_skb(self, prog: str, frame: bytes, skb: Skb) -> tuple[int, bytes, int]:
        """Run the tc program `prog` on `frame` as the skb `skb` says: (verdict, output,
        skb->tstamp as the program left it)."""
        if prog == "egress" and self.net is not None:  # as the uplink's: its FIB, its ifindex
            net, fd = self.net, self.fds[prog]
            ctx = replace(skb, ifindex=net.uplink).ctx()
            r = in_netns(
                net.name, lambda: bpfsys.prog_test_run(fd, frame, ctx=ctx, ctx_out=SKB_SIZE)
            )
        else:
            r = bpfsys.prog_test_run(self.fds[prog], frame, ctx=skb.ctx(), ctx_out=SKB_SIZE)
        self.runs += 1
        return r.retval, r.data, int(SKB_U64.unpack_from(r.ctx, SKB_TSTAMP)[0])


#: struct __sk_buff up to and including ingress_ifindex (offset 36, linux/bpf.h): the context
#: BPF_PROG_RUN takes, shorter than the struct (the rest is zero)
SKB_CTX = struct.Struct("=9II")
#: the whole struct __sk_buff (what ctx_out must be), and its fields that the limits read:
#: tstamp (u64), wire_len and gso_segs (u32 each, in a row); and ifindex (the device the
#: program runs on: BPF_PROG_RUN takes it from the test's namespace)
SKB_SIZE, SKB_TSTAMP, SKB_WIRE_LEN, SKB_IFINDEX = 192, 152, 160, 40
SKB_U64, SKB_GSO = struct.Struct("=Q"), struct.Struct("=II")


def skb_ctx(ingress_ifindex: int) -> bytes:
    """A tc program's context for BPF_PROG_RUN: the device the frame entered the node by."""
    return SKB_CTX.pack(*(0,) * 9, ingress_ifindex)


@dataclass(frozen=True)
class Skb:
    """What a tc program's skb carries besides the frame, as BPF_PROG_RUN's context sets it:
    the device it entered the node by (0: the node sent it), the qdisc layer's length
    (`wire_len`; 0: the frame's -- the kernel refuses a smaller one, EINVAL), a GSO packet's
    segments (`gso_segs`; its gso_size stays 0), and skb->tstamp as it comes."""

    in_dev: int = 0
    wire_len: int = 0
    gso_segs: int = 0
    tstamp: int = 0
    ifindex: int = 0  # the device the program runs on (0: the namespace's loopback)

    def ctx(self) -> bytes:
        out = bytearray(SKB_SIZE)
        out[: SKB_CTX.size] = skb_ctx(self.in_dev)
        struct.pack_into("=I", out, SKB_IFINDEX, self.ifindex)
        SKB_U64.pack_into(out, SKB_TSTAMP, self.tstamp)
        SKB_GSO.pack_into(out, SKB_WIRE_LEN, self.wire_len, self.gso_segs)
        return bytes(out)


PROGRAMS = {  # name -> (source, function, program type)
    "xdp": ("ingress.c", "cz_ingress", "xdp"),
    "tc-ingress": ("ingress_tc.c", "cz_ingress_tc", "sched_cls"),
    "egress": ("egress.c", "cz_egress", "sched_cls"),
}


# -- comparing -----------------------------------------------------------------------------


def _delta(
    after: dict[str, tuple[int, int]], before: dict[str, tuple[int, int]]
) -> dict[str, tuple[int, int]]:
    out = {}
    for r in REASONS:
        a, b = after.get(r, (0, 0)), before.get(r, (0, 0))
        if a != b:
            out[r] = (a[0] - b[0], a[1] - b[1])
    return out


def scapy_command(frame: bytes) -> str:
    try:
        return str(Ether(frame).command())
    except Exception:  # scapy cannot dissect every malformed frame
        return f"Ether(bytes.fromhex('{frame.hex()}'))"


def hexdump(data: bytes, marks: set[int]) -> str:
    """16 bytes a line; bytes at `marks` are bracketed."""
    lines = []
    for off in range(0, len(data), 16):
        cells = [
            f"[{b:02x}]" if off + i in marks else f" {b:02x} "
            for i, b in enumerate(data[off : off + 16])
        ]
        lines.append(f"  {off:04x} {''.join(cells)}")
    return "\n".join(lines)


def describe_state(state: RefState) -> str:
    def fmt(xs: object) -> str:
        return repr(xs).replace("IPv4Address", "A").replace("IPv6Address", "A")

    return "\n".join(
        f"  {name}: {fmt(getattr(state, name))}"
        for name in (
            "svc", "pod", "allow", "flow", "frag", "ranges", "flow_val", "dev", "limits",
            "buckets",
        )
    )  # fmt: skip


def mismatch(
    prog: str,
    frame: bytes,
    state: RefState,
    want: Result,
    want_code: int,
    got_code: int,
    got: bytes,
    got_counts: dict[str, tuple[int, int]],
    in_dev: int = 0,
    skb: Skb | None = None,
    got_tstamp: int | None = None,
) -> str | None:
    """None when the program did what the model says, else a report of the difference (a tc
    program's skb as given in `skb`, its skb->tstamp as it left it in `got_tstamp`)."""
    frame_ok = got == want.frame or got == want.limit_frame
    tstamp_ok = want.tstamp is None or got_tstamp is None or got_tstamp == want.tstamp
    if (got_code, got_counts) == (want_code, want.counts) and frame_ok and tstamp_ok:
        return None
    lines = [
        f"{prog}: the program and the model disagree",
        f"frame ({len(frame)} bytes, entered by device {in_dev}): {scapy_command(frame)}",
        f"  hex {frame.hex()}",
    ]
    if skb is not None and skb != Skb(in_dev):
        lines.append(f"  skb: {skb}")
    lines += [
        f"map state (before this frame; egress {'shaped' if state.shaped else 'policed'}):",
        describe_state(state),
        f"verdict: expected {want_code} ({want.verdict}), got {got_code}",
    ]
    if got_counts != want.counts:
        lines.append(f"counters: expected {want.counts}, got {got_counts}")
    if want.buckets or "drop_limit" in want.counts:
        lines.append(f"buckets moved: expected {want.buckets}")
    if not tstamp_ok:
        lines.append(f"skb->tstamp (the departure time): expected {want.tstamp}, got {got_tstamp}")
    if not frame_ok:
        n = max(len(got), len(want.frame))
        diff = {
            i for i in range(n) if i >= len(got) or i >= len(want.frame) or got[i] != want.frame[i]
        }
        translated = sorted(
            i for i in range(min(len(frame), len(want.frame))) if frame[i] != want.frame[i]
        )
        lines += [
            f"output differs at offsets {sorted(diff)} (the model changed offsets {translated})",
            f"expected ({len(want.frame)} bytes): {scapy_command(want.frame)}",
            hexdump(want.frame, diff),
            f"got ({len(got)} bytes): {scapy_command(got)}",
            hexdump(got, diff),
        ]
    return "\n".join(lines)


def tc_can_run(frame: bytes) -> bool:
    """BPF_PROG_RUN of a tc program refuses (EINVAL) a frame whose EtherType is IPv4 or IPv6
    with fewer bytes than the IP header after the Ethernet header; the model passes those
    untouched (too short for the key address) and XDP runs them."""
    ethertype = int.from_bytes(frame[12:14], "big")
    need = {rm.ETH_IPV4: 20, rm.ETH_IPV6: 40}.get(ethertype, 0)
    return len(frame) >= 14 + need


def per_service(counts: dict[str, tuple[int, int]], egress: bool) -> tuple[int, ...]:
    """What a frame's counts add to its Service's counters (svc_stat): the packets and bytes it
    accepted in its direction, or its drops by reason; flow-table events are not packets."""
    out = [0] * (4 + layout.SVC_DROPS)
    for reason, (packets, nbytes) in counts.items():
        if reason in EVENT_REASONS:
            continue
        if reason in SVC_DROP_REASONS:
            out[4 + SVC_DROP_REASONS.index(reason)] += packets
        else:
            at = 2 if egress else 0
            out[at] += packets
            out[at + 1] += nbytes
    return tuple(out)


@dataclass(frozen=True)
class Stretch:
    """A part [start, end] of a run's clock window in which the model gives one verdict: its
    answers at both ends (they differ only in times that grow with the clock)."""

    start: int
    end: int
    first: Result
    last: Result


def _decision(r: Result) -> tuple[str, dict[str, tuple[int, int]], int | None]:
    return r.verdict, r.counts, r.tstamp


def answers(model: Callable[[int], Result], lo: int, hi: int, first: Result) -> list[Stretch]:
    """The model's answers (`model(now)`; `first`, its answer at `lo`) for a program that read
    the clock somewhere in [lo, hi]: one stretch, or more when the decision (the verdict, the
    counters, the departure time) changes inside the window. A bucket refuses up to a time and
    admits from it (the limits' verdict is monotone in the clock); a shaper refuses beyond its
    horizon, then gives its departure time while it is ahead of the clock, then leaves the
    frame's: each decision holds in one part of the window, and the boundaries are found by
    bisection."""
    if lo == hi or not first.clocked:  # no bucket met: the answer is the clock's at any time
        return [Stretch(lo, hi, first, first)]
    out: list[Stretch] = []
    start, at_start = lo, first
    while True:
        last = model(hi)
        if _decision(last) == _decision(at_start):
            return [*out, Stretch(start, hi, at_start, last)]
        assert len(out) < 3, f"the model's decisions over [{lo}, {hi}] are not monotone"
        a, b = start, hi  # the decision at a is at_start's, at b another
        while b - a > 1:
            m = (a + b) // 2
            if _decision(model(m)) == _decision(at_start):
                a = m
            else:
                b = m
        out.append(Stretch(start, a, at_start, model(a)))
        start, at_start = b, model(b)


def check_buckets(
    got: dict[str, Tats], before: dict[str, Tats], stretch: Stretch
) -> dict[str, tuple[Tats, Tats]]:
    """The Services whose bucket times are not where the stretch puts them: (got, lowest) for
    each. Each time must lie between the model's answers at the stretch's ends."""
    bad = {}
    for service, tats in got.items():
        low = stretch.first.buckets.get(service, before[service])
        high = stretch.last.buckets.get(service, before[service])
        if not all(a <= t <= b for a, t, b in zip(low, tats, high, strict=True)):
            bad[service] = (tats, low)
    return bad


def check_frame(
    dp: Datapath,
    state: RefState,
    frame: bytes,
    egress: bool,
    in_dev: int = 0,
    skb: Skb | None = None,
) -> Result:
    """Run `frame` through the program(s) of its direction (egress: as if it entered the node
    by device `in_dev`; the tc programs' skb as `skb` says besides); assert they match the
    model, that the counters of the frame's Service count it once, that the Services' buckets
    moved as the model says, with the clock the program read (see the module docstring), and
    that egress leaves the skb's departure time (skb->tstamp) where the model does. Returns the
    model's result with the buckets the kernel holds (not yet applied to `state`)."""
    dp.frames += 1
    skb = replace(skb or Skb(), in_dev=in_dev if egress else 0)
    now = 0  # the flows' clock (coarse), as it was read before the run
    # the clock of the run's limits: shaped egress's is CLOCK_MONOTONIC, the limits' else (the
    # node's packets to LB IPs are held to their ingress limits: to_lb4)
    mono = egress and state.shaped and not rm.is_to_lb(state, frame)

    def model(prog: str, t: int) -> Result:
        if egress:
            return rm.egress(
                state,
                frame,
                now,
                in_dev,
                t,
                mono_ns=t,
                wire_len=skb.wire_len,
                tstamp=skb.tstamp,
            )
        return rm.ingress(state, frame, now, t, 1 if prog == "xdp" else skb.gso_segs)

    if egress:
        runs = [("egress", rm.tc_code)]
    else:
        runs = [("xdp", rm.xdp_code), ("tc-ingress", rm.tc_code)]
    before_tats = {s: state.buckets.get(s, Tats()) for s in state.limits}
    tats = before_tats
    want: Result | None = None
    for prog, code_of in runs:
        if prog != "xdp" and not tc_can_run(frame):
            continue
        if tats != before_tats:  # the run before charged them: each program meets the same
            for service, t in before_tats.items():
                dp.set_buckets(service, t)
        now = coarse_now_ns()
        lo = time.monotonic_ns() - MONO_SLACK_NS if mono else now + dp.offset[0] - TICK_NS
        first = model(prog, lo)
        before, svc_before = dp.counters(), dp.svc_stats(first.service)
        got_tstamp: int | None = None
        if prog == "xdp":
            got_code, got = dp.run(prog, frame)
        else:
            got_code, got, got_tstamp = dp.run_skb(prog, frame, skb)
        if mono:
            hi = time.monotonic_ns() + MONO_SLACK_NS
        else:
            hi = coarse_now_ns() + dp.offset[1] + TICK_NS
        stretches = answers(functools.partial(model, prog), lo, hi, first)
        # the stretch of the verdict (and departure time) the program gave (the first, to
        # report, when none)
        same_code = [x for x in stretches if code_of(x.first.verdict) == got_code]
        chosen = next(
            (x for x in same_code if x.first.tstamp in (None, got_tstamp)),
            same_code[0] if same_code else stretches[0],
        )
        want = chosen.first
        code = code_of(want.verdict)
        problem = mismatch(
            prog,
            frame,
            state,
            want,
            code,
            got_code,
            got,
            _delta(dp.counters(), before),
            in_dev,
            skb if prog != "xdp" else None,
            got_tstamp,
        )
        if problem:
            clock = "CLOCK_MONOTONIC (shaped)" if mono else "the limits' clock"
            pytest.fail(
                f"{problem}\nclock window [{lo}, {hi}] of {clock}: {len(stretches)} decision(s)"
            )
        svc = tuple(a - b for a, b in zip(dp.svc_stats(want.service), svc_before, strict=True))
        outbound = egress and not want.inbound
        if svc != per_service(want.counts, outbound):
            pytest.fail(
                f"{prog}: per-Service counters of {want.service!r} (in packets, bytes, out "
                f"packets, bytes, drops {SVC_DROP_REASONS}) {svc}, want "
                f"{per_service(want.counts, outbound)} for {want.counts}\n"
                f"frame: {scapy_command(frame)}"
            )
        tats = {s: dp.buckets(s) for s in before_tats}
        bad = check_buckets(tats, before_tats, chosen)
        if bad:
            pytest.fail(
                f"{prog}: bucket times (in_bytes, in_pkts, out_bytes, out_edt) "
                + "; ".join(f"{s}: {got}, the model's {low}" for s, (got, low) in bad.items())
                + f"\nbefore: {before_tats}\nclock window [{lo}, {hi}] "
                f"({'CLOCK_MONOTONIC, shaped' if mono else 'the limits clock'}): model at its "
                f"ends {chosen.first.buckets} .. {chosen.last.buckets}\n"
                f"{want.counts} frame: {scapy_command(frame)}\n  skb: {skb}"
            )
        dp.met["boundary"] += len(stretches) > 1
        if not mono:
            dp.met["ticked"] += hi - lo > dp.offset[1] - dp.offset[0] + 2 * TICK_NS
        dp.met[f"{prog} refused"] += "drop_limit" in want.counts
        dp.met["charged"] += bool(want.buckets)
        _met_more(dp, state, prog, want, skb, lo, len(frame))
    if want is None:  # no program could run it (tc_can_run): what the model says of it
        now = coarse_now_ns()
        return model("xdp", time.monotonic_ns() if mono else now + dp.offset[0])
    moved = {s: t for s, t in tats.items() if t != before_tats[s]}
    return replace(want, buckets=moved)


def _met_more(
    dp: Datapath, state: RefState, prog: str, want: Result, skb: Skb, lo: int, length: int
) -> None:
    """What a run met of the shaper and of GSO packets (Datapath.met)."""
    met = bool(want.buckets) or "drop_limit" in want.counts
    if met and prog == "egress" and state.shaped:
        edt = state.buckets.get(want.service, Tats()).out_edt
        if "drop_limit" in want.counts:
            dp.met["shaped: beyond the horizon"] += 1
        else:
            dp.met["shaped: busy" if edt > lo else "shaped: idle"] += 1
        # from an LB IP: shaped untouched and uncounted, or dropped with no translation to undo
        if not want.counts or ("drop_limit" in want.counts and want.limit_frame is None):
            dp.met["shaped: from an LB IP"] += 1
    if met and prog == "egress" and skb.wire_len > length:
        dp.met["gso: egress charged wire_len"] += 1
    if met and prog == "tc-ingress" and skb.gso_segs > 1:
        dp.met["gso: tc ingress charged segments"] += 1
    if want.inbound:  # the node's packet to an LB IP (to_lb4)
        if want.verdict == rm.REDIRECT:
            dp.met["to-lb: frag-needed" if not want.counts else "to-lb: to the pod"] += 1
        else:
            dp.met[
                f"to-lb: {'refused by the limit' if 'drop_limit' in want.counts else 'dropped'}"
            ] += 1


def check_devs(dp: Datapath, state: RefState, context: str) -> None:
    """Each pod's addr value caches the device the model's does (0: none)."""
    got = {p: dp.dev(p) for p in state.pod}
    want = {p: state.dev.get(p, 0) for p in state.pod}
    if got != want:
        pytest.fail(f"{context}: the pods' cached devices {got}, the model's {want}")


def check_tables(dp: Datapath, state: RefState, context: str) -> None:
    """The kernel's flow and fragment tables hold what the model's do."""
    flows, frags = dp.flows(), dp.frags()
    want_flows = {k: state.flow_val.get(k, FlowVal(0)).closing for k in state.flow}
    want_frags = {k: v.passed for k, v in state.frag.items()}
    if flows != want_flows or frags != want_frags:
        pytest.fail(
            f"{context}: the tables differ from the model's (flow -> closing)\n"
            f"flows only in the kernel: {set(flows.items()) - set(want_flows.items())}\n"
            f"flows only in the model: {set(want_flows.items()) - set(flows.items())}\n"
            f"frags in the kernel: {frags}\nfrags in the model: {want_frags}"
        )
