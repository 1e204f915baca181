"""What the `limits` part measures and how (bench/limits.py measures, bench/limits_report.py
summarizes and reports): the Services' pods and LB IPs, the limits and floods, the directions,
configurations, nodes and layouts with their labels, the goals, and the settings of a run."""

from __future__ import annotations

import os
from dataclasses import dataclass

from bench.common import Params
from cozyebpf import config
from cozyebpf.model.limits import parse_quantity
from cozylab.netns import Pod

ANN = "networking.cozystack.io/"
POD_ACC, POD_B, POD_A = (
    Pod("pod1", "10.244.1.10", 1),
    Pod("pod2", "10.244.1.20", 2),
    Pod("pod3", "10.244.1.30", 3),
)
LB_ACC, LB_B, LB_A = "203.0.113.10", "203.0.113.20", "203.0.113.30"
#: cozyebpf run's --guard-packet-rate default, in packets per second
DEFAULT_GUARD = parse_quantity(config.DEFAULT_GUARD)
#: the guard of the configuration `cz-guard-lab`: the default's 1M is more than the flood the
#: node forwards here (the generator shares its CPU with the node's work), so a guard that
#: cuts it is scaled down to the lab
LAB_GUARD = "100k"
#: vm-b's demand in the isolation rows: the sender's pacing (bits/s)
B_DEMAND = 200 * 10**6
#: the floods: none (vm-b alone), "full" (as fast as one generator thread goes: what the node
#: forwards slows it, so its rate differs per configuration), "fixed" (FIXED_FLOOD packets/s
#: offered in every configuration by bench_gen_paced, whose thread also takes a whole CPU:
#: below what the slowest configuration, nftables, forwards here; COZYEBPF_BENCH_FIXED_FLOOD
#: sets another, such as 800000: near what cozyebpf forwards here without limits)
FLOODS: tuple[str | None, ...] = (None, "full", "fixed")
FIXED_FLOOD = int(os.environ.get("COZYEBPF_BENCH_FIXED_FLOOD", "250000"))
#: a limit counts as reachable where the path without it carries this much more
REACHABLE = 1.2
#: accuracy: goodput / limit within this band
BAND = (0.95, 1.05)
#: isolation: vm-b keeps at least this share of its rate while vm-a is flooded (guard on)
KEEP_GOAL = 0.9


def frame_mss(mtu: int) -> tuple[int, int]:
    """A full frame's bytes and its TCP payload at `mtu` (IPv4, TCP timestamps on)."""
    return mtu + 14, mtu - 52


#: a full-size frame and the TCP payload in it on the single node (MTU 1500: 1514 and 1448):
#: the ingress bucket counts the frame's bytes, Ethernet header included, so a goodput at the
#: limit is MSS / FRAME = 0.956 of it (the Kube-OVN node's MTU 1400: frame_mss(1400))
FRAME, MSS = frame_mss(1500)

DIRECTIONS = {
    "ingress": "client -> vm-acc's LB IP, through its ingressBandwidth (XDP)",
    "egress": "vm-acc -> client, through its egressBandwidth (the uplink's tc egress)",
    "egress-shaped": "the same with fq as the uplink's root qdisc: shaped (departure times), "
    "not policed",
    "egress-nogso": "the same with TSO/GSO off in vm-acc: segments policed one by one",
}
#: where the Kube-OVN node's directions differ (the pod-facing hook on ovn0 translates egress)
KUBEOVN_DIRECTIONS = {
    "egress": "vm-acc -> client, through its egressBandwidth (the pod-facing hook on ovn0, tcx "
    "ingress, before the stack)",
    "egress-shaped": "the same with fq as the uplink's root qdisc: the pod-facing hook "
    "translates, the uplink's egress shapes what leaves from the LB IP",
}
#: how long a row waits for status to say what its qdisc should make of the egress limit (the
#: agent follows the uplinks' qdiscs over netlink: it takes a moment)
MODE_WAIT = 10.0
#: what `cozyebpf status --json` says of a Service's egress limit where fq holds its packets
SHAPED = "shaped"
#: the counters of fq (`tc -s -j qdisc show`) a row records: all its drops, those of a flow over
#: its flow_limit (100 packets), and the times it held a flow for a packet's departure time
FQ_COUNTERS = ("drops", "flows_plimit", "throttled")
CONFIGS = ("cz-guard", "cz-guard-lab", "cz-off", "nft")
#: the uplink pair's queues in the isolation rows: "one-queue" (a veth's default: one receive
#: ring and one NAPI for the flood and vm-b alike, on whichever CPU sends), and "rss" (two, as
#: a NIC's RSS spreads flows over its queues and their CPUs: the flood's one 5-tuple on one
#: queue and CPU 0, vm-b's flow on the other and CPU 1; _queues)
LAYOUTS = ("one-queue", "rss")
#: the nodes the part is measured on (--limits-nodes)
NODES = ("single", "kubeovn")
NODE_LABELS = {
    "single": "the single node: a veth per pod, the uplink's hooks translate",
    "kubeovn": "a Kube-OVN-shaped node: the pods behind ovn0, the pod-facing hook there, host "
    "routing on, natOutgoing (bench/kovnnode.py)",
}
NODE_NAMES = {"single": "single node", "kubeovn": "Kube-OVN node"}
LAYOUT_LABELS = {
    "one-queue": "the uplink pair with one queue each way (a veth's default): the flood and "
    "vm-b share one receive ring and its NAPI",
    "rss": "two queues each way, as RSS spreads flows over a NIC's queues and CPUs: the flood "
    "(one 5-tuple) on queue 0 and CPU 0, vm-b's flow on queue 1 and CPU 1 (XPS; threads pinned)",
}
#: rss: the CPUs of the flood's generator and of vm-b's TCP threads
FLOOD_CPU, B_CPU = 0, 1
#: the agent's --guard-packet-rate per configuration (None: its default)
GUARD_FLAG = {"cz-guard": None, "cz-guard-lab": LAB_GUARD, "cz-off": "0"}
CONFIG_LABELS = {
    "cz-guard": "cozyebpf, its default guard (1M packets/s per Service)",
    "cz-guard-lab": f"cozyebpf, --guard-packet-rate {LAB_GUARD} (the guard scaled to the lab)",
    "cz-off": "cozyebpf, guard off (--guard-packet-rate 0), no limits",
    "nft": "cozy-proxy's nftables ruleset (agent stopped, datapath detached)",
}


@dataclass(frozen=True)
class Settings:
    """How long and how often (quick: one repetition, shorter windows, cubic only, no
    egress-nogso). egress-shaped with the first congestion control, where the kernel has fq."""

    reps: int  # accuracy: repetitions (the order of the limits turned each time)
    iso_reps: int  # isolation: rounds of alone, full and fixed flood per row
    warmup: float  # seconds of traffic before a window (slow start, the burst)
    window: float  # seconds measured
    limits: tuple[str, ...]
    flows: tuple[int, ...]
    ccs: tuple[str, ...]  # the senders' congestion control; the first is the targets'
    nogso: bool  # egress-nogso too (with the first congestion control)
    shaped: bool = True  # egress-shaped too (off where the kernel has no fq)

    @classmethod
    def make(cls, params: Params) -> Settings:
        lims = ("10M", "100M", "1G")
        if params.quick:
            return cls(1, 1, 0.4, 1.2, lims, (1, 8), ("cubic",), False)
        return cls(2, 3, 0.8, 2.5, lims, (1, 8), ("cubic", "bbr"), True)

    def directions(self, cc: str) -> tuple[str, ...]:
        """egress-shaped and egress-nogso (a diagnosis of egress) with the targets' congestion
        control only."""
        more = (
            {"egress-shaped": self.shaped, "egress-nogso": self.nogso} if cc == self.ccs[0] else {}
        )
        return tuple(d for d in DIRECTIONS if more.get(d, d in ("ingress", "egress")))
