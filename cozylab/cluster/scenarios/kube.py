"""Section 14: the Kubernetes API as the agents meet it on a cluster (issue 35), against the
real kube-apiserver and EndpointSlice controller: a Service created, changed and deleted in
both modes; a VM's pod not Ready and Ready again; source ranges; EndpointSlices a tenant
writes in its own namespace (RBAC lets it); the metrics for Prometheus's token and a
tenant's."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

from cozylab.cluster.api import (
    MONITORING_NAMESPACE,
    PROMETHEUS,
    TENANT,
    TENANT_NAMESPACE,
    VM_LABEL,
    PodState,
    lb_status,
    pod_object,
    service_object,
)
from cozylab.cluster.rows import Case, Check, Group
from cozylab.cluster.scenarios.migration import acks_from_outside
from cozylab.cluster.spec import CLIENT_IP, NODES, OUTSIDE_IP, Workload, node_ip, node_name
from cozylab.kubecp import KubeError, path_of
from cozylab.netns import wait_for

if TYPE_CHECKING:
    from cozylab.cluster.lab import ClusterLab

SCENARIO = "14 kubernetes api"
#: a Service the rows create, change and delete; its backend is the plain pod p3's address
NEW = "vm-new"
NEW_LB = "203.0.113.80"
NEW_BACKEND = "p3"
#: the VM whose pod goes not Ready and back, the VM that gets source ranges
UNREADY, RANGED = "vm-d", "vm-b"
#: the tenant's Service (its namespace, no selector: its slices are written by hand) and the
#: address its forged slices point at (another tenant's VM)
FORGED, FORGED_LB, VICTIM = "tenant-svc", "203.0.113.90", "vm-e"
METRICS_NODE = 1
METRICS_PORT = 9811  # the DaemonSet's COZYEBPF_RUN_METRICS_ADDRESS: $(NODE_IP):9811


def _held(lab: ClusterLab, lb: str) -> dict[str, str | None]:
    """What each agent maps `lb` to (None: not at all)."""
    return {node_name(a.node): lab.agents.lb_map(a).get(lb) for a in lab.agents.by_node.values()}


def _everywhere(lab: ClusterLab, lb: str, ip: str | None, timeout: float = 15) -> None:
    wait_for(
        lambda: all(v == ip for v in _held(lab, lb).values()),
        timeout,
        lambda: f"every agent to map {lb} to {ip or 'nothing'}: {_held(lab, lb)}",
    )


class Lifecycle:
    """A Service created, changed and deleted, in both modes; a row per step, in order (each
    row makes its step: the rows are the steps)."""

    def __init__(self, lab: ClusterLab) -> None:
        self.lab = lab
        backend = lab.workloads[NEW_BACKEND]
        self.node = backend.node
        self.whole = Workload(NEW, 97, backend.node, backend.ip, NEW_LB, whole_ip=True)
        self.filter = Workload(NEW, 97, backend.node, backend.ip, NEW_LB)

    def _put(self, w: Workload) -> Check:
        lab, api = self.lab, self.lab.api
        assert api is not None
        api.put_service(w)
        if NEW_BACKEND not in api.pods:
            pod = pod_object(NEW_BACKEND, {VM_LABEL: NEW}, self.node)
            api.put_pod(pod, PodState(NEW, self.node, w.ip))
        lab.extra_lbs[NEW_LB] = self.node
        lab.announce()
        lab.sync_agents()
        _everywhere(lab, NEW_LB, w.ip)
        seen = lab.check("tcp", lab.client, NEW_LB, 80, CLIENT_IP)
        unlisted = lab.check_unlisted(NEW_LB, w.whole_ip)
        return seen[0] and unlisted[0], f"{seen[1]}; {unlisted[1]}"

    def _delete(self) -> Check:
        lab, api = self.lab, self.lab.api
        assert api is not None
        api.delete_service(NEW)
        api.delete_pod(NEW_BACKEND)
        lab.extra_lbs.pop(NEW_LB, None)
        lab.announce()
        lab.sync_agents()
        held = _held(lab, NEW_LB)
        return not any(held.values()), f"the agents map {NEW_LB} to: {held}"

    def group(self) -> Group:
        s = SCENARIO
        cases = [
            Case(
                s, f"{NEW} created, whole-IP: programmed, tcp/81 too", lambda: self._put(self.whole)
            ),
            Case(
                s, f"{NEW} changed to a port filter: tcp/81 dropped", lambda: self._put(self.filter)
            ),
            Case(s, f"{NEW} deleted: no agent holds {NEW_LB}", self._delete),
            Case(s, f"{NEW} created, port filter: tcp/81 dropped", lambda: self._put(self.filter)),
            Case(s, f"{NEW} changed to whole-IP: tcp/81 answered", lambda: self._put(self.whole)),
            Case(s, f"{NEW} deleted again: no agent holds {NEW_LB}", self._delete),
        ]
        return Group(cases)


def readiness(lab: ClusterLab, ready: bool) -> Check:
    """vm-d's pod not Ready (its slice's endpoint ready: false): no agent programs its LB IP,
    MetalLB withdraws it; Ready again: programmed and answered."""
    w = lab.workloads[UNREADY]
    assert w.lb_ip is not None
    lab.set_ready(w, ready)
    lab.announce({**lab.ready(), w.name: [lab.location[w.name]] if ready else []})
    lab.sync_agents()
    _everywhere(lab, w.lb_ip, w.ip if ready else None)
    if not ready:
        return True, f"no agent maps {w.lb_ip}: {_held(lab, w.lb_ip)}"
    return lab.check("tcp", lab.client, w.lb_ip, 80, CLIENT_IP)


def source_ranges(lab: ClusterLab) -> Check:
    """vm-b with loadBalancerSourceRanges [the client/32]: the client is answered; TCP from
    OUTSIDE_IP is dropped and counted (drop_source). The ranges go again after."""
    api, w = lab.api, lab.workloads[RANGED]
    assert api is not None and w.lb_ip is not None
    lb = w.lb_ip
    try:
        api.put_service(w, loadBalancerSourceRanges=[f"{CLIENT_IP}/32"])
        lab.sync_agents()
        seen = lab.check("tcp", lab.client, lb, 80, CLIENT_IP)
        dropped = acks_from_outside(lab, lb, 42000)
    finally:
        api.put_service(w)
        lab.sync_agents()
    return seen[0] and dropped >= 3, f"{seen[1]}; 3 ACKs from {OUTSIDE_IP}: drop_source +{dropped}"


# -- a tenant's EndpointSlices ------------------------------------------------------------------


def _tenant_slice(name: str, ip: str, managed_by: str | None) -> dict[str, Any]:
    labels = {"kubernetes.io/service-name": FORGED}
    if managed_by:
        labels["endpointslice.kubernetes.io/managed-by"] = managed_by
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": TENANT_NAMESPACE, "labels": labels},
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [ip],
                "conditions": {"ready": True},
                "nodeName": node_name(1),
                "targetRef": {"kind": "Pod", "namespace": TENANT_NAMESPACE, "name": "made-up"},
            }
        ],
        "ports": [{"name": "tcp-65535", "protocol": "TCP", "port": 65535}],
    }


class Tenant:
    """The tenant's whole-IP Service (no selector, in its namespace, labelled for cozyebpf;
    MetalLB gave it FORGED_LB) and the slices it writes with its own token."""

    def __init__(self, lab: ClusterLab) -> None:
        self.lab = lab
        self.results: dict[str, Check] = {}

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        api = self.lab.api
        assert api is not None
        tenant = api.tenant()
        victim = self.lab.workloads[VICTIM].ip
        svc = service_object(Workload(FORGED, 96, 1, victim, FORGED_LB, whole_ip=True))
        svc["metadata"]["namespace"] = TENANT_NAMESPACE
        del svc["spec"]["selector"]
        try:
            tenant.create(svc)
            api.admin.apply(lb_status(FORGED, FORGED_LB, TENANT_NAMESPACE), subresource="status")
            self.results["unlabelled"] = self._write(tenant, "by-hand", victim, None)
            self.results["labelled"] = self._write(
                tenant, "as-controller", victim, "endpointslice-controller.k8s.io"
            )
            self.lab.sync_agents()
            self.results["held"] = self._not_held()
            yield
        finally:
            with contextlib.suppress(KubeError):
                api.admin.delete("Service", TENANT_NAMESPACE, FORGED)
                api.admin.delete_all("EndpointSlice", TENANT_NAMESPACE)

    @staticmethod
    def _write(tenant: Any, name: str, ip: str, managed_by: str | None) -> Check:
        try:
            tenant.create(_tenant_slice(name, ip, managed_by))
        except KubeError as e:
            return False, f"refused: HTTP {e.status} {e.message}"
        return True, "written"

    def _not_held(self) -> Check:
        held = _held(self.lab, FORGED_LB)
        return not any(held.values()), f"the agents map {FORGED_LB} to: {held}"

    def unlabelled(self) -> Check:
        """Written (RBAC allows it), not programmed, a Warning Event on it from each agent."""
        api = self.lab.api
        assert api is not None
        wrote = self.results.get("unlabelled", (False, "not run"))
        held = self.results.get("held", (False, "not run"))

        def events() -> list[dict[str, Any]]:
            return [
                e
                for e in api.events(TENANT_NAMESPACE)
                if e["involvedObject"]["kind"] == "EndpointSlice"
                and e["involvedObject"]["name"] == "by-hand"
            ]

        with contextlib.suppress(TimeoutError):
            wait_for(lambda: len({e["source"].get("host") for e in events()}) == len(NODES), 10)
        got = events()
        hosts = sorted({str(e["source"].get("host")) for e in got})
        ok = wrote[0] and held[0] and hosts == [node_name(n) for n in NODES]
        ok = ok and all(e["type"] == "Warning" and "not programmed" in e["message"] for e in got)
        return ok, f"{wrote[1]}; {held[1]}; Warning Events from {hosts}"

    def labelled(self) -> Check:
        """Labelled as the controller's: the API server refuses it (the chart's
        ValidatingAdmissionPolicy), so no agent sees it."""
        wrote = self.results.get("labelled", (True, "not run"))
        held = self.results.get("held", (False, "not run"))
        refused = not wrote[0] and "endpointslice-controller.k8s.io" in wrote[1]
        return refused and held[0], f"{wrote[1]}; {held[1]}"


def _controller_slice_change(lab: ClusterLab) -> Check:
    """The tenant changes the address of a slice the controller wrote for a Service of the
    tenant's namespace (a Service with a selector and a pod): refused by the API server."""
    api = lab.api
    assert api is not None
    backend = lab.workloads[VICTIM]
    name = "tenant-vm"
    svc = service_object(Workload(name, 95, backend.node, backend.ip, "203.0.113.91"))
    svc["metadata"]["namespace"] = TENANT_NAMESPACE
    pod = pod_object("tenant-vm-pod", {VM_LABEL: name}, backend.node)
    pod["metadata"]["namespace"] = TENANT_NAMESPACE
    try:
        api.admin.apply(svc)
        api.admin.create(pod)
        status = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "tenant-vm-pod", "namespace": TENANT_NAMESPACE},
            "status": {
                "phase": "Running",
                "podIP": "10.244.9.95",
                "podIPs": [{"ip": "10.244.9.95"}],
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }
        api.admin.apply(status, subresource="status")
        slices: list[dict[str, Any]] = wait_for(
            lambda: api.admin.list(
                "EndpointSlice", TENANT_NAMESPACE, f"kubernetes.io/service-name={name}"
            ),
            15,
            "the controller's slice of the tenant's Service",
        )
        s = slices[0]
        patch = [{"op": "replace", "path": "/endpoints/0/addresses/0", "value": backend.ip}]
        try:
            api.tenant().request(
                "PATCH",
                path_of("EndpointSlice", TENANT_NAMESPACE, s["metadata"]["name"]),
                patch,
                content_type="application/json-patch+json",
            )
        except KubeError as e:
            return e.status in (403, 422), f"refused: HTTP {e.status} {e.message}"
        return False, f"the tenant changed {s['metadata']['name']} to {backend.ip}"
    finally:
        with contextlib.suppress(KubeError):
            api.admin.delete("Service", TENANT_NAMESPACE, name)
            api.admin.delete("Pod", TENANT_NAMESPACE, "tenant-vm-pod")


# -- metrics ------------------------------------------------------------------------------------


def scrape(lab: ClusterLab, token: str | None) -> tuple[str, str]:
    """GET https://<node1>:9811/metrics from the client (the agent's certificate is its own,
    self-signed): (HTTP code, the body's first cozyebpf_ line or what curl said)."""
    args = ["curl", "-sk", "--max-time", "10", "-w", "\n%{http_code}"]
    if token:
        args += ["-H", f"Authorization: Bearer {token}"]
    url = f"https://{node_ip(METRICS_NODE)}:{METRICS_PORT}/metrics"
    p = lab.lab.exec(lab.client, *args, url, check=False)
    body, _, code = p.stdout.rpartition("\n")
    first = next((line for line in body.splitlines() if line.startswith("cozyebpf_")), "")
    return code, first or (body[:200] + p.stderr[:200])


def metrics(lab: ClusterLab, who: str) -> Check:
    api = lab.api
    assert api is not None
    token = None
    if who == "prometheus":
        token = api.token_of(MONITORING_NAMESPACE, PROMETHEUS)
    elif who == "tenant":
        token = api.token_of(TENANT_NAMESPACE, TENANT)
    want = {"prometheus": "200", "tenant": "403", "nobody": "401"}[who]
    code, said = scrape(lab, token)
    ok = code == want and (want != "200" or said.startswith("cozyebpf_"))
    return ok, f"HTTP {code}: {said}"


def every_request_granted(lab: ClusterLab) -> Check:
    """Every request the agents made in the whole run was one the chart's ClusterRole grants:
    no 403 in any agent's log (an Event, a list or watch, a pod's metadata, a review)."""
    refused = {
        node_name(n): [line for line in lab.agents.log(n).splitlines() if "HTTP 403" in line]
        for n in NODES
    }
    bad = {n: lines[:2] for n, lines in refused.items() if lines}
    return not bad, f"refused: {bad}" if bad else "no 403 in the agents' logs"


def group(lab: ClusterLab) -> list[Group]:
    s = SCENARIO
    tenant = Tenant(lab)
    mnode = node_name(METRICS_NODE)
    step: Callable[[bool], Check] = partial(readiness, lab)
    return [
        Lifecycle(lab).group(),
        Group(
            [
                Case(
                    s, f"{UNREADY}'s pod not Ready: no agent holds its LB IP", lambda: step(False)
                ),
                Case(s, f"{UNREADY}'s pod Ready again: programmed, answered", lambda: step(True)),
                Case(
                    s,
                    f"{RANGED} with source ranges: the client answered, another dropped",
                    partial(source_ranges, lab),
                ),
            ]
        ),
        Group(
            [
                Case(
                    s,
                    "a tenant's slice without the controller's label: not programmed, Events",
                    tenant.unlabelled,
                ),
                Case(
                    s,
                    "a tenant's slice labelled as the controller's: refused by the API server",
                    tenant.labelled,
                ),
            ],
            around=tenant.running,
        ),
        Group(
            [
                Case(
                    s,
                    "a tenant's change of the controller's slice: refused by the API server",
                    partial(_controller_slice_change, lab),
                ),
                Case(
                    s,
                    f"{mnode} metrics, Prometheus's token: 200",
                    partial(metrics, lab, "prometheus"),
                ),
                Case(s, f"{mnode} metrics, a tenant's token: 403", partial(metrics, lab, "tenant")),
                Case(s, f"{mnode} metrics, no token: 401", partial(metrics, lab, "nobody")),
            ]
        ),
        Group(
            [
                Case(
                    s,
                    "the ClusterRole granted every request of the run: no 403 in an agent's log",
                    partial(every_request_granted, lab),
                )
            ]
        ),
    ]
