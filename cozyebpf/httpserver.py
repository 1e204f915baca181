"""The agent's one HTTP server, for health checks (cozyebpf/health.py) and metrics
(cozyebpf/metrics.py): a HOST:PORT option parsed once, both address families, a thread of its
own, and HTTPS when given a TLS context.

An unspecified host (empty, `0.0.0.0` or `::`) listens on every address of both families (one
socket on `::` with IPV6_V6ONLY off, as Go's listeners and so the Kubernetes components do; on
`0.0.0.0` alone when the kernel has no IPv6); any other host is the one address it names, of
either family (`[2001:db8::1]:9811` or `2001:db8::1:9811`).

The metrics are served on the node's address, which tenants' VMs reach, so a server holds what
any client can throw at it (issue 37) with a bounded number of threads, one per connection:

- at most MAX_CONNECTIONS connections at once, MAX_PER_SOURCE of them from one source (an IPv4
  address, or an IPv6 /64: what one VM can hold); a connection over either cap is closed at
  once, before its TLS handshake. When the server is full, a newcomer takes the place of a
  connection that has not sent its request yet (the oldest of those it may take), if:
  - it comes from an address that an authorised request came from in the last TRUST_TTL
    seconds (the handler says so: `Handler.trusted`; the metrics' token check, so a
    Prometheus that scraped once): any such connection of an address without that trust;
  - it comes from a source that holds fewer connections than the busiest one: one of the
    busiest source's (a swarm from a few addresses gives way);
  - or else one that has waited IDLE_GRACE without sending its request (a client sends it
    within milliseconds): 64 addresses holding one silent connection each shut nobody out.
  A connection of a trusted address is never taken for a newcomer without that trust, so a
  swarm from any number of addresses, reconnecting as fast as it likes, cannot keep an
  authorised scraper from its scrapes (issue 45, item 9);
- a client has REQUEST_TIMEOUT from its connection to the end of its request's headers (the
  TLS handshake included), a deadline for the whole request, not for each read: a client that
  sends a byte a second is cut there; writing the answer has RESPONSE_TIMEOUT;
- one request per connection (HTTP/1.0): no connection idles between requests.

`ServerStats` counts what was refused or cut (the metrics server exports it).
"""

from __future__ import annotations

import contextlib
import errno
import io
import ipaddress
import logging
import socket
import socketserver
import ssl
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from cozyebpf.errors import PermanentError

log = logging.getLogger(__name__)

UNSPECIFIED = ("", "0.0.0.0", "::")
#: connections served at once (a thread each): a scrape or a probe holds one for milliseconds,
#: a few scrapers and probes need a handful; 64 threads cost the agent about 2 MB at most
MAX_CONNECTIONS = 64
#: connections at once from one source (an IPv4 address or an IPv6 /64): Prometheus holds
#: one per target, `cozyebpf status` one; 8 leave room for a second scraper behind the same
#: address, and a swarm from one VM holds an eighth of the server at most
MAX_PER_SOURCE = 8
#: seconds from the connection to the end of the request's headers, the TLS handshake
#: included: Prometheus sends its request at once and gives a whole scrape 10 s by default
#: (scrape_timeout), the kubelet's probes 1 s; what takes longer is a slow client
REQUEST_TIMEOUT = 10.0
#: seconds to write the answer (10k Services' metrics are ~6 MB, written in milliseconds
#: to a scraper that reads them)
RESPONSE_TIMEOUT = 10.0
#: connections the kernel queues until the server accepts them (the accepting thread only
#: counts and hands out: a queue of 128 rides out a burst without dropping SYNs)
LISTEN_BACKLOG = 128
#: seconds a connection may wait without sending its request before any newcomer may take its
#: place in a full server: Prometheus and the probes send theirs within milliseconds (the TLS
#: handshake included); a second leaves a loaded node a margin
IDLE_GRACE = 1.0
#: seconds an address stays trusted after an authorised request (Prometheus scrapes every
#: 15-60 s; a scraper that stops for longer is a newcomer again), and how many are remembered
#: (the least recently authorised goes: a few scrapers per node, HA pairs)
TRUST_TTL = 600.0
TRUSTED_MAX = 16


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


@dataclass(frozen=True)
class Limits:
    """What one server holds: the caps and deadlines of the module's docstring."""

    connections: int = MAX_CONNECTIONS
    per_source: int = MAX_PER_SOURCE
    request_timeout: float = REQUEST_TIMEOUT
    response_timeout: float = RESPONSE_TIMEOUT
    idle_grace: float = IDLE_GRACE
    trust_ttl: float = TRUST_TTL


DEFAULT_LIMITS = Limits()


def source_key(host: str) -> str:
    """The source a client counts as, for caps and rate limits: its IPv4 address (also when it
    arrives IPv4-mapped on a dual-stack socket), or the /64 of its IPv6 address (one VM may
    hold a whole /64)."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))
    return str(ip)


def address_key(host: str) -> str:
    """A client's own address (IPv4 when it arrives IPv4-mapped), for trust: the address an
    authorised request came from, not its /64."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


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


@dataclass
class ServerStats:
    """What a server refused or cut, by reason; plain counters, read by the metrics."""

    #: connections closed as they came: "source" (its source held MAX_PER_SOURCE), "full"
    #: (the server held MAX_CONNECTIONS, none of them a busier source's waiting request)
    refused: dict[str, int] = field(default_factory=lambda: {"source": 0, "full": 0})
    #: connections closed before their answer: "slow" (the request or the answer outlived its
    #: deadline), "displaced" (cut, before its request, for a newcomer: see the module)
    cut: dict[str, int] = field(default_factory=lambda: {"slow": 0, "displaced": 0})


class _Conn:
    """One connection being served: its socket (the TLS one once wrapped), its source and
    address, when it came, the deadline of what it does now (None: the answer is being
    computed; the clock starts at its first write), whether its request is still being read,
    and whether its address was trusted when it came."""

    __slots__ = (
        "address",
        "came",
        "cut",
        "deadline",
        "limits",
        "reading",
        "sock",
        "source",
        "trusted",
    )

    def __init__(self, sock: socket.socket, host: str, limits: Limits) -> None:
        self.sock = sock
        self.source = source_key(host)
        self.address = address_key(host)
        self.limits = limits
        self.came = time.monotonic()
        self.deadline: float | None = self.came + limits.request_timeout
        self.reading = True
        self.cut = False  # displaced by a newcomer
        self.trusted = False

    def timeout(self) -> float:
        """Seconds left for the next read or write (TimeoutError when none is)."""
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + self.limits.response_timeout
        left = self.deadline - now
        if left <= 0:
            raise TimeoutError("the connection's deadline passed")
        return left

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def shut(self) -> None:
        """Wake its thread out of a blocking read or write: the connection ends there."""
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)  # not SSLSocket's: no TLS state


class _DeadlineIO(io.RawIOBase):
    """A connection's socket as a file whose reads and writes end at its deadline (one
    deadline for the whole request, not a timeout per read)."""

    def __init__(self, conn: _Conn) -> None:
        super().__init__()
        self.conn = conn

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        sock = self.conn.sock
        sock.settimeout(self.conn.timeout())
        return sock.recv_into(buf)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        sent = 0
        while sent < len(view):
            sock = self.conn.sock
            sock.settimeout(self.conn.timeout())
            sent += sock.send(view[sent:])
        return sent


class Handler(BaseHTTPRequestHandler):
    """A request handler that answers with whole bodies and logs at debug level; its reads
    and writes keep to the connection's deadlines."""

    log_name = "http"
    server: _Server
    conn: _Conn

    def setup(self) -> None:
        self.conn = self.server.current()
        self.connection = self.request
        self.rfile = io.BufferedReader(_DeadlineIO(self.conn))
        self.wfile = io.BufferedWriter(_DeadlineIO(self.conn))

    def parse_request(self) -> bool:
        ok = super().parse_request()
        self.conn.reading = False  # read: no longer a slow client's to cut for a newcomer
        self.conn.deadline = None  # the answer's deadline starts at its first write
        return ok

    @property
    def source(self) -> str:
        """The client's source (source_key), for caps and rate limits."""
        return self.conn.source

    def trusted(self) -> None:
        """Say that this request was authorised: its address keeps a place in a full server
        (module docstring) for the next TRUST_TTL seconds."""
        self.server.trust(self.conn.address)

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
    request_queue_size = LISTEN_BACKLOG

    def __init__(
        self,
        family: socket.AddressFamily,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        tls: ssl.SSLContext | None,
        limits: Limits,
    ) -> None:
        self.address_family = family
        self.tls = tls
        self.limits = limits
        self.stats = ServerStats()
        self._lock = threading.Lock()
        self._conns: dict[str, list[_Conn]] = {}  # by source, oldest first
        self._count = 0
        #: addresses an authorised request came from -> when (monotonic), the latest last
        self._trusted: OrderedDict[str, float] = OrderedDict()
        self._local = threading.local()  # the connection the calling thread serves
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

    def current(self) -> _Conn:
        """The connection the calling thread serves."""
        conn: _Conn = self._local.conn
        return conn

    def process_request(self, request: Any, client_address: Any) -> None:
        """In the accepting thread: admit the connection within the caps (see the module) and
        serve it in a thread of its own, or close it at once."""
        conn = _Conn(request, client_address[0], self.limits)
        refused, displaced = self._admit(conn)
        if refused is not None:
            log.debug("%s: refused %s (%s)", self.server_name, client_address[0], refused)
            self.shutdown_request(request)
            return
        if displaced is not None:
            log.debug("%s: cut a waiting connection of %s", self.server_name, displaced.source)
            displaced.shut()
        t = threading.Thread(
            target=self._serve, args=(conn, client_address), name="http-conn", daemon=True
        )
        try:
            t.start()
        except RuntimeError:  # no thread to be had (a limit of the container): not served
            self._release(conn)
            self.shutdown_request(request)

    def trust(self, address: str) -> None:
        """`address` (address_key) was answered an authorised request now."""
        with self._lock:
            self._trusted[address] = time.monotonic()
            self._trusted.move_to_end(address)
            while len(self._trusted) > TRUSTED_MAX:
                self._trusted.popitem(last=False)

    def _is_trusted(self, address: str, now: float) -> bool:
        """Under the lock."""
        at = self._trusted.get(address)
        return at is not None and now - at < self.limits.trust_ttl

    def _admit(self, conn: _Conn) -> tuple[str | None, _Conn | None]:
        """(why it is refused, or None; a connection it displaces, or None), counted in."""
        with self._lock:
            conn.trusted = self._is_trusted(conn.address, conn.came)
            mine = self._conns.get(conn.source, [])
            if len(mine) >= self.limits.per_source:
                self.stats.refused["source"] += 1
                return "source", None
            displaced = None
            if self._count >= self.limits.connections:
                displaced = self._place_for(conn, len(mine))
                if displaced is None:
                    self.stats.refused["full"] += 1
                    return "full", None
                displaced.cut = True
                self.stats.cut["displaced"] += 1
                self._forget(displaced)
            self._conns.setdefault(conn.source, []).append(conn)
            self._count += 1
            return None, displaced

    def _place_for(self, conn: _Conn, mine: int) -> _Conn | None:
        """The connection a newcomer to a full server takes the place of (module docstring),
        or None; under the lock. Only one that has not sent its request, of an address without
        trust."""

        def waiting(conns: list[_Conn]) -> list[_Conn]:
            return [c for c in conns if c.reading and not c.cut and not c.trusted]

        if conn.trusted:
            every = waiting([c for conns in self._conns.values() for c in conns])
            return min(every, key=lambda c: c.came, default=None)
        # the busiest source gives way while it would still hold no fewer after it
        busiest = max(self._conns.values(), key=len)
        theirs = waiting(busiest)
        if len(busiest) > mine + 1 and theirs:
            return theirs[0]  # the oldest: the slowest to send its request
        idle = [
            c
            for conns in self._conns.values()
            for c in waiting(conns)
            if conn.came - c.came >= self.limits.idle_grace
        ]
        return min(idle, key=lambda c: c.came, default=None)

    def _forget(self, conn: _Conn) -> None:
        """Out of the count (under the lock; at most once per connection)."""
        mine = self._conns.get(conn.source)
        if mine is None or conn not in mine:
            return
        mine.remove(conn)
        if not mine:
            del self._conns[conn.source]
        self._count -= 1

    def _release(self, conn: _Conn) -> None:
        with self._lock:
            self._forget(conn)

    def connections(self) -> int:
        """Connections served now."""
        with self._lock:
            return self._count

    def _serve(self, conn: _Conn, client_address: Any) -> None:
        self._local.conn = conn
        try:
            self.finish_request(conn.sock, client_address)
        except Exception as e:  # a client that went away, a timeout: its own connection's end
            self.handle_error(conn.sock, client_address, e)
        finally:
            self.shutdown_request(conn.sock)
            self._release(conn)
            self._local.conn = None

    def finish_request(self, request: Any, client_address: Any) -> None:
        """With TLS, the handshake runs in the connection's own thread (never in the
        accepting one, which a slow or silent client would hold), within its deadline."""
        conn = self.current()
        if self.tls is not None:
            try:
                tls_sock = self.tls.wrap_socket(
                    request, server_side=True, do_handshake_on_connect=False
                )
                conn.sock = tls_sock  # what a newcomer's cut shuts from now on
                if conn.cut:
                    return
                tls_sock.settimeout(conn.timeout())
                tls_sock.do_handshake()
            except (OSError, ssl.SSLError) as e:  # a port scan, plain HTTP, a bad client
                log.debug("TLS handshake with %s failed: %s", client_address[0], e)
                self._slow(conn, client_address)
                return
        try:
            super().finish_request(conn.sock, client_address)
        finally:
            self._slow(conn, client_address)

    def _slow(self, conn: _Conn, client_address: Any) -> None:
        """Count the connection as cut for slowness when its deadline passed."""
        if conn.cut or not conn.expired():
            return
        with self._lock:
            self.stats.cut["slow"] += 1
        what = "request" if conn.reading else "answer"
        log.debug(
            "%s: the %s of %s outlived its deadline", self.server_name, what, client_address[0]
        )

    def handle_error(self, request: Any, client_address: Any, error: Any = None) -> None:
        """A client's failure ends its connection only: logged at debug level (socketserver
        would print a traceback to stderr for every reset connection of a flood)."""
        error = error if error is not None else sys.exc_info()[1]
        log.debug("%s: connection from %s ended: %s", self.server_name, client_address[0], error)


class HttpServer:
    """`handler` on `address` (the value of `option`, e.g. --health-address), in a daemon
    thread named `name`; over HTTPS with `tls`. `paths`: what it serves, for the log; `limits`:
    the caps and deadlines of its connections (the module's)."""

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
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        self.name = name
        self.paths = paths
        self.scheme = "https" if tls is not None else "http"
        host, port = parse_address(address, option, example)
        try:
            self.server = self._listen(host, port, handler, tls, limits)
        except OSError as e:
            raise PermanentError(f"cannot serve {name} on {address} ({option}): {e}") from e
        bound_host, bound_port = self.server.server_address[:2]
        #: where it listens, as a URL's host:port ([::]:9811 for every address)
        self.address = authority(str(bound_host), bound_port)
        self._thread = threading.Thread(target=self.server.serve_forever, name=name, daemon=True)

    @staticmethod
    def _listen(
        host: str,
        port: int,
        handler: type[BaseHTTPRequestHandler],
        tls: ssl.SSLContext | None,
        limits: Limits,
    ) -> _Server:
        family = _family(host, port)
        if host:
            return _Server(family, (host, port), handler, tls, limits)
        if family == socket.AF_INET6:
            try:
                return _Server(family, ("::", port), handler, tls, limits)
            except OSError as e:  # a kernel booted with ipv6.disable=1 has no such sockets
                if e.errno != errno.EAFNOSUPPORT:
                    raise
        return _Server(socket.AF_INET, ("0.0.0.0", port), handler, tls, limits)

    def url(self, path: str) -> str:
        return f"{self.scheme}://{self.address}{path}"

    def start(self) -> None:
        self._thread.start()
        log.info("%s on %s", self.name, self.url(self.paths))

    @property
    def stats(self) -> ServerStats:
        """What the server refused or cut (ServerStats)."""
        return self.server.stats

    def connections(self) -> int:
        """Connections served now (each one a thread)."""
        return self.server.connections()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
