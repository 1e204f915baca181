"""What tests do with a MapState that the product never needs."""

from __future__ import annotations

from cozyebpf.state import MapState


def of_family(state: MapState, version: int) -> MapState:
    """The entries of one family (4 or 6), as a new state."""
    return MapState(
        {k: v for k, v in state.services.items() if k.version == version},
        {k: v for k, v in state.pods.items() if k.version == version},
        {a for a in state.allowed if a.version == version},
        {k: v for k, v in state.ranges.items() if k.version == version},
    )
