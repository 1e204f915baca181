"""Section 7, live migration (kubeovn): a VM moves to another node under load (a connection
from outside, one the VM opened, a download the VM opened, 100 datagrams/s from outside) as
KubeVirt and Kube-OVN move it: its EndpointSlice goes "old ready" -> "both ready" (one
address, two nodeNames) -> "new ready", its link moves between the nodes' OVS, the
announcement follows MetalLB's election. While both are ready, a sender outside the Service's
source ranges must be dropped, not learned (issue 28)."""

from __future__ import annotations

import contextlib
import math
import socket
import struct
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from cozylab.cluster.rows import Case, Check, Group
from cozylab.cluster.spec import (
    CLIENT_IP,
    NODES,
    OUTSIDE_IP,
    SERVER_IP,
    SERVER_PUSH,
    SERVER_TCP,
    node_name,
)
from cozylab.netns import wait_for
from cozylab.traffic import Download, TcpChat, UdpStream, describe

if TYPE_CHECKING:
    from cozylab.cluster.lab import ClusterLab

SCENARIO = "7 live migration"
#: a port-filter VM, node1 -> node3 and back. MetalLB elects the same node of the two while
#: both are ready (node1): going, the announcement moves at "new ready", after the switch;
#: coming back, at "both ready", to the target before the VM runs there
MIGRATIONS = (("vm-a", 3), ("vm-a", 1))
#: what a migration row accepts (the README quotes, *On a Cozystack cluster*: 2-4 datagrams of
#: the 100/s stream lost, a 30-50 ms gap; one TCP retransmission, a 225-230 ms pause): 10
#: datagrams (a 100 ms gap, twice the longest measured, for a loaded machine), and a pause of
#: 450 ms (one retransmission after TCP's 200 ms minimum RTO passes, a second does not: it
#: would pause 600 ms, 200 + 400). The bound was 2.5 RTOs for a while (issue 45, item 11):
#: migrating back, the download paused 130-170 ms and the connection the VM opened two RTOs
#: in half of the runs. Not the switch: the source-ranges check of "both ready" held the
#: server out, so the node that already announced the LB IP (node1, where the VM had no flow
#: yet) dropped the server's segments (drop_source: learning comes after the ranges) for as
#: long as the ranges were in force, two syncs through the real control plane (the double's
#: direct slice writes had made that window 30 ms). The ranges now hold the streams' peers.
#: The datagram bound grows with the switch itself when that takes longer: while the link
#: moves and OVN activates the target (`move_link`, up to the Southbound row's
#: "additional-chassis-activated"), the VM is reachable on neither node, whatever the agents
#: do. A CI run on the loaded machine (a qemu guest beside it) measured a 257 ms switch on
#: real OVN and 13 datagrams lost in a 138 ms gap: the switch's, not the NAT's. A loss beyond
#: what was sent while the switch ran still fails.
MIGRATION_MAX_UDP_LOST = 10
MIGRATION_MAX_PAUSE = 0.45


def tcp_ack(src: str, dst: str, sport: int, dport: int) -> bytes:
    """A TCP segment with ACK alone (it opens nothing), its checksum computed, for a raw socket
    that adds the IPv4 header."""
    hdr = struct.pack("!HHIIBBHHH", sport, dport, 1, 1, 5 << 4, 0x10, 65535, 0, 0)
    pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!BBH", 0, 6, len(hdr))
    data = pseudo + hdr
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return hdr[:16] + struct.pack("!H", ~total & 0xFFFF) + hdr[18:]


def acks_from_outside(lab: ClusterLab, lb: str, first_port: int) -> int:
    """Three TCP segments with ACK alone (they open nothing) from OUTSIDE_IP to `lb`:80, sent
    raw from the client's namespace; how many more drop_source the agents counted within 2 s
    (3 when the LB IP's source ranges hold them off)."""

    def drops() -> int:
        return sum(lab.agents.counted("drop_source").values())

    before = drops()
    with lab.lab.ns_socket(lab.client, socket.AF_INET, socket.SOCK_RAW, 6) as raw:
        raw.bind((OUTSIDE_IP, 0))
        for i in range(3):
            raw.sendto(tcp_ack(OUTSIDE_IP, lb, first_port + i, 80), (lb, 0))
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: drops() - before >= 3, 2, "drops")
    return drops() - before


def _event_keys(events: list[dict[str, Any]]) -> set[tuple[str, int]]:
    """(uid, count) of each Event: a new Event, or a repeat of one, is not among them."""
    return {(e["metadata"]["uid"], e.get("count", 1)) for e in events}


class Migration:
    """One migration of VM `name` to node `to`, from where `at` says it is when its turn comes
    (the plan of the rows; the run reads where it is). `group()` declares its rows: the
    migration runs once before them (`around`), each row reads what it recorded."""

    def __init__(self, lab: ClusterLab, name: str, to: int, at: dict[str, int]) -> None:
        self.lab, self.name, self.to = lab, name, to
        self.w = lab.workloads[name]
        assert self.w.lb_ip is not None, f"{name} is not a VM"
        self.lb: str = self.w.lb_ip
        self.desc = f"{lab.where(name, at)} -> n{to}"
        suffix = "bbb" if to != self.w.node else "ccc"
        self.new_pod = f"virt-launcher-{name}-{self.w.index:02d}{suffix}"
        self.errors: list[str] = []
        self.t: dict[str, float] = {}
        self.owners: dict[str, Any] = {}
        self.both_warnings: dict[int, list[str]] = {}
        self.both_events: list[dict[str, Any]] = []
        self.ranges: Check = (False, "not run")
        self.dropped = 0  # drop_source counted on every node during the migration
        self.fig: dict[str, Any] = {}
        self.owner = "none"  # the ToR's neighbour entry for the LB IP at the end
        self.garps: list[tuple[str, float]] = []
        # the load: from outside, opened by the VM, downloaded by the VM, 100 datagrams/s
        self.tin = TcpChat(lab.lab, lab.client, (self.lb, 80), timeout=10)
        self.tout = TcpChat(lab.lab, lab.pod_ns(name), (SERVER_IP, SERVER_TCP), timeout=10)
        self.down = Download(lab.lab, lab.pod_ns(name), (SERVER_IP, SERVER_PUSH))
        self.udp = UdpStream(lab.lab, lab.client, (self.lb, 53), drain=1.0)

    def group(self) -> Group:
        d, s = self.desc, SCENARIO
        cases = [
            Case(s, f"{d} tcp from outside keeps going", self._outside),
            Case(s, f"{d} tcp the VM opened keeps going", self._opened),
            Case(s, f"{d} tcp download the VM opened keeps going", self._download),
            Case(s, f"{d} udp 100 pkt/s", self._udp),
            Case(s, f"{d} learning: a sender outside the ranges is dropped", self._ranges),
            Case(s, f"{d} both ready (one address): no warning, no gap", self._both_ready_row),
            Case(s, f"{d} announcement moves", self._announcement),
        ]
        return Group(cases, around=self.running)

    # -- the run -------------------------------------------------------------------------

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        self.run()
        yield

    def _step(self, what: str, fn: Callable[[], object]) -> None:
        try:
            fn()
        except (TimeoutError, RuntimeError) as e:
            self.errors.append(f"{what}: {e}")

    def run(self) -> None:
        lab = self.lab
        assert lab.api is not None
        frm = lab.location[self.name]
        learned0 = lab.agents.learned()
        dropped0 = sum(lab.agents.counted("drop_source").values())
        self._start_load()
        offsets = {n: len(lab.agents.log(n)) for n in NODES}
        events0 = _event_keys(lab.api.events())
        self.t["start"] = time.monotonic()
        try:
            self._step("load", lambda: wait_for(self._loaded, 5))
            self._both_ready(frm, offsets, events0)
            self._switch()
            self._new_ready()
            self._after()
        finally:
            for st in (self.tin, self.tout, self.down, self.udp):
                st.stop()
        self.t["end"] = time.monotonic()
        self.dropped = sum(lab.agents.counted("drop_source").values()) - dropped0
        self._figures(learned0)

    def _start_load(self) -> None:
        for st in (self.tin, self.tout, self.down):
            try:
                st.start()
            except OSError as e:
                self.errors.append(f"could not connect: {describe(e)}")
        self.udp.start()

    def _loaded(self) -> bool:
        return bool(self.udp.got and self.tin.echoes and self.tout.echoes)

    def _both_ready(self, frm: int, offsets: dict[int, int], events0: set[tuple[str, int]]) -> None:
        """ "old ready" -> "both ready": the target virt-launcher pod, on the target node with
        the VM's IP, Ready beside the source pod (one address, two nodeNames in the slice the
        EndpointSlice controller writes); then the source ranges."""
        lab, w = self.lab, self.w
        assert lab.api is not None
        self.t["both"] = time.monotonic()
        self._step(
            "both ready",
            lambda: lab.set_endpoints(w, [frm, self.to], [lab.pod_names[self.name], self.new_pod]),
        )
        self._step("both ready", lab.sync_agents)
        self.owners["both"] = lab.announce({**lab.ready(), self.name: [frm, self.to]})[self.lb]
        self.both_warnings = {n: lab.agents.warnings(n, offsets[n]) for n in NODES}
        self.both_events = [
            e for e in lab.api.events() if (e["metadata"]["uid"], e.get("count", 1)) not in events0
        ]
        got = len(self.udp.got)
        self._step(
            "both ready", lambda: wait_for(lambda: len(self.udp.got) > got + 10, 2, "echoes")
        )
        self.ranges = self.outside_the_ranges_while_learning()

    def _switch(self) -> None:
        self.t["switch"] = time.monotonic()
        self.lab.move_link(self.name, self.to)
        self.t["switched"] = time.monotonic()

    def _new_ready(self) -> None:
        lab = self.lab
        lab.pod_names[self.name] = self.new_pod
        self._step("new ready", lambda: lab.set_endpoints(self.w, [self.to]))
        self._step("new ready", lab.sync_agents)
        self.owners["new"] = lab.announce()[self.lb]
        self.t["new"] = time.monotonic()

    def _after(self) -> None:
        """Each stream moves on after "new ready" (or fails)."""
        new = self.t["new"]
        for what, st in (("outside", self.tin), ("opened", self.tout)):
            self._step(
                f"after the migration ({what})",
                lambda st=st: wait_for(lambda: st.after(new) > 10 or st.error, 5),  # type: ignore[misc]
            )
        down = self.down
        self._step(
            "after the migration (download)",
            lambda: wait_for(lambda: down.bytes_after(new) > 100_000 or down.error, 5),
        )

    def outside_the_ranges_while_learning(self) -> Check:
        """While the VM is learning (both ready), give its Service source ranges that hold the
        client and the server (the peers of the streams the rows measure: a peer held out would
        be dropped where the VM has no flow yet, a pause of the streams that the migration did
        not cause); TCP that opens nothing from OUTSIDE_IP must be dropped (drop_source), not
        learned (issue 28): learning comes after the ranges. The ranges go again after."""
        lab, lb, api = self.lab, self.lb, self.lab.api
        assert api is not None
        errors: list[str] = []
        dropped = 0
        try:
            ranges = [f"{CLIENT_IP}/32", f"{SERVER_IP}/32"]
            api.put_service(self.w, loadBalancerSourceRanges=ranges)
            lab.sync_agents()
            dropped = acks_from_outside(lab, lb, 41000)
        except (TimeoutError, RuntimeError, OSError) as e:
            errors.append(str(e))
        finally:
            api.put_service(self.w)
            with contextlib.suppress(TimeoutError, RuntimeError):
                lab.sync_agents()
        detail = f"3 ACKs from {OUTSIDE_IP} (outside): drop_source +{dropped}"
        return not errors and dropped >= 3, "; ".join([*errors, detail])

    def _figures(self, learned0: dict[str, int]) -> None:
        """What the README's table quotes, kept in lab.migration[desc]."""
        lab, t, udp, down = self.lab, self.t, self.udp, self.down
        self.owner = lab.router_owner(self.lb)
        self.garps = [
            (node_name(n), ts - t["switch"])
            for n, sp in lab.speakers.items()
            for ts, ip in sp.garps
            if ip == self.lb and ts >= t["start"]
        ]
        learned = lab.agents.learned()
        self.fig = {
            "switch_ms": (t.get("switched", 0) - t.get("switch", 0)) * 1000,
            "udp": udp.summary(),
            "udp_lost": len(udp.lost()),
            "udp_sent_in_switch": sum(
                1 for ts in udp.sent.values() if t.get("switch", 0) <= ts <= t.get("switched", 0)
            ),
            "udp_sent": len(udp.sent),
            "udp_gap_ms": udp.gap() * 1000,
            "tcp_outside_pause_ms": self.tin.longest_pause() * 1000,
            "tcp_opened_pause_ms": self.tout.longest_pause() * 1000,
            "download_bytes_before": sum(n for at, n in down.reads if at <= t.get("both", 0)),
            "download_bytes_after": down.bytes_after(t.get("new", math.inf)),
            "download_pause_ms": down.longest_pause() * 1000,
            "pass_learn": {n: learned[n] - learned0.get(n, 0) for n in learned},
            "garp": [f"{n} at {dt * 1000:+.0f} ms from the switch" for n, dt in self.garps],
            "announcer": {
                "both ready": self.owners.get("both"),
                "new ready": self.owners.get("new"),
            },
            "router_neighbour": self.owner,
        }
        lab.migration[self.desc] = self.fig

    # -- the rows ------------------------------------------------------------------------

    def _common(self) -> list[str]:
        """The errors every row carries (those of one stream after the switch excepted)."""
        return [e for e in self.errors if not e.startswith("after")]

    def _of(self, what: str) -> list[str]:
        return [e for e in self.errors if e.startswith(f"after the migration ({what})")]

    def _stream(self, st: TcpChat, what: str, extra: str = "") -> Check:
        errs = self._common() + self._of(what)
        if st.error:
            errs.append(f"error: {st.error}")
        after = st.after(self.t.get("new", math.inf))
        pause, rto = st.longest_pause_and_rto()
        if pause > MIGRATION_MAX_PAUSE:
            errs.append(f"a pause over {MIGRATION_MAX_PAUSE * 1000:.0f} ms")
        said = f"{len(st.echoes)} echoes, {after} after the migration, "
        said += f"longest pause {pause * 1000:.0f} ms (RTO then {rto * 1000:.0f} ms, "
        said += f"{st.retransmissions} retransmitted by this side){extra}"
        return not errs and after > 0, "; ".join([*errs, said])

    def _outside(self) -> Check:
        return self._stream(self.tin, "outside")

    def _opened(self) -> Check:
        seen = ", ".join(sorted({p for _, p in self.tout.echoes})) or "nothing"
        return self._stream(self.tout, "opened", f"; the server saw {seen}")

    def _download(self) -> Check:
        down, fig = self.down, self.fig
        errs = self._common() + self._of("download")
        if down.error:
            errs.append(f"error: {down.error}")
        ok = not errs and fig["download_bytes_after"] > 0
        ok = ok and down.longest_pause() <= MIGRATION_MAX_PAUSE
        said = (
            f"{down.total} bytes, {fig['download_bytes_after']} after the migration, "
            f"longest pause {fig['download_pause_ms']:.0f} ms, "
            f"pass_learn by node: {fig['pass_learn']}"
        )
        return ok, "; ".join([*errs, said])

    def _ranges(self) -> Check:
        """The three ACKs from outside the ranges dropped, and nothing else in the whole
        migration: the streams' peers are inside the ranges, so none of their packets may be
        (a drop of theirs is a pause the migration did not cause)."""
        ok, detail = self.ranges
        if self.dropped != 3:
            ok = False
        return ok, f"{detail}; drop_source in the whole migration: {self.dropped} (3 expected)"

    def _udp(self) -> Check:
        udp, fig, common = self.udp, self.fig, self._common()
        new = self.t.get("new", math.inf)
        ok = not common and any(ts > new for ts in udp.got.values())
        most = max(MIGRATION_MAX_UDP_LOST, fig["udp_sent_in_switch"])
        ok = ok and fig["udp_lost"] <= most
        said = [
            udp.summary(),
            f"{fig['udp_lost']} lost (at most {most}: {MIGRATION_MAX_UDP_LOST}, or what was sent "
            f"while the switch ran, {fig['udp_sent_in_switch']})",
            f"the switch took {fig['switch_ms']:.0f} ms",
        ]
        return ok, "; ".join([*common, *said])

    def _both_ready_row(self) -> Check:
        # datagrams sent while both were ready, but not in flight at the switch (lab RTT < 1 ms)
        window = (self.t.get("both", 0.0), self.t.get("switch", 0.0) - 0.05)
        lost = self.udp.lost(window)
        warn = [x for v in self.both_warnings.values() for x in v]
        common = self._common()
        events = [e.get("message") for e in self.both_events]
        ok = not common and not warn and not self.both_events and not lost
        detail = "; ".join([*common, ""]) + f"warnings: {warn or 'none'}; Events: "
        detail += f"{events or 'none'}; lost while both ready: {len(lost)}"
        return ok, detail

    def _announcement(self) -> Check:
        to = node_name(self.to)
        ok = self.owners.get("new") == self.to and self.owner == to
        ok = ok and any(n == to for n, _ in self.garps)
        return ok, (
            f"elected: {self.fig['announcer']}; the ToR's neighbour: {self.owner}; "
            f"GARP: {', '.join(self.fig['garp']) or 'none'}"
        )
