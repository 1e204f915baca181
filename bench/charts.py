"""The bench's PNG chart (`report.write` makes it; `python -m bench --report` again from
a results file): forwarding per path and variant, the Kube-OVN node, the cold sync, one change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import mpps
from bench.datapath import PATHS, VARIANT_LABELS


def chart(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, 4, figsize=(23, 5.4), gridspec_kw={"width_ratios": [2.2, 1.7, 1, 1]}
    )
    dp, cp, kv = res.get("datapath"), res.get("control"), res.get("kubeovn")
    if dp:
        datapath_chart(axes[0], dp)
    if kv:
        kubeovn_chart(axes[1], kv)
    if cp:
        cold_sync_chart(axes[2], cp)
    change_chart(axes[3], cp)
    for a in axes:
        if not a.has_data():
            a.text(0.5, 0.5, "not run", ha="center", va="center", transform=a.transAxes, alpha=0.4)
    m = res["machine"]
    fig.suptitle(
        f"cozyebpf bench {res['started']} ({'quick' if res['quick'] else 'full'}): "
        f"{m['cpus']} vCPU, kernel {m['kernel']}, loadavg at start "
        f"{m['loadavg_start'].split()[0]}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def kubeovn_chart(ax: Any, kv: dict[str, Any]) -> None:
    """The Kube-OVN node (bench/kubeovn.py): Mpps per busy core of each contender on each
    row, as grouped bars."""
    from bench.kubeovn import CONTENDERS, LABELS

    colors = ("#888888", "#bbbbbb", "#d62728", "#aec7e8", "#1f77b4", "#9467bd")
    rows = list(kv["summary"])
    w = 0.8 / len(CONTENDERS)
    for j, c in enumerate(CONTENDERS):
        xs = [i + (j - len(CONTENDERS) / 2 + 0.5) * w for i in range(len(rows))]
        ys = [kv["summary"][r].get(c, {}).get("mpps", 0) for r in rows]
        ax.bar(xs, ys, w, label=LABELS[c], color=colors[j % len(colors)])
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r.removeprefix("kubeovn-") for r in rows], rotation=20, fontsize=8)
    ax.set_ylabel("Mpps per busy core")
    ax.set_title("A Kube-OVN node (60-byte UDP)", fontsize=10)
    ax.legend(fontsize=7)


def datapath_chart(ax: Any, dp: dict[str, Any]) -> None:
    """Mpps per busy core of the main variants on each path, as grouped bars."""
    colors = {  # the variants drawn, in order
        "plain": "#888888",
        "nft": "#d62728",
        "nft-noct": "#ff9896",
        "min-xdp": "#bcbd22",
        "min-snat": "#dbdb8d",
        "cz-tcx": "#aec7e8",
        "cz-xdp": "#1f77b4",
        "xdp-drop": "#2ca02c",
    }
    variants = list(colors)
    paths = list(PATHS)
    w = 0.8 / len(variants)
    for j, v in enumerate(variants):
        xs, ys = [], []
        for i, p in enumerate(paths):
            val = mpps(dp, p, v)
            if val:
                xs.append(i + (j - len(variants) / 2 + 0.5) * w)
                ys.append(val)
        ax.bar(xs, ys, w, label=VARIANT_LABELS[v], color=colors[v])
    ax.set_xticks(range(len(paths)), paths)
    ax.set_ylabel("Mpps per busy core (median), higher is better")
    ax.set_title("Datapath: generator + node + receiver on one core, 60-byte UDP")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(axis="y", alpha=0.3)


def cold_sync_chart(ax: Any, cp: dict[str, Any]) -> None:
    """Seconds to all maps programmed by the number of Services, beside one nft -f."""
    sizes = sorted({c["n"] for c in cp["cold_sync"]})
    for src, key, color, label in (
        ("manifest", "file_to_maps_s", "#9467bd", "manifest arriving at a ready agent"),
        ("api", "ready_to_maps_s", "#1f77b4", "API: datapath ready -> maps"),
        ("api", "start_to_maps_s", "#17becf", "API: process start -> maps"),
    ):
        cold: list[float | None] = [
            next(
                (c.get(key) for c in cp["cold_sync"] if c["n"] == n and c["source"] == src),
                None,
            )
            for n in sizes
        ]
        ax.plot(
            sizes,
            [max(y, 1e-3) if y is not None else None for y in cold],
            "o-",
            color=color,
            label=label,
        )
    ax.plot(
        [x["n"] for x in cp["nft"]],
        [x["nft_f_s"] for x in cp["nft"]],
        "s--",
        color="#d62728",
        label="one nft -f (cozy-proxy tables)",
    )
    ax.axhline(1.0, color="k", ls=":", lw=1, label="targets at 10k: API 1 s, manifest 2 s")
    ax.axhline(2.0, color="k", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("Services")
    ax.set_ylabel("seconds to all maps programmed")
    ax.set_title("Cold sync")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def change_chart(ax: Any, cp: dict[str, Any] | None) -> None:
    """One change's p50 and p99, idle and under churn, beside one nft add element."""
    labels, p50, p99 = [], [], []
    if cp:
        for ch in cp["changes"]:
            for key, what in (("slice_to_map", "map"), ("slice_to_forwarding", "fwd")):
                labels.append(f"{what}\n@{ch['n'] // 1000}k")
                p50.append(ch[key]["p50_ms"])
                p99.append(ch[key]["p99_ms"])
        if cp.get("churn"):
            c = cp["churn"]
            for key, what in (("probe_to_map", "map"), ("probe_to_forwarding", "fwd")):
                labels.append(f"{what}, churn\n{c['rate_per_s']:.0f}/s @{c['n'] // 1000}k")
                p50.append(c[key]["p50_ms"])
                p99.append(c[key]["p99_ms"])
        if cp["nft"]:
            labels.append("nft add\nelement")
            nft_ms = median_of([x["nft_add_element_ms"] for x in cp["nft"]])
            p50.append(nft_ms)
            p99.append(nft_ms)
    if labels:
        positions = range(len(labels))
        ax.bar([x - 0.2 for x in positions], p50, 0.4, label="p50", color="#1f77b4")
        ax.bar([x + 0.2 for x in positions], p99, 0.4, label="p99", color="#ff7f0e")
        ax.axhline(10, color="k", ls=":", lw=1, label="target p99 10 ms")
        ax.set_yscale("log")
        ax.set_xticks(list(positions), labels, fontsize=8)
        ax.set_ylabel("ms, API write -> map / -> first packet at the new pod")
        ax.set_title("One change, idle and under churn")
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)


def median_of(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else 0.0
