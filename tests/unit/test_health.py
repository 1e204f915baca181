"""The health endpoints and the agent's liveness/readiness, against a fake datapath."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from cozyebpf.agent import Agent
from cozyebpf.dump import build_dump
from cozyebpf.errors import PermanentError
from cozyebpf.health import HealthServer
from cozyebpf.httpserver import parse_address
from cozyebpf.model import read_objects
from cozyebpf.sources import ChangeSet
from cozylab.fakedp import FakeDatapath
from cozylab.k8s import Svc, objects
from tests.support.clock import FakeClock
from tests.support.sources import IdleSource


class ListSource(IdleSource):
    """A source whose objects the test sets; not ready until the first `set`."""

    def __init__(self) -> None:
        self.objects: list[dict[str, Any]] | None = None
        self.taken: list[dict[str, Any]] | None = None

    def set(self, objs: list[dict[str, Any]]) -> None:
        self.objects = objs

    def take(self) -> ChangeSet | None:
        if self.objects is None:
            return None
        if self.objects is self.taken:
            return ChangeSet()
        self.taken = self.objects
        return ChangeSet(whole=read_objects(self.objects))


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def served(clock: FakeClock) -> Iterator[tuple[Agent, ListSource, FakeDatapath, str]]:
    src, dp = ListSource(), FakeDatapath()
    agent = Agent(src, dp, resync_interval=3600, retry_delay=0.2, clock=clock)
    h = HealthServer("127.0.0.1:0", agent.liveness, agent.readiness)
    h.start()
    yield agent, src, dp, f"http://{h.address}"
    h.stop()


def test_ready_only_after_the_first_complete_sync(
    served: tuple[Agent, ListSource, FakeDatapath, str],
) -> None:
    agent, src, dp, url = served
    assert get(url + "/healthz") == (200, "ok\n")
    agent.tick()  # source not listed yet: nothing programmed, not ready
    assert get(url + "/readyz") == (503, "not synced yet\n")
    assert build_dump(dp.state)["services"] == []
    src.set(objects(Svc("vm", "203.0.113.10", "10.244.1.10", [("TCP", 22)])))
    agent.tick()
    assert get(url + "/readyz") == (200, "ok\n")
    assert [s["lb_ip"] for s in build_dump(dp.state)["services"]] == ["203.0.113.10"]
    assert get(url + "/nope")[0] == 404


def test_liveness_fails_when_the_loop_stalls(
    served: tuple[Agent, ListSource, FakeDatapath, str], clock: FakeClock
) -> None:
    agent, _, _, url = served
    agent.tick()
    clock.advance(30)
    assert get(url + "/healthz") == (200, "ok\n")
    clock.advance(3570)  # an hour without a turn of the loop
    assert agent.liveness() == "agent loop stalled for 3600s"
    assert get(url + "/healthz") == (503, "agent loop stalled for 3600s\n")
    agent.tick()
    assert get(url + "/healthz") == (200, "ok\n")


def test_a_failed_sync_is_retried_and_not_ready(
    served: tuple[Agent, ListSource, FakeDatapath, str], clock: FakeClock
) -> None:
    from cozyebpf.errors import DatapathError

    agent, src, dp, url = served
    src.set(objects(Svc("vm", "203.0.113.10", "10.244.1.10", [("TCP", 22)])))
    dp.fail_next_apply = DatapathError("map full")
    agent.tick()
    assert get(url + "/readyz")[0] == 503
    agent.tick()  # not in a tight loop: the retry waits (0.2 s here, 1 s by default)
    assert get(url + "/readyz")[0] == 503 and agent.syncs == 0
    clock.advance(0.25)
    agent.tick()  # nothing changed in the source, but the failed sync is retried
    assert get(url + "/readyz")[0] == 200
    assert [s["lb_ip"] for s in build_dump(dp.state)["services"]] == ["203.0.113.10"]


@pytest.mark.parametrize("bad", ["9810", "host:", "host:0x1", ":70000"])
def test_bad_health_address_is_a_clear_error(bad: str) -> None:
    with pytest.raises(PermanentError, match="is not HOST:PORT"):
        parse_address(bad, "--health-address", "127.0.0.1:9810")
