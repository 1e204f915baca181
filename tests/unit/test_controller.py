"""The controller against the fake datapath: whole dumps after sync, drift repair, failures,
and problem logging."""

from __future__ import annotations

import logging
from collections.abc import Callable
from ipaddress import IPv4Address, IPv6Address
from typing import Any

import pytest

from cozyebpf.controller import Controller
from cozyebpf.datapath import Datapath
from cozyebpf.dump import build_dump
from cozyebpf.errors import DatapathError
from cozyebpf.model import build_state
from cozyebpf.state import AllowedPort, MapDiff, MapState, PodEntry, Proto, ServiceEntry
from cozylab.fakedp import FakeDatapath

LB1, LB2, LB3 = IPv4Address("192.0.2.10"), IPv4Address("192.0.2.11"), IPv4Address("192.0.2.12")
POD1, POD2, POD3 = IPv4Address("10.244.0.5"), IPv4Address("10.244.0.7"), IPv4Address("10.244.1.3")
ROGUE_LB, ROGUE_POD = IPv4Address("198.51.100.1"), IPv4Address("10.244.9.9")

LOGGER = "test.controller"


def desired() -> MapState:
    """vm1: port filter tcp/22 + udp/53 with ICMP; vm2: whole-IP."""
    return MapState(
        services={LB1: ServiceEntry(POD1, True, True), LB2: ServiceEntry(POD2, False, False)},
        pods={POD1: PodEntry(LB1, True, True), POD2: PodEntry(LB2, False, False)},
        allowed={AllowedPort(POD1, Proto.TCP, 22), AllowedPort(POD1, Proto.UDP, 53)},
    )


def svc(
    lb: str, pod: str, mode: str, icmp: bool, ports: list[str], service: str | None = None
) -> dict[str, Any]:
    return {
        "lb_ip": lb,
        "pod_ip": pod,
        "mode": mode,
        "allow_icmp": icmp,
        "allowed_ports": ports,
        "flows": 0,
        "service": service,
        "source_ranges": None,
    }


def pod(pod_ip: str, lb: str, mode: str, icmp: bool, service: str | None = None) -> dict[str, Any]:
    return {"pod_ip": pod_ip, "lb_ip": lb, "mode": mode, "allow_icmp": icmp, "service": service}


def dump(services: list[dict[str, Any]], pods: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "pin_dir": "(fake)",
        "attachments": [],
        "services": services,
        "pods": pods,
        "flows": 0,
        "flow_timeouts": {},
        "flow_entries": [],
        "counters": {},
        "limits": [],
        "service_counters": [],
    }


DESIRED_DUMP = dump(
    [
        svc("192.0.2.10", "10.244.0.5", "port-filter", True, ["tcp/22", "udp/53"]),
        svc("192.0.2.11", "10.244.0.7", "whole-ip", False, []),
    ],
    [
        pod("10.244.0.5", "192.0.2.10", "port-filter", True),
        pod("10.244.0.7", "192.0.2.11", "whole-ip", False),
    ],
)
EMPTY_DUMP = dump([], [])


def _drift_deleted(s: MapState) -> None:
    del s.services[LB1]
    del s.pods[POD2]
    s.allowed.discard(AllowedPort(POD1, Proto.UDP, 53))


def _drift_added(s: MapState) -> None:
    s.services[ROGUE_LB] = ServiceEntry(ROGUE_POD, False, False)
    s.pods[ROGUE_POD] = PodEntry(ROGUE_LB, False, False)
    s.allowed.add(AllowedPort(POD1, Proto.TCP, 80))
    s.allowed.add(AllowedPort(ROGUE_POD, Proto.SCTP, 9))


def _drift_modified(s: MapState) -> None:
    s.services[LB1] = ServiceEntry(POD1, False, True)  # someone opened the port filter
    s.pods[POD1] = PodEntry(LB3, True, True)  # and points egress at another IP


def _drift_all(s: MapState) -> None:
    _drift_deleted(s)
    _drift_added(s)
    _drift_modified(s)


def _nothing(s: MapState) -> None:
    pass


# (id, how to corrupt the programmed desired state, expected INFO line)
DRIFT_CASES: list[tuple[str, Callable[[MapState], None], str]] = [
    (
        "deleted-entries-come-back",
        _drift_deleted,
        "programmed: services +1 ~0 -0, pods +1 ~0 -0, allowed ports +1 -0; "
        "now 2 services, 2 pods, 2 allowed ports",
    ),
    (
        "unwanted-entries-go-away",
        _drift_added,
        "programmed: services +0 ~0 -1, pods +0 ~0 -1, allowed ports +0 -2; "
        "now 2 services, 2 pods, 2 allowed ports",
    ),
    (
        "modified-entries-are-restored",
        _drift_modified,
        "programmed: services +0 ~1 -0, pods +0 ~1 -0, allowed ports +0 -0; "
        "now 2 services, 2 pods, 2 allowed ports",
    ),
    (
        "all-at-once",
        _drift_all,
        "programmed: services +0 ~1 -1, pods +1 ~1 -1, allowed ports +1 -2; "
        "now 2 services, 2 pods, 2 allowed ports",
    ),
]


def _records(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == LOGGER]


@pytest.fixture
def controller(caplog: pytest.LogCaptureFixture) -> tuple[Controller, FakeDatapath]:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    fake = FakeDatapath()
    return Controller(fake, logging.getLogger(LOGGER)), fake


def dumped(fake: FakeDatapath) -> dict[str, Any]:
    """The fake's state in the shape of `cozyebpf maps dump --json` (no counters)."""
    return build_dump(fake.state, fake.flows, pin_dir="(fake)")


def test_fake_is_a_datapath() -> None:
    fake = FakeDatapath()
    dp: Datapath = fake
    assert dp.capacity() is None and dp.attached and dp.check() == []
    assert dumped(fake) == EMPTY_DUMP


def test_first_sync_programs_everything(
    controller: tuple[Controller, FakeDatapath], caplog: pytest.LogCaptureFixture
) -> None:
    ctl, fake = controller
    d = ctl.sync(desired())
    assert dumped(fake) == DESIRED_DUMP
    assert d == MapDiff(
        services_set=dict(desired().services),
        pods_set=dict(desired().pods),
        allowed_add=set(desired().allowed),
    )
    assert _records(caplog) == [
        (
            "INFO",
            "programmed: services +2 ~0 -0, pods +2 ~0 -0, allowed ports +2 -0; "
            "now 2 services, 2 pods, 2 allowed ports",
        )
    ]


def test_second_sync_is_a_no_op(
    controller: tuple[Controller, FakeDatapath], caplog: pytest.LogCaptureFixture
) -> None:
    ctl, fake = controller
    ctl.sync(desired())
    caplog.clear()
    before = fake.state
    d = ctl.sync(desired())
    assert d.empty()
    assert fake.state is before, "apply() must not be called for an empty diff"
    assert dumped(fake) == DESIRED_DUMP
    assert _records(caplog) == [("DEBUG", "in sync: 2 services, 2 pods, 2 allowed ports")]


def test_change_of_desired_state(
    controller: tuple[Controller, FakeDatapath], caplog: pytest.LogCaptureFixture
) -> None:
    """vm1 switches to whole-IP (its ports go), vm2 is deleted, vm3 appears."""
    ctl, fake = controller
    ctl.sync(desired())
    caplog.clear()
    new = MapState(
        services={LB1: ServiceEntry(POD1, False, True), LB3: ServiceEntry(POD3, True, False)},
        pods={POD1: PodEntry(LB1, False, True), POD3: PodEntry(LB3, True, False)},
        allowed={AllowedPort(POD3, Proto.TCP, 443)},
    )
    ctl.sync(new)
    assert dumped(fake) == dump(
        [
            svc("192.0.2.10", "10.244.0.5", "whole-ip", True, []),
            svc("192.0.2.12", "10.244.1.3", "port-filter", False, ["tcp/443"]),
        ],
        [
            pod("10.244.0.5", "192.0.2.10", "whole-ip", True),
            pod("10.244.1.3", "192.0.2.12", "port-filter", False),
        ],
    )
    assert _records(caplog) == [
        (
            "INFO",
            "programmed: services +1 ~1 -1, pods +1 ~1 -1, allowed ports +1 -2; "
            "now 2 services, 2 pods, 1 allowed ports",
        )
    ]


def test_sync_to_empty_removes_everything(
    controller: tuple[Controller, FakeDatapath], caplog: pytest.LogCaptureFixture
) -> None:
    ctl, fake = controller
    ctl.sync(desired())
    caplog.clear()
    ctl.sync(MapState())
    assert dumped(fake) == EMPTY_DUMP
    assert _records(caplog) == [
        (
            "INFO",
            "programmed: services +0 ~0 -2, pods +0 ~0 -2, allowed ports +0 -2; "
            "now 0 services, 0 pods, 0 allowed ports",
        )
    ]


def test_failing_apply_propagates_and_next_sync_recovers(
    controller: tuple[Controller, FakeDatapath], caplog: pytest.LogCaptureFixture
) -> None:
    ctl, fake = controller
    error = DatapathError("writing map cozy_services: Operation not permitted")
    fake.fail_next_apply = error
    with pytest.raises(DatapathError) as info:
        ctl.sync(desired())
    assert info.value is error
    assert dumped(fake) == EMPTY_DUMP
    assert _records(caplog) == []
    assert fake.fail_next_apply is None, "the failure is injected once"

    ctl.sync(desired())
    assert dumped(fake) == DESIRED_DUMP
    assert _records(caplog) == [
        (
            "INFO",
            "programmed: services +2 ~0 -0, pods +2 ~0 -0, allowed ports +2 -0; "
            "now 2 services, 2 pods, 2 allowed ports",
        )
    ]


def test_failing_apply_keeps_previous_state(controller: tuple[Controller, FakeDatapath]) -> None:
    ctl, fake = controller
    ctl.sync(desired())
    fake.fail_next_apply = RuntimeError("bcc: map update failed")
    with pytest.raises(RuntimeError, match="bcc: map update failed"):
        ctl.sync(MapState())
    assert dumped(fake) == DESIRED_DUMP


def test_read_state_is_a_copy() -> None:
    fake = FakeDatapath(desired())
    live = fake.read_state()
    live.services.clear()
    live.allowed.clear()
    assert dumped(fake) == DESIRED_DUMP


def test_manifest_objects_to_dump(
    controller: tuple[Controller, FakeDatapath], caplog: pytest.LogCaptureFixture
) -> None:
    """Model and controller together: the dump of what a Service + EndpointSlice program."""
    ctl, fake = controller
    objects: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": "vm1",
                "namespace": "tenant-a",
                "labels": {"service.kubernetes.io/service-proxy-name": "cozy-proxy"},
                "annotations": {"networking.cozystack.io/allowICMP": "true"},
            },
            "spec": {"ports": [{"port": 22}, {"port": 53, "protocol": "UDP"}]},
            "status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.10"}]}},
        },
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "vm1-abc",
                "namespace": "tenant-a",
                "labels": {"kubernetes.io/service-name": "vm1"},
            },
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.244.0.5"]}],
        },
    ]
    result = build_state(objects)
    assert result.problems == []
    ctl.sync(result.state)
    vm1 = "tenant-a/vm1"  # the Service the addresses count for
    assert dumped(fake) == dump(
        [svc("192.0.2.10", "10.244.0.5", "port-filter", True, ["tcp/22", "udp/53"], vm1)],
        [pod("10.244.0.5", "192.0.2.10", "port-filter", True, vm1)],
    )


def test_default_logger(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="cozyebpf.controller")
    Controller(FakeDatapath()).sync(desired())
    assert [r.name for r in caplog.records] == ["cozyebpf.controller"]


# -- IPv6 and dual-stack ------------------------------------------------------------------------

LB6_1, LB6_2 = IPv6Address("2001:db8::10"), IPv6Address("2001:db8:ffff:ffff:ffff:ffff:ffff:fe11")
POD6_1, POD6_2 = IPv6Address("fd00:10:244::5"), IPv6Address("fd00:10:244:0:1234:5678:9abc:def0")


def desired_dual() -> MapState:
    """desired() plus vm1's IPv6 half (port filter tcp/22 + udp/53, ICMP) and an IPv6-only
    whole-IP vm3."""
    st = desired()
    st.services |= {
        LB6_1: ServiceEntry(POD6_1, True, True),
        LB6_2: ServiceEntry(POD6_2, False, False),
    }
    st.pods |= {POD6_1: PodEntry(LB6_1, True, True), POD6_2: PodEntry(LB6_2, False, False)}
    st.allowed |= {AllowedPort(POD6_1, Proto.TCP, 22), AllowedPort(POD6_1, Proto.UDP, 53)}
    return st


DUAL_DUMP = dump(
    [
        svc("192.0.2.10", "10.244.0.5", "port-filter", True, ["tcp/22", "udp/53"]),
        svc("192.0.2.11", "10.244.0.7", "whole-ip", False, []),
        svc("2001:db8::10", "fd00:10:244::5", "port-filter", True, ["tcp/22", "udp/53"]),
        svc(
            "2001:db8:ffff:ffff:ffff:ffff:ffff:fe11",
            "fd00:10:244:0:1234:5678:9abc:def0",
            "whole-ip",
            False,
            [],
        ),
    ],
    [
        pod("10.244.0.5", "192.0.2.10", "port-filter", True),
        pod("10.244.0.7", "192.0.2.11", "whole-ip", False),
        pod("fd00:10:244::5", "2001:db8::10", "port-filter", True),
        pod(
            "fd00:10:244:0:1234:5678:9abc:def0",
            "2001:db8:ffff:ffff:ffff:ffff:ffff:fe11",
            "whole-ip",
            False,
        ),
    ],
)


def test_first_sync_programs_both_families(
    controller: tuple[Controller, FakeDatapath], caplog: pytest.LogCaptureFixture
) -> None:
    ctl, fake = controller
    d = ctl.sync(desired_dual())
    assert dumped(fake) == DUAL_DUMP
    assert d == MapDiff(
        services_set=dict(desired_dual().services),
        pods_set=dict(desired_dual().pods),
        allowed_add=set(desired_dual().allowed),
    )
    assert _records(caplog) == [
        (
            "INFO",
            "programmed: services +4 ~0 -0, pods +4 ~0 -0, allowed ports +4 -0; "
            "now 4 services, 4 pods, 4 allowed ports",
        )
    ]
    caplog.clear()
    assert ctl.sync(desired_dual()).empty()
    assert _records(caplog) == [("DEBUG", "in sync: 4 services, 4 pods, 4 allowed ports")]


def test_ipv4_to_dual_stack_and_back(
    controller: tuple[Controller, FakeDatapath], caplog: pytest.LogCaptureFixture
) -> None:
    """Adding the IPv6 half touches no IPv4 entry; removing it leaves exactly the IPv4 dump."""
    ctl, fake = controller
    ctl.sync(desired())
    caplog.clear()
    d = ctl.sync(desired_dual())
    assert d == MapDiff(
        services_set={
            LB6_1: ServiceEntry(POD6_1, True, True),
            LB6_2: ServiceEntry(POD6_2, False, False),
        },
        pods_set={POD6_1: PodEntry(LB6_1, True, True), POD6_2: PodEntry(LB6_2, False, False)},
        allowed_add={AllowedPort(POD6_1, Proto.TCP, 22), AllowedPort(POD6_1, Proto.UDP, 53)},
    )
    assert dumped(fake) == DUAL_DUMP
    ctl.sync(desired())
    assert dumped(fake) == DESIRED_DUMP
    assert _records(caplog) == [
        (
            "INFO",
            "programmed: services +2 ~0 -0, pods +2 ~0 -0, allowed ports +2 -0; "
            "now 4 services, 4 pods, 4 allowed ports",
        ),
        (
            "INFO",
            "programmed: services +0 ~0 -2, pods +0 ~0 -2, allowed ports +0 -2; "
            "now 2 services, 2 pods, 2 allowed ports",
        ),
    ]


def _drift6_deleted(s: MapState) -> None:
    del s.services[LB6_1]
    del s.pods[POD6_2]
    s.allowed.discard(AllowedPort(POD6_1, Proto.UDP, 53))


def _drift6_added(s: MapState) -> None:
    rogue_lb, rogue_pod = IPv6Address("2001:db8::bad"), IPv6Address("fd00::bad")
    s.services[rogue_lb] = ServiceEntry(rogue_pod, False, False)
    s.pods[rogue_pod] = PodEntry(rogue_lb, False, False)
    s.allowed.add(AllowedPort(POD6_1, Proto.TCP, 80))


def _drift6_modified(s: MapState) -> None:
    s.services[LB6_1] = ServiceEntry(POD6_2, True, True)  # points at another pod
    s.pods[POD6_1] = PodEntry(LB6_2, True, True)


def _drift6_same_address_other_family(s: MapState) -> None:
    """An IPv4 entry whose address equals an IPv6 one's low bits is another entry."""
    s.services[IPv4Address("0.0.0.16")] = ServiceEntry(IPv4Address("10.244.0.5"), True, True)
    del s.services[LB1]


DRIFT6_CASES: list[tuple[str, Callable[[MapState], None], str]] = [
    (
        "deleted-ipv6-entries-come-back",
        _drift6_deleted,
        "programmed: services +1 ~0 -0, pods +1 ~0 -0, allowed ports +1 -0; "
        "now 4 services, 4 pods, 4 allowed ports",
    ),
    (
        "unwanted-ipv6-entries-go-away",
        _drift6_added,
        "programmed: services +0 ~0 -1, pods +0 ~0 -1, allowed ports +0 -1; "
        "now 4 services, 4 pods, 4 allowed ports",
    ),
    (
        "modified-ipv6-entries-are-restored",
        _drift6_modified,
        "programmed: services +0 ~1 -0, pods +0 ~1 -0, allowed ports +0 -0; "
        "now 4 services, 4 pods, 4 allowed ports",
    ),
    (
        "families-are-not-confused",
        _drift6_same_address_other_family,
        "programmed: services +1 ~0 -1, pods +0 ~0 -0, allowed ports +0 -0; "
        "now 4 services, 4 pods, 4 allowed ports",
    ),
]


#: (id, the desired state, its dump, the corruption, the log line of the repair)
DRIFTS = [(c[0], desired, DESIRED_DUMP, *c[1:]) for c in DRIFT_CASES] + [
    (f"ipv6-{c[0]}", desired_dual, DUAL_DUMP, *c[1:]) for c in DRIFT6_CASES
]


@pytest.mark.parametrize(
    ("want", "want_dump", "corrupt", "line"), [c[1:] for c in DRIFTS], ids=[c[0] for c in DRIFTS]
)
def test_drift_is_repaired(
    controller: tuple[Controller, FakeDatapath],
    caplog: pytest.LogCaptureFixture,
    want: Callable[[], MapState],
    want_dump: dict[str, Any],
    corrupt: Callable[[MapState], None],
    line: str,
) -> None:
    ctl, fake = controller
    ctl.sync(want())
    corrupt(fake.state)
    assert dumped(fake) != want_dump
    caplog.clear()
    ctl.sync(want())
    assert dumped(fake) == want_dump
    assert _records(caplog) == [("INFO", line)]


def test_fake_refuses_a_diff_that_mixes_families() -> None:
    fake = FakeDatapath(desired())
    d = MapDiff()
    d.services_set[LB6_1] = ServiceEntry(POD1, True, False)
    d.pods_set[POD2] = PodEntry(LB6_2, True, False)
    d.allowed_add.add(AllowedPort(POD6_1, Proto.TCP, 22))
    with pytest.raises(DatapathError) as info:
        fake.apply(d)
    assert str(info.value) == (
        "refusing to program maps in (fake): an entry mixes address families "
        "(service 2001:db8::10 -> pod 10.244.0.5; "
        "pod 10.244.0.7 -> LB IP 2001:db8:ffff:ffff:ffff:ffff:ffff:fe11)"
    )
    assert dumped(fake) == DESIRED_DUMP, "nothing is applied"


def test_flows_of_both_families_in_the_dump() -> None:
    fake = FakeDatapath(desired_dual())
    fake.flows = {POD1: 2, POD6_1: 3, POD6_2: 1}
    expected = DUAL_DUMP | {"flows": 6}
    expected["services"] = [dict(s) for s in DUAL_DUMP["services"]]
    for s, n in zip(expected["services"], (2, 0, 3, 1), strict=True):
        s["flows"] = n
    assert dumped(fake) == expected


def test_dual_stack_manifest_objects_to_dump(
    controller: tuple[Controller, FakeDatapath], caplog: pytest.LogCaptureFixture
) -> None:
    """Model and controller together: a dual-stack Service (IPv6 LB IP written in full, upper
    case) with its two EndpointSlices, and an IPv6 LB IP without an IPv6 pod (reported, not
    programmed)."""
    ctl, fake = controller
    meta = {"labels": {"service.kubernetes.io/service-proxy-name": "cozy-proxy"}}
    objects: list[dict[str, Any]] = [
        {
            "kind": "Service",
            "metadata": {"name": "vm1", "namespace": "tenant-a", **meta},
            "spec": {"ipFamilies": ["IPv6", "IPv4"], "ports": [{"port": 22}]},
            "status": {
                "loadBalancer": {"ingress": [{"ip": "2001:DB8:0:0:0:0:0:10"}, {"ip": "192.0.2.10"}]}
            },
        },
        {
            "kind": "EndpointSlice",
            "metadata": {
                "name": "vm1-v4",
                "namespace": "tenant-a",
                "labels": {"kubernetes.io/service-name": "vm1"},
            },
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.244.0.5"]}],
        },
        {
            "kind": "EndpointSlice",
            "metadata": {
                "name": "vm1-v6",
                "namespace": "tenant-a",
                "labels": {"kubernetes.io/service-name": "vm1"},
            },
            "addressType": "IPv6",
            "endpoints": [{"addresses": ["fd00:10:244:0:0:0:0:5"]}],
        },
        {
            "kind": "Service",
            "metadata": {
                "name": "vm2",
                "namespace": "tenant-a",
                "annotations": {"networking.cozystack.io/wholeIP": "true"},
                **meta,
            },
            "status": {"loadBalancer": {"ingress": [{"ip": "2001:db8::11"}]}},
        },
        {
            "kind": "EndpointSlice",
            "metadata": {
                "name": "vm2-v4",
                "namespace": "tenant-a",
                "labels": {"kubernetes.io/service-name": "vm2"},
            },
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.244.0.7"]}],
        },
    ]
    result = build_state(objects)
    assert [str(p) for p in result.problems] == [
        "Service tenant-a/vm2: LB IP 2001:db8::11 is IPv6 but the Service has no ready IPv6 "
        "endpoint; it is not programmed (an LB IP is only translated to a pod IP of its own "
        "family); check that the pod has an IPv6 address and is ready, or remove the IPv6 LB IP"
    ]
    ctl.sync(result.state)
    vm1 = "tenant-a/vm1"
    assert dumped(fake) == dump(
        [
            svc("192.0.2.10", "10.244.0.5", "port-filter", False, ["tcp/22"], vm1),
            svc("2001:db8::10", "fd00:10:244::5", "port-filter", False, ["tcp/22"], vm1),
        ],
        [
            pod("10.244.0.5", "192.0.2.10", "port-filter", False, vm1),
            pod("fd00:10:244::5", "2001:db8::10", "port-filter", False, vm1),
        ],
    )
