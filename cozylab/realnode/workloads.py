"""What runs on the real nodes besides the chart: the backends, as a user's cluster has them.

- `web`, a Deployment of one replica (the echo image: HTTP :80, TCP and UDP echo :7), behind a
  port-filter Service (TCP 80 and 7, UDP 7, ICMP allowed);
- `vm`, a VM-like Pod (labelled as KubeVirt labels a virt-launcher Pod), behind a whole-IP
  Service;
both with a readiness probe on /ready, so that the kubelet's probes decide the endpoints' Ready.
The Services are written as Cozystack's vm-instance chart writes them (cozylab/cluster/api.py
`service_object`); their LB IPs are written into their status by the lab, as MetalLB's
controller would (`lb_status`)."""

from __future__ import annotations

from typing import Any

from cozylab.realnode.spec import ECHO_IMAGE, LB_FILTERED, LB_WHOLE

Obj = dict[str, Any]

NAMESPACE = "tenant-lab"
PROXY_LABEL = "service.kubernetes.io/service-proxy-name"
WEB, VM = "web", "vm"
#: the port-filter Service's ports (the echo listens on them); a port outside them is refused
WEB_PORTS = (("TCP", 80), ("TCP", 7), ("UDP", 7))
#: the readiness probe's period (s) and failures: a backend that stops answering /ready leaves
#: its Service's endpoints within about 2 s
PROBE_PERIOD, PROBE_FAILURES = 1, 2


def _container() -> Obj:
    return {
        "name": "echo",
        "image": ECHO_IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "ports": [
            {"name": "http", "containerPort": 80, "protocol": "TCP"},
            {"name": "echo-tcp", "containerPort": 7, "protocol": "TCP"},
            {"name": "echo-udp", "containerPort": 7, "protocol": "UDP"},
        ],
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": 80},
            "periodSeconds": PROBE_PERIOD,
            "failureThreshold": PROBE_FAILURES,
        },
        # As a VM's virt-launcher Pod asks for its vCPUs: a BestEffort Pod gets cgroup v1's
        # smallest CPU share (2), and while an agent compiles on the 2-core node its echo was
        # starved for seconds and its socket overflowed (UdpRcvbufErrors in the Pod: the lab's
        # loss, not the datapath's)
        "resources": {"requests": {"cpu": "100m", "memory": "16Mi"}},
    }


def namespace() -> Obj:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}


def web_deployment() -> Obj:
    labels = {"app": WEB}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": WEB, "namespace": NAMESPACE},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [_container()],
                    "terminationGracePeriodSeconds": 1,
                },
            },
        },
    }


def vm_pod(node: str) -> Obj:
    """The VM-like Pod, on `node` (KubeVirt's virt-launcher Pods are bare Pods too)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": VM,
            "namespace": NAMESPACE,
            "labels": {"kubevirt.io": "virt-launcher", "vm.kubevirt.io/name": VM},
        },
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "containers": [_container()],
            "terminationGracePeriodSeconds": 1,
        },
    }


def service(name: str, whole_ip: bool, selector: dict[str, str]) -> Obj:
    """A VM's Service as Cozystack's vm-instance chart writes it (a whole-IP one lists port
    65535 only)."""
    ann = {"networking.cozystack.io/wholeIP": "true" if whole_ip else "false"}
    if not whole_ip:
        ann["networking.cozystack.io/allowICMP"] = "true"
    ports = (("TCP", 65535),) if whole_ip else WEB_PORTS
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": {PROXY_LABEL: "cozy-proxy", "apps.cozystack.io/application.name": name},
            "annotations": ann,
        },
        "spec": {
            "type": "LoadBalancer",
            "externalTrafficPolicy": "Local",
            "allocateLoadBalancerNodePorts": False,
            "selector": selector,
            "ports": [
                {"name": f"{p.lower()}-{n}", "protocol": p, "port": n, "targetPort": n}
                for p, n in ports
            ],
        },
    }


def services() -> list[Obj]:
    return [
        service(VM, True, {"vm.kubevirt.io/name": VM}),
        service(WEB, False, {"app": WEB}),
    ]


LB_IPS = {VM: LB_WHOLE, WEB: LB_FILTERED}


def lb_status(name: str) -> Obj:
    """The status MetalLB's controller writes once it assigned the Service its LB IP."""
    return {"status": {"loadBalancer": {"ingress": [{"ip": LB_IPS[name], "ipMode": "VIP"}]}}}
