"""The pure model: Service + EndpointSlice dicts -> desired MapState, views and Problems."""

from __future__ import annotations

import copy
import datetime as dt
import itertools
import random
from collections.abc import Callable, Iterator
from ipaddress import IPv4Address
from typing import Any

import pytest

from cozyebpf.model import (
    ANN_ALLOW_ICMP,
    ANN_WHOLE_IP,
    DEFAULT_PROXY_NAME,
    LABEL_PROXY_NAME,
    ObjectRef,
    PortSpec,
    Problem,
    ServiceView,
    build_state,
)
from cozyebpf.state import AllowedPort, MapState, PodEntry, Proto, ServiceEntry

LB1, LB2, LB3 = "192.0.2.10", "192.0.2.11", "192.0.2.12"
POD1, POD2, POD3 = "10.244.0.5", "10.244.0.7", "10.244.1.3"
T_OLD, T_NEW = "2024-01-01T00:00:00Z", "2024-06-01T12:00:00Z"

Obj = dict[str, Any]


def service(
    name: str = "vm1",
    ns: str | None = "default",
    *,
    ips: tuple[Any, ...] = (LB1,),
    ports: tuple[Any, ...] = (("TCP", 22),),
    whole_ip: Any = None,
    allow_icmp: Any = None,
    proxy: Any = DEFAULT_PROXY_NAME,
    created: Any = None,
) -> Obj:
    """A LoadBalancer Service as the API returns it; `None` arguments leave the field out."""
    meta: Obj = {"name": name, "labels": {LABEL_PROXY_NAME: proxy} if proxy is not None else {}}
    if ns is not None:
        meta["namespace"] = ns
    ann = {
        k: v for k, v in ((ANN_WHOLE_IP, whole_ip), (ANN_ALLOW_ICMP, allow_icmp)) if v is not None
    }
    if ann:
        meta["annotations"] = ann
    if created is not None:
        meta["creationTimestamp"] = created
    port_list: list[Obj] = []
    for p in ports:
        if isinstance(p, tuple):
            entry: Obj = {"port": p[1]}
            if p[0] is not None:
                entry["protocol"] = p[0]
            port_list.append(entry)
        else:
            port_list.append(p)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {"type": "LoadBalancer", "ports": port_list},
        "status": {
            "loadBalancer": {"ingress": [ip if isinstance(ip, dict) else {"ip": ip} for ip in ips]}
        },
    }


def endpoint(address: Any, ready: Any = True, terminating: Any = None) -> Obj:
    cond: Obj = {}
    if ready is not None:
        cond["ready"] = ready
    if terminating is not None:
        cond["terminating"] = terminating
    return {"addresses": [address], "conditions": cond}


def endpoints(
    service_name: str = "vm1",
    ns: str = "default",
    *eps: Any,
    name: str | None = None,
    address_type: Any = "IPv4",
) -> Obj:
    """An EndpointSlice of `service_name`; string endpoints are ready addresses, anything else
    is used as is."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name or f"{service_name}-abcde",
            "namespace": ns,
            "labels": {"kubernetes.io/service-name": service_name},
        },
        "addressType": address_type,
        "endpoints": [endpoint(e) if isinstance(e, str) else e for e in eps],
    }


def state(
    services: dict[str, tuple[str, bool, bool]] | None = None,
    pods: dict[str, tuple[str, bool, bool]] | None = None,
    allowed: set[str] | None = None,
) -> MapState:
    """A MapState from strings: allowed ports as "10.244.0.5 tcp/22"."""
    out = MapState()
    for lb, (pod, pf, icmp) in (services or {}).items():
        out.services[IPv4Address(lb)] = ServiceEntry(IPv4Address(pod), pf, icmp)
    for pod, (lb, pf, icmp) in (pods or {}).items():
        out.pods[IPv4Address(pod)] = PodEntry(IPv4Address(lb), pf, icmp)
    for a in allowed or set():
        ip, pp = a.split()
        proto, port = pp.split("/")
        out.allowed.add(AllowedPort(IPv4Address(ip), Proto[proto.upper()], int(port)))
    return out


def one(
    lb: str = LB1,
    pod: str = POD1,
    pf: bool = True,
    icmp: bool = False,
    ports: tuple[str, ...] = ("tcp/22",),
) -> MapState:
    """The state of one Service with one LB IP and one pod."""
    return state(
        {lb: (pod, pf, icmp)}, {pod: (lb, pf, icmp)}, {f"{pod} {p}" for p in ports} if pf else set()
    )


def lines(problems: list[Problem]) -> list[tuple[str, str]]:
    return [(p.severity, str(p)) for p in problems]


VM1 = "Service default/vm1"
VM2 = "Service default/vm2"
SLICE1 = "EndpointSlice default/vm1-abcde"
NO_ENDPOINT = (
    "has no ready endpoint (no IPv4 EndpointSlice labelled kubernetes.io/service-name=vm1 lists "
    "a ready address), so it is not programmed; check that its pod is running and ready"
)
NO_IP = (
    "has no LoadBalancer IP yet (status.loadBalancer.ingress is empty), so it is not programmed; "
    "it will be once a load balancer assigns one"
)

# (id, objects, expected state, expected (severity, "<ref>: <message>") lines)
CASES: list[tuple[str, list[Any], MapState, list[tuple[str, str]]]] = [
    ("port-filter", [service(), endpoints("vm1", "default", POD1)], one(), []),
    (
        "port-filter-several-ports-and-protocols",
        [
            service(ports=(("TCP", 22), (None, 80), ("UDP", 53), ("SCTP", 3868), ("TCP", 22))),
            endpoints("vm1", "default", POD1),
        ],
        one(ports=("tcp/22", "tcp/80", "udp/53", "sctp/3868")),
        [],
    ),
    (
        "target-port-is-not-what-is-matched",
        [
            service(ports=({"port": 80, "targetPort": 8080, "protocol": "TCP"},)),
            endpoints("vm1", "default", POD1),
        ],
        one(ports=("tcp/80",)),
        [],
    ),
    (
        "whole-ip-adds-no-ports",
        [
            service(whole_ip="true", ports=(("TCP", 22), ("TCP", 0))),
            endpoints("vm1", "default", POD1),
        ],
        one(pf=False),
        [],
    ),
    (
        "whole-ip-false-is-port-filter-silently",
        [service(whole_ip="false"), endpoints("vm1", "default", POD1)],
        one(),
        [],
    ),
    (
        "allow-icmp-with-port-filter",
        [service(allow_icmp="true"), endpoints("vm1", "default", POD1)],
        one(icmp=True),
        [],
    ),
    (
        "allow-icmp-stored-as-given-with-whole-ip",
        [service(whole_ip="true", allow_icmp="true"), endpoints("vm1", "default", POD1)],
        one(pf=False, icmp=True),
        [],
    ),
    (
        "namespace-defaults-to-default",
        [service(ns=None), endpoints("vm1", "default", POD1)],
        one(),
        [],
    ),
    ("not-labelled", [service(proxy=None), endpoints("vm1", "default", POD1)], MapState(), []),
    (
        "other-proxy",
        [service(proxy="kube-proxy"), endpoints("vm1", "default", POD1)],
        MapState(),
        [],
    ),
    (
        "label-is-case-sensitive",
        [service(proxy="Cozy-Proxy"), endpoints("vm1", "default", POD1)],
        MapState(),
        [],
    ),
    (
        "knative-service-is-not-a-core-service",
        [{**service(), "apiVersion": "serving.knative.dev/v1"}, endpoints("vm1", "default", POD1)],
        MapState(),
        [],
    ),
    (
        "leading-zeros",
        [service(ips=("010.1.2.3",)), endpoints("vm1", "default", POD1)],
        MapState(),
        [
            (
                "error",
                f'{VM1}: status.loadBalancer.ingress[0].ip "010.1.2.3" is not a valid IPv4 address '
                "(leading zeros are ambiguous); fix the Service status",
            )
        ],
    ),
    (
        "bad-ips-skipped-good-one-kept",
        [
            service(
                ips=(
                    "192.0.2.300",
                    "not-an-ip",
                    12345,
                    "2001:db8::1",
                    {"hostname": "lb.example.com"},
                    {},
                    "0.0.0.0",
                    "127.0.0.1",
                    "224.0.0.1",
                    "255.255.255.255",
                    " 192.0.2.10",
                    LB2,
                )
            ),
            endpoints("vm1", "default", POD1),
        ],
        one(lb=LB2),
        [
            (
                "error",
                f'{VM1}: status.loadBalancer.ingress[0].ip "192.0.2.300" is not a valid IPv4 '
                "address; fix the Service status",
            ),
            (
                "error",
                f'{VM1}: status.loadBalancer.ingress[10].ip " 192.0.2.10" is not a valid IPv4 '
                "address; fix the Service status",
            ),
            (
                "error",
                f'{VM1}: status.loadBalancer.ingress[1].ip "not-an-ip" is not a valid IPv4 '
                "address; fix the Service status",
            ),
            (
                "error",
                f"{VM1}: status.loadBalancer.ingress[2].ip must be a string but is a number "
                "(12345); fix the Service status",
            ),
            (
                "warning",
                f'{VM1}: status.loadBalancer.ingress[3].ip "2001:db8::1" is an IPv6 address and '
                "IPv6 is not supported yet; it is ignored",
            ),
            (
                "warning",
                f'{VM1}: status.loadBalancer.ingress[4] has hostname "lb.example.com" but no ip, '
                "and only IP addresses can be NATed; it is ignored",
            ),
            (
                "error",
                f"{VM1}: status.loadBalancer.ingress[5] has neither ip nor hostname; fix the "
                "Service status",
            ),
            (
                "error",
                f'{VM1}: status.loadBalancer.ingress[6].ip "0.0.0.0" is not a unicast address NAT '
                "can use; fix the Service status",
            ),
            (
                "error",
                f'{VM1}: status.loadBalancer.ingress[7].ip "127.0.0.1" is not a unicast address '
                "NAT can use; fix the Service status",
            ),
            (
                "error",
                f'{VM1}: status.loadBalancer.ingress[8].ip "224.0.0.1" is not a unicast address '
                "NAT can use; fix the Service status",
            ),
            (
                "error",
                f'{VM1}: status.loadBalancer.ingress[9].ip "255.255.255.255" is not a unicast '
                "address NAT can use; fix the Service status",
            ),
        ],
    ),
    (
        "same-ip-twice-in-status",
        [service(ips=(LB1, LB1)), endpoints("vm1", "default", POD1)],
        one(),
        [],
    ),
    (
        "no-status",
        [{k: v for k, v in service().items() if k != "status"}, endpoints("vm1", "default", POD1)],
        MapState(),
        [("warning", f"{VM1}: {NO_IP}")],
    ),
    (
        "empty-ingress",
        [service(ips=()), endpoints("vm1", "default", POD1)],
        MapState(),
        [("warning", f"{VM1}: {NO_IP}")],
    ),
    (
        "bad-ports-skipped",
        [
            service(
                ports=(
                    ("ICMP", 1),
                    ("tcp", 22),
                    ("TCP", 0),
                    ("TCP", 70000),
                    ("TCP", "80"),
                    ("TCP", True),
                    {"protocol": "UDP"},
                    "443",
                    ("UDP", 65535),
                    ("TCP", 1),
                )
            ),
            endpoints("vm1", "default", POD1),
        ],
        one(ports=("tcp/1", "udp/65535")),
        [
            (
                "error",
                f'{VM1}: spec.ports[0].protocol "ICMP" is not TCP, UDP or SCTP, so the port '
                "filter does not allow it; fix the protocol",
            ),
            (
                "error",
                f'{VM1}: spec.ports[1].protocol "tcp" is not TCP, UDP or SCTP, so the port filter '
                "does not allow it; fix the protocol",
            ),
            (
                "error",
                f"{VM1}: spec.ports[2].port 0 is not a port number from 1 to 65535, so the port "
                "filter does not allow it; fix the port",
            ),
            (
                "error",
                f"{VM1}: spec.ports[3].port 70000 is not a port number from 1 to 65535, so the "
                "port filter does not allow it; fix the port",
            ),
            (
                "error",
                f'{VM1}: spec.ports[4].port "80" is not a port number from 1 to 65535, so the '
                "port filter does not allow it; fix the port",
            ),
            (
                "error",
                f"{VM1}: spec.ports[5].port true is not a port number from 1 to 65535, so the "
                "port filter does not allow it; fix the port",
            ),
            (
                "error",
                f"{VM1}: spec.ports[6].port null is not a port number from 1 to 65535, so the "
                "port filter does not allow it; fix the port",
            ),
            (
                "error",
                f'{VM1}: spec.ports[7] must be a mapping but is a string ("443"); fix the object',
            ),
        ],
    ),
    (
        "port-filter-without-ports",
        [service(ports=()), endpoints("vm1", "default", POD1)],
        one(ports=()),
        [],
    ),
    ("no-endpointslice", [service()], MapState(), [("warning", f"{VM1}: {NO_ENDPOINT}")]),
    (
        "endpointslice-of-other-service-or-namespace",
        [service(), endpoints("vm2", "default", POD1), endpoints("vm1", "other", POD2)],
        MapState(),
        [("warning", f"{VM1}: {NO_ENDPOINT}")],
    ),
    (
        "endpoints-null",
        [service(), {**endpoints("vm1", "default"), "endpoints": None}],
        MapState(),
        [("warning", f"{VM1}: {NO_ENDPOINT}")],
    ),
    (
        "not-ready-and-terminating-skipped",
        [
            service(),
            endpoints(
                "vm1",
                "default",
                endpoint(POD2, ready=False),
                endpoint(POD3, ready=True, terminating=True),
                endpoint("10.244.9.9", ready=None, terminating=True),
            ),
        ],
        MapState(),
        [("warning", f"{VM1}: {NO_ENDPOINT}")],
    ),
    (
        "ready-absent-means-ready",
        [
            service(),
            endpoints("vm1", "default", endpoint(POD1, ready=None), endpoint(POD2, ready=False)),
        ],
        one(),
        [],
    ),
    (
        "conditions-absent-means-ready",
        [service(), endpoints("vm1", "default", {"addresses": [POD1]})],
        one(),
        [],
    ),
    (
        "terminating-false-is-ready",
        [service(), endpoints("vm1", "default", endpoint(POD1, ready=True, terminating=False))],
        one(),
        [],
    ),
    (
        "first-address-of-an-endpoint",
        [service(), endpoints("vm1", "default", {"addresses": [POD1, POD2]})],
        one(),
        [],
    ),
    (
        "several-ready-lowest-wins",
        [
            service(),
            endpoints("vm1", "default", POD3, POD1),
            endpoints("vm1", "default", POD2, name="vm1-fghij"),
        ],
        one(),
        [
            (
                "warning",
                f"{VM1}: has 3 ready endpoints (10.244.0.5, 10.244.0.7, 10.244.1.3) but NAT needs "
                "exactly one pod, so the lowest, 10.244.0.5, is used; scale the backend to one pod",
            )
        ],
    ),
    (
        "same-address-in-two-slices-is-one",
        [
            service(),
            endpoints("vm1", "default", POD1),
            endpoints("vm1", "default", POD1, name="vm1-fghij"),
        ],
        one(),
        [],
    ),
    (
        "fqdn-slice-ignored",
        [
            service(),
            endpoints("vm1", "default", "vm.example.com", name="vm1-fqdn", address_type="FQDN"),
            endpoints("vm1", "default", POD1),
        ],
        one(),
        [
            (
                "error",
                "EndpointSlice default/vm1-fqdn: addressType FQDN is not supported (NAT needs a "
                "pod IP, "
                "not a name), so its endpoints are ignored; use an IPv4 EndpointSlice",
            )
        ],
    ),
    (
        "ipv6-slice-ignored",
        [
            service(),
            endpoints("vm1", "default", "fd00::5", name="vm1-v6", address_type="IPv6"),
            endpoints("vm1", "default", POD1),
        ],
        one(),
        [
            (
                "warning",
                "EndpointSlice default/vm1-v6: addressType IPv6 is not supported yet; its "
                "endpoints are ignored",
            )
        ],
    ),
    (
        "address-type-missing",
        [service(), endpoints("vm1", "default", POD1, address_type=None)],
        MapState(),
        [
            (
                "error",
                f"{SLICE1}: addressType null is not IPv4, IPv6 or FQDN, so its endpoints are "
                "ignored; fix the EndpointSlice",
            ),
            ("warning", f"{VM1}: {NO_ENDPOINT}"),
        ],
    ),
    (
        "bad-endpoints-skipped",
        [
            service(),
            endpoints(
                "vm1",
                "default",
                {"addresses": []},
                {"addresses": "10.244.0.9"},
                endpoint("010.244.0.9"),
                endpoint("fd00::9"),
                endpoint(POD2, ready="true"),
                "not-an-ip",
                [POD3],
                {"addresses": [POD3], "conditions": [True]},
                endpoint(POD1),
            ),
        ],
        one(),
        [
            ("error", f"{SLICE1}: endpoints[0].addresses is empty; fix the EndpointSlice"),
            (
                "error",
                f'{SLICE1}: endpoints[1].addresses must be a list but is a string ("10.244.0.9"); '
                "fix the object",
            ),
            (
                "error",
                f'{SLICE1}: endpoints[2].addresses[0] "010.244.0.9" is not a valid IPv4 address '
                "(leading zeros are ambiguous); fix the EndpointSlice",
            ),
            (
                "warning",
                f'{SLICE1}: endpoints[3].addresses[0] "fd00::9" is an IPv6 address and IPv6 is '
                "not supported yet; it is ignored",
            ),
            (
                "error",
                f"{SLICE1}: endpoints[4].conditions.ready must be true, false or absent but is a "
                'string ("true"), so the endpoint is ignored; fix the EndpointSlice',
            ),
            (
                "error",
                f'{SLICE1}: endpoints[5].addresses[0] "not-an-ip" is not a valid IPv4 address; '
                "fix the EndpointSlice",
            ),
            ("error", f"{SLICE1}: endpoints[6] must be a mapping but is a list; fix the object"),
            (
                "error",
                f"{SLICE1}: endpoints[7].conditions must be a mapping but is a list; fix the "
                "object",
            ),
        ],
    ),
    (
        "problems-of-unrelated-slices-are-not-ours",
        [
            service(),
            endpoints("vm1", "default", POD1),
            endpoints("other", "default", "x", address_type="FQDN"),
        ],
        one(),
        [],
    ),
]


@pytest.mark.parametrize(
    ("objects", "expected", "problems"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_build_state(
    objects: list[Any], expected: MapState, problems: list[tuple[str, str]]
) -> None:
    result = build_state(objects)
    assert result.state == expected
    assert sorted(lines(result.problems)) == sorted(problems)


@pytest.mark.parametrize(
    ("value", "whole_ip"),
    [
        ("true", True),
        ("false", False),
        ("True", False),
        (" true", False),
        ("", False),
        ("yes", False),
        ("1", False),
        (True, False),
    ],
    ids=["true", "false", "True", "space-true", "empty", "yes", "1", "yaml-boolean"],
)
@pytest.mark.parametrize("annotation", [ANN_WHOLE_IP, ANN_ALLOW_ICMP], ids=["wholeIP", "allowICMP"])
def test_annotation_spellings(annotation: str, value: Any, whole_ip: bool) -> None:
    """Only the exact string "true" is true (as in cozy-proxy); odd spellings are warned about."""
    kwargs = {"whole_ip": value} if annotation == ANN_WHOLE_IP else {"allow_icmp": value}
    result = build_state([service(**kwargs), endpoints("vm1", "default", POD1)])
    if annotation == ANN_WHOLE_IP:
        assert result.state == one(pf=not whole_ip)
    else:
        assert result.state == one(icmp=whole_ip)
    if value in ("true", "false"):
        assert result.problems == []
    else:
        shown = f'a string ("{value}")' if isinstance(value, str) else "a boolean (true)"
        assert lines(result.problems) == [
            (
                "warning",
                f'{VM1}: annotation {annotation} is {shown}, which is not the string "true", so it '
                'counts as "false"; write "true" or "false" (quoted, lower case)',
            )
        ]


def test_proxy_name_parameter() -> None:
    objects = [
        service(proxy="my-proxy"),
        endpoints("vm1", "default", POD1),
        service("vm2", ips=(LB2,)),
        endpoints("vm2", "default", POD2),
    ]
    assert build_state(objects, proxy_name="my-proxy").state == one()
    assert build_state(objects).state == one(LB2, POD2)


def test_service_view() -> None:
    result = build_state(
        [
            service(ports=(("UDP", 53), ("TCP", 22)), allow_icmp="true", ips=(LB1, LB2)),
            endpoints("vm1", "default", POD1),
            service("vm2", ips=(), whole_ip="true"),
            service("other", proxy="kube-proxy"),
        ]
    )
    ref1, ref2 = ObjectRef("Service", "default", "vm1"), ObjectRef("Service", "default", "vm2")
    assert result.services == [
        ServiceView(
            ref1,
            (IPv4Address(LB1), IPv4Address(LB2)),
            IPv4Address(POD1),
            True,
            True,
            (PortSpec(Proto.TCP, 22), PortSpec(Proto.UDP, 53)),
        ),
        ServiceView(ref2, (), None, False, False, ()),
    ]
    assert [v.programmed for v in result.services] == [True, False]
    assert (
        str(result.services[0])
        == "Service default/vm1: 192.0.2.10,192.0.2.11 -> 10.244.0.5 port-filter tcp/22,udp/53 icmp"
    )
    assert str(result.services[1]) == "Service default/vm2: (no LB IP) -> (no ready pod) whole-ip"
    assert str(ref1) == "Service default/vm1"
    assert str(ObjectRef("object", "", "#3")) == "object #3"


def test_several_lb_ips_share_one_pod() -> None:
    result = build_state([service(ips=("bad", LB2, LB1)), endpoints("vm1", "default", POD1)])
    assert result.state == state(
        {LB2: (POD1, True, False), LB1: (POD1, True, False)},
        {POD1: (LB2, True, False)},
        {f"{POD1} tcp/22"},
    )


@pytest.mark.parametrize(
    ("created1", "created2", "winner"),
    [
        (T_OLD, T_NEW, "vm1"),
        (T_NEW, T_OLD, "vm2"),
        (T_OLD, T_OLD, "vm1"),
        (None, None, "vm1"),
        (None, T_NEW, "vm2"),
        ("yesterday", T_NEW, "vm2"),
        (dt.datetime(2025, 1, 1, tzinfo=dt.UTC), T_NEW, "vm2"),
        ("2024-06-01T13:00:00+02:00", T_NEW, "vm1"),
        (dt.datetime(2024, 6, 1, 11, 0), T_NEW, "vm1"),
    ],
    ids=[
        "older-first",
        "older-second",
        "tie-by-name",
        "no-timestamps-by-name",
        "missing-is-newest",
        "bad-timestamp-is-newest",
        "yaml-datetime",
        "offset",
        "naive-is-utc",
    ],
)
def test_duplicate_lb_ip(created1: Any, created2: Any, winner: str) -> None:
    """The older Service keeps a shared LB IP; the other gets a warning and only its other IPs."""
    objects = [
        service("vm1", ips=(LB1,), created=created1, ports=(("TCP", 22),)),
        service("vm2", ips=(LB1, LB2), created=created2, ports=(("TCP", 80),)),
        endpoints("vm1", "default", POD1),
        endpoints("vm2", "default", POD2),
    ]
    result = build_state(objects)
    loser = {"vm1": "vm2", "vm2": "vm1"}[winner]
    if winner == "vm1":
        assert result.state == state(
            {LB1: (POD1, True, False), LB2: (POD2, True, False)},
            {POD1: (LB1, True, False), POD2: (LB2, True, False)},
            {f"{POD1} tcp/22", f"{POD2} tcp/80"},
        )
    else:
        assert result.state == state(
            {LB1: (POD2, True, False), LB2: (POD2, True, False)},
            {POD2: (LB1, True, False)},
            {f"{POD2} tcp/80"},
        )
    expected = [
        (
            "warning",
            f"Service default/{loser}: LoadBalancer IP {LB1} is also claimed by the older "
            f"Service default/{winner}, which keeps it; give each Service its own LoadBalancer IP",
        )
    ]
    if created1 == "yesterday":
        expected.append(
            (
                "warning",
                f'{VM1}: metadata.creationTimestamp "yesterday" is not an RFC 3339 time, so the '
                "Service counts as the newest when LoadBalancer IPs conflict; fix or remove it",
            )
        )
    assert sorted(lines(result.problems)) == sorted(expected)
    views = {v.ref.name: v for v in result.services}
    assert views[winner].lb_ips[0] == IPv4Address(LB1)
    assert IPv4Address(LB1) not in views[loser].lb_ips


def test_lb_ip_claim_does_not_depend_on_readiness() -> None:
    """An older Service without a ready pod still holds its IP, so it does not flap."""
    objects = [
        service("vm1", created=T_OLD),
        service("vm2", created=T_NEW),
        endpoints("vm2", "default", POD2),
    ]
    result = build_state(objects)
    assert result.state == MapState()
    assert sorted(lines(result.problems)) == [
        ("warning", f"{VM1}: {NO_ENDPOINT}"),
        (
            "warning",
            f"{VM2}: LoadBalancer IP {LB1} is also claimed by the older {VM1}, which keeps it; "
            "give each Service its own LoadBalancer IP",
        ),
    ]


@pytest.mark.parametrize(
    ("created1", "created2"), [(T_OLD, T_NEW), (T_NEW, T_OLD)], ids=["vm1-older", "vm2-older"]
)
def test_pod_behind_two_services(created1: str, created2: str) -> None:
    """Ingress from both LB IPs; the pods entry belongs to the older Service; ports are the
    union."""
    objects = [
        service("vm1", ips=(LB1,), created=created1, ports=(("TCP", 22),), allow_icmp="true"),
        service("vm2", ips=(LB2, LB3), created=created2, whole_ip="true"),
        service("vm3", ips=(LB3,), created=created2, ports=(("UDP", 53),)),
        endpoints("vm1", "default", POD1),
        endpoints("vm2", "default", POD1),
        endpoints("vm3", "default", POD1, name="vm3-x"),
    ]
    result = build_state(objects)
    older_pod_entry = (LB1, True, True) if created1 == T_OLD else (LB2, False, False)
    assert result.state == state(
        {LB1: (POD1, True, True), LB2: (POD1, False, False), LB3: (POD1, False, False)},
        {POD1: older_pod_entry},
        {f"{POD1} tcp/22"},
    )
    older, newer = (VM1, VM2) if created1 == T_OLD else (VM2, VM1)
    expected = [
        (
            "warning",
            f"{newer}: its pod {POD1} is also behind the older {older}, so the pod's own "
            f"connections leave from {older_pod_entry[0]}, not from this Service's IP; give each "
            "Service its own pod",
        ),
        (
            "warning",
            f"Service default/vm3: LoadBalancer IP {LB3} is also claimed by the older {VM2}, "
            "which keeps it; give each Service its own LoadBalancer IP",
        ),
    ]
    assert sorted(lines(result.problems)) == sorted(expected)


def test_pod_behind_two_port_filter_services_union_of_ports() -> None:
    objects = [
        service("vm1", ips=(LB1,), created=T_OLD, ports=(("TCP", 22),)),
        service("vm2", ips=(LB2,), created=T_NEW, ports=(("TCP", 80), ("TCP", 22))),
        endpoints("vm1", "default", POD1),
        endpoints("vm2", "default", POD1),
    ]
    assert build_state(objects).state == state(
        {LB1: (POD1, True, False), LB2: (POD1, True, False)},
        {POD1: (LB1, True, False)},
        {f"{POD1} tcp/22", f"{POD1} tcp/80"},
    )


GOOD = [service("good", ips=(LB3,)), endpoints("good", "default", POD3)]
GOOD_STATE = one(LB3, POD3)
GOOD_REF = "Service default/good"


@pytest.mark.parametrize(
    ("garbage", "problems"),
    [
        (None, []),
        (
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "x"},
                "data": {"a": "b"},
            },
            [],
        ),
        ({"kind": ["Service"]}, []),
        ({}, []),
        (
            "a string",
            [
                (
                    "error",
                    'object #1: must be a Kubernetes object (a mapping) but is a string ("a '
                    'string"); fix or remove it',
                )
            ],
        ),
        (
            42,
            [
                (
                    "error",
                    "object #1: must be a Kubernetes object (a mapping) but is a number (42); "
                    "fix or remove it",
                )
            ],
        ),
        (
            [service("vm9")],
            [
                (
                    "error",
                    "object #1: must be a Kubernetes object (a mapping) but is a list; fix or "
                    "remove it",
                )
            ],
        ),
        (
            {"kind": "Service"},
            [
                (
                    "error",
                    "Service #1 (unnamed): metadata is missing; give the object a metadata.name",
                )
            ],
        ),
        (
            {"kind": "Service", "metadata": ["x"]},
            [
                (
                    "error",
                    "Service #1 (unnamed): metadata must be a mapping but is a list; give the "
                    "object a metadata.name",
                )
            ],
        ),
        (
            {"kind": "Service", "metadata": {"namespace": "ns"}},
            [
                (
                    "error",
                    "Service ns/#1 (unnamed): metadata.name is missing; give the object a name",
                )
            ],
        ),
        (
            {"kind": "Service", "metadata": {"name": ""}},
            [
                (
                    "error",
                    "Service default/#1 (unnamed): metadata.name is missing; give the object a "
                    "name",
                )
            ],
        ),
        (
            {"kind": "Service", "metadata": {"name": 7}},
            [
                (
                    "error",
                    "Service default/#1 (unnamed): metadata.name must be a string but is a "
                    "number (7); give the object a name",
                )
            ],
        ),
        (
            {"kind": "Service", "metadata": {"name": "x", "namespace": ["a"]}},
            [
                (
                    "error",
                    "Service x: metadata.namespace must be a string but is a list; fix the object",
                )
            ],
        ),
        (
            {"kind": "Service", "metadata": {"name": "x", "labels": "cozy-proxy"}},
            [
                (
                    "error",
                    "Service default/x: metadata.labels must be a mapping but is a string "
                    '("cozy-proxy"); fix the object',
                )
            ],
        ),
        (
            {
                "kind": "EndpointSlice",
                "metadata": {"labels": {"kubernetes.io/service-name": "good"}},
            },
            [
                (
                    "error",
                    "EndpointSlice default/#1 (unnamed): metadata.name is missing; give the "
                    "object a name",
                )
            ],
        ),
        (
            {**service("vm9"), "spec": ["ports"]},
            [
                (
                    "error",
                    "Service default/vm9: spec must be a mapping but is a list; fix the object",
                )
            ],
        ),
        (
            {**service("vm9"), "status": "ready"},
            [
                (
                    "error",
                    'Service default/vm9: status must be a mapping but is a string ("ready"); '
                    "fix the object",
                )
            ],
        ),
        (
            {**service("vm9"), "status": {"loadBalancer": {"ingress": {"ip": LB1}}}},
            [
                (
                    "error",
                    "Service default/vm9: status.loadBalancer.ingress must be a list but is a "
                    "mapping; fix the object",
                )
            ],
        ),
        (
            {**service("vm9"), "spec": {"ports": {"port": 22}}},
            [
                (
                    "error",
                    "Service default/vm9: spec.ports must be a list but is a mapping; fix the "
                    "object",
                )
            ],
        ),
        (
            {**service("vm9"), "status": {"loadBalancer": {"ingress": [[LB1]]}}},
            [
                (
                    "error",
                    "Service default/vm9: status.loadBalancer.ingress[0] must be a mapping but "
                    "is a list; fix the object",
                ),
                ("warning", "Service default/vm9: " + NO_ENDPOINT.replace("=vm1", "=vm9")),
            ],
        ),
        (
            {
                **service("vm9"),
                "metadata": {
                    "name": "vm9",
                    "labels": {LABEL_PROXY_NAME: "cozy-proxy"},
                    "annotations": ["x"],
                },
            },
            [
                (
                    "error",
                    "Service default/vm9: metadata.annotations must be a mapping but is a list; "
                    "fix the object",
                )
            ],
        ),
        (
            {**endpoints("good", "default", POD1), "endpoints": {"a": 1}},
            [
                (
                    "error",
                    "EndpointSlice default/good-abcde: endpoints must be a list but is a "
                    "mapping; fix the object",
                )
            ],
        ),
    ],
    ids=[
        "none-document",
        "configmap",
        "kind-is-a-list",
        "empty-mapping",
        "string",
        "number",
        "list",
        "service-without-metadata",
        "metadata-is-a-list",
        "name-missing",
        "name-empty",
        "name-not-a-string",
        "namespace-not-a-string",
        "labels-not-a-mapping",
        "slice-without-name",
        "spec-is-a-list",
        "status-is-a-string",
        "ingress-is-a-mapping",
        "ports-is-a-mapping",
        "ingress-entry-is-a-list",
        "annotations-are-a-list",
        "slice-endpoints-are-a-mapping",
    ],
)
def test_garbage_never_affects_others(garbage: Any, problems: list[tuple[str, str]]) -> None:
    result = build_state([garbage, *GOOD])
    assert result.state == GOOD_STATE
    assert sorted(lines(result.problems)) == sorted(problems)


def test_duplicate_service_definitions() -> None:
    same = build_state([service(), service(), endpoints("vm1", "default", POD1)])
    assert same.state == one()
    assert same.problems == []
    different = build_state(
        [service(), service(ips=(LB2,)), endpoints("vm1", "default", POD1), *GOOD]
    )
    assert different.state == GOOD_STATE
    assert lines(different.problems) == [
        (
            "error",
            f"{VM1}: is defined 2 times with different contents, so it is not programmed; keep "
            "one definition",
        )
    ]


MIXED: list[Any] = [
    service("vm1", ips=(LB1,), created=T_NEW),
    service("vm2", ips=(LB1, LB2)),
    service("vm3", ips=(LB3,), created=T_OLD, whole_ip="True"),
    endpoints("vm1", "default", POD1, POD2),
    endpoints("vm2", "default", POD1),
    endpoints("vm3", "default", POD3, name="vm3-a"),
    endpoints("vm3", "default", "x", name="vm3-b", address_type="FQDN"),
    "garbage",
    None,
]


def test_output_does_not_depend_on_input_order() -> None:
    reference = build_state(MIXED)
    assert reference.state == state(
        {LB1: (POD1, True, False), LB2: (POD1, True, False), LB3: (POD3, True, False)},
        {POD1: (LB1, True, False), POD3: (LB3, True, False)},
        {f"{POD1} tcp/22", f"{POD3} tcp/22"},
    )
    assert len(reference.problems) == 6
    rng = random.Random(1)
    for _ in range(50):
        objects = list(MIXED)
        rng.shuffle(objects)
        result = build_state(objects)
        assert result.state == reference.state
        assert result.services == reference.services
        # only "object #N" names the input position
        assert [p for p in result.problems if p.ref.kind != "object"] == [
            p for p in reference.problems if p.ref.kind != "object"
        ]


GARBAGE_VALUES: list[Any] = [
    None,
    "",
    "x",
    "010.1.2.3",
    0,
    -1,
    2**70,
    1.5,
    True,
    [],
    [None],
    {},
    {"a": None},
    [[1]],
    float("nan"),
]


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


def _replaced(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    out = copy.deepcopy(obj)
    target = out
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return out


@pytest.mark.parametrize(
    "make",
    [
        lambda: service(ports=(("TCP", 22), ("UDP", 53)), allow_icmp="true", created=T_OLD),
        lambda: endpoints("vm1", "default", POD1, endpoint(POD2, ready=False, terminating=True)),
    ],
    ids=["service", "endpointslice"],
)
def test_fuzz_any_field_replaced_by_garbage(make: Callable[[], Obj]) -> None:
    """Replacing any field of a valid object by any garbage never raises and never touches
    another Service."""
    base = [service(), endpoints("vm1", "default", POD1)]
    victim = 0 if make()["kind"] == "Service" else 1
    base[victim] = make()
    for path, value in itertools.product(list(_paths(base[victim])), GARBAGE_VALUES):
        objects = list(base)
        objects[victim] = _replaced(base[victim], path, value)
        result = build_state([*objects, *GOOD])
        assert result.state.services[IPv4Address(LB3)] == ServiceEntry(
            IPv4Address(POD3), True, False
        ), (path, value)
        assert result.state.pods[IPv4Address(POD3)] == PodEntry(IPv4Address(LB3), True, False), (
            path,
            value,
        )
        assert {a for a in result.state.allowed if a.pod_ip == IPv4Address(POD3)} == {
            AllowedPort(IPv4Address(POD3), Proto.TCP, 22)
        }
        assert not [p for p in result.problems if p.ref.name == "good"], (path, value)


def test_problem_str() -> None:
    p = Problem(ObjectRef("Service", "default", "vm1"), "something is wrong; fix it")
    assert str(p) == "Service default/vm1: something is wrong; fix it"
    assert p.severity == "warning"
