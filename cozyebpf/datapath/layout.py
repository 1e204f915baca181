"""Map layouts: ctypes mirrors of bpf/lib/types.h and the specification of every pinned map.

The C header is the source of truth for field order; tests/test_layout.py checks these mirrors
field by field against the classes bcc generates from that header, so a drift fails CI instead
of corrupting maps.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address
from pathlib import Path

from cozyebpf.datapath import bpfsys
from cozyebpf.datapath.reasons import REASONS

#: bump with CZ_LAYOUT_VERSION in bpf/lib/types.h whenever a layout below changes
LAYOUT_VERSION = 5

F_PORT_FILTER = 0x01
F_ALLOW_ICMP = 0x02
#: flags: the pod accepts only the sources in range4/range6; pod_flags: egress records flows
F_RANGES = 0x04
#: flags: the pod is migrating, TCP that opens nothing passes its filter (pass_learn)
F_LEARN = 0x08

K_LB = 0x01  # addr value kind: an LB IP (ingress translates to pod_ip)
K_POD = 0x02  # a pod IP (egress translates to lb_ip)
INLINE_PORTS = 8  # allowed ports inline in an addr value
PORTS_SPILL = 0xFF  # nports: more than INLINE_PORTS, all of them are in allow4/allow6

#: Services the maps hold by default (`PinnedMaps.ensure(max_services=...)`)
DEFAULT_MAX_SERVICES = 65536
#: kernel memory the per-Service counters may take by default: svcstats is a per-CPU array,
#: allocated whole, 96 bytes per slot and possible CPU; with more CPUs than this allows for
#: every Service, fewer Services get counters of their own (`map_specs(service_slots=...)`)
SVCSTATS_BUDGET = 64 << 20


def possible_cpus() -> int:
    """Number of possible CPUs: the stride of per-CPU map values."""
    text = Path("/sys/devices/system/cpu/possible").read_text().strip()
    n = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        n += (int(hi) if hi else int(lo)) - int(lo) + 1
    return n


def default_service_slots(max_services: int) -> int:
    """Every Service, as long as svcstats stays within SVCSTATS_BUDGET on this machine."""
    per_slot = 96 * possible_cpus()  # sizeof(struct svc_stat) per CPU
    return max(1, min(max_services, SVCSTATS_BUDGET // per_slot - 1))


class CzPort(ctypes.Structure):
    _fields_ = [
        ("proto", ctypes.c_uint8),
        ("reserved", ctypes.c_uint8),
        ("port", ctypes.c_uint16),
    ]


class Addr4Val(ctypes.Structure):
    _fields_ = [
        ("pod_ip", ctypes.c_uint32),
        ("kind", ctypes.c_uint8),
        ("flags", ctypes.c_uint8),
        ("pod_flags", ctypes.c_uint8),
        ("nports", ctypes.c_uint8),
        ("lb_ip", ctypes.c_uint32),
        ("ports", CzPort * INLINE_PORTS),
        ("in_slot", ctypes.c_uint32),
        ("out_slot", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    ]


class Allow4Key(ctypes.Structure):
    _fields_ = [
        ("pod_ip", ctypes.c_uint32),
        ("proto", ctypes.c_uint8),
        ("reserved", ctypes.c_uint8),
        ("port", ctypes.c_uint16),
    ]


class Flow4Key(ctypes.Structure):
    _fields_ = [
        ("pod_ip", ctypes.c_uint32),
        ("remote_ip", ctypes.c_uint32),
        ("pod_port", ctypes.c_uint16),
        ("remote_port", ctypes.c_uint16),
        ("proto", ctypes.c_uint8),
        ("reserved", ctypes.c_uint8 * 3),
    ]


class Flow4Val(ctypes.Structure):
    _fields_ = [("last_seen_ns", ctypes.c_uint64)]


#: Flow4Val.last_seen_ns: the pod sent a TCP FIN or RST (the closing timeout applies); the
#: other bits are the time (CLOCK_MONOTONIC_COARSE)
FLOW_CLOSING = 1 << 63

#: flow_cfg.timeout_ns[] indices (CZ_TO_*)
TO_UDP, TO_ICMP, TO_TCP, TO_TCP_CLOSING = 0, 1, 2, 3


UPLINKS_MAX = 6  # CZ_UPLINKS_MAX
CFG_POD_DEVICES = 0x01  # CZ_CFG_POD_DEVICES


class FlowCfg(ctypes.Structure):
    """flowcfg: the flows' idle timeouts (0: never expires), and the node's part: the uplinks'
    ifindexes and CZ_CFG_* flags (bpf/lib/cluster.h)."""

    _fields_ = [
        ("timeout_ns", ctypes.c_uint64 * 4),
        ("uplinks", ctypes.c_uint32 * UPLINKS_MAX),
        ("flags", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    ]


class Range4Key(ctypes.Structure):
    """range4 (an LPM trie): prefixlen 32 + the range's; the pod IP, the network."""

    _fields_ = [
        ("prefixlen", ctypes.c_uint32),
        ("pod_ip", ctypes.c_uint32),
        ("src", ctypes.c_uint32),
    ]


class StatVal(ctypes.Structure):
    _fields_ = [("packets", ctypes.c_uint64), ("bytes", ctypes.c_uint64)]


class Ip6(ctypes.Structure):
    _fields_ = [("a", ctypes.c_uint32 * 4)]


class Addr6Val(ctypes.Structure):
    _fields_ = [
        ("pod_ip", Ip6),
        ("kind", ctypes.c_uint8),
        ("flags", ctypes.c_uint8),
        ("pod_flags", ctypes.c_uint8),
        ("nports", ctypes.c_uint8),
        ("lb_ip", Ip6),
        ("ports", CzPort * INLINE_PORTS),
        ("in_slot", ctypes.c_uint32),
        ("out_slot", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    ]


class Allow6Key(ctypes.Structure):
    _fields_ = [
        ("pod_ip", Ip6),
        ("proto", ctypes.c_uint8),
        ("reserved", ctypes.c_uint8),
        ("port", ctypes.c_uint16),
    ]


class Range6Key(ctypes.Structure):
    _fields_ = [("prefixlen", ctypes.c_uint32), ("pod_ip", Ip6), ("src", Ip6)]


class Flow6Key(ctypes.Structure):
    _fields_ = [
        ("pod_ip", Ip6),
        ("remote_ip", Ip6),
        ("pod_port", ctypes.c_uint16),
        ("remote_port", ctypes.c_uint16),
        ("proto", ctypes.c_uint8),
        ("reserved", ctypes.c_uint8 * 3),
    ]


class Flow4Seen(ctypes.Structure):
    """A slot of seen4 (struct flow4_seen): the flow a fast path of one CPU last looked up
    (found, refreshed or added), the time its entry then held, and when."""

    _fields_ = [("key", Flow4Key), ("time", ctypes.c_uint64), ("checked", ctypes.c_uint64)]


class Flow6Seen(ctypes.Structure):
    _fields_ = [("key", Flow6Key), ("time", ctypes.c_uint64), ("checked", ctypes.c_uint64)]


class Frag4Key(ctypes.Structure):
    _fields_ = [
        ("remote_ip", ctypes.c_uint32),
        ("pod_ip", ctypes.c_uint32),
        ("id", ctypes.c_uint16),
        ("proto", ctypes.c_uint8),
        ("reserved", ctypes.c_uint8),
    ]


class Frag6Key(ctypes.Structure):
    _fields_ = [
        ("remote_ip", Ip6),
        ("pod_ip", Ip6),
        ("id", ctypes.c_uint32),
        ("proto", ctypes.c_uint8),
        ("reserved", ctypes.c_uint8 * 3),
    ]


class FragVal(ctypes.Structure):
    _fields_ = [
        ("seen_ns", ctypes.c_uint64),
        ("passed", ctypes.c_uint8),
        ("reserved", ctypes.c_uint8 * 7),
    ]


class MetaVal(ctypes.Structure):
    _fields_ = [("layout_version", ctypes.c_uint32), ("reserved", ctypes.c_uint32 * 3)]


SVC_DROPS = 8  # CZ_SVC_DROPS: svc_stat.drops[]


class SvcStat(ctypes.Structure):
    """svcstats (per CPU): one Service's counters."""

    _fields_ = [
        ("in_packets", ctypes.c_uint64),
        ("in_bytes", ctypes.c_uint64),
        ("out_packets", ctypes.c_uint64),
        ("out_bytes", ctypes.c_uint64),
        ("drops", ctypes.c_uint64 * SVC_DROPS),
    ]


NAME_LEN = 64  # svc_name.ns, .name: a Kubernetes namespace or Service name (63) and a NUL


class SvcName(ctypes.Structure):
    """svcnames: slot -> the Service (user space only)."""

    _fields_ = [
        ("ns", ctypes.c_char * NAME_LEN),
        ("name", ctypes.c_char * NAME_LEN),
        ("active", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    ]


MON_OFF, MON_DROPS, MON_ALL = 0, 1, 2  # mon_ctl.mode


class MonCtl(ctypes.Structure):
    _fields_ = [
        ("mode", ctypes.c_uint32),
        ("reserved0", ctypes.c_uint32),
        ("interval_ns", ctypes.c_uint64),
        ("burst_ns", ctypes.c_uint64),
        ("reserved1", ctypes.c_uint64 * 5),
        ("tat", ctypes.c_uint64),
        ("reserved2", ctypes.c_uint64 * 7),
    ]


class MonStat(ctypes.Structure):
    _fields_ = [
        ("events", ctypes.c_uint64),
        ("lost_limit", ctypes.c_uint64),
        ("lost_full", ctypes.c_uint64),
        ("reserved", ctypes.c_uint64),
    ]


class CzEvent(ctypes.Structure):
    """A record of the `events` ring buffer."""

    _fields_ = [
        ("time_ns", ctypes.c_uint64),
        ("ifindex", ctypes.c_uint32),
        ("slot", ctypes.c_uint32),
        ("len", ctypes.c_uint32),
        ("reason", ctypes.c_uint8),
        ("dir", ctypes.c_uint8),
        ("proto", ctypes.c_uint8),
        ("v6", ctypes.c_uint8),
        ("sport", ctypes.c_uint16),
        ("dport", ctypes.c_uint16),
        ("reserved", ctypes.c_uint32),
        ("src", Ip6),
        ("dst", Ip6),
    ]


DRY_MAGIC = 0x31757279647A6363  # CZ_DRY_MAGIC: a dry run's marker (bpf/lib/dryrun.h)


class DryRes(ctypes.Structure):
    _fields_ = [
        ("nonce", ctypes.c_uint64),
        ("reason", ctypes.c_uint32),
        ("slot", ctypes.c_uint32),
    ]


def be32(ip: IPv4Address) -> int:
    """The c_uint32 whose memory holds `ip` in network byte order."""
    return int.from_bytes(ip.packed, sys.byteorder)


def ip_of(be: int) -> IPv4Address:
    return IPv4Address(be.to_bytes(4, sys.byteorder))


def ip6(ip: IPv6Address) -> Ip6:
    """An Ip6 whose memory holds `ip` in network byte order."""
    return Ip6.from_buffer_copy(ip.packed)


def ip6_of(v: Ip6) -> IPv6Address:
    return IPv6Address(bytes(v))


def be16(port: int) -> int:
    return int.from_bytes(port.to_bytes(2, "big"), sys.byteorder)


def port_of(be: int) -> int:
    return int.from_bytes(be.to_bytes(2, sys.byteorder), "big")


@dataclass(frozen=True)
class MapSpec:
    """One pinned map: its file name under the pin dir, kernel type, layout and size."""

    name: str  # pin file name and (with the cz_ prefix) the kernel's map name
    map_type: int
    key: type[ctypes._SimpleCData] | type[ctypes.Structure] | type[ctypes.Array]  # type: ignore[type-arg]
    value: type[ctypes._SimpleCData] | type[ctypes.Structure] | type[ctypes.Array]  # type: ignore[type-arg]
    max_entries: int
    macro: str  # -D name of the size in bpf/lib/maps.h, "" where C does not need it
    flags: int = 0  # map_create flags

    @property
    def key_size(self) -> int:
        return ctypes.sizeof(self.key)

    @property
    def value_size(self) -> int:
        return ctypes.sizeof(self.value)


STATS_MAX = 64  # room for new reasons without a layout change
assert len(REASONS) <= STATS_MAX


def _pow2(n: int) -> int:
    """The smallest power of two >= n (and >= 1)."""
    return 1 << max(0, n - 1).bit_length()


META = MapSpec("meta", bpfsys.BPF_MAP_TYPE_ARRAY, ctypes.c_uint32, MetaVal, 1, "")
STATS = MapSpec(
    "stats", bpfsys.BPF_MAP_TYPE_PERCPU_ARRAY, ctypes.c_uint32, StatVal, STATS_MAX, "CZ_STATS_MAX"
)
#: the full paths the entry programs hand uncommon frames to (bpf/lib/tail.h), one prog array
#: per program type; pinned, so that they keep their programs when the agent is gone
TAIL_XDP = MapSpec(
    "tail_xdp", bpfsys.BPF_MAP_TYPE_PROG_ARRAY, ctypes.c_uint32, ctypes.c_uint32, 4, ""
)
TAIL_TC = MapSpec(
    "tail_tc", bpfsys.BPF_MAP_TYPE_PROG_ARRAY, ctypes.c_uint32, ctypes.c_uint32, 4, ""
)
#: the monitor (bpf/lib/monitor.h): its switch and token bucket, its counters, its ring buffer
MONCTL = MapSpec("monctl", bpfsys.BPF_MAP_TYPE_ARRAY, ctypes.c_uint32, MonCtl, 1, "")
MONSTATS = MapSpec("monstats", bpfsys.BPF_MAP_TYPE_PERCPU_ARRAY, ctypes.c_uint32, MonStat, 1, "")
EVENTS_SIZE = 256 * 1024  # bytes: about 3,600 events
_NOTHING = ctypes.c_uint8 * 0  # a ring buffer has no key or value
EVENTS = MapSpec(
    "events", bpfsys.BPF_MAP_TYPE_RINGBUF, _NOTHING, _NOTHING, EVENTS_SIZE, "CZ_EVENTS_SIZE"
)
#: explain's dry runs (bpf/lib/dryrun.h)
DRYRUN = MapSpec("dryrun", bpfsys.BPF_MAP_TYPE_PERCPU_ARRAY, ctypes.c_uint32, DryRes, 1, "")
#: the flows' timeouts (bpf/lib/types.h, struct flow_cfg)
FLOWCFG = MapSpec("flowcfg", bpfsys.BPF_MAP_TYPE_ARRAY, ctypes.c_uint32, FlowCfg, 1, "")
#: the fast paths' per-CPU cache of the flows they last looked up (struct flow4_seen): slots
#: per CPU, a power of two (CZ_SEEN_MAX)
SEEN_MAX = 256
SEEN4 = MapSpec(
    "seen4", bpfsys.BPF_MAP_TYPE_PERCPU_ARRAY, ctypes.c_uint32, Flow4Seen, SEEN_MAX, "CZ_SEEN_MAX"
)
SEEN6 = MapSpec("seen6", bpfsys.BPF_MAP_TYPE_PERCPU_ARRAY, ctypes.c_uint32, Flow6Seen, SEEN_MAX, "")


@dataclass(frozen=True)
class Layout:
    """Every pinned map of one size: `map_specs(max_services)`. The sizes derive from the number
    of Services: an addr map holds each Service's LB IP and its pod's IP (2 per Service), the
    allowed-port and flow maps 4 per Service, the fragment maps 1 per 4 Services (at least
    1024), the flow hint 32 bits per Service and half (4 bits per flow-table entry of both
    families; a power of two), the per-Service counters and names one slot per Service, as many
    as SVCSTATS_BUDGET allows on this machine unless chosen (and slot 0, never given out), the
    source ranges 4 networks per Service (allocated as they come)."""

    max_services: int
    meta: MapSpec
    addr4: MapSpec
    allow4: MapSpec
    flow4: MapSpec
    stats: MapSpec
    addr6: MapSpec
    allow6: MapSpec
    flow6: MapSpec
    frag4: MapSpec
    frag6: MapSpec
    flowhint: MapSpec
    svcstats: MapSpec
    svcnames: MapSpec
    range4: MapSpec
    range6: MapSpec
    flowcfg: MapSpec = FLOWCFG
    tail_xdp: MapSpec = TAIL_XDP
    tail_tc: MapSpec = TAIL_TC
    monctl: MapSpec = MONCTL
    monstats: MapSpec = MONSTATS
    events: MapSpec = EVENTS
    dryrun: MapSpec = DRYRUN
    seen4: MapSpec = SEEN4
    seen6: MapSpec = SEEN6

    @property
    def all(self) -> tuple[MapSpec, ...]:
        return (
            self.meta,
            self.addr4,
            self.allow4,
            self.flow4,
            self.stats,
            self.addr6,
            self.allow6,
            self.flow6,
            self.frag4,
            self.frag6,
            self.flowhint,
            self.tail_xdp,
            self.tail_tc,
            self.svcstats,
            self.svcnames,
            self.monctl,
            self.monstats,
            self.events,
            self.dryrun,
            self.range4,
            self.range6,
            self.flowcfg,
            self.seen4,
            self.seen6,
        )

    @property
    def slots(self) -> int:
        """Per-Service counter slots (slot 0 is never given to a Service)."""
        return self.svcstats.max_entries - 1

    @property
    def hint_words(self) -> int:
        """Words of one half of the flow hint (a power of two)."""
        return self.flowhint.max_entries // 2

    @property
    def hint_log2(self) -> int:
        """log2 of the bits of one half (CZ_FLOWHINT_LOG2)."""
        return (self.hint_words * 64).bit_length() - 1


def map_specs(max_services: int = DEFAULT_MAX_SERVICES, service_slots: int | None = None) -> Layout:
    """The maps for `max_services` Services (see Layout), `service_slots` of them with counters
    of their own (default: default_service_slots)."""
    if max_services < 1:
        raise ValueError(f"max_services must be at least 1, not {max_services}")
    s = max_services
    slots = default_service_slots(s) if service_slots is None else service_slots
    if slots < 1:
        raise ValueError(f"service_slots must be at least 1, not {slots}")
    hash_, lru = bpfsys.BPF_MAP_TYPE_HASH, bpfsys.BPF_MAP_TYPE_LRU_HASH
    lpm, no_prealloc = bpfsys.BPF_MAP_TYPE_LPM_TRIE, bpfsys.BPF_F_NO_PREALLOC
    frags = max(1024, s // 4)
    u64 = ctypes.c_uint64
    return Layout(
        s,
        META,
        MapSpec("addr4", hash_, ctypes.c_uint32, Addr4Val, 2 * s, "CZ_ADDR4_MAX"),
        MapSpec("allow4", hash_, Allow4Key, ctypes.c_uint8, 4 * s, "CZ_ALLOW4_MAX"),
        MapSpec("flow4", lru, Flow4Key, Flow4Val, 4 * s, "CZ_FLOW4_MAX"),
        STATS,
        MapSpec("addr6", hash_, Ip6, Addr6Val, 2 * s, "CZ_ADDR6_MAX"),
        MapSpec("allow6", hash_, Allow6Key, ctypes.c_uint8, 4 * s, "CZ_ALLOW6_MAX"),
        MapSpec("flow6", lru, Flow6Key, Flow4Val, 4 * s, "CZ_FLOW6_MAX"),
        MapSpec("frag4", lru, Frag4Key, FragVal, frags, "CZ_FRAG4_MAX"),
        MapSpec("frag6", lru, Frag6Key, FragVal, frags, "CZ_FRAG6_MAX"),
        MapSpec(
            "flowhint",
            bpfsys.BPF_MAP_TYPE_ARRAY,
            ctypes.c_uint32,
            u64,
            2 * _pow2(max(1, s // 2)),
            "CZ_FLOWHINT_MAX",
        ),
        MapSpec(
            "svcstats",
            bpfsys.BPF_MAP_TYPE_PERCPU_ARRAY,
            ctypes.c_uint32,
            SvcStat,
            slots + 1,
            "CZ_SVCSTATS_MAX",
        ),
        # user space only; entries are allocated as Services come (no preallocation)
        MapSpec(
            "svcnames", hash_, ctypes.c_uint32, SvcName, slots + 1, "", bpfsys.BPF_F_NO_PREALLOC
        ),
        MapSpec("range4", lpm, Range4Key, ctypes.c_uint8, 4 * s, "CZ_RANGE4_MAX", no_prealloc),
        MapSpec("range6", lpm, Range6Key, ctypes.c_uint8, 4 * s, "CZ_RANGE6_MAX", no_prealloc),
    )


DEFAULT_LAYOUT = map_specs()
ALL_MAPS: tuple[MapSpec, ...] = DEFAULT_LAYOUT.all
ADDR4, ALLOW4, FLOW4 = DEFAULT_LAYOUT.addr4, DEFAULT_LAYOUT.allow4, DEFAULT_LAYOUT.flow4
ADDR6, ALLOW6, FLOW6 = DEFAULT_LAYOUT.addr6, DEFAULT_LAYOUT.allow6, DEFAULT_LAYOUT.flow6
FRAG4, FRAG6, FLOWHINT = DEFAULT_LAYOUT.frag4, DEFAULT_LAYOUT.frag6, DEFAULT_LAYOUT.flowhint


def flow_hint_bit(
    pod: bytes, remote: bytes, pod_port: int, remote_port: int, proto: int, log2: int
) -> int:
    """The flow hint bit of a flow (cz_flow_hash in bpf/lib/lookup.h): addresses as packed
    bytes (IPv6 folded to 32 bits), on the words as they lie in memory."""

    def fold(a: bytes) -> int:
        x = 0
        for i in range(0, len(a), 4):
            x ^= int.from_bytes(a[i : i + 4], sys.byteorder)
        return x

    ports = be16(pod_port) << 16 | be16(remote_port)
    x = fold(pod) ^ fold(remote) ^ ports ^ proto
    return ((x * 0x9E3779B1) & 0xFFFFFFFF) >> (32 - log2)
