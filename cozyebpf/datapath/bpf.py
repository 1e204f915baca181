"""The real datapath: pinned maps + the ingress (XDP or tc) and egress (tc) programs on the
devices. The programs are compiled and loaded in a child process (`compiler`), so this
process never holds bcc's LLVM."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager

from cozyebpf.datapath import attach, bpfsys, kernel, loader, rtnl
from cozyebpf.datapath.compiler import Compilation, Request
from cozyebpf.datapath.layout import DEFAULT_MAX_SERVICES, MON_OFF
from cozyebpf.datapath.maps import DEFAULT_FLOW_TIMEOUTS, DEFAULT_PIN_DIR, PinnedMaps
from cozyebpf.datapath.pins import drop_retired, monitor_running
from cozyebpf.errors import DatapathError
from cozyebpf.state import Capacity, MapDiff, MapState

log = logging.getLogger(__name__)

INGRESS_HOOKS = ("xdp", "tcx", "auto")


def unguarded(_what: str) -> AbstractContextManager[object]:
    return contextlib.nullcontext()


class BpfDatapath:
    """Implements the Datapath protocol on the kernel. `start()` creates or adopts the pinned
    maps, loads the programs and attaches them to every device; `check()` re-attaches what
    someone removed or pushed back; `close()` releases our file descriptors only: links and maps
    stay pinned, so forwarding goes on (fail-static) until `cozyebpf detach`."""

    def __init__(
        self,
        devices: Sequence[str],
        pin_dir: str = DEFAULT_PIN_DIR,
        xdp_mode: str = "native",
        tc_mode: str = "auto",
        ingress_hook: str = "auto",
        on_foreign_xdp: str = "fail",
        max_services: int = DEFAULT_MAX_SERVICES,
        service_slots: int | None = None,
        flow_timeouts: Mapping[str, float] | None = None,
        pod_devices: Sequence[str] = (),
        host_routing: bool = False,
        guard_pps: int | None = None,
    ) -> None:
        if not devices:
            raise DatapathError("no devices given: name the uplink devices with --devices")
        if ingress_hook not in INGRESS_HOOKS:
            raise DatapathError(f"--ingress-hook must be one of {', '.join(INGRESS_HOOKS)}")
        self.devices = list(devices)
        #: pod-facing devices (--pod-devices: names and patterns): cz_pod_ingress on their tcx
        #: ingress, on the devices a pattern matches as they come and go (check())
        self.pod_devices = list(pod_devices)
        #: --host-routing on: translated packets go to their next device (bpf_redirect_neigh);
        #: behind XDP ingress, cz_route_tc on tcx ingress hands on what XDP marked
        #: (docs/design.md, Host routing)
        self.host_routing = host_routing
        #: the node's guard (--guard-packet-rate; None: none): also the limit of slot 0, which
        #: the Services without a counter slot of their own share (PinnedMaps.set_guard)
        self.guard_pps = guard_pps
        self.pin_dir = pin_dir
        self.xdp_mode = xdp_mode
        self.tc_mode = tc_mode
        self.ingress_hook = ingress_hook
        self.on_foreign_xdp = on_foreign_xdp
        self.max_services = max_services
        self.service_slots = service_slots
        #: the flows' idle timeouts in seconds by "udp", "icmp", "tcp", "tcp_closing"
        self.flow_timeouts = {**DEFAULT_FLOW_TIMEOUTS, **(flow_timeouts or {})}
        self.maps: PinnedMaps | None = None
        self.programs: dict[str, loader.Program] = {}  # the instance in use, per program
        self._spares: dict[str, list[loader.Program]] = {}  # other instances (tcx reorder)
        self._compilation: Compilation | None = None
        self.attachments: dict[tuple[str, str], attach.Attachment] = {}  # (device, role)
        #: wraps what must not be cut in the middle (the attach, a map batch, the map
        #: migration): `cozyebpf run` holds a stop that lands inside until it is done
        #: (cozyebpf.safepoint)
        self.guard: Callable[[str], AbstractContextManager[object]] = unguarded
        #: follows the node's routes for the programs' cached FIB answers (_follow_routes)
        self._routes: rtnl.Follow | None = None
        #: follows the uplinks' qdiscs: egress limits are shaped where all are fq (_shaping)
        self._qdiscs: rtnl.Follow | None = None
        #: whether egress limits are shaped (_shaping; None: not decided yet)
        self.shaped: bool | None = None

    # -- programs ------------------------------------------------------------------------

    def _requests(self) -> list[Request]:
        """The programs this configuration can attach; tc programs twice (the second
        instance puts ours back in front of the tcx chain, see check())."""
        out = []
        if self.ingress_hook in ("xdp", "auto"):
            out.append(Request("cz_ingress", "xdp"))
            if self.host_routing:
                out.append(Request("cz_route_tc", "sched_cls", 2))
        if self.ingress_hook in ("tcx", "auto") or self.on_foreign_xdp == "tcx":
            out.append(Request("cz_ingress_tc", "sched_cls", 2))
        out.append(Request("cz_egress", "sched_cls", 2))
        if self.pod_devices:
            out.append(Request("cz_pod_ingress", "sched_cls", 2))
        return out

    def _program(self, name: str) -> loader.Program:
        try:
            return self.programs[name]
        except KeyError:
            raise DatapathError(
                f"program {name} was not loaded for --ingress-hook {self.ingress_hook}"
            ) from None

    def prepare(self) -> None:
        """Check the kernel and the devices and create or adopt the pinned maps (fast; nothing
        attached). A kernel older than the oldest proven one is refused (datapath.kernel)."""
        for note in kernel.check():  # what this kernel lacks and the datapath works around
            log.info("%s", note)
        meta = kernel.xdp_meta_note()
        if meta and self.host_routing and self.ingress_hook in ("xdp", "auto"):
            log.warning("%s", meta)
        elif meta:
            log.info("%s", meta)
        uplinks = [attach.ifindex_of(dev) for dev in self.devices]  # a typo fails here
        with self.guard("preparing the maps"):
            self.maps = PinnedMaps.ensure(self.pin_dir, self.max_services, self.service_slots)
            self.maps.set_flow_timeouts(**self.flow_timeouts)
            self.maps.set_node(uplinks, bool(self.pod_devices), self.host_routing)
            self.maps.set_guard(self.guard_pps)
        self._shaping()

    def begin(self) -> None:
        """Start compiling and loading the programs in a child process (seconds); the maps
        can be programmed meanwhile."""
        self._compilation = Compilation(self.pin_dir, self._requests())

    def compiled(self) -> bool:
        """Whether finish() would not wait."""
        return self._compilation is None or self._compilation.done()

    def finish(self) -> None:
        """Take the loaded programs from the child and attach them to every device. Egress
        goes first on every device: the ingress program trusts the flow hints, which the egress
        program of this layout sets; flows that older programs recorded get theirs in between
        (PinnedMaps.seed_flow_hints). Then the prog arrays that prepare() replaced, which the
        programs attached before used until now, are unpinned (pins.retire)."""
        assert self._compilation is not None, "begin() first"
        compilation, self._compilation = self._compilation, None
        for name, kind, fd in compilation.result():
            prog = loader.Program(name, fd, None, kind)
            if name in self.programs:
                self._spares.setdefault(name, []).append(prog)
            else:
                self.programs[name] = prog
        self._follow_routes()
        self._follow_qdiscs()
        with self.guard("attaching the programs"):
            self._attach_all()
            # the prog arrays a migration replaced (pins.retire): no program of ours uses
            # them any more
            drop_retired(self.pin_dir)

    def _follow_routes(self) -> None:
        """The pod-facing hook and host routing cache the FIB's answers (bpf/lib/fib.h,
        cz_fib4_cached): every change of the node's routes, rules or devices bumps flowcfg's
        generation, and the programs ask again. Followed from before the attach, so that no
        change is missed; set_node (prepare) bumped it for whatever changed before."""
        if not (self.pod_devices or self.host_routing) or self._routes is not None:
            return
        maps = self._maps()
        self._routes = rtnl.Follow(rtnl.route_events(), maps.bump_fib_gen, "routes")
        self._routes.start()

    def _follow_qdiscs(self) -> None:
        """Every change of a qdisc decides again whether egress limits are shaped (_shaping)."""
        if self._qdiscs is not None:
            return
        self._qdiscs = rtnl.Follow(rtnl.qdisc_events(), self._shaping, "qdiscs")
        self._qdiscs.start()
        self._shaping()  # what changed before the follower listened

    def _shaping(self) -> None:
        """Egress limits are shaped where every uplink's root qdisc is fq (or mq of fq), which
        holds a packet until the departure time the programs set (bpf/lib/limit.h, cz_shape);
        policed otherwise. cozyebpf installs no qdisc: the node's is the operator's (or Cilium's
        bandwidth manager's, which installs fq)."""
        held = {dev: _device_qdisc(dev) for dev in self.devices}
        shaped = all(fq for fq, _ in held.values())
        self._maps().set_shaped(shaped)
        if shaped == self.shaped:
            return
        self.shaped = shaped
        if shaped:
            log.info("egress limits are shaped: fq on %s", ", ".join(held))
        else:
            log.info(
                "egress limits are policed: %s",
                "; ".join(
                    f"{dev} has {what}, not fq" for dev, (fq, what) in held.items() if not fq
                ),
            )

    def _attach_all(self) -> None:
        egress = self._program("cz_egress")
        for dev in self.devices:
            self.attachments[(dev, "egress")] = attach.attach_tc(
                egress.fd, "cz_egress", dev, self.pin_dir, "egress", self.tc_mode
            )
        pods = attach.match_pod_devices(self.pod_devices, self.devices)
        for dev in pods:
            self.attachments[(dev, "pod")] = self._attach_pod(dev)
        assert self.maps is not None, "prepare() first"
        if self.maps.hints_need_seed:
            n = self.maps.seed_flow_hints()
            log.info("flow hints seeded from %d flows", n)
        for dev in self.devices:
            self.attachments[(dev, "ingress")] = self._attach_ingress(dev)
            self._follow_route(dev)
        self._drop_stale_pod_hooks()
        order = [
            (dev, role)
            for dev in self.devices
            for role in ("ingress", "route", "egress")
            if (dev, role) in self.attachments
        ]
        order += [(dev, "pod") for dev in pods]
        self.attachments = {k: self.attachments[k] for k in order}

    def start(self) -> None:
        """prepare(), begin() and finish() in one."""
        self.prepare()
        self.begin()
        self.finish()

    @property
    def attached(self) -> bool:
        return bool(self.attachments)

    def _attach_ingress(self, dev: str) -> attach.Attachment:
        """XDP where chosen and possible, else tc ingress; the other hook of ours goes."""
        if self.ingress_hook in ("xdp", "auto"):
            try:
                a = attach.attach_xdp(
                    self._program("cz_ingress").fd, dev, self.pin_dir, self.xdp_mode
                )
            except attach.NoNativeXdpError as e:
                if self.ingress_hook == "xdp":
                    raise
                log.info("%s has no native XDP; using tcx ingress instead (%s)", dev, e)
            except attach.ForeignXdpError as e:
                if self.on_foreign_xdp != "tcx":
                    raise
                log.warning("%s; attaching behind it with tcx ingress (--on-foreign-xdp tcx)", e)
            else:
                self._drop_tc_ingress(dev)
                return a
        a = attach.attach_tc(
            self._program("cz_ingress_tc").fd,
            "cz_ingress_tc",
            dev,
            self.pin_dir,
            "ingress",
            self.tc_mode,
        )
        if attach.detach_link(attach.link_pin(self.pin_dir, "xdp", dev)):
            log.info("removed our XDP program from %s (ingress now on %s)", dev, a.hook)
        return a

    def _follow_route(self, dev: str) -> None:
        """Host routing behind XDP: cz_route_tc first in the uplink's tcx ingress, which hands
        on what XDP let through (an XDP redirect into Kube-OVN's ovn0, an OVS internal port
        without XDP transmit, would lose it). Where ingress runs on tc, cz_ingress_tc does it."""
        xdp = self.attachments[(dev, "ingress")].hook == "xdp"
        if self.host_routing and xdp:
            self.attachments[(dev, "route")] = attach.attach_tc(
                self._program("cz_route_tc").fd,
                "cz_route_tc",
                dev,
                self.pin_dir,
                "ingress",
                self.tc_mode,
            )
        else:
            self.attachments.pop((dev, "route"), None)

    def _attach_pod(self, dev: str) -> attach.Attachment:
        """The pod-facing hook: cz_pod_ingress first in the device's tc ingress, so it runs
        before netfilter (the node's masquerade) and before Cilium's programs there."""
        return attach.attach_tc(
            self._program("cz_pod_ingress").fd,
            "cz_pod_ingress",
            dev,
            self.pin_dir,
            "ingress",
            self.tc_mode,
        )

    def _follow_pod_devices(self) -> list[str]:
        """Attach the pod-facing hook to the devices that --pod-devices matches now and did
        not before (a pod's new veth); forget those that are gone (their link went with them)."""
        out: list[str] = []
        now = attach.match_pod_devices(self.pod_devices, self.devices)
        for dev, role in list(self.attachments):
            if role == "pod" and dev not in now:
                del self.attachments[(dev, role)]
                attach.detach_link(attach.link_pin(self.pin_dir, "tcx-ingress", dev))
                log.info("pod-facing device %s is gone", dev)
        for dev in now:
            if (dev, "pod") in self.attachments:
                continue
            try:
                self.attachments[(dev, "pod")] = self._attach_pod(dev)
            except (DatapathError, OSError) as e:  # gone again, or a failure: tried next time
                log.error("%s: cannot attach the pod-facing hook: %s", dev, e)
                continue
            out.append(f"{dev} tcx-ingress: a new pod-facing device")
        return out

    def _drop_stale_pod_hooks(self) -> None:
        """Our tcx ingress links on devices that are neither uplinks nor pod-facing devices now
        (a pod-facing device left out of --pod-devices) go."""
        keep = {*self.devices, *attach.match_pod_devices(self.pod_devices, self.devices)}
        for a in attach.list_attachments(self.pin_dir):
            if (
                a.hook == "tcx-ingress"
                and a.device not in keep
                and attach.detach_link(attach.link_pin(self.pin_dir, a.hook, a.device))
            ):
                log.warning(
                    "removed our %s program from %s: it is no longer a --pod-devices device",
                    a.program,
                    a.device,
                )

    def _drop_tc_ingress(self, dev: str) -> None:
        if attach.detach_link(attach.link_pin(self.pin_dir, "tcx-ingress", dev)):
            log.info("removed our tcx ingress program from %s (ingress now on XDP)", dev)
        attach.remove_legacy(attach.ifindex_of(dev), attach.TC_INGRESS_PARENT)

    def check(self) -> list[str]:
        """Verify every attachment is in place and our tc programs run first (tcx, or a legacy
        clsact filter: attach.LEGACY_PRIO); repair and report what was wrong (one line each).
        A monitor's events left on by a monitor that is gone (killed) are turned off."""
        with self.guard("checking the attachments"):
            return self._check()

    def _check(self) -> list[str]:
        repaired: list[str] = []
        if self._monitor_left_on():
            repaired.append("monitor events: on without a monitor")
        if self._routes is not None and not self._routes.alive():
            self._routes = None
            self._maps().bump_fib_gen()
            self._follow_routes()
            repaired.append("route follower: stopped, started again")
        if self._qdiscs is not None and not self._qdiscs.alive():
            self._qdiscs = None
            self._follow_qdiscs()
            repaired.append("qdisc follower: stopped, started again")
        if self.pod_devices:
            repaired += self._follow_pod_devices()
        for (dev, role), a in list(self.attachments.items()):
            try:
                problem = self._check_one(a)
                if problem is None:
                    continue
                log.warning("%s %s: %s; re-attaching", dev, a.hook, problem)
                if problem == "not first" and a.hook.startswith("tcx-"):
                    spares = self._spares.get(a.program)
                    if not spares:
                        raise DatapathError(f"no second instance of {a.program} to move first")
                    new = spares.pop()
                    attach.move_tcx_first(new.fd, dev, self.pin_dir, a.hook.removeprefix("tcx-"))
                    spares.append(self.programs[a.program])
                    self.programs[a.program] = new
                    self.attachments[(dev, role)] = attach.Attachment(
                        dev, a.hook, a.program, bpfsys.prog_info(new.fd).id
                    )
                elif role == "ingress":
                    self.attachments[(dev, role)] = self._attach_ingress(dev)
                    self._follow_route(dev)  # its tcx ingress went with a switch to XDP
                elif role == "route":
                    self._follow_route(dev)
                elif role == "pod":
                    self.attachments[(dev, role)] = self._attach_pod(dev)
                else:
                    self.attachments[(dev, role)] = attach.attach_tc(
                        self.programs["cz_egress"].fd,
                        "cz_egress",
                        dev,
                        self.pin_dir,
                        "egress",
                        self.tc_mode,
                    )
                repaired.append(f"{dev} {a.hook}: {problem}")
            except (DatapathError, OSError) as e:
                log.error("%s %s: cannot repair: %s", dev, a.hook, e)
                repaired.append(f"{dev} {a.hook}: {e}")
        return repaired

    def _monitor_left_on(self) -> bool:
        """Turn the monitor's events off when they are on and no monitor holds them (its lock
        on the pin directory went with it); True when it did."""
        if self.maps is None:
            return False
        try:
            if self.maps.monitor_state().mode == MON_OFF or monitor_running(self.pin_dir):
                return False
            self.maps.set_monitor(MON_OFF)
        except OSError as e:
            log.error("checking the monitor's switch failed: %s", e)
            return False
        log.warning(
            "the monitor's events were on without a monitor (one that was killed?): turned off"
        )
        return True

    def _check_one(self, a: attach.Attachment) -> str | None:
        ifindex = attach.ifindex_of(a.device)
        if a.hook == "xdp":
            cur = attach.current_xdp(ifindex)
            if cur is None:
                return "detached"
            return None if cur[0] == a.prog_id else f"program {cur[0]} instead of ours"
        if a.hook.startswith("tcx-"):
            attach_type, _ = attach.DIRECTIONS[a.hook.removeprefix("tcx-")]
            ids, _ = bpfsys.prog_query(ifindex, attach_type)
            if a.prog_id not in ids:
                return "detached"
            return None if ids[0] == a.prog_id else "not first"
        _, parent = attach.DIRECTIONS[a.hook.removeprefix("tc-")]
        first = attach.legacy_first(ifindex, parent)
        if first is None:
            return "filter gone"
        return None if first else "not first"

    # -- maps ----------------------------------------------------------------------------

    def _maps(self) -> PinnedMaps:
        if self.maps is None:
            raise DatapathError("datapath not started")
        return self.maps

    def capacity(self) -> Capacity:
        return self._maps().capacity()

    def uncounted(self) -> tuple[set[str], int]:
        return self._maps().uncounted()

    def read_state(self) -> MapState:
        return self._maps().read_state()

    def apply(self, diff: MapDiff) -> None:
        with self.guard("writing the maps"):
            self._maps().apply(diff)

    def close(self) -> None:
        """Release our descriptors (a running compilation is stopped); the pinned links keep
        the attached programs."""
        if self._compilation is not None:
            self._compilation.cancel()
            self._compilation = None
        for follower in (self._routes, self._qdiscs):
            if follower is not None:
                follower.stop()
        self._routes = self._qdiscs = None
        if self.maps:
            self.maps.close()
            self.maps = None
        for prog in [*self.programs.values(), *(p for ps in self._spares.values() for p in ps)]:
            with contextlib.suppress(OSError):
                os.close(prog.fd)
        self.programs, self._spares = {}, {}


COZY_PROXY_TABLE = ("ip", "cozy_proxy")


def cozy_proxy_table_present() -> bool:
    """Is cozy-proxy's nftables table in this network namespace? An nft error other than
    "no such table" (no permission, say) is an error, not an absence."""
    nft = shutil.which("nft")
    if nft is None:
        log.warning(
            "the nft command is not installed, so cozy-proxy's nftables table `ip cozy_proxy` "
            "cannot be looked for: if cozy-proxy ran on this node, delete its table (it would "
            "translate the same traffic a second time)"
        )
        return False
    p = subprocess.run([nft, "list", "table", *COZY_PROXY_TABLE], capture_output=True, text=True)
    if p.returncode == 0:
        return True
    if "No such file or directory" in p.stderr:
        return False
    raise DatapathError(
        f"cannot look for cozy-proxy's nftables table `ip cozy_proxy`: {p.stderr.strip()} "
        f"(this needs CAP_NET_ADMIN)"
    )


def handle_cozy_proxy(remove: bool) -> None:
    """Warn about (or, with `remove`, delete) cozy-proxy's table: with both, the same traffic
    would be translated twice."""
    if not cozy_proxy_table_present():
        return
    if not remove:
        log.warning(
            "nftables table `ip cozy_proxy` (cozy-proxy) is present: it would NAT the same "
            "traffic a second time. Stop cozy-proxy, then delete the table with `nft delete "
            "table ip cozy_proxy`, or start cozyebpf with --remove-cozy-proxy-table"
        )
        return
    p = subprocess.run(
        ["nft", "delete", "table", *COZY_PROXY_TABLE], capture_output=True, text=True
    )
    if p.returncode != 0:
        raise DatapathError(f"deleting nftables table ip cozy_proxy failed: {p.stderr.strip()}")
    log.warning("deleted cozy-proxy's nftables table `ip cozy_proxy` (--remove-cozy-proxy-table)")


def egress_qdisc(ifindex: int) -> tuple[bool, str]:
    """Whether fq holds a device's egress -- its root qdisc is fq, or mq (a qdisc per transmit
    queue) whose every child is fq -- and what the device has (for the log): "fq",
    "mq of 4 fq", "noqueue", "mq of fq_codel", "no qdisc" (a device that is gone)."""
    qs = [q for q in rtnl.qdiscs(ifindex) if q.parent >> 16 != 0xFFFF or q.parent == rtnl.TC_H_ROOT]
    root = next((q for q in qs if q.parent == rtnl.TC_H_ROOT), None)
    if root is None:
        return False, "no qdisc"
    if root.kind == "fq":
        return True, "fq"
    if root.kind != "mq":
        return False, root.kind
    kids = [q.kind for q in qs if q is not root and q.parent >> 16 == root.handle >> 16]
    if kids and all(k == "fq" for k in kids):
        return True, f"mq of {len(kids)} fq"
    return False, "mq of " + ", ".join(sorted(set(kids)) or ["nothing"])


def _device_qdisc(dev: str) -> tuple[bool, str]:
    """egress_qdisc of a device by name; a device that is gone has "no device"."""
    try:
        return egress_qdisc(socket.if_nametoindex(dev))
    except OSError:
        return False, "no device"
