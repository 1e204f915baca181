"""The shape of `cozyebpf maps dump`: JSON-ready data built from a MapState plus the datapath's
own tables (flows, counters, attachments), and the human table printed from it.

Both address families in one list, addresses in their usual text form (IPv6 compressed, lower
case), IPv4 entries first; the table's columns are as wide as their longest cell."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cozyebpf.model.limits import describe
from cozyebpf.state import IPAddress, Limits, MapState, address_key

if TYPE_CHECKING:
    from cozyebpf.datapath.views import ServiceCounters


#: flows the table lists (the JSON lists them all)
FLOW_ROWS = 100


def mode_name(port_filter: bool) -> str:
    return "port-filter" if port_filter else "whole-ip"


def build_dump(
    state: MapState,
    flows_by_pod: Mapping[IPAddress, int] | None = None,
    counters: Mapping[str, Mapping[str, int]] | None = None,
    attachments: Sequence[Mapping[str, Any]] = (),
    pin_dir: str = "",
    service_counters: Sequence[ServiceCounters] = (),
    flow_entries: Sequence[Mapping[str, Any]] = (),
    flow_timeouts: Mapping[str, float] | None = None,
    limits: Mapping[str, tuple[Limits, Mapping[str, float]]] | None = None,
) -> dict[str, Any]:
    """JSON-ready dump. Services are sorted by LB IP and pods by pod IP, IPv4 before IPv6;
    ports as "tcp/22", sorted by protocol number and port; `service` names the Service an
    address counts for (null: none); the per-Service counters by Service, drops by reason
    (those that counted any); `source_ranges` of a Service's pod (null: every source); the
    flows with their age in seconds (`flow_entries`, as FlowEntry.as_dict) and the timeouts;
    each Service's limits with the share of each bucket's burst left (`limits`, as
    PinnedMaps.limits gives them)."""
    flows_by_pod = flows_by_pod or {}
    ports_by_pod: dict[IPAddress, list[str]] = {}
    for a in sorted(state.allowed):
        ports_by_pod.setdefault(a.pod_ip, []).append(f"{a.proto.name.lower()}/{a.port}")
    services = [
        {
            "lb_ip": str(lb),
            "pod_ip": str(svc.pod_ip),
            "mode": mode_name(svc.port_filter),
            "allow_icmp": svc.allow_icmp,
            "allowed_ports": ports_by_pod.get(svc.pod_ip, []) if svc.port_filter else [],
            "flows": flows_by_pod.get(svc.pod_ip, 0),
            "service": svc.service or None,
            "source_ranges": _ranges(state, svc.pod_ip),
        }
        for lb, svc in sorted(state.services.items(), key=lambda kv: address_key(kv[0]))
    ]
    pods = [
        {
            "pod_ip": str(pod),
            "lb_ip": str(entry.lb_ip),
            "mode": mode_name(entry.port_filter),
            "allow_icmp": entry.allow_icmp,
            "service": entry.service or None,
        }
        for pod, entry in sorted(state.pods.items(), key=lambda kv: address_key(kv[0]))
    ]
    return {
        "pin_dir": pin_dir,
        "attachments": list(attachments),
        "services": services,
        "pods": pods,
        "flows": sum(flows_by_pod.values()),
        "flow_timeouts": dict(flow_timeouts or {}),
        "flow_entries": list(flow_entries),
        "counters": {k: dict(v) for k, v in (counters or {}).items()},
        "limits": [
            {
                "service": svc,
                "ingress_bits_per_second": lim.ingress_bps,
                "ingress_packets_per_second": lim.ingress_pps,
                "egress_bits_per_second": lim.egress_bps,
                "guard": lim.guard,
                "burst_left": {k: round(v, 3) for k, v in left.items()},
            }
            for svc, (lim, left) in sorted((limits or {}).items())
        ],
        "service_counters": [
            {
                "service": c.service,
                "slot": c.slot,
                "ingress": {"packets": c.in_packets, "bytes": c.in_bytes},
                "egress": {"packets": c.out_packets, "bytes": c.out_bytes},
                "drops": {r: n for r, n in c.drops.items() if n},
            }
            for c in sorted(service_counters, key=lambda c: c.service)
        ],
    }


def _ranges(state: MapState, pod: IPAddress) -> list[str] | None:
    nets = state.ranges.get(pod)
    if nets is None:
        return None
    return [str(n) for n in sorted(nets, key=lambda n: (int(n.network_address), n.prefixlen))]


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]


def render_refused(rows: Iterable[Mapping[str, str]]) -> list[str]:
    """The lines `status` and `maps dump` print for refused Services (an LB IP in use)."""
    return [f"  {r['service']}: LB IP {r['lb_ip']} is {r['why']}: not programmed" for r in rows]


def _indented(headers: list[str], rows: list[tuple[Any, ...]]) -> list[str]:
    return ["  " + line for line in _table(headers, rows)]


def render_dump(d: Mapping[str, Any]) -> str:
    """The readable table of `cozyebpf maps dump`."""
    out: list[str] = []
    if d.get("pin_dir"):
        out.append(f"pinned maps: {d['pin_dir']}")
    if d.get("attachments"):
        out.append("attached:")
        out += _indented(
            ["DEVICE", "HOOK", "PROGRAM", "PROG ID"],
            [(a["device"], a["hook"], a["program"], a["prog_id"]) for a in d["attachments"]],
        )
    out += _render_services(d)
    out += _render_flows(d)
    out += _render_limits(d)
    out += _render_counters(d)
    return "\n".join(out)


def _render_limits(d: Mapping[str, Any]) -> list[str]:
    """Each Service's limits and how much of each bucket's burst is left."""
    rows = d.get("limits", [])
    if not rows:
        return []
    out = [f"limits ({len(rows)}):"]
    out += _indented(
        ["SERVICE", "LIMITS", "BURST LEFT"],
        [
            (
                r["service"],
                describe(
                    Limits(
                        r["ingress_bits_per_second"],
                        r["egress_bits_per_second"],
                        r["ingress_packets_per_second"],
                        r["guard"],
                    )
                ),
                ", ".join(f"{k} {v:.0%}" for k, v in r["burst_left"].items()) or "-",
            )
            for r in rows
        ],
    )
    return out


def _render_services(d: Mapping[str, Any]) -> list[str]:
    """The Services (and those refused), and pods whose LB IP has no service entry."""
    out = [f"services ({len(d['services'])}):"]
    refused = d.get("refused")
    if refused:
        out.append(f"refused, not programmed: LB IP already in use ({len(refused)}):")
        out += render_refused(refused)
    elif d.get("refused_error"):
        out.append(f"refused Services unknown: {d['refused_error']}")
    if d["services"]:
        rows = [
            (
                s["lb_ip"],
                s["pod_ip"],
                s.get("service") or "-",
                s["mode"],
                _yes(s["allow_icmp"]),
                ",".join(s["allowed_ports"]) or "-",
                "any" if s.get("source_ranges") is None else ",".join(s["source_ranges"]) or "none",
                s["flows"],
            )
            for s in d["services"]
        ]
        out += _indented(
            ["LB IP", "POD IP", "SERVICE", "MODE", "ICMP", "PORTS", "SOURCES", "FLOWS"], rows
        )
    lonely = [p for p in d["pods"] if p["lb_ip"] not in {s["lb_ip"] for s in d["services"]}]
    if lonely:
        out.append("pods whose LB IP has no service entry:")
        out += _indented(
            ["POD IP", "LB IP", "MODE", "ICMP"],
            [(p["pod_ip"], p["lb_ip"], p["mode"], _yes(p["allow_icmp"])) for p in lonely],
        )
    return out


def _render_flows(d: Mapping[str, Any]) -> list[str]:
    """The flow count, the idle timeouts and the first FLOW_ROWS flows."""
    out = [f"flows: {d['flows']}"]
    if d.get("flow_timeouts"):
        out.append(
            "  idle timeouts (s, 0 never): "
            + ", ".join(f"{k} {v:g}" for k, v in d["flow_timeouts"].items())
        )
    entries = d.get("flow_entries", [])
    if entries:
        out += _indented(
            ["POD IP", "POD PORT", "REMOTE", "REMOTE PORT", "PROTO", "AGE (s)", "STATE"],
            [
                (
                    f["pod_ip"],
                    f["pod_port"],
                    f["remote_ip"],
                    f["remote_port"],
                    f["proto"],
                    f"{f['age_s']:.0f}",
                    "closing" if f["closing"] else "open",
                )
                for f in entries[:FLOW_ROWS]
            ],
        )
        if len(entries) > FLOW_ROWS:
            out.append(f"  ... {len(entries) - FLOW_ROWS} more flows (--json lists them all)")
    return out


def _render_counters(d: Mapping[str, Any]) -> list[str]:
    """The node-wide counters that counted a packet, and each Service's."""
    nonzero = {k: v for k, v in d["counters"].items() if v.get("packets")}
    out = ["counters:" + ("" if nonzero else " (all zero)")]
    if nonzero:
        out += _indented(
            ["REASON", "PACKETS", "BYTES"],
            [(k, v["packets"], v["bytes"]) for k, v in sorted(nonzero.items())],
        )
    per = d.get("service_counters", [])
    if per:
        out.append("per Service:")
        out += _indented(
            ["SERVICE", "IN PACKETS", "IN BYTES", "OUT PACKETS", "OUT BYTES", "DROPS"],
            [
                (
                    c["service"],
                    c["ingress"]["packets"],
                    c["ingress"]["bytes"],
                    c["egress"]["packets"],
                    c["egress"]["bytes"],
                    ",".join(f"{r}={n}" for r, n in c["drops"].items()) or "-",
                )
                for c in per
            ],
        )
    return out


def dump_pinned(pin_dir: str) -> dict[str, Any]:
    """`maps dump`, also from another process: read the pins, no compilation."""
    from cozyebpf.datapath.attach import list_attachments
    from cozyebpf.datapath.maps import PinnedMaps, coarse_now_ns

    with PinnedMaps.open(pin_dir) as m:
        now = coarse_now_ns()
        flows = sorted(
            m.flow_entries(),
            key=lambda e: (address_key(e.flow.pod_ip), address_key(e.flow.remote_ip), e.flow[2:]),
        )
        return build_dump(
            m.read_state(),
            m.flows_by_pod(),
            m.counters(),
            [a.as_dict() for a in list_attachments(pin_dir)],
            pin_dir,
            m.service_counters(),
            [e.as_dict(now) for e in flows],
            m.flow_timeouts(),
            m.limits(),
        )
