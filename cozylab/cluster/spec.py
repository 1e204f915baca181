"""What the cluster lab is made of: its addresses, MACs and names, and its workloads (the VMs,
with a LoadBalancer Service each, and the plain pods). Every address is a documentation range
or a private range used only inside the lab's namespaces (the package's docstring)."""

from __future__ import annotations

from dataclasses import dataclass

LAYOUTS = ("kubeovn", "perpod")
NODES = (1, 2, 3)

ROUTER_IP = "192.0.2.254"
ROUTER_MAC = "02:00:c0:00:02:fe"
CLIENT_IP, CLIENT_GW = "198.51.100.2", "198.51.100.1"
#: a second address of the client, outside the source ranges the migration gives vm-a
OUTSIDE_IP = "198.51.100.3"
SERVER_IP, SERVER_GW = "198.51.100.130", "198.51.100.129"
LB_POOL = "203.0.113.0/24"
POD_CIDR, POD_GW = "10.244.0.0/16", "10.244.0.1"
JOIN_CIDR, JOIN_GW = "100.64.0.0/16", "100.64.0.1"
GW_MAC = "02:00:0a:f4:00:01"  # ovn-cluster's port on ovn-default: one MAC on every node
LRP_JOIN_MAC = "02:00:64:40:00:01"  # ovn-cluster's port on the join subnet
TUNNEL = "vxlan_sys_4789"  # OVS's name for its vxlan device (Kube-OVN's tunnel type vxlan)
VNI = 1
POD_MTU = 1400  # Kube-OVN: 1500 minus its tunnel overhead
CANARY_LB = "203.0.113.250"
#: kube-apiserver's address on the nodes' segment (the control plane's namespace on the ToR)
API_IP = "192.0.2.250"
SERVER_TCP, SERVER_UDP = 8443, 5353
SERVER_PUSH = 8444  # the server sends without pause to whoever connects (a download)
#: the port the nodes listen on (the kubelet's): section 12 claims a node's address
NODE_PORT = 10250


def node_name(n: int) -> str:
    return f"node{n}"


def node_ip(n: int) -> str:
    return f"192.0.2.{n}"


def node_mac(n: int) -> str:
    return f"02:00:c0:00:02:{n:02x}"


def join_ip(n: int) -> str:  # the node's ovn0
    return f"100.64.0.{n + 1}"


def ovn0_mac(n: int) -> str:
    return f"02:00:64:40:01:{n:02x}"


def tun_ip(n: int) -> str:
    return f"100.65.0.{n}"


def tun_mac(n: int) -> str:
    return f"02:00:64:41:00:{n:02x}"


def perpod_gw(n: int) -> str:
    return f"10.244.{n}.1"


@dataclass(frozen=True)
class Workload:
    """A VM (with a LoadBalancer Service: `lb_ip`) or a plain pod (no Service)."""

    name: str
    index: int  # unique, for MACs
    node: int  # where it starts
    ip: str  # 10.244.<node>.x: in ovn-default (kubeovn) and in its node's /24 (perpod)
    lb_ip: str | None = None
    whole_ip: bool = False
    allow_icmp: bool = False
    #: its pod has `ovn.kubernetes.io/port_security: "true"` (kubeovn: its port drops what it
    #: sends from another address, as OVN's port security does; the lab's OVS nftables)
    port_security: bool = True

    @property
    def is_vm(self) -> bool:
        return self.lb_ip is not None

    @property
    def mode(self) -> str:
        return "pod" if not self.is_vm else "whole" if self.whole_ip else "filter"

    @property
    def ports(self) -> tuple[tuple[str, int], ...]:
        """spec.ports: a WholeIP Service without ports lists 65535 (Cozystack's chart)."""
        return (("TCP", 65535),) if self.whole_ip else (("TCP", 80), ("UDP", 53))

    @property
    def mac(self) -> str:
        return f"02:00:0a:f4:{self.index:02x}:02"

    @property
    def host_mac(self) -> str:  # perpod: the node's lxc-<name>
        return f"02:00:0a:f4:{self.index:02x}:01"

    @property
    def host_dev(self) -> str:
        return f"lxc-{self.name}"

    @property
    def ovs_dev(self) -> str:  # kubeovn: its port in the OVS namespace (Kube-OVN: <id>_h)
        return f"{self.name}_h"

    def label(self, node: int) -> str:
        return f"{self.name}({self.mode},n{node})"


#: One VM per Service shape and enough of them to try every pairing of modes on one node and
#: across nodes (section 3), two plain pods. Listed ports of a port-filter VM: TCP 80, UDP 53.
DEFAULT_WORKLOADS = (
    Workload("vm-a", 1, 1, "10.244.1.10", "203.0.113.10"),
    Workload("vm-b", 2, 2, "10.244.2.20", "203.0.113.20", whole_ip=True),
    Workload("vm-c", 3, 2, "10.244.2.30", "203.0.113.30", allow_icmp=True),
    Workload("vm-d", 4, 1, "10.244.1.40", "203.0.113.40"),
    Workload("vm-e", 5, 1, "10.244.1.50", "203.0.113.50", whole_ip=True),
    Workload("vm-f", 6, 2, "10.244.2.60", "203.0.113.60", whole_ip=True, port_security=False),
    Workload("p1", 7, 1, "10.244.1.70"),
    Workload("p3", 8, 3, "10.244.3.80"),
)
