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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from ipaddress import IPv4Address, IPv6Address
from typing import Any, Literal, NamedTuple

from cozyebpf.state import (
    FAMILIES,
    AllowedPort,
    IPAddress,
    MapState,
    PodEntry,
    Proto,
    ServiceEntry,
    family_name,
)

LABEL_PROXY_NAME = "service.kubernetes.io/service-proxy-name"
DEFAULT_PROXY_NAME = "cozy-proxy"
ANN_WHOLE_IP = "networking.cozystack.io/wholeIP"
ANN_ALLOW_ICMP = "networking.cozystack.io/allowICMP"
#: The label that ties an EndpointSlice to its Service.
LABEL_SERVICE_NAME = "kubernetes.io/service-name"

Severity = Literal["warning", "error"]

_PROTOS = {"TCP": Proto.TCP, "UDP": Proto.UDP, "SCTP": Proto.SCTP}
_DOTTED_QUAD = re.compile(r"\d+\.\d+\.\d+\.\d+")
_BROADCAST = IPv4Address("255.255.255.255")
#: EndpointSlice addressType -> address family
_ADDRESS_TYPES = {"IPv4": 4, "IPv6": 6}


@dataclass(frozen=True, order=True)
class ObjectRef:
    """Names a Kubernetes object (or, for garbage, its position in the input) in messages."""

    kind: str
    namespace: str
    name: str

    def __str__(self) -> str:
        if not self.namespace:
            return f"{self.kind} {self.name}"
        return f"{self.kind} {self.namespace}/{self.name}"


@dataclass(frozen=True, order=True)
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


@dataclass(frozen=True)
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


@dataclass
class _Service:
    """A selected Service whose fields could be read."""

    ref: ObjectRef
    created: datetime | None
    port_filter: bool
    allow_icmp: bool
    lb_ips: list[IPAddress]
    ports: tuple[PortSpec, ...]
    problems: list[Problem]


@dataclass
class _Slice:
    ref: ObjectRef
    obj: Mapping[str, Any]


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


def _read_service(ref: ObjectRef, obj: Mapping[str, Any], meta: Mapping[str, Any]) -> _Service:
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
    return _Service(ref, created, port_filter, allow_icmp, lb_ips, tuple(sorted(ports)), problems)


def _ready_addresses(sl: _Slice, problems: list[Problem]) -> set[IPAddress]:
    """The first address of each ready, non-terminating endpoint of an IPv4 or IPv6
    EndpointSlice; all of the slice's addressType (an address of the other family is an error
    and skipped)."""
    obj = sl.obj
    address_type = obj.get("addressType")
    if address_type == "FQDN":
        problems.append(
            Problem(
                sl.ref,
                "addressType FQDN is not supported (NAT needs a pod IP, not a name), so its "
                "endpoints are ignored; use an IPv4 or IPv6 EndpointSlice",
                "error",
            )
        )
        return set()
    if not isinstance(address_type, str) or address_type not in _ADDRESS_TYPES:
        problems.append(
            Problem(
                sl.ref,
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
        problems.append(Problem(sl.ref, e.message, e.severity))
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
        except _Invalid as e:
            problems.append(Problem(sl.ref, e.message, e.severity))
    return out


def _same(a: object, b: object) -> bool:
    """a == b, and False for structures too deep (or self-referencing, via YAML anchors)."""
    try:
        return a == b
    except RecursionError:
        return False


def _age(s: _Service) -> tuple[bool, datetime, str, str]:
    """Sort key, oldest first; Services without a (valid) timestamp count as the newest."""
    return (
        s.created is None,
        s.created or datetime.min.replace(tzinfo=UTC),
        s.ref.namespace,
        s.ref.name,
    )


def build_state(
    objects: Iterable[Mapping[str, Any]], proxy_name: str = DEFAULT_PROXY_NAME
) -> ModelResult:
    """The desired MapState for the Services labelled for `proxy_name`, with a view of each and
    every Problem found. Never raises on bad input; the result does not depend on input order.
    """
    problems: list[Problem] = []
    found: dict[tuple[str, str], list[tuple[Mapping[str, Any], _Service | Problem]]] = {}
    slices: dict[tuple[str, str], list[_Slice]] = {}

    for index, obj in enumerate(objects, start=1):
        if obj is None:
            continue
        if not isinstance(obj, Mapping):
            problems.append(
                Problem(
                    ObjectRef("object", "", f"#{index}"),
                    f"must be a Kubernetes object (a mapping) but is {_describe(obj)}; "
                    "fix or remove it",
                    "error",
                )
            )
            continue
        kind, api_version = obj.get("kind"), obj.get("apiVersion")
        if kind == "Service" and api_version in (None, "v1"):
            ident = _ident(obj, "Service", index)
            if isinstance(ident, Problem):
                problems.append(ident)
                continue
            ref, meta = ident
            try:
                labels = _mapping(meta.get("labels"), "metadata.labels")
                if labels.get(LABEL_PROXY_NAME) != proxy_name:
                    continue
                parsed: _Service | Problem = _read_service(ref, obj, meta)
            except _Invalid as e:
                parsed = Problem(ref, e.message, e.severity)
            found.setdefault((ref.namespace, ref.name), []).append((obj, parsed))
        elif kind == "EndpointSlice" and api_version in (None, "discovery.k8s.io/v1"):
            ident = _ident(obj, "EndpointSlice", index)
            if isinstance(ident, Problem):
                problems.append(ident)
                continue
            ref, meta = ident
            slice_labels = meta.get("labels")
            service = (
                slice_labels.get(LABEL_SERVICE_NAME) if isinstance(slice_labels, Mapping) else None
            )
            if isinstance(service, str):
                slices.setdefault((ref.namespace, service), []).append(_Slice(ref, obj))

    services: list[_Service] = []
    for (ns, name), copies in found.items():
        if not all(_same(o, copies[0][0]) for o, _ in copies[1:]):
            problems.append(
                Problem(
                    ObjectRef("Service", ns, name),
                    f"is defined {len(copies)} times with different contents, so it is not "
                    "programmed; keep one definition",
                    "error",
                )
            )
            continue
        parsed = copies[0][1]
        if isinstance(parsed, Problem):
            problems.append(parsed)
        else:
            services.append(parsed)
            problems += parsed.problems

    pods: dict[ObjectRef, dict[int, IPAddress]] = {}
    for s in services:
        ready: dict[int, set[IPAddress]] = {version: set() for version in FAMILIES}
        for sl in slices.get((s.ref.namespace, s.ref.name), []):
            for ip in _ready_addresses(sl, problems):
                ready[ip.version].add(ip)
        chosen: dict[int, IPAddress] = {}
        for version, addresses in ready.items():
            if not addresses:
                continue
            pod = chosen[version] = min(addresses)
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
        pods[s.ref] = chosen

    state = MapState()
    lb_owner: dict[IPAddress, ObjectRef] = {}
    pod_owner: dict[IPAddress, ObjectRef] = {}
    views: list[ServiceView] = []
    for s in sorted(services, key=_age):
        kept: list[IPAddress] = []
        for lb in s.lb_ips:
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
        chosen = pods[s.ref]
        views.append(
            ServiceView(
                s.ref,
                tuple(kept),
                tuple(chosen[v] for v in FAMILIES if v in chosen),
                s.port_filter,
                s.allow_icmp,
                s.ports,
            )
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
            for lb in lbs:
                state.services[lb] = ServiceEntry(backend, s.port_filter, s.allow_icmp)
            if backend in pod_owner:
                problems.append(
                    Problem(
                        s.ref,
                        f"its pod {backend} is also behind the older {pod_owner[backend]}, so the "
                        f"pod's own connections leave from {state.pods[backend].lb_ip}, not from "
                        "this Service's IP; give each Service its own pod",
                    )
                )
            else:
                pod_owner[backend] = s.ref
                state.pods[backend] = PodEntry(lbs[0], s.port_filter, s.allow_icmp)
            if s.port_filter:
                state.allowed |= {AllowedPort(backend, p.proto, p.port) for p in s.ports}

    views.sort(key=lambda v: v.ref)
    return ModelResult(state, views, sorted(set(problems)))
