"""The model's addresses (cozyebpf/state.py, HashedIPv4Address and HashedIPv6Address) stand in
for ipaddress's everywhere: equal, hashed, ordered, shown and pickled alike, so that a dict keyed
by one finds the other (the maps read back plain ones)."""

from __future__ import annotations

import pickle
from ipaddress import IPv4Address, IPv6Address, ip_address

import pytest

from cozyebpf.model.fields import _parse_ip
from cozyebpf.state import HashedIPv4Address, HashedIPv6Address


@pytest.mark.parametrize(
    "text", ["198.51.100.7", "203.0.113.255", "2001:db8::1", "2001:db8:0:0:0:0:0:a"]
)
def test_a_hashed_address_is_the_plain_one(text: str) -> None:
    plain = ip_address(text)
    mine = (HashedIPv4Address if plain.version == 4 else HashedIPv6Address)(text)
    assert mine == plain and plain == mine
    assert hash(mine) == hash(plain)
    assert {plain: 1}[mine] == 1 and {mine: 1}[plain] == 1
    assert repr(mine) == repr(plain) and str(mine) == str(plain)
    assert mine.packed == plain.packed and int(mine) == int(plain)
    assert pickle.loads(pickle.dumps(mine)) == plain
    other = ip_address(int(plain) + 1) if plain.version == 4 else IPv6Address(int(plain) + 1)
    assert sorted([other, mine]) == [mine, other] and mine < other


def test_the_model_reads_hashed_addresses() -> None:
    """What the model reads from an object is the hashed kind (its hash computed once)."""
    v4 = _parse_ip("198.51.100.7", "ip", "fix it")
    v6 = _parse_ip("2001:DB8::7", "ip", "fix it")
    assert type(v4) is HashedIPv4Address and v4 == IPv4Address("198.51.100.7")
    assert type(v6) is HashedIPv6Address and v6 == IPv6Address("2001:db8::7")
