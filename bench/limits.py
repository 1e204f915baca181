"""Limits per public IP (issue 38) with real traffic: the real agent (`python -m cozyebpf run`,
a manifest file) in the node namespace of a cozylab.netns.Lab, TCP through it, a flood at it.

    client ns               node ns (the agent: XDP, tcx egress)          pod ns
    eth0 198.51.100.2 ===== uplink           lxc-pod1 ====================== vm-acc 10.244.1.10
      TCP senders/receivers                  lxc-pod2 ====================== vm-b   10.244.1.20
      bench_gen (the flood)                  lxc-pod3 ====================== vm-a   10.244.1.30
                                                                            (bench_count)

Three whole-IP Services: vm-acc (203.0.113.10), vm-b (203.0.113.20), vm-a (203.0.113.30).
The part runs on this single node and on a Kube-OVN-shaped one (NODES, --limits-nodes): the
same client, uplink and Services, the pods behind ovn0 (bench/kovnnode.py), where the agent's
pod-facing hook translates and polices egress.

1. Accuracy: TCP goodput (the bytes the receivers read, per second of a window that follows a
   warm-up long enough to empty the burst) from the client to vm-acc's LB IP through its
   ingressBandwidth (`ingress`), and from vm-acc to the client through its egressBandwidth
   (`egress`), at 10M, 100M and 1G, with 1 and 8 parallel flows, and the same without a limit
   in the same run: a limit the path does not exceed by REACHABLE without it is "not reachable
   here", not a miss. `egress-nogso` is `egress` with TSO and GSO off on vm-acc's eth0, so that
   the uplink's egress polices its segments one by one instead of 64 KiB GSO packets.
   `egress-shaped` is `egress` with fq as the uplink's root qdisc (`tc qdisc replace dev
   uplink root fq` for the row, the veth's default noqueue back after it): there the agent
   shapes vm-acc's egress (sets each packet's departure time, which fq holds it until) instead
   of policing it, and drops only what would leave more than the burst ahead. Before the row
   the agent must say so (`cozyebpf status --json`: the Service's limits[].egress "shaped"; it
   follows the uplinks' qdiscs over netlink); each row records what status said, the agent's
   drop_limit and fq's own drops (flows_plimit: a flow's 100 packets; the rest: its limit of
   10,000 or its horizon) in the window. Where the kernel has no fq (sch_fq), the row is not
   measured and the part says why (bench/guest.py runs the part in a Debian guest). The
   senders' congestion control is set per socket: cubic (Linux's default; the targets), and in
   full runs also bbr (this VM's kernel default). The retransmissions the limit causes:
   tcpi_total_retrans of the senders (TCP_INFO) and the sender namespace's retransmission
   timeouts (TcpExt TCPTimeouts) over the window.
2. Isolation: vm-b's TCP goodput (one flow in, then one out) while vm-a's LB IP is flooded by
   the in-kernel generator (60-byte UDP, one 5-tuple: bench_gen as fast as one thread makes
   it, and bench_gen_paced at FIXED_FLOOD packets/s), against the same without the flood (the
   three in turns, the order turned per repetition), in four configurations of the node: the
   agent with its default guard (1M packets/s for every Service without a rate of its own),
   with the guard at LAB_GUARD (the default is more than the flood the node forwards here: see
   below), with the guard off (--guard-packet-rate 0), and cozy-proxy's nftables ruleset
   (bench/nftrules.py) with the agent stopped and the datapath detached. vm-b's demand is
   capped by the sender's pacing (SO_MAX_PACING_RATE, B_DEMAND): its rate alone is then the
   same in every configuration and far below what the path carries, so what it loses under the
   flood is the flood's doing, not the sender's share of the CPUs (its unpaced rate would fall
   under any product: the generator takes one of the two CPUs).

What the 2-vCPU VM shows and does not: the flood's frames and vm-b's share the uplink's one
receive ring (a veth's, 256 entries) and its NAPI, as a NIC queue's would be shared, but the
flood's work on the node runs in the generator thread's softirq, on the generator's CPU: the
node does not have CPUs of its own, and a flood that the node forwards slows the generator
(the flood's rate is recorded per configuration): a slower datapath gets a smaller flood.
The lab's round-trip time is tens of microseconds (this kernel has no netem to add one): far
below the 50 ms the bursts are sized for. Other jobs on the machine share both CPUs: each
measurement records the CPU they took.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from bench import bpfx, progs
from bench.common import REPO, TAG, Params, cpu_busy, loadavg, log, pin_dir, terminate
from bench.datapath import _ksoftirqd_seconds
from bench.frames import udp_frame
from bench.kovnnode import MTU as KOVN_MTU
from bench.kovnnode import OVN0, KubeOvnNodeLab
from bench.limits_params import (
    ANN,
    B_CPU,
    B_DEMAND,
    CONFIGS,
    DEFAULT_GUARD,
    FIXED_FLOOD,
    FLOOD_CPU,
    FLOODS,
    FQ_COUNTERS,
    GUARD_FLAG,
    LAB_GUARD,
    LB_A,
    LB_ACC,
    LB_B,
    MODE_WAIT,
    NODE_LABELS,
    POD_A,
    POD_ACC,
    POD_B,
    SHAPED,
    Settings,
    frame_mss,
)
from bench.limits_report import summarize_accuracy, summarize_isolation
from bench.nftrules import full_ruleset
from bench.tcpflows import TcpRun, measure_tcp
from cozyebpf.datapath.maps import PinnedMaps
from cozyebpf.model.compose import enforced_limits
from cozyebpf.model.limits import parse_quantity, read_limits
from cozyebpf.state import Limits
from cozylab.k8s import Svc, manifest
from cozylab.netns import CLIENT_IP, CLIENT_MAC, UPLINK, UPLINK_MAC, Lab, Pod, wait_for

# -- the agent -------------------------------------------------------------------------------


@dataclass
class Agent:
    """`python -m cozyebpf run` in the lab's node namespace, on a manifest file."""

    lab: Lab
    pin: str
    tmp: Path
    proc: subprocess.Popen[str] | None = None
    guard_pps: int | None = DEFAULT_GUARD

    @property
    def manifest(self) -> Path:
        return self.tmp / "services.yaml"

    @property
    def log_path(self) -> Path:
        return self.tmp / "agent.log"

    def log_text(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def start(self, guard: str | None = None) -> None:
        """Start it (--guard-packet-rate `guard`; None: the default) and wait for its datapath."""
        self.guard_pps = DEFAULT_GUARD if guard is None else _bits(guard) or None
        offset = len(self.log_text())
        cmd = [sys.executable, "-m", "cozyebpf", "run", "--manifests", str(self.manifest),
               "--devices", UPLINK, "--pin-dir", self.pin, "--poll-interval", "0.1",
               "--resync-interval", "3600", "--check-interval", "3600",
               "--log-level", "info"]  # fmt: skip
        if guard is not None:
            cmd += ["--guard-packet-rate", guard]
        with self.log_path.open("a") as out:
            self.proc = self.lab.popen(
                self.lab.node,
                *cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
        t0 = time.monotonic()
        wait_for(
            lambda: "datapath ready" in self.log_text()[offset:] or self.exited(),
            300,  # a bound for a hang: bcc compiles slowly on a busy machine
            "the agent's datapath",
        )
        if self.exited():
            raise RuntimeError(f"the agent exited:\n{self.log_text()[offset:][-3000:]}")
        log(f"limits: agent up (guard {guard or 'default'}) in {time.monotonic() - t0:.1f}s")

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def stop(self, detach: bool = True) -> None:
        terminate(self.proc)
        self.proc = None
        if detach:
            self.lab.exec(self.lab.node, sys.executable, "-m", "cozyebpf", "detach",
                          "--pin-dir", self.pin, check=False)  # fmt: skip

    def set_services(self, *svcs: Svc) -> None:
        """Write the manifest (atomically) and wait until the maps hold each Service's limits as
        the datapath enforces them (its own; the guard for a packet rate it does not set)."""
        tmp = self.manifest.with_suffix(".tmp")
        tmp.write_text(manifest(*svcs))
        os.replace(tmp, self.manifest)
        want = {f"default/{s.name}": self.enforced(s) for s in svcs}

        def programmed() -> bool:
            with PinnedMaps.open(self.pin) as m:
                st = m.read_state()
            have = {k: st.limits.get(k, Limits()) for k in want}
            return have == want and len(st.services) == len(svcs)

        wait_for(programmed, 20, lambda: f"the limits in the maps:\n{self.log_text()[-2000:]}")

    def enforced(self, s: Svc) -> Limits:
        """The limits the agent programs for `s`: the product's own rules (read_limits,
        enforced_limits), so that the bench waits for what the agent does."""
        own, errors = read_limits(s.annotations)
        assert not errors, errors
        return enforced_limits(own, self.guard_pps, self.guard_pps)  # the ceiling: the guard's

    def counters(self) -> dict[str, int]:
        with PinnedMaps.open(self.pin) as m:
            return {k: v["packets"] for k, v in m.counters().items()}

    def egress_mode(self, service: str) -> str | None:
        """What `cozyebpf status --json` says of the Service's egress limit ("policed",
        "shaped"; None: it has none)."""
        p = self.lab.exec(self.lab.node, sys.executable, "-m", "cozyebpf", "status", "--json",
                          "--pin-dir", self.pin)  # fmt: skip
        limits = json.loads(p.stdout)["datapath"].get("limits", [])
        return next((x.get("egress") for x in limits if x["service"] == service), None)


def _bits(q: str | None) -> int | None:
    return None if q is None else parse_quantity(q)


def _svc(name: str, lb: str, pod: Pod, **annotations: str) -> Svc:
    return Svc(name, lb, pod.ip, [("TCP", 5001)], whole_ip="true",
               annotations={ANN + k: v for k, v in annotations.items()})  # fmt: skip


# -- the flood -------------------------------------------------------------------------------


@dataclass
class PacedGenerator:
    """bench_gen_paced (bench/bpf/gen_paced.c): bench_gen's template, one frame sent every
    1/pps s of the run and the other live frames dropped, so that one long BPF_PROG_RUN call
    offers a fixed rate (short calls and sleeps cannot: each call costs some 20 ms)."""

    bpf: Any
    fd: int

    @classmethod
    def load(cls) -> PacedGenerator:
        from bcc import BPF

        b = BPF(src_file=str(progs.BPF_DIR / "gen_paced.c").encode())
        return cls(b, b.load_func(b"bench_gen_paced", BPF.XDP).fd)

    def set(self, frame: bytes, pps: int) -> None:
        """The template and the rate; the count of frames sent starts at 0."""
        assert len(frame) == 60, len(frame)
        t = self.bpf[b"pace"]
        v = t.Leaf()
        ctypes.memmove(ctypes.addressof(v), frame + bytes(4), 64)
        v.gap_ns, v.next_ns, v.sent = 10**9 // pps, 0, 0
        t[ctypes.c_int(0)] = v

    def sent(self) -> int:
        return int(self.bpf[b"pace"][ctypes.c_int(0)].sent)


@dataclass
class Flood:
    """60-byte UDP to vm-a's LB IP from the client's eth0 (XDP live frames, XDP_TX to the
    node's uplink, whose NAPI takes each batch of 64 in the same softirq), in one thread until
    stopped: bench_gen as fast as the thread goes, or at `pps` bench_gen_paced."""

    lab: Lab
    gen: progs.Generator
    paced: PacedGenerator
    ifindex: int
    pps: int | None = None  # the offered rate; None: as fast as the thread goes
    on_cpu: int | None = None  # the CPU of the generator's thread (None: any)
    sent: int = 0
    cpu: float = 0.0
    seconds: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    error: str | None = None

    def start(self) -> Flood:
        frame = udp_frame(CLIENT_MAC, UPLINK_MAC, CLIENT_IP, LB_A, 1000, 9)
        if self.pps:
            self.paced.set(frame, self.pps)
            fd = self.paced.fd
        else:
            self.gen.set_frame(frame)
            fd = self.gen.fd
        self._stop.clear()

        def loop() -> None:
            if self.on_cpu is not None:
                os.sched_setaffinity(0, {self.on_cpu})  # this thread
            # a call costs some 20 ms of set-up and tear-down, besides its frames: the paced
            # generator's calls are long (mostly cheap drops), so that they pace, not the calls
            chunk, runs = (1 << 22 if self.pps else 65536), 0
            t0, c0 = time.monotonic(), time.thread_time()
            try:
                while not self._stop.is_set():
                    bpfx.xdp_live_run(fd, frame, self.ifindex, chunk)
                    runs += chunk
            except OSError as e:
                self.error = str(e)
            self.seconds, self.cpu = time.monotonic() - t0, time.thread_time() - c0
            self.sent = self.paced.sent() if self.pps else runs

        self._thread = threading.Thread(
            target=self.lab.in_ns, args=(self.lab.client, loop), daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(10)
        if self.error:
            raise RuntimeError(f"the flood's generator: {self.error}")


# -- the bench -------------------------------------------------------------------------------


@dataclass
class LimitsBench:
    params: Params
    node: str = "single"  # NODES
    settings: Settings = field(init=False)
    lab: Lab = field(init=False)
    agent: Agent = field(init=False)
    _links: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.settings = Settings.make(self.params)
        pods = (POD_ACC, POD_B, POD_A)
        if self.node == "kubeovn":
            self.lab = KubeOvnNodeLab(f"{TAG}-limk", pods=pods)
        else:
            self.lab = Lab(f"{TAG}-lim", pods=pods)
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{TAG}-lim-"))
        self.agent = Agent(self.lab, pin_dir(f"lim-{self.node}"), self.tmp)
        self.fq_missing: str | None = None
        self.lab_mtu = KOVN_MTU if self.node == "kubeovn" else 1500  # the pods'

    def setup(self) -> None:
        self.lab.up()
        # XDP_TX frames into a veth whose peer has no XDP program (nft's configuration) need
        # GRO on there; on in every configuration, so that they compare
        self.lab.exec(self.lab.node, "ethtool", "-K", UPLINK, "gro", "on")
        self.gen = progs.Generator.load()
        self.paced = PacedGenerator.load()
        self.sinks = progs.Sinks.load()
        self.client_eth0 = self.lab.in_ns(self.lab.client, lambda: socket.if_nametoindex("eth0"))
        a_ns = self.lab.pod_ns(POD_A)
        a_eth0 = self.lab.in_ns(a_ns, lambda: socket.if_nametoindex("eth0"))
        # vm-a takes the flood: bench_count (native XDP) counts and drops what reaches it
        link = partial(progs.attach_xdp_native, self.sinks.count_fd, a_eth0)
        self._links.append(self.lab.in_ns(a_ns, link))
        self.fq_missing = self._probe_fq()
        if self.fq_missing:
            self.settings = replace(self.settings, shaped=False)
            log(f"limits: no egress-shaped rows: fq cannot be the uplink's qdisc here "
                f"({self.fq_missing})")  # fmt: skip

    def teardown(self) -> None:
        for fd in self._links:
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(Exception):
            self.agent.stop()
        self.lab.down()
        subprocess.run(["rm", "-rf", str(self.tmp)], check=False)

    def services(self, acc: str | None = None) -> tuple[Svc, ...]:
        """The three Services, vm-acc with ingress and egress limits of `acc` (None: none)."""
        acc_ann = {"ingressBandwidth": acc, "egressBandwidth": acc} if acc else {}
        return (
            _svc("vm-acc", LB_ACC, POD_ACC, **acc_ann),
            _svc("vm-b", LB_B, POD_B),
            _svc("vm-a", LB_A, POD_A),
        )

    def tcp(
        self,
        direction: str,
        pod: Pod,
        lb: str,
        flows: int,
        pacing: int | None,
        cc: str = "cubic",
        cpu: int | None = None,
    ) -> TcpRun:
        """Client -> the pod's LB IP (ingress), or the pod -> the client (egress); its threads
        on `cpu` if given."""
        ns = self.lab.pod_ns(pod)
        if direction == "ingress":
            return TcpRun(self.lab, self.lab.client, ns, "0.0.0.0", lb, flows, pacing, cc, cpu=cpu)
        return TcpRun(
            self.lab, ns, self.lab.client, CLIENT_IP, CLIENT_IP, flows, pacing, cc, cpu=cpu
        )

    def _queues(self, layout: str) -> None:
        """The uplink pair (the client's eth0, the node's uplink) in `layout` (LAYOUTS): its
        queues each way (ethtool -L: a veth has as many as CPUs at most), and with two, XPS on
        both ends (a packet sent on CPU n leaves by queue n, so its peer's NAPI on queue n runs
        on CPU n; the flood's XDP frames take the queue of their CPU anyway)."""
        n = 2 if layout == "rss" else 1
        ends = [(self.lab.node, UPLINK), (self.lab.client, "eth0")]
        # a veth with XDP keeps at least as many receive queues as its peer sends on (EINVAL):
        # the uplink's grow first and shrink last
        for ns, dev in ends if n > 1 else ends[::-1]:
            self.lab.exec(ns, "ethtool", "-L", dev, "rx", str(n), "tx", str(n))
            for q in range(n if n > 1 else 0):
                # sysfs shows a namespace's devices to a process that mounted it there
                cmd = f"echo {1 << q:x} > /sys/class/net/{dev}/queues/tx-{q}/xps_cpus"
                subprocess.run(["ip", "netns", "exec", ns, "sh", "-c", cmd], check=True)

    def _gso(self, on: bool) -> None:
        """TSO and GSO of vm-acc's eth0 (its TCP then hands the node single segments)."""
        v = "on" if on else "off"
        self.lab.exec(self.lab.pod_ns(POD_ACC), "ethtool", "-K", "eth0", "tso", v, "gso", v)

    def _root_qdisc(self) -> str:
        out = self.lab.exec(self.lab.node, "tc", "-j", "qdisc", "show", "dev", UPLINK).stdout
        return next((q["kind"] for q in json.loads(out) if q.get("root")), "")

    def _probe_fq(self) -> str | None:
        """None where fq can be the uplink's root qdisc (the veth's noqueue is put back), else
        why not (tc's error: this kernel without sch_fq says "Specified qdisc kind is
        unknown")."""
        root = self._root_qdisc()
        if root != "noqueue":
            raise RuntimeError(
                f"the lab's {UPLINK} has a root qdisc {root!r}, not a veth's noqueue"
            )
        p = self.lab.exec(self.lab.node, "tc", "qdisc", "replace", "dev", UPLINK, "root", "fq",
                          check=False)  # fmt: skip
        if p.returncode:
            return f"tc qdisc replace dev {UPLINK} root fq: {p.stderr.strip()}"
        self._fq(False)
        return None

    def _fq(self, on: bool) -> None:
        """fq as the uplink's root qdisc, or the veth's default (noqueue) back."""
        if on:
            self.lab.exec(self.lab.node, "tc", "qdisc", "replace", "dev", UPLINK, "root", "fq")
        else:
            self.lab.exec(self.lab.node, "tc", "qdisc", "del", "dev", UPLINK, "root")
            assert self._root_qdisc() == "noqueue", self._root_qdisc()

    def fq_stats(self) -> dict[str, int]:
        """FQ_COUNTERS of the uplink's root fq (`tc -s -j qdisc show`; 0 for what tc leaves out
        when it is 0)."""
        out = self.lab.exec(self.lab.node, "tc", "-s", "-j", "qdisc", "show", "dev", UPLINK).stdout
        q = next(q for q in json.loads(out) if q.get("root"))
        assert q["kind"] == "fq", q
        return {k: int(q.get(k, 0)) for k in FQ_COUNTERS}

    def _drops(self, shaped: bool) -> dict[str, int]:
        """The agent's drop_limit, and with fq fq's counters (fq_<name>): `counters` of a row."""
        out = {"drop_limit": self.agent.counters().get("drop_limit", 0)}
        if shaped:
            out |= {f"fq_{k}": v for k, v in self.fq_stats().items()}
        return out

    def _egress_mode(self, lim: str | None, shaped: bool) -> str | None:
        """What status says of vm-acc's egress limit (None without one), once it says what the
        row wants ("shaped" with fq, else "policed") or, when it does not within MODE_WAIT, what
        it says then (the row goes on: a cozyebpf that does not shape still measures)."""
        if lim is None:
            return None
        want = SHAPED if shaped else "policed"
        deadline = time.monotonic() + MODE_WAIT
        while (mode := self.agent.egress_mode("default/vm-acc")) != want:
            if time.monotonic() > deadline:
                log(f"limits: status says vm-acc's egress is {mode!r}, not {want!r}: measuring")
                break
            time.sleep(0.2)
        return mode

    # -- accuracy ----------------------------------------------------------------------------

    def accuracy(self) -> dict[str, Any]:
        s = self.settings
        limits = [None, *s.limits]
        runs: list[dict[str, Any]] = []
        for rep in range(s.reps):
            k = rep % len(limits)
            for lim in limits[k:] + limits[:k]:
                self.agent.set_services(*self.services(acc=lim))
                for cc in s.ccs:
                    for direction in s.directions(cc):
                        runs += self._accuracy_rows(direction, lim, cc, rep)
        self._gso(True)
        self.agent.set_services(*self.services())
        rows = summarize_accuracy(runs, s, *frame_mss(self.lab_mtu))
        out: dict[str, Any] = {"runs": runs, "rows": rows}
        if self.fq_missing:
            out["shaped_missing"] = self.fq_missing
        return out

    def _accuracy_rows(
        self, direction: str, lim: str | None, cc: str, rep: int
    ) -> list[dict[str, Any]]:
        """A row per number of flows: vm-acc's GSO off for egress-nogso, fq the uplink's root
        qdisc for egress-shaped (noqueue back after it); status asked first for egress."""
        shaped = direction == "egress-shaped"
        self._gso(direction != "egress-nogso")
        if shaped:
            self._fq(True)
        try:
            mode = self._egress_mode(lim, shaped) if direction.startswith("egress") else None
            return [
                self._accuracy_row(direction, lim, flows, cc, rep, mode)
                for flows in self.settings.flows
            ]
        finally:
            if shaped:
                self._fq(False)

    def _accuracy_row(
        self, direction: str, lim: str | None, flows: int, cc: str, rep: int, mode: str | None
    ) -> dict[str, Any]:
        s = self.settings
        tcp = self.tcp(direction, POD_ACC, LB_ACC, flows, None, cc)
        shaped = direction == "egress-shaped"
        r = measure_tcp(tcp, s.warmup, s.window, partial(self._drops, shaped))
        r.update(rep=rep, limit=lim or "none", direction=direction, flows=flows, cc=cc)
        r.update(mode=mode)
        c = r["counted"]
        log(
            f"limits accuracy rep {rep + 1}/{s.reps} {cc:5s} {direction:13s} limit "
            f"{lim or 'none':4s} {flows} flow(s): {r['goodput_bps'] / 1e6:8.1f} Mbit/s "
            f"(kernel {r['received_bps'] / 1e6:.1f}), "
            f"{r['retrans']} retransmitted, {r['timeouts']} RTOs, drop_limit {c['drop_limit']}"
            + (f", fq drops {c['fq_drops']} ({c['fq_flows_plimit']} flow limit)" if shaped else "")
            + (f", status {mode}" if mode else "")
            + f", other jobs {r['others_cpus']:.2f} CPUs"
        )
        return r

    # -- isolation ---------------------------------------------------------------------------

    def _b_rate(
        self, direction: str, flood: str | None, pacing: int | None, layout: str = "one-queue"
    ) -> dict[str, Any]:
        """vm-b's TCP in `direction`, alone (`flood` None) or with vm-a flooded ("full": as fast
        as the generator goes; "fixed": FIXED_FLOOD packets/s), the uplink pair in `layout`
        (with "rss" the flood's thread on FLOOD_CPU, vm-b's on B_CPU)."""
        s = self.settings
        pps = FIXED_FLOOD if flood == "fixed" else None
        rss = layout == "rss"
        fl = Flood(
            self.lab, self.gen, self.paced, self.client_eth0, pps, FLOOD_CPU if rss else None
        )
        c0 = self.sinks.counted()
        d0 = self.agent.counters().get("drop_limit", 0) if self.agent.proc else 0
        k0 = _ksoftirqd_seconds()
        if flood:
            fl.start()
            time.sleep(0.2)
        try:
            tcp = self.tcp(direction, POD_B, LB_B, 1, pacing, cpu=B_CPU if rss else None)
            r = measure_tcp(tcp, s.warmup, s.window)
        finally:
            if flood:
                fl.stop()
        r["flood"] = flood
        if flood and fl.seconds:
            drops = self.agent.counters().get("drop_limit", 0) - d0 if self.agent.proc else None
            r["flood_stats"] = {
                "sent_pps": round(fl.sent / fl.seconds),
                "to_vm_a_pps": round((self.sinks.counted() - c0) / fl.seconds),
                "drop_limit_pps": None if drops is None else round(drops / fl.seconds),
                "generator_cpu_share": round(fl.cpu / fl.seconds, 3),
                # softirq work deferred out of the generator's context (vm-b's included)
                "ksoftirqd_cpu_share": round((_ksoftirqd_seconds() - k0) / fl.seconds, 3),
            }
        return r

    def _config(self, c: str) -> None:
        """Bring the node into configuration `c` (the agent restarted where its flags differ)."""
        if c == "nft":
            self.agent.stop()
            wait_for(lambda: not self.agent_links(), 10, "the datapath detached")
            mappings = [(LB_ACC, POD_ACC.ip), (LB_B, POD_B.ip), (LB_A, POD_A.ip)]
            self.lab.exec(self.lab.node, "nft", "-f", "-", input=full_ruleset(mappings))
            return
        # cozy-proxy's table, if the last configuration was nft's
        self.lab.exec(self.lab.node, "nft", "delete", "table", "ip", "cozy_proxy", check=False)
        guard = GUARD_FLAG[c]
        want_guard = DEFAULT_GUARD if guard is None else _bits(guard) or 0
        if self.agent.proc is None or (self.agent.guard_pps or 0) != want_guard:
            self.agent.stop(detach=False)
            self.agent.start(guard)
        self.agent.set_services(*self.services())

    def agent_links(self) -> list[str]:
        d = Path(self.agent.pin) / "links"
        return sorted(os.listdir(d)) if d.is_dir() else []

    def isolation(self, layout: str = "one-queue") -> dict[str, Any]:
        """The isolation rows with the uplink pair in `layout` (LAYOUTS)."""
        s = self.settings
        out: dict[str, Any] = {}
        self._queues(layout)
        for c in CONFIGS:
            self._config(c)
            out[c] = {}
            for direction in ("ingress", "egress"):
                runs: list[dict[str, Any]] = []
                for rep in range(s.iso_reps):
                    k = rep % len(FLOODS)
                    for flood in FLOODS[k:] + FLOODS[:k]:
                        r = self._b_rate(direction, flood, B_DEMAND, layout)
                        r["rep"] = rep
                        runs.append(r)
                        fl = r.get("flood_stats")
                        log(
                            f"limits isolation {layout:9s} {c:12s} vm-b {direction:7s} "
                            f"{flood or 'alone':5s}: "
                            f"{r['goodput_bps'] / 1e6:8.1f} Mbit/s, {r['retrans']} "
                            f"retransmitted, other jobs {r['others_cpus']:.2f} CPUs"
                            + (
                                f"; flood {fl['sent_pps'] / 1e6:.2f} Mpps sent, "
                                f"{fl['to_vm_a_pps'] / 1e6:.3f} Mpps to vm-a, generator "
                                f"{fl['generator_cpu_share'] * 100:.0f}% of a CPU, ksoftirqd "
                                f"{fl['ksoftirqd_cpu_share'] * 100:.0f}%"
                                if fl
                                else ""
                            )
                        )
                out[c][direction] = summarize_isolation(runs)
        self._queues("one-queue")
        return out

    def run(self) -> dict[str, Any]:
        busy = cpu_busy(1.0)
        load0 = loadavg()
        self.agent.manifest.write_text(manifest(*self.services()))
        self.agent.start()
        self.agent.set_services(*self.services())
        if self.node == "kubeovn":  # the pod-facing hook, as `--pod-devices auto` finds it
            links = self.agent_links()
            if not any(OVN0 in name for name in links):
                raise RuntimeError(f"the agent has no hook on {OVN0}: its links are {links}")
        acc = self.accuracy() if self.params.limits_accuracy else {"runs": [], "rows": []}
        iso = self.isolation("one-queue") if self.params.limits_isolation else {}
        iso_rss = self.isolation("rss") if self.params.limits_isolation else {}
        return {
            "accuracy": acc,
            "isolation": iso,
            "isolation_rss": iso_rss,
            "settings": self.settings.__dict__,
            "node": self.node,
            "mtu": self.lab_mtu,
            "b_demand_bps": B_DEMAND,
            "lab_guard_pps": parse_quantity(LAB_GUARD),
            "load": {"cpu_busy_before": round(busy, 3), "before": load0, "after": loadavg()},
        }


# -- summaries -------------------------------------------------------------------------------


def main_limits(params: Params) -> dict[str, Any]:
    """The part on each of params.limits_nodes: the single node's figures at the top (as
    before the Kube-OVN node was measured too), each other node's under its name."""
    out: dict[str, Any] = {}
    for node in params.limits_nodes:
        b = LimitsBench(params, node)
        try:
            log(f"limits: building the lab ({NODE_LABELS[node]})")
            b.setup()
            res = b.run()
        finally:
            b.teardown()
        if node == "single":
            out.update(res)
        else:
            out[node] = res
    return out
