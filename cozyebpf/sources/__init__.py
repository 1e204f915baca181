"""Sources of desired state (the Kubernetes API, a manifest file). Each reads its objects into
the model's records (`cozyebpf.model.read_object`) as they arrive and hands the agent only what
changed, keyed by object, coalesced until the agent takes it: a source never makes the agent
look at the whole cluster for one change."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from cozyebpf.model import (
    ForeignRecord,
    IncrementalModel,
    Key,
    NodeRecord,
    ObjectSet,
    ServiceRecord,
    SliceRecord,
)

#: objects whose changes' times are kept one by one (`Triggers`); the changes of any more
#: objects count as one, the oldest of them: 10,000 objects cost under 2 MB
TRIGGERS_MAX = 10_000
#: what a change without an object of its own counts as (a manifest read anew)
WHOLE: tuple[str, Key] = ("whole", ("", ""))
_OVERFLOW: tuple[str, Key] = ("overflow", ("", ""))


class Triggers:
    """When the changes not programmed yet were made (seconds since the epoch), the oldest per
    object (a kind and its namespace/name): the network programming latency of an object's
    changes is that of the one that waited longest, so however often an object changes before
    it is programmed (every API change while writes fail: a full map, a refused write), it
    costs one entry. At most `limit` objects are kept one by one; the others count as one, the
    oldest of their changes (the longest latency is never lost)."""

    __slots__ = ("limit", "times")

    def __init__(self, limit: int | None = None) -> None:
        self.limit = TRIGGERS_MAX if limit is None else limit
        self.times: dict[tuple[str, Key], float] = {}

    def add(self, obj: tuple[str, Key], trigger: float) -> None:
        """A change of `obj` made at `trigger`."""
        times = self.times
        old = times.get(obj)
        if old is None and len(times) >= self.limit:
            obj = _OVERFLOW
            old = times.get(obj)
        if old is None or trigger < old:
            times[obj] = trigger

    def update(self, other: Triggers) -> None:
        """Add `other`'s changes."""
        for obj, trigger in other.times.items():
            self.add(obj, trigger)

    def take(self) -> list[float]:
        """The times, oldest per object, and forget them."""
        out = list(self.times.values())
        self.times = {}
        return out

    def __len__(self) -> int:
        return len(self.times)


@dataclass
class ChangeSet:
    """Changes not yet taken, the newest per object: a record, or None for an object that is
    gone (or no longer ours). `whole` replaces everything (a manifest read anew)."""

    services: dict[Key, ServiceRecord | None] = field(default_factory=dict)
    foreign: dict[Key, ForeignRecord | None] = field(default_factory=dict)
    slices: dict[Key, tuple[SliceRecord, ...] | None] = field(default_factory=dict)
    nodes: dict[Key, NodeRecord | None] = field(default_factory=dict)
    whole: ObjectSet | None = None
    since: float | None = None  # time.monotonic() of the oldest change in the set
    #: when the changes were made, in seconds since the epoch, the oldest per object: an
    #: EndpointSlice's endpoints.kubernetes.io/last-change-trigger-time, else when it arrived
    triggers: Triggers = field(default_factory=Triggers)

    def touch(self, obj: tuple[str, Key] = WHOLE, trigger: float | None = None) -> None:
        """Note one change of `obj` (its kind and namespace/name): when it was made
        (`trigger`, epoch seconds), else now."""
        if self.since is None:
            self.since = time.monotonic()
        self.triggers.add(obj, trigger if trigger is not None else time.time())

    def __len__(self) -> int:
        return (
            len(self.services)
            + len(self.foreign)
            + len(self.slices)
            + len(self.nodes)
            + (self.whole is not None)
        )

    def record_into(self, model: IncrementalModel) -> int:
        """Record the changes in `model` (no computation yet); how many objects changed."""
        n = 0
        if self.whole is not None:
            before = model.pending
            model.replace(self.whole)
            n += int(model.pending and not before)
        for key, rec in self.services.items():
            n += model.set_service(key, rec)
        for key, frec in self.foreign.items():
            n += model.set_foreign(key, frec)
        for key, recs in self.slices.items():
            n += model.set_slices(key, recs)
        for key, nrec in self.nodes.items():
            n += model.set_node(key, nrec)
        return n


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside: for large batches of allocations (a whole
    manifest, a first list, a first model), where the collector's passes over every live
    object cost about as much as the work (0.2 of 0.44 s for 10k Services' model here). The
    objects made are mostly acyclic and freed by reference counting anyway."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class Notifier:
    """Wakes the agent when a source has something new (or when it is asked to stop)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._flag = False

    def notify(self) -> None:
        with self._cv:
            self._flag = True
            self._cv.notify_all()

    def wait(self, timeout: float) -> bool:
        """Block until notified (True) or `timeout` seconds passed (False); clears the flag."""
        with self._cv:
            if not self._flag:
                self._cv.wait(max(0.0, timeout))
            woke, self._flag = self._flag, False
            return woke


class Source(Protocol):
    """A source of objects for the agent."""

    def start(self, notify: Callable[[], None]) -> None:
        """Begin reading; call `notify` whenever there is something to take."""
        ...

    def stop(self) -> None: ...

    def take(self) -> ChangeSet | None:
        """The changes since the last take, or None while the source has never been read
        completely (the agent then changes nothing: fail-static)."""
        ...

    def alive(self) -> bool:
        """False when a thread of the source died (for /healthz)."""
        ...
