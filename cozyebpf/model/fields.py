"""The readers of an object's fields (`read.py` calls them): an IP, a time, an annotation's
flag, the LB IPs, the ports, the source ranges, a slice's family and its ready addresses, with
a Problem for each bad field. Pure and never raises on bad input."""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from ipaddress import IPv4Address, IPv6Address, ip_network
from sys import intern
from typing import Any

from cozyebpf.model.limits import read_limits
from cozyebpf.model.records import (
    _ADDRESS_TYPES,
    _BROADCAST,
    _CANONICAL_V4,
    _DOTTED_QUAD,
    _PROTOS,
    ANN_ALLOW_ICMP,
    ANN_SOURCE_RANGES,
    ANN_WHOLE_IP,
    LABEL_MANAGED_BY,
    SLICE_CONTROLLER,
    TRUST_SETTING,
    ObjectRef,
    ParsedService,
    PortSpec,
    Problem,
    _Invalid,
)
from cozyebpf.state import IPAddress, IPNetwork, family_name


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
    # interned: a namespace's name is in every object of it, a Service's name in its slices
    return ObjectRef(kind, intern(ns), intern(name)), meta


def _lb_ips(ingress: Sequence[Any], problems: list[Problem], ref: ObjectRef) -> list[IPAddress]:
    """The IPs of status.loadBalancer.ingress, each once; a problem for each unusable entry."""
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
    return lb_ips


def _ports(spec: Mapping[str, Any], problems: list[Problem], ref: ObjectRef) -> set[PortSpec]:
    """spec.ports as the port filter allows them; a problem for each unusable port."""
    ports: set[PortSpec] = set()
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
    return ports


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
    lb_ips = _lb_ips(ingress, problems, ref)
    if not ingress:
        problems.append(
            Problem(
                ref,
                "has no LoadBalancer IP yet (status.loadBalancer.ingress is empty), so it is not "
                "programmed; it will be once a load balancer assigns one",
            )
        )

    ports = _ports(spec, problems, ref) if port_filter else set()
    source_ranges = _source_ranges(spec, ann, problems, ref)
    limits, bad = read_limits(ann)
    problems += [Problem(ref, message) for message in bad]
    return ParsedService(
        ref,
        created,
        port_filter,
        allow_icmp,
        tuple(lb_ips),
        _shared_ports(tuple(sorted(ports))),
        tuple(problems),
        source_ranges,
        limits,
    )


#: each list of ports once (Services repeat a few): bounded, emptied when full
_PORT_LISTS: dict[tuple[PortSpec, ...], tuple[PortSpec, ...]] = {}
_PORT_LISTS_MAX = 4096


def _shared_ports(ports: tuple[PortSpec, ...]) -> tuple[PortSpec, ...]:
    """`ports`, or the equal tuple read before (the records keep one per Service)."""
    if len(_PORT_LISTS) >= _PORT_LISTS_MAX:
        _PORT_LISTS.clear()
    return _PORT_LISTS.setdefault(ports, ports)


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


def _slice_version(ref: ObjectRef, address_type: Any, problems: list[Problem]) -> int | None:
    """The IP version of an EndpointSlice's addressType; None (and a problem) when it is FQDN
    or not an address type at all."""
    if address_type == "FQDN":
        problems.append(
            Problem(
                ref,
                "addressType FQDN is not supported (NAT needs a pod IP, not a name), so its "
                "endpoints are ignored; use an IPv4 or IPv6 EndpointSlice",
                "error",
            )
        )
        return None
    if not isinstance(address_type, str) or address_type not in _ADDRESS_TYPES:
        problems.append(
            Problem(
                ref,
                f"addressType {_q(address_type)} is not IPv4, IPv6 or FQDN, so its endpoints "
                "are ignored; fix the EndpointSlice",
                "error",
            )
        )
        return None
    return _ADDRESS_TYPES[address_type]


def _ready_addresses(
    ref: ObjectRef,
    obj: Mapping[str, Any],
    problems: list[Problem],
    nodes: set[tuple[IPAddress, str]] | None = None,
    pods: set[tuple[str, str, str]] | None = None,
    verify: bool = False,
) -> set[IPAddress]:
    """The first address of each ready, non-terminating endpoint of an IPv4 or IPv6
    EndpointSlice; all of the slice's addressType (an address of the other family is an error
    and skipped). Each with the endpoint's nodeName (a string) goes to `nodes` as well, and
    (namespace, name, nodeName or "") of its targetRef of kind Pod to `pods`. With `verify`,
    an endpoint whose targetRef is not a Pod of the slice's namespace is skipped, with a
    warning (`_untrusted_endpoint`)."""
    address_type = obj.get("addressType")
    version = _slice_version(ref, address_type, problems)
    if version is None:
        return set()
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
            if verify and _pod_of(ep.get("targetRef"), ref.namespace, strict=True) is None:
                problems.append(_untrusted_endpoint(ref, where, ip, ep.get("targetRef")))
                continue
            out.add(ip)
            node = ep.get("nodeName")
            if isinstance(node, str):
                node = intern(node)  # a few nodes, named by every endpoint
            if nodes is not None and isinstance(node, str) and node:
                nodes.add((ip, node))
            if pods is not None:
                pod = _pod_of(ep.get("targetRef"), ref.namespace)
                if pod is not None:
                    pods.add((*pod, node if isinstance(node, str) else ""))
        except _Invalid as e:
            problems.append(Problem(ref, e.message, e.severity))
    return out


def _pod_of(target: object, namespace: str, strict: bool = False) -> tuple[str, str] | None:
    """(namespace, name) of an endpoint's targetRef when it names a Pod (its namespace
    defaults to the slice's); None for anything else. `strict`: a Pod of `namespace` only."""
    if not isinstance(target, Mapping) or target.get("kind") != "Pod":
        return None
    name, ns = target.get("name"), target.get("namespace") or namespace
    if not isinstance(name, str) or not name or not isinstance(ns, str):
        return None
    if strict and ns != namespace:
        return None
    return (intern(ns), name)  # a namespace is named by every pod of it


def _untrusted_endpoint(ref: ObjectRef, where: str, ip: IPAddress, target: object) -> Problem:
    if isinstance(target, Mapping) and target.get("kind") == "Pod":
        what = f"a Pod of the namespace {_q(target.get('namespace'))}"
    elif isinstance(target, Mapping):
        what = f"a {_q(target.get('kind'))}"
    else:
        what = "nothing"
    return Problem(
        ref,
        f"{where} ({ip}) is not a Pod of the namespace {ref.namespace} (its targetRef names "
        f"{what}), so it is not programmed: an endpoint must be a pod of the Service's own "
        "namespace, or the Service's LB IP could be pointed at any address of the cluster; "
        f"if this platform writes such endpoints itself, set {TRUST_SETTING}",
        "warning",
    )


def _untrusted_slice(ref: ObjectRef, manager: object) -> Problem:
    by = f"by {_q(manager)}" if manager is not None else "by no controller (no label)"
    return Problem(
        ref,
        f"is managed {by}, not by Kubernetes' EndpointSlice controller ({LABEL_MANAGED_BY}: "
        f"{SLICE_CONTROLLER}), so its endpoints are not programmed: a slice written by hand "
        "could point the Service's LB IP at any address of the cluster; if this platform "
        f"writes EndpointSlices itself, set {TRUST_SETTING}",
        "warning",
    )


def _same(a: object, b: object) -> bool:
    """a == b, and False for structures too deep (or self-referencing, via YAML anchors)."""
    try:
        return a == b
    except RecursionError:
        return False
