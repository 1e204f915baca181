"""The Python mirrors of the C layouts, checked against what bcc generates from the header
(cilium's alignchecker idea), and the reason list against the C enum."""

from __future__ import annotations

import ctypes
import re

import pytest

from cozyebpf.datapath import bpfsys, buckets, layout
from cozyebpf.datapath.loader import bpf_dir, flatten
from cozyebpf.datapath.reasons import DESCRIPTIONS, REASONS

#: structs C uses that are no map's key or value: a port inside addr values, the events ring
#: buffer's records
RECORDS: dict[str, layout.CType] = {
    "struct cz_port": layout.CzPort,
    "struct cz_event": layout.CzEvent,
}


def _mirrors() -> dict[str, layout.CType]:
    """C type -> its ctypes mirror: every key and value of the registry, and RECORDS."""
    out = dict(RECORDS)
    for m in layout.MAPS:
        for c, mirror in ((m.c_key, m.key), (m.c_value, m.value)):
            if c:
                assert out.setdefault(c, mirror) is mirror, f"{c} has two mirrors"
    return out


MIRRORS = _mirrors()


def _fields(t: type[ctypes.Structure]) -> list[tuple[str, int, int]]:
    """(name, offset, size) of each field; bcc's generated classes are packed with explicit
    `__pad_N` members, which are left out."""
    return [
        (name, getattr(t, name).offset, getattr(t, name).size)
        for name, *_ in t._fields_
        if not name.startswith("__pad")
    ]


@pytest.mark.datapath
@pytest.mark.parametrize("ctype", sorted(MIRRORS))
def test_ctypes_mirror_matches_the_c_layout(ctype: str) -> None:
    from bcc import BPF

    text = flatten(bpf_dir() / "lib" / "types.h")
    text += f"BPF_HASH(probe, __u32, {ctype}, 1);\n"
    b = BPF(text=text.encode())
    generated = b[b"probe"].Leaf
    mirror = MIRRORS[ctype]
    assert ctypes.sizeof(mirror) == ctypes.sizeof(generated)
    if issubclass(mirror, ctypes.Structure):
        assert _fields(mirror) == _fields(generated)


def test_every_key_and_value_of_the_registry_has_its_c_type() -> None:
    """So that the test above checks it; only meta's value (user space's alone) and the ring
    buffer (no key, no value) have none."""
    none = {
        (m.name, part)
        for m in layout.MAPS
        for part, c in (("key", m.c_key), ("value", m.c_value))
        if not c
    }
    assert none == {("meta", "value"), ("events", "key"), ("events", "value")}


_C_MAP_TYPES = {
    "hash": bpfsys.BPF_MAP_TYPE_HASH,
    "lru_hash": bpfsys.BPF_MAP_TYPE_LRU_HASH,
    "array": bpfsys.BPF_MAP_TYPE_ARRAY,
    "percpu_array": bpfsys.BPF_MAP_TYPE_PERCPU_ARRAY,
    "lpm_trie": bpfsys.BPF_MAP_TYPE_LPM_TRIE,
    "prog": bpfsys.BPF_MAP_TYPE_PROG_ARRAY,
}
_PINNED = re.compile(
    r'BPF_TABLE_PINNED\("(\w+)",\s*([\w ]+?),\s*([\w ]+?),\s*cz_(\w+),\s*(\w+),\s*'
    r'CZ_PIN_DIR "/(\w+)"\)'
)
_RINGBUF = re.compile(r'CZ_RINGBUF_PINNED\(cz_(\w+),\s*(\w+),\s*CZ_PIN_DIR "/(\w+)"\)')


def test_the_registry_is_what_bpf_declares() -> None:
    """Every pinned map the programs declare (bpf/lib/maps.h, stats.h, tail.h) is in the
    registry with its type, key, value and size, and every map of the registry that C uses is
    declared, as cz_<name> pinned at <name>."""
    paths = sorted([*(bpf_dir() / "lib").glob("*.h"), *bpf_dir().glob("*.c")])
    text = "".join(p.read_text() for p in paths)
    declared: dict[str, tuple[int, str, str, str]] = {}
    for kind, key, value, name, size, pin in _PINNED.findall(text):
        assert name == pin and name not in declared, name
        declared[name] = (_C_MAP_TYPES[kind], key, value, size)
    for name, size, pin in _RINGBUF.findall(text):
        assert name == pin and name not in declared, name
        declared[name] = (bpfsys.BPF_MAP_TYPE_RINGBUF, "", "", size)
    registry = {
        m.name: (m.map_type, m.c_key, m.c_value, m.macro or str(m.size))
        for m in layout.MAPS
        if m.in_c
    }
    assert declared == registry
    assert "maps.h" in {p.name for p in paths} and len(declared) > 20


def test_derived_from_the_registry() -> None:
    names = [m.name for m in layout.MAPS]
    assert len(set(names)) == len(names)
    assert [s.name for s in layout.DEFAULT_LAYOUT.all] == names
    assert set(layout.SAME_SINCE) == set(names)
    assert all(1 <= v <= layout.LAYOUT_VERSION for v in layout.SAME_SINCE.values())
    assert set(layout.COUNTED) <= set(names)
    # maps of one size macro have one size
    sizes: dict[str, int] = {}
    for s in layout.map_specs(1000).all:
        if s.macro:
            assert sizes.setdefault(s.macro, s.max_entries) == s.max_entries, s.macro


def test_reasons_match_the_c_enum() -> None:
    text = (bpf_dir() / "lib" / "stats.h").read_text()
    enum = re.search(r"enum cz_reason \{(.*?)\};", text, re.S)
    assert enum
    names = re.findall(r"CZ_([A-Z_]+) = (\d+)", enum.group(1))
    assert [(n.lower(), int(v)) for n, v in names] == [(r, i) for i, r in enumerate(REASONS)]
    assert set(DESCRIPTIONS) == set(REASONS)


def test_layout_version_matches_the_c_define() -> None:
    text = (bpf_dir() / "lib" / "types.h").read_text()
    assert f"#define CZ_LAYOUT_VERSION {layout.LAYOUT_VERSION}\n" in text


def test_layout_constants_match_the_c_defines() -> None:
    text = (bpf_dir() / "lib" / "types.h").read_text()
    for name, value in (
        ("CZ_K_LB", layout.K_LB),
        ("CZ_K_POD", layout.K_POD),
        ("CZ_F_PORT_FILTER", layout.F_PORT_FILTER),
        ("CZ_F_ALLOW_ICMP", layout.F_ALLOW_ICMP),
        ("CZ_F_RANGES", layout.F_RANGES),
        ("CZ_F_LEARN", layout.F_LEARN),
        ("CZ_F_LIMIT", layout.F_LIMIT),
        ("CZ_UNIT_SHIFT", buckets.UNIT_SHIFT),
        ("CZ_TO_UDP", layout.TO_UDP),
        ("CZ_TO_ICMP", layout.TO_ICMP),
        ("CZ_TO_TCP", layout.TO_TCP),
        ("CZ_TO_TCP_CLOSING", layout.TO_TCP_CLOSING),
        ("CZ_INLINE_PORTS", layout.INLINE_PORTS),
        ("CZ_PORTS_SPILL", layout.PORTS_SPILL),
    ):
        m = re.search(rf"#define {name} (0x[0-9a-f]+|\d+)", text)
        assert m and int(m.group(1), 0) == value, name


def test_map_sizes_derive_from_the_number_of_services() -> None:
    lay = layout.map_specs(1000)
    sizes = {s.name: s.max_entries for s in lay.all}
    assert sizes == {
        "meta": 1,
        "addr4": 2000,
        "allow4": 4000,
        "flow4": 4000,
        "stats": layout.STATS_MAX,
        "addr6": 2000,
        "allow6": 4000,
        "flow6": 4000,
        "frag4": 1024,
        "frag6": 1024,
        "flowhint": 1024,  # 2 halves of 512 words (a power of two >= 500)
        "addrhint": 1024,  # 64 bits per Service (a power of two >= 1000 words): 0.3.0's
        "rolehint": 1024,  # the same, in 2 halves (pod IPs, LB IPs)
        "tail_xdp": 4,  # prog arrays: not Service-related
        "tail_tc": 4,
        "tail_rare": 4,
        "svcstats": 1001,  # a counter slot per Service, and slot 0 (never given out)
        "svcnames": 1001,
        "limits": 1001,  # limits per Service and their buckets, at its slot
        "buckets": 1001,
        "monctl": 1,  # the monitor and explain: not Service-related
        "monstats": 1,
        "events": layout.EVENTS_SIZE,
        "dryrun": 1,
        "range4": 4000,  # source ranges: 4 networks per Service
        "range6": 4000,
        "flowcfg": 1,
        "seen4": 256,  # per CPU, whatever the number of Services
        "seen6": 256,
    }
    assert lay.hint_words == 512 and lay.hint_log2 == 15
    assert lay.addr_hint_log2 == 16  # addrhint: one filter of 1024 words of 64 bits
    assert lay.role_hint_log2 == 15  # rolehint: two halves of 512 words
    assert layout.map_specs().addr4.max_entries == 2 * layout.DEFAULT_MAX_SERVICES
    with pytest.raises(ValueError):
        layout.map_specs(0)


def test_byte_order_helpers_round_trip() -> None:
    from ipaddress import IPv4Address

    ip = IPv4Address("203.0.113.10")
    v = layout.Addr4Val(pod_ip=layout.be32(ip))
    assert bytes(v)[:4] == ip.packed
    assert layout.ip_of(v.pod_ip) == ip
    k = layout.Allow4Key(port=layout.be16(8080))
    assert bytes(k)[6:8] == (8080).to_bytes(2, "big")
    assert layout.port_of(k.port) == 8080
