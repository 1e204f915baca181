"""The labs' Kubernetes control plane: the real etcd, kube-apiserver and kube-controller-manager
(issue 35), built from the Go module proxy by scripts/build-kube.sh (the release that
cozylab/controlplane/kube/go.mod pins), run in a network namespace of their own.

- **etcd** on the namespace's 127.0.0.1 (fsync off: a lab's data lives as long as the lab).
- **kube-apiserver** on 0.0.0.0:6443 of the namespace: TLS with a certificate of the lab's CA
  (`Pki`, made with `cryptography`) for its address on the lab's network, the first Service IP
  and kubernetes.default.svc; client certificates of that CA (the lab's admin is in
  system:masters; kube-controller-manager is system:kube-controller-manager); authorization
  Node,RBAC; ServiceAccount tokens signed with a key of the lab's; the lab's Service range
  `SERVICE_CIDR`.
- **kube-controller-manager**: the controllers the labs need (`CONTROLLERS`: the EndpointSlice
  controller writes every Service's slices from the Pods the lab creates; serviceaccount,
  serviceaccount-token, namespace, garbagecollector), each with its own ServiceAccount's
  credentials (--use-service-account-credentials), as Talos and kubeadm run it.

No kubelet, no scheduler, no kube-proxy: the lab creates Pods with spec.nodeName and writes
their status (podIP, phase, Ready) as a kubelet would; `attach` wires the namespace to a lab's
network, so that agents reach the API server over it. `Kube` is a small client of the API for
the lab (admin, or any bearer token), over sockets made in the control plane's namespace (or a
lab namespace). A `ControlPlane` is shared by the labs of a test module: `clean` removes what a
lab wrote.

What it leaves out: a kubelet and the node lifecycle controller (Nodes are created and their
addresses written by the lab; no Node goes NotReady), the scheduler, kube-proxy and ClusterIP
traffic, cloud controllers, aggregated APIs (no front proxy), HA (one etcd, one API server).

kube-apiserver writes an audit log (`ControlPlane.audit_log`; the policy and a reader in
`audit`): what each identity asked and whether the authorizer allowed it, for the tests that
hold the chart's ClusterRole to what the agents use.

The package: `spec` (the release, binaries, addresses, ports; the prerequisites), `pki` (the
certificates), `client` (`Kube`, the labs' client of the API), `plane` (`ControlPlane`: the
processes and what the labs ask of them), `audit` (the audit policy and log).
"""

from cozylab.kubecp.client import Kube, KubeError, path_of
from cozylab.kubecp.plane import ControlPlane
from cozylab.kubecp.spec import missing_prerequisites

__all__ = ["ControlPlane", "Kube", "KubeError", "missing_prerequisites", "path_of"]
