"""bpf(2) calls the benchmark needs and the product does not have: BPF_PROG_RUN with live
frames and run-time statistics of programs (the batch map operations moved into
cozyebpf/datapath/bpfsys.py). Attribute layouts follow `union bpf_attr` in
include/uapi/linux/bpf.h.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

from cozyebpf.datapath import bpfsys

BPF_ENABLE_STATS = 32
BPF_STATS_RUN_TIME = 0
BPF_F_TEST_XDP_LIVE_FRAMES = 1 << 1

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_ATTR_SIZE = 144


_sys_bpf = bpfsys._sys_bpf  # copies attr back, also on failure


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
