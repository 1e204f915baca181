"""The API the agents read: the real control plane (cozylab/kubecp/) on the lab's network, and
what the lab writes to it as the cluster's other components would: Nodes and their addresses
(the kubelet), Services as Cozystack's chart writes them and their LB IPs (MetalLB), the VMs'
virt-launcher Pods bound to nodes and their status (the scheduler, the kubelet: podIP, phase,
Ready). Kubernetes' EndpointSlice controller writes the slices from them. The agents' rights
are the chart's own (its rendered ServiceAccount, ClusterRole and binding), with a token from
the TokenRequest API bound to a pod of theirs, as the DaemonSet's pods get one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cozylab.cluster.spec import Workload, node_ip, node_name
from cozylab.kubecp import ControlPlane, Kube, KubeError
from cozylab.netns import wait_for

PROXY_LABEL = "service.kubernetes.io/service-proxy-name"
VM_LABEL = "vm.kubevirt.io/name"
NAMESPACE = "default"
#: the chart's release namespace (deploy/: cozy-system), where the agents' pods run
AGENT_NAMESPACE = "cozy-system"
#: a tenant with write rights on EndpointSlices and Services in its own namespace
TENANT_NAMESPACE, TENANT = "tenant-a", "tenant"
#: Prometheus, bound to the chart's metrics-reader ClusterRole
MONITORING_NAMESPACE, PROMETHEUS = "monitoring", "prometheus"
REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "cozyebpf"
RELEASE = "cozyebpf"

Obj = dict[str, Any]


def service_object(w: Workload, namespace: str = NAMESPACE, **spec: Any) -> Obj:
    """The Service of a VM as Cozystack's vm-instance chart writes it (its spec; MetalLB
    writes the status: `lb_status`). `spec` adds or replaces fields of its spec."""
    assert w.lb_ip is not None
    ann = {"networking.cozystack.io/wholeIP": "true" if w.whole_ip else "false"}
    if w.allow_icmp:
        ann["networking.cozystack.io/allowICMP"] = "true"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": w.name,
            "namespace": namespace,
            "labels": {PROXY_LABEL: "cozy-proxy", "apps.cozystack.io/application.name": w.name},
            "annotations": ann,
        },
        "spec": {
            "type": "LoadBalancer",
            "externalTrafficPolicy": "Local",
            "allocateLoadBalancerNodePorts": False,
            "selector": {VM_LABEL: w.name},
            "ports": [
                {"name": f"{p.lower()}-{n}", "protocol": p, "port": n, "targetPort": n}
                for p, n in w.ports
            ],
            **spec,
        },
    }


def lb_status(name: str, lb_ip: str, namespace: str = NAMESPACE) -> Obj:
    """The status MetalLB writes once it assigned the Service its LB IP."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace},
        "status": {"loadBalancer": {"ingress": [{"ip": lb_ip, "ipMode": "VIP"}]}},
    }


def node_object(n: int) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": node_name(n), "labels": {"kubernetes.io/hostname": node_name(n)}},
    }


def node_status(n: int) -> Obj:
    """A Node's addresses, as the kubelet reports them."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": node_name(n)},
        "status": {
            "addresses": [
                {"type": "InternalIP", "address": node_ip(n)},
                {"type": "Hostname", "address": node_name(n)},
            ]
        },
    }


def pod_object(
    name: str, labels: Mapping[str, str], node: int, annotations: Mapping[str, str] | None = None
) -> Obj:
    """A pod bound to `node` (no scheduler); its container never runs (no kubelet)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": dict(labels),
            "annotations": dict(annotations or {}),
        },
        "spec": {
            "nodeName": node_name(node),
            "containers": [{"name": "compute", "image": "registry.invalid/virt-launcher:lab"}],
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 0,
        },
    }


def vm_pod_object(w: Workload, name: str, node: int) -> Obj:
    """A VM's virt-launcher pod (the port-security annotation as KubeVirt copies it from the
    VM's template; none without port security)."""
    ann = {"ovn.kubernetes.io/port_security": "true"} if w.port_security else {}
    return pod_object(name, {VM_LABEL: w.name, "kubevirt.io": "virt-launcher"}, node, ann)


def pod_status(name: str, ip: str, node: int, ready: bool = True, phase: str = "Running") -> Obj:
    """The status a kubelet writes: running (Ready or not), or Succeeded (the VM left: the
    source virt-launcher pod after a migration)."""
    running = phase == "Running"
    flag = "True" if ready and running else "False"
    conditions = [
        {"type": "PodScheduled", "status": "True"},
        {"type": "Initialized", "status": "True"},
        {"type": "ContainersReady", "status": flag},
        {"type": "Ready", "status": flag},
    ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "status": {
            "phase": phase,
            "hostIP": node_ip(node),
            "hostIPs": [{"ip": node_ip(node)}],
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "conditions": conditions,
        },
    }


@dataclass(frozen=True)
class PodState:
    """A pod as the lab last wrote it: the Service it backs (by its selector), where it runs,
    its IP, Ready, its phase."""

    service: str
    node: int
    ip: str
    ready: bool = True
    phase: str = "Running"


def find_helm() -> str | None:
    """helm beside this Python, in the repository's .venv (scripts/setup.sh puts it there), or
    on PATH."""
    for candidate in (Path(sys.executable).parent / "helm", REPO / ".venv" / "bin" / "helm"):
        if os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("helm")


def chart_objects(
    kinds: Iterable[str] = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding"),
) -> list[Obj]:
    """The chart's objects of `kinds`, rendered with its default values as the release
    `cozyebpf` in `AGENT_NAMESPACE` (helm template: what an install applies)."""
    helm = find_helm()
    if helm is None:
        raise RuntimeError("the lab renders the chart with helm: run scripts/setup.sh")
    out = subprocess.run(
        [helm, "template", RELEASE, str(CHART), "--namespace", AGENT_NAMESPACE],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    wanted = set(kinds)
    return [d for d in yaml.safe_load_all(out) if isinstance(d, dict) and d.get("kind") in wanted]


class LabApi:
    """The control plane as the lab uses it (module docstring): `admin` writes what the
    cluster's components would; the rest are identities (the agents', a tenant's,
    Prometheus's)."""

    def __init__(self, cp: ControlPlane, workdir: Path) -> None:
        self.cp = cp
        self.admin: Kube = cp.admin
        self.workdir = workdir
        self.pods: dict[str, PodState] = {}  # by pod name (namespace NAMESPACE)
        self.chart: list[Obj] = []

    # -- the cluster's shape -------------------------------------------------------------

    def setup(self) -> None:
        """Namespaces, the chart's RBAC (and whatever else it renders for the API), a tenant
        and Prometheus with their rights."""
        for ns in (AGENT_NAMESPACE, TENANT_NAMESPACE, MONITORING_NAMESPACE):
            self.admin.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        self.chart = chart_objects(
            (
                "ServiceAccount",
                "ClusterRole",
                "ClusterRoleBinding",
                "ValidatingAdmissionPolicy",
                "ValidatingAdmissionPolicyBinding",
            )
        )
        for obj in self.chart:
            self.admin.apply(obj)
        self._service_account(MONITORING_NAMESPACE, PROMETHEUS)
        self.admin.apply(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": "prometheus-cozyebpf-metrics"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": f"{RELEASE}-metrics-reader",
                },
                "subjects": [
                    {
                        "kind": "ServiceAccount",
                        "name": PROMETHEUS,
                        "namespace": MONITORING_NAMESPACE,
                    }
                ],
            }
        )
        # a tenant: Services and EndpointSlices of its own namespace (what a platform that
        # lets tenants run their own controllers grants; the README's threat)
        self._service_account(TENANT_NAMESPACE, TENANT)
        self.admin.apply(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": "tenant-network", "namespace": TENANT_NAMESPACE},
                "rules": [
                    {
                        "apiGroups": [""],
                        "resources": ["services", "pods"],
                        "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
                    },
                    {
                        "apiGroups": ["discovery.k8s.io"],
                        "resources": ["endpointslices"],
                        "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
                    },
                ],
            }
        )
        self.admin.apply(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": "tenant-network", "namespace": TENANT_NAMESPACE},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "Role",
                    "name": "tenant-network",
                },
                "subjects": [
                    {"kind": "ServiceAccount", "name": TENANT, "namespace": TENANT_NAMESPACE}
                ],
            }
        )

    def _service_account(self, namespace: str, name: str) -> None:
        self.admin.apply(
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": {"name": name, "namespace": namespace},
            }
        )

    def agent_service_account(self) -> str:
        """The ServiceAccount the chart's DaemonSet runs as."""
        sa = next(o for o in self.chart if o["kind"] == "ServiceAccount")
        return str(sa["metadata"]["name"])

    def agent_identity(self, n: int, where: Path) -> Path:
        """The DaemonSet's pod on node n (bound to it, never running) and the files its
        ServiceAccount volume would hold: a token bound to that pod, the CA, the namespace."""
        sa = self.agent_service_account()
        pod = self.admin.apply(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"{RELEASE}-{node_name(n)}",
                    "namespace": AGENT_NAMESPACE,
                    "labels": {"app.kubernetes.io/name": RELEASE},
                },
                "spec": {
                    "nodeName": node_name(n),
                    "serviceAccountName": sa,
                    "hostNetwork": True,
                    "containers": [{"name": RELEASE, "image": "ghcr.io/cozystack/cozyebpf:lab"}],
                },
            }
        )
        token = self.admin.token(AGENT_NAMESPACE, sa, seconds=3600, pod=pod)
        return self.cp.in_cluster(where, AGENT_NAMESPACE, token)

    def token_of(self, namespace: str, name: str) -> str:
        return self.admin.token(namespace, name, seconds=3600)

    def tenant(self) -> Kube:
        return self.admin.as_token(self.token_of(TENANT_NAMESPACE, TENANT))

    # -- what the cluster's components write ----------------------------------------------

    def put_node(self, n: int) -> None:
        self.admin.apply(node_object(n))
        self.admin.apply(node_status(n), subresource="status")

    def put_service(self, w: Workload, namespace: str = NAMESPACE, **spec: Any) -> None:
        """w's Service (with `spec` fields), and its LB IP as MetalLB writes it."""
        assert w.lb_ip is not None
        self.admin.apply(service_object(w, namespace, **spec))
        self.admin.apply(lb_status(w.name, w.lb_ip, namespace), subresource="status")

    def delete_service(self, name: str, namespace: str = NAMESPACE) -> None:
        self.admin.delete("Service", namespace, name)

    def put_pod(self, obj: Obj, state: PodState) -> None:
        """Create the pod `obj` (bound to its node) unless it exists, then write its status."""
        name = obj["metadata"]["name"]
        if name not in self.pods:
            try:
                self.admin.create(obj)
            except KubeError as e:
                if e.status != 409:
                    raise
        self.set_pod(name, state)

    def set_pod(self, name: str, state: PodState) -> None:
        self.admin.apply(
            pod_status(name, state.ip, state.node, state.ready, state.phase), subresource="status"
        )
        self.pods[name] = state

    def delete_pod(self, name: str) -> None:
        self.admin.delete("Pod", NAMESPACE, name)
        self.pods.pop(name, None)

    # -- what the EndpointSlice controller writes ------------------------------------------

    def expected(self, service: str) -> set[tuple[str, str, str, bool]]:
        """(pod, node, address, ready) of each endpoint the controller must write for
        `service` from the pods as the lab wrote them: the running ones (a pod that
        Succeeded is no endpoint)."""
        return {
            (name, node_name(p.node), p.ip, p.ready)
            for name, p in self.pods.items()
            if p.service == service and p.phase == "Running"
        }

    def endpoints(
        self, service: str, namespace: str = NAMESPACE
    ) -> set[tuple[str, str, str, bool]]:
        """(pod, node, address, ready) of each endpoint of the Service's slices on the server."""
        out = set()
        for s in self.admin.list(
            "EndpointSlice", namespace, f"kubernetes.io/service-name={service}"
        ):
            for ep in s.get("endpoints") or []:
                ref = ep.get("targetRef") or {}
                ready = bool((ep.get("conditions") or {}).get("ready"))
                for addr in ep.get("addresses") or []:
                    out.add((str(ref.get("name")), str(ep.get("nodeName")), addr, ready))
        return out

    def wait_slices(self, services: Iterable[str], timeout: float = 90) -> None:
        """Until the controller wrote what the pods say for each of `services`. A bound for
        a hang: right after kube-apiserver restarts, kube-controller-manager's informers are
        refused (403: the server's RBAC is not loaded yet although /readyz passed) and back
        off, up to 30 s once it restarted a few times in two minutes (client-go's reflector)."""
        for svc in services:
            wait_for(
                lambda svc=svc: self.endpoints(svc) == self.expected(svc),  # type: ignore[misc]
                timeout,
                lambda svc=svc: (  # type: ignore[misc]
                    f"the EndpointSlice controller to write {svc}'s endpoints "
                    f"{sorted(self.expected(svc))} (the server has {sorted(self.endpoints(svc))})"
                ),
            )

    def events(self, namespace: str = NAMESPACE, component: str | None = "cozyebpf") -> list[Obj]:
        """The Events of `namespace` as the server stores them, of `component` (the agents'
        by default; None: all). The cluster's own components post theirs too: the
        EndpointSlice controller's FailedToUpdateEndpointSlices on a Service, under load."""
        events = self.admin.list("Event", namespace)
        if component is None:
            return events
        return [e for e in events if (e.get("source") or {}).get("component") == component]

    def clean(self) -> None:
        """What the lab wrote, removed (a shared control plane serves the next lab)."""
        self.cp.clean([NAMESPACE, AGENT_NAMESPACE, TENANT_NAMESPACE, MONITORING_NAMESPACE])
        self.pods.clear()
