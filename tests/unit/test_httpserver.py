"""The one HTTP server of health checks and metrics (cozyebpf/httpserver.py): a probe and a
scrape over IPv4 and IPv6, on one address of either family or on every address of both; the
metrics' HTTPS and token check on both families; what a flood meets: caps per source and per
server, a newcomer's place taken from the busiest source, deadlines for slow clients."""

from __future__ import annotations

import http.client
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter

from cozyebpf.errors import PermanentError
from cozyebpf.health import HealthServer
from cozyebpf.httpserver import Handler, HttpServer, Limits, source_key, url
from cozyebpf.kube.metricsauth import KubeAuthorizer
from cozyebpf.metrics import MetricsServer
from cozyebpf.tls import server_context
from cozylab.kubeapi import FakeKubeAPI
from cozylab.netns import wait_for

V4, V6 = "127.0.0.1", "::1"
READER = "system:serviceaccount:monitoring:prometheus"

#: --*-address (port 0: any free one) -> the loopback addresses that must reach it
LISTENS = {
    "ipv4": ("127.0.0.1:0", [V4]),
    "ipv6": ("[::1]:0", [V6]),
    "ipv6-no-brackets": ("::1:0", [V6]),
    "a-name": ("localhost:0", [V4]),  # IPv4 where the name has an IPv4 address, as before
    "both-no-host": (":0", [V4, V6]),
    "both-0.0.0.0": ("0.0.0.0:0", [V4, V6]),
    "both-::": ("[::]:0", [V4, V6]),
}


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def request(
    host: str, port: int, path: str, tls: bool = False, token: str | None = None
) -> tuple[int, str]:
    if tls:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # self-signed
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            host, port, context=ctx, timeout=10
        )
    else:
        conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def registry() -> CollectorRegistry:
    r = CollectorRegistry()
    Counter("cozyebpf_probe", "a metric that names a tenant", ["service"], registry=r).labels(
        "tenant-a/vm1"
    ).inc()
    return r


@pytest.mark.parametrize(("address", "reach"), LISTENS.values(), ids=LISTENS.keys())
def test_health_probe_over_each_family(address: str, reach: list[str]) -> None:
    h = HealthServer(address, lambda: None, lambda: "not synced yet")
    h.start()
    try:
        for host in reach:
            assert request(host, port_of(h.address), "/healthz") == (200, "ok\n"), host
            assert request(host, port_of(h.address), "/readyz") == (503, "not synced yet\n"), host
    finally:
        h.stop()


@pytest.mark.parametrize(("address", "reach"), LISTENS.values(), ids=LISTENS.keys())
def test_plain_metrics_scrape_over_each_family(address: str, reach: list[str]) -> None:
    m = MetricsServer(address, registry())
    m.start()
    try:
        for host in reach:
            code, body = request(host, port_of(m.address), "/metrics")
            assert code == 200, host
            assert 'cozyebpf_probe_total{service="tenant-a/vm1"} 1.0' in body, host
    finally:
        m.stop()


def test_one_address_is_only_that_family() -> None:
    """127.0.0.1 is not reached over ::1 and the other way round (no accidental wildcard)."""
    for address, other in (("127.0.0.1:0", V6), ("[::1]:0", V4)):
        h = HealthServer(address, lambda: None, lambda: None)
        h.start()
        try:
            with pytest.raises(ConnectionRefusedError):
                request(other, port_of(h.address), "/healthz")
        finally:
            h.stop()


@pytest.fixture
def api() -> Iterator[FakeKubeAPI]:
    with FakeKubeAPI() as a:
        a.add_token("reader-token", READER)
        a.grant(READER, "/metrics")
        yield a


def test_https_metrics_with_token_check_over_both_families(api: FakeKubeAPI) -> None:
    auth = KubeAuthorizer(api.api_client())
    tls = server_context("", ["127.0.0.1", "::1"])
    m = MetricsServer(":0", registry(), tls, auth)
    m.start()
    try:
        assert m.address.startswith("[::]:")
        for host in (V4, V6):
            assert request(host, port_of(m.address), "/metrics", tls=True)[0] == 401, host
            code, body = request(host, port_of(m.address), "/metrics", True, "reader-token")
            assert code == 200 and "tenant-a/vm1" in body, host
            with pytest.raises((http.client.HTTPException, OSError)):
                request(host, port_of(m.address), "/metrics")  # plain HTTP on the TLS port
    finally:
        m.stop()


def test_a_taken_port_is_a_clear_error() -> None:
    with socket.socket(socket.AF_INET6) as taken:
        taken.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        taken.bind(("::", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for address in (f":{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
            with pytest.raises(PermanentError, match=r"cannot serve health on .* \(--health-addr"):
                HealthServer(address, lambda: None, lambda: None)


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("127.0.0.1:9810", "http://127.0.0.1:9810/status"),
        ("[::1]:9810", "http://[::1]:9810/status"),
        ("::1:9810", "http://[::1]:9810/status"),
        ("localhost", "http://localhost/status"),
    ],
)
def test_url_of_an_address(address: str, expected: str) -> None:
    assert url(address, "/status") == expected


# -- a flood (issue 37, item 4): caps per source and per server, deadlines for slow clients --


class OkHandler(Handler):
    def do_GET(self) -> None:
        self.send_body(200, b"ok\n", "text/plain")


class BigHandler(Handler):
    def do_GET(self) -> None:
        self.send_body(200, b"x" * (32 << 20), "text/plain")  # more than the socket buffers


def small_server(limits: Limits, handler: type[Handler] = OkHandler, **kw: Any) -> HttpServer:
    s = HttpServer("test", "127.0.0.1:0", handler, option="--x", example="", limits=limits, **kw)
    s.start()
    return s


def idle(server: HttpServer, source: str) -> socket.socket:
    """A connection from `source` (an address of 127/8) that sends nothing."""
    return socket.create_connection(
        (V4, port_of(server.address)), timeout=10, source_address=(source, 0)
    )


def closed_by_server(s: socket.socket) -> bool:
    """The server closed `s` without an answer (EOF or a reset within 10 s)."""
    s.settimeout(10)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def get_from(server: HttpServer, source: str) -> bytes:
    with idle(server, source) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def conn_threads() -> int:
    return sum(t.name == "http-conn" for t in threading.enumerate())


def test_connections_are_capped_per_source_and_per_server() -> None:
    """At most `per_source` connections from one source and `connections` in all, one thread
    each: a swarm of 40 connections from 10 sources holds 4 threads; the others are closed as
    they come, or cut for a newcomer (counted either way)."""
    server = small_server(Limits(connections=4, per_source=2, request_timeout=60))
    swarm: list[socket.socket] = []
    try:
        swarm += [idle(server, "127.0.0.2") for _ in range(2)]
        wait_for(lambda: server.connections() == 2, 10, "two connections served")
        third = idle(server, "127.0.0.2")
        swarm.append(third)
        assert closed_by_server(third)  # over its source's cap
        assert server.stats.refused == {"source": 1, "full": 0}
        swarm += [idle(server, f"127.0.0.{3 + i % 9}") for i in range(37)]
        st = server.stats

        def closed() -> int:  # refused as they came, or cut for a newcomer of a source with fewer
            return st.refused["source"] + st.refused["full"] + st.cut["displaced"]

        wait_for(lambda: closed() == 36, 10, "all but 4 of the 40 closed")
        assert server.connections() == 4
        wait_for(lambda: conn_threads() <= 4, 10, "the cut connections' threads gone")
    finally:
        for s in swarm:
            s.close()
        server.stop()


def test_a_newcomer_displaces_a_waiting_connection_of_the_busiest_source() -> None:
    """When the server is full, a source that holds fewer connections than the busiest one
    (a Prometheus with one) gets in: the busiest source's oldest connection that has not sent
    its request is cut. A server full of sources that hold one each refuses."""
    server = small_server(Limits(connections=4, per_source=3, request_timeout=60))
    try:
        a = [idle(server, "127.0.0.2") for _ in range(3)]
        b = idle(server, "127.0.0.3")
        wait_for(lambda: server.connections() == 4, 10, "the server full")
        assert get_from(server, "127.0.0.4").startswith(b"HTTP/1.0 200 OK\r\n")
        assert closed_by_server(a[0])  # the oldest of the busiest source gave way
        assert not select.select(a[1:], [], [], 0.2)[0], "only one was cut"
        assert server.stats.cut["displaced"] == 1 and server.stats.refused["full"] == 0
        for s in a:
            s.close()
        wait_for(lambda: server.connections() == 1, 10, "the swarm gone")
        ones = [idle(server, f"127.0.0.{i}") for i in (6, 7, 8)]  # four sources, one each
        wait_for(lambda: server.connections() == 4, 10, "the server full again")
        late = idle(server, "127.0.0.9")
        assert closed_by_server(late)
        assert server.stats.refused["full"] == 1
        for s in (b, late, *ones):
            s.close()
    finally:
        server.stop()


class Swarm:
    """`n` sources (127.0.1.1 and up), each holding one connection that sends nothing; one cut
    by the server is opened again at once (an attacker's loop)."""

    def __init__(self, server: HttpServer, n: int) -> None:
        self.server = server
        self.halt = threading.Event()
        self.threads = [
            threading.Thread(target=self._hold, args=(f"127.0.1.{i + 1}",), daemon=True)
            for i in range(n)
        ]
        for t in self.threads:
            t.start()

    def _hold(self, source: str) -> None:
        while not self.halt.is_set():
            try:
                with idle(self.server, source) as s:
                    while not self.halt.is_set() and not select.select([s], [], [], 0.05)[0]:
                        pass
            except OSError:
                pass
            self.halt.wait(0.01)

    def stop(self) -> None:
        self.halt.set()
        for t in self.threads:
            t.join(10)


def scrape_from(server: HttpServer, source: str, token: str) -> int | None:
    """GET /metrics over TLS from `source` with `token`: the status, or None when the server
    closed the connection without an answer (refused)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    data = b""
    try:
        with idle(server, source) as raw, ctx.wrap_socket(raw) as s:
            s.sendall(f"GET /metrics HTTP/1.0\r\nAuthorization: Bearer {token}\r\n\r\n".encode())
            while chunk := s.recv(65536):
                data += chunk
    except (OSError, ssl.SSLError):
        if not data:
            return None
    return int(data.split(b" ", 2)[1])


def metrics_server(api: FakeKubeAPI, limits: Limits) -> MetricsServer:
    """The metrics as the chart serves them (HTTPS, the token check), with the default caps."""
    m = MetricsServer(
        "127.0.0.1:0",
        registry(),
        server_context("", ["127.0.0.1"]),
        KubeAuthorizer(api.api_client()),
        limits=limits,
    )
    m.start()
    return m


def test_an_authorised_scraper_keeps_its_scrapes_against_64_idle_sources(
    api: FakeKubeAPI,
) -> None:
    """Issue 45, item 9: 64 sources, each holding one silent connection and opening it again
    whenever it is cut, fill the metrics server (64 connections, one per source: no busiest
    source gives way). Before, every newcomer was refused "full": Prometheus got no scrape.
    Now an address that an authorised scrape came from takes the place of a silent connection,
    at every scrape; a newcomer without one does not (the silent connections are younger than
    the idle grace, 60 s here), nor does a tenant whose token was refused."""
    m = metrics_server(api, Limits(request_timeout=60, idle_grace=60))
    swarm = None
    try:
        prometheus, tenant, stranger = "127.0.0.2", "127.0.0.3", "127.0.0.4"
        assert scrape_from(m, prometheus, "reader-token") == 200
        assert scrape_from(m, tenant, "not-a-token") == 401
        swarm = Swarm(m, 64)
        wait_for(lambda: m.connections() == 64, 10, "the swarm to fill the server")
        assert scrape_from(m, stranger, "reader-token") is None  # refused: full
        assert scrape_from(m, tenant, "reader-token") is None  # a 401 earns no place
        full = m.stats.refused["full"]
        codes = []
        for _ in range(10):
            wait_for(lambda: m.connections() == 64, 10, "the swarm back at 64")
            codes.append(scrape_from(m, prometheus, "reader-token"))
        assert codes == [200] * 10
        assert m.stats.cut["displaced"] >= 10 and m.stats.refused["full"] >= full
    finally:
        if swarm is not None:
            swarm.stop()
        m.stop()


def test_a_first_scrape_gets_the_place_of_a_connection_idle_past_the_grace(
    api: FakeKubeAPI,
) -> None:
    """A scraper with no authorised scrape yet (an agent restarted under the swarm) takes the
    place of a connection that has waited the idle grace (0.5 s here) without a request, the
    oldest; one that came later is left."""
    m = metrics_server(api, Limits(request_timeout=60, idle_grace=0.5))
    swarm = Swarm(m, 64)
    try:
        wait_for(lambda: m.connections() == 64, 10, "the swarm to fill the server")
        time.sleep(0.6)  # the swarm's connections waited past the grace (not a time asserted)
        assert scrape_from(m, "127.0.0.2", "reader-token") == 200
        assert m.stats.cut["displaced"] >= 1
    finally:
        swarm.stop()
        m.stop()


def drip(s: socket.socket, data: bytes, every: float = 0.1) -> int:
    """Send `data` a byte every `every` seconds until the server closes `s`; how many bytes
    were sent."""
    for i, byte in enumerate(data):
        if select.select([s], [], [], every)[0]:  # readable: the server answered or closed
            return i
        try:
            s.send(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            return i
    return len(data)


def test_a_client_that_sends_a_byte_at_a_time_is_cut_at_the_request_deadline() -> None:
    """The deadline is for the whole request, not for each read: a byte every 0.1 s keeps
    every read short, and the request (100 bytes: 10 s) is cut at its 1 s deadline."""
    server = small_server(Limits(connections=4, per_source=2, request_timeout=1.0))
    try:
        with idle(server, "127.0.0.2") as s:
            request = b"GET / HTTP/1.0\r\nX-Pad: " + b"a" * 70 + b"\r\n\r\n"
            sent = drip(s, request)
            assert sent < len(request) and closed_by_server(s)
        wait_for(lambda: server.stats.cut["slow"] == 1, 10, "the cut counted")
        assert get_from(server, "127.0.0.2").startswith(b"HTTP/1.0 200")
    finally:
        server.stop()


def client_hello() -> bytes:
    """The first flight of a TLS client (its ClientHello), as bytes to send by hand."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def test_a_tls_handshake_sent_a_byte_at_a_time_is_cut_at_the_deadline() -> None:
    """The TLS handshake counts against the request's deadline too (before issue 37 each
    read of it had 10 s, so a ClientHello dripped a byte at a time held a thread for ever)."""
    tls = server_context("", ["127.0.0.1"])
    server = small_server(Limits(connections=4, per_source=2, request_timeout=1.0), tls=tls)
    try:
        with idle(server, "127.0.0.2") as s:
            hello = client_hello()
            sent = drip(s, hello)
            assert sent < len(hello) and closed_by_server(s)
        wait_for(lambda: server.stats.cut["slow"] == 1, 10, "the cut counted")
    finally:
        server.stop()


def test_a_client_that_does_not_read_the_answer_is_cut_at_the_answer_deadline() -> None:
    server = small_server(
        Limits(connections=4, per_source=2, response_timeout=1.0), handler=BigHandler
    )
    try:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.bind(("127.0.0.2", 0))
        s.connect((V4, port_of(server.address)))
        with s:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")  # and reads nothing
            wait_for(lambda: server.stats.cut["slow"] == 1, 20, "the answer cut")
            wait_for(lambda: server.connections() == 0, 10, "its thread gone")
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("host", "source"),
    [
        ("198.51.100.7", "198.51.100.7"),
        ("::ffff:198.51.100.7", "198.51.100.7"),  # IPv4 on a dual-stack socket
        ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),
        ("fe80::1%eth0", "fe80::/64"),
    ],
)
def test_the_source_of_a_client(host: str, source: str) -> None:
    assert source_key(host) == source
