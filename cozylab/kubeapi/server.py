"""The API double's state and its controls (`FakeKubeAPI`): the store, lists and watches,
the faults a test injects, the reviews; `http` serves it."""

from __future__ import annotations

import contextlib
import copy
import secrets
import socket
import threading
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import yaml

from cozylab.kubeapi.http import _Handler, _Server
from cozylab.kubeapi.objects import (
    _KINDS,
    Obj,
    RequestRecord,
    _ApiError,
    _Change,
    _decode,
    _Fault,
    _Kind,
    _kind,
    _merge_patch,
    _not_found,
    _now,
    _parse_int,
    _Selector,
    _Snapshot,
    _strip,
    _Watcher,
    _with_rv,
)

if TYPE_CHECKING:
    from kubernetes.client import ApiClient


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
