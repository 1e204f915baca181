"""A small client of the API for the labs (`Kube`: admin, or any bearer token), over sockets
made in the control plane's namespace or a lab's; its error (`KubeError`) and `path_of`."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cozylab.kubecp.spec import Obj
from cozylab.netns import in_netns


class KubeError(RuntimeError):
    """A non-2xx answer of the API server: `status` and its Status object."""

    def __init__(self, method: str, path: str, status: int, body: Obj) -> None:
        self.status = status
        self.body = body
        self.reason = str(body.get("reason") or "")
        self.message = str(body.get("message") or body)
        super().__init__(f"{method} {path}: HTTP {status} {self.reason}: {self.message}")


class _NsHTTPS(http.client.HTTPSConnection):
    """HTTPS over a socket made in the network namespace `netns`."""

    def __init__(
        self, netns: str, host: str, port: int, context: ssl.SSLContext, timeout: float
    ) -> None:
        super().__init__(host, port, context=context, timeout=timeout)
        self.netns = netns
        self._ctx = context

    def connect(self) -> None:
        sock = in_netns(self.netns, lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        sock.settimeout(self.timeout)
        try:
            sock.connect((self.host, self.port))
            self.sock = self._ctx.wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise


#: the plural and API path prefix of the kinds the labs write
_KINDS: dict[str, tuple[str, str, bool]] = {
    # kind: (prefix, plural, namespaced)
    "Namespace": ("/api/v1", "namespaces", False),
    "Node": ("/api/v1", "nodes", False),
    "Service": ("/api/v1", "services", True),
    "Pod": ("/api/v1", "pods", True),
    "Event": ("/api/v1", "events", True),
    "ServiceAccount": ("/api/v1", "serviceaccounts", True),
    "ConfigMap": ("/api/v1", "configmaps", True),
    "EndpointSlice": ("/apis/discovery.k8s.io/v1", "endpointslices", True),
    "ClusterRole": ("/apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles", True),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings", True),
    "ValidatingAdmissionPolicy": (
        "/apis/admissionregistration.k8s.io/v1",
        "validatingadmissionpolicies",
        False,
    ),
    "ValidatingAdmissionPolicyBinding": (
        "/apis/admissionregistration.k8s.io/v1",
        "validatingadmissionpolicybindings",
        False,
    ),
}


def path_of(kind: str, namespace: str | None = None, name: str | None = None) -> str:
    """The REST path of `kind` (all namespaces when `namespace` is None), or of one object."""
    prefix, plural, namespaced = _KINDS[kind]
    p = prefix
    if namespaced and namespace is not None:
        p += f"/namespaces/{namespace}"
    p += f"/{plural}"
    return f"{p}/{name}" if name else p


class Kube:
    """Requests to the API server at host:port, over sockets made in `netns`, as the lab's
    admin (a client certificate) or as whoever `token` is. One connection per request: it
    outlives an API server restart and is safe from any thread."""

    def __init__(
        self,
        netns: str,
        host: str,
        port: int,
        ca: Path,
        cert: tuple[Path, Path] | None = None,
        token: str | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.netns, self.host, self.port, self.timeout = netns, host, port, timeout
        self.bearer = token
        self.ca = ca
        self.ctx = ssl.create_default_context(cafile=str(ca))
        if cert is not None:
            self.ctx.load_cert_chain(str(cert[0]), str(cert[1]))

    def as_token(self, token: str) -> Kube:
        """The same server, as the bearer of `token` (no client certificate)."""
        return Kube(self.netns, self.host, self.port, self.ca, token=token, timeout=self.timeout)

    def _send(
        self,
        method: str,
        path: str,
        body: Any,
        query: Mapping[str, str] | None,
        content_type: str,
        timeout: float | None,
        accept: str,
    ) -> tuple[int, bytes]:
        if query:
            path += "?" + urllib.parse.urlencode(query)
        headers = {"Accept": accept}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        if self.bearer:
            headers["Authorization"] = f"Bearer {self.bearer}"
        conn = _NsHTTPS(self.netns, self.host, self.port, self.ctx, timeout or self.timeout)
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        timeout: float | None = None,
    ) -> Obj:
        """The decoded answer of a 2xx; KubeError otherwise."""
        status, raw = self._send(
            method, path, body, query, content_type, timeout, "application/json"
        )
        try:
            out = json.loads(raw) if raw else {}
        except ValueError:
            out = {"message": raw.decode(errors="replace")}
        if not 200 <= status <= 299:
            raise KubeError(method, path, status, out if isinstance(out, dict) else {})
        return out if isinstance(out, dict) else {"value": out}

    def request_text(self, method: str, path: str) -> str:
        """The text of a 2xx answer (/metrics, /healthz); KubeError otherwise."""
        status, raw = self._send(method, path, None, None, "", None, "text/plain")
        text = raw.decode(errors="replace")
        if not 200 <= status <= 299:
            raise KubeError(method, path, status, {"message": text[:500]})
        return text

    # -- objects -------------------------------------------------------------------------

    def get(self, kind: str, namespace: str | None, name: str) -> Obj | None:
        try:
            return self.request("GET", path_of(kind, namespace, name))
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def list(
        self, kind: str, namespace: str | None = None, selector: str | None = None
    ) -> list[Obj]:
        query = {"labelSelector": selector} if selector else None
        items = self.request("GET", path_of(kind, namespace), query=query).get("items") or []
        return [i for i in items if isinstance(i, dict)]

    def create(self, obj: Obj) -> Obj:
        ns = obj.get("metadata", {}).get("namespace")
        return self.request("POST", path_of(obj["kind"], ns), obj)

    def apply(self, obj: Obj, subresource: str = "", manager: str = "cozylab") -> Obj:
        """Server-side apply (create or update; fields the manager applied before and leaves
        out are removed), forced: the lab owns what it applies."""
        meta = obj.get("metadata", {})
        path = path_of(obj["kind"], meta.get("namespace"), meta["name"])
        return self.request(
            "PATCH",
            path + (f"/{subresource}" if subresource else ""),
            obj,
            query={"fieldManager": manager, "force": "true"},
            content_type="application/apply-patch+yaml",
        )

    def delete(self, kind: str, namespace: str | None, name: str, missing_ok: bool = True) -> None:
        """Delete now (grace period 0: no kubelet confirms a Pod's end here)."""
        try:
            self.request(
                "DELETE",
                path_of(kind, namespace, name),
                {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0},
            )
        except KubeError as e:
            if not (missing_ok and e.status == 404):
                raise

    def delete_all(self, kind: str, namespace: str | None = None, selector: str = "") -> None:
        """Delete every object of `kind` (in `namespace`; with the label selector)."""
        query = {"gracePeriodSeconds": "0"}
        if selector:
            query["labelSelector"] = selector
        self.request("DELETE", path_of(kind, namespace), query=query)

    def token(
        self,
        namespace: str,
        service_account: str,
        seconds: int = 3600,
        pod: Obj | None = None,
    ) -> str:
        """A token of the ServiceAccount from the TokenRequest API (bound to `pod`, as the
        kubelet asks for the tokens it mounts)."""
        spec: Obj = {"expirationSeconds": seconds}
        if pod is not None:
            spec["boundObjectRef"] = {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": pod["metadata"]["name"],
                "uid": pod["metadata"]["uid"],
            }
        got = self.request(
            "POST",
            path_of("ServiceAccount", namespace, service_account) + "/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
        )
        return str(got["status"]["token"])
