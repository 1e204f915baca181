"""The lab's network: namespaces, veths, addresses and routes. The ToR with the client and the
server behind it, three nodes on one L2 segment, and per layout the pods: behind each node's
"OVS" namespace (kubeovn: ovn0, the vxlan tunnel, Kube-OVN's nftables, OVN's port security)
or on per-pod veths in the node (perpod). The package's docstring draws it."""

from __future__ import annotations

import re
import shutil
from collections.abc import Sequence

from cozylab.cluster.cni import kubeovn_ruleset, port_security_ruleset
from cozylab.cluster.spec import (
    CLIENT_GW,
    CLIENT_IP,
    GW_MAC,
    JOIN_GW,
    LAYOUTS,
    LB_POOL,
    LRP_JOIN_MAC,
    NODES,
    OUTSIDE_IP,
    POD_CIDR,
    POD_GW,
    POD_MTU,
    ROUTER_IP,
    ROUTER_MAC,
    SERVER_GW,
    SERVER_IP,
    TUNNEL,
    VNI,
    Workload,
    join_ip,
    node_ip,
    node_mac,
    node_name,
    ovn0_mac,
    perpod_gw,
    tun_ip,
    tun_mac,
)
from cozylab.netns import Lab, run

#: a node's forwarding, as a router without ICMP redirects (the model's and the real-OVN lab's)
NODE_SYSCTLS = [
    ("net.ipv4.ip_forward", "1"),
    ("net.ipv4.conf.all.send_redirects", "0"),
    ("net.ipv4.conf.default.send_redirects", "0"),
    ("net.ipv4.conf.all.accept_redirects", "0"),
    ("net.ipv4.conf.default.accept_redirects", "0"),
]


class Topology:
    """The namespaces of one lab (`prefix`-<what>) and how they are wired for `layout`;
    `location`: the node each workload runs on now (a migration moves it)."""

    def __init__(self, layout: str, prefix: str, workloads: Sequence[Workload]) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
        self.layout = layout
        self.prefix = prefix
        self.workloads = {w.name: w for w in workloads}
        self.location = {w.name: w.node for w in workloads}
        self.lab = Lab(prefix, pods=())
        self.created: list[str] = []

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
        self.remove_pins()

    def remove_pins(self) -> None:
        for n in NODES:
            shutil.rmtree(f"/sys/fs/bpf/{self.prefix}-node{n}", ignore_errors=True)

    def build(self) -> None:
        """The ToR, the client and the server, the nodes, (kubeovn) their OVS, the pods."""
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
        self.sysctl(ns, NODE_SYSCTLS)
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

    def where(self, name: str, at: dict[str, int] | None = None) -> str:
        """A workload's label, on the node it is on now (or in `at`)."""
        return self.workloads[name].label((at or self.location)[name])

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

    def remove_namespaces(self) -> None:
        existing = run("ip", "netns", "list", check=False).stdout.split()
        for ns in reversed(self.created):
            if ns in existing:
                run("ip", "netns", "del", ns, check=False)
        self.created.clear()
