"""The age order of Services (`compose._age`): who keeps a contested LB IP or a pod's egress.
One string per Service must sort exactly as the tuple it replaced, (no timestamp, creation
time, namespace, name), for any times and offsets and any namespace that begins another."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

from hypothesis import given
from hypothesis import strategies as st

from cozyebpf.model.compose import _age
from cozyebpf.model.records import ObjectRef, ParsedService

NAMES = st.text(alphabet="ab-.z0", min_size=1, max_size=4)
OFFSETS = st.integers(-14 * 60, 14 * 60).map(lambda m: timezone(timedelta(minutes=m)))
TIMES = st.one_of(
    st.none(),
    st.datetimes(min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31), timezones=OFFSETS),
    st.sampled_from([datetime(1, 1, 1, tzinfo=UTC), datetime(2026, 1, 1, tzinfo=UTC)]),
    st.sampled_from([datetime(1, 1, 1, h, tzinfo=timezone(timedelta(hours=10))) for h in (1, 5)]),
)


def service(ns: str, name: str, created: datetime | None) -> ParsedService:
    return ParsedService(ObjectRef("Service", ns, name), created, False, False, (), (), ())


def the_tuple(s: ParsedService) -> tuple[bool, datetime, str, str]:
    first = datetime.min.replace(tzinfo=UTC)
    return (s.created is None, s.created or first, s.ref.namespace, s.ref.name)


@given(st.lists(st.tuples(NAMES, NAMES, TIMES), max_size=30))
def test_the_key_sorts_as_the_tuple(items: list[tuple[str, str, datetime | None]]) -> None:
    services = [service(*i) for i in items]
    assert [the_tuple(s) for s in sorted(services, key=_age)] == sorted(map(the_tuple, services))


def test_examples() -> None:
    old, new = datetime(2024, 1, 1, tzinfo=UTC), datetime(2025, 1, 1, tzinfo=UTC)
    # an hour east of UTC is an hour earlier
    east = datetime(2024, 1, 1, 0, 30, tzinfo=timezone(timedelta(hours=1)))
    order = [
        service("a", "z", east),
        service("a", "b", old),
        service("a-b", "a", old),
        service("ab", "a", old),
        service("a", "a", new),
        service("", "a", None),
        service("a", "a", None),
    ]
    assert sorted(reversed(order), key=_age) == order
