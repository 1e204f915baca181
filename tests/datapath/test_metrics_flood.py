"""The metrics server holds a flood (issue 37, item 4), as the chart runs it: a real agent in the
lab's node namespace, its Services from the API server double (which records every request),
its metrics over HTTPS with the token check, on every address of both families (`[::]:19811`).

From the tenant's namespace (the lab's client, a VM that reaches the node's addresses):
10,000 requests with unknown bearer tokens over IPv4, and meanwhile a swarm of slow clients
over IPv6 (its own source: an IPv6 /64) that connect and send nothing, drip a TLS ClientHello a
byte a second, or finish the handshake and drip the request a byte a second. From a pod (the
Prometheus), scrapes with an allowed token, back to back, all along.

What must hold: every scrape is answered 200; the API double sees no more TokenReviews than
the rate limit allows for the time the flood took (REVIEW_BURST, then one every REVIEW_EVERY
seconds, and Prometheus's own); the agent's threads stay within what the caps allow (counted
in /proc, sampled all along; no time is asserted) and its memory grows by little; every one of
the 10,000 requests is answered (401 reviewed or 429 limited), and the metrics count exactly the
429s; the slow clients are cut (counted); once the swarm stops, the threads are back. The agent
logs no ERROR.

Many tenant addresses at once (issue 45, item 9): 64 addresses of the tenant's namespace, each
holding one silent connection, against Prometheus's scrapes.

What it leaves out: the kernel's side of a flood (SYN floods, conntrack: the node's, not the
agent's); the API server is the double, not a real kube-apiserver (what a flood costs the real
one: test_kube_e2e.py, its flood test)."""

from __future__ import annotations

import collections
import contextlib
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cozyebpf.httpserver import MAX_PER_SOURCE
from cozyebpf.kube.metricsauth import CACHE_TTL, REVIEW_BURST, REVIEW_EVERY
from cozylab.k8s import Svc, objects
from cozylab.kubeapi import FakeKubeAPI
from cozylab.netns import DEFAULT_PODS, NODE_UPLINK_IP, NODE_UPLINK_IP6
from tests.support.https import CTX, https_get
from tests.support.labtools import AgentLab, agent_lab, wait_for
from tests.support.packets import LB_WHOLE

POD1, PROMETHEUS_POD = DEFAULT_PODS[:2]
WHOLE = Svc("vm1", LB_WHOLE, POD1.ip, [("TCP", 22)], whole_ip="true")
READER = "system:serviceaccount:monitoring:prometheus"
PORT = 19811
V4, V6 = (NODE_UPLINK_IP, PORT), (NODE_UPLINK_IP6, PORT)
TOKENS = 10_000
FLOOD_WORKERS = 6  # within MAX_PER_SOURCE: the flood's requests are answered, not refused
SWARM_EACH = 16  # slow clients of each kind: 48 from one source, six times its cap
#: the agent's threads beyond its own: the flood's source and the swarm's at their caps; a
#: flood worker's last connection, whose thread may still be ending when its next one is
#: admitted (its answer's end reached the client before the thread let go of its slot); and
#: Prometheus's scrape, with its last one ending
THREADS_MORE = 2 * MAX_PER_SOURCE + FLOOD_WORKERS + 2
RSS_MORE = 20 << 20  # bytes: a connection costs tens of kB (OpenSSL's buffers, a stack)


def proc_figures(pid: int) -> tuple[int, int]:
    """(threads, resident bytes) of process `pid`."""
    threads = len(os.listdir(f"/proc/{pid}/task"))
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return threads, rss * 1024


@pytest.fixture
def env(tmp_path: Path, cozyebpf_cmd: list[str]) -> Iterator[tuple[AgentLab, FakeKubeAPI]]:
    with agent_lab("mf", tmp_path, cozyebpf_cmd, DEFAULT_PODS[:2]) as env:
        api = FakeKubeAPI(bookmark_interval=0.5)
        env.lab.in_ns(env.lab.node, api.start)  # the server socket lives in the node namespace
        env.source_args = [
            "--kubeconfig",
            str(api.kubeconfig(tmp_path / "kubeconfig")),
            "--node-name",
            "node-a",
        ]
        try:
            yield env, api
        finally:
            api.stop()


class Loop:
    """`fn` again and again in `n` threads inside namespace `ns`, until stop()."""

    def __init__(self, env: AgentLab, ns: str, fn: Callable[[threading.Event], None], n: int):
        self.halt = threading.Event()
        self.threads = [
            threading.Thread(target=env.lab.in_ns, args=(ns, self._run(fn)), daemon=True)
            for _ in range(n)
        ]
        for t in self.threads:
            t.start()

    def _run(self, fn: Callable[[threading.Event], None]) -> Callable[[], None]:
        def loop() -> None:
            while not self.halt.is_set():
                fn(self.halt)

        return loop

    def stop(self) -> None:
        self.halt.set()
        for t in self.threads:
            t.join(60)


def silent(halt: threading.Event) -> None:
    """Connect and send nothing until the server closes."""
    try:
        with socket.create_connection(V6, timeout=10) as s:
            while not halt.is_set():
                if select.select([s], [], [], 0.5)[0]:
                    s.recv(1)  # EOF or a reset: the server closed
                    break
    except OSError:
        pass
    halt.wait(0.2)


def drip(s: socket.socket, data: bytes, halt: threading.Event) -> None:
    """`data` a byte a second until the server closes `s`."""
    for byte in data:
        if halt.is_set() or select.select([s], [], [], 1.0)[0]:
            return
        s.send(bytes([byte]))


def client_hello() -> bytes:
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = CTX.wrap_bio(incoming, outgoing)
    with contextlib.suppress(ssl.SSLWantReadError):  # it waits for the ServerHello
        tls.do_handshake()
    return outgoing.read()


HELLO = client_hello()


def slow_hello(halt: threading.Event) -> None:
    """A TLS ClientHello, a byte a second."""
    try:
        with socket.create_connection(V6, timeout=10) as s:
            drip(s, HELLO, halt)
    except OSError:
        pass
    halt.wait(0.2)


def slow_request(halt: threading.Event) -> None:
    """The TLS handshake, then the request a byte a second."""
    try:
        with socket.create_connection(V6, timeout=10) as raw, CTX.wrap_socket(raw) as s:
            drip(s, b"GET /metrics HTTP/1.0\r\nAuthorization: Bearer slow\r\n\r\n", halt)
    except (OSError, ssl.SSLError):
        pass
    halt.wait(0.2)


def token_reviews(api: FakeKubeAPI) -> int:
    return sum(1 for r in api.requests if r.path.endswith("/tokenreviews"))


def metric(body: str, name: str) -> float:
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in the scrape")


def test_the_metrics_server_holds_a_flood_of_tokens_and_slow_clients(
    env: tuple[AgentLab, FakeKubeAPI],
) -> None:
    agent, api = env
    lab = agent.lab
    api.add_token("reader", READER)
    api.grant(READER, "/metrics")
    for o in objects(WHOLE):
        api.apply(o)
    agent.start_agent("--metrics-address", f"[::]:{PORT}", "--metrics-auth", "kubernetes")
    assert agent.proc is not None
    pid = agent.proc.pid  # nsenter execs the agent: the same process
    offset = len(agent.log())
    wait_for(lambda: {str(lb) for lb in agent.maps_state().services} == {LB_WHOLE}, 10, "vm1")

    def scrape() -> tuple[int, str] | None:
        return lab.in_ns(lab.pod_ns(PROMETHEUS_POD), lambda: https_get(V4, "reader"))

    for _ in range(3):  # Prometheus's token reviewed and cached; the server warmed up
        got = scrape()
        assert got is not None and got[0] == 200 and 'service="vm1"' in got[1], got
    base_threads, base_rss = proc_figures(pid)
    reviews_before = token_reviews(api)
    peak = [base_threads, base_rss]
    scrapes: list[int | None] = []

    def sample(halt: threading.Event) -> None:
        threads, rss = proc_figures(pid)
        peak[0], peak[1] = max(peak[0], threads), max(peak[1], rss)
        halt.wait(0.05)

    def prometheus(halt: threading.Event) -> None:
        got = https_get(V4, "reader")
        scrapes.append(None if got is None else got[0])
        halt.wait(0.2)

    codes: collections.Counter[int] = collections.Counter()
    todo = iter(range(TOKENS))
    lock = threading.Lock()

    def flood(halt: threading.Event) -> None:
        with lock:
            i = next(todo, None)
        if i is None:
            halt.set()
            return
        for _ in range(100):  # a connection refused at the cap: sent again
            got = https_get(V4, f"unknown-{i}")
            if got is not None:
                with lock:
                    codes[got[0]] += 1
                return
        raise AssertionError(f"unknown-{i} was refused 100 times")

    sampler = Loop(agent, lab.node, sample, 1)
    scraper = Loop(agent, lab.pod_ns(PROMETHEUS_POD), prometheus, 1)
    swarm = [Loop(agent, lab.client, fn, SWARM_EACH) for fn in (silent, slow_hello, slow_request)]
    try:
        t0 = time.monotonic()
        flooder = Loop(agent, lab.client, flood, FLOOD_WORKERS)
        for t in flooder.threads:
            t.join()
        flood_s = time.monotonic() - t0

        def cut_slow() -> bool:
            got = scrape()
            scrapes.append(None if got is None else got[0])
            if got is None or got[0] != 200:
                return False
            return metric(got[1], 'cozyebpf_metrics_connections_cut_total{reason="slow"}') > 0

        # the swarm's first connections outlive their 10 s deadline (a bound for a hang)
        wait_for(cut_slow, 60, "a slow client cut")
    finally:
        for loop in swarm:
            loop.stop()
        scraper.stop()
    elapsed = time.monotonic() - t0
    wait_for(  # the swarm gone: its threads too
        lambda: proc_figures(pid)[0] <= base_threads, 30, "the agent's threads back"
    )
    sampler.stop()
    log = agent.log()[offset:]

    # every request of the flood was answered: reviewed (401) or rate-limited (429)
    assert sum(codes.values()) == TOKENS and set(codes) <= {401, 429}, codes
    # the API server saw no more TokenReviews than the limit allows over the time it took
    flood_reviews = REVIEW_BURST + int(elapsed / REVIEW_EVERY) + 1
    prometheus_reviews = int(elapsed / CACHE_TTL) + 1
    asked = token_reviews(api) - reviews_before
    assert codes[401] <= flood_reviews and asked <= flood_reviews + prometheus_reviews, (
        codes,
        asked,
        elapsed,
    )
    # Prometheus was answered throughout
    assert scrapes and all(code == 200 for code in scrapes), collections.Counter(scrapes)
    got = scrape()
    assert got is not None and got[0] == 200
    assert metric(got[1], "cozyebpf_metrics_token_reviews_limited_total") == codes[429]
    assert metric(got[1], 'cozyebpf_metrics_connections_refused_total{reason="source"}') > 0
    # the agent's threads and memory stayed bounded
    assert peak[0] - base_threads <= THREADS_MORE, (peak, base_threads)
    assert peak[1] - base_rss <= RSS_MORE, (peak, base_rss)
    assert [line for line in log.splitlines() if " ERROR " in line] == [], log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    print(
        f"\n{TOKENS} unknown tokens in {flood_s:.1f}s: {dict(codes)}, {asked} TokenReviews; "
        f"{len(scrapes)} scrapes, all 200; threads {base_threads} -> peak {peak[0]}; RSS "
        f"{base_rss >> 20} -> peak {peak[1] >> 20} MiB"
    )


#: the tenant's addresses that each hold one silent connection (issue 45, item 9): as many as
#: the server holds connections, one per source
IDLE_SOURCES = [f"198.51.100.{100 + i}" for i in range(64)]


class Holders:
    """One connection from each of `sources` (addresses of namespace `ns`) to `address`, each
    sending nothing and opened again as soon as the server closes it (an attacker's loop)."""

    def __init__(self, agent: AgentLab, ns: str, sources: list[str], address: tuple[str, int]):
        self.agent, self.ns, self.address = agent, ns, address
        self.halt = threading.Event()
        self.live: dict[str, float] = {}  # source -> when its connection was opened
        self.opened = collections.Counter[str]()
        self.lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._hold, args=(a,), daemon=True) for a in sources
        ]
        for t in self.threads:
            t.start()

    def _hold(self, source: str) -> None:
        while not self.halt.is_set():
            try:
                s = self.agent.lab.ns_socket(self.ns, socket.AF_INET, socket.SOCK_STREAM)
                with s:
                    s.settimeout(10)
                    s.bind((source, 0))
                    s.connect(self.address)
                    with self.lock:
                        self.live[source] = time.monotonic()
                        self.opened[source] += 1
                    while not self.halt.is_set() and not select.select([s], [], [], 0.1)[0]:
                        pass
            except OSError:
                pass
            finally:
                with self.lock:
                    self.live.pop(source, None)
            self.halt.wait(0.01)

    def settled(self, seconds: float = 0.5) -> bool:
        """Every source holds a connection that the server kept for `seconds`: a connection
        the server refuses as full is closed at once, and its holder sees the close within
        0.1 s, so a connection only just opened may not be held by the server yet."""
        now = time.monotonic()
        with self.lock:
            return len(self.live) == len(self.threads) and all(
                now - t >= seconds for t in self.live.values()
            )

    def stop(self) -> None:
        self.halt.set()
        for t in self.threads:
            t.join(30)


def test_an_authorised_scraper_gets_its_scrapes_past_64_idle_sources(
    env: tuple[AgentLab, FakeKubeAPI],
) -> None:
    """Issue 45, item 9, as the chart runs it: 64 addresses of the tenant's namespace (added to
    its eth0), each holding one silent connection to the node's metrics port and opening it
    again whenever it is closed, fill the agent's server (64 connections, one per source: the
    per-source cap stops none of them). Before, the server answered "full" to everyone else:
    Prometheus, whose token was allowed a moment before, got no scrape. Now its address keeps a
    place: every scrape is answered 200, each by taking the place of a silent connection, which
    the metrics count (`displaced`)."""
    agent, api = env
    lab = agent.lab
    api.add_token("reader", READER)
    api.grant(READER, "/metrics")
    for o in objects(WHOLE):
        api.apply(o)
    agent.start_agent("--metrics-address", f"[::]:{PORT}", "--metrics-auth", "kubernetes")
    wait_for(lambda: {str(lb) for lb in agent.maps_state().services} == {LB_WHOLE}, 10, "vm1")

    def scrape() -> tuple[int, str] | None:
        return lab.in_ns(lab.pod_ns(PROMETHEUS_POD), lambda: https_get(V4, "reader"))

    first = scrape()
    assert first is not None and first[0] == 200, first
    lab.exec(
        lab.client,
        *("ip", "-batch", "-"),
        input="".join(f"addr add {a}/24 dev eth0\n" for a in IDLE_SOURCES),
    )
    holders = Holders(agent, lab.client, IDLE_SOURCES, V4)
    codes: list[int | None] = []
    try:
        for _ in range(10):
            wait_for(holders.settled, 30, "64 silent connections that the server holds")
            got = scrape()
            codes.append(None if got is None else got[0])
        assert codes == [200] * 10, codes
        got = scrape()
        assert got is not None and got[0] == 200
        displaced = metric(got[1], 'cozyebpf_metrics_connections_cut_total{reason="displaced"}')
        assert displaced >= 10, got[1][-2000:]
    finally:
        holders.stop()
    log = agent.log()
    assert [line for line in log.splitlines() if " ERROR " in line] == [], log[-3000:]
    print(f"\n10 scrapes past {len(IDLE_SOURCES)} silent sources: {codes}; displaced {displaced}")
