"""Datapath throughput in a namespace lab: generator -> node -> pod (and pod -> node -> client).

Load is generated in the kernel: BPF_PROG_RUN with BPF_F_TEST_XDP_LIVE_FRAMES runs bench_gen
(bench/bpf/gen.c) "on" the generator's veth; its XDP_TX sends each frame to the peer, the node's
device, whose NAPI processes it in the same softirq. bench_gen rewrites all 60 bytes of every
frame (live frames are recycled with the forwarder's rewrites in them). The node device needs
GRO on to accept XDP_TX frames when no XDP program is attached to it. Delivered frames are
counted by bench_count, native XDP on the receiving veth (pod or client side). Variants are
interleaved (A B C, B C A, ...) and each (path, variant) is measured `reps` times; the report
uses medians.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from ipaddress import ip_network
from typing import Any

from bench import bpfx, progs, variant
from bench.common import Params, log, median, pin_dir
from bench.frames import udp_frame
from bench.nftrules import full_ruleset
from cozyebpf.datapath import attach, bpfsys, loader
from cozyebpf.datapath.maps import PinnedMaps
from cozyebpf.model import build_state
from cozyebpf.state import diff
from cozylab.k8s import Svc, objects
from cozylab.netns import CLIENT_IP, CLIENT_MAC, DEFAULT_PODS, UPLINK, UPLINK_MAC, Lab

POD_W, POD_F = DEFAULT_PODS[0], DEFAULT_PODS[1]  # whole-IP pod, port-filter pod
POD_P = DEFAULT_PODS[2]  # a plain pod: no Service
LB_W, LB_F = "203.0.113.10", "203.0.113.20"
ALLOWED_PORT = 80  # UDP, listed in the port-filter Service
UNLISTED_PORT = 9999
POD_EPHEMERAL, REMOTE_PORT = 40000, 53  # the flow the pod opens (reply path)

SERVICES = (
    Svc("vm-whole", LB_W, POD_W.ip, [("UDP", 5000)], whole_ip="true"),
    Svc("vm-filter", LB_F, POD_F.ip, [("UDP", ALLOWED_PORT), ("TCP", 22)]),
)

# path -> variants measured on it (in this order, rotated per repetition)
# cz-xdp-nosvc / cz-xdp-mon: cz-xdp without per-Service counters (-DCZ_NO_SVC_STATS), and
# with a monitor running (--type all: every packet asks the token bucket)
# cz-xdp-ranges: cz-xdp with loadBalancerSourceRanges on both Services (the client inside)
_CZ = ("cz-xdp", "cz-xdp-nosvc", "cz-xdp-mon", "cz-xdp-ranges", "cz-tcx")
PATHS: dict[str, tuple[str, ...]] = {
    "whole-ip": ("plain", "xdp-pass", "nft", "nft-noct", "min-xdp", *_CZ),
    "port-allowed": ("plain", "xdp-pass", "nft", "nft-noct", "min-xdp", *_CZ),
    "port-drop": ("gen-only", "xdp-drop", "nft", "nft-noct", "min-xdp", *_CZ),
    "reply": ("plain", "xdp-pass", "nft", *_CZ),
    "egress-snat": ("plain", "tc-next", "nft", "nft-noct", "min-snat", *_CZ, "cz-xdp-nospoof"),
    # the same SNAT from the whole-IP pod, which records no flows: what the flow record costs
    "egress-whole": ("plain", "tc-next", "min-snat", "cz-xdp", "cz-xdp-nospoof"),
    # the pod-facing hook (--pod-devices, tcx ingress of the pods' host devices): the same SNAT
    # taken there, and a plain pod's traffic, which it (and the uplink's egress) only looks at
    "pod-side-snat": ("plain", "cz-xdp", "cz-xdp-podnext", "cz-pod"),
    "pod-side-other": ("plain", "cz-xdp", "cz-xdp-podnext", "cz-pod"),
}
VARIANT_LABELS = {
    "plain": "plain routing (no NAT)",
    "nft": "cozy-proxy nftables (as shipped)",
    "nft-noct": "cozy-proxy nftables without conntrack",
    "cz-xdp": "cozyebpf, XDP ingress",
    "cz-xdp-nosvc": "cozyebpf, XDP ingress, built without per-Service counters",
    "cz-xdp-nospoof": "cozyebpf, XDP ingress, egress built without the source check",
    "cz-xdp-mon": "cozyebpf, XDP ingress, with `cozyebpf monitor --type all` running",
    "cz-xdp-ranges": "cozyebpf, XDP ingress, both Services with source ranges (client inside)",
    "cz-tcx": "cozyebpf, tcx ingress",
    "gen-only": "generator floor (gen alone, XDP_DROP)",
    "xdp-drop": "bare XDP_DROP on the node device",
    "xdp-pass": "bare XDP_PASS on the node device (the floor of any XDP forwarding)",
    "tc-next": "bare TCX_NEXT in tcx egress of the node device (the floor of any tc SNAT)",
    "min-xdp": "minimal XDP NAT, no extras (reference)",
    "min-snat": "minimal tcx SNAT, no extras (reference: one lookup, the rewrite)",
    "cz-pod": "cozyebpf with --pod-devices: the pod-facing hook on the pods' host devices too",
    "cz-xdp-podnext": "cz-xdp and a bare TCX_NEXT in tcx ingress of the pods' host devices (the "
    "floor of any pod-facing hook)",
}
DROP_PATHS = ("port-drop",)


@dataclass
class Measurement:
    path: str
    variant: str
    rep: int
    sent: int
    seconds: float
    delivered: int
    counter: int  # cozyebpf counter of the expected reason (cz variants), else 0
    cpu_seconds: float  # the generator thread's CPU time + ksoftirqd's, during the run

    @property
    def packets(self) -> int:
        return self.sent if self.path in DROP_PATHS else self.delivered

    @property
    def pps(self) -> float:
        """Packets per second of one busy core: everything (generator, the node's NAPI and
        forwarding, the counter) runs in the generator thread's context, so its CPU time is
        the work; time the thread was preempted by other processes does not count."""
        return self.packets / self.cpu_seconds

    @property
    def wall_pps(self) -> float:
        return self.packets / self.seconds

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "variant": self.variant,
            "rep": self.rep,
            "sent": self.sent,
            "seconds": round(self.seconds, 6),
            "delivered": self.delivered,
            "cz_counter": self.counter,
            "cpu_seconds": round(self.cpu_seconds, 6),
            "pps": round(self.pps),
            "wall_pps": round(self.wall_pps),
        }


def _frames(path: str, variant: str) -> tuple[str, bytes]:
    """(side the generator runs on: "client", "pod" (POD_F) or "pod-w" (POD_W), frame)."""
    nat = variant not in ("plain", "xdp-pass", "tc-next")
    if path == "pod-side-other":
        return "pod-p", udp_frame(
            POD_P.mac, POD_P.host_mac, POD_P.ip, CLIENT_IP, POD_EPHEMERAL, REMOTE_PORT
        )
    if path in ("egress-snat", "egress-whole", "pod-side-snat"):
        pod, side = (POD_W, "pod-w") if path == "egress-whole" else (POD_F, "pod")
        return side, udp_frame(pod.mac, pod.host_mac, pod.ip, CLIENT_IP, POD_EPHEMERAL, REMOTE_PORT)
    if path == "whole-ip":
        dst, sport, dport = (LB_W if nat else POD_W.ip), 1000, 5000
    elif path == "port-allowed":
        dst, sport, dport = (LB_F if nat else POD_F.ip), 1000, ALLOWED_PORT
    elif path == "port-drop":
        dst, sport, dport = LB_F, 1000, UNLISTED_PORT
    elif path == "reply":
        dst, sport, dport = (LB_F if nat else POD_F.ip), REMOTE_PORT, POD_EPHEMERAL
    else:
        raise ValueError(path)
    return "client", udp_frame(CLIENT_MAC, UPLINK_MAC, CLIENT_IP, dst, sport, dport)


EXPECTED_REASON = {
    "whole-ip": "nat_ingress",
    "port-allowed": "pass_port",
    "port-drop": "drop_port",
    "reply": "pass_reply",
    "egress-snat": "nat_egress",
    "egress-whole": "nat_egress",
    "pod-side-snat": "nat_egress",
    "pod-side-other": "",  # nothing of ours: counted by no reason
}


@dataclass
class DatapathBench:
    params: Params
    lab: Lab = field(init=False)
    pin: str = field(init=False)
    _links: list[int] = field(default_factory=list)
    _variant_fd: int | None = None
    _pod_next: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        from bench.common import TAG

        self.lab = Lab(f"{TAG}-dp", pods=(POD_W, POD_F, POD_P))
        self.pin = pin_dir("dp")

    # -- set-up ------------------------------------------------------------------------------

    def _ifindex(self, ns: str, dev: str) -> int:
        return self.lab.in_ns(ns, lambda: socket.if_nametoindex(dev))

    def setup(self) -> None:
        lab = self.lab
        lab.up()
        # a veth without an XDP program takes XDP_TX frames only with GRO on (NAPI mode)
        for dev in (UPLINK, POD_W.host_dev, POD_F.host_dev, POD_P.host_dev):
            lab.exec(lab.node, "ethtool", "-K", dev, "gro", "on")
        self.gen = progs.Generator.load()
        self.gen_floor = progs.Generator.load(progs.XDP_DROP)
        self.sinks = progs.Sinks.load()
        self.ifindex = {
            "client": self._ifindex(lab.client, "eth0"),
            "pod": self._ifindex(lab.pod_ns(POD_F), "eth0"),
            "pod-w": self._ifindex(lab.pod_ns(POD_W), "eth0"),
            "pod-p": self._ifindex(lab.pod_ns(POD_P), "eth0"),
            "uplink": self._ifindex(lab.node, UPLINK),
        }
        for ns in (lab.client, lab.pod_ns(POD_W), lab.pod_ns(POD_F), lab.pod_ns(POD_P)):
            idx = self._ifindex(ns, "eth0")
            self._links.append(
                lab.in_ns(ns, partial(progs.attach_xdp_native, self.sinks.count_fd, idx))
            )
        # the product's maps, programmed from Services through the model, and its programs
        self.maps = PinnedMaps.ensure(self.pin)
        state = build_state([o for s in SERVICES for o in objects(s)], "cozy-proxy").state
        self.maps.apply(diff(self.maps.read_state(), state))
        self.state = state
        # cz-xdp-ranges: the same Services with source ranges (the client's network among a few)
        self.ranged = state.copy()
        nets = frozenset(ip_network(n) for n in ("198.51.100.0/24", "192.0.2.128/25", "10.0.0.0/8"))
        self.ranged.ranges = {e.pod_ip: nets for e in state.services.values()}
        log("compiling cozyebpf's programs (bcc), with and without per-Service counters")
        # the build without first: each load puts its full paths into the pinned prog arrays,
        # and the product's should be there (the bench's frames all take the fast paths)
        nosvc = ["-DCZ_NO_SVC_STATS"]
        self.nosvc_ingress = loader.load("ingress.c", "cz_ingress", "xdp", self.pin, nosvc)
        self.nosvc_egress = loader.load("egress.c", "cz_egress", "sched_cls", self.pin, nosvc)
        self.nospoof_egress = variant.build("egress_nocheck.c", "cz_egress", "sched_cls", self.pin)
        self.cz_ingress = loader.load("ingress.c", "cz_ingress", "xdp", self.pin)
        self.cz_ingress_tc = loader.load("ingress_tc.c", "cz_ingress_tc", "sched_cls", self.pin)
        self.cz_egress = loader.load("egress.c", "cz_egress", "sched_cls", self.pin)
        self.cz_pod = loader.load("pod.c", "cz_pod_ingress", "sched_cls", self.pin)
        self.monitor: Any = None
        self.minimal = progs.MinimalNat.load()
        self.minimal.seed(
            {str(lb): (str(e.pod_ip), e.port_filter) for lb, e in state.services.items()},
            [(str(a.pod_ip), int(a.proto), a.port) for a in state.allowed],
        )
        self.nft_mappings = [(str(lb), str(e.pod_ip)) for lb, e in state.services.items()]
        self.nft_allowed = [
            (str(a.pod_ip), a.proto.name.lower(), a.port) for a in sorted(state.allowed)
        ]
        self.nft_filtered = [str(e.pod_ip) for e in state.services.values() if e.port_filter]

    def teardown(self) -> None:
        with contextlib.suppress(Exception):
            self._variant_down("nft")
        for fd in self._links:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._links.clear()
        if getattr(self, "maps", None):
            self.maps.close()
        with contextlib.suppress(Exception):
            attach.detach_all(self.pin)
        self.lab.down()

    # -- variants ----------------------------------------------------------------------------

    def _variant_up(self, v: str) -> None:
        lab, pin = self.lab, self.pin
        if v in ("nft", "nft-noct"):
            rules = full_ruleset(
                self.nft_mappings, self.nft_allowed, self.nft_filtered, conntrack=v == "nft"
            )
            lab.exec(lab.node, "nft", "-f", "-", input=rules)
        elif v in (
            "cz-xdp",
            "cz-xdp-nosvc",
            "cz-xdp-nospoof",
            "cz-xdp-mon",
            "cz-xdp-ranges",
            "cz-pod",
            "cz-xdp-podnext",
        ):
            self._cozyebpf_up(v)
        elif v == "cz-tcx":
            lab.in_ns(
                lab.node,
                lambda: attach.attach_tc(
                    self.cz_ingress_tc.fd, "cz_ingress_tc", UPLINK, pin, "ingress", "tcx"
                ),
            )
            lab.in_ns(
                lab.node,
                lambda: attach.attach_tc(
                    self.cz_egress.fd, "cz_egress", UPLINK, pin, "egress", "tcx"
                ),
            )
        elif v in ("xdp-drop", "xdp-pass", "min-xdp"):
            idx = self.ifindex["uplink"]
            fd = {"xdp-drop": self.sinks.drop_fd, "xdp-pass": self.sinks.pass_fd}.get(
                v, self.minimal.fd
            )
            self._variant_fd = lab.in_ns(lab.node, lambda: progs.attach_xdp_native(fd, idx))
        elif v in ("tc-next", "min-snat"):
            idx = self.ifindex["uplink"]
            fd = self.sinks.tc_next_fd if v == "tc-next" else self.minimal.snat_fd
            self._variant_fd = lab.in_ns(
                lab.node, lambda: bpfsys.link_create(fd, idx, bpfsys.BPF_TCX_EGRESS)
            )

    def _cozyebpf_up(self, v: str) -> None:
        """The product's XDP ingress and tcx egress on the uplink (the build `v` names), and
        what the variant adds: source ranges, a monitor, the pod-facing hook or a bare TCX_NEXT
        on the pods' devices."""
        lab, pin = self.lab, self.pin
        if v == "cz-xdp-ranges":
            self.maps.apply(diff(self.maps.read_state(), self.ranged))
        ing, eg = (
            (self.nosvc_ingress, self.nosvc_egress)
            if v == "cz-xdp-nosvc"
            else (self.cz_ingress, self.nospoof_egress)
            if v == "cz-xdp-nospoof"
            else (self.cz_ingress, self.cz_egress)
        )
        lab.in_ns(lab.node, lambda: attach.attach_xdp(ing.fd, UPLINK, pin))
        lab.in_ns(
            lab.node,
            lambda: attach.attach_tc(eg.fd, "cz_egress", UPLINK, pin, "egress", "tcx"),
        )
        if v == "cz-xdp-mon":
            self.monitor = _RunningMonitor(pin)
        if v == "cz-xdp-podnext":
            for pod in (POD_W, POD_F, POD_P):
                idx = self._ifindex(lab.node, pod.host_dev)
                self._pod_next.append(
                    lab.in_ns(
                        lab.node,
                        partial(
                            bpfsys.link_create, self.sinks.tc_next_fd, idx, bpfsys.BPF_TCX_INGRESS
                        ),
                    )
                )
        if v == "cz-pod":
            self.maps.set_node([self.ifindex["uplink"]], True)
            for pod in (POD_W, POD_F, POD_P):
                lab.in_ns(
                    lab.node,
                    partial(
                        attach.attach_tc,
                        self.cz_pod.fd,
                        "cz_pod_ingress",
                        pod.host_dev,
                        pin,
                        "ingress",
                        "tcx",
                    ),
                )

    def _variant_down(self, v: str) -> None:
        lab = self.lab
        if v in ("nft", "nft-noct"):
            lab.exec(lab.node, "nft", "delete", "table", "ip", "cozy_proxy", check=False)
        elif v.startswith("cz-"):
            if self.monitor is not None:
                self.monitor.stop()
                self.monitor = None
            if v == "cz-xdp-ranges":
                self.maps.apply(diff(self.maps.read_state(), self.state))
            for hook in ("xdp", "tcx-ingress", "tcx-egress"):
                attach.detach_link(attach.link_pin(self.pin, hook, UPLINK))
            for fd in self._pod_next:
                os.close(fd)
            self._pod_next.clear()
            if v == "cz-pod":
                for pod in (POD_W, POD_F, POD_P):
                    attach.detach_link(attach.link_pin(self.pin, "tcx-ingress", pod.host_dev))
                self.maps.set_node([], False)
        elif self._variant_fd is not None:
            os.close(self._variant_fd)
            self._variant_fd = None

    @contextlib.contextmanager
    def variant(self, v: str) -> Iterator[None]:
        self._variant_up(v)
        try:
            yield
        finally:
            self._variant_down(v)

    def _seed_reply_flow(self) -> None:
        """The pod opens the flow (one datagram out): conntrack or flow4 learns it."""
        lab = self.lab
        s = lab.ns_socket(lab.pod_ns(POD_F), socket.AF_INET, socket.SOCK_DGRAM)
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((POD_F.ip, POD_EPHEMERAL))
            s.sendto(b"open", (CLIENT_IP, REMOTE_PORT))
        time.sleep(0.02)

    # -- measuring ---------------------------------------------------------------------------

    def _cz_count(self, reason: str) -> int:
        return int(self.maps.counters().get(reason, {}).get("packets", 0))

    def measure(self, path: str, variant: str, rep: int, seconds: float) -> Measurement:
        side, frame = _frames(path, variant)
        gen = self.gen_floor if variant == "gen-only" else self.gen
        gen.set_frame(frame)
        ns = {
            "client": self.lab.client,
            "pod": self.lab.pod_ns(POD_F),
            "pod-w": self.lab.pod_ns(POD_W),
            "pod-p": self.lab.pod_ns(POD_P),
        }[side]
        ifindex = self.ifindex[side]
        reason = EXPECTED_REASON[path]
        chunk = 131072

        def run() -> tuple[int, float]:
            # warm-up (first pages of the pool, caches), then the timed loop
            bpfx.xdp_live_run(gen.fd, frame, ifindex, 8192)
            time.sleep(0.005)
            return 0, 0.0

        def timed() -> tuple[int, float, float]:
            n = 0
            t0, c0 = time.perf_counter(), time.thread_time()
            while True:
                bpfx.xdp_live_run(gen.fd, frame, ifindex, chunk)
                n += chunk
                el = time.perf_counter() - t0
                if el >= seconds:
                    return n, el, time.thread_time() - c0

        self.lab.in_ns(ns, run)
        c0, z0 = self.sinks.counted(), self._cz_count(reason)
        k0 = _ksoftirqd_seconds()
        n, el, cpu = self.lab.in_ns(ns, timed)
        time.sleep(0.005)  # the last batch's softirq
        cpu += _ksoftirqd_seconds() - k0
        delivered = self.sinks.counted() - c0
        counter = self._cz_count(reason) - z0 if variant.startswith("cz-") else 0
        return Measurement(path, variant, rep, n, el, delivered, counter, cpu)

    def paths(self) -> dict[str, tuple[str, ...]]:
        """The paths to measure: all, or those the COZYEBPF_BENCH_PATHS environment variable
        names (comma-separated), for a focused run while working on one."""
        only = [p for p in os.environ.get("COZYEBPF_BENCH_PATHS", "").split(",") if p]
        return {k: v for k, v in PATHS.items() if not only or k in only}

    def run(self) -> dict[str, Any]:
        p = self.params
        out: list[Measurement] = []
        for rep in range(p.reps):
            for path, variants in self.paths().items():
                k = rep % len(variants)
                for v in variants[k:] + variants[:k]:
                    with self.variant(v):
                        if path == "reply":
                            self._seed_reply_flow()
                        m = self.measure(path, v, rep, p.seconds)
                    out.append(m)
                    log(
                        f"datapath rep {rep + 1}/{p.reps} {path:13s} {v:9s} "
                        f"{m.pps / 1e6:6.2f} Mpps per busy core, {m.wall_pps / 1e6:5.2f} by wall "
                        f"clock (cpu {m.cpu_seconds / m.seconds:.0%}; sent {m.sent}, "
                        f"delivered {m.delivered}"
                        + (f", counted {m.counter}" if v.startswith("cz-") else "")
                        + ")"
                    )
        insitu = self.in_situ()
        return {
            "measurements": [m.as_dict() for m in out],
            "summary": summarize(out),
            "in_situ_ns_per_packet": insitu,
            "frame_bytes": 60,
        }

    def in_situ(self) -> dict[str, Any]:
        """One more pass of the cozyebpf variants with run-time stats on: the ns our program
        spends per packet inside the real datapath (stats add ~2 clock reads per run, so this
        pass is not used for the rates)."""
        res: dict[str, Any] = {}
        fd = bpfx.enable_stats()
        try:
            for path, variants in self.paths().items():
                for v in variants:
                    if not v.startswith("cz-"):
                        continue
                    if v == "cz-xdp-nosvc":
                        prog = self.nosvc_egress if path == "egress-snat" else self.nosvc_ingress
                    elif v == "cz-xdp-nospoof":
                        prog = self.nospoof_egress
                    elif v == "cz-pod":
                        prog = self.cz_pod  # the hook's own cost (the uplink's egress runs too)
                    elif path.startswith(("egress-", "pod-side-")):
                        prog = self.cz_egress
                    else:
                        prog = self.cz_ingress_tc if v == "cz-tcx" else self.cz_ingress
                    with self.variant(v):
                        if path == "reply":
                            self._seed_reply_flow()
                        s0 = bpfx.prog_run_stats(prog.fd)
                        self.measure(path, v, -1, min(0.3, self.params.seconds))
                        s1 = bpfx.prog_run_stats(prog.fd)
                    runs = s1.run_cnt - s0.run_cnt
                    ns = (s1.run_time_ns - s0.run_time_ns) / runs if runs else float("nan")
                    res[f"{path}/{v}"] = {"program": prog.name, "runs": runs, "ns": round(ns, 1)}
        finally:
            os.close(fd)
        return res


class _RunningMonitor:
    """`cozyebpf monitor --type all` at its default rate, in a thread: the events switched on
    and read from the ring buffer while a variant is measured."""

    def __init__(self, pin: str) -> None:
        import threading

        from cozyebpf.monitor import Monitor

        self.mon = Monitor(pin, "all")
        self.mon.start()
        self.events = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            self.events += len(self.mon.poll(0.1))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        _, lost = self.mon.stop()
        log(f"monitor: {self.events} events read, {lost}")


CLK_TCK = os.sysconf("SC_CLK_TCK")


def _ksoftirqd_seconds() -> float:
    """CPU time of every ksoftirqd thread: softirq work deferred out of the generator's context
    (rare here, but counted)."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                st = f.read()
        except OSError:
            continue
        if "(ksoftirqd/" in st:
            fields = st.rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def summarize(ms: list[Measurement]) -> dict[str, dict[str, dict[str, float]]]:
    """path -> variant -> {mpps, ns_per_packet, n, loss, spread}."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for path, variants in PATHS.items():
        out[path] = {}
        for v in variants:
            rates = [m.pps for m in ms if m.path == path and m.variant == v]
            if not rates:
                continue
            mp = median(rates)
            wall = median([m.wall_pps for m in ms if m.path == path and m.variant == v])
            sent = sum(m.sent for m in ms if m.path == path and m.variant == v)
            dl = sum(m.delivered for m in ms if m.path == path and m.variant == v)
            out[path][v] = {
                "mpps": round(mp / 1e6, 3),
                "ns_per_packet": round(1e9 / mp, 1) if mp else float("nan"),
                "min_mpps": round(min(rates) / 1e6, 3),
                "max_mpps": round(max(rates) / 1e6, 3),
                "wall_mpps": round(wall / 1e6, 3),
                "n": len(rates),
                "delivered_fraction": round(dl / sent, 4) if sent else 0.0,
            }
    return out


def main_datapath(params: Params) -> dict[str, Any]:
    b = DatapathBench(params)
    try:
        log("datapath: building the lab")
        b.setup()
        return b.run()
    finally:
        b.teardown()
