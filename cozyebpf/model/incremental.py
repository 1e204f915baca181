"""The model kept up to date change by change (IncrementalModel), and what each change
did (Delta)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cozyebpf.model.compose import (
    ModelResult,
    Reserved,
    ServiceView,
    _admit,
    _age_order,
    _compose,
    _Eval,
    _evaluate,
    _Output,
    _state_of,
)
from cozyebpf.model.records import (
    DEFAULT_PROXY_NAME,
    ForeignRecord,
    Key,
    NodeRecord,
    ObjectRef,
    ObjectSet,
    Problem,
    ServiceRecord,
    SliceRecord,
)
from cozyebpf.state import Capacity, IPAddress, IPNetwork, MapDiff, MapState, diff, whole

#: seconds a pod stays learning after its nodes changed (IncrementalModel): long enough for
#: its first answer on the new node to record each flow it has (docs/design.md, "Live migration")
MIGRATION_HOLD = 10.0


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


#: an index's value: the one key (mostly), or a tuple of two or more (a bare Key is a tuple of
#: str: a tuple (key,) for each of 100,000 Services' addresses and slices was 48 bytes more)
Keys = Key | tuple[Key, ...]


def _keys(index: Mapping[Any, Keys], at: Any) -> tuple[Key, ...]:
    """The keys `index` has at `at`."""
    v = index.get(at)
    if v is None:
        return ()
    return (v,) if isinstance(v[0], str) else v


def _put(index: dict[Any, Keys], at: Any, keys: tuple[Key, ...]) -> None:
    if len(keys) > 1:
        index[at] = keys
    elif keys:
        index[at] = keys[0]
    else:
        index.pop(at, None)


def _tuple_add(index: dict[Any, Keys], at: Any, key: Key) -> None:
    if at not in index:  # the first key (every one of a cold start)
        index[at] = key
        return
    keys = _keys(index, at)
    if key not in keys:
        _put(index, at, (*keys, key))


def _tuple_discard(index: dict[Any, Keys], at: Any, key: Key) -> None:
    _put(index, at, tuple(k for k in _keys(index, at) if k != key))


class IncrementalModel:
    """The model kept up to date change by change, with the result of `build_state` on the same
    objects at every `flush()` (tests/unit/test_incremental.py checks that after every step of
    random histories).

    Changes are recorded with `set_service`/`set_slices`/`set_foreign`/`set_node`/
    `set_problems` (or `replace` with a whole ObjectSet) and `set_local` (this node's
    addresses) and take effect at `flush()`, which re-evaluates only the Services whose
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
        reserved_cidrs: Iterable[IPNetwork] = (),
        guard_pps: int | None = None,
        max_pps: int | None = None,
    ) -> None:
        self.proxy_name = proxy_name
        self.guard_pps = guard_pps  # the node's packet-rate guard per Service
        self.max_pps = max_pps  # and its ceiling of a Service's own rate
        self.capacity = capacity
        self.clock = clock
        self.hold = hold
        self._held: dict[IPAddress, float] = {}  # pod -> until when it stays learning
        self.services: dict[Key, ServiceRecord] = {}
        #: EndpointSlice -> its record, or a tuple of them where a manifest defines it twice
        #: (`slice_records`: a tuple of one was 48 bytes more per slice)
        self.slices: dict[Key, SliceRecord | tuple[SliceRecord, ...]] = {}
        #: namespace -> Service name -> the slices that name it (by namespace: a (namespace,
        #: name) tuple per Service was 56 bytes, the names are the records' own strings)
        self._slices_of: dict[str, dict[str, Keys]] = {}
        self.foreign: dict[Key, ForeignRecord] = {}
        self._foreign_by_ip: dict[IPAddress, set[ForeignRecord]] = {}
        self.nodes: dict[Key, NodeRecord] = {}
        #: the addresses no LB IP may take (issue 31): Nodes', this node's, reserved ranges
        self.reserved = Reserved(reserved_cidrs)
        # addresses whose meaning changed (a foreign LB IP, a Node's or this node's address):
        # the Services that claim them are composed again
        self._ip_dirty: set[IPAddress] = set()
        self._unkeyed: list[Problem] = []
        self._evals: dict[Key, _Eval] = {}
        # LB IP or chosen pod -> the Services that claim it (Keys: mostly one)
        self._claims: dict[IPAddress, Keys] = {}
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
        old = self.slice_records(key)
        new = recs or ()
        if old == new:
            return False
        for r in old:  # (a slice defined twice: its second record finds it gone)
            names = self._slices_of.get(r.ref.namespace)
            if names is not None:
                _tuple_discard(names, r.service, key)
                if not names:
                    del self._slices_of[r.ref.namespace]
            self._dirty.add((r.ref.namespace, r.service))
        for r in new:
            _tuple_add(self._slices_of.setdefault(r.ref.namespace, {}), r.service, key)
            self._dirty.add((r.ref.namespace, r.service))
        if new:
            self.slices[key] = new[0] if len(new) == 1 else new
        else:
            del self.slices[key]
        return True

    def slice_records(self, key: Key) -> tuple[SliceRecord, ...]:
        """The records of the EndpointSlice `key` (usually one; none: unknown)."""
        v = self.slices.get(key)
        if v is None:
            return ()
        return (v,) if isinstance(v, SliceRecord) else v

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
            self._ip_dirty.update(old.lb_ips)
            del self.foreign[key]
        if rec is not None:
            self.foreign[key] = rec
            for ip in rec.lb_ips:
                self._foreign_by_ip.setdefault(ip, set()).add(rec)
            self._ip_dirty.update(rec.lb_ips)
        return True

    def set_node(self, key: Key, rec: NodeRecord | None) -> bool:
        """Record a Node's addresses (None: gone); False when nothing changed."""
        old = self.nodes.get(key)
        if old == rec:
            return False
        if rec is None:
            del self.nodes[key]
        else:
            self.nodes[key] = rec
        self._ip_dirty |= self.reserved.set_node(old, rec)
        return True

    def set_local(self, addresses: Mapping[IPAddress, str]) -> bool:
        """Record this node's own addresses (address -> device, read from the kernel); False
        when nothing changed."""
        changed = self.reserved.set_local(addresses)
        self._ip_dirty |= changed
        return bool(changed)

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
        for key in self.nodes.keys() - objects.nodes.keys():
            self.set_node(key, None)
        for key, nrec in objects.nodes.items():
            self.set_node(key, nrec)
        self.set_problems(objects.problems)

    @property
    def pending(self) -> bool:
        """Whether a flush() has something to do (a held pod's time may be up)."""
        if self._dirty or self._ip_dirty or self._added or self._removed:
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
        keys = _keys(self._slices_of.get(key[0], {}), key[1])
        # one slice of one record (most Services): the list below, without its loops and sort
        if len(keys) == 1 and isinstance(r := self.slices.get(keys[0]), SliceRecord):
            return [r] if (r.ref.namespace, r.service) == key else []
        out = [
            r for sk in keys for r in self.slice_records(sk) if (r.ref.namespace, r.service) == key
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
        return any(pod in self._evals[k].moving() for k in _keys(self._claims, pod))

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
            for key in _keys(self._claims, ip):
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
        # a foreign LB IP, a Node's or this node's address appeared or went: the Services
        # that claim it are warned or refused anew; a held pod's time is up: its Services stop
        # learning
        ips, self._ip_dirty = self._ip_dirty, set()
        ips |= self._expire()
        for ip in ips:
            changed.update(_keys(self._claims, ip))
        addresses |= ips
        comp = self._component(changed, addresses)
        old_outputs = [self._outputs.pop(k) for k in comp if k in self._outputs]
        new_by_ref = _compose(
            (self._evals[k] for k in comp if k in self._evals),
            self._foreign_by_ip,
            self._held,
            self.reserved.why,
            self.guard_pps,
            self.max_pps,
        )
        for k in comp:  # keyed by the evaluations' keys (no new tuple per Service)
            e = self._evals.get(k)
            if e is not None:
                self._outputs[k] = new_by_ref[e.ref]
        for o in old_outputs:
            self._count(o.problems, -1)
        for o in new_by_ref.values():
            self._count(o.problems, +1)
        old, new = _state_of(old_outputs), _state_of(new_by_ref.values())
        d = diff(old, new) if old_outputs else whole(new)  # (new is only read after this)
        self._update_counts(old, -1)
        self._update_counts(new, +1)
        over = self.capacity is not None and self.capacity.full(self._counts) is not None
        before = self.state
        if over and before is self._full:
            before = before.copy()  # the maps held the whole state until this change
        self._full.apply(d)  # the same change on the whole unconstrained state, in place
        if over or before is not self._full:
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

    def backend_pods(self, key: Key, node: str | None = None) -> frozenset[Key]:
        """The pods (namespace, name) of the ready endpoints of the Service `key` while it is
        selected and usable, empty otherwise; with `node`, only those on that node (or of an
        endpoint without a nodeName). For the port-security check (cozyebpf/kube/portsec.py)."""
        rec = self.services.get(key)
        if rec is None or rec.service is None:
            return frozenset()
        return frozenset(
            (ns, name)
            for r in self._slice_records(key)
            for ns, name, on in r.pod_triples()
            if node is None or on in (node, "")
        )

    def views(self) -> list[ServiceView]:
        """Every selected Service as understood, sorted by namespace/name."""
        return sorted(
            (o.view for o in self._outputs.values() if o.view is not None), key=lambda v: v.ref
        )

    def result(self) -> ModelResult:
        """The whole result, as `build_state` gives it (for tests and tools)."""
        return ModelResult(self.state.copy(), self.views(), self.problems())
