"""The scenarios, each a module that declares its rows (`rows.Case`: name and check) where it
runs them. `table(lab)` puts them in the order they run; `ClusterLab.run_all` runs that table
and `planned_cases` lists its names without building anything."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cozylab.cluster.rows import Group
from cozylab.cluster.scenarios import (
    cilium_view,
    claim,
    kube,
    migration,
    paths,
    restart,
    source_warnings,
    spoof,
)

if TYPE_CHECKING:
    from cozylab.cluster.lab import ClusterLab


def table(lab: ClusterLab) -> list[Group]:
    """Every scenario's rows for this lab, in the order they run. `at` follows where each
    workload will be when its scenario's turn comes (the migrations move vm-a and back), so
    that the names are known before anything runs."""
    at = dict(lab.location)
    groups = [paths.group(lab)]
    if lab.layout == "kubeovn":
        for name, to in migration.MIGRATIONS:
            groups.append(lab.migration_scenario(lab, name, to, at).group())
            at[name] = to
    groups += [
        restart.Restart(lab, at).group(),
        spoof.group(lab, at),
        source_warnings.group(lab),
        cilium_view.group(lab),
        claim.group(lab),
        *kube.group(lab),
    ]
    return groups
