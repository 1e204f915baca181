"""Map writes: the product's PinnedMaps with batch operations (BPF_MAP_UPDATE_BATCH /
DELETE_BATCH, its default) against the same without them (one call per entry), on 10k / 30k
entries of the real maps, and read_state's key walk against BPF_MAP_LOOKUP_BATCH. Next to
them, one `nft -f` transaction of the same entries (cozy-proxy's tables, in a scratch
namespace)."""

from __future__ import annotations

import ctypes
import os
import struct
import tempfile
import time
from ipaddress import IPv4Address
from typing import Any

from bench import scale
from bench.common import TAG, Params, log, median, pin_dir, sh
from bench.nftrules import full_ruleset
from cozyebpf.datapath import attach, bpfsys
from cozyebpf.datapath.layout import (
    ADDR4,
    F_ALLOW_ICMP,
    F_PORT_FILTER,
    K_LB,
    Addr4Val,
    be32,
)
from cozyebpf.datapath.maps import PinnedMaps
from cozyebpf.state import AllowedPort, MapState, diff


def _flags(port_filter: bool, allow_icmp: bool) -> int:
    return (F_PORT_FILTER if port_filter else 0) | (F_ALLOW_ICMP if allow_icmp else 0)


def _allow_key_bytes(a: AllowedPort) -> bytes:
    # struct allow4_key: __be32 pod_ip, __u8 proto, __u8 reserved, __be16 port
    return a.pod_ip.packed + _ALLOW_TAIL.pack(int(a.proto), 0, a.port)


_ALLOW_TAIL = struct.Struct("!BBH")


def per_entry(maps: PinnedMaps) -> PinnedMaps:
    """The same pinned maps, driven without batch operations (one bpf(2) call per entry), as
    the product does on a kernel that refuses them."""
    slow = PinnedMaps(maps.pin_dir, maps.fds, maps.layout)
    slow._no_batch = True
    slow.read_state()  # its own mirror of what the maps hold
    return slow


def _raw_per_element(maps: PinnedMaps, st: MapState) -> float:
    """Per-element updates with every key and value built beforehand: the syscalls alone."""
    svc = maps.fds[ADDR4.name]
    pairs = [
        (ctypes.c_uint32(be32(lb)), Addr4Val(pod_ip=be32(s.pod_ip), kind=K_LB, flags=1))
        for lb, s in st.services.items()
        if isinstance(lb, IPv4Address) and isinstance(s.pod_ip, IPv4Address)
    ]
    t0 = time.perf_counter()
    for k, v in pairs:
        bpfsys.map_update(svc, k, v)
    return time.perf_counter() - t0


def _clear(maps: PinnedMaps) -> None:
    maps.apply(diff(maps.read_state(), MapState()))


def nft_transaction(st: MapState, ns: str) -> tuple[float, float]:
    """(seconds for one `nft -f` of the whole ruleset with these entries, seconds for one
    `nft add element` to it afterwards, median of 5) in namespace `ns`."""
    mappings, allowed, filtered, icmp = scale.nft_entries(st)
    rules = full_ruleset(mappings, allowed, filtered, icmp)
    with tempfile.NamedTemporaryFile("w", suffix=".nft", delete=False) as f:
        f.write(rules)
        path = f.name
    try:
        sh("ip", "netns", "exec", ns, "nft", "delete", "table", "ip", "cozy_proxy", check=False)
        t0 = time.perf_counter()
        sh("ip", "netns", "exec", ns, "nft", "-f", path)
        t_full = time.perf_counter() - t0
        one = []
        for i in range(5):
            t0 = time.perf_counter()
            sh(
                "ip",
                "netns",
                "exec",
                ns,
                "nft",
                "add",
                "element",
                "ip",
                "cozy_proxy",
                "svc_pod",
                f"{{ 198.19.255.{i + 1} : 10.244.255.{i + 1} }}",
            )
            one.append(time.perf_counter() - t0)
        sh("ip", "netns", "exec", ns, "nft", "delete", "table", "ip", "cozy_proxy", check=False)
        return t_full, median(one)
    finally:
        os.unlink(path)


def sync_breakdown(sizes: tuple[int, ...]) -> dict[str, Any]:
    """What one agent sync costs besides the map writes, in this process: parsing a manifest
    (yaml.SafeLoader, pure Python, against libyaml's CSafeLoader, which the agent uses), the model
    (build_state over every object), and the diff. Seconds."""
    import yaml

    from cozyebpf.model import build_state

    out: dict[str, Any] = {}
    text = scale.manifest_yaml(1000)
    t0 = time.perf_counter()
    list(yaml.load_all(text, Loader=yaml.SafeLoader))
    safe = time.perf_counter() - t0
    out["yaml_1000"] = {"bytes": len(text), "SafeLoader_s": round(safe, 3)}
    if getattr(yaml, "CSafeLoader", None):
        t0 = time.perf_counter()
        list(yaml.load_all(text, Loader=yaml.CSafeLoader))
        out["yaml_1000"]["CSafeLoader_s"] = round(time.perf_counter() - t0, 3)
    for n in sizes:
        objs = scale.objects(n)
        t0 = time.perf_counter()
        st = build_state(objs, "cozy-proxy").state
        t_model = time.perf_counter() - t0
        st2 = st.copy()
        lb = next(iter(st2.services))
        st2.services[lb] = st2.services[lb].__class__(
            IPv4Address("10.244.250.1"), False, False
        )  # one change
        t0 = time.perf_counter()
        diff(st, st2)
        t_diff = time.perf_counter() - t0
        out[str(n)] = {"build_state_s": round(t_model, 3), "diff_one_change_s": round(t_diff, 4)}
        log(f"sync breakdown n={n}: model {t_model:.2f}s, diff {t_diff:.3f}s")
    return out


def main_mapwrites(params: Params) -> dict[str, Any]:
    pin = pin_dir("mw")
    ns = f"{TAG}-nft"
    maps = PinnedMaps.ensure(pin)
    slow = per_entry(maps)
    sh("ip", "netns", "add", ns)
    out: dict[str, Any] = {}
    try:
        for n in params.mapwrite_sizes:
            st = scale.state(n)
            entries = len(st.services) + len(st.pods) + len(st.allowed)
            r: dict[str, list[float]] = {
                k: []
                for k in (
                    "apply_per_element",
                    "apply_batch",
                    "delete_per_element",
                    "delete_batch",
                    "read_state",
                    "lookup_batch",
                    "raw_update_addr4",
                    "nft_f",
                    "nft_add_element",
                )
            }
            for rep in range(params.mapwrite_reps):
                # interleaved: per-element, batch, per-element, ... (both are the product's
                # PinnedMaps, with and without batch operations)
                _clear(maps)
                d = diff(maps.read_state(), st)
                t0 = time.perf_counter()
                slow.apply(d)
                r["apply_per_element"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                walked = slow.read_state()
                r["read_state"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                batched = maps.read_state()
                r["lookup_batch"].append(time.perf_counter() - t0)
                assert walked == batched == st, "the two reads disagree"
                t0 = time.perf_counter()
                slow.apply(diff(st, MapState()))
                r["delete_per_element"].append(time.perf_counter() - t0)
                d = diff(maps.read_state(), st)
                t0 = time.perf_counter()
                maps.apply(d)
                r["apply_batch"].append(time.perf_counter() - t0)
                assert maps.read_state() == st, "batch apply wrote something else"
                t0 = time.perf_counter()
                maps.apply(diff(st, MapState()))
                r["delete_batch"].append(time.perf_counter() - t0)
                r["raw_update_addr4"].append(_raw_per_element(maps, st))
                full, one = nft_transaction(st, ns)
                r["nft_f"].append(full)
                r["nft_add_element"].append(one)
                per, bat = r["apply_per_element"][-1], r["apply_batch"][-1]
                log(f"map writes n={n} rep {rep + 1}: per-element {per:.3f}s, batch {bat:.3f}s")
            out[str(n)] = {
                "entries": entries,
                **{k: round(median(v), 4) for k, v in r.items()},
                "all": r,
            }
    finally:
        maps.close()
        attach.detach_all(pin)
        sh("ip", "netns", "del", ns, check=False)
    out["sync_breakdown"] = sync_breakdown((1000, *params.mapwrite_sizes))
    return out
