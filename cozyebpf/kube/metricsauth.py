"""Metrics only for who may read them (issue 28, item 1).

The metrics name every managed Service with its traffic and drops, and the DaemonSet serves
them on the node's address, which every tenant's VM can reach. So by default they are served
as Kubernetes components and controller-runtime's secure metrics serve theirs:

- over HTTPS, with a certificate from `--metrics-cert-dir` (tls.crt and tls.key, e.g. a
  mounted Secret) or else one generated at start (self-signed, in memory: the root file system
  is read-only; `cozyebpf/tls.py`);
- to a caller whose bearer token a TokenReview authenticates and whose user a
  SubjectAccessReview allows `get` on the non-resource URL `/metrics` (a ClusterRole with
  `nonResourceURLs: ["/metrics"]`); 401 without a valid token, 403 without the right. Answers
  are cached for `CACHE_TTL` seconds per token (a hash of it), so a scrape every 30 s costs the
  API server two requests a minute per node at most.

Anyone who reaches the node's address can send tokens, so what they cost is bounded (issue 37):
the cache keeps the CACHE_MAX tokens used last, denials as well as grants (a flood of unknown
tokens evicts the least recently used, never the whole cache, and Prometheus's token is used at
every scrape); a token the cache does not answer is reviewed only within its source's token
bucket (REVIEW_BURST at once, then one every REVIEW_EVERY seconds; a source is an IPv4 address
or an IPv6 /64), else answered 429 without asking the API server.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cozyebpf.kube.client import KubeRest

log = logging.getLogger(__name__)

TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"
CACHE_TTL = 60.0  # seconds an answer (allowed or not) is kept per token
#: tokens remembered at most; the least recently used goes first (an entry is ~200 bytes)
CACHE_MAX = 1024
#: token reviews one source may cause: REVIEW_BURST at once, then one every REVIEW_EVERY
#: seconds. Prometheus needs one a minute per token (CACHE_TTL), a token rotation one more; a
#: tenant's flood of unknown tokens costs the API server at most 6 TokenReviews a minute per
#: address and node (and no SubjectAccessReview: an unknown token ends at the TokenReview)
REVIEW_BURST = 4
REVIEW_EVERY = 10.0
#: sources whose bucket is kept (the least recently used goes; a source seen again starts
#: with a full bucket, so only more addresses than this would get more than their share)
SOURCES_MAX = 4096


@dataclass
class AuthStats:
    """What the authorizer asked and refused; plain counters, read by the metrics."""

    reviews: int = 0  # TokenReviews asked (a token the cache did not answer)
    limited: int = 0  # tokens answered 429 by their source's rate limit, not reviewed


class TokenBucket:
    """`burst` tokens, one more every `every` seconds (up to `burst`)."""

    __slots__ = ("at", "burst", "every", "tokens")

    def __init__(self, burst: int, every: float, now: float) -> None:
        self.burst, self.every = burst, every
        self.tokens, self.at = float(burst), now

    def take(self, now: float) -> float:
        """0 when a token was taken; else the seconds until one is there."""
        self.tokens = min(float(self.burst), self.tokens + (now - self.at) / self.every)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) * self.every


class KubeAuthorizer:
    """Is a request's `Authorization` header allowed to `get` `path`? Asks the API server
    (TokenReview, then SubjectAccessReview) through the agent's API client, within the rate
    limit of the caller's source; answers cached (least recently used out first)."""

    def __init__(
        self,
        api_client: Any,
        path: str = "/metrics",
        ttl: float = CACHE_TTL,
        clock: Callable[[], float] = time.monotonic,
        timeout: float = 10.0,
        cache_max: int = CACHE_MAX,
    ) -> None:
        self.rest = KubeRest(api_client)
        self.path = path
        self.ttl = ttl
        self.clock = clock
        self.timeout = timeout
        self.cache_max = cache_max
        self.stats = AuthStats()
        #: sha256 of a token -> (expires at, code, why), least recently used first
        self._cache: OrderedDict[bytes, tuple[float, int, str]] = OrderedDict()
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()  # by source
        self._lock = threading.Lock()

    def __call__(self, authorization: str | None, source: str = "") -> tuple[int, str]:
        """(200, "") when allowed; (401 or 403, why) when not; (429, why) when the token is
        not cached and `source` (httpserver.source_key of the caller) has used up its reviews.
        An API error raises (and is not cached): the caller answers 503."""
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return 401, "a bearer token is needed (Authorization: Bearer <token>)"
        key = hashlib.sha256(token.encode()).digest()
        now = self.clock()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] > now:
                self._cache.move_to_end(key)
                return hit[1], hit[2]
            wait = self._bucket(source, now).take(now)
            if wait > 0:
                self.stats.limited += 1
                return 429, (
                    f"too many token reviews for {source or 'this address'}; ask again in "
                    f"{max(1, math.ceil(wait))}s"
                )
            self.stats.reviews += 1
        code, why = self._review(token)
        with self._lock:
            self._cache[key] = (now + self.ttl, code, why)
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_max:
                self._cache.popitem(last=False)
        return code, why

    def cached(self) -> int:
        """Answers in the cache now (some may have expired)."""
        with self._lock:
            return len(self._cache)

    def _bucket(self, source: str, now: float) -> TokenBucket:
        """`source`'s bucket (under the lock)."""
        bucket = self._buckets.get(source)
        if bucket is None:
            bucket = self._buckets[source] = TokenBucket(REVIEW_BURST, REVIEW_EVERY, now)
            while len(self._buckets) > SOURCES_MAX:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(source)
        return bucket

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        answer = self.rest.json(
            "POST", path, body=body, content_type="application/json", timeout=self.timeout
        )
        return answer if isinstance(answer, dict) else {}

    def _review(self, token: str) -> tuple[int, str]:
        review = self._post(
            TOKEN_REVIEWS,
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenReview",
                "spec": {"token": token},
            },
        )
        status = review.get("status") or {}
        user = status.get("user") or {}
        if not status.get("authenticated") or not user.get("username"):
            return 401, "the token is not valid"
        spec: dict[str, Any] = {
            "user": user["username"],
            "nonResourceAttributes": {"path": self.path, "verb": "get"},
        }
        for field in ("uid", "groups", "extra"):
            if user.get(field):
                spec[field] = user[field]
        access = self._post(
            ACCESS_REVIEWS,
            {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SubjectAccessReview",
                "spec": spec,
            },
        )
        if (access.get("status") or {}).get("allowed"):
            return 200, ""
        return 403, f"{user['username']} may not get {self.path} (no ClusterRole grants it)"
