"""Issue 11's proof in the namespace lab, with a real `cozyebpf run` and known traffic:

- N packets to a whole-IP LB IP, M to an unlisted port and K to a listed port of a port-filter
  Service, and E from its pod: the metrics show exactly N, M (drop_port), K and E for the right
  Services, and the node-wide counters agree; a removed Service's series are gone from the next
  scrape;
- `explain` gives the verdict, reason, Service and translation of each mode, of an unmanaged
  address and of egress, and leaves every counter, flow and fragment entry unchanged;
- `monitor --json` shows the drops with reason, port and Service while they happen and stops
  cleanly (the programs' switch off again); one killed with SIGKILL leaves the switch on only
  until the agent's next check;
- `status` shows the attachments, layout, Services by mode, the last sync and the problems.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.l2 import Ether

from cozyebpf import __version__
from cozyebpf.datapath.layout import LAYOUT_VERSION, MON_OFF
from cozyebpf.datapath.maps import PinnedMaps
from cozylab.k8s import Svc
from cozylab.netns import CLIENT_IP, CLIENT_MAC, DEFAULT_PODS, UPLINK, UPLINK_MAC
from tests.support.contract import CONTRACT
from tests.support.labtools import (
    AgentLab,
    agent_lab,
    dry_run_witness,
    interrupt,
    read_line_with,
    wait_for,
)
from tests.support.packets import LB_FILT, LB_UNKNOWN, LB_WHOLE

POD1, POD2 = DEFAULT_PODS[:2]
WHOLE = Svc("vm-whole", LB_WHOLE, POD1.ip, [("TCP", 22)], whole_ip="true")
FILT = Svc("vm-filt", LB_FILT, POD2.ip, [("TCP", 80), ("UDP", 53)])
HEALTH, METRICS = "127.0.0.1:19810", "127.0.0.1:19811"  # in the node's namespace
SINK_PORT, EGRESS_PORT = 5000, 6000  # ports where nobody answers (no ICMP errors either)

Sample = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, cozyebpf_cmd: list[str]) -> Iterator[AgentLab]:
    with agent_lab("o", tmp_path_factory.mktemp("obs"), cozyebpf_cmd) as env:
        env.start_agent(
            "--health-address", HEALTH, "--metrics-address", METRICS, "--check-interval", "0.5"
        )
        env.set_services(WHOLE, FILT)
        # sockets that take traffic and never answer: no reply or ICMP error muddles the counts
        sinks = [
            env.lab.ns_socket(ns, socket.AF_INET, socket.SOCK_DGRAM)
            for ns in (env.lab.pod_ns(POD1), env.lab.pod_ns(POD2), env.lab.pod_ns(POD2))
        ]
        sinks[0].bind(("0.0.0.0", SINK_PORT))
        sinks[1].bind(("0.0.0.0", 53))
        sinks[2].bind(("0.0.0.0", SINK_PORT))
        client_sink = env.lab.ns_socket(env.lab.client, socket.AF_INET, socket.SOCK_DGRAM)
        client_sink.bind(("0.0.0.0", EGRESS_PORT))
        yield env
        for s in (*sinks, client_sink):
            s.close()
        assert env.stop_agent() == 0, env.log()[-3000:]


def http_get(env: AgentLab, address: str, path: str) -> str:
    """GET from inside the node's namespace, where the agent listens."""

    def get() -> str:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as r:
            return str(r.read().decode())

    return env.lab.in_ns(env.lab.node, get)


def scrape(env: AgentLab) -> Sample:
    out: Sample = {}
    for fam in text_string_to_metric_families(http_get(env, METRICS, "/metrics")):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: Sample, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def cli(env: AgentLab, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return env.lab.exec(env.lab.node, *env.cmd, *args, "--pin-dir", env.pin_dir, check=check)


def send(env: AgentLab, frames: list[bytes]) -> None:
    tx = env.packet_socket(env.lab.client, "eth0")
    for f in frames:
        tx.send(f)


def client_frame(dst: str, proto: str, dport: int, n: int) -> bytes:
    l4 = (
        TCP(sport=41000 + n, dport=dport, flags="S")
        if proto == "tcp"
        else UDP(sport=41000 + n, dport=dport) / b"counted"
    )
    return bytes(Ether(src=CLIENT_MAC, dst=UPLINK_MAC) / IP(src=CLIENT_IP, dst=dst) / l4)


def test_metrics_count_each_services_traffic_exactly(env: AgentLab) -> None:
    before = scrape(env)
    n, m, k, e = 7, 5, 3, 4
    send(env, [client_frame(LB_WHOLE, "udp", SINK_PORT, i) for i in range(n)])
    send(env, [client_frame(LB_FILT, "tcp", 443, i) for i in range(m)])  # not in spec.ports
    send(env, [client_frame(LB_FILT, "udp", 53, i) for i in range(k)])
    with env.lab.ns_socket(env.lab.pod_ns(POD2), socket.AF_INET, socket.SOCK_DGRAM) as s:
        for i in range(e):
            s.sendto(b"from the pod %d" % i, (CLIENT_IP, EGRESS_PORT))

    def delta(name: str, **labels: str) -> float:
        return value(scrape(env), name, **labels) - value(before, name, **labels)

    whole = {"namespace": "default", "service": "vm-whole"}
    filt = {"namespace": "default", "service": "vm-filt"}
    wait_for(
        lambda: delta("cozyebpf_service_packets_total", **filt, direction="egress") == e,
        5,
        "the pod's egress in the metrics",
    )
    after = scrape(env)

    def d(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert d("cozyebpf_service_packets_total", **whole, direction="ingress") == n
    assert d("cozyebpf_service_packets_total", **whole, direction="egress") == 0
    assert d("cozyebpf_service_drops_total", **filt, reason="drop_port") == m
    assert d("cozyebpf_service_packets_total", **filt, direction="ingress") == k
    assert d("cozyebpf_service_packets_total", **filt, direction="egress") == e
    frame = len(client_frame(LB_WHOLE, "udp", SINK_PORT, 0))
    assert d("cozyebpf_service_bytes_total", **whole, direction="ingress") == n * frame
    # node-wide, every reason as `maps dump` names it
    assert d("cozyebpf_datapath_packets_total", reason="nat_ingress") == n
    assert d("cozyebpf_datapath_packets_total", reason="drop_port") == m
    assert d("cozyebpf_datapath_packets_total", reason="pass_port") == k
    assert d("cozyebpf_datapath_packets_total", reason="nat_egress") == e
    # the rest of the contract
    assert value(after, "cozyebpf_services", mode="whole-ip") == 1
    assert value(after, "cozyebpf_services", mode="port-filter") == 1
    assert value(after, "cozyebpf_map_entries", map="addr4") == 4  # 2 LB IPs, 2 pod IPs
    assert value(after, "cozyebpf_map_capacity", map="addr4") == 131072
    assert value(after, "cozyebpf_last_sync_timestamp_seconds") > time.time() - 600
    assert value(after, "cozyebpf_sync_duration_seconds_count", kind="full") >= 1
    assert value(after, "cozyebpf_network_programming_duration_seconds_count") >= 1
    build = (("layout", str(LAYOUT_VERSION)), ("version", __version__))
    assert ("cozyebpf_build_info", build) in after
    for name in ("cozyebpf_sync_errors_total", "cozyebpf_monitor_events_lost_total"):
        assert (name, ()) in after
    assert value(after, "cozyebpf_problems", severity="error") == 0
    # exactly the families of the contract (and the process collector's)
    served = {n for (n, _) in after if n.startswith("cozyebpf_")}
    assert served >= set(CONTRACT), set(CONTRACT) - served
    extra = {n for n in served - set(CONTRACT) if not n.endswith(("_count", "_sum", "_created"))}
    assert extra == set(), extra
    # no series is about an address: no label holds one
    labels = {v for (_, ls) in after for _, v in ls}
    assert not {CLIENT_IP, LB_WHOLE, LB_FILT, POD1.ip, POD2.ip} & labels


def test_a_removed_service_is_gone_from_the_next_scrape(env: AgentLab) -> None:
    send(env, [client_frame(LB_FILT, "udp", 53, 0)])
    assert any(("service", "vm-filt") in ls for (_, ls) in scrape(env))
    env.set_services(WHOLE)
    try:
        m = scrape(env)
        assert not any(("service", "vm-filt") in ls for (_, ls) in m)
        assert any(("service", "vm-whole") in ls for (_, ls) in m)
        assert value(m, "cozyebpf_services", mode="port-filter") == 0
    finally:
        env.set_services(WHOLE, FILT)


def tables(env: AgentLab) -> tuple[Any, ...]:
    """Everything a dry run must leave as it is."""
    with PinnedMaps.open(env.pin_dir) as m:
        return dry_run_witness(m)


EGRESS_OF_POD2 = ["--direction", "egress", "--from", f"{POD2.ip}:40002", "--to", f"{CLIENT_IP}:443"]
EXPLAIN = [
    (
        "whole-ip",
        ["--from", CLIENT_IP, "--to", f"{LB_WHOLE}:4444"],
        {"verdict": "pass", "reason": "nat_ingress", "service": "default/vm-whole"},
        {"dst": POD1.ip, "dport": 4444},
    ),
    (
        "listed port",
        ["--from", f"{CLIENT_IP}:40001", "--to", f"{LB_FILT}:53", "--proto", "udp"],
        {"verdict": "pass", "reason": "pass_port", "service": "default/vm-filt"},
        {"dst": POD2.ip, "sport": 40001, "dport": 53},
    ),
    (
        "unlisted port",
        ["--from", CLIENT_IP, "--to", f"{LB_FILT}:443"],
        {"verdict": "drop", "reason": "drop_port", "service": "default/vm-filt"},
        {"dst": LB_FILT, "dport": 443},
    ),
    (
        "icmp to a port filter",
        ["--from", CLIENT_IP, "--to", LB_FILT, "--proto", "icmp"],
        {"verdict": "drop", "reason": "drop_icmp", "service": "default/vm-filt"},
        {"sport": None, "dport": None},
    ),
    (
        "the pod ip directly",
        ["--from", CLIENT_IP, "--to", f"{POD2.ip}:80"],
        {"verdict": "pass", "reason": "pass_port", "service": "default/vm-filt"},
        {"dst": POD2.ip},
    ),
    (
        "an unmanaged address",
        ["--from", CLIENT_IP, "--to", f"{LB_UNKNOWN}:80"],
        {"verdict": "pass", "reason": None, "service": None},
        {"dst": LB_UNKNOWN},
    ),
    (
        "egress of a port-filter pod",
        EGRESS_OF_POD2,
        {"verdict": "pass", "reason": "nat_egress", "service": "default/vm-filt"},
        {"src": LB_FILT, "dst": CLIENT_IP, "sport": 40002, "dport": 443},
    ),
    (
        "egress from the pod's own veth",
        [*EGRESS_OF_POD2, "--from-device", POD2.host_dev],
        {"verdict": "pass", "reason": "nat_egress", "service": "default/vm-filt"},
        {"src": LB_FILT, "dst": CLIENT_IP},
    ),
    (
        "egress as a pod ip from another pod's veth",
        [*EGRESS_OF_POD2, "--from-device", POD1.host_dev],
        {"verdict": "drop", "reason": "drop_spoofed", "service": "default/vm-filt"},
        {"src": POD2.ip, "dst": CLIENT_IP},
    ),
]


@pytest.mark.parametrize(
    ("args", "want", "leaves"), [c[1:] for c in EXPLAIN], ids=[c[0] for c in EXPLAIN]
)
def test_explain_changes_nothing_and_says_why(
    env: AgentLab, args: list[str], want: dict[str, Any], leaves: dict[str, Any]
) -> None:
    before = tables(env)
    got = json.loads(cli(env, "explain", "--json", *args).stdout)
    assert tables(env) == before, "a dry run changed a counter or a table"
    assert {k: got[k] for k in want} == want
    assert {k: got[k] for k in leaves} == leaves
    assert set(got) >= {"verdict", "reason", "service", "src", "dst", "sport", "dport", "hint"}
    assert got["device"] == UPLINK


def test_explain_says_what_to_change(env: AgentLab) -> None:
    out = cli(env, "explain", "--from", CLIENT_IP, "--to", f"{LB_FILT}:443").stdout
    assert "verdict: drop" in out and "reason:  drop_port" in out
    assert (
        "port 443/tcp is not in spec.ports of default/vm-filt; add it, or set "
        'networking.cozystack.io/wholeIP: "true"' in out
    )
    out = cli(env, "explain", "--from", CLIENT_IP, "--to", f"{LB_WHOLE}:443").stdout
    assert f"leaves:  {CLIENT_IP}:40000 -> {POD1.ip}:443" in out
    bad = cli(env, "explain", "--from", CLIENT_IP, "--to", LB_FILT, check=False)
    assert bad.returncode == 1 and "tcp needs a destination port" in bad.stderr


def read_events(proc: subprocess.Popen[str], n: int, timeout: float) -> list[dict[str, Any]]:
    assert proc.stdout is not None
    out: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line:
            out.append(json.loads(line))
    return out


def drop_monitor(env: AgentLab) -> subprocess.Popen[str]:
    """`cozyebpf monitor --json --type drop`, once it said it is monitoring."""
    proc = env.lab.popen(
        env.lab.node,
        *env.cmd,
        "monitor",
        "--json",
        "--type",
        "drop",
        "--pin-dir",
        env.pin_dir,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stderr is not None
        text = "monitoring dropped packets"
        assert text in read_line_with(proc.stderr, text)
    except BaseException:
        interrupt(proc)
        raise
    return proc


def test_monitor_shows_drops_while_they_happen_and_stops_cleanly(env: AgentLab) -> None:
    proc = drop_monitor(env)
    try:
        send(env, [client_frame(LB_WHOLE, "udp", SINK_PORT, 0)])  # passes: no event
        send(env, [client_frame(LB_FILT, "tcp", 443, i) for i in range(3)])
        events = read_events(proc, 3, 5)
    finally:
        _, err = interrupt(proc)
    assert proc.returncode == 0, err
    assert "stopped; 0 events lost" in err
    assert len(events) == 3
    for i, ev in enumerate(events):
        assert set(ev) == {
            "time",
            "device",
            "direction",
            "reason",
            "proto",
            "src",
            "dst",
            "sport",
            "dport",
            "service",
            "len",
        }
        assert (ev["device"], ev["direction"], ev["reason"], ev["proto"]) == (
            UPLINK,
            "ingress",
            "drop_port",
            "tcp",
        )
        assert (ev["src"], ev["dst"], ev["sport"], ev["dport"]) == (
            CLIENT_IP,
            LB_FILT,
            41000 + i,
            443,
        )
        assert ev["service"] == "default/vm-filt" and ev["len"] == 54
    with PinnedMaps.open(env.pin_dir) as m:
        assert m.monitor_state().mode == MON_OFF


def test_monitor_shows_a_spoofed_source_and_its_service_counts_it(env: AgentLab) -> None:
    """Issue 21: pod1 sends with pod2's IP as source; the uplink's egress drops it (it came from
    pod1's veth, pod2's IP is routed to pod2's) and the monitor and pod2's Service say so."""
    from cozyebpf.explain import build_packet

    proc = drop_monitor(env)
    try:
        pkt = build_packet(ip_address(POD2.ip), ip_address(CLIENT_IP), 17, 40003, 9999, b"spoof")
        with env.lab.ns_socket(
            env.lab.pod_ns(POD1), socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW
        ) as raw:
            raw.sendto(pkt, (CLIENT_IP, 0))
        events = read_events(proc, 1, 5)
    finally:
        _, err = interrupt(proc)
    assert proc.returncode == 0, err
    assert [
        (e["device"], e["direction"], e["reason"], e["proto"], e["src"], e["dst"], e["service"])
        for e in events
    ] == [(UPLINK, "egress", "drop_spoofed", "udp", POD2.ip, CLIENT_IP, "default/vm-filt")]
    with PinnedMaps.open(env.pin_dir) as m:
        counted = {c.service: c.drops for c in m.service_counters()}
        assert counted["default/vm-filt"].get("drop_spoofed") == 1
        assert m.counters()["drop_spoofed"]["packets"] == 1


def test_a_killed_monitors_switch_is_turned_off_by_the_agent(env: AgentLab) -> None:
    proc = env.lab.popen(
        env.lab.node,
        *env.cmd,
        "monitor",
        "--type",
        "all",
        "--pin-dir",
        env.pin_dir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stderr is not None
        assert "monitoring" in read_line_with(proc.stderr, "monitoring")
        busy = cli(env, "monitor", check=False)
        assert busy.returncode == 1 and "another `cozyebpf monitor`" in busy.stderr
        with PinnedMaps.open(env.pin_dir) as m:
            assert m.monitor_state().mode != MON_OFF
            proc.kill()
            proc.wait()
            wait_for(lambda: m.monitor_state().mode == MON_OFF, 5, "the agent to turn it off")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_status_shows_the_node(env: AgentLab) -> None:
    send(env, [client_frame(LB_FILT, "tcp", 443, 9)])
    d = json.loads(cli(env, "status", "--json", "--agent", HEALTH).stdout)
    dp, agent = d["datapath"], d["agent"]
    assert {(a["device"], a["hook"]) for a in dp["attachments"]} == {
        (UPLINK, "xdp"),
        (UPLINK, "tcx-egress"),
    }
    assert dp["layout_version"] == LAYOUT_VERSION
    assert dp["services"] == {"whole-ip": 1, "port-filter": 1}
    assert dp["monitor"]["running"] is False
    assert dp["top_drops"][0]["reason"] == "drop_port"
    assert dp["top_dropping_services"][0]["service"] == "default/vm-filt"
    assert agent["synced"] is True and agent["sync_errors"] == 0
    assert agent["last_sync"] > time.time() - 600 and agent["services"]["port-filter"] == 1
    assert agent["problems"] == []
    text = cli(env, "status", "--agent", HEALTH).stdout
    assert f"attached: {UPLINK} tcx-egress (cz_egress), {UPLINK} xdp (cz_ingress)" in text
    assert "services: 1 whole-IP, 1 port-filter" in text and "last sync: " in text
    gone = cli(env, "status", "--agent", "127.0.0.1:1").stdout
    assert "agent: cannot reach the agent at http://127.0.0.1:1/status" in gone


def test_maps_dump_names_the_services(env: AgentLab, tmp_path: Path) -> None:
    d = json.loads(cli(env, "maps", "dump", "--json").stdout)
    assert {s["lb_ip"]: s["service"] for s in d["services"]} == {
        LB_WHOLE: "default/vm-whole",
        LB_FILT: "default/vm-filt",
    }
    assert {c["service"] for c in d["service_counters"]} == {"default/vm-whole", "default/vm-filt"}
    assert "per Service:" in cli(env, "maps", "dump").stdout
