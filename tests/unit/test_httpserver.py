"""The one HTTP server of health checks and metrics (cozyebpf/httpserver.py): a probe and a
scrape over IPv4 and IPv6, on one address of either family or on every address of both; the
metrics' HTTPS and token check on both families."""

from __future__ import annotations

import http.client
import socket
import ssl
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter

from cozyebpf.errors import PermanentError
from cozyebpf.health import HealthServer
from cozyebpf.httpserver import url
from cozyebpf.metrics import MetricsServer
from cozyebpf.metricsauth import KubeAuthorizer, server_context
from cozylab.kubeapi import FakeKubeAPI

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
