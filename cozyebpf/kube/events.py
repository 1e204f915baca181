"""Kubernetes Events for problems with Services (conflicts, invalid fields, no backend), so
they show in `kubectl describe service`. Posting happens on a background thread: a slow or
unreachable API server never delays the datapath."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import queue
import threading
from datetime import UTC, datetime
from typing import Any

from cozyebpf.kube.client import KubeRest, forbidden
from cozyebpf.model import Problem

log = logging.getLogger(__name__)

COMPONENT = "cozyebpf"
API_VERSIONS = {"Service": "v1", "EndpointSlice": "discovery.k8s.io/v1", "Node": "v1"}
#: where the Events of cluster-scoped objects (a Node) go, as the kubelet puts its own
CLUSTER_EVENTS_NAMESPACE = "default"


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def event_name(p: Problem, node: str) -> str:
    """Stable per (object, node, message), so a repeat bumps `count` instead of piling up."""
    digest = hashlib.sha256(f"{node}\0{p.ref.kind}\0{p.message}".encode()).hexdigest()[:12]
    return f"{p.ref.name}.{COMPONENT}.{digest}"


def event_body(p: Problem, node: str) -> dict[str, Any]:
    now = _now()
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": event_name(p, node),
            "namespace": p.ref.namespace or CLUSTER_EVENTS_NAMESPACE,
        },
        "involvedObject": {
            "apiVersion": API_VERSIONS.get(p.ref.kind, "v1"),
            "kind": p.ref.kind,
            "namespace": p.ref.namespace,
            "name": p.ref.name,
        },
        "reason": "CozyebpfError" if p.severity == "error" else "CozyebpfWarning",
        "message": p.message,
        "type": "Warning",
        "source": {"component": COMPONENT, "host": node},
        "reportingComponent": COMPONENT,
        "reportingInstance": node,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


class EventRecorder:
    """Queue Problems as Events; create each once, then patch its count on repeats. Uses the
    rights the chart grants on events, `create` and `patch`, and no other: an Event that
    exists already (made before a restart: its name is stable) is patched, and the answer
    tells its count. `cluster_role`: the ClusterRole a 403 names."""

    def __init__(
        self, api_client: Any, node: str, max_queue: int = 1000, cluster_role: str = "cozyebpf"
    ) -> None:
        self.rest = KubeRest(api_client)
        self.node = node
        self.cluster_role = cluster_role
        self.queue: queue.Queue[Problem | None] = queue.Queue(max_queue)
        self.counts: dict[tuple[str, str], int] = {}
        self.sent = 0
        self.failed = 0
        self._thread = threading.Thread(target=self._run, name="events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with contextlib.suppress(queue.Full):
            self.queue.put_nowait(None)

    def record(self, problems: list[Problem]) -> None:
        for p in problems:
            scoped = p.ref.namespace or p.ref.kind == "Node"
            if p.ref.kind not in API_VERSIONS or not scoped or not p.ref.name:
                continue  # garbage objects: logged, but nothing to attach an Event to
            try:
                self.queue.put_nowait(p)
            except queue.Full:
                log.warning("event queue full; not reporting: %s", p)

    def _run(self) -> None:
        while True:
            p = self.queue.get()
            if p is None:
                return
            try:
                self._post(p)
                self.sent += 1
            except Exception as e:  # never let the recorder die: the log has the problem
                self.failed += 1
                log.warning("could not record an Event for %s: %s", p.ref, self._why(e))

    def _post(self, p: Problem) -> None:
        body = event_body(p, self.node)
        ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
        key = (ns, name)
        events = f"/api/v1/namespaces/{ns}/events"
        merge = "application/merge-patch+json"
        if key not in self.counts:
            try:
                self.verb = "create"
                self.rest.json("POST", events, body=body, content_type="application/json")
                self.counts[key] = 1
                return
            except Exception as e:
                if getattr(e, "status", None) != 409:
                    raise
            # made before a restart: the patch's answer is the Event, with its count (the
            # ClusterRole grants no `get` on events, and needs none)
            self.verb = "patch"
            patch = {"lastTimestamp": _now(), "message": p.message}
            existing = self.rest.json("PATCH", f"{events}/{name}", body=patch, content_type=merge)
            self.counts[key] = int(existing.get("count") or 1)
        self.counts[key] += 1
        bump = {"count": self.counts[key], "lastTimestamp": _now(), "message": p.message}
        self.verb = "patch"
        self.rest.json("PATCH", f"{events}/{name}", body=bump, content_type=merge)

    verb = "create"  # the request that failed, for `_why`

    def _why(self, e: BaseException) -> str:
        if getattr(e, "status", None) == 403:
            return forbidden(e, self.verb, "events", "", self.cluster_role)
        return _short(e)


def _short(e: BaseException) -> str:
    status = getattr(e, "status", None)
    return f"HTTP {status} {getattr(e, 'reason', '')}".strip() if status else str(e)
