"""What the deployment and the agent agree on, checked from both sides: the capabilities the
DaemonSet adds (tests/datapath/test_capabilities.py proves them sufficient,
tests/unit/test_chart.py that the chart adds exactly them) and the metrics the agent serves
(tests/datapath/test_observability.py scrapes them, tests/unit/test_deploy_monitoring.py holds
the dashboard to them)."""

from __future__ import annotations

#: what deploy/daemonset.yaml adds (keep the two in step)
MINIMAL = ("CAP_SYS_ADMIN", "CAP_NET_ADMIN")

#: every metric family of the contract, with its labels (histograms: their _bucket series)
CONTRACT: dict[str, set[str]] = {
    "cozyebpf_service_packets_total": {"namespace", "service", "direction"},
    "cozyebpf_service_bytes_total": {"namespace", "service", "direction"},
    "cozyebpf_service_drops_total": {"namespace", "service", "reason"},
    "cozyebpf_datapath_packets_total": {"reason"},
    "cozyebpf_datapath_bytes_total": {"reason"},
    "cozyebpf_map_entries": {"map"},
    "cozyebpf_map_capacity": {"map"},
    "cozyebpf_sync_duration_seconds_bucket": {"kind", "le"},
    "cozyebpf_network_programming_duration_seconds_bucket": {"le"},
    "cozyebpf_sync_errors_total": set(),
    "cozyebpf_last_sync_timestamp_seconds": set(),
    "cozyebpf_services": {"mode"},
    "cozyebpf_problems": {"severity"},
    "cozyebpf_services_refused": {"reason"},
    "cozyebpf_build_info": {"version", "layout"},
    "cozyebpf_agent_memory_bytes": set(),
    "cozyebpf_agent_memory_limit_bytes": set(),
    "cozyebpf_monitor_events_lost_total": set(),
    "cozyebpf_metrics_connections_refused_total": {"reason"},
    "cozyebpf_metrics_connections_cut_total": {"reason"},
    "cozyebpf_metrics_token_reviews_total": set(),
    "cozyebpf_metrics_token_reviews_limited_total": set(),
}
