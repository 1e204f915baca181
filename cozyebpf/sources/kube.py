"""The Kubernetes source: Services, EndpointSlices and Nodes from the API server, with
informer semantics built on the official client.

Each resource is listed (in pages), then watched from the list's resourceVersion. A watch that
ends is resumed from the last resourceVersion seen (bookmarks included); a 410 Gone means the
history is compacted and the resource is listed again; any other failure is retried with capped
exponential backoff and jitter. The cache is replaced only by a *complete* list, so while the
API server is unreachable the last known state stays (fail-static), and the source reports
nothing until every resource has been listed once, so an agent that starts during an outage
does not program an empty state over the pinned one.

Caches hold the model's records, not API objects: each object is read (`read_object`) when it
arrives, in the informer's thread, and only its record is kept. An update whose record equals
the cached one (a status heartbeat, a label the model does not read) is dropped there; a
relist hands over only the objects whose record differs.

Services are watched without a label selector: the labelled ones are ours; of the others only
their LoadBalancer IPs are kept, so that an LB IP shared with a Service we do not manage can be
warned about. Of Nodes only their addresses are kept: no LB IP may take one (issue 31). Nodes
are optional: an agent whose ClusterRole cannot list them (an older chart's) says so and goes
on without that check rather than program nothing.
"""

from __future__ import annotations

import json
import logging
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from sys import intern
from typing import Any

from cozyebpf.errors import SourceError
from cozyebpf.kube.client import KubeRest, forbidden
from cozyebpf.model import (
    ForeignRecord,
    Key,
    NodeRecord,
    Problem,
    ServiceRecord,
    SliceRecord,
    read_object,
)
from cozyebpf.sources import ChangeSet, gc_paused

log = logging.getLogger(__name__)

Obj = dict[str, Any]
Record = ServiceRecord | SliceRecord | ForeignRecord | NodeRecord

#: set by the EndpointSlice controller: when the change that this version reflects happened
TRIGGER_ANNOTATION = "endpoints.kubernetes.io/last-change-trigger-time"


def trigger_time(obj: Obj) -> float | None:
    """The object's last-change-trigger-time, in seconds since the epoch, or None."""
    ann = (obj.get("metadata") or {}).get("annotations") or {}
    value = ann.get(TRIGGER_ANNOTATION) if isinstance(ann, dict) else None
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None


class Gone(Exception):
    """410 Gone: the resourceVersion is too old; list again."""


@dataclass
class Backoff:
    """Capped exponential backoff with full jitter in [delay/2, delay]."""

    base: float = 0.5
    cap: float = 30.0
    attempt: int = 0

    def next(self) -> float:
        delay = min(self.cap, self.base * (2**self.attempt))
        self.attempt = min(self.attempt + 1, 30)
        return random.uniform(delay / 2, delay)

    def reset(self) -> None:
        self.attempt = 0


def _status_code(e: BaseException) -> int | None:
    status = getattr(e, "status", None)
    return int(status) if isinstance(status, int) else None


@dataclass
class Resource:
    """How to list and watch one kind of object."""

    kind: str
    api_version: str
    rest: KubeRest
    path: str  # e.g. /api/v1/services: every namespace
    label_selector: str | None = None
    #: what the agent loses without it, when the API forbids listing it (403); None: the
    #: resource is required, and the source waits for it
    optional: str | None = None

    @property
    def plural(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]


@dataclass
class Informer:
    """List + watch one resource into a cache of records keyed by namespace/name.
    `read` makes an object's record (None: nothing to keep); `on_change(key, old, new)` is
    called, under `lock`, for every object whose record changed."""

    resource: Resource
    read: Callable[[Obj], Record | None]
    on_change: Callable[[Key, Record | None, Record | None, float | None], None]
    lock: threading.Lock
    on_synced: Callable[[], None] = lambda: None
    page_size: int = 500
    watch_timeout: int = 300
    request_timeout: float = 30.0
    #: the ClusterRole a 403 names (--cluster-role: the chart passes the one it made)
    cluster_role: str = "cozyebpf"
    backoff: Backoff = field(default_factory=Backoff)
    cache: dict[Key, Record] = field(default_factory=dict)
    resource_version: str | None = None
    synced: bool = False
    lists: int = 0  # complete lists so far (for tests and logs)

    # -- HTTP ----------------------------------------------------------------------------

    def _call(self, timeout: Any, **query: Any) -> Any:
        r = self.resource
        if r.label_selector:
            query["labelSelector"] = r.label_selector
        q = [
            (k, str(v).lower() if isinstance(v, bool) else str(v))
            for k, v in query.items()
            if v is not None
        ]
        return r.rest.request("GET", r.path, q, timeout=timeout)

    def _record(self, obj: Obj) -> tuple[Key, Record | None]:
        obj.setdefault("kind", self.resource.kind)  # list items carry no kind
        obj.setdefault("apiVersion", self.resource.api_version)
        return _key_of(obj), self.read(obj)

    def _list(self) -> tuple[dict[Key, Record], str, int]:
        """A complete, consistent list (all pages at the first page's resourceVersion), read
        into records; also the number of objects listed."""
        items: dict[Key, Record] = {}
        listed = 0
        token: str | None = None
        rv = ""
        while True:
            kw: dict[str, Any] = {"limit": self.page_size}
            if token:
                kw["continue"] = token
            resp = self._call(self.request_timeout, **kw)
            try:
                body = json.loads(resp.data)
            finally:
                resp.release_conn()
            meta = body.get("metadata") or {}
            if not token:
                rv = str(meta.get("resourceVersion") or "")
            for obj in body.get("items") or []:
                key, rec = self._record(obj)
                listed += 1
                if rec is not None:
                    items[key] = rec
            del body
            token = meta.get("continue") or None
            if not token:
                return items, rv, listed

    def _events(self) -> Iterator[Obj]:
        """Watch events from self.resource_version until the server ends the watch."""
        resp = self._call(
            (self.request_timeout, self.watch_timeout + self.request_timeout),
            watch=True,
            resourceVersion=self.resource_version,
            allowWatchBookmarks=True,
            timeoutSeconds=self.watch_timeout,
        )
        try:
            buf = b""
            for chunk in resp.stream(4096, decode_content=False):
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        yield json.loads(line)
            if buf.strip():
                yield json.loads(buf)
        finally:
            resp.release_conn()

    # -- the loop ------------------------------------------------------------------------

    def _apply(self, ev: Obj) -> bool:
        """Apply one watch event; True when the cache changed."""
        kind, obj = ev.get("type"), ev.get("object") or {}
        if kind == "ERROR":
            code = obj.get("code")
            if code == 410:
                raise Gone(obj.get("message", "resource version too old"))
            raise SourceError(f"watch of {self.resource.kind}s failed: {obj.get('message', obj)}")
        meta = obj.get("metadata") or {}
        rv = meta.get("resourceVersion")
        if kind == "BOOKMARK":
            if rv:
                self.resource_version = str(rv)
            return False
        if kind in ("ADDED", "MODIFIED"):
            key, rec = self._record(obj)
        elif kind == "DELETED":
            key, rec = _key_of(obj), None
        else:
            log.warning("unknown watch event type %r for %ss", kind, self.resource.kind)
            return False
        with self.lock:
            if rv:
                self.resource_version = str(rv)
            old = self.cache.get(key)
            if old == rec:
                return False
            if rec is None:
                del self.cache[key]
            else:
                self.cache[key] = rec
            self.on_change(key, old, rec, trigger_time(obj))
        return True

    def run(self, stop: threading.Event) -> None:
        what = f"{self.resource.kind}s"
        need_list = True
        while not stop.is_set():
            try:
                if need_list:
                    with gc_paused():
                        items, rv, listed = self._list()
                    with self.lock:
                        old, self.cache = self.cache, items
                        for key in old.keys() | items.keys():
                            if old.get(key) != items.get(key):
                                self.on_change(key, old.get(key), items.get(key), None)
                        self.resource_version = rv
                        self.synced = True
                        self.lists += 1
                    log.info(
                        "listed %d %s at resourceVersion %s (%d kept)", listed, what, rv, len(items)
                    )
                    need_list = False
                    self.on_synced()
                for ev in self._events():
                    if stop.is_set():
                        return
                    self._apply(ev)
                self.backoff.reset()  # a watch that ended normally: resume at once
            except Gone as e:
                log.info("%s: %s; listing again", what, e)
                need_list = True
            except Exception as e:  # API or network failure: keep the cache, retry
                if stop.is_set():
                    return
                code = _status_code(e)
                if code == 410:
                    log.info("%s: 410 Gone; listing again", what)
                    need_list = True
                    continue
                delay = self.backoff.next()
                doing = "listing" if need_list else "watching"
                if code != 403:
                    log.warning(
                        "%s %s failed (%s); retrying in %.1fs, keeping the last known state",
                        *(doing, what, _describe(e), delay),
                    )
                    stop.wait(delay)
                    continue
                r = self.resource
                verb = "list" if need_list else "watch"
                why = forbidden(e, verb, r.plural, r.group, self.cluster_role)
                if r.optional and not self.synced:
                    log.error(
                        "listing %s is forbidden, so %s: %s; retrying in %.1fs",
                        *(what, r.optional, why, delay),
                    )
                    with self.lock:
                        self.synced = True  # go on without it rather than program nothing
                    self.on_synced()
                else:
                    log.error(
                        "%s %s is forbidden (%s); retrying in %.1fs, keeping the last known state",
                        *(doing, what, why, delay),
                    )
                stop.wait(delay)


def _key_of(obj: Obj) -> Key:
    """(namespace, name) of an object, interned as the records' refs are (fields.py): the
    cache's key and the record name it with the same two strings, not copies of them."""
    m = obj.get("metadata") or {}
    ns, name = m.get("namespace") or "", m.get("name") or ""
    return (
        intern(ns) if isinstance(ns, str) else ns,
        intern(name) if isinstance(name, str) else name,
    )


def _describe(e: BaseException) -> str:
    code = _status_code(e)
    if code is not None:
        reason = getattr(e, "reason", "") or ""
        return f"HTTP {code} {reason}".strip()
    return f"{type(e).__name__}: {e}"


class KubeSource:
    """Services and EndpointSlices from the API server, as records (see the module docstring).

    Implements the agent's Source protocol: `take()` returns what changed since the last take,
    and None until both resources have been listed completely."""

    def __init__(
        self,
        api_client: Any,
        proxy_name: str,
        watch_timeout: int = 300,
        request_timeout: float = 30.0,
        trust_any_endpoints: bool = False,
        cluster_role: str = "cozyebpf",
    ) -> None:
        rest = KubeRest(api_client)
        self.proxy_name = proxy_name
        #: False (the default): only EndpointSlices of Kubernetes' controller, and endpoints
        #: that are Pods of the slice's namespace, are programmed (`read_object`)
        self.verify_endpoints = not trust_any_endpoints
        self._lock = threading.Lock()
        self._pending = ChangeSet()
        self._notify: Callable[[], None] = lambda: None
        self.informers = [
            Informer(
                Resource("Service", "v1", rest, "/api/v1/services"),
                self._read,
                self._service_changed,
                self._lock,
                self._synced,
                watch_timeout=watch_timeout,
                request_timeout=request_timeout,
                cluster_role=cluster_role,
            ),
            Informer(
                Resource(
                    "EndpointSlice",
                    "discovery.k8s.io/v1",
                    rest,
                    "/apis/discovery.k8s.io/v1/endpointslices",
                ),
                self._read,
                self._slice_changed,
                self._lock,
                self._synced,
                watch_timeout=watch_timeout,
                request_timeout=request_timeout,
                cluster_role=cluster_role,
            ),
            Informer(
                Resource(
                    "Node",
                    "v1",
                    rest,
                    "/api/v1/nodes",
                    optional="no LB IP is checked against the Nodes' addresses",
                ),
                self._read,
                self._node_changed,
                self._lock,
                self._synced,
                watch_timeout=watch_timeout,
                request_timeout=request_timeout,
                cluster_role=cluster_role,
            ),
        ]
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()

    def _read(self, obj: Obj) -> Record | None:
        rec = read_object(obj, 0, self.proxy_name, self.verify_endpoints)
        if isinstance(rec, Problem):  # the API server never sends an object without a name
            log.warning("ignoring an object the API server sent: %s", rec)
            return None
        return rec

    def _service_changed(
        self, key: Key, old: Record | None, new: Record | None, trigger: float | None
    ) -> None:
        p = self._pending
        p.touch(("Service", key), trigger)
        if isinstance(old, ServiceRecord) or isinstance(new, ServiceRecord):
            p.services[key] = new if isinstance(new, ServiceRecord) else None
        if isinstance(old, ForeignRecord) or isinstance(new, ForeignRecord):
            p.foreign[key] = new if isinstance(new, ForeignRecord) else None
        self._notify()

    def _slice_changed(
        self, key: Key, old: Record | None, new: Record | None, trigger: float | None
    ) -> None:
        self._pending.touch(("EndpointSlice", key), trigger)
        self._pending.slices[key] = (new,) if isinstance(new, SliceRecord) else None
        self._notify()

    def _node_changed(
        self, key: Key, old: Record | None, new: Record | None, trigger: float | None
    ) -> None:
        self._pending.touch(("Node", key), trigger)
        self._pending.nodes[key] = new if isinstance(new, NodeRecord) else None
        self._notify()

    def _synced(self) -> None:
        self._notify()

    def start(self, notify: Callable[[], None] | None = None) -> None:
        if notify is not None:
            self._notify = notify
        for inf in self.informers:
            t = threading.Thread(
                target=inf.run, args=(self._stop,), name=f"watch-{inf.resource.kind}", daemon=True
            )
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()

    @property
    def synced(self) -> bool:
        return all(i.synced for i in self.informers)

    def alive(self) -> bool:
        return all(t.is_alive() for t in self._threads)

    def take(self) -> ChangeSet | None:
        with self._lock:
            if not self.synced:
                return None
            out, self._pending = self._pending, ChangeSet()
        return out
