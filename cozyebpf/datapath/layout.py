"""Map layouts: ctypes mirrors of bpf/lib/types.h and the specification of every pinned map.

The C header is the source of truth for field order; tests/unit/test_layout.py checks these mirrors
field by field against the classes bcc generates from that header, so a drift fails CI instead
of corrupting maps.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from ipaddress import IPv4Address, IPv6Address
from pathlib import Path

from cozyebpf.datapath import bpfsys
from cozyebpf.datapath.reasons import REASONS

#: bump with CZ_LAYOUT_VERSION in bpf/lib/types.h whenever a layout below changes
LAYOUT_VERSION = 7
#: the oldest layout whose agent can run on maps of this layout; `meta` records it beside the
#: layout version (docs/design.md, *Releases and map layouts*). A layout that only adds (a map,
#: a field or bits that older programs leave zero and whose zero means what it meant) keeps it,
#: so that the previous release can run on its maps (a rollback keeps every flow); one that
#: changes what an older agent reads or writes (a key, a value's size, a meaning) raises it to
#: LAYOUT_VERSION. 6: layout 6 gave svcstats' values more room, which layout 5 cannot read;
#: layout 7 only added a map (addrhint), so 6 can run on its maps. Since 0.3.0 layout 7 gained
#: maps that its agents do not know and leave (tail_rare, limits, buckets) and a flag bit they
#: never read (F_LIMIT): the version stays, as both ways round each runs on the other's maps
#: (a missing map is created). Such maps are `late` (MapSpec): readers go on without them on
#: 0.3.0's maps. addrhint keeps 0.3.0's meaning; the role split of the address hint that came
#: after 0.3.0 is a map of its own (rolehint), as a pinned map never changes its meaning within
#: a layout (issue 45).
OLDEST_COMPATIBLE = 6

F_PORT_FILTER = 0x01
F_ALLOW_ICMP = 0x02
#: flags: the pod accepts only the sources in range4/range6; pod_flags: egress records flows
F_RANGES = 0x04
#: flags: the pod is migrating, TCP that opens nothing passes its filter (pass_learn)
F_LEARN = 0x08
#: flags (an LB IP): its Service has ingress limits; pod_flags (a pod IP): an egress limit; the
#: Service's slot indexes limits and buckets (bpf/lib/limit.h); since 0.3.0
F_LIMIT = 0x10

K_LB = 0x01  # addr value kind: an LB IP (ingress translates to pod_ip)
K_POD = 0x02  # a pod IP (egress translates to lb_ip)
INLINE_PORTS = 8  # allowed ports inline in an addr value
PORTS_SPILL = 0xFF  # nports: more than INLINE_PORTS, all of them are in allow4/allow6

#: Services the maps hold by default (`PinnedMaps.ensure(max_services=...)`)
DEFAULT_MAX_SERVICES = 65536
#: kernel memory the per-Service counters may take by default: svcstats is a per-CPU array,
#: allocated whole, 160 bytes per slot and possible CPU (struct svc_stat); with more CPUs than
#: this allows for every Service, fewer Services get counters of their own
#: (`map_specs(service_slots=...)`)
SVCSTATS_BUDGET = 64 << 20


@functools.cache
def possible_cpus() -> int:
    """Number of possible CPUs: the stride of per-CPU map values (fixed at boot, so read once:
    every per-CPU lookup asks, and the file cost more than the lookup)."""
    text = Path("/sys/devices/system/cpu/possible").read_text().strip()
    n = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        n += (int(hi) if hi else int(lo)) - int(lo) + 1
    return n


def default_service_slots(max_services: int) -> int:
    """Every Service, as long as svcstats stays within SVCSTATS_BUDGET on this machine."""
    per_slot = ctypes.sizeof(SvcStat) * possible_cpus()
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
        ("dev", ctypes.c_uint32),  # the programs' cache of the pod's device (cz_spoofed)
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
CFG_HOST_ROUTING = 0x02  # CZ_CFG_HOST_ROUTING
CFG_SHAPED = 0x04  # CZ_CFG_SHAPED: every uplink has fq, egress limits shape


class FlowCfg(ctypes.Structure):
    """flowcfg: the flows' idle timeouts (0: never expires), and the node's part: the uplinks'
    ifindexes and CZ_CFG_* flags (bpf/lib/fib.h)."""

    _fields_ = [
        ("timeout_ns", ctypes.c_uint64 * 4),
        ("uplinks", ctypes.c_uint32 * UPLINKS_MAX),
        ("flags", ctypes.c_uint32),
        ("fib_gen", ctypes.c_uint32),  # the routes' generation (cz_fib4_cached); was reserved
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
        ("dev", ctypes.c_uint32),  # the programs' cache of the pod's device (cz_spoofed)
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
    """meta[0], user space's alone: the layout of the maps; the oldest layout that can run on
    them (OLDEST_COMPATIBLE; 0: not recorded, by a release before 0.2.0: only their own); the
    release that wrote them (0.0.0: not recorded). Its own layout never changes."""

    _fields_ = [
        ("layout_version", ctypes.c_uint32),
        ("oldest_compatible", ctypes.c_uint32),
        ("release_major", ctypes.c_uint16),
        ("release_minor", ctypes.c_uint16),
        ("release_patch", ctypes.c_uint16),
        ("reserved", ctypes.c_uint16),
    ]


SVC_DROPS = 16  # CZ_SVC_DROPS: svc_stat.drops[] (layout 6; 9 used)


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


class Gcra(ctypes.Structure):
    """struct cz_gcra: one bucket of a Service's limits (cozyebpf/datapath/buckets.py)."""

    _fields_ = [("unit", ctypes.c_uint64), ("tol", ctypes.c_uint64)]


class LimitVal(ctypes.Structure):
    """limits: slot -> the Service's limits (unit 0: none of that kind); since 0.3.0."""

    _fields_ = [
        ("in_bytes", Gcra),
        ("in_pkts", Gcra),
        ("out_bytes", Gcra),
        ("rates", ctypes.c_uint64 * 3),  # ingress bits/s, ingress packets/s, egress bits/s
        ("guard", ctypes.c_uint64),  # 1: in_pkts is the node's guard
    ]


class BucketVal(ctypes.Structure):
    """buckets: slot -> each bucket's time (ns of the limits' clock; 0: full) and the shaped
    egress's next departure (ns of the monotonic clock; 0: none); since 0.3.0."""

    _fields_ = [
        ("in_bytes", ctypes.c_uint64),
        ("in_pkts", ctypes.c_uint64),
        ("reserved0", ctypes.c_uint64 * 6),
        ("out_bytes", ctypes.c_uint64),
        ("out_edt", ctypes.c_uint64),  # shaped egress: the next departure (ktime ns); 0: none
        ("reserved1", ctypes.c_uint64 * 6),
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


#: a ctypes mirror of a key or value
CType = type[ctypes._SimpleCData] | type[ctypes.Structure] | type[ctypes.Array]  # type: ignore[type-arg]


@dataclass(frozen=True)
class MapSpec:
    """One pinned map: an entry of the registry (MAPS), and sized for a number of Services in
    a Layout (`sized`)."""

    name: str  # the pin's file name; C declares it as cz_<name>, pinned at CZ_PIN_DIR "/<name>"
    map_type: int
    key: CType
    value: CType
    c_key: str  # the key and value as bpf/lib declares them ("": no C type)
    c_value: str
    #: max entries: a number, or a function of (Services, Services counted on their own)
    size: int | Callable[[int, int], int]
    since: int  # the first layout version since which its layout and meaning are unchanged
    macro: str = ""  # -D name of the size in bpf/lib ("": C writes the number)
    counted: bool = False  # a hash map whose fill `PinnedMaps.entries()` reports
    in_c: bool = True  # declared by the programs (False: user space's alone)
    flags: int = 0  # map_create flags
    #: values of this layout version and later are a prefix of today's (fields appended at
    #: their end, whose zero means what it meant): such a pin with smaller values is copied,
    #: its values zero-padded, not rebuilt (0: never)
    padded_since: int = 0
    #: added to layout `since` after a release of that layout had shipped (0.3.0 for layout 7):
    #: maps of that layout may lack it, as that release's agent neither creates nor writes it.
    #: A reader (`maps dump`, status) goes on without it; an agent creates it (docs/design.md,
    #: *Releases and map layouts*)
    late: bool = False
    max_entries: int = 0  # in a Layout

    @property
    def fixed(self) -> bool:
        """Its size does not depend on the number of Services."""
        return isinstance(self.size, int)

    def sized(self, services: int, slots: int) -> MapSpec:
        n = self.size if isinstance(self.size, int) else self.size(services, slots)
        return replace(self, max_entries=n)

    @property
    def key_size(self) -> int:
        return ctypes.sizeof(self.key)

    @property
    def value_size(self) -> int:
        return ctypes.sizeof(self.value)


STATS_MAX = 64  # room for new reasons without a layout change
assert len(REASONS) <= STATS_MAX
EVENTS_SIZE = 256 * 1024  # bytes: about 3,600 events
#: the fast paths' seen slots per CPU, a power of two
SEEN_MAX = 256


def _pow2(n: int) -> int:
    """The smallest power of two >= n (and >= 1)."""
    return 1 << max(0, n - 1).bit_length()


def _per_service(n: int) -> Callable[[int, int], int]:
    return lambda services, _: n * services


_u8, _u32, _u64, _nothing = ctypes.c_uint8, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_uint8 * 0
_HASH, _LRU = bpfsys.BPF_MAP_TYPE_HASH, bpfsys.BPF_MAP_TYPE_LRU_HASH
_LPM, _ARRAY = bpfsys.BPF_MAP_TYPE_LPM_TRIE, bpfsys.BPF_MAP_TYPE_ARRAY
_PERCPU = bpfsys.BPF_MAP_TYPE_PERCPU_ARRAY
_NO_PREALLOC = bpfsys.BPF_F_NO_PREALLOC

#: Every pinned map, the one place that names them: `Layout`, `SAME_SINCE`, `COUNTED` and the
#: loader's -D flags derive from it; tests/unit/test_layout.py checks it against bpf/lib (every
#: declaration, every key and value field by field). A new map: its types in bpf/lib/types.h,
#: its declaration in bpf/lib/maps.h, its ctypes mirrors above, an entry here and a field in
#: Layout (and CZ_LAYOUT_VERSION/LAYOUT_VERSION + 1).
MAPS: tuple[MapSpec, ...] = (
    # the layout version (user space's: C knows it as CZ_LAYOUT_VERSION)
    MapSpec("meta", _ARRAY, _u32, MetaVal, "__u32", "", 1, 1, in_c=False),
    # an address: LB IP (its pod IP, filter flags), pod IP (its LB IP), both; 2 per Service
    MapSpec(
        "addr4", _HASH, _u32, Addr4Val, "__be32", "struct addr4_val", _per_service(2), 2,
        "CZ_ADDR4_MAX", counted=True,
    ),
    MapSpec(
        "addr6", _HASH, Ip6, Addr6Val, "struct ip6", "struct addr6_val", _per_service(2), 2,
        "CZ_ADDR6_MAX", counted=True,
    ),
    # every allowed port: 4 per Service
    MapSpec(
        "allow4", _HASH, Allow4Key, _u8, "struct allow4_key", "__u8", _per_service(4), 1,
        "CZ_ALLOW4_MAX", counted=True,
    ),
    MapSpec(
        "allow6", _HASH, Allow6Key, _u8, "struct allow6_key", "__u8", _per_service(4), 1,
        "CZ_ALLOW6_MAX", counted=True,
    ),
    # the flows the pods opened: 4 per Service (values gained the closing mark in layout 4, in
    # a bit that layout 3 never set)
    MapSpec(
        "flow4", _LRU, Flow4Key, Flow4Val, "struct flow4_key", "struct flow4_val",
        _per_service(4), 1, "CZ_FLOW4_MAX", counted=True,
    ),
    MapSpec(
        "flow6", _LRU, Flow6Key, Flow4Val, "struct flow6_key", "struct flow4_val",
        _per_service(4), 1, "CZ_FLOW6_MAX", counted=True,
    ),
    # fragments: 1 per 4 Services, at least 1024
    MapSpec(
        "frag4", _LRU, Frag4Key, FragVal, "struct frag4_key", "struct frag_val",
        lambda s, _: max(1024, s // 4), 1, "CZ_FRAG4_MAX", counted=True,
    ),
    MapSpec(
        "frag6", _LRU, Frag6Key, FragVal, "struct frag6_key", "struct frag_val",
        lambda s, _: max(1024, s // 4), 1, "CZ_FRAG6_MAX", counted=True,
    ),
    # per-Service counter slot -> its Service (user space's, allocated as Services come) and
    # slot 0, never given out; layout 3 (addr values name their slots in what was reserved, a
    # zero there meaning "not counted per Service": values of layout 2 are valid as they are)
    MapSpec(
        "svcnames", _HASH, _u32, SvcName, "__u32", "struct svc_name", lambda _, n: n + 1, 3,
        counted=True, in_c=False, flags=_NO_PREALLOC,
    ),
    # source ranges: 4 networks per Service, allocated as they come; layout 4 (addr values of
    # layout 3 have no CZ_F_RANGES: valid as they are)
    MapSpec(
        "range4", _LPM, Range4Key, _u8, "struct range4_key", "__u8", _per_service(4), 4,
        "CZ_RANGE4_MAX", counted=True, flags=_NO_PREALLOC,
    ),
    MapSpec(
        "range6", _LPM, Range6Key, _u8, "struct range6_key", "__u8", _per_service(4), 4,
        "CZ_RANGE6_MAX", counted=True, flags=_NO_PREALLOC,
    ),
    # the node-wide counters by reason
    MapSpec(
        "stats", _PERCPU, _u32, StatVal, "__u32", "struct stat_val", STATS_MAX, 1, "CZ_STATS_MAX"
    ),
    # the flow hint: 32 bits per Service and half (4 bits per flow-table entry of both
    # families; a power of two)
    MapSpec(
        "flowhint", _ARRAY, _u32, _u64, "__u32", "__u64",
        lambda s, _: 2 * _pow2(max(1, s // 2)), 2, "CZ_FLOWHINT_MAX",
    ),
    # the addresses' hint (layout 7, 0.3.0's): a one-hash Bloom filter of addr4's keys over the
    # whole array, 64 bits per Service (a power of two). 0.3.0's programs read it; this
    # release's read rolehint, and its agent keeps this one as 0.3.0 defined it, for 0.3.0's
    # programs while they are attached (an upgrade's, a rollback's compile window). Rebuilt from
    # addr4 at every start
    MapSpec(
        "addrhint", _ARRAY, _u32, _u64, "__u32", "__u64", lambda s, _: _pow2(max(64, s)), 7,
        in_c=False,
    ),
    # the addresses' hint by role (layout 7, since 0.4.0): one-hash Bloom filters of addr4's
    # pod IPs and LB IPs, a half each, the size of addrhint; user space writes it, rebuilt from
    # addr4 at every start. addrhint's meaning never changes within layout 7: the role split is
    # a map of its own, which 0.3.0's agent neither knows nor writes
    MapSpec(
        "rolehint", _ARRAY, _u32, _u64, "__u32", "__u64", lambda s, _: _pow2(max(64, s)), 7,
        "CZ_ROLEHINT_MAX", late=True,
    ),
    # the full paths the entry programs hand uncommon frames to (bpf/lib/tail.h), one prog array
    # per program type; pinned, so that they keep their programs when the agent is gone
    MapSpec("tail_xdp", bpfsys.BPF_MAP_TYPE_PROG_ARRAY, _u32, _u32, "__u32", "__u32", 4, 2),
    MapSpec("tail_tc", bpfsys.BPF_MAP_TYPE_PROG_ARRAY, _u32, _u32, "__u32", "__u32", 4, 2),
    # the rare paths the tc entry programs hand their rare frames to (issue 37: to_lb4, the
    # pod-facing hook's IPv6 route); a map an older agent of layout 7 does not know, and leaves
    MapSpec(
        "tail_rare", bpfsys.BPF_MAP_TYPE_PROG_ARRAY, _u32, _u32, "__u32", "__u32", 4, 7, late=True
    ),
    # per-Service counters: a slot per Service, as many as SVCSTATS_BUDGET allows on this
    # machine unless chosen, and slot 0; layout 6 (drops[] grew from 8 to 16 at the end, for
    # drop_spoofed: the counters of layouts 3-5 are copied, zero-padded)
    MapSpec(
        "svcstats", _PERCPU, _u32, SvcStat, "__u32", "struct svc_stat", lambda _, n: n + 1, 6,
        "CZ_SVCSTATS_MAX", padded_since=3,
    ),
    # limits per Service (bpf/lib/limit.h), at its slot as svcstats: what the control plane set,
    # and the programs' buckets (pinned: a restart keeps them); maps an older agent of layout
    # 7 does not know, and leaves
    MapSpec(
        "limits", _ARRAY, _u32, LimitVal, "__u32", "struct cz_limit", lambda _, n: n + 1, 7,
        "CZ_SVCSTATS_MAX", late=True,
    ),
    MapSpec(
        "buckets", _ARRAY, _u32, BucketVal, "__u32", "struct cz_bucket", lambda _, n: n + 1, 7,
        "CZ_SVCSTATS_MAX", late=True,
    ),
    # the monitor (bpf/lib/monitor.h): its switch and token bucket, its counters, its ring buffer
    MapSpec("monctl", _ARRAY, _u32, MonCtl, "__u32", "struct mon_ctl", 1, 3),
    MapSpec("monstats", _PERCPU, _u32, MonStat, "__u32", "struct mon_stat", 1, 3),
    MapSpec(
        "events", bpfsys.BPF_MAP_TYPE_RINGBUF, _nothing, _nothing, "", "", EVENTS_SIZE, 3,
        "CZ_EVENTS_SIZE",
    ),
    # explain's dry runs (bpf/lib/dryrun.h)
    MapSpec("dryrun", _PERCPU, _u32, DryRes, "__u32", "struct dry_res", 1, 3),
    # the flows' timeouts and the node's part (bpf/lib/fib.h); layout 4
    MapSpec("flowcfg", _ARRAY, _u32, FlowCfg, "__u32", "struct flow_cfg", 1, 4),
    # the fast paths' per-CPU cache of the flows they last looked up; layout 5
    MapSpec(
        "seen4", _PERCPU, _u32, Flow4Seen, "__u32", "struct flow4_seen", SEEN_MAX, 5,
        "CZ_SEEN_MAX",
    ),
    MapSpec(
        "seen6", _PERCPU, _u32, Flow6Seen, "__u32", "struct flow6_seen", SEEN_MAX, 5,
        "CZ_SEEN_MAX",
    ),
)  # fmt: skip

#: the first layout version since which each map's layout (and meaning) is unchanged: a pin of
#: that version or later is kept (or, with another size only, copied); older ones are rebuilt
SAME_SINCE = {m.name: m.since for m in MAPS}
#: the maps `PinnedMaps.entries()` counts (hash maps whose fill matters)
COUNTED = tuple(m.name for m in MAPS if m.counted)


@dataclass(frozen=True)
class Layout:
    """Every pinned map of one size: `map_specs(max_services)`, the sizes from the registry
    (MAPS), from the number of Services and of Services counted on their own."""

    max_services: int
    meta: MapSpec
    addr4: MapSpec
    addr6: MapSpec
    allow4: MapSpec
    allow6: MapSpec
    flow4: MapSpec
    flow6: MapSpec
    frag4: MapSpec
    frag6: MapSpec
    svcnames: MapSpec
    range4: MapSpec
    range6: MapSpec
    stats: MapSpec
    flowhint: MapSpec
    addrhint: MapSpec
    rolehint: MapSpec
    tail_xdp: MapSpec
    tail_tc: MapSpec
    tail_rare: MapSpec
    svcstats: MapSpec
    limits: MapSpec
    buckets: MapSpec
    monctl: MapSpec
    monstats: MapSpec
    events: MapSpec
    dryrun: MapSpec
    flowcfg: MapSpec
    seen4: MapSpec
    seen6: MapSpec

    @property
    def all(self) -> tuple[MapSpec, ...]:
        """Every map, in the registry's order."""
        return tuple(getattr(self, m.name) for m in MAPS)

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

    @property
    def addr_hint_log2(self) -> int:
        """log2 of addrhint's bits (0.3.0's CZ_ADDRHINT_LOG2: one filter over the array)."""
        return (self.addrhint.max_entries * 64).bit_length() - 1

    @property
    def role_hint_log2(self) -> int:
        """log2 of the bits of one half of rolehint (CZ_ROLEHINT_LOG2)."""
        return (self.rolehint.max_entries // 2 * 64).bit_length() - 1


def map_specs(max_services: int = DEFAULT_MAX_SERVICES, service_slots: int | None = None) -> Layout:
    """The maps for `max_services` Services, `service_slots` of them with counters of their own
    (default: default_service_slots)."""
    if max_services < 1:
        raise ValueError(f"max_services must be at least 1, not {max_services}")
    slots = default_service_slots(max_services) if service_slots is None else service_slots
    if slots < 1:
        raise ValueError(f"service_slots must be at least 1, not {slots}")
    return Layout(max_services, **{m.name: m.sized(max_services, slots) for m in MAPS})


DEFAULT_LAYOUT = map_specs()
ALL_MAPS: tuple[MapSpec, ...] = DEFAULT_LAYOUT.all
META, STATS, EVENTS = DEFAULT_LAYOUT.meta, DEFAULT_LAYOUT.stats, DEFAULT_LAYOUT.events
ADDR4, ALLOW4, FLOW4 = DEFAULT_LAYOUT.addr4, DEFAULT_LAYOUT.allow4, DEFAULT_LAYOUT.flow4
ADDR6, ALLOW6, FLOW6 = DEFAULT_LAYOUT.addr6, DEFAULT_LAYOUT.allow6, DEFAULT_LAYOUT.flow6
FRAG4, FRAG6, FLOWHINT = DEFAULT_LAYOUT.frag4, DEFAULT_LAYOUT.frag6, DEFAULT_LAYOUT.flowhint


def addr_hint_bit(addr: bytes, log2: int) -> int:
    """The address hint's bit of an IPv4 address (packed), of a filter of 1 << log2 bits:
    cz_addr4_hinted in bpf/lib/lookup.h (rolehint's halves) and 0.3.0's (addrhint), on the word
    as it lies in memory."""
    x = int.from_bytes(addr, sys.byteorder)
    return ((x * 0x9E3779B1) & 0xFFFFFFFF) >> (32 - log2)


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
