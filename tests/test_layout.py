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
    "svc4_val": layout.Svc4Val,
    "pod4_val": layout.Pod4Val,
    "allow4_key": layout.Allow4Key,
    "flow4_key": layout.Flow4Key,
    "flow4_val": layout.Flow4Val,
    "stat_val": layout.StatVal,
    "ip6": layout.Ip6,
    "svc6_val": layout.Svc6Val,
    "pod6_val": layout.Pod6Val,
    "allow6_key": layout.Allow6Key,
    "flow6_key": layout.Flow6Key,
    "frag4_key": layout.Frag4Key,
    "frag6_key": layout.Frag6Key,
    "frag_val": layout.FragVal,
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


def test_byte_order_helpers_round_trip() -> None:
    from ipaddress import IPv4Address

    ip = IPv4Address("203.0.113.10")
    v = layout.Svc4Val(pod_ip=layout.be32(ip))
    assert bytes(v)[:4] == ip.packed
    assert layout.ip_of(v.pod_ip) == ip
    k = layout.Allow4Key(port=layout.be16(8080))
    assert bytes(k)[6:8] == (8080).to_bytes(2, "big")
    assert layout.port_of(k.port) == 8080
