"""The agent's Kubernetes API client: requests through the official client's ApiClient
(`KubeRest`), the client made from a kubeconfig or the in-cluster service account
(`api_client`), and what an API error means for the agent (`forbidden`, `server_message`).
The only module of cozyebpf that imports the `kubernetes` package."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from cozyebpf.errors import SourceError


class KubeRest:
    """Requests through the official client's ApiClient: its configuration, TLS, credentials
    (token refresh and exec plugins included) and its errors (ApiException with `status`),
    without its generated API classes. Importing CoreV1Api's module alone keeps 22 MB
    resident for the life of the agent, and the agent needs three paths of it."""

    def __init__(self, api_client: Any) -> None:
        self.client = api_client

    def request(
        self,
        method: str,
        path: str,
        query: Iterable[tuple[str, str]] = (),
        body: Any = None,
        content_type: str | None = None,
        timeout: Any = None,
        accept: str = "application/json",
    ) -> Any:
        """The raw urllib3 response (not read yet) of a 2xx answer; ApiException otherwise."""
        from kubernetes.client.exceptions import ApiException

        headers = {"Accept": accept}
        if content_type is not None:
            headers["Content-Type"] = content_type
        req = self.client.param_serialize(
            method=method,
            resource_path=path,
            query_params=list(query),
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        resp = self.client.call_api(*req, _request_timeout=timeout)
        if not 200 <= resp.status <= 299:
            resp.read()
            raise ApiException.from_response(http_resp=resp, body=None, data=None)
        return resp.response

    def json(
        self,
        method: str,
        path: str,
        query: Iterable[tuple[str, str]] = (),
        body: Any = None,
        content_type: str | None = None,
        timeout: Any = None,
        accept: str = "application/json",
    ) -> Any:
        """The decoded JSON of a 2xx answer."""
        resp = self.request(method, path, query, body, content_type, timeout, accept)
        try:
            return json.loads(resp.data)
        finally:
            resp.release_conn()


def server_message(e: BaseException) -> str:
    """The message of the Status object the API server answered with (empty if none)."""
    body = getattr(e, "body", None)
    if isinstance(body, bytes):
        body = body.decode(errors="replace")
    if not isinstance(body, str):
        return ""
    try:
        status = json.loads(body)
    except ValueError:
        return body.strip()[:300]
    message = status.get("message") if isinstance(status, dict) else None
    return str(message) if message else ""


def forbidden(e: BaseException, verb: str, resource: str, group: str, cluster_role: str) -> str:
    """What a 403 of the API server means for the agent: the right its ClusterRole lacks
    (verb, resource, API group), by name, and the server's own words."""
    said = server_message(e)
    return (
        f"HTTP 403 Forbidden: the ClusterRole {cluster_role} does not grant `{verb}` on "
        f'{resource} (API group "{group}"); add it (the chart\'s ClusterRole has it; a '
        "kube-apiserver that has just started may refuse for a moment, until it has "
        "loaded RBAC)" + (f"; the API server said: {said}" if said else "")
    )


def api_client(kubeconfig: str | None) -> Any:
    """An ApiClient from a kubeconfig file, or the in-cluster service account."""
    from kubernetes import client, config

    try:
        if kubeconfig:
            cfg = client.Configuration()
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=kubeconfig, client_configuration=cfg
            )
        else:
            cfg = client.Configuration()
            config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    except Exception as e:  # ConfigException, file errors
        where = kubeconfig or "the in-cluster service account"
        raise SourceError(
            f"cannot load Kubernetes credentials from {where}: {e}. Pass --kubeconfig, or "
            f"--manifests to run from a file"
        ) from e
    return client.ApiClient(cfg)
