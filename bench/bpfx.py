"""bpf(2) calls the benchmark needs and the product does not (yet) have: BPF_PROG_RUN with live
frames, batch map operations, run-time statistics of programs.

Attribute layouts follow `union bpf_attr` in include/uapi/linux/bpf.h. The batch functions are
written so that they can move into cozyebpf/datapath/bpfsys.py as they are (see bench/README.md).
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass

from cozyebpf.datapath import bpfsys

BPF_MAP_LOOKUP_BATCH = 24
BPF_MAP_UPDATE_BATCH = 26
BPF_MAP_DELETE_BATCH = 27
BPF_ENABLE_STATS = 32
BPF_STATS_RUN_TIME = 0
BPF_F_TEST_XDP_LIVE_FRAMES = 1 << 1

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_ATTR_SIZE = 144


def _sys_bpf(cmd: int, attr: ctypes.Structure, what: str) -> int:
    """bpf(2) with `attr` zero-padded to the size the kernel checks; attr is copied back."""
    buf = ctypes.create_string_buffer(_ATTR_SIZE)
    ctypes.memmove(buf, ctypes.addressof(attr), ctypes.sizeof(attr))
    ret = _libc.syscall(bpfsys.SYS_BPF, cmd, buf, _ATTR_SIZE)
    ctypes.memmove(ctypes.addressof(attr), buf, ctypes.sizeof(attr))
    if ret < 0:
        err = ctypes.get_errno()
        raise bpfsys.BpfError(err, f"{what}: {os.strerror(err)}")
    return int(ret)


# --- batch map operations ------------------------------------------------------------------


class _MapBatch(ctypes.Structure):
    _fields_ = [
        ("in_batch", ctypes.c_uint64),
        ("out_batch", ctypes.c_uint64),
        ("keys", ctypes.c_uint64),
        ("values", ctypes.c_uint64),
        ("count", ctypes.c_uint32),
        ("map_fd", ctypes.c_uint32),
        ("elem_flags", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
    ]


def map_update_batch(
    fd: int, keys: bytes, values: bytes, count: int, elem_flags: int = bpfsys.BPF_ANY
) -> int:
    """BPF_MAP_UPDATE_BATCH: `keys` and `values` are `count` packed keys / values. Returns how
    many were written (all, or raises BpfError after the kernel wrote some)."""
    if count == 0:
        return 0
    kbuf = ctypes.create_string_buffer(keys, len(keys))
    vbuf = ctypes.create_string_buffer(values, len(values))
    attr = _MapBatch(
        keys=ctypes.addressof(kbuf),
        values=ctypes.addressof(vbuf),
        count=count,
        map_fd=fd,
        elem_flags=elem_flags,
    )
    _sys_bpf(BPF_MAP_UPDATE_BATCH, attr, "map update batch")
    return int(attr.count)


def map_delete_batch(fd: int, keys: bytes, key_size: int) -> int:
    """BPF_MAP_DELETE_BATCH of packed keys; keys that are not there are skipped (the kernel
    stops at the first missing key with ENOENT and reports how far it got: continue after it).
    Returns how many were deleted."""
    n = len(keys) // key_size
    deleted = 0
    start = 0
    while start < n:
        kbuf = ctypes.create_string_buffer(keys[start * key_size :], (n - start) * key_size)
        attr = _MapBatch(keys=ctypes.addressof(kbuf), count=n - start, map_fd=fd)
        try:
            _sys_bpf(BPF_MAP_DELETE_BATCH, attr, "map delete batch")
        except bpfsys.BpfError as e:
            if e.errno != errno.ENOENT:
                raise
            deleted += int(attr.count)
            start += int(attr.count) + 1  # skip the missing key
            continue
        deleted += int(attr.count)
        break
    return deleted


def map_lookup_batch(
    fd: int, key_size: int, value_size: int, max_entries: int, chunk: int = 4096
) -> list[tuple[bytes, bytes]]:
    """Every (key, value) of a hash map with BPF_MAP_LOOKUP_BATCH, `chunk` entries a call."""
    out: list[tuple[bytes, bytes]] = []
    kbuf = ctypes.create_string_buffer(key_size * chunk)
    vbuf = ctypes.create_string_buffer(value_size * chunk)
    token_in = ctypes.create_string_buffer(max(key_size, 8))
    token_out = ctypes.create_string_buffer(max(key_size, 8))
    first = True
    while True:
        attr = _MapBatch(
            in_batch=0 if first else ctypes.addressof(token_in),
            out_batch=ctypes.addressof(token_out),
            keys=ctypes.addressof(kbuf),
            values=ctypes.addressof(vbuf),
            count=chunk,
            map_fd=fd,
        )
        done = False
        try:
            _sys_bpf(BPF_MAP_LOOKUP_BATCH, attr, "map lookup batch")
        except bpfsys.BpfError as e:
            if e.errno != errno.ENOENT:
                raise
            done = True
        n = int(attr.count)
        kr, vr = kbuf.raw, vbuf.raw
        out.extend(
            (kr[i * key_size : (i + 1) * key_size], vr[i * value_size : (i + 1) * value_size])
            for i in range(n)
        )
        if done:
            return out
        ctypes.memmove(token_in, token_out, len(token_out))
        first = False


# --- BPF_PROG_RUN with live frames ------------------------------------------------------------


class _XdpMd(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_uint32),
        ("data_end", ctypes.c_uint32),
        ("data_meta", ctypes.c_uint32),
        ("ingress_ifindex", ctypes.c_uint32),
        ("rx_queue_index", ctypes.c_uint32),
        ("egress_ifindex", ctypes.c_uint32),
    ]


def xdp_live_run(prog_fd: int, frame: bytes, ifindex: int, repeat: int, batch: int = 64) -> int:
    """Run an XDP program `repeat` times on live frames "received" on `ifindex` (of the calling
    thread's network namespace): XDP_TX transmits each through that device, as xdp-trafficgen
    does. Returns the kernel's ns per frame."""
    din = ctypes.create_string_buffer(frame, len(frame))
    ctx = _XdpMd(data=0, data_end=len(frame), ingress_ifindex=ifindex)
    attr = bpfsys._TestRun(
        prog_fd=prog_fd,
        data_size_in=len(frame),
        data_in=ctypes.addressof(din),
        repeat=repeat,
        ctx_size_in=ctypes.sizeof(ctx),
        ctx_in=ctypes.addressof(ctx),
        flags=BPF_F_TEST_XDP_LIVE_FRAMES,
        batch_size=batch,
    )
    _sys_bpf(bpfsys.BPF_PROG_TEST_RUN, attr, "live-frames test run")
    return int(attr.duration)


# --- run-time statistics --------------------------------------------------------------------


class _EnableStats(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint32)]


def enable_stats() -> int:
    """BPF_ENABLE_STATS(BPF_STATS_RUN_TIME): the same switch as sysctl kernel.bpf_stats_enabled,
    held by the returned fd and released (even on a crash) when it is closed."""
    return _sys_bpf(BPF_ENABLE_STATS, _EnableStats(type=BPF_STATS_RUN_TIME), "enable stats")


class _ProgInfoStats(ctypes.Structure):
    _fields_ = [
        ("_head", ctypes.c_uint8 * 192),
        ("run_time_ns", ctypes.c_uint64),
        ("run_cnt", ctypes.c_uint64),
        ("_tail", ctypes.c_uint8 * 64),
    ]


class _InfoByFd(ctypes.Structure):
    _fields_ = [
        ("bpf_fd", ctypes.c_uint32),
        ("info_len", ctypes.c_uint32),
        ("info", ctypes.c_uint64),
    ]


@dataclass(frozen=True)
class RunStats:
    run_time_ns: int
    run_cnt: int


def prog_run_stats(prog_fd: int) -> RunStats:
    """run_time_ns and run_cnt of bpf_prog_info (counted while stats are enabled)."""
    info = _ProgInfoStats()
    attr = _InfoByFd(bpf_fd=prog_fd, info_len=ctypes.sizeof(info), info=ctypes.addressof(info))
    _sys_bpf(bpfsys.BPF_OBJ_GET_INFO_BY_FD, attr, "program info")
    return RunStats(int(info.run_time_ns), int(info.run_cnt))


def pack(objs: Sequence[ctypes.Structure | ctypes._SimpleCData]) -> bytes:  # type: ignore[type-arg]
    return b"".join(bytes(o) for o in objs)
