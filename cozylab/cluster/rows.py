"""The lab's result rows and the table they come from. Each scenario declares its rows once:
a `Case` (scenario, name, the check that decides it), in a `Group` of cases that run together
(concurrently, or around a setup such as a migration that the checks then read). The runner
(`run_groups`) and the plan (`planned_cases`) read the same table, so a row's name is written
in one place, beside the code that decides it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from cozylab.traffic import describe

Check = tuple[bool, str]  # PASS?, what the peers saw


@dataclass(frozen=True)
class Row:
    scenario: str
    case: str
    layout: str
    ok: bool
    detail: str

    @property
    def result(self) -> str:
        return "PASS" if self.ok else "FAIL"


@dataclass(frozen=True)
class Case:
    scenario: str
    name: str
    check: Callable[[], Check]


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


@dataclass(frozen=True)
class Group:
    """Cases that run together: `around` is entered before the first check and left after the
    last (a setup, or a run whose results the checks read); `workers` > 1 runs the checks
    concurrently."""

    cases: Sequence[Case]
    around: Callable[[], contextlib.AbstractContextManager[object]] = field(default=_nothing)
    workers: int = 1


def _decide(case: Case, layout: str) -> Row:
    try:
        ok, detail = case.check()
    except Exception as e:
        ok, detail = False, f"error: {describe(e)}"
    return Row(case.scenario, case.name, layout, ok, detail)


def run_group(group: Group, layout: str) -> list[Row]:
    """One row per case, in the group's order; a failed setup fails each of its rows."""
    try:
        with group.around():
            if group.workers > 1:
                with ThreadPoolExecutor(group.workers) as pool:
                    return list(pool.map(lambda c: _decide(c, layout), group.cases))
            return [_decide(c, layout) for c in group.cases]
    except Exception as e:  # in the setup: its message says what (a timeout's what it awaited)
        said = f"error: {type(e).__name__}: {e}"
        return [Row(c.scenario, c.name, layout, False, said) for c in group.cases]


def run_groups(groups: Sequence[Group], layout: str) -> list[Row]:
    return [row for g in groups for row in run_group(g, layout)]


def names(groups: Sequence[Group]) -> list[tuple[str, str]]:
    """(scenario, name) of every case, in the order they run."""
    return [(c.scenario, c.name) for g in groups for c in g.cases]
