"""The agent loop: take what changed from a source, update the incremental model, write the
difference to the datapath.

- A change is applied as soon as the loop is free: the loop sleeps until a source notifies it
  (or a timer is due), takes every change that arrived meanwhile (they coalesce while a sync
  runs), recomputes only what they touch and writes only their entries. There is no fixed
  debounce.
- A full resync (read the maps, diff against the whole desired state, repair drift) runs when
  the source is first complete, every `resync_interval`, and after a failed write, retried
  with a growing delay (1 s doubling up to `resync_interval`), never in a tight loop.
- Fail-static: nothing is written before the source has been read completely once; a source
  that cannot be read keeps the last state programmed.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cozyebpf.controller import Controller
from cozyebpf.datapath import Datapath
from cozyebpf.errors import CozyError
from cozyebpf.model import DEFAULT_PROXY_NAME, Delta, IncrementalModel, Key, ObjectRef, Problem
from cozyebpf.model.limits import describe
from cozyebpf.sources import ChangeSet, Notifier, Source, Triggers, gc_paused
from cozyebpf.state import IPAddress, Limits, MapDiff, address_key

if TYPE_CHECKING:
    from cozyebpf.kube.portsec import PortSecurity
    from cozyebpf.memlimit import MemoryWatch
    from cozyebpf.sources.local import LocalAddresses
    from cozyebpf.state import IPNetwork

log = logging.getLogger(__name__)

_LEVELS = {"warning": logging.WARNING, "error": logging.ERROR}
RETRY_FIRST = 1.0  # seconds before the first retry of a failed sync (then doubling)


@dataclass(frozen=True)
class SyncReport:
    """One write to the maps (or one change that needed none): for metrics and `status`.
    `latencies` are the network programming durations of the changes it covered, one per
    object changed: from when its oldest change not programmed before was made (an
    EndpointSlice's last-change-trigger-time, else when it arrived) to the end of the write
    (sources.Triggers: bounded while writes fail)."""

    kind: str  # "full" (the full resync) or "change"
    duration: float  # seconds the write took (model, diff and maps)
    latencies: tuple[float, ...]
    ok: bool


@dataclass
class AgentStats:
    """Counters of what the agent did; plain values, read by other threads."""

    syncs: int = 0  # successful writes, full or incremental
    full_syncs: int = 0
    sync_errors: int = 0
    last_sync: float | None = None  # time.time() at the end of the last successful write
    last_sync_duration: float | None = None
    last_full_sync: float | None = None


#: glibc's M_MMAP_THRESHOLD for the agent (tune_malloc)
MMAP_THRESHOLD = 256 * 1024


def tune_malloc() -> None:
    """glibc gives each thread that allocates its own malloc arena (up to 8 per core), and
    memory freed in one is not reused by another: the watch threads' JSON parsing would keep
    tens of MB resident. Two arenas are plenty for this agent (M_ARENA_MAX, before any thread
    starts). And a block of 256 KiB or more (the tables of the dicts and sets of every
    Service, a batch's buffer) is mapped on its own and unmapped when freed (M_MMAP_THRESHOLD;
    glibc's own threshold rises to the largest block freed, up to 32 MiB, after which such
    blocks stay in the heap until a trim): at 100,000 Services a cold start's peak was 20 MB
    higher without it (issue 48). MALLOC_ARENA_MAX and MALLOC_MMAP_THRESHOLD_ in the
    environment win."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
        if "MALLOC_ARENA_MAX" not in os.environ:
            libc.mallopt(-8, 2)  # M_ARENA_MAX
        if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
            libc.mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD


def release_memory() -> None:
    """Give memory freed by a large piece of work (the first list or file, the first sync)
    back to the system: a collection, then glibc's malloc_trim, which returns the free pages
    of every malloc arena (threads that parsed API lists leave theirs fragmented). What is left
    is frozen (`freeze_heap`)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)
    freeze_heap(collected=True)


def freeze_heap(collected: bool = False) -> None:
    """Move every object alive now out of the collector's sight (gc.freeze), after a large
    batch: the caches of 70,000 Services are 1.8 million objects, a full collection over them
    took 1.4-1.6 s (0.0 frozen), and Python runs a signal handler only after it, so a SIGTERM
    that landed during one waited for it (3.1 s once). Frozen objects are still freed by
    reference counting, which frees the caches (acyclic records and dicts); only a cycle made
    before the freeze and dropped later stays.

    A collection comes first (unless the caller just ran one: `collected`): cycles that are
    already garbage (the batch ran with the collector paused) would otherwise be frozen for
    good, a leak under the memory limit at every large batch (issue 28). It walks only what
    is not frozen yet, the objects since the last freeze."""
    if not collected:
        gc.collect()
    gc.freeze()


def own_limits(limits: Limits) -> bool:
    """Has a Service limits of its own (its annotations'), not only the node's guard?"""
    own_pps = limits.ingress_pps is not None and not limits.guard
    return limits.ingress_bps is not None or limits.egress_bps is not None or own_pps


class Agent:
    def __init__(
        self,
        source: Source,
        datapath: Datapath,
        proxy_name: str = DEFAULT_PROXY_NAME,
        resync_interval: float = 60.0,
        on_problems: Callable[[list[Problem]], None] | None = None,
        check_interval: float = 10.0,
        retry_delay: float = RETRY_FIRST,
        clock: Callable[[], float] = time.monotonic,
        portsec: PortSecurity | None = None,
        unverified: Sequence[str] = (),
        local: LocalAddresses | None = None,
        reserved_cidrs: Sequence[IPNetwork] = (),
        guard_pps: int | None = None,
        max_pps: int | None = None,
        memory: MemoryWatch | None = None,
    ) -> None:
        self.source = source
        #: the agent's memory against its cgroup's limit (None: not checked, for tests)
        self.memory = memory
        self._memory_problem: Problem | None = None
        #: this node's addresses, followed in the kernel (None: not checked, for tests)
        self.local = local
        if local is not None:
            local.notify = self.notify
        #: the port security of the backend pods behind a shared pod-facing device (None: no
        #: such device, or no API to read pods from); its Problems join the model's
        self.portsec = portsec
        #: the pod-facing devices behind which source addresses are not verified (ovn0)
        self.unverified = tuple(unverified)
        if portsec is not None:
            portsec.notify = self.notify
        self.clock = clock  # monotonic seconds, for every timer (tests drive their own)
        self.controller = Controller(datapath)
        self.model = IncrementalModel(
            proxy_name,
            datapath.capacity(),
            clock=clock,
            reserved_cidrs=reserved_cidrs,
            guard_pps=guard_pps,
            max_pps=max_pps,
        )
        self.resync_interval = resync_interval
        self.on_problems = on_problems
        self.check_interval = check_interval
        self.notifier = Notifier()
        self._next_check = self.clock() + check_interval
        self._next_memory_check = self.clock()  # at the first tick, then every check_interval
        self.synced_once = False  # readiness: a complete source was programmed once
        self.last_tick = self.clock()
        self._resync_at = 0.0  # the first complete source is synced at once
        self.retry_first = retry_delay
        self._retry_delay = retry_delay
        self._last_error: str | None = None
        self.stats = AgentStats()
        #: called after every write (and every change that needed none), in the loop's thread
        self.on_sync: list[Callable[[SyncReport], None]] = []
        #: when the changes not programmed yet were made (epoch seconds), the oldest per
        #: object, bounded (Triggers): kept while writes fail, for the write that succeeds
        self._triggers = Triggers()
        #: the open Problems of Services whose own limits have no counter slot (_check_counted)
        self._uncounted: dict[str, Problem] = {}

    @property
    def syncs(self) -> int:
        """Successful writes to the maps (full or incremental)."""
        return self.stats.syncs

    def _done(self, kind: str, started: float, ok: bool, wrote: bool = True) -> None:
        """Account for one write (`wrote`: False for changes that needed none) or failure,
        and tell the observers."""
        duration = self.clock() - started
        latencies: tuple[float, ...] = ()
        st = self.stats
        if ok:
            wall = time.time()
            latencies = tuple(max(0.0, wall - t) for t in self._triggers.take())
            if wrote:
                st.syncs += 1
                st.last_sync, st.last_sync_duration = wall, duration
                if kind == "full":
                    st.full_syncs += 1
                    st.last_full_sync = wall
        else:
            st.sync_errors += 1
        if ok and not wrote and not latencies:
            return
        report = SyncReport(kind, duration, latencies, ok)
        for fn in self.on_sync:
            self._tell(fn, report)

    @staticmethod
    def _tell(fn: Callable[[SyncReport], None], report: SyncReport) -> None:
        try:
            fn(report)
        except Exception as e:  # an observer must not stop the loop
            log.error("sync observer failed: %s", e)

    def notify(self) -> None:
        """Wake the loop (a source has changes)."""
        self.notifier.notify()

    def _report(self, added: list[Problem], removed: list[Problem]) -> None:
        for p in added:
            log.log(_LEVELS.get(p.severity, logging.WARNING), "%s", p)
        for p in removed:
            log.debug("resolved: %s", p)
        if added and self.on_problems:
            self.on_problems(added)

    def problems(self) -> list[Problem]:
        """Every open Problem: the model's, the port-security check's and the counter slots'
        (sorted)."""
        extra = self.portsec.problems() if self.portsec is not None else []
        extra += self._uncounted.values()
        if self._memory_problem is not None:
            extra.append(self._memory_problem)
        return sorted([*self.model.problems(), *extra]) if extra else self.model.problems()

    def _check_counted(self) -> None:
        """After a write: a Service with limits of its own that the datapath holds without a
        counter slot (every slot taken: --counted-services) has them not enforced (its buckets
        live in its slot): a Problem naming the Service, its limits and the fix, resolved once
        it has a slot (a resync gives it one a Service left) or no limit of its own."""
        missing, slots = self.controller.datapath.uncounted()
        limits = self.model.state.limits
        now: dict[str, Problem] = {}
        for service in sorted(missing):
            lim = limits.get(service)
            if lim is None or not own_limits(lim):
                continue
            namespace, _, name = service.partition("/")
            now[service] = Problem(
                ObjectRef("Service", namespace, name),
                f"has limits of its own ({describe(lim)}) that are not enforced: a Service's "
                f"limits live in its per-Service counter slot, and all {slots} of this node's "
                "are taken; raise --counted-services (the chart's agent.countedServices) above "
                "the number of Services",
            )
        added = [p for k, p in now.items() if self._uncounted.get(k) != p]
        removed = [p for k, p in self._uncounted.items() if now.get(k) != p]
        self._uncounted = now
        if added or removed:
            self._report(added, removed)

    def _touched(self, changes: ChangeSet) -> set[Key] | None:
        """The Services whose record or EndpointSlices `changes` change (None: every one);
        before they are recorded in the model (a slice's Service before and after)."""
        if changes.whole is not None:
            return None
        keys = set(changes.services)
        for key, recs in changes.slices.items():
            for r in (*self.model.slice_records(key), *(recs or ())):
                keys.add((r.ref.namespace, r.service))
        return keys

    def _check_pods(self, ps: PortSecurity, touched: set[Key] | None) -> None:
        """Hand the backend pods of the `touched` Services to the port-security check; report
        the Problems it found since the last turn."""
        keys = touched if touched is not None else self.model.services.keys() | ps.services()
        for key in keys:
            ps.set_backends(key, self.model.backend_pods(key, ps.node))
        self._report(*ps.take())

    def _report_moves(self, before: frozenset[IPAddress], after: frozenset[IPAddress]) -> None:
        for pod in sorted(after - before, key=address_key):
            log.info(
                "pod %s moved to another node (a live migration): TCP to it that opens no "
                "connection passes its port filter until %.0fs after its last move, so that "
                "the flows it opened on the node it left go on (pass_learn)",
                pod,
                self.model.hold,
            )
        for pod in sorted(before - after, key=address_key):
            log.info("pod %s is settled: its port filter is strict again", pod)

    def _check_memory(self) -> None:
        """The memory against the cgroup's limit (memlimit.py): a Problem on the Node above
        85 %, resolved below 80 %."""
        if self.memory is None:
            return
        try:
            p = self.memory.check(len(self.model.services))
        except Exception as e:  # a failed read must not stop the loop
            log.error("reading the agent's memory and its limit failed: %s", e)
            return
        old, self._memory_problem = self._memory_problem, p
        if p != old:
            self._report([p] if p else [], [old] if old else [])

    def _check(self, now: float) -> None:
        if now >= self._next_memory_check:
            self._next_memory_check = now + self.check_interval
            self._check_memory()
        datapath = self.controller.datapath
        if not datapath.attached or now < self._next_check:
            return
        self._next_check = now + self.check_interval
        try:
            datapath.check()
        except Exception as e:  # a failed check must not stop the loop (a stop held by the
            # check's section is raised at its end: Stopping is no Exception, it passes)
            log.error("checking the attachments failed: %s", e)

    def _failed(self, now: float, what: str, e: CozyError) -> None:
        """Schedule a full resync after a growing delay; log each distinct error once."""
        self._resync_at = now + self._retry_delay
        if str(e) != self._last_error:
            log.error("%s failed, full resync in %.0fs: %s", what, self._retry_delay, e)
            self._last_error = str(e)
        else:
            log.debug("%s failed again, full resync in %.0fs: %s", what, self._retry_delay, e)
        self._retry_delay = min(self._retry_delay * 2, max(self.retry_first, self.resync_interval))

    def tick(self) -> None:
        """One round: take the source's changes, update the model, write what changed (or run
        the full resync when it is due); check the attachments every `check_interval`."""
        now = self.clock()
        self.last_tick = now
        self._check(now)
        if self.local is not None:
            addresses = self.local.take()
            if addresses is not None:
                self.model.set_local(addresses)
        changes = self.source.take()
        if changes is None:  # never read completely: change nothing (fail-static)
            return
        self._triggers.update(changes.triggers)
        big = changes.whole is not None or len(changes) > 1000
        held = self.model.held
        ps = self.portsec
        first = not self.synced_once
        # the collector paused for a large batch; for the cold start until release_memory's
        # one collection after the first sync (each time the collector came back in between,
        # it ran full passes over every record just made: about a second at 100,000 Services)
        paused = contextlib.ExitStack()
        if big or first:
            paused.enter_context(gc_paused())
        with paused:
            touched = self._touched(changes) if ps is not None else set()
            changes.record_into(self.model)
            delta = self.model.flush() if self.model.pending else None
            if not first:
                paused.close()
                if big:
                    freeze_heap()
            self._program(now, delta, held, ps, touched)

    def _program(
        self,
        now: float,
        delta: Delta | None,
        held: frozenset[IPAddress],
        ps: PortSecurity | None,
        touched: set[Key] | None,
    ) -> None:
        """Report what `delta` said and write it (or the full resync, when it is due)."""
        if delta is not None:
            self._report(delta.problems_added, delta.problems_removed)
            self._report_moves(held, self.model.held)
        if ps is not None:
            self._check_pods(ps, touched)
        if now >= self._resync_at:
            # the full sync writes the change too: its dicts go first (a cold start's is a
            # copy of the whole state, which the sync's own diff is once more)
            if delta is not None:
                delta.diff = MapDiff()
            try:
                self.controller.sync(self.model.state)
            except CozyError as e:
                self._done("full", now, False)
                self._failed(now, "sync", e)
                return
            self._done("full", now, True)
            self._check_counted()
            if not self.synced_once:
                self.synced_once = True
                release_memory()
            self._resync_at = now + self.resync_interval
            self._retry_delay = self.retry_first
            self._last_error = None
        elif self.controller.in_sync and delta is not None:
            try:
                self.controller.apply(delta, self.model.state)
            except CozyError as e:
                self._done("change", now, False)
                self._failed(now, "programming a change", e)
                return
            self._done("change", now, True, wrote=not delta.diff.empty())
            if not delta.diff.empty():
                self._check_counted()

    def next_timer(self) -> float:
        """Seconds until the loop must turn without a notification."""
        now = self.clock()
        held = self.model.next_deadline()  # on the same clock
        due = min(self._resync_at, self._next_check, math.inf if held is None else held)
        return max(0.0, due - now)

    def run(self, stop: threading.Event, idle: float = 1.0) -> None:
        """Turn until `stop` is set (a signal handler also calls notify() to wake us); wake at
        least every `idle` seconds (for /healthz)."""
        log.info(
            "syncing on every change, full resync every %.0fs, attachments checked every %.0fs",
            self.resync_interval,
            self.check_interval,
        )
        while not stop.is_set():
            self.tick()
            if stop.is_set():
                break
            self.notifier.wait(min(idle, self.next_timer()))

    def liveness(self) -> str | None:
        """None while the loop is turning; else why not (for /healthz)."""
        stalled = self.clock() - self.last_tick
        if stalled > 30.0:
            return f"agent loop stalled for {stalled:.0f}s"
        if not self.source.alive():
            return "a watch thread died"
        if self.local is not None and not self.local.alive():
            return "the thread that follows the node's addresses died"
        return None

    def readiness(self) -> str | None:
        """None once a complete desired state was programmed and the programs are attached
        (for /readyz)."""
        if not self.synced_once:
            return "not synced yet"
        if not self.controller.datapath.attached:
            return "programs not attached yet"
        return None
