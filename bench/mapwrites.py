"""Map writes: the product's per-element PinnedMaps.apply against BPF_MAP_UPDATE_BATCH /
BPF_MAP_DELETE_BATCH (bench/bpfx.py) on 10k / 30k entries of the real maps, and the map walk
of read_state (done on every sync) against BPF_MAP_LOOKUP_BATCH. Next to them, one `nft -f`
transaction of the same entries (cozy-proxy's tables, in a scratch namespace)."""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import tempfile
import time
from typing import Any

from bench import bpfx, scale
from bench.common import TAG, Params, log, median, pin_dir, sh
from bench.nftrules import full_ruleset
from cozyebpf.datapath import attach, bpfsys
from cozyebpf.datapath.layout import (
    ALLOW4,
    F_ALLOW_ICMP,
    F_PORT_FILTER,
    POD4,
    SVC4,
    Allow4Key,
    Svc4Val,
    be32,
)
from cozyebpf.datapath.maps import PinnedMaps
from cozyebpf.errors import DatapathError
from cozyebpf.state import AllowedPort, MapDiff, MapState, diff


def _flags(port_filter: bool, allow_icmp: bool) -> int:
    return (F_PORT_FILTER if port_filter else 0) | (F_ALLOW_ICMP if allow_icmp else 0)


def _allow_key_bytes(a: AllowedPort) -> bytes:
    # struct allow4_key: __be32 pod_ip, __u8 proto, __u8 reserved, __be16 port
    return a.pod_ip.packed + _ALLOW_TAIL.pack(int(a.proto), 0, a.port)


_ALLOW_TAIL = struct.Struct("!BBH")
_FLAGS = [bytes([f, 0, 0, 0]) for f in range(4)]  # svc4_val/pod4_val: flags, reserved[3]


def apply_batched(maps: PinnedMaps, d: MapDiff) -> None:
    """PinnedMaps.apply with one BPF_MAP_UPDATE_BATCH / BPF_MAP_DELETE_BATCH per map and step,
    in the same hole-free order between steps (allowed ports added, services set, pods set,
    services deleted, pods deleted, allowed ports deleted); within one step the order does not
    matter, so nothing is sorted. Keys and values are packed with `struct`/`.packed` (network
    byte order, as the C structs hold them). The candidate for the product (see README)."""
    svc, pod, allow = maps.fds[SVC4.name], maps.fds[POD4.name], maps.fds[ALLOW4.name]
    try:
        adds = [_allow_key_bytes(a) for a in d.allowed_add]
        bpfx.map_update_batch(allow, b"".join(adds), b"\x01" * len(adds), len(adds))
        svcs = d.services_set.items()
        bpfx.map_update_batch(
            svc,
            b"".join(lb.packed for lb, _ in svcs),
            b"".join(
                s.pod_ip.packed + _FLAGS[_flags(s.port_filter, s.allow_icmp)] for _, s in svcs
            ),
            len(svcs),
        )
        pods = d.pods_set.items()
        bpfx.map_update_batch(
            pod,
            b"".join(p.packed for p, _ in pods),
            b"".join(e.lb_ip.packed + _FLAGS[_flags(e.port_filter, e.allow_icmp)] for _, e in pods),
            len(pods),
        )
        bpfx.map_delete_batch(svc, b"".join(lb.packed for lb in d.services_del), 4)
        bpfx.map_delete_batch(pod, b"".join(p.packed for p in d.pods_del), 4)
        bpfx.map_delete_batch(
            allow, b"".join(_allow_key_bytes(a) for a in d.allowed_del), ctypes.sizeof(Allow4Key)
        )
    except bpfsys.BpfError as e:
        hint = " (map full?)" if e.errno in (errno.E2BIG, errno.ENOSPC) else ""
        raise DatapathError(f"programming maps in {maps.pin_dir} failed: {e}{hint}") from e


def read_state_batched(maps: PinnedMaps) -> int:
    """The map walk of read_state with BPF_MAP_LOOKUP_BATCH (entries only, not converted)."""
    n = 0
    for spec in (SVC4, POD4, ALLOW4):
        n += len(
            bpfx.map_lookup_batch(
                maps.fds[spec.name], spec.key_size, spec.value_size, spec.max_entries
            )
        )
    return n


def _raw_per_element(maps: PinnedMaps, st: MapState) -> None:
    """Per-element updates with every key and value built beforehand: the syscalls alone."""
    svc = maps.fds[SVC4.name]
    pairs = [
        (ctypes.c_uint32(be32(lb)), Svc4Val(pod_ip=be32(s.pod_ip), flags=1))
        for lb, s in st.services.items()
    ]
    t0 = time.perf_counter()
    for k, v in pairs:
        bpfsys.map_update(svc, k, v)
    return time.perf_counter() - t0  # type: ignore[return-value]


def _clear(maps: PinnedMaps) -> None:
    live = maps.read_state()
    apply_batched(maps, diff(live, MapState()))


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
    (the agent's yaml.SafeLoader, pure Python, against libyaml's CSafeLoader), the model
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
            scale.IPv4Address("10.244.250.1"), False, False
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
                    "raw_update_svc4",
                    "nft_f",
                    "nft_add_element",
                )
            }
            for rep in range(params.mapwrite_reps):
                # interleaved: per-element, batch, per-element, ...
                _clear(maps)
                d = diff(maps.read_state(), st)
                t0 = time.perf_counter()
                maps.apply(d)
                r["apply_per_element"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                maps.read_state()
                r["read_state"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                got = read_state_batched(maps)
                r["lookup_batch"].append(time.perf_counter() - t0)
                assert got == entries, (got, entries)
                t0 = time.perf_counter()
                maps.apply(diff(st, MapState()))
                r["delete_per_element"].append(time.perf_counter() - t0)
                d = diff(maps.read_state(), st)
                t0 = time.perf_counter()
                apply_batched(maps, d)
                r["apply_batch"].append(time.perf_counter() - t0)
                live = maps.read_state()
                assert live == st, "batch apply wrote something else"
                t0 = time.perf_counter()
                apply_batched(maps, diff(st, MapState()))
                r["delete_batch"].append(time.perf_counter() - t0)
                r["raw_update_svc4"].append(_raw_per_element(maps, st))
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
