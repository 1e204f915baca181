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
when cozylab/cluster/ changes shape, these are the hooks this module needs): the ToR, the
client and server, the real control plane (cozylab/kubecp.py: kube-apiserver, its
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
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import click

from cozylab.cilium import CiliumLike, Point
from cozylab.cluster import ClusterLab, Row, format_table
from cozylab.cluster.announcer import _arp, _mac
from cozylab.cluster.report import _interrupted
from cozylab.cluster.rows import Case, Check, Group, names, run_groups
from cozylab.cluster.scenarios import migration
from cozylab.cluster.spec import (
    CANARY_LB,
    CLIENT_IP,
    GW_MAC,
    JOIN_CIDR,
    JOIN_GW,
    LRP_JOIN_MAC,
    NODES,
    POD_CIDR,
    POD_GW,
    POD_MTU,
    ROUTER_IP,
    SERVER_IP,
    SERVER_TCP,
    Workload,
    join_ip,
    node_ip,
    node_mac,
    node_name,
    ovn0_mac,
)
from cozylab.cluster.topology import NODE_SYSCTLS
from cozylab.netns import drain, run, wait_for

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


@dataclasses.dataclass
class Daemon:
    name: str
    proc: subprocess.Popen[str]
    pidfile: Path


class Ovn:
    """The OVS and OVN daemons of the lab, each a child of this process with a pidfile under
    `root` (one directory per node, `central` for NB, SB and northd), and their clients."""

    def __init__(
        self, root: Path, nsenter: Callable[[str], list[str]], logdir: Path | None = None
    ) -> None:
        self.root = root
        #: the daemons' logs (kept after the run; `root`, with the sockets, is removed)
        self.logdir = logdir or root
        self.nsenter = nsenter
        self.daemons: list[Daemon] = []
        self.central = root / "central"
        self.nb = f"unix:{self.central / 'nb.sock'}"
        self.sb = f"unix:{self.central / 'sb.sock'}"

    @staticmethod
    def stop_leftovers(root: Path) -> list[str]:
        """Stop the daemons of an earlier run that used `root` (its pidfiles; a pid counts
        only while its command line still names `root`), remove `root`. Returns what it
        stopped."""
        stopped = []
        for pidfile in sorted(root.glob("*/*.pid")) if root.is_dir() else []:
            with contextlib.suppress(ValueError, OSError):
                pid = int(pidfile.read_text().split()[0])
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                if str(root).encode() in cmdline:
                    os.kill(pid, signal.SIGTERM)
                    stopped.append(f"{pidfile.name}:{pid}")
                    with contextlib.suppress(TimeoutError):
                        wait_for(lambda pid=pid: _gone(pid), 5, f"pid {pid} to exit")  # type: ignore[misc]
                    if not _gone(pid):
                        os.kill(pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)
        return stopped

    def start(self, name: str, ns: str | None, argv: Sequence[str], **env: str) -> Daemon:
        """A daemon in the foreground, as a child (its pidfile `<dir>/<name>.pid`, its log
        `<dir>/<name>.log`), killed with this process's thread if that dies (setpriv)."""
        rundir = Path(env.get("OVS_RUNDIR") or self.central)
        pidfile = rundir / f"{name}.pid"
        logs = self.logdir / rundir.name
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / f"{name}.log"
        cmd = [
            *(self.nsenter(ns) if ns else []),
            *(["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []),
            *argv,
            "--no-chdir",
            f"--pidfile={pidfile}",
            f"--log-file={log}",
        ]
        with (logs / f"{name}.out").open("a") as out:
            proc = subprocess.Popen(
                cmd,
                text=True,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
            )
        daemon = Daemon(name, proc, pidfile)
        self.daemons.append(daemon)

        def started() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited ({proc.returncode}) at start: {' '.join(cmd)}\n"
                    + _tail(log)
                    + _tail(logs / f"{name}.out")
                )
            return pidfile.exists()

        wait_for(started, 15, f"{name} to write {pidfile}")
        return daemon

    def stop(self) -> None:
        """Every daemon by its pid, last started first (controllers before databases)."""
        for d in reversed(self.daemons):
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGTERM)
                try:
                    d.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    d.proc.kill()
                    d.proc.wait()
        self.daemons.clear()

    # -- central --------------------------------------------------------------------------

    def start_central(self) -> None:
        self.central.mkdir(parents=True, exist_ok=True)
        for db in ("nb", "sb"):
            path = self.central / f"{db}.db"
            run("ovsdb-tool", "create", str(path), str(OVN_SCHEMAS[db]))
            self.start(
                f"{db}db",
                None,
                [
                    "ovsdb-server",
                    str(path),
                    f"--remote=punix:{self.central / f'{db}.sock'}",
                    f"--unixctl={self.central / f'{db}.ctl'}",
                ],
            )
        for db in ("nb", "sb"):
            wait_for(lambda db=db: (self.central / f"{db}.sock").exists(), 10, f"the {db} socket")  # type: ignore[misc]
        self.start(
            "northd",
            None,
            [
                "ovn-northd",
                f"--ovnnb-db={self.nb}",
                f"--ovnsb-db={self.sb}",
                f"--unixctl={self.central / 'northd.ctl'}",
            ],
            OVN_RUNDIR=str(self.central),
        )

    def nbctl(self, *args: str) -> str:
        return run("ovn-nbctl", f"--db={self.nb}", "--timeout=20", *args).stdout.strip()

    def sbctl(self, *args: str) -> str:
        return run("ovn-sbctl", f"--db={self.sb}", "--timeout=20", *args).stdout.strip()

    # -- a chassis --------------------------------------------------------------------------

    def node_dir(self, n: int) -> Path:
        return self.root / node_name(n)

    def vsctl(self, n: int, *args: str) -> str:
        db = f"unix:{self.node_dir(n) / 'db.sock'}"
        return run("ovs-vsctl", f"--db={db}", "--timeout=20", *args).stdout.strip()

    def start_vswitch(self, n: int, ns: str) -> None:
        """ovsdb-server and ovs-vswitchd of node n, in its namespace, with their own run
        directory (trap 2)."""
        d = self.node_dir(n)
        d.mkdir(parents=True, exist_ok=True)
        run("ovsdb-tool", "create", str(d / "conf.db"), str(OVS_SCHEMA))
        env = {"OVS_RUNDIR": str(d), "OVS_DBDIR": str(d), "OVN_RUNDIR": str(d)}
        self.start(
            "ovsdb",
            ns,
            [
                "ovsdb-server",
                str(d / "conf.db"),
                f"--remote=punix:{d / 'db.sock'}",
                f"--unixctl={d / 'ovsdb.ctl'}",
            ],
            **env,
        )
        wait_for(lambda: (d / "db.sock").exists(), 10, f"{node_name(n)}'s db socket")
        self.vsctl(n, "--no-wait", "init")
        self.start(
            "vswitchd",
            ns,
            ["ovs-vswitchd", f"unix:{d / 'db.sock'}", f"--unixctl={d / 'vswitchd.ctl'}"],
            **env,
        )

    def start_controller(self, n: int, ns: str) -> None:
        """start-ovs.sh: a random system-id, hostname = the node's name (requested-chassis
        names it), geneve, the node's address as the tunnel endpoint; then ovn-controller."""
        d = self.node_dir(n)
        self.vsctl(
            n,
            "set",
            "open",
            ".",
            f"external_ids:system-id={uuid.uuid4()}",
            f"external_ids:hostname={node_name(n)}",
            f"external_ids:ovn-remote={self.sb}",
            "external_ids:ovn-encap-type=geneve",
            f"external_ids:ovn-encap-ip={node_ip(n)}",
            "external_ids:ovn-bridge-datapath-type=netdev",
        )
        env = {"OVS_RUNDIR": str(d), "OVN_RUNDIR": str(d)}
        self.start("ovn-controller", ns, ["ovn-controller", f"unix:{d / 'db.sock'}"], **env)


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _tail(path: Path, chars: int = 1500) -> str:
    with contextlib.suppress(OSError):
        return path.read_text()[-chars:]
    return ""


class RealMigration(migration.Migration):
    """The model's migration (cozylab/cluster/scenarios/migration.py) with a row more: what
    OVN delivered to the target pod's interface before the VM's RARP once the target's
    activation block was in (with activation-strategy=rarp nothing; `RealOvnLab.move_link`
    counts it at the switch-over). What came before the block (OVN installs the port's
    delivery one round ahead of its block, see `RealOvnLab.wait_activation_block`) is said,
    not judged."""

    def group(self) -> Group:
        g = super().group()
        name = (
            f"{self.desc} before its RARP the target gets nothing once OVN blocks it "
            "(activation-strategy=rarp)"
        )
        return dataclasses.replace(
            g, cases=[*g.cases, Case(migration.SCENARIO, name, self._before_rarp)]
        )

    def _before_rarp(self) -> Check:
        lab = self.lab
        assert isinstance(lab, RealOvnLab)
        got = lab.before_rarp.get(self.desc)
        if got is None:
            return False, "; ".join([*self.errors, "not counted: no switch-over ran"])
        early, block_ms = lab.before_block.get(self.desc, (0, None))
        if block_ms is None:
            return False, f"OVN's activation block never appeared on the target; {got} frames"
        return (
            got == 0,
            f"{got} frames to the VM on the target pod's interface from the block to the "
            f"switch-over; {early} before it (the block came {block_ms:.0f} ms after the bind)",
        )


class RealOvnLab(ClusterLab):
    """The model lab's kubeovn layout with its OVS part replaced by real OVS and OVN (the
    module docstring)."""

    migration_scenario: ClassVar[type[migration.Migration]] = RealMigration

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

    # -- live migration, the Kube-OVN/KubeVirt way ----------------------------------------------

    def binding(self, w: Workload) -> str:
        """The SB port binding of `w`'s port: its chassis and additional chassis (by
        hostname, the node's name) and its options."""
        chassis = json.loads(
            self.ovn.sbctl("--format=json", "--columns=_uuid,name,hostname", "list", "chassis")
        )["data"]
        # rows point at a chassis by its row's UUID, the activation names its system-id
        names = {key: row[2] for row in chassis for key in (row[0][1], row[1])}
        data = json.loads(
            self.ovn.sbctl(
                "--format=json",
                "--columns=chassis,additional_chassis,options",
                "find",
                "port_binding",
                f"logical_port={port_name(w)}",
            )
        )["data"][0]

        def hosts(v: Any) -> list[str]:
            refs = [v[1]] if v[0] == "uuid" else [u[1] for u in v[1]]
            return [names.get(u, u) for u in refs]

        opts = dict(data[2][1])
        activated = opts.pop("additional-chassis-activated", None)
        return f"chassis={hosts(data[0])} additional={hosts(data[1])} options={opts}" + (
            f" (activated: {names.get(activated, activated)})" if activated else ""
        )

    def target_ns(self, w: Workload) -> str:
        """The target virt-launcher pod's namespace during a migration."""
        return self.ns(f"{w.name}-t")

    def set_endpoints(
        self, w: Workload, nodes: Sequence[int], pods: Sequence[str] = (), wait: bool = True
    ) -> None:
        """Kube-OVN's controller acts where the lab writes the pods: the target pod scheduled
        ("both ready": MigrationScheduling), the source pod done ("new ready")."""
        src = self.location[w.name]
        if len(nodes) == 2 and w.name not in self.migrating:
            self.migration_scheduling(w, src, nodes[1])
        elif w.name in self.migrating and list(nodes) == [src]:
            self.clean_migrate_options(w)
        super().set_endpoints(w, nodes, pods, wait)

    def migration_scheduling(self, w: Workload, src: int, dst: int) -> None:
        """kubevirt.go handleAddOrUpdateVMIMigration, MigrationScheduling: the target pod's
        SetLogicalSwitchPortMigrateOptions, set once the target pod has a node, before the CNI
        makes its interface; then that interface (`eth1`, up, in a namespace of its own as the
        target virt-launcher pod's, with the VM's MAC and no address) bound to the same port on
        the target's br-int; the target pod routed (reconcileRouteSubnets): the port moves to
        the target's port group. A packet socket on `eth1`, open before it is bound, counts
        what OVN delivers there before the VM's RARP: before the activation block is in
        (`wait_activation_block`: said, not judged) and after (with activation-strategy=rarp:
        nothing).
        In the other order (bound first, as this lab did until 2 December 2026) the target's
        ovn-controller finds a second interface of a port that requests no chassis and takes
        the binding for some 20 ms ("Changing chassis for lport"): the row saw 4-11 frames
        there in 3 runs of 6."""
        self.migrating[w.name] = (src, dst)
        steps = self.bindings.setdefault(f"{w.name} n{src}->n{dst}", [])
        self.set_migrate_options(w, src, dst)
        target = self.add_ns(self.target_ns(w))
        self.configure_nic(dst, w, "eth1", target, bind=False)
        self.batch(target, [f"link set eth1 address {w.mac}", "link set eth1 up"])
        self.target_caps[w.name] = (
            f"{w.label(src)} -> n{dst}",
            self.lab.packet_socket(target, "eth1"),
        )
        t = time.monotonic()
        self.bind_nic(dst, w)
        self.wait_activation_block(dst, w, t)
        if self.port_group_move == "both-ready":
            self.move_port_group(w, src, dst)
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: "additional=['" in self.binding(w), 5, "the two-chassis binding")
        steps.append(f"scheduling: {self.binding(w)}")

    def wait_activation_block(self, n: int, w: Workload, since: float) -> None:
        """Wait until node n's br-int holds the activation block of `w`'s port (the flow that
        sends its RARP to ovn-controller; the drops of everything else to and from the port come
        in the same round), then count and drop what the target's capture got before it.

        ovn-controller (23.03.1 here; the same code in main) installs a port's flows in the
        round that claims it and its block in the next: physical.c adds the block only once the
        port's Southbound row names this chassis as additional chassis, which the claim makes
        true a round later. `ovs-ofctl monitor` showed the delivery flow (table 65,
        `output:<port>`) one batch ahead of the block in each of the 7 migrations it recorded.
        Under load that round is long enough for a frame or more to reach the target's
        interface (seen in CI: 1-5). QEMU on the target has not started the VM then: the frames
        are lost, as they would be without the option."""
        desc, cap = self.target_caps[w.name]
        mgmt = f"unix:{self.ovn.node_dir(n) / 'br-int.mgmt'}"

        def blocked() -> bool:
            """Both ends of the block: the RARP flow from the port (table 0) and the drop of
            what goes to it (table 65, OFTABLE_LOG_TO_PHY: the last flow of that batch)."""
            ofport = self.ovn.vsctl(n, "get", "interface", w.ovs_dev, "ofport")
            if not ofport.isdigit() or int(ofport) <= 0:
                return False
            rarp = run("ovs-ofctl", "dump-flows", mgmt, f"table=0,rarp,in_port={ofport}").stdout
            out = run("ovs-ofctl", "dump-flows", mgmt, "table=65").stdout.splitlines()
            return "controller(" in rarp and any(
                "priority=1000" in f and f.endswith("actions=drop") for f in out
            )

        try:
            wait_for(blocked, 5, "the target's activation block")
            ms: float | None = (time.monotonic() - since) * 1000
        except TimeoutError:
            ms = None
        early = sum(1 for f in _queued(cap) if f[:6] == _mac(w.mac) or _dst(f) == w.ip)
        self.before_block[desc] = (early, ms)

    def set_migrate_options(self, w: Workload, src: int, dst: int) -> None:
        """ovn-nb-logical_switch_port.go SetLogicalSwitchPortMigrateOptions. `--wait=hv`: the
        target's ovn-controller knows the options before the lab binds the target's interface
        (as the target pod's CNI call comes after the controller's update)."""
        self.ovn.nbctl(
            "--wait=hv",
            "set",
            "logical_switch_port",
            port_name(w),
            f'options:requested-chassis="{node_name(src)},{node_name(dst)}"',
            "options:activation-strategy=rarp",
        )

    def reset_migrate_options(self, w: Workload, to: int) -> None:
        """ResetLogicalSwitchPortMigrateOptions (MigrationSucceeded: the target)."""
        p = port_name(w)
        self.ovn.nbctl(
            "set",
            "logical_switch_port",
            p,
            f"options:requested-chassis={node_name(to)}",
            "--",
            "remove",
            "logical_switch_port",
            p,
            "options",
            "activation-strategy",
        )

    def clean_migrate_options(self, w: Workload) -> None:
        """pod.go handleDeletePod -> CleanLogicalSwitchPortMigrateOptions (the source pod
        deleted after the migration)."""
        p = port_name(w)
        src, dst = self.migrating.pop(w.name)
        steps = self.bindings[f"{w.name} n{src}->n{dst}"]
        steps.append(f"succeeded (requested-chassis={node_name(dst)}): {self.binding(w)}")
        self.ovn.nbctl(
            "remove",
            "logical_switch_port",
            p,
            "options",
            "requested-chassis",
            "--",
            "remove",
            "logical_switch_port",
            p,
            "options",
            "activation-strategy",
        )
        steps.append(f"source pod deleted: {self.binding(w)}")

    def move_link(self, name: str, to: int) -> None:
        """The switch-over: the source interface goes (its br-int port with it), the target's
        becomes the VM's eth0 and sends QEMU's RARP, which activates the target chassis in
        OVN; then MigrationSucceeded (requested-chassis = the target)."""
        w = self.workloads[name]
        frm = self.location[name]
        steps = self.bindings.setdefault(f"{name} n{frm}->n{to}", [])
        desc, cap = self.target_caps.pop(name)
        with cap:
            self.before_rarp[desc] = sum(
                1 for f in _queued(cap) if f[:6] == _mac(w.mac) or _dst(f) == w.ip
            )
        target = self.target_ns(w)
        self.batch(target, [f"link set eth1 netns {self.pod_ns(name)}"])
        run("ip", "netns", "del", target)
        self.created.remove(target)
        self.batch(self.pod_ns(name), ["link del eth0", "link set eth1 name eth0"])
        self.ovn.vsctl(frm, "--if-exists", "del-port", "br-int", w.ovs_dev)
        self.batch(self.pod_ns(name), self._pod_link(w))
        with self.lab.packet_socket(self.pod_ns(name), "eth0") as s:
            s.send(rarp_frame(w.mac))
        self.location[name] = to
        if self.port_group_move == "switch":
            self.move_port_group(w, frm, to)
        t = time.monotonic()
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: "activated" in self.binding(w), 3, "the target's activation")
        steps.append(f"RARP: {self.binding(w)} after {(time.monotonic() - t) * 1000:.0f} ms")
        self.reset_migrate_options(w, to)

    # -- OVN's port security: MAC and ARP (the model has the IP part only) -----------------------

    def port_security_group(self) -> Group:
        """From a VM with port security, a frame with another source MAC and an ARP reply
        claiming another IP must not reach the victim; from vm-f (none) both do."""
        cases = []
        for attacker, victim in PORT_SECURITY_SPOOFS:
            secured = self.workloads[attacker].port_security
            for kind in PORT_SECURITY_KINDS:
                what = "(OVN drops it)" if secured else "(no port security: delivered)"
                name = f"{self.where(attacker)} -> {victim}: {kind} {what}"
                check = partial(self.port_security, attacker, victim, kind)
                cases.append(Case(SPOOFING, name, check))
        return Group(cases)

    def port_security(self, attacker: str, victim: str, kind: str) -> Check:
        """One spoofed frame (`kind`), sent on the attacker's eth0 and looked for on the
        victim's: delivered only when the attacker's port has no port security."""
        a, v = self.workloads[attacker], self.workloads[victim]
        marker = f"cz-ps {attacker} {kind}".encode()
        if kind == "spoofed source MAC":
            frame = _udp_frame("02:00:0a:f4:ee:ee", v.mac, a.ip, v.ip, 53, marker)
            seen = self._delivered(attacker, victim, frame, marker)
        else:
            claim = "10.244.99.99"
            frame = _arp(2, _mac(a.mac), claim, _mac(v.mac), v.ip, _mac(v.mac))
            seen = self._delivered(attacker, victim, frame, socket.inet_aton(claim))
        said = f"{'delivered' if seen else 'not delivered'} to {victim}'s eth0"
        return seen == (not a.port_security), said

    def _delivered(self, attacker: str, victim: str, frame: bytes, marker: bytes) -> bool:
        cap = self.lab.packet_socket(self.pod_ns(victim), "eth0")
        try:
            drain(cap)
            with self.lab.packet_socket(self.pod_ns(attacker), "eth0") as out:
                for _ in range(3):
                    out.send(frame)
                    time.sleep(0.05)
            end = time.monotonic() + 1.0
            cap.settimeout(0.2)
            while time.monotonic() < end:
                try:
                    data = cap.recv(65535)
                except TimeoutError:
                    continue
                if marker in data:
                    return True
            return False
        finally:
            cap.close()

    # -- what only the real dataplane shows ------------------------------------------------------

    def real_dataplane_group(self) -> Group:
        """Rows the model has no counterpart for: a whole-IP VM reached across chassis
        (announced by another node: geneve seen on the ToR), natOutgoing of plain pods (the
        MASQUERADE rule of Kube-OVN's chain counting them), a full pod-MTU packet across
        chassis."""
        s, (vm, by), (a, b) = REAL_DATAPLANE, ACROSS_CHASSIS, MTU_PAIR
        home = node_name(self.location[vm])
        cases = [
            Case(
                s,
                f"client -> {self.where(vm)} announced by {node_name(by)}: across chassis by "
                f"geneve, the answer leaves {home} as the LB IP",
                partial(self.across_chassis, vm, by),
            )
        ]
        for name in NAT_OUTGOING:
            ip = node_ip(self.location[name])
            what = f"{self.where(name)} -> external: natOutgoing masquerades it as {ip}"
            cases.append(Case(s, what, partial(self.nat_outgoing, name)))
        what = f"{self.where(a)} -> {self.where(b)}: a {POD_MTU}-byte packet across chassis"
        cases.append(Case(s, f"{what} (Kube-OVN's geneve MTU)", partial(self.full_mtu, a, b)))
        return Group(cases)

    def nat_outgoing(self, name: str) -> Check:
        """TCP from plain pod `name` to the server: the server sees the node's address and
        Kube-OVN's OVN-MASQUERADE rule counts it."""
        n = self.location[name]
        before = self._masqueraded(n)
        ok, detail = self.check("tcp", self.pod_ns(name), SERVER_IP, SERVER_TCP, node_ip(n))
        got = self._masqueraded(n) - before
        said = f"{detail}; {node_name(n)}'s OVN-MASQUERADE MASQUERADE rule: +{got} packets"
        return ok and got > 0, said

    def full_mtu(self, a: str, b: str) -> Check:
        """A ping of the pod MTU with DF from `a` to `b` (on other chassis)."""
        size = POD_MTU - 28
        p = self.lab.exec(
            self.pod_ns(a),
            *("ping", "-c", "2", "-i", "0.2", "-W", "2", "-M", "do", "-s", str(size)),
            self.workloads[b].ip,
            check=False,
        )
        return p.returncode == 0, (p.stdout.strip().splitlines() or [p.stderr.strip()])[-1]

    def _masqueraded(self, n: int) -> int:
        out = self.lab.exec(
            self.node(n), "iptables", "-w", "-t", "nat", "-n", "-v", "-x", "-L", "OVN-MASQUERADE"
        ).stdout
        return sum(
            int(line.split()[0])
            for line in out.splitlines()
            if "MASQUERADE" in line and line.split()[0].isdigit()
        )

    def across_chassis(self, name: str, announcer: int) -> Check:
        """The LB IP of `name` announced by node `announcer` (not the VM's node): the
        client's TCP and UDP reach the VM through that node's agent, ovn0 and geneve; the
        answer leaves by the VM's own node (the 29000 policy) as the LB IP."""
        w = self.workloads[name]
        home = self.location[name]
        assert w.lb_ip is not None and home != announcer
        for n, sp in self.speakers.items():
            ips = set(sp.announced) - {w.lb_ip}
            sp.announce(ips | {w.lb_ip} if n == announcer else ips)
        cap = self.lab.packet_socket(self.tor, f"sw{home}")
        try:
            wait_for(
                lambda: self.router_owner(w.lb_ip or "") == node_name(announcer),
                5,
                "the ToR to take the announcement",
            )
            drain(cap)
            checks = [
                self.check("tcp", self.client, w.lb_ip, 80, CLIENT_IP),
                self.check("udp", self.client, w.lb_ip, 53, CLIENT_IP),
            ]
            geneve = answers = 0
            for frame in _frames(cap, 0.5):
                if frame[12:14] != b"\x08\x00":
                    continue
                ihl = (frame[14] & 0xF) * 4
                src, dst = socket.inet_ntoa(frame[26:30]), socket.inet_ntoa(frame[30:34])
                dport = struct.unpack("!H", frame[14 + ihl + 2 : 14 + ihl + 4])[0]
                if (
                    frame[23] == 17
                    and dport == 6081
                    and (src, dst) == (node_ip(announcer), node_ip(home))
                ):
                    geneve += 1
                elif src == w.lb_ip and dst == CLIENT_IP:
                    answers += 1
        except TimeoutError as e:
            checks, geneve, answers = [(False, str(e))], 0, 0
        finally:
            cap.close()
            self.announce()
        return (
            all(ok for ok, _ in checks) and geneve > 0 and answers > 0,
            "; ".join(d for _, d in checks)
            + f"; on {node_name(home)}'s ToR port: {geneve} geneve packets from "
            f"{node_ip(announcer)}, {answers} answers from {w.lb_ip}",
        )

    # -- running ---------------------------------------------------------------------------------

    def table(self) -> list[Group]:
        """The model's rows (section 7 with `RealMigration`'s row more, section 9 on ovn0),
        then OVN's port security and what only the real dataplane shows."""
        return [*super().table(), self.port_security_group(), self.real_dataplane_group()]

    def run_all(self) -> list[Row]:
        return run_groups(self.table(), LAYOUT)

    def down(self) -> None:
        for _, cap in self.target_caps.values():
            cap.close()
        self.target_caps.clear()
        try:
            super().down()
        finally:
            self.ovn.stop()
            shutil.rmtree(self.ovn.root, ignore_errors=True)


def _frames(sock: socket.socket, quiet: float) -> list[bytes]:
    """The frames `sock` received (both directions) until `quiet` seconds pass without one."""
    out = []
    sock.settimeout(quiet)
    with contextlib.suppress(TimeoutError):
        while True:
            out.append(sock.recv(65535))
    return out


def _queued(sock: socket.socket) -> list[bytes]:
    """The frames waiting on `sock` now (bounded, even under a flood)."""
    out: list[bytes] = []
    sock.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        while len(out) < 100_000:
            out.append(sock.recv(65535))
    return out


def _dst(frame: bytes) -> str:
    """The IPv4 destination of an Ethernet frame ("" for anything else)."""
    if frame[12:14] != b"\x08\x00" or len(frame) < 34:
        return ""
    return socket.inet_ntoa(frame[30:34])


def _udp_frame(src_mac: str, dst_mac: str, src: str, dst: str, dport: int, data: bytes) -> bytes:
    """An Ethernet frame with an IPv4/UDP datagram (UDP checksum 0: none)."""
    udp = struct.pack("!HHHH", 40002, dport, 8 + len(data), 0) + data
    hdr = struct.pack(
        "!BBHHHBBH4s4s",
        0x45,
        0,
        20 + len(udp),
        1,
        0,
        64,
        17,
        0,
        socket.inet_aton(src),
        socket.inet_aton(dst),
    )
    total = sum(struct.unpack("!10H", hdr))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    hdr = hdr[:10] + struct.pack("!H", ~total & 0xFFFF) + hdr[12:]
    eth = bytes.fromhex(dst_mac.replace(":", "")) + bytes.fromhex(src_mac.replace(":", ""))
    return eth + b"\x08\x00" + hdr + udp


def planned_cases() -> list[tuple[str, str]]:
    """The (scenario, case) of every row `RealOvnLab.run_all()` returns with the default
    workloads, read from the table it runs, without building anything: the model's kubeovn
    rows (the migrations' with the RARP row, the Cilium view on ovn0 alone), then OVN's
    port-security rows and the real dataplane's own."""
    return names(RealOvnLab().table())


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--prefix", default="czo", show_default=True, help="Namespace and pin prefix.")
@click.option("--observer", type=click.Choice(["drop", "count"]), default="drop", show_default=True)
@click.option(
    "--port-group-move",
    type=click.Choice(PORT_GROUP_MOVES),
    default="both-ready",
    show_default=True,
    help="When a migrating VM's port joins the target node's port group (its traffic to "
    "outside then leaves by that node): when the target pod is routed, as read in Kube-OVN, "
    "or at the switch-over.",
)
@click.option("--agent-arg", "agent_args", multiple=True, help="An extra argument of `run`.")
@click.option("--json", "as_json", type=click.Path(dir_okay=False), help="Write the rows here.")
def main(
    prefix: str,
    observer: str,
    port_group_move: str,
    agent_args: tuple[str, ...],
    as_json: str | None,
) -> None:
    """The cluster lab on real OVS and OVN (issue 27): every row of the model's kubeovn
    layout plus OVN's port security, on three chassis. Exits 1 when a row fails."""
    if os.geteuid() != 0:
        raise click.ClickException("run as root (namespaces, BPF, OVS)")
    signal.signal(signal.SIGTERM, _interrupted)
    t0 = time.monotonic()
    lab = RealOvnLab(
        prefix=prefix,
        observer=observer,
        port_group_move=port_group_move,
        agent_args=agent_args,
        log=click.echo,
    )
    click.echo(f"agent and daemon logs in {lab.workdir}")
    with lab:
        t_up = time.monotonic() - t0
        rows = lab.run_all()
    total = time.monotonic() - t0
    click.echo(format_table(rows))
    for desc, fig in lab.migration.items():
        click.secho(f"\nlive migration, {desc}:", bold=True)
        for k, v in fig.items():
            click.echo(f"  {k}: {round(v) if isinstance(v, float) else v}")
    for desc, steps in lab.bindings.items():
        click.secho(f"\nOVN port binding, {desc}:", bold=True)
        for line in steps:
            click.echo(f"  {line}")
    failed = [r for r in rows if not r.ok]
    click.echo(
        f"\n{len(rows) - len(failed)}/{len(rows)} PASS; up (agents ready) in {t_up:.1f}s, "
        f"{total:.0f}s in all; {lab.timings}"
    )
    if as_json:
        Path(as_json).write_text(
            json.dumps({"rows": [r.__dict__ for r in rows], "migration": lab.migration}, indent=1)
        )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
