"""The datapath interface: what the controller needs from a datapath, real or fake."""

from __future__ import annotations

from typing import Any, Protocol

from cozyebpf.state import MapDiff, MapState


class Datapath(Protocol):
    """A programmable datapath. `BpfDatapath` is the real one, `FakeDatapath` holds state in
    memory for controller tests."""

    def read_state(self) -> MapState:
        """What the maps hold now (the live state the controller diffs against)."""
        ...

    def apply(self, diff: MapDiff) -> None:
        """Apply `diff` without opening a hole: addresses that go away entirely first (room
        in a full map), allowed ports before the entries that need them, removals of allowed
        ports last. Raises DatapathError."""
        ...

    def dump(self) -> dict[str, Any]:
        """The whole state as JSON-ready data (the shape of `cozyebpf maps dump --json`)."""
        ...
