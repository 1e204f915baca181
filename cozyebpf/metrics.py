"""Prometheus metrics: `cozyebpf run --metrics-address HOST:PORT` serves /metrics.

Datapath figures are read from the pinned maps when Prometheus scrapes (a custom collector, as
Cilium's agent and the Prometheus exporter guidelines do), never mirrored in Python counters:
the per-Service counters (svcstats, named by svcnames), the node-wide counters of `maps dump`,
the maps' fill and the monitor's losses. The control plane's own figures (sync durations,
network programming latency, errors) are observed by the agent loop as it works
(`Agent.on_sync`) and the Services and problems are read from the model at scrape time.

A Service that is not managed never appears (only slots named for a managed Service are
read), a removed Service's series are gone from the next scrape (its slot is no longer active),
and no label carries a client's address.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import ssl
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from cozyebpf import __version__
from cozyebpf.datapath.layout import LAYOUT_VERSION
from cozyebpf.datapath.maps import PinnedMaps
from cozyebpf.datapath.reasons import EVENT_REASONS, REASONS
from cozyebpf.errors import CozyError
from cozyebpf.httpserver import DEFAULT_LIMITS, Handler, HttpServer, Limits, ServerStats
from cozyebpf.kube.metricsauth import AuthStats
from cozyebpf.memlimit import CgroupMemory, rss
from cozyebpf.model.compose import REFUSAL_HARM
from cozyebpf.status import read_model

if TYPE_CHECKING:
    from cozyebpf.agent import Agent, SyncReport
    from cozyebpf.model import Problem, ServiceView

log = logging.getLogger(__name__)

#: seconds; from 0.5 ms (a change written at once) to a full resync of a large cluster
SYNC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
#: from 0.5 ms to kube-proxy's 5 minutes (its SLI's largest bucket)
PROGRAMMING_BUCKETS = (*SYNC_BUCKETS, 60, 120, 300)


class DatapathCollector(Collector):
    """Reads the pins at every scrape (its own descriptors, opened for the scrape: the agent
    may replace maps while it upgrades them)."""

    def __init__(self, pin_dir: str) -> None:
        self.pin_dir = pin_dir

    def collect(self) -> Iterator[Metric]:
        try:
            maps = PinnedMaps.open(self.pin_dir)
        except CozyError as e:
            log.debug("metrics: no maps to read: %s", e)
            return
        with maps:
            yield from self._services(maps)
            yield from self._datapath(maps)
            yield from self._maps(maps)
            yield from self._monitor(maps)

    def _services(self, maps: PinnedMaps) -> Iterator[Metric]:
        packets = CounterMetricFamily(
            "cozyebpf_service_packets",
            "Packets accepted for the Service (translated, or passed by its port filter), each "
            "counted once, by direction.",
            labels=["namespace", "service", "direction"],
        )
        nbytes = CounterMetricFamily(
            "cozyebpf_service_bytes",
            "Bytes (whole frames) of the packets counted in cozyebpf_service_packets_total.",
            labels=["namespace", "service", "direction"],
        )
        drops = CounterMetricFamily(
            "cozyebpf_service_drops",
            "Packets dropped for the Service, by reason (the names of `cozyebpf maps dump`); "
            "a reason appears once it has counted a packet.",
            labels=["namespace", "service", "reason"],
        )
        for c in maps.service_counters():
            ns, name = c.namespace, c.name
            packets.add_metric([ns, name, "ingress"], c.in_packets)
            packets.add_metric([ns, name, "egress"], c.out_packets)
            nbytes.add_metric([ns, name, "ingress"], c.in_bytes)
            nbytes.add_metric([ns, name, "egress"], c.out_bytes)
            for reason, n in c.drops.items():
                if n:
                    drops.add_metric([ns, name, reason], n)
        yield from (packets, nbytes, drops)

    def _datapath(self, maps: PinnedMaps) -> Iterator[Metric]:
        packets = CounterMetricFamily(
            "cozyebpf_datapath_packets",
            "Packets for managed addresses on this node, by reason (every packet once; "
            "flow_new and flow_error count flow-table insertions, not packets).",
            labels=["reason"],
        )
        nbytes = CounterMetricFamily(
            "cozyebpf_datapath_bytes",
            "Bytes of the packets in cozyebpf_datapath_packets_total, by reason.",
            labels=["reason"],
        )
        counters = maps.counters()
        for reason in REASONS:
            c = counters.get(reason, {"packets": 0, "bytes": 0})
            packets.add_metric([reason], c["packets"])
            if reason not in EVENT_REASONS:
                nbytes.add_metric([reason], c["bytes"])
        yield from (packets, nbytes)

    def _maps(self, maps: PinnedMaps) -> Iterator[Metric]:
        entries = GaugeMetricFamily(
            "cozyebpf_map_entries", "Entries in a pinned map.", labels=["map"]
        )
        capacity = GaugeMetricFamily(
            "cozyebpf_map_capacity", "Entries a pinned map can hold.", labels=["map"]
        )
        for name, (n, size) in maps.entries().items():
            entries.add_metric([name], n)
            capacity.add_metric([name], size)
        yield from (entries, capacity)

    def _monitor(self, maps: PinnedMaps) -> Iterator[Metric]:
        st = maps.monitor_state()
        yield CounterMetricFamily(
            "cozyebpf_monitor_events_lost",
            "Events of `cozyebpf monitor` lost to its rate limit or to a full ring buffer.",
            value=st.lost_limit + st.lost_full,
        )


class AgentCollector(Collector):
    """The control plane's state at scrape time: Services by mode, problems by severity, the
    last successful write, the version."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        agent = self.agent
        views: list[ServiceView] = read_model(agent.model.views)
        problems: list[Problem] = read_model(agent.problems)
        services = GaugeMetricFamily(
            "cozyebpf_services", "Services cozyebpf manages, by mode.", labels=["mode"]
        )
        modes = {"whole-ip": 0, "port-filter": 0}
        for v in views:
            modes["port-filter" if v.port_filter else "whole-ip"] += 1
        for mode, n in modes.items():
            services.add_metric([mode], n)
        yield services
        yield from self._refused(views)
        by_severity = GaugeMetricFamily(
            "cozyebpf_problems",
            "Open problems with Services (logged, and Events on the Services), by severity.",
            labels=["severity"],
        )
        counts = {"warning": 0, "error": 0}
        for p in problems:
            counts[p.severity] = counts.get(p.severity, 0) + 1
        for severity, n in counts.items():
            by_severity.add_metric([severity], n)
        yield by_severity
        st = agent.stats
        yield CounterMetricFamily(
            "cozyebpf_sync_errors",
            "Writes to the maps that failed (a full resync follows).",
            value=st.sync_errors,
        )
        last = GaugeMetricFamily(
            "cozyebpf_last_sync_timestamp_seconds",
            "When the last successful write to the maps ended (Unix time).",
        )
        if st.last_sync is not None:
            last.add_metric([], st.last_sync)
        yield last
        info = GaugeMetricFamily(
            "cozyebpf_build_info",
            "The running cozyebpf's version and the map layout it writes.",
            labels=["version", "layout"],
        )
        info.add_metric([__version__, str(LAYOUT_VERSION)], 1)
        yield info
        yield from self._memory()

    def _memory(self) -> Iterator[Metric]:
        """The agent's memory against its limit (memlimit.py), read now: its cgroup's working
        set (the process's RSS where no cgroup is readable), and the limit (0: none)."""
        watch = self.agent.memory
        m = (watch.cgroup if watch is not None else CgroupMemory()).read()
        yield GaugeMetricFamily(
            "cozyebpf_agent_memory_bytes",
            "The agent's memory: its cgroup's working set (usage minus inactive file pages, "
            "what the limit is held against), or its RSS where no cgroup is readable.",
            value=m.used if m is not None else rss(),
        )
        yield GaugeMetricFamily(
            "cozyebpf_agent_memory_limit_bytes",
            "The memory limit of the agent's cgroup (0: none). Above 85 % of it the agent "
            "warns (an Event on its Node).",
            value=(m.limit or 0) if m is not None else 0,
        )

    @staticmethod
    def _refused(views: list[ServiceView]) -> Iterator[Metric]:
        """The Services refused because an LB IP of theirs is an address in use (issue 31), by
        what the address is: every reason always present (0 on a healthy node: alert on any
        other value); the Services and addresses are in `status` and their Events (no label
        holds an address)."""
        refused = GaugeMetricFamily(
            "cozyebpf_services_refused",
            "Services not programmed at all because an LB IP of theirs is an address already in "
            "use, by what it is (a Service with two such LB IPs counts under both reasons).",
            labels=["reason"],
        )
        counts = dict.fromkeys(REFUSAL_HARM, 0)
        for v in views:
            for kind in {r.kind for r in v.refused}:
                counts[kind] += 1
        for kind, n in counts.items():
            refused.add_metric([kind], n)
        yield refused


class SyncObserver:
    """The histograms of the agent's writes, fed by Agent.on_sync."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.duration = Histogram(
            "cozyebpf_sync_duration_seconds",
            "How long a write to the maps took (model, diff and maps): kind full is the full "
            "resync, change one change (or several that arrived together).",
            ["kind"],
            buckets=SYNC_BUCKETS,
            registry=registry,
        )
        self.programming = Histogram(
            "cozyebpf_network_programming_duration_seconds",
            "From a change (its EndpointSlice's endpoints.kubernetes.io/"
            "last-change-trigger-time, or when it was received) to the end of the write that "
            "programmed it (kube-proxy's network programming SLI); one per object and write, "
            "its oldest change.",
            buckets=PROGRAMMING_BUCKETS,
            registry=registry,
        )

    def __call__(self, report: SyncReport) -> None:
        if report.ok:
            self.duration.labels(report.kind).observe(report.duration)
        for latency in report.latencies:
            self.programming.observe(latency)


def registry_for(pin_dir: str, agent: Agent | None = None) -> CollectorRegistry:
    """Every metric of this node: the datapath's from the pins, and the agent's."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    registry.register(DatapathCollector(pin_dir))
    if agent is not None:
        registry.register(AgentCollector(agent))
        agent.on_sync.append(SyncObserver(registry))
    return registry


def _trim() -> None:
    """Give the memory of a large scrape (megabytes of samples and text at 10k Services) back
    to the system: glibc keeps freed memory otherwise (the agent's RSS is a target)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


class ServerCollector(Collector):
    """What the metrics server refused (httpserver.ServerStats) and its token check asked and
    refused (kube.metricsauth.AuthStats), read at each scrape."""

    def __init__(self, server: ServerStats, auth: AuthStats | None) -> None:
        self.server = server
        self.auth = auth

    def collect(self) -> Iterator[Metric]:
        refused = CounterMetricFamily(
            "cozyebpf_metrics_connections_refused",
            "Connections to the metrics server closed as they came: `source`, their source "
            "(an IPv4 address or IPv6 /64) held its cap; `full`, the server held its cap.",
            labels=["reason"],
        )
        for reason, n in self.server.refused.items():
            refused.add_metric([reason], n)
        cut = CounterMetricFamily(
            "cozyebpf_metrics_connections_cut",
            "Connections to the metrics server closed before their answer: `slow`, the request "
            "or the answer outlived its deadline; `displaced`, cut before their request for a "
            "newcomer (from a source that held fewer, from an address an authorised scrape "
            "came from, or any once they waited longer than a second).",
            labels=["reason"],
        )
        for reason, n in self.server.cut.items():
            cut.add_metric([reason], n)
        yield from (refused, cut)
        auth = self.auth or AuthStats()  # none without a token check (--metrics-auth none)
        yield CounterMetricFamily(
            "cozyebpf_metrics_token_reviews",
            "TokenReviews asked for callers' tokens that the cache did not answer.",
            value=auth.reviews,
        )
        yield CounterMetricFamily(
            "cozyebpf_metrics_token_reviews_limited",
            "Callers' tokens answered 429, not reviewed: their source's rate limit was used up.",
            value=auth.limited,
        )


class MetricsServer(HttpServer):
    """/metrics (Prometheus text format), in a thread of its own: over HTTPS with `tls`, to
    callers that `authorize` allows (cozyebpf/kube/metricsauth.py), or plain HTTP to anyone. What
    the server refused joins `registry` (ServerCollector)."""

    def __init__(
        self,
        address: str,
        registry: CollectorRegistry,
        tls: ssl.SSLContext | None = None,
        authorize: Callable[[str | None, str], tuple[int, str]] | None = None,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        class MetricsHandler(Handler):
            log_name = "metrics"

            def do_GET(self) -> None:
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "see /metrics")
                    return
                if authorize is not None:
                    if not self._allowed():
                        return
                    self.trusted()  # its address keeps a place in a full server
                try:
                    body = generate_latest(registry)
                except Exception as e:  # a failed scrape must not kill the server
                    log.error("metrics: scrape failed: %s", e)
                    self.send_error(500, str(e))
                    return
                self.send_body(200, body, CONTENT_TYPE_LATEST)
                del body
                _trim()

            def _allowed(self) -> bool:
                assert authorize is not None
                try:
                    code, why = authorize(self.headers.get("Authorization"), self.source)
                except Exception as e:  # the API server: not cached, the next scrape asks again
                    log.warning("metrics: cannot check a caller's token: %s", e)
                    self.send_error(503, "cannot check the token now")
                    return False
                if code == 200:
                    return True
                log.debug("metrics: %s from %s: %s", code, self.client_address[0], why)
                challenge = {"WWW-Authenticate": 'Bearer realm="cozyebpf metrics"'}
                self.send_body(
                    code,
                    f"{why}\n".encode(),
                    "text/plain; charset=utf-8",
                    challenge if code == 401 else None,
                )
                return False

        super().__init__(
            "metrics",
            address,
            MetricsHandler,
            option="--metrics-address",
            example="0.0.0.0:9811",
            tls=tls,
            paths="/metrics",
            limits=limits,
        )
        registry.register(ServerCollector(self.stats, getattr(authorize, "stats", None)))
