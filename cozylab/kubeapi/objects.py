"""The API double's objects: the kinds it serves, its errors as `Status` objects, label
selectors, the records of its store and watches, and what requests carry."""

from __future__ import annotations

import copy
import json
import re
import struct
import threading
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

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
