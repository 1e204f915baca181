"""Where a stop may land (issue 28, item 4).

`cozyebpf run` stops on SIGTERM and SIGINT by raising `Stopping` from the signal handler, so a
stop interrupts whatever the agent does (parsing 30,000 Services included) and takes effect at
once. Some work must not be cut in the middle: attaching the programs (egress on a device
without its ingress sends translated answers back to an LB IP that nobody translates), a batch
of map writes (an LB IP's entry without its pod's), the map migration at start. Those run in a
`section`: a signal that lands in one is held until the section ends, then raised, so the node
is left either as it was or with the whole of what the section does. The wait is bounded: a
section that takes longer than `bound` seconds after the signal (a hung syscall) is interrupted
anyway, with an error that says what may be left half-done and how to repair it.

Sections are entered by the main thread only, where Python runs signal handlers.

A stop is not an error: `Stopping` derives from BaseException, as KeyboardInterrupt does, so the
`except Exception` that keep the agent's loop going (a failed check, an observer that raised)
let it through, and only `cozyebpf run` catches it. Once raised, it is raised again by any
section entered later: nothing that a section guards (an attach, a map batch) starts after the
stop, even if code on the way swallowed it.
"""

from __future__ import annotations

import _thread
import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from typing import NoReturn

log = logging.getLogger(__name__)

#: seconds a stop waits for the section in progress: well under the chart's
#: terminationGracePeriodSeconds (30), far above an attach (milliseconds) or a map batch
#: (10,000 Services: 0.20 s, bench/README.md)
STOP_WAIT = 10.0


class Stopping(BaseException):
    """Raised in the main thread to leave whatever the agent is doing (a stop was asked). A
    BaseException: no `except Exception` takes it for an error."""


def _interrupt_main() -> None:
    _thread.interrupt_main(signal.SIGTERM)  # the handler runs again, in the main thread


class SafePoints:
    """Holds a stop asked for inside a `section` until the section ends (at most `bound`
    seconds); outside any section, `request_stop` raises `Stopping` at once."""

    def __init__(
        self, bound: float = STOP_WAIT, interrupt: Callable[[], None] = _interrupt_main
    ) -> None:
        self.bound = bound
        self._interrupt = interrupt
        self._sections: list[str] = []  # what runs now, outermost first
        self.pending = False  # a stop was asked inside a section, not raised yet
        self.forced = False  # the bound passed: the next request interrupts the section
        self.stopped = False  # Stopping was raised: no section runs any more
        self._timer: threading.Timer | None = None

    @property
    def inside(self) -> str | None:
        """The section running now (the innermost), or None."""
        return self._sections[-1] if self._sections else None

    @contextlib.contextmanager
    def section(self, what: str) -> Iterator[None]:
        """Run the body whole: a stop asked meanwhile raises `Stopping` when it is done (an
        error in the body propagates as it is). After a stop, the body does not run."""
        if self.stopped:
            log.debug("not %s: stopping", what)
            raise Stopping
        self._sections.append(what)
        try:
            yield
        finally:
            self._sections.pop()
        if not self._sections and self.pending:
            log.info("%s done; stopping", what)
            self._raise()

    def request_stop(self) -> None:
        """From the signal handler: raise `Stopping` now, outside any section (or once the
        bound has passed); inside one, return and raise it when the section ends."""
        if not self._sections or self.forced:
            self._raise()
        if self.pending:
            return
        self.pending = True
        log.info("stopping once %s is done (waiting at most %.0fs)", self.inside, self.bound)
        self._timer = threading.Timer(self.bound, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _raise(self) -> NoReturn:
        self._cancel_timer()
        self.pending = False
        self.stopped = True
        raise Stopping

    def _expire(self) -> None:
        if not self._sections:
            return
        self.forced = True
        log.error(
            "%s did not finish within %.0fs of the stop; interrupting it: the node may hold "
            "part of it (start the agent again, or remove the datapath with `cozyebpf detach`)",
            self.inside,
            self.bound,
        )
        self._interrupt()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
