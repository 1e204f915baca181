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

from cozyebpf.datapath import bpfsys
from cozyebpf.datapath.reasons import REASONS

#: bump with CZ_LAYOUT_VERSION in bpf/lib/types.h whenever a layout below changes
LAYOUT_VERSION = 1

F_PORT_FILTER = 0x01
F_ALLOW_ICMP = 0x02


class Svc4Val(ctypes.Structure):
    _fields_ = [
        ("pod_ip", ctypes.c_uint32),
        ("flags", ctypes.c_uint8),
        ("reserved", ctypes.c_uint8 * 3),
    ]


class Pod4Val(ctypes.Structure):
    _fields_ = [
        ("lb_ip", ctypes.c_uint32),
        ("flags", ctypes.c_uint8),
        ("reserved", ctypes.c_uint8 * 3),
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


class StatVal(ctypes.Structure):
    _fields_ = [("packets", ctypes.c_uint64), ("bytes", ctypes.c_uint64)]


class Ip6(ctypes.Structure):
    _fields_ = [("a", ctypes.c_uint32 * 4)]


class Svc6Val(ctypes.Structure):
    _fields_ = [
        ("pod_ip", Ip6),
        ("flags", ctypes.c_uint8),
        ("reserved", ctypes.c_uint8 * 3),
    ]


class Pod6Val(ctypes.Structure):
    _fields_ = [
        ("lb_ip", Ip6),
        ("flags", ctypes.c_uint8),
        ("reserved", ctypes.c_uint8 * 3),
    ]


class Allow6Key(ctypes.Structure):
    _fields_ = [
        ("pod_ip", Ip6),
        ("proto", ctypes.c_uint8),
        ("reserved", ctypes.c_uint8),
        ("port", ctypes.c_uint16),
    ]


class Flow6Key(ctypes.Structure):
    _fields_ = [
        ("pod_ip", Ip6),
        ("remote_ip", Ip6),
        ("pod_port", ctypes.c_uint16),
        ("remote_port", ctypes.c_uint16),
        ("proto", ctypes.c_uint8),
        ("reserved", ctypes.c_uint8 * 3),
    ]


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
    key: type[ctypes._SimpleCData] | type[ctypes.Structure]  # type: ignore[type-arg]
    value: type[ctypes._SimpleCData] | type[ctypes.Structure]  # type: ignore[type-arg]
    max_entries: int
    macro: str  # -D name of the size in bpf/lib/maps.h, "" where C does not need it

    @property
    def key_size(self) -> int:
        return ctypes.sizeof(self.key)

    @property
    def value_size(self) -> int:
        return ctypes.sizeof(self.value)


STATS_MAX = 64  # room for new reasons without a layout change
assert len(REASONS) <= STATS_MAX

META = MapSpec("meta", bpfsys.BPF_MAP_TYPE_ARRAY, ctypes.c_uint32, MetaVal, 1, "")
SVC4 = MapSpec("svc4", bpfsys.BPF_MAP_TYPE_HASH, ctypes.c_uint32, Svc4Val, 65536, "CZ_SVC4_MAX")
POD4 = MapSpec("pod4", bpfsys.BPF_MAP_TYPE_HASH, ctypes.c_uint32, Pod4Val, 65536, "CZ_POD4_MAX")
ALLOW4 = MapSpec(
    "allow4", bpfsys.BPF_MAP_TYPE_HASH, Allow4Key, ctypes.c_uint8, 262144, "CZ_ALLOW4_MAX"
)
FLOW4 = MapSpec("flow4", bpfsys.BPF_MAP_TYPE_LRU_HASH, Flow4Key, Flow4Val, 262144, "CZ_FLOW4_MAX")
STATS = MapSpec(
    "stats", bpfsys.BPF_MAP_TYPE_PERCPU_ARRAY, ctypes.c_uint32, StatVal, STATS_MAX, "CZ_STATS_MAX"
)

SVC6 = MapSpec("svc6", bpfsys.BPF_MAP_TYPE_HASH, Ip6, Svc6Val, 65536, "CZ_SVC6_MAX")
POD6 = MapSpec("pod6", bpfsys.BPF_MAP_TYPE_HASH, Ip6, Pod6Val, 65536, "CZ_POD6_MAX")
ALLOW6 = MapSpec(
    "allow6", bpfsys.BPF_MAP_TYPE_HASH, Allow6Key, ctypes.c_uint8, 262144, "CZ_ALLOW6_MAX"
)
FLOW6 = MapSpec("flow6", bpfsys.BPF_MAP_TYPE_LRU_HASH, Flow6Key, Flow4Val, 262144, "CZ_FLOW6_MAX")
FRAG4 = MapSpec("frag4", bpfsys.BPF_MAP_TYPE_LRU_HASH, Frag4Key, FragVal, 16384, "CZ_FRAG4_MAX")
FRAG6 = MapSpec("frag6", bpfsys.BPF_MAP_TYPE_LRU_HASH, Frag6Key, FragVal, 16384, "CZ_FRAG6_MAX")

ALL_MAPS: tuple[MapSpec, ...] = (
    META,
    SVC4,
    POD4,
    ALLOW4,
    FLOW4,
    STATS,
    SVC6,
    POD6,
    ALLOW6,
    FLOW6,
    FRAG4,
    FRAG6,
)
