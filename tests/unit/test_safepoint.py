"""Safe points (cozyebpf.safepoint): a stop asked inside a section waits for its end, a bound
ends the wait, an error inside propagates as it is."""

from __future__ import annotations

import threading

import pytest

from cozyebpf.safepoint import SafePoints, Stopping


def test_outside_a_section_a_stop_is_at_once() -> None:
    safe = SafePoints()
    with pytest.raises(Stopping):
        safe.request_stop()


def test_inside_a_section_the_stop_waits_for_its_end() -> None:
    safe = SafePoints(bound=60)
    done = []
    with pytest.raises(Stopping):
        with safe.section("attaching"):
            with safe.section("one link"):
                safe.request_stop()  # returns: the section goes on
                done.append("first")
            done.append("second")  # the outer section too
        done.append("never")  # pragma: no cover
    assert done == ["first", "second"]
    assert safe._timer is None


def test_an_error_inside_propagates_as_it_is() -> None:
    safe = SafePoints(bound=60)
    with pytest.raises(ValueError, match="boom"), safe.section("writing the maps"):
        safe.request_stop()
        raise ValueError("boom")


def test_the_bound_interrupts_a_section_that_does_not_end() -> None:
    interrupted = threading.Event()
    safe = SafePoints(bound=0.01, interrupt=interrupted.set)
    with pytest.raises(Stopping), safe.section("a hung attach"):
        safe.request_stop()
        assert interrupted.wait(10), "the bound passed without an interrupt"
        assert safe.forced
        safe.request_stop()  # the handler's next call (the interrupt's) raises, inside
        raise AssertionError("not interrupted")  # pragma: no cover
