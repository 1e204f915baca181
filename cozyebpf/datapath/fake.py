"""An in-memory datapath for controller tests: holds a MapState and dumps it like the real one."""

from __future__ import annotations

from typing import Any

from cozyebpf.dump import build_dump
from cozyebpf.state import MapDiff, MapState, apply_to


class FakeDatapath:
    """Implements the Datapath protocol in memory.

    Tests may replace or mutate `state` to simulate drift (someone editing the maps), and set
    `fail_next_apply` to make the next apply() raise that exception without changing anything.
    """

    def __init__(self, state: MapState | None = None) -> None:
        self.state = state.copy() if state is not None else MapState()
        self.fail_next_apply: Exception | None = None

    def read_state(self) -> MapState:
        """A copy of the held state."""
        return self.state.copy()

    def apply(self, diff: MapDiff) -> None:
        """Apply `diff` (in the order of `state.apply_to`), or raise `fail_next_apply` once."""
        if self.fail_next_apply is not None:
            exc, self.fail_next_apply = self.fail_next_apply, None
            raise exc
        self.state = apply_to(self.state, diff)

    def dump(self) -> dict[str, Any]:
        """The held state in the shape of `cozyebpf maps dump --json` (no flows or counters)."""
        return build_dump(self.state, pin_dir="(fake)")
