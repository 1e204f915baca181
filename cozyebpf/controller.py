"""The controller: makes the datapath hold the desired MapState, and reports model Problems.

Each sync reads the live maps, so it also repairs drift: an entry someone deleted is written
again, an entry nobody wants is removed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from cozyebpf.datapath import Datapath
from cozyebpf.model import Problem
from cozyebpf.state import MapDiff, MapState, diff

_LEVELS = {"warning": logging.WARNING, "error": logging.ERROR}


def _counts(state: MapState) -> str:
    return (
        f"{len(state.services)} services, {len(state.pods)} pods, "
        f"{len(state.allowed)} allowed ports"
    )


def summarize(live: MapState, d: MapDiff, desired: MapState) -> str:
    """One line on what applying `d` to `live` programs, e.g. `programmed: services +1 ~0 -0,
    pods +1 ~0 -0, allowed ports +3 -0; now 4 services, 4 pods, 9 allowed ports`."""
    s_new = sum(1 for k in d.services_set if k not in live.services)
    p_new = sum(1 for k in d.pods_set if k not in live.pods)
    return (
        f"programmed: services +{s_new} ~{len(d.services_set) - s_new} -{len(d.services_del)}, "
        f"pods +{p_new} ~{len(d.pods_set) - p_new} -{len(d.pods_del)}, "
        f"allowed ports +{len(d.allowed_add)} -{len(d.allowed_del)}; now {_counts(desired)}"
    )


class ProblemLog:
    """Logs each Problem once: only those that were not in the previous call's list, so a
    source re-read every second does not repeat a warning. A Problem that goes away and comes
    back is logged again."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self._seen: set[Problem] = set()

    def log_problems(self, problems: Iterable[Problem]) -> list[Problem]:
        """Log the new ones (at WARNING, or ERROR for severity "error") as `<ref>: <message>`;
        return them."""
        current = set(problems)
        new = sorted(current - self._seen)
        for p in new:
            self.log.log(_LEVELS.get(p.severity, logging.WARNING), "%s", p)
        self._seen = current
        return new


class Controller:
    """Syncs a Datapath to a desired MapState."""

    def __init__(self, datapath: Datapath, log: logging.Logger | None = None) -> None:
        self.datapath = datapath
        self.log = log if log is not None else logging.getLogger("cozyebpf.controller")
        self.problem_log = ProblemLog(self.log)

    def sync(self, desired: MapState) -> MapDiff:
        """Diff the live maps against `desired` and apply the difference; return the diff.

        Logs one INFO line when something was programmed (DEBUG when already in sync).
        Exceptions from the datapath propagate; the next sync starts again from the live maps.
        """
        live = self.datapath.read_state()
        d = diff(live, desired)
        if d.empty():
            self.log.debug("in sync: %s", _counts(desired))
            return d
        self.datapath.apply(d)
        self.log.info("%s", summarize(live, d, desired))
        return d

    def log_problems(self, problems: Iterable[Problem]) -> list[Problem]:
        """Log the Problems not logged by the previous call (see ProblemLog); return them."""
        return self.problem_log.log_problems(problems)


_problem_logs: dict[logging.Logger, ProblemLog] = {}


def log_problems(log: logging.Logger, problems: Iterable[Problem]) -> list[Problem]:
    """`ProblemLog.log_problems` with one ProblemLog per logger, kept for the process's life;
    prefer `Controller.log_problems` or an own ProblemLog where the memory should be scoped."""
    return _problem_logs.setdefault(log, ProblemLog(log)).log_problems(problems)
