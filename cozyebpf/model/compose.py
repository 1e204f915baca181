"""Records -> the desired MapState: each Service with its slices (`_evaluate`), the rules
between Services (`_compose`), what fits the maps (`_admit`). `compose` does it for an
ObjectSet, `build_state` for objects: the reference that IncrementalModel is tested against.
The underscored names are the package's own: incremental.py uses them, nothing outside."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from cozyebpf.model.records import (
    DEFAULT_PROXY_NAME,
    LABEL_PROXY_NAME,
    LABEL_SERVICE_NAME,
    ForeignRecord,
    Key,
    ObjectRef,
    ObjectSet,
    ParsedService,
    PortSpec,
    Problem,
    ServiceRecord,
    SliceRecord,
    read_objects,
)
from cozyebpf.state import (
    FAMILIES,
    AllowedPort,
    Capacity,
    IPAddress,
    IPNetwork,
    MapState,
    PodEntry,
    Ranges,
    ServiceEntry,
    family_name,
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


AgeKey = tuple[bool, datetime, str, str]


def _age(s: ParsedService) -> AgeKey:
    """Sort key, oldest first; Services without a (valid) timestamp count as the newest."""
    return (
        s.created is None,
        s.created or datetime.min.replace(tzinfo=UTC),
        s.ref.namespace,
        s.ref.name,
    )


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


def _compose(
    evals: Iterable[_Eval],
    foreign: Mapping[IPAddress, Iterable[ForeignRecord]],
    held: Iterable[IPAddress],
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
