"""What the unit tests' sources share: a Source's lifecycle with no thread of its own."""

from __future__ import annotations

from collections.abc import Callable


class IdleSource:
    """start, stop and alive of a source whose changes the test hands over (take() is the
    subclass's)."""

    def start(self, notify: Callable[[], None]) -> None:
        pass

    def stop(self) -> None:
        pass

    def alive(self) -> bool:
        return True
