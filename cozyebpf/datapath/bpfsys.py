"""Thin wrappers over the bpf(2) system call, for what bcc does not offer: creating and pinning
maps with a checked layout, bpf_link create/update/pin (XDP and tcx), program queries, and
BPF_PROG_TEST_RUN. Calling the syscall directly keeps us independent of the libbpf version on the
host (Debian 12's libbpf 1.1 predates tcx).

Attribute layouts follow `union bpf_attr` in include/uapi/linux/bpf.h; each ctypes struct below
covers exactly the fields of one command and is zero-padded to the size the kernel checks.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import platform
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

#: a ctypes object passed by address (Structure, Array, c_* value)
CObj = Any

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long

#: bpf(2)'s number by `platform.machine()`: arch/x86/entry/syscalls/syscall_64.tbl and the
#: generic table (include/uapi/asm-generic/unistd.h) that arm64 uses; the Dockerfile builds both
_SYS_BPF_BY_MACHINE = {"x86_64": 321, "amd64": 321, "aarch64": 280, "arm64": 280}


def sys_bpf_number(machine: str) -> int | None:
    """bpf(2)'s syscall number on `machine` (as `platform.machine()` names it), None if unknown."""
    return _SYS_BPF_BY_MACHINE.get(machine.lower())


# Chosen at import; an unknown machine fails at the first bpf(2) call, not here, so that
# what needs no syscall (the model, the fake datapath, --help) still works there.
MACHINE = platform.machine()
SYS_BPF = sys_bpf_number(MACHINE)

# commands
BPF_MAP_CREATE = 0
BPF_MAP_LOOKUP_ELEM = 1
BPF_MAP_UPDATE_ELEM = 2
BPF_MAP_DELETE_ELEM = 3
BPF_MAP_GET_NEXT_KEY = 4
BPF_PROG_LOAD = 5
BPF_OBJ_PIN = 6
BPF_OBJ_GET = 7
BPF_PROG_TEST_RUN = 10
BPF_PROG_GET_FD_BY_ID = 13
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_PROG_QUERY = 16
BPF_LINK_CREATE = 28
BPF_LINK_UPDATE = 29
BPF_LINK_GET_FD_BY_ID = 30
BPF_LINK_DETACH = 34
BPF_MAP_LOOKUP_BATCH = 24
BPF_MAP_UPDATE_BATCH = 26
BPF_MAP_DELETE_BATCH = 27

# map types
BPF_MAP_TYPE_HASH = 1
BPF_MAP_TYPE_ARRAY = 2
BPF_MAP_TYPE_PROG_ARRAY = 3
BPF_MAP_TYPE_PERCPU_ARRAY = 6
BPF_MAP_TYPE_LRU_HASH = 9
BPF_MAP_TYPE_LPM_TRIE = 11
BPF_MAP_TYPE_RINGBUF = 27

MAP_TYPE_NAMES = {
    BPF_MAP_TYPE_HASH: "hash",
    BPF_MAP_TYPE_ARRAY: "array",
    BPF_MAP_TYPE_PROG_ARRAY: "prog_array",
    BPF_MAP_TYPE_PERCPU_ARRAY: "percpu_array",
    BPF_MAP_TYPE_LRU_HASH: "lru_hash",
    BPF_MAP_TYPE_LPM_TRIE: "lpm_trie",
    BPF_MAP_TYPE_RINGBUF: "ringbuf",
}

# program types
BPF_PROG_TYPE_XDP = 6

# map_create flags
BPF_F_NO_PREALLOC = 1 << 0

# attach types
BPF_XDP = 37
BPF_TCX_INGRESS = 46
BPF_TCX_EGRESS = 47

# link_create / prog_query flags
BPF_F_BEFORE = 1 << 3
XDP_FLAGS_SKB_MODE = 1 << 1
XDP_FLAGS_DRV_MODE = 1 << 2

# update flags
BPF_ANY = 0
BPF_NOEXIST = 1
BPF_EXIST = 2

BPF_OBJ_NAME_LEN = 16
_ATTR_SIZE = 144  # sizeof(union bpf_attr) on 6.x; the kernel zero-checks bytes it does not know


class BpfError(OSError):
    """A bpf(2) call failed; `errno` is set, the message names the command and the object."""


def _sys_bpf(cmd: int, attr: ctypes.Structure, what: str) -> int:
    if SYS_BPF is None:
        raise BpfError(
            errno.ENOSYS,
            f"{what}: no bpf(2) syscall number known for machine {MACHINE!r} "
            f"(cozyebpf knows {', '.join(sorted(_SYS_BPF_BY_MACHINE))})",
        )
    buf = ctypes.create_string_buffer(_ATTR_SIZE)
    ctypes.memmove(buf, ctypes.addressof(attr), ctypes.sizeof(attr))
    ret = _libc.syscall(SYS_BPF, cmd, buf, _ATTR_SIZE)
    err = ctypes.get_errno()
    # copy back, also on failure: some commands write into attr (test_run, query, batch counts)
    ctypes.memmove(ctypes.addressof(attr), buf, ctypes.sizeof(attr))
    if ret < 0:
        raise BpfError(err, f"{what}: {os.strerror(err)}")
    return int(ret)


def _ptr(obj: CObj | None) -> int:
    return 0 if obj is None else ctypes.addressof(obj)


class _MapCreate(ctypes.Structure):
    _fields_ = [
        ("map_type", ctypes.c_uint32),
        ("key_size", ctypes.c_uint32),
        ("value_size", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("inner_map_fd", ctypes.c_uint32),
        ("numa_node", ctypes.c_uint32),
        ("map_name", ctypes.c_char * BPF_OBJ_NAME_LEN),
    ]


class _MapElem(ctypes.Structure):
    _fields_ = [
        ("map_fd", ctypes.c_uint32),
        ("_pad", ctypes.c_uint32),
        ("key", ctypes.c_uint64),
        ("value", ctypes.c_uint64),  # or next_key
        ("flags", ctypes.c_uint64),
    ]


class _ProgLoad(ctypes.Structure):
    _fields_ = [
        ("prog_type", ctypes.c_uint32),
        ("insn_cnt", ctypes.c_uint32),
        ("insns", ctypes.c_uint64),
        ("license", ctypes.c_uint64),
        ("log_level", ctypes.c_uint32),
        ("log_size", ctypes.c_uint32),
        ("log_buf", ctypes.c_uint64),
        ("kern_version", ctypes.c_uint32),
        ("prog_flags", ctypes.c_uint32),
        ("prog_name", ctypes.c_char * BPF_OBJ_NAME_LEN),
        ("prog_ifindex", ctypes.c_uint32),
        ("expected_attach_type", ctypes.c_uint32),
    ]


class _ObjPin(ctypes.Structure):
    _fields_ = [
        ("pathname", ctypes.c_uint64),
        ("bpf_fd", ctypes.c_uint32),
        ("file_flags", ctypes.c_uint32),
    ]


class _InfoByFd(ctypes.Structure):
    _fields_ = [
        ("bpf_fd", ctypes.c_uint32),
        ("info_len", ctypes.c_uint32),
        ("info", ctypes.c_uint64),
    ]


class _GetFdById(ctypes.Structure):
    _fields_ = [
        ("id", ctypes.c_uint32),
        ("next_id", ctypes.c_uint32),
        ("open_flags", ctypes.c_uint32),
    ]


class _LinkCreate(ctypes.Structure):
    _fields_ = [
        ("prog_fd", ctypes.c_uint32),
        ("target_ifindex", ctypes.c_uint32),
        ("attach_type", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("relative_fd", ctypes.c_uint32),  # tcx.relative_fd / relative_id
        ("_pad", ctypes.c_uint32),
        ("expected_revision", ctypes.c_uint64),
    ]


class _LinkUpdate(ctypes.Structure):
    _fields_ = [
        ("link_fd", ctypes.c_uint32),
        ("new_prog_fd", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("old_prog_fd", ctypes.c_uint32),
    ]


class _LinkDetach(ctypes.Structure):
    _fields_ = [("link_fd", ctypes.c_uint32)]


class _ProgQuery(ctypes.Structure):
    _fields_ = [
        ("target_ifindex", ctypes.c_uint32),
        ("attach_type", ctypes.c_uint32),
        ("query_flags", ctypes.c_uint32),
        ("attach_flags", ctypes.c_uint32),
        ("prog_ids", ctypes.c_uint64),
        ("prog_cnt", ctypes.c_uint32),
        ("_pad", ctypes.c_uint32),
        ("prog_attach_flags", ctypes.c_uint64),
        ("link_ids", ctypes.c_uint64),
        ("link_attach_flags", ctypes.c_uint64),
        ("revision", ctypes.c_uint64),
    ]


class _TestRun(ctypes.Structure):
    _fields_ = [
        ("prog_fd", ctypes.c_uint32),
        ("retval", ctypes.c_uint32),
        ("data_size_in", ctypes.c_uint32),
        ("data_size_out", ctypes.c_uint32),
        ("data_in", ctypes.c_uint64),
        ("data_out", ctypes.c_uint64),
        ("repeat", ctypes.c_uint32),
        ("duration", ctypes.c_uint32),
        ("ctx_size_in", ctypes.c_uint32),
        ("ctx_size_out", ctypes.c_uint32),
        ("ctx_in", ctypes.c_uint64),
        ("ctx_out", ctypes.c_uint64),
        ("flags", ctypes.c_uint32),
        ("cpu", ctypes.c_uint32),
        ("batch_size", ctypes.c_uint32),
    ]


class _ProgInfo(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("tag", ctypes.c_uint8 * 8),
        ("jited_prog_len", ctypes.c_uint32),
        ("xlated_prog_len", ctypes.c_uint32),
        ("jited_prog_insns", ctypes.c_uint64),
        ("xlated_prog_insns", ctypes.c_uint64),
        ("load_time", ctypes.c_uint64),
        ("created_by_uid", ctypes.c_uint32),
        ("nr_map_ids", ctypes.c_uint32),
        ("map_ids", ctypes.c_uint64),
        ("name", ctypes.c_char * BPF_OBJ_NAME_LEN),
        ("_rest", ctypes.c_uint8 * 168),  # up to verified_insns (offset 216) and beyond
    ]


class _MapInfo(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("key_size", ctypes.c_uint32),
        ("value_size", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("name", ctypes.c_char * BPF_OBJ_NAME_LEN),
    ]


class _LinkInfo(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("prog_id", ctypes.c_uint32),
        ("_pad", ctypes.c_uint32),
        ("ifindex", ctypes.c_uint32),  # xdp.ifindex / tcx.ifindex
        ("attach_type", ctypes.c_uint32),  # tcx.attach_type
        ("_rest", ctypes.c_uint8 * 32),
    ]


@dataclass(frozen=True)
class MapInfo:
    type: int
    id: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    name: str


@dataclass(frozen=True)
class ProgInfo:
    type: int
    id: int
    name: str
    xlated_insns: int  # xlated_prog_len / 8
    verified_insns: int
    tag: str  # hex digest of the instructions: differs when the program changed


@dataclass(frozen=True)
class LinkInfo:
    type: int
    id: int
    prog_id: int
    ifindex: int
    attach_type: int


def map_create(
    map_type: int, key_size: int, value_size: int, max_entries: int, name: str, flags: int = 0
) -> int:
    attr = _MapCreate(
        map_type=map_type,
        key_size=key_size,
        value_size=value_size,
        max_entries=max_entries,
        map_flags=flags,
        map_name=name.encode()[: BPF_OBJ_NAME_LEN - 1],
    )
    return _sys_bpf(BPF_MAP_CREATE, attr, f"create map {name}")


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    """One eBPF instruction (struct bpf_insn), little-endian as on every machine we know."""
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def prog_load(prog_type: int, insns: bytes, name: str, expected_attach_type: int = 0) -> int:
    """Load a small hand-assembled program (a feature probe; the real programs go through
    bcc); its fd. A refusal raises BpfError with the verifier's log in the message."""
    code = ctypes.create_string_buffer(insns, len(insns))
    lic = ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(4096)
    attr = _ProgLoad(
        prog_type=prog_type,
        insn_cnt=len(insns) // 8,
        insns=_ptr(code),
        license=_ptr(lic),
        log_level=1,
        log_size=len(log),
        log_buf=_ptr(log),
        prog_name=name.encode()[: BPF_OBJ_NAME_LEN - 1],
        expected_attach_type=expected_attach_type,
    )
    try:
        return _sys_bpf(BPF_PROG_LOAD, attr, f"load program {name}")
    except BpfError as e:
        text = log.value.decode(errors="replace").strip()
        raise BpfError(e.errno, f"{e.strerror}: {text}" if text else str(e.strerror)) from None


def obj_pin(fd: int, path: str) -> None:
    p = ctypes.create_string_buffer(path.encode())
    _sys_bpf(BPF_OBJ_PIN, _ObjPin(pathname=_ptr(p), bpf_fd=fd), f"pin {path}")


def obj_get(path: str) -> int:
    p = ctypes.create_string_buffer(path.encode())
    return _sys_bpf(BPF_OBJ_GET, _ObjPin(pathname=_ptr(p)), f"open pin {path}")


def _info(fd: int, info: ctypes.Structure, what: str) -> None:
    attr = _InfoByFd(bpf_fd=fd, info_len=ctypes.sizeof(info), info=_ptr(info))
    _sys_bpf(BPF_OBJ_GET_INFO_BY_FD, attr, f"info of {what}")


def map_info(fd: int) -> MapInfo:
    i = _MapInfo()
    _info(fd, i, f"map fd {fd}")
    return MapInfo(
        i.type, i.id, i.key_size, i.value_size, i.max_entries, i.map_flags, i.name.decode()
    )


def prog_info(fd: int) -> ProgInfo:
    i = _ProgInfo()
    _info(fd, i, f"program fd {fd}")
    verified = int.from_bytes(bytes(i._rest)[216 - 80 : 216 - 80 + 4], "little")
    return ProgInfo(
        i.type, i.id, i.name.decode(), i.xlated_prog_len // 8, verified, bytes(i.tag).hex()
    )


def link_info(fd: int) -> LinkInfo:
    i = _LinkInfo()
    _info(fd, i, f"link fd {fd}")
    return LinkInfo(i.type, i.id, i.prog_id, i.ifindex, i.attach_type)


def prog_fd_by_id(prog_id: int) -> int:
    return _sys_bpf(BPF_PROG_GET_FD_BY_ID, _GetFdById(id=prog_id), f"open program id {prog_id}")


def prog_info_by_id(prog_id: int) -> ProgInfo:
    fd = prog_fd_by_id(prog_id)
    try:
        return prog_info(fd)
    finally:
        os.close(fd)


def link_create(
    prog_fd: int, ifindex: int, attach_type: int, flags: int = 0, relative_fd: int = 0
) -> int:
    attr = _LinkCreate(
        prog_fd=prog_fd,
        target_ifindex=ifindex,
        attach_type=attach_type,
        flags=flags,
        relative_fd=relative_fd,
    )
    return _sys_bpf(
        BPF_LINK_CREATE, attr, f"attach program (type {attach_type}) to ifindex {ifindex}"
    )


def link_update(link_fd: int, new_prog_fd: int) -> None:
    _sys_bpf(BPF_LINK_UPDATE, _LinkUpdate(link_fd=link_fd, new_prog_fd=new_prog_fd), "update link")


def link_detach(link_fd: int) -> None:
    _sys_bpf(BPF_LINK_DETACH, _LinkDetach(link_fd=link_fd), "detach link")


def prog_query(ifindex: int, attach_type: int) -> tuple[list[int], list[int]]:
    """Program ids and link ids (0 where none) attached at (ifindex, tcx attach type), in order."""
    ids = (ctypes.c_uint32 * 64)()
    links = (ctypes.c_uint32 * 64)()
    attr = _ProgQuery(
        target_ifindex=ifindex,
        attach_type=attach_type,
        prog_ids=_ptr(ids),
        link_ids=_ptr(links),
        prog_cnt=64,
    )
    try:
        _sys_bpf(BPF_PROG_QUERY, attr, f"query programs on ifindex {ifindex}")
    except BpfError as e:
        if e.errno in (errno.ENOENT, errno.EINVAL):
            return [], []
        raise
    n = attr.prog_cnt
    return list(ids[:n]), list(links[:n])


def map_lookup(fd: int, key: CObj, value: CObj) -> bool:
    attr = _MapElem(map_fd=fd, key=_ptr(key), value=_ptr(value))
    try:
        _sys_bpf(BPF_MAP_LOOKUP_ELEM, attr, "map lookup")
    except BpfError as e:
        if e.errno == errno.ENOENT:
            return False
        raise
    return True


def map_update(fd: int, key: CObj, value: CObj, flags: int = BPF_ANY) -> None:
    _sys_bpf(
        BPF_MAP_UPDATE_ELEM,
        _MapElem(map_fd=fd, key=_ptr(key), value=_ptr(value), flags=flags),
        "map update",
    )


def map_delete(fd: int, key: CObj) -> bool:
    try:
        _sys_bpf(BPF_MAP_DELETE_ELEM, _MapElem(map_fd=fd, key=_ptr(key)), "map delete")
    except BpfError as e:
        if e.errno == errno.ENOENT:
            return False
        raise
    return True


def map_keys(fd: int, key_size: int) -> list[bytes]:
    """Every key of a hash map (raw bytes). Keys deleted meanwhile may restart the walk."""
    keys: list[bytes] = []
    cur = None
    nxt = ctypes.create_string_buffer(key_size)
    while True:
        attr = _MapElem(map_fd=fd, key=_ptr(cur), value=_ptr(nxt))
        try:
            _sys_bpf(BPF_MAP_GET_NEXT_KEY, attr, "map walk")
        except BpfError as e:
            if e.errno == errno.ENOENT:
                return keys
            raise
        keys.append(nxt.raw)
        cur = ctypes.create_string_buffer(nxt.raw, key_size)


@dataclass(frozen=True)
class TestRunResult:
    retval: int
    data: bytes
    duration_ns: int
    ctx: bytes = b""  # the context as the program left it (when one was given)


#: prog_test_run flag (Linux 6.11): a tc program's skb is CHECKSUM_COMPLETE, its skb->csum the
#: sum of the frame after the Ethernet header; the run fails with EBADMSG if the program leaves
#: skb->csum disagreeing with the packet it returns
BPF_F_TEST_SKB_CHECKSUM_COMPLETE = 1 << 2


def prog_test_run(
    prog_fd: int,
    data: bytes,
    repeat: int = 1,
    out_size: int = 4096,
    ctx: bytes | None = None,
    flags: int = 0,
    ctx_out: int = 0,
) -> TestRunResult:
    """BPF_PROG_TEST_RUN: run a loaded program on `data` (a frame from its Ethernet header;
    for XDP with metadata, the metadata first), with the context `ctx` (struct xdp_md or
    struct __sk_buff, possibly shorter: the rest is zero) if given; with `ctx_out` (the
    context's whole size: the kernel refuses less) the result gives it back as the program
    left it."""
    din = ctypes.create_string_buffer(data, len(data))
    dout = ctypes.create_string_buffer(out_size)
    cin = ctypes.create_string_buffer(ctx, len(ctx)) if ctx is not None else None
    cout = ctypes.create_string_buffer(ctx_out) if ctx_out else None
    attr = _TestRun(
        prog_fd=prog_fd,
        data_size_in=len(data),
        data_size_out=out_size,
        data_in=_ptr(din),
        data_out=_ptr(dout),
        repeat=repeat,
        ctx_size_in=len(ctx) if ctx is not None else 0,
        ctx_in=_ptr(cin),
        ctx_size_out=ctx_out,
        ctx_out=_ptr(cout),
        flags=flags,
    )
    _sys_bpf(BPF_PROG_TEST_RUN, attr, "test run")
    return TestRunResult(
        ctypes.c_int32(attr.retval).value,
        dout.raw[: attr.data_size_out],
        attr.duration,
        cout.raw[: attr.ctx_size_out] if cout is not None else b"",
    )


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


#: errnos of a kernel or map type without batch operations (ENOTSUPP is 524, kernel-internal)
BATCH_UNSUPPORTED = (errno.EINVAL, errno.EOPNOTSUPP, 524)


def map_update_batch(fd: int, keys: bytes, values: bytes, count: int, flags: int = BPF_ANY) -> None:
    """BPF_MAP_UPDATE_BATCH: `count` packed keys and values in one call (about ten times faster
    than one call per entry: bench/). On an error the kernel has written the first attr.count."""
    if count == 0:
        return
    kbuf = ctypes.create_string_buffer(keys, len(keys))
    vbuf = ctypes.create_string_buffer(values, len(values))
    attr = _MapBatch(keys=_ptr(kbuf), values=_ptr(vbuf), count=count, map_fd=fd, elem_flags=flags)
    _sys_bpf(BPF_MAP_UPDATE_BATCH, attr, f"map update batch ({count} entries)")


def map_delete_batch(fd: int, keys: bytes, key_size: int) -> int:
    """BPF_MAP_DELETE_BATCH of packed keys; missing keys are skipped as map_delete does (the
    kernel stops at one with ENOENT, attr.count = how many it deleted before). The number
    deleted."""
    n, start, deleted = len(keys) // key_size, 0, 0
    while start < n:
        kbuf = ctypes.create_string_buffer(keys[start * key_size :], (n - start) * key_size)
        attr = _MapBatch(keys=_ptr(kbuf), count=n - start, map_fd=fd)
        try:
            _sys_bpf(BPF_MAP_DELETE_BATCH, attr, f"map delete batch ({n - start} keys)")
        except BpfError as e:
            if e.errno != errno.ENOENT:
                raise
            deleted += int(attr.count)
            start += int(attr.count) + 1
            continue
        return deleted + int(attr.count)
    return deleted


def _lookup_batches(
    fd: int, key_size: int, value_size: int, chunk: int
) -> Iterator[tuple[bytes, bytes, int]]:
    """BPF_MAP_LOOKUP_BATCH over a whole hash map: (keys, values, count) per chunk, the
    buffers' raw bytes with `count` entries at their start."""
    kbuf = ctypes.create_string_buffer(key_size * chunk)
    vbuf = ctypes.create_string_buffer(value_size * chunk)
    tok_in = ctypes.create_string_buffer(max(key_size, 8))
    tok_out = ctypes.create_string_buffer(max(key_size, 8))
    first = True
    while True:
        attr = _MapBatch(
            in_batch=0 if first else _ptr(tok_in),
            out_batch=_ptr(tok_out),
            keys=_ptr(kbuf),
            values=_ptr(vbuf),
            count=chunk,
            map_fd=fd,
        )
        try:
            _sys_bpf(BPF_MAP_LOOKUP_BATCH, attr, "map lookup batch")
            done = False
        except BpfError as e:
            if e.errno != errno.ENOENT:  # ENOENT: that was the last chunk
                raise
            done = True
        yield kbuf.raw, vbuf.raw, int(attr.count)
        if done:
            return
        ctypes.memmove(tok_in, tok_out, len(tok_out))
        first = False


def map_items_batch(
    fd: int, key_size: int, value_size: int, chunk: int = 4096
) -> list[tuple[bytes, bytes]]:
    """Every (key, value) of a hash map with BPF_MAP_LOOKUP_BATCH. Not for per-CPU maps."""
    return [
        (kr[i * key_size : (i + 1) * key_size], vr[i * value_size : (i + 1) * value_size])
        for kr, vr, count in _lookup_batches(fd, key_size, value_size, chunk)
        for i in range(count)
    ]


def map_count(fd: int, key_size: int, value_size: int, chunk: int = 8192) -> int:
    """How many entries a hash map holds (BPF_MAP_LOOKUP_BATCH, the entries not kept): for
    metrics, which must not build Python objects for every flow of a full table."""
    return sum(count for _, _, count in _lookup_batches(fd, key_size, value_size, chunk))


BPF_FS_MAGIC = 0xCAFE4A11


def on_bpffs(path: str) -> bool:
    """Is `path` on a bpf filesystem? (statfs f_type)"""

    class _Statfs(ctypes.Structure):
        _fields_ = [("f_type", ctypes.c_long), ("_rest", ctypes.c_byte * 120)]

    buf = _Statfs()
    if _libc.statfs(path.encode(), ctypes.byref(buf)) != 0:
        return False
    return bool(buf.f_type & 0xFFFFFFFF == BPF_FS_MAGIC)
