"""The real-OVN lab's names and constants, and what it writes as Kube-OVN's daemon writes it
(the iptables rules, the RARP frame)."""

from __future__ import annotations

import shutil
import socket
import struct
from pathlib import Path

from cozylab.cluster.spec import (
    JOIN_CIDR,
    NODES,
    POD_CIDR,
    Workload,
    node_ip,
    node_name,
)

LAYOUT = "real-ovn"
ROUTER = "ovn-cluster"  # util.DefaultVpc
JOIN, DEFAULT_SUBNET = "join", "ovn-default"
#: util.SubnetRouterPolicyPriority, NodeRouterPolicyPriority, GatewayRouterPolicyPriority
PRIO_SUBNET, PRIO_NODE, PRIO_GATEWAY = 31000, 30000, 29000
BINARIES = (
    *("ovsdb-tool", "ovsdb-server", "ovs-vswitchd", "ovs-vsctl", "ovn-northd", "ovn-controller"),
    *("ovn-nbctl", "ovn-sbctl", "ipset", "iptables-restore", "ethtool"),
)
OVS_SCHEMA = Path("/usr/share/openvswitch/vswitch.ovsschema")
OVN_SCHEMAS = {db: Path(f"/usr/share/ovn/ovn-{db}.ovsschema") for db in ("nb", "sb")}
UPLINK, UNDERLAY = "eth0", "phy0"  # the node's OVS bridge (its own port: a tap) and the veth
ETH_P_RARP = 0x8035
#: (attacker, victim) of OVN's port-security rows: a VM and a pod with port security, vm-f
#: without (its frames must arrive: the probe sees what is delivered)
PORT_SECURITY_SPOOFS = (("vm-e", "vm-a"), ("p3", "vm-a"), ("vm-f", "vm-b"))
PORT_SECURITY_KINDS = ("spoofed source MAC", "ARP reply for another IP")
SPOOFING, REAL_DATAPLANE = "10 spoofing", "13 real dataplane"
#: a whole-IP VM and the node (not its own) that announces its LB IP for that row
ACROSS_CHASSIS = ("vm-b", 1)
NAT_OUTGOING = ("p1", "p3")  # plain pods whose traffic to outside Kube-OVN masquerades
MTU_PAIR = ("p1", "p3")  # a full pod-MTU packet between them, across chassis
#: when a migrating VM's port moves to the target node's port group (so its traffic to outside
#: leaves by the target's ovn0): when the target pod is routed, as pod.go
#: reconcileRouteSubnets reads ("both-ready"), or at the switch-over ("switch")
PORT_GROUP_MOVES = ("both-ready", "switch")


def missing_prerequisites() -> list[str]:
    """What this lab needs and the machine lacks (scripts/setup.sh installs all of it)."""
    out = [b for b in BINARIES if shutil.which(b) is None]
    out += [str(p) for p in (OVS_SCHEMA, *OVN_SCHEMAS.values()) if not p.exists()]
    if not Path("/dev/net/tun").exists():
        out.append("/dev/net/tun (OVS's userspace datapath makes its ports as taps)")
    return out


def port_name(w: Workload) -> str:
    """pkg/ovs/util.go PodNameToPortName: <pod>.<namespace>; a KubeVirt pod's port is named
    after its VM (pod.go getNameByPod, --keep-vm-ip), so both pods of a migration share it."""
    return f"{w.name}.default"


def port_group(n: int) -> str:
    """subnet.go getOverlaySubnetsPortGroupName: <subnet>.<node>, every '-' made '.'."""
    return f"{DEFAULT_SUBNET}.{node_name(n)}".replace("-", ".")


def rarp_frame(mac: str) -> bytes:
    """The RARP QEMU broadcasts after a switch-over (op 3, "reverse request")."""
    m = bytes.fromhex(mac.replace(":", ""))
    zero = socket.inet_aton("0.0.0.0")
    return (
        b"\xff" * 6
        + m
        + struct.pack("!H", ETH_P_RARP)
        + struct.pack("!HHBBH", 1, 0x0800, 6, 4, 3)
        + m
        + zero
        + m
        + zero
    )


def iptables_rules(n: int) -> tuple[str, str]:
    """gateway_linux.go setIPSet + setIptables (v4) for node n: (ipset restore input,
    iptables-restore input). The same rules as the model's nft `kubeovn_ruleset`, written
    as Kube-OVN writes them."""
    others = [node_ip(m) for m in NODES if m != n]
    sets = {
        "ovn40subnets": [POD_CIDR, JOIN_CIDR],
        "ovn40subnets-nat": [POD_CIDR],
        "ovn40subnets-distributed-gw": [POD_CIDR, JOIN_CIDR],
        "ovn40other-node": others,
        "ovn40services": [],
        "ovn40local-pod-ip-nat": [],
        "ovn40subnets-nat-policy": [],
    }
    ipset = "".join(
        f"create {name} hash:net\n" + "".join(f"add {name} {e}\n" for e in elems)
        for name, elems in sets.items()
    )

    def inset(name: str, d: str, neg: bool = False) -> str:
        return f"-m set {'! ' if neg else ''}--match-set {name} {d}"

    nat = [
        "*nat",
        ":OVN-PREROUTING - [0:0]",
        ":OVN-POSTROUTING - [0:0]",
        ":OVN-MASQUERADE - [0:0]",
        ":OVN-NAT-POLICY - [0:0]",
        '-A PREROUTING -m comment --comment "kube-ovn prerouting rules" -j OVN-PREROUTING',
        '-A POSTROUTING -m comment --comment "kube-ovn postrouting rules" -j OVN-POSTROUTING',
        f"-A OVN-PREROUTING -i ovn0 {inset('ovn40subnets', 'src')} "
        f"{inset('ovn40services', 'dst')} -j MARK --set-xmark 0x4000/0x4000",
        f"-A OVN-POSTROUTING {inset('ovn40services', 'src')} {inset('ovn40subnets', 'dst')} "
        f"-m mark --mark 0x4000/0x4000 -j SNAT --to-source {node_ip(n)} --random-fully",
        "-A OVN-POSTROUTING -m mark --mark 0x4000/0x4000 -j OVN-MASQUERADE",
        f"-A OVN-POSTROUTING {inset('ovn40subnets', 'src')} {inset('ovn40subnets', 'dst')} "
        "-j OVN-MASQUERADE",
        f"-A OVN-POSTROUTING -m mark --mark 0x80000/0x80000 "
        f"{inset('ovn40subnets-distributed-gw', 'dst')} -j RETURN",
        "-A OVN-POSTROUTING -m mark --mark 0x80000/0x80000 -j OVN-MASQUERADE",
        "-A OVN-POSTROUTING -p tcp -m tcp --tcp-flags SYN NONE -m conntrack --ctstate NEW "
        "-j RETURN",
        f"-A OVN-POSTROUTING {inset('ovn40subnets', 'src', True)} "
        f"{inset('ovn40other-node', 'src', True)} {inset('ovn40subnets-nat', 'dst')} -j RETURN",
        f"-A OVN-POSTROUTING {inset('ovn40subnets-nat-policy', 'src')} "
        f"{inset('ovn40subnets', 'dst', True)} -j OVN-NAT-POLICY",
        "-A OVN-POSTROUTING -m mark --mark 0x90001/0x90001 -j OVN-MASQUERADE",
        "-A OVN-POSTROUTING -m mark --mark 0x90002/0x90002 -j RETURN",
        f"-A OVN-POSTROUTING {inset('ovn40subnets-nat', 'src')} "
        f"{inset('ovn40subnets', 'dst', True)} -j OVN-MASQUERADE",
        "-A OVN-MASQUERADE -j MARK --set-xmark 0x0/0xffffffff",
        "-A OVN-MASQUERADE -j MASQUERADE --random-fully",
        "COMMIT",
        "*mangle",
        ":OVN-POSTROUTING - [0:0]",
        '-A POSTROUTING -m comment --comment "kube-ovn postrouting rules" -j OVN-POSTROUTING',
        f"-A OVN-POSTROUTING -p tcp {inset('ovn40subnets', 'src')} -m tcp --tcp-flags RST RST "
        "-m conntrack --ctstate INVALID -j DROP",
        "COMMIT",
    ]
    return ipset, "\n".join(nat) + "\n"
