"""More Services than the maps hold (`--max-services`): the oldest are programmed, each one
left out is reported once (log and, with the API, an Event) naming the full map, its size and
the flag to raise; the others keep working, nothing is retried in a loop, and a Service that
goes away makes room for the oldest one waiting."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cozylab.k8s import Svc, manifest
from cozylab.netns import DEFAULT_PODS
from tests.support.labtools import AgentLab, agent_lab, wait_for

POD1 = DEFAULT_PODS[0]
HEALTH = "127.0.0.1:19812"  # in the lab's node namespace
# six whole-IP Services, oldest first; vm0 goes to a real pod
SVCS = [
    Svc(
        f"vm{i}",
        f"203.0.113.{100 + i}",
        POD1.ip if i == 0 else f"10.244.50.{i}",
        [("TCP", 22)],
        whole_ip="true",
        created=f"2026-01-0{i + 1}T00:00:00Z",
    )
    for i in range(6)
]


@pytest.fixture
def env(tmp_path: Path, cozyebpf_cmd: list[str]) -> Iterator[AgentLab]:
    with agent_lab("cap", tmp_path, cozyebpf_cmd, DEFAULT_PODS[:1], manifest(*SVCS)) as env:
        yield env


def lbs(env: AgentLab) -> list[str]:
    return sorted(str(lb) for lb in env.maps_state().services)


def left_out(log: str) -> list[str]:
    return re.findall(
        r"ERROR cozyebpf.agent: Service default/(vm\d): is not programmed: map addr4 is full "
        r"\(8 entries\) and older Services come first; raise --max-services",
        log,
    )


def test_the_oldest_services_that_fit_are_programmed_and_the_rest_reported(
    env: AgentLab,
) -> None:
    env.start_agent("--max-services", "4", "--health-address", HEALTH)  # addr4: 8 entries
    wait_for(lambda: len(lbs(env)) == 4, 10, "the four oldest Services")
    assert lbs(env) == [s.lb_ip for s in SVCS[:4]]
    wait_for(lambda: left_out(env.log()) == ["vm4", "vm5"], 5, "two Services reported")
    # the others work: traffic to the oldest flows
    p = env.lab.exec(env.lab.client, "ping", "-c", "1", "-W", "2", SVCS[0].lb_ip, check=False)
    assert p.returncode == 0
    # nothing is retried: a second later the agent has written the maps once, and nothing failed
    time.sleep(1.0)
    status = env.agent_status(HEALTH)
    assert (status["syncs"], status["sync_errors"]) == (1, 0), status
    assert [p["object"] for p in status["problems"]] == [
        "Service default/vm4",
        "Service default/vm5",
    ]
    assert left_out(env.log()) == ["vm4", "vm5"]
    # a Service goes away: the oldest one waiting takes its place
    tmp = env.manifest_path.with_suffix(".tmp")
    tmp.write_text(manifest(*[s for s in SVCS if s.name != "vm1"]))
    os.replace(tmp, env.manifest_path)
    want = sorted(s.lb_ip for s in SVCS if s.name not in ("vm1", "vm5"))
    wait_for(lambda: lbs(env) == want, 10, "vm4 to be programmed")
    assert left_out(env.log()) == ["vm4", "vm5"], "each one reported once"
