"""`cozyebpf run`'s options as one value, between the command line (flags and COZYEBPF_RUN_*
variables, parsed by click in cli.py) and what `run` builds from them: the source, the datapath
and the agent."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cozyebpf.datapath.bpf import BpfDatapath


@dataclass(frozen=True)
class RunConfig:
    """Every option of `cozyebpf run`, named as its parameter (tests/unit/test_cli.py holds the two
    to each other; the defaults and help are the options')."""

    manifests: str | None
    devices: str  # names, or "auto"
    pod_devices: str  # names and patterns, "auto" or "none"
    pin_dir: str
    proxy_name: str
    xdp_mode: str
    tc_mode: str
    poll_interval: float
    resync_interval: float
    log_level: str
    ingress_hook: str
    on_foreign_xdp: str
    check_interval: float
    remove_cozy_proxy_table: bool
    kubeconfig: str | None
    node_name: str
    max_services: int
    health_address: str
    metrics_address: str
    counted_services: int | None
    flow_timeout_udp: float
    flow_timeout_icmp: float
    flow_timeout_tcp: float
    flow_timeout_tcp_closing: float
    host_routing: str  # "on" or "off"

    def datapath(self, devices: Sequence[str], pod_devices: Sequence[str]) -> BpfDatapath:
        """The datapath on `devices` and `pod_devices` (as resolved from `devices` and
        `pod_devices`), not started."""
        from cozyebpf.datapath.bpf import BpfDatapath

        return BpfDatapath(
            devices,
            pin_dir=self.pin_dir,
            xdp_mode=self.xdp_mode,
            tc_mode=self.tc_mode,
            ingress_hook=self.ingress_hook,
            on_foreign_xdp=self.on_foreign_xdp,
            max_services=self.max_services,
            service_slots=self.counted_services,
            flow_timeouts={
                "udp": self.flow_timeout_udp,
                "icmp": self.flow_timeout_icmp,
                "tcp": self.flow_timeout_tcp,
                "tcp_closing": self.flow_timeout_tcp_closing,
            },
            pod_devices=pod_devices,
            host_routing=self.host_routing == "on",
        )
