"""Pinned maps with another layout are never reused as they are: same key/value layout with
another size is migrated (entries copied), anything else is rebuilt; both are logged (the
in-place upgrades of older layouts without a lost packet are in tests/datapath/test_upgrade.py)."""

from __future__ import annotations

import ctypes
import logging
import os
import struct
from collections.abc import Iterator
from ipaddress import IPv4Address as A
from pathlib import Path

import pytest

from cozyebpf import __version__
from cozyebpf.datapath import bpfsys
from cozyebpf.datapath.layout import (
    ADDR4,
    FLOW4,
    LAYOUT_VERSION,
    META,
    OLDEST_COMPATIBLE,
    Flow4Key,
    Flow4Val,
    MetaVal,
    be32,
)
from cozyebpf.datapath.maps import PinnedMaps
from cozyebpf.datapath.pins import LayoutTooNew, PinnedLayout, read_pinned_meta
from cozyebpf.errors import DatapathError
from tests.support.env import unique_prefix
from tests.support.labtools import mark_pins


@pytest.fixture
def pin_dir() -> Iterator[str]:
    from cozyebpf.datapath.attach import detach_all

    path = f"/sys/fs/bpf/{unique_prefix('m')}"
    os.makedirs(path, mode=0o700)
    yield path
    if os.path.exists(f"{path}/newer"):  # a newer layout's map (not ours: detach leaves it)
        os.unlink(f"{path}/newer")
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


# -- the compatibility contract between releases (docs/design.md, *Releases and map layouts*) --


def ids(pin_dir: str) -> dict[str, int]:
    out = {}
    for name in sorted(os.listdir(pin_dir)):
        if os.path.isfile(f"{pin_dir}/{name}"):
            fd = bpfsys.obj_get(f"{pin_dir}/{name}")
            out[name] = bpfsys.map_info(fd).id
            os.close(fd)
    return out


def two_flows(pin_dir: str) -> None:
    with PinnedMaps.ensure(pin_dir) as maps:
        for i in (1, 2):
            bpfsys.map_update(maps.fds["flow4"], flow(i), Flow4Val(last_seen_ns=i))


def test_a_newer_layout_that_names_ours_compatible_keeps_every_entry(pin_dir: str) -> None:
    """A rollback from a release whose layout only added (one more map here): this agent runs
    on its maps as they are, flows included (2 -> 2, not 0), and records its own layout."""
    two_flows(pin_dir)
    os.close(pin_map(f"{pin_dir}/newer", ADDR4.map_type, 4, 4, 16))  # layout 7's alone
    mark_pins(pin_dir, LAYOUT_VERSION + 1, LAYOUT_VERSION)
    before = ids(pin_dir)
    with PinnedMaps.ensure(pin_dir) as maps:
        assert maps.flows_by_pod() == {A("10.244.1.10"): 2}
    assert ids(pin_dir) == before, "every map kept as it is, the newer one left pinned"
    found = read_pinned_meta(pin_dir)
    assert found == PinnedLayout(LAYOUT_VERSION, OLDEST_COMPATIBLE, __version__)


@pytest.mark.parametrize(
    "oldest", [LAYOUT_VERSION + 1, 0], ids=["oldest-is-newer", "oldest-not-recorded"]
)
def test_a_newer_layout_it_cannot_run_on_is_refused_untouched(pin_dir: str, oldest: int) -> None:
    two_flows(pin_dir)
    mark_pins(pin_dir, LAYOUT_VERSION + 1, oldest)
    before = ids(pin_dir)
    new = LAYOUT_VERSION + 1
    with pytest.raises(LayoutTooNew) as e:
        PinnedMaps.ensure(pin_dir)
    msg = str(e.value)
    assert f"have layout {new}, written by cozyebpf 0.3.0, and need layout {new} or newer" in msg
    assert f"this cozyebpf {__version__} has layout {LAYOUT_VERSION}. Nothing was changed" in msg
    assert f"cozyebpf detach --pin-dir {pin_dir}" in msg
    assert ids(pin_dir) == before
    assert read_pinned_meta(pin_dir) == PinnedLayout(new, oldest, "0.3.0")
    # a reader (maps dump, status) says the same and reads nothing
    with pytest.raises(LayoutTooNew, match="cannot read them: use the `cozyebpf` of cozyebpf"):
        PinnedMaps.open(pin_dir)
    # the flows are still there for the release that can run on them
    mark_pins(pin_dir, LAYOUT_VERSION, LAYOUT_VERSION)
    with PinnedMaps.open(pin_dir) as maps:
        assert maps.flows_by_pod() == {A("10.244.1.10"): 2}


def test_a_newer_layout_that_claims_ours_but_changed_a_map_is_refused(pin_dir: str) -> None:
    two_flows(pin_dir)
    os.unlink(f"{pin_dir}/addr4")
    os.close(pin_map(f"{pin_dir}/addr4", ADDR4.map_type, 4, 4, 16))
    mark_pins(pin_dir, LAYOUT_VERSION + 1, LAYOUT_VERSION)
    before = ids(pin_dir)
    with pytest.raises(LayoutTooNew, match=r"yet its addr4 has value size 4 \(want 56\)"):
        PinnedMaps.ensure(pin_dir)
    assert ids(pin_dir) == before


def test_counters_whose_values_grew_at_their_end_are_copied_zero_padded(pin_dir: str) -> None:
    """Layout 6 gave svcstats' drops[] 16 slots instead of 8: the counters of layout 5 are
    copied into the new map, each CPU's value zero-padded, not dropped."""
    from cozyebpf.datapath.layout import SvcStat, possible_cpus

    old_size = ctypes.sizeof(SvcStat) - 8 * 8  # drops[8]
    cpus = possible_cpus()
    with PinnedMaps.ensure(pin_dir, max_services=4) as maps:
        slots = maps.layout.svcstats.max_entries
    os.unlink(f"{pin_dir}/svcstats")
    old = pin_map(f"{pin_dir}/svcstats", bpfsys.BPF_MAP_TYPE_PERCPU_ARRAY, 4, old_size, slots)
    stride = (old_size + 7) // 8 * 8
    val = ctypes.create_string_buffer(stride * cpus)
    for cpu in range(cpus):  # in_packets = 10 + cpu, drops[7] = 70 + cpu
        vals = [10 + cpu, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 70 + cpu]
        ctypes.memmove(ctypes.byref(val, cpu * stride), struct.pack("12Q", *vals), old_size)
    bpfsys.map_update(old, ctypes.c_uint32(1), val)
    os.close(old)
    mark_pins(pin_dir, 5, 0, "0.0.0")
    with PinnedMaps.ensure(pin_dir, max_services=4) as maps:
        new = ctypes.create_string_buffer(ctypes.sizeof(SvcStat) * cpus)
        assert bpfsys.map_lookup(maps.fds["svcstats"], ctypes.c_uint32(1), new)
    for cpu in range(cpus):
        got = SvcStat.from_buffer_copy(new.raw, cpu * ctypes.sizeof(SvcStat))
        assert got.in_packets == 10 + cpu and list(got.drops) == [0] * 7 + [70 + cpu] + [0] * 8


def test_a_replaced_prog_array_stays_pinned_until_dropped(pin_dir: str) -> None:
    """A prog array of another size is replaced, but its pin moves to retired/<name>-<id>
    (the entry programs still attached tail-call through it: an unpinned prog array empties
    itself) until drop_retired, after the new programs are attached; `detach` removes what an
    agent stopped in between left. (The same upgrade under traffic, the compile held: tests/
    datapath/test_upgrade.py.)"""
    from cozyebpf.datapath.attach import detach_all
    from cozyebpf.datapath.pins import drop_retired

    PinnedMaps.ensure(pin_dir, max_services=16).close()
    os.unlink(f"{pin_dir}/tail_tc")
    os.close(pin_map(f"{pin_dir}/tail_tc", bpfsys.BPF_MAP_TYPE_PROG_ARRAY, 4, 4, 8))
    old_id = map_id(f"{pin_dir}/tail_tc")
    PinnedMaps.ensure(pin_dir, max_services=16).close()
    assert os.listdir(f"{pin_dir}/retired") == [f"tail_tc-{old_id}"]
    assert map_id(f"{pin_dir}/retired/tail_tc-{old_id}") == old_id, "the old array, still pinned"
    assert map_id(f"{pin_dir}/tail_tc") != old_id
    assert drop_retired(pin_dir) == [f"{pin_dir}/retired/tail_tc-{old_id}"]
    assert not os.path.exists(f"{pin_dir}/retired")
    # an agent stopped between the two: detach removes it with the rest
    os.unlink(f"{pin_dir}/tail_tc")
    os.close(pin_map(f"{pin_dir}/tail_tc", bpfsys.BPF_MAP_TYPE_PROG_ARRAY, 4, 4, 8))
    PinnedMaps.ensure(pin_dir, max_services=16).close()
    assert os.path.isdir(f"{pin_dir}/retired")
    removed = detach_all(pin_dir)
    assert any("/retired/tail_tc-" in r for r in removed) and not os.path.exists(pin_dir)


def map_id(path: str) -> int:
    fd = bpfsys.obj_get(path)
    try:
        return bpfsys.map_info(fd).id
    finally:
        os.close(fd)
