"""loadBalancerSourceRanges and expiring reply flows through the real agent and datapath, both
families: who may connect (through the LB IP and to the pod IP directly, whole-IP and
port-filter), the pod's own connections to anyone, an invalid range among valid ones, a change
under traffic, and replies after a flow's (short) idle timeout."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct
from collections.abc import Iterator

import pytest
from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether

from cozyebpf.datapath.maps import PinnedMaps
from cozylab.k8s import Svc, manifest
from cozylab.netns import CLIENT_IP, CLIENT_IP6, CLIENT_MAC, DEFAULT_PODS, UPLINK, UPLINK_MAC
from tests.support.clock import age_flows
from tests.support.labtools import AgentLab, agent_lab, serve, tcp_echo, wait_for
from tests.support.packets import LB_FILT, LB_WHOLE

POD1, POD2 = DEFAULT_PODS[:2]
LB6_WHOLE, LB6_FILT = "2001:db8:113::10", "2001:db8:113::20"
#: a second client address: outside the ranges the tests give
OTHER_IP, OTHER_IP6 = "198.51.100.3", "2001:db8:100::3"
INSIDE = [f"{CLIENT_IP}/32", "2001:db8:100::2/128"]
TIMEOUT = 2.0  # --flow-timeout-udp and --flow-timeout-tcp-closing

FAMILIES = {
    4: (socket.AF_INET, CLIENT_IP, OTHER_IP, {LB_WHOLE: POD1.ip, LB_FILT: POD2.ip}),
    6: (socket.AF_INET6, CLIENT_IP6, OTHER_IP6, {LB6_WHOLE: POD1.ip6, LB6_FILT: POD2.ip6}),
}


def older(env: AgentLab, seconds: float) -> None:
    """The flows as they are `seconds` later (without waiting for them)."""
    with PinnedMaps.open(env.pin_dir) as m:
        age_flows(m, int(seconds * 1e9))


def svcs(ranges: list[str] | None = INSIDE) -> tuple[Svc, Svc]:
    whole = Svc(
        "vm1",
        LB_WHOLE,
        POD1.ip,
        [("TCP", 22)],
        whole_ip="true",
        lb_ip6=LB6_WHOLE,
        pod_ip6=POD1.ip6,
        source_ranges=ranges,
    )
    filt = Svc(
        "vm2",
        LB_FILT,
        POD2.ip,
        [("TCP", 80), ("UDP", 53)],
        lb_ip6=LB6_FILT,
        pod_ip6=POD2.ip6,
        source_ranges=ranges,
    )
    return whole, filt


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, cozyebpf_cmd: list[str]) -> Iterator[AgentLab]:
    tmp = tmp_path_factory.mktemp("ranges")
    with agent_lab("r", tmp, cozyebpf_cmd, DEFAULT_PODS[:2], manifest(*svcs())) as env:
        lab = env.lab
        lab.ip(lab.client, "addr", "add", f"{OTHER_IP}/24", "dev", "eth0")
        lab.ip(lab.client, "-6", "addr", "add", f"{OTHER_IP6}/64", "dev", "eth0", "nodad")
        lab.neigh(lab.node, OTHER_IP, CLIENT_MAC, UPLINK)
        lab.neigh(lab.node, OTHER_IP6, CLIENT_MAC, UPLINK)
        env.start_agent(
            "--flow-timeout-udp", str(TIMEOUT), "--flow-timeout-tcp-closing", str(TIMEOUT)
        )
        yield env


def _valid(ranges: list[str]) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    out = []
    for r in ranges:
        with contextlib.suppress(ValueError):
            out.append(ipaddress.ip_network(r))
    return out


def set_ranges(env: AgentLab, ranges: list[str] | None) -> None:
    """Program both Services with `ranges` and wait until the maps hold them."""
    env.set_services(*svcs(ranges))
    want = None if ranges is None else {str(n.network_address) for n in _valid(ranges)}

    def programmed() -> bool:
        have = env.maps_state().ranges
        if want is None:
            return not have
        nets = {str(n.network_address) for ns in have.values() for n in ns}
        return len(have) == 4 and nets == want

    wait_for(programmed, 10, lambda: f"the ranges; log:\n{env.log()[-2000:]}")


def talk(
    env: AgentLab, family: int, src: str, dst: str, port: int, data: bytes, timeout: float = 1.5
) -> bytes | None:
    """A TCP exchange from the client, bound to `src`: the answer, or None (no connection)."""
    with env.lab.ns_socket(env.lab.client, family, socket.SOCK_STREAM) as c:
        c.settimeout(timeout)
        c.bind((src, 0))
        try:
            c.connect((dst, port))
            c.sendall(data)
            return c.recv(1024)
        except (TimeoutError, OSError):
            return None


@pytest.mark.parametrize("version", [4, 6])
def test_inside_connects_and_outside_is_dropped(env: AgentLab, version: int) -> None:
    set_ranges(env, INSIDE)
    family, inside, outside, lbs = FAMILIES[version]
    lab = env.lab
    before = env.counters().get("drop_source", 0)
    for lb, pod_ip in lbs.items():  # whole-IP (any port) and port-filter (an allowed port)
        pod = POD1 if pod_ip in (POD1.ip, POD1.ip6) else POD2
        port = 4444 if pod is POD1 else 80
        with serve(lab, lab.pod_ns(pod), socket.SOCK_STREAM, port, tcp_echo, family=family):
            assert talk(env, family, inside, lb, port, b"in") == f"{inside} in".encode()
            assert talk(env, family, outside, lb, port, b"out", 0.5) is None, lb
        # the pod IP sent to directly (its answers would leave as the LB IP: frames, not a
        # connection)
        for src, arrives in ((inside, True), (outside, False)):
            syn = TCP(sport=40123, dport=port, flags="S", seq=7)
            got = env.send_and_capture(
                _raw(version, src, pod_ip, syn), pod, lambda f, s=src: _tcp_from(f, s, 40123)
            )
            assert bool(got) == arrives, (src, pod_ip)
    assert env.counters().get("drop_source", 0) > before
    # counted for the Services too
    from cozyebpf.datapath.maps import PinnedMaps

    with PinnedMaps.open(env.pin_dir) as m:
        per = {c.service: c.drops.get("drop_source", 0) for c in m.service_counters()}
    assert per.get("default/vm1", 0) > 0 and per.get("default/vm2", 0) > 0, per


@pytest.mark.parametrize("version", [4, 6])
def test_the_pods_own_connection_to_an_outside_remote_gets_its_replies(
    env: AgentLab, version: int
) -> None:
    set_ranges(env, INSIDE)
    family, _, outside, lbs = FAMILIES[version]
    lab = env.lab
    with serve(lab, lab.client, socket.SOCK_STREAM, 8446, tcp_echo, family=family):
        for lb, pod_ip in lbs.items():
            pod = POD1 if pod_ip in (POD1.ip, POD1.ip6) else POD2
            with lab.ns_socket(lab.pod_ns(pod), family, socket.SOCK_STREAM) as c:
                c.settimeout(3)
                c.connect((outside, 8446))
                c.sendall(b"mine")
                assert c.recv(1024) == f"{lb} mine".encode()


def test_an_invalid_range_among_valid_ones(env: AgentLab) -> None:
    offset = len(env.log())
    set_ranges(env, [*INSIDE, "198.51.100.300/32"])
    # the maps held these valid ranges already (the test before set INSIDE): the read of the
    # new file is told by its warning, which may come after set_ranges returns
    wait_for(lambda: "198.51.100.300/32" in env.log()[offset:], 10, "the invalid range named")
    assert "vm1" in env.log()[offset:]
    lab = env.lab
    with serve(lab, lab.pod_ns(POD1), socket.SOCK_STREAM, 4444, tcp_echo):
        assert talk(env, socket.AF_INET, CLIENT_IP, LB_WHOLE, 4444, b"a") == b"198.51.100.2 a"
        assert talk(env, socket.AF_INET, OTHER_IP, LB_WHOLE, 4444, b"b", 0.5) is None


@pytest.mark.parametrize("version", [4, 6])
def test_a_change_of_the_ranges_under_traffic(env: AgentLab, version: int) -> None:
    """New ranges apply to new connections and to the traffic that flows, without a restart:
    a stream of datagrams from `outside` (which the pod does not answer) passes while a range
    holds it and stops when the range goes."""
    family, _, outside, lbs = FAMILIES[version]
    lb = next(iter(lbs))  # whole-IP
    lab = env.lab
    set_ranges(env, INSIDE)
    with serve(lab, lab.pod_ns(POD1), socket.SOCK_STREAM, 4444, tcp_echo, family=family):
        assert talk(env, family, outside, lb, 4444, b"x", 0.5) is None
        set_ranges(env, [*INSIDE, f"{OTHER_IP}/32", f"{OTHER_IP6}/128"])
        assert talk(env, family, outside, lb, 4444, b"x") == f"{outside} x".encode()

    def datagram() -> bool:
        frame = _raw(version, outside, lb, UDP(sport=40999, dport=7000) / b"stream")
        return bool(env.send_and_capture(frame, POD1, lambda f: b"stream" in f, 0.5))

    assert datagram()
    set_ranges(env, INSIDE)
    assert not datagram()
    set_ranges(env, None)


@contextlib.contextmanager
def migrating(env: AgentLab) -> Iterator[None]:
    """Every managed pod marked as migrating (CZ_F_LEARN) in the maps, as the agent marks a pod
    ready on two nodes; the entries as they were afterwards. The manifest source knows no
    nodes, so the mark is written here; the agent rewrites it only at its resync (60 s)."""
    from dataclasses import replace

    from cozyebpf.state import diff

    with PinnedMaps.open(env.pin_dir) as m:
        before = m.read_state()
        learning = before.copy()
        learning.services = {k: replace(v, learning=True) for k, v in before.services.items()}
        learning.pods = {k: replace(v, learning=True) for k, v in before.pods.items()}
        m.apply(diff(before, learning))
        try:
            yield
        finally:
            m.apply(diff(m.read_state(), before))


@pytest.mark.parametrize("version", [4, 6])
def test_a_migrating_pod_learns_only_from_inside_the_ranges(env: AgentLab, version: int) -> None:
    """While a pod migrates, TCP that opens nothing passes its filter to any port (pass_learn)
    from a source inside the Service's ranges, and never from one outside them (issue 28):
    those get drop_source, to the LB IP and to the pod IP, whole-IP and port-filter alike."""
    set_ranges(env, INSIDE)
    _, inside, outside, lbs = FAMILIES[version]
    sport = 41000 + version
    with migrating(env):
        for lb, pod_ip in lbs.items():
            pod = POD1 if pod_ip in (POD1.ip, POD1.ip6) else POD2
            for dst in (lb, pod_ip):
                before = env.counters()
                ack = TCP(sport=sport, dport=5555, flags="A", seq=9) / b"mid-flow"
                got = env.send_and_capture(
                    _raw(version, outside, dst, ack), pod, lambda f: _tcp_from(f, outside, sport)
                )
                after = env.counters()
                assert not got, (outside, dst)
                assert after.get("pass_learn", 0) == before.get("pass_learn", 0), (outside, dst)
                assert after.get("drop_source", 0) == before.get("drop_source", 0) + 1, dst
        # from inside, the same frame is learned (the mark is in effect)
        before = env.counters().get("pass_learn", 0)
        lb_filt = list(lbs)[1]
        ack = TCP(sport=sport, dport=5555, flags="A", seq=9) / b"mid-flow"
        got = env.send_and_capture(
            _raw(version, inside, lb_filt, ack), POD2, lambda f: _tcp_from(f, inside, sport)
        )
        assert got, (inside, lb_filt)
        assert env.counters().get("pass_learn", 0) == before + 1


def _tcp_from(frame: bytes, src: str, sport: int) -> bool:
    p = Ether(frame)
    srcs = [p[layer].src for layer in (IP, IPv6) if layer in p]
    return srcs == [src] and TCP in p and p[TCP].sport == sport


def _raw(version: int, src: str, dst: str, l4: object) -> bytes:
    ip = IP(src=src, dst=dst) if version == 4 else IPv6(src=src, dst=dst)
    return bytes(Ether(src=CLIENT_MAC, dst=UPLINK_MAC) / ip / l4)


@pytest.mark.parametrize("version", [4, 6])
def test_a_udp_reply_passes_before_the_timeout_and_not_after(env: AgentLab, version: int) -> None:
    family, inside, _, lbs = FAMILIES[version]
    lb_filt = list(lbs)[1]
    lab = env.lab
    set_ranges(env, None)
    with (
        lab.ns_socket(lab.client, family, socket.SOCK_DGRAM) as remote,
        lab.ns_socket(lab.pod_ns(POD2), family, socket.SOCK_DGRAM) as pod,
    ):
        remote.bind((inside, 9053))
        remote.settimeout(2)
        pod.bind(("::" if version == 6 else "0.0.0.0", 40053))  # not an allowed port
        pod.settimeout(1)
        pod.sendto(b"q", (inside, 9053))
        _, peer = remote.recvfrom(100)
        assert peer[0] == lb_filt
        remote.sendto(b"r1", (lb_filt, 40053))
        assert pod.recvfrom(100)[0] == b"r1"  # within the timeout
        older(env, TIMEOUT + 1.5)
        before = env.counters().get("drop_port", 0)
        remote.sendto(b"r2", (lb_filt, 40053))
        with pytest.raises(TimeoutError):
            pod.recvfrom(100)  # expired: dropped like any unlisted port
        assert env.counters().get("drop_port", 0) > before


@pytest.mark.parametrize("close", ["fin", "rst"])
@pytest.mark.parametrize("version", [4, 6])
def test_a_closed_tcp_flow_stops_admitting_replies(env: AgentLab, version: int, close: str) -> None:
    """The pod connects out, then closes by FIN or RST: after the closing timeout a segment of
    that flow from the remote is dropped; before, it passed."""
    family, inside, _, lbs = FAMILIES[version]
    lb_filt = list(lbs)[1]
    lab = env.lab
    set_ranges(env, None)
    srv = lab.ns_socket(lab.client, family, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((inside, 9080))
    srv.listen(1)
    srv.settimeout(3)
    with srv, lab.ns_socket(lab.pod_ns(POD2), family, socket.SOCK_STREAM) as c:
        c.settimeout(3)
        c.connect((inside, 9080))
        conn, _ = srv.accept()
        pod_port = c.getsockname()[1]
        if close == "rst":
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c.close()
        conn.close()
    tx = env.packet_socket(lab.client, "eth0")
    seg = _raw(version, inside, lb_filt, TCP(sport=9080, dport=pod_port, flags="A", seq=1))
    before = env.counters()
    tx.send(seg)
    wait_for(lambda: env.counters().get("pass_reply", 0) > before.get("pass_reply", 0), 2, "a pass")
    with PinnedMaps.open(env.pin_dir) as m:
        (flow,) = [
            e
            for e in m.flow_entries()
            if e.flow.pod_port == pod_port and e.flow.remote_port == 9080
        ]
    assert flow.closing, "the pod's FIN or RST marked its flow"
    older(env, TIMEOUT + 1.5)
    before = env.counters()
    tx.send(seg)
    wait_for(lambda: env.counters().get("drop_port", 0) > before.get("drop_port", 0), 2, "a drop")
    assert env.counters().get("pass_reply", 0) == before.get("pass_reply", 0)


def test_maps_dump_shows_each_flows_age(env: AgentLab) -> None:
    import json
    import subprocess

    out = subprocess.run(
        [
            *env.lab.nsenter(env.lab.node),
            *env.cmd,
            "maps",
            "dump",
            "--pin-dir",
            env.pin_dir,
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    d = json.loads(out)
    assert d["flow_timeouts"] == {"udp": TIMEOUT, "icmp": 30, "tcp": 432000, "tcp_closing": TIMEOUT}
    assert d["flow_entries"] and all("age_s" in f for f in d["flow_entries"])
    assert UDP  # scapy layers used above
