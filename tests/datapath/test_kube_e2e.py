"""End to end with the Kubernetes source, against the real control plane (cozylab/kubecp/,
issue 35: etcd, kube-apiserver and kube-controller-manager of the pinned release, one for the
module): the agent in the lab's node namespace, in-cluster with a token of the chart's
ServiceAccount and its ClusterRole, reaches kube-apiserver over a link of the node's own, and
programs the real datapath. The lab writes Services, their LB IPs and their pods as the
cluster's components would; the EndpointSlice controller writes the slices.

A Service change reaches the datapath; faults of the real server: kube-apiserver killed (traffic
kept, converges after it is back; etcd compacted meanwhile, and the watches resume into 410 Gone
and list again: with the watch cache, as kube-apiserver runs by default, the 410 comes from the
restarted server's cache, whose history starts at the restart, with or without the compaction; a
compaction alone ends no watch the cache serves), watches the server ends at their timeout
(resumed, not listed again), a right removed from the ClusterRole (the error names the verb, the
resource and the ClusterRole); readiness follows the first complete sync; conflicts become
Events the server stores; metrics only for Prometheus's token, and a tenant's flood of tokens
costs kube-apiserver no more reviews than the per-source limit."""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cozylab.cluster.agents import in_cluster_wrapper
from cozylab.cluster.api import (
    AGENT_NAMESPACE,
    MONITORING_NAMESPACE,
    NAMESPACE,
    PROMETHEUS,
    TENANT,
    TENANT_NAMESPACE,
    LabApi,
    PodState,
    lb_status,
    pod_object,
)
from cozylab.cluster.spec import node_name
from cozylab.k8s import Svc, objects
from cozylab.kubecp import ControlPlane
from cozylab.netns import DEFAULT_PODS
from tests.support.labtools import AgentLab, agent_lab, wait_for
from tests.support.packets import LB_FILT, LB_WHOLE

pytestmark = pytest.mark.requires("kube", "helm")

POD1, POD2 = DEFAULT_PODS[:2]
WHOLE = Svc("vm1", LB_WHOLE, POD1.ip, [("TCP", 22)], whole_ip="true")
FILT = Svc("vm2", LB_FILT, POD2.ip, [("TCP", 80)], allow_icmp="true")
HEALTH = "127.0.0.1:19810"
#: the control plane's link to the node: kube-apiserver at API_IP, the node at NODE_IP (its
#: Node object's InternalIP; the agent is node1)
API_IP, NODE_IP, NODE = "192.0.2.250", "192.0.2.1", 1


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    from tests.support.env import unique_prefix

    with ControlPlane(unique_prefix("ke"), tmp_path_factory.mktemp("cp"), API_IP) as cp:
        yield cp


@pytest.fixture
def env(
    tmp_path: Path,
    cozyebpf_cmd: list[str],
    control_plane: ControlPlane,
    request: pytest.FixtureRequest,
) -> Iterator[tuple[AgentLab, LabApi]]:
    """The lab, the API, and the agent's identity; after the test, the kube-apiserver's audit
    log must show every request of the agent's ServiceAccount allowed, but those a test takes
    the right of (`audit_denies`), which must show refused."""
    cp = control_plane
    since = time.time()
    if not cp.running("kube-apiserver"):  # a test that failed with it down
        cp.start_apiserver()
    starts = cp.apiserver_starts
    with agent_lab("k", tmp_path, cozyebpf_cmd, DEFAULT_PODS[:2]) as env:
        cp.link(env.lab.node, "kapi", NODE_IP, 24)
        api = LabApi(cp, tmp_path)
        api.setup()
        api.put_node(NODE)
        identity = api.agent_identity(NODE, tmp_path / "serviceaccount")
        env.source_args = ["--node-name", node_name(NODE), "--health-address", HEALTH]
        env.env = cp.env()
        env.wrapper = in_cluster_wrapper(identity)
        try:
            yield env, api
        finally:
            if env.proc:
                env.stop_agent()
            if not cp.running("kube-apiserver"):
                cp.start_apiserver()
            if cp.apiserver_starts != starts:  # its controllers back off: new ones, for the next
                cp.restart_controllers()
            api.admin.apply(_role(api))  # a test that took a right away
            api.clean()
    _audited(cp, api, since, request, restarted=cp.apiserver_starts != starts)


def _audited(
    cp: ControlPlane,
    api: LabApi,
    since: float,
    request: pytest.FixtureRequest,
    restarted: bool,
) -> None:
    """What the audit log holds of the agent's requests since `since` (issue 45, item 10): the
    server's own word that each was allowed, or refused where the test took the right. One
    refusal is the server's, not the ClusterRole's: a kube-apiserver that just started (the
    test restarted it) answers before its RBAC cache holds the roles, and refuses with the
    ClusterRole "not found", or with no reason while the binding is not loaded (api.py,
    wait_slices, says the same of kube-controller-manager); the same request is allowed later."""
    from cozylab.kubecp.audit import requests

    user = f"system:serviceaccount:{AGENT_NAMESPACE}:{api.agent_service_account()}"
    reqs = requests(cp.audit_log, user, since)
    assert reqs, f"no request of {user} in {cp.audit_log}"
    role = _role(api)["metadata"]["name"]
    unloaded = f'clusterrole.rbac.authorization.k8s.io "{role}" not found'

    def unready(i: int) -> bool:
        """Refused by a server whose RBAC cache had not loaded the role or its binding yet
        (the reason names the ClusterRole not found, or no rule at all), where the same request
        was allowed later: a right the ClusterRole lacks is never allowed later."""
        r = reqs[i]
        what = (r.verb, r.resource, r.group)
        return (
            restarted
            and (unloaded in r.reason or not r.reason)
            and any(x.allowed and (x.verb, x.resource, x.group) == what for x in reqs[i + 1 :])
        )

    refused = [r for i, r in enumerate(reqs) if not r.allowed and not unready(i)]
    expected = {tuple(d) for m in request.node.iter_markers("audit_denies") for d in m.args}
    said = [str(r) for r in refused][:10]
    assert {(r.verb, r.resource, r.group) for r in refused} == expected, (
        f"{len(reqs)} requests of {user}; refused: {said}"
    )


def _role(api: LabApi, without: tuple[str, str] | None = None) -> dict[str, Any]:
    """The chart's ClusterRole for the agent, as rendered; `without` (verb, resource): that
    right taken out."""
    binding = next(o for o in api.chart if o["kind"] == "ClusterRoleBinding")
    role = copy.deepcopy(
        next(
            o
            for o in api.chart
            if o["kind"] == "ClusterRole" and o["metadata"]["name"] == binding["roleRef"]["name"]
        )
    )
    if without:
        verb, resource = without
        for rule in role["rules"]:
            if resource in rule.get("resources", []):
                rule["verbs"] = [v for v in rule["verbs"] if v != verb]
    return role


def put(api: LabApi, *svcs: Svc) -> None:
    """Each Service as Cozystack's chart writes it, with a selector; its LB IP (MetalLB); its
    pod on node1, Running and Ready (the EndpointSlice controller writes the slice)."""
    for s in svcs:
        svc: dict[str, Any] = copy.deepcopy(objects(s)[0])
        del svc["metadata"]["creationTimestamp"], svc["status"]
        svc["spec"]["selector"] = {"app": s.name}
        api.admin.apply(svc)
        api.admin.apply(lb_status(s.name, s.lb_ip), subresource="status")
        assert s.pod_ip is not None
        pod = pod_object(f"{s.name}-pod", {"app": s.name}, NODE)
        api.put_pod(pod, PodState(s.name, NODE, s.pod_ip))
    api.wait_slices([s.name for s in svcs])


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


def listed(env: AgentLab, kind: str) -> int:
    """How many complete lists of `kind` (Services, EndpointSlices, Nodes) the agent made."""
    return len(re.findall(rf"listed \d+ {kind} at resourceVersion", env.log()))


def test_changes_reach_the_datapath_and_a_dead_api_server_keeps_traffic(
    env: tuple[AgentLab, LabApi],
) -> None:
    """kube-apiserver killed (SIGKILL): the agent keeps the datapath and says so; etcd is
    compacted meanwhile; back, a watch that resumes from a resourceVersion older than the
    restarted server's history (its watch cache starts at the restart) gets 410 Gone ("too
    old resource version"), lists again, and the maps converge on a change made then."""
    agent, api = env
    put(api, WHOLE)
    agent.start_agent()
    wait_for(lambda: lbs(agent) == {LB_WHOLE}, 10, "the first sync")
    assert ping(agent, LB_WHOLE)
    assert probe(agent, "/readyz") == "200" and probe(agent, "/healthz") == "200"

    put(api, FILT)  # a watch event
    wait_for(lambda: lbs(agent) == {LB_WHOLE, LB_FILT}, 10, "the new Service")
    assert ping(agent, LB_FILT)
    assert listed(agent, "Services") == 1

    api.cp.kill_apiserver()  # every connection reset
    wait_for(lambda: "keeping the last known state" in agent.log(), 15, "the agent to notice")
    assert lbs(agent) == {LB_WHOLE, LB_FILT} and ping(agent, LB_WHOLE)
    assert probe(agent, "/healthz") == "200"
    compacted = api.cp.compact()

    api.cp.start_apiserver()  # back: the maps converge on what changes now
    api.delete_service("vm1")
    api.delete_pod("vm1-pod")
    wait_for(lambda: lbs(agent) == {LB_FILT}, 30, "convergence after the outage")
    assert not ping(agent, LB_WHOLE) and ping(agent, LB_FILT)
    log = agent.log()
    assert listed(agent, "Services") == 2, log[-3000:]
    gone = [line for line in log.splitlines() if "listing again" in line]
    assert gone, f"no 410 after the compaction at revision {compacted}: {log[-3000:]}"


def test_not_ready_and_nothing_removed_until_the_first_list(
    env: tuple[AgentLab, LabApi],
) -> None:
    agent, api = env
    put(api, WHOLE)
    agent.start_agent()
    wait_for(lambda: lbs(agent) == {LB_WHOLE}, 10, "the first sync")
    agent.stop_agent()
    api.cp.kill_apiserver()
    agent.start_agent()  # restart during an outage: the pinned state stays
    wait_for(lambda: probe(agent, "/readyz") == "503", 10, "not ready")
    assert probe(agent, "/healthz") == "200"
    assert lbs(agent) == {LB_WHOLE} and ping(agent, LB_WHOLE)
    api.cp.start_apiserver()
    wait_for(lambda: probe(agent, "/readyz") == "200", 30, "ready after the list")


def test_watches_the_server_ends_are_resumed_not_listed_again(
    env: tuple[AgentLab, LabApi],
) -> None:
    """kube-apiserver ends each watch at the timeoutSeconds it asks for (--watch-timeout):
    the agent resumes it from its last resourceVersion (bookmarks included), without a new
    list, and takes what changes after."""
    agent, api = env
    put(api, WHOLE)
    agent.start_agent("--watch-timeout", "2")
    wait_for(lambda: lbs(agent) == {LB_WHOLE}, 10, "the first sync")

    def watches() -> int:
        text = api.admin.request_text("GET", "/metrics")
        return sum(
            int(float(m))
            for m in re.findall(
                r'apiserver_request_total\{[^}]*resource="services"[^}]*verb="WATCH"[^}]*\} (\S+)',
                text,
            )
        )

    before = watches()
    wait_for(lambda: watches() >= before + 3, 30, "the server to end three watches of Services")
    put(api, FILT)
    wait_for(lambda: lbs(agent) == {LB_WHOLE, LB_FILT}, 10, "a change after the watches ended")
    assert listed(agent, "Services") == 1 and listed(agent, "EndpointSlices") == 1, agent.log()


@pytest.mark.audit_denies(("watch", "endpointslices", "discovery.k8s.io"), ("create", "events", ""))
def test_a_right_taken_from_the_cluster_role_is_named(env: tuple[AgentLab, LabApi]) -> None:
    """The chart's ClusterRole without `watch` on EndpointSlices: the agent's next watch (the
    server ends each after --watch-timeout) is refused; its error names the verb, the resource
    and the ClusterRole, the datapath stays; the right given back, it converges. Without
    `create` on Events, a conflict's Event is refused and the log says which right is
    missing."""
    agent, api = env
    put(api, WHOLE)
    agent.start_agent("--watch-timeout", "2")
    wait_for(lambda: lbs(agent) == {LB_WHOLE}, 10, "the first sync")
    role = _role(api, without=("watch", "endpointslices"))
    api.admin.apply(role)
    name = role["metadata"]["name"]
    said = (
        f"HTTP 403 Forbidden: the ClusterRole {name} does not grant `watch` on endpointslices "
        '(API group "discovery.k8s.io")'
    )
    wait_for(lambda: said in agent.log(), 30, lambda: f"the error: {agent.log()[-2000:]}")
    assert lbs(agent) == {LB_WHOLE} and ping(agent, LB_WHOLE)
    api.admin.apply(_role(api))
    put(api, FILT)
    wait_for(lambda: lbs(agent) == {LB_WHOLE, LB_FILT}, 30, "convergence with the right back")

    api.admin.apply(_role(api, without=("create", "events")))
    thief = Svc("vm-late", LB_WHOLE, POD2.ip, [("TCP", 80)])
    put(api, thief)
    said = f'the ClusterRole {name} does not grant `create` on events (API group "")'
    wait_for(lambda: said in agent.log(), 15, lambda: f"the error: {agent.log()[-2000:]}")
    assert "could not record an Event for Service default/vm-late" in agent.log()


def test_a_conflict_becomes_an_event_on_the_newer_service(
    env: tuple[AgentLab, LabApi],
) -> None:
    agent, api = env
    put(api, WHOLE)
    time.sleep(1.1)  # creationTimestamp has seconds: the thief must be the newer
    thief = Svc("vm-late", LB_WHOLE, POD2.ip, [("TCP", 80)])
    put(api, thief)
    agent.start_agent()
    wait_for(lambda: lbs(agent) == {LB_WHOLE}, 10, "the first sync")
    services = agent.maps_state().services  # the older Service keeps the LB IP
    assert {str(lb): str(e.pod_ip) for lb, e in services.items()} == {LB_WHOLE: POD1.ip}
    (ev,) = wait_for(lambda: api.events(NAMESPACE), 10, "an Event")
    assert ev["involvedObject"]["name"] == "vm-late" and ev["type"] == "Warning"
    assert LB_WHOLE in ev["message"] and ev["source"]["host"] == node_name(NODE)
    # the agent restarts: the same Event is counted, not made again (patch, no get)
    agent.stop_agent()
    agent.start_agent()
    wait_for(lambda: api.events(NAMESPACE)[0].get("count") == 2, 15, "the repeat counted")
    assert "could not record an Event" not in agent.log()


def test_an_lb_ip_that_is_another_nodes_address_is_refused(
    env: tuple[AgentLab, LabApi],
) -> None:
    """Issue 31 with the API: a Service whose LB IP is another Node's InternalIP (as its
    kubelet reports it) is not programmed, gets a Warning Event that says why, and shows in
    the metrics; when that Node goes, the Service is programmed."""
    agent, api = env
    other_node = "198.51.100.50"
    api.admin.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-b"}})
    api.admin.apply(
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
        },
        subresource="status",
    )
    claim = Svc("vm-b", other_node, POD2.ip, whole_ip="true")
    put(api, WHOLE, claim)
    agent.start_agent("--metrics-address", "127.0.0.1:19811", "--metrics-auth", "none")
    wait_for(lambda: lbs(agent) == {LB_WHOLE}, 10, "the first sync")
    (ev,) = wait_for(lambda: api.events(NAMESPACE), 10, "an Event")
    assert ev["involvedObject"]["name"] == "vm-b" and ev["type"] == "Warning"
    assert ev["reason"] == "CozyebpfWarning"
    assert ev["message"].startswith(
        f"is not programmed: its LoadBalancer IP {other_node} is node node-b's InternalIP"
    )
    metrics = agent.lab.exec(agent.lab.node, "curl", "-sf", "http://127.0.0.1:19811/metrics").stdout
    assert 'cozyebpf_services_refused{reason="node"} 1.0' in metrics
    assert 'cozyebpf_services_refused{reason="node-address"} 0.0' in metrics
    assert ping(agent, LB_WHOLE)
    api.admin.delete("Node", None, "node-b")
    wait_for(lambda: lbs(agent) == {LB_WHOLE, other_node}, 10, "vm-b programmed")


def test_metrics_only_for_who_may_read_them(env: tuple[AgentLab, LabApi]) -> None:
    """As the chart runs it (issue 28, item 1): the metrics on the node's uplink address, over
    HTTPS with a certificate made at start; from the client (a tenant's VM, say): no token 401,
    a tenant's ServiceAccount token 403, Prometheus's (bound to the chart's metrics-reader
    ClusterRole) 200 with the Services. TokenReview and SubjectAccessReview are the real
    server's, with the agent's own rights."""
    from cozylab.netns import NODE_UPLINK_IP

    agent, api = env
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

    tenant = api.token_of(TENANT_NAMESPACE, TENANT)
    reader = api.token_of(MONITORING_NAMESPACE, PROMETHEUS)
    code, body = scrape()
    assert code == "401" and "vm1" not in body, body
    code, body = scrape("-H", f"Authorization: Bearer {tenant}")
    assert code == "403" and "vm1" not in body, body
    assert f"system:serviceaccount:{TENANT_NAMESPACE}:{TENANT} may not get /metrics" in body
    code, body = scrape("-H", f"Authorization: Bearer {reader}")
    assert code == "200" and 'service="vm1"' in body, body[-2000:]
    code, body = scrape("-H", "Authorization: Bearer not-a-token")
    assert code == "401" and "vm1" not in body, body
    # plain HTTP is not served there
    plain = agent.lab.exec(
        agent.lab.client, "curl", "-s", "-m", "5", f"http://{address}/metrics", check=False
    )
    assert "vm1" not in plain.stdout


def test_a_flood_of_tokens_costs_the_real_server_at_most_the_limit(
    env: tuple[AgentLab, LabApi],
) -> None:
    """Issue 37, item 4, against kube-apiserver (test_metrics_flood.py has the slow clients,
    the threads and the memory, on the double): from a tenant's VM, its own ServiceAccount's
    token and then 300 unknown tokens at the node's metrics, with Prometheus scraping from a pod
    all along. kube-apiserver's own request counter sees no more TokenReviews than the per-source
    bucket allows for the time it took (plus Prometheus's and the tenant's first), and one
    SubjectAccessReview for the tenant however often it asks (its denial is cached); every
    answer is 401, 403 or 429 for the tenant's VM, 200 for Prometheus."""
    import collections
    import threading

    from cozyebpf.kube.metricsauth import CACHE_TTL, REVIEW_BURST, REVIEW_EVERY
    from cozylab.netns import NODE_UPLINK_IP
    from tests.support.https import https_get

    agent, api = env
    lab = agent.lab
    put(api, WHOLE)
    address = (NODE_UPLINK_IP, 19811)
    agent.start_agent(
        "--metrics-address", f"{address[0]}:{address[1]}", "--metrics-auth", "kubernetes"
    )
    wait_for(lambda: lbs(agent) == {LB_WHOLE}, 10, "the Service")
    tenant = api.token_of(TENANT_NAMESPACE, TENANT)
    reader = api.token_of(MONITORING_NAMESPACE, PROMETHEUS)

    def reviews() -> dict[str, int]:
        text = api.admin.request_text("GET", "/metrics")
        got = {}
        for resource in ("tokenreviews", "subjectaccessreviews"):
            pattern = rf'apiserver_request_total\{{[^}}]*resource="{resource}"[^}}]*\}} (\S+)'
            got[resource] = sum(int(float(m)) for m in re.findall(pattern, text))
        return got

    def get(ns: str, token: str) -> int | None:
        got = lab.in_ns(ns, lambda: https_get(address, token))
        return None if got is None else got[0]

    assert get(lab.pod_ns(POD2), reader) == 200  # Prometheus's token reviewed and cached
    before = reviews()
    t0 = time.monotonic()
    codes: collections.Counter[int | None] = collections.Counter()
    tenant_codes: collections.Counter[int | None] = collections.Counter()
    scrapes: collections.Counter[int | None] = collections.Counter()
    tenant_codes[get(lab.client, tenant)] += 1
    halt = threading.Event()

    def prometheus() -> None:
        while not halt.is_set():
            scrapes[get(lab.pod_ns(POD2), reader)] += 1
            halt.wait(0.2)

    scraper = threading.Thread(target=prometheus, daemon=True)
    scraper.start()
    try:
        for i in range(300):
            codes[get(lab.client, f"unknown-{i}")] += 1
            if i % 30 == 0:
                tenant_codes[get(lab.client, tenant)] += 1
    finally:
        halt.set()
        scraper.join(30)
    elapsed = time.monotonic() - t0
    after = reviews()
    asked = {k: after[k] - before[k] for k in after}
    said = f"{asked} in {elapsed:.1f} s; flood {dict(codes)}; tenant {dict(tenant_codes)}"
    assert set(codes) <= {401, 429} and codes[429] > 0, said
    assert set(tenant_codes) == {403}, said  # reviewed once, then the cached denial
    assert set(scrapes) == {200}, (scrapes, said)
    prometheus_reviews = int(elapsed / CACHE_TTL) + 1
    limit = REVIEW_BURST + int(elapsed / REVIEW_EVERY) + 1
    assert asked["tokenreviews"] <= limit + 1 + prometheus_reviews, said
    assert codes[401] <= limit, said
    assert asked["subjectaccessreviews"] <= 1 + prometheus_reviews, said
    assert "Traceback" not in agent.log()
    print(f"\nkube-apiserver saw {said}")
