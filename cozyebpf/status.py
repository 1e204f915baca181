"""`cozyebpf status`: the node at a glance.

The datapath's part comes from the pins, as `maps dump` reads them (attachments, layout
version, Services by mode, the monitor, the top drop reasons); the agent's part (its last sync,
open problems) from the running agent, which serves it as JSON at /status next to /healthz
(`--health-address`).
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from cozyebpf import __version__, httpserver
from cozyebpf.datapath import attach
from cozyebpf.datapath.layout import LAYOUT_VERSION, MON_ALL, MON_DROPS
from cozyebpf.datapath.maps import PinnedMaps
from cozyebpf.datapath.pins import monitor_running, read_pinned_meta
from cozyebpf.dump import mode_name, render_refused
from cozyebpf.errors import CozyError
from cozyebpf.model.limits import describe

if TYPE_CHECKING:
    from cozyebpf.agent import Agent
    from cozyebpf.model import ServiceView

TOP = 5


T = TypeVar("T")


def read_model(read: Callable[[], list[T]]) -> list[T]:
    """A read of the agent's model from another thread (an HTTP request): the agent's loop
    changes it meanwhile, and a read that meets a dict changing size is tried again."""
    for _ in range(5):
        try:
            return read()
        except RuntimeError:
            time.sleep(0.001)
    return read()


def agent_status(agent: Agent) -> dict[str, Any]:
    """The agent's side of `status`, served at /status."""
    views = read_model(agent.model.views)
    problems = read_model(agent.problems)
    st = agent.stats
    modes = Counter(mode_name(v.port_filter) for v in views)
    return {
        "version": __version__,
        "layout_version": LAYOUT_VERSION,  # of the maps it writes
        "pid": os.getpid(),
        "synced": agent.synced_once,
        "last_sync": st.last_sync,
        "last_sync_duration": st.last_sync_duration,
        "last_full_sync": st.last_full_sync,
        "syncs": st.syncs,
        "full_syncs": st.full_syncs,
        "sync_errors": st.sync_errors,
        "services": {m: modes.get(m, 0) for m in ("whole-ip", "port-filter")},
        "problems": [
            {"severity": p.severity, "object": str(p.ref), "message": p.message} for p in problems
        ],
        # pod-facing devices every pod's packets cross: sources behind them are not verified
        "unverified_sources": list(agent.unverified),
        "refused": refused(views),
    }


def refused(views: Iterable[ServiceView]) -> list[dict[str, str]]:
    """The Services not programmed because an LB IP of theirs is an address in use (issue
    31): one row per such LB IP, with its kind (for metrics) and what the address is."""
    return [
        {"service": str(v.ref), "lb_ip": str(r.lb), "kind": r.kind, "why": r.what}
        for v in views
        for r in v.refused
    ]


def fetch_agent(address: str, timeout: float = 2.0) -> dict[str, Any]:
    """GET http://ADDRESS/status; {"error": ...} when the agent cannot be reached."""
    url = httpserver.url(address, "/status")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            data: dict[str, Any] = json.load(r)
            return data
    except (OSError, urllib.error.URLError, ValueError) as e:
        return {"error": f"cannot reach the agent at {url}: {e}"}


def with_refused(d: dict[str, Any], agent_address: str | None) -> dict[str, Any]:
    """`d` with the Services the running agent refused (they have no map entry: an LB IP of
    theirs is an address in use), asked from its /status; `refused_error` when it cannot
    be asked."""
    if not agent_address:
        return d
    ag = fetch_agent(agent_address)
    if "error" in ag:
        d["refused_error"] = ag["error"]
    else:
        d["refused"] = ag.get("refused", [])
    return d


def datapath_status(pin_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {"pin_dir": pin_dir}
    try:
        out["attachments"] = [a.as_dict() for a in attach.list_attachments(pin_dir)]
    except (OSError, CozyError) as e:
        out["attachments"] = []
        out["attachments_error"] = str(e)
    try:  # what meta says: the layout and the release that wrote the maps
        found = read_pinned_meta(pin_dir)
    except CozyError:
        found = None
    if found is not None:
        out["layout"] = found.as_dict()
    try:
        maps = PinnedMaps.open(pin_dir)
    except CozyError as e:
        out["error"] = str(e)
        return out
    with maps:
        state = maps.read_state()
        counters = maps.counters()
        mon = maps.monitor_state()
        slots = maps.service_counters()
        entries = maps.entries()
        uplinks, pod_devices = maps.node_config()
        limits = maps.limits()
        shaped = maps.shaped()
        out["node"] = {
            "uplinks": [_device_name(i) for i in uplinks],
            "pod_devices": pod_devices,  # the pod-facing hooks and their paths are on
            "host_routing": maps.host_routing(),
            "fib_gen": maps.fib_gen(),  # bumped on each change of the node's routes
            # egress limits shaped (every uplink's root qdisc is fq) or policed
            "egress_limits": "shaped" if shaped else "policed",
        }
    out["layout_version"] = found.version if found else LAYOUT_VERSION  # the maps'
    services: dict[str, set[str]] = {"whole-ip": set(), "port-filter": set()}
    for lb, entry in state.services.items():
        services[mode_name(entry.port_filter)].add(entry.service or f"(unnamed) {lb}")
    out["services"] = {m: len(s) for m, s in services.items()}
    out["lb_ips"] = len(state.services)
    out["pods"] = len(state.pods)
    running = monitor_running(pin_dir)
    out["monitor"] = {
        "running": running,
        "type": {MON_DROPS: "drop", MON_ALL: "all"}.get(mon.mode),
        "rate": round(1e9 / mon.interval_ns) if mon.mode and mon.interval_ns else None,
        "stale": bool(mon.mode) and not running,
        "events": mon.events,
        "lost": mon.lost_limit + mon.lost_full,
    }
    drops = sorted(
        ((r, v["packets"]) for r, v in counters.items() if r.startswith("drop_") and v["packets"]),
        key=lambda x: (-x[1], x[0]),
    )
    out["top_drops"] = [{"reason": r, "packets": n} for r, n in drops[:TOP]]
    by_service = sorted(
        ((c.service, sum(c.drops.values())) for c in slots if sum(c.drops.values())),
        key=lambda x: (-x[1], x[0]),
    )
    out["top_dropping_services"] = [{"service": s, "packets": n} for s, n in by_service[:TOP]]
    out["maps"] = {name: {"entries": n, "capacity": cap} for name, (n, cap) in entries.items()}
    # egress limits are shaped where every uplink's root qdisc is fq (the uplink's egress sets
    # each packet's departure time), else policed (dropped over the rate where the pod's packet
    # is translated): docs/behaviour.md, Limits per public IP
    out["limits"] = [
        {
            "service": svc,
            "limits": describe(lim),
            "guard_only": lim.guard and lim.ingress_bps is None and lim.egress_bps is None,
            "egress": out["node"]["egress_limits"] if lim.egress_bps is not None else None,
            "burst_left": {k: round(v, 3) for k, v in left.items()},
        }
        for svc, (lim, left) in sorted(limits.items())
    ]
    return out


def _device_name(ifindex: int) -> str:
    try:
        return socket.if_indextoname(ifindex)
    except OSError:
        return f"ifindex {ifindex}"


def render_node(node: dict[str, Any]) -> str:
    """One line: what the agent wrote of the node's part (flowcfg)."""
    hr = "on" if node["host_routing"] else "off"
    pods = "on" if node["pod_devices"] else "off (no --pod-devices)"
    return (
        f"node: uplinks {', '.join(node['uplinks']) or 'none'}; pod-facing hooks {pods}; "
        f"host routing {hr} (--host-routing); FIB answers of generation {node['fib_gen']}; "
        f"egress limits {node['egress_limits']} ({SHAPED_WHY[node['egress_limits']]})"
    )


#: why a node's egress limits are shaped or policed (bpf/lib/limit.h)
SHAPED_WHY = {
    "shaped": "every uplink's root qdisc is fq",
    "policed": "an uplink's root qdisc is not fq",
}


#: `status`'s agent part when no address was given (--agent, COZYEBPF_RUN_HEALTH_ADDRESS)
NOT_ASKED = (
    "not asked (no --agent: pass the HOST:PORT of its --health-address, which the DaemonSet "
    "sets in COZYEBPF_RUN_HEALTH_ADDRESS)"
)


def gather(pin_dir: str, agent_address: str | None) -> dict[str, Any]:
    """The datapath's part from the pins; the agent's from its /status when `agent_address`
    is given (else `{"not_asked": ...}`: an agent is asked only where one serves)."""
    agent = fetch_agent(agent_address) if agent_address else {"not_asked": NOT_ASKED}
    return {"datapath": datapath_status(pin_dir), "agent": agent}


def _ago(t: float | None, now: float) -> str:
    if t is None:
        return "never"
    s = max(0.0, now - t)
    when = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))
    return f"{when} ({s:.0f}s ago)"


def render(d: dict[str, Any], now: Callable[[], float] = time.time) -> str:
    dp, ag = d["datapath"], d["agent"]
    out = [f"pin dir: {dp['pin_dir']}"]
    if dp.get("attachments"):
        out.append(
            "attached: "
            + ", ".join(f"{a['device']} {a['hook']} ({a['program']})" for a in dp["attachments"])
        )
    else:
        out.append("attached: nothing")
    lay = dp.get("layout")
    if lay:
        out.append(
            f"map layout: {lay['layout_version']} (written by cozyebpf "
            f"{lay['written_by'] or 'before 0.2.0'}; layout {lay['oldest']} or newer runs on it)"
        )
    if "error" in dp:
        out.append(f"maps: {dp['error']}")
    else:
        svc = dp["services"]
        out.append(
            f"services: {svc['whole-ip']} whole-IP, {svc['port-filter']} port-filter "
            f"({dp['lb_ips']} LB IPs, {dp['pods']} pods)"
        )
        if "node" in dp:
            out.append(render_node(dp["node"]))
        m = dp["monitor"]
        if m["running"]:
            out.append(f"monitor: running (--type {m['type']}, {m['rate']} events/s)")
        elif m["stale"]:
            out.append("monitor: none, but its events are on (the agent turns them off)")
        else:
            out.append("monitor: not running")
        out.append(f"events lost (monitor): {m['lost']}")
        full = [
            f"{name} {v['entries']}/{v['capacity']}"
            for name, v in dp["maps"].items()
            if v["capacity"] and v["entries"] / v["capacity"] >= 0.8
        ]
        if full:
            out.append("maps 80% full or more: " + ", ".join(full))
        lim = dp.get("limits", [])
        own = [x for x in lim if not x["guard_only"]]
        out.append(
            f"limits: {len(own)} Services of their own"
            + (f", {len(lim) - len(own)} the node's guard only" if len(lim) > len(own) else "")
        )
        out += [
            f"  {x['service']}: {x['limits']}" + (f" (egress {x['egress']})" if x["egress"] else "")
            for x in own
        ]
        if dp["top_drops"]:
            out.append(
                "top drop reasons: "
                + ", ".join(f"{x['reason']} {x['packets']}" for x in dp["top_drops"])
            )
        else:
            out.append("top drop reasons: none")
        if dp["top_dropping_services"]:
            out.append(
                "most drops: "
                + ", ".join(f"{x['service']} {x['packets']}" for x in dp["top_dropping_services"])
            )
    if "error" in ag or "not_asked" in ag:
        out.append(f"agent: {ag.get('error') or ag['not_asked']}")
        return "\n".join(out)
    t = now()
    layout = f" (map layout {ag['layout_version']})" if "layout_version" in ag else ""
    out.append(f"agent: cozyebpf {ag['version']}{layout}, pid {ag['pid']}, synced: {ag['synced']}")
    dur = ag.get("last_sync_duration")
    out.append(
        f"last sync: {_ago(ag.get('last_sync'), t)}"
        + (f", took {dur * 1000:.1f} ms" if dur is not None else "")
        + f"; {ag['syncs']} syncs ({ag['full_syncs']} full), {ag['sync_errors']} errors"
    )
    if ag.get("unverified_sources"):
        out.append(
            f"source addresses not verified behind: {', '.join(ag['unverified_sources'])} "
            "(only the CNI's port security can)"
        )
    rows = ag.get("refused", [])
    out.append(f"refused (LB IP already in use, not programmed): {len(rows)}")
    out += render_refused(rows)
    problems = ag.get("problems", [])
    out.append(f"problems: {len(problems)}")
    out += [f"  {p['severity']}: {p['object']}: {p['message']}" for p in problems]
    return "\n".join(out)
