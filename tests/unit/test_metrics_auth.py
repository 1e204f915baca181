"""Metrics only for who may read them (issue 28, item 1): HTTPS with a generated certificate,
and the caller's bearer token checked with a TokenReview and a SubjectAccessReview on the API
double: no token, a token without the right, a token with it; answers cached."""

from __future__ import annotations

import http.client
import ssl
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter

from cozyebpf.metrics import MetricsServer
from cozyebpf.metricsauth import KubeAuthorizer, server_context
from cozylab.kubeapi import FakeKubeAPI
from tests.support.clock import FakeClock

READER = "system:serviceaccount:monitoring:prometheus"
TENANT = "system:serviceaccount:tenant-a:default"


@pytest.fixture
def api() -> Iterator[FakeKubeAPI]:
    with FakeKubeAPI() as a:
        a.add_token("reader-token", READER, ("system:serviceaccounts",))
        a.add_token("tenant-token", TENANT)
        a.grant(READER, "/metrics")
        yield a


@pytest.fixture
def served(api: FakeKubeAPI) -> Iterator[tuple[MetricsServer, FakeClock]]:
    registry = CollectorRegistry()
    Counter(
        "cozyebpf_probe", "a metric that names a tenant", ["service"], registry=registry
    ).labels("tenant-a/vm1").inc()
    clock = FakeClock()
    auth = KubeAuthorizer(api.api_client(), clock=clock)
    server = MetricsServer("127.0.0.1:0", registry, server_context("", ["127.0.0.1"]), auth)
    server.start()
    try:
        yield server, clock
    finally:
        server.stop()


def get(server: MetricsServer, token: str | None) -> tuple[int, str]:
    host, port = server.address.rsplit(":", 1)
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # self-signed (a PodMonitor skips verification too)
    conn = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=10)
    try:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        conn.request("GET", "/metrics", headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def reviews(api: FakeKubeAPI) -> int:
    return sum(1 for r in api.requests if r.path.endswith("reviews"))


def test_no_token_is_401_and_the_names_stay_hidden(
    api: FakeKubeAPI, served: tuple[MetricsServer, FakeClock]
) -> None:
    server, _ = served
    code, body = get(server, None)
    assert code == 401 and "tenant-a/vm1" not in body
    code, body = get(server, "not-a-token")
    assert code == 401 and "tenant-a/vm1" not in body and "not valid" in body


def test_a_token_without_the_right_is_403(
    api: FakeKubeAPI, served: tuple[MetricsServer, FakeClock]
) -> None:
    server, _ = served
    code, body = get(server, "tenant-token")
    assert code == 403 and "tenant-a/vm1" not in body
    assert body.strip() == f"{TENANT} may not get /metrics (no ClusterRole grants it)"


def test_a_token_with_the_right_reads_the_metrics_and_the_answer_is_cached(
    api: FakeKubeAPI, served: tuple[MetricsServer, FakeClock]
) -> None:
    server, clock = served
    code, body = get(server, "reader-token")
    assert code == 200 and 'cozyebpf_probe_total{service="tenant-a/vm1"} 1.0' in body
    asked = reviews(api)
    assert asked == 2  # a TokenReview and a SubjectAccessReview
    sar = [r for r in api.requests if r.path.endswith("subjectaccessreviews")]
    assert len(sar) == 1
    for _ in range(3):  # scrapes within the cache's life ask nothing more
        assert get(server, "reader-token")[0] == 200
    assert reviews(api) == asked
    clock.advance(61)  # then the API server is asked again
    assert get(server, "reader-token")[0] == 200
    assert reviews(api) == asked + 2


def test_plain_http_is_refused_by_the_tls_port(served: tuple[MetricsServer, FakeClock]) -> None:
    server, _ = served
    host, port = server.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        with pytest.raises((http.client.HTTPException, OSError)):
            conn.request("GET", "/metrics")
            conn.getresponse()
    finally:
        conn.close()
