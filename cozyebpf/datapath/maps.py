"""The pinned maps: create them with a checked layout, open them from another process, and
read or program them through plain bpf(2) calls (no compilation needed, so `maps dump` is
instant).

Layout version 2 keys everything the programs need to know about an address by that address:
one value in addr4 (or addr6) says whether it is an LB IP (and its pod IP and filter flags), a
pod IP (and the LB IP its egress leaves as), or both, and carries up to 8 allowed ports of the
pod its ingress reaches. allow4/allow6 still hold every allowed port; the programs look there
only for a pod with more ports than fit inline. The control plane keeps speaking MapState
(services, pods, allowed ports): `read_state()` decodes the maps into one, `apply()` encodes a
MapDiff, and a mirror of the state (refreshed by read_state, updated by apply) tells which addr
values an allowed-port change rewrites.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from typing import NamedTuple

from cozyebpf.datapath import bpfsys
from cozyebpf.datapath.layout import (
    CFG_POD_DEVICES,
    COUNTED,
    DEFAULT_MAX_SERVICES,
    F_ALLOW_ICMP,
    F_LEARN,
    F_PORT_FILTER,
    F_RANGES,
    FLOW_CLOSING,
    INLINE_PORTS,
    K_LB,
    K_POD,
    LAYOUT_VERSION,
    META,
    PORTS_SPILL,
    SAME_SINCE,
    STATS,
    UPLINKS_MAX,
    Flow4Val,
    FlowCfg,
    Layout,
    MapSpec,
    MetaVal,
    MonCtl,
    MonStat,
    StatVal,
    SvcStat,
    be16,
    flow_hint_bit,
    map_specs,
    possible_cpus,
)
from cozyebpf.datapath.reasons import REASONS, SVC_DROP_REASONS
from cozyebpf.datapath.slots import ServiceSlots, decode_name, split_service
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
    Ranges,
    ServiceEntry,
)

log = logging.getLogger(__name__)

DEFAULT_PIN_DIR = "/sys/fs/bpf/cozyebpf"

#: the flows' idle timeouts by default (seconds), as Linux conntrack's: UDP, ICMP echo, TCP
#: established, TCP after a FIN or RST (cozyebpf run --flow-timeout-*)
DEFAULT_FLOW_TIMEOUTS = {"udp": 120, "icmp": 30, "tcp": 432000, "tcp_closing": 10}
#: a timeout of 0 ("never") as the programs see it (bpf/lib/lookup.h, flow_fresh)
NEVER_NS = 1 << 62


@dataclass(frozen=True)
class ServiceCounters:
    """One Service's counters (svcstats, summed over CPUs): packets and bytes accepted per
    direction, and dropped packets per reason (every drop reason, zeros included)."""

    service: str  # "namespace/name"
    slot: int
    in_packets: int
    in_bytes: int
    out_packets: int
    out_bytes: int
    drops: dict[str, int]

    @property
    def namespace(self) -> str:
        return split_service(self.service)[0]

    @property
    def name(self) -> str:
        return split_service(self.service)[1]


@dataclass(frozen=True)
class MonitorState:
    """The monitor's switch and rate (monctl) and its counters (monstats, summed over CPUs)."""

    mode: int  # layout.MON_*
    interval_ns: int
    burst_ns: int
    events: int
    lost_limit: int
    lost_full: int


class Flow(NamedTuple):
    """A flow-table entry: ICMP echo flows have the identifier as pod_port and remote_port 0."""

    pod_ip: IPAddress
    remote_ip: IPAddress
    pod_port: int
    remote_port: int
    proto: int


@dataclass(frozen=True)
class FlowEntry:
    """A flow with its value: when the pod last sent on it (CLOCK_MONOTONIC_COARSE ns) and
    whether it sent a FIN or RST."""

    flow: Flow
    last_seen_ns: int
    closing: bool

    def age_s(self, now_ns: int) -> float:
        """Seconds since the pod last sent on the flow (refreshed at most once a second)."""
        return max(0, now_ns - self.last_seen_ns) / 1e9

    def as_dict(self, now_ns: int) -> dict[str, object]:
        """For `maps dump`."""
        f = self.flow
        return {
            "pod_ip": str(f.pod_ip),
            "remote_ip": str(f.remote_ip),
            "pod_port": f.pod_port,
            "remote_port": f.remote_port,
            "proto": {1: "icmp", 6: "tcp", 17: "udp", 58: "icmpv6", 132: "sctp"}.get(
                f.proto, str(f.proto)
            ),
            "age_s": round(self.age_s(now_ns), 1),
            "closing": self.closing,
        }


def coarse_now_ns() -> int:
    """The programs' clock for flows (bpf_ktime_get_coarse_ns)."""
    import time

    return time.clock_gettime_ns(getattr(time, "CLOCK_MONOTONIC_COARSE", 6))  # 6 on Linux


def _range_key(pod: bytes, net: IPv4Network | IPv6Network) -> bytes:
    """A range4/range6 key (bpf/lib/types.h): prefixlen covers the pod IP and the network."""
    return struct.pack("=I", 8 * len(pod) + net.prefixlen) + pod + net.network_address.packed


def _range_of(raw: bytes) -> tuple[bytes, IPv4Network | IPv6Network]:
    """(pod IP, network) of a range4/range6 key."""
    n = (len(raw) - 4) // 2
    (plen,) = struct.unpack_from("=I", raw)
    pod, addr = raw[4 : 4 + n], raw[4 + n :]
    net: IPv4Network | IPv6Network
    net = IPv4Network((addr, plen - 32)) if n == 4 else IPv6Network((addr, plen - 128))
    return pod, net


def _flags(e: ServiceEntry | PodEntry) -> int:
    """The CZ_F_* flags of an entry (without F_RANGES: the ranges map says that)."""
    return (
        (F_PORT_FILTER if e.port_filter else 0)
        | (F_ALLOW_ICMP if e.allow_icmp else 0)
        | (F_LEARN if e.learning else 0)
    )


def _service_entry(addr: IPAddress, flags: int, service: str = "") -> ServiceEntry:
    """The ServiceEntry of an LB role: its pod IP and its flags."""
    pf, icmp, learn = (bool(flags & f) for f in (F_PORT_FILTER, F_ALLOW_ICMP, F_LEARN))
    return ServiceEntry(addr, pf, icmp, service, learn)


def _pod_entry(addr: IPAddress, flags: int, service: str = "") -> PodEntry:
    """The PodEntry of a pod role: its LB IP and its flags."""
    pf, icmp, learn = (bool(flags & f) for f in (F_PORT_FILTER, F_ALLOW_ICMP, F_LEARN))
    return PodEntry(addr, pf, icmp, service, learn)


def _ip(raw: bytes) -> IPAddress:
    return IPv4Address(raw) if len(raw) == 4 else IPv6Address(raw)


_ALLOW_TAIL = struct.Struct("!BBH")  # allow4/6 keys after the pod IP: proto, reserved, port
_PORT = struct.Struct("!BBH")  # struct cz_port


def _allow_bytes(a: AllowedPort) -> bytes:
    return a.pod_ip.packed + _ALLOW_TAIL.pack(int(a.proto), 0, a.port)


def _port_bytes(a: AllowedPort) -> bytes:
    """struct cz_port of an allowed port (also the tail of its allow4/allow6 key)."""
    return _PORT.pack(int(a.proto), 0, a.port)


def _ports_bytes(ports: Iterable[bytes]) -> tuple[int, bytes]:
    """(nports, ports[]) of an addr value from struct cz_port bytes: sorted (by protocol, then
    port), the first INLINE_PORTS of them inline; more than that is marked PORTS_SPILL
    (allow4/allow6 hold them all)."""
    ps = sorted(ports)
    n = len(ps) if len(ps) <= INLINE_PORTS else PORTS_SPILL
    return n, b"".join(ps[:INLINE_PORTS]).ljust(4 * INLINE_PORTS, b"\0")


_ZERO = {4: bytes(4), 16: bytes(16)}
_SLOTS = struct.Struct("=III")  # addr values' tail: in_slot, out_slot, reserved


class _Mirror:
    """What the maps hold, keyed by packed addresses (cheap to hash, unlike ipaddress objects):
    enough to encode any addr value without reading the maps. Each role (an LB IP, a pod IP)
    names the Service it is counted for; `refs` says how many roles name each Service (those
    named by none give their counter slot back)."""

    def __init__(self) -> None:
        self.svc: dict[bytes, tuple[bytes, int, str]] = {}  # LB IP -> (pod IP, flags, Service)
        self.pod: dict[bytes, tuple[bytes, int, str]] = {}  # pod IP -> (LB IP, flags, Service)
        self.ports: dict[bytes, set[bytes]] = {}  # pod IP -> its allowed ports (cz_port)
        self.lbs_of: dict[bytes, set[bytes]] = {}  # pod IP -> LB IPs whose Service goes there
        self.enc: dict[bytes, tuple[int, bytes]] = {}  # pod IP -> its encoded ports (a cache)
        self.refs: dict[str, int] = {}  # Service -> roles that name it
        self.ranges: dict[bytes, Ranges] = {}  # restricted pod IP -> its source ranges

    @classmethod
    def of(cls, st: MapState) -> _Mirror:
        m = cls()
        for lb, s in st.services.items():
            m.link(lb.packed, s.pod_ip.packed, _flags(s), s.service)
        for p, e in st.pods.items():
            m.set_pod(p.packed, e.lb_ip.packed, _flags(e), e.service)
        for a in st.allowed:
            m.ports.setdefault(a.pod_ip.packed, set()).add(_port_bytes(a))
        m.ranges = {p.packed: nets for p, nets in st.ranges.items()}
        return m

    def _ref(self, service: str, step: int) -> None:
        if service:
            n = self.refs.get(service, 0) + step
            if n:
                self.refs[service] = n
            else:
                del self.refs[service]

    def link(self, lb: bytes, pod: bytes, flags: int, service: str) -> None:
        self.unlink(lb)
        self.svc[lb] = (pod, flags, service)
        self._ref(service, 1)
        self.lbs_of.setdefault(pod, set()).add(lb)

    def unlink(self, lb: bytes) -> str | None:
        """Remove the LB role of `lb`; the Service it named, if any."""
        old = self.svc.pop(lb, None)
        if old is None:
            return None
        self._ref(old[2], -1)
        lbs = self.lbs_of.get(old[0])
        if lbs is not None:
            lbs.discard(lb)
            if not lbs:
                del self.lbs_of[old[0]]
        return old[2]

    def set_pod(self, pod: bytes, lb: bytes, flags: int, service: str) -> None:
        self.del_pod(pod)
        self.pod[pod] = (lb, flags, service)
        self._ref(service, 1)

    def del_pod(self, pod: bytes) -> str | None:
        """Remove the pod role of `pod`; the Service it named, if any."""
        old = self.pod.pop(pod, None)
        if old is None:
            return None
        self._ref(old[2], -1)
        return old[2]

    def value(self, addr: bytes, slot_of: Callable[[str], int]) -> bytes | None:
        """The addr value of `addr` (bpf/lib/types.h), with the counter slots `slot_of` gives
        its Services; None when it is neither an LB IP nor a pod IP."""
        svc, pod = self.svc.get(addr), self.pod.get(addr)
        if svc is None and pod is None:
            return None
        zero = _ZERO[len(addr)]
        lb, pod_flags, pod_svc = pod if pod is not None else (zero, 0, "")
        out_slot = slot_of(pod_svc) if pod_svc else 0
        if svc is not None:  # ingress uses the LB role
            to, flags, in_svc = svc
            in_pod, in_slot = to, slot_of(in_svc) if in_svc else 0
        else:  # traffic to the pod IP directly: no rewrite, the pod's flags and Service
            to, flags, in_pod, in_slot = zero, pod_flags, addr, out_slot
        kind = (K_LB if svc is not None else 0) | (K_POD if pod is not None else 0)
        if in_pod in self.ranges:
            flags |= F_RANGES
        if pod is not None and addr in self.ranges:
            pod_flags |= F_RANGES  # egress records the flows, so that replies pass
        enc = self.enc.get(in_pod)
        if enc is None:
            enc = self.enc[in_pod] = _ports_bytes(self.ports.get(in_pod, ()))
        return (
            to
            + bytes((kind, flags, pod_flags, enc[0]))
            + lb
            + enc[1]
            + _SLOTS.pack(in_slot, out_slot, 0)
        )


def _read_version(fd: int) -> int | None:
    val = MetaVal()
    if not bpfsys.map_lookup(fd, ctypes.c_uint32(0), val):
        return None
    return int(val.layout_version)


def _kind_problem(spec: MapSpec, info: bpfsys.MapInfo) -> str | None:
    """What differs in type, key or value size (the layout proper, not the size)."""
    want = (spec.map_type, spec.key_size, spec.value_size)
    have = (info.type, info.key_size, info.value_size)
    names = ("type", "key size", "value size")
    diffs = [f"{n} {h} (want {w})" for n, h, w in zip(names, have, want, strict=True) if h != w]
    return ", ".join(diffs) or None


def _size_problem(spec: MapSpec, info: bpfsys.MapInfo) -> str | None:
    if info.max_entries == spec.max_entries:
        return None
    return f"max entries {info.max_entries} (want {spec.max_entries})"


def _lb_at(n: int) -> int:
    """Offset of lb_ip in an addr value whose addresses have n bytes (bpf/lib/types.h)."""
    return n + 4


def _slots_at(n: int) -> int:
    """Offset of in_slot (then out_slot) in an addr value whose addresses have n bytes."""
    return 2 * n + 4 + 4 * INLINE_PORTS


class _Addr(NamedTuple):
    """An addr4/addr6 value's fields (addresses as packed bytes)."""

    pod_ip: bytes
    kind: int
    flags: int
    pod_flags: int
    lb_ip: bytes


def _decode_addr(vraw: bytes, n: int) -> _Addr:
    lb = _lb_at(n)
    return _Addr(vraw[:n], vraw[n], vraw[n + 1], vraw[n + 2], vraw[lb : lb + n])


def _flow_key_fields(raw: bytes) -> Flow:
    """A flow4/flow6 key's fields (addresses as in the key, ports as numbers)."""
    n = 4 if len(raw) == 16 else 16
    pod, remote = raw[:n], raw[n : 2 * n]
    pp, rp = struct.unpack_from("!HH", raw, 2 * n)
    return Flow(_ip(pod), _ip(remote), pp, rp, raw[2 * n + 4])


def _flow_key_bytes(f: Flow) -> bytes:
    return f.pod_ip.packed + f.remote_ip.packed + struct.pack("!HHB3x", *f[2:])


def _check_bpffs(pin_dir: str) -> None:
    """The pin directory, or where it will be made, must be on a bpf filesystem: pins cannot
    live anywhere else, and nothing is created or changed (no mkdir, no chmod) elsewhere."""
    from cozyebpf.datapath.attach import on_bpffs

    existing = os.path.abspath(pin_dir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not on_bpffs(existing):
        raise DatapathError(
            f"--pin-dir {pin_dir} is not on a bpf filesystem ({existing} is not); give a "
            f"directory under a bpffs mount such as {DEFAULT_PIN_DIR} (mount -t bpf bpf "
            "/sys/fs/bpf)"
        )


class PinnedMaps:
    """File descriptors of every cozyebpf map under one pin directory, and the mirror of the
    state they hold. `sizes` is each map's size (max entries): an addr map holds the LB IPs
    and the pod IPs of its family (a pod IP that is also an LB IP once), an allow map the
    allowed ports, a flow map the flows the pods opened; `capacity()` says it in the model's
    terms."""

    def __init__(self, pin_dir: str, fds: dict[str, int], layout: Layout) -> None:
        self.pin_dir = pin_dir
        self.fds = fds
        self.layout = layout
        self.sizes = {s.name: s.max_entries for s in layout.all if not s.fixed}
        self.slots = ServiceSlots(
            fds[layout.svcnames.name], fds[layout.svcstats.name], layout.slots, possible_cpus()
        )
        self._no_batch = False  # set when the kernel refuses batch operations
        self._m: _Mirror | None = None  # the mirror; None: read the maps before the next apply
        self._repair = False  # read_state rewrites addr values that disagree (the agent's)
        self._old_flows: list[tuple[MapSpec, int]] = []  # flow maps replaced by a resize
        #: the flow hints must be seeded again once the new egress program runs (the maps
        #: were upgraded or resized while older programs were recording flows)
        self.hints_need_seed = False

    @property
    def max_services(self) -> int:
        return self.layout.max_services

    # -- opening -------------------------------------------------------------------------

    @classmethod
    def open(cls, pin_dir: str = DEFAULT_PIN_DIR) -> PinnedMaps:
        """Open existing pins (for `maps dump`), whatever their size; every map must be there
        with our layout."""
        fds: dict[str, int] = {}
        try:
            specs = map_specs().all
            for spec in specs:
                path = os.path.join(pin_dir, spec.name)
                try:
                    fd = bpfsys.obj_get(path)
                except bpfsys.BpfError as e:
                    if e.errno == errno.ENOENT:
                        raise DatapathError(
                            f"no cozyebpf map pinned at {path}: is `cozyebpf run` running on "
                            f"this node (and is --pin-dir the same)? (maps of an older "
                            f"cozyebpf are upgraded by `cozyebpf run` of this version)"
                        ) from None
                    raise DatapathError(f"cannot open {path}: {e}") from e
                fds[spec.name] = fd
                problem = _kind_problem(spec, bpfsys.map_info(fd))
                if problem:
                    raise DatapathError(
                        f"pinned map {path} has another layout ({problem}): it was made by "
                        f"another cozyebpf version; this one cannot read it. `cozyebpf run` "
                        f"of this version migrates it"
                    )
            services = bpfsys.map_info(fds["addr4"]).max_entries // 2
            slots = bpfsys.map_info(fds["svcstats"]).max_entries - 1
            maps = cls(pin_dir, fds, map_specs(max(1, services), max(1, slots)))
            maps._check_version()
            return maps
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise

    @classmethod
    def ensure(
        cls,
        pin_dir: str = DEFAULT_PIN_DIR,
        max_services: int = DEFAULT_MAX_SERVICES,
        service_slots: int | None = None,
    ) -> PinnedMaps:
        """Open the pins, creating (and pinning, mode 0600 in a 0700 dir) any that are missing,
        every map sized for `max_services` Services, `service_slots` of them counted on their
        own (layout.map_specs).

        A pin with another layout is never reused as it is: a map whose type, key and value
        sizes are unchanged since its layout version (SAME_SINCE) and whose only change is its
        size is migrated, its entries copied; any other map is rebuilt empty (the controller
        refills services, pods and ports; flows and counters start over). Each migration is
        logged."""
        layout = map_specs(max_services, service_slots)
        _check_bpffs(pin_dir)
        os.makedirs(pin_dir, mode=0o700, exist_ok=True)
        os.chmod(pin_dir, 0o700)
        fds: dict[str, int] = {}
        created: list[str] = []
        old_flows: list[tuple[MapSpec, int]] = []
        reseed = False
        try:
            meta_path = os.path.join(pin_dir, META.name)
            try:
                fds[META.name] = bpfsys.obj_get(meta_path)
            except bpfsys.BpfError as e:
                if e.errno != errno.ENOENT:
                    raise DatapathError(f"cannot open {meta_path}: {e}") from e
                fds[META.name] = cls._create(META, meta_path)
                created.append(META.name)
                version: int | None = None
            else:
                info = bpfsys.map_info(fds[META.name])
                problem = _kind_problem(META, info) or _size_problem(META, info)
                version = None if problem else _read_version(fds[META.name])
                if problem:  # not a meta of ours: nothing is proven, a new one
                    fds[META.name] = cls._migrate(
                        META, fds[META.name], info, meta_path, problem, copy=False
                    )
            if version is not None and version > LAYOUT_VERSION:
                version = None  # a newer cozyebpf's: nothing is proven the same
            for spec in layout.all:
                if spec.name == META.name:
                    continue
                path = os.path.join(pin_dir, spec.name)
                try:
                    fd = bpfsys.obj_get(path)
                except bpfsys.BpfError as e:
                    if e.errno != errno.ENOENT:
                        raise DatapathError(f"cannot open {path}: {e}") from e
                    fds[spec.name] = cls._create(spec, path)
                    created.append(spec.name)
                    reseed = reseed or spec.name == "flowhint"
                    continue
                info = bpfsys.map_info(fd)
                proven = version is not None and version >= SAME_SINCE[spec.name]
                kind_problem = _kind_problem(spec, info)
                size_problem = _size_problem(spec, info)
                if proven and not kind_problem and not size_problem:
                    fds[spec.name] = fd
                    continue
                why = kind_problem or size_problem or f"layout version {version}"
                if not proven and not kind_problem:
                    why = f"layout version {version} (want {LAYOUT_VERSION})"
                # the flow hint's bits depend on its size: rebuilt, then seeded from the flows;
                # prog arrays are filled by the loader
                copy = proven and not kind_problem and spec.name != "flowhint"
                copy = copy and spec.map_type != bpfsys.BPF_MAP_TYPE_PROG_ARRAY
                keep_old = copy and spec.name in ("flow4", "flow6")
                fds[spec.name] = cls._migrate(spec, fd, info, path, why, copy, keep_old)
                if keep_old:
                    old_flows.append((spec, fd))
                reseed = reseed or spec.name in ("flowhint", "flow4", "flow6")
            maps = cls(pin_dir, fds, layout)
            if "flowcfg" in created or _read_version(fds[META.name]) != LAYOUT_VERSION:
                maps.set_flow_timeouts(**DEFAULT_FLOW_TIMEOUTS)  # before any program reads it
            maps._repair = True
            maps._old_flows = old_flows
            if reseed:
                maps.seed_flow_hints()
                maps.hints_need_seed = True
            if version is not None and 1 < version < LAYOUT_VERSION:
                log.warning(
                    "upgrading maps in %s from layout version %d to %d: %s created beside "
                    "the maps kept; every address gets its Service's counter slot at the "
                    "first sync",
                    pin_dir,
                    version,
                    LAYOUT_VERSION,
                    ", ".join(n for n in created if SAME_SINCE.get(n, 0) > version),
                )
            bpfsys.map_update(
                fds[META.name], ctypes.c_uint32(0), MetaVal(layout_version=LAYOUT_VERSION)
            )
        except bpfsys.BpfError as e:
            for fd in fds.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
            hint = " (cozyebpf needs CAP_SYS_ADMIN)" if e.errno == errno.EPERM else ""
            raise DatapathError(f"preparing the maps in {pin_dir} failed: {e}{hint}") from e
        except BaseException:
            for fd in fds.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise
        if created:
            log.info("created maps in %s: %s", pin_dir, ", ".join(created))
        kept = [s.name for s in layout.all if s.name not in created]
        if kept:
            log.info("adopted pinned maps in %s: %s", pin_dir, ", ".join(kept))
        return maps

    @staticmethod
    def _new_map(spec: MapSpec) -> int:
        return bpfsys.map_create(
            spec.map_type,
            spec.key_size,
            spec.value_size,
            spec.max_entries,
            f"cz_{spec.name}",
            spec.flags,
        )

    @classmethod
    def _create(cls, spec: MapSpec, path: str) -> int:
        fd = cls._new_map(spec)
        bpfsys.obj_pin(fd, path)
        os.chmod(path, 0o600)
        return fd

    @classmethod
    def _migrate(
        cls,
        spec: MapSpec,
        old_fd: int,
        info: bpfsys.MapInfo,
        path: str,
        why: str,
        copy: bool,
        keep_old: bool = False,
    ) -> int:
        """Replace the pin at `path` by a map with our layout, copying entries if `copy`. The
        old map's fd is closed unless `keep_old`."""
        ringbuf = info.type == bpfsys.BPF_MAP_TYPE_RINGBUF  # no keys
        keys = [] if ringbuf else bpfsys.map_keys(old_fd, info.key_size)
        new_fd = cls._new_map(spec)
        copied = cls._copy_entries(spec, old_fd, new_fd, keys) if copy else 0
        if not keep_old:
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
    def _copy_entries(spec: MapSpec, old_fd: int, new_fd: int, keys: list[bytes]) -> int:
        per_cpu = spec.map_type == bpfsys.BPF_MAP_TYPE_PERCPU_ARRAY
        size = (spec.value_size + 7) // 8 * 8 * possible_cpus() if per_cpu else spec.value_size
        copied = 0
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
        return copied

    def _check_version(self) -> None:
        version = _read_version(self.fds[META.name])
        if version is None:
            raise DatapathError(f"{self.pin_dir}/meta holds no layout version")
        if version != LAYOUT_VERSION:
            raise DatapathError(
                f"maps in {self.pin_dir} have layout version {version}, this "
                f"cozyebpf uses {LAYOUT_VERSION}; `cozyebpf run` of this version migrates them"
            )

    # -- flow hints ----------------------------------------------------------------------

    def seed_flow_hints(self) -> int:
        """Set the flow-hint bit of every flow in flow4/flow6 in user space's half (copying
        first the flows a resized flow map's predecessor got meanwhile). Call it once the
        egress program of this layout runs, before the ingress program that trusts the hints
        is attached: flows recorded by older programs have no bit yet. The number of flows."""
        for spec, old_fd in self._old_flows:
            new_fd = self.fds[spec.name]
            have = set(bpfsys.map_keys(new_fd, spec.key_size))
            missing = [k for k in bpfsys.map_keys(old_fd, spec.key_size) if k not in have]
            self._copy_entries(spec, old_fd, new_fd, missing)
            os.close(old_fd)
        self._old_flows = []
        self.forget_seen()  # the flow maps were rebuilt or copied: no slot vouches for them
        keys = [
            raw
            for spec in (self.layout.flow4, self.layout.flow6)
            for raw in bpfsys.map_keys(self.fds[spec.name], spec.key_size)
        ]
        self._set_hints(_flow_key_fields(k) for k in keys)
        return len(keys)

    def _set_hints(self, flows: Iterable[Flow]) -> None:
        """OR the flows' bits into user space's words (user space is their only writer)."""
        log2 = self.layout.hint_log2
        bits: dict[int, int] = {}
        for f in flows:
            b = flow_hint_bit(
                f.pod_ip.packed, f.remote_ip.packed, f.pod_port, f.remote_port, f.proto, log2
            )
            word = 2 * (b >> 6) + 1  # user space's word of the pair (bpf/lib/types.h)
            bits[word] = bits.get(word, 0) | 1 << (b & 63)
        if not bits:
            return
        fd = self.fds[self.layout.flowhint.name]
        keys, values = [], []
        for idx, mask in bits.items():
            cur = ctypes.c_uint64()
            bpfsys.map_lookup(fd, ctypes.c_uint32(idx), cur)
            keys.append(struct.pack("=I", idx))
            values.append(struct.pack("=Q", cur.value | mask))
        self._update_batch(self.layout.flowhint, keys, values)

    def forget_seen(self) -> None:
        """Zero every CPU's seen4/seen6 slots (types.h, struct flow4_seen): the fast paths then
        look every flow up again. Whoever writes, deletes or replaces flow entries calls this
        after, so that no slot vouches for an entry that changed under it."""
        for spec in (self.layout.seen4, self.layout.seen6):
            keys = [struct.pack("=I", i) for i in range(spec.max_entries)]
            zero = bytes(spec.value_size * possible_cpus())
            self._update_batch(spec, keys, [zero] * len(keys))

    def add_flows(
        self, flows: Iterable[Flow], last_seen_ns: int | None = None, closing: bool = False
    ) -> None:
        """Write flow-table entries as the egress program records them (with their hint
        bits), last seen now unless said: for tests, benchmarks and tools."""
        fl = list(flows)
        self._set_hints(fl)
        seen = coarse_now_ns() if last_seen_ns is None else last_seen_ns
        val = Flow4Val(last_seen_ns=seen | (FLOW_CLOSING if closing else 0))
        for f in fl:
            spec = self.layout.flow4 if f.pod_ip.version == 4 else self.layout.flow6
            key = _flow_key_bytes(f)
            bpfsys.map_update(self.fds[spec.name], ctypes.create_string_buffer(key, len(key)), val)
        self.forget_seen()

    def flows(self) -> set[Flow]:
        """Every entry of flow4 and flow6."""
        return {
            _flow_key_fields(raw)
            for spec in (self.layout.flow4, self.layout.flow6)
            for raw in bpfsys.map_keys(self.fds[spec.name], spec.key_size)
        }

    # -- closing -------------------------------------------------------------------------

    def close(self) -> None:
        for fd in [*self.fds.values(), *(f for _, f in self._old_flows)]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = {}
        self._old_flows = []

    def __enter__(self) -> PinnedMaps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading -------------------------------------------------------------------------

    def _raw_items(self, fd: int, key_size: int, value_size: int) -> Iterator[tuple[bytes, bytes]]:
        """(key, value) pairs of a hash map: BPF_MAP_LOOKUP_BATCH (about 17x faster than a key
        walk, bench/), or the walk on kernels without batch operations."""
        if not self._no_batch:
            try:
                yield from bpfsys.map_items_batch(fd, key_size, value_size)
                return
            except bpfsys.BpfError as e:
                if e.errno not in bpfsys.BATCH_UNSUPPORTED:
                    raise
                self._no_batch = True
        for raw in bpfsys.map_keys(fd, key_size):
            val = ctypes.create_string_buffer(value_size)
            if bpfsys.map_lookup(fd, ctypes.create_string_buffer(raw, key_size), val):
                yield raw, val.raw  # gone meanwhile: skipped

    def _items(self, spec: MapSpec) -> Iterator[tuple[bytes, bytes]]:
        return self._raw_items(self.fds[spec.name], spec.key_size, spec.value_size)

    def _read_addrs(self, m: _Mirror) -> tuple[MapState, dict[bytes, bytes], set[bytes]]:
        """services and pods from addr4/addr6 (into `m` too), the raw values by key, and the
        pod IPs that some value marks restricted (F_RANGES). The Service of each role is the
        one svcnames names its slot for ("" without one)."""
        st = MapState()
        raw: dict[bytes, bytes] = {}
        restricted: set[bytes] = set()
        name = self.slots.name
        for spec, n in ((self.layout.addr4, 4), (self.layout.addr6, 16)):
            lb_at, slots_at = _lb_at(n), _slots_at(n)
            for kraw, vraw in self._items(spec):
                addr = _ip(kraw)
                kind = vraw[n]
                in_slot, out_slot, _ = _SLOTS.unpack_from(vraw, slots_at)
                if vraw[n + 1] & F_RANGES:
                    restricted.add(vraw[:n] if kind & K_LB else kraw)
                if kind & K_POD and vraw[n + 2] & F_RANGES:
                    restricted.add(kraw)
                if kind & K_LB:
                    pod, flags, svc = vraw[:n], vraw[n + 1] & ~F_RANGES, name(in_slot)
                    m.link(kraw, pod, flags, svc)
                    st.services[addr] = _service_entry(_ip(pod), flags, svc)
                if kind & K_POD:
                    lb, flags, svc = (
                        vraw[lb_at : lb_at + n],
                        vraw[n + 2] & ~F_RANGES,
                        name(out_slot),
                    )
                    m.set_pod(kraw, lb, flags, svc)
                    st.pods[addr] = _pod_entry(_ip(lb), flags, svc)
                raw[kraw] = vraw
        return st, raw, restricted

    def _read_ranges(self, restricted: set[bytes]) -> dict[IPAddress, Ranges]:
        """The source ranges of every pod an addr value marks restricted (none: no source).
        Entries of a pod that no value marks (a write that stopped half way) are never looked
        at by the programs; the agent's maps (ensure) delete them here."""
        nets: dict[bytes, set[IPv4Network | IPv6Network]] = {p: set() for p in restricted}
        stray: list[bytes] = []
        for spec in (self.layout.range4, self.layout.range6):
            for raw in bpfsys.map_keys(self.fds[spec.name], spec.key_size):
                pod, net = _range_of(raw)
                if pod in nets:
                    nets[pod].add(net)
                else:
                    stray.append(raw)
        if stray and self._repair:
            log.warning("%d source-range entries of unrestricted pods: deleted", len(stray))
            self._write_ranges(stray, delete=True)
        return {_ip(p): frozenset(v) for p, v in nets.items()}

    def _read_slots(self) -> None:
        self.slots.load(self._items(self.layout.svcnames))

    def _read_allowed(self, m: _Mirror | None = None) -> tuple[set[AllowedPort], _Mirror | None]:
        """The allowed ports (into `m` too)."""
        out: set[AllowedPort] = set()
        for spec, n in ((self.layout.allow4, 4), (self.layout.allow6, 16)):
            for kraw, _ in self._items(spec):
                proto_n, _, port = _ALLOW_TAIL.unpack_from(kraw, n)
                try:
                    proto = Proto(proto_n)
                except ValueError:
                    # not something we write, and not representable in a MapState: it stays
                    # (harmless: the filter only looks up TCP, UDP and SCTP)
                    log.warning("%s holds an entry with unknown protocol %d", spec.name, proto_n)
                    continue
                out.add(AllowedPort(_ip(kraw[:n]), proto, port))
                if m is not None:
                    m.ports.setdefault(kraw[:n], set()).add(kraw[n:])
        return out, m

    def read_state(self) -> MapState:
        """Everything in addr4/addr6 and allow4/allow6, as one MapState; it refreshes the
        mirror. The agent's maps (ensure) also rewrite here any addr value that disagrees with
        the state (its inline ports are not part of a MapState, so no diff would repair them)."""
        self._read_slots()
        m = _Mirror()
        st, raw, restricted = self._read_addrs(m)
        st.allowed = self._read_allowed(m)[0]
        st.ranges = self._read_ranges(restricted)
        m.ranges = {p.packed: nets for p, nets in st.ranges.items()}
        self._m = m
        if self._repair:
            # a write that stopped half way: the slots that addresses carry are active, the
            # others parked
            active = set(self.slots.active().values())
            self.slots.activate(sorted(set(m.refs) - active))
            self.slots.park(sorted(active - set(m.refs)))
            stale = [k for k, v in raw.items() if m.value(k, self.slots.slot) not in (v, None)]
            if stale:
                log.warning(
                    "%d addr entries disagreed with the allowed ports (edited by hand?): rewritten",
                    len(stale),
                )
                self._write_addrs(stale)
        return st

    def capacity(self) -> Capacity:
        """The maps' sizes in the model's terms: what fits (--max-services sets them)."""
        return Capacity(
            tuple(
                MapLimit(spec.name, self.sizes[spec.name], kinds)
                for spec, kinds in (
                    # LB IPs and pod IPs share addr4 (an address that is both counts twice)
                    (self.layout.addr4, (("services", 4), ("pods", 4))),
                    (self.layout.allow4, (("allowed", 4),)),
                    (self.layout.addr6, (("services", 6), ("pods", 6))),
                    (self.layout.allow6, (("allowed", 6),)),
                    (self.layout.range4, (("ranges", 4),)),
                    (self.layout.range6, (("ranges", 6),)),
                )
            )
        )

    def lookup_service(self, lb: IPAddress) -> ServiceEntry | None:
        """The entry of one LB IP, by a single lookup (no map walk): for probes and tools that
        must not depend on the map layout."""
        vraw = self._lookup_addr(lb)
        if vraw is None:
            return None
        n = len(lb.packed)
        v = _decode_addr(vraw, n)
        if not v.kind & K_LB:
            return None
        svc = self.service_of_slot(_SLOTS.unpack_from(vraw, _slots_at(n))[0])
        return _service_entry(_ip(v.pod_ip), v.flags, svc)

    def lookup_pod(self, pod: IPAddress) -> PodEntry | None:
        """The entry of one pod IP, by a single lookup."""
        vraw = self._lookup_addr(pod)
        if vraw is None:
            return None
        n = len(pod.packed)
        v = _decode_addr(vraw, n)
        if not v.kind & K_POD:
            return None
        svc = self.service_of_slot(_SLOTS.unpack_from(vraw, _slots_at(n))[1])
        return _pod_entry(_ip(v.lb_ip), v.pod_flags, svc)

    def _lookup_addr(self, addr: IPAddress) -> bytes | None:
        spec = self.layout.addr4 if addr.version == 4 else self.layout.addr6
        val = ctypes.create_string_buffer(spec.value_size)
        key = ctypes.create_string_buffer(addr.packed, len(addr.packed))
        return val.raw if bpfsys.map_lookup(self.fds[spec.name], key, val) else None

    def has_allowed(self, a: AllowedPort) -> bool:
        """Whether the allowed-port entry `a` is programmed, by a single lookup."""
        spec = self.layout.allow4 if a.version == 4 else self.layout.allow6
        key = _allow_bytes(a)
        return bpfsys.map_lookup(
            self.fds[spec.name], ctypes.create_string_buffer(key, len(key)), ctypes.c_uint8()
        )

    def flows_by_pod(self) -> dict[IPAddress, int]:
        """Number of flow4 and flow6 entries per pod IP."""
        out: dict[IPAddress, int] = {}
        for spec in (self.layout.flow4, self.layout.flow6):
            n = 4 if spec is self.layout.flow4 else 16
            for raw in bpfsys.map_keys(self.fds[spec.name], spec.key_size):
                pod = _ip(raw[:n])
                out[pod] = out.get(pod, 0) + 1
        return out

    def percpu(self, spec: MapSpec, key: int) -> list[bytes] | None:
        """The value of `key` in a per-CPU array, one bytes per possible CPU."""
        ncpu = possible_cpus()
        stride = (spec.value_size + 7) // 8 * 8
        buf = ctypes.create_string_buffer(stride * ncpu)
        if not bpfsys.map_lookup(self.fds[spec.name], ctypes.c_uint32(key), buf):
            return None
        raw = buf.raw
        return [raw[c * stride : c * stride + spec.value_size] for c in range(ncpu)]

    def service_counters(self) -> list[ServiceCounters]:
        """The counters of every Service with an active slot (one whose addresses carry it),
        sorted by Service."""
        self._read_slots()
        out = []
        for slot, service in self.slots.active().items():
            per_cpu = self.percpu(self.layout.svcstats, slot)
            if per_cpu is None:
                continue
            vals = [SvcStat.from_buffer_copy(v) for v in per_cpu]
            drops = {r: sum(int(v.drops[i]) for v in vals) for i, r in enumerate(SVC_DROP_REASONS)}
            out.append(
                ServiceCounters(
                    service,
                    slot,
                    sum(int(v.in_packets) for v in vals),
                    sum(int(v.in_bytes) for v in vals),
                    sum(int(v.out_packets) for v in vals),
                    sum(int(v.out_bytes) for v in vals),
                    drops,
                )
            )
        return sorted(out, key=lambda c: c.service)

    def service_of_slot(self, slot: int) -> str:
        """The Service named for `slot` in svcnames (active or parked), or "" (one lookup)."""
        if slot <= 0:
            return ""
        raw = ctypes.create_string_buffer(self.layout.svcnames.value_size)
        if not bpfsys.map_lookup(self.fds[self.layout.svcnames.name], ctypes.c_uint32(slot), raw):
            return ""
        return decode_name(raw.raw).service

    def service_names(self) -> dict[int, str]:
        """slot -> Service, for every active slot."""
        self._read_slots()
        return self.slots.active()

    def monitor_state(self) -> MonitorState:
        ctl = MonCtl()
        bpfsys.map_lookup(self.fds[self.layout.monctl.name], ctypes.c_uint32(0), ctl)
        per_cpu = self.percpu(self.layout.monstats, 0) or []
        st = [MonStat.from_buffer_copy(v) for v in per_cpu]
        return MonitorState(
            int(ctl.mode),
            int(ctl.interval_ns),
            int(ctl.burst_ns),
            sum(int(v.events) for v in st),
            sum(int(v.lost_limit) for v in st),
            sum(int(v.lost_full) for v in st),
        )

    def set_monitor(self, mode: int, interval_ns: int = 0, burst_ns: int = 0) -> None:
        """Switch the monitor's events on (layout.MON_DROPS, MON_ALL) at a rate, or off; the
        token bucket starts full."""
        ctl = MonCtl(mode=mode, interval_ns=interval_ns, burst_ns=burst_ns, tat=0)
        bpfsys.map_update(self.fds[self.layout.monctl.name], ctypes.c_uint32(0), ctl)

    def entries(self) -> dict[str, tuple[int, int]]:
        """map -> (entries, capacity), for the maps in COUNTED (a batch walk per map; a
        kernel without batch operations walks the keys)."""
        out = {}
        for name in COUNTED:
            spec = getattr(self.layout, name)
            fd = self.fds[name]
            try:
                n = bpfsys.map_count(fd, spec.key_size, spec.value_size)
            except bpfsys.BpfError as e:
                if e.errno not in bpfsys.BATCH_UNSUPPORTED:
                    raise
                n = len(bpfsys.map_keys(fd, spec.key_size))
            out[name] = (n, self.sizes[name])
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

    # -- the encoding ---------------------------------------------------------------------

    def _write_addrs(self, addrs: Iterable[bytes]) -> None:
        """Write the mirror's values of `addrs` (packed; all of them must have one)."""
        assert self._m is not None
        for spec, n in ((self.layout.addr4, 4), (self.layout.addr6, 16)):
            mine = [a for a in addrs if len(a) == n]
            values = [self._m.value(a, self.slots.slot) for a in mine]
            assert all(v is not None for v in values), "an address without a value"
            self._update_batch(spec, mine, values)  # type: ignore[arg-type]

    def _delete_addrs(self, addrs: Iterable[bytes]) -> None:
        for spec, n in ((self.layout.addr4, 4), (self.layout.addr6, 16)):
            self._delete_batch(spec, [a for a in addrs if len(a) == n])

    # -- programming ---------------------------------------------------------------------

    def apply(self, d: MapDiff) -> None:
        """Apply `d` in an order that never opens a hole: counter slots given to the Services
        that come (slots.py), addresses that are neither LB nor pod IP any more deleted (nothing
        that stays uses them, and a full map then has room for what comes), allowed ports added,
        then every addr value that changes (services, pods and the inline ports of the addresses
        whose pod's allowed ports change) written, allowed ports deleted, the slots of Services
        that went parked; one BPF_MAP_UPDATE_BATCH / DELETE_BATCH per map and step (a kernel
        without batch operations gets one call per entry). A diff that mixes families in an
        entry is refused before anything is written."""
        errors = d.family_errors()
        if errors:
            raise DatapathError(
                f"refusing to program maps in {self.pin_dir}: an entry mixes address families "
                f"({'; '.join(errors)})"
            )
        if self._m is None:
            self.read_state()
        m = self._m
        assert m is not None
        touched: set[bytes] = set()
        ported: set[bytes] = set()
        named: set[str | None] = set()  # the Services of roles that change
        # the mirror first (in apply_to's order), then the values it gives
        add_keys: dict[int, list[bytes]] = {4: [], 16: []}
        for a in d.allowed_add:
            pod = a.pod_ip.packed
            port = _port_bytes(a)
            add_keys[len(pod)].append(pod + port)  # the allow4/allow6 key
            m.ports.setdefault(pod, set()).add(port)
            ported.add(pod)
        for lb, s in d.services_set.items():
            key = lb.packed
            named.add(m.unlink(key))
            m.link(key, s.pod_ip.packed, _flags(s), s.service)
            named.add(s.service)
            touched.add(key)
        for p, e in d.pods_set.items():
            key = p.packed
            named.add(m.del_pod(key))
            m.set_pod(key, e.lb_ip.packed, _flags(e), e.service)
            named.add(e.service)
            touched.add(key)
        for lb in d.services_del:
            key = lb.packed
            named.add(m.unlink(key))
            touched.add(key)
        for p in d.pods_del:
            key = p.packed
            named.add(m.del_pod(key))
            touched.add(key)
        for a in d.allowed_del:
            pod = a.pod_ip.packed
            mine = m.ports.get(pod)
            if mine is not None:
                mine.discard(_port_bytes(a))
                if not mine:
                    del m.ports[pod]
            ported.add(pod)
        for pod in ported:
            m.enc.pop(pod, None)
            touched |= m.lbs_of.get(pod, set())
            if pod in m.pod:
                touched.add(pod)
        # source ranges: a pod's networks are added before and removed after the addr values
        # that (un)mark it restricted, so that no source it accepts is ever refused
        range_add: list[bytes] = []
        range_del: list[bytes] = []
        flipped: set[bytes] = set()
        for p, nets in d.ranges_set.items():
            pod = p.packed
            old = m.ranges.get(pod)
            if old is None:
                flipped.add(pod)
                old = frozenset()
            range_add += [_range_key(pod, n) for n in nets - old]
            range_del += [_range_key(pod, n) for n in old - nets]
            m.ranges[pod] = nets
        for p in d.ranges_del:
            pod = p.packed
            old = m.ranges.pop(pod, None)
            if old is not None:
                flipped.add(pod)
                range_del += [_range_key(pod, n) for n in old]
        for pod in flipped:
            touched |= m.lbs_of.get(pod, set())
            if pod in m.pod:
                touched.add(pod)
        sets = [a for a in touched if a in m.svc or a in m.pod]
        dels = [a for a in touched if a not in m.svc and a not in m.pod]
        services = sorted(n for n in named if n)
        try:
            self.slots.activate(n for n in services if n in m.refs)
            self._delete_addrs(dels)
            self._update_batch(self.layout.allow4, add_keys[4], [b"\x01"] * len(add_keys[4]))
            self._update_batch(self.layout.allow6, add_keys[16], [b"\x01"] * len(add_keys[16]))
            self._write_ranges(range_add)
            self._write_addrs(sets)
            self._delete_allowed(d.allowed_del)
            self._write_ranges(range_del, delete=True)
            self.slots.park(n for n in services if n not in m.refs)
        except bpfsys.BpfError as e:
            self._m = None  # the maps hold part of it: read them again before the next apply
            hint = " (map full?)" if e.errno in (errno.E2BIG, errno.ENOSPC) else ""
            raise DatapathError(f"programming maps in {self.pin_dir} failed: {e}{hint}") from e

    def _write_ranges(self, keys: list[bytes], delete: bool = False) -> None:
        """Add or delete range4/range6 keys, one call each (an LPM trie has no batch
        operations on every kernel; a pod has few ranges)."""
        one = ctypes.c_uint8(1)
        for k in keys:
            spec = self.layout.range4 if len(k) == 12 else self.layout.range6
            key = ctypes.create_string_buffer(k, len(k))
            if delete:
                bpfsys.map_delete(self.fds[spec.name], key)
            else:
                bpfsys.map_update(self.fds[spec.name], key, one)

    # -- flows ---------------------------------------------------------------------------

    def set_flow_timeouts(self, udp: float, icmp: float, tcp: float, tcp_closing: float) -> None:
        """The flows' idle timeouts in seconds (0: never), read by the programs (flowcfg)."""
        cfg = self._flow_cfg()
        for i, t in enumerate((udp, icmp, tcp, tcp_closing)):
            if t < 0:
                raise ValueError(f"a flow timeout cannot be negative: {t}")
            cfg.timeout_ns[i] = int(t * 1e9) if t else NEVER_NS
        bpfsys.map_update(self.fds[self.layout.flowcfg.name], ctypes.c_uint32(0), cfg)

    def _flow_cfg(self) -> FlowCfg:
        cfg = FlowCfg()
        bpfsys.map_lookup(self.fds[self.layout.flowcfg.name], ctypes.c_uint32(0), cfg)
        return cfg

    def set_node(self, uplinks: Sequence[int], pod_devices: bool) -> None:
        """The node's part of flowcfg (bpf/lib/cluster.h): the uplinks' ifindexes, and whether
        pod-facing hooks are attached (which turns the cluster paths on)."""
        if len(uplinks) > UPLINKS_MAX:
            raise DatapathError(
                f"{len(uplinks)} uplink devices; the programs know at most {UPLINKS_MAX}"
            )
        cfg = self._flow_cfg()
        for i in range(UPLINKS_MAX):
            cfg.uplinks[i] = uplinks[i] if i < len(uplinks) else 0
        cfg.flags = CFG_POD_DEVICES if pod_devices else 0
        bpfsys.map_update(self.fds[self.layout.flowcfg.name], ctypes.c_uint32(0), cfg)

    def node_config(self) -> tuple[list[int], bool]:
        """The uplinks' ifindexes and whether the cluster paths are on (set_node)."""
        cfg = self._flow_cfg()
        return [int(i) for i in cfg.uplinks if i], bool(cfg.flags & CFG_POD_DEVICES)

    def flow_timeouts(self) -> dict[str, float]:
        """The timeouts the programs apply, in seconds (0: never)."""
        cfg = self._flow_cfg()
        names = ("udp", "icmp", "tcp", "tcp_closing")
        t = [int(x) for x in cfg.timeout_ns]
        return {n: 0 if t[i] >= NEVER_NS else t[i] / 1e9 for i, n in enumerate(names)}

    def flow_entries(self) -> list[FlowEntry]:
        """Every flow with its value (when the pod last sent, closing or not)."""
        out = []
        for spec in (self.layout.flow4, self.layout.flow6):
            for kraw, vraw in self._items(spec):
                (v,) = struct.unpack("=Q", vraw[:8])
                out.append(
                    FlowEntry(_flow_key_fields(kraw), v & ~FLOW_CLOSING, bool(v & FLOW_CLOSING))
                )
        return out

    def _delete_allowed(self, ports: set[AllowedPort]) -> None:
        for spec, version in ((self.layout.allow4, 4), (self.layout.allow6, 6)):
            self._delete_batch(spec, [_allow_bytes(a) for a in ports if a.version == version])

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


__all__ = [
    "DEFAULT_FLOW_TIMEOUTS",
    "DEFAULT_MAX_SERVICES",
    "DEFAULT_PIN_DIR",
    "Flow",
    "FlowEntry",
    "MonitorState",
    "PinnedMaps",
    "ServiceCounters",
    "be16",
    "possible_cpus",
]
