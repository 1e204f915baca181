"""Objects -> records: each Service and EndpointSlice read on its own into the small,
immutable records the model keeps (`records.py`), with a Problem for each bad object or field.
Pure and never raises on bad input."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from ipaddress import ip_address
from sys import intern
from typing import Any

from cozyebpf.model.fields import (
    _describe,
    _ident,
    _mapping,
    _parse_ip,
    _read_service,
    _ready_addresses,
    _same,
    _untrusted_slice,
)
from cozyebpf.model.records import (
    DEFAULT_PROXY_NAME,
    LABEL_MANAGED_BY,
    LABEL_PROXY_NAME,
    LABEL_SERVICE_NAME,
    SLICE_CONTROLLER,
    ForeignRecord,
    Key,
    NodeRecord,
    ObjectRef,
    ObjectSet,
    Problem,
    Read,
    ServiceRecord,
    SliceRecord,
    _Invalid,
)
from cozyebpf.state import IPAddress

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


def _read_node(obj: Mapping[str, Any]) -> NodeRecord | None:
    """The IP addresses of a Node (status.addresses[] entries whose address is an IP, of any
    type; Hostname and DNS entries are names, not addresses). Nothing is reported about a
    Node: an address that does not parse is not one an LB IP can take either."""
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    if not isinstance(name, str) or not name:
        return None
    status = obj.get("status")
    entries = status.get("addresses") if isinstance(status, Mapping) else None
    found: set[tuple[IPAddress, str]] = set()
    for entry in entries if isinstance(entries, list | tuple) else ():
        if not isinstance(entry, Mapping):
            continue
        value, kind = entry.get("address"), entry.get("type")
        if not isinstance(value, str):
            continue
        try:
            ip = ip_address(value.strip())
        except ValueError:
            continue  # a Hostname or InternalDNS entry
        found.add((ip, kind if isinstance(kind, str) and kind else "address"))
    return NodeRecord(ObjectRef("Node", "", name), tuple(sorted(found, key=_node_key)))


def read_object(
    obj: object, index: int, proxy_name: str = DEFAULT_PROXY_NAME, verify_endpoints: bool = False
) -> ServiceRecord | SliceRecord | ForeignRecord | NodeRecord | Problem | None:
    """One object of a source, read on its own: a ServiceRecord for a Service labelled for
    `proxy_name`, a ForeignRecord for another Service that holds LoadBalancer IPs, a
    SliceRecord for an EndpointSlice that names its Service, a NodeRecord for a Node (its
    addresses, which no LB IP may take), a Problem for an object that cannot even be named
    (`index`, from 1, names it by its position), None for everything else (other kinds,
    slices without a Service label). Pure and never raises on bad input.

    `verify_endpoints` (the API source, by default): a slice not managed by Kubernetes'
    EndpointSlice controller has no ready address, and an endpoint that is not a Pod of the
    slice's namespace is skipped, each with a warning naming the setting that allows them.
    The manifest source is the operator's own file and is read as written."""
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
        pods: set[tuple[str, str, str]] = set()
        manager = slice_labels.get(LABEL_MANAGED_BY) if isinstance(slice_labels, Mapping) else None
        if verify_endpoints and manager != SLICE_CONTROLLER:
            return SliceRecord(ref, service, (), (_untrusted_slice(ref, manager),))
        ready = _ready_addresses(ref, obj, problems, nodes, pods, verify_endpoints)
        return SliceRecord(
            ref,
            intern(service),  # the same string as its Service's name (fields._ident)
            tuple(sorted(ready, key=_address_key)),
            tuple(problems),
            tuple(x for pair in sorted(nodes, key=_node_key) for x in pair),  # flat
            tuple(x for pod in sorted(pods) for x in pod),
        )
    if kind == "Node" and api_version in (None, "v1"):
        return _read_node(obj)
    return None


def _address_key(ip: IPAddress) -> tuple[int, IPAddress]:
    return (ip.version, ip)


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
        elif isinstance(rec, NodeRecord):
            out.nodes[("", rec.ref.name)] = rec
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
