"""The `limits` part's figures (bench/limits.py measures them): the accuracy and isolation rows
summarized from the runs, the table under the bench's report, its notes and its targets."""

from __future__ import annotations

from typing import Any

from bench.common import median
from bench.limits_params import (
    BAND,
    CONFIG_LABELS,
    CONFIGS,
    DIRECTIONS,
    FIXED_FLOOD,
    FRAME,
    KEEP_GOAL,
    KUBEOVN_DIRECTIONS,
    LAYOUT_LABELS,
    MSS,
    NODE_LABELS,
    NODE_NAMES,
    NODES,
    REACHABLE,
    SHAPED,
    Settings,
    frame_mss,
)
from cozyebpf.model.limits import parse_quantity


def summarize_accuracy(
    runs: list[dict[str, Any]], s: Settings, frame: int = FRAME, mss: int = MSS
) -> list[dict[str, Any]]:
    """Per (congestion control, direction, limit, flows): the median goodput, its ratio to the
    limit, the same in full frames (`wire_ratio`: what the ingress bucket counts, and what a
    wire carries), the median retransmissions and RTOs, the median drops in the window (the
    agent's drop_limit; fq's for egress-shaped), what status said of the egress limit (`mode`),
    and the path's goodput without a limit."""
    rows = []
    for cc in s.ccs:
        for direction in s.directions(cc):
            for flows in s.flows:
                key = (cc, direction, flows)
                mine_of = {
                    lim: [
                        r
                        for r in runs
                        if (r["cc"], r["direction"], r["flows"], r["limit"]) == (*key, lim)
                    ]
                    for lim in ("none", *s.limits)
                }
                free = [r["goodput_bps"] for r in mine_of["none"]]
                for lim, mine in mine_of.items():
                    if not mine:
                        continue
                    good = median([r["goodput_bps"] for r in mine])
                    segs = good / 8 * mine[0]["seconds"] / mss
                    retrans = median([r["retrans"] for r in mine])
                    row: dict[str, Any] = {
                        "cc": cc,
                        "direction": direction,
                        "limit": lim,
                        "flows": flows,
                        "goodput_bps": round(good),
                        "min_bps": min(r["goodput_bps"] for r in mine),
                        "max_bps": max(r["goodput_bps"] for r in mine),
                        "retrans": retrans,
                        "retrans_share": round(retrans / segs, 4) if segs else None,
                        "timeouts": median([r["timeouts"] for r in mine]),
                        "others_cpus": median([r["others_cpus"] for r in mine]),
                        "unlimited_bps": round(median(free)) if free else None,
                        "n": len(mine),
                        "counted": {
                            k: median([r["counted"][k] for r in mine])
                            for k in mine[0].get("counted", {})
                        },
                        "mode": "/".join(sorted({r["mode"] for r in mine if r.get("mode")}))
                        or None,
                    }
                    if lim != "none":
                        bps = parse_quantity(lim)
                        row["limit_bps"] = bps
                        row["ratio"] = round(good / bps, 4)
                        row["wire_ratio"] = round(good * frame / mss / bps, 4)
                        got = [r["received_bps"] for r in mine if "received_bps" in r]
                        if got:  # what the receivers' kernel took, their reads' lag aside
                            row["received_ratio"] = round(median(got) / bps, 4)
                        row["reachable"] = bool(free) and median(free) >= REACHABLE * bps
                    rows.append(row)
    return rows


def summarize_isolation(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """vm-b alone (medians), and per flood: vm-b flooded (medians), the median of each
    repetition's flooded / alone, and the flood's own figures."""
    alone = [r for r in runs if r["flood"] is None]
    by_rep = {r["rep"]: r["goodput_bps"] for r in alone}
    out: dict[str, Any] = {
        "alone_bps": round(median([r["goodput_bps"] for r in alone])),
        "retrans_alone": median([r["retrans"] for r in alone]),
        "others_cpus_alone": median([r["others_cpus"] for r in alone]),
        "runs": runs,
    }
    for mode in ("full", "fixed"):
        flooded = [r for r in runs if r["flood"] == mode]
        kept = [r["goodput_bps"] / by_rep[r["rep"]] for r in flooded if by_rep.get(r["rep"])]
        floods = [r["flood_stats"] for r in flooded if "flood_stats" in r]
        stats: dict[str, Any] = {}
        for k in floods[0] if floods else ():
            vals = [f[k] for f in floods if f[k] is not None]
            stats[k] = median(vals) if vals else None
        out[mode] = {
            "flooded_bps": round(median([r["goodput_bps"] for r in flooded])),
            "kept": round(median(kept), 3) if kept else None,
            "retrans": median([r["retrans"] for r in flooded]),
            "others_cpus": median([r["others_cpus"] for r in flooded]),
            "flood": stats,
        }
    return out


# -- report ----------------------------------------------------------------------------------


def _mbit(bps: float | None) -> str:
    return "" if bps is None else f"{bps / 1e6:.1f}"


def _nodes(lim: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(node, its figures) of each node the part measured: the single node's at the top of the
    part's results (a file from before the Kube-OVN node has only those), the others under
    their names."""
    out = [("single", lim)] if "accuracy" in lim else []
    return out + [(n, lim[n]) for n in NODES if n != "single" and n in lim]


def table(lim: dict[str, Any]) -> list[str]:
    """The part's tables, per node: accuracy per congestion control, direction, limit and
    flows; isolation per configuration."""
    return [line for node, fig in _nodes(lim) for line in _node_table(fig, node)]


def _node_table(lim: dict[str, Any], node: str) -> list[str]:
    s = lim["settings"]
    ld = lim["load"]
    lines = [
        "",
        f"LIMITS PER PUBLIC IP (issue 38), {NODE_LABELS[node]}: TCP through the real agent, "
        f"medians of {s['reps']} repetition(s) of {s['window']} s after {s['warmup']} s of "
        f"warm-up; load before {ld['before']} (CPUs {ld['cpu_busy_before'] * 100:.0f}% busy), "
        f"after {ld['after']}",
    ]
    measured = {r["direction"] for r in lim["accuracy"]["rows"]}
    frame, mss = frame_mss(lim.get("mtu", 1500))
    directions = DIRECTIONS | (KUBEOVN_DIRECTIONS if node == "kubeovn" else {})
    for d, what in directions.items():
        if d in measured:
            lines.append(f"  {d}: {what}")
    lines.append(
        f"  {'cc':5s} {'direction':12s} {'limit':>5s} {'flows':>5s} {'Mbit/s':>9s} "
        f"{'goodput/limit':>13s} {'wire/limit':>10s} {'retrans':>8s} {'retr %':>6s} "
        f"{'RTOs':>5s} {'others':>6s}  unlimited Mbit/s"
    )
    for r in lim["accuracy"]["rows"]:
        ratio = f"{r['ratio']:.3f}" if "ratio" in r else ""
        wire = f"{r['wire_ratio']:.3f}" if "wire_ratio" in r else ""
        share = "" if r["retrans_share"] is None else f"{r['retrans_share'] * 100:.1f}"
        note = "" if r.get("reachable", True) else "  not reachable here"
        lines.append(
            f"  {r['cc']:5s} {r['direction']:12s} {r['limit']:>5s} {r['flows']:>5d} "
            f"{_mbit(r['goodput_bps']):>9s} {ratio:>13s} {wire:>10s} {r['retrans']:>8.0f} "
            f"{share:>6s} {r['timeouts']:>5.0f} {r['others_cpus']:>6.2f}  "
            f"{_mbit(r['unlimited_bps'])}{note}"
        )
    lines.append(
        f"  (wire/limit: the goodput in full frames, {frame} bytes per {mss} of payload: what the "
        "buckets count, egress a GSO packet's wire length, its headers once per segment; "
        "retr %: retransmitted segments per segment of goodput; RTOs: retransmission timeouts "
        "in the window; others: CPUs other jobs on the machine took meanwhile, of 2)"
    )
    lines += shaped_table(lim)
    lines += isolation_table(lim)
    lines += ["  " + n for n in notes(lim)]
    return lines


def isolation_table(lim: dict[str, Any]) -> list[str]:
    """vm-b alone and flooded, per configuration and direction."""
    if not lim["isolation"]:
        return ["  isolation: not measured (--limits-accuracy-only)"]
    s = lim["settings"]
    lines: list[str] = []
    lines.append(
        f"  isolation: vm-b's TCP, 1 flow paced to {lim['b_demand_bps'] / 1e6:.0f} Mbit/s, alone "
        f"and while vm-a's LB IP is flooded (60-byte UDP, bench_gen, one thread) at its full rate "
        f"or at a fixed {FIXED_FLOOD / 1e6:.2f} Mpps, medians of {s['iso_reps']} repetition(s); "
        "flood: Mpps sent, to vm-a, drop_limit; the generator thread's CPU; others: CPUs of other "
        "jobs"
    )
    lines.append(
        f"  {'config':12s} {'vm-b':8s} {'alone':>6s} | {'full':>6s} {'kept':>6s} {'retr':>5s} "
        f"{'flood':>19s} {'gen':>4s} | {'fixed':>6s} {'kept':>6s} {'retr':>5s} {'flood':>19s} "
        f"| {'others':>6s}"
    )

    for layout, key in (("one-queue", "isolation"), ("rss", "isolation_rss")):
        if lim.get(key):
            lines.append(f"  {layout}: {LAYOUT_LABELS[layout]}")
            lines += _iso_rows(lim[key])
    for c, label in CONFIG_LABELS.items():
        lines.append(f"    {c}: {label}")
    return lines


def _iso_rows(iso: dict[str, Any]) -> list[str]:
    """The isolation table's rows of one layout of the uplink pair (LAYOUTS)."""
    lines = []

    def mpps(x: float | None) -> str:
        return "-" if x is None else f"{x / 1e6:.3f}"

    for c, dirs in iso.items():
        for direction, d in dirs.items():
            cells = []
            for mode in ("full", "fixed"):
                m = d[mode]
                f = m["flood"]
                kept = f"{m['kept']:.2f}x" if m["kept"] is not None else ""
                flood = (
                    f"{mpps(f.get('sent_pps'))}/{mpps(f.get('to_vm_a_pps'))}/"
                    f"{mpps(f.get('drop_limit_pps'))}"
                )
                cell = f"{_mbit(m['flooded_bps']):>6s} {kept:>6s} {m['retrans']:>5.0f} {flood:>19s}"
                if mode == "full":
                    cell += f" {f.get('generator_cpu_share', 0) * 100:>3.0f}%"
                cells.append(cell)
            others = max(
                [d["others_cpus_alone"]] + [d[m]["others_cpus"] for m in ("full", "fixed")]
            )
            lines.append(
                f"  {c:12s} {direction:8s} {_mbit(d['alone_bps']):>6s} | "
                + " | ".join(cells)
                + f" | {others:>6.2f}"
            )
    return lines


def shaped_table(lim: dict[str, Any]) -> list[str]:
    """egress policed (noqueue) beside egress-shaped (fq) per limit and flows: goodput / limit,
    the retransmissions and RTOs, and whose drops they were (the agent's drop_limit, fq's)."""
    acc = lim["accuracy"]
    if "shaped_missing" in acc:
        return [f"  egress-shaped: not measured: {acc['shaped_missing']}"]
    cc0 = lim["settings"]["ccs"][0]
    rows = {(r["direction"], r["limit"], r["flows"]): r for r in acc["rows"] if r["cc"] == cc0}
    keys = [(r["limit"], r["flows"]) for r in acc["rows"] if r["direction"] == "egress-shaped"]
    if not keys:
        return []
    lines = [
        f"  egress policed (the uplink's noqueue) and shaped (fq), {cc0}, medians in the window: "
        "goodput / limit (the receivers' reads; kernel: the bytes their kernel took in order), "
        "retransmitted segments (% of the goodput's), RTOs, drops of the "
        "agent (drop_limit) and of fq (all / over its flow_limit); status: what "
        "`cozyebpf status` said of the egress limit",
        f"  {'limit':>5s} {'flows':>5s} | {'policed':>7s} {'kernel':>7s} {'retrans':>13s} "
        f"{'RTOs':>4s} {'drops':>6s} | {'shaped':>7s} {'kernel':>7s} {'retrans':>13s} "
        f"{'RTOs':>4s} {'drops':>6s} {'fq drops':>9s}  status",
    ]

    def cells(r: dict[str, Any] | None) -> str:
        if r is None:
            return f"{'-':>7s} {'-':>7s} {'-':>13s} {'-':>4s} {'-':>6s}"
        ratio = f"{r['ratio']:.3f}" if "ratio" in r else _mbit(r["goodput_bps"])
        kernel = f"{r['received_ratio']:.3f}" if "received_ratio" in r else ""
        share = "" if r["retrans_share"] is None else f" ({r['retrans_share'] * 100:.1f}%)"
        drops = r["counted"].get("drop_limit")
        retrans = f"{r['retrans']:.0f}{share}"
        dropped = "" if drops is None else f"{drops:.0f}"
        return f"{ratio:>7s} {kernel:>7s} {retrans:>13s} {r['timeouts']:>4.0f} {dropped:>6s}"

    for lim_, flows in keys:
        sh = rows[("egress-shaped", lim_, flows)]
        c = sh["counted"]
        fq = f"{c.get('fq_drops', 0):.0f} / {c.get('fq_flows_plimit', 0):.0f}"
        lines.append(
            f"  {lim_:>5s} {flows:>5d} | {cells(rows.get(('egress', lim_, flows)))} | "
            f"{cells(sh)} {fq:>9s}  {sh['mode'] or ''}"
        )
    lines.append("  (the limit none: Mbit/s in the goodput's place)")
    return lines


def notes(lim: dict[str, Any]) -> list[str]:
    """What the numbers of this run cannot show, from the run itself."""
    out = []
    busy = lim["load"]["cpu_busy_before"]
    if busy > 0.25:
        out.append(
            f"note: the CPUs were {busy * 100:.0f}% busy before the part: other jobs shared them "
            "(see each row's others)"
        )
    g = lim["isolation"].get("cz-guard", {}).get("ingress", {}).get("full", {}).get("flood", {})
    if g and not g.get("drop_limit_pps") and g.get("sent_pps") is not None:
        out.append(
            f"note: the flood the node forwards reaches {g['sent_pps'] / 1e6:.2f} Mpps here, below "
            "the default guard's 1M: the guard did not cut it (cz-guard-lab shows a cut flood)"
        )
    return out


def targets(lim: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """The part's targets on each node it measured (the single node's named "limits: ...",
    the others' "limits, <node>: ..."), appended to `rows` in report.Targets' format."""
    for node, fig in _nodes(lim):
        _node_targets(fig, rows, "limits" if node == "single" else f"limits, {NODE_NAMES[node]}")


def _node_targets(lim: dict[str, Any], rows: list[dict[str, Any]], prefix: str) -> None:
    """One node's targets, named `prefix`: ...: with the first
    congestion control, goodput within BAND of each limit, ingress and egress (n/a where the
    path cannot carry REACHABLE x the limit); vm-b keeping KEEP_GOAL of its rate while vm-a is
    flooded, the guard on and vm-a's own rate (the others beside them)."""
    lo, hi = BAND
    acc = lim["accuracy"]["rows"]
    cc0 = lim["settings"]["ccs"][0]
    for r in acc:
        if r["limit"] == "none" or r["cc"] != cc0 or r["direction"] == "egress-nogso":
            continue
        name = (
            f"{prefix}: {r['direction']} {r['limit']}, {r['flows']} flow(s), {cc0}: TCP goodput / "
            f"limit within {lo}-{hi}"
        )
        kernel = r.get("received_ratio")
        detail = (
            f"{_mbit(r['goodput_bps'])} Mbit/s, wire/limit {r['wire_ratio']:.3f}, "
            + ("" if kernel is None else f"the receivers' kernel {kernel:.3f}, ")
            + f"{r['retrans']:.0f} retransmitted and {r['timeouts']:.0f} RTOs in the window"
        )
        shaped = r["direction"] == "egress-shaped"
        if shaped:
            c = r["counted"]
            detail += (
                f", drops: {c.get('drop_limit', 0):.0f} the agent's, {c.get('fq_drops', 0):.0f} "
                f"fq's; status said {r['mode']}"
            )
        # beside it: bbr's, and egress's other ways (policed, without GSO, shaped)
        related = {r["direction"]} | (
            {"egress", "egress-nogso", "egress-shaped"} if r["direction"] != "ingress" else set()
        )
        others = [
            o
            for o in acc
            if (o["limit"], o["flows"]) == (r["limit"], r["flows"])
            and o is not r
            and o["direction"] in related
        ]
        detail += "".join(f"; {o['cc']} {o['direction']} {o['ratio']:.3f}" for o in others)
        if shaped and r["mode"] != SHAPED:
            verdict = "n/a"
            detail = f"not shaped: status said {r['mode']} with fq on the uplink; " + detail
        elif not r["reachable"]:
            verdict = "n/a"
            detail = (
                f"not reachable here: {_mbit(r['unlimited_bps'])} Mbit/s without the limit, < "
                f"{REACHABLE}x; " + detail
            )
        else:
            verdict = "PASS" if lo <= r["ratio"] <= hi else "MISS"
        rows.append(
            {
                "target": name,
                "value": r["ratio"],
                "want": lo,
                "unit": "x",
                "verdict": verdict,
                "detail": detail,
                "higher_is_better": True,
            }
        )
    for layout, key in (("one-queue", "isolation"), ("rss", "isolation_rss")):
        if lim.get(key):  # (none with --limits-accuracy-only)
            _iso_targets(lim[key], layout, rows, prefix)


def _iso_targets(iso: dict[str, Any], layout: str, rows: list[dict[str, Any]], prefix: str) -> None:
    """The isolation targets of one layout of the uplink pair (LAYOUTS)."""

    def kept(c: str, direction: str, mode: str) -> float | None:
        v = iso.get(c, {}).get(direction, {}).get(mode, {}).get("kept")
        return v if isinstance(v, float | int) else None

    for c in ("cz-guard", "cz-guard-lab"):
        for direction in ("ingress", "egress"):
            value = kept(c, direction, "full")
            beside = "; ".join(
                f"{o} "
                + " / ".join(f"{kept(o, direction, m) or 0:.2f}x" for m in ("full", "fixed"))
                for o in CONFIGS
            )
            rows.append(
                {
                    "target": f"{prefix}: vm-b's {direction} rate kept while vm-a is flooded "
                    f"at the generator's full rate, {CONFIG_LABELS[c]}, {layout}",
                    "value": value,
                    "want": KEEP_GOAL,
                    "unit": "x",
                    "verdict": "n/a" if value is None else "PASS" if value >= KEEP_GOAL else "MISS",
                    "detail": f"kept under the full / a fixed {FIXED_FLOOD / 1e6:.2f} Mpps flood: "
                    + beside,
                    "higher_is_better": True,
                }
            )
