"""`cozyebpf maps dump`: the JSON-ready data and the table, for IPv4, IPv6 and dual-stack
states (whole expected outputs)."""

from __future__ import annotations

import json
from ipaddress import ip_address, ip_network
from typing import Any

import pytest

from cozyebpf.datapath.maps import Flow, FlowEntry, ServiceCounters
from cozyebpf.dump import build_dump, render_dump
from cozyebpf.state import AllowedPort, IPAddress, MapState, PodEntry, Proto, ServiceEntry


def ip(text: str) -> IPAddress:
    return ip_address(text)


LONG_LB, LONG_POD = "2001:db8:ffff:ffff:ffff:ffff:ffff:fe11", "fd00:10:244:0:1234:5678:9abc:def0"

IPV4 = MapState(
    services={
        ip("192.0.2.10"): ServiceEntry(ip("10.244.0.5"), True, True),
        ip("192.0.2.9"): ServiceEntry(ip("10.244.0.7"), False, False),
    },
    pods={
        ip("10.244.0.5"): PodEntry(ip("192.0.2.10"), True, True),
        ip("10.244.0.7"): PodEntry(ip("192.0.2.9"), False, False),
    },
    allowed={
        AllowedPort(ip("10.244.0.5"), Proto.UDP, 53),
        AllowedPort(ip("10.244.0.5"), Proto.TCP, 22),
    },
)

# dual-stack vm1 (port filter), IPv4 whole-IP vm2, two IPv6-only Services (one with long
# addresses), and a pods entry whose LB IP has no service entry
VM1, VM2 = "default/vm1", "tenant-a/vm2"
DUAL = MapState(
    services={
        ip(LONG_LB): ServiceEntry(ip(LONG_POD), False, False),
        ip("2001:db8::10"): ServiceEntry(ip("fd00:10:244::5"), True, True, VM1),
        ip("192.0.2.10"): ServiceEntry(ip("10.244.0.5"), True, True, VM1),
        ip("2001:db8::9"): ServiceEntry(ip("fd00:10:244::9"), True, False),
        ip("192.0.2.9"): ServiceEntry(ip("10.244.0.7"), False, False, VM2),
    },
    pods={
        ip("fd00:10:244::9"): PodEntry(ip("2001:db8::9"), True, False),
        ip(LONG_POD): PodEntry(ip(LONG_LB), False, False),
        ip("fd00:10:244::5"): PodEntry(ip("2001:db8::10"), True, True, VM1),
        ip("10.244.0.5"): PodEntry(ip("192.0.2.10"), True, True, VM1),
        ip("10.244.0.7"): PodEntry(ip("192.0.2.9"), False, False, VM2),
        ip("fd00::99"): PodEntry(ip("2001:db8::99"), True, False),
    },
    allowed={
        AllowedPort(ip("fd00:10:244::5"), Proto.SCTP, 9),
        AllowedPort(ip("10.244.0.5"), Proto.UDP, 53),
        AllowedPort(ip("fd00:10:244::5"), Proto.TCP, 22),
        AllowedPort(ip("10.244.0.5"), Proto.TCP, 22),
        AllowedPort(ip("fd00:10:244::5"), Proto.UDP, 53),
    },
    # vm2 accepts two ranges, the IPv6-only Service's pod none at all
    ranges={
        ip("10.244.0.7"): frozenset({ip_network("198.51.100.0/24"), ip_network("192.0.2.7/32")}),
        ip("fd00:10:244::9"): frozenset(),
    },
)
NOW = 500_000_000_000
FLOWS = [
    FlowEntry(
        Flow(ip("10.244.0.5"), ip("198.51.100.1"), 40000, 53, 17), NOW - 3_000_000_000, False
    ),
    FlowEntry(Flow(ip("fd00:10:244::5"), ip("2001:db8::1"), 40001, 443, 6), NOW, True),
]
FLOW_DICTS = [f.as_dict(NOW) for f in FLOWS]
TIMEOUTS = {"udp": 120.0, "icmp": 30.0, "tcp": 432000.0, "tcp_closing": 10.0}
DUAL_FLOWS = {ip("10.244.0.5"): 2, ip("fd00:10:244::5"): 5, ip("fd00::dead"): 1}
COUNTERS = {
    "nat_ingress": {"packets": 3, "bytes": 180},
    "pass_port": {"packets": 7, "bytes": 1234},
    "drop_port": {"packets": 0, "bytes": 0},
}
ATTACHMENTS = [
    {"device": "eth0", "hook": "xdp", "program": "cz_ingress", "prog_id": 42},
    {"device": "eth0", "hook": "tcx-egress", "program": "cz_egress", "prog_id": 43},
]
NO_DROPS = {
    r: 0
    for r in (
        "drop_port",
        "drop_icmp",
        "drop_proto",
        "drop_malformed",
        "drop_fragment",
        "drop_frag_orphan",
        "drop_icmp_inner",
    )
}
PER_SERVICE = [
    ServiceCounters(VM2, 2, 3, 180, 0, 0, NO_DROPS),
    ServiceCounters(VM1, 1, 7, 1234, 2, 120, {**NO_DROPS, "drop_port": 5, "drop_icmp": 1}),
]


def svc(
    lb: str,
    pod: str,
    mode: str,
    icmp: bool,
    ports: list[str],
    flows: int,
    service: str | None = None,
    ranges: list[str] | None = None,
) -> dict[str, Any]:
    return {
        "lb_ip": lb,
        "pod_ip": pod,
        "mode": mode,
        "allow_icmp": icmp,
        "allowed_ports": ports,
        "flows": flows,
        "service": service,
        "source_ranges": ranges,
    }


def pod(pod_ip: str, lb: str, mode: str, icmp: bool, service: str | None = None) -> dict[str, Any]:
    return {"pod_ip": pod_ip, "lb_ip": lb, "mode": mode, "allow_icmp": icmp, "service": service}


DUAL_JSON: dict[str, Any] = {
    "pin_dir": "/sys/fs/bpf/cozyebpf",
    "attachments": ATTACHMENTS,
    "services": [
        svc(
            "192.0.2.9",
            "10.244.0.7",
            "whole-ip",
            False,
            [],
            0,
            VM2,
            ["192.0.2.7/32", "198.51.100.0/24"],
        ),
        svc("192.0.2.10", "10.244.0.5", "port-filter", True, ["tcp/22", "udp/53"], 2, VM1),
        svc("2001:db8::9", "fd00:10:244::9", "port-filter", False, [], 0, None, []),
        svc(
            "2001:db8::10",
            "fd00:10:244::5",
            "port-filter",
            True,
            ["tcp/22", "udp/53", "sctp/9"],
            5,
            VM1,
        ),
        svc(LONG_LB, LONG_POD, "whole-ip", False, [], 0),
    ],
    "pods": [
        pod("10.244.0.5", "192.0.2.10", "port-filter", True, VM1),
        pod("10.244.0.7", "192.0.2.9", "whole-ip", False, VM2),
        pod("fd00::99", "2001:db8::99", "port-filter", False),
        pod("fd00:10:244::5", "2001:db8::10", "port-filter", True, VM1),
        pod("fd00:10:244::9", "2001:db8::9", "port-filter", False),
        pod(LONG_POD, LONG_LB, "whole-ip", False),
    ],
    "flows": 8,
    "flow_timeouts": TIMEOUTS,
    "flow_entries": [
        {
            "pod_ip": "10.244.0.5",
            "remote_ip": "198.51.100.1",
            "pod_port": 40000,
            "remote_port": 53,
            "proto": "udp",
            "age_s": 3.0,
            "closing": False,
        },
        {
            "pod_ip": "fd00:10:244::5",
            "remote_ip": "2001:db8::1",
            "pod_port": 40001,
            "remote_port": 443,
            "proto": "tcp",
            "age_s": 0.0,
            "closing": True,
        },
    ],
    "counters": COUNTERS,
    "limits": [],
    "service_counters": [
        {
            "service": VM1,
            "slot": 1,
            "ingress": {"packets": 7, "bytes": 1234},
            "egress": {"packets": 2, "bytes": 120},
            "drops": {"drop_port": 5, "drop_icmp": 1},
        },
        {
            "service": VM2,
            "slot": 2,
            "ingress": {"packets": 3, "bytes": 180},
            "egress": {"packets": 0, "bytes": 0},
            "drops": {},
        },
    ],
}


def test_dual_stack_json() -> None:
    d = build_dump(
        DUAL,
        DUAL_FLOWS,
        COUNTERS,
        ATTACHMENTS,
        "/sys/fs/bpf/cozyebpf",
        PER_SERVICE,
        FLOW_DICTS,
        TIMEOUTS,
    )
    assert d == DUAL_JSON
    assert json.loads(json.dumps(d)) == d


DUAL_TABLE = """\
pinned maps: /sys/fs/bpf/cozyebpf
attached:
  DEVICE  HOOK        PROGRAM     PROG ID
  eth0    xdp         cz_ingress  42
  eth0    tcx-egress  cz_egress   43
services (5):
  LB IP                                   POD IP                             SERVICE       MODE         ICMP  PORTS                 SOURCES                       FLOWS
  192.0.2.9                               10.244.0.7                         tenant-a/vm2  whole-ip     no    -                     192.0.2.7/32,198.51.100.0/24  0
  192.0.2.10                              10.244.0.5                         default/vm1   port-filter  yes   tcp/22,udp/53         any                           2
  2001:db8::9                             fd00:10:244::9                     -             port-filter  no    -                     none                          0
  2001:db8::10                            fd00:10:244::5                     default/vm1   port-filter  yes   tcp/22,udp/53,sctp/9  any                           5
  2001:db8:ffff:ffff:ffff:ffff:ffff:fe11  fd00:10:244:0:1234:5678:9abc:def0  -             whole-ip     no    -                     any                           0
pods whose LB IP has no service entry:
  POD IP    LB IP         MODE         ICMP
  fd00::99  2001:db8::99  port-filter  no
flows: 8
  idle timeouts (s, 0 never): udp 120, icmp 30, tcp 432000, tcp_closing 10
  POD IP          POD PORT  REMOTE        REMOTE PORT  PROTO  AGE (s)  STATE
  10.244.0.5      40000     198.51.100.1  53           udp    3        open
  fd00:10:244::5  40001     2001:db8::1   443          tcp    0        closing
counters:
  REASON       PACKETS  BYTES
  nat_ingress  3        180
  pass_port    7        1234
per Service:
  SERVICE       IN PACKETS  IN BYTES  OUT PACKETS  OUT BYTES  DROPS
  default/vm1   7           1234      2            120        drop_port=5,drop_icmp=1
  tenant-a/vm2  3           180       0            0          -"""  # noqa: E501 (the table is as wide as its longest addresses)

IPV4_TABLE = """\
services (2):
  LB IP       POD IP      SERVICE  MODE         ICMP  PORTS          SOURCES  FLOWS
  192.0.2.9   10.244.0.7  -        whole-ip     no    -              any      0
  192.0.2.10  10.244.0.5  -        port-filter  yes   tcp/22,udp/53  any      1
flows: 1
counters: (all zero)"""

IPV6_ONLY_TABLE = """\
services (1):
  LB IP         POD IP          SERVICE  MODE         ICMP  PORTS          SOURCES  FLOWS
  2001:db8::10  fd00:10:244::5  -        port-filter  yes   tcp/22,udp/53  any      5
flows: 5
counters: (all zero)"""

# (id, build_dump arguments, the whole table)
TABLES: list[tuple[str, dict[str, Any], str]] = [
    (
        "dual-stack",
        {
            "state": DUAL,
            "flows_by_pod": DUAL_FLOWS,
            "counters": COUNTERS,
            "attachments": ATTACHMENTS,
            "pin_dir": "/sys/fs/bpf/cozyebpf",
            "service_counters": PER_SERVICE,
            "flow_entries": FLOW_DICTS,
            "flow_timeouts": TIMEOUTS,
        },
        DUAL_TABLE,
    ),
    (
        "ipv4-columns-stay-narrow",
        {"state": IPV4, "flows_by_pod": {ip("10.244.0.5"): 1}},
        IPV4_TABLE,
    ),
    (
        "ipv6-only",
        {
            "state": MapState(
                {ip("2001:db8::10"): ServiceEntry(ip("fd00:10:244::5"), True, True)},
                {ip("fd00:10:244::5"): PodEntry(ip("2001:db8::10"), True, True)},
                {
                    AllowedPort(ip("fd00:10:244::5"), Proto.UDP, 53),
                    AllowedPort(ip("fd00:10:244::5"), Proto.TCP, 22),
                },
            ),
            "flows_by_pod": {ip("fd00:10:244::5"): 5},
        },
        IPV6_ONLY_TABLE,
    ),
    ("empty", {"state": MapState()}, "services (0):\nflows: 0\ncounters: (all zero)"),
]


@pytest.mark.parametrize(("args", "text"), [t[1:] for t in TABLES], ids=[t[0] for t in TABLES])
def test_table(args: dict[str, Any], text: str) -> None:
    assert render_dump(build_dump(**args)) == text


def test_ipv4_json_is_unchanged_by_ipv6_support() -> None:
    assert build_dump(IPV4) == {
        "pin_dir": "",
        "attachments": [],
        "services": [
            svc("192.0.2.9", "10.244.0.7", "whole-ip", False, [], 0),
            svc("192.0.2.10", "10.244.0.5", "port-filter", True, ["tcp/22", "udp/53"], 0),
        ],
        "pods": [
            pod("10.244.0.5", "192.0.2.10", "port-filter", True),
            pod("10.244.0.7", "192.0.2.9", "whole-ip", False),
        ],
        "flows": 0,
        "flow_timeouts": {},
        "flow_entries": [],
        "counters": {},
        "limits": [],
        "service_counters": [],
    }
