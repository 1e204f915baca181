"""Pinned maps with another layout are never reused as they are: same key/value layout with
another size is migrated (entries copied), anything else is rebuilt; both are logged (the
in-place upgrades of older layouts without a lost packet are in tests/datapath/test_upgrade.py)."""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Iterator
from ipaddress import IPv4Address as A
from pathlib import Path

import pytest

from cozyebpf.datapath import bpfsys
from cozyebpf.datapath.layout import (
    ADDR4,
    FLOW4,
    LAYOUT_VERSION,
    META,
    Flow4Key,
    Flow4Val,
    MetaVal,
    be32,
)
from cozyebpf.datapath.maps import PinnedMaps
from cozyebpf.errors import DatapathError
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
    """How many warnings (or worse) the maps logged (their pins, since the split of maps.py)."""
    names = ("cozyebpf.datapath.maps", "cozyebpf.datapath.pins")
    return sum(r.levelno >= logging.WARNING for r in caplog.records if r.name in names)


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
