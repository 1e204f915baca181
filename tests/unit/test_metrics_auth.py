"""Metrics only for who may read them (issue 28, item 1): HTTPS with a generated certificate,
and the caller's bearer token checked with a TokenReview and a SubjectAccessReview on the API
double: no token, a token without the right, a token with it; answers cached. What a flood of
tokens costs (issue 37, item 4): reviews within a rate limit per source, a cache that keeps
what was used last (denials too) and drops nothing else."""

from __future__ import annotations

import http.client
import ssl
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter

from cozyebpf.kube.metricsauth import (
    CACHE_TTL,
    REVIEW_BURST,
    REVIEW_EVERY,
    AuthStats,
    KubeAuthorizer,
)
from cozyebpf.metrics import MetricsServer
from cozyebpf.tls import server_context
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


def token_reviews(api: FakeKubeAPI) -> int:
    return sum(1 for r in api.requests if r.path.endswith("/tokenreviews"))


def access_reviews(api: FakeKubeAPI) -> int:
    return sum(1 for r in api.requests if r.path.endswith("/subjectaccessreviews"))


TENANT_VM = "198.51.100.2"
PROMETHEUS = "10.244.1.20"


def test_unknown_tokens_are_reviewed_within_their_sources_rate_limit(api: FakeKubeAPI) -> None:
    """100 unknown tokens from one source: REVIEW_BURST TokenReviews, then one every
    REVIEW_EVERY seconds; the others are answered 429 without asking the API server. Another
    source (Prometheus) has its own bucket; a token already answered comes from the cache."""
    clock = FakeClock()
    auth = KubeAuthorizer(api.api_client(), clock=clock)
    codes = [auth(f"Bearer unknown-{i}", TENANT_VM)[0] for i in range(100)]
    assert codes == [401] * REVIEW_BURST + [429] * (100 - REVIEW_BURST)
    assert token_reviews(api) == REVIEW_BURST
    assert auth("Bearer unknown-100", TENANT_VM) == (
        429,
        f"too many token reviews for {TENANT_VM}; ask again in {REVIEW_EVERY:.0f}s",
    )
    assert auth("Bearer reader-token", PROMETHEUS) == (200, "")
    clock.advance(REVIEW_EVERY / 2)
    assert auth("Bearer more-0", TENANT_VM) == (
        429,
        f"too many token reviews for {TENANT_VM}; ask again in {REVIEW_EVERY / 2:.0f}s",
    )
    clock.advance(REVIEW_EVERY / 2)  # one more review
    assert [auth(f"Bearer more-{i}", TENANT_VM)[0] for i in range(1, 4)] == [401, 429, 429]
    assert auth("Bearer unknown-0", TENANT_VM)[0] == 401  # cached: neither asked nor limited
    assert token_reviews(api) == REVIEW_BURST + 2  # the tenant's and Prometheus's
    assert auth.stats == AuthStats(reviews=REVIEW_BURST + 2, limited=100 - REVIEW_BURST + 4)


def test_the_cache_keeps_what_was_used_last_denials_too(api: FakeKubeAPI) -> None:
    """A flood of unknown tokens (from many sources: no rate limit to hide behind) evicts the
    least recently used answers, never Prometheus's, which each scrape uses; denials are kept
    for their TTL like grants (before issue 37 the whole cache was dropped at 1,024 tokens)."""
    clock = FakeClock()
    auth = KubeAuthorizer(api.api_client(), clock=clock, cache_max=8)
    assert auth("Bearer reader-token", PROMETHEUS) == (200, "")
    for i in range(100):
        assert auth(f"Bearer unknown-{i}", f"198.51.100.{i + 1}")[0] == 401
        if i % 5 == 4:  # a scrape
            assert auth("Bearer reader-token", PROMETHEUS) == (200, "")
    assert access_reviews(api) == 1 and token_reviews(api) == 101
    assert auth.cached() == 8
    assert auth("Bearer unknown-99", TENANT_VM)[0] == 401  # a denial kept: not asked again
    assert token_reviews(api) == 101
    assert auth("Bearer unknown-0", TENANT_VM)[0] == 401  # the least recently used: it went
    assert token_reviews(api) == 102
    clock.advance(CACHE_TTL)  # the TTL: grants and denials are asked again
    assert auth("Bearer reader-token", PROMETHEUS) == (200, "")
    assert auth("Bearer unknown-99", "198.51.100.200")[0] == 401
    assert access_reviews(api) == 2 and token_reviews(api) == 104


def test_a_rate_limited_caller_gets_429_and_the_metrics_count_it(
    api: FakeKubeAPI, served: tuple[MetricsServer, FakeClock]
) -> None:
    """Over HTTPS from one address: Prometheus's token (cached), then a burst of unknown
    tokens: reviewed up to the bucket, then 429 with when to ask again; Prometheus's next
    scrapes from that same address are answered from the cache, and count what was refused."""
    server, _ = served
    assert get(server, "reader-token")[0] == 200  # one review of the bucket
    codes = [get(server, f"unknown-{i}")[0] for i in range(REVIEW_BURST + 5)]
    assert codes == [401] * (REVIEW_BURST - 1) + [429] * 6
    code, body = get(server, "one-more")
    assert (code, body) == (429, "too many token reviews for 127.0.0.1; ask again in 10s\n")
    code, body = get(server, "reader-token")
    assert code == 200
    assert "cozyebpf_metrics_token_reviews_total 4.0" in body.splitlines()
    assert "cozyebpf_metrics_token_reviews_limited_total 7.0" in body.splitlines()
    assert 'cozyebpf_metrics_connections_refused_total{reason="source"} 0.0' in body
    assert token_reviews(api) == REVIEW_BURST
