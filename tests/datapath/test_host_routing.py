"""Host routing (--host-routing, issue 26): what cozyebpf translated goes straight to its next
device with bpf_redirect_neigh, past the node's netfilter; with it off, through the stack.

A namespace lab (cozylab.netns: client -- node -- pods on per-pod veths) runs the agent's
datapath (BpfDatapath, as `cozyebpf run --pod-devices 'lxc-*' --host-routing on` builds it: the
pod-facing hook on the pods' veths, XDP ingress on the uplink and cz_route_tc behind it). Real
frames are sent from the client's and the pods' eth0 and captured whole at the other end. An nft
counter of the test's datagrams in the node's forward and postrouting hooks says whether they
walked the stack: not with host routing on, and with it off; the frame that arrives is the same
byte for byte either way (translated, TTL - 1, checksums right), and so are cozyebpf's counters;
a tc program after ours on the output device's egress (where Cilium's `to-netdev` runs) sees it
on both paths. What the fast path leaves to the stack -- TTL 1, a packet too big for the output
device -- still gets the stack's answer (ICMP), never vanishes. On a kernel that refuses
bpf_xdp_adjust_meta (kernel.xdp_meta), XDP cannot mark what it lets in: there the frames from
outside behind XDP must walk the stack (Node.routes_inbound), and do.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from scapy.layers.inet import ICMP, IP, UDP, IPerror, UDPerror
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether
from scapy.packet import Packet

from cozyebpf.datapath import kernel, layout
from cozyebpf.datapath.attach import detach_all
from cozyebpf.datapath.bpf import BpfDatapath
from cozyebpf.datapath.layout import be16
from cozyebpf.datapath.loader import cflags
from cozyebpf.datapath.maps import PinnedMaps
from cozyebpf.datapath.reasons import REASONS
from cozyebpf.explain import explain
from cozyebpf.model import build_state
from cozyebpf.state import diff
from cozylab import netns as labmod
from cozylab.k8s import Svc, manifest, objects
from cozylab.netns import (
    CLIENT_IP,
    CLIENT_IP6,
    CLIENT_MAC,
    UPLINK,
    UPLINK_MAC,
    Lab,
    capture,
    drain,
    wait_for,
)
from tests.support.env import hang_bound, unique_prefix
from tests.support.packets import LB_WHOLE, assert_frame, checksums_ok

POD1 = labmod.DEFAULT_PODS[0]
IP_MTU_DISCOVER, IP_PMTUDISC_DO = 10, 2  # linux/in.h
LB6 = "2001:db8:113::10"
WHOLE = Svc(
    "vm-whole", LB_WHOLE, POD1.ip, [("TCP", 22)], whole_ip="true", lb_ip6=LB6, pod_ip6=POD1.ip6
)
NFT = """
table inet czhr {
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


#: Kube-OVN's natOutgoing: the node masquerades what its pods send out
NATOUT = """
table ip czhr_nat {
    chain postrouting {
        type nat hook postrouting priority srcnat; policy accept;
        ip saddr 10.244.0.0/16 oifname "uplink" masquerade
    }
}
"""


@dataclass
class Node:
    lab: Lab
    dp: BpfDatapath
    uplink: int

    def host_routing(self, on: bool) -> None:
        assert self.dp.maps is not None
        self.dp.maps.set_node([self.uplink], True, on)
        assert self.dp.maps.host_routing() is on

    def routes_inbound(self, on: bool) -> bool:
        """Whether a frame from outside is host-routed with host routing `on`: behind XDP only
        where the kernel lets XDP mark it (bpf_xdp_adjust_meta; kernel.xdp_meta), else the
        stack routes it (6.18.44-fc-v1300 refuses the helper)."""
        return on and (self.dp.ingress_hook != "auto" or kernel.xdp_meta() is None)

    def fib_gen(self) -> int:
        assert self.dp.maps is not None
        return int(self.dp.maps._flow_cfg().fib_gen)

    @contextmanager
    def routes_change(self) -> Iterator[None]:
        """The body changes the node's routes or devices: wait until the agent's route follower
        bumped the generation of the programs' cached FIB answers (as it does for any change)."""
        gen = self.fib_gen()
        yield
        wait_for(lambda: self.fib_gen() != gen, 3.0, "the route follower bumps fib_gen")

    def stack_packets(self) -> int:
        """Packets the node's forward and postrouting hooks counted so far."""
        out = self.lab.exec(self.lab.node, "nft", "list", "table", "inet", "czhr").stdout
        return sum(int(n) for n in re.findall(r"counter packets (\d+)", out))

    def counters(self) -> dict[str, int]:
        with PinnedMaps.open(self.dp.pin_dir) as m:
            return {k: v["packets"] for k, v in m.counters().items()}

    def send(
        self, ns: str, frame: Packet, to_ns: str, match: type[Packet] | None = None
    ) -> list[Packet]:
        """Send `frame` from `ns`'s eth0; the frames that arrive at `to_ns`'s eth0 carrying the
        frame's marker (the IPv4 id, or the IPv6 flow label)."""
        tx = self.lab.packet_socket(ns, "eth0")
        rx = self.lab.packet_socket(to_ns, "eth0")
        try:
            drain(rx)
            tx.send(bytes(frame))
            got = [Ether(f) for f in capture(rx, 1.0)]
        finally:
            tx.close()
            rx.close()
        if match is not None:
            return [p for p in got if match in p]
        if IP in frame:
            return [p for p in got if IP in p and p[IP].id == frame[IP].id]
        return [p for p in got if IPv6 in p and p[IPv6].fl == frame[IPv6].fl]


#: --ingress-hook -> the uplink's ingress attachments: XDP decides, drops and marks what it lets
#: through, cz_route_tc hands the marked frames on; on tcx, cz_ingress_tc does both
INGRESS = {
    "auto": {"ingress": ("xdp", "cz_ingress"), "route": ("tcx-ingress", "cz_route_tc")},
    "tcx": {"ingress": ("tcx-ingress", "cz_ingress_tc")},
}


@pytest.fixture(scope="module", params=list(INGRESS), ids=[f"ingress-{h}" for h in INGRESS])
def node(request: pytest.FixtureRequest) -> Iterator[Node]:
    hook: str = request.param
    prefix = unique_prefix("hr")
    lab = Lab(prefix, pods=(POD1,))
    pin = f"/sys/fs/bpf/{prefix}"
    lab.up()
    dp = BpfDatapath(
        [UPLINK], pin_dir=pin, pod_devices=["lxc-*"], host_routing=True, ingress_hook=hook
    )
    try:
        lab.exec(lab.node, "nft", "-f", "-", input=NFT)
        lab.in_ns(lab.node, dp.start)
        assert {role: (a.hook, a.program) for (_, role), a in dp.attachments.items()} == {
            **INGRESS[hook],
            "egress": ("tcx-egress", "cz_egress"),
            "pod": ("tcx-ingress", "cz_pod_ingress"),
        }
        state = build_state(objects(WHOLE), "cozy-proxy").state
        dp.apply(diff(dp.read_state(), state))
        yield Node(lab, dp, lab.in_ns(lab.node, lambda: socket.if_nametoindex(UPLINK)))
    finally:
        dp.close()
        detach_all(pin)
        lab.down()


#: a tc program after ours on a device's egress, as Cilium's `to-netdev` would be: it counts
#: the test's datagrams (UDP to port 53 or 4444) per device
TAP = r"""
#include <uapi/linux/bpf.h>
BPF_HASH(seen, u32, u64, 16);
int tap(struct __sk_buff *skb)
{
    u32 dev = skb->ifindex;
    u16 port = 0;
    u8 proto = 0;
    u64 one = 1, *n;

    if (skb->protocol != bpf_htons(0x0800) || bpf_skb_load_bytes(skb, 23, &proto, 1) ||
        proto != 17 || bpf_skb_load_bytes(skb, 36, &port, 2))
        return -1;
    if (port != bpf_htons(53) && port != bpf_htons(4444))
        return -1;
    n = seen.lookup(&dev);
    if (n)
        __sync_fetch_and_add(n, 1);
    else
        seen.update(&dev, &one);
    return -1; /* TCX_NEXT */
}
"""


@dataclass
class Taps:
    bpf: Any
    ifindex: dict[str, int]

    def seen(self, dev: str) -> int:
        for k, v in self.bpf[b"seen"].items():
            if k.value == self.ifindex[dev]:
                return int(v.value)
        return 0


@pytest.fixture(scope="module")
def taps(node: Node) -> Iterator[Taps]:
    """TAP last on the tcx egress of the uplink and of the VM's link."""
    from bcc import BPF

    from cozyebpf.datapath import bpfsys

    b = BPF(text=TAP.encode())
    fd = b.load_func(b"tap", BPF.SCHED_CLS).fd
    devs = (UPLINK, POD1.host_dev)
    idx = {d: node.lab.in_ns(node.lab.node, lambda d=d: socket.if_nametoindex(d)) for d in devs}
    links = [
        node.lab.in_ns(
            node.lab.node, lambda i=idx[d]: bpfsys.link_create(fd, i, bpfsys.BPF_TCX_EGRESS)
        )
        for d in devs
    ]
    try:
        yield Taps(b, idx)
    finally:
        for link in links:
            os.close(link)
        b.cleanup()


def out_frame(ttl: int = 64, size: int = 18, v6: bool = False) -> Packet:
    """The VM's datagram to the client, as it leaves the VM (`ttl`: the hop limit for IPv6)."""
    ip = (
        IPv6(src=POD1.ip6, dst=CLIENT_IP6, fl=0x2604, hlim=ttl)
        if v6
        else IP(src=POD1.ip, dst=CLIENT_IP, id=0x2601, ttl=ttl)
    )
    return Ether(src=POD1.mac, dst=POD1.host_mac) / ip / UDP(sport=40000, dport=53) / (b"x" * size)


def in_frame(ttl: int = 64, size: int = 18, df: bool = False) -> Packet:
    """The client's datagram to the VM's LB IP."""
    return (
        Ether(src=CLIENT_MAC, dst=UPLINK_MAC)
        / IP(src=CLIENT_IP, dst=LB_WHOLE, id=0x2602, ttl=ttl, flags="DF" if df else 0)
        / UDP(sport=41000, dport=4444)
        / (b"y" * size)
    )


def forwarded(frame: Packet, src_mac: str, dst_mac: str, **ip: str) -> Packet:
    """`frame` as a forwarding node delivers it: the next link's MACs, TTL (hop limit) - 1, the
    addresses in `ip` translated, checksums recomputed."""
    if IP in frame:
        want = frame[IP].copy()
        want.ttl -= 1
        del want.chksum
    else:
        want = frame[IPv6].copy()
        want.hlim -= 1
    for k, v in ip.items():
        setattr(want, k, v)
    if UDP in want:
        del want[UDP].chksum
    return Ether(src=src_mac, dst=dst_mac) / want.__class__(bytes(want))


@pytest.mark.parametrize("on", [True, False], ids=["host-routing", "stack"])
def test_vm_to_outside(node: Node, taps: Taps, on: bool) -> None:
    node.host_routing(on)
    before, counted = node.stack_packets(), node.counters()["nat_egress"]
    tapped = taps.seen(UPLINK)
    got = node.send(node.lab.pod_ns(POD1), out_frame(), node.lab.client)
    assert taps.seen(UPLINK) == tapped + 1, "the uplink's tc egress did not see it"
    assert len(got) == 1, f"{len(got)} frames at the client"
    assert_frame(bytes(got[0]), forwarded(out_frame(), UPLINK_MAC, CLIENT_MAC, src=LB_WHOLE))
    assert checksums_ok(bytes(got[0])) == []
    assert node.counters()["nat_egress"] == counted + 1
    stack = node.stack_packets() - before
    assert (stack == 0) if on else (stack >= 2), f"netfilter counted {stack} packets"


@pytest.mark.parametrize("on", [True, False], ids=["host-routing", "stack"])
def test_outside_to_vm(node: Node, taps: Taps, on: bool) -> None:
    node.host_routing(on)
    before, counted = node.stack_packets(), node.counters()["nat_ingress"]
    tapped = taps.seen(POD1.host_dev)
    got = node.send(node.lab.client, in_frame(), node.lab.pod_ns(POD1))
    assert taps.seen(POD1.host_dev) == tapped + 1, "the VM link's tc egress did not see it"
    assert len(got) == 1, f"{len(got)} frames at the VM"
    assert_frame(bytes(got[0]), forwarded(in_frame(), POD1.host_mac, POD1.mac, dst=POD1.ip))
    assert checksums_ok(bytes(got[0])) == []
    assert node.counters()["nat_ingress"] == counted + 1
    stack = node.stack_packets() - before
    routed = node.routes_inbound(on)
    assert (stack == 0) if routed else (stack >= 2), f"netfilter counted {stack} packets"


@pytest.mark.parametrize("on", [True, False], ids=["host-routing", "stack"])
def test_outside_to_vm_ipv6(node: Node, on: bool) -> None:
    node.host_routing(on)
    frame = (
        Ether(src=CLIENT_MAC, dst=UPLINK_MAC)
        / IPv6(src=CLIENT_IP6, dst=LB6, fl=0x2603, hlim=64)
        / UDP(sport=41000, dport=4444)
        / b"v6"
    )
    before = node.stack_packets()
    got = node.send(node.lab.client, frame, node.lab.pod_ns(POD1))
    assert len(got) == 1, f"{len(got)} frames at the VM"
    assert_frame(bytes(got[0]), forwarded(frame, POD1.host_mac, POD1.mac, dst=POD1.ip6))
    stack = node.stack_packets() - before
    routed = node.routes_inbound(on)
    assert (stack == 0) if routed else (stack >= 2), f"netfilter counted {stack} packets"


@pytest.mark.parametrize("on", [True, False], ids=["host-routing", "stack"])
def test_vm_to_outside_ipv6(node: Node, on: bool) -> None:
    """IPv6 from the VM: translated on the pod-facing hook whatever the path (before the node's
    masquerade, tested below), then handed to the uplink, past netfilter, or routed by the
    stack; the same frame arrives either way."""
    node.host_routing(on)
    before, counted = node.stack_packets(), node.counters()["nat_egress"]
    got = node.send(node.lab.pod_ns(POD1), out_frame(v6=True), node.lab.client)
    assert len(got) == 1, f"{len(got)} frames at the client"
    # the whole frame, its UDP checksum as scapy computes it over the new pseudo-header
    assert_frame(bytes(got[0]), forwarded(out_frame(v6=True), UPLINK_MAC, CLIENT_MAC, src=LB6))
    assert node.counters()["nat_egress"] == counted + 1
    stack = node.stack_packets() - before
    assert (stack == 0) if on else (stack >= 2), f"netfilter counted {stack} packets"


#: Kube-OVN's natOutgoing for an IPv6 subnet (ip6tables MASQUERADE of the ovn60subnets-nat set)
NATOUT6 = """
table ip6 czhr_nat6 {
    chain postrouting {
        type nat hook postrouting priority srcnat; policy accept;
        ip6 saddr 2001:db8:244::/48 oifname "uplink" masquerade
    }
}
"""


@pytest.mark.parametrize("on", [True, False], ids=["host-routing", "stack"])
def test_vm_ipv6_leaves_as_its_lb_ip_under_the_nodes_masquerade(node: Node, on: bool) -> None:
    """With the node masquerading its pods' IPv6 (natOutgoing), the VM's packet still leaves
    from its LB IP: the pod-facing hook translates it before the stack's postrouting, where the
    uplink's egress would come too late."""
    assert POD1.ip6.startswith("2001:db8:244:"), POD1.ip6
    node.host_routing(on)
    lab = node.lab
    lab.exec(lab.node, "nft", "-f", "-", input=NATOUT6)
    try:
        got = node.send(lab.pod_ns(POD1), out_frame(v6=True), lab.client)
    finally:
        lab.exec(lab.node, "nft", "delete", "table", "ip6", "czhr_nat6")
    assert [p[IPv6].src for p in got] == [LB6]


def test_ipv6_hop_limit_1_gets_the_stacks_answer_at_the_pod(node: Node) -> None:
    """Hop limit 1 is neither translated nor redirected: the stack answers time exceeded to the
    VM's own address, and nothing reaches the client."""
    from scapy.layers.inet6 import ICMPv6TimeExceeded

    node.host_routing(True)
    lab = node.lab
    last_hop = out_frame(ttl=1, v6=True)
    assert node.send(lab.pod_ns(POD1), last_hop, lab.client) == []
    got = node.send(lab.pod_ns(POD1), last_hop, lab.pod_ns(POD1), ICMPv6TimeExceeded)
    assert [p[IPv6].dst for p in got] == [POD1.ip6], [p.summary() for p in got]


def test_ipv6_too_big_for_the_uplink_gets_packet_too_big_at_the_pod(node: Node) -> None:
    """Larger than the uplink: left untranslated to the stack, which answers packet-too-big
    with the uplink's MTU to the VM's own address (a router does not fragment IPv6)."""
    from scapy.layers.inet6 import ICMPv6PacketTooBig

    node.host_routing(True)
    lab = node.lab
    with node.routes_change():
        lab.ip(lab.node, "link", "set", UPLINK, "mtu", "1400")
    try:
        big = out_frame(size=1400, v6=True)
        assert node.send(lab.pod_ns(POD1), big, lab.client) == []
        got = node.send(lab.pod_ns(POD1), big, lab.pod_ns(POD1), ICMPv6PacketTooBig)
    finally:
        with node.routes_change():
            lab.ip(lab.node, "link", "set", UPLINK, "mtu", "1500")
    assert [(p[IPv6].dst, p[ICMPv6PacketTooBig].mtu) for p in got] == [(POD1.ip6, 1400)]


def test_ttl_1_gets_the_stacks_answer(node: Node) -> None:
    """TTL 1 is not redirected (it would leave with TTL 0): the stack answers time exceeded."""
    node.host_routing(True)
    got = node.send(node.lab.client, in_frame(ttl=1), node.lab.client, ICMP)
    errors = [p for p in got if p[ICMP].type == 11 and IPerror in p and p[IPerror].id == 0x2602]
    assert len(errors) == 1, f"no time-exceeded at the client: {[p.summary() for p in got]}"
    assert node.send(node.lab.client, in_frame(ttl=1), node.lab.pod_ns(POD1)) == []


@pytest.fixture
def small_pod_link(node: Node) -> Iterator[None]:
    """The VM's link 1400 bytes, as Kube-OVN's ovn0 under a 1500-byte uplink."""
    with node.routes_change():
        node.lab.ip(node.lab.node, "link", "set", POD1.host_dev, "mtu", "1400")
    try:
        yield
    finally:
        with node.routes_change():
            node.lab.ip(node.lab.node, "link", "set", POD1.host_dev, "mtu", "1500")


@pytest.mark.parametrize("size", [1390, 1376], ids=["over-mtu", "within-vlan-slack"])
def test_too_big_for_the_vm_link_gets_frag_needed(
    node: Node, small_pod_link: None, size: int
) -> None:
    """Larger than the VM's link: not redirected, the stack answers ICMP fragmentation-needed
    with the link's MTU. 1418 bytes of IP the FIB itself refuses (BPF_FIB_LKUP_RET_FRAG_NEEDED);
    1404 bytes pass its check (is_skb_forwardable allows a VLAN tag's 4 bytes more), and a veth
    whose peer has a larger MTU would deliver them: the program's own check refuses them."""
    node.host_routing(True)
    big = in_frame(size=size, df=True)
    got = node.send(node.lab.client, big, node.lab.client, ICMP)
    errors = [
        p
        for p in got
        if p[ICMP].type == 3 and p[ICMP].code == 4 and UDPerror in p and p[IPerror].id == 0x2602
    ]
    assert len(errors) == 1, f"no fragmentation-needed: {[p.summary() for p in got]}"
    assert errors[0][ICMP].nexthopmtu == 1400
    assert node.send(node.lab.client, big, node.lab.pod_ns(POD1)) == []
    fits = in_frame(size=1400 - 28, df=True)
    got = node.send(node.lab.client, fits, node.lab.pod_ns(POD1))
    assert len(got) == 1 and len(got[0][IP]) == 1400


@pytest.mark.parametrize("on", [True, False], ids=["host-routing", "stack"])
def test_explain_says_which_path(node: Node, on: bool) -> None:
    """`explain` runs the packet through the full path (a dry run), which never redirects; it
    says which path the real packet takes."""
    node.host_routing(on)
    pin = node.dp.pin_dir

    def run(*args: str | None) -> str:
        e, _ = node.lab.in_ns(node.lab.node, lambda: explain(pin, *args))  # type: ignore[arg-type]
        assert e.verdict == "pass"
        return e.path

    inbound = run(CLIENT_IP, f"{LB_WHOLE}:4444", "udp", "ingress", None, None)
    outbound = run(f"{POD1.ip}:40000", f"{CLIENT_IP}:53", "udp", "egress", None, POD1.host_dev)
    node_own = run(f"{POD1.ip}:40000", f"{CLIENT_IP}:53", "udp", "egress", None, None)
    outbound6 = run(
        f"[{POD1.ip6}]:40000", f"[{CLIENT_IP6}]:53", "udp", "egress", None, POD1.host_dev
    )
    if on:
        how = "marked by XDP, " if node.dp.ingress_hook == "auto" else ""
        if node.routes_inbound(on):
            assert inbound.startswith(f"host routing: {how}handed to the device the node's FIB")
        else:
            assert inbound.startswith("the node's stack routes it (host routing behind XDP")
            assert "this kernel refuses" in inbound
        for out in (outbound, outbound6):
            assert out.startswith(
                f"host routing: translated by the pod-facing hook on {POD1.host_dev}"
            )
        assert "hop limit is 1" in outbound6 and "hop limit" not in outbound
        assert node_own.startswith("the node's stack routes it (host routing starts at")
    else:
        assert {inbound, outbound, outbound6, node_own} == {
            "the node's stack routes it (--host-routing off)"
        }


@pytest.mark.parametrize("on", [True, False], ids=["host-routing", "stack"])
def test_vm_packet_too_big_for_the_uplink_is_translated_then_fragmented(
    node: Node, on: bool
) -> None:
    """A VM's packet larger than the uplink's MTU (the FIB answers FRAG_NEEDED): translated on
    the pod-facing hook all the same, before the node's masquerade (Kube-OVN's natOutgoing,
    here for the test) could take it, then the stack's: without DF it leaves in fragments, each
    from the LB IP (never the pod IP nor the node's)."""
    node.host_routing(on)
    lab = node.lab
    lab.exec(lab.node, "nft", "-f", "-", input=NATOUT)
    with node.routes_change():
        lab.ip(lab.node, "link", "set", UPLINK, "mtu", "1400")
    try:
        big = out_frame(size=1450)
        got = node.send(lab.pod_ns(POD1), big, lab.client)
    finally:
        with node.routes_change():
            lab.ip(lab.node, "link", "set", UPLINK, "mtu", "1500")
        lab.exec(lab.node, "nft", "delete", "table", "ip", "czhr_nat")
    assert len(got) >= 2, f"{len(got)} fragments at the client"
    assert {p[IP].src for p in got} == {LB_WHOLE}
    assert sum(len(p[IP].payload) for p in got) == 8 + 1450  # UDP header + payload
    assert all(p[IP].ttl == 63 for p in got)


META_PROBE = r"""
#include <uapi/linux/bpf.h>
int probe(struct xdp_md *ctx)
{
    return bpf_xdp_adjust_meta(ctx, -4) ? XDP_ABORTED : XDP_PASS;
}
"""


def test_the_kernel_probe_agrees_with_a_compiled_program() -> None:
    """kernel.xdp_meta asks the kernel with four hand-assembled instructions; a program that bcc
    compiles from C and loads must get the same answer (the loader sets CZ_NO_XDP_META, and
    the tests above expect the stack, by it)."""
    from bcc import BPF

    b = BPF(text=META_PROBE.encode())
    try:
        b.load_func(b"probe", BPF.XDP)
        loaded = None
    except Exception as e:  # bcc raises bare Exception; the verifier's log went to stderr
        loaded = str(e)
    finally:
        b.cleanup()
    refusal = kernel.xdp_meta()
    assert (loaded is None) == (refusal is None), (loaded, refusal)
    if refusal is not None:
        assert "bpf_xdp_adjust_meta" in refusal
        assert "-DCZ_NO_XDP_META" in cflags("/sys/fs/bpf/none")


def test_check_puts_the_route_program_back(node: Node) -> None:
    """The attachment check repairs what host routing attached, as any other of ours."""
    from cozyebpf.datapath import attach

    if node.dp.ingress_hook != "auto":
        assert ("uplink", "route") not in node.dp.attachments  # cz_ingress_tc routes itself
        return
    lab = node.lab
    assert lab.in_ns(lab.node, node.dp.check) == []
    attach.detach_link(attach.link_pin(node.dp.pin_dir, "tcx-ingress", UPLINK))
    repaired = lab.in_ns(lab.node, node.dp.check)
    assert repaired == [f"{UPLINK} tcx-ingress: detached"]
    assert lab.in_ns(lab.node, node.dp.check) == []
    node.host_routing(True)
    before = node.stack_packets()
    got = node.send(lab.client, in_frame(), lab.pod_ns(POD1))
    assert len(got) == 1
    if node.routes_inbound(True):
        assert node.stack_packets() == before, "not host-routed after the repair"
    else:  # nothing marked: what the repaired program sees goes on to the stack untouched
        assert node.stack_packets() >= before + 2


@pytest.mark.parametrize("on", [True, False], ids=["host-routing", "stack"])
def test_a_route_change_is_followed(node: Node, on: bool) -> None:
    """The pod-facing hook caches the FIB's answer per (source, destination, device): a route
    that changes after the answer was cached is followed at once (the agent's route follower
    bumps flowcfg's fib_gen). A blackhole route to the client: the VM's packet is the stack's
    (dropped there, as the route says), never translated and sent on by a stale answer; the
    route removed, it flows again."""
    node.host_routing(on)
    lab = node.lab
    assert len(node.send(lab.pod_ns(POD1), out_frame(), lab.client)) == 1  # cached
    counted = node.counters()["nat_egress"]
    with node.routes_change():
        lab.ip(lab.node, "route", "add", "blackhole", f"{CLIENT_IP}/32")
    try:
        got = node.send(lab.pod_ns(POD1), out_frame(), lab.client)
        assert got == [], "sent on by a stale FIB answer"
        assert node.counters()["nat_egress"] == counted, "translated by a stale FIB answer"
    finally:
        with node.routes_change():
            lab.ip(lab.node, "route", "del", "blackhole", f"{CLIENT_IP}/32")
    got = node.send(lab.pod_ns(POD1), out_frame(), lab.client)
    assert len(got) == 1 and got[0][IP].src == LB_WHOLE


@pytest.mark.parametrize("on", [True, False], ids=["host-routing", "stack"])
def test_node_to_lb_ip_too_big_for_the_vm_link_gets_frag_needed(
    node: Node, small_pod_link: None, on: bool
) -> None:
    """The node's own datagram to a VM's LB IP is handed to the VM's device by the uplink's
    egress (to_lb4). Larger than that device (1400 under a 1500-byte uplink), it would vanish
    there: the node's stack gets ICMP fragmentation-needed instead and lowers the path MTU of
    the LB IP (the next such send says EMSGSIZE, as TCP's segments then fit); a datagram that
    fits arrives translated, whole. A running monitor sees only the one translated (the
    too-big one was neither translated nor counted; before issue 37 it showed as translated)."""
    from cozyebpf.monitor import RingBuffer

    lab = node.lab
    node.host_routing(on)
    lab.ip(lab.node, "route", "add", f"{LB_WHOLE}/32", "via", CLIENT_IP, "dev", UPLINK)
    rx = lab.packet_socket(lab.pod_ns(POD1), "eth0")
    maps = node.dp.maps
    assert maps is not None
    ring = RingBuffer(maps.fds[maps.layout.events.name], maps.layout.events.max_entries)
    ring.skip()
    maps.set_monitor(layout.MON_ALL, 1, 10**15)

    def shown() -> list[tuple[str, int]]:  # the monitor's events of the datagrams to port 4444
        events = [layout.CzEvent.from_buffer_copy(r) for r in ring.records()]
        return [(REASONS[e.reason], e.len) for e in events if e.dport == be16(4444)]

    def send(size: int) -> str:
        def run() -> str:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
                s.connect((LB_WHOLE, 4444))
                try:
                    s.send(b"z" * size)
                except OSError as e:
                    return os.strerror(e.errno or 0)
                return "sent"

        return lab.in_ns(lab.node, run)

    try:
        drain(rx)
        assert send(1420) == "sent"
        wait_for(lambda: "mtu 1400" in lab.exec(lab.node, "ip", "route", "get", LB_WHOLE).stdout,
                 2.0, "the path MTU of the LB IP learned from fragmentation-needed")  # fmt: skip
        assert send(1420) == os.strerror(errno.EMSGSIZE)
        assert [Ether(f) for f in capture(rx, 0.3)] == [], "the too-big datagram reached the VM"
        assert shown() == [], "the too-big datagram was shown to the monitor"
        assert send(1400 - 28) == "sent"
        got = [Ether(f) for f in capture(rx, 0.5)]
        got = [p for p in got if UDP in p and p[UDP].dport == 4444]
        assert len(got) == 1, [p.summary() for p in got]
        assert len(got[0][IP]) == 1400 and got[0][IP].dst == POD1.ip
        # (its UDP checksum is the node's partial one: the veth passes checksum offload on)
        assert bytes(got[0][UDP].payload) == b"z" * (1400 - 28)
        assert shown() == [("nat_ingress", 14 + 1400)]
    finally:
        maps.set_monitor(layout.MON_OFF)
        ring.close()
        rx.close()
        lab.ip(lab.node, "route", "del", f"{LB_WHOLE}/32")
        lab.exec(lab.node, "ip", "route", "flush", "cache")


@pytest.mark.parametrize("on", [True, False], ids=["host-routing", "stack"])
def test_status_says_whether_host_routing_is_on(node: Node, on: bool) -> None:
    """`cozyebpf status` shows the node's part the agent wrote: the uplinks, the pod-facing
    hooks, host routing, the generation of the cached FIB answers, and how egress limits are
    enforced."""
    from cozyebpf.status import datapath_status, render_node

    node.host_routing(on)
    d = node.lab.in_ns(node.lab.node, lambda: datapath_status(node.dp.pin_dir))
    assert d["node"] == {
        "uplinks": [UPLINK],
        "pod_devices": True,
        "host_routing": on,
        "fib_gen": node.fib_gen(),
        "egress_limits": "policed",  # the lab's uplink has a veth's noqueue, not fq
    }
    line = render_node(d["node"])
    assert line.startswith(f"node: uplinks {UPLINK}; pod-facing hooks on; host routing ")
    assert f"host routing {'on' if on else 'off'} (--host-routing)" in line
    assert line.endswith("egress limits policed (an uplink's root qdisc is not fq)"), line


#: a second uplink for test_a_route_moved_while_no_agent_runs_is_followed: the node's uplink2
#: and the client's eth1 on their own link (192.0.2.0/24), and a remote address that the node
#: routes by the first uplink, then by the second
UPLINK2, UPLINK2_MAC, CLIENT2_MAC = "uplink2", "02:00:00:00:02:02", "02:00:00:00:02:01"
NODE2_IP, CLIENT2_IP, REMOTE = "192.0.2.1", "192.0.2.2", "203.0.113.77"


def test_a_route_moved_while_no_agent_runs_is_followed(
    tmp_path: Path, cozyebpf_cmd: list[str]
) -> None:
    """Every cached FIB answer expires by the kernel's clock (bpf/lib/fib.h, CZ_FIBC_NS: a
    second), so the programs follow a route that moves while no agent runs to bump fib_gen (an
    upgrade, a crash loop). A real agent with two uplinks, host routing on, caches the route of
    the VM's datagrams to a remote address by the first uplink; it is killed (SIGKILL: its
    programs stay attached, as designed) and the route moved to the second uplink. The VM's
    datagrams then leave by the second uplink, translated and whole, and no longer by the first
    (the cache before issue 37 sent them by the first for as long as no agent ran)."""
    from tests.support.labtools import agent_lab

    with agent_lab("fm", tmp_path, cozyebpf_cmd, (POD1,), manifest(WHOLE)) as env:
        lab = env.lab
        lab.veth(lab.node, UPLINK2, UPLINK2_MAC, lab.client, "eth1", CLIENT2_MAC)
        lab.ip(lab.node, "addr", "add", f"{NODE2_IP}/24", "dev", UPLINK2)
        lab.ip(lab.node, "link", "set", UPLINK2, "up")
        lab.neigh(lab.node, CLIENT2_IP, CLIENT2_MAC, UPLINK2)
        lab.ip(lab.client, "link", "set", "eth1", "up")
        lab.ip(lab.node, "route", "add", f"{REMOTE}/32", "via", CLIENT_IP, "dev", UPLINK)
        env.start_agent_on(f"{UPLINK},{UPLINK2}", "--pod-devices", "lxc-*", "--host-routing", "on")
        env.set_services(WHOLE)
        ident = iter(range(0x2700, 0x2800))

        def send() -> tuple[list[Packet], list[Packet], Packet]:
            """One datagram of the VM to REMOTE: what arrives on the client's eth0 (the first
            uplink's link) and eth1 (the second's), and the datagram."""
            frame = out_frame()
            frame[IP].dst, frame[IP].id = REMOTE, next(ident)
            tx = env.packet_socket(lab.pod_ns(POD1), "eth0")
            rx = {dev: env.packet_socket(lab.client, dev) for dev in ("eth0", "eth1")}
            for s in rx.values():
                drain(s)
            tx.send(bytes(frame))
            got: dict[str, list[Packet]] = {
                dev: [
                    p for p in map(Ether, capture(s, 0.5)) if IP in p and p[IP].id == frame[IP].id
                ]
                for dev, s in rx.items()
            }
            env.close()
            return got["eth0"], got["eth1"], frame

        first, second, frame = send()
        assert second == [] and len(first) == 1, (first, second)
        assert_frame(bytes(first[0]), forwarded(frame, UPLINK_MAC, CLIENT_MAC, src=LB_WHOLE))
        counted = env.counters()["nat_egress"]
        links = env.links()
        env.stop_agent(signal.SIGKILL)
        assert env.links() == links, "the programs did not stay attached"
        lab.ip(lab.node, "route", "replace", f"{REMOTE}/32", "via", CLIENT2_IP, "dev", UPLINK2)
        moved: list[tuple[list[Packet], list[Packet], Packet]] = []

        def follows() -> bool:
            moved.append(send())
            return bool(moved[-1][1])

        # (a bound for a hang: the cached answer is a second old at most when it is asked again)
        wait_for(follows, hang_bound(10), "the VM's datagrams to leave by the second uplink")
        first, second, frame = moved[-1]
        assert first == [] and len(second) == 1, (first, second)
        assert_frame(bytes(second[0]), forwarded(frame, UPLINK2_MAC, CLIENT2_MAC, src=LB_WHOLE))
        first, second, frame = send()
        assert first == [] and len(second) == 1, "the route's old answer came back"
        assert_frame(bytes(second[0]), forwarded(frame, UPLINK2_MAC, CLIENT2_MAC, src=LB_WHOLE))
        assert env.counters()["nat_egress"] == counted + len(moved) + 1
