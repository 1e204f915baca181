"""A burst of changes through the API: the real agent in the lab watches the API server double
while 1,000 changes of every kind arrive as fast as the double takes them (endpoints moving,
readiness flipping, modes and ports changing, Services deleted and created again, LB IPs
contested, pods shared, EndpointSlices changing family). Afterwards the pinned maps must hold
exactly what the full model computes from the final objects: incremental updates that
coalesce must never leave a stale or missing entry."""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cozyebpf.config import DEFAULT_GUARD
from cozyebpf.model import build_state
from cozyebpf.model.limits import parse_packet_rate
from cozyebpf.state import MapState
from cozylab.k8s import Svc, objects
from cozylab.kubeapi import FakeKubeAPI
from cozylab.netns import DEFAULT_PODS
from tests.support.labtools import AgentLab, agent_lab, wait_for

Obj = dict[str, Any]
HEALTH = "127.0.0.1:19811"  # in the lab's node namespace
N = 200  # Services
CHANGES = 1000


@pytest.fixture
def env(tmp_path: Path, cozyebpf_cmd: list[str]) -> Iterator[tuple[AgentLab, FakeKubeAPI]]:
    with agent_lab("b", tmp_path, cozyebpf_cmd, DEFAULT_PODS[:1]) as env:
        api = FakeKubeAPI(bookmark_interval=0.5)
        env.lab.in_ns(env.lab.node, api.start)
        env.source_args = [
            *("--kubeconfig", str(api.kubeconfig(tmp_path / "kubeconfig"))),
            *("--health-address", HEALTH),
        ]
        try:
            yield env, api
        finally:
            api.stop()


def lb(i: int) -> str:
    return f"192.0.2.{i % 250 + 1}"


def pod(i: int) -> str:
    return f"10.244.{100 + i // 250}.{i % 250 + 1}"


class Cluster:
    """The objects, as the test last wrote them to the API double."""

    def __init__(self, api: FakeKubeAPI, rng: random.Random) -> None:
        self.api, self.rng = api, rng
        self.objs: dict[tuple[str, str, str], Obj] = {}

    def put(self, o: Obj) -> None:
        """Write `o`; keep what the API stored (it keeps creationTimestamp on updates)."""
        stored = self.api.apply(copy.deepcopy(o))
        self.objs[(o["kind"], stored["metadata"]["namespace"], stored["metadata"]["name"])] = stored

    def delete(self, kind: str, name: str) -> None:
        if self.objs.pop((kind, "default", name), None) is not None:
            self.api.delete(kind, "default", name)

    def service(self, name: str) -> Obj | None:
        return self.objs.get(("Service", "default", name))

    def slices(self, name: str) -> list[Obj]:
        return [
            o
            for (kind, _, _), o in self.objs.items()
            if kind == "EndpointSlice"
            and o["metadata"]["labels"]["kubernetes.io/service-name"] == name
        ]

    def state(self) -> MapState:
        """What the agent must program: the full model, with the agent's default guard."""
        return build_state(list(self.objs.values()), guard_pps=GUARD).state

    def change(self) -> None:
        rng = self.rng
        i = rng.randrange(N + 20)  # a few names that come and go
        name = f"vm{i}"
        svc, slices = self.service(name), self.slices(name)
        what = rng.choice(
            ["move", "ready", "mode", "ports", "delete", "create", "contest", "share", "family"]
        )
        if svc is None or what == "create":
            created = f"2026-01-{rng.randrange(1, 28):02d}T00:00:00Z"
            for o in objects(Svc(name, lb(i), pod(i), [("TCP", 22)], created=created)):
                self.put(o)
        elif what == "delete":
            self.delete("Service", name)
            for sl in slices:
                self.delete("EndpointSlice", sl["metadata"]["name"])
        elif what == "move" and slices:
            sl = rng.choice(slices)
            v6 = sl["addressType"] == "IPv6"
            sl["endpoints"][0]["addresses"] = [
                f"fd00::{rng.randrange(1, 500):x}" if v6 else pod(rng.randrange(2 * N))
            ]
            self.put(sl)
        elif what == "ready" and slices:
            sl = rng.choice(slices)
            cond = sl["endpoints"][0]["conditions"]
            cond["ready"] = not cond.get("ready", True)
            self.put(sl)
        elif what == "mode":
            ann = svc["metadata"]["annotations"]
            key = rng.choice(
                ["networking.cozystack.io/wholeIP", "networking.cozystack.io/allowICMP"]
            )
            ann[key] = rng.choice(["true", "false"])
            self.put(svc)
        elif what == "ports":
            svc["spec"]["ports"] = [
                {"name": f"p{n}", "protocol": rng.choice(["TCP", "UDP"]), "port": n}
                for n in rng.sample([22, 53, 80, 443, 8080], rng.randrange(1, 4))
            ]
            self.put(svc)
        elif what == "contest":  # another LB IP, perhaps one an older Service holds
            svc["status"]["loadBalancer"]["ingress"] = [{"ip": lb(rng.randrange(N))}]
            self.put(svc)
        elif what == "share" and slices:  # another Service's pod
            sl = slices[0]
            if sl["addressType"] == "IPv4":
                sl["endpoints"][0]["addresses"] = [pod(rng.randrange(N))]
                self.put(sl)
        elif what == "family" and slices:
            sl = slices[0]
            if sl["addressType"] == "IPv4":
                sl["addressType"] = "IPv6"
                sl["endpoints"][0]["addresses"] = [f"fd00::{i + 1:x}"]
                svc["status"]["loadBalancer"]["ingress"] = [{"ip": f"2001:db8:113::{i + 1:x}"}]
                self.put(svc)
            else:
                sl["addressType"] = "IPv4"
                sl["endpoints"][0]["addresses"] = [pod(i)]
            self.put(sl)


#: the agent's --guard-packet-rate by default (cozyebpf/config.py)
GUARD = parse_packet_rate("--guard-packet-rate", DEFAULT_GUARD)


def test_a_burst_of_changes_converges_to_the_full_model(
    env: tuple[AgentLab, FakeKubeAPI],
) -> None:
    lab, api = env
    cluster = Cluster(api, random.Random(20261130))
    for i in range(N):
        for o in objects(Svc(f"vm{i}", lb(i), pod(i), [("TCP", 22), ("UDP", 53)])):
            cluster.put(o)
    lab.start_agent()
    want = cluster.state()
    assert len(want.services) == N
    wait_for(lambda: lab.maps_state() == want, 30, "the first sync")
    for _ in range(CHANGES):
        cluster.change()
    want = cluster.state()
    assert want.services and any(lb.version == 6 for lb in want.services)
    wait_for(lambda: lab.maps_state() == want, 30, lambda: f"convergence:\n{lab.log()[-3000:]}")
    status = lab.agent_status(HEALTH)
    assert status["sync_errors"] == 0, status  # every write succeeded
