"""`cozyebpf run`'s options as one value, between the command line (flags and COZYEBPF_RUN_*
variables, parsed by click in cli.py) and what `run` builds from them: the source, the datapath
and the agent."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from ipaddress import ip_network
from typing import TYPE_CHECKING

from cozyebpf.errors import PermanentError
from cozyebpf.model.limits import LimitError, parse_packet_rate
from cozyebpf.state import IPNetwork

if TYPE_CHECKING:
    from cozyebpf.datapath.bpf import BpfDatapath


#: --guard-packet-rate's default: 1,000,000 packets per second into each Service's LB IPs
#: (docs/behaviour.md, Limits per public IP: above what one VM's virtio queue pair forwards,
#: so that the guard never cuts a VM's own traffic; a 10 Gbit/s flood of small packets,
#: 14.88 million a second, loses 93 % of it at XDP)
DEFAULT_GUARD = "1M"


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
    reserved_cidrs: str  # comma-separated CIDRs, or ""
    reserved_exclude_devices: str  # comma-separated device names, or ""
    cluster_role: str
    trusted_endpoints: str  # "controller" or "any"
    watch_timeout: int  # seconds
    metrics_auth: str  # "auto", "kubernetes" or "none"
    metrics_cert_dir: str
    host_routing: str  # "auto" (on with pod-facing devices), "on" or "off"
    guard_packet_rate: str  # a quantity ("1M"), "0": no guard
    max_packet_rate: str  # a quantity, "": the guard's, "0": no ceiling

    def reserved_networks(self) -> tuple[IPNetwork, ...]:
        """--reserved-cidrs as networks; PermanentError naming a bad item."""
        out: list[IPNetwork] = []
        for item in _items(self.reserved_cidrs):
            try:
                out.append(ip_network(item, strict=False))
            except ValueError:
                raise PermanentError(
                    f"--reserved-cidrs: {item!r} is not a CIDR (e.g. 10.96.0.0/12 or "
                    "fd00:10:96::/112); fix the option (or the chart's reservedCIDRs)"
                ) from None
        return tuple(out)

    def guard_pps(self) -> int | None:
        """--guard-packet-rate in packets per second (None: no guard); PermanentError naming a
        bad value and the fix."""
        text = self.guard_packet_rate.strip()
        if text in ("0", ""):
            return None
        try:
            return parse_packet_rate("--guard-packet-rate", text)
        except LimitError as e:
            raise PermanentError(
                f"{str(e).removeprefix('annotation ')}; or 0 for no guard (the chart's "
                "agent.guardPacketRate)"
            ) from None

    def max_pps(self) -> int | None:
        """--max-packet-rate in packets per second: the ceiling of a Service's own
        ingressPacketRate (None: no ceiling); by default the guard's. PermanentError naming a
        bad value, or a guard above the ceiling (the guard would let in more than any Service
        may ask for), and the fix."""
        guard = self.guard_pps()
        text = self.max_packet_rate.strip()
        if text == "":
            return guard
        if text == "0":
            return None
        try:
            ceiling = parse_packet_rate("--max-packet-rate", text)
        except LimitError as e:
            raise PermanentError(
                f"{str(e).removeprefix('annotation ')}; or 0 for no ceiling, or leave it unset "
                "for the guard's rate (the chart's agent.maxPacketRate)"
            ) from None
        if guard is not None and guard > ceiling:
            raise PermanentError(
                f"--guard-packet-rate {guard:,} is above --max-packet-rate {ceiling:,}: the "
                "node's guard would let in more packets than any Service may ask for; lower the "
                "guard or raise the ceiling (the chart's agent.guardPacketRate and "
                "agent.maxPacketRate)"
            )
        return ceiling

    def exclude_devices(self) -> tuple[str, ...]:
        """--reserved-exclude-devices as names."""
        return tuple(_items(self.reserved_exclude_devices))

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
            host_routing=self.host_routing == "on"
            or (self.host_routing == "auto" and bool(pod_devices)),
            guard_pps=self.guard_pps(),
        )


def _items(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]
