"""vagrant/e2e.sh's Kubernetes objects, applied to the labs' real API server (issue 47).

e2e.sh runs in the Vagrant VM against k3s with Cilium, which need the Internet and never run
here. What can be checked without it: its Namespace, Pod and whole-IP LoadBalancer Service,
taken from the script as it applies them (its `kubectl apply` heredoc, the script's own values
for $NS and $MARKER), are created by kube-apiserver of the pinned release (validation and
admission: a field misspelt or of the wrong type fails), and the Service's status takes the
LoadBalancer ingress e2e.sh writes when LB-IPAM gives none. vagrant/k8s.sh's
CiliumLoadBalancerIPPool needs Cilium's CRD, which the labs do not have: not checked."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from cozylab.kubecp import ControlPlane

pytestmark = pytest.mark.requires("kube")

E2E = Path(__file__).resolve().parents[2] / "vagrant" / "e2e.sh"


def script_value(text: str, name: str) -> str:
    m = re.search(rf"^{name}=(\S+)$", text, re.M)
    assert m, f"e2e.sh sets no {name}"
    return m.group(1)


def e2e_objects() -> tuple[list[dict[str, object]], str, str]:
    """e2e.sh's objects as it applies them, its namespace and its fallback LB IP."""
    text = E2E.read_text()
    m = re.search(r"^kubectl apply -f - >/dev/null <<EOF\n(.*?)^EOF$", text, re.M | re.S)
    assert m, "e2e.sh has no `kubectl apply -f - <<EOF` of its objects"
    manifest = m.group(1)
    for name in ("NS", "MARKER"):
        manifest = manifest.replace(f"${name}", script_value(text, name))
    assert "$" not in manifest, f"a variable left in e2e.sh's manifest: {manifest}"
    objs = [o for o in yaml.safe_load_all(manifest) if o]
    return objs, script_value(text, "NS"), script_value(text, "FALLBACK_LB_IP")


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    from tests.support.env import unique_prefix

    with ControlPlane(unique_prefix("vg"), tmp_path_factory.mktemp("cp"), "192.0.2.250") as cp:
        yield cp


def test_e2e_objects_are_created_by_the_api_server(control_plane: ControlPlane) -> None:
    objs, ns, lb_ip = e2e_objects()
    assert [o["kind"] for o in objs] == ["Namespace", "Pod", "Service"]
    admin = control_plane.admin
    for obj in objs:
        admin.create(obj)
    svc = admin.get("Service", ns, "web")
    assert svc is not None
    assert svc["spec"]["type"] == "LoadBalancer"
    assert svc["metadata"]["labels"]["service.kubernetes.io/service-proxy-name"] == "cozy-proxy"
    assert svc["metadata"]["annotations"]["networking.cozystack.io/wholeIP"] == "true"
    assert [(p["protocol"], p["port"]) for p in svc["spec"]["ports"]] == [("TCP", 22)]
    pod = admin.get("Pod", ns, "web")
    assert pod is not None
    assert [p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]] == [8080, 22]
    # what e2e.sh writes when LB-IPAM assigns nothing (kubectl patch --subresource=status)
    admin.request(
        "PATCH",
        f"/api/v1/namespaces/{ns}/services/web/status",
        {"status": {"loadBalancer": {"ingress": [{"ip": lb_ip}]}}},
        content_type="application/merge-patch+json",
    )
    svc = admin.get("Service", ns, "web")
    assert svc is not None
    assert [i["ip"] for i in svc["status"]["loadBalancer"]["ingress"]] == [lb_ip]
