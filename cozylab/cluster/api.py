"""The API the agents read: the objects the lab writes (Nodes, Services as Cozystack's chart
writes them, virt-launcher Pods, EndpointSlices) and the FakeKubeAPI with a forwarder in each
node namespace (`ApiBridge`)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cozylab.cluster.spec import Workload, node_ip, node_name
from cozylab.kubeapi import FakeKubeAPI
from cozylab.netns import Lab

PROXY_LABEL = "service.kubernetes.io/service-proxy-name"


def service_object(w: Workload, created: str = "2026-01-01T00:00:00Z") -> dict[str, Any]:
    """The Service of a VM as Cozystack's vm-instance chart writes it, with its status."""
    assert w.lb_ip is not None
    ann = {"networking.cozystack.io/wholeIP": "true" if w.whole_ip else "false"}
    if w.allow_icmp:
        ann["networking.cozystack.io/allowICMP"] = "true"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": w.name,
            "namespace": "default",
            "creationTimestamp": created,
            "labels": {PROXY_LABEL: "cozy-proxy", "apps.cozystack.io/application.name": w.name},
            "annotations": ann,
        },
        "spec": {
            "type": "LoadBalancer",
            "externalTrafficPolicy": "Local",
            "allocateLoadBalancerNodePorts": False,
            "selector": {"vm.kubevirt.io/name": w.name},
            "ports": [
                {"name": f"{p.lower()}-{n}", "protocol": p, "port": n, "targetPort": n}
                for p, n in w.ports
            ],
        },
        "status": {"loadBalancer": {"ingress": [{"ip": w.lb_ip, "ipMode": "VIP"}]}},
    }


def node_object(n: int) -> dict[str, Any]:
    """A Node with its addresses, as the kubelet reports them."""
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


def pod_object(w: Workload, name: str, node: int) -> dict[str, Any]:
    """A VM's virt-launcher pod, for the agents' port-security reads (the annotation as
    KubeVirt copies it from the VM's template; none without port security)."""
    ann = {"ovn.kubernetes.io/port_security": "true"} if w.port_security else {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "default",
            "labels": {"vm.kubevirt.io/name": w.name},
            "annotations": ann,
        },
        "spec": {"nodeName": node_name(node)},
        "status": {"podIP": w.ip},
    }


def slice_object(
    name: str, ip: str, ports: Sequence[tuple[str, int]], endpoints: Sequence[tuple[int, str]]
) -> dict[str, Any]:
    """The EndpointSlice of Service `name`: one ready endpoint per (node, pod name), all with
    the address `ip` (during a migration both virt-launcher pods are ready with one IP)."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{name}-x7k2p",
            "namespace": "default",
            "labels": {
                "kubernetes.io/service-name": name,
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
            },
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [ip],
                "conditions": {"ready": True, "serving": True, "terminating": False},
                "nodeName": node_name(n),
                "targetRef": {"kind": "Pod", "namespace": "default", "name": pod},
            }
            for n, pod in endpoints
        ],
        "ports": [{"name": f"{p.lower()}-{n}", "protocol": p, "port": n} for p, n in ports],
    }


class ApiBridge:
    """The FakeKubeAPI, listening on 127.0.0.1 of namespace `api_ns`, and a forwarder in each
    node namespace on its own 127.0.0.1 at the same port: agents use one kubeconfig."""

    def __init__(self, lab: Lab, api_ns: str, node_nss: Sequence[str], workdir: Path) -> None:
        self.lab = lab
        self.api_ns = api_ns
        self.api = FakeKubeAPI(bookmark_interval=1.0)
        lab.in_ns(api_ns, self.api.start)
        self.port = urlsplit(self.api.url).port or 0
        self.kubeconfig = self.api.kubeconfig(workdir / "kubeconfig")
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        for ns in node_nss:
            listener = lab.ns_socket(ns, socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self.port))
            listener.listen(16)
            listener.settimeout(0.2)
            self._keep(listener)
            threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _keep(self, s: socket.socket) -> None:
        with self._lock:
            self._socks.append(s)

    def _accept(self, listener: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            up = self.lab.ns_socket(self.api_ns, socket.AF_INET, socket.SOCK_STREAM)
            try:
                up.connect(("127.0.0.1", self.port))
            except OSError:
                conn.close()
                up.close()
                continue
            self._keep(conn)
            self._keep(up)
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
        self.api.stop()


# -- MetalLB L2 ------------------------------------------------------------------------------
