"""End to end with the Kubernetes source: the agent in the lab's node namespace watches the API
server double (listening inside that namespace) and programs the real datapath. A Service
change reaches the datapath, an outage keeps traffic flowing, and after recovery the maps
converge; readiness follows the first complete sync; conflicts become Events."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cozylab.k8s import Svc, objects
from cozylab.kubeapi import FakeKubeAPI
from cozylab.netns import DEFAULT_PODS
from tests.support.labtools import AgentLab, agent_lab, wait_for
from tests.support.packets import LB_FILT, LB_WHOLE

POD1, POD2 = DEFAULT_PODS[:2]
WHOLE = Svc("vm1", LB_WHOLE, POD1.ip, [("TCP", 22)], whole_ip="true")
FILT = Svc(
    "vm2", LB_FILT, POD2.ip, [("TCP", 80)], allow_icmp="true", created="2026-01-02T00:00:00Z"
)
HEALTH = "127.0.0.1:19810"


@pytest.fixture
def env(tmp_path: Path, cozyebpf_cmd: list[str]) -> Iterator[tuple[AgentLab, FakeKubeAPI]]:
    with agent_lab("k", tmp_path, cozyebpf_cmd, DEFAULT_PODS[:2]) as env:
        api = FakeKubeAPI(bookmark_interval=0.5)
        env.lab.in_ns(env.lab.node, api.start)  # the server socket lives in the node namespace
        env.source_args = [
            "--kubeconfig",
            str(api.kubeconfig(tmp_path / "kubeconfig")),
            "--node-name",
            "node-a",
            "--health-address",
            HEALTH,
        ]
        try:
            yield env, api
        finally:
            api.stop()


def put(api: FakeKubeAPI, *svcs: Svc) -> None:
    for s in svcs:
        for o in objects(s):
            api.apply(o)


def lbs(env: AgentLab) -> set[str]:
    return {str(lb) for lb in env.maps_state().services}


def ping(env: AgentLab, lb: str) -> bool:
    return (
        env.lab.exec(env.lab.client, "ping", "-c", "1", "-W", "1", lb, check=False).returncode == 0
    )


def probe(env: AgentLab, path: str) -> str:
    p = env.lab.exec(
        env.lab.node,
        "curl",
        "-s",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        f"http://{HEALTH}{path}",
        check=False,
    )
    return p.stdout


def test_changes_reach_the_datapath_and_outages_keep_traffic(
    env: tuple[AgentLab, FakeKubeAPI],
) -> None:
    agent, api = env
    put(api, WHOLE)
    agent.start_agent()
    wait_for(lambda: lbs(agent) == {LB_WHOLE}, 10, "the first sync")
    assert ping(agent, LB_WHOLE)
    assert probe(agent, "/readyz") == "200" and probe(agent, "/healthz") == "200"

    put(api, FILT)  # a watch event
    wait_for(lambda: lbs(agent) == {LB_WHOLE, LB_FILT}, 10, "the new Service")
    assert ping(agent, LB_FILT)

    api.set_down(True)  # outage: nothing changes in the datapath
    api.delete("Service", "default", "vm1")
    wait_for(lambda: "keeping the last known state" in agent.log(), 15, "the agent to notice")
    assert lbs(agent) == {LB_WHOLE, LB_FILT} and ping(agent, LB_WHOLE)
    assert probe(agent, "/healthz") == "200"

    api.set_down(False)  # recovery: the maps converge on the API's state
    wait_for(lambda: lbs(agent) == {LB_FILT}, 20, "convergence after the outage")
    assert not ping(agent, LB_WHOLE) and ping(agent, LB_FILT)


def test_not_ready_and_nothing_removed_until_the_first_list(
    env: tuple[AgentLab, FakeKubeAPI],
) -> None:
    agent, api = env
    put(api, WHOLE)
    agent.start_agent()
    wait_for(lambda: lbs(agent) == {LB_WHOLE}, 10, "the first sync")
    agent.stop_agent()
    api.set_down(True)
    agent.start_agent()  # restart during an outage: the pinned state stays
    wait_for(lambda: probe(agent, "/readyz") == "503", 10, "not ready")
    assert probe(agent, "/healthz") == "200"
    assert lbs(agent) == {LB_WHOLE} and ping(agent, LB_WHOLE)
    api.set_down(False)
    wait_for(lambda: probe(agent, "/readyz") == "200", 20, "ready after the list")


def test_a_conflict_becomes_an_event_on_the_newer_service(
    env: tuple[AgentLab, FakeKubeAPI],
) -> None:
    agent, api = env
    thief = Svc("vm-late", LB_WHOLE, POD2.ip, [("TCP", 80)], created="2026-03-01T00:00:00Z")
    put(api, WHOLE, thief)
    agent.start_agent()
    wait_for(lambda: lbs(agent) == {LB_WHOLE}, 10, "the first sync")
    services = agent.maps_state().services  # the older Service keeps the LB IP
    assert {str(lb): str(e.pod_ip) for lb, e in services.items()} == {LB_WHOLE: POD1.ip}
    events = wait_for(lambda: api.events("default"), 10, "an Event")
    (ev,) = events
    assert ev["involvedObject"]["name"] == "vm-late" and ev["type"] == "Warning"
    assert LB_WHOLE in ev["message"] and ev["source"]["host"] == "node-a"


def test_an_lb_ip_that_is_another_nodes_address_is_refused(
    env: tuple[AgentLab, FakeKubeAPI],
) -> None:
    """Issue 31 with the API: a Service whose LB IP is another Node's InternalIP is not
    programmed, gets a Warning Event that says why, and shows in the metrics; when that Node
    goes, the Service is programmed."""
    agent, api = env
    other_node = "198.51.100.50"
    api.apply(
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": "node-b"},
            "status": {
                "addresses": [
                    {"type": "InternalIP", "address": other_node},
                    {"type": "Hostname", "address": "node-b"},
                ]
            },
        }
    )
    claim = Svc("vm-b", other_node, POD2.ip, whole_ip="true")
    put(api, WHOLE, claim)
    agent.start_agent("--metrics-address", "127.0.0.1:19811", "--metrics-auth", "none")
    wait_for(lambda: lbs(agent) == {LB_WHOLE}, 10, "the first sync")
    events = wait_for(lambda: api.events("default"), 10, "an Event")
    (ev,) = events
    assert ev["involvedObject"]["name"] == "vm-b" and ev["type"] == "Warning"
    assert ev["reason"] == "CozyebpfWarning"
    assert ev["message"].startswith(
        f"is not programmed: its LoadBalancer IP {other_node} is node node-b's InternalIP"
    )
    metrics = agent.lab.exec(agent.lab.node, "curl", "-sf", "http://127.0.0.1:19811/metrics").stdout
    assert 'cozyebpf_services_refused{reason="node"} 1.0' in metrics
    assert 'cozyebpf_services_refused{reason="node-address"} 0.0' in metrics
    assert ping(agent, LB_WHOLE)
    api.delete("Node", "", "node-b")
    wait_for(lambda: lbs(agent) == {LB_WHOLE, other_node}, 10, "vm-b programmed")


def test_metrics_only_for_who_may_read_them(env: tuple[AgentLab, FakeKubeAPI]) -> None:
    """As the chart runs it (issue 28, item 1): the metrics on the node's uplink address, over
    HTTPS with a certificate made at start; from the client (a tenant's VM, say): no token 401,
    a token without the right 403, a token allowed to get /metrics 200 with the Services."""
    from cozylab.netns import NODE_UPLINK_IP

    agent, api = env
    api.add_token("tenant", "system:serviceaccount:tenant-a:default")
    api.add_token("reader", "system:serviceaccount:monitoring:prometheus")
    api.grant("system:serviceaccount:monitoring:prometheus", "/metrics")
    put(api, WHOLE)
    address = f"{NODE_UPLINK_IP}:19811"
    agent.start_agent("--metrics-address", address, "--metrics-auth", "kubernetes")
    wait_for(lambda: lbs(agent) == {LB_WHOLE}, 10, "the Service")

    def scrape(*header: str) -> tuple[str, str]:
        p = agent.lab.exec(
            agent.lab.client,
            "curl",
            "-sk",  # self-signed
            "-w",
            "\n%{http_code}",
            *header,
            f"https://{address}/metrics",
            check=False,
        )
        body, _, code = p.stdout.rpartition("\n")
        return code, body

    code, body = scrape()
    assert code == "401" and "vm1" not in body, body
    code, body = scrape("-H", "Authorization: Bearer tenant")
    assert code == "403" and "vm1" not in body, body
    code, body = scrape("-H", "Authorization: Bearer reader")
    assert code == "200" and 'service="vm1"' in body, body[-2000:]
    # plain HTTP is not served there
    plain = agent.lab.exec(
        agent.lab.client, "curl", "-s", "-m", "5", f"http://{address}/metrics", check=False
    )
    assert "vm1" not in plain.stdout
