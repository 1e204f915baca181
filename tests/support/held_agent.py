"""`python -m tests.support.held_agent ARM <cozyebpf arguments>`: cozyebpf as `python -m
cozyebpf` runs it, with one seam for tests/datapath/test_stop_points.py, so that a signal lands
inside a given section of the agent (cozyebpf.safepoint), not at a random moment.

Once the file ARM exists and holds a section's name (e.g. "checking the attachments"), the
next time the agent enters that section the seam removes ARM, prints `held-agent: held in
<section>` and waits, inside the section, until a stop is asked (the test's SIGTERM, whose
handler runs in this wait); then the section's body runs as the agent would run it. While it
waits, every wake-up of the agent by a source (the manifest's watch thread handing over a
change) prints `held-agent: notified`, so the test knows a change is there to take before it
signals.

Nothing of the agent is replaced: the seam wraps SafePoints.section and Notifier.notify and
calls them.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator

from cozyebpf.cli import main
from cozyebpf.safepoint import SafePoints
from cozyebpf.sources import Notifier

HOLD_BOUND = 120.0  # seconds a held section waits for the stop (a test that never signals)


def _say(line: str) -> None:
    sys.stderr.write(f"held-agent: {line}\n")
    sys.stderr.flush()


def install(arm: str) -> None:
    section = SafePoints.section
    notify = Notifier.notify
    holding = [False]

    @contextlib.contextmanager
    def held_section(self: SafePoints, what: str) -> Iterator[None]:
        with section(self, what):
            if _armed(arm, what):
                holding[0] = True
                _say(f"held in {what}")
                deadline = time.monotonic() + HOLD_BOUND
                while not self.pending:  # the signal handler sets it, in this loop
                    if time.monotonic() > deadline:
                        _say("no stop came")
                        os._exit(3)
                    time.sleep(0.005)
                _say(f"stop asked in {what}; its body runs")
                holding[0] = False
            yield

    def noted_notify(self: Notifier) -> None:
        if holding[0]:
            _say("notified")
        notify(self)

    SafePoints.section = held_section  # type: ignore[method-assign,assignment]
    Notifier.notify = noted_notify  # type: ignore[method-assign]


def _armed(arm: str, what: str) -> bool:
    try:
        with open(arm) as f:
            if f.read().strip() != what:
                return False
        os.unlink(arm)
    except FileNotFoundError:
        return False
    return True


if __name__ == "__main__":
    install(sys.argv[1])
    main(args=sys.argv[2:], prog_name="cozyebpf")
