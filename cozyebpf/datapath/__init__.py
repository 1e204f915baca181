"""The datapath interface: what the controller and the agent need from a datapath, real or fake.

The datapath is the bottom layer: nothing in `cozyebpf.datapath` imports from above it (the
model, the sources, the agent, the CLI or the presentation modules;
tests/unit/test_controller.py holds it to that)."""

from __future__ import annotations

from typing import Protocol

from cozyebpf.state import Capacity, MapDiff, MapState


class Datapath(Protocol):
    """A programmable datapath. `BpfDatapath` is the real one; the labs' `FakeDatapath`
    (cozylab/fakedp.py) holds state in memory for controller and agent tests."""

    def read_state(self) -> MapState:
        """What the maps hold now (the live state the controller diffs against)."""
        ...

    def apply(self, diff: MapDiff) -> None:
        """Apply `diff` without opening a hole: addresses that go away entirely first (room
        in a full map), allowed ports before the entries that need them, removals of allowed
        ports last. Raises DatapathError."""
        ...

    def capacity(self) -> Capacity | None:
        """What the maps can hold, in the model's terms (None: no limit)."""
        ...

    def uncounted(self) -> tuple[set[str], int]:
        """The Services the maps hold without a counter slot of their own (every slot taken:
        --counted-services), which therefore have no counters and no limits of their own, and
        how many slots there are."""
        ...

    @property
    def attached(self) -> bool:
        """The programs are attached (the agent is ready and checks them)."""
        ...

    def check(self) -> list[str]:
        """Verify the attachments and repair what is wrong; what was repaired, one line each."""
        ...
