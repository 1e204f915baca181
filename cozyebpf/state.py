"""The datapath state as plain values: what the BPF maps hold, and the difference between two.

This module is the contract between the layers:

    sources (manifest file, Kubernetes)  ->  model (pure)  ->  MapState
    controller: diff(live MapState, desired MapState) -> MapDiff -> Datapath.apply()

It imports nothing from bcc or the kubernetes client. Addresses are `ipaddress.IPv4Address`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from ipaddress import IPv4Address


class Proto(enum.IntEnum):
    """IP protocol numbers that the port filter knows."""

    ICMP = 1
    TCP = 6
    UDP = 17
    SCTP = 132


#: Protocols that `spec.ports` can name and that the port filter keys on.
PORT_PROTOS = (Proto.TCP, Proto.UDP, Proto.SCTP)


@dataclass(frozen=True, order=True)
class ServiceEntry:
    """Value of the LB-IP map: where packets to the LB IP go, and how they are filtered."""

    pod_ip: IPv4Address
    port_filter: bool  # False: whole-IP (every port and protocol passes)
    allow_icmp: bool  # only meaningful with port_filter


@dataclass(frozen=True, order=True)
class PodEntry:
    """Value of the pod-IP map: the LB IP the pod's egress is rewritten to, and its filter."""

    lb_ip: IPv4Address
    port_filter: bool
    allow_icmp: bool


@dataclass(frozen=True, order=True)
class AllowedPort:
    """One entry of the allowed-ports set: (pod IP, L4 protocol, destination port)."""

    pod_ip: IPv4Address
    proto: Proto
    port: int


@dataclass
class MapState:
    """Everything the control plane programs into the datapath (the flow table and the
    counters belong to the datapath and are not part of it)."""

    services: dict[IPv4Address, ServiceEntry] = field(default_factory=dict)
    pods: dict[IPv4Address, PodEntry] = field(default_factory=dict)
    allowed: set[AllowedPort] = field(default_factory=set)

    def copy(self) -> MapState:
        return MapState(dict(self.services), dict(self.pods), set(self.allowed))


@dataclass
class MapDiff:
    """What to change to turn one MapState into another.

    `Datapath.apply()` applies it in an order that never opens a hole: allowed ports are added
    before the services that need them and removed after the services that used them.
    """

    services_set: dict[IPv4Address, ServiceEntry] = field(default_factory=dict)  # add or modify
    services_del: set[IPv4Address] = field(default_factory=set)
    pods_set: dict[IPv4Address, PodEntry] = field(default_factory=dict)
    pods_del: set[IPv4Address] = field(default_factory=set)
    allowed_add: set[AllowedPort] = field(default_factory=set)
    allowed_del: set[AllowedPort] = field(default_factory=set)

    def empty(self) -> bool:
        return not (
            self.services_set
            or self.services_del
            or self.pods_set
            or self.pods_del
            or self.allowed_add
            or self.allowed_del
        )


def diff(live: MapState, desired: MapState) -> MapDiff:
    """The changes that turn `live` into `desired`; unchanged entries are not touched."""
    d = MapDiff()
    for lb, svc in desired.services.items():
        if live.services.get(lb) != svc:
            d.services_set[lb] = svc
    d.services_del = set(live.services) - set(desired.services)
    for pod, entry in desired.pods.items():
        if live.pods.get(pod) != entry:
            d.pods_set[pod] = entry
    d.pods_del = set(live.pods) - set(desired.pods)
    d.allowed_add = desired.allowed - live.allowed
    d.allowed_del = live.allowed - desired.allowed
    return d


def apply_to(state: MapState, d: MapDiff) -> MapState:
    """`state` with `d` applied (a new object); what a correct datapath must end up holding."""
    out = state.copy()
    out.allowed |= d.allowed_add
    out.services.update(d.services_set)
    out.pods.update(d.pods_set)
    for lb in d.services_del:
        out.services.pop(lb, None)
    for pod in d.pods_del:
        out.pods.pop(pod, None)
    out.allowed -= d.allowed_del
    return out
