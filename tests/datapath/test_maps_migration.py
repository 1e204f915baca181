"""Pinned maps with another layout are never reused as they are: same key/value layout with
another size is migrated (entries copied), anything else is rebuilt; both are logged. Maps of
layout version 1 are upgraded in place (the agent-level test without a lost packet is in
tests/datapath/test_upgrade.py)."""

from __future__ import annotations

import ctypes
import logging
import os
import struct
from collections.abc import Iterator
from ipaddress import IPv4Address as A
from pathlib import Path

import pytest

from cozyebpf.datapath import bpfsys
from cozyebpf.datapath.layout import (
    ADDR4,
    ALLOW4,
    ALLOW6,
    FLOW4,
    FLOW6,
    FRAG4,
    FRAG6,
    LAYOUT_VERSION,
    META,
    STATS,
    V1_REPLACED,
    Flow4Key,
    Flow4Val,
    MetaVal,
    be32,
    flow_hint_bit,
)
from cozyebpf.datapath.maps import Flow, PinnedMaps
from cozyebpf.errors import DatapathError
from cozyebpf.state import AllowedPort, MapState, PodEntry, Proto, ServiceEntry, diff
from tests.support.env import unique_prefix


@pytest.fixture
def pin_dir() -> Iterator[str]:
    from cozyebpf.datapath.attach import detach_all

    path = f"/sys/fs/bpf/{unique_prefix('m')}"
    os.makedirs(path, mode=0o700)
    yield path
    detach_all(path)


def pin_map(path: str, map_type: int, key: int, value: int, entries: int) -> int:
    fd = bpfsys.map_create(map_type, key, value, entries, "cz_old")
    bpfsys.obj_pin(fd, path)
    return fd


def flow(i: int) -> Flow4Key:
    return Flow4Key(
        pod_ip=be32(A("10.244.1.10")),
        remote_ip=be32(A(f"198.51.100.{i}")),
        pod_port=i,
        remote_port=443,
        proto=6,
    )


def warnings(caplog: pytest.LogCaptureFixture) -> int:
    """How many warnings (or worse) the maps logged."""
    return sum(
        r.levelno >= logging.WARNING for r in caplog.records if r.name == "cozyebpf.datapath.maps"
    )


def test_old_layouts_are_migrated_or_rebuilt(
    pin_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    # an old flow table: same key and value, a smaller size, two flows in it
    old_flows = pin_map(f"{pin_dir}/flow4", FLOW4.map_type, FLOW4.key_size, FLOW4.value_size, 1024)
    for i in (1, 2):
        bpfsys.map_update(old_flows, flow(i), Flow4Val(last_seen_ns=i))
    # an address map whose value was 4 bytes
    old_addr = pin_map(f"{pin_dir}/addr4", ADDR4.map_type, 4, 4, 16)
    bpfsys.map_update(old_addr, ctypes.c_uint32(1), ctypes.c_uint32(2))
    # the layout version is current
    meta = pin_map(f"{pin_dir}/meta", META.map_type, META.key_size, META.value_size, 1)
    bpfsys.map_update(meta, ctypes.c_uint32(0), MetaVal(layout_version=LAYOUT_VERSION))
    for fd in (old_flows, old_addr, meta):
        os.close(fd)

    with PinnedMaps.ensure(pin_dir) as maps:
        for spec in (FLOW4, ADDR4):
            info = bpfsys.map_info(maps.fds[spec.name])
            assert (info.key_size, info.value_size, info.max_entries) == (
                spec.key_size,
                spec.value_size,
                spec.max_entries,
            )
        assert maps.flows_by_pod() == {A("10.244.1.10"): 2}
        assert maps.read_state().services == {}
    # each map migrated or rebuilt is reported, with a warning
    assert warnings(caplog) == 2, caplog.text
    with PinnedMaps.open(pin_dir) as again:  # and now a reader accepts them
        assert again.flows_by_pod() == {A("10.244.1.10"): 2}


def test_another_layout_version_rebuilds_everything(
    pin_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    with PinnedMaps.ensure(pin_dir) as maps:
        bpfsys.map_update(maps.fds["flow4"], flow(1), Flow4Val(last_seen_ns=1))
        bpfsys.map_update(maps.fds["meta"], ctypes.c_uint32(0), MetaVal(layout_version=0))
    with pytest.raises(
        DatapathError, match=f"layout version 0, this cozyebpf uses {LAYOUT_VERSION}"
    ):
        PinnedMaps.open(pin_dir)
    caplog.set_level(logging.WARNING)
    with PinnedMaps.ensure(pin_dir) as maps:
        assert maps.flows_by_pod() == {}
    assert warnings(caplog) >= 1, "dropping the old entries warns"


def test_a_reader_refuses_a_wrong_layout(pin_dir: str) -> None:
    PinnedMaps.ensure(pin_dir).close()
    os.unlink(f"{pin_dir}/addr4")
    os.close(pin_map(f"{pin_dir}/addr4", ADDR4.map_type, 4, 4, 16))
    with pytest.raises(DatapathError, match=r"addr4 has another layout \(value size 4 \(want 56\)"):
        PinnedMaps.open(pin_dir)


def test_detach_never_deletes_what_is_not_ours(tmp_path: Path, pin_dir: str) -> None:
    from cozyebpf.datapath.attach import detach_all

    (tmp_path / "precious").write_text("keep me")
    with pytest.raises(DatapathError, match="is not on a bpf filesystem"):
        detach_all(str(tmp_path))
    assert (tmp_path / "precious").read_text() == "keep me"
    PinnedMaps.ensure(pin_dir).close()
    os.mkdir(f"{pin_dir}/someone-elses")
    removed = detach_all(pin_dir)
    assert f"{pin_dir}/addr4" in removed and os.path.isdir(f"{pin_dir}/someone-elses")
    os.rmdir(f"{pin_dir}/someone-elses")


LB, POD, LB6, POD6 = A("203.0.113.10"), A("10.244.1.10"), "2001:db8::10", "fd00:10:244::10"
REMOTE = A("198.51.100.1")


def pin_layout_1(pin_dir: str) -> dict[str, int]:
    """The maps as a cozyebpf of layout version 1 left them: svc4/pod4/svc6/pod6 beside the
    maps whose layout has not changed since, with entries (fds by name, all open)."""
    from ipaddress import IPv6Address

    fds = {}
    for spec in (META, STATS, ALLOW4, FLOW4, ALLOW6, FLOW6, FRAG4, FRAG6, *V1_REPLACED):
        fds[spec.name] = pin_map(
            f"{pin_dir}/{spec.name}", spec.map_type, spec.key_size, spec.value_size,
            spec.max_entries,
        )  # fmt: skip
    bpfsys.map_update(fds["meta"], ctypes.c_uint32(0), MetaVal(layout_version=1))

    def put(name: str, key: bytes, value: bytes) -> None:
        k = ctypes.create_string_buffer(key, len(key))
        bpfsys.map_update(fds[name], k, ctypes.create_string_buffer(value, len(value)))

    pod6, lb6 = IPv6Address(POD6), IPv6Address(LB6)
    put("svc4", LB.packed, POD.packed + bytes([1, 0, 0, 0]))  # port filter
    put("pod4", POD.packed, LB.packed + bytes([1, 0, 0, 0]))
    put("svc6", lb6.packed, pod6.packed + bytes([0, 0, 0, 0]))  # whole-IP
    put("pod6", pod6.packed, lb6.packed + bytes([0, 0, 0, 0]))
    put("allow4", POD.packed + bytes([6, 0]) + (22).to_bytes(2, "big"), b"\x01")
    key = POD.packed + A("198.51.100.7").packed + struct.pack("!HHB3x", 7, 443, 6)
    bpfsys.map_update(fds["flow4"], ctypes.create_string_buffer(key, 16), Flow4Val(5))
    return fds


def test_layout_1_is_upgraded_in_place(pin_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    """addr4/addr6 are filled from layout 1's svc/pod maps beside them (which stay, and follow
    every apply, until finish_upgrade()); allowed ports, flows, fragments and counters are kept
    as they are, and the flows get their flow-hint bits."""
    from ipaddress import IPv6Address

    old = pin_layout_1(pin_dir)
    caplog.set_level(logging.WARNING)
    want = MapState(
        services={
            LB: ServiceEntry(POD, True, False),
            IPv6Address(LB6): ServiceEntry(IPv6Address(POD6), False, False),
        },
        pods={
            POD: PodEntry(LB, True, False),
            IPv6Address(POD6): PodEntry(IPv6Address(LB6), False, False),
        },
        allowed={AllowedPort(POD, Proto.TCP, 22)},
    )
    with PinnedMaps.ensure(pin_dir) as maps:
        assert maps.upgrading and maps.hints_need_seed
        assert maps.read_state() == want
        assert maps.flows() == {Flow(POD, A("198.51.100.7"), 7, 443, 6)}
        assert bpfsys.map_info(maps.fds["flow4"]).id == bpfsys.map_info(old["flow4"]).id
        assert bpfsys.map_info(maps.fds["allow4"]).id == bpfsys.map_info(old["allow4"]).id
        lay = maps.layout
        bit = flow_hint_bit(POD.packed, A("198.51.100.7").packed, 7, 443, 6, lay.hint_log2)
        word = ctypes.c_uint64()
        assert bpfsys.map_lookup(maps.fds["flowhint"], ctypes.c_uint32(2 * (bit >> 6) + 1), word)
        assert word.value >> (bit & 63) & 1, "the user-space half holds the flow's bit"
        # while layout 1's programs may run, its maps follow the changes
        later = want.copy()
        later.services[LB] = ServiceEntry(POD, False, True)
        maps.apply(diff(maps.read_state(), later))
        v = ctypes.create_string_buffer(8)
        assert bpfsys.map_lookup(old["svc4"], ctypes.create_string_buffer(LB.packed, 4), v)
        assert v.raw == POD.packed + bytes([2, 0, 0, 0])
        assert all(os.path.exists(f"{pin_dir}/{s.name}") for s in V1_REPLACED)
        maps.finish_upgrade()
        assert not maps.upgrading
        assert not any(os.path.exists(f"{pin_dir}/{s.name}") for s in V1_REPLACED)
    assert f"from layout version 1 to {LAYOUT_VERSION}: 2 services and 2 pods moved" in caplog.text
    assert "removed pod4, pod6, svc4, svc6" in caplog.text
    with PinnedMaps.open(pin_dir) as reader:
        assert reader.read_state() == later
    for fd in old.values():
        os.close(fd)


def test_an_unfinished_upgrade_is_finished_by_the_next_start(
    pin_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent that died between ensure() and finish_upgrade(): the next one finds layout 2
    beside layout 1's maps, keeps what it has, holds the old maps and finishes."""
    for fd in pin_layout_1(pin_dir).values():
        os.close(fd)
    PinnedMaps.ensure(pin_dir).close()  # dies before finish_upgrade()
    caplog.set_level(logging.WARNING)
    with PinnedMaps.ensure(pin_dir) as maps:
        assert maps.upgrading and maps.hints_need_seed
        assert maps.read_state().services[LB] == ServiceEntry(POD, True, False)
        maps.finish_upgrade()
    assert "the upgrade from layout version 1 was not finished; finishing it" in caplog.text
    assert not os.path.exists(f"{pin_dir}/svc4")
