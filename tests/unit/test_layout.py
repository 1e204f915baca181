"""The Python mirrors of the C layouts, checked against what bcc generates from the header
(cilium's alignchecker idea), and the reason list against the C enum."""

from __future__ import annotations

import ctypes
import re

import pytest

from cozyebpf.datapath import layout
from cozyebpf.datapath.loader import bpf_dir, flatten
from cozyebpf.datapath.reasons import DESCRIPTIONS, REASONS

MIRRORS = {
    "cz_port": layout.CzPort,
    "addr4_val": layout.Addr4Val,
    "addr6_val": layout.Addr6Val,
    "allow4_key": layout.Allow4Key,
    "flow4_key": layout.Flow4Key,
    "flow4_val": layout.Flow4Val,
    "stat_val": layout.StatVal,
    "ip6": layout.Ip6,
    "allow6_key": layout.Allow6Key,
    "flow6_key": layout.Flow6Key,
    "frag4_key": layout.Frag4Key,
    "frag6_key": layout.Frag6Key,
    "frag_val": layout.FragVal,
    "svc_stat": layout.SvcStat,
    "svc_name": layout.SvcName,
    "mon_ctl": layout.MonCtl,
    "mon_stat": layout.MonStat,
    "cz_event": layout.CzEvent,
    "dry_res": layout.DryRes,
    "flow_cfg": layout.FlowCfg,
    "range4_key": layout.Range4Key,
    "range6_key": layout.Range6Key,
}


def _fields(t: type[ctypes.Structure]) -> list[tuple[str, int, int]]:
    """(name, offset, size) of each field; bcc's generated classes are packed with explicit
    `__pad_N` members, which are left out."""
    return [
        (name, getattr(t, name).offset, getattr(t, name).size)
        for name, *_ in t._fields_
        if not name.startswith("__pad")
    ]


@pytest.mark.datapath
@pytest.mark.parametrize("cname", sorted(MIRRORS))
def test_ctypes_mirror_matches_the_c_layout(cname: str) -> None:
    from bcc import BPF

    text = flatten(bpf_dir() / "lib" / "types.h")
    text += f"BPF_HASH(probe, __u32, struct {cname}, 1);\n"
    b = BPF(text=text.encode())
    generated = b[b"probe"].Leaf
    mirror = MIRRORS[cname]
    assert ctypes.sizeof(mirror) == ctypes.sizeof(generated)
    assert _fields(mirror) == _fields(generated)


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
        ("CZ_TO_UDP", layout.TO_UDP),
        ("CZ_TO_ICMP", layout.TO_ICMP),
        ("CZ_TO_TCP", layout.TO_TCP),
        ("CZ_TO_TCP_CLOSING", layout.TO_TCP_CLOSING),
        ("CZ_INLINE_PORTS", layout.INLINE_PORTS),
        ("CZ_PORTS_SPILL", layout.PORTS_SPILL),
    ):
        m = re.search(rf"#define {name} (0x[0-9a-f]+|\d+)", text)
        assert m and int(m.group(1), 0) == value, name


def test_the_version_1_mirrors_still_describe_layout_version_1() -> None:
    """The in-place upgrade reads svc4/pod4/svc6/pod6 of layout 1 with these (types.h no
    longer has them): svc/pod value = the other address, then flags and 3 reserved bytes."""
    assert [ctypes.sizeof(c) for c in (layout.Svc4Val, layout.Pod4Val)] == [8, 8]
    assert [ctypes.sizeof(c) for c in (layout.Svc6Val, layout.Pod6Val)] == [20, 20]
    assert [(s.name, s.key_size, s.value_size) for s in layout.V1_REPLACED] == [
        ("svc4", 4, 8),
        ("pod4", 4, 8),
        ("svc6", 16, 20),
        ("pod6", 16, 20),
    ]


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
        "tail_xdp": 4,  # prog arrays: not Service-related
        "tail_tc": 4,
        "svcstats": 1001,  # a counter slot per Service, and slot 0 (never given out)
        "svcnames": 1001,
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
