"""Egress limits shaped where the uplink has fq (issue 38): the agent follows the uplink's root
qdisc, says in its log and `status` how egress limits are enforced, and with fq the uplink's
egress gives each of a limited Service's packets its departure time (bpf/lib/limit.h, cz_shape):
they leave paced at the rate, whole, with the LB IP as their source, and what would leave more
than the burst's time ahead is dropped as drop_limit. This machine's kernel has no fq
(CONFIG_NET_SCH_FQ is not set): the kernel matrix's 6.12 guest runs this file on every CI run
(cozylab/kmatrix.py, plan "ci"; tests/datapath/test_kernel_guest.py), and the host run skips it
for that reason only (tests/conftest.py). The programs' arithmetic (departure times, the
horizon, from the pod IP and from the LB IP) is test_limit_buckets.py's, on every kernel."""

from __future__ import annotations

import contextlib
import ctypes
import json
import socket
import time
from collections.abc import Iterator

import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from cozyebpf.datapath import bpfsys
from cozyebpf.datapath.layout import BucketVal
from cozyebpf.datapath.maps import PinnedMaps
from cozylab.netns import CLIENT_IP, DEFAULT_PODS, drain
from tests.datapath.test_limits import (
    EGRESS_BURST_BYTES,
    PAYLOAD,
    POD1,
    POD_HOOK,
    WIRE,
    assert_whole,
    cli,
    drops,
    fill_egress_bucket,
    send_egress,
    services,
)
from tests.support.env import hang_bound
from tests.support.labtools import AgentLab, agent_lab, wait_for
from tests.support.packets import LB_WHOLE, partial_checksum_ok

pytestmark = pytest.mark.requires("fq")


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, cozyebpf_cmd: list[str]) -> Iterator[AgentLab]:
    from cozylab.k8s import manifest

    tmp = tmp_path_factory.mktemp("shaping")
    with agent_lab("shp", tmp, cozyebpf_cmd, DEFAULT_PODS[:2], manifest(*services())) as env:
        yield env  # each test starts the agent as it needs it (a start compiles: 80 s in a guest)


def egress_limits(env: AgentLab) -> str:
    """How the agent's node enforces egress limits (`status`): "shaped" or "policed"."""
    return str(json.loads(cli(env, "status", "--json"))["datapath"]["node"]["egress_limits"])


@pytest.mark.parametrize("agent_args", [[], POD_HOOK], ids=["uplink", "pod-facing-hook"])
def test_egress_bandwidth_is_shaped_where_the_uplink_has_fq(
    env: AgentLab, agent_args: list[str]
) -> None:
    """With fq as the uplink's root qdisc the agent shapes egress (its log and `status` say
    so): vm1's datagrams leave at 1 Mbit/s one after the other (fq holds each until the
    departure time the uplink's egress gave it; none leaves before the rate allows), whole,
    with the LB IP as their source, up to the burst's time (64 KiB at 1 Mbit/s: 524 ms) of
    them queued; what would leave later is dropped as drop_limit. fq removed: policed again.
    Where the uplink's egress translates vm1's packets, and where the pod-facing hook does
    (Kube-OVN's layout, host routing on): it leaves them to the uplink's egress, which shapes
    them by their LB IP."""
    node = env.lab.node
    env.start_agent(*agent_args)
    wait_for(lambda: "default/vm1" in env.maps_state().limits, hang_bound(15), "vm1's limits")
    env.lab.exec(node, "tc", "qdisc", "replace", "dev", "uplink", "root", "fq")
    try:
        wait_for(lambda: egress_limits(env) == "shaped", hang_bound(15), "egress shaped")
        assert "egress limits are shaped: fq on uplink" in env.log()
        before = drops(env)
        rx = env.packet_socket(env.lab.client, "eth0")
        drain(rx)
        sock = env.lab.ns_socket(env.lab.pod_ns(POD1), socket.AF_INET, socket.SOCK_DGRAM)
        sink = env.lab.ns_socket(env.lab.client, socket.AF_INET, socket.SOCK_DGRAM)
        sink.bind((CLIENT_IP, 40001))
        n = 150
        try:
            t0 = time.monotonic()
            for i in range(n):
                sock.sendto(b"%05d" % i + b"s" * (PAYLOAD - 5), (CLIENT_IP, 40001))
            sent = time.monotonic() - t0
            arrivals = []
            rx.settimeout(hang_bound(0.5))  # the last one left 0.5 s after the first
            with contextlib.suppress(TimeoutError):
                while True:
                    frame = Ether(rx.recv(65535))
                    if IP in frame and UDP in frame and frame[UDP].dport == 40001:
                        arrivals.append((time.monotonic(), frame))
        finally:
            sock.close()
            sink.close()
        per_packet = WIRE * 8 / 1e6  # seconds of 1 Mbit/s
        horizon = EGRESS_BURST_BYTES // WIRE
        got = len(arrivals)
        assert horizon - 1 <= got <= horizon + int(sent / per_packet) + 2, (got, sent)
        assert drops(env) - before == n - got
        span = arrivals[-1][0] - arrivals[0][0]
        assert span >= 0.9 * (got - 1) * per_packet, (span, got)  # paced, not a burst
        for _, p in arrivals:
            assert p[IP].src == LB_WHOLE and p[IP].dst == CLIENT_IP, p.summary()
            assert partial_checksum_ok(bytes(p)), p.summary()
            i = int(bytes(p[UDP].payload)[:5])
            assert bytes(p[UDP].payload) == b"%05d" % i + b"s" * (PAYLOAD - 5)
        assert "default/vm1: ingress 2 packets/s; egress 1 Mbit/s (egress shaped)" in cli(
            env, "status"
        )
        # a shaper whose queue holds a minute: explain says so (its dry run moves nothing)
        with PinnedMaps.open(env.pin_dir) as m:
            m.read_state()  # (loads the slots)
            key = ctypes.c_uint32(m.slots.slot("default/vm1"))
            b = BucketVal()
            assert key.value and bpfsys.map_lookup(m.fds["buckets"], key, b)
            b.out_edt = time.monotonic_ns() + 60 * 10**9  # fq's clock, and bpf_ktime_get_ns's
            bpfsys.map_update(m.fds["buckets"], key, b)
            out = cli(
                env,
                "explain",
                "--direction",
                "egress",
                "--from-device",
                POD1.host_dev,
                "--from",
                f"{POD1.ip}:4000",
                "--to",
                f"{CLIENT_IP}:40001",
                "--proto",
                "udp",
            )
            assert "drop_limit" in out and "shaped (fq on the uplinks)" in out, out
            assert bpfsys.map_lookup(m.fds["buckets"], key, b)
            assert time.monotonic_ns() + 50 * 10**9 < b.out_edt, "explain's dry run moved it"
            b.out_edt = 0
            bpfsys.map_update(m.fds["buckets"], key, b)
    finally:
        env.lab.exec(node, "tc", "qdisc", "del", "dev", "uplink", "root")
    try:
        wait_for(lambda: egress_limits(env) == "policed", hang_bound(15), "policed again")
        assert "egress limits are policed: uplink has noqueue, not fq" in env.log()
    finally:
        env.stop_agent()


def test_egress_stays_limited_when_fq_goes_while_no_agent_runs(env: AgentLab) -> None:
    """fq on the uplink, the agent shaping, then the agent stopped and fq deleted (issue 45):
    the flag still says shaped and the departure times mean nothing to noqueue, yet vm1's
    flood gets its 64 KiB burst and its rate, as policed (the shaper's horizon), the rest
    drop_limit, whole from the LB IP (test_limits.py's twin leaves the flag set by hand)."""
    node = env.lab.node
    env.lab.exec(node, "tc", "qdisc", "replace", "dev", "uplink", "root", "fq")
    try:
        env.start_agent()
        wait_for(lambda: egress_limits(env) == "shaped", hang_bound(15), "egress shaped")
        env.stop_agent()
    finally:
        env.lab.exec(node, "tc", "qdisc", "del", "dev", "uplink", "root")
    assert egress_limits(env) == "shaped"  # no agent followed the qdisc
    fill_egress_bucket(env)
    with PinnedMaps.open(env.pin_dir) as m:
        m.read_state()  # (loads the slots)
        key = ctypes.c_uint32(m.slots.slot("default/vm1"))
        b = BucketVal()
        assert key.value and bpfsys.map_lookup(m.fds["buckets"], key, b)
        b.out_edt = 0  # the shaper idle
        bpfsys.map_update(m.fds["buckets"], key, b)
    before = drops(env)
    n = 200
    out, elapsed = send_egress(env, 40400, n, b"n")
    burst = EGRESS_BURST_BYTES // WIRE
    refill = int(elapsed * 125_000 / WIRE) + 1
    assert burst - 1 <= len(out) <= burst + refill, (len(out), elapsed)
    assert_whole(out, b"n")
    assert drops(env) - before == n - len(out)
