"""The real-OVN lab: live migration the Kube-OVN/KubeVirt way, OVN's port security (MAC and
ARP), what only the real dataplane shows, and the run."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import socket
import struct
import time
from collections.abc import Sequence
from functools import partial
from typing import Any, ClassVar

from cozylab.cluster import Row
from cozylab.cluster.announcer import _arp, _mac
from cozylab.cluster.rows import Case, Check, Group, run_groups
from cozylab.cluster.scenarios import migration
from cozylab.cluster.spec import (
    CLIENT_IP,
    POD_MTU,
    SERVER_IP,
    SERVER_TCP,
    Workload,
    node_ip,
    node_name,
)
from cozylab.netns import drain, run, wait_for
from cozylab.realovn.spec import (
    ACROSS_CHASSIS,
    LAYOUT,
    MTU_PAIR,
    NAT_OUTGOING,
    PORT_SECURITY_KINDS,
    PORT_SECURITY_SPOOFS,
    REAL_DATAPLANE,
    SPOOFING,
    port_name,
    rarp_frame,
)
from cozylab.realovn.topology import OvnTopology


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


class RealOvnLab(OvnTopology):
    """The model lab's kubeovn layout on real OVS and OVN (the package docstring): the live
    migrations the Kube-OVN/KubeVirt way, OVN's port security rows, what only the real
    dataplane shows, and the run."""

    migration_scenario: ClassVar[type[migration.Migration]] = RealMigration

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
