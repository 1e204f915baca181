"""The records the model keeps (ServiceRecord, SliceRecord, ForeignRecord, NodeRecord), the
Problems it reports, and the labels and annotations it reads. `cozyebpf/model/read.py` reads
objects into them, with `fields.py`'s readers of each field."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from ipaddress import IPv4Address
from typing import Literal, NamedTuple

from cozyebpf.state import NO_LIMITS, IPAddress, IPNetwork, Limits, Proto, Ranges

LABEL_PROXY_NAME = "service.kubernetes.io/service-proxy-name"
DEFAULT_PROXY_NAME = "cozy-proxy"
ANN_WHOLE_IP = "networking.cozystack.io/wholeIP"
ANN_ALLOW_ICMP = "networking.cozystack.io/allowICMP"
#: the older way to give loadBalancerSourceRanges (comma-separated); the spec field wins
ANN_SOURCE_RANGES = "service.beta.kubernetes.io/load-balancer-source-ranges"
#: The label that ties an EndpointSlice to its Service.
LABEL_SERVICE_NAME = "kubernetes.io/service-name"
#: Who wrote an EndpointSlice, and the value Kubernetes' EndpointSlice controller gives it: the
#: only slices trusted by default from the API (issue 28; `read_object`, `verify_endpoints`)
LABEL_MANAGED_BY = "endpointslice.kubernetes.io/managed-by"
SLICE_CONTROLLER = "endpointslice-controller.k8s.io"
#: the setting that trusts other slices and endpoints, as the warnings name it
TRUST_SETTING = "--trusted-endpoints any (the chart's agent.trustedEndpoints: any)"

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
    #: what its limit annotations ask (model/limits.py; bad ones left out, with a Problem)
    limits: Limits = NO_LIMITS

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
    pairs each ready address with the nodeName of an endpoint that has it (sorted; flat,
    address and node in turn: `node_pairs`): during a live migration one address is ready on
    two nodes. `pods` names the pods of its ready endpoints (a targetRef of kind Pod) as
    namespace, name and the endpoint's nodeName or "" in turn (sorted; `pod_triples`): the
    model does not use them; the agent reads their port security (cozyebpf/kube/portsec.py).
    Flat, not a tuple of tuples: most slices have one endpoint, and the outer tuple was 48
    bytes each (issue 48)."""

    ref: ObjectRef
    service: str
    #: sorted (IPv4 first), each once: a tuple, not a frozenset (216 bytes for one address;
    #: the model keeps one per EndpointSlice)
    ready: tuple[IPAddress, ...]
    problems: tuple[Problem, ...]
    nodes: tuple[IPAddress | str, ...] = ()
    pods: tuple[str, ...] = ()

    def node_pairs(self) -> Iterator[tuple[IPAddress, str]]:
        """(address, nodeName) of `nodes`."""
        it = iter(self.nodes)
        return zip(it, it, strict=True)  # type: ignore[arg-type]

    def pod_triples(self) -> Iterator[tuple[str, str, str]]:
        """(namespace, name, nodeName or "") of `pods`."""
        it = iter(self.pods)
        return zip(it, it, it, strict=True)


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """A Node's IP addresses (`status.addresses`, each with its type: InternalIP, ExternalIP),
    sorted: an LB IP may not be one of them (issue 31). Nodes are cluster-scoped: the ref's
    namespace is empty."""

    ref: ObjectRef
    addresses: tuple[tuple[IPAddress, str], ...]


@dataclass(frozen=True, slots=True)
class ForeignRecord:
    """A Service that cozyebpf does not manage but that holds LoadBalancer IPs: a managed LB IP
    shared with it is warned about (another proxy, Cilium for one, programs that IP too)."""

    ref: ObjectRef
    lb_ips: tuple[IPAddress, ...]
    labelled: bool  # it has a service-proxy-name label (of another proxy)


#: Objects are keyed by (namespace, name).
Key = tuple[str, str]


@dataclass
class ObjectSet:
    """Every object of a source, read: the model's input. Slices are kept per (namespace,
    name) as a tuple, since a manifest may define one twice."""

    services: dict[Key, ServiceRecord] = field(default_factory=dict)
    slices: dict[Key, tuple[SliceRecord, ...]] = field(default_factory=dict)
    foreign: dict[Key, ForeignRecord] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)  # objects that cannot be named
    nodes: dict[Key, NodeRecord] = field(default_factory=dict)  # ("", name)


#: what read_object makes of one object
Read = ServiceRecord | SliceRecord | ForeignRecord | NodeRecord | Problem | None
