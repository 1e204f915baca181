"""The differential test's harness (tests/datapath/test_differential.py): the three programs
loaded with their pinned maps (seed a RefState, run a frame, read the tables and counters back)
and the comparison of each run with the reference model, reported with scapy and a hexdump
when they differ."""

from __future__ import annotations

import ctypes
import functools
import struct
import sys
import time
from ipaddress import IPv4Address
from typing import Any

import pytest
from scapy.layers.l2 import Ether

from cozyebpf.datapath import bpfsys, layout, loader
from cozyebpf.datapath.layout import FLOW4, FLOW6, FRAG4, FRAG6, MapSpec
from cozyebpf.datapath.maps import Flow, PinnedMaps, possible_cpus
from cozyebpf.datapath.reasons import EVENT_REASONS, REASONS, SVC_DROP_REASONS
from cozyebpf.state import AllowedPort, MapState, PodEntry, Proto, ServiceEntry, diff
from tests.support import refmodel as rm
from tests.support.refmodel import (
    ALLOW_ICMP,
    LEARN,
    PORT_FILTER,
    Addr,
    FlowKey,
    FlowVal,
    FragKey,
    RefState,
    Result,
)

# -- the programs ------------------------------------------------------------------------------


def _be32_int(n: int) -> int:
    """The c_uint32 whose memory holds `n` in network byte order."""
    return int.from_bytes(n.to_bytes(4, "big"), sys.byteorder)


def _addr(ip: Addr) -> int | layout.Ip6:
    return layout.be32(ip) if isinstance(ip, IPv4Address) else layout.ip6(ip)


def _addr_of(v: int | layout.Ip6) -> Addr:
    return layout.ip_of(v) if isinstance(v, int) else layout.ip6_of(v)


def _entry(addr: Addr, flags: int) -> tuple[Addr, bool, bool, str, bool]:
    """ServiceEntry/PodEntry arguments of a model entry's address and flags."""
    return addr, bool(flags & PORT_FILTER), bool(flags & ALLOW_ICMP), "", bool(flags & LEARN)


def map_state(state: RefState) -> MapState:
    """The model's svc, pod and allow tables as the control plane's MapState (PinnedMaps
    encodes it into addr4/addr6 and allow4/allow6, as the agent does)."""
    return MapState(
        {lb: ServiceEntry(*_entry(s.pod_ip, s.flags)) for lb, s in state.svc.items()},
        {p: PodEntry(*_entry(e.lb_ip, e.flags)) for p, e in state.pod.items()},
        {AllowedPort(a.pod_ip, Proto(a.proto), a.port) for a in state.allow},
        dict(state.ranges),
    )


class Datapath:
    """The three loaded programs and their pinned maps: seed, run, read back."""

    RAW_MAPS = (FLOW4, FRAG4, FLOW6, FRAG6)  # the tables the programs write

    def __init__(self, maps: PinnedMaps, progs: dict[str, loader.Program]) -> None:
        self.maps = maps
        self.progs = progs
        self.fds = {name: p.fd for name, p in progs.items()}
        self.frames = 0  # checked against the model
        self.runs = 0  # program runs

    def _fd(self, spec: MapSpec) -> int:
        return self.maps.fds[spec.name]

    def clear(self) -> None:
        self.maps.apply(diff(self.maps.read_state(), MapState()))
        for spec in self.RAW_MAPS:
            for raw in bpfsys.map_keys(self._fd(spec), spec.key_size):
                bpfsys.map_delete(self._fd(spec), ctypes.create_string_buffer(raw, len(raw)))
        self.maps.forget_seen()

    def seed(self, state: RefState, now_ns: int) -> None:
        self.maps.apply(diff(MapState(), map_state(state)))
        for pod_ip, dev in state.dev.items():  # the programs' cache: user space writes 0
            if pod_ip in state.pod:
                self.set_dev(pod_ip, dev)
        for f in state.flow:
            v = state.flow_val.get(f, FlowVal(now_ns))
            self.maps.add_flows([Flow(*f)], v.seen_ns, v.closing)
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

    def unnamed(self) -> tuple[int, ...]:
        """svcstats slot 0: the counters of every packet's Service here (the seeds name none);
        in_packets, in_bytes, out_packets, out_bytes, drops[]."""
        ncpu, buf, fmt, size = self._svc0
        assert bpfsys.map_lookup(self.maps.fds["svcstats"], ctypes.c_uint32(0), buf)
        raw = buf.raw
        per_cpu = [fmt.unpack_from(raw, c * size) for c in range(ncpu)]
        return tuple(sum(col) for col in zip(*per_cpu, strict=True))

    def run(self, prog: str, frame: bytes, in_dev: int = 0) -> tuple[int, bytes]:
        """Run `prog` on `frame`; a tc program's frame as if it entered by device `in_dev`."""
        r = bpfsys.prog_test_run(self.fds[prog], frame, ctx=skb_ctx(in_dev) if in_dev else None)
        self.runs += 1
        return r.retval, r.data


#: struct __sk_buff up to and including ingress_ifindex (offset 36, linux/bpf.h): the context
#: BPF_PROG_RUN takes, shorter than the struct (the rest is zero)
SKB_CTX = struct.Struct("=9II")


def skb_ctx(ingress_ifindex: int) -> bytes:
    """A tc program's context for BPF_PROG_RUN: the device the frame entered the node by."""
    return SKB_CTX.pack(*(0,) * 9, ingress_ifindex)


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
        for name in ("svc", "pod", "allow", "flow", "frag", "ranges", "flow_val", "dev")
    )


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
) -> str | None:
    """None when the program did what the model says, else a report of the difference."""
    if (got_code, got, got_counts) == (want_code, want.frame, want.counts):
        return None
    lines = [
        f"{prog}: the program and the model disagree",
        f"frame ({len(frame)} bytes, entered by device {in_dev}): {scapy_command(frame)}",
        f"  hex {frame.hex()}",
        "map state (before this frame):",
        describe_state(state),
        f"verdict: expected {want_code} ({want.verdict}), got {got_code}",
    ]
    if got_counts != want.counts:
        lines.append(f"counters: expected {want.counts}, got {got_counts}")
    if got != want.frame:
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


def check_frame(
    dp: Datapath, state: RefState, frame: bytes, egress: bool, in_dev: int = 0
) -> Result:
    """Run `frame` through the program(s) of its direction (egress: as if it entered the node
    by device `in_dev`); assert they match the model, and that the per-Service counters of the
    address (slot 0 here) count it once. Returns the model's result (not yet applied to
    `state`)."""
    now = time.monotonic_ns()
    dp.frames += 1
    if egress:
        want = rm.egress(state, frame, now, in_dev)
        runs = [("egress", rm.tc_code(want.verdict))]
    else:
        want = rm.ingress(state, frame, now)
        runs = [("xdp", rm.xdp_code(want.verdict)), ("tc-ingress", rm.tc_code(want.verdict))]
    for prog, code in runs:
        if prog != "xdp" and not tc_can_run(frame):
            continue
        before, svc_before = dp.counters(), dp.unnamed()
        got_code, got = dp.run(prog, frame, in_dev if egress else 0)
        problem = mismatch(
            prog, frame, state, want, code, got_code, got, _delta(dp.counters(), before), in_dev
        )
        if problem:
            pytest.fail(problem)
        svc = tuple(a - b for a, b in zip(dp.unnamed(), svc_before, strict=True))
        if svc != per_service(want.counts, egress):
            pytest.fail(
                f"{prog}: per-Service counters (in packets, bytes, out packets, bytes, drops "
                f"{SVC_DROP_REASONS}) {svc}, want {per_service(want.counts, egress)} for "
                f"{want.counts}\nframe: {scapy_command(frame)}"
            )
    return want


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
