"""A test double of the Kubernetes API server: Services, EndpointSlices, Pods and core/v1 Events.

`FakeKubeAPI` serves HTTP/1.1 on 127.0.0.1 and follows the API conventions closely enough that
the official `kubernetes` client cannot tell it from a kube-apiserver for the calls it supports:
lists with label selectors and `limit`/`continue` pagination over a consistent snapshot,
chunked watches replayed from a history log (410 Expired once compacted), bookmarks, Events
create/patch/list, token and access reviews, and errors as `Status` objects. Tests drive the
state with `apply`/`delete` and inject faults with `fail_next`, `drop_watches`, `set_down`,
`compact` and `forbid` (RBAC's 403 for every request on a resource); `requests` records every
request the server read. `stop()` then `start()` is an apiserver restart: same port and
state, connections refused in between.

Since the labs run on the real control plane (issue 35, cozylab/kubecp.py) the double serves
only what its users ask (the unit tests of the source, the Event recorder, port security and
the metrics' reviews; test_burst, test_metrics_flood, bench/control.py): discovery (kubectl's),
field selectors, generateName and injected latency went with issue 37.

Known deviations from a real kube-apiserver:
- HTTP only; no authentication, authorization, admission, validation of object contents,
  managedFields, metadata.generation, dryRun, fieldValidation, server-side apply, protobuf,
  Table output, legacy /watch/ paths, sendInitialEvents, discovery, field selectors or
  generateName.
- Services, EndpointSlices and Pods are read-only over HTTP (tests write them with `apply`); Events
  take POST and PATCH only (no PUT or DELETE).
- PATCH takes merge and strategic-merge patches, both applied as RFC 7386 JSON merge patches
  (no list merge keys, no $patch directives); json-patch and apply-patch answer 415.
- LIST ignores resourceVersion/resourceVersionMatch and always serves the current state.
- A watch from a resourceVersion newer than the current one sends only later changes instead
  of answering 'Too large resource version' after 3 s.
- Watches have no server-side default timeout; bookmarks are sent every `bookmark_interval`.
- `compact()` expires a resume from an older resourceVersion, as a watch served by etcd would
  be; `stop()` then `start()` keeps the history. The real kube-apiserver (issue 35, checked
  against 1.34.3) serves watches from its watch cache: a compaction alone expires none of them,
  and after a restart every resume from before it is 410 ("too old resource version"), since
  the cache's history starts at the restart.
- No RBAC: every request is allowed unless `forbid` says otherwise (the real server refused
  the Event recorder's `get` on events, which the chart's ClusterRole does not grant).
- Continue tokens are opaque random strings kept in memory; a malformed one is 410 (not 400),
  and the selectors of a continued list are those of its first page.
- Injected faults carry no Retry-After header (urllib3 would silently retry a 429/503 that has
  one).
- `apply()` keeps a uid the test gives on create (the real server always generates one).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import re
import secrets
import select
import socket
import struct
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

import yaml

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

Obj = dict[str, Any]

_LINGER_RST = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a TCP RST
_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


@dataclass(frozen=True, eq=False)
class _Kind:
    kind: str
    api_version: str
    plural: str
    verbs: tuple[str, ...]
    namespaced: bool = True  # False: cluster-scoped (Nodes), stored under namespace ""

    @property
    def prefix(self) -> str:
        return "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"


_KINDS = {
    k.kind: k
    for k in (
        _Kind("Service", "v1", "services", ("get", "list", "watch")),
        _Kind("EndpointSlice", "discovery.k8s.io/v1", "endpointslices", ("get", "list", "watch")),
        _Kind("Pod", "v1", "pods", ("get", "list", "watch")),
        _Kind("Node", "v1", "nodes", ("get", "list", "watch"), namespaced=False),
        _Kind("Event", "v1", "events", ("create", "get", "list", "patch", "watch")),
    )
}
_BY_PATH = {(k.prefix, k.plural): k for k in _KINDS.values()}
_RESOURCE_PATH = re.compile(
    r"^(?P<prefix>/api/v1|/apis/discovery\.k8s\.io/v1)"
    r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?/?$"
)


@dataclass(frozen=True)
class RequestRecord:
    """One request the server read: method, path, query (last value per key), time.monotonic(),
    and its Accept header."""

    method: str
    path: str
    query: dict[str, str]
    time: float
    accept: str = ""


class _ApiError(Exception):
    def __init__(
        self, code: int, message: str, details: Obj | None = None, reason: str | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details
        self.reason = reason

    def status(self) -> Obj:
        return _status(self.code, self.message, self.details, self.reason)


def _status(code: int, message: str, details: Obj | None = None, reason: str | None = None) -> Obj:
    out: Obj = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason or _REASONS.get(code, "Unknown"),
        "code": code,
    }
    if details is not None:
        out["details"] = details
    return out


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_bool(query: dict[str, str], key: str) -> bool:
    """Go's strconv.ParseBool, as the apiserver decodes boolean query parameters."""
    value = query.get(key, "false")
    if value in ("1", "t", "T", "true", "TRUE", "True"):
        return True
    if value in ("", "0", "f", "F", "false", "FALSE", "False"):
        return False
    raise _ApiError(400, f'invalid value for {key}: strconv.ParseBool: parsing "{value}"')


def _parse_int(query: dict[str, str], key: str) -> int | None:
    if not query.get(key):
        return None
    try:
        return int(query[key])
    except ValueError:
        raise _ApiError(400, f"invalid value for {key}: {query[key]!r}") from None


# --- selectors ---------------------------------------------------------------------------------

_KEY = r"[A-Za-z0-9][-A-Za-z0-9_./]*"
_VALUE = r"[-A-Za-z0-9_.]*"
_EQUALITY = re.compile(rf"^({_KEY})\s*(==|=|!=)\s*({_VALUE})$")
_SET = re.compile(rf"^({_KEY})\s+(in|notin)\s*\(([^()]*)\)$")
_EXISTS = re.compile(rf"^(!?)\s*({_KEY})$")


def _split_terms(text: str) -> list[str]:
    """Split a selector on commas that are not inside parentheses."""
    terms, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            terms.append(text[start:i])
            start = i + 1
    terms.append(text[start:])
    return [t.strip() for t in terms]


@dataclass(frozen=True)
class _Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!"
    values: frozenset[str] = frozenset()

    def matches(self, labels: dict[str, str]) -> bool:
        if self.op == "exists":
            return self.key in labels
        if self.op == "!":
            return self.key not in labels
        if self.op in ("=", "in"):
            return labels.get(self.key) in self.values
        return self.key not in labels or labels[self.key] not in self.values


def _parse_labels(text: str) -> tuple[_Requirement, ...]:
    if not text.strip():
        return ()
    out = []
    for term in _split_terms(text):
        if m := _EQUALITY.match(term):
            op = "!=" if m[2] == "!=" else "="
            out.append(_Requirement(m[1], op, frozenset([m[3]])))
        elif m := _SET.match(term):
            values = frozenset(v.strip() for v in m[3].split(",") if v.strip())
            out.append(_Requirement(m[1], m[2], values))
        elif m := _EXISTS.match(term):
            out.append(_Requirement(m[2], "!" if m[1] else "exists"))
        else:
            raise _ApiError(400, f"unable to parse requirement: {term!r} in {text!r}")
    return tuple(out)


@dataclass(frozen=True)
class _Selector:
    namespace: str | None
    labels: tuple[_Requirement, ...]

    @classmethod
    def parse(cls, kind: _Kind, namespace: str | None, query: dict[str, str]) -> _Selector:
        return cls(namespace, _parse_labels(query.get("labelSelector", "")))

    @property
    def empty(self) -> bool:
        """No label selector (the namespace is part of the key, not the predicate)."""
        return not self.labels

    def matches(self, obj: Obj) -> bool:
        meta = obj["metadata"]
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        labels = meta.get("labels") or {}
        return all(r.matches(labels) for r in self.labels)


# --- store -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Change:
    """One write: `obj` is the stored object (for DELETED: the last state with the delete's rv),
    `prev` the object before the write (None for a create)."""

    rv: int
    type: str
    kind: _Kind
    obj: Obj
    prev: Obj | None


@dataclass(eq=False)
class _Watcher:
    kind: _Kind
    after: int  # send only changes with a greater resourceVersion
    pending: deque[_Change] = field(default_factory=deque)
    dropped: bool = False
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class _Snapshot:
    rv: int
    items: tuple[Obj, ...]


@dataclass
class _Fault:
    remaining: int
    status: int
    paths: str | None


def _strip(obj: Obj) -> Obj:
    """An object as a list item: lists omit kind and apiVersion."""
    return {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}


def _with_rv(obj: Obj, rv: int) -> Obj:
    return {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(rv)}}


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge_patch(out.get(key), value)
    return out


def _watch_event(change: _Change, sel: _Selector) -> tuple[str, Obj] | None:
    """What one watcher sees of a change (the apiserver's cacheWatcher.convertToWatchEvent)."""
    cur = change.type != "DELETED" and sel.matches(change.obj)
    old = change.prev is not None and sel.matches(change.prev)
    if cur and not old:
        return "ADDED", change.obj
    if cur and old:
        return "MODIFIED", change.obj
    if old and change.prev is not None:
        return "DELETED", _with_rv(change.prev, change.rv)
    return None


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    api: FakeKubeAPI

    def verify_request(self, request: Any, client_address: Any) -> bool:
        if self.api._down:
            _reset(request)
            return False
        return True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a vanished client is not news
            super().handle_error(request, client_address)


def _reset(sock: socket.socket) -> None:
    """Close a connection the way a vanished peer does: with a TCP RST, no goodbye."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
    sock.close()


def _peer_closed(sock: socket.socket) -> bool:
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


class FakeKubeAPI:
    """In-process Kubernetes API server double; see the module docstring. Thread-safe."""

    def __init__(self, bookmark_interval: float = 1.0) -> None:
        self.bookmark_interval = bookmark_interval
        self._cv = threading.Condition()
        self._rv = 1
        self._horizon = 1  # history holds every change with rv > horizon
        self._objects: dict[str, dict[tuple[str, str], Obj]] = {k: {} for k in _KINDS}
        self._history: list[_Change] = []
        self._watchers: set[_Watcher] = set()
        self._continues: dict[str, tuple[_Snapshot, int]] = {}
        self._faults: list[_Fault] = []
        self._forbidden: set[str] = set()  # plurals answered 403 (forbid)
        #: TokenReview: bearer token -> the user it authenticates ({"username", "groups"})
        self._tokens: dict[str, Obj] = {}
        #: SubjectAccessReview: (username, non-resource path, verb) that are allowed
        self._grants: set[tuple[str, str, str]] = set()
        self._requests: list[RequestRecord] = []
        self._connections: set[socket.socket] = set()
        self._down = False
        self._server: _Server | None = None
        self._port = 0  # kept across stop()/start(): a restarted server has the same URL

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> str:
        """Listen on 127.0.0.1 (a free port, or the previous one on a restart); return the URL."""
        if self._server is None:
            self._server = _Server(("127.0.0.1", self._port), _Handler)
            self._server.api = self
            self._port = self._server.server_address[1]
            threading.Thread(
                target=self._server.serve_forever,
                kwargs={"poll_interval": 0.05},
                name="fake-kube-api",
                daemon=True,
            ).start()
        return self.url

    def stop(self) -> None:
        """Stop listening and cut every open connection (watches end as if the server died).

        The state is kept; `start()` serves it again on the same port."""
        if self._server is None:
            return
        self._drop(wait=True)
        self._server.shutdown()
        self._server.server_close()
        with self._cv:
            conns = list(self._connections)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._server = None

    def __enter__(self) -> FakeKubeAPI:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:40123 (only while started)."""
        if self._server is None:
            raise RuntimeError("FakeKubeAPI is not started")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def kubeconfig(self, path: Path) -> Path:
        """Write a kubeconfig for this server (http, no credentials) to `path`; return it."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {}}],
            "contexts": [
                {"name": "fake", "context": {"cluster": "fake", "user": "fake"}},
            ],
            "current-context": "fake",
            "preferences": {},
        }
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    def api_client(self) -> ApiClient:
        """A `kubernetes.client.ApiClient` configured for this server."""
        from kubernetes import client  # imported here: the server itself needs no client

        config = client.Configuration()
        config.host = self.url
        return client.ApiClient(config)

    # --- state ---------------------------------------------------------------------------------

    def resource_version(self) -> int:
        """The current (latest) resourceVersion."""
        with self._cv:
            return self._rv

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or update an object (its `kind` picks the store, its namespace defaults to
        "default"); return the stored copy.

        An update identical to the stored object is a no-op: no new resourceVersion, no event.
        """
        kind = _kind(obj.get("kind"))
        if obj.get("apiVersion", kind.api_version) != kind.api_version:
            raise ValueError(
                f"{kind.kind} has apiVersion {kind.api_version}, not {obj['apiVersion']}"
            )
        meta = obj.get("metadata") or {}
        if not meta.get("name"):
            raise ValueError("apply() needs metadata.name")
        key = (meta.get("namespace") or "default" if kind.namespaced else "", meta["name"])
        with self._cv:
            prev = self._objects[kind.kind].get(key)
            new = self._prepare(kind, obj, key, prev)
            if new is not None:
                self._store(kind, new, prev)
            return copy.deepcopy(self._objects[kind.kind][key])

    def delete(self, kind: str, namespace: str, name: str) -> dict[str, Any]:
        """Delete an object (KeyError if absent); return its last state with the delete's rv."""
        k = _kind(kind)
        with self._cv:
            prev = self._objects[k.kind].pop((namespace, name))
            self._rv += 1
            gone = _with_rv(prev, self._rv)
            self._record(_Change(self._rv, "DELETED", k, gone, prev))
            return copy.deepcopy(gone)

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The stored object (with kind and apiVersion), or None."""
        with self._cv:
            obj = self._objects[_kind(kind).kind].get((namespace, name))
            return copy.deepcopy(obj)

    def events(self, namespace: str | None = None) -> list[dict[str, Any]]:
        """Stored core/v1 Events, sorted by namespace and name, optionally of one namespace."""
        with self._cv:
            return [
                copy.deepcopy(o)
                for (ns, _), o in sorted(self._objects["Event"].items())
                if namespace is None or ns == namespace
            ]

    # --- faults and observation ----------------------------------------------------------------

    @property
    def requests(self) -> list[RequestRecord]:
        """Every request read so far, oldest first (a copy)."""
        with self._cv:
            return list(self._requests)

    def fail_next(self, n: int, status: int = 503, paths: str | None = None) -> None:
        """Answer the next `n` requests whose target (path?query) contains `paths` (any request
        when None) with `status` and a Status body, without touching the state."""
        with self._cv:
            self._faults.append(_Fault(n, status, paths))

    def forbid(self, plural: str, forbidden: bool = True) -> None:
        """Answer every request on the resource `plural` (e.g. "pods") with 403 Forbidden, as
        the API server does for a service account whose role lacks the verb."""
        with self._cv:
            if forbidden:
                self._forbidden.add(plural)
            else:
                self._forbidden.discard(plural)

    def add_token(self, token: str, username: str, groups: tuple[str, ...] = ()) -> None:
        """A bearer token that TokenReview authenticates as `username`."""
        with self._cv:
            self._tokens[token] = {"username": username, "uid": username, "groups": list(groups)}

    def grant(self, username: str, path: str, verb: str = "get") -> None:
        """Let `username` `verb` the non-resource URL `path` (what a ClusterRole with
        nonResourceURLs grants), as SubjectAccessReview answers."""
        with self._cv:
            self._grants.add((username, path, verb))

    def _review(self, path: str, body: bytes) -> Obj | None:
        """TokenReview and SubjectAccessReview (create), or None for another path."""
        if path == "/apis/authentication.k8s.io/v1/tokenreviews":
            review = _decode(body)
            with self._cv:
                user = self._tokens.get(str(review.get("spec", {}).get("token", "")))
            status: Obj = {"authenticated": bool(user)}
            if user:
                status["user"] = user
            return {**review, "status": status}
        if path == "/apis/authorization.k8s.io/v1/subjectaccessreviews":
            review = _decode(body)
            spec = review.get("spec", {})
            attrs = spec.get("nonResourceAttributes") or {}
            key = (spec.get("user"), attrs.get("path"), attrs.get("verb"))
            with self._cv:
                allowed = key in self._grants
            return {**review, "status": {"allowed": allowed}}
        return None

    def drop_watches(self) -> int:
        """Cut every open watch connection with a TCP RST, mid-stream (no terminating chunk).

        Returns once they are closed; returns how many there were."""
        return self._drop(wait=True)

    def set_down(self, down: bool) -> None:
        """While down, the server accepts TCP connections and resets them (RST) before answering,
        including kept-alive ones, and open watches are cut: clients see a connection reset /
        'Connection aborted', the nearest to a dead apiserver we can get while keeping the port.
        Requests made while down are not recorded."""
        with self._cv:
            self._down = down
        if down:
            self._drop(wait=True)

    def compact(self) -> None:
        """Forget history up to the current resourceVersion (like an etcd compaction): watches
        from an older resourceVersion get 410 Expired, and so do older continue tokens."""
        with self._cv:
            self._horizon = self._rv
            self._history.clear()
            self._continues = {t: v for t, v in self._continues.items() if v[0].rv >= self._horizon}

    def open_watches(self) -> int:
        """How many watch streams are open now."""
        with self._cv:
            return len(self._watchers)

    # --- internals (called with self._cv held unless noted) -------------------------------------

    def _prepare(self, kind: _Kind, obj: Obj, key: tuple[str, str], prev: Obj | None) -> Obj | None:
        """The object to store for a write, or None when it changes nothing."""
        new = copy.deepcopy(obj)
        new["kind"], new["apiVersion"] = kind.kind, kind.api_version
        meta = new.setdefault("metadata", {})
        meta["namespace"], meta["name"] = key
        if not kind.namespaced:
            del meta["namespace"]
        if prev is None:
            meta["uid"] = meta.get("uid") or str(uuid.uuid4())
            meta["creationTimestamp"] = meta.get("creationTimestamp") or _now()
            return new
        for immutable in ("uid", "creationTimestamp", "resourceVersion"):
            meta[immutable] = prev["metadata"][immutable]
        return None if new == prev else new

    def _store(self, kind: _Kind, obj: Obj, prev: Obj | None) -> None:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        meta = obj["metadata"]
        self._objects[kind.kind][(meta.get("namespace", ""), meta["name"])] = obj
        self._record(_Change(self._rv, "ADDED" if prev is None else "MODIFIED", kind, obj, prev))

    def _record(self, change: _Change) -> None:
        self._history.append(change)
        for w in self._watchers:
            if w.kind is change.kind:
                w.pending.append(change)
        self._cv.notify_all()

    def _drop(self, wait: bool) -> int:
        """Mark every watch dropped; optionally wait (up to 5 s) until their handlers closed."""
        with self._cv:
            watchers = list(self._watchers)
            for w in watchers:
                w.dropped = True
            self._cv.notify_all()
        if wait:
            deadline = time.monotonic() + 5.0
            for w in watchers:
                w.done.wait(max(0.0, deadline - time.monotonic()))
        return len(watchers)

    def _take_fault(self, target: str) -> int | None:
        with self._cv:
            for fault in self._faults:
                if fault.remaining > 0 and (fault.paths is None or fault.paths in target):
                    fault.remaining -= 1
                    return fault.status
            self._faults = [f for f in self._faults if f.remaining > 0]
            return None

    # --- request handling (called from handler threads, without the lock) ----------------------

    def _list(self, kind: _Kind, namespace: str | None, query: dict[str, str]) -> Obj:
        sel = _Selector.parse(kind, namespace, query)
        limit = _parse_int(query, "limit") or 0
        token = query.get("continue")
        with self._cv:
            if token:
                entry = self._continues.get(token)
                if entry is None:
                    raise _ApiError(
                        410,
                        "The provided continue parameter is too old to display a consistent "
                        "list result. You can start a new list without the continue parameter.",
                    )
                snap, offset = entry
            else:
                items = tuple(
                    o for _, o in sorted(self._objects[kind.kind].items()) if sel.matches(o)
                )
                snap, offset = _Snapshot(self._rv, items), 0
            end = offset + limit if limit > 0 else len(snap.items)
            meta: Obj = {"resourceVersion": str(snap.rv)}
            if end < len(snap.items):
                next_token = secrets.token_urlsafe(16)
                self._continues[next_token] = (snap, end)
                meta["continue"] = next_token
                if sel.empty:  # as etcd3's GetList: only counted without a selector
                    meta["remainingItemCount"] = len(snap.items) - end
        return {
            "kind": f"{kind.kind}List",
            "apiVersion": kind.api_version,
            "metadata": meta,
            "items": [_strip(o) for o in snap.items[offset:end]],
        }

    def _get(self, kind: _Kind, namespace: str, name: str) -> Obj:
        with self._cv:
            obj = self._objects[kind.kind].get((namespace, name))
        if obj is None:
            raise _not_found(kind, name)
        return obj

    def _create(self, kind: _Kind, namespace: str, body: bytes) -> Obj:
        obj = _decode(body)
        if obj.get("kind", kind.kind) != kind.kind:
            raise _ApiError(400, f"the body kind {obj['kind']!r} is not {kind.kind!r}")
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise _ApiError(400, "metadata must be an object")
        if meta.setdefault("namespace", namespace) != namespace:
            raise _ApiError(
                400,
                "the namespace of the provided object does not match the namespace sent on the "
                "request",
            )
        if meta.get("resourceVersion"):
            raise _ApiError(500, "resourceVersion should not be set on objects to be created")
        if not meta.get("name"):
            raise _ApiError(
                422,
                f'{kind.kind} "" is invalid: metadata.name: Required value: name is required '
                "(the double takes no generateName)",
            )
        meta.pop("uid", None)
        key = (namespace, meta["name"])
        with self._cv:
            if key in self._objects[kind.kind]:
                raise _ApiError(
                    409,
                    f'{kind.plural} "{meta["name"]}" already exists',
                    {"name": meta["name"], "kind": kind.plural},
                    reason="AlreadyExists",
                )
            new = self._prepare(kind, obj, key, None)
            assert new is not None
            self._store(kind, new, None)
            return new

    def _patch(self, kind: _Kind, namespace: str, name: str, ctype: str, body: bytes) -> Obj:
        if ctype not in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            raise _ApiError(
                415,
                "the body of the request was in an unknown format - accepted media types "
                "include: application/merge-patch+json, application/strategic-merge-patch+json",
            )
        patch = _decode(body)
        patch_meta = patch.get("metadata")
        want = patch_meta.get("resourceVersion") if isinstance(patch_meta, dict) else None
        with self._cv:
            prev = self._objects[kind.kind].get((namespace, name))
            if prev is None:
                raise _not_found(kind, name)
            if want and want != prev["metadata"]["resourceVersion"]:
                raise _ApiError(
                    409,
                    f'Operation cannot be fulfilled on {kind.plural} "{name}": the object has '
                    "been modified; please apply your changes to the latest version and try again",
                    {"name": name, "kind": kind.plural},
                )
            merged = _merge_patch(prev, patch)
            meta = merged.get("metadata")
            if not isinstance(meta, dict):
                raise _ApiError(400, "metadata must be an object")
            for field_name, want_value in (("name", name), ("namespace", namespace)):
                if meta.get(field_name) != want_value:
                    raise _ApiError(
                        400,
                        f"the {field_name} of the object ({meta.get(field_name)}) does not match "
                        f"the {field_name} on the URL ({want_value})",
                    )
            new = self._prepare(kind, merged, (namespace, name), prev)
            if new is not None:
                self._store(kind, new, prev)
            return self._objects[kind.kind][(namespace, name)]


#: the media type of a PartialObjectMetadata answer (and what asks for one, in Accept)
PARTIAL = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"


def _wants_metadata(accept: str) -> bool:
    """Does the Accept header ask for PartialObjectMetadata first (the API server takes the
    first media range it can serve)?"""
    first = accept.split(",")[0]
    params = {p.strip() for p in first.split(";")[1:]}
    return {"as=PartialObjectMetadata", "g=meta.k8s.io", "v=v1"} <= params


def _kind(name: Any) -> _Kind:
    if name not in _KINDS:
        raise ValueError(f"unsupported kind {name!r} (one of {', '.join(_KINDS)})")
    return _KINDS[name]


def _not_found(kind: _Kind, name: str) -> _ApiError:
    return _ApiError(404, f'{kind.plural} "{name}" not found', {"name": name, "kind": kind.plural})


def _decode(body: bytes) -> Obj:
    try:
        obj = json.loads(body or b"null")
    except ValueError as e:
        raise _ApiError(400, f"the body of the request could not be decoded: {e}") from None
    if not isinstance(obj, dict):
        raise _ApiError(400, "the body of the request must be a JSON object")
    return obj


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fake-kube-apiserver"
    sys_version = ""
    server: _Server

    def setup(self) -> None:
        super().setup()
        # as Go's net/http: without it, Nagle + delayed ACK add 40 ms to every response
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.server.api._cv:
            self.server.api._connections.add(self.connection)

    def finish(self) -> None:
        with self.server.api._cv:
            self.server.api._connections.discard(self.connection)
        with contextlib.suppress(OSError):
            super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep pytest output clean; `requests` records what was asked

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    # ---

    def _serve(self, method: str) -> None:
        api = self.server.api
        if api._down:
            self._reset()
            return
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        with api._cv:
            accept = self.headers.get("Accept", "")
            api._requests.append(RequestRecord(method, url.path, query, time.monotonic(), accept))
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        status = api._take_fault(self.path)
        if status is not None:
            self._send_json(status, _status(status, f"injected fault: {status}"))
            return
        try:
            self._route(method, url.path, query, body)
        except _ApiError as e:
            self._send_json(e.code, e.status())
        except OSError:  # the client went away
            self.close_connection = True

    def _route(self, method: str, path: str, query: dict[str, str], body: bytes) -> None:
        api = self.server.api
        if method == "GET" and path.rstrip("/") in ("/healthz", "/livez", "/readyz"):
            self._send(200, b"ok", "text/plain; charset=utf-8")
            return
        if method == "POST" and (review := api._review(path, body)) is not None:
            self._send_json(201, review)
            return
        m = _RESOURCE_PATH.match(path)
        kind = _BY_PATH.get((m["prefix"], m["plural"])) if m else None
        if m is None or kind is None or (m["name"] and not m["ns"]):
            raise _ApiError(404, "the server could not find the requested resource", {})
        ns, name = m["ns"], m["name"]
        with api._cv:
            forbidden = kind.plural in api._forbidden
        if forbidden:
            verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}.get(
                method, "get" if name else "watch" if _parse_bool(query, "watch") else "list"
            )
            group = kind.api_version.rpartition("/")[0]
            where = f' in the namespace "{ns}"' if ns else " at the cluster scope"
            raise _ApiError(
                403,
                f"{kind.plural} {f'{chr(34)}{name}{chr(34)} ' if name else ''}is forbidden: User "
                f'"system:serviceaccount:cozy-system:cozyebpf" cannot {verb} resource '
                f'"{kind.plural}" in API group "{group}"{where}',
                {"name": name or "", "kind": kind.plural},
            )
        if method == "GET" and name:
            obj = api._get(kind, ns, name)
            if _wants_metadata(self.headers.get("Accept", "")):
                # the API server's PartialObjectMetadata: the object's metadata, nothing else
                meta = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1"}
                self._send(200, json.dumps({**meta, "metadata": obj["metadata"]}).encode(), PARTIAL)
                return
            self._send_json(200, obj)
        elif method == "GET" and _parse_bool(query, "watch"):
            self._watch(kind, ns, query)
        elif method == "GET":
            self._send_json(200, api._list(kind, ns, query))
        elif method == "POST" and "create" in kind.verbs and ns and not name:
            self._send_json(201, api._create(kind, ns, body))
        elif method == "PATCH" and "patch" in kind.verbs and name:
            ctype = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
            self._send_json(200, api._patch(kind, ns, name, ctype, body))
        else:
            raise _ApiError(
                405, "the server does not allow this method on the requested resource", {}
            )

    def _watch(self, kind: _Kind, namespace: str | None, query: dict[str, str]) -> None:
        api = self.server.api
        sel = _Selector.parse(kind, namespace, query)
        bookmarks = _parse_bool(query, "allowWatchBookmarks")
        timeout = _parse_int(query, "timeoutSeconds")
        rv_param = query.get("resourceVersion", "")
        start_rv = 0 if rv_param in ("", "0") else _parse_int(query, "resourceVersion")
        watcher = _Watcher(kind, start_rv or 0)
        expired = None
        with api._cv:
            if not start_rv:  # "" or "0": synthetic ADDED events for the current state first
                for _, obj in sorted(api._objects[kind.kind].items()):
                    rv = int(obj["metadata"]["resourceVersion"])
                    watcher.pending.append(_Change(rv, "ADDED", kind, obj, None))
            elif start_rv < api._horizon:
                expired = f"too old resource version: {start_rv} ({api._horizon})"
            else:
                watcher.pending.extend(
                    c for c in api._history if c.kind is kind and c.rv > start_rv
                )
            if expired is None:
                api._watchers.add(watcher)
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            if expired is not None:
                self._chunk({"type": "ERROR", "object": _status(410, expired)})
                self.wfile.write(b"0\r\n\r\n")
                return
            self._stream(watcher, sel, bookmarks, timeout)
        except OSError:
            self.close_connection = True
        finally:
            with api._cv:
                api._watchers.discard(watcher)
            watcher.done.set()

    def _stream(self, w: _Watcher, sel: _Selector, bookmarks: bool, timeout: int | None) -> None:
        api = self.server.api
        now = time.monotonic()
        deadline = now + timeout if timeout and timeout > 0 else math.inf
        interval = api.bookmark_interval
        next_bookmark = now + interval if bookmarks else math.inf
        while True:
            with api._cv:
                if not (w.pending or w.dropped):
                    wake = min(deadline, next_bookmark, now + 0.2)
                    api._cv.wait(max(0.0, wake - now))
                if w.dropped:
                    self._reset()
                    return
                batch = list(w.pending)
                w.pending.clear()
                current = api._rv  # every change up to here is in `batch` or already sent
            now = time.monotonic()
            changes = (_watch_event(c, sel) for c in batch if c.rv > w.after)
            events = [e for e in changes if e is not None]
            if not events and now < deadline and now < next_bookmark:
                if _peer_closed(self.connection):
                    self.close_connection = True
                    return
                continue
            for type_, obj in events:
                self._chunk({"type": type_, "object": obj})
            if now >= deadline or now >= next_bookmark:
                if bookmarks:
                    self._chunk({"type": "BOOKMARK", "object": self._bookmark(w.kind, current)})
                    next_bookmark = now + interval
                if now >= deadline:
                    self.wfile.write(b"0\r\n\r\n")
                    return

    @staticmethod
    def _bookmark(kind: _Kind, rv: int) -> Obj:
        return {
            "kind": kind.kind,
            "apiVersion": kind.api_version,
            "metadata": {"resourceVersion": str(rv)},
        }

    def _chunk(self, event: Obj) -> None:
        data = json.dumps(event, separators=(",", ":")).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _send_json(self, code: int, obj: Obj) -> None:
        self._send(code, json.dumps(obj).encode(), "application/json")

    def _send(self, code: int, data: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Cache-Control", "no-cache, private")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _reset(self) -> None:
        """Drop this connection with a RST; the socket really closes once rfile is closed."""
        self.close_connection = True
        _reset(self.connection)
