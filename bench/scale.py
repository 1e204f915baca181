"""Synthetic clusters for the control-plane benches: N Services with their EndpointSlices.

LB IPs come from 198.18.0.0/15 (RFC 2544's benchmark range, 131072 addresses) and pod IPs from
10.240.0.0/12 (room for 100k Services and a second pod each); they only go into maps and
nftables sets, no packet is ever sent to them. Every fourth Service is whole-IP; the others
filter ports (TCP 22 and TCP 80, every other one UDP 53 too), and every eighth allows ICMP.

The probe Service (`bench/probe`, 203.0.113.200, whole-IP) is the one real one: its endpoint
is one of the lab's pods, and the forwarding probe sends to it.
"""

from __future__ import annotations

from ipaddress import IPv4Address
from typing import Any

from cozyebpf.model import build_state
from cozyebpf.state import MapState

LB_BASE = int(IPv4Address("198.18.0.0"))
POD_BASE = int(IPv4Address("10.240.0.0"))
PROBE_LB = "203.0.113.200"


def lb_ip(i: int) -> str:
    return str(IPv4Address(LB_BASE + 1 + i))


def pod_ip(i: int, gen: int = 0) -> str:
    """Pod IP of Service i; `gen` 1 gives it another pod (a changed EndpointSlice)."""
    n = 1 + i + gen * (1 << 19)
    assert i < (1 << 19) - 1 and gen in (0, 1), "10.240.0.0/12 holds 524,286 Services"
    return str(IPv4Address(POD_BASE + n))


def ports(i: int) -> list[tuple[str, int]]:
    if i % 4 == 0:
        return [("TCP", 22)]
    p = [("TCP", 22), ("TCP", 80)]
    return [*p, ("UDP", 53)] if i % 2 else p


def service(i: int, flip: bool = False) -> dict[str, Any]:
    """Service i; `flip` toggles its allowICMP annotation (a Service change: the flags of its
    LB IP's entry change)."""
    ann = {}
    if i % 4 == 0:
        ann["networking.cozystack.io/wholeIP"] = "true"
    if (i % 8 == 1) != flip:
        ann["networking.cozystack.io/allowICMP"] = "true"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": f"vm-{i}",
            "namespace": f"tenant-{i % 50}",
            "uid": f"00000000-0000-4000-8000-{i:012d}",
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": {"service.kubernetes.io/service-proxy-name": "cozy-proxy"},
            "annotations": ann,
        },
        "spec": {
            "type": "LoadBalancer",
            "ports": [
                {"name": f"{p.lower()}-{n}", "protocol": p, "port": n, "targetPort": n}
                for p, n in ports(i)
            ],
        },
        "status": {"loadBalancer": {"ingress": [{"ip": lb_ip(i)}]}},
    }


#: the label Kubernetes' EndpointSlice controller gives its slices
MANAGED_BY = {"endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}


def slice_(i: int, gen: int = 0) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"vm-{i}-abcde",
            "namespace": f"tenant-{i % 50}",
            "labels": {"kubernetes.io/service-name": f"vm-{i}", **MANAGED_BY},
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [pod_ip(i, gen)],
                "conditions": {"ready": True, "serving": True, "terminating": False},
                # as the controller writes it (the API source trusts only that: issue 28)
                "targetRef": {"kind": "Pod", "namespace": f"tenant-{i % 50}", "name": f"vm-{i}"},
            }
        ],
        "ports": [{"name": f"{p.lower()}-{n}", "port": n, "protocol": p} for p, n in ports(i)],
    }


def probe_service() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "probe",
            "namespace": "bench",
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": {"service.kubernetes.io/service-proxy-name": "cozy-proxy"},
            "annotations": {"networking.cozystack.io/wholeIP": "true"},
        },
        "spec": {"type": "LoadBalancer", "ports": [{"protocol": "UDP", "port": 9999}]},
        "status": {"loadBalancer": {"ingress": [{"ip": PROBE_LB}]}},
    }


def probe_slice(pod: str) -> dict[str, Any]:
    """The probe Service's EndpointSlice, its endpoint at `pod` (one of the lab's pods)."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "probe-abcde",
            "namespace": "bench",
            "labels": {"kubernetes.io/service-name": "probe", **MANAGED_BY},
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [pod],
                "conditions": {"ready": True},
                "targetRef": {"kind": "Pod", "namespace": "bench", "name": "probe"},
            }
        ],
    }


def objects(n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(n):
        out += [service(i), slice_(i)]
    return out


def manifest_text(n: int) -> str:
    """The cluster as a kind: List manifest. JSON is valid YAML and keeps the file small; the
    agent parses it with its YAML loader like any manifest."""
    import json

    return json.dumps({"apiVersion": "v1", "kind": "List", "items": objects(n)})


def manifest_yaml(n: int) -> str:
    return manifest_yaml_objects(objects(n))


def manifest_yaml_objects(objs: list[dict[str, Any]]) -> str:
    import yaml

    return yaml.dump_all(
        objs, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), sort_keys=False
    )


def state(n: int) -> MapState:
    return build_state(objects(n), "cozy-proxy").state


def nft_entries(
    st: MapState,
) -> tuple[list[tuple[str, str]], list[tuple[str, str, int]], list[str], list[str]]:
    """The same entries as cozy-proxy would program them: (mappings, allowed, filtered, icmp)."""
    mappings = [(str(lb), str(e.pod_ip)) for lb, e in sorted(st.services.items())]
    allowed = [(str(a.pod_ip), a.proto.name.lower(), a.port) for a in sorted(st.allowed)]
    filtered = sorted({str(e.pod_ip) for e in st.services.values() if e.port_filter})
    icmp = sorted({str(e.pod_ip) for e in st.services.values() if e.allow_icmp})
    return mappings, allowed, filtered, icmp
