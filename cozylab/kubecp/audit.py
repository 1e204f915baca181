"""kube-apiserver's audit log in the labs (issue 45, item 10): what the server itself says the
agents asked and whether it allowed it, for the tests that hold the chart's ClusterRole to what
the agents use.

The policy (`POLICY`, written next to the log by `policy_file`): the control plane's own
components (kube-apiserver's loopback client, kube-controller-manager and the controllers'
ServiceAccounts in kube-system) are not logged; a Pod read (`get`) by a ServiceAccount is
logged at level RequestResponse, so the event holds the object the server answered (a
`PartialObjectMetadata` when the client asked for metadata only: the audit layer records the
object after the Accept header's transformation; it records no request header but the user
agent); every other request at level Metadata: user, verb, resource, namespace and name, the
answer's code and the authorizer's decision (`authorization.k8s.io/decision`, `allow` or
`forbid`, and its reason: the RBAC binding and role that allowed it). Stage RequestReceived is
left out (each request is logged when its answer starts and when it ends).

`requests` reads the log back, one `Request` per request (its last stage), newest last.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

Obj = dict[str, Any]

POLICY: Obj = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "None", "users": ["system:apiserver", "system:kube-controller-manager"]},
        {"level": "None", "userGroups": ["system:serviceaccounts:kube-system"]},
        {
            "level": "RequestResponse",
            "userGroups": ["system:serviceaccounts"],
            "verbs": ["get"],
            "resources": [{"group": "", "resources": ["pods"]}],
        },
        {"level": "Metadata"},
    ],
}

DECISION = "authorization.k8s.io/decision"
REASON = "authorization.k8s.io/reason"


def policy_file(workdir: Path) -> Path:
    """The policy, written in `workdir` (for --audit-policy-file)."""
    path = workdir / "audit-policy.json"
    path.write_text(json.dumps(POLICY, indent=1))
    return path


@dataclass(frozen=True)
class Request:
    """One request as the audit log has it."""

    user: str
    verb: str  # the Kubernetes verb: get, list, watch, create, patch, ...
    group: str  # the API group ("" core); "" for a non-resource URL too
    resource: str  # e.g. "pods", "services/status"; "" for a non-resource URL
    namespace: str
    name: str
    uri: str
    code: int  # the answer's HTTP status (0 when the log has none)
    decision: str  # the authorizer's: "allow", "forbid", or "" (refused before it)
    reason: str
    #: the kind and apiVersion of the object the server answered (level RequestResponse only)
    response: tuple[str, str] | None
    at: float  # when the server received it, seconds since the epoch

    @property
    def allowed(self) -> bool:
        return self.decision == "allow"

    def __str__(self) -> str:
        where = "/".join(x for x in (self.namespace, self.name) if x)
        what = f"{self.resource} ({self.group or 'core'})" if self.resource else self.uri
        return f"{self.verb} {what} {where} -> {self.code} {self.decision} {self.reason}".strip()


def _time(value: str | None) -> float:
    return datetime.fromisoformat(value).timestamp() if value else 0.0


def _request(ev: Mapping[str, Any]) -> Request:
    ref = ev.get("objectRef") or {}
    resource = ref.get("resource") or ""
    if ref.get("subresource"):
        resource += f"/{ref['subresource']}"
    ann = ev.get("annotations") or {}
    obj = ev.get("responseObject")
    return Request(
        user=(ev.get("user") or {}).get("username", ""),
        verb=ev.get("verb", ""),
        group=ref.get("apiGroup") or "",
        resource=resource,
        namespace=ref.get("namespace") or "",
        name=ref.get("name") or "",
        uri=ev.get("requestURI", ""),
        code=int((ev.get("responseStatus") or {}).get("code") or 0),
        decision=ann.get(DECISION, ""),
        reason=ann.get(REASON, ""),
        response=(obj.get("kind", ""), obj.get("apiVersion", "")) if obj else None,
        at=_time(ev.get("requestReceivedTimestamp")),
    )


def logs(path: Path) -> list[Path]:
    """The log and the files it was rotated into (kube-apiserver's lumberjack names them
    `<stem>-<time>.<ext>`), oldest first."""
    rotated = sorted(path.parent.glob(f"{path.stem}-*{path.suffix}"))
    return [*rotated, path] if path.exists() else rotated


def requests(path: Path, user: str | None = None, since: float = 0.0) -> list[Request]:
    """The requests the log at `path` holds (its rotated files too), of `user` (None: all),
    received at or after `since` (seconds since the epoch): one per request (audit ID), as
    its last stage has it, in the order they were received."""
    by_id: dict[str, Request] = {}
    for f in logs(path):
        with f.open() as lines:
            for line in lines:
                if not line.strip():
                    continue
                try:
                    ev = json.loads(line)
                except json.JSONDecodeError:  # a line being written as we read
                    continue
                if user is not None and (ev.get("user") or {}).get("username") != user:
                    continue
                req = _request(ev)
                if req.at >= since:
                    by_id[ev.get("auditID", str(len(by_id)))] = req
    return sorted(by_id.values(), key=lambda r: r.at)


def grants(rule: Mapping[str, Any], req: Request) -> bool:
    """Does the ClusterRole rule `rule` grant `req` (a resource request; RBAC's matching)?"""
    if "nonResourceURLs" in rule or not req.resource:
        return False

    def has(values: Iterable[str], value: str) -> bool:
        return "*" in values or value in values

    return (
        has(rule.get("apiGroups") or (), req.group)
        and has(rule.get("resources") or (), req.resource)
        and has(rule.get("verbs") or (), req.verb)
        and (not rule.get("resourceNames") or req.name in rule["resourceNames"])
    )


def unused(rules: Iterable[Mapping[str, Any]], reqs: Iterable[Request]) -> list[str]:
    """Each (verb, resource, group) a rule grants that none of `reqs` used, as
    "verb resource (group)"."""
    used = {(r.verb, r.resource, r.group) for r in reqs}
    out = []
    for rule in rules:
        if "nonResourceURLs" in rule:
            continue
        for group in rule.get("apiGroups") or ():
            for resource in rule.get("resources") or ():
                for verb in rule.get("verbs") or ():
                    if (verb, resource, group) not in used:
                        out.append(f"{verb} {resource} ({group or 'core'})")
    return out
