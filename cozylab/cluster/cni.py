"""The CNI's rules as the lab writes them: Kube-OVN's nftables on each node (kubeovn) and OVN's
port security in each OVS namespace."""

from __future__ import annotations

from collections.abc import Iterable

from cozylab.cluster.spec import JOIN_CIDR, NODES, POD_CIDR, Workload, node_ip


def kubeovn_ruleset(n: int) -> str:
    """Kube-OVN's v4 rules of setIptables (pkg/daemon/gateway_linux.go), in nft, for node n.
    Filter INPUT/FORWARD accepts are left out: the lab's policies accept everything anyway."""
    others = ", ".join(node_ip(m) for m in NODES if m != n)
    return f"""
table ip kube-ovn {{
    set ovn40subnets {{ type ipv4_addr; flags interval; elements = {{ {POD_CIDR}, {JOIN_CIDR} }} }}
    set ovn40subnets-nat {{ type ipv4_addr; flags interval; elements = {{ {POD_CIDR} }} }}
    set ovn40subnets-distributed-gw {{ type ipv4_addr; flags interval;
        elements = {{ {POD_CIDR}, {JOIN_CIDR} }} }}
    set ovn40other-node {{ type ipv4_addr; flags interval; elements = {{ {others} }} }}
    set ovn40services {{ type ipv4_addr; flags interval; }}
    set ovn40subnets-nat-policy {{ type ipv4_addr; flags interval; }}

    chain PREROUTING {{ type nat hook prerouting priority dstnat; policy accept;
        jump OVN-PREROUTING
    }}
    chain OVN-PREROUTING {{
        iifname "ovn0" ip saddr @ovn40subnets ip daddr @ovn40services meta mark set mark or 0x4000
    }}
    chain POSTROUTING {{ type nat hook postrouting priority srcnat; policy accept;
        jump OVN-POSTROUTING
    }}
    chain OVN-POSTROUTING {{
        ip saddr @ovn40services ip daddr @ovn40subnets meta mark & 0x4000 == 0x4000 \
            snat to {node_ip(n)} fully-random
        meta mark & 0x4000 == 0x4000 jump OVN-MASQUERADE
        ip saddr @ovn40subnets ip daddr @ovn40subnets jump OVN-MASQUERADE
        meta mark & 0x80000 == 0x80000 ip daddr @ovn40subnets-distributed-gw return
        meta mark & 0x80000 == 0x80000 jump OVN-MASQUERADE
        tcp flags & syn == 0 ct state new return
        ip saddr != @ovn40subnets ip saddr != @ovn40other-node ip daddr @ovn40subnets-nat return
        ip saddr @ovn40subnets-nat-policy ip daddr != @ovn40subnets jump OVN-NAT-POLICY
        meta mark & 0x90001 == 0x90001 jump OVN-MASQUERADE
        meta mark & 0x90002 == 0x90002 return
        ip saddr @ovn40subnets-nat ip daddr != @ovn40subnets jump OVN-MASQUERADE
    }}
    chain OVN-NAT-POLICY {{
    }}
    chain OVN-MASQUERADE {{
        meta mark set 0x0
        masquerade fully-random
    }}
    chain MANGLE-POSTROUTING {{ type filter hook postrouting priority mangle; policy accept;
        jump OVN-POSTROUTING-MANGLE
    }}
    chain OVN-POSTROUTING-MANGLE {{
        ip saddr @ovn40subnets tcp flags & rst == rst ct state invalid drop
    }}
}}
"""


def port_security_ruleset(workloads: Iterable[Workload]) -> str:
    """OVN's port security as the lab's OVS namespace has it (kubeovn): what a pod with the
    annotation sends from another address than its own is dropped at its port (by name, so the
    rule holds on every node the pod may migrate to)."""
    rules = "".join(
        f'    iifname "{w.ovs_dev}" ip saddr != {w.ip} drop\n' for w in workloads if w.port_security
    )
    return (
        "table ip port_security {\n  chain prerouting {\n"
        "    type filter hook prerouting priority raw - 10; policy accept;\n"
        f"{rules}  }}\n}}\n"
    )
