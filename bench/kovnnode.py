"""The limits part's Kube-OVN-shaped node (bench/limits.py, node "kubeovn"): the single node's
client and uplink, but the pods behind one device, `ovn0`, as Kube-OVN lays a node out (the
rows kubeovn-* of bench/kubeovn.py have the same node, there with one pod side for generated
frames; here real pods, for TCP):

    client ns                node ns                                 ovs ns (OVN's router)
    eth0 198.51.100.2/24 === uplink 198.51.100.1/24
                             ovn0 10.245.0.2/16, MTU 1400 ========== ovn0-p 10.245.0.1/16
                             10.244.0.0/16 via 10.245.0.1 dev ovn0     <pod>_h 10.244.0.1/32 ===
                             natOutgoing (nft masquerade)               pod ns: eth0 10.244.1.N0,
                                                                        MTU 1400, default via
                                                                        10.244.0.1

What it keeps of Kube-OVN's node: the agent's pod-facing hook on ovn0 (the one device every
pod's packets come in by, at the join network's gateway's MAC), the routes through it, MTU 1400
(a geneve overlay's, pkg/daemon/config.go) on ovn0 and the pods, natOutgoing's masquerade in
nat POSTROUTING (conntrack on for every packet). What it leaves out: OVS itself (the ovs
namespace forwards with the kernel's IPv4 router where OVS's kernel datapath would switch and
route by its flows: a cost both contenders pay alike), the tunnel to other nodes, and IPv6.
bench/kubeovn.py and cozylab/realovn/ (the real OVS and OVN, userspace datapath) say more.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.kubeovn import JOIN_GW, JOIN_NODE, NATOUT, OVN0_MAC, OVS_MAC
from cozylab.netns import (
    CLIENT_IP,
    CLIENT_MAC,
    NODE_POD_GW,
    NODE_UPLINK_IP,
    UPLINK,
    UPLINK_MAC,
    Lab,
    Pod,
)

OVN0 = "ovn0"
MTU = 1400  # Kube-OVN's with geneve under a 1500-byte uplink


@dataclass
class KubeOvnNodeLab(Lab):
    """cozylab.netns.Lab's client and uplink, the pods behind ovn0 (IPv4 only)."""

    @property
    def ovs(self) -> str:
        return f"{self.prefix}-ovs"

    @property
    def all_namespaces(self) -> list[str]:
        return [self.client, self.node, self.ovs, *(self.pod_ns(p) for p in self.pods)]

    @staticmethod
    def pod_side(pod: Pod) -> str:
        """The pod's veth in the ovs namespace (Kube-OVN names its host end <id>_h)."""
        return f"{pod.name}_h"

    def up(self) -> KubeOvnNodeLab:
        self.down()
        for ns in self.all_namespaces:
            self.add_namespace(ns)
        c, n, o = self.client, self.node, self.ovs
        for ns in (n, o):
            self.sysctl(ns, "net.ipv4.ip_forward", "1")
        self.veth(n, UPLINK, UPLINK_MAC, c, "eth0", CLIENT_MAC)
        self.ip(c, "addr", "add", f"{CLIENT_IP}/24", "dev", "eth0")
        self.ip(c, "link", "set", "eth0", "up")
        self.ip(c, "route", "add", "default", "via", NODE_UPLINK_IP)
        self.neigh(c, NODE_UPLINK_IP, UPLINK_MAC, "eth0")
        self.ip(n, "addr", "add", f"{NODE_UPLINK_IP}/24", "dev", UPLINK)
        self.ip(n, "link", "set", UPLINK, "up")
        self.neigh(n, CLIENT_IP, CLIENT_MAC, UPLINK)
        self.veth(n, OVN0, OVN0_MAC, o, "ovn0-p", OVS_MAC)
        for ns, dev, addr in ((n, OVN0, JOIN_NODE), (o, "ovn0-p", JOIN_GW)):
            self.ip(ns, "link", "set", dev, "mtu", str(MTU))
            self.ip(ns, "addr", "add", f"{addr}/16", "dev", dev)
            self.ip(ns, "link", "set", dev, "up")
        self.ip(n, "route", "add", "10.244.0.0/16", "via", JOIN_GW, "dev", OVN0)
        self.neigh(n, JOIN_GW, OVS_MAC, OVN0)
        self.ip(o, "route", "add", "default", "via", JOIN_NODE, "dev", "ovn0-p")
        self.neigh(o, JOIN_NODE, OVN0_MAC, "ovn0-p")
        self.exec(n, "nft", "-f", "-", input=NATOUT)
        for p in self.pods:
            pns, side = self.pod_ns(p), self.pod_side(p)
            self.veth(o, side, p.host_mac, pns, "eth0", p.mac)
            for ns, dev in ((o, side), (pns, "eth0")):
                self.ip(ns, "link", "set", dev, "mtu", str(MTU))
                self.ip(ns, "link", "set", dev, "up")
            self.ip(o, "addr", "add", f"{NODE_POD_GW}/32", "dev", side)
            self.ip(o, "route", "add", f"{p.ip}/32", "dev", side)
            self.neigh(o, p.ip, p.mac, side)
            self.ip(pns, "addr", "add", f"{p.ip}/32", "dev", "eth0")
            self.ip(pns, "route", "add", NODE_POD_GW, "dev", "eth0")
            self.ip(pns, "route", "add", "default", "via", NODE_POD_GW)
            self.neigh(pns, NODE_POD_GW, p.host_mac, "eth0")
        return self
