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
import threading
import time
from collections.abc import Callable

from cozyebpf.controller import Controller
from cozyebpf.datapath import Datapath
from cozyebpf.errors import CozyError
from cozyebpf.model import DEFAULT_PROXY_NAME, Delta, IncrementalModel, Problem
from cozyebpf.sources import Notifier, Source
from cozyebpf.state import Capacity

log = logging.getLogger(__name__)

_LEVELS = {"warning": logging.WARNING, "error": logging.ERROR}
RETRY_FIRST = 1.0  # seconds before the first retry of a failed sync (then doubling)


def release_memory() -> None:
    """Give memory freed by a large piece of work (the first list or file, the first sync)
    back to the system: a collection, then glibc's malloc_trim, which returns the free pages
    of every malloc arena (threads that parsed API lists leave theirs fragmented)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


class Agent:
    def __init__(
        self,
        source: Source,
        datapath: Datapath,
        proxy_name: str = DEFAULT_PROXY_NAME,
        resync_interval: float = 60.0,
        on_problems: Callable[[list[Problem]], None] | None = None,
        check_interval: float = 10.0,
        capacity: Capacity | None = None,
        retry_delay: float = RETRY_FIRST,
    ) -> None:
        self.source = source
        self.controller = Controller(datapath)
        self.model = IncrementalModel(proxy_name, capacity)
        self.resync_interval = resync_interval
        self.on_problems = on_problems
        self.check_interval = check_interval
        self.notifier = Notifier()
        self._next_check = time.monotonic() + check_interval
        self.synced_once = False  # readiness: a complete source was programmed once
        self.last_tick = time.monotonic()
        self._resync_at = 0.0  # the first complete source is synced at once
        self.retry_first = retry_delay
        self._retry_delay = retry_delay
        self._last_error: str | None = None
        self.syncs = 0  # writes to the maps (full or incremental), for tests and logs

    def notify(self) -> None:
        """Wake the loop (a source has changes)."""
        self.notifier.notify()

    def _report(self, delta: Delta) -> None:
        for p in delta.problems_added:
            log.log(_LEVELS.get(p.severity, logging.WARNING), "%s", p)
        for p in delta.problems_removed:
            log.debug("resolved: %s", p)
        if delta.problems_added and self.on_problems:
            self.on_problems(delta.problems_added)

    def _check(self, now: float) -> None:
        check = getattr(self.controller.datapath, "check", None)
        attached = getattr(self.controller.datapath, "attached", True)
        if check is None or not attached or now < self._next_check:
            return
        self._next_check = now + self.check_interval
        try:
            check()
        except Exception as e:  # a failed check must not stop the loop
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
        now = time.monotonic()
        self.last_tick = now
        self._check(now)
        changes = self.source.take()
        if changes is None:  # never read completely: change nothing (fail-static)
            return
        changes.record_into(self.model)
        delta = self.model.flush() if self.model.pending else None
        if delta is not None:
            self._report(delta)
        if now >= self._resync_at:
            try:
                self.controller.sync(self.model.state)
            except CozyError as e:
                self._failed(now, "sync", e)
                return
            self.syncs += 1
            if not self.synced_once:
                self.synced_once = True
                release_memory()
            self._resync_at = now + self.resync_interval
            self._retry_delay = self.retry_first
            self._last_error = None
        elif delta is not None and not delta.diff.empty() and self.controller.in_sync:
            try:
                self.controller.apply(delta, self.model.state)
            except CozyError as e:
                self._failed(now, "programming a change", e)
                return
            self.syncs += 1

    def next_timer(self) -> float:
        """Seconds until the loop must turn without a notification."""
        now = time.monotonic()
        return max(0.0, min(self._resync_at, self._next_check) - now)

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
        stalled = time.monotonic() - self.last_tick
        if stalled > 30.0:
            return f"agent loop stalled for {stalled:.0f}s"
        if not self.source.alive():
            return "a watch thread died"
        return None

    def readiness(self) -> str | None:
        """None once a complete desired state was programmed and the programs are attached
        (for /readyz)."""
        if not self.synced_once:
            return "not synced yet"
        if not getattr(self.controller.datapath, "attached", True):
            return "programs not attached yet"
        return None
