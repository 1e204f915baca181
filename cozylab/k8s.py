"""Kubernetes manifests for the lab: Services with status and their EndpointSlices."""

from __future__ import annotations

from dataclasses import dataclass, field

import yaml


@dataclass
class Svc:
    name: str
    lb_ip: str
    pod_ip: str | None
    ports: list[tuple[str, int]] = field(default_factory=list)  # ("TCP", 22)
    whole_ip: str | None = None  # value of networking.cozystack.io/wholeIP, None: absent
    allow_icmp: str | None = None
    proxy_name: str = "cozy-proxy"
    namespace: str = "default"
    created: str = "2026-01-01T00:00:00Z"
    lb_ip6: str | None = None  # dual-stack: an IPv6 LB IP too
    pod_ip6: str | None = None  # and an IPv6 EndpointSlice
    source_ranges: list[str] | None = None  # spec.loadBalancerSourceRanges
    #: the slices' endpointslice.kubernetes.io/managed-by (None: no label); Kubernetes'
    #: EndpointSlice controller by default, the only manager the API source trusts
    managed_by: str | None = "endpointslice-controller.k8s.io"
    #: the endpoint's targetRef, as the controller writes it: a Pod of the Service's namespace
    #: (None: no targetRef)
    target: dict[str, str] | None = field(default_factory=lambda: {"kind": "Pod"})
    #: more annotations, as they are (the limits': networking.cozystack.io/ingressBandwidth...)
    annotations: dict[str, str] = field(default_factory=dict)


def objects(svc: Svc) -> list[dict[str, object]]:
    ann = {}
    if svc.whole_ip is not None:
        ann["networking.cozystack.io/wholeIP"] = svc.whole_ip
    if svc.allow_icmp is not None:
        ann["networking.cozystack.io/allowICMP"] = svc.allow_icmp
    ann.update(svc.annotations)
    service: dict[str, object] = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": svc.name,
            "namespace": svc.namespace,
            "creationTimestamp": svc.created,
            "labels": {"service.kubernetes.io/service-proxy-name": svc.proxy_name},
            "annotations": ann,
        },
        "spec": {
            "type": "LoadBalancer",
            "ports": [
                {"name": f"{p.lower()}-{n}", "protocol": p, "port": n, "targetPort": n}
                for p, n in svc.ports
            ]
            # a LoadBalancer Service needs a port; port 1 stands in where a test names none
            or [{"name": "placeholder", "protocol": "TCP", "port": 1}],
            **(
                {"loadBalancerSourceRanges": svc.source_ranges}
                if svc.source_ranges is not None
                else {}
            ),
        },
        "status": {
            "loadBalancer": {
                "ingress": [{"ip": ip} for ip in (svc.lb_ip, svc.lb_ip6) if ip is not None]
            }
        },
    }
    out: list[dict[str, object]] = [service]
    labels = {"kubernetes.io/service-name": svc.name}
    if svc.managed_by is not None:
        labels["endpointslice.kubernetes.io/managed-by"] = svc.managed_by
    endpoint: dict[str, object] = {"conditions": {"ready": True}}
    if svc.target is not None:
        # the controller's targetRef: the pod by name, in the Service's namespace unless given
        pod = {"namespace": svc.namespace, "name": f"{svc.name}-pod", **svc.target}
        endpoint["targetRef"] = pod
    for family, pod_ip in (("IPv4", svc.pod_ip), ("IPv6", svc.pod_ip6)):
        if pod_ip:
            out.append(
                {
                    "apiVersion": "discovery.k8s.io/v1",
                    "kind": "EndpointSlice",
                    "metadata": {
                        "name": f"{svc.name}-{family.lower()}",
                        "namespace": svc.namespace,
                        "labels": dict(labels),
                    },
                    "addressType": family,
                    "endpoints": [{"addresses": [pod_ip], **endpoint}],
                    "ports": [{"port": n, "protocol": p} for p, n in svc.ports],
                }
            )
    return out


def manifest(*services: Svc) -> str:
    docs = [o for s in services for o in objects(s)]
    return yaml.safe_dump_all(docs, sort_keys=False)
