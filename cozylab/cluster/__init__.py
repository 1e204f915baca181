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
- The API: the real control plane (cozylab/kubecp/, issue 35): etcd, kube-apiserver and
  kube-controller-manager of the Kubernetes release cozylab/controlplane/kube/go.mod pins, in
  the namespace czc-cp, on the nodes' segment at 192.0.2.250 (a port of the ToR's br0, so
  the agents reach it over each node's eth0, through their own programs). The lab writes
  what the cluster's other components would: the Nodes and their addresses (the kubelet),
  the VMs' Services as Cozystack's chart writes them and their LB IPs (MetalLB: the Service's
  status), the virt-launcher Pods bound to their nodes (no scheduler) with their status
  (podIP, Running, Ready: the kubelet). Kubernetes' EndpointSlice controller writes the
  slices (nodeName, targetRef, conditions, managed-by, the owner reference); the lab waits
  for what it must write, then moves a canary pod of its own to a new IP and waits until
  every agent programmed it (one watch stream, in order: every write before it was taken).
  The chart's rendered ServiceAccount, ClusterRole and binding (and its EndpointSlice guard)
  are applied; each agent runs with a token of that ServiceAccount from the TokenRequest API,
  bound to a pod of the DaemonSet's on its node, and the CA, bind-mounted at
  /var/run/secrets/kubernetes.io/serviceaccount in a mount namespace of its own, with
  KUBERNETES_SERVICE_HOST/PORT: in-cluster configuration, as in the DaemonSet's pod. Nothing
  in the lab talks to an agent with admin rights (the metrics rows scrape with Prometheus's
  and a tenant's tokens). A test module shares one control plane between its labs; each lab
  removes what it wrote.
- The agents: `cozyebpf run` per node inside the node namespace (nsenter --net, so bpffs pins
  stay visible), with the arguments and environment of deploy/daemonset.yaml, or of the DaemonSet
  `make image-test` renders from the chart (COZYEBPF_RUN_DEVICES=auto,
  node name, health and metrics addresses, ...), COZYEBPF_PIN_DIR=/sys/fs/bpf/<prefix>-nodeN,
  the in-cluster configuration above, plus any extra arguments given. On kubeovn that is all: the
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

What the lab leaves out: a kubelet, the scheduler, kube-proxy and ClusterIP traffic, the node
lifecycle controller (the lab writes what they would); OVS and OVN themselves (flows, logical
switch ports, ACLs, conntrack zones in OVS; port security's MAC and ARP parts), GENEVE, Cilium
itself (only the observer stands in for its programs), kube-proxy and ClusterIP Services, IPv6
(Cozystack patches it out of Kube-OVN), KubeVirt's memory copy and the pod annotation
kubevirt.io/migration-target-ready-timestamp (the agent reads Pods only for port security), a
MetalLB memberlist (elections are computed by the lab from the pods it makes ready), more
than one VLAN or subnet, and rp_filter (0 everywhere, as Cilium sets it on its devices).

Every address is a documentation range (192.0.2.0/24 nodes, 198.51.100.0/24 outside,
203.0.113.0/24 LB IPs) or a private range used only inside these namespaces (10.244.0.0/16
pods, 100.64.0.0/16 join subnet, 100.65.0.0/16 tunnel). Nothing is attached to the machine's
own interfaces and every namespace, pin and process is removed on every exit path.

The package, by seam: `spec` (addresses, names, workloads), `topology` (namespaces, veths,
routes: the ToR, the nodes, the OVS model, the pods), `cni` (Kube-OVN's nftables, OVN's port
security), `api` (what the lab writes to the real API server, the identities), `announcer`
(MetalLB's stand-in), `agents` (a `cozyebpf run` per node), `lab` (`ClusterLab`: all of it up
and down, the probes), `scenarios` (one module per section, each declaring its rows where it
runs them), `rows` (rows and the table they come from), `report` (the table and the command
line). The Cilium-like observer and the traffic streams are cozylab's own (cozylab/cilium.py,
cozylab/traffic.py), shared with the datapath tests."""

from __future__ import annotations

from cozylab.cluster.lab import ClusterLab
from cozylab.cluster.report import format_table, main, planned_cases, run_layout
from cozylab.cluster.rows import Row
from cozylab.cluster.spec import LAYOUTS

__all__ = ["LAYOUTS", "ClusterLab", "Row", "format_table", "main", "planned_cases", "run_layout"]
