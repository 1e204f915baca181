"""A three-node model of a Cozystack cluster, in network namespaces, with a real `cozyebpf run`
agent per node: the lab of issue 18 (`make cluster-lab`, `python -m cozylab.cluster`,
tests/datapath/test_cluster_lab.py).

Layout "kubeovn" (the default; Kube-OVN with natOutgoing, as Cozystack runs it)::

    czc-client 198.51.100.2/25          czc-server 198.51.100.130/25
          |                                   |
    czc-tor: ext-c 198.51.100.1/25, ext-s 198.51.100.129/25, br0 192.0.2.254/24 (ports sw1-3)
             203.0.113.0/24 (the LB pool) on-link on br0: the ToR ARPs for LB IPs and hairpins
             ======================= one L2 segment (br0) ==========================
          |                          |                          |
    czc-node1 eth0 192.0.2.1    czc-node2 eth0 192.0.2.2    czc-node3 eth0 192.0.2.3
      default via 192.0.2.254     (the same per node: cozyebpf agent on eth0, MetalLB-like
      ovn0 100.64.0.2/16           speaker on eth0, nftables as Kube-OVN writes it)
      10.244.0.0/16 via 100.64.0.1 dev ovn0
          |  (veth)                  |                          |
    czc-ovs1 lrp-join 100.64.0.1  czc-ovs2 ...               czc-ovs3 ...
      vxlan_sys_4789 100.65.0.1 === vxlan (UDP 4789 over the nodes' eth0) === 100.65.0.2/.3
      <pod>_h (10.244.0.1/32, proxy ARP, one gateway MAC on every node) -- pod eth0 10.244.x.y/16

- The "OVS" namespace of a node stands for its OVS bridge and the distributed logical router:
  it routes its local pods (/32 to their veths), remote pods (/32 via the tunnel to the pod's
  node), its own node's IP via ovn0 (100.64.0.N+1), other nodes' IPs via the tunnel into that
  node's OVS and ovn0 (Kube-OVN's node policy routes), everything else via its own node's ovn0.
  Pod-to-pod traffic, and pod-to-another-node's-IP traffic, never crosses a node's IP stack.
- The tunnel is a real vxlan device (this kernel has no geneve), made in the node namespace over
  eth0's address and moved into the OVS namespace: its UDP socket stays in the node, so the
  underlay crosses the nodes' uplinks (and their netfilter), the inner packets do not.
- One subnet, ovn-default 10.244.0.0/16, across the nodes; pods' gateway 10.244.0.1; MTU 1400
  on pods and ovn0, as Kube-OVN sets it for a tunnel.
- Each node's nftables: Kube-OVN's iptables rules (pkg/daemon/gateway_linux.go, setIptables, v4)
  written rule by rule in nft, as iptables-nft would: nat OVN-PREROUTING (pod -> Service mark),
  nat OVN-POSTROUTING (Service SNAT, mark 0x4000 and 0x80000 rules, "do not nat reply packets
  in direct routing" `-p tcp --tcp-flags SYN NONE --ctstate NEW -j RETURN`, "do not nat route
  traffic", the nat-outgoing-policy jumps, the default natOutgoing
  `-m set --match-set ovn40subnets-nat src -m set ! --match-set ovn40subnets dst -j
  OVN-MASQUERADE`), OVN-MASQUERADE (clear mark, MASQUERADE --random-fully) and mangle
  OVN-POSTROUTING (drop INVALID RSTs from pods). The ipsets: ovn40subnets = ovn-default and the
  join subnet, ovn40subnets-nat = ovn-default, ovn40other-node = the other nodes' IPs,
  ovn40services and ovn40subnets-nat-policy empty (no ClusterIPs in the lab), distributed
  gateway = both subnets.

Layout "perpod" (today's lab, other CNIs): the same ToR, clients and nodes; per node the pods
sit on their own veths in the node namespace (lxc-<pod>, gateway 10.244.N.1/32 on each, /32
routes), pod CIDR 10.244.N.0/24 per node routed by the ToR to the node; no tunnel, no NAT.

Both layouts:
- Workloads: VMs (a Service each, labelled for cozyebpf, as Cozystack's vm-instance chart
  writes it: wholeIP "true"/"false", allowICMP, externalTrafficPolicy Local,
  allocateLoadBalancerNodePorts false, port 65535 for a WholeIP Service) and plain pods. Each
  runs in its own namespace with echo servers (TCP 80, 81, UDP 53).
- The API: one FakeKubeAPI (cozylab/kubeapi.py) in the namespace czc-api, listening on its
  127.0.0.1; a forwarder in each node namespace listens on the node's 127.0.0.1 at the same
  port and relays each connection to it (sockets keep the namespace they were made in, so no
  device and no packet is added to any node). EndpointSlices carry nodeName and targetRef.
- The agents: `cozyebpf run` per node inside the node namespace (nsenter --net, so bpffs pins
  stay visible), with the arguments and environment of deploy/daemonset.yaml, or of the DaemonSet
  `make image-test` renders from the chart (COZYEBPF_RUN_DEVICES=auto,
  node name, health and metrics addresses, ...), COZYEBPF_PIN_DIR=/sys/fs/bpf/<prefix>-nodeN,
  --kubeconfig for the forwarder, plus any extra arguments given. On kubeovn that is all: the
  DaemonSet's COZYEBPF_RUN_POD_DEVICES=auto finds Kube-OVN's ovn0, so the lab runs what the
  DaemonSet runs. On perpod the pod devices are set to `lxc-*`, as an operator of a CNI with
  per-pod veths sets them (the pattern follows the veths as they come and go).
- MetalLB L2: a speaker per node (an AF_PACKET socket on the node's eth0, a thread) answers ARP
  for the LB IPs its node announces and sends gratuitous ARP (request and reply, as MetalLB)
  when it starts announcing one. The announcing node is elected as MetalLB does with
  externalTrafficPolicy Local: among the nodes with a ready endpoint, the lowest
  sha256(node + "#" + ip). The ToR takes the update at once (locktime 0, arp_accept 1).
- Live migration (kubeovn): the VM's namespace, IP and MAC stay; its link moves to the target
  node's OVS (a new veth, the old one deleted), every OVS's /32 route follows it; the
  EndpointSlice goes "old ready" -> "both ready" (one address, two nodeNames) -> "new ready";
  the announcement follows the election.
- A Cilium-like observer: a tc program (bcc) appended at the tail of tcx, like Cilium, counting
  packets to and from an LB IP and (mode "drop", the default) dropping those to an LB IP as
  Cilium 1.19's wildcard entry does; on ovn0 (ingress and egress) and on the tunnel device of
  each node (kubeovn), on each node's eth0 ingress (perpod, where Cilium's bpf_host sits).

- OVN port security (kubeovn): a rule per pod port in each OVS namespace drops what a pod with
  `ovn.kubernetes.io/port_security: "true"` sends from another address (the IP part of OVN's
  port security; by port name, so it holds wherever the pod migrates). Every workload has it
  but vm-f, whose Service the agents must warn about. The API holds a Pod per virt-launcher pod
  with that annotation, which the agents read (`get`).

What the lab leaves out: OVS and OVN themselves (flows, logical switch ports, ACLs, conntrack
zones in OVS; port security's MAC and ARP parts), GENEVE, Cilium itself (only the observer
stands in for its programs), kube-proxy and ClusterIP Services, IPv6 (Cozystack patches it out
of Kube-OVN), KubeVirt's memory copy and the pod annotation
kubevirt.io/migration-target-ready-timestamp (the agent reads Pods only for port security), a
MetalLB memberlist (elections are computed by the lab from the EndpointSlices it writes), more
than one VLAN or subnet, and rp_filter (0 everywhere, as Cilium sets it on its devices).

Every address is a documentation range (192.0.2.0/24 nodes, 198.51.100.0/24 outside,
203.0.113.0/24 LB IPs) or a private range used only inside these namespaces (10.244.0.0/16
pods, 100.64.0.0/16 join subnet, 100.65.0.0/16 tunnel). Nothing is attached to the machine's
own interfaces and every namespace, pin and process is removed on every exit path.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import itertools
import json
import math
import os
import re
import select
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from ipaddress import ip_address
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import click
import yaml

from cozyebpf.explain import build_packet
from cozylab.netns import PACKET_OUTGOING, Lab, drain, run, wait_for

if TYPE_CHECKING:
    from cozylab.kubeapi import FakeKubeAPI

T = TypeVar("T")
Check = tuple[bool, str]  # PASS?, what the peers saw

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
SERVER_TCP, SERVER_UDP = 8443, 5353
SERVER_PUSH = 8444  # the server sends without pause to whoever connects (a download)
PROXY_LABEL = "service.kubernetes.io/service-proxy-name"
ETH_P_ARP = 0x0806

REPO = Path(__file__).resolve().parent.parent


def daemonset_path() -> Path:
    """The DaemonSet whose container arguments and environment the agents run with: deploy/'s
    (rendered from charts/cozyebpf), or the one `make image-test` renders from the chart for
    the image under test (COZYEBPF_TEST_DAEMONSET, read when a lab starts, not at import)."""
    return Path(os.environ.get("COZYEBPF_TEST_DAEMONSET") or REPO / "deploy" / "daemonset.yaml")


def daemonset_container() -> dict[str, Any]:
    """The agent's container of the DaemonSet (`daemonset_path`)."""
    doc = yaml.safe_load(daemonset_path().read_text())
    container: dict[str, Any] = doc["spec"]["template"]["spec"]["containers"][0]
    return container


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
#: (client, server) for section 3: same node FF, WW, FW, WF; across nodes FF, FW, WF, WW
VM_PAIRS = (
    ("vm-a", "vm-d"),
    ("vm-b", "vm-f"),
    ("vm-c", "vm-b"),
    ("vm-e", "vm-a"),
    ("vm-a", "vm-c"),
    ("vm-c", "vm-e"),
    ("vm-b", "vm-a"),
    ("vm-e", "vm-b"),
)
SHAPES = ("vm-a", "vm-b", "vm-c")  # sections 1, 2: filter, whole-IP, filter with allowICMP
POD_PAIRS = (("p1", "vm-b"), ("p3", "vm-a"), ("p1", "vm-a"))  # section 4 (the last: one node)
HAIRPIN = ("vm-a", "vm-b")
HOST_PAIRS = ((1, "vm-a"), (1, "vm-b"))  # section 6: on the VM's node, on another
#: section 7: a port-filter VM, node1 -> node3 and back. MetalLB elects the same node of the
#: two while both are ready (node1): going, the announcement moves at "new ready", after the
#: switch; coming back, at "both ready", to the target before the VM runs there
MIGRATIONS = (("vm-a", 3), ("vm-a", 1))
#: what a migration row accepts (the README quotes, *On a Cozystack cluster*: 2-4 datagrams of
#: the 100/s stream lost, a 30-50 ms gap; one TCP retransmission, a 225-230 ms pause): 10
#: datagrams (a 100 ms gap, twice the longest measured, for a loaded machine), and a pause of
#: 450 ms (one retransmission after TCP's 200 ms minimum RTO passes, a second does not: it
#: would pause 600 ms, 200 + 400)
MIGRATION_MAX_UDP_LOST = 10
MIGRATION_MAX_PAUSE = 0.45
#: section 10, (attacker, victim): another VM on the victim's node, a plain pod on another node,
#: and a VM without port security (behind ovn0 nothing stops it: the rows say what happens)
SPOOFS = (("vm-e", "vm-a"), ("p3", "vm-a"), ("vm-f", "vm-b"))
SPOOF_KINDS = ("tcp syn", "udp", "icmp echo")
#: section 12: a Service that asks for a node's address as its LB IP (issue 31), its backend,
#: and the port the nodes listen on (the kubelet's): that node's traffic to it stays the node's
CLAIMED_NODE, CLAIM_BACKEND, NODE_PORT = 2, "p1", 10250
RESTART_NODE = 2  # section 8
RESTART_STREAMS = ("vm-a", "vm-b", "vm-e")  # one or more VMs per node, node2's included


@dataclass(frozen=True)
class Row:
    scenario: str
    case: str
    layout: str
    ok: bool
    detail: str

    @property
    def result(self) -> str:
        return "PASS" if self.ok else "FAIL"


# -- Kube-OVN's nftables, Services ---------------------------------------------------------


def _sources_with(cap: socket.socket, marker: bytes, seconds: float) -> set[str]:
    """The IPv4 sources of the frames captured on `cap` within `seconds` that carry
    `marker`."""
    out: set[str] = set()
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        ready, _, _ = select.select([cap], [], [], left)
        if not ready:
            break
        frame, addr = cap.recvfrom(65535)
        if addr[2] == PACKET_OUTGOING:
            continue  # the server's own answer
        if frame[12:14] == b"\x08\x00" and marker in frame:
            out.add(socket.inet_ntoa(frame[26:30]))
    return out


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


def service_object(w: Workload, created: str = "2026-01-01T00:00:00Z") -> dict[str, Any]:
    """The Service of a VM as Cozystack's vm-instance chart writes it, with its status."""
    assert w.lb_ip is not None
    ann = {"networking.cozystack.io/wholeIP": "true" if w.whole_ip else "false"}
    if w.allow_icmp:
        ann["networking.cozystack.io/allowICMP"] = "true"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": w.name,
            "namespace": "default",
            "creationTimestamp": created,
            "labels": {PROXY_LABEL: "cozy-proxy", "apps.cozystack.io/application.name": w.name},
            "annotations": ann,
        },
        "spec": {
            "type": "LoadBalancer",
            "externalTrafficPolicy": "Local",
            "allocateLoadBalancerNodePorts": False,
            "selector": {"vm.kubevirt.io/name": w.name},
            "ports": [
                {"name": f"{p.lower()}-{n}", "protocol": p, "port": n, "targetPort": n}
                for p, n in w.ports
            ],
        },
        "status": {"loadBalancer": {"ingress": [{"ip": w.lb_ip, "ipMode": "VIP"}]}},
    }


def node_object(n: int) -> dict[str, Any]:
    """A Node with its addresses, as the kubelet reports them."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": node_name(n)},
        "status": {
            "addresses": [
                {"type": "InternalIP", "address": node_ip(n)},
                {"type": "Hostname", "address": node_name(n)},
            ]
        },
    }


def pod_object(w: Workload, name: str, node: int) -> dict[str, Any]:
    """A VM's virt-launcher pod, for the agents' port-security reads (the annotation as
    KubeVirt copies it from the VM's template; none without port security)."""
    ann = {"ovn.kubernetes.io/port_security": "true"} if w.port_security else {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "default",
            "labels": {"vm.kubevirt.io/name": w.name},
            "annotations": ann,
        },
        "spec": {"nodeName": node_name(node)},
        "status": {"podIP": w.ip},
    }


def slice_object(
    name: str, ip: str, ports: Sequence[tuple[str, int]], endpoints: Sequence[tuple[int, str]]
) -> dict[str, Any]:
    """The EndpointSlice of Service `name`: one ready endpoint per (node, pod name), all with
    the address `ip` (during a migration both virt-launcher pods are ready with one IP)."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{name}-x7k2p",
            "namespace": "default",
            "labels": {
                "kubernetes.io/service-name": name,
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
            },
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [ip],
                "conditions": {"ready": True, "serving": True, "terminating": False},
                "nodeName": node_name(n),
                "targetRef": {"kind": "Pod", "namespace": "default", "name": pod},
            }
            for n, pod in endpoints
        ],
        "ports": [{"name": f"{p.lower()}-{n}", "protocol": p, "port": n} for p, n in ports],
    }


def _tcp_ack(src: str, dst: str, sport: int, dport: int) -> bytes:
    """A TCP segment with ACK alone (it opens nothing), its checksum computed, for a raw socket
    that adds the IPv4 header."""
    hdr = struct.pack("!HHIIBBHHH", sport, dport, 1, 1, 5 << 4, 0x10, 65535, 0, 0)
    pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!BBH", 0, 6, len(hdr))
    data = pseudo + hdr
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return hdr[:16] + struct.pack("!H", ~total & 0xFFFF) + hdr[18:]


def elect(ip: str, nodes: Sequence[int]) -> int | None:
    """MetalLB L2's choice among the nodes with a ready endpoint (externalTrafficPolicy
    Local): the lowest sha256(node name + "#" + ip)."""
    if not nodes:
        return None
    return min(nodes, key=lambda n: hashlib.sha256(f"{node_name(n)}#{ip}".encode()).digest())


# -- the echo servers ----------------------------------------------------------------------


class EchoHub:
    """One thread serving every echo socket of the lab (a socket keeps the namespace it was
    made in). TCP: each read is answered with "<peer ip> <data>"; UDP likewise per datagram."""

    def __init__(self) -> None:
        self.sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._add: list[tuple[socket.socket, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self.sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._loop, name="echo-hub", daemon=True)
        self._thread.start()

    def serve(self, lab: Lab, ns: str, kind: int, port: int) -> None:
        s = lab.ns_socket(ns, socket.AF_INET, kind)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))
        if kind == socket.SOCK_STREAM:
            s.listen(64)
        self._register(s, "listen" if kind == socket.SOCK_STREAM else "udp")

    def _register(self, s: socket.socket, what: str) -> None:
        with self._lock:
            self._add.append((s, what))
            self._socks.append(s)
        self._wake_w.send(b"x")

    def _loop(self) -> None:
        while not self._stop.is_set():
            for key, _ in self.sel.select(0.2):
                s = key.fileobj
                assert isinstance(s, socket.socket)
                try:
                    self._handle(s, key.data)
                except OSError:
                    with contextlib.suppress(KeyError, ValueError):
                        if key.data == "conn":
                            self.sel.unregister(s)
                            s.close()

    def _handle(self, s: socket.socket, what: str) -> None:
        if what == "wake":
            s.recv(4096)
            with self._lock:
                add, self._add = self._add, []
            for sock, w in add:
                self.sel.register(sock, selectors.EVENT_READ, w)
        elif what == "listen":
            conn, _ = s.accept()
            conn.settimeout(2)
            with self._lock:
                self._socks.append(conn)
            self.sel.register(conn, selectors.EVENT_READ, "conn")
        elif what == "conn":
            data = s.recv(65536)
            if not data:
                self.sel.unregister(s)
                s.close()
                return
            s.sendall(f"{s.getpeername()[0]} ".encode() + data)
        elif what == "udp":
            data, peer = s.recvfrom(65536)
            s.sendto(f"{peer[0]} ".encode() + data, peer)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()
        self._wake_r.close()
        self._wake_w.close()
        self.sel.close()


# -- the API double and its forwarders -------------------------------------------------------


def _fake_kube_api() -> FakeKubeAPI:
    try:
        from cozylab.kubeapi import FakeKubeAPI
    except ImportError as e:  # the double lives with the tests
        raise click.ClickException(
            "the cluster lab needs the API double cozylab/kubeapi.py: run it from the "
            f"repository root (python -m cozylab.cluster, make cluster-lab): {e}"
        ) from e
    return FakeKubeAPI(bookmark_interval=1.0)


class ApiBridge:
    """The FakeKubeAPI, listening on 127.0.0.1 of namespace `api_ns`, and a forwarder in each
    node namespace on its own 127.0.0.1 at the same port: agents use one kubeconfig."""

    def __init__(self, lab: Lab, api_ns: str, node_nss: Sequence[str], workdir: Path) -> None:
        self.lab = lab
        self.api_ns = api_ns
        self.api = _fake_kube_api()
        lab.in_ns(api_ns, self.api.start)
        self.port = urlsplit(self.api.url).port or 0
        self.kubeconfig = self.api.kubeconfig(workdir / "kubeconfig")
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        for ns in node_nss:
            listener = lab.ns_socket(ns, socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self.port))
            listener.listen(16)
            listener.settimeout(0.2)
            self._keep(listener)
            threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _keep(self, s: socket.socket) -> None:
        with self._lock:
            self._socks.append(s)

    def _accept(self, listener: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            up = self.lab.ns_socket(self.api_ns, socket.AF_INET, socket.SOCK_STREAM)
            try:
                up.connect(("127.0.0.1", self.port))
            except OSError:
                conn.close()
                up.close()
                continue
            self._keep(conn)
            self._keep(up)
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
        self.api.stop()


# -- MetalLB L2 ------------------------------------------------------------------------------


def _arp(op: int, sha: bytes, spa: str, tha: bytes, tpa: str, dst: bytes) -> bytes:
    return (
        dst
        + sha
        + struct.pack("!H", ETH_P_ARP)
        + struct.pack("!HHBBH", 1, 0x0800, 6, 4, op)
        + sha
        + socket.inet_aton(spa)
        + tha
        + socket.inet_aton(tpa)
    )


def _mac(text: str) -> bytes:
    return bytes.fromhex(text.replace(":", ""))


class Speaker:
    """A MetalLB L2 speaker on a node's eth0: answers ARP for the LB IPs it announces and
    sends a gratuitous ARP (request and reply) for each IP it starts announcing."""

    def __init__(self, lab: Lab, ns: str, dev: str, mac: str) -> None:
        self.mac = _mac(mac)
        self.sock = lab.ns_socket(ns, socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ARP))
        self.sock.bind((dev, ETH_P_ARP))
        self.announced: set[str] = set()
        self.garps: list[tuple[float, str]] = []  # (time.monotonic(), ip)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"speaker-{ns}", daemon=True)
        self._thread.start()

    def announce(self, ips: set[str]) -> None:
        with self._lock:
            new = ips - self.announced
            self.announced = set(ips)
        bcast = b"\xff" * 6
        for ip in sorted(new):
            for op in (1, 2):
                self.sock.send(_arp(op, self.mac, ip, bcast, ip, bcast))
            self.garps.append((time.monotonic(), ip))

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self.sock], [], [], 0.1)
                if not ready:
                    continue
                frame, addr = self.sock.recvfrom(2048)
            except (OSError, ValueError):
                return
            if addr[2] == PACKET_OUTGOING or len(frame) < 42:
                continue
            op = struct.unpack("!H", frame[20:22])[0]
            sha, spa, tpa = frame[22:28], frame[28:32], socket.inet_ntoa(frame[38:42])
            with self._lock:
                ours = tpa in self.announced
            if op == 1 and ours:
                with contextlib.suppress(OSError):
                    self.sock.send(_arp(2, self.mac, tpa, sha, socket.inet_ntoa(spa), sha))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


# -- the Cilium-like observer ----------------------------------------------------------------

OBSERVER_C = r"""
#include <uapi/linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/pkt_cls.h>

BPF_HASH(lbs, __u32, __u8, 1024);
BPF_ARRAY(cfg, __u32, 1);                /* [0] = 1: drop packets to an LB IP (the wildcard) */
BPF_ARRAY(counts, __u64, NPOINTS * 3);   /* per point: to an LB IP, from one, dropped */

static __always_inline void bump(__u32 k)
{
	__u64 *v = counts.lookup(&k);

	if (v)
		__sync_fetch_and_add(v, 1);
}

static __always_inline int observe(struct __sk_buff *skb, __u32 point)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = (void *)(eth + 1);
	__u32 saddr, daddr, zero = 0;
	__u32 *drop;

	if ((void *)(ip + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP))
		return TC_ACT_UNSPEC;
	saddr = ip->saddr;
	daddr = ip->daddr;
	if (lbs.lookup(&saddr))
		bump(point * 3 + 1);
	if (!lbs.lookup(&daddr))
		return TC_ACT_UNSPEC;
	bump(point * 3);
	drop = cfg.lookup(&zero);
	if (drop && *drop) {
		bump(point * 3 + 2);
		return TC_ACT_SHOT; /* DROP_NO_SERVICE */
	}
	return TC_ACT_UNSPEC;
}
"""


@dataclass(frozen=True)
class Point:
    node: int
    ns: str
    dev: str
    egress: bool

    @property
    def name(self) -> str:
        return f"{self.dev} {'egress' if self.egress else 'ingress'}"


class Observer:
    """The Cilium-like program at the tail of tcx on each point (see the module docstring)."""

    def __init__(self, lab: Lab, points: Sequence[Point], lb_ips: Sequence[str], drop: bool):
        from bcc import BPF

        from cozyebpf.datapath import bpfsys

        self.points = list(points)
        n = len(self.points)
        text = OBSERVER_C + "".join(
            f"int observe_{i}(struct __sk_buff *skb) {{ return observe(skb, {i}); }}\n"
            for i in range(n)
        )
        self.bpf = BPF(text=text.encode(), cflags=[f"-DNPOINTS={n}"])
        lbs = self.bpf[b"lbs"]
        for ip in lb_ips:
            key = int.from_bytes(socket.inet_aton(ip), "little")
            lbs[lbs.Key(key)] = lbs.Leaf(1)
        cfg = self.bpf[b"cfg"]
        cfg[ctypes.c_int(0)] = ctypes.c_uint32(1 if drop else 0)
        self.links: list[int] = []
        for i, p in enumerate(self.points):
            fd = self.bpf.load_func(f"observe_{i}".encode(), BPF.SCHED_CLS).fd
            kind = bpfsys.BPF_TCX_EGRESS if p.egress else bpfsys.BPF_TCX_INGRESS

            def attach(fd: int = fd, dev: str = p.dev, kind: int = kind) -> int:
                return bpfsys.link_create(fd, socket.if_nametoindex(dev), kind)

            self.links.append(lab.in_ns(p.ns, attach))

    def counts(self) -> list[tuple[Point, int, int, int]]:
        """(point, packets to an LB IP, packets from one, dropped) for each point."""
        t = self.bpf[b"counts"]
        vals = [int(t[ctypes.c_int(i)].value) for i in range(len(self.points) * 3)]
        return [(p, *vals[i * 3 : i * 3 + 3]) for i, p in enumerate(self.points)]  # type: ignore[misc]

    def close(self) -> None:
        from cozyebpf.datapath import bpfsys

        for fd in self.links:
            with contextlib.suppress(OSError):
                bpfsys.link_detach(fd)
            with contextlib.suppress(OSError):
                os.close(fd)
        self.links.clear()
        self.bpf.cleanup()


# -- traffic -------------------------------------------------------------------------------


def _err(e: BaseException) -> str:
    if isinstance(e, ConnectionResetError):
        return "connection reset"
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, TimeoutError | socket.timeout):
        return "timeout"
    return f"{type(e).__name__}: {e}"


@dataclass
class TcpStream:
    """A long-lived TCP connection sending one line every `interval` and reading its echo, in
    lockstep, in a thread: the errors, the echoes (monotonic time, peer the server saw)."""

    sock: socket.socket
    interval: float = 0.02
    echoes: list[tuple[float, str]] = field(default_factory=list)
    error: str | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> TcpStream:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        seq = 0
        self.sock.settimeout(10)
        try:
            while not self._stop.is_set():
                seq += 1
                line = f"{seq}\n".encode()
                self.sock.sendall(line)
                buf = b""
                while not buf.endswith(line):
                    data = self.sock.recv(4096)
                    if not data:
                        raise ConnectionAbortedError("closed by the peer")
                    buf += data
                self.echoes.append((time.monotonic(), buf.split(b" ", 1)[0].decode()))
                self._stop.wait(self.interval)
        except OSError as e:
            self.error = _err(e)

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(15)
        self.sock.close()

    def longest_pause(self) -> float:
        times = [t for t, _ in self.echoes]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)

    def after(self, t: float) -> int:
        return sum(1 for e, _ in self.echoes if e > t)


class Pusher:
    """A server that, to every connection, sends 1,000 bytes every 10 ms until it fails (a
    download), in threads."""

    def __init__(self, lab: Lab, ns: str, port: int) -> None:
        self.sock = lab.ns_socket(ns, socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", port))
        self.sock.listen(16)
        self._stop = threading.Event()
        threading.Thread(target=self._accept, name="pusher", daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._push, args=(conn,), daemon=True).start()

    def _push(self, conn: socket.socket) -> None:
        chunk = b"d" * 1000
        with conn:
            conn.settimeout(10)
            while not self._stop.is_set():
                try:
                    conn.sendall(chunk)
                except OSError:
                    return
                self._stop.wait(0.01)

    def close(self) -> None:
        self._stop.set()
        self.sock.close()


@dataclass
class Download:
    """Reads a connection without ever writing to it: (monotonic time, bytes) of each read.
    Only the TCP stack answers (ACKs), as a VM downloading a file does."""

    sock: socket.socket
    reads: list[tuple[float, int]] = field(default_factory=list)
    error: str | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Download:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        self.sock.settimeout(0.5)
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError as e:
                self.error = _err(e)
                return
            if not data:
                self.error = "closed by the peer"
                return
            self.reads.append((time.monotonic(), len(data)))

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(5)
        self.sock.close()

    def bytes_after(self, t: float) -> int:
        return sum(n for at, n in self.reads if at > t)

    def longest_pause(self) -> float:
        times = [t for t, _ in self.reads]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


@dataclass
class UdpStream:
    """Datagrams at `rate` per second from one socket to addr:port; the echoes received."""

    sock: socket.socket
    addr: tuple[str, int]
    rate: float = 100.0
    sent: dict[int, float] = field(default_factory=dict)
    got: dict[int, float] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> UdpStream:
        self.sock.settimeout(0.2)
        self._threads = [
            threading.Thread(target=self._send, daemon=True),
            threading.Thread(target=self._recv, daemon=True),
        ]
        for t in self._threads:
            t.start()
        return self

    def _send(self) -> None:
        t0 = time.monotonic()
        seq = 0
        while not self._stop.is_set():
            seq += 1
            self.sent[seq] = time.monotonic()
            with contextlib.suppress(OSError):
                self.sock.sendto(f"{seq}".encode(), self.addr)
            self._stop.wait(max(0.0, t0 + seq / self.rate - time.monotonic()))

    def _recv(self) -> None:
        while True:
            try:
                data, peer = self.sock.recvfrom(2048)
            except TimeoutError:
                if self._stop.is_set():
                    return
                continue
            except OSError:
                return
            if peer == self.addr:
                with contextlib.suppress(ValueError, IndexError):
                    self.got[int(data.split(b" ", 1)[1])] = time.monotonic()

    def stop(self) -> None:
        """Stop sending, wait until the last datagrams had their chance, stop receiving."""
        self._stop.set()
        self._threads[0].join(5)
        last = max(self.sent, default=0)
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: last in self.got or not last, 1.0, "the last echo")
        self._threads[1].join(5)
        self.sock.close()

    def lost(self, between: tuple[float, float] | None = None) -> list[int]:
        return [
            s
            for s, t in sorted(self.sent.items())
            if s not in self.got and (between is None or between[0] <= t <= between[1])
        ]

    def gap(self) -> float:
        """The longest time without an echo: from the last echoed datagram's sending to the
        next echoed one's, in send time (what a receiver would see as a hole)."""
        ok = [self.sent[s] for s in sorted(self.got) if s in self.sent]
        return max((b - a for a, b in itertools.pairwise(ok)), default=0.0)

    def summary(self) -> str:
        lost = self.lost()
        return f"{len(lost)} of {len(self.sent)} lost, longest gap {self.gap() * 1000:.0f} ms"


# -- the lab ---------------------------------------------------------------------------------


@dataclass
class Agent:
    node: int
    ns: str
    pin_dir: str
    log_path: Path
    proc: subprocess.Popen[str] | None = None
    offset: int = 0  # where the current process's part of the log starts


class ClusterLab:
    """The three-node lab of the module docstring. `up()` builds it (agents included),
    `down()` removes everything; `run_all()` runs every scenario and returns the rows."""

    def __init__(
        self,
        layout: str = "kubeovn",
        prefix: str = "czc",
        workloads: Sequence[Workload] = DEFAULT_WORKLOADS,
        cmd: Sequence[str] | None = None,
        agent_args: Sequence[str] = (),
        observer: str = "drop",
        workdir: Path | None = None,
        log: Callable[[str], None] = lambda s: None,
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
        self.layout = layout
        self.prefix = prefix
        self.workloads = {w.name: w for w in workloads}
        self.location = {w.name: w.node for w in workloads}
        self.cmd = list(cmd or [sys.executable, "-m", "cozyebpf"])
        self.agent_args = list(agent_args)
        self.observer_mode = observer
        self._workdir = workdir
        self.say = log
        self.lab = Lab(prefix, pods=())
        self.agents: dict[int, Agent] = {}
        self.speakers: dict[int, Speaker] = {}
        self.echo: EchoHub | None = None
        self.pusher: Pusher | None = None
        self.api: ApiBridge | None = None
        self.observer: Observer | None = None
        self.created: list[str] = []
        self.pod_names = {w.name: f"virt-launcher-{w.name}-{w.index:02d}aaa" for w in workloads}
        self.canary = 0
        self.migration: dict[str, dict[str, Any]] = {}  # by migration

    @property
    def workdir(self) -> Path:
        """Logs and the kubeconfig (a temporary directory unless given)."""
        if self._workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-{self.layout}-"))
        return self._workdir

    # -- names ---------------------------------------------------------------------------

    def ns(self, what: str) -> str:
        return f"{self.prefix}-{what}"

    def node(self, n: int) -> str:
        return self.ns(f"node{n}")

    def ovs(self, n: int) -> str:
        return self.ns(f"ovs{n}")

    def pod_ns(self, name: str) -> str:
        return self.ns(name)

    @property
    def tor(self) -> str:
        return self.ns("tor")

    @property
    def client(self) -> str:
        return self.ns("client")

    @property
    def server(self) -> str:
        return self.ns("server")

    @property
    def vms(self) -> list[Workload]:
        return [w for w in self.workloads.values() if w.is_vm]

    # -- helpers -------------------------------------------------------------------------

    def batch(self, ns: str, lines: Sequence[str]) -> None:
        """`ip -batch` in `ns` (one process for many commands)."""
        run("ip", "-n", ns, "-batch", "-", input="\n".join(lines) + "\n")

    def sysctl(self, ns: str, pairs: Sequence[tuple[str, str]]) -> None:
        self.lab.exec(ns, "sysctl", "-q", "-w", *(f"{k}={v}" for k, v in pairs))

    def add_ns(self, name: str) -> str:
        run("ip", "netns", "add", name)
        self.created.append(name)
        self.batch(name, ["link set lo up"])
        self.sysctl(
            name,
            [
                ("net.ipv4.conf.all.rp_filter", "0"),
                ("net.ipv4.conf.default.rp_filter", "0"),
                ("net.ipv6.conf.all.disable_ipv6", "1"),
                ("net.ipv6.conf.default.disable_ipv6", "1"),
            ],
        )
        return name

    # -- building ------------------------------------------------------------------------

    def cleanup_leftovers(self) -> None:
        """Namespaces and pins of an earlier run with this prefix (a killed run)."""
        existing = run("ip", "netns", "list", check=False).stdout.split()
        for ns in existing:
            if ns.startswith(f"{self.prefix}-"):
                run("ip", "netns", "del", ns, check=False)
        for n in NODES:
            shutil.rmtree(f"/sys/fs/bpf/{self.prefix}-node{n}", ignore_errors=True)

    def up(self) -> ClusterLab:
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def _up(self) -> None:
        t0 = time.monotonic()
        self.cleanup_leftovers()
        self._router()
        for n in NODES:
            self._node(n)
        if self.layout == "kubeovn":
            for n in NODES:
                self._ovs(n)
            for n in NODES:
                self._ovs_routes(n)
        for w in self.workloads.values():
            self._workload(w)
        self.say(f"topology up in {time.monotonic() - t0:.1f}s ({self.layout})")
        self.echo = EchoHub()
        for w in self.workloads.values():
            for kind, port in ((socket.SOCK_STREAM, 80), (socket.SOCK_STREAM, 81)):
                self.echo.serve(self.lab, self.pod_ns(w.name), kind, port)
            self.echo.serve(self.lab, self.pod_ns(w.name), socket.SOCK_DGRAM, 53)
        for n in NODES:  # the kubelet's port, for section 12
            self.echo.serve(self.lab, self.node(n), socket.SOCK_STREAM, NODE_PORT)
        self.echo.serve(self.lab, self.server, socket.SOCK_STREAM, SERVER_TCP)
        self.echo.serve(self.lab, self.server, socket.SOCK_DGRAM, SERVER_UDP)
        self.pusher = Pusher(self.lab, self.server, SERVER_PUSH)
        self.api = ApiBridge(
            self.lab, self.add_ns(self.ns("api")), [self.node(n) for n in NODES], self.workdir
        )
        for n in NODES:
            self.api.api.apply(node_object(n))
        for w in self.vms:
            self.api.api.apply(service_object(w))
            self.api.api.apply(pod_object(w, self.pod_names[w.name], self.location[w.name]))
            self._set_endpoints(w, [self.location[w.name]])
        self._canary_bump()
        for n in NODES:
            self.speakers[n] = Speaker(self.lab, self.node(n), "eth0", node_mac(n))
        self.announce()
        self._observer()
        t1 = time.monotonic()
        for n in NODES:
            self.start_agent(n, wait=False)
        for n in NODES:
            self.wait_agent(n)
        self.wait_programmed()
        self.say(f"agents ready in {time.monotonic() - t1:.1f}s")

    def _router(self) -> None:
        tor = self.add_ns(self.tor)
        self.sysctl(
            tor,
            [
                ("net.ipv4.ip_forward", "1"),
                ("net.ipv4.conf.all.send_redirects", "0"),
                ("net.ipv4.conf.default.send_redirects", "0"),
            ],
        )
        self.batch(
            tor,
            [
                f"link add br0 address {ROUTER_MAC} type bridge stp_state 0 forward_delay 0",
                "link set br0 up",
                f"addr add {ROUTER_IP}/24 dev br0",
                f"route add {LB_POOL} dev br0",  # on-link: the ToR ARPs for LB IPs
            ],
        )
        self.sysctl(
            tor,
            [
                ("net.ipv4.neigh.br0.locktime", "0"),
                ("net.ipv4.conf.br0.arp_accept", "1"),
                ("net.ipv4.conf.br0.send_redirects", "0"),
            ],
        )
        for name, ip, gw, dev in (
            (self.client, CLIENT_IP, CLIENT_GW, "ext-c"),
            (self.server, SERVER_IP, SERVER_GW, "ext-s"),
        ):
            self.add_ns(name)
            last = int(gw.rsplit(".", 1)[1])
            self.lab.veth(
                tor,
                dev,
                f"02:00:c6:33:64:{last:02x}",
                name,
                "eth0",
                f"02:00:c6:33:64:{last + 1:02x}",
            )
            self.batch(tor, [f"addr add {gw}/25 dev {dev}", f"link set {dev} up"])
            self.batch(
                name,
                [f"addr add {ip}/25 dev eth0", "link set eth0 up", f"route add default via {gw}"],
            )
        self.batch(self.client, [f"addr add {OUTSIDE_IP}/25 dev eth0"])

    def _node(self, n: int) -> None:
        ns = self.add_ns(self.node(n))
        self.sysctl(
            ns,
            [
                ("net.ipv4.ip_forward", "1"),
                ("net.ipv4.conf.all.send_redirects", "0"),
                ("net.ipv4.conf.default.send_redirects", "0"),
                ("net.ipv4.conf.all.accept_redirects", "0"),
                ("net.ipv4.conf.default.accept_redirects", "0"),
            ],
        )
        self.lab.veth(ns, "eth0", node_mac(n), self.tor, f"sw{n}", f"02:00:c0:00:12:{n:02x}")
        self.batch(self.tor, [f"link set sw{n} master br0", f"link set sw{n} up"])
        lines = [
            f"addr add {node_ip(n)}/24 dev eth0",
            "link set eth0 up",
            f"route add default via {ROUTER_IP}",
        ]
        if self.layout == "perpod":
            self.batch(self.tor, [f"route add 10.244.{n}.0/24 via {node_ip(n)}"])
        self.batch(ns, lines)
        if self.layout == "kubeovn":
            self.lab.exec(ns, "nft", "-f", "-", input=kubeovn_ruleset(n))

    def _ovs(self, n: int) -> None:
        """Node n's OVS namespace: ovn0 to the node, the vxlan tunnel device."""
        ovs, node = self.add_ns(self.ovs(n)), self.node(n)
        self.sysctl(
            ovs,
            [
                ("net.ipv4.ip_forward", "1"),
                ("net.ipv4.conf.all.send_redirects", "0"),
                ("net.ipv4.conf.default.send_redirects", "0"),
                ("net.ipv4.conf.default.proxy_arp", "1"),  # pods ARP for pods: the router answers
            ],
        )
        self.lab.veth(node, "ovn0", ovn0_mac(n), ovs, "lrp-join", LRP_JOIN_MAC)
        self.batch(
            node,
            [
                f"link set ovn0 mtu {POD_MTU}",
                f"addr add {join_ip(n)}/16 dev ovn0",
                "link set ovn0 up",
                f"route add {POD_CIDR} via {JOIN_GW} dev ovn0",
                f"neigh replace {JOIN_GW} lladdr {LRP_JOIN_MAC} dev ovn0 nud permanent",
                # the tunnel: its UDP socket lives here, over eth0; the device goes to the OVS
                f"link add {TUNNEL} address {tun_mac(n)} type vxlan id {VNI} local {node_ip(n)}"
                f" dev eth0 dstport 4789 nolearning",
                f"link set {TUNNEL} netns {ovs}",
            ],
        )
        lines = [
            f"link set lrp-join mtu {POD_MTU}",
            f"addr add {JOIN_GW}/16 dev lrp-join",
            "link set lrp-join up",
            f"neigh replace {join_ip(n)} lladdr {ovn0_mac(n)} dev lrp-join nud permanent",
            f"addr add {tun_ip(n)}/24 dev {TUNNEL}",
            f"link set {TUNNEL} up",
            f"route add default via {join_ip(n)} dev lrp-join",
            f"route add {node_ip(n)}/32 via {join_ip(n)} dev lrp-join",
        ]
        for m in NODES:
            if m == n:
                continue
            lines += [
                f"neigh replace {tun_ip(m)} lladdr {tun_mac(m)} dev {TUNNEL} nud permanent",
                f"route add {node_ip(m)}/32 via {tun_ip(m)} dev {TUNNEL}",
                f"route add {join_ip(m)}/32 via {tun_ip(m)} dev {TUNNEL}",
            ]
        self.batch(ovs, lines)
        self.lab.exec(ovs, "nft", "-f", "-", input=port_security_ruleset(self.workloads.values()))
        for m in NODES:
            if m != n:
                run(
                    "bridge",
                    "-n",
                    ovs,
                    "fdb",
                    "append",
                    tun_mac(m),
                    "dev",
                    TUNNEL,
                    "dst",
                    node_ip(m),
                    "self",
                    "permanent",
                )

    def _ovs_routes(self, n: int) -> None:
        """Remote pods: /32 via the tunnel to the OVS of the pod's node."""
        lines = [
            f"route replace {w.ip}/32 via {tun_ip(self.location[w.name])} dev {TUNNEL} onlink"
            for w in self.workloads.values()
            if self.location[w.name] != n
        ]
        if lines:
            self.batch(self.ovs(n), lines)

    def _ovs_port(self, n: int, w: Workload, pod_dev: str) -> None:
        """A port for `w` on node n's OVS: veth `w.ovs_dev` (gateway MAC) <-> `pod_dev`."""
        self.lab.veth(self.ovs(n), w.ovs_dev, GW_MAC, self.pod_ns(w.name), pod_dev, w.mac)
        self.batch(
            self.ovs(n),
            [
                f"link set {w.ovs_dev} mtu {POD_MTU}",
                f"addr add {POD_GW}/32 dev {w.ovs_dev}",
                f"link set {w.ovs_dev} up",
                f"route replace {w.ip}/32 dev {w.ovs_dev}",
                f"neigh replace {w.ip} lladdr {w.mac} dev {w.ovs_dev} nud permanent",
            ],
        )
        # answer at once (the default delays proxy ARP answers by up to 0.8 s)
        self.sysctl(self.ovs(n), [(f"net.ipv4.neigh.{w.ovs_dev}.proxy_delay", "0")])

    def _pod_link(self, w: Workload, dev: str = "eth0") -> list[str]:
        if self.layout == "kubeovn":
            return [
                f"link set {dev} mtu {POD_MTU}",
                f"addr add {w.ip}/16 dev {dev}",
                f"link set {dev} up",
                f"route add default via {POD_GW} dev {dev}",
                f"neigh replace {POD_GW} lladdr {GW_MAC} dev {dev} nud permanent",
            ]
        gw = perpod_gw(w.node)
        return [
            f"addr add {w.ip}/32 dev {dev}",
            f"link set {dev} up",
            f"route add {gw} dev {dev}",
            f"route add default via {gw} dev {dev}",
            f"neigh replace {gw} lladdr {w.host_mac} dev {dev} nud permanent",
        ]

    def _workload(self, w: Workload) -> None:
        pns = self.add_ns(self.pod_ns(w.name))
        n = self.location[w.name]
        if self.layout == "kubeovn":
            self._ovs_port(n, w, "eth0")
        else:
            node = self.node(n)
            self.lab.veth(node, w.host_dev, w.host_mac, pns, "eth0", w.mac)
            self.batch(
                node,
                [
                    f"addr add {perpod_gw(n)}/32 dev {w.host_dev}",
                    f"link set {w.host_dev} up",
                    f"route add {w.ip}/32 dev {w.host_dev}",
                    f"neigh replace {w.ip} lladdr {w.mac} dev {w.host_dev} nud permanent",
                ],
            )
        self.batch(pns, self._pod_link(w))

    def _observer(self) -> None:
        if self.layout == "kubeovn":
            points = [
                Point(n, ns, dev, egress)
                for n in NODES
                for ns, dev in ((self.node(n), "ovn0"), (self.ovs(n), TUNNEL))
                for egress in (False, True)
            ]
        else:
            points = [Point(n, self.node(n), "eth0", False) for n in NODES]
        lbs = [w.lb_ip for w in self.vms if w.lb_ip] + [CANARY_LB]
        self.observer = Observer(self.lab, points, lbs, self.observer_mode == "drop")

    # -- Services, announcements ---------------------------------------------------------

    def _set_endpoints(self, w: Workload, nodes: Sequence[int], pods: Sequence[str] = ()) -> None:
        assert self.api is not None
        names = list(pods) or [self.pod_names[w.name]] * len(nodes)
        self.api.api.apply(
            slice_object(w.name, w.ip, w.ports, list(zip(nodes, names, strict=True)))
        )

    def _canary_bump(self) -> str:
        """A Service of the lab's own whose endpoint changes after every EndpointSlice write:
        once every agent programmed its new pod IP, every agent took the writes before it
        (one watch stream, in order). Returns the pod IP to wait for."""
        assert self.api is not None
        self.canary += 1
        canary = Workload(
            "lab-canary", 99, 3, f"10.244.3.{200 + self.canary % 50}", CANARY_LB, whole_ip=True
        )
        if self.canary == 1:
            self.api.api.apply(service_object(canary))
        self.api.api.apply(slice_object(canary.name, canary.ip, canary.ports, [(3, "canary")]))
        return canary.ip

    def sync_agents(self, timeout: float = 15) -> None:
        """Wait until every running agent took every API write made so far."""
        want = self._canary_bump()
        for a in self.agents.values():
            if a.proc is not None:
                wait_for(
                    lambda a=a: self.lb_map(a).get(CANARY_LB) == want,  # type: ignore[misc]
                    timeout,
                    f"{node_name(a.node)}'s agent to take the API's writes",
                )

    def announce(self, ready: dict[str, list[int]] | None = None) -> dict[str, int | None]:
        """Tell each speaker what it announces: the elected node of each LB IP."""
        ready = ready or {w.name: [self.location[w.name]] for w in self.vms}
        owners = {w.lb_ip: elect(w.lb_ip, ready[w.name]) for w in self.vms if w.lb_ip}
        owners[CANARY_LB] = 3
        for n, sp in self.speakers.items():
            sp.announce({ip for ip, o in owners.items() if o == n})
        return owners

    # -- agents --------------------------------------------------------------------------

    def agent_env(self, n: int) -> dict[str, str]:
        """The container environment of the DaemonSet (`daemonset_path`) for node n, the pin dir
        moved into the lab's (fieldRefs: spec.nodeName, status.hostIP; $(VAR) expanded)."""
        env: dict[str, str] = {}
        for e in daemonset_container().get("env", []):
            if "value" in e:
                env[e["name"]] = re.sub(
                    r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), str(e["value"])
                )
            else:
                ref = e["valueFrom"]["fieldRef"]["fieldPath"]
                env[e["name"]] = {"spec.nodeName": node_name(n), "status.hostIP": node_ip(n)}[ref]
        env["COZYEBPF_PIN_DIR"] = f"/sys/fs/bpf/{self.prefix}-node{n}"
        if self.layout == "perpod":  # the DaemonSet's value for a CNI with per-pod veths
            env["COZYEBPF_RUN_POD_DEVICES"] = "lxc-*"
        return env

    def agent_command(self, n: int) -> list[str]:
        """The DaemonSet's container arguments (`run`), the API's kubeconfig, the extras."""
        assert self.api is not None
        return [
            *self.cmd,
            *daemonset_container()["args"],
            "--kubeconfig",
            str(self.api.kubeconfig),
            *self.agent_args,
        ]

    def start_agent(self, n: int, wait: bool = True) -> None:
        env = self.agent_env(n)
        a = self.agents.get(n) or Agent(
            n, self.node(n), env["COZYEBPF_PIN_DIR"], self.workdir / f"agent-node{n}.log"
        )
        self.agents[n] = a
        a.offset = len(self.agent_log(n)) if a.log_path.exists() else 0
        with a.log_path.open("a") as log:
            log.write(f"=== {' '.join(self.agent_command(n))}\n")
            log.flush()
            a.proc = self.lab.popen(
                a.ns,
                # killed with the lab's thread that started it: a lab killed by SIGKILL leaves
                # no agent running (util-linux setpriv; nsenter --net does not fork)
                *(["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []),
                *self.agent_command(n),
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
            )
        if wait:
            self.wait_agent(n)

    def agent_log(self, n: int) -> str:
        a = self.agents[n]
        return a.log_path.read_text() if a.log_path.exists() else ""

    def wait_agent(self, n: int, timeout: float = 180) -> None:
        a = self.agents[n]
        start = a.offset

        def ready() -> bool:
            if a.proc is not None and a.proc.poll() is not None:
                raise RuntimeError(
                    f"{node_name(n)}'s agent exited ({a.proc.returncode}):\n"
                    f"{self.agent_log(n)[start:][-3000:]}"
                )
            return "datapath ready" in self.agent_log(n)[start:]

        wait_for(ready, timeout, f"{node_name(n)}'s agent to attach")

    def learned(self) -> dict[str, int]:
        """pass_learn packets per node (cumulative: the counters live as long as the pins)."""
        return self.counted("pass_learn")

    def lb_map(self, a: Agent) -> dict[str, str]:
        from cozyebpf.datapath.maps import PinnedMaps

        with PinnedMaps.open(a.pin_dir) as m:
            return {str(lb): str(e.pod_ip) for lb, e in m.read_state().services.items()}

    def wait_programmed(self, timeout: float = 30) -> None:
        want = {w.lb_ip: w.ip for w in self.vms if w.lb_ip}
        for a in self.agents.values():
            wait_for(
                lambda a=a: all(self.lb_map(a).get(lb) == ip for lb, ip in want.items()),  # type: ignore[misc]
                timeout,
                lambda a=a: f"{node_name(a.node)}'s maps: {self.agent_log(a.node)[-2000:]}",  # type: ignore[misc]
            )

    def stop_agent(self, n: int, sig: int = signal.SIGTERM) -> int | None:
        a = self.agents[n]
        if a.proc is None:
            return None
        a.proc.send_signal(sig)
        try:
            rc = a.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            a.proc.kill()
            rc = a.proc.wait()
        a.proc = None
        return rc

    def warnings(self, n: int, since: int = 0) -> list[str]:
        return [
            line
            for line in self.agent_log(n)[since:].splitlines()
            if " WARNING " in line or " ERROR " in line
        ]

    # -- teardown ------------------------------------------------------------------------

    def down(self) -> None:
        for n in list(self.agents):
            with contextlib.suppress(Exception):
                self.stop_agent(n, signal.SIGKILL)
        if self.observer:
            with contextlib.suppress(Exception):
                self.observer.close()
            self.observer = None
        for sp in self.speakers.values():
            with contextlib.suppress(Exception):
                sp.close()
        self.speakers.clear()
        if self.echo:
            self.echo.close()
            self.echo = None
        if self.pusher:
            self.pusher.close()
            self.pusher = None
        if self.api:
            with contextlib.suppress(Exception):
                self.api.close()
            self.api = None
        for n, a in self.agents.items():
            subprocess.run(
                [*self.lab.nsenter(self.node(n)), *self.cmd, "detach", "--pin-dir", a.pin_dir],
                capture_output=True,
                timeout=60,
            )
        for n in NODES:
            shutil.rmtree(f"/sys/fs/bpf/{self.prefix}-node{n}", ignore_errors=True)
        existing = run("ip", "netns", "list", check=False).stdout.split()
        for ns in reversed(self.created):
            if ns in existing:
                run("ip", "netns", "del", ns, check=False)
        self.created.clear()

    def __enter__(self) -> ClusterLab:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- probes --------------------------------------------------------------------------

    def tcp(self, ns: str, addr: str, port: int, timeout: float = 2.0) -> tuple[str | None, str]:
        """Connect from `ns`, send a line, read the echo: (the peer the server saw, "") or
        (None, what went wrong)."""
        try:
            with self.lab.ns_socket(ns, socket.AF_INET, socket.SOCK_STREAM) as c:
                c.settimeout(timeout)
                c.connect((addr, port))
                c.sendall(b"probe\n")
                data = b""
                while not data.endswith(b"probe\n"):
                    chunk = c.recv(1024)
                    if not chunk:
                        return None, "closed by the peer"
                    data += chunk
                return data.split(b" ", 1)[0].decode(), ""
        except OSError as e:
            return None, _err(e)

    def udp(self, ns: str, addr: str, port: int, timeout: float = 1.0) -> tuple[str | None, str]:
        """One datagram (two tries): (the peer the server saw, "") when the echo came back
        from addr:port, else (None, what happened)."""
        with self.lab.ns_socket(ns, socket.AF_INET, socket.SOCK_DGRAM) as c:
            c.settimeout(timeout)
            what = "timeout"
            for _ in range(2):
                try:
                    c.sendto(b"probe", (addr, port))
                    while True:
                        data, peer = c.recvfrom(2048)
                        if peer == (addr, port):
                            return data.split(b" ", 1)[0].decode(), ""
                        what = f"answer from {peer[0]}:{peer[1]}, not {addr}:{port}"
                except OSError as e:
                    what = what if isinstance(e, TimeoutError) else _err(e)
            return None, what

    def ping(self, ns: str, addr: str) -> bool:
        p = self.lab.exec(ns, "ping", "-c", "1", "-W", "1", addr, check=False)
        return p.returncode == 0

    def where(self, name: str) -> str:
        return self.workloads[name].label(self.location[name])

    # -- scenarios 1-6 -------------------------------------------------------------------

    def check(self, proto: str, ns: str, addr: str, port: int, want: str | None) -> Check:
        """A TCP or UDP echo from `ns` to addr:port: PASS when it completes (and the far side
        saw `want` as the source, unless `want` is None)."""
        seen, err = (self.tcp if proto == "tcp" else self.udp)(ns, addr, port)
        what = f"{proto}/{port}"
        if seen is None:
            return False, f"{what}: {err}"
        if want is not None and seen != want:
            return False, f"{what}: the far side saw {seen}, want {want}"
        return True, f"{what}: the far side saw {seen}"

    def check_icmp(self, lb: str, allowed: bool) -> Check:
        before = sum(self.counted("drop_icmp").values())
        ok = self.ping(self.client, lb)
        if allowed:
            return ok, f"ping {'answered' if ok else 'unanswered'}"
        # silence alone proves nothing (a route, a timeout): the filter must have counted it
        dropped = sum(self.counted("drop_icmp").values()) - before
        return not ok and dropped > 0, (
            f"ping {'answered' if ok else 'unanswered'} (ICMP not allowed: must be dropped); "
            f"drop_icmp +{dropped}"
        )

    def check_unlisted(self, lb: str, whole: bool, ns: str | None = None) -> Check:
        before = sum(self.counted("drop_port").values())
        seen, err = self.tcp(ns or self.client, lb, 81, timeout=1.0)
        if whole:
            return seen == CLIENT_IP, f"whole-IP: tcp/81 {'saw ' + seen if seen else err}"
        if seen is not None:
            return False, f"tcp/81 is not listed but was answered (the pod saw {seen})"
        # a timeout alone proves nothing: the port filter must have counted the SYNs
        dropped = sum(self.counted("drop_port").values()) - before
        what = "dropped" if err == "timeout" else err
        return err == "timeout" and dropped > 0, f"tcp/81 not listed: {what}; drop_port +{dropped}"

    def path_cases(self) -> list[tuple[str, str, Callable[[], Check]]]:
        """(scenario, case, check) of sections 1-6, for the workloads of this lab."""
        out: list[tuple[str, str, Callable[[], Check]]] = []
        w = self.workloads

        def both(
            scenario: str, case: str, ns: str, addr: str, port: tuple[int, int], want: str | None
        ) -> None:
            for proto, p in zip(("tcp", "udp"), port, strict=True):
                out.append(
                    (scenario, f"{case} {proto}", partial(self.check, proto, ns, addr, p, want))
                )

        for name in SHAPES:
            vm, label = w[name], self.where(name)
            assert vm.lb_ip is not None
            for proto, port in (("tcp", 80), ("udp", 53)):
                out.append(
                    (
                        "1 external->vm",
                        f"{label} {proto}/{port}",
                        partial(self.check, proto, self.client, vm.lb_ip, port, CLIENT_IP),
                    )
                )
            out.append(
                (
                    "1 external->vm",
                    f"{label} icmp",
                    partial(self.check_icmp, vm.lb_ip, vm.whole_ip or vm.allow_icmp),
                )
            )
            out.append(
                (
                    "1 external->vm",
                    f"{label} tcp/81 unlisted",
                    partial(self.check_unlisted, vm.lb_ip, vm.whole_ip),
                )
            )
        for name in SHAPES:
            lb = w[name].lb_ip
            both(
                "2 vm->external",
                self.where(name),
                self.pod_ns(name),
                SERVER_IP,
                (SERVER_TCP, SERVER_UDP),
                lb,
            )
        for a, b in VM_PAIRS:
            same = "same node" if w[a].node == w[b].node else "across nodes"
            lb = w[b].lb_ip
            assert lb is not None
            both(
                "3 vm->vm-lb",
                f"{self.where(a)} -> {self.where(b)} {same}",
                self.pod_ns(a),
                lb,
                (80, 53),
                w[a].lb_ip,
            )
        for a, b in POD_PAIRS:
            same = "same node" if w[a].node == w[b].node else "across nodes"
            lb = w[b].lb_ip
            assert lb is not None
            both(
                "4 pod->vm-lb",
                f"{self.where(a)} -> {self.where(b)} {same}",
                self.pod_ns(a),
                lb,
                (80, 53),
                None,
            )
            if not w[b].whole_ip:  # the port filter holds for in-cluster clients too
                out.append(
                    (
                        "4 pod->vm-lb",
                        f"{self.where(a)} -> {self.where(b)} {same} tcp/81 unlisted",
                        partial(self.check_unlisted, lb, False, self.pod_ns(a)),
                    )
                )
        for name in HAIRPIN:
            lb = w[name].lb_ip
            assert lb is not None
            both("5 hairpin", self.where(name), self.pod_ns(name), lb, (80, 53), lb)
        for n, name in HOST_PAIRS:
            where = "the VM's node" if w[name].node == n else "another node"
            lb = w[name].lb_ip
            assert lb is not None
            both(
                "6 host->vm-lb",
                f"{node_name(n)} -> {self.where(name)} ({where})",
                self.node(n),
                lb,
                (80, 53),
                None,
            )
            if not w[name].whole_ip:
                out.append(
                    (
                        "6 host->vm-lb",
                        f"{node_name(n)} -> {self.where(name)} ({where}) tcp/81 unlisted",
                        partial(self.check_unlisted, lb, False, self.node(n)),
                    )
                )
        return out

    def run_paths(self, workers: int = 8) -> list[Row]:
        cases = self.path_cases()

        def one(c: tuple[str, str, Callable[[], Check]]) -> Row:
            try:
                ok, detail = c[2]()
            except Exception as e:
                ok, detail = False, f"error: {_err(e)}"
            return Row(c[0], c[1], self.layout, ok, detail)

        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(one, cases))

    # -- scenario 7: live migration ------------------------------------------------------

    def move_link(self, name: str, to: int) -> None:
        """The VM's link moves to node `to`'s OVS: a new port there, the VM's old link deleted
        and the new one renamed into its place (same MAC and IP), every OVS's /32 follows."""
        w = self.workloads[name]
        self._ovs_port(to, w, "eth1")
        self.batch(
            self.pod_ns(name),
            ["link del eth0", "link set eth1 name eth0", *self._pod_link(w)],
        )
        self.location[name] = to
        for n in NODES:
            if n != to:
                self.batch(
                    self.ovs(n),
                    [f"route replace {w.ip}/32 via {tun_ip(to)} dev {TUNNEL} onlink"],
                )

    def router_owner(self, lb: str) -> str:
        out = self.lab.exec(self.tor, "ip", "neigh", "show", lb, "dev", "br0").stdout
        m = re.search(r"lladdr (\S+)", out)
        if not m:
            return "none"
        for n in NODES:
            if m[1] == node_mac(n):
                return node_name(n)
        return m[1]

    def run_migration(self, name: str, to: int) -> list[Row]:
        s = "7 live migration"
        w = self.workloads[name]
        assert w.lb_ip is not None and self.api is not None
        frm = self.location[name]
        desc = f"{self.where(name)} -> n{to}"
        new_pod = f"virt-launcher-{name}-{w.index:02d}{'bbb' if to != w.node else 'ccc'}"
        learned0 = self.learned()
        # load: a connection from outside, one the VM opened, 100 datagrams/s from outside
        outside = self.lab.ns_socket(self.client, socket.AF_INET, socket.SOCK_STREAM)
        opened = self.lab.ns_socket(self.pod_ns(name), socket.AF_INET, socket.SOCK_STREAM)
        fetch = self.lab.ns_socket(self.pod_ns(name), socket.AF_INET, socket.SOCK_STREAM)
        errors: list[str] = []
        try:
            outside.settimeout(3)
            outside.connect((w.lb_ip, 80))
            opened.settimeout(3)
            opened.connect((SERVER_IP, SERVER_TCP))
            fetch.settimeout(3)
            fetch.connect((SERVER_IP, SERVER_PUSH))
        except OSError as e:
            errors.append(f"could not connect: {_err(e)}")
        tin, tout = TcpStream(outside).start(), TcpStream(opened).start()
        down = Download(fetch).start()
        udp = UdpStream(
            self.lab.ns_socket(self.client, socket.AF_INET, socket.SOCK_DGRAM), (w.lb_ip, 53)
        ).start()
        offsets = {n: len(self.agent_log(n)) for n in NODES}
        events0 = len(self.api.api.events())
        t = {"start": time.monotonic()}
        owners: dict[str, Any] = {}
        both_warnings: dict[int, list[str]] = {}
        both_events: list[dict[str, Any]] = []
        ranges_row: Row | None = None

        def step(what: str, fn: Callable[[], object]) -> None:
            try:
                fn()
            except (TimeoutError, RuntimeError) as e:
                errors.append(f"{what}: {e}")

        try:
            step("load", lambda: wait_for(lambda: udp.got and tin.echoes and tout.echoes, 5))
            # "old ready" -> "both ready": one address, two nodeNames
            t["both"] = time.monotonic()
            self.api.api.apply(pod_object(w, new_pod, to))
            self._set_endpoints(w, [frm, to], [self.pod_names[name], new_pod])
            step("both ready", self.sync_agents)
            owners["both"] = self.announce({**self._ready(), name: [frm, to]})[w.lb_ip]
            both_warnings = {n: self.warnings(n, offsets[n]) for n in NODES}
            both_events = self.api.api.events()[events0:]
            got = len(udp.got)
            step("both ready", lambda: wait_for(lambda: len(udp.got) > got + 10, 2, "echoes"))
            ranges_row = self.outside_the_ranges_while_learning(s, desc, w)
            # the switch
            t["switch"] = time.monotonic()
            self.move_link(name, to)
            t["switched"] = time.monotonic()
            # "new ready"
            self.pod_names[name] = new_pod
            self._set_endpoints(w, [to])
            step("new ready", self.sync_agents)
            owners["new"] = self.announce()[w.lb_ip]
            t["new"] = time.monotonic()
            for what, st in (("outside", tin), ("opened", tout)):
                step(
                    f"after the migration ({what})",
                    lambda st=st: wait_for(lambda: st.after(t["new"]) > 10 or st.error, 5),  # type: ignore[misc]
                )
            step(
                "after the migration (download)",
                lambda: wait_for(lambda: down.bytes_after(t["new"]) > 100_000 or down.error, 5),
            )
        finally:
            tin.stop()
            tout.stop()
            down.stop()
            udp.stop()
        t["end"] = time.monotonic()
        owner = self.router_owner(w.lb_ip)
        garps = [
            (node_name(n), ts - t["switch"])
            for n, sp in self.speakers.items()
            for ts, ip in sp.garps
            if ip == w.lb_ip and ts >= t["start"]
        ]
        # datagrams sent while both were ready, but not in flight at the switch (lab RTT: < 1 ms)
        both_window = (t.get("both", 0.0), t.get("switch", 0.0) - 0.05)
        learned = self.learned()
        fig: dict[str, Any] = {
            "switch_ms": (t.get("switched", 0) - t.get("switch", 0)) * 1000,
            "udp": udp.summary(),
            "udp_lost": len(udp.lost()),
            "udp_sent": len(udp.sent),
            "udp_gap_ms": udp.gap() * 1000,
            "tcp_outside_pause_ms": tin.longest_pause() * 1000,
            "tcp_opened_pause_ms": tout.longest_pause() * 1000,
            "download_bytes_before": sum(n for at, n in down.reads if at <= t.get("both", 0)),
            "download_bytes_after": down.bytes_after(t.get("new", math.inf)),
            "download_pause_ms": down.longest_pause() * 1000,
            "pass_learn": {n: learned[n] - learned0.get(n, 0) for n in learned},
            "garp": [f"{n} at {dt * 1000:+.0f} ms from the switch" for n, dt in garps],
            "announcer": {"both ready": owners.get("both"), "new ready": owners.get("new")},
            "router_neighbour": owner,
        }
        self.migration[desc] = fig
        common = [e for e in errors if not e.startswith("after")]

        def stream_row(case: str, st: TcpStream, what: str, extra: str = "") -> Row:
            errs = common + [e for e in errors if e.startswith(f"after the migration ({what})")]
            if st.error:
                errs.append(f"error: {st.error}")
            after = st.after(t.get("new", math.inf))
            pause = st.longest_pause()
            if pause > MIGRATION_MAX_PAUSE:
                errs.append(f"a pause over {MIGRATION_MAX_PAUSE * 1000:.0f} ms")
            return Row(
                s,
                f"{desc} {case}",
                self.layout,
                not errs and after > 0,
                "; ".join(
                    [
                        *errs,
                        f"{len(st.echoes)} echoes, {after} after the migration, "
                        f"longest pause {st.longest_pause() * 1000:.0f} ms{extra}",
                    ]
                ),
            )

        seen_out = ", ".join(sorted({p for _, p in tout.echoes})) or "nothing"
        down_errs = common + [e for e in errors if e.startswith("after the migration (download)")]
        if down.error:
            down_errs.append(f"error: {down.error}")
        rows = [
            stream_row("tcp from outside keeps going", tin, "outside"),
            stream_row(
                "tcp the VM opened keeps going", tout, "opened", f"; the server saw {seen_out}"
            ),
            Row(
                s,
                f"{desc} tcp download the VM opened keeps going",
                self.layout,
                not down_errs
                and fig["download_bytes_after"] > 0
                and down.longest_pause() <= MIGRATION_MAX_PAUSE,
                "; ".join(
                    [
                        *down_errs,
                        f"{sum(n for _, n in down.reads)} bytes, "
                        f"{fig['download_bytes_after']} after the migration, "
                        f"longest pause {fig['download_pause_ms']:.0f} ms, "
                        f"pass_learn by node: {fig['pass_learn']}",
                    ]
                ),
            ),
            Row(
                s,
                f"{desc} udp 100 pkt/s",
                self.layout,
                not common
                and any(ts > t.get("new", math.inf) for ts in udp.got.values())
                and fig["udp_lost"] <= MIGRATION_MAX_UDP_LOST,
                "; ".join(
                    [
                        *common,
                        udp.summary(),
                        f"{fig['udp_lost']} lost (at most {MIGRATION_MAX_UDP_LOST})",
                        f"the switch took {fig['switch_ms']:.0f} ms",
                    ]
                ),
            ),
        ]
        if ranges_row is not None:
            rows.append(ranges_row)
        lost_both = udp.lost(both_window)
        warn = [x for v in both_warnings.values() for x in v]
        rows.append(
            Row(
                s,
                f"{desc} both ready (one address): no warning, no gap",
                self.layout,
                not common and not warn and not both_events and not lost_both,
                "; ".join([*common, ""]) + f"warnings: {warn or 'none'}; Events: "
                f"{[e.get('message') for e in both_events] or 'none'}; "
                f"lost while both ready: {len(lost_both)}",
            )
        )
        rows.append(
            Row(
                s,
                f"{desc} announcement moves",
                self.layout,
                owners.get("new") == to
                and owner == node_name(to)
                and any(n == node_name(to) for n, _ in garps),
                f"elected: {fig['announcer']}; the ToR's neighbour: {owner}; "
                f"GARP: {', '.join(fig['garp']) or 'none'}",
            )
        )
        return rows

    def outside_the_ranges_while_learning(self, s: str, desc: str, w: Workload) -> Row | None:
        """While vm-a is learning (both ready), give its Service source ranges that hold the
        client only; TCP that opens nothing from OUTSIDE_IP must be dropped (drop_source), not
        learned (issue 28): learning comes after the ranges. The ranges go again after."""
        assert self.api is not None and w.lb_ip is not None
        svc = service_object(w)
        ranged = {**svc, "spec": {**svc["spec"], "loadBalancerSourceRanges": [f"{CLIENT_IP}/32"]}}
        errors: list[str] = []
        dropped = 0
        try:
            self.api.api.apply(ranged)
            self.sync_agents()
            before = sum(self.counted("drop_source").values())
            with self.lab.ns_socket(self.client, socket.AF_INET, socket.SOCK_RAW, 6) as raw:
                raw.bind((OUTSIDE_IP, 0))
                for i in range(3):
                    raw.sendto(_tcp_ack(OUTSIDE_IP, w.lb_ip, 41000 + i, 80), (w.lb_ip, 0))
            with contextlib.suppress(TimeoutError):
                wait_for(
                    lambda: sum(self.counted("drop_source").values()) - before >= 3, 2, "drops"
                )
            dropped = sum(self.counted("drop_source").values()) - before
        except (TimeoutError, RuntimeError, OSError) as e:
            errors.append(str(e))
        finally:
            self.api.api.apply(svc)
            with contextlib.suppress(TimeoutError, RuntimeError):
                self.sync_agents()
        return Row(
            s,
            f"{desc} learning: a sender outside the ranges is dropped",
            self.layout,
            not errors and dropped >= 3,
            "; ".join([*errors, f"3 ACKs from {OUTSIDE_IP} (outside): drop_source +{dropped}"]),
        )

    def _ready(self) -> dict[str, list[int]]:
        return {w.name: [self.location[w.name]] for w in self.vms}

    # -- scenario 8: an agent restarts ---------------------------------------------------

    def run_restart(self) -> list[Row]:
        s = "8 agent restart"
        n = RESTART_NODE
        streams = {
            name: UdpStream(
                self.lab.ns_socket(self.client, socket.AF_INET, socket.SOCK_DGRAM),
                (self.workloads[name].lb_ip or "", 53),
            ).start()
            for name in RESTART_STREAMS
        }
        err = ""
        try:
            wait_for(lambda: all(len(u.got) > 20 for u in streams.values()), 5, "the streams")
            rc = self.stop_agent(n)
            self.start_agent(n)
            self.wait_programmed()
            self.sync_agents()
            t_ready = time.monotonic()
            wait_for(
                lambda: all(any(ts > t_ready for ts in u.got.values()) for u in streams.values()),
                5,
                "the streams after the restart",
            )
            if rc not in (0, None):
                err = f"the agent exited with {rc}; "
        except (TimeoutError, RuntimeError) as e:
            err = f"{e}; "
        finally:
            for u in streams.values():
                u.stop()
        rows = []
        for name, u in streams.items():
            where = "the restarted node" if self.location[name] == n else "another node"
            rows.append(
                Row(
                    s,
                    f"{node_name(n)} restarts: udp 100 pkt/s to {self.where(name)} ({where})",
                    self.layout,
                    not err and not u.lost(),
                    err + u.summary(),
                )
            )
        return rows

    # -- scenario 10: a pod sends as a VM's pod IP -----------------------------------------

    def spoof_where(self, attacker: str, victim: str) -> str:
        same = self.location[attacker] == self.location[victim]
        where = (
            f"{self.where(attacker)} as {victim}'s pod IP ({'same' if same else 'another'} node)"
        )
        if self.layout == "kubeovn" and not self.workloads[attacker].port_security:
            return f"{where}, no port security: leaves as {victim}'s LB IP"
        return where

    def run_spoof(self) -> list[Row]:
        """Each attacker sends a TCP SYN, a UDP datagram and an ICMP echo to the external
        server with the victim's pod IP as its source; the server must see none of them as the
        victim's LB IP or pod IP (issue 21)."""
        rows = []
        cap = self.lab.packet_socket(self.server, "eth0")
        try:
            for attacker, victim in SPOOFS:
                v, node = self.workloads[victim], node_name(self.location[attacker])
                assert v.lb_ip is not None
                for kind in SPOOF_KINDS:
                    before = self.counted("drop_spoofed")
                    marker = f"cz-spoof {attacker} {kind}".encode()
                    port = SERVER_UDP if kind == "udp" else SERVER_TCP
                    proto = {"tcp syn": 6, "udp": 17, "icmp echo": 1}[kind]
                    pkt = build_packet(
                        ip_address(v.ip), ip_address(SERVER_IP), proto, 40001, port, marker
                    )
                    drain(cap)
                    raw = self.lab.ns_socket(
                        self.pod_ns(attacker), socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW
                    )
                    with raw:
                        raw.sendto(pkt, (SERVER_IP, 0))
                    seen = sorted(_sources_with(cap, marker, 1.0))
                    bad = [ip for ip in seen if ip in (v.ip, v.lb_ip)]
                    after = self.counted("drop_spoofed")
                    spoofed = {
                        n: after[n] - before.get(n, 0)
                        for n in after
                        if after[n] != before.get(n, 0)
                    }
                    # per-pod devices: the attacker's node drops it (drop_spoofed); behind ovn0
                    # only the attacker's port security (the lab's OVN) can, and without it the
                    # packet leaves as the victim's LB IP: what the agents' warnings are about
                    secured = self.workloads[attacker].port_security
                    if self.layout == "perpod":
                        ok = not bad and spoofed == {node: 1}
                    elif secured:
                        ok = not bad and not spoofed
                    else:
                        ok = bad == [v.lb_ip] and not spoofed
                    rows.append(
                        Row(
                            "10 spoofing",
                            f"{self.spoof_where(attacker, victim)}: {kind}",
                            self.layout,
                            ok,
                            f"the server saw it from {', '.join(seen) or 'nobody'}; "
                            f"drop_spoofed by node: {spoofed or 'none'}"
                            + (
                                ""
                                if self.layout == "perpod"
                                else "; the attacker's port security"
                                if secured
                                else "; behind ovn0 without port security it leaves, as expected"
                            ),
                        )
                    )
        finally:
            cap.close()
        return rows

    def run_source_warnings(self) -> list[Row]:
        """What the agents say about the sources they cannot verify (issue 21): behind ovn0
        each agent once at start, naming it, and the node of a VM whose pod has no port
        security an Event on its Service; on per-pod veths neither."""
        assert self.api is not None
        s, shared = "11 source warnings", self.layout == "kubeovn"
        rows = []
        for n in NODES:
            log = self.agent_log(n)
            said = log.count("source addresses behind ovn0 are not verified")
            starts = sum(1 for line in log.splitlines() if line.startswith("=== "))
            rows.append(
                Row(
                    s,
                    f"{node_name(n)}: "
                    + (
                        "warns at each start that ovn0 hides the sender"
                        if shared
                        else "no such warning"
                    ),
                    self.layout,
                    said == (starts if shared else 0),
                    f"said {said} times in {starts} starts",
                )
            )
        events = [
            e
            for e in self.api.api.events("default")
            if e["involvedObject"]["kind"] == "Service" and "port security" in e["message"]
        ]
        for w in self.vms:
            got = [e for e in events if e["involvedObject"]["name"] == w.name]
            want = shared and not w.port_security
            rows.append(
                Row(
                    s,
                    f"{w.name} ({'no ' if not w.port_security else ''}port security): "
                    + ("a Warning Event on its Service" if want else "no port-security Event"),
                    self.layout,
                    bool(got) == want and all(e["type"] == "Warning" for e in got),
                    "; ".join(f"{e['source'].get('host')}: {e['message']}" for e in got) or "none",
                )
            )
        return rows

    def counted(self, reason: str) -> dict[str, int]:
        """Packets counted under `reason` per node (0 where the reason does not exist)."""
        from cozyebpf.datapath.maps import PinnedMaps

        out = {}
        for n, a in self.agents.items():
            with PinnedMaps.open(a.pin_dir) as m:
                out[node_name(n)] = m.counters().get(reason, {}).get("packets", 0)
        return out

    # -- scenario 9: what the Cilium-like program saw -------------------------------------

    def run_observer(self) -> list[Row]:
        assert self.observer is not None
        rows = []
        by_node: dict[int, list[tuple[Point, int, int, int]]] = {}
        for c in self.observer.counts():
            by_node.setdefault(c[0].node, []).append(c)
        for n, counts in sorted(by_node.items()):
            devs = " + ".join(sorted({p.dev for p, *_ in counts}))
            to_lb = sum(c[1] for c in counts)
            detail = "; ".join(
                f"{p.name}: to LB {a}, from LB {b}, dropped {d}" for p, a, b, d in counts
            )
            rows.append(
                Row(
                    "9 cilium view",
                    f"{node_name(n)} {devs}: no packet to an LB IP",
                    self.layout,
                    to_lb == 0,
                    f"mode {self.observer_mode}; {detail}",
                )
            )
        return rows

    # -- scenario 12: an LB IP that is a node's address ---------------------------------------

    def claim_cases(self) -> list[tuple[str, Callable[[], Check]]]:
        """(case, check) of section 12, with the claim in place."""
        claimed = node_ip(CLAIMED_NODE)

        def refused() -> Check:
            bad, said = [], []
            for n, a in self.agents.items():
                what = (
                    "this node's address on eth0"
                    if n == CLAIMED_NODE
                    else f"node {node_name(CLAIMED_NODE)}'s InternalIP"
                )
                line = f"its LoadBalancer IP {claimed} is {what}"
                if claimed in self.lb_map(a) or line not in self.agent_log(n):
                    bad.append(node_name(n))
                else:
                    said.append(f"{node_name(n)}: {what}")
            return not bad, "; ".join(said) + (f"; programmed or silent on {bad}" if bad else "")

        def event() -> Check:
            api = self.api
            assert api is not None

            def posted() -> list[dict[str, Any]]:  # Events are posted in the background
                return [
                    e
                    for e in api.api.events("default")
                    if e["involvedObject"]["name"] == "vm-claim" and claimed in e["message"]
                ]

            with contextlib.suppress(TimeoutError):
                wait_for(posted, 10, "an Event on vm-claim")
            got = posted()
            ok = bool(got) and all(e["type"] == "Warning" for e in got)
            return ok, "; ".join(f"{e['source'].get('host')}: {e['reason']}" for e in got)

        cases: list[tuple[str, Callable[[], Check]]] = [
            (
                f"vm-claim asks for {node_name(CLAIMED_NODE)}'s address: refused by every agent",
                refused,
            ),
            ("a Warning Event on vm-claim names the address", event),
        ]
        for n in NODES:
            if n != CLAIMED_NODE:
                cases.append(
                    (
                        f"{node_name(n)} -> {node_name(CLAIMED_NODE)}'s address tcp/{NODE_PORT}: "
                        "the node answers",
                        partial(self.check, "tcp", self.node(n), claimed, NODE_PORT, node_ip(n)),
                    )
                )
        cases.append(
            (
                f"client -> {node_name(CLAIMED_NODE)}'s address tcp/{NODE_PORT}: the node answers",
                partial(self.check, "tcp", self.client, claimed, NODE_PORT, CLIENT_IP),
            )
        )
        return cases

    def run_claim(self) -> list[Row]:
        """A whole-IP Service whose LB IP is a node's address (a pool that overlaps the nodes'
        network, a typo): every agent refuses it, and the nodes' own traffic to that address
        (the kubelet's port) still reaches the node (issue 31)."""
        assert self.api is not None
        backend = self.workloads[CLAIM_BACKEND]
        claim = Workload("vm-claim", 98, backend.node, backend.ip, node_ip(CLAIMED_NODE), True)
        self.api.api.apply(service_object(claim))
        self.api.api.apply(
            slice_object(claim.name, claim.ip, claim.ports, [(self.location[CLAIM_BACKEND], "p1")])
        )
        try:
            self.sync_agents()
            return [
                Row("12 reserved addresses", case, self.layout, *check())
                for case, check in self.claim_cases()
            ]
        finally:
            self.api.api.delete("Service", "default", claim.name)
            self.api.api.delete("EndpointSlice", "default", f"{claim.name}-x7k2p")

    def run_all(self) -> list[Row]:
        rows = self.run_paths()
        if self.layout == "kubeovn":
            for name, to in MIGRATIONS:
                rows += self.run_migration(name, to)
        rows += self.run_restart()
        rows += self.run_spoof()
        rows += self.run_source_warnings()
        rows += self.run_observer()
        rows += self.run_claim()
        return rows


def planned_cases(layout: str) -> list[tuple[str, str]]:
    """The (scenario, case) of every row `run_all()` returns for `layout` with the default
    workloads, without building anything (for the tests' ids)."""
    lab = ClusterLab(layout)
    rows = [(s, c) for s, c, _ in lab.path_cases()]
    for name, to in MIGRATIONS if layout == "kubeovn" else ():
        desc = f"{lab.where(name)} -> n{to}"
        rows += [
            ("7 live migration", f"{desc} {what}")
            for what in (
                "tcp from outside keeps going",
                "tcp the VM opened keeps going",
                "tcp download the VM opened keeps going",
                "udp 100 pkt/s",
                "learning: a sender outside the ranges is dropped",
                "both ready (one address): no warning, no gap",
                "announcement moves",
            )
        ]
        lab.location[name] = to
    for s in RESTART_STREAMS:
        where = "the restarted node" if lab.location[s] == RESTART_NODE else "another node"
        rows.append(
            (
                "8 agent restart",
                f"{node_name(RESTART_NODE)} restarts: udp 100 pkt/s to {lab.where(s)} ({where})",
            )
        )
    for attacker, victim in SPOOFS:
        rows += [("10 spoofing", f"{lab.spoof_where(attacker, victim)}: {k}") for k in SPOOF_KINDS]
    shared = layout == "kubeovn"
    rows += [
        (
            "11 source warnings",
            f"{node_name(n)}: "
            + ("warns at each start that ovn0 hides the sender" if shared else "no such warning"),
        )
        for n in NODES
    ]
    for w in lab.vms:
        what = "a Warning Event on its Service" if shared and not w.port_security else None
        rows.append(
            (
                "11 source warnings",
                f"{w.name} ({'no ' if not w.port_security else ''}port security): "
                + (what or "no port-security Event"),
            )
        )
    devs = f"ovn0 + {TUNNEL}" if layout == "kubeovn" else "eth0"
    rows += [("9 cilium view", f"{node_name(n)} {devs}: no packet to an LB IP") for n in NODES]
    rows += [("12 reserved addresses", case) for case, _ in lab.claim_cases()]
    return rows


def format_table(rows: Sequence[Row]) -> str:
    heads = ("scenario", "case", "layout", "result", "detail")
    cells = [(r.scenario, r.case, r.layout, r.result, r.detail) for r in rows]
    widths = [
        max(len(h), *(len(c[i]) for c in cells)) if cells else len(h)
        for i, h in enumerate(heads[:4])
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(heads[:4], widths, strict=True)) + "  detail"]
    for c in cells:
        lines.append(
            "  ".join(x.ljust(w) for x, w in zip(c[:4], widths, strict=True)) + "  " + c[4]
        )
    return "\n".join(lines)


def run_layout(layout: str, **kw: Any) -> tuple[list[Row], dict[str, Any], float]:
    """Build the lab, run every scenario, tear it down: (rows, migration figures, seconds)."""
    t0 = time.monotonic()
    lab = ClusterLab(layout, **kw)
    lab.say(f"agent logs and kubeconfig in {lab.workdir}")
    with lab:
        rows = lab.run_all()
        figures = lab.migration
    return rows, figures, time.monotonic() - t0


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # the lab comes down in its finally/__exit__


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--layout", type=click.Choice([*LAYOUTS, "both"]), default="both", show_default=True)
@click.option(
    "--observer",
    type=click.Choice(["drop", "count"]),
    default="drop",
    show_default=True,
    help="The Cilium-like program drops packets to LB IPs (as the wildcard entry does), or "
    "only counts them (to see what the datapath alone does).",
)
@click.option("--prefix", default="czc", show_default=True, help="Namespace and pin prefix.")
@click.option("--agent-arg", "agent_args", multiple=True, help="An extra argument of `run`.")
@click.option("--json", "as_json", type=click.Path(dir_okay=False), help="Write the rows here.")
def main(
    layout: str, observer: str, prefix: str, agent_args: tuple[str, ...], as_json: str | None
) -> None:
    """The cluster lab of issue 18: three nodes, Kube-OVN-like or per-pod veths, one agent
    per node; prints a table of scenario x case x layout with PASS/FAIL and the migration
    figures. Exits 1 when a row fails. Run as root from the repository root."""
    if os.geteuid() != 0:
        raise click.ClickException("run as root (namespaces, BPF)")
    signal.signal(signal.SIGTERM, _interrupted)
    all_rows: list[Row] = []
    figures: dict[str, dict[str, Any]] = {}
    for lay in LAYOUTS if layout == "both" else (layout,):
        click.secho(f"==> layout {lay}", bold=True)
        rows, fig, secs = run_layout(
            lay, prefix=prefix, agent_args=agent_args, observer=observer, log=click.echo
        )
        click.echo(f"{lay}: {sum(r.ok for r in rows)}/{len(rows)} PASS in {secs:.0f}s")
        all_rows += rows
        if fig:
            figures[lay] = fig
    click.echo()
    click.echo(format_table(all_rows))
    for lay, figs in figures.items():
        for desc, fig in figs.items():
            click.secho(f"\nlive migration ({lay}), {desc}:", bold=True)
            for k, v in fig.items():
                click.echo(f"  {k}: {round(v) if isinstance(v, float) else v}")
    if as_json:
        Path(as_json).write_text(
            json.dumps({"rows": [r.__dict__ for r in all_rows], "migration": figures}, indent=1)
        )
    failed = [r for r in all_rows if not r.ok]
    click.echo(f"\n{len(all_rows) - len(failed)}/{len(all_rows)} PASS")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
