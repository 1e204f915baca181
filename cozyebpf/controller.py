"""The controller: makes the datapath hold the desired MapState (the agent reports Problems).

Two ways, like kube-proxy's and Cilium's reconcilers:
- `apply(delta)`, on every change: writes (and deletes) only the entries of what changed,
  without reading the maps; it relies on the maps holding the state before the change, which
  `in_sync` vouches for.
- `sync(desired)`, the full resync: reads the live maps, diffs them against the whole desired
  state and applies the difference, which also repairs drift (an entry someone deleted is
  written again, an entry nobody wants is removed). At start, every --resync-interval, and
  after any failed write (the maps may then hold anything in between).
"""

from __future__ import annotations

import logging

from cozyebpf.datapath import Datapath
from cozyebpf.model import Delta
from cozyebpf.state import MapDiff, MapState, diff, whole


def _counts(state: MapState) -> str:
    return (
        f"{len(state.services)} services, {len(state.pods)} pods, "
        f"{len(state.allowed)} allowed ports"
    )


def summarize(live: MapState, d: MapDiff, desired: MapState) -> str:
    """One line on what applying `d` to `live` programs, e.g. `programmed: services +1 ~0 -0,
    pods +1 ~0 -0, allowed ports +3 -0; now 4 services, 4 pods, 9 allowed ports`."""
    s_new = sum(1 for k in d.services_set if k not in live.services)
    p_new = sum(1 for k in d.pods_set if k not in live.pods)
    return _summary(d, s_new, p_new, desired)


def _summary(d: MapDiff, s_new: int, p_new: int, desired: MapState) -> str:
    ranges = ""
    if d.ranges_set or d.ranges_del:
        ranges = f", pods with source ranges ~{len(d.ranges_set)} -{len(d.ranges_del)}"
    return (
        f"programmed: services +{s_new} ~{len(d.services_set) - s_new} -{len(d.services_del)}, "
        f"pods +{p_new} ~{len(d.pods_set) - p_new} -{len(d.pods_del)}, "
        f"allowed ports +{len(d.allowed_add)} -{len(d.allowed_del)}{ranges}; "
        f"now {_counts(desired)}"
    )


def _empty(st: MapState) -> bool:
    return not (st.services or st.pods or st.allowed or st.ranges or st.limits)


class Controller:
    """Syncs a Datapath to a desired MapState: change by change, with a full resync to start
    from and to fall back on."""

    def __init__(self, datapath: Datapath, log: logging.Logger | None = None) -> None:
        self.datapath = datapath
        self.log = log if log is not None else logging.getLogger("cozyebpf.controller")
        self.in_sync = False  # the maps hold what the last sync or apply wrote

    def sync(self, desired: MapState) -> MapDiff:
        """Diff the live maps against `desired` and apply the difference; return the diff.

        Logs one INFO line when something was programmed (DEBUG when already in sync).
        Exceptions from the datapath propagate (and `in_sync` is False until a sync succeeds).
        """
        self.in_sync = False
        live = self.datapath.read_state()
        # empty maps (a first start): the diff is the desired state's own dicts, not a copy
        # (read only while it is written; a copy was 18 MB of the peak at 100,000 Services)
        d = whole(desired) if _empty(live) else diff(live, desired)
        if d.empty():
            self.log.debug("in sync: %s", _counts(desired))
            self.in_sync = True
            return d
        self.datapath.apply(d)
        self.in_sync = True
        self.log.info("%s", summarize(live, d, desired))
        return d

    def apply(self, delta: Delta, desired: MapState) -> None:
        """Write one change: `delta.diff`, which turns the state the maps hold into `desired`.
        Only while `in_sync`; a failure propagates and clears it (a full sync must follow)."""
        if not self.in_sync:
            raise RuntimeError("apply() needs the maps in sync; sync() first")
        if delta.diff.empty():
            return
        self.in_sync = False
        self.datapath.apply(delta.diff)
        self.in_sync = True
        self.log.info("%s", _summary(delta.diff, delta.new_services, delta.new_pods, desired))
