"""The pure model: Service + EndpointSlice dicts -> desired MapState, views and Problems."""

from __future__ import annotations

import copy
import datetime as dt
import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from ipaddress import IPv4Address, ip_address
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
    SliceRecord,
    build_state,
    read_object,
)
from cozyebpf.state import (
    AllowedPort,
    MapDiff,
    MapState,
    PodEntry,
    Proto,
    ServiceEntry,
    address_key,
    apply_to,
    diff,
)
from tests.support.states import of_family

LB1, LB2, LB3 = "192.0.2.10", "192.0.2.11", "192.0.2.12"
POD1, POD2, POD3 = "10.244.0.5", "10.244.0.7", "10.244.1.3"
LB6_1, LB6_2, LB6_3 = "2001:db8::10", "2001:db8::11", "2001:db8::12"
POD6_1, POD6_2, POD6_3 = "fd00:10:244::5", "fd00:10:244::7", "fd00:10:244:1::3"
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
    """A MapState from strings of either family: allowed ports as "10.244.0.5 tcp/22"."""
    out = MapState()
    for lb, (pod, pf, icmp) in (services or {}).items():
        out.services[ip_address(lb)] = ServiceEntry(ip_address(pod), pf, icmp)
    for pod, (lb, pf, icmp) in (pods or {}).items():
        out.pods[ip_address(pod)] = PodEntry(ip_address(lb), pf, icmp)
    for a in allowed or set():
        ip, pp = a.split()
        proto, port = pp.split("/")
        out.allowed.add(AllowedPort(ip_address(ip), Proto[proto.upper()], int(port)))
    out.check()
    return out


def merged(*states: MapState) -> MapState:
    """The union of states with disjoint keys (e.g. the IPv4 and the IPv6 half of a Service)."""
    out = MapState()
    for st in states:
        assert not set(st.services) & set(out.services)
        assert not set(st.pods) & set(out.pods)
        out.services.update(st.services)
        out.pods.update(st.pods)
        out.allowed |= st.allowed
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


def no_family(lb: str, version: int) -> str:
    """The Problem message of an LB IP whose family has no ready endpoint."""
    fam = f"IPv{version}"
    return (
        f"LB IP {lb} is {fam} but the Service has no ready {fam} endpoint; it is not programmed "
        "(an LB IP is only translated to a pod IP of its own family); check that the pod has an "
        f"{fam} address and is ready, or remove the {fam} LB IP"
    )


VM1 = "Service default/vm1"
VM2 = "Service default/vm2"
SLICE1 = "EndpointSlice default/vm1-abcde"
NO_ENDPOINT = (
    "has no ready endpoint (no EndpointSlice labelled kubernetes.io/service-name=vm1 lists a "
    "ready address), so it is not programmed; check that its pod is running and ready"
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
                f'{VM1}: status.loadBalancer.ingress[0].ip "010.1.2.3" is not a valid IP address '
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
                f'{VM1}: status.loadBalancer.ingress[0].ip "192.0.2.300" is not a valid IP '
                "address; fix the Service status",
            ),
            (
                "error",
                f'{VM1}: status.loadBalancer.ingress[10].ip " 192.0.2.10" is not a valid IP '
                "address; fix the Service status",
            ),
            (
                "error",
                f'{VM1}: status.loadBalancer.ingress[1].ip "not-an-ip" is not a valid IP '
                "address; fix the Service status",
            ),
            (
                "error",
                f"{VM1}: status.loadBalancer.ingress[2].ip must be a string but is a number "
                "(12345); fix the Service status",
            ),
            ("warning", f"{VM1}: {no_family('2001:db8::1', 6)}"),
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
                f"{VM1}: has 3 ready IPv4 endpoints (10.244.0.5, 10.244.0.7, 10.244.1.3) but NAT "
                "needs exactly one pod, so the lowest, 10.244.0.5, is used; scale the backend to "
                "one pod",
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
                "not a name), so its endpoints are ignored; use an IPv4 or IPv6 EndpointSlice",
            )
        ],
    ),
    (
        "ipv6-slice-unused-without-an-ipv6-lb-ip",
        [
            service(),
            endpoints("vm1", "default", "fd00::5", name="vm1-v6", address_type="IPv6"),
            endpoints("vm1", "default", POD1),
        ],
        one(),
        [],
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
                "error",
                f'{SLICE1}: endpoints[3].addresses[0] "fd00::9" is an IPv6 address but the '
                "EndpointSlice's addressType is IPv4, so the endpoint is ignored; fix the "
                "EndpointSlice",
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


SLICE6 = "EndpointSlice default/vm1-v6"


def v6_slice(*eps: Any, name: str = "vm1-v6") -> Obj:
    return endpoints("vm1", "default", *eps, name=name, address_type="IPv6")


def bad_lb(index: int, value: str, why: str) -> tuple[str, str]:
    return (
        "error",
        f'{VM1}: status.loadBalancer.ingress[{index}].ip "{value}" is {why}; fix the Service '
        "status",
    )


def bad_pod(index: int, value: str, why: str) -> tuple[str, str]:
    return (
        "error",
        f'{SLICE6}: endpoints[{index}].addresses[0] "{value}" is {why}; fix the EndpointSlice',
    )


# IPv6 and dual-stack: (id, objects, expected state, expected problems), as CASES
CASES_V6: list[tuple[str, list[Any], MapState, list[tuple[str, str]]]] = [
    ("ipv6-only", [service(ips=(LB6_1,)), v6_slice(POD6_1)], one(LB6_1, POD6_1), []),
    (
        "ipv6-only-whole-ip-with-icmp",
        [service(ips=(LB6_1,), whole_ip="true", allow_icmp="true"), v6_slice(POD6_1)],
        one(LB6_1, POD6_1, pf=False, icmp=True),
        [],
    ),
    (
        "dual-stack",
        [
            service(ips=(LB1, LB6_1), ports=(("TCP", 22), ("UDP", 53)), allow_icmp="true"),
            endpoints("vm1", "default", POD1),
            v6_slice(POD6_1),
        ],
        merged(
            one(LB1, POD1, icmp=True, ports=("tcp/22", "udp/53")),
            one(LB6_1, POD6_1, icmp=True, ports=("tcp/22", "udp/53")),
        ),
        [],
    ),
    (
        "dual-stack-ipv6-first-in-status",
        [service(ips=(LB6_1, LB1)), endpoints("vm1", "default", POD1), v6_slice(POD6_1)],
        merged(one(LB1, POD1), one(LB6_1, POD6_1)),
        [],
    ),
    (
        "dual-stack-whole-ip",
        [
            service(ips=(LB1, LB6_1), whole_ip="true"),
            endpoints("vm1", "default", POD1),
            v6_slice(POD6_1),
        ],
        merged(one(LB1, POD1, pf=False), one(LB6_1, POD6_1, pf=False)),
        [],
    ),
    (
        "ipv6-lb-ip-without-ipv6-endpoint",
        [service(ips=(LB1, LB6_1, LB6_2)), endpoints("vm1", "default", POD1)],
        one(LB1, POD1),
        [
            ("warning", f"{VM1}: {no_family(LB6_1, 6)}"),
            ("warning", f"{VM1}: {no_family(LB6_2, 6)}"),
        ],
    ),
    (
        "ipv4-lb-ip-without-ipv4-endpoint",
        [service(ips=(LB1, LB6_1)), v6_slice(POD6_1)],
        one(LB6_1, POD6_1),
        [("warning", f"{VM1}: {no_family(LB1, 4)}")],
    ),
    (
        "ipv6-only-lb-with-ipv4-only-pod-is-not-guessed",
        [service(ips=(LB6_1,)), endpoints("vm1", "default", POD1)],
        MapState(),
        [("warning", f"{VM1}: {no_family(LB6_1, 6)}")],
    ),
    (
        "ipv6-endpoint-not-ready-is-a-missing-family",
        [
            service(ips=(LB1, LB6_1)),
            endpoints("vm1", "default", POD1),
            v6_slice(endpoint(POD6_1, ready=False), endpoint(POD6_2, terminating=True)),
        ],
        one(LB1, POD1),
        [("warning", f"{VM1}: {no_family(LB6_1, 6)}")],
    ),
    (
        "dual-stack-lb-no-endpoint-at-all-is-one-problem",
        [service(ips=(LB1, LB6_1))],
        MapState(),
        [("warning", f"{VM1}: {NO_ENDPOINT}")],
    ),
    (
        "ipv6-not-ready-and-terminating-skipped",
        [
            service(ips=(LB6_1,)),
            v6_slice(
                endpoint(POD6_2, ready=False),
                endpoint(POD6_3, ready=True, terminating=True),
                endpoint(POD6_1, ready=None, terminating=False),
            ),
        ],
        one(LB6_1, POD6_1),
        [],
    ),
    (
        "several-ready-per-family-lowest-wins",
        [
            service(ips=(LB1, LB6_1)),
            endpoints("vm1", "default", POD3, POD1),
            v6_slice(POD6_3, POD6_1),
            v6_slice(POD6_2, name="vm1-v6b"),
        ],
        merged(one(LB1, POD1), one(LB6_1, POD6_1)),
        [
            (
                "warning",
                f"{VM1}: has 2 ready IPv4 endpoints (10.244.0.5, 10.244.1.3) but NAT needs "
                "exactly one pod, so the lowest, 10.244.0.5, is used; scale the backend to one pod",
            ),
            (
                "warning",
                f"{VM1}: has 3 ready IPv6 endpoints (fd00:10:244::5, fd00:10:244::7, "
                "fd00:10:244:1::3) but NAT needs exactly one pod, so the lowest, fd00:10:244::5, "
                "is used; scale the backend to one pod",
            ),
        ],
    ),
    (
        "ipv6-forms-are-normalised",
        [
            service(ips=("2001:0DB8:0:0:0:0:0:10", LB6_1, "2001:db8:0::10")),
            v6_slice("FD00:10:244:0:0:0:0:5", "fd00:0010:0244::0005"),
        ],
        one(LB6_1, POD6_1),
        [],
    ),
    (
        "bad-ipv6-lb-ips-skipped-good-one-kept",
        [
            service(
                ips=(
                    "2001:db8::1::2",
                    "fe80::10",
                    "febf:ffff::1",
                    "2001:db8::10%eth0",
                    "ff02::1",
                    "::",
                    "::1",
                    "::ffff:192.0.2.10",
                    "2001:db8::10/128",
                    "[2001:db8::10]",
                    " 2001:db8::10",
                    "2001:db8::g",
                    "2001:db8:0:0:0:0:0:0:10",
                    LB6_1,
                )
            ),
            v6_slice(POD6_1),
        ],
        one(LB6_1, POD6_1),
        [
            bad_lb(0, "2001:db8::1::2", "not a valid IP address"),
            bad_lb(1, "fe80::10", "an IPv6 link-local address (fe80::/10), which NAT cannot use"),
            bad_lb(
                2, "febf:ffff::1", "an IPv6 link-local address (fe80::/10), which NAT cannot use"
            ),
            bad_lb(
                3,
                "2001:db8::10%eth0",
                "an IPv6 address with a zone index (%eth0), which NAT cannot use",
            ),
            bad_lb(4, "ff02::1", "an IPv6 multicast address, which NAT cannot use"),
            bad_lb(5, "::", "the unspecified IPv6 address, which NAT cannot use"),
            bad_lb(6, "::1", "the IPv6 loopback address, which NAT cannot use"),
            bad_lb(
                7,
                "::ffff:192.0.2.10",
                "an IPv4-mapped IPv6 address (::ffff:0:0/96, standing for 192.0.2.10), which "
                "NAT cannot use",
            ),
            bad_lb(8, "2001:db8::10/128", "not a valid IP address"),
            bad_lb(9, "[2001:db8::10]", "not a valid IP address"),
            bad_lb(10, " 2001:db8::10", "not a valid IP address"),
            bad_lb(11, "2001:db8::g", "not a valid IP address"),
            bad_lb(12, "2001:db8:0:0:0:0:0:0:10", "not a valid IP address"),
        ],
    ),
    (
        "bad-ipv6-pod-ips-skipped-good-one-kept",
        [
            service(ips=(LB6_1,)),
            v6_slice(
                "fe80::5",
                "::ffff:10.244.0.5",
                "::1",
                "ff02::1",
                "::",
                "fe80::5%eth0",
                "fd00::zz",
                "010.244.0.5",
                POD1,
                POD6_1,
            ),
        ],
        one(LB6_1, POD6_1),
        [
            bad_pod(0, "fe80::5", "an IPv6 link-local address (fe80::/10), which NAT cannot use"),
            bad_pod(
                1,
                "::ffff:10.244.0.5",
                "an IPv4-mapped IPv6 address (::ffff:0:0/96, standing for 10.244.0.5), which "
                "NAT cannot use",
            ),
            bad_pod(2, "::1", "the IPv6 loopback address, which NAT cannot use"),
            bad_pod(3, "ff02::1", "an IPv6 multicast address, which NAT cannot use"),
            bad_pod(4, "::", "the unspecified IPv6 address, which NAT cannot use"),
            bad_pod(
                5, "fe80::5%eth0", "an IPv6 address with a zone index (%eth0), which NAT cannot use"
            ),
            bad_pod(6, "fd00::zz", "not a valid IPv6 address"),
            bad_pod(7, "010.244.0.5", "not a valid IPv6 address"),
            (
                "error",
                f'{SLICE6}: endpoints[8].addresses[0] "{POD1}" is an IPv4 address but the '
                "EndpointSlice's addressType is IPv6, so the endpoint is ignored; fix the "
                "EndpointSlice",
            ),
        ],
    ),
    (
        "address-type-is-case-sensitive",
        [service(ips=(LB6_1,)), endpoints("vm1", "default", POD6_1, address_type="ipv6")],
        MapState(),
        [
            (
                "error",
                f'{SLICE1}: addressType "ipv6" is not IPv4, IPv6 or FQDN, so its endpoints are '
                "ignored; fix the EndpointSlice",
            ),
            ("warning", f"{VM1}: {NO_ENDPOINT}"),
        ],
    ),
    (
        "same-ipv6-lb-ip-in-two-services-older-keeps-it",
        [
            service("vm1", ips=(LB6_1,), created=T_NEW),
            service("vm2", ips=(LB6_1, LB6_2), created=T_OLD, ports=(("UDP", 53),)),
            v6_slice(POD6_1),
            endpoints("vm2", "default", POD6_2, address_type="IPv6"),
        ],
        state(
            {LB6_1: (POD6_2, True, False), LB6_2: (POD6_2, True, False)},
            {POD6_2: (LB6_1, True, False)},
            {f"{POD6_2} udp/53"},
        ),
        [
            (
                "warning",
                f"{VM1}: LoadBalancer IP {LB6_1} is also claimed by the older {VM2}, which keeps "
                "it; give each Service its own LoadBalancer IP",
            )
        ],
    ),
]


@pytest.mark.parametrize(
    ("objects", "expected", "problems"),
    [c[1:] for c in CASES + CASES_V6],
    ids=[c[0] for c in CASES + CASES_V6],
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
            (IPv4Address(POD1),),
            True,
            True,
            (PortSpec(Proto.TCP, 22), PortSpec(Proto.UDP, 53)),
        ),
        ServiceView(ref2, (), (), False, False, ()),
    ]
    assert [v.pod_ip for v in result.services] == [IPv4Address(POD1), None]
    assert [bool(v.programmed_lb_ips) for v in result.services] == [True, False]
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


@dataclass(frozen=True)
class Fam:
    """The addresses of one family, for tests that must hold in both."""

    lb: tuple[str, str, str]
    pod: tuple[str, str, str]
    address_type: str


V4 = Fam((LB1, LB2, LB3), (POD1, POD2, POD3), "IPv4")
V6 = Fam((LB6_1, LB6_2, LB6_3), (POD6_1, POD6_2, POD6_3), "IPv6")
BOTH_FAMILIES = pytest.mark.parametrize("fam", [V4, V6], ids=["ipv4", "ipv6"])


@BOTH_FAMILIES
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
def test_duplicate_lb_ip(fam: Fam, created1: Any, created2: Any, winner: str) -> None:
    """The older Service keeps a shared LB IP; the other gets a warning and only its other IPs."""
    (lb1, lb2, _), (pod1, pod2, _) = fam.lb, fam.pod
    objects = [
        service("vm1", ips=(lb1,), created=created1, ports=(("TCP", 22),)),
        service("vm2", ips=(lb1, lb2), created=created2, ports=(("TCP", 80),)),
        endpoints("vm1", "default", pod1, address_type=fam.address_type),
        endpoints("vm2", "default", pod2, address_type=fam.address_type),
    ]
    result = build_state(objects)
    loser = {"vm1": "vm2", "vm2": "vm1"}[winner]
    if winner == "vm1":
        assert result.state == state(
            {lb1: (pod1, True, False), lb2: (pod2, True, False)},
            {pod1: (lb1, True, False), pod2: (lb2, True, False)},
            {f"{pod1} tcp/22", f"{pod2} tcp/80"},
        )
    else:
        assert result.state == state(
            {lb1: (pod2, True, False), lb2: (pod2, True, False)},
            {pod2: (lb1, True, False)},
            {f"{pod2} tcp/80"},
        )
    expected = [
        (
            "warning",
            f"Service default/{loser}: LoadBalancer IP {lb1} is also claimed by the older "
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
    assert views[winner].lb_ips[0] == ip_address(lb1)
    assert ip_address(lb1) not in views[loser].lb_ips


@BOTH_FAMILIES
def test_lb_ip_claim_does_not_depend_on_readiness(fam: Fam) -> None:
    """An older Service without a ready pod still holds its IP, so it does not flap."""
    objects = [
        service("vm1", ips=(fam.lb[0],), created=T_OLD),
        service("vm2", ips=(fam.lb[0],), created=T_NEW),
        endpoints("vm2", "default", fam.pod[1], address_type=fam.address_type),
    ]
    result = build_state(objects)
    assert result.state == MapState()
    assert sorted(lines(result.problems)) == [
        ("warning", f"{VM1}: {NO_ENDPOINT}"),
        (
            "warning",
            f"{VM2}: LoadBalancer IP {fam.lb[0]} is also claimed by the older {VM1}, which keeps "
            "it; give each Service its own LoadBalancer IP",
        ),
    ]


@BOTH_FAMILIES
@pytest.mark.parametrize(
    ("created1", "created2"), [(T_OLD, T_NEW), (T_NEW, T_OLD)], ids=["vm1-older", "vm2-older"]
)
def test_pod_behind_two_services(fam: Fam, created1: str, created2: str) -> None:
    """Ingress from both LB IPs; the pods entry belongs to the older Service; ports are the
    union."""
    (lb1, lb2, lb3), pod1 = fam.lb, fam.pod[0]
    objects = [
        service("vm1", ips=(lb1,), created=created1, ports=(("TCP", 22),), allow_icmp="true"),
        service("vm2", ips=(lb2, lb3), created=created2, whole_ip="true"),
        service("vm3", ips=(lb3,), created=created2, ports=(("UDP", 53),)),
        endpoints("vm1", "default", pod1, address_type=fam.address_type),
        endpoints("vm2", "default", pod1, address_type=fam.address_type),
        endpoints("vm3", "default", pod1, name="vm3-x", address_type=fam.address_type),
    ]
    result = build_state(objects)
    older_pod_entry = (lb1, True, True) if created1 == T_OLD else (lb2, False, False)
    assert result.state == state(
        {lb1: (pod1, True, True), lb2: (pod1, False, False), lb3: (pod1, False, False)},
        {pod1: older_pod_entry},
        {f"{pod1} tcp/22"},
    )
    older, newer = (VM1, VM2) if created1 == T_OLD else (VM2, VM1)
    expected = [
        (
            "warning",
            f"{newer}: its pod {pod1} is also behind the older {older}, so the pod's own "
            f"connections leave from {older_pod_entry[0]}, not from this Service's IP; give each "
            "Service its own pod",
        ),
        (
            "warning",
            f"Service default/vm3: LoadBalancer IP {lb3} is also claimed by the older {VM2}, "
            "which keeps it; give each Service its own LoadBalancer IP",
        ),
    ]
    assert sorted(lines(result.problems)) == sorted(expected)


@BOTH_FAMILIES
def test_pod_behind_two_port_filter_services_union_of_ports(fam: Fam) -> None:
    (lb1, lb2, _), pod1 = fam.lb, fam.pod[0]
    objects = [
        service("vm1", ips=(lb1,), created=T_OLD, ports=(("TCP", 22),)),
        service("vm2", ips=(lb2,), created=T_NEW, ports=(("TCP", 80), ("TCP", 22))),
        endpoints("vm1", "default", pod1, address_type=fam.address_type),
        endpoints("vm2", "default", pod1, address_type=fam.address_type),
    ]
    assert build_state(objects).state == state(
        {lb1: (pod1, True, False), lb2: (pod1, True, False)},
        {pod1: (lb1, True, False)},
        {f"{pod1} tcp/22", f"{pod1} tcp/80"},
    )


def dual_stack(name: str, pod4: str, pod6: str) -> list[Obj]:
    """The two EndpointSlices of a dual-stack Service with one pod."""
    return [
        endpoints(name, "default", pod4, name=f"{name}-v4"),
        endpoints(name, "default", pod6, name=f"{name}-v6", address_type="IPv6"),
    ]


def test_dual_stack_conflict_is_per_address() -> None:
    """The newer Service loses only the shared IPv6 LB IP: its IPv4 half stays programmed, its
    IPv6 pod gets no entry (and no missing-family Problem: the LB IP went to the older one)."""
    objects = [
        service("vm1", ips=(LB1, LB6_1), created=T_OLD),
        service("vm2", ips=(LB2, LB6_1), created=T_NEW, ports=(("UDP", 53),)),
        *dual_stack("vm1", POD1, POD6_1),
        *dual_stack("vm2", POD2, POD6_2),
    ]
    result = build_state(objects)
    assert result.state == merged(
        one(LB1, POD1),
        one(LB6_1, POD6_1),
        one(LB2, POD2, ports=("udp/53",)),
    )
    assert lines(result.problems) == [
        (
            "warning",
            f"{VM2}: LoadBalancer IP {LB6_1} is also claimed by the older {VM1}, which keeps it; "
            "give each Service its own LoadBalancer IP",
        )
    ]
    assert [(v.lb_ips, v.programmed_lb_ips) for v in result.services] == [
        ((ip_address(LB1), ip_address(LB6_1)),) * 2,
        ((ip_address(LB2),),) * 2,
    ]


@pytest.mark.parametrize(
    ("created1", "created2"), [(T_OLD, T_NEW), (T_NEW, T_OLD)], ids=["vm1-older", "vm2-older"]
)
def test_dual_stack_pod_egress_per_family(created1: str, created2: str) -> None:
    """A dual-stack pod behind an IPv4-only Service and a dual-stack one: its IPv4 egress leaves
    from the older Service's IPv4 LB IP, its IPv6 egress from the only Service with an IPv6 LB
    IP, whichever is older."""
    objects = [
        service("vm1", ips=(LB1,), created=created1),
        service("vm2", ips=(LB6_1, LB2), created=created2, whole_ip="true"),
        *dual_stack("vm1", POD1, POD6_1),
        *dual_stack("vm2", POD1, POD6_1),
    ]
    result = build_state(objects)
    egress4 = (LB1, True, False) if created1 == T_OLD else (LB2, False, False)
    assert result.state == state(
        {LB1: (POD1, True, False), LB2: (POD1, False, False), LB6_1: (POD6_1, False, False)},
        {POD1: egress4, POD6_1: (LB6_1, False, False)},
        {f"{POD1} tcp/22"},
    )
    older, newer = (VM1, VM2) if created1 == T_OLD else (VM2, VM1)
    assert lines(result.problems) == [
        (
            "warning",
            f"{newer}: its pod {POD1} is also behind the older {older}, so the pod's own "
            f"connections leave from {egress4[0]}, not from this Service's IP; give each "
            "Service its own pod",
        )
    ]


def test_dual_stack_service_view() -> None:
    result = build_state(
        [
            service("vm1", ips=(LB6_1, LB1, LB2)),
            *dual_stack("vm1", POD1, POD6_1),
            service("vm2", ips=(LB3, LB6_2), whole_ip="true"),
            endpoints("vm2", "default", POD3),
            service("vm3", ips=(LB6_3,)),
            service("vm4", ips=()),
            endpoints("vm4", "default", POD6_3, address_type="IPv6"),
        ]
    )
    shown = [str(v) for v in result.services]
    assert shown == [
        "Service default/vm1: 192.0.2.10,192.0.2.11 -> 10.244.0.5, 2001:db8::10 -> "
        "fd00:10:244::5 port-filter tcp/22",
        "Service default/vm2: 192.0.2.12 -> 10.244.1.3, 2001:db8::11 -> (no ready IPv6 pod) "
        "whole-ip",
        "Service default/vm3: 2001:db8::12 -> (no ready pod) port-filter tcp/22",
        "Service default/vm4: (no LB IP) -> fd00:10:244:1::3 port-filter tcp/22",
    ]
    views = {v.ref.name: v for v in result.services}
    assert views["vm1"].lb_ips == (ip_address(LB6_1), ip_address(LB1), ip_address(LB2))
    assert views["vm1"].pod_ips == (ip_address(POD1), ip_address(POD6_1))
    assert views["vm1"].pod_for(ip_address(LB6_1)) == ip_address(POD6_1)
    assert views["vm1"].pod_ip == ip_address(POD1)
    assert views["vm2"].programmed_lb_ips == (ip_address(LB3),)
    assert [bool(v.programmed_lb_ips) for v in result.services] == [True, True, False, False]
    assert views["vm4"].pod_ip == ip_address(POD6_3)


def test_dual_stack_egress_leaves_from_the_first_lb_ip_of_each_family() -> None:
    result = build_state([service(ips=(LB6_2, LB1, LB6_1, LB2)), *dual_stack("vm1", POD1, POD6_1)])
    assert result.state.pods == {
        ip_address(POD1): PodEntry(ip_address(LB1), True, False),
        ip_address(POD6_1): PodEntry(ip_address(LB6_2), True, False),
    }
    assert result.problems == []


# one Service of each shape (dual-stack, a family missing either way, a lost IPv6 LB IP)
FAMILY_INVARIANT: list[Any] = [
    service("vm1", ips=(LB1, LB6_1, LB6_2, LB2), allow_icmp="true"),
    *dual_stack("vm1", POD1, POD6_1),
    service("vm2", ips=(LB6_3,), created=T_OLD),
    endpoints("vm2", "default", POD2),
    service("vm3", ips=(LB3, "2001:db8::13"), whole_ip="true"),
    endpoints("vm3", "default", POD6_2, address_type="IPv6"),
    service("vm4", ips=(LB6_1,), created=T_OLD),
    endpoints("vm4", "default", POD6_3, address_type="IPv6"),
]


def test_model_never_mixes_families() -> None:
    result = build_state(FAMILY_INVARIANT)
    st = result.state
    assert st.family_errors() == []
    assert {(k.version, v.pod_ip.version) for k, v in st.services.items()} == {(4, 4), (6, 6)}
    assert {(k.version, v.lb_ip.version) for k, v in st.pods.items()} == {(4, 4), (6, 6)}
    assert st == merged(
        one(LB1, POD1, icmp=True),
        state({LB2: (POD1, True, True), LB6_2: (POD6_1, True, True)}),
        state({"2001:db8::13": (POD6_2, False, False)}, {POD6_2: ("2001:db8::13", False, False)}),
        one(LB6_1, POD6_3),
        state(pods={POD6_1: (LB6_2, True, True)}, allowed={f"{POD6_1} tcp/22"}),
    )
    assert sorted(lines(result.problems)) == [
        (
            "warning",
            "Service default/vm1: LoadBalancer IP 2001:db8::10 is also claimed by the older "
            "Service default/vm4, which keeps it; give each Service its own LoadBalancer IP",
        ),
        ("warning", f"Service default/vm2: {no_family(LB6_3, 6)}"),
        ("warning", f"Service default/vm3: {no_family(LB3, 4)}"),
    ]


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
    service("vm4", ips=(LB6_1, "192.0.2.20"), created=T_OLD),
    endpoints("vm4", "default", POD6_2, POD6_1, address_type="IPv6"),
    service("vm5", ips=(LB6_1,), created=T_NEW),
    endpoints("vm5", "default", POD6_3, address_type="IPv6"),
    "garbage",
    None,
]


def test_output_does_not_depend_on_input_order() -> None:
    reference = build_state(MIXED)
    assert reference.state == state(
        {
            LB1: (POD1, True, False),
            LB2: (POD1, True, False),
            LB3: (POD3, True, False),
            LB6_1: (POD6_1, True, False),
        },
        {POD1: (LB1, True, False), POD3: (LB3, True, False), POD6_1: (LB6_1, True, False)},
        {f"{POD1} tcp/22", f"{POD3} tcp/22", f"{POD6_1} tcp/22"},
    )
    # vm1: 2 ready, conflict; vm3: annotation, FQDN slice; garbage; vm4: 2 ready IPv6, no IPv4
    # endpoint for 192.0.2.20; vm5: conflict
    assert len(reference.problems) == 9
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


GOOD_DUAL = [
    service("good", ips=(LB3, LB6_3)),
    endpoints("good", "default", POD3),
    endpoints("good", "default", POD6_3, name="good-v6", address_type="IPv6"),
]
GOOD_DUAL_STATE = merged(one(LB3, POD3), one(LB6_3, POD6_3))


@pytest.mark.parametrize(
    ("base", "victim"),
    [
        (
            [
                service(ports=(("TCP", 22), ("UDP", 53)), allow_icmp="true", created=T_OLD),
                endpoints("vm1", "default", POD1),
            ],
            0,
        ),
        (
            [
                service(),
                endpoints("vm1", "default", POD1, endpoint(POD2, ready=False, terminating=True)),
            ],
            1,
        ),
        ([service(ips=(LB1, LB6_1), created=T_OLD), *dual_stack("vm1", POD1, POD6_1)], 0),
        (
            [
                service(ips=(LB6_1, LB1)),
                endpoints("vm1", "default", POD1),
                v6_slice(POD6_1, endpoint(POD6_2, ready=False, terminating=True)),
            ],
            2,
        ),
    ],
    ids=["service", "endpointslice", "dual-stack-service", "ipv6-endpointslice"],
)
def test_fuzz_any_field_replaced_by_garbage(base: list[Obj], victim: int) -> None:
    """Replacing any field of a valid object by any garbage never raises, never touches
    another Service and never pairs two families in one entry."""
    for path, value in itertools.product(list(_paths(base[victim])), GARBAGE_VALUES):
        objects = list(base)
        objects[victim] = _replaced(base[victim], path, value)
        result = build_state([*objects, *GOOD_DUAL])
        good = {ip_address(a) for a in (LB3, LB6_3, POD3, POD6_3)}
        assert (
            MapState(
                {k: v for k, v in result.state.services.items() if k in good},
                {k: v for k, v in result.state.pods.items() if k in good},
                {a for a in result.state.allowed if a.pod_ip in good},
            )
            == GOOD_DUAL_STATE
        ), (path, value)
        assert result.state.family_errors() == [], (path, value)
        assert not [p for p in result.problems if p.ref.name == "good"], (path, value)


def test_problem_str() -> None:
    p = Problem(ObjectRef("Service", "default", "vm1"), "something is wrong; fix it")
    assert str(p) == "Service default/vm1: something is wrong; fix it"
    assert p.severity == "warning"


# -- the state contract: both families, never mixed in one entry -----------------------------

A4, B4, A6, B6 = (ip_address(x) for x in (LB1, POD1, LB6_1, POD6_1))

# (id, how to build the object, the ValueError message)
MIXED_ENTRIES: list[tuple[str, Callable[[], object], str]] = [
    (
        "state-service-ipv4-to-ipv6",
        lambda: MapState(services={A4: ServiceEntry(B6, True, False)}),
        "the map state mixes address families (an IPv4 address is only ever translated to an "
        "IPv4 address, an IPv6 one to an IPv6 one): service 192.0.2.10 -> pod fd00:10:244::5",
    ),
    (
        "state-pod-ipv6-to-ipv4",
        lambda: MapState(pods={B6: PodEntry(A4, True, False)}),
        "the map state mixes address families (an IPv4 address is only ever translated to an "
        "IPv4 address, an IPv6 one to an IPv6 one): pod fd00:10:244::5 -> LB IP 192.0.2.10",
    ),
    (
        "diff-both",
        lambda: MapDiff(
            services_set={A6: ServiceEntry(B4, False, False), A4: ServiceEntry(B4, False, False)},
            pods_set={B4: PodEntry(A6, False, False)},
        ),
        "the map diff mixes address families (an IPv4 address is only ever translated to an "
        "IPv4 address, an IPv6 one to an IPv6 one): service 2001:db8::10 -> pod 10.244.0.5; "
        "pod 10.244.0.5 -> LB IP 2001:db8::10",
    ),
]


@pytest.mark.parametrize(
    ("build", "message"), [c[1:] for c in MIXED_ENTRIES], ids=[c[0] for c in MIXED_ENTRIES]
)
def test_state_refuses_mixed_families(build: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError) as info:
        build()
    assert str(info.value) == message


def test_mixed_family_after_construction_is_caught_by_check() -> None:
    st = one(LB6_1, POD6_1)
    st.services[A6] = ServiceEntry(B4, True, False)
    assert st.family_errors() == ["service 2001:db8::10 -> pod 10.244.0.5"]
    with pytest.raises(ValueError, match=r"service 2001:db8::10 -> pod 10\.244\.0\.5$"):
        st.check()
    d = MapDiff()
    d.pods_set[B4] = PodEntry(A6, True, False)
    with pytest.raises(ValueError, match=r"pod 10\.244\.0\.5 -> LB IP 2001:db8::10$"):
        apply_to(MapState(), d)


@pytest.mark.parametrize(
    "build",
    [
        lambda: ServiceEntry(POD1, True, False),  # type: ignore[arg-type]
        lambda: PodEntry(None, True, False),  # type: ignore[arg-type]
        lambda: AllowedPort(b"\x0a\xf4\x00\x05", Proto.TCP, 22),  # type: ignore[arg-type]
    ],
    ids=["service-str", "pod-none", "allowed-bytes"],
)
def test_entries_hold_addresses(build: Callable[[], object]) -> None:
    with pytest.raises(TypeError, match="must be an IPv4Address or IPv6Address"):
        build()


def test_entries_of_both_families_sort_ipv4_first() -> None:
    ports = [
        AllowedPort(B6, Proto.TCP, 22),
        AllowedPort(B4, Proto.UDP, 53),
        AllowedPort(ip_address("::a00:1"), Proto.TCP, 1),  # int value below 10.244.0.5's
        AllowedPort(B4, Proto.TCP, 80),
        AllowedPort(B4, Proto.TCP, 22),
    ]
    assert sorted(ports) == [ports[4], ports[3], ports[1], ports[2], ports[0]]
    entries = [ServiceEntry(B6, False, False), ServiceEntry(B4, True, False)]
    assert sorted(entries) == entries[::-1]
    assert max(PodEntry(A6, False, False), PodEntry(A4, True, True)) == PodEntry(A6, False, False)
    assert sorted([A6, B4, ip_address("::1"), A4], key=address_key) == [
        B4,
        A4,
        ip_address("::1"),
        A6,
    ]
    assert [e.version for e in (entries[0], PodEntry(A4, True, True), ports[1])] == [6, 4, 4]


def test_diff_and_apply_across_families() -> None:
    live = merged(one(LB1, POD1), one(LB6_1, POD6_1), one(LB6_2, POD6_2, pf=False))
    desired = merged(
        one(LB1, POD1, ports=("tcp/22", "udp/53")),
        one(LB6_1, POD6_1, pf=False),
        one(LB2, POD2),
    )
    d = diff(live, desired)
    assert d == MapDiff(
        services_set={
            A6: ServiceEntry(B6, False, False),
            ip_address(LB2): ServiceEntry(ip_address(POD2), True, False),
        },
        services_del={ip_address(LB6_2)},
        pods_set={
            B6: PodEntry(A6, False, False),
            ip_address(POD2): PodEntry(ip_address(LB2), True, False),
        },
        pods_del={ip_address(POD6_2)},
        allowed_add={AllowedPort(B4, Proto.UDP, 53), AllowedPort(ip_address(POD2), Proto.TCP, 22)},
        allowed_del={AllowedPort(B6, Proto.TCP, 22)},
    )
    assert apply_to(live, d) == desired
    assert of_family(desired, 6) == one(LB6_1, POD6_1, pf=False)
    assert of_family(desired, 4) == merged(
        one(LB1, POD1, ports=("tcp/22", "udp/53")), one(LB2, POD2)
    )
    assert Proto(58) is Proto.ICMPV6


def test_the_fast_ipv4_path_accepts_exactly_what_ipaddress_accepts() -> None:
    """LB and pod IPs in canonical form skip ipaddress's parser; the shortcut must accept
    exactly the canonical strings, and give the same address."""
    import socket

    from cozyebpf.model import _CANONICAL_V4

    cases = [
        s
        for a in [*range(256), 300, 999]
        for s in (f"{a}.0.0.1", f"10.{a}.2.3", f"0{a}.1.1.1", f"{a}.1.1", f"1.2.3.{a}")
    ] + ["1.2.3.4\n", " 1.2.3.4", "1.2.3.4 ", "\u0661.2.3.4", "1.2.3.04", "1..2.3", ""]
    for s in cases:
        try:
            canonical = str(IPv4Address(s)) == s
        except ValueError:
            canonical = False
        assert bool(_CANONICAL_V4.fullmatch(s)) == canonical, s
        if canonical:
            assert IPv4Address(socket.inet_aton(s)) == IPv4Address(s)


# -- loadBalancerSourceRanges ---------------------------------------------------------------

RANGES_FIELD = "loadBalancerSourceRanges"
SR_ANN = "service.beta.kubernetes.io/load-balancer-source-ranges"


def with_ranges(obj: Obj, field: Any = None, ann: Any = None) -> Obj:
    if field is not None:
        obj["spec"][RANGES_FIELD] = field
    if ann is not None:
        obj["metadata"].setdefault("annotations", {})[SR_ANN] = ann
    return obj


def nets(*texts: str) -> frozenset[Any]:
    from ipaddress import ip_network

    return frozenset(ip_network(t) for t in texts)


VM1_REF = "Service default/vm1"


@pytest.mark.parametrize(
    ("field", "ann", "ranges", "problems"),
    [
        (None, None, None, []),
        ([], None, None, []),
        (
            ["198.51.100.0/24", "203.0.113.7/32"],
            None,
            nets("198.51.100.0/24", "203.0.113.7/32"),
            [],
        ),
        (None, " 198.51.100.0/24 ,203.0.113.7/32,", nets("198.51.100.0/24", "203.0.113.7/32"), []),
        (None, "", None, []),
        (["10.1.2.3/8"], None, nets("10.0.0.0/8"), []),  # host bits are cleared, as k8s does
        (["2001:db8::/32"], None, nets(), []),  # an IPv4 pod: no range of its family, no source
        (
            ["198.51.100.0/24"],
            "192.0.2.0/24",
            nets("198.51.100.0/24"),
            [
                f"annotation {SR_ANN} is ignored because spec.loadBalancerSourceRanges is set "
                "(the field wins, as in Kubernetes); remove one of them"
            ],
        ),
        (
            ["198.51.100.0/24", "300.1.1.0/24", "203.0.113.7"],
            None,
            nets("198.51.100.0/24"),
            [
                'spec.loadBalancerSourceRanges[1] "300.1.1.0/24" is not a valid CIDR; it is '
                "ignored, the other ranges still apply; fix it",
                'spec.loadBalancerSourceRanges[2] "203.0.113.7" is not a CIDR (no prefix length, '
                "e.g. 203.0.113.7/32); it is ignored, the other ranges still apply; fix it",
            ],
        ),
        (
            None,
            "010.0.0.0/8",
            nets(),
            [
                f'annotation {SR_ANN} item 1 "010.0.0.0/8" is not a valid CIDR; it is ignored, '
                "the other ranges still apply; fix it",
                f"none of the 1 source ranges in annotation {SR_ANN} is valid, so no source may "
                "connect (never wider than asked); fix them",
            ],
        ),
        (
            "10.0.0.0/8",
            None,
            nets(),
            [
                'spec.loadBalancerSourceRanges must be a list but is a string ("10.0.0.0/8"), so '
                "no source may connect; fix the field"
            ],
        ),
    ],
    ids=[
        "none",
        "empty-list",
        "field",
        "annotation",
        "empty-annotation",
        "host-bits",
        "other-family-only",
        "field-wins",
        "invalid-among-valid",
        "nothing-valid",
        "field-not-a-list",
    ],
)
def test_source_ranges(field: Any, ann: Any, ranges: Any, problems: list[str]) -> None:
    objs = [with_ranges(service(), field, ann), endpoints("vm1", "default", POD1)]
    result = build_state(objs)
    want = {} if ranges is None else {ip_address(POD1): ranges}
    assert result.state.ranges == want
    assert [str(p) for p in result.problems] == [f"{VM1_REF}: {m}" for m in problems]
    assert len(result.state.services) == 1, "the Service is programmed either way"


def test_source_ranges_of_a_pod_behind_two_services_are_their_union() -> None:
    """Keyed on the pod IP like the allowed ports: the union of its Services' ranges, and no
    restriction when one of them has none."""
    a = with_ranges(service("a", ips=(LB1,), created=T_OLD), ["198.51.100.0/24"])
    b = with_ranges(service("b", ips=(LB2,), created=T_NEW), ["203.0.113.0/25"])
    c = service("c", ips=(LB3,), created=T_NEW)
    eps = [endpoints(n, "default", POD1, name=f"{n}-x") for n in ("a", "b", "c")]
    both = build_state([a, b, *eps[:2]])
    assert both.state.ranges == {ip_address(POD1): nets("198.51.100.0/24", "203.0.113.0/25")}
    assert build_state([a, b, c, *eps]).state.ranges == {}


def test_dual_stack_ranges_apply_per_family() -> None:
    objs = [
        with_ranges(
            service(ips=(LB1, LB6_1)), ["198.51.100.0/24", "2001:db8:100::/48", "192.0.2.0/24"]
        ),
        endpoints("vm1", "default", POD1, name="vm1-v4"),
        endpoints("vm1", "default", POD6_1, name="vm1-v6", address_type="IPv6"),
    ]
    st = build_state(objs).state
    assert st.ranges == {
        ip_address(POD1): nets("198.51.100.0/24", "192.0.2.0/24"),
        ip_address(POD6_1): nets("2001:db8:100::/48"),
    }
    view = build_state(objs).services[0]
    assert str(view).endswith("from 192.0.2.0/24,198.51.100.0/24,2001:db8:100::/48")


# -- trusted endpoints (issue 28, item 2) ------------------------------------------------------


def _slice(labels: dict[str, str], *endpoints: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "vm-abcde",
            "namespace": "tenant-a",
            "labels": {"kubernetes.io/service-name": "vm", **labels},
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [ep["ip"]],
                "conditions": {"ready": True},
                **{k: v for k, v in ep.items() if k != "ip"},
            }
            for ep in endpoints
        ],
    }


CONTROLLER = {"endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}
POD_A = {"kind": "Pod", "namespace": "tenant-a"}


@pytest.mark.parametrize(
    ("labels", "endpoints", "ready"),
    [
        (
            CONTROLLER,
            [
                {
                    "ip": "10.244.1.1",
                    "targetRef": {"kind": "Pod", "namespace": "tenant-a", "name": "p1"},
                },
                {"ip": "10.244.1.2", "targetRef": {"kind": "Pod", "name": "p2"}},  # its namespace
                {
                    "ip": "10.244.1.6",
                    "targetRef": {"kind": "Pod", "namespace": "tenant-a"},
                },  # no name
                {"ip": "10.244.1.3", "targetRef": {"kind": "Pod", "namespace": "tenant-b"}},
                {"ip": "10.96.0.1"},  # no targetRef: the API server's address, say
                {"ip": "192.0.2.10", "targetRef": {"kind": "Node", "name": "node1"}},
            ],
            {"10.244.1.1", "10.244.1.2"},
        ),
        ({}, [{"ip": "10.244.1.4", "targetRef": {"kind": "Pod", "name": "p"}}], set()),
        (
            {"endpointslice.kubernetes.io/managed-by": "someone"},
            [{"ip": "10.244.1.5", "targetRef": {"kind": "Pod", "name": "p"}}],
            set(),
        ),
    ],
    ids=["controller-slice", "no-manager", "another-manager"],
)
def test_only_endpoints_a_tenant_cannot_forge_are_ready(
    labels: dict[str, str], endpoints: list[dict[str, Any]], ready: set[str]
) -> None:
    """From the API (`verify_endpoints`): a slice of Kubernetes' EndpointSlice controller, and
    in it only endpoints whose targetRef is a named Pod of the slice's namespace; each thing
    left out is a warning naming the setting. A manifest (no verification) takes all."""
    obj = _slice(labels, *endpoints)
    rec = read_object(copy.deepcopy(obj), 1, verify_endpoints=True)
    assert isinstance(rec, SliceRecord)
    assert {str(a) for a in rec.ready} == ready
    left_out = len(endpoints) - len(ready) if labels == CONTROLLER else 1
    assert len(rec.problems) == left_out
    assert all(
        p.severity == "warning" and "--trusted-endpoints any" in p.message for p in rec.problems
    )
    trusted = read_object(obj, 1)
    assert isinstance(trusted, SliceRecord) and trusted.problems == ()
    assert {str(a) for a in trusted.ready} == {e["ip"] for e in endpoints}
