"""The pinned maps with both address families: a dual-stack diff lands in addr4/addr6 (services
and pods, with the allowed ports inline) and allow4/allow6 in network byte order, read_state()
gives back exactly what was applied, and flows_by_pod() counts flow6 entries. Real maps under a
private pin dir; no program is loaded."""

from __future__ import annotations

import ctypes
import logging
import os
import struct
from collections.abc import Callable, Iterator
from ipaddress import IPv4Address, IPv6Address, ip_address
from typing import Any

import pytest

from cozyebpf.datapath import bpfsys
from cozyebpf.datapath.layout import (
    PORTS_SPILL,
    Addr4Val,
    Addr6Val,
    Allow6Key,
    Flow4Key,
    Flow4Val,
    Flow6Key,
    Ip6,
    be16,
    be32,
    ip6,
)
from cozyebpf.datapath.maps import Flow, PinnedMaps
from cozyebpf.errors import DatapathError
from cozyebpf.state import (
    AllowedPort,
    IPAddress,
    MapDiff,
    MapState,
    PodEntry,
    Proto,
    ServiceEntry,
    apply_to,
    diff,
)
from tests.support.env import unique_prefix
from tests.support.states import of_family

LB4, POD4 = IPv4Address("192.0.2.10"), IPv4Address("10.244.0.5")
LB4_WHOLE, POD4_WHOLE = IPv4Address("192.0.2.11"), IPv4Address("10.244.0.7")
LB6, POD6 = IPv6Address("2001:db8::10"), IPv6Address("fd00:10:244::5")
LB6_WHOLE = IPv6Address("2001:db8:ffff:ffff:ffff:ffff:ffff:fe11")
POD6_WHOLE = IPv6Address("fd00:10:244:0:1234:5678:9abc:def0")
REMOTE6 = IPv6Address("2001:db8:1::99")

#: vm1 dual-stack port filter (tcp/22, udp/53, ICMP), vm2 IPv4 whole-IP, vm3 IPv6 whole-IP
DUAL = MapState(
    services={
        LB4: ServiceEntry(POD4, True, True),
        LB6: ServiceEntry(POD6, True, True),
        LB4_WHOLE: ServiceEntry(POD4_WHOLE, False, False),
        LB6_WHOLE: ServiceEntry(POD6_WHOLE, False, False),
    },
    pods={
        POD4: PodEntry(LB4, True, True),
        POD6: PodEntry(LB6, True, True),
        POD4_WHOLE: PodEntry(LB4_WHOLE, False, False),
        POD6_WHOLE: PodEntry(LB6_WHOLE, False, False),
    },
    allowed={
        AllowedPort(POD4, Proto.TCP, 22),
        AllowedPort(POD4, Proto.UDP, 53),
        AllowedPort(POD6, Proto.TCP, 22),
        AllowedPort(POD6, Proto.UDP, 53),
        AllowedPort(POD6, Proto.SCTP, 3868),
    },
)


@pytest.fixture
def pin_dir() -> Iterator[str]:
    from cozyebpf.datapath.attach import detach_all

    path = f"/sys/fs/bpf/{unique_prefix('v6')}"
    try:
        yield path
    finally:
        detach_all(path)


@pytest.fixture
def maps(pin_dir: str) -> Iterator[PinnedMaps]:
    m = PinnedMaps.ensure(pin_dir)
    try:
        yield m
    finally:
        m.close()


def key_count(m: PinnedMaps, name: str) -> int:
    spec = next(s for s in m.layout.all if s.name == name)
    return len(bpfsys.map_keys(m.fds[name], spec.key_size))


def counts(m: PinnedMaps) -> dict[str, int]:
    names = ("addr4", "addr6", "allow4", "allow6")
    return {n: key_count(m, n) for n in names}


def test_dual_stack_state_round_trips(maps: PinnedMaps, pin_dir: str) -> None:
    maps.apply(diff(maps.read_state(), DUAL))
    assert maps.read_state() == DUAL
    assert counts(maps) == {"addr4": 4, "addr6": 4, "allow4": 2, "allow6": 3}
    with PinnedMaps.open(pin_dir) as reader:  # another process's view, as `maps dump`
        assert reader.read_state() == DUAL


def test_single_lookups_agree_with_read_state(maps: PinnedMaps) -> None:
    """lookup_service/lookup_pod/has_allowed (what probes use instead of map walks) give the
    entries read_state() gives, of both families, and nothing for what is not programmed."""
    maps.apply(diff(maps.read_state(), DUAL))
    for lb, svc in DUAL.services.items():
        assert maps.lookup_service(lb) == svc
        assert maps.lookup_pod(lb) is None
    for pod, entry in DUAL.pods.items():
        assert maps.lookup_pod(pod) == entry
        assert maps.lookup_service(pod) is None
    for a in DUAL.allowed:
        assert maps.has_allowed(a)
    assert not maps.has_allowed(AllowedPort(POD4, Proto.TCP, 23))
    assert not maps.has_allowed(AllowedPort(POD6_WHOLE, Proto.TCP, 22))


def port(proto: int, number: int) -> bytes:
    """struct cz_port: protocol, reserved, port in network byte order."""
    return bytes([proto, 0]) + number.to_bytes(2, "big")


def test_ipv6_entries_are_in_network_byte_order(maps: PinnedMaps) -> None:
    """The raw bytes the C programs see: 16-byte addresses as on the wire, kind and flags, the
    allowed ports of the pod inline and sorted, zeroes."""
    maps.apply(diff(maps.read_state(), DUAL))
    key = ip6(LB6)
    assert bytes(key) == bytes.fromhex("20010db8000000000000000000000010")
    sv = Addr6Val()
    assert bpfsys.map_lookup(maps.fds["addr6"], key, sv)
    ports = port(6, 22) + port(17, 53) + port(132, 3868) + bytes(4 * 5)
    # pod_ip, kind LB, flags port-filter + ICMP, no pod role, 3 ports; lb_ip; ports; reserved
    assert bytes(sv) == POD6.packed + bytes([1, 3, 0, 3]) + bytes(16) + ports + bytes(12)
    pv = Addr6Val()
    assert bpfsys.map_lookup(maps.fds["addr6"], ip6(POD6_WHOLE), pv)
    # a pod IP: no rewrite on ingress (its own flags, ports), egress to its LB IP
    assert bytes(pv) == bytes(16) + bytes([2, 0, 0, 0]) + LB6_WHOLE.packed + bytes(44)
    one = ctypes.c_uint8()
    ak = Allow6Key(pod_ip=ip6(POD6), proto=132, port=be16(3868))
    assert bytes(ak) == POD6.packed + bytes([132, 0]) + (3868).to_bytes(2, "big")
    assert bpfsys.map_lookup(maps.fds["allow6"], ak, one)
    assert one.value == 1
    sv4 = Addr4Val()
    assert bpfsys.map_lookup(maps.fds["addr4"], ctypes.c_uint32(be32(LB4)), sv4)
    ports4 = port(6, 22) + port(17, 53) + bytes(4 * 6)
    assert bytes(sv4) == POD4.packed + bytes([1, 3, 0, 2]) + bytes(4) + ports4 + bytes(12)
    pv4 = Addr4Val()
    assert bpfsys.map_lookup(maps.fds["addr4"], ctypes.c_uint32(be32(POD4)), pv4)
    # the pod IP: traffic sent to it directly is filtered by its own flags and ports
    assert bytes(pv4) == bytes(4) + bytes([2, 3, 3, 2]) + LB4.packed + ports4 + bytes(12)
    # an IPv6 key is not in the IPv4 map and the other way round
    assert not bpfsys.map_lookup(maps.fds["addr6"], ip6(IPv6Address(f"::{LB4}")), Addr6Val())


def test_an_address_that_is_lb_and_pod_ip_holds_both_roles(maps: PinnedMaps) -> None:
    """An LB IP that is also some pod's IP: ingress takes the LB role (and the ports of the
    Service's pod), egress the pod role."""
    both = IPv4Address("10.244.0.99")
    st = MapState(
        services={both: ServiceEntry(POD4, True, False)},
        pods={both: PodEntry(LB4, False, True), POD4: PodEntry(both, True, False)},
        allowed={AllowedPort(POD4, Proto.UDP, 53), AllowedPort(both, Proto.TCP, 1)},
    )
    maps.apply(diff(maps.read_state(), st))
    assert maps.read_state() == st
    v = Addr4Val()
    assert bpfsys.map_lookup(maps.fds["addr4"], ctypes.c_uint32(be32(both)), v)
    assert (v.kind, v.flags, v.pod_flags, v.nports) == (3, 1, 2, 1)
    assert bytes(v.ports[0]) == port(17, 53)
    assert maps.lookup_service(both) == st.services[both]
    assert maps.lookup_pod(both) == st.pods[both]


def test_more_ports_than_fit_inline_spill_to_the_allow_map(maps: PinnedMaps) -> None:
    """Up to 8 allowed ports live in the addr value; with more, the value says so (nports
    0xff) and keeps the first 8 (sorted): the programs look the others up in allow4."""
    many = {AllowedPort(POD4, Proto.TCP, p) for p in range(1000, 1010)}
    st = MapState(
        services={LB4: ServiceEntry(POD4, True, False)},
        pods={POD4: PodEntry(LB4, True, False)},
        allowed=many,
    )
    maps.apply(diff(maps.read_state(), st))
    v = Addr4Val()
    assert bpfsys.map_lookup(maps.fds["addr4"], ctypes.c_uint32(be32(LB4)), v)
    assert v.nports == PORTS_SPILL
    assert [bytes(p) for p in v.ports] == [port(6, p) for p in range(1000, 1008)]
    assert all(maps.has_allowed(a) for a in many)
    # back to 2 ports: inline only again
    fewer = st.copy()
    fewer.allowed = {AllowedPort(POD4, Proto.TCP, p) for p in (1000, 1009)}
    maps.apply(diff(maps.read_state(), fewer))
    assert bpfsys.map_lookup(maps.fds["addr4"], ctypes.c_uint32(be32(LB4)), v)
    assert v.nports == 2
    assert [bytes(p) for p in v.ports[:3]] == [port(6, 1000), port(6, 1009), bytes(4)]
    assert maps.read_state() == fewer


def test_an_allowed_port_change_rewrites_every_address_that_reaches_the_pod(
    maps: PinnedMaps,
) -> None:
    """Only `allowed` changes: the addr values of the LB IPs whose Service goes to the pod
    and of the pod IP itself are rewritten with the new inline ports, nothing else."""
    lb2 = IPv4Address("192.0.2.12")
    st = DUAL.copy()
    st.services[lb2] = ServiceEntry(POD4, True, False)
    maps.apply(diff(maps.read_state(), st))
    later = st.copy()
    later.allowed.add(AllowedPort(POD4, Proto.TCP, 443))
    written: list[bytes] = []
    real = bpfsys.map_update_batch

    def spy(fd: int, keys: bytes, values: bytes, count: int, flags: int = 0) -> None:
        if fd == maps.fds["addr4"]:
            written.extend(keys[i * 4 : i * 4 + 4] for i in range(count))
        real(fd, keys, values, count, flags)

    bpfsys.map_update_batch = spy  # type: ignore[assignment]
    try:
        maps.apply(diff(maps.read_state(), later))
    finally:
        bpfsys.map_update_batch = real  # type: ignore[assignment]
    assert sorted(written) == sorted(a.packed for a in (LB4, lb2, POD4))
    for addr in (LB4, lb2, POD4):
        v = Addr4Val()
        assert bpfsys.map_lookup(maps.fds["addr4"], ctypes.c_uint32(be32(addr)), v)
        assert bytes(v.ports[1]) == port(6, 443), addr  # sorted: tcp/22, tcp/443, udp/53
    assert maps.read_state() == later


def test_read_state_repairs_inline_ports_edited_by_hand(
    maps: PinnedMaps, pin_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Inline ports are not part of a MapState, so no diff would see them: the agent's
    read_state() rewrites a value that disagrees with the allowed ports; a reader (maps dump)
    only reads."""
    maps.apply(diff(maps.read_state(), DUAL))
    key = ctypes.c_uint32(be32(LB4))
    good = Addr4Val()
    assert bpfsys.map_lookup(maps.fds["addr4"], key, good)
    bad = Addr4Val.from_buffer_copy(bytes(good))
    bad.ports[0].port = be16(9999)
    bpfsys.map_update(maps.fds["addr4"], key, bad)
    with PinnedMaps.open(pin_dir) as reader:
        assert reader.read_state() == DUAL
    now = Addr4Val()
    assert bpfsys.map_lookup(maps.fds["addr4"], key, now) and bytes(now) == bytes(bad)
    caplog.set_level(logging.WARNING)
    assert maps.read_state() == DUAL
    assert bpfsys.map_lookup(maps.fds["addr4"], key, now) and bytes(now) == bytes(good)
    warned = [r.levelname for r in caplog.records if r.name == "cozyebpf.datapath.maps"]
    assert warned == ["WARNING"], "the repair is reported"


def test_sizes_derive_from_max_services(pin_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    """Every Service-related map is sized from one number; open() takes whatever size the
    pins have; another size is migrated with the entries copied (the flow hint is rebuilt
    from the flows)."""
    with PinnedMaps.ensure(pin_dir, max_services=16) as m:
        assert m.sizes == {
            "addr4": 32,
            "allow4": 64,
            "flow4": 64,
            "addr6": 32,
            "allow6": 64,
            "flow6": 64,
            "frag4": 1024,
            "frag6": 1024,
            "flowhint": 16,
            "addrhint": 64,  # 64 bits per Service, at least 64 words
            "rolehint": 64,
            "svcstats": 17,  # a counter slot per Service, and slot 0 (never given out)
            "svcnames": 17,
            "limits": 17,  # the limits and buckets at each Service's slot
            "buckets": 17,
            "range4": 64,
            "range6": 64,
        }
        m.apply(diff(m.read_state(), DUAL))
        m.add_flows([Flow(POD4, IPv4Address("198.51.100.1"), 40000, 443, 6)])
    with PinnedMaps.open(pin_dir) as reader:
        assert reader.max_services == 16 and reader.read_state() == DUAL
    caplog.set_level(logging.WARNING)
    with PinnedMaps.ensure(pin_dir, max_services=64) as m:
        assert m.sizes["addr4"] == 128 and m.read_state() == DUAL
        limits = {x.map: (x.size, x.kinds) for x in m.capacity().limits}
        assert limits["addr4"] == (128, (("services", 4), ("pods", 4)))
        assert limits["allow6"] == (256, (("allowed", 6),))
        assert m.flows_by_pod() == {POD4: 1}
        assert m.hints_need_seed  # the flow hint was rebuilt, to be seeded from the flows


def _v6_second(st: MapState) -> MapState:
    """vm1's IPv6 half opens to whole-IP, vm3 goes, vm2 gets an IPv6 half."""
    out = st.copy()
    out.services[LB6] = ServiceEntry(POD6, False, True)
    out.pods[POD6] = PodEntry(LB6, False, True)
    out.allowed -= {a for a in out.allowed if a.pod_ip == POD6}
    del out.services[LB6_WHOLE], out.pods[POD6_WHOLE]
    out.services[IPv6Address("2001:db8::11")] = ServiceEntry(IPv6Address("fd00::7"), False, False)
    out.pods[IPv6Address("fd00::7")] = PodEntry(IPv6Address("2001:db8::11"), False, False)
    return out


def _v4_gone(st: MapState) -> MapState:
    return of_family(st, 6)


def _v6_gone(st: MapState) -> MapState:
    return of_family(st, 4)


def _all_gone(st: MapState) -> MapState:
    return MapState()


# (id, the next desired state from DUAL, the key counts after it)
CHANGES: list[tuple[str, Callable[[MapState], MapState], dict[str, int]]] = [
    (
        "ipv6-changes",
        _v6_second,
        {"addr4": 4, "addr6": 4, "allow4": 2, "allow6": 0},
    ),
    (
        "ipv4-removed",
        _v4_gone,
        {"addr4": 0, "addr6": 4, "allow4": 0, "allow6": 3},
    ),
    (
        "ipv6-removed",
        _v6_gone,
        {"addr4": 4, "addr6": 0, "allow4": 2, "allow6": 0},
    ),
    (
        "all-removed",
        _all_gone,
        {"addr4": 0, "addr6": 0, "allow4": 0, "allow6": 0},
    ),
]


@pytest.mark.parametrize(
    ("change", "expected_counts"), [c[1:] for c in CHANGES], ids=[c[0] for c in CHANGES]
)
def test_second_diff_round_trips(
    maps: PinnedMaps, change: Callable[[MapState], MapState], expected_counts: dict[str, int]
) -> None:
    maps.apply(diff(maps.read_state(), DUAL))
    desired = change(DUAL)
    d = diff(maps.read_state(), desired)
    assert apply_to(DUAL, d) == desired
    maps.apply(d)
    assert maps.read_state() == desired
    assert counts(maps) == expected_counts
    maps.apply(diff(maps.read_state(), desired))  # idempotent
    assert maps.read_state() == desired


def test_apply_order_never_opens_a_hole(maps: PinnedMaps, monkeypatch: pytest.MonkeyPatch) -> None:
    """Addresses that go away entirely are deleted first (nothing that stays uses them),
    allowed ports of both families are added before the values that need them and deleted
    last; services and pods of one address are one addr value; each write goes to the map of
    its family."""
    maps.apply(diff(maps.read_state(), DUAL))
    names = {fd: name for name, fd in maps.fds.items()}
    calls: list[tuple[str, str]] = []

    def recorder(op: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(fd: int, *args: Any) -> Any:
            calls.append((op, names[fd]))
            return real(fd, *args)

        return call

    monkeypatch.setattr(bpfsys, "map_update_batch", recorder("update", bpfsys.map_update_batch))
    monkeypatch.setattr(bpfsys, "map_delete_batch", recorder("delete", bpfsys.map_delete_batch))
    desired = MapState(
        services={
            LB4: ServiceEntry(POD4_WHOLE, True, False),
            LB6: ServiceEntry(POD6_WHOLE, True, False),
        },
        pods={POD4_WHOLE: PodEntry(LB4, True, False), POD6_WHOLE: PodEntry(LB6, True, False)},
        allowed={AllowedPort(POD4_WHOLE, Proto.TCP, 80), AllowedPort(POD6_WHOLE, Proto.TCP, 80)},
    )
    maps.apply(diff(maps.read_state(), desired))
    assert calls == [
        ("delete", "addr4"),  # addresses that go away entirely: room in a full map
        ("delete", "addr6"),
        ("update", "allow4"),
        ("update", "allow6"),
        ("update", "addr4"),
        ("update", "addr6"),
        ("delete", "allow4"),
        ("delete", "allow6"),
        # the address hints: no key comes that was not there (its bit would be set before
        # addr4's update); the bits of the keys gone are cleared last, 0.3.0's and by role
        ("update", "addrhint"),
        ("update", "rolehint"),
    ], calls  # one batch per map and step
    monkeypatch.undo()
    assert maps.read_state() == desired


def test_without_batch_operations_each_entry_is_written(maps: PinnedMaps) -> None:
    """A kernel that refuses batch operations gets one call per entry, with the same result."""
    maps._no_batch = True
    maps.apply(diff(maps.read_state(), DUAL))
    assert maps.read_state() == DUAL
    maps.apply(diff(maps.read_state(), MapState()))
    assert maps.read_state() == MapState()


def test_a_diff_that_mixes_families_is_refused_before_any_write(maps: PinnedMaps) -> None:
    maps.apply(diff(maps.read_state(), DUAL))
    d = MapDiff(allowed_add={AllowedPort(POD6, Proto.TCP, 8080)}, services_del={LB4})
    d.services_set[LB6] = ServiceEntry(POD4, True, False)
    with pytest.raises(DatapathError) as info:
        maps.apply(d)
    assert str(info.value) == (
        f"refusing to program maps in {maps.pin_dir}: an entry mixes address families "
        "(service 2001:db8::10 -> pod 10.244.0.5)"
    )
    assert maps.read_state() == DUAL


def _flow6(pod: IPv6Address, remote: IPv6Address, pod_port: int, proto: int) -> Flow6Key:
    return Flow6Key(
        pod_ip=ip6(pod),
        remote_ip=ip6(remote),
        pod_port=be16(pod_port),
        remote_port=be16(443 if proto != 58 else 0),
        proto=proto,
    )


def test_flows_by_pod_counts_both_families(maps: PinnedMaps, pin_dir: str) -> None:
    from cozyebpf.dump import dump_pinned

    maps.apply(diff(maps.read_state(), DUAL))
    seen = Flow4Val(last_seen_ns=1)
    for key in (
        _flow6(POD6, REMOTE6, 40000, 6),
        _flow6(POD6, REMOTE6, 7, 58),  # an ICMPv6 echo: identifier 7
        _flow6(POD6_WHOLE, REMOTE6, 40001, 17),
    ):
        bpfsys.map_update(maps.fds["flow6"], key, seen)
    flow4 = Flow4Key(
        pod_ip=be32(POD4),
        remote_ip=be32(IPv4Address("198.51.100.1")),
        pod_port=be16(40000),
        remote_port=be16(443),
        proto=6,
    )
    bpfsys.map_update(maps.fds["flow4"], flow4, seen)
    expected: dict[IPAddress, int] = {POD4: 1, POD6: 2, POD6_WHOLE: 1}
    assert maps.flows_by_pod() == expected
    dumped = dump_pinned(pin_dir)
    assert [(s["lb_ip"], s["pod_ip"], s["flows"]) for s in dumped["services"]] == [
        ("192.0.2.10", "10.244.0.5", 1),
        ("192.0.2.11", "10.244.0.7", 0),
        ("2001:db8::10", "fd00:10:244::5", 2),
        (str(LB6_WHOLE), str(POD6_WHOLE), 1),
    ]
    assert dumped["flows"] == 4


def test_unknown_protocol_in_allow6_is_skipped_and_warned(
    maps: PinnedMaps, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="cozyebpf.datapath.maps")
    maps.apply(diff(maps.read_state(), DUAL))
    gre = Allow6Key(pod_ip=ip6(POD6), proto=47, port=0)
    bpfsys.map_update(maps.fds["allow6"], gre, ctypes.c_uint8(1))
    assert maps.read_state() == DUAL  # skipped
    assert [r.levelname for r in caplog.records] == ["WARNING"]  # and warned


def test_raw_ipv6_keys_are_read_back_normalised(maps: PinnedMaps) -> None:
    """An entry written by someone else (drift) is read as the address it holds."""
    raw = Ip6.from_buffer_copy(bytes.fromhex("20010db8000000000000000000000abc"))
    val = Addr6Val(pod_ip=ip6(POD6), kind=1, flags=0x01)
    bpfsys.map_update(maps.fds["addr6"], raw, val)
    assert maps.read_state() == MapState(
        services={ip_address("2001:db8::abc"): ServiceEntry(POD6, True, False)}
    )
    assert os.path.exists(os.path.join(maps.pin_dir, "addr6"))


def test_source_ranges_round_trip_and_flag_the_addresses(maps: PinnedMaps, pin_dir: str) -> None:
    """A restricted pod's networks go to range4/range6 and its addresses carry CZ_F_RANGES (the
    LB IP's ingress flags and the pod's own egress flags); a pod restricted to nothing has the
    flag and no entry; changes add before and delete after; unrestricted pods are unflagged."""
    from ipaddress import ip_network

    from cozyebpf.datapath.layout import F_RANGES

    st = DUAL.copy()
    st.ranges = {
        POD4_WHOLE: frozenset({ip_network("198.51.100.0/24"), ip_network("192.0.2.7/32")}),
        POD6: frozenset(),
    }
    maps.apply(diff(maps.read_state(), st))
    assert maps.read_state() == st
    with PinnedMaps.open(pin_dir) as reader:
        assert reader.read_state() == st
    assert key_count(maps, "range4") == 2 and key_count(maps, "range6") == 0

    def flags(addr: IPAddress) -> tuple[int, int]:
        v = maps._addr(addr)
        assert v is not None
        return v.flags & F_RANGES, v.pod_flags & F_RANGES

    assert flags(LB4_WHOLE) == (F_RANGES, 0)  # ingress of the LB IP reaches the pod
    assert flags(POD4_WHOLE) == (F_RANGES, F_RANGES)  # its own ingress and egress
    assert flags(LB6) == (F_RANGES, 0) and flags(LB4) == (0, 0)
    # another set, then none
    st2 = st.copy()
    st2.ranges = {POD4_WHOLE: frozenset({ip_network("198.51.100.0/25")})}
    maps.apply(diff(maps.read_state(), st2))
    assert maps.read_state() == st2
    assert key_count(maps, "range4") == 1 and flags(LB6) == (0, 0)
    maps.apply(diff(maps.read_state(), DUAL))
    assert maps.read_state() == DUAL and key_count(maps, "range4") == 0
    assert flags(POD4_WHOLE) == (0, 0)
    # entries of an unrestricted pod (a write that stopped half way) go at the next read
    maps._write_ranges([struct.pack("=I", 56) + POD4.packed + bytes([198, 51, 100, 0])])
    assert maps.read_state() == DUAL and key_count(maps, "range4") == 0
