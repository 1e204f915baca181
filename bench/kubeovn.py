"""A node as Kube-OVN lays it out (rows kubeovn-*): pods behind one device, `ovn0`, the pod CIDR
routed through it, and natOutgoing's masquerade in nat POSTROUTING (which turns conntrack on for
every packet). Five contenders on the same node, measured in turns (interleaved, rotated per
repetition) in one run:

- bare: no netfilter rules at all (the stack's own limit);
- natout: natOutgoing alone (a VM without a public IP, masqueraded as the node);
- cozy-proxy: natOutgoing plus cozy-proxy's nftables (bench/nftrules.py);
- cozyebpf: natOutgoing plus cozyebpf as the DaemonSet runs it (XDP ingress and tcx egress on
  the uplink, the pod-facing hook on ovn0, --host-routing off);
- cozyebpf-hr: the same with --host-routing on (cz_route_tc behind XDP on the uplink, and what
  cozyebpf translates handed to its next device with bpf_redirect_neigh);
- floor (the plain pod's row only): natOutgoing plus an empty tcx program (TCX_NEXT) where
  cozyebpf has its hooks on that path, ovn0's ingress and the uplink's egress: what any program
  there costs a packet it lets go.

    client ns                node ns                                   ovs ns
    eth0 198.51.100.2/24 === uplink 198.51.100.1/24
                             ovn0 10.245.0.2/16 ======================= ovn0-p (the pods' side)
                             10.244.0.0/16 via 10.245.0.1 dev ovn0

Load is generated in the kernel as in bench/datapath.py (bench_gen, XDP live frames) on the
client's eth0 or on ovn0-p (every pod's frames leave there, as from OVS), and counted by
bench_count on the other end. 60-byte UDP. The pods' side is one device for every pod, as OVS's
internal port is; it is a veth here (OVS's internal port has no XDP transmit, which only the
XDP-redirect design would need: neither contender uses it).
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

from bench import bpfx, progs
from bench.common import TAG, Params, log, median, pin_dir, sh
from bench.frames import udp_frame
from bench.nftrules import full_ruleset
from cozyebpf.datapath import attach, loader
from cozyebpf.datapath.maps import PinnedMaps
from cozyebpf.model import build_state
from cozyebpf.state import diff
from cozylab.k8s import Svc, objects
from cozylab.netns import in_netns

CLIENT, NODE = "198.51.100.2", "198.51.100.1"
CLIENT_MAC, UPLINK_MAC = "02:00:00:00:00:01", "02:00:00:00:00:02"
OVN0_MAC, OVS_MAC = "02:00:00:00:0e:01", "02:00:00:00:0e:02"
JOIN_NODE, JOIN_GW = "10.245.0.2", "10.245.0.1"  # ovn0's address, OVS's router on it
POD_W, POD_F, POD_P = "10.244.1.10", "10.244.1.20", "10.244.1.30"
LB_W, LB_F = "203.0.113.10", "203.0.113.20"
ALLOWED_PORT, POD_PORT, REMOTE_PORT = 80, 40000, 53
#: kubeovn-egress-spread: the whole-IP VM's frames go round SPREAD addresses from REMOTES' first
#: (RFC 2544's benchmark range, routed by the client), one after the other: every FIB answer
#: the programs cache is then asked again before it is asked once more
REMOTES, SPREAD = "198.18.0.0/15", 100_000
SERVICES = (
    Svc("vm-whole", LB_W, POD_W, [("UDP", 5000)], whole_ip="true"),
    Svc("vm-filter", LB_F, POD_F, [("UDP", ALLOWED_PORT), ("TCP", 22)]),
)
CONTENDERS = ("bare", "natout", "cozy-proxy", "cozyebpf", "cozyebpf-hr", "floor")
#: the rows a contender is measured on, where not every row
ONLY_ON = {"floor": ("kubeovn-egress-plain",)}
LABELS = {
    "bare": "no netfilter",
    "natout": "natOutgoing",
    "cozy-proxy": "+ cozy-proxy",
    "cozyebpf": "+ cozyebpf",
    "cozyebpf-hr": "+ cozyebpf, host routing",
    "floor": "natOutgoing + empty hooks",
}
#: row -> (what it is, the side the generator runs on)
ROWS: dict[str, tuple[str, str]] = {
    "kubeovn-egress-whole": ("whole-IP VM -> outside", "ovs"),
    "kubeovn-egress-spread": ("whole-IP VM -> 100,000 remote addresses", "ovs"),
    "kubeovn-egress-filter": ("port-filter VM -> outside", "ovs"),
    "kubeovn-egress-plain": ("a plain pod -> outside (no Service)", "ovs"),
    "kubeovn-ingress-whole": ("outside -> whole-IP VM's LB IP (no NAT: its pod IP)", "client"),
    "kubeovn-ingress-port": ("outside -> allowed port of a port-filter VM", "client"),
    "kubeovn-reply": ("reply to a flow the port-filter VM opened", "client"),
}
NATOUT = """
table ip kovn_nat {
    chain postrouting {
        type nat hook postrouting priority srcnat; policy accept;
        ip saddr 10.244.0.0/16 ip daddr != 10.244.0.0/16 masquerade
    }
}
"""


def _nat(c: str) -> bool:
    """Whether the contender translates a VM's LB IP (else the VM is reached at its pod IP)."""
    return c in ("cozy-proxy", "cozyebpf", "cozyebpf-hr")


def frame(row: str, c: str) -> bytes:
    """The 60-byte frame of `row` for contender `c`."""
    if row == "kubeovn-egress-spread":
        first = str(ip_network(REMOTES)[1])
        return udp_frame(OVS_MAC, OVN0_MAC, POD_W, first, POD_PORT, REMOTE_PORT)
    if row.startswith("kubeovn-egress-"):
        src = {"whole": POD_W, "filter": POD_F, "plain": POD_P}[row.rsplit("-", 1)[1]]
        return udp_frame(OVS_MAC, OVN0_MAC, src, CLIENT, POD_PORT, REMOTE_PORT)
    if row == "kubeovn-ingress-whole":
        dst = LB_W if _nat(c) else POD_W
        return udp_frame(CLIENT_MAC, UPLINK_MAC, CLIENT, dst, 1000, 5000)
    if row == "kubeovn-ingress-port":
        dst = LB_F if _nat(c) else POD_F
        return udp_frame(CLIENT_MAC, UPLINK_MAC, CLIENT, dst, 1000, ALLOWED_PORT)
    # the reply: to the LB IP, the node's address (masqueraded) or the pod IP (no rules)
    dst = LB_F if _nat(c) else NODE if c == "natout" else POD_F
    return udp_frame(CLIENT_MAC, UPLINK_MAC, CLIENT, dst, REMOTE_PORT, POD_PORT)


@dataclass
class Measurement:
    row: str
    contender: str
    rep: int
    sent: int
    seconds: float
    delivered: int
    cpu_seconds: float

    @property
    def pps(self) -> float:
        """Delivered packets per second of busy CPU (the generator's thread and its softirq)."""
        return self.delivered / self.cpu_seconds if self.cpu_seconds else 0.0


@dataclass
class KubeOvnBench:
    params: Params
    ns: dict[str, str] = field(default_factory=dict)
    _links: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ns = {k: f"{TAG}-kovn-{k}" for k in ("client", "node", "ovs")}
        self.pin = pin_dir("kovn")

    def _ip(self, ns: str, *args: str) -> None:
        sh("ip", "-n", self.ns[ns], *args)

    def _exec(self, ns: str, *cmd: str, input: str | None = None) -> None:
        import subprocess

        subprocess.run(
            ["nsenter", f"--net=/run/netns/{self.ns[ns]}", *cmd],
            check=True,
            capture_output=True,
            text=True,
            input=input,
        )

    def _ifindex(self, ns: str, dev: str) -> int:
        return in_netns(self.ns[ns], lambda: socket.if_nametoindex(dev))

    def setup(self) -> None:
        for ns in self.ns.values():
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        self._exec("node", "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for key in ("all", "default"):
            self._exec("node", "sysctl", "-qw", f"net.ipv4.conf.{key}.rp_filter=0")
        n, c, o = self.ns["node"], self.ns["client"], self.ns["ovs"]
        sh("ip", "-n", n, "link", "add", "uplink", "address", UPLINK_MAC, "type", "veth", "peer",
           "name", "eth0", "address", CLIENT_MAC, "netns", c)  # fmt: skip
        sh("ip", "-n", n, "link", "add", "ovn0", "address", OVN0_MAC, "type", "veth", "peer",
           "name", "ovn0-p", "address", OVS_MAC, "netns", o)  # fmt: skip
        self._ip("client", "addr", "add", f"{CLIENT}/24", "dev", "eth0")
        self._ip("client", "link", "set", "eth0", "up")
        self._ip("ovs", "link", "set", "ovn0-p", "up")
        self._ip("node", "addr", "add", f"{NODE}/24", "dev", "uplink")
        self._ip("node", "addr", "add", f"{JOIN_NODE}/16", "dev", "ovn0")
        for dev in ("uplink", "ovn0"):
            self._ip("node", "link", "set", dev, "up")
            # a veth without an XDP program takes XDP_TX frames only with GRO on (NAPI mode)
            self._exec("node", "ethtool", "-K", dev, "gro", "on")
        self._ip("node", "route", "add", "10.244.0.0/16", "via", JOIN_GW, "dev", "ovn0")
        self._ip("node", "route", "add", REMOTES, "via", CLIENT, "dev", "uplink")
        for ns, ip, mac, dev in (
            ("node", CLIENT, CLIENT_MAC, "uplink"),
            ("node", JOIN_GW, OVS_MAC, "ovn0"),
        ):
            self._ip(ns, "neigh", "replace", ip, "lladdr", mac, "dev", dev, "nud", "permanent")
        self.gen = progs.Generator.load()
        self.sinks = progs.Sinks.load()
        self.ifindex = {
            "client": self._ifindex("client", "eth0"),
            "ovs": self._ifindex("ovs", "ovn0-p"),
            "uplink": self._ifindex("node", "uplink"),
        }
        for ns in ("client", "ovs"):
            i = self.ifindex[ns]
            self._links.append(
                in_netns(self.ns[ns], partial(progs.attach_xdp_native, self.sinks.count_fd, i))
            )
        self.maps = PinnedMaps.ensure(self.pin)
        state = build_state([o for s in SERVICES for o in objects(s)], "cozy-proxy").state
        self.maps.apply(diff(self.maps.read_state(), state))
        self.nft = full_ruleset(
            [(str(lb), str(e.pod_ip)) for lb, e in state.services.items()],
            [(str(a.pod_ip), a.proto.name.lower(), a.port) for a in sorted(state.allowed)],
            [str(e.pod_ip) for e in state.services.values() if e.port_filter],
        )
        log("compiling cozyebpf's programs (bcc)")
        module = loader.compile_source("cozyebpf.c", self.pin)
        self.progs = {
            name: loader.load_from(module, name, kind)
            for name, kind in (
                ("cz_ingress", "xdp"),
                ("cz_ingress_tc", "sched_cls"),
                ("cz_egress", "sched_cls"),
                ("cz_pod_ingress", "sched_cls"),
                ("cz_route_tc", "sched_cls"),
            )
        }
        self.empty = self.sinks.tc_next_fd  # the floor's program: TCX_NEXT

    def teardown(self) -> None:
        for fd in self._links:
            with contextlib.suppress(OSError):
                os.close(fd)
        if getattr(self, "maps", None):
            self.maps.close()
        with contextlib.suppress(Exception):
            attach.detach_all(self.pin)
        for ns in self.ns.values():
            sh("ip", "netns", "del", ns, check=False)

    # -- contenders --------------------------------------------------------------------------

    def _up(self, c: str) -> None:
        if c == "bare":
            return
        self._exec("node", "nft", "-f", "-", input=NATOUT)
        if c == "floor":
            pin, fd = self.pin, self.empty

            def attach_empty() -> None:
                attach.attach_tc(fd, "cz_pod_ingress", "ovn0", pin, "ingress", "tcx")
                attach.attach_tc(fd, "cz_egress", "uplink", pin, "egress", "tcx")

            in_netns(self.ns["node"], attach_empty)
        if c == "cozy-proxy":
            self._exec("node", "nft", "-f", "-", input=self.nft)
        if c.startswith("cozyebpf"):
            hr = c == "cozyebpf-hr"
            self.maps.set_node([self.ifindex["uplink"]], True, hr)
            pin, p = self.pin, self.progs

            def attach_all() -> None:
                attach.attach_xdp(p["cz_ingress"].fd, "uplink", pin)
                if hr:  # behind XDP, as the agent attaches it
                    attach.attach_tc(p["cz_route_tc"].fd, "cz_route_tc", "uplink", pin,
                                     "ingress", "tcx")  # fmt: skip
                attach.attach_tc(p["cz_egress"].fd, "cz_egress", "uplink", pin, "egress", "tcx")
                attach.attach_tc(p["cz_pod_ingress"].fd, "cz_pod_ingress", "ovn0", pin,
                                 "ingress", "tcx")  # fmt: skip

            in_netns(self.ns["node"], attach_all)

    def _flush_conntrack(self) -> None:
        """Forget every connection the node's conntrack holds: an entry one contender left
        (e.g. a reply row's datagram, tracked after the DNAT) would make the next one's first
        packet a reply, which natOutgoing then does not masquerade."""
        from pyroute2 import Conntrack

        def flush() -> None:
            ct = Conntrack()
            try:
                ct.flush()
            finally:
                ct.close()

        in_netns(self.ns["node"], flush)

    def _down(self, c: str) -> None:
        if c == "bare":
            return
        self._exec("node", "nft", "flush", "ruleset")
        self._flush_conntrack()
        if c == "floor":
            for hook, dev in (("tcx-ingress", "ovn0"), ("tcx-egress", "uplink")):
                attach.detach_link(attach.link_pin(self.pin, hook, dev))
        if c.startswith("cozyebpf"):
            for hook, dev in (
                ("xdp", "uplink"),
                ("tcx-ingress", "uplink"),
                ("tcx-egress", "uplink"),
                ("tcx-ingress", "ovn0"),
            ):
                attach.detach_link(attach.link_pin(self.pin, hook, dev))
            self.maps.set_node([], False, False)

    @contextlib.contextmanager
    def contender(self, c: str) -> Iterator[None]:
        self._up(c)
        try:
            yield
        finally:
            self._down(c)

    # -- measuring ---------------------------------------------------------------------------

    def _seed_reply_flow(self, c: str) -> None:
        """The port-filter VM opens the flow (one datagram out): conntrack or flow4 learns it."""
        f = frame("kubeovn-egress-filter", c)
        self.gen.set_frame(f)
        i = self.ifindex["ovs"]
        in_netns(self.ns["ovs"], lambda: bpfx.xdp_live_run(self.gen.fd, f, i, 1))
        time.sleep(0.02)

    def measure(self, row: str, c: str, rep: int, seconds: float) -> Measurement:
        side = ROWS[row][1]
        f = frame(row, c)
        self.gen.set_frame(f, SPREAD if row == "kubeovn-egress-spread" else 1)
        ifindex, chunk = self.ifindex[side], 131072

        def timed() -> tuple[int, float, float]:
            bpfx.xdp_live_run(self.gen.fd, f, ifindex, 8192)  # warm-up
            time.sleep(0.005)
            n = 0
            t0, c0 = time.perf_counter(), time.thread_time()
            while True:
                bpfx.xdp_live_run(self.gen.fd, f, ifindex, chunk)
                n += chunk
                el = time.perf_counter() - t0
                if el >= seconds:
                    return n, el, time.thread_time() - c0

        from bench.datapath import _ksoftirqd_seconds

        k0 = _ksoftirqd_seconds()
        c0 = self.sinks.counted()
        n, el, cpu = in_netns(self.ns[side], timed)
        time.sleep(0.005)
        cpu += _ksoftirqd_seconds() - k0
        # the warm-up's frames are counted too: subtract its share
        delivered = max(0, self.sinks.counted() - c0)
        delivered = round(delivered * n / (n + 8192))
        return Measurement(row, c, rep, n, el, delivered, cpu)

    def run(self) -> dict[str, Any]:
        p = self.params
        out: list[Measurement] = []
        rows = [r for r in ROWS if not _only() or r in _only()]
        for rep in range(p.reps):
            for row in rows:
                k = rep % len(CONTENDERS)
                for c in CONTENDERS[k:] + CONTENDERS[:k]:
                    if row not in ONLY_ON.get(c, (row,)):
                        continue
                    with self.contender(c):
                        if row == "kubeovn-reply":
                            self._seed_reply_flow(c)
                        m = self.measure(row, c, rep, p.seconds)
                    out.append(m)
                    log(
                        f"kubeovn rep {rep + 1}/{p.reps} {row:22s} {c:12s} "
                        f"{m.pps / 1e6:6.2f} Mpps per busy core (sent {m.sent}, delivered "
                        f"{m.delivered})"
                    )
        return {
            "measurements": [m.__dict__ for m in out],
            "summary": summarize(out, rows),
            "frame_bytes": 60,
        }


def _only() -> list[str]:
    return [r for r in os.environ.get("COZYEBPF_BENCH_ROWS", "").split(",") if r]


def summarize(ms: list[Measurement], rows: list[str]) -> dict[str, dict[str, dict[str, float]]]:
    """row -> contender -> {mpps, delivered_fraction, n}, and each contender's ratio to the
    others measured in the same repetitions (the median of per-repetition ratios)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for row in rows:
        out[row] = {}
        for c in CONTENDERS:
            mine = [m for m in ms if m.row == row and m.contender == c]
            if not mine:
                continue
            sent = sum(m.sent for m in mine)
            out[row][c] = {
                "mpps": round(median([m.pps for m in mine]) / 1e6, 3),
                "delivered_fraction": round(sum(m.delivered for m in mine) / sent, 4),
                "n": len(mine),
            }
        for c in ("cozyebpf", "cozyebpf-hr", "floor"):
            for base in ("bare", "natout", "cozy-proxy", "floor"):
                ratios = []
                for rep in {m.rep for m in ms}:
                    a = [m.pps for m in ms if (m.row, m.contender, m.rep) == (row, c, rep)]
                    b = [m.pps for m in ms if (m.row, m.contender, m.rep) == (row, base, rep)]
                    if a and b and b[0]:
                        ratios.append(a[0] / b[0])
                if ratios and c in out[row]:
                    out[row][c][f"x_{base}"] = round(median(ratios), 3)
    return out


def table(res: dict[str, Any]) -> list[str]:
    """The README's table: Mpps delivered per busy core, and cozyebpf's ratios."""
    s = res["summary"]
    head = "| Mpps delivered | " + " | ".join(LABELS[c] for c in CONTENDERS) + " |"
    lines = [head, "|---|" + "---|" * len(CONTENDERS)]
    for row, cs in s.items():
        cells = [f"{cs[c]['mpps']:.2f}" if c in cs else "" for c in CONTENDERS]
        lines.append(f"| {ROWS[row][0]} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("| ratio, same repetitions | cozyebpf / no netfilter | cozyebpf / cozy-proxy "
                 "| host routing / no netfilter | host routing / cozy-proxy |")  # fmt: skip
    lines.append("|---|---|---|---|---|")
    for row, cs in s.items():

        def r(c: str, b: str, cs: dict[str, Any] = cs) -> str:
            v = cs.get(c, {}).get(f"x_{b}")
            return f"{v:.2f}x" if v else ""

        lines.append(
            f"| {ROWS[row][0]} | {r('cozyebpf', 'bare')} | {r('cozyebpf', 'cozy-proxy')} | "
            f"{r('cozyebpf-hr', 'bare')} | {r('cozyebpf-hr', 'cozy-proxy')} |"
        )
    return lines


def main_kubeovn(params: Params) -> dict[str, Any]:
    b = KubeOvnBench(params)
    try:
        log("kubeovn: building the node")
        b.setup()
        return b.run()
    finally:
        b.teardown()
