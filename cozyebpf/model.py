"""Kubernetes Service + EndpointSlice objects -> the desired MapState. Pure: no I/O, no clients.

Objects are plain dicts, as parsed from YAML or as the API server returns them (camelCase JSON).
The rules follow cozy-proxy:

- a Service is ours iff `metadata.labels[LABEL_PROXY_NAME] == proxy_name`;
- `annotations[ANN_WHOLE_IP] == "true"` (exactly) selects whole-IP mode, anything else the port
  filter; `annotations[ANN_ALLOW_ICMP] == "true"` (exactly) lets ICMP through the port filter;
- each `status.loadBalancer.ingress[].ip` is NATed 1:1 to the one ready pod found in the
  Service's EndpointSlices; the destination port is not rewritten, so the port filter matches
  `spec.ports[].port`.

IPv6 and dual-stack: each LB IP is translated to the pod IP *of its own family*, taken from the
EndpointSlices of that family (`addressType` IPv4 or IPv6; a dual-stack Service has one of
each), chosen per family by the same rules (ready, not terminating, the lowest address when
there are several). An LB IP whose family has no ready endpoint is reported and not programmed;
it is never translated to an address of the other family. The pod's egress leaves from the
first LB IP of the same family of the oldest Service behind it, and its allowed ports are set for
its pod IP of each programmed family. `spec.ipFamilies` and `spec.ipFamilyPolicy` are not
interpreted: the LB status and the EndpointSlices say which addresses exist, and they are what
the model reads.

Bad input never raises: each bad object or field becomes a `Problem` about that object only.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from ipaddress import IPv4Address, IPv6Address, ip_network
from typing import Any, Literal, NamedTuple

from cozyebpf.state import (
    FAMILIES,
    AllowedPort,
    Capacity,
    IPAddress,
    IPNetwork,
    MapDiff,
    MapState,
    PodEntry,
    Proto,
    Ranges,
    ServiceEntry,
    diff,
    family_name,
)

LABEL_PROXY_NAME = "service.kubernetes.io/service-proxy-name"
DEFAULT_PROXY_NAME = "cozy-proxy"
ANN_WHOLE_IP = "networking.cozystack.io/wholeIP"
ANN_ALLOW_ICMP = "networking.cozystack.io/allowICMP"
#: the older way to give loadBalancerSourceRanges (comma-separated); the spec field wins
ANN_SOURCE_RANGES = "service.beta.kubernetes.io/load-balancer-source-ranges"
#: The label that ties an EndpointSlice to its Service.
LABEL_SERVICE_NAME = "kubernetes.io/service-name"
#: seconds a pod stays learning after its nodes changed (IncrementalModel): long enough for
#: its first answer on the new node to record each flow it has (docs/design.md, "Live migration")
MIGRATION_HOLD = 10.0

Severity = Literal["warning", "error"]

_PROTOS = {"TCP": Proto.TCP, "UDP": Proto.UDP, "SCTP": Proto.SCTP}
_DOTTED_QUAD = re.compile(r"\d+\.\d+\.\d+\.\d+")
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
#: what IPv4Address accepts, in its one canonical form (no leading zeros, four octets)
_CANONICAL_V4 = re.compile(rf"{_OCTET}\.{_OCTET}\.{_OCTET}\.{_OCTET}", re.ASCII)
_BROADCAST = IPv4Address("255.255.255.255")
#: EndpointSlice addressType -> address family
_ADDRESS_TYPES = {"IPv4": 4, "IPv6": 6}


@dataclass(frozen=True, order=True, slots=True)
class ObjectRef:
    """Names a Kubernetes object (or, for garbage, its position in the input) in messages."""

    kind: str
    namespace: str
    name: str

    def __str__(self) -> str:
        if not self.namespace:
            return f"{self.kind} {self.name}"
        return f"{self.kind} {self.namespace}/{self.name}"


@dataclass(frozen=True, order=True, slots=True)
class Problem:
    """Something wrong with one object: `message` says what, and what to do about it."""

    ref: ObjectRef
    message: str
    severity: Severity = "warning"

    def __str__(self) -> str:
        return f"{self.ref}: {self.message}"


class PortSpec(NamedTuple):
    """An allowed destination port of a Service, as (protocol, port)."""

    proto: Proto
    port: int

    def __str__(self) -> str:
        return f"{self.proto.name.lower()}/{self.port}"


@dataclass(frozen=True, slots=True)
class ServiceView:
    """One selected Service as the model understood it, for logs.

    `lb_ips` are the valid addresses of both families the Service holds, in status order (those
    claimed by an older Service are left out; those whose family has no ready endpoint are
    kept: the claim does not depend on readiness). `pod_ips` are the chosen backends, at most
    one per family, IPv4 first; empty when there is no ready endpoint. `ports` is empty in
    whole-IP mode.
    """

    ref: ObjectRef
    lb_ips: tuple[IPAddress, ...]
    pod_ips: tuple[IPAddress, ...]
    port_filter: bool
    allow_icmp: bool
    ports: tuple[PortSpec, ...]
    #: the valid loadBalancerSourceRanges (both families); None: every source may connect
    source_ranges: tuple[IPNetwork, ...] | None = None
    #: backends that are migrating (ready on two nodes, or moved less than MIGRATION_HOLD ago)
    migrating: tuple[IPAddress, ...] = ()

    def pod_for(self, lb: IPAddress) -> IPAddress | None:
        """The backend `lb` is translated to: the pod IP of its family, or None."""
        return next((p for p in self.pod_ips if p.version == lb.version), None)

    @property
    def pod_ip(self) -> IPAddress | None:
        """The first backend (the IPv4 one of a dual-stack Service), or None; for callers that
        know one family only."""
        return self.pod_ips[0] if self.pod_ips else None

    @property
    def programmed_lb_ips(self) -> tuple[IPAddress, ...]:
        """The LB IPs that have entries in the desired state (a pod IP of their family)."""
        return tuple(lb for lb in self.lb_ips if self.pod_for(lb) is not None)

    @property
    def programmed(self) -> bool:
        """Whether the Service has entries in the desired state."""
        return bool(self.programmed_lb_ips)

    def _target(self) -> str:
        """`LB IPs -> pod IP`, one group per family of the LB IPs."""
        if not self.lb_ips:
            return "(no LB IP) -> " + (",".join(map(str, self.pod_ips)) or "(no ready pod)")
        groups = []
        for version in FAMILIES:
            lbs = [lb for lb in self.lb_ips if lb.version == version]
            if not lbs:
                continue
            pod = next((p for p in self.pod_ips if p.version == version), None)
            if pod is not None:
                shown = str(pod)
            elif self.pod_ips:
                shown = f"(no ready {family_name(version)} pod)"
            else:
                shown = "(no ready pod)"
            groups.append(f"{','.join(map(str, lbs))} -> {shown}")
        return ", ".join(groups)

    def __str__(self) -> str:
        if self.port_filter:
            mode = "port-filter " + (",".join(map(str, self.ports)) or "(no ports)")
            mode += " icmp" if self.allow_icmp else ""
        else:
            mode = "whole-ip"
        if self.source_ranges is not None:
            mode += " from " + (",".join(map(str, self.source_ranges)) or "(no source)")
        if self.migrating:
            mode += " migrating " + ",".join(map(str, self.migrating))
        return f"{self.ref}: {self._target()} {mode}"


@dataclass
class ModelResult:
    """The desired state, every selected Service (sorted by namespace/name) and every Problem
    (sorted, without duplicates)."""

    state: MapState
    services: list[ServiceView] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


class _Invalid(Exception):
    """A bad field; becomes a Problem about the object being read."""

    def __init__(self, message: str, severity: Severity = "error") -> None:
        super().__init__(message)
        self.message = message
        self.severity = severity


@dataclass(frozen=True, slots=True)
class ParsedService:
    """A selected Service whose fields could be read (immutable: records are compared to drop
    no-op updates and shared between threads)."""

    ref: ObjectRef
    created: datetime | None
    port_filter: bool
    allow_icmp: bool
    lb_ips: tuple[IPAddress, ...]
    ports: tuple[PortSpec, ...]
    problems: tuple[Problem, ...]
    source_ranges: tuple[IPNetwork, ...] | None = None  # None: no restriction

    def ranges_of(self, version: int) -> Ranges | None:
        """The source ranges that apply to addresses of one family (None: every source)."""
        if self.source_ranges is None:
            return None
        return frozenset(n for n in self.source_ranges if n.version == version)


@dataclass(frozen=True, slots=True)
class ServiceRecord:
    """One selected Service as read from its object: `service`, or the `problem` that makes it
    unusable (exactly one of the two is set)."""

    ref: ObjectRef
    service: ParsedService | None
    problem: Problem | None = None


@dataclass(frozen=True, slots=True)
class SliceRecord:
    """One EndpointSlice as read from its object: the Service it belongs to (its
    kubernetes.io/service-name label), its ready addresses and the Problems found reading it
    (reported only while that Service is selected and usable, as `build_state` does). `nodes`
    pairs each ready address with the nodeName of an endpoint that has it (sorted): during a
    live migration one address is ready on two nodes."""

    ref: ObjectRef
    service: str
    ready: frozenset[IPAddress]
    problems: tuple[Problem, ...]
    nodes: tuple[tuple[IPAddress, str], ...] = ()


@dataclass(frozen=True, slots=True)
class ForeignRecord:
    """A Service that cozyebpf does not manage but that holds LoadBalancer IPs: a managed LB IP
    shared with it is warned about (another proxy, Cilium for one, programs that IP too)."""

    ref: ObjectRef
    lb_ips: tuple[IPAddress, ...]
    labelled: bool  # it has a service-proxy-name label (of another proxy)


#: Objects are keyed by (namespace, name).
Key = tuple[str, str]


def _q(value: object) -> str:
    """`value` quoted the way it would be written in YAML/JSON."""
    try:
        return json.dumps(value, ensure_ascii=False, default=repr)
    except (TypeError, ValueError):  # non-string keys, circular structures
        return repr(value)


def _describe(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({_q(value)})"
    if isinstance(value, int | float):
        return f"a number ({value})"
    if isinstance(value, str):
        return f"a string ({_q(value)})"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return f"a {type(value).__name__}"


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    """`value` as a mapping; a missing (null) field is an empty one."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _Invalid(f"{where} must be a mapping but is {_describe(value)}; fix the object")
    return value


def _list(value: object, where: str) -> list[Any] | tuple[Any, ...]:
    """`value` as a list; a missing (null) field is an empty one."""
    if value is None:
        return []
    if not isinstance(value, list | tuple):
        raise _Invalid(f"{where} must be a list but is {_describe(value)}; fix the object")
    return value


def _unusable_ipv6(ip: IPv6Address) -> str | None:
    """Why NAT cannot use `ip` as an LB or pod IP, or None."""
    if ip.scope_id is not None:
        return f"an IPv6 address with a zone index (%{ip.scope_id})"
    if ip.ipv4_mapped is not None:
        return f"an IPv4-mapped IPv6 address (::ffff:0:0/96, standing for {ip.ipv4_mapped})"
    if ip.is_unspecified:
        return "the unspecified IPv6 address"
    if ip.is_loopback:
        return "the IPv6 loopback address"
    if ip.is_multicast:
        return "an IPv6 multicast address"
    if ip.is_link_local:
        return "an IPv6 link-local address (fe80::/10)"
    return None


def _parse_ip(value: object, where: str, fix: str, version: int | None = None) -> IPAddress:
    """A unicast address NAT can use, IPv4 or IPv6 (normalised: `IPv6Address` accepts the
    compressed and the full forms, upper case too), or _Invalid (an error). `version` only
    names the expected family in the message about an address that does not parse; the caller
    checks the family of one that does."""
    if not isinstance(value, str):
        raise _Invalid(f"{where} must be a string but is {_describe(value)}; {fix}")
    ip: IPAddress
    try:
        if _CANONICAL_V4.fullmatch(value):  # the common case, without ipaddress's parser
            ip = IPv4Address(socket.inet_aton(value))
        else:
            ip = IPv4Address(value)
    except ValueError:
        try:
            ip = IPv6Address(value)
        except ValueError:
            why = ""
            if (
                version != 6
                and _DOTTED_QUAD.fullmatch(value)
                and any(len(o) > 1 and o.startswith("0") for o in value.split("."))
            ):
                why = " (leading zeros are ambiguous)"
            want = family_name(version) if version is not None else "IP"
            raise _Invalid(
                f"{where} {_q(value)} is not a valid {want} address{why}; {fix}"
            ) from None
    if isinstance(ip, IPv4Address):
        if ip.is_unspecified or ip.is_loopback or ip.is_multicast or ip == _BROADCAST:
            raise _Invalid(f"{where} {_q(value)} is not a unicast address NAT can use; {fix}")
        return ip
    unusable = _unusable_ipv6(ip)
    if unusable is not None:
        raise _Invalid(f"{where} {_q(value)} is {unusable}, which NAT cannot use; {fix}")
    return ip


def _parse_time(value: object) -> datetime | None:
    """An RFC 3339 timestamp (a string, or the datetime YAML makes of an unquoted one) as an
    aware datetime (UTC if it has no offset); None if it is not one."""
    if isinstance(value, datetime):
        t = value
    elif isinstance(value, str):
        try:
            t = datetime.fromisoformat(value)
        except ValueError:
            return None
    else:
        return None
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def _flag(ann: Mapping[str, Any], key: str, problems: list[Problem], ref: ObjectRef) -> bool:
    """cozy-proxy's rule: only the exact string "true" is true. Values other than "true" and
    "false" (such as "True", " true", "" or an unquoted YAML boolean) are warned about."""
    value = ann.get(key)
    if value is None or value == "false":
        return False
    if value == "true":
        return True
    problems.append(
        Problem(
            ref,
            f'annotation {key} is {_describe(value)}, which is not the string "true", so it '
            'counts as "false"; write "true" or "false" (quoted, lower case)',
        )
    )
    return False


def _ident(
    obj: Mapping[str, Any], kind: str, index: int
) -> tuple[ObjectRef, Mapping[str, Any]] | Problem:
    """The object's reference and metadata, or a Problem naming it as well as possible."""
    unnamed = f"#{index} (unnamed)"
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping):
        what = "is missing" if meta is None else f"must be a mapping but is {_describe(meta)}"
        return Problem(
            ObjectRef(kind, "", unnamed),
            f"metadata {what}; give the object a metadata.name",
            "error",
        )
    name = meta.get("name")
    ns = meta.get("namespace")
    if ns is None or ns == "":
        ns = "default"
    elif not isinstance(ns, str):
        return Problem(
            ObjectRef(kind, "", name if isinstance(name, str) and name else unnamed),
            f"metadata.namespace must be a string but is {_describe(ns)}; fix the object",
            "error",
        )
    if not isinstance(name, str) or not name:
        ref = ObjectRef(kind, ns, unnamed)
        if name is None or name == "":
            what = "is missing"
        else:
            what = f"must be a string but is {_describe(name)}"
        return Problem(ref, f"metadata.name {what}; give the object a name", "error")
    return ObjectRef(kind, ns, name), meta


def _read_service(ref: ObjectRef, obj: Mapping[str, Any], meta: Mapping[str, Any]) -> ParsedService:
    """A selected Service's fields; _Invalid if the object cannot be used at all. Problems with
    single LB IPs or ports are collected in `problems` and those entries skipped."""
    problems: list[Problem] = []
    ann = _mapping(meta.get("annotations"), "metadata.annotations")
    port_filter = not _flag(ann, ANN_WHOLE_IP, problems, ref)
    allow_icmp = _flag(ann, ANN_ALLOW_ICMP, problems, ref)

    created = None
    if meta.get("creationTimestamp") is not None:
        created = _parse_time(meta["creationTimestamp"])
        if created is None:
            problems.append(
                Problem(
                    ref,
                    f"metadata.creationTimestamp {_q(meta['creationTimestamp'])} is not an "
                    "RFC 3339 time, so the Service counts as the newest when LoadBalancer IPs "
                    "conflict; fix or remove it",
                )
            )

    spec = _mapping(obj.get("spec"), "spec")
    status = _mapping(obj.get("status"), "status")
    lb = _mapping(status.get("loadBalancer"), "status.loadBalancer")
    ingress = _list(lb.get("ingress"), "status.loadBalancer.ingress")
    lb_ips: list[IPAddress] = []
    for i, entry in enumerate(ingress):
        where = f"status.loadBalancer.ingress[{i}]"
        try:
            entry = _mapping(entry, where)
            if entry.get("ip") is None:
                if entry.get("hostname") is None:
                    raise _Invalid(f"{where} has neither ip nor hostname; fix the Service status")
                raise _Invalid(
                    f"{where} has hostname {_q(entry['hostname'])} but no ip, and only IP "
                    "addresses can be NATed; it is ignored",
                    "warning",
                )
            ip = _parse_ip(entry["ip"], f"{where}.ip", "fix the Service status")
        except _Invalid as e:
            problems.append(Problem(ref, e.message, e.severity))
            continue
        if ip not in lb_ips:
            lb_ips.append(ip)
    if not ingress:
        problems.append(
            Problem(
                ref,
                "has no LoadBalancer IP yet (status.loadBalancer.ingress is empty), so it is not "
                "programmed; it will be once a load balancer assigns one",
            )
        )

    ports: set[PortSpec] = set()
    if port_filter:
        for i, p in enumerate(_list(spec.get("ports"), "spec.ports")):
            where = f"spec.ports[{i}]"
            try:
                p = _mapping(p, where)
                proto = p.get("protocol")
                if proto is None:
                    proto = "TCP"
                if not isinstance(proto, str) or proto not in _PROTOS:
                    raise _Invalid(
                        f"{where}.protocol {_q(proto)} is not TCP, UDP or SCTP, so the port "
                        "filter does not allow it; fix the protocol"
                    )
                port = p.get("port")
                if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
                    raise _Invalid(
                        f"{where}.port {_q(port)} is not a port number from 1 to 65535, so the "
                        "port filter does not allow it; fix the port"
                    )
            except _Invalid as e:
                problems.append(Problem(ref, e.message, e.severity))
                continue
            ports.add(PortSpec(_PROTOS[proto], port))
    source_ranges = _source_ranges(spec, ann, problems, ref)
    return ParsedService(
        ref,
        created,
        port_filter,
        allow_icmp,
        tuple(lb_ips),
        tuple(sorted(ports)),
        tuple(problems),
        source_ranges,
    )


def _parse_cidr(value: object, where: str) -> IPNetwork:
    """A CIDR of either family (host bits allowed and cleared, as Kubernetes accepts them),
    or _Invalid (a warning: the other ranges still apply)."""
    fix = "it is ignored, the other ranges still apply; fix it"
    if not isinstance(value, str):
        raise _Invalid(f"{where} must be a string but is {_describe(value)}; {fix}", "warning")
    if "/" not in value:
        raise _Invalid(
            f"{where} {_q(value)} is not a CIDR (no prefix length, e.g. {value}/32); {fix}",
            "warning",
        )
    try:
        return ip_network(value.strip(), strict=False)
    except ValueError:
        raise _Invalid(f"{where} {_q(value)} is not a valid CIDR; {fix}", "warning") from None


def _source_ranges(
    spec: Mapping[str, Any], ann: Mapping[str, Any], problems: list[Problem], ref: ObjectRef
) -> tuple[IPNetwork, ...] | None:
    """The valid loadBalancerSourceRanges, from the spec field or else the annotation (as
    Kubernetes reads them); None when there are none (every source may connect). Invalid ones
    are reported and left out; a list in which none is valid lets no source in: never wider
    than asked."""
    field_value = spec.get("loadBalancerSourceRanges")
    items: list[tuple[str, object]] = []
    what = "spec.loadBalancerSourceRanges"
    if field_value not in (None, [], ()):
        if not isinstance(field_value, list | tuple):
            problems.append(
                Problem(
                    ref,
                    f"{what} must be a list but is {_describe(field_value)}, so no source may "
                    "connect; fix the field",
                    "error",
                )
            )
            return ()
        items = [(f"{what}[{i}]", v) for i, v in enumerate(field_value)]
        if ann.get(ANN_SOURCE_RANGES) is not None:
            problems.append(
                Problem(
                    ref,
                    f"annotation {ANN_SOURCE_RANGES} is ignored because {what} is set (the "
                    "field wins, as in Kubernetes); remove one of them",
                )
            )
    else:
        value = ann.get(ANN_SOURCE_RANGES)
        if value is None:
            return None
        what = f"annotation {ANN_SOURCE_RANGES}"
        if not isinstance(value, str):
            problems.append(
                Problem(
                    ref,
                    f"{what} must be a comma-separated string but is {_describe(value)}, so no "
                    "source may connect; fix the annotation",
                    "error",
                )
            )
            return ()
        parts = [p.strip() for p in value.split(",")]
        items = [(f"{what} item {n}", p) for n, p in enumerate(parts, start=1) if p]
        if not items:
            return None
    nets: set[IPNetwork] = set()
    for where, v in items:
        try:
            nets.add(_parse_cidr(v, where))
        except _Invalid as e:
            problems.append(Problem(ref, e.message, e.severity))
    if not nets:
        problems.append(
            Problem(
                ref,
                f"none of the {len(items)} source ranges in {what} is valid, so no source may "
                "connect (never wider than asked); fix them",
                "error",
            )
        )
    return tuple(sorted(nets, key=lambda n: (n.version, int(n.network_address), n.prefixlen)))


def _ready_addresses(
    ref: ObjectRef,
    obj: Mapping[str, Any],
    problems: list[Problem],
    nodes: set[tuple[IPAddress, str]] | None = None,
) -> set[IPAddress]:
    """The first address of each ready, non-terminating endpoint of an IPv4 or IPv6
    EndpointSlice; all of the slice's addressType (an address of the other family is an error
    and skipped). Each with the endpoint's nodeName (a string) goes to `nodes` as well."""
    address_type = obj.get("addressType")
    if address_type == "FQDN":
        problems.append(
            Problem(
                ref,
                "addressType FQDN is not supported (NAT needs a pod IP, not a name), so its "
                "endpoints are ignored; use an IPv4 or IPv6 EndpointSlice",
                "error",
            )
        )
        return set()
    if not isinstance(address_type, str) or address_type not in _ADDRESS_TYPES:
        problems.append(
            Problem(
                ref,
                f"addressType {_q(address_type)} is not IPv4, IPv6 or FQDN, so its endpoints "
                "are ignored; fix the EndpointSlice",
                "error",
            )
        )
        return set()
    version = _ADDRESS_TYPES[address_type]
    try:
        endpoints = _list(obj.get("endpoints"), "endpoints")
    except _Invalid as e:
        problems.append(Problem(ref, e.message, e.severity))
        return set()
    out: set[IPAddress] = set()
    for i, ep in enumerate(endpoints):
        where = f"endpoints[{i}]"
        try:
            ep = _mapping(ep, where)
            cond = _mapping(ep.get("conditions"), f"{where}.conditions")
            ready, terminating = cond.get("ready"), cond.get("terminating")
            for key, value in (("ready", ready), ("terminating", terminating)):
                if value is not None and not isinstance(value, bool):
                    raise _Invalid(
                        f"{where}.conditions.{key} must be true, false or absent but is "
                        f"{_describe(value)}, so the endpoint is ignored; fix the EndpointSlice"
                    )
            if ready is False or terminating is True:
                continue
            addresses = _list(ep.get("addresses"), f"{where}.addresses")
            if not addresses:
                raise _Invalid(f"{where}.addresses is empty; fix the EndpointSlice")
            fix = "fix the EndpointSlice"
            ip = _parse_ip(addresses[0], f"{where}.addresses[0]", fix, version)
            if ip.version != version:
                raise _Invalid(
                    f"{where}.addresses[0] {_q(addresses[0])} is an {family_name(ip.version)} "
                    f"address but the EndpointSlice's addressType is {address_type}, so the "
                    f"endpoint is ignored; {fix}"
                )
            out.add(ip)
            node = ep.get("nodeName")
            if nodes is not None and isinstance(node, str) and node:
                nodes.add((ip, node))
        except _Invalid as e:
            problems.append(Problem(ref, e.message, e.severity))
    return out


def _same(a: object, b: object) -> bool:
    """a == b, and False for structures too deep (or self-referencing, via YAML anchors)."""
    try:
        return a == b
    except RecursionError:
        return False


AgeKey = tuple[bool, datetime, str, str]


def _age(s: ParsedService) -> AgeKey:
    """Sort key, oldest first; Services without a (valid) timestamp count as the newest."""
    return (
        s.created is None,
        s.created or datetime.min.replace(tzinfo=UTC),
        s.ref.namespace,
        s.ref.name,
    )


# -- reading objects ----------------------------------------------------------------------


def _read_foreign(ref: ObjectRef, obj: Mapping[str, Any], labelled: bool) -> ForeignRecord | None:
    """The valid LB IPs of a Service that is not ours (nothing is reported about it)."""
    status = obj.get("status")
    lb = status.get("loadBalancer") if isinstance(status, Mapping) else None
    ingress = lb.get("ingress") if isinstance(lb, Mapping) else None
    if not isinstance(ingress, list | tuple):
        return None
    ips: list[IPAddress] = []
    for entry in ingress:
        if isinstance(entry, Mapping):
            try:
                ip = _parse_ip(entry.get("ip"), "", "")
            except _Invalid:
                continue
            if ip not in ips:
                ips.append(ip)
    return ForeignRecord(ref, tuple(ips), labelled) if ips else None


def read_object(
    obj: object, index: int, proxy_name: str = DEFAULT_PROXY_NAME
) -> ServiceRecord | SliceRecord | ForeignRecord | Problem | None:
    """One object of a source, read on its own: a ServiceRecord for a Service labelled for
    `proxy_name`, a ForeignRecord for another Service that holds LoadBalancer IPs, a
    SliceRecord for an EndpointSlice that names its Service, a Problem for an object that
    cannot even be named (`index`, from 1, names it by its position), None for everything else
    (other kinds, slices without a Service label). Pure and never raises on bad input."""
    if not isinstance(obj, Mapping):
        return Problem(
            ObjectRef("object", "", f"#{index}"),
            f"must be a Kubernetes object (a mapping) but is {_describe(obj)}; fix or remove it",
            "error",
        )
    kind, api_version = obj.get("kind"), obj.get("apiVersion")
    if kind == "Service" and api_version in (None, "v1"):
        ident = _ident(obj, "Service", index)
        if isinstance(ident, Problem):
            return ident
        ref, meta = ident
        try:
            labels = _mapping(meta.get("labels"), "metadata.labels")
            if labels.get(LABEL_PROXY_NAME) != proxy_name:
                return _read_foreign(ref, obj, LABEL_PROXY_NAME in labels)
            return ServiceRecord(ref, _read_service(ref, obj, meta))
        except _Invalid as e:
            return ServiceRecord(ref, None, Problem(ref, e.message, e.severity))
    if kind == "EndpointSlice" and api_version in (None, "discovery.k8s.io/v1"):
        ident = _ident(obj, "EndpointSlice", index)
        if isinstance(ident, Problem):
            return ident
        ref, meta = ident
        slice_labels = meta.get("labels")
        service = (
            slice_labels.get(LABEL_SERVICE_NAME) if isinstance(slice_labels, Mapping) else None
        )
        if not isinstance(service, str):
            return None
        problems: list[Problem] = []
        nodes: set[tuple[IPAddress, str]] = set()
        ready = _ready_addresses(ref, obj, problems, nodes)
        return SliceRecord(
            ref, service, frozenset(ready), tuple(problems), tuple(sorted(nodes, key=_node_key))
        )
    return None


def _node_key(pair: tuple[IPAddress, str]) -> tuple[int, IPAddress, str]:
    return (pair[0].version, pair[0], pair[1])


def duplicate_problem(ref: ObjectRef, copies: int) -> ServiceRecord:
    """The record of a Service defined several times with different contents."""
    return ServiceRecord(
        ref,
        None,
        Problem(
            ref,
            f"is defined {copies} times with different contents, so it is not programmed; "
            "keep one definition",
            "error",
        ),
    )


@dataclass
class ObjectSet:
    """Every object of a source, read: the model's input. Slices are kept per (namespace,
    name) as a tuple, since a manifest may define one twice."""

    services: dict[Key, ServiceRecord] = field(default_factory=dict)
    slices: dict[Key, tuple[SliceRecord, ...]] = field(default_factory=dict)
    foreign: dict[Key, ForeignRecord] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)  # objects that cannot be named


#: what read_object makes of one object
Read = ServiceRecord | SliceRecord | ForeignRecord | Problem | None


def gather(results: Iterable[Read]) -> tuple[ObjectSet, set[Key]]:
    """The records of a source's objects, in order, as an ObjectSet (a Service's first copy
    counts), and the keys of Services defined more than once (see read_objects)."""
    out = ObjectSet()
    copies: dict[Key, int] = {}
    for rec in results:
        if isinstance(rec, ServiceRecord):
            key = (rec.ref.namespace, rec.ref.name)
            copies[key] = copies.get(key, 0) + 1
            out.services.setdefault(key, rec)
        elif isinstance(rec, SliceRecord):
            key = (rec.ref.namespace, rec.ref.name)
            out.slices[key] = (*out.slices.get(key, ()), rec)
        elif isinstance(rec, ForeignRecord):
            out.foreign[(rec.ref.namespace, rec.ref.name)] = rec
        elif isinstance(rec, Problem):
            out.problems.append(rec)
    return out, {key for key, n in copies.items() if n > 1}


def read_objects(
    objects: Iterable[object],
    proxy_name: str = DEFAULT_PROXY_NAME,
    again: Callable[[], Iterable[object]] | None = None,
) -> ObjectSet:
    """Read every object (`read_object`), in one pass that keeps only records. A Service
    defined more than once counts only when every copy is the same object: when that happens
    the copies are compared in a second pass over `again()` (the same objects again; by default
    `objects` itself, which must then be a list or tuple)."""
    out, twice = gather(
        read_object(obj, index, proxy_name)
        for index, obj in enumerate(objects, start=1)
        if obj is not None
    )
    if not twice:
        return out
    if again is None:
        assert isinstance(objects, list | tuple), "pass `again` to read a stream"
        again = lambda: objects  # noqa: E731
    found: dict[Key, list[Mapping[str, Any]]] = {}
    for index, obj in enumerate(again(), start=1):
        if obj is None:
            continue
        rec = read_object(obj, index, proxy_name)
        if isinstance(rec, ServiceRecord) and (rec.ref.namespace, rec.ref.name) in twice:
            assert isinstance(obj, Mapping)
            found.setdefault((rec.ref.namespace, rec.ref.name), []).append(obj)
    for key, objs in found.items():
        if not all(_same(o, objs[0]) for o in objs[1:]):
            out.services[key] = duplicate_problem(out.services[key].ref, len(objs))
    return out


# -- the model ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Eval:
    """A Service with its EndpointSlices: the backend chosen per family and the Service's own
    problems (its record's, its slices', its endpoints'). Everything that does not depend on
    other Services."""

    ref: ObjectRef
    service: ParsedService | None  # None: unusable, `problems` says why
    chosen: tuple[tuple[int, IPAddress], ...]  # (family, pod IP)
    problems: tuple[Problem, ...]
    #: each chosen pod with the nodes its address is ready on (sorted; empty: none named)
    homes: tuple[tuple[IPAddress, tuple[str, ...]], ...] = ()

    def moving(self) -> frozenset[IPAddress]:
        """The chosen pods ready on more than one node: a live migration (KubeVirt's source
        and target virt-launcher pods, one address)."""
        return frozenset(pod for pod, nodes in self.homes if len(nodes) > 1)

    @property
    def age(self) -> AgeKey:
        assert self.service is not None
        return _age(self.service)

    def addresses(self) -> tuple[IPAddress, ...]:
        """The LB IPs it claims and the pods it chose: what links it to other Services."""
        if self.service is None:
            return ()
        return (*self.service.lb_ips, *(ip for _, ip in self.chosen))


def _evaluate(rec: ServiceRecord, slices: Iterable[SliceRecord]) -> _Eval:
    s = rec.service
    if s is None:
        assert rec.problem is not None
        return _Eval(rec.ref, None, (), (rec.problem,))
    problems = list(s.problems)
    ready: dict[int, set[IPAddress]] = {version: set() for version in FAMILIES}
    on: dict[IPAddress, set[str]] = {}
    for sl in slices:
        problems += sl.problems
        for ip in sl.ready:
            ready[ip.version].add(ip)
        for ip, node in sl.nodes:
            on.setdefault(ip, set()).add(node)
    chosen: list[tuple[int, IPAddress]] = []
    for version, addresses in ready.items():
        if not addresses:
            continue
        pod = min(addresses)
        chosen.append((version, pod))
        if len(addresses) > 1:
            problems.append(
                Problem(
                    s.ref,
                    f"has {len(addresses)} ready {family_name(version)} endpoints "
                    f"({', '.join(map(str, sorted(addresses)))}) but NAT needs exactly one "
                    f"pod, so the lowest, {pod}, is used; scale the backend to one pod",
                )
            )
    if not chosen:
        problems.append(
            Problem(
                s.ref,
                f"has no ready endpoint (no EndpointSlice labelled "
                f"{LABEL_SERVICE_NAME}={s.ref.name} lists a ready address), so it is not "
                "programmed; check that its pod is running and ready",
            )
        )
    homes = tuple((pod, tuple(sorted(on[pod]))) for _, pod in chosen if pod in on)
    return _Eval(rec.ref, s, tuple(chosen), tuple(problems), homes)


@dataclass(frozen=True, slots=True)
class _Output:
    """What one Service contributes to the desired state, and everything said about it.
    Tuples, not dicts and sets: the incremental model keeps one per Service."""

    services: tuple[tuple[IPAddress, ServiceEntry], ...] = ()
    pods: tuple[tuple[IPAddress, PodEntry], ...] = ()
    allowed: tuple[AllowedPort, ...] = ()
    problems: tuple[Problem, ...] = ()
    view: ServiceView | None = None
    #: for each pod its LB IPs reach: the sources it lets in (None: every source)
    ranges: tuple[tuple[IPAddress, Ranges | None], ...] = ()


def _state_of(outputs: Iterable[_Output]) -> MapState:
    """The desired state the outputs make together. A pod's source ranges are the union of
    its Services' (a pod behind a Service without ranges accepts every source, as its allowed
    ports are the union of its Services')."""
    st = MapState()
    contrib: dict[IPAddress, list[Ranges | None]] = {}
    for o in outputs:
        st.services.update(o.services)
        st.pods.update(o.pods)
        st.allowed.update(o.allowed)
        for pod, r in o.ranges:
            contrib.setdefault(pod, []).append(r)
    st.ranges = {
        pod: frozenset().union(*rs)  # type: ignore[arg-type]
        for pod, rs in contrib.items()
        if None not in rs
    }
    return st


def _shared_problem(ref: ObjectRef, lb: IPAddress, other: ForeignRecord) -> Problem:
    if other.labelled:
        who = f"which another proxy ({LABEL_PROXY_NAME} is not ours) programs"
    else:
        who = (
            f"which has no {LABEL_PROXY_NAME} label, so the cluster's own Service proxy "
            "programs it (Cilium adds a wildcard entry for the IP that drops ports that Service "
            "does not list)"
        )
    return Problem(
        ref,
        f"LoadBalancer IP {lb} is also the LoadBalancer IP of {other.ref}, {who}; traffic to "
        "the IP may not reach this Service's pod: give each Service its own LoadBalancer IP",
    )


NO_FOREIGN: Mapping[IPAddress, Iterable[ForeignRecord]] = {}


def _compose(
    evals: Iterable[_Eval],
    foreign: Mapping[IPAddress, Iterable[ForeignRecord]] = NO_FOREIGN,
    held: Iterable[IPAddress] = (),
) -> dict[ObjectRef, _Output]:
    """The cross-Service rules over `evals`, which must hold every Service that shares an LB
    IP or a pod with one of them: the older Service keeps a contested LB IP, the oldest
    Service of a pod owns its egress, the allowed ports of a pod are the union of its
    port-filter Services'. A pod that is moving, or in `held` (moved a moment ago), is
    marked learning. One output per Service."""
    held = frozenset(held)
    out: dict[ObjectRef, _Output] = {}
    valid: list[_Eval] = []
    for e in evals:
        if e.service is None:
            out[e.ref] = _Output(problems=e.problems)
        else:
            valid.append(e)
    lb_owner: dict[IPAddress, ObjectRef] = {}
    pod_owner: dict[IPAddress, tuple[ObjectRef, IPAddress]] = {}  # -> (owner, its egress LB)
    for e in sorted(valid, key=lambda e: e.age):
        s = e.service
        assert s is not None
        problems = list(e.problems)
        services: list[tuple[IPAddress, ServiceEntry]] = []
        pods: list[tuple[IPAddress, PodEntry]] = []
        allowed: set[AllowedPort] = set()
        ranges: list[tuple[IPAddress, Ranges | None]] = []
        kept: list[IPAddress] = []
        for lb in s.lb_ips:
            for other in sorted(foreign.get(lb, ()), key=lambda f: f.ref):
                problems.append(_shared_problem(s.ref, lb, other))
            if lb in lb_owner:
                problems.append(
                    Problem(
                        s.ref,
                        f"LoadBalancer IP {lb} is also claimed by the older {lb_owner[lb]}, "
                        "which keeps it; give each Service its own LoadBalancer IP",
                    )
                )
            else:
                lb_owner[lb] = s.ref
                kept.append(lb)
        chosen = dict(e.chosen)
        pod_ips = tuple(chosen[v] for v in FAMILIES if v in chosen)
        migrating = e.moving() | (held & set(pod_ips))
        name = f"{s.ref.namespace}/{s.ref.name}"  # whose counters its entries feed
        view = ServiceView(
            s.ref,
            tuple(kept),
            pod_ips,
            s.port_filter,
            s.allow_icmp,
            s.ports,
            s.source_ranges,
            tuple(p for p in pod_ips if p in migrating),
        )
        for version in FAMILIES:
            lbs = [lb for lb in kept if lb.version == version]
            if not lbs:
                continue
            fam = family_name(version)
            backend = chosen.get(version)
            if backend is None:
                # no ready endpoint at all is reported once above; here only a missing family
                if chosen:
                    problems += [
                        Problem(
                            s.ref,
                            f"LB IP {lb} is {fam} but the Service has no ready {fam} endpoint; "
                            "it is not programmed (an LB IP is only translated to a pod IP of "
                            f"its own family); check that the pod has an {fam} address and is "
                            f"ready, or remove the {fam} LB IP",
                        )
                        for lb in lbs
                    ]
                continue
            learning = backend in migrating
            entry = ServiceEntry(backend, s.port_filter, s.allow_icmp, name, learning)
            services += [(lb, entry) for lb in lbs]
            ranges.append((backend, s.ranges_of(version)))
            if backend in pod_owner:
                owner, egress = pod_owner[backend]
                problems.append(
                    Problem(
                        s.ref,
                        f"its pod {backend} is also behind the older {owner}, so the "
                        f"pod's own connections leave from {egress}, not from "
                        "this Service's IP; give each Service its own pod",
                    )
                )
            else:
                pod_owner[backend] = (s.ref, lbs[0])
                pod = PodEntry(lbs[0], s.port_filter, s.allow_icmp, name, learning)
                pods.append((backend, pod))
            if s.port_filter:
                allowed |= {AllowedPort(backend, p.proto, p.port) for p in s.ports}
        out[e.ref] = _Output(
            tuple(services), tuple(pods), tuple(allowed), tuple(problems), view, tuple(ranges)
        )
    return out


def _admit(
    outputs: Iterable[_Output], capacity: Capacity
) -> tuple[MapState, dict[ObjectRef, Problem]]:
    """Over capacity: the outputs in the order given (oldest Service first) are programmed
    while all their entries fit; each Service that does not fit is left out whole and gets a
    Problem naming the full map. (A pod's source ranges are counted as its Services add them:
    an upper bound of what the union holds.)"""
    counts: dict[tuple[str, int], int] = {}
    left_out: dict[ObjectRef, Problem] = {}
    admitted: list[_Output] = []
    services: set[IPAddress] = set()
    pods: set[IPAddress] = set()
    allowed: set[AllowedPort] = set()
    ranges: dict[IPAddress, set[IPNetwork]] = {}
    for o in outputs:
        if o.view is None:
            continue
        new: dict[tuple[str, int], int] = {}
        for kind, keys in (
            ("services", [k for k, _ in o.services if k not in services]),
            ("pods", [k for k, _ in o.pods if k not in pods]),
            ("allowed", [a.pod_ip for a in o.allowed if a not in allowed]),
            (
                "ranges",
                [
                    pod
                    for pod, r in o.ranges
                    for net in (r or ())
                    if net not in ranges.get(pod, set())
                ],
            ),
        ):
            for ip in keys:
                new[(kind, ip.version)] = new.get((kind, ip.version), 0) + 1
        after = {k: counts.get(k, 0) + new.get(k, 0) for k in counts.keys() | new.keys()}
        limit = capacity.full(after)
        if limit is not None:
            ref = o.view.ref
            left_out[ref] = Problem(
                ref,
                f"is not programmed: map {limit.map} is full ({limit.size} entries) and older "
                f"Services come first; {capacity.hint}",
                "error",
            )
            continue
        counts = after
        admitted.append(o)
        services.update(k for k, _ in o.services)
        pods.update(k for k, _ in o.pods)
        allowed.update(o.allowed)
        for pod, r in o.ranges:
            ranges.setdefault(pod, set()).update(r or ())
    return _state_of(admitted), left_out


def _age_order(outputs: Mapping[ObjectRef, _Output], evals: Mapping[Key, _Eval]) -> list[_Output]:
    ordered = sorted(
        (e for e in evals.values() if e.service is not None and e.ref in outputs),
        key=lambda e: e.age,
    )
    return [outputs[e.ref] for e in ordered]


def foreign_by_ip(records: Iterable[ForeignRecord]) -> dict[IPAddress, list[ForeignRecord]]:
    out: dict[IPAddress, list[ForeignRecord]] = {}
    for r in records:
        for ip in r.lb_ips:
            out.setdefault(ip, []).append(r)
    return out


def slices_by_service(
    slices: Mapping[Key, tuple[SliceRecord, ...]],
) -> dict[Key, list[SliceRecord]]:
    """The slices grouped by the Service they name, (namespace, service name)."""
    out: dict[Key, list[SliceRecord]] = {}
    for recs in slices.values():
        for r in recs:
            out.setdefault((r.ref.namespace, r.service), []).append(r)
    return out


def compose(
    objects: ObjectSet, capacity: Capacity | None = None, held: Iterable[IPAddress] = ()
) -> ModelResult:
    """The desired state of an ObjectSet, every selected Service's view and every Problem;
    the pods in `held` moved a moment ago (IncrementalModel.held) and are still learning."""
    by_service = slices_by_service(objects.slices)
    evals = {key: _evaluate(rec, by_service.get(key, ())) for key, rec in objects.services.items()}
    outputs = _compose(evals.values(), foreign_by_ip(objects.foreign.values()), held)
    problems = list(objects.problems)
    state = _state_of(outputs.values())
    for o in outputs.values():
        problems += o.problems
    if capacity is not None and capacity.full(state.counts()) is not None:
        state, left_out = _admit(_age_order(outputs, evals), capacity)
        problems += left_out.values()
    views = sorted((o.view for o in outputs.values() if o.view is not None), key=lambda v: v.ref)
    return ModelResult(state, views, sorted(set(problems)))


def build_state(
    objects: Iterable[Mapping[str, Any]],
    proxy_name: str = DEFAULT_PROXY_NAME,
    capacity: Capacity | None = None,
    held: Iterable[IPAddress] = (),
) -> ModelResult:
    """The desired MapState for the Services labelled for `proxy_name`, with a view of each and
    every Problem found. Never raises on bad input; the result does not depend on input order.
    The reference for `IncrementalModel`, which must always give the same result (given its
    `held` pods: the one thing it knows that the objects do not say, when a pod moved)."""
    return compose(read_objects(objects, proxy_name), capacity, held)


# -- the incremental model ----------------------------------------------------------------


@dataclass
class Delta:
    """What one `IncrementalModel.flush()` changed: `diff` turns the desired state before into
    the desired state after; `new_services`/`new_pods` count the keys of `diff.services_set`/
    `diff.pods_set` that did not exist before (for the summary line); the Problems that
    appeared and went away; how many Services were recomputed."""

    diff: MapDiff = field(default_factory=MapDiff)
    new_services: int = 0
    new_pods: int = 0
    problems_added: list[Problem] = field(default_factory=list)
    problems_removed: list[Problem] = field(default_factory=list)
    recomputed: int = 0

    def empty(self) -> bool:
        return self.diff.empty() and not self.problems_added and not self.problems_removed


def _tuple_add(index: dict[Any, tuple[Key, ...]], at: Any, key: Key) -> None:
    keys = index.get(at, ())
    if key not in keys:
        index[at] = (*keys, key)


def _tuple_discard(index: dict[Any, tuple[Key, ...]], at: Any, key: Key) -> None:
    keys = tuple(k for k in index.get(at, ()) if k != key)
    if keys:
        index[at] = keys
    else:
        index.pop(at, None)


def _key(ref: ObjectRef) -> Key:
    return (ref.namespace, ref.name)


class IncrementalModel:
    """The model kept up to date change by change, with the result of `build_state` on the same
    objects at every `flush()` (tests/test_incremental.py checks that after every step of random
    histories).

    Changes are recorded with `set_service`/`set_slices`/`set_problems` (or `replace` with a
    whole ObjectSet) and take effect at `flush()`, which re-evaluates only the Services whose
    record or slices changed, plus every Service that shares an LB IP or a pod with them,
    directly or through others (the older-wins rules connect exactly those), and returns the
    difference as a MapDiff. Work per change is proportional to what it touches, not to the
    cluster. Over capacity, the programmed state is chosen again over all Services (oldest
    first): a slow path that only runs while the maps cannot hold everything.

    Live migration: a chosen pod whose nodes change (one address ready on another node, or on
    more than one) is held learning for `hold` seconds of `clock` after the change, on top of
    the time it is ready on two nodes: its flows were recorded on the node it left, and its
    answers record them here (docs/design.md, "Live migration")."""

    def __init__(
        self,
        proxy_name: str = DEFAULT_PROXY_NAME,
        capacity: Capacity | None = None,
        clock: Callable[[], float] = time.monotonic,
        hold: float = MIGRATION_HOLD,
    ) -> None:
        self.proxy_name = proxy_name
        self.capacity = capacity
        self.clock = clock
        self.hold = hold
        self._held: dict[IPAddress, float] = {}  # pod -> until when it stays learning
        self.services: dict[Key, ServiceRecord] = {}
        self.slices: dict[Key, tuple[SliceRecord, ...]] = {}
        self._slices_of: dict[Key, tuple[Key, ...]] = {}  # Service -> slices that name it
        self.foreign: dict[Key, ForeignRecord] = {}
        self._foreign_by_ip: dict[IPAddress, set[ForeignRecord]] = {}
        self._foreign_dirty: set[IPAddress] = set()
        self._unkeyed: list[Problem] = []
        self._evals: dict[Key, _Eval] = {}
        # LB IP or chosen pod -> the Services that claim it (tuples: mostly one, and small)
        self._claims: dict[IPAddress, tuple[Key, ...]] = {}
        self._outputs: dict[Key, _Output] = {}
        self._full = MapState()  # every Service's entries
        self._counts: dict[tuple[str, int], int] = {}  # of _full, per kind and family
        self.state = self._full  # the desired state: _full, or what fits when over capacity
        self._left_out: dict[ObjectRef, Problem] = {}
        self._problems: dict[Problem, int] = {}
        self._dirty: set[Key] = set()
        self._added: set[Problem] = set()
        self._removed: set[Problem] = set()

    # -- recording changes ---------------------------------------------------------------

    def set_service(self, key: Key, rec: ServiceRecord | None) -> bool:
        """Record the Service `key` (None: gone); False when nothing changed."""
        if self.services.get(key) == rec:
            return False
        if rec is None:
            del self.services[key]
        else:
            self.services[key] = rec
        self._dirty.add(key)
        return True

    def set_slices(self, key: Key, recs: tuple[SliceRecord, ...] | None) -> bool:
        """Record the EndpointSlice `key` (usually one record; None or () : gone); False when
        nothing changed."""
        old = self.slices.get(key, ())
        new = recs or ()
        if old == new:
            return False
        for r in old:
            service = (r.ref.namespace, r.service)
            _tuple_discard(self._slices_of, service, key)
            self._dirty.add(service)
        for r in new:
            service = (r.ref.namespace, r.service)
            _tuple_add(self._slices_of, service, key)
            self._dirty.add(service)
        if new:
            self.slices[key] = new
        else:
            del self.slices[key]
        return True

    def set_foreign(self, key: Key, rec: ForeignRecord | None) -> bool:
        """Record the LB IPs of a Service that is not ours (None: gone, or none)."""
        old = self.foreign.get(key)
        if old == rec:
            return False
        if old is not None:
            for ip in old.lb_ips:
                recs = self._foreign_by_ip[ip]
                recs.discard(old)
                if not recs:
                    del self._foreign_by_ip[ip]
            self._foreign_dirty.update(old.lb_ips)
            del self.foreign[key]
        if rec is not None:
            self.foreign[key] = rec
            for ip in rec.lb_ips:
                self._foreign_by_ip.setdefault(ip, set()).add(rec)
            self._foreign_dirty.update(rec.lb_ips)
        return True

    def set_problems(self, problems: Iterable[Problem]) -> None:
        """The Problems about objects without a usable name (a manifest's garbage)."""
        new = list(problems)
        if new == self._unkeyed:
            return
        self._count(self._unkeyed, -1)
        self._count(new, +1)
        self._unkeyed = new

    def replace(self, objects: ObjectSet) -> None:
        """Make the recorded objects exactly `objects` (a source's whole content); only what
        differs is marked changed."""
        for key in self.services.keys() - objects.services.keys():
            self.set_service(key, None)
        for key, rec in objects.services.items():
            self.set_service(key, rec)
        for key in self.slices.keys() - objects.slices.keys():
            self.set_slices(key, None)
        for key, recs in objects.slices.items():
            self.set_slices(key, recs)
        for key in self.foreign.keys() - objects.foreign.keys():
            self.set_foreign(key, None)
        for key, frec in objects.foreign.items():
            self.set_foreign(key, frec)
        self.set_problems(objects.problems)

    @property
    def pending(self) -> bool:
        """Whether a flush() has something to do (a held pod's time may be up)."""
        if self._dirty or self._foreign_dirty or self._added or self._removed:
            return True
        deadline = self.next_deadline()
        return deadline is not None and deadline <= self.clock()

    @property
    def held(self) -> frozenset[IPAddress]:
        """The pods learning: on two nodes, or moved less than `hold` ago (build_state's
        `held`)."""
        return frozenset(self._held)

    def next_deadline(self) -> float | None:
        """When (on `clock`) the first held pod stops learning; None: none is held."""
        return min(self._held.values(), default=None)

    # -- computing -----------------------------------------------------------------------

    def _count(self, problems: Iterable[Problem], step: int) -> None:
        for p in problems:
            n = self._problems.get(p, 0) + step
            if n > 0:
                self._problems[p] = n
            else:
                self._problems.pop(p, None)
            if step > 0 and n == 1:
                if p in self._removed:
                    self._removed.discard(p)
                else:
                    self._added.add(p)
            elif step < 0 and n == 0:
                if p in self._added:
                    self._added.discard(p)
                else:
                    self._removed.add(p)

    def _slice_records(self, key: Key) -> list[SliceRecord]:
        out = [
            r
            for sk in self._slices_of.get(key, ())
            for r in self.slices[sk]
            if (r.ref.namespace, r.service) == key
        ]
        out.sort(key=lambda r: r.ref)
        return out

    def _reevaluate(self, dirty: Iterable[Key]) -> tuple[set[Key], set[IPAddress]]:
        """New evaluations of `dirty`: the Services whose evaluation changed, and the
        addresses they claimed before or claim now."""
        changed: set[Key] = set()
        addresses: set[IPAddress] = set()
        for key in dirty:
            rec = self.services.get(key)
            new = _evaluate(rec, self._slice_records(key)) if rec is not None else None
            old = self._evals.get(key)
            if new == old:
                continue
            if new is not None and (old is None or old.homes != new.homes):
                self._moved(old, new)
            if old is not None:
                for ip in old.addresses():
                    addresses.add(ip)
                    _tuple_discard(self._claims, ip, key)
                del self._evals[key]
            changed.add(key)
            if new is not None:
                self._evals[key] = new
                for ip in new.addresses():
                    addresses.add(ip)
                    _tuple_add(self._claims, ip, key)
        return changed, addresses

    def _moved(self, old: _Eval | None, new: _Eval) -> None:
        """Hold learning each chosen pod that is ready on two nodes, or whose nodes changed
        from some to others."""
        before = dict(old.homes) if old is not None else {}
        for pod, nodes in new.homes:
            if len(nodes) > 1 or before.get(pod, nodes) != nodes:
                self._held[pod] = self.clock() + self.hold

    def _moving(self, pod: IPAddress) -> bool:
        return any(pod in self._evals[k].moving() for k in self._claims.get(pod, ()))

    def _expire(self) -> set[IPAddress]:
        """Release the held pods whose time is up (one still on two nodes is held on); those
        released."""
        now = self.clock()
        done = set()
        for pod in [pod for pod, until in self._held.items() if until <= now]:
            if self._moving(pod):
                self._held[pod] = now + self.hold
            else:
                del self._held[pod]
                done.add(pod)
        return done

    def _component(self, seeds: set[Key], addresses: set[IPAddress]) -> set[Key]:
        """`seeds` and every Service linked to them through shared addresses, transitively."""
        comp = set(seeds)
        if comp >= self._evals.keys():
            return comp  # everything (a first read): nothing to look for
        frontier = list(addresses)
        for key in seeds:
            if key in self._evals:
                frontier.extend(self._evals[key].addresses())
        seen: set[IPAddress] = set()
        while frontier:
            ip = frontier.pop()
            if ip in seen:
                continue
            seen.add(ip)
            for key in self._claims.get(ip, ()):
                if key not in comp:
                    comp.add(key)
                    frontier.extend(self._evals[key].addresses())
        return comp

    def _update_counts(self, st: MapState, step: int) -> None:
        c = self._counts
        for k, n in st.counts().items():
            c[k] = c.get(k, 0) + step * n

    def flush(self) -> Delta:
        """Apply the recorded changes; the difference in the desired state and Problems."""
        dirty, self._dirty = self._dirty, set()
        changed, addresses = self._reevaluate(dirty)
        # a foreign LB IP appeared or went: the Services that claim it are warned anew; a
        # held pod's time is up: its Services stop learning
        foreign, self._foreign_dirty = self._foreign_dirty, set()
        foreign |= self._expire()
        for ip in foreign:
            changed.update(self._claims.get(ip, ()))
        addresses |= foreign
        comp = self._component(changed, addresses)
        old_outputs = [self._outputs.pop(k) for k in comp if k in self._outputs]
        new_by_ref = _compose(
            (self._evals[k] for k in comp if k in self._evals), self._foreign_by_ip, self._held
        )
        for ref, o in new_by_ref.items():
            self._outputs[_key(ref)] = o
        for o in old_outputs:
            self._count(o.problems, -1)
        for o in new_by_ref.values():
            self._count(o.problems, +1)
        old, new = _state_of(old_outputs), _state_of(new_by_ref.values())
        d = diff(old, new)
        # the same change on the whole unconstrained state, in place
        self._update_counts(old, -1)
        self._update_counts(new, +1)
        full = self._full
        full.apply(d)

        before = self.state
        over = self.capacity is not None and self.capacity.full(self._counts) is not None
        if over and before is full:
            # the maps held the whole state until this change, which `full` now holds too:
            # what they hold is `full` without it
            before = full.copy()
            before.undo(d, old)
        if over or before is not full:
            d, old = self._constrain(over, before), before
        out = Delta(
            d,
            new_services=sum(1 for k in d.services_set if k not in old.services),
            new_pods=sum(1 for k in d.pods_set if k not in old.pods),
            problems_added=sorted(self._added),
            problems_removed=sorted(self._removed),
            recomputed=len(comp),
        )
        self._added, self._removed = set(), set()
        return out

    def _constrain(self, over: bool, before: MapState) -> MapDiff:
        """Choose what is programmed again over all Services (the capacity slow path); the
        difference to what was programmed (`before`)."""
        self._count(self._left_out.values(), -1)
        if over:
            assert self.capacity is not None
            outputs = {o.view.ref: o for o in self._outputs.values() if o.view is not None}
            self.state, self._left_out = _admit(_age_order(outputs, self._evals), self.capacity)
        else:
            self.state, self._left_out = self._full, {}
        self._count(self._left_out.values(), +1)
        return diff(before, self.state)

    # -- reading -------------------------------------------------------------------------

    def problems(self) -> list[Problem]:
        """Every current Problem, sorted."""
        return sorted(self._problems)

    def views(self) -> list[ServiceView]:
        """Every selected Service as understood, sorted by namespace/name."""
        return sorted(
            (o.view for o in self._outputs.values() if o.view is not None), key=lambda v: v.ref
        )

    def result(self) -> ModelResult:
        """The whole result, as `build_state` gives it (for tests and tools)."""
        return ModelResult(self.state.copy(), self.views(), self.problems())
