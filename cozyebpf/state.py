"""The datapath state as plain values: what the BPF maps hold, and the difference between two.

This module is the contract between the layers:

    sources (manifest file, Kubernetes)  ->  model (pure)  ->  MapState, a MapDiff per change
    controller: Datapath.apply(MapDiff) per change; a resync: diff(live, desired) -> apply()

It imports nothing from bcc or the kubernetes client. Addresses are `ipaddress.IPv4Address` or
`ipaddress.IPv6Address` (`IPAddress`); each family has its own maps in the datapath (addr4/addr6
hold services and pods, allow4/allow6 the allowed ports, range4/range6 the source ranges), and
the key and the value of one entry are always of the same family: an IPv4 LB IP is translated to
an IPv4 pod IP and an IPv6 LB IP to an IPv6 pod IP, never across.
`MapState` and `MapDiff` check that when they are built (`check()` checks again after in-place
changes), and both datapaths refuse to apply a diff that mixes families.

Entries of both families sort together: IPv4 before IPv6, then by address (`address_key`).
"""

from __future__ import annotations

import enum
import functools
import operator
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from typing import TypeAlias

#: An address of either family.
IPAddress: TypeAlias = IPv4Address | IPv6Address
#: A network (a CIDR) of either family.
IPNetwork: TypeAlias = IPv4Network | IPv6Network
#: The sources a pod accepts connections from (loadBalancerSourceRanges), all of the pod's
#: family; empty: none at all.
Ranges: TypeAlias = frozenset[IPNetwork]

#: The address families, as `IPv4Address.version` / `IPv6Address.version` name them.
FAMILIES = (4, 6)
#: an address's family by its class (`MapState.counts` counts classes)
_VERSION_OF: dict[type, int] = {IPv4Address: 4, IPv6Address: 6}
_POD_IP = operator.attrgetter("pod_ip")


def family_name(version: int) -> str:
    """The family's name: "IPv4" or "IPv6"."""
    return f"IPv{version}"


def address_key(ip: IPAddress) -> tuple[int, int]:
    """Sort key of an address of either family: IPv4 before IPv6, then numerically (the order
    `ipaddress` gives within one family; across families it raises TypeError)."""
    return (ip.version, int(ip))


def _check_address(owner: str, name: str, value: object) -> None:
    if not isinstance(value, IPv4Address | IPv6Address):
        raise TypeError(
            f"{owner}.{name} must be an IPv4Address or IPv6Address, not {type(value).__name__}"
        )


class Proto(enum.IntEnum):
    """IP protocol numbers that the port filter and the flow table know."""

    ICMP = 1
    TCP = 6
    UDP = 17
    ICMPV6 = 58
    SCTP = 132


@dataclass(frozen=True, slots=True)
class Limits:
    """A Service's limits (issue 38; None: no limit of that kind): bits per second into its LB
    IPs and out of its pod, packets per second into its LB IPs. `guard`: the packet rate is
    the node's guard (`--guard-packet-rate`), not the Service's own. The datapath enforces them
    per Service slot (bpf/lib/limit.h; the buckets' arithmetic: cozyebpf/datapath/buckets.py)."""

    ingress_bps: int | None = None
    egress_bps: int | None = None
    ingress_pps: int | None = None
    guard: bool = False

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.ingress_bps, self.egress_bps, self.ingress_pps))

    @property
    def ingress(self) -> bool:
        """Is anything coming in limited?"""
        return self.ingress_bps is not None or self.ingress_pps is not None


NO_LIMITS = Limits()


@functools.total_ordering
@dataclass(frozen=True, slots=True)
class ServiceEntry:
    """Value of the LB-IP map: where packets to the LB IP go, and how they are filtered.
    `pod_ip` is of the LB IP's family. `service` names the Service whose counters the LB IP's
    traffic feeds ("namespace/name", "" for none): it is not part of equality (two entries that
    forward alike are equal), but `diff()` compares it, so a new owner is written."""

    pod_ip: IPAddress
    port_filter: bool  # False: whole-IP (every port and protocol passes)
    allow_icmp: bool  # only meaningful with port_filter
    service: str = field(default="", compare=False)
    #: the pod is migrating: TCP that opens nothing passes its filter (bpf/lib/types.h, CZ_F_LEARN)
    learning: bool = False
    #: its Service limits what comes in (MapState.limits; bpf/lib/types.h, CZ_F_LIMIT)
    limited: bool = False

    def __post_init__(self) -> None:
        _check_address("ServiceEntry", "pod_ip", self.pod_ip)

    @property
    def version(self) -> int:
        """The address family (4 or 6)."""
        return self.pod_ip.version

    def _key(self) -> tuple[tuple[int, int], bool, bool, bool, bool]:
        return (
            address_key(self.pod_ip), self.port_filter, self.allow_icmp, self.learning,
            self.limited,
        )  # fmt: skip

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, ServiceEntry):
            return NotImplemented
        return self._key() < other._key()


@functools.total_ordering
@dataclass(frozen=True, slots=True)
class PodEntry:
    """Value of the pod-IP map: the LB IP the pod's egress is rewritten to, and its filter.
    `lb_ip` is of the pod IP's family. `service` names the Service whose counters the pod's
    egress (and traffic sent to the pod IP directly) feeds: the Service of `lb_ip`; as in
    ServiceEntry, outside equality and compared by `diff()`."""

    lb_ip: IPAddress
    port_filter: bool
    allow_icmp: bool
    service: str = field(default="", compare=False)
    #: the pod is migrating: TCP that opens nothing passes its filter (bpf/lib/types.h, CZ_F_LEARN)
    learning: bool = False
    #: its Service limits what goes out (MapState.limits; bpf/lib/types.h, CZ_F_LIMIT)
    limited: bool = False

    def __post_init__(self) -> None:
        _check_address("PodEntry", "lb_ip", self.lb_ip)

    @property
    def version(self) -> int:
        """The address family (4 or 6)."""
        return self.lb_ip.version

    def _key(self) -> tuple[tuple[int, int], bool, bool, bool, bool]:
        return (
            address_key(self.lb_ip), self.port_filter, self.allow_icmp, self.learning,
            self.limited,
        )  # fmt: skip

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, PodEntry):
            return NotImplemented
        return self._key() < other._key()


@functools.total_ordering
@dataclass(frozen=True, slots=True)
class AllowedPort:
    """One entry of the allowed-ports set: (pod IP, L4 protocol, destination port); it goes to
    allow4 or allow6 by the pod IP's family."""

    pod_ip: IPAddress
    proto: Proto
    port: int

    def __post_init__(self) -> None:
        _check_address("AllowedPort", "pod_ip", self.pod_ip)

    @property
    def version(self) -> int:
        """The address family (4 or 6)."""
        return self.pod_ip.version

    def _key(self) -> tuple[tuple[int, int], int, int]:
        return (address_key(self.pod_ip), int(self.proto), self.port)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, AllowedPort):
            return NotImplemented
        return self._key() < other._key()


def _mixed(
    services: dict[IPAddress, ServiceEntry],
    pods: dict[IPAddress, PodEntry],
    ranges: Mapping[IPAddress, Ranges] | None = None,
) -> list[str]:
    """One line per entry whose key and value are of different families: services, then pods,
    then ranges, each in key order (found first, then sorted: every MapState and MapDiff is
    checked when it is built)."""
    # (the classes, not `version`: a property a call each, and every entry of a cold start's
    # state and diff is checked)
    found = [
        (0, lb, f"service {lb} -> pod {s.pod_ip}")
        for lb, s in services.items()
        if lb.__class__ is not s.pod_ip.__class__
    ]
    found += [
        (1, p, f"pod {p} -> LB IP {e.lb_ip}")
        for p, e in pods.items()
        if p.__class__ is not e.lb_ip.__class__
    ]
    found += [
        (2, p, f"source ranges of pod {p}: {net}")
        for p, nets in (ranges or {}).items()
        for net in sorted(nets, key=lambda n: (n.version, int(n.network_address), n.prefixlen))
        if net.version != p.version
    ]
    return [line for _, _, line in sorted(found, key=lambda f: (f[0], address_key(f[1])))]


def _raise_mixed(what: str, errors: list[str]) -> None:
    if errors:
        raise ValueError(
            f"{what} mixes address families (an IPv4 address is only ever translated to an "
            f"IPv4 address, an IPv6 one to an IPv6 one): {'; '.join(errors)}"
        )


#: The MapState fields that map a key (an address; a Service's "namespace/name" for limits) to
#: a value: MapDiff has `<field>_set` (entries to add or modify) and `<field>_del` (keys to
#: delete) for each. `allowed`, a set, has `allowed_add` and `allowed_del`.
KEYED = ("services", "pods", "ranges", "limits")


@dataclass
class MapState:
    """Everything the control plane programs into the datapath (the flow table and the
    counters belong to the datapath and are not part of it). Both families in one state; the
    key and value of each entry are of one family (checked on construction and by `check()`).
    """

    services: dict[IPAddress, ServiceEntry] = field(default_factory=dict)
    pods: dict[IPAddress, PodEntry] = field(default_factory=dict)
    allowed: set[AllowedPort] = field(default_factory=set)
    #: pods that accept only some sources (loadBalancerSourceRanges): pod IP -> the networks
    #: (empty: no source at all); a pod without an entry accepts every source
    ranges: dict[IPAddress, Ranges] = field(default_factory=dict)
    #: the Services with limits ("namespace/name" -> Limits), each with entries here that
    #: carry `limited`
    limits: dict[str, Limits] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.check()

    def family_errors(self) -> list[str]:
        """Entries whose key and value are of different families, one line each."""
        return _mixed(self.services, self.pods, self.ranges)

    def check(self) -> None:
        """Raise ValueError naming every entry whose key and value are of different families."""
        _raise_mixed("the map state", self.family_errors())

    def copy(self) -> MapState:
        return MapState(
            dict(self.services), dict(self.pods), set(self.allowed), dict(self.ranges),
            dict(self.limits),
        )  # fmt: skip

    def apply(self, d: MapDiff) -> None:
        """Apply `d` in place, in the order a datapath writes it (`MapDiff`): allowed ports
        added, entries set, keys deleted (a key that `d` sets and deletes goes; one it deletes
        that is not here is no matter), allowed ports removed. Raises ValueError (and changes
        nothing) if `d` mixes families."""
        d.check()
        self.allowed |= d.allowed_add
        for kind in KEYED:
            getattr(self, kind).update(getattr(d, f"{kind}_set"))
        for kind in KEYED:
            entries = getattr(self, kind)
            for key in getattr(d, f"{kind}_del"):
                entries.pop(key, None)
        self.allowed -= d.allowed_del

    def counts(self) -> dict[tuple[str, int], int]:
        """The entries per (kind, family), as `Capacity.full` reads them ("ranges" counts
        networks)."""
        counts: dict[tuple[str, int], int] = {}
        for kind, keys in (
            ("services", self.services),
            ("pods", self.pods),
            ("allowed", map(_POD_IP, self.allowed)),
            ("ranges", (pod for pod, nets in self.ranges.items() for _ in nets)),
        ):
            # by class, counted in C (a cold start counts every entry)
            for cls, n in Counter(map(type, keys)).items():
                counts[(kind, _VERSION_OF[cls])] = n
        return counts


@dataclass
class MapDiff:
    """What to change to turn one MapState into another.

    `Datapath.apply()` applies it in an order that never opens a hole: allowed ports are added
    before the services that need them and removed after the services that used them. Each
    entry goes to the maps of its family; an entry that mixes families is refused (on
    construction and by `check()`).
    """

    services_set: dict[IPAddress, ServiceEntry] = field(default_factory=dict)  # add or modify
    services_del: set[IPAddress] = field(default_factory=set)
    pods_set: dict[IPAddress, PodEntry] = field(default_factory=dict)
    pods_del: set[IPAddress] = field(default_factory=set)
    allowed_add: set[AllowedPort] = field(default_factory=set)
    allowed_del: set[AllowedPort] = field(default_factory=set)
    ranges_set: dict[IPAddress, Ranges] = field(default_factory=dict)  # a pod's sources, whole
    ranges_del: set[IPAddress] = field(default_factory=set)  # pods that accept every source
    limits_set: dict[str, Limits] = field(default_factory=dict)  # a Service's limits, whole
    limits_del: set[str] = field(default_factory=set)  # Services without limits

    def __post_init__(self) -> None:
        self.check()

    def family_errors(self) -> list[str]:
        """Entries to set whose key and value are of different families, one line each."""
        return _mixed(self.services_set, self.pods_set, self.ranges_set)

    def check(self) -> None:
        """Raise ValueError naming every entry whose key and value are of different families."""
        _raise_mixed("the map diff", self.family_errors())

    def empty(self) -> bool:
        return not any(getattr(self, f.name) for f in fields(self))


def _changed(old: object, new: object) -> bool:
    """Whether `new` must be written over `old`: another value or, for a ServiceEntry or a
    PodEntry, another Service (which is not part of their equality)."""
    return old != new or getattr(old, "service", "") != getattr(new, "service", "")


def diff(live: MapState, desired: MapState) -> MapDiff:
    """The changes that turn `live` into `desired`; unchanged entries (the same value and
    Service) are not touched."""
    d = MapDiff(
        allowed_add=desired.allowed - live.allowed, allowed_del=live.allowed - desired.allowed
    )
    for kind in KEYED:
        have, want = getattr(live, kind), getattr(desired, kind)
        to_set = getattr(d, f"{kind}_set")
        if not have:  # every entry is new (a cold start): one copy, no comparison per entry
            to_set.update(want)
            continue
        for key, value in want.items():
            if _changed(have.get(key), value):
                to_set[key] = value
        getattr(d, f"{kind}_del").update(have.keys() - want.keys())
    return d


def whole(desired: MapState) -> MapDiff:
    """`diff(MapState(), desired)` without a copy: the diff holds `desired`'s own dicts and
    sets, so neither may change while it is in use (the model's flush of new Services only,
    whose state is dropped after; a sync onto empty maps, which only reads it)."""
    return MapDiff(
        services_set=desired.services,
        pods_set=desired.pods,
        allowed_add=desired.allowed,
        ranges_set=desired.ranges,
        limits_set=desired.limits,
    )


def apply_to(state: MapState, d: MapDiff) -> MapState:
    """`state` with `d` applied (a new object); what a correct datapath must end up holding.
    Raises ValueError (and changes nothing) if `d` mixes families."""
    out = state.copy()
    out.apply(d)
    return out


@dataclass(frozen=True)
class MapLimit:
    """One map of the datapath and what it holds: at most `size` entries of the kinds listed,
    ("services" | "pods" | "allowed" | "ranges", address family) counted together ("ranges"
    counts networks)."""

    map: str
    size: int
    kinds: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Capacity:
    """The datapath's maps, for programming what fits when the cluster is larger; `hint` says
    how to raise the sizes (it ends the message about each Service left out)."""

    limits: tuple[MapLimit, ...]
    hint: str = "raise --max-services"

    def full(self, counts: Mapping[tuple[str, int], int]) -> MapLimit | None:
        """The first map that `counts` would overflow, or None."""
        for limit in self.limits:
            if sum(counts.get(k, 0) for k in limit.kinds) > limit.size:
                return limit
        return None
