"""deploy/monitoring: the PodMonitor scrapes the DaemonSet's metrics port by its name, and the
Grafana dashboard asks only for metrics and labels the agent serves (issue 11's contract)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from tests.support.contract import CONTRACT

ADDED = {"node"}  # by the PodMonitor's relabeling


def _daemonset(repo_root: Path) -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all((repo_root / "deploy/daemonset.yaml").read_text()) if d]
    (ds,) = docs
    return ds  # type: ignore[no-any-return]


def test_the_podmonitor_scrapes_the_daemonsets_metrics_port(repo_root: Path) -> None:
    ds = _daemonset(repo_root)
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["COZYEBPF_RUN_METRICS_ADDRESS"] == f"$(NODE_IP):{ports['metrics']}"
    docs = yaml.safe_load_all((repo_root / "deploy/monitoring/podmonitor.yaml").read_text())
    (pm,) = [d for d in docs if d and d["kind"] == "PodMonitor"]
    assert pm["metadata"]["namespace"] == ds["metadata"]["namespace"]
    assert (
        pm["spec"]["selector"]["matchLabels"].items()
        <= ds["spec"]["selector"]["matchLabels"].items()
    )
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    # the agent serves HTTPS to allowed tokens by default, and the PodMonitor scrapes so
    assert env["COZYEBPF_RUN_METRICS_AUTH"] == "kubernetes" and endpoint["scheme"] == "https"


def _exprs(node: Any) -> list[str]:
    if isinstance(node, dict):
        out = [node["expr"]] if isinstance(node.get("expr"), str) else []
        q = node.get("query")
        if isinstance(q, dict) and isinstance(q.get("query"), str):
            out.append(q["query"])
        return out + [e for v in node.values() for e in _exprs(v)]
    if isinstance(node, list):
        return [e for v in node for e in _exprs(v)]
    return []


def test_the_dashboard_uses_only_the_contract(repo_root: Path) -> None:
    dash = json.loads((repo_root / "deploy/monitoring/grafana-dashboard.json").read_text())
    exprs = _exprs(dash)
    assert len(exprs) >= 15
    used: set[str] = set()
    for e in exprs:
        for name in re.findall(r"\bcozyebpf_[a-z_]+", e):
            assert name in CONTRACT, f"{name} (in {e}) is not a metric the agent serves"
            used.add(name)
        # label matchers and groupings name labels the metric has
        for name, labels in re.findall(r"(cozyebpf_[a-z_]+)\{([^}]*)\}", e):
            for label in re.findall(r"(\w+)\s*[=!]~?", labels):
                assert label in CONTRACT[name] | ADDED, f"{label} of {name} in {e}"
    assert used >= {
        "cozyebpf_service_packets_total",
        "cozyebpf_service_bytes_total",
        "cozyebpf_service_drops_total",
        "cozyebpf_datapath_packets_total",
        "cozyebpf_map_entries",
        "cozyebpf_sync_duration_seconds_bucket",
        "cozyebpf_network_programming_duration_seconds_bucket",
    }
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
