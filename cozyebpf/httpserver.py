"""The agent's one HTTP server, for health checks (cozyebpf/health.py) and metrics
(cozyebpf/metrics.py): a HOST:PORT option parsed once, both address families, a thread of its
own, and HTTPS when given a TLS context.

An unspecified host (empty, `0.0.0.0` or `::`) listens on every address of both families (one
socket on `::` with IPV6_V6ONLY off, as Go's listeners and so the Kubernetes components do; on
`0.0.0.0` alone when the kernel has no IPv6); any other host is the one address it names, of
either family (`[2001:db8::1]:9811` or `2001:db8::1:9811`).
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
import socketserver
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from cozyebpf.errors import PermanentError

log = logging.getLogger(__name__)

UNSPECIFIED = ("", "0.0.0.0", "::")
TLS_HANDSHAKE_TIMEOUT = 10.0  # seconds a client has to finish its TLS handshake


def parse_address(address: str, option: str, example: str) -> tuple[str, int]:
    """(host, port) of `address` (HOST:PORT, an IPv6 host with or without brackets); the host
    is "" when unspecified (every address)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise PermanentError(f"{option} {address!r} is not HOST:PORT (e.g. {example})")
    host = host.strip("[]")
    return ("" if host in UNSPECIFIED else host), int(port)


def authority(host: str, port: int | str) -> str:
    """host:port as a URL has it: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def url(address: str, path: str, scheme: str = "http") -> str:
    """The URL of `path` on a server at `address` (HOST:PORT, an IPv6 host with or without
    brackets), e.g. for `cozyebpf status --agent-address`."""
    host, sep, port = address.rpartition(":")
    return f"{scheme}://{authority(host.strip('[]'), port) if sep else address}{path}"


def _family(host: str, port: int) -> socket.AddressFamily:
    """The family to listen with on `host` (an address or a name)."""
    if not host:
        return socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:  # a name: IPv4 where it has an IPv4 address (as before), else IPv6
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        families = {info[0] for info in infos}
        return socket.AF_INET if socket.AF_INET in families else socket.AF_INET6


class Handler(BaseHTTPRequestHandler):
    """A request handler that answers with whole bodies and logs at debug level."""

    log_name = "http"

    def send_body(
        self, code: int, body: bytes, content_type: str, headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(code)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug(self.log_name + ": " + format, *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        family: socket.AddressFamily,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        tls: ssl.SSLContext | None,
    ) -> None:
        self.address_family = family
        self.tls = tls
        super().__init__(address, handler, bind_and_activate=False)
        try:
            if family == socket.AF_INET6 and address[0] == "::":
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            self.server_bind()
            self.server_activate()
        except BaseException:
            self.server_close()
            raise

    def server_bind(self) -> None:
        # HTTPServer's own asks DNS for the host's name (getfqdn), which nothing here uses.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    def finish_request(self, request: Any, client_address: Any) -> None:
        """With TLS, the handshake runs in the request's own thread (never in the accepting
        one, which a slow or silent client would hold), bounded by a timeout."""
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(TLS_HANDSHAKE_TIMEOUT)
        try:
            conn = self.tls.wrap_socket(request, server_side=True)
        except (OSError, ssl.SSLError) as e:  # a port scan, plain HTTP, a bad client
            log.debug("TLS handshake with %s failed: %s", client_address[0], e)
            return
        try:
            super().finish_request(conn, client_address)
        finally:
            conn.close()  # the plain socket was detached into it


class HttpServer:
    """`handler` on `address` (the value of `option`, e.g. --health-address), in a daemon
    thread named `name`; over HTTPS with `tls`. `paths`: what it serves, for the log."""

    def __init__(
        self,
        name: str,
        address: str,
        handler: type[BaseHTTPRequestHandler],
        *,
        option: str,
        example: str,
        tls: ssl.SSLContext | None = None,
        paths: str = "/",
    ) -> None:
        self.name = name
        self.paths = paths
        self.scheme = "https" if tls is not None else "http"
        host, port = parse_address(address, option, example)
        try:
            self.server = self._listen(host, port, handler, tls)
        except OSError as e:
            raise PermanentError(f"cannot serve {name} on {address} ({option}): {e}") from e
        bound_host, bound_port = self.server.server_address[:2]
        #: where it listens, as a URL's host:port ([::]:9811 for every address)
        self.address = authority(str(bound_host), bound_port)
        self._thread = threading.Thread(target=self.server.serve_forever, name=name, daemon=True)

    @staticmethod
    def _listen(
        host: str, port: int, handler: type[BaseHTTPRequestHandler], tls: ssl.SSLContext | None
    ) -> _Server:
        family = _family(host, port)
        if host:
            return _Server(family, (host, port), handler, tls)
        if family == socket.AF_INET6:
            try:
                return _Server(family, ("::", port), handler, tls)
            except OSError as e:  # a kernel booted with ipv6.disable=1 has no such sockets
                if e.errno != errno.EAFNOSUPPORT:
                    raise
        return _Server(socket.AF_INET, ("0.0.0.0", port), handler, tls)

    def url(self, path: str) -> str:
        return f"{self.scheme}://{self.address}{path}"

    def start(self) -> None:
        self._thread.start()
        log.info("%s on %s", self.name, self.url(self.paths))

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
