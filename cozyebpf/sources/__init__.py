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
    #: when each change was made, in seconds since the epoch: an EndpointSlice's
    #: endpoints.kubernetes.io/last-change-trigger-time, else when it was received
    triggers: list[float] = field(default_factory=list)

    def touch(self, trigger: float | None = None) -> None:
        """Note one change: when it was made (`trigger`, epoch seconds), else now."""
        if self.since is None:
            self.since = time.monotonic()
        self.triggers.append(trigger if trigger is not None else time.time())

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
