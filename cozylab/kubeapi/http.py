"""The API double over HTTP/1.1: the server, the request handler that routes to
`FakeKubeAPI`, the chunked watch streams, a TCP reset."""

from __future__ import annotations

import contextlib
import json
import math
import select
import socket
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from cozylab.kubeapi.objects import (
    _BY_PATH,
    _LINGER_RST,
    _RESOURCE_PATH,
    PARTIAL,
    Obj,
    RequestRecord,
    _ApiError,
    _Change,
    _Kind,
    _parse_bool,
    _parse_int,
    _Selector,
    _status,
    _wants_metadata,
    _watch_event,
    _Watcher,
)

if TYPE_CHECKING:
    from cozylab.kubeapi.server import FakeKubeAPI


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
