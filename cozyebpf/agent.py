"""The agent loop: poll a source of desired state, run the model, sync the datapath.

Fail-static: when the source cannot be read (bad YAML, missing file) the datapath keeps its last
state; when programming fails, the next tick retries. A periodic resync re-applies the last
desired state, which repairs drift in the maps (entries deleted or changed by hand).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

from cozyebpf.controller import Controller
from cozyebpf.datapath import Datapath
from cozyebpf.errors import CozyError, SourceError
from cozyebpf.model import DEFAULT_PROXY_NAME, build_state
from cozyebpf.state import MapState

log = logging.getLogger(__name__)


class Source(Protocol):
    """A source of Kubernetes objects (the manifest file now; the API server later)."""

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
    ) -> None:
        self.source = source
        self.controller = Controller(datapath)
        self.proxy_name = proxy_name
        self.poll_interval = poll_interval
        self.resync_interval = resync_interval
        self.desired: MapState | None = None
        self._last_sync = 0.0
        self._source_error: str | None = None

    def tick(self) -> None:
        """One round: re-read the source if it changed, sync when there is something new or
        the resync interval has passed (or the last sync failed)."""
        now = time.monotonic()
        fresh = False
        if self.source.changed():
            try:
                objects = self.source.load()
            except SourceError as e:
                if str(e) != self._source_error:
                    log.error("%s", e)
                    self._source_error = str(e)
            else:
                self._source_error = None
                result = build_state(objects, self.proxy_name)
                self.controller.log_problems(result.problems)
                self.desired = result.state
                fresh = True
        if self.desired is None:
            return
        if fresh or now - self._last_sync >= self.resync_interval:
            try:
                self.controller.sync(self.desired)
            except CozyError as e:
                log.error("sync failed, retrying in %.0fs: %s", self.poll_interval, e)
                self._last_sync = 0.0  # retry on the next tick
                return
            self._last_sync = now

    def run(self, stop: threading.Event) -> None:
        log.info(
            "watching for changes every %.1fs, full resync every %.0fs",
            self.poll_interval,
            self.resync_interval,
        )
        while not stop.is_set():
            self.tick()
            stop.wait(self.poll_interval)
