"""The agent's paths that depend on the kernel, through one `cozyebpf run` per tc mode, with a
Cilium-like program attached first on every hook as Cilium attaches on this kernel (issue 36;
the agent-level part of what each kernel-matrix guest runs: cozylab/kmatrix.py).

The node of a namespace lab runs the agent on its uplink (XDP ingress, cz_route_tc behind it,
cz_egress), with the pod-facing hook on pod1's veth and host routing on: pod1 is a whole-IP VM
whose packets take the pod-facing hook; pod2 a port-filter pod, not behind one, whose packets
the stack routes to the uplink's egress. Real frames are sent from the client's and the pods'
eth0 and compared whole where they arrive; an nft counter in the node's forward and
postrouting hooks says whether a packet walked the stack.

Before the agent, a Cilium stand-in (cozylab/cilium.py) takes the uplink's tc ingress and
egress and pod1's tc ingress, where Cilium's from-netdev, to-netdev and from-container run:
with tcx, appended at the tail, where the kernel has it and the mode is `auto`; else (a kernel
before 6.6, or `--tc-mode legacy`, which models one here) as clsact filters at priority 1,
handle 1, protocol all, as Cilium attaches there. Then the agent's programs must run first on
every hook and leave Cilium's in place; a packet Cilium's egress program sees already carries
the LB IP. In legacy mode Cilium attaching again (replaced in place) keeps ours first, and
Cilium's filter added anew, which the kernel then runs first, is put behind ours again by the
agent's attachment check; with tcx, Cilium's links made anew go behind ours.

What it leaves out: one uplink, IPv4 only (test_host_routing and test_dualstack have IPv6);
the stand-in is not Cilium's datapath.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import pytest
from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Packet

from cozyebpf.datapath import attach, bpfsys, rtnl
from cozylab.cilium import CILIUM_HANDLE, CiliumLike, Point
from cozylab.k8s import Svc, manifest
from cozylab.netns import (
    CLIENT_IP,
    CLIENT_MAC,
    DEFAULT_PODS,
    UPLINK,
    UPLINK_MAC,
    Pod,
    capture,
    drain,
    wait_for,
)
from tests.support.env import hang_bound
from tests.support.labtools import AgentLab, agent_lab
from tests.support.packets import LB_FILT, LB_WHOLE, assert_frame, checksums_ok

POD1, POD2 = DEFAULT_PODS[:2]  # the VM behind the pod-facing hook; the port-filter pod
WHOLE = Svc("vm", LB_WHOLE, POD1.ip, [("TCP", 22)], whole_ip="true")
FILT = Svc("web", LB_FILT, POD2.ip, [("TCP", 80), ("UDP", 53)])
#: the LB IPs the stand-in knows, with the one port each lists (it drops the others)
LISTED = {LB_WHOLE: 22, LB_FILT: 80}
NFT = """
table inet czkp {
    chain forwarded {
        type filter hook forward priority 0; policy accept;
        udp dport { 53, 4444 } counter
    }
    chain posted {
        type filter hook postrouting priority 0; policy accept;
        udp dport { 53, 4444 } counter
    }
}
"""


@dataclass
class Node:
    env: AgentLab
    cilium: CiliumLike
    legacy: bool  # clsact filters (ours and Cilium's), not tcx

    def send(self, ns: str, frame: Packet, to_ns: str) -> list[Packet]:
        """Send `frame` from `ns`'s eth0; the frames at `to_ns`'s eth0 with its IPv4 id."""
        lab = self.env.lab
        tx, rx = lab.packet_socket(ns, "eth0"), lab.packet_socket(to_ns, "eth0")
        try:
            drain(rx)
            tx.send(bytes(frame))
            got = [Ether(f) for f in capture(rx, 1.0)]
        finally:
            tx.close()
            rx.close()
        return [p for p in got if IP in p and p[IP].id == frame[IP].id]

    def stack_packets(self) -> int:
        """Packets the node's forward and postrouting hooks counted so far."""
        lab = self.env.lab
        out = lab.exec(lab.node, "nft", "list", "table", "inet", "czkp").stdout
        return sum(int(n) for n in re.findall(r"counter packets (\d+)", out))

    def hooks(self) -> dict[str, list[str]]:
        """Each tc hook of the test: the programs on it in the order the kernel runs them."""
        lab = self.env.lab
        hooks = ((UPLINK, "ingress"), (UPLINK, "egress"), (POD1.host_dev, "ingress"))
        return {f"{dev} {d}": lab.in_ns(lab.node, partial(self._names, dev, d)) for dev, d in hooks}

    def _names(self, dev: str, direction: str) -> list[str]:
        attach_type, parent = attach.DIRECTIONS[direction]
        idx = socket.if_nametoindex(dev)
        if self.legacy:
            return [f.name for f in rtnl.tc_filters(idx, parent)]
        ids, _ = bpfsys.prog_query(idx, attach_type)
        return [bpfsys.prog_info_by_id(i).name for i in ids]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """One node per tc mode: `auto` and, where the kernel has tcx, `legacy` (on a kernel
    without tcx `auto` attaches the legacy filters already: a second node would be the same)."""
    if "node" in metafunc.fixturenames:
        modes = ["auto", "legacy"] if attach.tcx_supported() else ["auto"]
        metafunc.parametrize(
            "node", modes, indirect=True, scope="module", ids=[f"tc-{m}" for m in modes]
        )


@pytest.fixture(scope="module")
def node(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    cozyebpf_cmd: list[str],
) -> Iterator[Node]:
    mode: str = request.param
    legacy = mode == "legacy" or not attach.tcx_supported()
    tc_hooks = ("tc-ingress", "tc-egress") if legacy else ("ingress", "egress")
    with agent_lab("kp", tmp_path_factory.mktemp("kpaths"), cozyebpf_cmd, DEFAULT_PODS) as env:
        lab = env.lab
        lab.exec(lab.node, "nft", "-f", "-", input=NFT)
        cilium = CiliumLike(
            lab,
            [Point(lab.node, UPLINK, tc_hooks), Point(lab.node, POD1.host_dev, tc_hooks[:1])],
            LISTED,
        )
        try:
            env.manifest_path.write_text(manifest(WHOLE, FILT))
            env.start_agent(
                *("--tc-mode", mode, "--pod-devices", POD1.host_dev, "--host-routing", "on"),
                *("--check-interval", "0.5"),
            )
            env.set_services(WHOLE, FILT)
            yield Node(env, cilium, legacy)
            assert env.stop_agent() == 0, env.log()[-3000:]
        finally:
            cilium.close()


def to_client(frame: Packet, src: str) -> Packet:
    """`frame` (from a pod) as the client gets it: the uplink's MACs, TTL - 1, source `src`."""
    want = frame[IP].copy()
    want.ttl -= 1
    want.src = src
    del want.chksum
    for layer in (TCP, UDP):
        if layer in want:
            del want[layer].chksum
    return Ether(src=UPLINK_MAC, dst=CLIENT_MAC) / IP(bytes(want))


def to_pod(frame: Packet, pod: Pod) -> Packet:
    """`frame` (from the client, to an LB IP) as `pod` gets it: its link's MACs, TTL - 1,
    destination the pod IP."""
    want = frame[IP].copy()
    want.ttl -= 1
    want.dst = pod.ip
    del want.chksum
    for layer in (TCP, UDP):
        if layer in want:
            del want[layer].chksum
    return Ether(src=pod.host_mac, dst=pod.mac) / IP(bytes(want))


def from_client(ip: Packet) -> Packet:
    return Ether(src=CLIENT_MAC, dst=UPLINK_MAC) / ip


def test_our_programs_run_first_on_every_hook_and_ciliums_stay(node: Node) -> None:
    """On each tc hook ours is the first the kernel runs, the stand-in's (Cilium's) right after
    it: attaching ours took nothing of Cilium's away (in legacy mode: its filter, handle 1)."""
    ours = {
        f"{UPLINK} ingress": "cz_route_tc",
        f"{UPLINK} egress": "cz_egress",
        f"{POD1.host_dev} ingress": "cz_pod_ingress",
    }
    hooks = node.hooks()
    for hook, prog in ours.items():
        names = hooks[hook]
        assert len(names) == 2 and names[0] == prog, f"{hook}: {names}"
        assert names[1].startswith("cilium_like"), f"{hook}: {names}"
    if node.legacy:
        lab = node.env.lab
        idx = lab.in_ns(lab.node, lambda: socket.if_nametoindex(UPLINK))
        for parent in (attach.TC_INGRESS_PARENT, attach.TC_EGRESS_PARENT):
            filters = lab.in_ns(lab.node, lambda p=parent: rtnl.tc_filters(idx, p))
            assert [(f.prio, f.handle) for f in filters] == [
                (attach.LEGACY_PRIO, attach.LEGACY_HANDLES[0]),
                (1, CILIUM_HANDLE),
            ], filters


def test_a_client_reaches_each_pod_through_its_lb_ip(node: Node) -> None:
    """Ingress (XDP): the whole-IP VM on an unlisted port, the port-filter pod on its listed
    port, whole frames; an unlisted port of the port-filter Service is dropped. Cilium's
    programs behind XDP never see a packet to an LB IP."""
    lab = node.env.lab
    before = node.cilium.to_lb()
    whole = from_client(IP(src=CLIENT_IP, dst=LB_WHOLE, id=0x3601) / UDP(sport=41000, dport=4444))
    got = node.send(lab.client, whole, lab.pod_ns(POD1))
    assert len(got) == 1, f"{len(got)} frames at the VM"
    assert_frame(bytes(got[0]), to_pod(whole, POD1))
    assert checksums_ok(bytes(got[0])) == []
    syn = from_client(IP(src=CLIENT_IP, dst=LB_FILT, id=0x3602) / TCP(sport=41001, dport=80))
    got = node.send(lab.client, syn, lab.pod_ns(POD2))
    assert len(got) == 1, f"{len(got)} frames at the pod"
    assert_frame(bytes(got[0]), to_pod(syn, POD2))
    drops = node.env.counters()["drop_port"]
    unlisted = from_client(IP(src=CLIENT_IP, dst=LB_FILT, id=0x3603) / TCP(sport=41002, dport=81))
    assert node.send(lab.client, unlisted, lab.pod_ns(POD2)) == []
    assert node.env.counters()["drop_port"] == drops + 1
    assert node.cilium.to_lb() == before, "Cilium saw a packet to an LB IP"


def test_the_vm_leaves_as_its_lb_ip_by_host_routing(node: Node) -> None:
    """Egress through the pod-facing hook: translated there and handed to the uplink past
    netfilter (host routing), the whole frame at the client."""
    lab = node.env.lab
    stack, counted = node.stack_packets(), node.env.counters()["nat_egress"]
    out = (
        Ether(src=POD1.mac, dst=POD1.host_mac)
        / IP(src=POD1.ip, dst=CLIENT_IP, id=0x3604)
        / UDP(sport=40000, dport=53)
    )
    got = node.send(lab.pod_ns(POD1), out, lab.client)
    assert len(got) == 1, f"{len(got)} frames at the client"
    assert_frame(bytes(got[0]), to_client(out, LB_WHOLE))
    assert checksums_ok(bytes(got[0])) == []
    assert node.env.counters()["nat_egress"] == counted + 1
    assert node.stack_packets() == stack, "host routing: netfilter saw the packet"


def pod2_opens_a_flow(node: Node, sport: int) -> None:
    """pod2's datagram to the client, through the stack and the uplink's egress hook, where
    ours must run before Cilium's: Cilium's sees the LB IP as the source (counted as from an
    LB IP)."""
    lab = node.env.lab
    from_lb = sum(c.from_lb for c in node.cilium.counts())
    out = (
        Ether(src=POD2.mac, dst=POD2.host_mac)
        / IP(src=POD2.ip, dst=CLIENT_IP, id=sport & 0xFFFF)
        / UDP(sport=sport, dport=53)
    )
    got = node.send(lab.pod_ns(POD2), out, lab.client)
    assert len(got) == 1, f"{len(got)} frames at the client"
    assert_frame(bytes(got[0]), to_client(out, LB_FILT))
    assert sum(c.from_lb for c in node.cilium.counts()) == from_lb + 1, "ours ran after Cilium's"


def test_a_port_filter_pod_gets_the_reply_of_a_flow_it_opened(node: Node) -> None:
    """Egress through the stack and the uplink's egress hook, ours before Cilium's; the reply
    to the flow the pod opened passes the port filter to the pod; the same datagram to a port
    the pod opened no flow from is dropped."""
    lab = node.env.lab
    pod2_opens_a_flow(node, 40053)
    reply = from_client(IP(src=CLIENT_IP, dst=LB_FILT, id=0x3606) / UDP(sport=53, dport=40053))
    got = node.send(lab.client, reply, lab.pod_ns(POD2))
    assert len(got) == 1, "the reply did not reach the pod"
    assert_frame(bytes(got[0]), to_pod(reply, POD2))
    drops = node.env.counters()["drop_port"]
    stray = from_client(IP(src=CLIENT_IP, dst=LB_FILT, id=0x3607) / UDP(sport=53, dport=40054))
    assert node.send(lab.client, stray, lab.pod_ns(POD2)) == []
    assert node.env.counters()["drop_port"] == drops + 1


def test_cilium_attaching_again_leaves_ours_first(node: Node) -> None:
    """Legacy filters: Cilium attaching again replaces its filter in place, ours stays first;
    its filter added anew goes in front of ours, and the agent's attachment check puts ours
    back in front (a new filter with its other handle, then the old one removed), without
    touching Cilium's. tcx: Cilium attaching anew (its links gone, new ones appended at the
    tail, as its tcx attach does) leaves ours first with no re-attachment. Either way traffic
    through the uplink's egress then still meets ours first."""
    first = {h: names[0] for h, names in node.hooks().items()}
    if not node.legacy:
        node.cilium.attach_tcx_anew()
        assert {h: names[0] for h, names in node.hooks().items()} == first, node.hooks()
        assert all(len(names) == 2 for names in node.hooks().values()), node.hooks()
        pod2_opens_a_flow(node, 40153)
        assert "not first; re-attaching" not in node.env.log()
        return
    node.cilium.attach_legacy_again()
    assert {h: names[0] for h, names in node.hooks().items()} == first
    node.cilium.attach_legacy_again(anew=True)
    wait_for(
        lambda: {h: names[0] for h, names in node.hooks().items()} == first,
        hang_bound(10),
        lambda: f"ours first again; hooks {node.hooks()}; agent log:\n{node.env.log()[-2000:]}",
    )
    assert all(len(names) == 2 for names in node.hooks().values()), node.hooks()
    assert "not first; re-attaching" in node.env.log()
    pod2_opens_a_flow(node, 40153)
