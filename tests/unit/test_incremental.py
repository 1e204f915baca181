"""The incremental model against the full one: after every step of random histories (Services
and EndpointSlices added, changed and deleted; LB IP conflicts and pods shared between
Services; endpoints becoming ready or not; families changing; bad fields; a capacity too small
for everything; Nodes and this node's addresses coming and going under programmed LB IPs),
IncrementalModel gives exactly what build_state gives on the same objects, and each flush's
MapDiff turns the previous desired state into the new one."""

from __future__ import annotations

import copy
import os
from ipaddress import ip_address, ip_network
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from cozyebpf.model import (
    ANN_ALLOW_ICMP,
    ANN_SOURCE_RANGES,
    ANN_WHOLE_IP,
    DEFAULT_PROXY_NAME,
    LABEL_PROXY_NAME,
    LABEL_SERVICE_NAME,
    IncrementalModel,
    ModelResult,
    Problem,
    build_state,
    read_objects,
)
from cozyebpf.model.limits import (
    ANN_EGRESS_BANDWIDTH,
    ANN_INGRESS_BANDWIDTH,
    ANN_INGRESS_PACKET_RATE,
)
from cozyebpf.state import Capacity, MapLimit, MapState, apply_to

Obj = dict[str, Any]

NAMESPACES = ("default", "tenant")
NAMES = ("vm0", "vm1", "vm2", "vm3")
SLICE_NAMES = ("s0", "s1", "s2", "s3", "s4")
# few addresses, so that Services collide on LB IPs and share pods
LB_IPS = (
    "192.0.2.1",
    "192.0.2.2",
    "192.0.2.3",
    "2001:db8::1",
    "2001:db8::2",
    "010.0.0.1",
    "169.254.1.1",  # link-local: always refused
    "10.244.0.2",  # a pod IP too: refused while a Service has chosen that pod
    "198.51.100.9",  # in RESERVED_CIDRS
)
#: the addresses Nodes and this node may have: some are LB IPs above
NODE_IPS = ("192.0.2.1", "192.0.2.2", "2001:db8::1", "198.51.100.1", "10.244.0.1")
NODE_NAMES = ("node1", "node2")
RESERVED_CIDRS = (ip_network("198.51.100.0/24"),)
POD_IPS = ("10.244.0.1", "10.244.0.2", "10.244.0.3", "fd00::1", "fd00::2", "nonsense")
TIMES = (None, "2024-01-01T00:00:00Z", "2024-06-01T00:00:00Z", "2025-01-01T00:00:00Z", "never")
FLAGS = (None, "true", "false", "True", True)
RANGES = (
    None,
    None,
    [],
    ["192.0.2.0/24"],
    ["10.0.0.0/8", "2001:db8::/32"],
    ["bad"],
    ["0.0.0.0/0", "::/0"],
    ["198.51.100.7/32", "nonsense", "10.0.0.1/8"],
)

#: limit annotations' values (None: absent), good and bad, and the node's guard
LIMITS = {
    ANN_INGRESS_BANDWIDTH: (None, None, "100M", "1G", "fast", "10"),
    ANN_EGRESS_BANDWIDTH: (None, None, "1G", "2.5G", "-1"),
    ANN_INGRESS_PACKET_RATE: (None, None, "100k", "50000", "0", "2M"),
}
GUARD = 1_000_000
CEILING = 1_500_000  # the node's ceiling of a Service's own rate: "2M" is above it

keys = st.tuples(st.sampled_from(NAMESPACES), st.sampled_from(NAMES))
slice_keys = st.tuples(st.sampled_from(NAMESPACES), st.sampled_from(SLICE_NAMES))


@st.composite
def services(draw: st.DrawFn) -> Obj:
    proxy = draw(st.sampled_from([DEFAULT_PROXY_NAME] * 4 + ["other", None]))
    meta: Obj = {
        # other proxies' Services and unlabelled ones share LB IPs with ours: warned about
        "labels": {LABEL_PROXY_NAME: proxy} if proxy else {"app": "x"},
        "annotations": {ANN_WHOLE_IP: draw(st.sampled_from(FLAGS))}
        | ({ANN_ALLOW_ICMP: "true"} if draw(st.booleans()) else {}),
    }
    created = draw(st.sampled_from(TIMES))
    if created is not None:
        meta["creationTimestamp"] = created
    ips = draw(st.lists(st.sampled_from(LB_IPS), max_size=3))
    ports = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["TCP", "UDP", "SCTP", "ICMP"]), st.sampled_from([22, 80, 0])
            ),
            max_size=3,
        )
    )
    obj: Obj = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {"ports": [{"protocol": p, "port": n} for p, n in ports]},
        "status": {"loadBalancer": {"ingress": [{"ip": ip} for ip in ips]}},
    }
    # source ranges of both families, valid and not, from the field and the annotation
    ranges = draw(st.sampled_from(RANGES))
    if ranges is not None:
        obj["spec"]["loadBalancerSourceRanges"] = ranges
    ann = draw(st.sampled_from([None, None, "192.0.2.0/25, 10.1.0.0/16", "", "x,fd00::/8"]))
    if ann is not None:
        meta["annotations"][ANN_SOURCE_RANGES] = ann
    # limits (issue 38), valid and not: the guard stands in for a missing packet rate
    for limit, values in LIMITS.items():
        value = draw(st.sampled_from(values))
        if value is not None:
            meta["annotations"][limit] = value
    if draw(st.integers(0, 20)) == 0:
        obj["spec"] = "garbage"
    return obj


@st.composite
def slices(draw: st.DrawFn) -> Obj:
    eps = []
    for _ in range(draw(st.integers(0, 3))):
        cond: Obj = {}
        ready = draw(st.sampled_from([True, True, False, None]))
        if ready is not None:
            cond["ready"] = ready
        if draw(st.integers(0, 5)) == 0:
            cond["terminating"] = True
        ep: Obj = {"addresses": [draw(st.sampled_from(POD_IPS))], "conditions": cond}
        node = draw(st.sampled_from([None, "node1", "node2"]))
        if node is not None:
            ep["nodeName"] = node  # one address on two nodes: a live migration
        eps.append(ep)
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"labels": {LABEL_SERVICE_NAME: draw(st.sampled_from(NAMES))}},
        "addressType": draw(st.sampled_from(["IPv4", "IPv4", "IPv6", "IPv6", "FQDN"])),
        "endpoints": eps,
    }


class Histories(RuleBasedStateMachine):
    """Objects as a source would hold them, fed to the incremental model change by change."""

    capacity: Capacity | None = None

    def __init__(self) -> None:
        super().__init__()
        self.services: dict[tuple[str, str], Obj] = {}
        self.slices: dict[tuple[str, str], Obj] = {}
        self.garbage: list[Obj] = []
        self.nodes: dict[str, Obj] = {}
        self.local: dict[Any, str] = {}
        self.now = 0.0
        self.model = IncrementalModel(
            DEFAULT_PROXY_NAME,
            self.capacity,
            clock=lambda: self.now,
            reserved_cidrs=RESERVED_CIDRS,
            guard_pps=GUARD,
            max_pps=CEILING,
        )
        self.before = MapState()
        self.problems_before: set[Problem] = set()

    def objects(self) -> list[Obj]:
        return [
            *(self.services[k] for k in sorted(self.services)),
            *(self.slices[k] for k in sorted(self.slices)),
            *(self.nodes[k] for k in sorted(self.nodes)),
            *self.garbage,
        ]

    def feed(self) -> None:
        """What a source does after a change: the records of the objects, keyed."""
        self.model.replace(read_objects(self.objects(), DEFAULT_PROXY_NAME))

    @rule(key=keys, obj=services())
    def put_service(self, key: tuple[str, str], obj: Obj) -> None:
        obj = copy.deepcopy(obj)
        obj["metadata"].update(namespace=key[0], name=key[1])
        self.services[key] = obj
        self.feed()

    @rule(key=keys)
    def delete_service(self, key: tuple[str, str]) -> None:
        self.services.pop(key, None)
        self.feed()

    @rule(key=keys, created=st.sampled_from(TIMES))
    def age_changes(self, key: tuple[str, str], created: str | None) -> None:
        """The older-wins rules re-decided: the same Service, another creation time."""
        if key in self.services:
            self.services[key]["metadata"]["creationTimestamp"] = created
            self.feed()

    @rule(key=slice_keys, obj=slices())
    def put_slice(self, key: tuple[str, str], obj: Obj) -> None:
        obj = copy.deepcopy(obj)
        obj["metadata"].update(namespace=key[0], name=key[1])
        self.slices[key] = obj
        self.feed()

    @rule(key=slice_keys)
    def flip_ready(self, key: tuple[str, str]) -> None:
        if key in self.slices:
            for ep in self.slices[key]["endpoints"]:
                ep["conditions"]["ready"] = not ep["conditions"].get("ready", True)
            self.feed()

    @rule(key=slice_keys, node=st.sampled_from(["node1", "node2", "node3"]))
    def move(self, key: tuple[str, str], node: str) -> None:
        """The pods of a slice move to another node (a live migration, done)."""
        if key in self.slices:
            for ep in self.slices[key]["endpoints"]:
                ep["nodeName"] = node
            self.feed()

    @rule(seconds=st.sampled_from([1.0, 5.0, 10.0, 30.0]))
    def time_passes(self, seconds: float) -> None:
        """Held pods stop learning when their time is up (the next flush)."""
        self.now += seconds

    @rule(key=slice_keys)
    def delete_slice(self, key: tuple[str, str]) -> None:
        self.slices.pop(key, None)
        self.feed()

    @rule(
        name=st.sampled_from(NODE_NAMES),
        addresses=st.lists(
            st.tuples(st.sampled_from(NODE_IPS), st.sampled_from(["InternalIP", "ExternalIP"])),
            max_size=3,
        ),
    )
    def put_node(self, name: str, addresses: list[tuple[str, str]]) -> None:
        """A Node joins or its addresses change: an LB IP that is one is refused."""
        self.nodes[name] = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name},
            "status": {
                "addresses": [{"type": t, "address": a} for a, t in addresses]
                + [{"type": "Hostname", "address": name}]
            },
        }
        self.feed()

    @rule(name=st.sampled_from(NODE_NAMES))
    def delete_node(self, name: str) -> None:
        self.nodes.pop(name, None)
        self.feed()

    @rule(
        addresses=st.lists(st.sampled_from(NODE_IPS), max_size=3),
        device=st.sampled_from(["eth0", "br0"]),
    )
    def local_addresses(self, addresses: list[str], device: str) -> None:
        """This node's addresses change (read from the kernel, not from an object)."""
        self.local = {ip_address(a): device for a in addresses}
        self.model.set_local(self.local)

    @rule()
    def garbage_object(self) -> None:
        self.garbage = [] if self.garbage else [{"kind": "Service", "metadata": {}}]
        self.feed()

    @rule(n=st.integers(1, 4))
    def several_changes_in_one_flush(self, n: int) -> None:
        """Changes recorded between two flushes coalesce."""
        for i, key in enumerate(sorted(self.slices)[:n]):
            self.slices[key]["metadata"]["labels"][LABEL_SERVICE_NAME] = NAMES[i % len(NAMES)]
        self.feed()

    @invariant()
    def same_as_the_full_model(self) -> None:
        delta = self.model.flush()
        assert not self.model.pending
        got = self.model.result()
        want = build_state(
            self.objects(),
            DEFAULT_PROXY_NAME,
            self.capacity,
            self.model.held,
            self.local,
            RESERVED_CIDRS,
            GUARD,
            CEILING,
        )
        assert_same(got, want)
        # the diff is exactly what the controller must write
        assert apply_to(self.before, delta.diff) == want.state
        assert set(delta.problems_added) == set(want.problems) - self.problems_before
        assert set(delta.problems_removed) == self.problems_before - set(want.problems)
        self.before = want.state
        self.problems_before = set(want.problems)


class HistoriesOverCapacity(Histories):
    """The same with maps too small for everything: what fits, oldest first."""

    capacity = Capacity(
        (
            MapLimit("svc4", 2, (("services", 4),)),
            MapLimit("pod4", 2, (("pods", 4),)),
            MapLimit("addr6", 3, (("services", 6), ("pods", 6))),
            MapLimit("allow4", 3, (("allowed", 4),)),
            MapLimit("ranges4", 3, (("ranges", 4),)),
        )
    )


def assert_same(got: ModelResult, want: ModelResult) -> None:
    assert got.state == want.state
    assert got.services == want.services
    assert got.problems == want.problems


SETTINGS = settings(
    max_examples=int(os.environ.get("COZYEBPF_HYPOTHESIS_EXAMPLES", "150")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

TestHistories = Histories.TestCase
TestHistories.settings = SETTINGS
TestHistoriesOverCapacity = HistoriesOverCapacity.TestCase
TestHistoriesOverCapacity.settings = SETTINGS


def test_a_change_recomputes_only_what_it_touches() -> None:
    """1,000 unrelated Services: one endpoint change recomputes that Service alone; a change
    of an LB IP shared by two Services recomputes both."""
    objs: list[Obj] = []
    for i in range(1000):
        objs += [service_obj(f"vm{i}", f"198.18.{i // 250}.{i % 250 + 1}"), slice_obj(f"vm{i}", i)]
    objs += [
        service_obj("twin", "198.18.0.1", created="2030-01-01T00:00:00Z"),
        slice_obj("twin", 1000),
    ]
    m = IncrementalModel()
    m.replace(read_objects(objs))
    first = m.flush()
    assert first.recomputed == 1001 and len(first.diff.services_set) == 1000
    m.set_slices(
        ("default", "vm7-x"), read_objects([slice_obj("vm7", 5000)]).slices[("default", "vm7-x")]
    )
    d = m.flush()
    assert d.recomputed == 1
    assert set(d.diff.services_set) == {ip("198.18.0.8")}
    assert set(d.diff.pods_del) == {ip("10.244.0.8")}
    assert d.problems_added == d.problems_removed == []
    m.set_service(("default", "vm0"), None)  # the twin gets the LB IP
    d = m.flush()
    assert d.recomputed == 2
    assert m.state.services[ip("198.18.0.1")].pod_ip == ip("10.244.3.233")
    assert_same(
        m.result(),
        build_state(
            [o for o in objs if name(o) not in ("vm0", "vm7-x")] + [slice_obj("vm7", 5000)],
        ),
    )


def ip(text: str) -> Any:
    from ipaddress import ip_address

    return ip_address(text)


def name(o: Obj) -> str:
    return str(o["metadata"]["name"])


def service_obj(n: str, lb: str, created: str = "2024-01-01T00:00:00Z") -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": n,
            "namespace": "default",
            "creationTimestamp": created,
            "labels": {LABEL_PROXY_NAME: DEFAULT_PROXY_NAME},
        },
        "spec": {"ports": [{"protocol": "TCP", "port": 22}]},
        "status": {"loadBalancer": {"ingress": [{"ip": lb}]}},
    }


def slice_obj(service: str, i: int) -> Obj:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{service}-x",
            "namespace": "default",
            "labels": {LABEL_SERVICE_NAME: service},
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [str(ip("10.244.0.1") + i)], "conditions": {"ready": True}}],
    }


@pytest.mark.parametrize("n", [0, 1])
def test_flush_without_changes_is_empty(n: int) -> None:
    m = IncrementalModel()
    if n:
        m.replace(read_objects([service_obj("vm", "192.0.2.1"), slice_obj("vm", 1)]))
        assert not m.flush().empty()
    assert m.flush().empty()
    m.replace(read_objects([service_obj("vm", "192.0.2.1"), slice_obj("vm", 1)][: 2 * n]))
    assert m.flush().empty()
