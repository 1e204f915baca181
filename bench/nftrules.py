"""cozy-proxy's nftables ruleset as it ships (its README, "Datapath"; pkg/proxy/nft.go): the
lab's stateless subset (cozylab.netns.cozy_proxy_ruleset: maps svc_pod/pod_svc, chains
egress_snat at raw and ingress_dnat at mangle) plus the port filter: sets filtered_pods,
allowed_ports (concat ipv4_addr . inet_proto . inet_service) and icmp_allowed_pods, and chain
port_filter at priority filter with `ct state established,related accept` first.

`conntrack=False` leaves out the ct rule, so nothing in the namespace enables conntrack (the
"without conntrack" variant; replies to flows the pod opened are then dropped like any other
unlisted port)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cozylab.netns import cozy_proxy_ruleset


def _elements(items: Sequence[str]) -> str:
    return f"elements = {{ {', '.join(items)} }}" if items else ""


def full_ruleset(
    mappings: Sequence[tuple[str, str]],
    allowed: Iterable[tuple[str, str, int]] = (),
    filtered: Iterable[str] = (),
    icmp_pods: Iterable[str] = (),
    conntrack: bool = True,
) -> str:
    """`mappings`: (LB IP, pod IP); `allowed`: (pod IP, "tcp"|"udp"|"sctp", port);
    `filtered`: pod IPs in port-filter mode; `icmp_pods`: those with allowICMP."""
    allowed_el = [f"{ip} . {proto} . {port}" for ip, proto, port in allowed]
    filt = _elements(list(filtered))
    icmp = _elements(list(icmp_pods))
    ct = "        ct state established,related accept\n" if conntrack else ""
    return (
        cozy_proxy_ruleset(mappings)
        + f"""
table ip cozy_proxy {{
    set filtered_pods {{ type ipv4_addr; {filt} }}
    set icmp_allowed_pods {{ type ipv4_addr; {icmp} }}
    set allowed_ports {{ type ipv4_addr . inet_proto . inet_service; {_elements(allowed_el)} }}
    chain port_filter {{
        type filter hook prerouting priority filter; policy accept;
{ct}        ip daddr @icmp_allowed_pods meta l4proto icmp accept
        ip daddr @filtered_pods ip daddr . meta l4proto . th dport != @allowed_ports drop
    }}
}}
"""
    )
