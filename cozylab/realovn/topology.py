"""The real-OVN lab's topology: the model's kubeovn layout with real OVS and OVN in place of its
OVS part (Kube-OVN's controller, a chassis and Kube-OVN's daemon per node, the pods)."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

from cozylab.cilium import CiliumLike, Point
from cozylab.cluster import ClusterLab
from cozylab.cluster.spec import (
    CANARY_LB,
    GW_MAC,
    JOIN_CIDR,
    JOIN_GW,
    LRP_JOIN_MAC,
    NODES,
    POD_CIDR,
    POD_GW,
    POD_MTU,
    ROUTER_IP,
    Workload,
    join_ip,
    node_ip,
    node_mac,
    node_name,
    ovn0_mac,
)
from cozylab.cluster.topology import NODE_SYSCTLS
from cozylab.netns import wait_for
from cozylab.realovn.ovn import Ovn
from cozylab.realovn.spec import (
    DEFAULT_SUBNET,
    JOIN,
    PORT_GROUP_MOVES,
    PRIO_GATEWAY,
    PRIO_NODE,
    PRIO_SUBNET,
    ROUTER,
    UNDERLAY,
    UPLINK,
    iptables_rules,
    missing_prerequisites,
    port_group,
    port_name,
)


class OvnTopology(ClusterLab):
    """The model lab's kubeovn layout with its OVS part replaced by real OVS and OVN: the
    central part and Kube-OVN's controller, the chassis and Kube-OVN's daemon per node, the
    pods (the package docstring). `RealOvnLab` adds the migrations and the rows."""

    def __init__(self, prefix: str = "czo", port_group_move: str = "both-ready", **kw: Any) -> None:
        if port_group_move not in PORT_GROUP_MOVES:
            raise ValueError(f"port_group_move {port_group_move!r}: one of {PORT_GROUP_MOVES}")
        super().__init__("kubeovn", prefix=prefix, **kw)
        self.port_group_move = port_group_move
        #: per migration: the target interface's capture until the switch-over, and what it
        #: received before the VM's RARP
        self.target_caps: dict[str, tuple[str, socket.socket]] = {}
        self.before_rarp: dict[str, int] = {}
        #: per migration: frames delivered there before the activation block, and when it came
        #: (ms after the bind; None: never)
        self.before_block: dict[str, tuple[int, float | None]] = {}
        # sockets need short paths: the run directories live in /tmp, the logs in the workdir
        # (set at bring-up: a lab made only for its table, `planned_cases`, makes no directory)
        self.ovn = Ovn(Path("/tmp") / f"{prefix}-ovn", self.lab.nsenter)
        self.migrating: dict[str, tuple[int, int]] = {}
        self._t0 = time.monotonic()
        self.timings: dict[str, float] = {}
        #: per migration: what OVN's port binding showed at each step
        self.bindings: dict[str, list[str]] = {}

    # -- the central part and Kube-OVN's controller --------------------------------------------

    def cleanup_leftovers(self) -> None:
        stopped = Ovn.stop_leftovers(self.ovn.root)
        if stopped:
            self.say(f"stopped the daemons an earlier run left: {', '.join(stopped)}")
        super().cleanup_leftovers()

    def _router(self) -> None:
        missing = missing_prerequisites()
        if missing:
            raise RuntimeError(
                "the real-OVN lab needs "
                + ", ".join(missing)
                + ": run scripts/setup.sh (it installs openvswitch-switch, ovn-central, "
                "ovn-host, ipset, iptables)"
            )
        self._t0 = time.monotonic()
        super()._router()
        self.ovn.logdir = self.workdir / "ovn"
        self.ovn.start_central()
        self.init_cluster_router()
        self.create_logical_switch(JOIN, f"{JOIN_GW}/16", LRP_JOIN_MAC)
        self.create_logical_switch(DEFAULT_SUBNET, f"{POD_GW}/16", GW_MAC)
        for cidr in (JOIN_CIDR, POD_CIDR):
            self.add_common_routes_for_subnet(cidr)
        # vpc.go handleAddOrUpdateVpc: the cluster router's default route via the join gateway
        self.ovn.nbctl("lr-route-add", ROUTER, "0.0.0.0/0", JOIN_GW)

    def init_cluster_router(self) -> None:
        """init.go initClusterRouter."""
        self.ovn.nbctl(
            "lr-add",
            ROUTER,
            "--",
            "set",
            "logical_router",
            ROUTER,
            "options:mac_binding_age_threshold=300",
            "options:dynamic_neigh_routers=true",
            "external_ids:vendor=kube-ovn",
        )

    def create_logical_switch(self, name: str, gateway: str, mac: str) -> None:
        """ovn-nb-logical_switch.go CreateLogicalSwitch -> ovn-nb.go CreateRouterPortOp."""
        lrp, lsp = f"{ROUTER}-{name}", f"{name}-{ROUTER}"
        self.ovn.nbctl(
            "ls-add",
            name,
            "--",
            "set",
            "logical_switch",
            name,
            "external_ids:vendor=kube-ovn",
            "--",
            "lrp-add",
            ROUTER,
            lrp,
            mac,
            gateway,
            "--",
            "set",
            "logical_router_port",
            lrp,
            f"external_ids:lr={ROUTER}",
            "external_ids:vendor=kube-ovn",
            "--",
            "lsp-add",
            name,
            lsp,
            "--",
            "lsp-set-type",
            lsp,
            "router",
            "--",
            "lsp-set-addresses",
            lsp,
            "router",
            "--",
            "lsp-set-options",
            lsp,
            f"router-port={lrp}",
            "--",
            "set",
            "logical_switch_port",
            lsp,
            f"external_ids:ls={name}",
            "external_ids:vendor=kube-ovn",
        )

    def add_common_routes_for_subnet(self, cidr: str) -> None:
        """subnet.go addCommonRoutesForSubnet: traffic to a subnet is the router's own."""
        self.ovn.nbctl("lr-policy-add", ROUTER, str(PRIO_SUBNET), f"ip4.dst == {cidr}", "allow")

    def handle_add_node(self, n: int) -> None:
        """node.go handleAddNode (the node's port on join, the 30000 policy) and subnet.go
        createPortGroupForDistributedSubnet + addPolicyRouteForDistributedSubnet."""
        lsp, pg = f"node-{node_name(n)}", port_group(n)
        ext = ["external_ids:vendor=kube-ovn", f"external_ids:node={node_name(n)}"]
        self.ovn.nbctl(
            "lsp-add",
            JOIN,
            lsp,
            "--",
            "lsp-set-addresses",
            lsp,
            f"{ovn0_mac(n)} {join_ip(n)}",
            "--",
            "set",
            "logical_switch_port",
            lsp,
            f"external_ids:ls={JOIN}",
            "external_ids:vendor=kube-ovn",
            "--",
            "pg-add",
            pg,
            "--",
            "set",
            "port_group",
            pg,
            f"external_ids:subnet={DEFAULT_SUBNET}",
            *ext,
        )
        self.ovn.nbctl(
            "--",
            "--id=@p",
            "create",
            "logical_router_policy",
            f"priority={PRIO_NODE}",
            f'match="ip4.dst == {node_ip(n)}"',
            "action=reroute",
            f"nexthops={join_ip(n)}",
            *ext,
            "external_ids:address-family=ipv4",
            "--",
            "add",
            "logical_router",
            ROUTER,
            "policies",
            "@p",
        )
        self.ovn.nbctl(
            "lr-policy-add",
            ROUTER,
            str(PRIO_GATEWAY),
            f"ip4.src == ${pg}_ip4",
            "reroute",
            join_ip(n),
        )

    def create_logical_switch_port(self, w: Workload) -> None:
        """ovn-nb-logical_switch_port.go CreateLogicalSwitchPort (port security only for a pod
        with the annotation) and pod.go reconcileRouteSubnets (its node's port group)."""
        p = port_name(w)
        args = [
            "lsp-add",
            DEFAULT_SUBNET,
            p,
            "--",
            "lsp-set-addresses",
            p,
            f"{w.mac} {w.ip}",
            "--",
            "set",
            "logical_switch_port",
            p,
            f"external_ids:pod=default/{w.name}",
            f"external_ids:ls={DEFAULT_SUBNET}",
            "external_ids:vendor=kube-ovn",
        ]
        if w.port_security:
            args += ["--", "lsp-set-port-security", p, f"{w.mac} {w.ip}"]
        self.ovn.nbctl(*args)
        self.move_port_group(w, None, self.location[w.name])

    def move_port_group(self, w: Workload, frm: int | None, to: int) -> None:
        """pod.go reconcileRouteSubnets: RemovePortFromPortGroups, then the node's group."""
        uid = self.ovn.nbctl("get", "logical_switch_port", port_name(w), "_uuid")
        args = []
        if frm is not None:
            args += ["remove", "port_group", port_group(frm), "ports", uid, "--"]
        self.ovn.nbctl(*args, "add", "port_group", port_group(to), "ports", uid)

    # -- a node: the chassis and Kube-OVN's daemon ------------------------------------------

    def _node(self, n: int) -> None:
        ns = self.add_ns(self.node(n))
        self.sysctl(ns, NODE_SYSCTLS)
        self.lab.veth(
            ns, UNDERLAY, f"02:00:c0:00:22:{n:02x}", self.tor, f"sw{n}", f"02:00:c0:00:12:{n:02x}"
        )
        self.batch(self.tor, [f"link set sw{n} master br0", f"link set sw{n} up"])
        # its peer is an OVS netdev port, read with a packet socket: no checksum left undone
        self.lab.exec(self.tor, "ethtool", "-K", f"sw{n}", "tx", "off")
        self.ovn.start_vswitch(n, ns)
        self.ovn.vsctl(
            n,
            "add-br",
            UPLINK,
            "--",
            "set",
            "bridge",
            UPLINK,
            "datapath_type=netdev",
            f"other-config:hwaddr={node_mac(n)}",
            "--",
            "add-port",
            UPLINK,
            UNDERLAY,
        )
        self._wait_link(ns, UPLINK)
        self.batch(
            ns,
            [
                f"link set {UNDERLAY} up",
                f"addr add {node_ip(n)}/24 dev {UPLINK}",
                f"link set {UPLINK} up",
                f"route add default via {ROUTER_IP}",
            ],
        )
        self.ovn.vsctl(
            n,
            "add-br",
            "br-int",
            "--",
            "set",
            "bridge",
            "br-int",
            "datapath_type=netdev",
            "fail-mode=secure",
            "other-config:disable-in-band=true",
        )
        self.ovn.start_controller(n, ns)
        self.set_iptables(n)

    def _wait_link(self, ns: str, dev: str) -> None:
        wait_for(
            lambda: self.lab.exec(ns, "ip", "link", "show", dev, check=False).returncode == 0,
            10,
            f"{dev} in {ns}",
        )

    def set_iptables(self, n: int) -> None:
        """gateway_linux.go setIPSet + setIptables (v4)."""
        ipset, rules = iptables_rules(n)
        self.lab.exec(self.node(n), "ipset", "restore", input=ipset)
        self.lab.exec(self.node(n), "iptables-restore", "-w", input=rules)

    def _ovs(self, n: int) -> None:
        self.handle_add_node(n)
        self.configure_node_nic(n)
        self.reconcile_routers(n)

    def configure_node_nic(self, n: int) -> None:
        """ovs_linux.go configureNodeNic: ovn0, an internal port of br-int bound to the join
        switch's node-<name>; configureNic: the node annotation's MAC, the pod MTU, the join
        address, txqueuelen 1000, the join subnet's route."""
        ns = self.node(n)
        self.ovn.vsctl(
            n,
            "--may-exist",
            "add-port",
            "br-int",
            "ovn0",
            "--",
            "set",
            "interface",
            "ovn0",
            "type=internal",
            f"external_ids:iface-id=node-{node_name(n)}",
            f"external_ids:ip={join_ip(n)}",
        )
        self._wait_link(ns, "ovn0")
        self.batch(
            ns,
            [
                f"link set ovn0 address {ovn0_mac(n)} mtu {POD_MTU} txqueuelen 1000",
                f"addr add {join_ip(n)}/16 dev ovn0",
                "link set ovn0 up",
            ],
        )

    def reconcile_routers(self, n: int) -> None:
        """controller_linux.go reconcileRouters / routeDiff: each subnet of the cluster router
        via the join gateway, from the node's InternalIP."""
        self.batch(
            self.node(n),
            [f"route replace {POD_CIDR} via {JOIN_GW} dev ovn0 src {node_ip(n)} proto static"],
        )

    def _ovs_routes(self, n: int) -> None:
        """No routes to write (OVN routes); wait as configureNodeNic does: the port bound, the
        join gateway answering through it."""
        self.wait_port_up(f"node-{node_name(n)}")
        wait_for(lambda: self.ping(self.node(n), JOIN_GW), 20, f"{node_name(n)}'s ovn0 to work")

    def wait_port_up(self, port: str, timeout: float = 20) -> None:
        wait_for(
            lambda: self.ovn.nbctl("get", "logical_switch_port", port, "up") == "true",
            timeout,
            f"OVN to bind {port} (up=true)",
        )

    # -- pods ---------------------------------------------------------------------------------

    def _workload(self, w: Workload) -> None:
        self.create_logical_switch_port(w)
        super()._workload(w)  # -> _ovs_port (configure_nic), _pod_link
        self.wait_port_up(port_name(w))

    def _ovs_port(self, n: int, w: Workload, pod_dev: str) -> None:
        self.configure_nic(n, w, pod_dev)

    def configure_nic(
        self, n: int, w: Workload, pod_dev: str, pns: str | None = None, bind: bool = True
    ) -> None:
        """ovs_linux.go configureNic: a veth <name>_h (node) / `pod_dev` (pod, in namespace
        `pns`, the workload's by default), the pod MTU, tx checksum off on the pod end
        (TurnOffNicTxChecksum, on a userspace datapath), then (`bind`) `bind_nic`."""
        node, pns = self.node(n), pns or self.pod_ns(w.name)
        self.lab.veth(node, w.ovs_dev, f"02:00:0a:f5:{w.index:02x}:{n:02x}", pns, pod_dev, w.mac)
        self.batch(node, [f"link set {w.ovs_dev} mtu {POD_MTU}", f"link set {w.ovs_dev} up"])
        self.batch(pns, [f"link set {pod_dev} mtu {POD_MTU}"])
        self.lab.exec(pns, "ethtool", "-K", pod_dev, "tx", "off")
        if bind:
            self.bind_nic(n, w)

    def bind_nic(self, n: int, w: Workload) -> None:
        """configureNic: the node end <name>_h a port of br-int with iface-id = the logical
        port's name (what makes ovn-controller claim the port on this chassis)."""
        self.ovn.vsctl(
            n,
            "--may-exist",
            "add-port",
            "br-int",
            w.ovs_dev,
            "--",
            "set",
            "interface",
            w.ovs_dev,
            f"external_ids:iface-id={port_name(w)}",
            "external_ids:vendor=kube-ovn",
            f"external_ids:pod_name={w.name}",
            "external_ids:pod_namespace=default",
            f"external_ids:ip={w.ip}",
        )

    def _pod_link(self, w: Workload, dev: str = "eth0") -> list[str]:
        """The pod's address and default route; its gateway's MAC is learned by ARP from
        OVN's router port (the model sets a permanent entry instead)."""
        return [
            f"link set {dev} mtu {POD_MTU}",
            f"addr add {w.ip}/16 dev {dev}",
            f"link set {dev} up",
            f"route add default via {POD_GW} dev {dev}",
        ]

    def _observer(self) -> None:
        """The Cilium-like program on ovn0 (ingress and egress); no tunnel netdev here."""
        points = [Point(self.node(n), "ovn0", ("ingress", "egress"), n) for n in NODES]
        lbs = {lb: 0 for lb in [w.lb_ip for w in self.vms if w.lb_ip] + [CANARY_LB]}
        self.observer = CiliumLike(self.lab, points, lbs, self.observer_mode == "drop")
        self.timings["bring-up (topology, daemons, ports)"] = time.monotonic() - self._t0

    def observed_devices(self) -> str:
        return "ovn0"
