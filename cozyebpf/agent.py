"""The agent loop: take objects from a source, run the model, sync the datapath.

Fail-static: when the source cannot be read (bad YAML, API server not listed yet) the datapath
keeps its last state; when programming fails, the next tick retries. A periodic full resync
recomputes the desired state from the source and re-applies it, which repairs drift in the maps
(entries deleted or changed by hand).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from cozyebpf.controller import Controller
from cozyebpf.datapath import Datapath
from cozyebpf.errors import CozyError, SourceError
from cozyebpf.model import DEFAULT_PROXY_NAME, Problem, build_state
from cozyebpf.state import MapState

log = logging.getLogger(__name__)


class Source(Protocol):
    """A source of Kubernetes objects (a manifest file, the API server)."""

    def changed(self) -> bool: ...

    def load(self) -> list[dict[str, Any]]: ...


class Agent:
    def __init__(
        self,
        source: Source,
        datapath: Datapath,
        proxy_name: str = DEFAULT_PROXY_NAME,
        poll_interval: float = 1.0,
        resync_interval: float = 60.0,
        on_problems: Callable[[list[Problem]], None] | None = None,
        check_interval: float = 10.0,
    ) -> None:
        self.source = source
        self.controller = Controller(datapath)
        self.proxy_name = proxy_name
        self.poll_interval = poll_interval
        self.resync_interval = resync_interval
        self.on_problems = on_problems
        self.check_interval = check_interval
        self._last_check = time.monotonic()
        self.desired: MapState | None = None
        self.synced_once = False  # readiness: a complete source was programmed once
        self.last_tick = time.monotonic()
        self._last_sync = float("-inf")  # never: the first tick syncs
        self._source_error: str | None = None

    def _load(self) -> bool:
        """Read the source and run the model; False when the source cannot be read."""
        try:
            objects = self.source.load()
        except SourceError as e:
            if str(e) != self._source_error:
                log.error("%s", e)
                self._source_error = str(e)
            return False
        self._source_error = None
        result = build_state(objects, self.proxy_name)
        new = self.controller.log_problems(result.problems)
        if new and self.on_problems:
            self.on_problems(new)
        self.desired = result.state
        return True

    def tick(self) -> None:
        """One round: re-read the source if it changed (or a resync is due), and sync when
        there is something new, a resync is due, or the last sync failed. Every
        `check_interval` the datapath checks its attachments (re-attaching what is gone)."""
        now = time.monotonic()
        self.last_tick = now
        check = getattr(self.controller.datapath, "check", None)
        if check is not None and now - self._last_check >= self.check_interval:
            self._last_check = now
            try:
                check()
            except Exception as e:  # a failed check must not stop the loop
                log.error("checking the attachments failed: %s", e)
        resync_due = now - self._last_sync >= self.resync_interval
        fresh = False
        if self.source.changed() or (resync_due and self.desired is not None):
            fresh = self._load()
        if self.desired is None:
            return
        if fresh or resync_due:
            try:
                self.controller.sync(self.desired)
            except CozyError as e:
                log.error("sync failed, retrying in %.0fs: %s", self.poll_interval, e)
                self._last_sync = float("-inf")  # retry on the next tick
                return
            self._last_sync = now
            self.synced_once = True

    def run(self, stop: threading.Event) -> None:
        log.info(
            "syncing on every change (checked every %.1fs), full resync every %.0fs",
            self.poll_interval,
            self.resync_interval,
        )
        wait = getattr(self.source, "wait", None)
        while not stop.is_set():
            self.tick()
            if wait is not None:
                wait(self.poll_interval)  # returns early when the source changes
            else:
                stop.wait(self.poll_interval)

    def liveness(self) -> str | None:
        """None while the loop is turning; else why not (for /healthz)."""
        stalled = time.monotonic() - self.last_tick
        limit = max(30.0, 10 * self.poll_interval)
        if stalled > limit:
            return f"agent loop stalled for {stalled:.0f}s"
        alive = getattr(self.source, "alive", None)
        if alive is not None and not alive():
            return "a watch thread died"
        return None

    def readiness(self) -> str | None:
        """None once a complete desired state was programmed (for /readyz)."""
        return None if self.synced_once else "not synced yet"
