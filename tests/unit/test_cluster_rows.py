"""The cluster lab's row table (cozylab/cluster/rows.py, scenarios/): the names it plans, and
how a group turns checks, errors and a failed setup into rows. Nothing is built here: the
lab itself runs in tests/datapath/test_cluster_lab.py."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from cozylab.cluster import LAYOUTS, ClusterLab, planned_cases
from cozylab.cluster.rows import Case, Check, Group, run_group


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_row_has_a_name_of_its_own(layout: str) -> None:
    plan = planned_cases(layout)
    assert len(plan) == len(set(plan)), [c for c in plan if plan.count(c) > 1]
    assert plan == [(c.scenario, c.name) for g in ClusterLab(layout).table() for c in g.cases]


def test_the_migration_rows_only_on_kubeovn_and_named_for_the_way_back() -> None:
    kubeovn = [c for s, c in planned_cases("kubeovn") if s == "7 live migration"]
    assert len(kubeovn) == 14
    assert {c.split(" -> ")[0] for c in kubeovn} == {"vm-a(filter,n1)", "vm-a(filter,n3)"}
    assert not [c for s, c in planned_cases("perpod") if s == "7 live migration"]


def test_a_group_turns_checks_and_errors_into_rows() -> None:
    def boom() -> Check:
        raise ConnectionRefusedError

    rows = run_group(
        Group([Case("s", "ok", lambda: (True, "fine")), Case("s", "error", boom)], workers=2),
        "kubeovn",
    )
    assert [(r.case, r.ok, r.detail) for r in rows] == [
        ("ok", True, "fine"),
        ("error", False, "error: connection refused"),
    ]


def test_a_failed_setup_fails_every_row_of_its_group_and_runs_none() -> None:
    ran: list[str] = []

    @contextlib.contextmanager
    def setup() -> Iterator[None]:
        raise TimeoutError("the agents did not sync")
        yield

    def check() -> Check:
        ran.append("x")
        return True, ""

    rows = run_group(Group([Case("s", "a", check), Case("s", "b", check)], setup), "perpod")
    assert ran == []
    assert [(r.case, r.result, r.detail) for r in rows] == [
        ("a", "FAIL", "error: TimeoutError: the agents did not sync"),
        ("b", "FAIL", "error: TimeoutError: the agents did not sync"),
    ]
