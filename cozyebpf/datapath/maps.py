"""The pinned maps: create them with a checked layout, open them from another process, and
read or program them through plain bpf(2) calls (no compilation needed, so `maps dump` is
instant). Each address family has its own maps (svc4/pod4/allow4/flow4 and svc6/pod6/allow6/
flow6); a MapState holds both, and each entry is read from and written to the maps of its
family."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import struct
from collections.abc import Iterator
from ipaddress import IPv4Address
from pathlib import Path
from typing import TypeAlias

from cozyebpf.datapath import bpfsys
from cozyebpf.datapath.layout import (
    ALL_MAPS,
    ALLOW4,
    ALLOW6,
    F_ALLOW_ICMP,
    F_PORT_FILTER,
    FLOW4,
    FLOW6,
    LAYOUT_VERSION,
    META,
    POD4,
    POD6,
    STATS,
    SVC4,
    SVC6,
    Allow4Key,
    Allow6Key,
    Flow4Key,
    Flow6Key,
    Ip6,
    MapSpec,
    MetaVal,
    Pod4Val,
    Pod6Val,
    StatVal,
    Svc4Val,
    Svc6Val,
    be16,
    be32,
    ip6,
    ip6_of,
    ip_of,
    port_of,
)
from cozyebpf.datapath.reasons import REASONS
from cozyebpf.errors import DatapathError
from cozyebpf.state import (
    AllowedPort,
    Capacity,
    IPAddress,
    MapDiff,
    MapLimit,
    MapState,
    PodEntry,
    Proto,
    ServiceEntry,
)

log = logging.getLogger(__name__)

DEFAULT_PIN_DIR = "/sys/fs/bpf/cozyebpf"


def possible_cpus() -> int:
    """Number of possible CPUs: the stride of per-CPU map values."""
    text = Path("/sys/devices/system/cpu/possible").read_text().strip()
    n = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        n += (int(hi) if hi else int(lo)) - int(lo) + 1
    return n


def _flags(port_filter: bool, allow_icmp: bool) -> int:
    return (F_PORT_FILTER if port_filter else 0) | (F_ALLOW_ICMP if allow_icmp else 0)


def _entry_flags(flags: int) -> tuple[bool, bool]:
    """(port_filter, allow_icmp) of a map value's flags."""
    return bool(flags & F_PORT_FILTER), bool(flags & F_ALLOW_ICMP)


_AddrKey: TypeAlias = ctypes.c_uint32 | Ip6


def _addr_key(ip: IPAddress) -> _AddrKey:
    """The svc/pod map key of `ip`, in its family's layout (network byte order)."""
    return ctypes.c_uint32(be32(ip)) if isinstance(ip, IPv4Address) else ip6(ip)


def _svc_val(s: ServiceEntry) -> Svc4Val | Svc6Val:
    flags = _flags(s.port_filter, s.allow_icmp)
    if isinstance(s.pod_ip, IPv4Address):
        return Svc4Val(pod_ip=be32(s.pod_ip), flags=flags)
    return Svc6Val(pod_ip=ip6(s.pod_ip), flags=flags)


def _pod_val(e: PodEntry) -> Pod4Val | Pod6Val:
    flags = _flags(e.port_filter, e.allow_icmp)
    if isinstance(e.lb_ip, IPv4Address):
        return Pod4Val(lb_ip=be32(e.lb_ip), flags=flags)
    return Pod6Val(lb_ip=ip6(e.lb_ip), flags=flags)


def _allow_key(a: AllowedPort) -> Allow4Key | Allow6Key:
    if isinstance(a.pod_ip, IPv4Address):
        return Allow4Key(pod_ip=be32(a.pod_ip), proto=int(a.proto), port=be16(a.port))
    return Allow6Key(pod_ip=ip6(a.pod_ip), proto=int(a.proto), port=be16(a.port))


_ALLOW_TAIL = struct.Struct("!BBH")  # allow4/6 keys after the pod IP: proto, reserved, port
_FLAG_BYTES = [bytes([f, 0, 0, 0]) for f in range(256)]  # svc/pod values: flags, reserved[3]


def _allow_bytes(a: AllowedPort) -> bytes:
    return a.pod_ip.packed + _ALLOW_TAIL.pack(int(a.proto), 0, a.port)


def _entry_bytes(ip: IPAddress, port_filter: bool, allow_icmp: bool) -> bytes:
    return ip.packed + _FLAG_BYTES[_flags(port_filter, allow_icmp)]


def _read_version(fd: int) -> int | None:
    val = MetaVal()
    if not bpfsys.map_lookup(fd, ctypes.c_uint32(0), val):
        return None
    return int(val.layout_version)


def _layout_problem(spec: MapSpec, info: bpfsys.MapInfo) -> str | None:
    want = (spec.map_type, spec.key_size, spec.value_size, spec.max_entries)
    have = (info.type, info.key_size, info.value_size, info.max_entries)
    if want == have:
        return None
    names = ("type", "key size", "value size", "max entries")
    return ", ".join(
        f"{n} {h} (want {w})" for n, h, w in zip(names, have, want, strict=True) if h != w
    )


class PinnedMaps:
    """File descriptors of every cozyebpf map under one pin directory."""

    def __init__(self, pin_dir: str, fds: dict[str, int]) -> None:
        self.pin_dir = pin_dir
        self.fds = fds
        self._no_batch = False  # set when the kernel refuses batch operations

    # -- opening -------------------------------------------------------------------------

    @classmethod
    def open(cls, pin_dir: str = DEFAULT_PIN_DIR) -> PinnedMaps:
        """Open existing pins (for `maps dump`); every map must be there with our layout."""
        fds: dict[str, int] = {}
        try:
            for spec in ALL_MAPS:
                path = os.path.join(pin_dir, spec.name)
                try:
                    fd = bpfsys.obj_get(path)
                except bpfsys.BpfError as e:
                    if e.errno == errno.ENOENT:
                        raise DatapathError(
                            f"no cozyebpf map pinned at {path}: is `cozyebpf run` running on "
                            f"this node (and is --pin-dir the same)?"
                        ) from None
                    raise DatapathError(f"cannot open {path}: {e}") from e
                fds[spec.name] = fd
                cls._check(spec, fd, path)
            maps = cls(pin_dir, fds)
            maps._check_version()
            return maps
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise

    @classmethod
    def ensure(cls, pin_dir: str = DEFAULT_PIN_DIR) -> PinnedMaps:
        """Open the pins, creating (and pinning, mode 0600 in a 0700 dir) any that are missing.

        A pin with another layout is never reused as it is: a map whose type, key and value
        sizes are unchanged (only its size differs) is migrated, its entries copied; any other
        map, and every map when the layout version in `meta` differs, is rebuilt empty (the
        controller refills services, pods and ports; flows and counters start over). Each
        migration is logged."""
        os.makedirs(pin_dir, mode=0o700, exist_ok=True)
        os.chmod(pin_dir, 0o700)
        fds: dict[str, int] = {}
        created: list[str] = []
        version_ok = True
        try:
            for spec in ALL_MAPS:
                path = os.path.join(pin_dir, spec.name)
                try:
                    fd = bpfsys.obj_get(path)
                except bpfsys.BpfError as e:
                    if e.errno != errno.ENOENT:
                        raise DatapathError(f"cannot open {path}: {e}") from e
                    fd = cls._create(spec, path)
                    created.append(spec.name)
                else:
                    info = bpfsys.map_info(fd)
                    problem = _layout_problem(spec, info)
                    if spec is META and not problem:
                        version_ok = _read_version(fd) == LAYOUT_VERSION
                    elif spec is META:
                        version_ok = False
                    if problem or (spec is not META and not version_ok):
                        why = problem or "layout version changed"
                        copy = version_ok and (info.type, info.key_size, info.value_size) == (
                            spec.map_type,
                            spec.key_size,
                            spec.value_size,
                        )
                        fd = cls._migrate(spec, fd, info, path, why, copy)
                fds[spec.name] = fd
            bpfsys.map_update(
                fds[META.name], ctypes.c_uint32(0), MetaVal(layout_version=LAYOUT_VERSION)
            )
            maps = cls(pin_dir, fds)
        except bpfsys.BpfError as e:
            for fd in fds.values():
                os.close(fd)
            hint = " (cozyebpf needs CAP_SYS_ADMIN)" if e.errno == errno.EPERM else ""
            raise DatapathError(f"preparing the maps in {pin_dir} failed: {e}{hint}") from e
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise
        if created:
            log.info("created maps in %s: %s", pin_dir, ", ".join(created))
        if len(created) < len(ALL_MAPS):
            kept = [s.name for s in ALL_MAPS if s.name not in created]
            log.info("adopted pinned maps in %s: %s", pin_dir, ", ".join(kept))
        return maps

    @staticmethod
    def _create(spec: MapSpec, path: str) -> int:
        fd = bpfsys.map_create(
            spec.map_type, spec.key_size, spec.value_size, spec.max_entries, f"cz_{spec.name}"
        )
        bpfsys.obj_pin(fd, path)
        os.chmod(path, 0o600)
        return fd

    @classmethod
    def _migrate(
        cls, spec: MapSpec, old_fd: int, info: bpfsys.MapInfo, path: str, why: str, copy: bool
    ) -> int:
        """Replace the pin at `path` by a map with our layout, copying entries if `copy`."""
        keys = bpfsys.map_keys(old_fd, info.key_size)
        new_fd = bpfsys.map_create(
            spec.map_type, spec.key_size, spec.value_size, spec.max_entries, f"cz_{spec.name}"
        )
        copied = 0
        if copy:
            per_cpu = spec.map_type == bpfsys.BPF_MAP_TYPE_PERCPU_ARRAY
            size = (spec.value_size + 7) // 8 * 8 * possible_cpus() if per_cpu else spec.value_size
            for raw in keys:
                key = ctypes.create_string_buffer(raw, len(raw))
                val = ctypes.create_string_buffer(size)
                if not bpfsys.map_lookup(old_fd, key, val):
                    continue
                try:
                    bpfsys.map_update(new_fd, key, val)
                    copied += 1
                except bpfsys.BpfError as e:
                    if e.errno not in (errno.E2BIG, errno.ENOSPC):
                        raise
        os.close(old_fd)
        os.unlink(path)
        bpfsys.obj_pin(new_fd, path)
        os.chmod(path, 0o600)
        if copy:
            log.warning(
                "migrated map %s (%s): %d of %d entries copied", path, why, copied, len(keys)
            )
        else:
            log.warning(
                "rebuilt map %s (%s): %d old entries dropped; until the first sync packets to "
                "its addresses pass untranslated",
                path,
                why,
                len(keys),
            )
        return new_fd

    @staticmethod
    def _check(spec: MapSpec, fd: int, path: str) -> None:
        problem = _layout_problem(spec, bpfsys.map_info(fd))
        if problem:
            raise DatapathError(
                f"pinned map {path} has another layout ({problem}): it was made by another "
                f"cozyebpf version; this one cannot read it. `cozyebpf run` of this version "
                f"migrates it"
            )

    def _check_version(self) -> None:
        version = _read_version(self.fds[META.name])
        if version is None:
            raise DatapathError(f"{self.pin_dir}/meta holds no layout version")
        if version != LAYOUT_VERSION:
            raise DatapathError(
                f"maps in {self.pin_dir} have layout version {version}, this "
                f"cozyebpf uses {LAYOUT_VERSION}; `cozyebpf run` of this version migrates them"
            )

    def close(self) -> None:
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = {}

    def __enter__(self) -> PinnedMaps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading -------------------------------------------------------------------------

    def _items(self, spec: MapSpec) -> Iterator[tuple[bytes, bytes]]:
        """(key, value) pairs of a hash map: BPF_MAP_LOOKUP_BATCH (about 17x faster than a key
        walk, bench/), or the walk on kernels without batch operations."""
        fd = self.fds[spec.name]
        if not self._no_batch:
            try:
                yield from bpfsys.map_items_batch(fd, spec.key_size, spec.value_size)
                return
            except bpfsys.BpfError as e:
                if e.errno not in bpfsys.BATCH_UNSUPPORTED:
                    raise
                self._no_batch = True
        for raw in bpfsys.map_keys(fd, spec.key_size):
            key = spec.key.from_buffer_copy(raw)
            val = spec.value()
            if bpfsys.map_lookup(fd, key, val):  # gone meanwhile: skip
                yield raw, bytes(val)

    def read_state(self) -> MapState:
        """Everything in svc4/svc6, pod4/pod6 and allow4/allow6, as one MapState."""
        st = MapState()
        for kraw, vraw in self._items(SVC4):
            sv = Svc4Val.from_buffer_copy(vraw)
            st.services[IPv4Address(kraw)] = ServiceEntry(ip_of(sv.pod_ip), *_entry_flags(sv.flags))
        for kraw, vraw in self._items(SVC6):
            sv6 = Svc6Val.from_buffer_copy(vraw)
            st.services[ip6_of(Ip6.from_buffer_copy(kraw))] = ServiceEntry(
                ip6_of(sv6.pod_ip), *_entry_flags(sv6.flags)
            )
        for kraw, vraw in self._items(POD4):
            pv = Pod4Val.from_buffer_copy(vraw)
            st.pods[IPv4Address(kraw)] = PodEntry(ip_of(pv.lb_ip), *_entry_flags(pv.flags))
        for kraw, vraw in self._items(POD6):
            pv6 = Pod6Val.from_buffer_copy(vraw)
            st.pods[ip6_of(Ip6.from_buffer_copy(kraw))] = PodEntry(
                ip6_of(pv6.lb_ip), *_entry_flags(pv6.flags)
            )
        for spec in (ALLOW4, ALLOW6):
            for kraw, _ in self._items(spec):
                ak: Allow4Key | Allow6Key
                pod: IPAddress
                if spec is ALLOW4:
                    ak = Allow4Key.from_buffer_copy(kraw)
                    pod = ip_of(ak.pod_ip)
                else:
                    ak = Allow6Key.from_buffer_copy(kraw)
                    pod = ip6_of(ak.pod_ip)
                try:
                    proto = Proto(ak.proto)
                except ValueError:
                    # not something we write, and not representable in a MapState: it stays
                    # (harmless: the filter only looks up TCP, UDP and SCTP)
                    log.warning("%s holds an entry with unknown protocol %d", spec.name, ak.proto)
                    continue
                st.allowed.add(AllowedPort(pod, proto, port_of(ak.port)))
        return st

    def capacity(self) -> Capacity:
        """The maps' sizes in the model's terms: what fits (--max-services sets them)."""
        return Capacity(
            tuple(
                MapLimit(spec.name, spec.max_entries, ((kind, version),))
                for spec, kind, version in (
                    (SVC4, "services", 4),
                    (POD4, "pods", 4),
                    (ALLOW4, "allowed", 4),
                    (SVC6, "services", 6),
                    (POD6, "pods", 6),
                    (ALLOW6, "allowed", 6),
                )
            )
        )

    def lookup_service(self, lb: IPAddress) -> ServiceEntry | None:
        """The entry of one LB IP, by a single lookup (no map walk): for probes and tools that
        must not depend on the map layout."""
        if isinstance(lb, IPv4Address):
            sv = Svc4Val()
            if not bpfsys.map_lookup(self.fds[SVC4.name], _addr_key(lb), sv):
                return None
            return ServiceEntry(ip_of(sv.pod_ip), *_entry_flags(sv.flags))
        sv6 = Svc6Val()
        if not bpfsys.map_lookup(self.fds[SVC6.name], _addr_key(lb), sv6):
            return None
        return ServiceEntry(ip6_of(sv6.pod_ip), *_entry_flags(sv6.flags))

    def lookup_pod(self, pod: IPAddress) -> PodEntry | None:
        """The entry of one pod IP, by a single lookup."""
        if isinstance(pod, IPv4Address):
            pv = Pod4Val()
            if not bpfsys.map_lookup(self.fds[POD4.name], _addr_key(pod), pv):
                return None
            return PodEntry(ip_of(pv.lb_ip), *_entry_flags(pv.flags))
        pv6 = Pod6Val()
        if not bpfsys.map_lookup(self.fds[POD6.name], _addr_key(pod), pv6):
            return None
        return PodEntry(ip6_of(pv6.lb_ip), *_entry_flags(pv6.flags))

    def has_allowed(self, a: AllowedPort) -> bool:
        """Whether the allowed-port entry `a` is programmed, by a single lookup."""
        spec = ALLOW4 if a.version == 4 else ALLOW6
        return bpfsys.map_lookup(self.fds[spec.name], _allow_key(a), ctypes.c_uint8())

    def flows_by_pod(self) -> dict[IPAddress, int]:
        """Number of flow4 and flow6 entries per pod IP."""
        out: dict[IPAddress, int] = {}
        for raw in bpfsys.map_keys(self.fds[FLOW4.name], FLOW4.key_size):
            pod: IPAddress = ip_of(Flow4Key.from_buffer_copy(raw).pod_ip)
            out[pod] = out.get(pod, 0) + 1
        for raw in bpfsys.map_keys(self.fds[FLOW6.name], FLOW6.key_size):
            pod = ip6_of(Flow6Key.from_buffer_copy(raw).pod_ip)
            out[pod] = out.get(pod, 0) + 1
        return out

    def counters(self) -> dict[str, dict[str, int]]:
        """Per-reason totals, summed over CPUs."""
        ncpu = possible_cpus()
        stride = (STATS.value_size + 7) // 8 * 8
        buf = ctypes.create_string_buffer(stride * ncpu)
        out: dict[str, dict[str, int]] = {}
        for idx, name in enumerate(REASONS):
            if not bpfsys.map_lookup(self.fds[STATS.name], ctypes.c_uint32(idx), buf):
                continue
            pk = by = 0
            for cpu in range(ncpu):
                v = StatVal.from_buffer_copy(buf.raw, cpu * stride)
                pk += v.packets
                by += v.bytes
            out[name] = {"packets": pk, "bytes": by}
        return out

    # -- programming ---------------------------------------------------------------------

    def apply(self, d: MapDiff) -> None:
        """Apply `d` in the order that never opens a hole (allowed ports added, services set,
        pods set, services deleted, pods deleted, allowed ports deleted), one
        BPF_MAP_UPDATE_BATCH / DELETE_BATCH per map and step (the order inside a step does not
        matter); a kernel without batch operations gets one call per entry. A diff that mixes
        families in an entry is refused before anything is written."""
        errors = d.family_errors()
        if errors:
            raise DatapathError(
                f"refusing to program maps in {self.pin_dir}: an entry mixes address families "
                f"({'; '.join(errors)})"
            )
        specs = {"svc": (SVC4, SVC6), "pod": (POD4, POD6), "allow": (ALLOW4, ALLOW6)}

        def write(kind: str, items: list[tuple[int, bytes, bytes]]) -> None:
            for spec, version in zip(specs[kind], (4, 6), strict=True):
                mine = [(k, v) for ver, k, v in items if ver == version]
                self._update_batch(spec, [k for k, _ in mine], [v for _, v in mine])

        def delete(kind: str, keys: list[tuple[int, bytes]]) -> None:
            for spec, version in zip(specs[kind], (4, 6), strict=True):
                self._delete_batch(spec, [k for ver, k in keys if ver == version])

        try:
            write("allow", [(a.version, _allow_bytes(a), b"\x01") for a in d.allowed_add])
            write(
                "svc",
                [
                    (lb.version, lb.packed, _entry_bytes(s.pod_ip, s.port_filter, s.allow_icmp))
                    for lb, s in d.services_set.items()
                ],
            )
            write(
                "pod",
                [
                    (p.version, p.packed, _entry_bytes(e.lb_ip, e.port_filter, e.allow_icmp))
                    for p, e in d.pods_set.items()
                ],
            )
            delete("svc", [(lb.version, lb.packed) for lb in d.services_del])
            delete("pod", [(p.version, p.packed) for p in d.pods_del])
            delete("allow", [(a.version, _allow_bytes(a)) for a in d.allowed_del])
        except bpfsys.BpfError as e:
            hint = " (map full?)" if e.errno in (errno.E2BIG, errno.ENOSPC) else ""
            raise DatapathError(f"programming maps in {self.pin_dir} failed: {e}{hint}") from e

    def _update_batch(self, spec: MapSpec, keys: list[bytes], values: list[bytes]) -> None:
        fd = self.fds[spec.name]
        if not keys:
            return
        if not self._no_batch:
            try:
                bpfsys.map_update_batch(fd, b"".join(keys), b"".join(values), len(keys))
                return
            except bpfsys.BpfError as e:
                if e.errno not in bpfsys.BATCH_UNSUPPORTED:
                    raise
                self._no_batch = True
                log.info("this kernel has no batch map operations: one call per entry")
        for k, v in zip(keys, values, strict=True):
            bpfsys.map_update(
                fd, ctypes.create_string_buffer(k, len(k)), ctypes.create_string_buffer(v, len(v))
            )

    def _delete_batch(self, spec: MapSpec, keys: list[bytes]) -> None:
        fd = self.fds[spec.name]
        if not keys:
            return
        if not self._no_batch:
            try:
                bpfsys.map_delete_batch(fd, b"".join(keys), spec.key_size)
                return
            except bpfsys.BpfError as e:
                if e.errno not in bpfsys.BATCH_UNSUPPORTED:
                    raise
                self._no_batch = True
        for k in keys:
            bpfsys.map_delete(fd, ctypes.create_string_buffer(k, len(k)))
