"""Per-packet cost of each program path with BPF_PROG_RUN (no namespaces, no devices).

The kernel runs the program `repeat` times on ONE buffer and reports the mean ns per run; the
program's rewrites stay in that buffer. The maps are therefore seeded so that a rewritten
packet takes the same path again: every LB IP is also a "service" pointing back from its pod IP
(its pod role too, for egress), with the allowed ports and flows of both addresses. Each
path is next to a trivial program of the same type (the floor: BPF_PROG_RUN's own cost per
run), and cross-checked with the kernel's run-time statistics (BPF_ENABLE_STATS, the switch
behind sysctl kernel.bpf_stats_enabled), which add about two clock reads per run.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from ipaddress import IPv4Address as A
from ipaddress import IPv4Network as N
from typing import Any

from bench import bpfx, progs, variant
from bench.common import Params, log, median, pin_dir
from bench.frames import udp_frame
from cozyebpf.datapath import attach, bpfsys, layout, loader
from cozyebpf.datapath.maps import Flow, PinnedMaps
from cozyebpf.state import AllowedPort, Limits, MapState, PodEntry, Proto, ServiceEntry, diff

CLIENT = "198.51.100.2"
LB_W, POD_W = "203.0.113.10", "10.244.1.10"
LB_F, POD_F = "203.0.113.20", "10.244.1.20"
POD_D = "10.244.1.40"  # a pod IP only: traffic sent to the pod IP directly
UNKNOWN = "203.0.113.99"
# with loadBalancerSourceRanges (CLIENT inside, OUTSIDER not): whole-IP and port filter
LB_RW, POD_RW = "203.0.113.50", "10.244.1.50"
LB_RF, POD_RF = "203.0.113.60", "10.244.1.60"
OUTSIDER = "192.0.2.5"
RANGES = frozenset({N("198.51.100.0/24"), N("192.0.2.128/25"), N("10.0.0.0/8")})
M1, M2 = "02:00:00:00:aa:01", "02:00:00:00:aa:02"
# Services with limits (issue 38), whole-IP, named (an active slot: their limits are written
# there): one far above anything a run sends (every packet passes and is charged), one whose
# packet rate a run exceeds at once (after the burst of 64 every packet is a drop_limit; its
# byte bucket admits first: the longest way to a drop)
LB_L, POD_L, SVC_L = "203.0.113.70", "10.244.1.70", "bench/limited"
LB_LD, POD_LD, SVC_LD = "203.0.113.80", "10.244.1.80", "bench/limit-drop"
LIMITS = {
    SVC_L: Limits(ingress_bps=10**15, egress_bps=10**15, ingress_pps=10**9),
    SVC_LD: Limits(ingress_bps=10**15, ingress_pps=1),
}

# flipping seeds: a rewritten packet comes back to the same path on the next run
SEED = MapState(
    services={
        A(LB_W): ServiceEntry(A(POD_W), False, False),
        A(POD_W): ServiceEntry(A(LB_W), False, False),
        A(LB_F): ServiceEntry(A(POD_F), True, False),
        A(POD_F): ServiceEntry(A(LB_F), True, False),
        A(LB_RW): ServiceEntry(A(POD_RW), False, False),
        A(POD_RW): ServiceEntry(A(LB_RW), False, False),
        A(LB_RF): ServiceEntry(A(POD_RF), True, False),
        A(POD_RF): ServiceEntry(A(LB_RF), True, False),
        A(LB_L): ServiceEntry(A(POD_L), False, False, SVC_L, limited=True),
        A(POD_L): ServiceEntry(A(LB_L), False, False, SVC_L, limited=True),
        A(LB_LD): ServiceEntry(A(POD_LD), False, False, SVC_LD, limited=True),
        A(POD_LD): ServiceEntry(A(LB_LD), False, False, SVC_LD, limited=True),
    },
    pods={
        A(POD_W): PodEntry(A(LB_W), False, False),
        A(LB_W): PodEntry(A(POD_W), False, False),
        A(POD_F): PodEntry(A(LB_F), True, False),
        A(LB_F): PodEntry(A(POD_F), True, False),
        A(POD_D): PodEntry(A("203.0.113.40"), False, False),
        A(POD_RW): PodEntry(A(LB_RW), False, False),
        A(LB_RW): PodEntry(A(POD_RW), False, False),
        A(POD_RF): PodEntry(A(LB_RF), True, False),
        A(LB_RF): PodEntry(A(POD_RF), True, False),
        A(POD_L): PodEntry(A(LB_L), False, False, SVC_L, limited=True),
        A(LB_L): PodEntry(A(POD_L), False, False, SVC_L, limited=True),
        A(POD_LD): PodEntry(A(LB_LD), False, False, SVC_LD),  # no egress limit
        A(LB_LD): PodEntry(A(POD_LD), False, False, SVC_LD),
    },
    allowed={
        AllowedPort(A(POD_F), Proto.UDP, 80),
        AllowedPort(A(LB_F), Proto.UDP, 80),
        AllowedPort(A(POD_RF), Proto.UDP, 80),
        AllowedPort(A(LB_RF), Proto.UDP, 80),
    },
    ranges={A(a): RANGES for a in (POD_RW, LB_RW, POD_RF, LB_RF)},
    limits=LIMITS,
)


def _ingress(dst: str, sport: int, dport: int) -> bytes:
    return udp_frame(M1, M2, CLIENT, dst, sport, dport)


#: name -> (program, frame, expected verdict, what it exercises)
CASES: dict[str, tuple[str, bytes, int, str]] = {
    "xdp/not-ours": ("xdp", _ingress(UNKNOWN, 1000, 5000), 2, "addr4 miss"),
    "xdp/whole-ip": ("xdp", _ingress(LB_W, 1000, 5000), 2, "addr4 hit, checks, counter, rewrite"),
    "xdp/direct-pod": ("xdp", _ingress(POD_D, 1000, 5000), 2, "addr4 hit (a pod IP), counter"),
    "xdp/port-allowed": ("xdp", _ingress(LB_F, 1000, 80), 2, "addr4, inline port hit, rewrite"),
    "xdp/port-drop": ("xdp", _ingress(LB_F, 1000, 9999), 1, "addr4, inline ports, flow hint 0"),
    "xdp/reply": ("xdp", _ingress(LB_F, 53, 40000), 2, "addr4, inline ports, hint, flow4 hit"),
    "xdp/whole-ip-ranges": (
        "xdp",
        _ingress(LB_RW, 1000, 5000),
        2,
        "as xdp/whole-ip, with source ranges: an LPM lookup",
    ),
    "xdp/port-allowed-ranges": (
        "xdp",
        _ingress(LB_RF, 1000, 80),
        2,
        "as xdp/port-allowed, with source ranges",
    ),
    "xdp/source-drop": (
        "xdp",
        udp_frame(M1, M2, OUTSIDER, LB_RW, 1000, 5000),
        1,
        "outside the ranges: LPM miss, flow hint 0, drop_source",
    ),
    "xdp/port-drop-stale-hint": (
        "xdp",
        _ingress(LB_F, 1000, 9998),
        1,
        "as xdp/port-drop, its flow-hint bit set by a flow that is gone: a flow4 miss",
    ),
    "xdp/whole-ip-limited": (
        "xdp",
        _ingress(LB_L, 1000, 5000),
        2,
        "as xdp/whole-ip, under its Service's limits: both buckets charged",
    ),
    "xdp/limit-drop": (
        "xdp",
        _ingress(LB_LD, 1000, 5000),
        1,
        "a whole-IP Service over its packet rate: byte bucket admits, packet bucket drop_limit",
    ),
    "tc/whole-ip": ("tc", _ingress(LB_W, 1000, 5000), -1, "as xdp/whole-ip, skb helpers"),
    "tc/whole-ip-ranges": ("tc", _ingress(LB_RW, 1000, 5000), -1, "as xdp/whole-ip-ranges"),
    "tc/port-allowed": ("tc", _ingress(LB_F, 1000, 80), -1, "as xdp/port-allowed"),
    "tc/port-drop": ("tc", _ingress(LB_F, 1000, 9999), 2, "as xdp/port-drop"),
    "tc/reply": ("tc", _ingress(LB_F, 53, 40000), -1, "as xdp/reply"),
    "egress/not-ours": ("egress", udp_frame(M1, M2, UNKNOWN, CLIENT, 1, 2), -1, "addr4 miss"),
    "egress/whole-ip": (
        "egress",
        udp_frame(M1, M2, POD_W, CLIENT, 40000, 53),
        -1,
        "addr4 hit, SNAT",
    ),
    "egress/port-filter": (
        "egress",
        udp_frame(M1, M2, POD_F, CLIENT, 40000, 53),
        -1,
        "addr4, flow4 hit (refresh), SNAT",
    ),
    "egress/whole-ip-ranges": (
        "egress",
        udp_frame(M1, M2, POD_RW, CLIENT, 40000, 53),
        -1,
        "a restricted whole-IP pod: its flows recorded (flow4 hit), SNAT",
    ),
    "egress/whole-ip-limited": (
        "egress",
        udp_frame(M1, M2, POD_L, CLIENT, 40000, 53),
        -1,
        "as egress/whole-ip, under its Service's egress limit: its bucket charged",
    ),
    "min/whole-ip": ("min", _ingress(LB_W, 1000, 5000), 2, "minimal NAT: svc hit, rewrite"),
    "min/port-allowed": ("min", _ingress(LB_F, 1000, 80), 2, "minimal NAT: svc, allow hit"),
    "min/port-drop": ("min", _ingress(LB_F, 1000, 9999), 1, "minimal NAT: svc, allow miss"),
    "floor/xdp": ("xdp-floor", _ingress(LB_W, 1000, 5000), 2, "return XDP_PASS"),
    # the parts of a packet's cost, one program each (bench/bpf/parts.c), on the reply frame
    "part/addr-hit": ("part-addr_hit", _ingress(LB_F, 53, 40000), 2, "hash lookup, hit (addr4)"),
    "part/addr-miss": ("part-addr_miss", _ingress(LB_F, 53, 40000), 2, "hash lookup, miss"),
    "part/flow-hit": ("part-flow_hit", _ingress(LB_F, 53, 40000), 2, "LRU lookup, hit (flow4)"),
    "part/hint": ("part-hint", _ingress(LB_F, 53, 40000), 2, "flow hint: hash, 2 array words"),
    "part/count": ("part-count", _ingress(LB_F, 53, 40000), 2, "per-CPU counter"),
    "part/rewrite": ("part-rewrite", _ingress(LB_F, 53, 40000), 2, "IPv4 daddr + checksum"),
    "part/fib": (
        "part-fib",
        _ingress(LB_F, 53, 40000),
        2,
        "bpf_fib_lookup of the source (a source check without the cache)",
    ),
    "floor/tc": ("tc-floor", _ingress(LB_W, 1000, 5000), -1, "return TCX_NEXT"),
}
# the same paths without the per-Service counters (built with -DCZ_NO_SVC_STATS), and with a
# monitor running (`--type all`: every packet asks the token bucket; 1,000 events/s get out)
_SVC_CASES = (
    "xdp/whole-ip",
    "xdp/port-allowed",
    "xdp/port-drop",
    "xdp/reply",
    "tc/whole-ip",
    "tc/port-drop",
    "egress/whole-ip",
    "egress/port-filter",
)
for _name in _SVC_CASES:
    _prog, _frame, _want, _what = CASES[_name]
    CASES[f"nosvc/{_name}"] = (f"{_prog}-nosvc", _frame, _want, "without per-Service counters")
# egress without the source check (bench/bpf/variants/egress_nocheck.c): what it costs. The
# frames of BPF_PROG_RUN carry ingress_ifindex 0, which the check compares with the pod's
# cached device (0 too) and passes at once: the same instructions as a packet from the cached
# device
for _name in ("egress/whole-ip", "egress/port-filter"):
    _prog, _frame, _want, _what = CASES[_name]
    CASES[f"nospoof/{_name}"] = (f"{_prog}-nospoof", _frame, _want, "without the source check")
for _name in ("xdp/whole-ip", "xdp/port-drop", "tc/whole-ip", "egress/port-filter"):
    _prog, _frame, _want, _what = CASES[_name]
    CASES[f"mon/{_name}"] = (_prog, _frame, _want, "with a monitor running (--type all)")
#: cases whose Service is over its limit: its bucket is emptied before each measurement (it
#: refills a packet a second, up to the burst of 64, while the other cases run), so that the
#: verdict is the drop and every run of the measurement is one
DRAIN = frozenset({"xdp/limit-drop"})
DRAIN_RUNS = 10_000
#: the limits' cost (issue 38), measured apart in interleaved rounds for its targets: each
#: case of a Service with limits beside the one of today it is held to (limited: today's)
LIMIT_PAIRS = {
    "xdp/whole-ip-limited": "xdp/whole-ip",
    "egress/whole-ip-limited": "egress/whole-ip",
    "xdp/limit-drop": "xdp/port-drop",
}


@dataclass
class ProgRunBench:
    params: Params

    def setup(self) -> None:
        self.pin = pin_dir("run")
        self.maps = PinnedMaps.ensure(self.pin)
        self.maps.apply(diff(self.maps.read_state(), SEED))
        written = {svc: lim for svc, (lim, _) in self.maps.limits().items()}
        if written != LIMITS:
            raise RuntimeError(
                f"the limits map holds {written}, not {LIMITS}: the limited Services need "
                "active slots (PinnedMaps.ensure's service_slots)"
            )
        # the reply flow, for both sides of the flip (with its flow-hint bit, as egress sets it)
        self.maps.add_flows(
            Flow(A(pod), A(CLIENT), 40000, 53, 17) for pod in (POD_F, LB_F, POD_RW, LB_RW)
        )
        # a stale hint: the bit of a flow that expired or was evicted (bits are never cleared)
        self.maps._set_hints([Flow(A(POD_F), A(CLIENT), 9998, 1000, 17)])
        log("compiling cozyebpf's programs (bcc), with and without per-Service counters")
        nosvc = ["-DCZ_NO_SVC_STATS"]
        # first: each load puts its full paths into the pinned prog arrays, and the product's
        # should be the ones there (no case here takes a full path, though)
        self.nosvc = {
            "xdp-nosvc": loader.load("ingress.c", "cz_ingress", "xdp", self.pin, nosvc),
            "tc-nosvc": loader.load("ingress_tc.c", "cz_ingress_tc", "sched_cls", self.pin, nosvc),
            "egress-nosvc": loader.load("egress.c", "cz_egress", "sched_cls", self.pin, nosvc),
            "egress-nospoof": variant.build("egress_nocheck.c", "cz_egress", "sched_cls", self.pin),
        }
        self.progs = {
            "xdp": loader.load("ingress.c", "cz_ingress", "xdp", self.pin),
            "tc": loader.load("ingress_tc.c", "cz_ingress_tc", "sched_cls", self.pin),
            "egress": loader.load("egress.c", "cz_egress", "sched_cls", self.pin),
        }
        self.sinks = progs.Sinks.load()
        self.fds = {k: p.fd for k, p in (*self.progs.items(), *self.nosvc.items())}
        self.minimal = progs.MinimalNat.load()
        self.minimal.seed(
            {str(lb): (str(e.pod_ip), e.port_filter) for lb, e in SEED.services.items()},
            [(str(a.pod_ip), int(a.proto), a.port) for a in SEED.allowed],
        )
        self.fds["min"] = self.minimal.fd
        self.parts = progs.Parts.load()
        self.parts.seed(LB_F, CLIENT, 53, 40000, 17)
        self.fds.update({f"part-{n}": fd for n, fd in self.parts.fds.items()})
        self.fds["xdp-floor"] = self.sinks.pass_fd
        self.fds["tc-floor"] = self.sinks.tc_next_fd

    def teardown(self) -> None:
        if getattr(self, "maps", None):
            self.maps.close()
        attach.detach_all(self.pin)

    def _ready(self, name: str, fd: int, frame: bytes) -> None:
        """The monitor's switch on (every packet an event candidate) for the mon/ cases; the
        bucket of a DRAIN case emptied."""
        if name.startswith("mon/"):
            self.maps.set_monitor(layout.MON_ALL, 1_000_000, 100_000_000)  # 1000/s, burst 100
        else:
            self.maps.set_monitor(layout.MON_OFF)
        if name in DRAIN:
            bpfsys.prog_test_run(fd, frame, repeat=DRAIN_RUNS)

    def _limit_rounds(self, rounds: int) -> dict[str, dict[str, float]]:
        """ns per packet of LIMIT_PAIRS' cases in `rounds` interleaved rounds (the order turned
        by one each round); per case the minimum over the rounds (the figure least moved by
        other work) and the median. Checks that the drops were counted drop_limit."""
        names = sorted({*LIMIT_PAIRS, *LIMIT_PAIRS.values()})
        res: dict[str, list[float]] = {n: [] for n in names}
        self.maps.set_monitor(layout.MON_OFF)
        before = self.maps.counters().get("drop_limit", {}).get("packets", 0)
        for i in range(rounds):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                prog, frame, want, _ = CASES[name]
                fd = self.fds[prog]
                self._ready(name, fd, frame)
                r = bpfsys.prog_test_run(fd, frame, repeat=1)
                if r.retval != want:
                    raise RuntimeError(f"{name}: verdict {r.retval}, want {want}")
                r = bpfsys.prog_test_run(fd, frame, repeat=self.params.progrun_repeat)
                res[name].append(r.duration_ns)
        dropped = self.maps.counters().get("drop_limit", {}).get("packets", 0) - before
        if dropped < rounds * self.params.progrun_repeat:
            raise RuntimeError(f"drop_limit counted {dropped} packets, want the limit-drop runs")
        return {n: {"min": min(v), "median": median(v)} for n, v in res.items()}

    def run(self) -> dict[str, Any]:
        p = self.params
        res: dict[str, list[float]] = {k: [] for k in CASES}
        stats: dict[str, list[float]] = {k: [] for k in CASES}
        for rep in range(p.progrun_reps):
            for name, (prog, frame, want, _) in CASES.items():
                fd = self.fds[prog]
                self._ready(name, fd, frame)
                r = bpfsys.prog_test_run(fd, frame, repeat=1)
                if r.retval != want:
                    raise RuntimeError(f"{name}: verdict {r.retval}, want {want}")
                r = bpfsys.prog_test_run(fd, frame, repeat=p.progrun_repeat)
                res[name].append(r.duration_ns)
            sfd = bpfx.enable_stats()
            try:
                for name, (prog, frame, _, _) in CASES.items():
                    fd = self.fds[prog]
                    self._ready(name, fd, frame)
                    s0 = bpfx.prog_run_stats(fd)
                    bpfsys.prog_test_run(fd, frame, repeat=p.progrun_repeat)
                    s1 = bpfx.prog_run_stats(fd)
                    runs = s1.run_cnt - s0.run_cnt
                    stats[name].append((s1.run_time_ns - s0.run_time_ns) / max(1, runs))
            finally:
                os.close(sfd)
                self.maps.set_monitor(layout.MON_OFF)
            log(f"progrun rep {rep + 1}/{p.progrun_reps} done")
        out: dict[str, Any] = {"repeat": p.progrun_repeat, "cases": {}}
        out["limits"] = self._limit_rounds(10 * p.progrun_reps)
        floor = {"xdp": median(res["floor/xdp"]), "tc": median(res["floor/tc"])}
        for name, (prog, _, _, what) in CASES.items():
            ns = median(res[name])
            base = floor["xdp"] if prog.startswith(("xdp", "min", "part")) else floor["tc"]
            if name.startswith(("nosvc/", "mon/", "nospoof/")):
                what = f"{CASES[name.split('/', 1)[1]][3]}; {what}"
            out["cases"][name] = {
                "ns": round(ns, 1),
                "ns_above_floor": round(ns - base, 1),
                "ns_bpf_stats": round(median(stats[name]), 1),
                "what": what,
                "all_ns": res[name],
            }
        out["insns"] = {k: bpfsys.prog_info(p.fd).xlated_insns for k, p in self.progs.items()}
        out["verified_insns"] = {}
        for k, program in self.progs.items():
            out["verified_insns"][k] = bpfsys.prog_info(program.fd).verified_insns
            slow = loader.slow_program_fd(program)
            if slow is not None:
                out["verified_insns"][f"{k}-full-path"] = bpfsys.prog_info(slow).verified_insns
            for more, _, _ in loader.MORE_PATHS.get(program.name) or ():
                more_fd = loader.slow_program_fd(program, more)
                if more_fd is not None:
                    out["verified_insns"][f"{k}-outside"] = bpfsys.prog_info(more_fd).verified_insns
        return out


#: the source check (issue 21), measured apart: cz_egress as shipped (the FIB's answer cached
#: in the pod's entry: a packet from the cached device costs one compare), built without the
#: check, and built to ask the FIB for every packet in the entry program (the other way the
#: issue names; the variants of bench/bpf/variants/, "" the product's own); frames from a
#: device the pod IPs are routed to, in a namespace of the run's own
SPOOF_BUILDS = {
    "cached": "",
    "nocheck": "egress_nocheck.c",
    "fib": "egress_fib_always.c",
}
SPOOF_CASES = {
    "egress/whole-ip": udp_frame(M1, M2, POD_W, CLIENT, 40000, 53),
    "egress/port-filter": udp_frame(M1, M2, POD_F, CLIENT, 40000, 53),
}


def spoof_check(params: Params, rounds: int) -> dict[str, Any]:
    """ns per packet (BPF_PROG_RUN) of each SPOOF_BUILDS build on each SPOOF_CASES frame, the
    builds loaded twice each and run in interleaved rounds; per build and case the minimum over
    the rounds (the figure least moved by other work) and the median."""
    import struct

    from bench.common import TAG, sh
    from cozylab.netns import in_netns

    ns, dev = f"{TAG}-spoof", "pod0"
    pin = pin_dir("spoof")
    maps = PinnedMaps.ensure(pin)
    try:
        maps.apply(diff(maps.read_state(), SEED))
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "add", dev, "type", "veth", "peer", "name", "pod0-peer")
        sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", ns, "link", "set", "pod0-peer", "up")
        sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.conf.all.forwarding=1")
        # every pod IP of the seed: a repeated run translates the frame back and forth between
        # the pod IP and the LB IP, which the seed makes a pod IP too
        for pod in SEED.pods:
            sh("ip", "-n", ns, "route", "add", f"{pod}/32", "dev", dev)
        ifindex = int(sh("ip", "-n", ns, "-o", "link", "show", dev).stdout.split(":")[0])
        ctx = bytes(36) + struct.pack("=I", ifindex)  # __sk_buff.ingress_ifindex
        log("compiling cz_egress three times for the source check (cached, none, FIB each time)")
        loads = [
            (
                name,
                variant.build(build, "cz_egress", "sched_cls", pin)
                if build
                else loader.load("egress.c", "cz_egress", "sched_cls", pin),
            )
            for _ in range(2)
            for name, build in SPOOF_BUILDS.items()
        ]
        res: dict[str, dict[str, list[float]]] = {
            b: {c: [] for c in SPOOF_CASES} for b in SPOOF_BUILDS
        }

        def run() -> None:
            for case, frame in SPOOF_CASES.items():  # the first run fills the cache
                for name, prog in loads:
                    r = bpfsys.prog_test_run(prog.fd, frame, ctx=ctx)
                    if r.retval != -1:
                        raise RuntimeError(f"{name} {case}: verdict {r.retval}, want -1")
            for _ in range(rounds):
                for case, frame in SPOOF_CASES.items():
                    for name, prog in loads:
                        r = bpfsys.prog_test_run(
                            prog.fd, frame, repeat=params.progrun_repeat, ctx=ctx
                        )
                        res[name][case].append(r.duration_ns)

        in_netns(ns, run)  # bpf_fib_lookup asks the caller's namespace
        cached = {p: getattr(maps._addr(A(p)), "dev", None) for p in (POD_W, POD_F, LB_W, LB_F)}
        if set(cached.values()) != {ifindex} or maps.counters()["drop_spoofed"]["packets"]:
            raise RuntimeError(f"the pods' entries cache {cached}, not {dev}'s {ifindex}")
        return {
            b: {c: {"min": min(v), "median": median(v)} for c, v in cases.items()}
            for b, cases in res.items()
        }
    finally:
        maps.close()
        attach.detach_all(pin)
        sh("ip", "netns", "del", ns, check=False)


@contextlib.contextmanager
def _pod_node(name: str, *routes: str) -> Iterator[tuple[str, str, PinnedMaps, dict[str, int]]]:
    """(namespace, pin directory, maps, ifindex by device) of a node shaped for the pod-facing
    hook: the seed in the maps, forwarding on, `pod0` (the pods' device, 10.244.0.0/16) and
    `up0` (the uplink, 198.51.100.1/24), plus `routes` ("PREFIX via GATEWAY"). Removed after."""
    from bench.common import TAG, sh

    ns = f"{TAG}-{name}"
    pin = pin_dir(name)
    maps = PinnedMaps.ensure(pin)
    try:
        maps.apply(diff(maps.read_state(), SEED))
        sh("ip", "netns", "add", ns)
        sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.conf.all.forwarding=1")
        for dev in ("pod0", "up0"):
            sh("ip", "-n", ns, "link", "add", dev, "type", "veth", "peer", "name", f"{dev}-p")
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", f"{dev}-p", "up")
        sh("ip", "-n", ns, "route", "add", "10.244.0.0/16", "dev", "pod0")
        sh("ip", "-n", ns, "addr", "add", "198.51.100.1/24", "dev", "up0")
        for route in routes:
            sh("ip", "-n", ns, "route", "add", *route.split())
        idx = {
            d: int(sh("ip", "-n", ns, "-o", "link", "show", d).stdout.split(":")[0])
            for d in ("pod0", "up0")
        }
        yield ns, pin, maps, idx
    finally:
        maps.close()
        attach.detach_all(pin)
        sh("ip", "netns", "del", ns, check=False)


def _run_time_ns(fd: int, frames: list[bytes], ctx: bytes | None) -> float:
    """ns per run of program `fd` over `frames`, one single run each, by the kernel's run-time
    statistics (which add about two clock reads per run; bpfx.enable_stats must be on)."""
    s0 = bpfx.prog_run_stats(fd)
    for f in frames:
        bpfsys.prog_test_run(fd, f, ctx=ctx)
    s1 = bpfx.prog_run_stats(fd)
    return (s1.run_time_ns - s0.run_time_ns) / max(1, s1.run_cnt - s0.run_cnt)


#: the pod-facing hook (cz_pod_ingress on Kube-OVN's ovn0), beside the uplink's egress program
#: and the floor: name -> (program, frame, host routing on). Frames enter from the pod device;
#: the routes send CLIENT out by the uplink
POD_HOOK_CASES: dict[str, tuple[str, bytes, bool]] = {
    "floor/tc": ("floor", udp_frame(M1, M2, POD_W, CLIENT, 40000, 53), False),
    "pod/plain-pod": ("pod", udp_frame(M1, M2, "10.244.9.9", CLIENT, 40000, 53), False),
    "pod/whole-ip": ("pod", udp_frame(M1, M2, POD_W, CLIENT, 40000, 53), False),
    "pod/whole-ip-host-routing": ("pod", udp_frame(M1, M2, POD_W, CLIENT, 40000, 53), True),
    "pod/port-filter": ("pod", udp_frame(M1, M2, POD_F, CLIENT, 40000, 53), False),
    "pod/port-filter-host-routing": ("pod", udp_frame(M1, M2, POD_F, CLIENT, 40000, 53), True),
    "egress/whole-ip": ("egress", udp_frame(M1, M2, LB_W, CLIENT, 40000, 53), False),
    "egress/plain-pod": ("egress", udp_frame(M1, M2, "10.244.9.9", CLIENT, 40000, 53), False),
}
#: the verdict each case must return: TCX_NEXT, or TC_ACT_REDIRECT (host routing)
_POD_HOOK_WANT = {False: -1, True: 7}


def pod_hook(params: Params, rounds: int, runs: int = 4000) -> dict[str, Any]:
    """ns per packet of the pod-facing hook (cz_pod_ingress) in BPF_PROG_RUN, beside the
    uplink's egress program (cz_egress: what a VM's packet costs there once translated, and a
    plain pod's) and the floor (a bare TCX_NEXT). Host routing decrements the TTL of the one
    buffer a repeated run reuses, so every case is measured the same way: `runs` single runs
    per round (a fresh frame each), timed by the kernel's run-time statistics (which add about
    two clock reads per run), interleaved in `rounds` rounds; per case the minimum over the
    rounds (the figure least moved by other work) and the median."""
    import struct

    from cozylab.netns import in_netns

    with _pod_node("podhook") as (ns, pin, maps, idx):
        pod_ctx = bytes(36) + struct.pack("=I", idx["pod0"])  # __sk_buff.ingress_ifindex
        log("compiling the pod-facing hook and the egress program")
        fds = {
            "pod": loader.load("pod.c", "cz_pod_ingress", "sched_cls", pin).fd,
            "egress": loader.load("egress.c", "cz_egress", "sched_cls", pin).fd,
            "floor": progs.Sinks.load().tc_next_fd,
        }
        res: dict[str, list[float]] = {c: [] for c in POD_HOOK_CASES}

        def one(case: str, n: int) -> float:
            prog, frame, hr = POD_HOOK_CASES[case]
            maps.set_node([idx["up0"]], True, hr)
            ctx = pod_ctx if prog == "pod" else None
            fd = fds[prog]
            r = bpfsys.prog_test_run(fd, frame, ctx=ctx)
            if r.retval != _POD_HOOK_WANT[hr and prog == "pod"]:
                raise RuntimeError(f"{case}: verdict {r.retval}")
            return _run_time_ns(fd, [frame] * n, ctx)

        def run() -> None:
            sfd = bpfx.enable_stats()
            try:
                for case in POD_HOOK_CASES:
                    one(case, 100)  # warm-up; the pods' devices cached
                for _ in range(rounds):
                    for case in POD_HOOK_CASES:
                        res[case].append(one(case, runs))
            finally:
                os.close(sfd)

        in_netns(ns, run)  # bpf_fib_lookup asks the caller's namespace
        return {c: {"min": round(min(v), 1), "median": round(median(v), 1)} for c, v in res.items()}


#: fib_cache: how many remote addresses the VM's datagrams go round in the "many" case (more
#: than the cache's slots, bpf/lib/fib.h CZ_FIBC4_SLOTS, so that every answer misses)
FIB_SPREAD = 20_000


def fib_cache(params: Params, rounds: int) -> dict[str, Any]:
    """ns per packet (BPF_PROG_RUN, the run-time statistics) of the pod-facing hook for a
    whole-IP VM's datagram to one remote address and to FIB_SPREAD of them in turn, with the
    FIB answers' cache (the product) and without it (bench/bpf/variants/pod_fib_uncached.c),
    host routing off and on: is the cache worth its keep, and what does a miss cost (issue 37).
    Per case the minimum over the interleaved rounds and the median."""
    import struct
    from ipaddress import IPv4Address

    from cozylab.netns import in_netns

    with _pod_node("fibc", f"198.18.0.0/15 via {CLIENT}") as (ns, pin, maps, idx):
        ctx = bytes(36) + struct.pack("=I", idx["pod0"])  # __sk_buff.ingress_ifindex
        log("compiling the pod-facing hook with and without its FIB answers' cache")
        fds = {
            "cached": loader.load("pod.c", "cz_pod_ingress", "sched_cls", pin).fd,
            "uncached": variant.build("pod_fib_uncached.c", "cz_pod_ingress", "sched_cls", pin).fd,
        }
        first = int(IPv4Address("198.18.0.1"))
        frames = {
            "one": [udp_frame(M1, M2, POD_W, "198.18.0.1", 40000, 53)] * FIB_SPREAD,
            "many": [
                udp_frame(M1, M2, POD_W, str(IPv4Address(first + i)), 40000, 53)
                for i in range(FIB_SPREAD)
            ],
        }
        res: dict[str, list[float]] = {}

        def one(fd: int, batch: list[bytes], want: int) -> float:
            r = bpfsys.prog_test_run(fd, batch[0], ctx=ctx)
            if r.retval != want:
                raise RuntimeError(f"fib_cache: verdict {r.retval}, want {want}")
            return _run_time_ns(fd, batch, ctx)

        def run() -> None:
            sfd = bpfx.enable_stats()
            try:
                for hr in (False, True):
                    maps.set_node([idx["up0"]], True, hr)
                    for _ in range(rounds):
                        for name, fd in fds.items():
                            for case, batch in frames.items():
                                key = f"{name}/{case}{'/host-routing' if hr else ''}"
                                res.setdefault(key, []).append(one(fd, batch, _POD_HOOK_WANT[hr]))
            finally:
                os.close(sfd)

        in_netns(ns, run)  # bpf_fib_lookup asks the caller's namespace
        return {c: {"min": round(min(v), 1), "median": round(median(v), 1)} for c, v in res.items()}


def main_progrun(params: Params) -> dict[str, Any]:
    b = ProgRunBench(params)
    try:
        b.setup()
        out = b.run()
    finally:
        b.teardown()
    out["spoof"] = spoof_check(params, rounds=10 * params.progrun_reps)
    out["pod_hook"] = pod_hook(params, rounds=3 * params.progrun_reps)
    out["fib_cache"] = fib_cache(params, rounds=params.progrun_reps)
    return out
