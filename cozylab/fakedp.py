"""An in-memory datapath for controller and agent tests: holds a MapState."""

from __future__ import annotations

from cozyebpf.errors import DatapathError
from cozyebpf.state import Capacity, IPAddress, MapDiff, MapState, apply_to


class FakeDatapath:
    """Implements the Datapath protocol in memory, both address families in one MapState.

    Tests may replace or mutate `state` to simulate drift (someone editing the maps), set
    `flows` (pod IP -> number of flow entries) for a dump, `limits` for capacity(), `counted`
    for uncounted(), `attached`
    for the agent's readiness, `fail_next_apply` to make the next apply() raise that
    exception without changing anything, and `failing` to make every apply() raise it while
    it is set (a full map). Like the real datapath, apply() refuses a diff whose
    entries mix address families. `cozyebpf.dump.build_dump(fake.state, fake.flows)` dumps it
    like the real one.
    """

    def __init__(self, state: MapState | None = None, limits: Capacity | None = None) -> None:
        self.state = state.copy() if state is not None else MapState()
        self.flows: dict[IPAddress, int] = {}
        self.limits = limits
        self.attached = True
        self.checks = 0  # check() calls
        self.fail_next_apply: Exception | None = None
        self.failing: Exception | None = None
        self.reads = 0  # read_state() calls: a change must be written without one
        self.applies: list[MapDiff] = []  # every diff applied (or refused), in order
        #: how many Services have counter slots (uncounted(); None: all)
        self.counted: int | None = None

    def read_state(self) -> MapState:
        """A copy of the held state."""
        self.reads += 1
        return self.state.copy()

    def apply(self, diff: MapDiff) -> None:
        """Apply `diff` (in the order of `state.apply_to`), or raise `fail_next_apply` once,
        or `failing`; DatapathError, changing nothing, if an entry of `diff` mixes address
        families."""
        self.applies.append(diff)
        if self.fail_next_apply is not None:
            exc, self.fail_next_apply = self.fail_next_apply, None
            raise exc
        if self.failing is not None:
            raise self.failing
        errors = diff.family_errors()
        if errors:
            raise DatapathError(
                f"refusing to program maps in (fake): an entry mixes address families "
                f"({'; '.join(errors)})"
            )
        self.state = apply_to(self.state, diff)

    def capacity(self) -> Capacity | None:
        return self.limits

    def uncounted(self) -> tuple[set[str], int]:
        """The Services of the state beyond the first `counted` (by name; None: every one
        counted), and `counted`."""
        names = sorted({e.service for e in self.state.services.values() if e.service})
        if self.counted is None:
            return set(), len(names)
        return set(names[self.counted :]), self.counted

    def check(self) -> list[str]:
        self.checks += 1
        return []
