"""The cluster lab on Kube-OVN's real dataplane: Open vSwitch 3.1 and OVN 23.03 (Debian's
packages, userspace datapath), three chassis, configured as Kube-OVN's controller and daemon
configure them (issue 27; `make real-ovn-lab`, `python -m cozylab.realovn`,
tests/datapath/test_real_ovn.py). docs/real-ovn-lab.md has the reading behind every step, the
traps and what this lab proves next to the model (cozylab/cluster/, layout "kubeovn").

    czo-client / czo-server / czo-tor: the model lab's (ToR bridge br0 192.0.2.254/24, the
    LB pool on-link, the outside client and server); each node's port sw<N> of br0 has tx
    checksum offload off (its peer is an OVS netdev port, trap 1 of the doc)
          |                          |                          |
    czo-node1 phy0 (veth)       czo-node2 ...              czo-node3 ...
      OVS bridge "eth0" (netdev): phy0 + its own port, the tap eth0 = the node's uplink,
        192.0.2.N/24, MAC node_mac(N), default via 192.0.2.254: the agent's uplink
        (COZYEBPF_RUN_DEVICES=auto picks it), MetalLB's speaker, OVN's tunnel endpoint
      OVS bridge br-int (netdev, fail-mode secure): ovn0 (internal port, a tap here,
        iface-id node-nodeN, 100.64.0.N+1/16, MTU 1400) and one <pod>_h per pod
      ovsdb-server, ovs-vswitchd, ovn-controller: run in the node's namespace, each with its
        own run directory; geneve is built by ovs-vswitchd and leaves through "eth0" -> phy0
      iptables/ipset: Kube-OVN's v4 rules (natOutgoing among them), written with iptables-nft
    central (no namespace): the NB and SB ovsdb-servers on unix sockets, ovn-northd
    pods: their own namespaces, eth0 (veth, MTU 1400, tx checksum off) <-> <pod>_h in br-int

What follows Kube-OVN (kubeovn/kube-ovn, v1.14.41 c76f88953b61 and master 1533681d7a6b; the
functions named are where each step is read from, one function here per step):
- `init_cluster_router`: pkg/controller/init.go initClusterRouter.
- `create_logical_switch`: pkg/ovs/ovn-nb-logical_switch.go CreateLogicalSwitch ->
  pkg/ovs/ovn-nb.go CreateLogicalPatchPort / CreateRouterPortOp (switch, router port, router
  type switch port), for the subnets of init.go initNodeSwitch (join) and
  initDefaultLogicalSwitch (ovn-default).
- `add_common_routes_for_subnet`: pkg/controller/subnet.go addCommonRoutesForSubnet (31000).
- the default route: pkg/controller/vpc.go handleAddOrUpdateVpc.
- `handle_add_node`: pkg/controller/node.go handleAddNode (node-<name> on join, 30000) and
  subnet.go createPortGroupForDistributedSubnet + addPolicyRouteForDistributedSubnet (the
  port group ovn.default.<node>, 29000 to the node's join IP).
- `create_logical_switch_port`: pkg/controller/pod.go reconcileAllocateSubnets ->
  pkg/ovs/ovn-nb-logical_switch_port.go CreateLogicalSwitchPort (addresses, port security
  when the pod has `ovn.kubernetes.io/port_security: "true"`), and pod.go
  reconcileRouteSubnets (the port joins its node's port group).
- `configure_node_nic`: pkg/daemon/ovs_linux.go configureNodeNic / configureNic (ovn0).
- `configure_nic`: pkg/daemon/ovs_linux.go configureNic (a pod's veth; tx checksum off on a
  userspace datapath, TurnOffNicTxChecksum).
- `reconcile_routers`: pkg/daemon/controller_linux.go reconcileRouters / routeDiff.
- `set_iptables`: pkg/daemon/gateway_linux.go setIPSet + setIptables (v4).
- the chassis: dist/images/start-ovs.sh (random system-id, hostname = node name) and
  pkg/daemon/config.go (ovn-encap-ip; the MTU: 1500 - 100 for geneve = 1400).
- `set_migrate_options`, `reset_migrate_options`, `clean_migrate_options`:
  pkg/controller/kubevirt.go handleAddOrUpdateVMIMigration ->
  ovn-nb-logical_switch_port.go SetLogicalSwitchPortMigrateOptions
  (`requested-chassis=<src>,<dst>`, `activation-strategy=rarp`),
  ResetLogicalSwitchPortMigrateOptions (`requested-chassis=<dst>`) and pod.go handleDeletePod
  -> CleanLogicalSwitchPortMigrateOptions. The VM's port moves to the target node's port
  group when the target pod is routed (pod.go reconcileRouteSubnets; read, not checked
  against a cluster): here at "both ready", or at the switch-over with
  `port_group_move="switch"` (`--port-group-move switch`), what the model does.

What it keeps from the model lab (it is a subclass of cozylab.cluster.ClusterLab and replaces
only its OVS part: of the topology (cozylab/cluster/topology.py) `_router` (extended),
`_node`, `_ovs`, `_ovs_routes`, `_ovs_port`, `_pod_link`, `_workload`, `move_link`,
`cleanup_leftovers`; of the lab (cozylab/cluster/lab.py) `set_endpoints`, `_observer`,
`observed_devices`, `down`, `table` and `run_all` (extended), and `migration_scenario`
(`RealMigration`, cozylab/cluster/scenarios/migration.py's `Migration` with one row more);
when cozylab/cluster/ changes shape, these are the hooks this package needs): the ToR, the
client and server, the real control plane (cozylab/kubecp/: kube-apiserver, its
EndpointSlice controller) and what the lab writes to it, one `cozyebpf run` per node with the
DaemonSet's environment and in-cluster credentials, the MetalLB-like speakers and election,
the workloads, streams and
every scenario with its rows and expectations, plus the rows of OVN's port security (MAC and
ARP, which the model does not have) and of the real dataplane, declared as the model's are
(`Case`s in `Group`s: `table()` runs them and `planned_cases` names them). The Cilium-like
observer (cozylab/cilium.py) sits on ovn0 only: the userspace datapath has no tunnel netdev
(no genev_sys_6081), so the model's tunnel point has no counterpart here.

What it leaves out: Kube-OVN's controller and daemon themselves (their writes are replayed as
read), the kernel datapath (ovn0 here is a tap with native XDP; on a node it is an
`openvswitch` internal port, generic XDP only; conntrack of OVN in ovs-vswitchd, not in the
kernel; geneve never crosses the uplink's hooks here), Cilium and MetalLB themselves,
KubeVirt's memory copy (the switch-over is a renamed link and a RARP), IPv6.

Every daemon is a child of this process, started with a pidfile under /tmp/<prefix>-ovn and
stopped by its pid (controllers first, databases last) on every exit path; a run killed
before that is cleaned up by the next one with the same prefix (pidfiles whose process still
names that directory). Addresses: the model lab's (documentation ranges, 10.244.0.0/16,
100.64.0.0/16), only inside these namespaces.

The package, by seam (as cozylab/cluster/): `spec` (names, constants, Kube-OVN's iptables
rules, the RARP frame), `ovn` (the daemons and databases: `Ovn`), `topology` (`OvnTopology`:
the model's hooks for the central part and Kube-OVN's controller, a chassis and Kube-OVN's
daemon per node, the pods), `lab` (`RealOvnLab`: the migrations the Kube-OVN/KubeVirt way with
`RealMigration`, OVN's port security rows, the real dataplane's rows, the run), `report`
(`planned_cases`, the command line).
"""

from cozylab.realovn.lab import RealOvnLab
from cozylab.realovn.ovn import Ovn
from cozylab.realovn.report import main, planned_cases

__all__ = ["Ovn", "RealOvnLab", "main", "planned_cases"]
