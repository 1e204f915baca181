"""The address hints as this process last wrote them (`AddrHints`): addrhint, 0.3.0's one
filter of every addr4 key, and rolehint, a filter per role (pod IPs, LB IPs) in its two halves
(bpf/lib/types.h, bpf/lib/lookup.h). PinnedMaps writes the words this reports changed.

Kept in the shape of the maps (issue 48): each map's words in an array of 64-bit words, fixed
by the map's size (1 MiB per map at --max-services 131072), not a dict entry per word and per
bit that grew with the Services (about 1.1 KB per Service at 100,000). A bit that more than one
key has (two keys that hash alike) counts the keys beyond the first in `more`: a few thousand
at most, where one key per bit is the rule. A key's roles are not kept: the caller passes each
key's roles before and after (the mirror says them).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping

from cozyebpf.datapath.layout import Layout, addr_hint_bit

#: a key's roles in the address hints: rolehint's halves (bpf/lib/lookup.h), and addrhint
#: (0.3.0's), where a key with any role has its bit
HINT_POD, HINT_LB, HINT_ANY = 1, 2, 4

#: words by map: map name -> the indexes of its words
Words = dict[str, set[int]]


class AddrHints:
    """addrhint's and rolehint's words, and how many keys share a bit."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.maps = (layout.addrhint.name, layout.rolehint.name)
        self.words: dict[str, array[int]] = {
            spec.name: array("Q", bytes(8 * spec.max_entries))
            for spec in (layout.addrhint, layout.rolehint)
        }
        #: (map, bit) -> keys beyond the first that have it (only bits two keys share)
        self.more: dict[tuple[str, int], int] = {}

    def change(
        self, before: Mapping[bytes, int], after: Iterable[tuple[bytes, int]], gain: bool
    ) -> Words:
        """Give IPv4 keys their roles (`after`, (key, HINT_POD | HINT_LB), 0: none; `before`
        what they had, a key not there: none), and their addrhint bit while they have any:
        `gain`, only the roles each gains (before the keys are written); else only those each
        loses (after), a bit cleared when no key has it any more. The words that changed.
        O(the keys). (`after` may be made as it is read: at a cold start of 100,000 Services
        a dict of pairs was 20 MB of the peak.)"""
        changed: Words = {name: set() for name in self.maps}
        if not gain and not before:
            return changed  # no key had a role, none can lose one (a cold start: `after` unread)
        addr, role = self.maps
        lay = self.layout
        addr_log2, role_log2 = lay.addr_hint_log2, lay.role_hint_log2
        lb_base = lay.rolehint.max_entries // 2 * 64
        flip = self._flip
        # a key's bits: HINT_POD and HINT_LB in their halves of rolehint, HINT_ANY in addrhint,
        # one filter over the whole array as 0.3.0's programs read it (tests/unit/test_hints.py
        # computes them from the layout alone)
        for k, was in after:
            b = before.get(k, 0)
            if b == was:
                continue
            old = b | HINT_ANY if b else 0
            new = was | HINT_ANY if was else 0
            moved = new & ~old if gain else old & ~new
            if moved & (HINT_POD | HINT_LB):
                bit = addr_hint_bit(k, role_log2)
                if moved & HINT_POD and flip(role, bit, gain):
                    changed[role].add(bit >> 6)
                if moved & HINT_LB and flip(role, lb_base + bit, gain):
                    changed[role].add((lb_base + bit) >> 6)
            if moved & HINT_ANY:
                bit = addr_hint_bit(k, addr_log2)
                if flip(addr, bit, gain):
                    changed[addr].add(bit >> 6)
        return changed

    def _flip(self, name: str, bit: int, gain: bool) -> bool:
        """One key more (`gain`) or less with `bit`; whether its word changed."""
        words = self.words[name]
        w, mask = bit >> 6, 1 << (bit & 63)
        had = bool(words[w] & mask)
        pos = (name, bit)
        if gain:
            if had:
                self.more[pos] = self.more.get(pos, 0) + 1
                return False
            words[w] |= mask
            return True
        n = self.more.get(pos, 0)
        if n:
            if n > 1:
                self.more[pos] = n - 1
            else:
                del self.more[pos]
            return False
        words[w] &= ~mask
        return had

    def rebuild(self, roles: Iterable[tuple[bytes, int]]) -> AddrHints:
        """New hints of the IPv4 keys with these roles (key, HINT_POD | HINT_LB)."""
        new = AddrHints(self.layout)
        new.change({}, roles, gain=True)
        return new

    def differ(self, other: AddrHints) -> Words:
        """The words whose value differs from `other`'s."""
        out: Words = {}
        for name in self.maps:
            a, b = self.words[name], other.words[name]
            pairs = enumerate(zip(a, b, strict=True))
            out[name] = set() if a == b else {i for i, (x, y) in pairs if x != y}
        return out

    def every_word(self) -> Words:
        """Every word of both maps (the first write of a process)."""
        return {name: set(range(len(self.words[name]))) for name in self.maps}
