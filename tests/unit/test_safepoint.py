"""Safe points (cozyebpf.safepoint): a stop asked inside a section waits for its end, a bound
ends the wait, an error inside propagates as it is; a stop is no error (no `except Exception`
takes it), is raised once, and no section runs after it; `run`'s way out stops everything even
when one stopper fails."""

from __future__ import annotations

import logging
import threading

import pytest

from cozyebpf.cli import _stop_all
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


def test_a_stop_is_no_error() -> None:
    """A stop held by a section is raised at its end through an `except Exception` (the
    agent's attachment check keeps its loop going with one): not taken for a failure."""
    safe = SafePoints(bound=60)
    caught: list[BaseException] = []
    with pytest.raises(Stopping):
        try:
            with safe.section("checking the attachments"):
                safe.request_stop()
        except Exception as e:  # what agent._check does  # pragma: no cover
            caught.append(e)
    assert caught == []
    assert not issubclass(Stopping, Exception)


def test_a_stop_is_raised_once_and_no_section_runs_after_it() -> None:
    """`pending` is cleared once the stop is raised; a section entered after it (code on the
    way that swallowed the stop, then a map batch) raises at once, before its body."""
    safe = SafePoints(bound=60)
    with pytest.raises(Stopping), safe.section("checking the attachments"):
        safe.request_stop()
    assert not safe.pending and safe.stopped and safe._timer is None
    written = []
    with pytest.raises(Stopping), safe.section("writing the maps"):
        written.append("a batch after the stop")  # pragma: no cover
    assert written == []


def test_a_stop_outside_a_section_also_closes_the_sections() -> None:
    safe = SafePoints()
    with pytest.raises(Stopping):
        safe.request_stop()
    with pytest.raises(Stopping), safe.section("attaching the programs"):
        raise AssertionError("ran after the stop")  # pragma: no cover


def test_every_stopper_runs_even_if_one_fails(caplog: pytest.LogCaptureFixture) -> None:
    ran: list[str] = []

    def failing() -> None:
        ran.append("metrics")
        raise OSError(9, "Bad file descriptor")

    stoppers = [
        ("the source", lambda: ran.append("source")),
        ("the metrics server", failing),
        ("the datapath's descriptors", lambda: ran.append("datapath")),
    ]
    with caplog.at_level(logging.ERROR, logger="cozyebpf"):
        _stop_all(stoppers)
    assert ran == ["source", "metrics", "datapath"]
    assert [r.getMessage() for r in caplog.records] == [
        "stopping the metrics server failed: OSError: [Errno 9] Bad file descriptor"
    ]
