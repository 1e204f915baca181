"""rolehint (bpf/lib/types.h): the one-hash Bloom filters of addr4's keys by role that let the
pod-facing hook and the uplinks' egress skip a plain pod's packet without a lookup. Whatever
the agent applies, every key of addr4 has its bit in the half of each of its roles (pod IP, LB
IP), set before the key is written; once a role is gone its bit is clear unless another key has
it; an agent that starts rebuilds it from addr4. addrhint, 0.3.0's filter of every key over the
whole array, which 0.3.0's programs read while they are attached (an upgrade from it, a
rollback to it), is kept the same way in 0.3.0's meaning.
Real maps (PinnedMaps on bpffs); tests/datapath/test_prog_run.py shows the programs read it."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from cozyebpf.datapath.attach import detach_all
from cozyebpf.datapath.layout import addr_hint_bit
from cozyebpf.datapath.maps import PinnedMaps
from cozyebpf.model import build_state
from cozyebpf.state import diff
from cozylab.k8s import Svc, objects
from tests.support.env import unique_prefix


@pytest.fixture
def pin() -> Iterator[str]:
    path = f"/sys/fs/bpf/{unique_prefix('hint')}"
    yield path
    detach_all(path)


def words(maps: PinnedMaps) -> dict[tuple[str, int], int]:
    """rolehint and addrhint as the kernel holds them: (map, word) -> bits, the words that are
    not zero."""
    out = {}
    for spec in (maps.layout.rolehint, maps.layout.addrhint):
        for w in range(spec.max_entries):
            raw = maps._lookup(spec, w.to_bytes(4, "little"))
            assert raw is not None
            if v := int.from_bytes(raw, "little"):
                out[(spec.name, w)] = v
    return out


def expected(maps: PinnedMaps) -> dict[tuple[str, int], int]:
    """The bits of the IPv4 keys addr4 holds now: in rolehint, in the half of each of their
    roles; in addrhint, as 0.3.0 reads it (one filter over the whole array)."""
    from cozyebpf.datapath.codec import addr_val
    from cozyebpf.datapath.layout import K_LB, K_POD

    lay = maps.layout
    half = lay.rolehint.max_entries // 2
    out: dict[tuple[str, int], int] = {}

    def put(name: str, w: int, b: int) -> None:
        out[(name, w)] = out.get((name, w), 0) | 1 << b

    for k, v in maps._items(lay.addr4):
        kind = addr_val(v, 4).kind
        for role, base in ((K_POD, 0), (K_LB, half)):
            if kind & role:
                b = addr_hint_bit(k, lay.role_hint_log2)
                put("rolehint", base + (b >> 6), b & 63)
        if kind & (K_POD | K_LB):
            b = addr_hint_bit(k, lay.addr_hint_log2)
            put("addrhint", b >> 6, b & 63)
    return out


def services(rng: random.Random, n: int) -> list[Svc]:
    out = []
    for i in rng.sample(range(1, 250), n):
        dual = rng.random() < 0.2
        out.append(
            Svc(
                f"vm{i}",
                f"203.0.113.{i}",
                f"10.244.{i}.{rng.randrange(1, 250)}",
                [("TCP", 22)],
                whole_ip="true" if rng.random() < 0.5 else None,
                lb_ip6=f"2001:db8:113::{i:x}" if dual else None,
                pod_ip6=f"2001:db8:244::{i:x}" if dual else None,
            )
        )
    return out


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_the_hint_follows_every_apply(
    pin: str, dense: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random histories: after each apply the hint is exactly addr4's bits; at the moment a key
    is written its bit is already set (a write checked through a wrapper). Dense: every key's
    bit among 16 of each half, so that keys share bits and a bit stays while any key has it."""
    if dense:
        import sys

        from cozyebpf.datapath import hints as hints_module

        real = addr_hint_bit

        def few(addr: bytes, log2: int) -> int:
            return real(addr, log2) % 16

        monkeypatch.setattr(hints_module, "addr_hint_bit", few)
        monkeypatch.setattr(sys.modules[__name__], "addr_hint_bit", few)
    rng = random.Random(2026)
    maps = PinnedMaps.ensure(pin, max_services=16)  # 64 words: bits shared between keys
    write = maps._write_addrs
    checked = 0

    def checking(addrs: list[bytes]) -> None:
        nonlocal checked
        have = words(maps)
        write(addrs)
        want = expected(maps)  # the roles the keys have now, after the write
        for w, bits in want.items():
            assert have.get(w, 0) & bits == bits, f"word {w}: a key written before its bit"
        checked += sum(1 for a in addrs if len(a) == 4)

    maps._write_addrs = checking  # type: ignore[method-assign]
    try:
        for _ in range(25):
            state = build_state(
                [o for s in services(rng, rng.randrange(0, 12)) for o in objects(s)], "cozy-proxy"
            ).state
            maps.apply(diff(maps.read_state(), state))
            assert words(maps) == expected(maps)
        assert checked > 50
    finally:
        maps.close()


def test_a_starting_agent_rebuilds_the_hint(pin: str) -> None:
    """Bits an older agent left (or none: addrhint new at an upgrade from layout 6) are made
    right before any program could read them: at PinnedMaps.ensure, from addr4's keys."""
    maps = PinnedMaps.ensure(pin, max_services=16)
    state = build_state(
        [o for s in services(random.Random(7), 8) for o in objects(s)], "cozy-proxy"
    ).state
    maps.apply(diff(maps.read_state(), state))
    want = expected(maps)
    for spec in (maps.layout.addrhint, maps.layout.rolehint):
        stale = [w.to_bytes(4, "little") for w in range(spec.max_entries)]
        maps._update_batch(spec, stale, [(0xF0F0).to_bytes(8, "little")] * len(stale))
    maps.close()
    again = PinnedMaps.ensure(pin, max_services=16)
    try:
        assert words(again) == want
    finally:
        again.close()


def test_addresses_and_hints_are_written_batch_by_batch(
    pin: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The addr values and the allowed ports go out WRITE_CHUNK at a time (maps.py): with a
    batch of three, what a reader finds afterwards is every entry of the state, and the hints
    are addr4's."""
    from cozyebpf.datapath import maps as maps_module

    monkeypatch.setattr(maps_module, "WRITE_CHUNK", 3)
    maps = PinnedMaps.ensure(pin, max_services=64)
    try:
        state = build_state(
            [o for s in services(random.Random(48), 20) for o in objects(s)], "cozy-proxy"
        ).state
        assert len(state.services) + len(state.pods) > 3 * 4  # more batches than one
        assert len(state.allowed) > 3  # and of the allowed ports
        maps.apply(diff(maps.read_state(), state))
        with PinnedMaps.open(pin) as reader:
            got = reader.read_state()
        assert got.services == state.services and got.pods == state.pods
        assert got.allowed == state.allowed
        assert {k: v.service for k, v in got.services.items()} == {
            k: v.service for k, v in state.services.items()
        }
        assert words(maps) == expected(maps)
    finally:
        maps.close()
