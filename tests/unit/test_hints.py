"""The address hints' bookkeeping (cozyebpf/datapath/hints.py) without the kernel: every bit is
set exactly while a key with its role has it, also where keys share a bit; what is reported
changed is what changed. (tests/datapath/test_addr_hint.py holds the maps to the same, written.)"""

from __future__ import annotations

import random

import pytest

from cozyebpf.datapath import hints as hints_module
from cozyebpf.datapath.hints import HINT_ANY, HINT_LB, HINT_POD, AddrHints
from cozyebpf.datapath.layout import addr_hint_bit, map_specs


def _bit(h: AddrHints, key: bytes, role: int) -> tuple[str, int]:
    """(map, bit in the map) of an IPv4 key's bit for `role`, from the layout alone: HINT_POD
    and HINT_LB in their halves of rolehint, HINT_ANY in addrhint (the reference that
    AddrHints.change is held to)."""
    lay = h.layout
    if role == HINT_ANY:
        return "addrhint", hints_module.addr_hint_bit(key, lay.addr_hint_log2)
    b = hints_module.addr_hint_bit(key, lay.role_hint_log2)
    base = 0 if role == HINT_POD else lay.rolehint.max_entries // 2 * 64
    return "rolehint", base + b


def _expected(h: AddrHints, roles: dict[bytes, int]) -> dict[str, list[int]]:
    """The words recomputed from the keys' roles alone."""
    out = {name: [0] * len(h.words[name]) for name in h.maps}
    for k, r in roles.items():
        for role in (HINT_POD, HINT_LB, HINT_ANY):
            if (r | HINT_ANY if r else 0) & role:
                name, bit = _bit(h, k, role)
                out[name][bit >> 6] |= 1 << (bit & 63)
    return out


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_the_words_follow_every_change(dense: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random histories of roles over 60 keys; dense: every key's bit among 8, so that keys
    share bits and a bit stays while any key has it. After each change the words are what the
    roles give, the changed words reported are exactly those that differ, and a rebuild from
    the roles gives the same words and nothing to write."""
    if dense:
        monkeypatch.setattr(hints_module, "addr_hint_bit", lambda a, n: addr_hint_bit(a, n) % 8)
    rng = random.Random(48)
    h = AddrHints(map_specs(16))
    keys = [bytes([198, 51, 100, i]) for i in range(60)]
    roles: dict[bytes, int] = {}
    for _ in range(300):
        before = {name: list(w) for name, w in h.words.items()}
        change = {
            k: rng.choice((0, 0, HINT_POD, HINT_LB, HINT_POD | HINT_LB))
            for k in rng.sample(keys, rng.randrange(1, 8))
        }
        gained = h.change(roles, change.items(), gain=True)
        lost = h.change(roles, change.items(), gain=False)
        reported = {(n, i) for words in (gained, lost) for n, ws in words.items() for i in ws}
        roles.update(change)
        want = _expected(h, roles)
        assert {name: list(w) for name, w in h.words.items()} == want
        differ = {(n, i) for n in h.maps for i, w in enumerate(want[n]) if w != before[n][i]}
        assert differ <= reported  # a word set and cleared again in one change may be reported
        again = h.rebuild(roles.items())
        assert again.differ(h) == {name: set() for name in h.maps}
    assert h.more if dense else True
    for k in keys:  # every key gone: nothing set, nothing shared
        h.change(roles, [(k, 0)], gain=False)
    assert all(not any(w) for w in h.words.values()) and h.more == {}


def test_a_shared_bit_is_cleared_with_its_last_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two keys on one bit: it stays set when the first goes, and goes with the second."""
    monkeypatch.setattr(hints_module, "addr_hint_bit", lambda a, n: 5)
    h = AddrHints(map_specs(16))
    a, b = bytes([198, 51, 100, 1]), bytes([198, 51, 100, 2])
    assert h.change({}, [(a, HINT_POD)], gain=True) == {"rolehint": {0}, "addrhint": {0}}
    assert h.change({}, [(b, HINT_POD)], gain=True) == {"rolehint": set(), "addrhint": set()}
    assert h.change({a: HINT_POD}, [(a, 0)], gain=False) == {"rolehint": set(), "addrhint": set()}
    assert h.words["rolehint"][0] == 1 << 5
    assert h.change({b: HINT_POD}, [(b, 0)], gain=False) == {"rolehint": {0}, "addrhint": {0}}
    assert h.words["rolehint"][0] == 0 and h.more == {}
