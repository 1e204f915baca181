"""Records -> the desired MapState: each Service with its slices (`_evaluate`), the rules
between Services (`_compose`), what fits the maps (`_admit`). `compose` does it for an
ObjectSet, `build_state` for objects: the reference that IncrementalModel is tested against.
The underscored names are the package's own: incremental.py uses them, nothing outside."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from ipaddress import ip_network
from sys import intern
from typing import Any

from cozyebpf.model.limits import ANN_INGRESS_PACKET_RATE
from cozyebpf.model.read import read_objects
from cozyebpf.model.records import (
    DEFAULT_PROXY_NAME,
    LABEL_PROXY_NAME,
    LABEL_SERVICE_NAME,
    ForeignRecord,
    Key,
    NodeRecord,
    ObjectRef,
    ObjectSet,
    ParsedService,
    PortSpec,
    Problem,
    ServiceRecord,
    SliceRecord,
)
from cozyebpf.state import (
    FAMILIES,
    NO_LIMITS,
    AllowedPort,
    Capacity,
    IPAddress,
    IPNetwork,
    Limits,
    MapState,
    PodEntry,
    Ranges,
    ServiceEntry,
    family_name,
)

#: IPv4 link-local: the pods' gateway 169.254.1.1 (Calico, the per-pod layout), the cloud
#: metadata service 169.254.169.254, NodeLocal DNSCache's 169.254.20.10
LINK_LOCAL_V4 = ip_network("169.254.0.0/16")


@dataclass(frozen=True, order=True, slots=True)
class Refusal:
    """Why a Service is not programmed at all: its LB IP `lb` is an address already in use
    (issue 31). `kind` is one of REFUSAL_KINDS (for metrics); `what` says what the address
    already is, e.g. "this node's address on eth0"."""

    lb: IPAddress
    kind: str
    what: str

    def __str__(self) -> str:
        return f"{self.lb} is {self.what}"


#: Refusal.kind -> what a Service with such an LB IP would break, said in its Problem
REFUSAL_HARM = {
    "node-address": "the node's own services (SSH, the kubelet) would reach the pod instead",
    "node": "that node's own traffic to its address would reach the pod instead",
    "link-local": "pods and nodes use link-local addresses for their gateway and metadata",
    "pod": "that pod's own traffic would be translated as this Service's",
    "reserved-cidr": "the operator reserved that range with --reserved-cidrs",
}


class Reserved:
    """The addresses an LB IP may not be, and what each already is: this node's own
    addresses (read from the kernel, `set_local`), every Node's addresses (`set_node`), IPv4
    link-local and the operator's `cidrs` (--reserved-cidrs). A pod IP of a managed Service is
    checked by `_compose`, which knows the pods. A whole LB IP takes every packet to its
    address, so a Service that claims one of these would cut off what already answers there."""

    def __init__(self, cidrs: Iterable[IPNetwork] = ()) -> None:
        self.cidrs = tuple(cidrs)
        self.local: dict[IPAddress, str] = {}  # address -> its device
        self.nodes: dict[IPAddress, dict[str, str]] = {}  # address -> node name -> type

    def set_local(self, addresses: Mapping[IPAddress, str]) -> set[IPAddress]:
        """This node's addresses, each with its device; the addresses whose meaning changed."""
        old, self.local = self.local, dict(addresses)
        return {ip for ip in old.keys() | self.local.keys() if old.get(ip) != self.local.get(ip)}

    def set_node(self, old: NodeRecord | None, new: NodeRecord | None) -> set[IPAddress]:
        """One Node's addresses changed from `old` to `new`; the addresses concerned."""
        changed: set[IPAddress] = set()
        if old is not None:
            for ip, _ in old.addresses:
                names = self.nodes.get(ip, {})
                names.pop(old.ref.name, None)
                if not names:
                    self.nodes.pop(ip, None)
                changed.add(ip)
        if new is not None:
            for ip, kind in new.addresses:
                self.nodes.setdefault(ip, {})[new.ref.name] = kind
                changed.add(ip)
        return changed

    def why(self, ip: IPAddress) -> Refusal | None:
        """What `ip` already is, or None: it may be an LB IP."""
        device = self.local.get(ip)
        if device is not None:
            return Refusal(ip, "node-address", f"this node's address on {device}")
        names = self.nodes.get(ip)
        if names:
            name = min(names)
            return Refusal(ip, "node", f"node {name}'s {names[name]}")
        if ip.version == 4 and ip in LINK_LOCAL_V4:
            return Refusal(ip, "link-local", f"an IPv4 link-local address ({LINK_LOCAL_V4})")
        for net in self.cidrs:
            if ip.version == net.version and ip in net:
                what = f"in the reserved range {net} (--reserved-cidrs)"
                return Refusal(ip, "reserved-cidr", what)
        return None


def _refused_problem(ref: ObjectRef, r: Refusal) -> Problem:
    return Problem(
        ref,
        f"is not programmed: its LoadBalancer IP {r.lb} is {r.what}, and a whole LB IP takes "
        f"every packet to its address ({REFUSAL_HARM[r.kind]}); give the Service an address "
        "of its own: fix the load balancer's IP pool (MetalLB IPAddressPool, Cilium "
        "LB-IPAM) or spec.loadBalancerIP so that it overlaps no node, pod or reserved address",
    )


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
    #: why the Service is not programmed at all: LB IPs that are addresses in use (issue 31)
    refused: tuple[Refusal, ...] = ()
    #: its limits as enforced: its annotations', the node's guard for its packet rate
    limits: Limits = NO_LIMITS

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
        """The LB IPs that have entries in the desired state (a pod IP of their family; none
        when the Service is refused)."""
        if self.refused:
            return ()
        return tuple(lb for lb in self.lb_ips if self.pod_for(lb) is not None)

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
        if self.refused:
            mode += " REFUSED: " + "; ".join(map(str, self.refused))
        return f"{self.ref}: {self._target()} {mode}"


@dataclass
class ModelResult:
    """The desired state, every selected Service (sorted by namespace/name) and every Problem
    (sorted, without duplicates)."""

    state: MapState
    services: list[ServiceView] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


AgeKey = str

_FIRST = datetime(1, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


def _age(s: ParsedService) -> AgeKey:
    """Sort key, oldest first; Services without a (valid) timestamp count as the newest, ties
    in namespace/name order. One string that sorts as the tuple (no timestamp, creation time,
    namespace, name) does: a flag, the microseconds since year 1 (offset by 10**18: a fixed 19
    digits, also for an offset before it), the namespace, NUL (in no Kubernetes name: a
    namespace sorts before every longer one it begins), the name. A cold start sorts every
    Service: strings compare many times faster than tuples of a datetime and two strings."""
    ref = s.ref
    if s.created is None:
        return f"1{ref.namespace}\0{ref.name}"
    return f"0{(s.created - _FIRST) // _MICROSECOND + 10**18:019d}{ref.namespace}\0{ref.name}"


_NOT_MOVING: frozenset[IPAddress] = frozenset()


@dataclass(frozen=True, slots=True)
class _Eval:
    """A Service with its EndpointSlices: the backend chosen per family and the Service's own
    problems (its record's, its slices', its endpoints'). Everything that does not depend on
    other Services."""

    ref: ObjectRef
    service: ParsedService | None  # None: unusable, `problems` says why
    chosen: tuple[IPAddress, ...]  # the pod IP of each family, IPv4 first
    problems: tuple[Problem, ...]
    #: each chosen pod with the nodes its address is ready on (sorted; empty: none named)
    homes: tuple[tuple[IPAddress, tuple[str, ...]], ...] = ()

    def moving(self) -> frozenset[IPAddress]:
        """The chosen pods ready on more than one node: a live migration (KubeVirt's source
        and target virt-launcher pods, one address)."""
        if not self.homes:
            return _NOT_MOVING
        return frozenset(pod for pod, nodes in self.homes if len(nodes) > 1)

    @property
    def age(self) -> AgeKey:
        assert self.service is not None
        return _age(self.service)

    def addresses(self) -> tuple[IPAddress, ...]:
        """The LB IPs it claims and the pods it chose: what links it to other Services."""
        if self.service is None:
            return ()
        return (*self.service.lb_ips, *self.chosen)


def _evaluate(rec: ServiceRecord, slices: Iterable[SliceRecord]) -> _Eval:
    s = rec.service
    if s is None:
        assert rec.problem is not None
        return _Eval(rec.ref, None, (), (rec.problem,))
    if isinstance(slices, list) and len(slices) == 1 and len(slices[0].ready) == 1:
        # most Services: one slice, one ready address (what the loops below give for it,
        # without their dicts and sets: a cold start evaluates every Service)
        sl = slices[0]
        pod = sl.ready[0]
        nodes = sorted({n for ip, n in sl.node_pairs() if ip == pod}) if sl.nodes else ()
        home = ((pod, tuple(nodes)),) if nodes else ()
        return _Eval(rec.ref, s, sl.ready, (*s.problems, *sl.problems), home)
    problems = list(s.problems)
    ready: dict[int, set[IPAddress]] = {version: set() for version in FAMILIES}
    on: dict[IPAddress, set[str]] = {}
    readies: list[tuple[IPAddress, ...]] = []
    for sl in slices:
        problems += sl.problems
        readies.append(sl.ready)
        for ip in sl.ready:
            ready[ip.version].add(ip)
        for ip, node in sl.node_pairs() if sl.nodes else ():
            on.setdefault(ip, set()).add(node)
    chosen: list[IPAddress] = []  # FAMILIES' order
    for version, addresses in ready.items():
        if not addresses:
            continue
        pod = min(addresses)
        chosen.append(pod)
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
    homes = tuple((pod, tuple(sorted(on[pod]))) for pod in chosen if pod in on)
    # a slice's own tuple where it is what is chosen (one endpoint: most Services)
    picked = tuple(chosen)
    picked = next((r for r in readies if r == picked), picked)
    return _Eval(rec.ref, s, picked, tuple(problems), homes)


@dataclass(frozen=True, slots=True)
class _Output:
    """What one Service contributes to the desired state, and everything said about it.
    Tuples, not dicts and sets: the incremental model keeps one per Service. `services` and
    `pods` are flat, key and value in turn (LB IP, ServiceEntry, ...; pod IP, PodEntry, ...):
    a pair per entry was 56 bytes more (`_pairs` reads them)."""

    services: tuple[IPAddress | ServiceEntry, ...] = ()
    pods: tuple[IPAddress | PodEntry, ...] = ()
    allowed: tuple[AllowedPort, ...] = ()
    problems: tuple[Problem, ...] = ()
    view: ServiceView | None = None
    #: a Service with source ranges: each pod its LB IPs reach, with the sources it lets in;
    #: empty for a Service without (its pods, those of `services`, let every source in)
    ranges: tuple[tuple[IPAddress, Ranges], ...] = ()
    #: its limits, keyed by its name (empty: none, or nothing of it programmed)
    limits: tuple[tuple[str, Limits], ...] = ()


def _pairs(flat: tuple[Any, ...]) -> Iterator[tuple[Any, Any]]:
    """(key, value) of a flat tuple of keys and values in turn (_Output)."""
    it = iter(flat)
    return zip(it, it, strict=True)


def _state_of(outputs: Iterable[_Output]) -> MapState:
    """The desired state the outputs make together. A pod's source ranges are the union of
    its Services' (a pod behind a Service without ranges accepts every source, as its allowed
    ports are the union of its Services')."""
    st = MapState()
    contrib: dict[IPAddress, list[Ranges]] = {}
    every: set[IPAddress] = set()  # pods behind a Service without ranges
    for o in outputs:
        st.services.update(_pairs(o.services))
        st.pods.update(_pairs(o.pods))
        st.allowed.update(o.allowed)
        st.limits.update(o.limits)
        if o.ranges:
            for pod, r in o.ranges:
                contrib.setdefault(pod, []).append(r)
        else:
            every.update(e.pod_ip for e in o.services[1::2])  # type: ignore[union-attr]
    st.ranges = {pod: frozenset().union(*rs) for pod, rs in contrib.items() if pod not in every}
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


def _nothing_reserved(ip: IPAddress) -> Refusal | None:
    return None


def enforced_limits(limits: Limits, guard_pps: int | None, max_pps: int | None = None) -> Limits:
    """A Service's limits as the datapath enforces them: its own, and the node's guard as its
    packet rate into its LB IPs where it sets none (its own rate, lower or up to the node's
    ceiling `max_pps`, wins: the guard never cuts traffic below what a Service asked for); a
    rate of its own above the ceiling is the ceiling. The node's operator holds the ceiling,
    not whoever may annotate a Service: no LB IP takes in more packets than it unless the
    operator says so (docs/behaviour.md, Limits per public IP)."""
    if limits.ingress_pps is None and guard_pps:
        return replace(limits, ingress_pps=guard_pps, guard=True)
    if max_pps and limits.ingress_pps is not None and limits.ingress_pps > max_pps:
        return replace(limits, ingress_pps=max_pps)
    return limits


# (82 lines: the model's one decision table, Service by Service, kept whole to be read whole)
def _compose(
    evals: Iterable[_Eval],
    foreign: Mapping[IPAddress, Iterable[ForeignRecord]],
    held: Iterable[IPAddress],
    reserved: Callable[[IPAddress], Refusal | None] = _nothing_reserved,
    guard_pps: int | None = None,
    max_pps: int | None = None,
) -> dict[ObjectRef, _Output]:
    """The cross-Service rules over `evals`, which must hold every Service that shares an LB
    IP or a pod with one of them: a Service with an LB IP that is `reserved` or the pod IP of
    any of them is refused whole, the older Service keeps a contested LB IP, the oldest
    Service of a pod owns its egress, the allowed ports of a pod are the union of its
    port-filter Services'. A pod that is moving, or in `held` (moved a moment ago), is
    marked learning. Limits: the Service's own (its packet rate at most `max_pps`) and the
    node's guard of `guard_pps` packets per second into each LB IP (enforced_limits). One
    output per Service."""
    held = frozenset(held)
    out: dict[ObjectRef, _Output] = {}
    valid: list[_Eval] = []
    for e in evals:
        if e.service is None:
            out[e.ref] = _Output(problems=e.problems)
        else:
            valid.append(e)
    valid.sort(key=lambda e: e.age)
    pod_of: dict[IPAddress, ObjectRef] = {}  # every chosen pod -> the oldest Service behind it
    for e in valid:
        for ip in e.chosen:
            pod_of.setdefault(ip, e.ref)
    lb_owner: dict[IPAddress, ObjectRef] = {}
    pod_owner: dict[IPAddress, tuple[ObjectRef, IPAddress]] = {}  # -> (owner, its egress LB)
    for e in valid:
        s = e.service
        assert s is not None
        problems = list(e.problems)
        services: list[IPAddress | ServiceEntry] = []  # flat (_Output)
        pods: list[IPAddress | PodEntry] = []
        allowed: set[AllowedPort] = set()
        ranges: list[tuple[IPAddress, Ranges]] = []
        kept = _claim_lb_ips(s, foreign, lb_owner, problems)
        chosen: dict[int, IPAddress] = {ip.version: ip for ip in e.chosen}
        pod_ips = e.chosen  # (one tuple, the evaluation's, in its view)
        migrating = e.moving()
        if held:
            migrating = migrating | held.intersection(pod_ips)
        # whose counters its entries feed; interned: one string however often it is composed
        name = intern(f"{s.ref.namespace}/{s.ref.name}")
        refused = _refusals(s.lb_ips, reserved, pod_of)
        limits = enforced_limits(s.limits, guard_pps, max_pps)
        if s.limits.ingress_pps is not None and limits.ingress_pps != s.limits.ingress_pps:
            problems.append(
                Problem(
                    s.ref,
                    f"annotation {ANN_INGRESS_PACKET_RATE} asks for {s.limits.ingress_pps:,} "
                    f"packets per second, above the node's ceiling of {limits.ingress_pps:,} "
                    "(--max-packet-rate, the chart's agent.maxPacketRate): its LB IPs get "
                    "the ceiling; lower the annotation, or ask the node's operator to raise "
                    "the ceiling",
                )
            )
        view = ServiceView(
            s.ref,
            s.lb_ips if len(kept) == len(s.lb_ips) else tuple(kept),  # the record's when all
            pod_ips,
            s.port_filter,
            s.allow_icmp,
            s.ports,
            s.source_ranges,
            tuple(p for p in pod_ips if p in migrating),
            refused,
            limits,
        )
        if refused:  # not programmed at all; it keeps its claim on its other LB IPs
            problems += [_refused_problem(s.ref, r) for r in refused]
            out[e.ref] = _Output(problems=tuple(problems), view=view)
            continue
        for version in FAMILIES:
            lbs = [lb for lb in kept if lb.version == version]
            if not lbs:
                continue
            backend = chosen.get(version)
            if backend is None:
                # no ready endpoint at all is reported once above; here only a missing family
                if chosen:
                    problems += _no_family_problems(s.ref, lbs, family_name(version))
                continue
            learning = backend in migrating
            entry = ServiceEntry(
                backend, s.port_filter, s.allow_icmp, name, learning, limits.ingress
            )
            for lb in lbs:
                services += (lb, entry)
            restricted = s.ranges_of(version)
            if restricted is not None:
                ranges.append((backend, restricted))
            if backend in pod_owner:
                problems.append(_pod_taken_problem(s.ref, backend, *pod_owner[backend]))
            else:
                pod_owner[backend] = (s.ref, lbs[0])
                pod = PodEntry(
                    lbs[0], s.port_filter, s.allow_icmp, name, learning,
                    limits.egress_bps is not None,
                )  # fmt: skip
                pods += (backend, pod)
            if s.port_filter:
                allowed |= {AllowedPort(backend, p.proto, p.port) for p in s.ports}
        limited = ((name, limits),) if limits and (services or pods) else ()
        out[e.ref] = _Output(
            tuple(services),
            tuple(pods),
            tuple(allowed),
            tuple(problems),
            view,
            tuple(ranges),
            limited,
        )
    return out


def _claim_lb_ips(
    s: ParsedService,
    foreign: Mapping[IPAddress, Iterable[ForeignRecord]],
    lb_owner: dict[IPAddress, ObjectRef],
    problems: list[Problem],
) -> list[IPAddress]:
    """The LB IPs of `s` that it keeps: those no older Service (`lb_owner`, which it joins)
    claimed; a problem for each one it loses and each one another controller announces."""
    kept: list[IPAddress] = []
    for lb in s.lb_ips:
        others = foreign.get(lb)
        for other in sorted(others, key=lambda f: f.ref) if others else ():
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
    return kept


def _no_family_problems(ref: ObjectRef, lbs: list[IPAddress], fam: str) -> list[Problem]:
    """LB IPs of a family the Service has no ready endpoint of (it has one of the other)."""
    return [
        Problem(
            ref,
            f"LB IP {lb} is {fam} but the Service has no ready {fam} endpoint; "
            "it is not programmed (an LB IP is only translated to a pod IP of "
            f"its own family); check that the pod has an {fam} address and is "
            f"ready, or remove the {fam} LB IP",
        )
        for lb in lbs
    ]


def _pod_taken_problem(
    ref: ObjectRef, pod: IPAddress, owner: ObjectRef, egress: IPAddress
) -> Problem:
    """The pod of `ref` is behind an older Service, `owner`, whose LB IP its egress takes."""
    return Problem(
        ref,
        f"its pod {pod} is also behind the older {owner}, so the "
        f"pod's own connections leave from {egress}, not from "
        "this Service's IP; give each Service its own pod",
    )


def _refusals(
    lb_ips: Iterable[IPAddress],
    reserved: Callable[[IPAddress], Refusal | None],
    pod_of: Mapping[IPAddress, ObjectRef],
) -> tuple[Refusal, ...]:
    """The LB IPs among `lb_ips` that are addresses in use, with what each is."""
    out: list[Refusal] = []
    for lb in lb_ips:
        r = reserved(lb)
        if r is None and lb in pod_of:
            r = Refusal(lb, "pod", f"the pod IP of the backend of {pod_of[lb]}")
        if r is not None:
            out.append(r)
    return tuple(out)


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
            ("services", [k for k in o.services[::2] if k not in services]),
            ("pods", [k for k in o.pods[::2] if k not in pods]),
            ("allowed", [a.pod_ip for a in o.allowed if a not in allowed]),
            (
                "ranges",
                [pod for pod, r in o.ranges for net in r if net not in ranges.get(pod, set())],
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
        services.update(o.services[::2])  # type: ignore[arg-type]
        pods.update(o.pods[::2])  # type: ignore[arg-type]
        allowed.update(o.allowed)
        for pod, r in o.ranges:
            ranges.setdefault(pod, set()).update(r)
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
    objects: ObjectSet,
    capacity: Capacity | None = None,
    held: Iterable[IPAddress] = (),
    local: Mapping[IPAddress, str] | None = None,
    reserved_cidrs: Iterable[IPNetwork] = (),
    guard_pps: int | None = None,
    max_pps: int | None = None,
) -> ModelResult:
    """The desired state of an ObjectSet, every selected Service's view and every Problem;
    the pods in `held` moved a moment ago (IncrementalModel.held) and are still learning;
    `local` are this node's addresses (address -> device) and `reserved_cidrs` the operator's
    reserved ranges, which no LB IP may take (nor a Node's address, see `Reserved`);
    `guard_pps` the node's packet-rate guard per Service, `max_pps` its ceiling of a Service's
    own rate (enforced_limits)."""
    reserved = Reserved(reserved_cidrs)
    reserved.set_local(local or {})
    for node in objects.nodes.values():
        reserved.set_node(None, node)
    by_service = slices_by_service(objects.slices)
    evals = {key: _evaluate(rec, by_service.get(key, ())) for key, rec in objects.services.items()}
    outputs = _compose(
        evals.values(),
        foreign_by_ip(objects.foreign.values()),
        held,
        reserved.why,
        guard_pps,
        max_pps,
    )
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
    local: Mapping[IPAddress, str] | None = None,
    reserved_cidrs: Iterable[IPNetwork] = (),
    guard_pps: int | None = None,
    max_pps: int | None = None,
) -> ModelResult:
    """The desired MapState for the Services labelled for `proxy_name`, with a view of each and
    every Problem found. Never raises on bad input; the result does not depend on input order.
    The reference for `IncrementalModel`, which must always give the same result (given its
    `held` pods, when a pod moved, and this node's `local` addresses: what the objects do not
    say)."""
    return compose(
        read_objects(objects, proxy_name),
        capacity,
        held,
        local,
        reserved_cidrs,
        guard_pps,
        max_pps,
    )
