"""Source verification with the kernel's FIB (issue 21): a packet whose source is a managed pod
IP is translated only when it entered the node from the device the node routes that pod IP to.

A network namespace of our own holds two pod-facing veth devices, A and B, and an uplink; the
pod IP (10.244.77.10, 2001:db8:244::77) is routed via A, forwarding is on. cz_egress and
cz_pod_ingress run with BPF_PROG_RUN from a thread inside that namespace (bpf_fib_lookup asks
the caller's namespace; `ip netns exec` would hide /sys/fs/bpf), the frame's device set in the
context (__sk_buff.ingress_ifindex). Each egress frame is also checked against the reference
model (tests/support/refmodel.py) with the same FIB as its input: verdict, bytes, counters,
per-Service counters, and the device the pod's addr value caches (`dev`).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from ipaddress import ip_address
from typing import TypeVar

import pytest
from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.inet6 import ICMPv6EchoRequest, IPv6, IPv6ExtHdrDestOpt
from scapy.layers.l2 import Dot1Q, Ether
from scapy.packet import Packet

from cozyebpf.datapath import loader
from cozyebpf.datapath.maps import PinnedMaps
from cozylab.netns import in_netns
from tests.support import refmodel as rm
from tests.support.diffharness import Datapath, check_devs, check_frame, check_tables
from tests.support.packets import MAC_A, MAC_B
from tests.support.refmodel import PORT_FILTER, Pod, RefState

T = TypeVar("T")


POD4, LB4, CLIENT4 = "10.244.77.10", "203.0.113.77", "198.51.100.2"
POD6, LB6, CLIENT6 = "2001:db8:244::77", "2001:db8:113::77", "2001:db8:100::2"
TC_NEXT, TC_SHOT = -1, 2


@dataclass
class Node:
    """The namespace, its devices' ifindexes, and the loaded programs on their maps."""

    ns: str
    a: int
    b: int
    uplink: int
    dp: Datapath

    def ip(self, *args: str) -> None:
        subprocess.run(["ip", "-n", self.ns, *args], check=True, capture_output=True)

    def inside(self, fn: Callable[[], T]) -> T:
        """Run `fn` in a thread that has entered only the namespace's network namespace."""
        return in_netns(self.ns, fn)

    def run(self, prog: str, frame: Packet, in_dev: int) -> tuple[int, bytes]:
        return self.inside(lambda: self.dp.run(prog, bytes(frame), in_dev))

    def route_pod_via(self, dev: str) -> None:
        self.ip("route", "replace", f"{POD4}/32", "dev", dev)
        self.ip("-6", "route", "replace", f"{POD6}/128", "dev", dev)


def _ifindex(ns: str, dev: str) -> int:
    out = subprocess.run(
        ["ip", "-n", ns, "-o", "link", "show", "dev", dev],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return int(out.split(":", 1)[0])


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    from cozyebpf.datapath.attach import detach_all
    from tests.support.env import unique_prefix

    ns = unique_prefix("spoof")
    pin_dir = f"/sys/fs/bpf/{ns}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    maps = None
    try:
        # forwarding first: the devices created after it inherit it (bpf_fib_lookup refuses to
        # look up from a device that does not forward)
        for key in ("net.ipv4.ip_forward", "net.ipv6.conf.all.forwarding"):
            subprocess.run(
                ["ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}=1"],
                check=True,
            )
        for dev in ("spa", "spb", "spu"):
            subprocess.run(
                ["ip", "-n", ns, "link", "add", dev, "type", "veth", "peer", "name", f"{dev}-p"],
                check=True,
            )
            for d in (dev, f"{dev}-p"):
                subprocess.run(["ip", "-n", ns, "link", "set", d, "up"], check=True)
        for cmd in (
            ["addr", "add", "198.51.100.1/24", "dev", "spu"],
            ["-6", "addr", "add", "2001:db8:100::1/64", "dev", "spu", "nodad"],
        ):
            subprocess.run(["ip", "-n", ns, *cmd], check=True)
        ids = {d: _ifindex(ns, d) for d in ("spa", "spb", "spu")}
        maps = PinnedMaps.ensure(pin_dir)
        maps.set_node([ids["spu"]], True)
        module = loader.compile_source("cozyebpf.c", pin_dir)  # egress.c and pod.c
        progs = {
            "egress": loader.load_from(module, "cz_egress", "sched_cls"),
            "pod": loader.load_from(module, "cz_pod_ingress", "sched_cls"),
        }
        n = Node(ns, ids["spa"], ids["spb"], ids["spu"], Datapath(maps, progs))
        n.route_pod_via("spa")
        yield n
    finally:
        if maps is not None:
            maps.close()
        detach_all(pin_dir)
        subprocess.run(["ip", "netns", "del", ns], check=False)


@pytest.fixture
def state(node: Node) -> RefState:
    """The pod of both families (a port filter: a translated frame records a flow), its
    device not known yet (0), routed via A."""
    node.route_pod_via("spa")
    node.dp.clear()
    s = RefState(
        pod={
            ip_address(POD4): Pod(ip_address(LB4), PORT_FILTER),
            ip_address(POD6): Pod(ip_address(LB6), PORT_FILTER),
        }
    )
    node.dp.seed(s, 0)
    s.routes = {ip_address(POD4): node.a, ip_address(POD6): node.a}
    return s


def eth() -> Packet:
    return Ether(src=MAC_A, dst=MAC_B)


def from_pod(family: int, sport: int) -> Packet:
    """The pod's packet to a client behind the uplink: IPv4 a TCP SYN, IPv6 UDP."""
    if family == 4:
        return eth() / IP(src=POD4, dst=CLIENT4) / TCP(sport=sport, dport=443, flags="S")
    return eth() / IPv6(src=POD6, dst=CLIENT6) / UDP(sport=sport, dport=53) / b"q"


def egress(node: Node, state: RefState, frame: Packet, in_dev: int) -> rm.Result:
    """cz_egress on `frame` from device `in_dev`, as the model says (check_frame), in the
    namespace; the model's result applied, the flow table and the cached devices compared."""
    result = node.inside(lambda: check_frame(node.dp, state, bytes(frame), True, in_dev))
    state.apply(result, 0)
    check_tables(node.dp, state, f"after {frame!r} from {in_dev}")
    check_devs(node.dp, state, f"after {frame!r} from {in_dev}")
    return result


@pytest.mark.parametrize("family", [4, 6])
def test_egress_from_the_routed_device_only(node: Node, state: RefState, family: int) -> None:
    """From A (the route's device), the cache empty: translated, dev := A. From B: spoofed,
    dev unchanged, nothing recorded. The route moves to B (a VM that migrated): from B passes
    and dev := B, from A is spoofed now."""
    pod = ip_address(POD4 if family == 4 else POD6)
    frame = from_pod(family, 40001)
    r = egress(node, state, frame, node.a)
    assert (r.verdict, set(r.counts) - {"flow_new"}) == (rm.PASS, {"nat_egress"})
    assert node.dp.dev(pod) == node.a

    r = egress(node, state, from_pod(family, 40002), node.b)
    assert (r.verdict, r.counts) == (rm.DROP, {"drop_spoofed": (1, len(r.frame))})
    assert r.frame == bytes(from_pod(family, 40002))
    assert node.dp.dev(pod) == node.a
    assert {f.pod_port for f in node.dp.flows()} == {40001}  # none for the spoofed one

    node.route_pod_via("spb")
    state.routes[pod] = node.b
    r = egress(node, state, from_pod(family, 40003), node.b)
    assert r.verdict == rm.PASS and "nat_egress" in r.counts
    assert node.dp.dev(pod) == node.b
    r = egress(node, state, from_pod(family, 40004), node.a)
    assert r.counts == {"drop_spoofed": (1, len(r.frame))}
    assert node.dp.dev(pod) == node.b
    r = egress(node, state, from_pod(family, 40005), 0)  # the node's own: trusted
    assert r.verdict == rm.PASS and "nat_egress" in r.counts


@pytest.mark.parametrize("family", [4, 6])
def test_the_full_path_caches_but_not_a_dry_run(node: Node, state: RefState, family: int) -> None:
    """The entry program hands a frame from another device than the cached one to the full
    path, which asks the FIB: a dry run (explain) from A is translated and caches nothing; a
    tagged frame (the full path only) from A caches A, as does an untagged one the fast path
    would not take (IPv4 options, an IPv6 extension header) after the route moved to B."""
    from cozyebpf.explain import dry_run

    pod = ip_address(POD4 if family == 4 else POD6)
    inner = from_pod(family, 40010).payload
    run = node.inside(
        lambda: dry_run(node.dp.maps, node.dp.fds["egress"], False, bytes(inner), node.a)
    )
    assert not run.drop and run.result is not None
    assert node.dp.dev(pod) == 0, "a dry run cached the device"
    r = egress(node, state, eth() / Dot1Q(vlan=7) / inner, node.a)
    assert r.verdict == rm.PASS and "nat_egress" in r.counts
    assert node.dp.dev(pod) == node.a
    node.route_pod_via("spb")
    state.routes[pod] = node.b
    if family == 4:
        odd = eth() / IP(src=POD4, dst=CLIENT4, options=b"\x01\x01\x01\x01") / UDP(dport=9)
    else:
        odd = eth() / IPv6(src=POD6, dst=CLIENT6) / IPv6ExtHdrDestOpt() / ICMPv6EchoRequest()
    r = egress(node, state, odd, node.b)
    assert r.verdict == rm.PASS and "nat_egress" in r.counts
    assert node.dp.dev(pod) == node.b


@pytest.mark.parametrize("family", [4, 6])
def test_the_pod_facing_hook(node: Node, state: RefState, family: int) -> None:
    """cz_pod_ingress: from A, a packet to a client behind the uplink is translated there (both
    families: the IPv6 one too since pod_route6) and dev := A; from B it is dropped as spoofed,
    counted, dev unchanged, no flow."""
    pod = ip_address(POD4 if family == 4 else POD6)
    frame = from_pod(family, 40020)
    before = node.dp.counters()
    code, out = node.run("pod", frame, node.b)
    assert code == TC_SHOT and out == bytes(frame)
    got = node.dp.counters().get("drop_spoofed", (0, 0))
    assert got[0] == before.get("drop_spoofed", (0, 0))[0] + 1
    assert node.dp.dev(pod) == 0 and node.dp.flows() == {}
    code, out = node.run("pod", frame, node.a)
    assert code == TC_NEXT
    want = rm.egress(state, bytes(frame), 0).frame
    assert out == want and out != bytes(frame)
    assert node.dp.dev(pod) == node.a
    code, out = node.run("pod", frame, node.b)
    assert code == TC_SHOT and node.dp.dev(pod) == node.a


def test_a_device_that_does_not_exist_is_spoofed(node: Node, state: RefState) -> None:
    """The FIB fails for an ifindex the namespace does not have: spoofed."""
    r = egress(node, state, from_pod(4, 40030), 2_000_000_009)
    assert r.counts == {"drop_spoofed": (1, len(r.frame))}
    assert node.dp.dev(ip_address(POD4)) == 0
