"""Attaching the programs: XDP and tcx through pinned bpf_links, legacy clsact through netlink.

Links are pinned under <pin dir>/links/<device>.<hook>, so the datapath keeps forwarding when
the agent exits or crashes (fail-static), and a new agent replaces the program in place with
BPF_LINK_UPDATE. bcc's attach_xdp/remove_xdp are not used: they cannot replace atomically and
remove_xdp removes whatever program is attached, ours or not.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

from cozyebpf.datapath import bpfsys, rtnl
from cozyebpf.errors import DatapathError

log = logging.getLogger(__name__)

OUR_PROGRAMS = ("cz_ingress", "cz_ingress_tc", "cz_egress", "cz_pod_ingress", "cz_route_tc")
XDP_MODES = {"native": bpfsys.XDP_FLAGS_DRV_MODE, "generic": bpfsys.XDP_FLAGS_SKB_MODE}
TC_INGRESS_PARENT = 0xFFFFFFF2  # clsact ingress
TC_EGRESS_PARENT = 0xFFFFFFF3  # clsact egress
#: A legacy clsact filter (a kernel without tcx, before 6.6) runs first at priority 1, the
#: lowest there is (0 asks the kernel to pick one). Cilium's filters take priority 1 too, with
#: protocol all and handle 1, and are replaced in place when Cilium attaches again
#: (pkg/datapath/loader/tc.go, attachTCProgram: netlink.FilterReplace; its TCFilterPriority is 1
#: by default). Ours share that priority and protocol with handles of their own: of the filters
#: of one priority cls_bpf runs the one added last first (a new filter goes to the head of its
#: list, a replaced one keeps its place), so ours, added after Cilium's, runs before it however
#: often Cilium replaces its own. When Cilium's is added anew after ours (its first start on the
#: node after ours), the attachment check finds ours not first and adds it again in front, with
#: the other handle, before the old one goes (`_attach_legacy`). Until issue 36 ours took
#: handle 1 of priority 1 too: each side's replace then took the other's filter off the device.
LEGACY_PRIO = 1
LEGACY_HANDLES = (0x637A0001, 0x637A0002)  # "cz", 1 and 2
ETH_P_ALL = 3


@dataclass(frozen=True)
class Attachment:
    device: str
    hook: str  # "xdp", "tcx-egress", "tc-egress"
    program: str
    prog_id: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "hook": self.hook,
            "program": self.program,
            "prog_id": self.prog_id,
        }


def links_dir(pin_dir: str) -> str:
    return os.path.join(pin_dir, "links")


def link_pin(pin_dir: str, hook: str, device: str) -> str:
    """<pin dir>/links/<hook>_<device>; bpffs forbids dots in names, so a dot in a device name
    (eth0.100) is stored as '%'."""
    return os.path.join(links_dir(pin_dir), f"{hook}_{device.replace('.', '%')}")


def _parse_link_pin(name: str) -> tuple[str, str]:
    hook, _, device = name.partition("_")
    return hook, device.replace("%", ".")


def ifindex_of(device: str) -> int:
    try:
        return socket.if_nametoindex(device)
    except OSError:
        raise DatapathError(
            f"device {device!r} does not exist in this network namespace; check --devices"
        ) from None


def resolve_devices(spec: str) -> list[str]:
    """The --devices value as a list: names as given, or for `auto` the device(s) of the
    default IPv4 route (every next hop of a multipath route)."""
    names = [d.strip() for d in spec.split(",") if d.strip()]
    if names != ["auto"]:
        if not names:
            raise DatapathError("--devices is empty: name the uplink devices, or use auto")
        return names
    found = [socket.if_indextoname(i) for i in rtnl.default_route_devices()]
    if not found:
        raise DatapathError(
            "--devices auto: this network namespace has no default IPv4 route; name the "
            "uplink devices with --devices"
        )
    log.info("--devices auto: the default route uses %s", ", ".join(found))
    return found


#: the pod-facing device that --pod-devices auto looks for: Kube-OVN's host port to its pods
KUBE_OVN_POD_DEVICE = "ovn0"


def is_pattern(spec: str) -> bool:
    """A --pod-devices entry that names devices by a shell pattern (lxc*, cali*)."""
    return any(c in spec for c in "*?[")


def resolve_pod_devices(spec: str, uplinks: list[str]) -> list[str]:
    """The --pod-devices value as a list: `none` (or empty); names and shell patterns as given
    (a pattern matches the devices there are, now and later: per-pod veths come and go); or for
    `auto` Kube-OVN's `ovn0` when this network namespace has it, else none. A named device must
    exist, and cannot be an uplink too (a pattern never matches an uplink)."""
    names = [d.strip() for d in spec.split(",") if d.strip()]
    if names in ([], ["none"]):
        return []
    if names == ["auto"]:
        try:
            socket.if_nametoindex(KUBE_OVN_POD_DEVICE)
        except OSError:
            log.info(
                "--pod-devices auto: no %s here, so no pod-facing hook (pods' traffic is "
                "translated on the uplinks' egress only)",
                KUBE_OVN_POD_DEVICE,
            )
            return []
        log.info("--pod-devices auto: Kube-OVN's %s", KUBE_OVN_POD_DEVICE)
        names = [KUBE_OVN_POD_DEVICE]
    both = sorted(set(names) & set(uplinks))
    if both:
        raise DatapathError(
            f"{', '.join(both)} is in both --devices and --pod-devices: a device faces either "
            f"the uplink or the pods; leave it out of one of them"
        )
    for dev in names:
        if is_pattern(dev):
            continue
        try:
            socket.if_nametoindex(dev)
        except OSError:
            raise DatapathError(
                f"pod-facing device {dev!r} does not exist in this network namespace; check "
                f"--pod-devices (auto finds Kube-OVN's {KUBE_OVN_POD_DEVICE}, a pattern such "
                f"as 'lxc*' matches per-pod veths, none turns it off)"
            ) from None
    return names


def match_pod_devices(specs: list[str], uplinks: list[str]) -> list[str]:
    """The devices of this network namespace that the --pod-devices entries name now, in
    order, uplinks left out."""
    present = [name for _, name in socket.if_nameindex()]
    out: list[str] = []
    for spec in specs:
        for name in present if is_pattern(spec) else [spec]:
            if name not in out and name not in uplinks and fnmatch.fnmatchcase(name, spec):
                out.append(name)
    return out


def _prog_name(prog_id: int) -> str:
    try:
        return bpfsys.prog_info_by_id(prog_id).name or "(unnamed)"
    except OSError:
        return "(unknown)"


#: how netlink says an XDP program is attached (IFLA_XDP_ATTACHED)
XDP_ATTACH_MODES = {1: "xdp", 2: "xdpgeneric", 3: "xdpoffload", 4: "xdpmulti"}


def current_xdp(ifindex: int) -> tuple[int, str] | None:
    """(program id, attach mode as netlink reports it: "xdp", "xdpgeneric", ...) of the XDP
    program on a device, or None."""
    found = rtnl.xdp_program(ifindex)
    if found is None:
        return None
    prog_id, mode = found
    return prog_id, XDP_ATTACH_MODES.get(mode, str(mode))


def _replace_pinned(path: str, ifindex: int, prog_fd: int) -> bool:
    """If our pinned link for this hook exists and still targets `ifindex`, swap its program
    atomically and return True. A stale pin (device recreated) is removed."""
    try:
        fd = bpfsys.obj_get(path)
    except bpfsys.BpfError as e:
        if e.errno == errno.ENOENT:
            return False
        raise DatapathError(f"cannot open our link pin {path}: {e}") from e
    try:
        info = bpfsys.link_info(fd)
        if info.ifindex == ifindex:
            bpfsys.link_update(fd, prog_fd)
            return True
        log.warning(
            "link pin %s targets ifindex %d, not %d: removing it", path, info.ifindex, ifindex
        )
        with contextlib.suppress(OSError):
            bpfsys.link_detach(fd)
        os.unlink(path)
        return False
    finally:
        os.close(fd)


def _pin_link(fd: int, path: str) -> None:
    try:
        bpfsys.obj_pin(fd, path)
        os.chmod(path, 0o600)
    finally:
        os.close(fd)


class ForeignXdpError(DatapathError):
    """Another XDP program is attached to the device; cozyebpf never replaces it."""


class NoNativeXdpError(DatapathError):
    """The device's driver has no native XDP."""


def attach_xdp(prog_fd: int, device: str, pin_dir: str, mode: str = "native") -> Attachment:
    """Attach (or atomically replace) our XDP program on `device`. A foreign XDP program is
    never replaced: that raises ForeignXdpError naming it."""
    ifindex = ifindex_of(device)
    os.makedirs(links_dir(pin_dir), mode=0o700, exist_ok=True)
    path = link_pin(pin_dir, "xdp", device)
    prog_id = bpfsys.prog_info(prog_fd).id
    if _replace_pinned(path, ifindex, prog_fd):
        log.info("replaced XDP program on %s in place (link %s)", device, path)
        return Attachment(device, "xdp", "cz_ingress", prog_id)
    cur = current_xdp(ifindex)
    if cur:
        _foreign_xdp(device, cur[0])
    try:
        fd = bpfsys.link_create(prog_fd, ifindex, bpfsys.BPF_XDP, flags=XDP_MODES[mode])
    except bpfsys.BpfError as e:
        if e.errno in (errno.EBUSY, errno.EEXIST):
            cur = current_xdp(ifindex)
            _foreign_xdp(device, cur[0] if cur else 0)
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL) and mode == "native":
            raise NoNativeXdpError(
                f"device {device} does not support native XDP ({e.strerror}); use "
                f"--ingress-hook tcx (or auto), or --xdp-mode generic (slower than tc)"
            ) from e
        raise DatapathError(f"attaching XDP to {device} failed: {e}") from e
    _pin_link(fd, path)
    log.info("attached cz_ingress (XDP %s) to %s", mode, device)
    return Attachment(device, "xdp", "cz_ingress", prog_id)


def _foreign_xdp(device: str, prog_id: int) -> None:
    name = _prog_name(prog_id) if prog_id else "(unknown)"
    raise ForeignXdpError(
        f"device {device} already has an XDP program that is not cozyebpf's: {name} "
        f"(id {prog_id}). cozyebpf never replaces a foreign XDP program; remove it (e.g. "
        f"`ip link set dev {device} xdp off`) if it is not needed, run with "
        f"--on-foreign-xdp tcx to attach behind it with tcx, or leave {device} out of --devices"
    )


def tcx_supported() -> bool:
    """tcx exists from Linux 6.6: a program query for a tcx hook on lo fails with EINVAL
    on older kernels. Any other failure (EPERM) is an error, not a reason to fall back."""
    attr = bpfsys._ProgQuery(
        target_ifindex=socket.if_nametoindex("lo"), attach_type=bpfsys.BPF_TCX_EGRESS
    )
    try:
        bpfsys._sys_bpf(bpfsys.BPF_PROG_QUERY, attr, "probe tcx")
    except bpfsys.BpfError as e:
        if e.errno == errno.EINVAL:
            return False
        raise DatapathError(
            f"cannot query tc programs ({e.strerror}); cozyebpf needs CAP_SYS_ADMIN and "
            f"CAP_NET_ADMIN"
        ) from e
    return True


#: devices warned about a forced legacy filter on a kernel with tcx (once each)
_WARNED_LEGACY: set[str] = set()

#: direction -> (tcx attach type, clsact parent)
DIRECTIONS = {
    "ingress": (bpfsys.BPF_TCX_INGRESS, TC_INGRESS_PARENT),
    "egress": (bpfsys.BPF_TCX_EGRESS, TC_EGRESS_PARENT),
}


def attach_tc(
    prog_fd: int, program: str, device: str, pin_dir: str, direction: str, mode: str = "auto"
) -> Attachment:
    """Attach (or atomically replace) a tc program on `device`: a tcx link placed before every
    other tcx program (BPF_F_BEFORE) where the kernel has tcx, else a clsact filter that runs
    first (LEGACY_PRIO; mode "legacy" forces that)."""
    ifindex = ifindex_of(device)
    prog_id = bpfsys.prog_info(prog_fd).id
    attach_type, parent = DIRECTIONS[direction]
    if mode == "auto":
        mode = "tcx" if tcx_supported() else "legacy"
    elif mode == "legacy" and device not in _WARNED_LEGACY and tcx_supported():
        _WARNED_LEGACY.add(device)
        log.warning(
            "%s: --tc-mode legacy on a kernel with tcx: the clsact filter runs after every tcx "
            "program of the hook (Cilium attaches with tcx here), so ours is not first; "
            "--tc-mode auto uses tcx",
            device,
        )
    if mode == "legacy":
        _attach_legacy(prog_fd, program, device, ifindex, parent)
        log.info("attached %s (clsact %s, prio %d) to %s", program, direction, LEGACY_PRIO, device)
        return Attachment(device, f"tc-{direction}", program, prog_id)
    hook = f"tcx-{direction}"
    os.makedirs(links_dir(pin_dir), mode=0o700, exist_ok=True)
    path = link_pin(pin_dir, hook, device)
    if _replace_pinned(path, ifindex, prog_fd):
        log.info("replaced %s program on %s in place (link %s)", hook, device, path)
        return Attachment(device, hook, program, prog_id)
    try:
        fd = bpfsys.link_create(prog_fd, ifindex, attach_type, flags=bpfsys.BPF_F_BEFORE)
    except bpfsys.BpfError as e:
        raise DatapathError(f"attaching {hook} to {device} failed: {e}") from e
    _pin_link(fd, path)
    log.info("attached %s (%s, first) to %s", program, hook, device)
    return Attachment(device, hook, program, prog_id)


def move_tcx_first(new_prog_fd: int, device: str, pin_dir: str, direction: str) -> None:
    """Put our tcx program back in front: a link for a second instance of our program with
    BPF_F_BEFORE first, then the old link goes, so there is no moment without us. Both run for
    that moment, which is harmless: a translated packet no longer matches a managed address of
    the same direction."""
    ifindex = ifindex_of(device)
    attach_type, _ = DIRECTIONS[direction]
    path = link_pin(pin_dir, f"tcx-{direction}", device)
    # the new link is pinned beside the old one and renamed over it once the old one is
    # detached, so the pin is never missing (a reader of the links saw a gap before)
    tmp = os.path.join(os.path.dirname(path), "new-" + os.path.basename(path))
    detach_link(tmp)  # left by an agent that stopped half way
    fd = bpfsys.link_create(new_prog_fd, ifindex, attach_type, flags=bpfsys.BPF_F_BEFORE)
    _pin_link(fd, tmp)
    old = _open_pin(path)
    if old is not None:
        try:
            with contextlib.suppress(OSError):
                bpfsys.link_detach(old)
        finally:
            os.close(old)
    os.replace(tmp, path)


def _open_pin(path: str) -> int | None:
    try:
        return bpfsys.obj_get(path)
    except OSError:
        return None


def detach_link(path: str) -> bool:
    """Detach and unpin one of our pinned links; False when there was none."""
    try:
        fd = bpfsys.obj_get(path)
    except OSError:
        return False
    try:
        with contextlib.suppress(OSError):
            bpfsys.link_detach(fd)
    finally:
        os.close(fd)
    os.unlink(path)
    return True


def _ours(f: rtnl.TcFilter) -> bool:
    return f.name.startswith(OUR_PROGRAMS)


def legacy_first(ifindex: int, parent: int) -> bool | None:
    """Is one of our clsact filters the first the kernel runs at `parent`? None: we have none."""
    filters = rtnl.tc_filters(ifindex, parent)
    if not any(_ours(f) for f in filters):
        return None
    return _ours(filters[0])


def _attach_legacy(prog_fd: int, program: str, device: str, ifindex: int, parent: int) -> None:
    """Our program in a clsact filter that runs first at `parent` (LEGACY_PRIO, LEGACY_HANDLES):
    our filter's program replaced in place where ours runs first already; else a new filter,
    which goes in front of the others of its priority, and then our other filters removed."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    def put(ipr: IPRoute, command: str, handle: int) -> None:
        try:
            ipr.tc(
                command,
                "bpf",
                ifindex,
                handle,
                fd=prog_fd,
                name=program,
                parent=parent,
                prio=LEGACY_PRIO,
                protocol=ETH_P_ALL,
                direct_action=True,
            )
        except NetlinkError as e:
            theirs = [
                f"{f.name} (prio {f.prio}, protocol {f.protocol:#x})"
                for f in rtnl.tc_filters(ifindex, parent)
                if not _ours(f) and f.prio == LEGACY_PRIO
            ]
            raise DatapathError(
                f"adding the clsact filter {program} to {device} failed: {e}"
                + (
                    f"; priority {LEGACY_PRIO} holds {', '.join(theirs)}, which it cannot share "
                    f"(a filter of one priority shares its protocol and kind: all, bpf)"
                    if theirs
                    else ""
                )
            ) from e

    with IPRoute() as ipr:
        try:
            ipr.tc("add", "clsact", ifindex)
        except NetlinkError as e:
            if e.code != errno.EEXIST:
                raise DatapathError(f"adding clsact qdisc to {device} failed: {e}") from e
        filters = rtnl.tc_filters(ifindex, parent)
        ours = [f for f in filters if _ours(f)]
        first = filters[0] if filters else None
        if first is not None and _ours(first) and first.handle in LEGACY_HANDLES:
            put(ipr, "replace-filter", first.handle)  # in place: it keeps its place
            keep = first.handle
        else:
            used = {f.handle for f in ours if f.prio == LEGACY_PRIO}
            if used >= set(LEGACY_HANDLES):  # both taken (one not first): that one goes
                stale = next(f for f in ours if f.handle == LEGACY_HANDLES[1])
                _remove_filter(ipr, ifindex, parent, stale)
                used.discard(stale.handle)
            keep = next(h for h in LEGACY_HANDLES if h not in used)
            put(ipr, "add-filter", keep)  # the head of its priority's list
        for f in ours:
            if not (f.prio == LEGACY_PRIO and f.handle == keep):
                _remove_filter(ipr, ifindex, parent, f)


def _remove_filter(ipr: Any, ifindex: int, parent: int, f: rtnl.TcFilter) -> None:
    """One filter, by its priority, protocol and handle: never a whole priority, which would
    take the filters of others sharing it (Cilium's) too."""
    from pyroute2.netlink.exceptions import NetlinkError

    try:
        ipr.tc(
            "del-filter",
            "bpf",
            ifindex,
            f.handle,
            parent=parent,
            prio=f.prio,
            protocol=f.protocol,
        )
    except NetlinkError as e:
        if e.code != errno.ENOENT:
            raise


def legacy_programs(ifindex: int, parent: int) -> list[tuple[int, str, int]]:
    """(priority, program name, program id) of our (cz_*) clsact filters at `parent` on a
    device."""
    out = {
        (f.prio, f.name.split(":")[0], f.prog_id)
        for f in rtnl.tc_filters(ifindex, parent)
        if _ours(f)
    }
    return sorted(out)


def legacy_filters(ifindex: int, parent: int) -> list[tuple[int, str]]:
    """(priority, program name) of our (cz_*) clsact filters at `parent` on a device."""
    return sorted({(prio, name) for prio, name, _ in legacy_programs(ifindex, parent)})


def remove_legacy(ifindex: int, parent: int) -> list[str]:
    """Remove our clsact filters at `parent` of a device, each by its handle (the filters of
    others at the same priority stay)."""
    ours = [f for f in rtnl.tc_filters(ifindex, parent) if _ours(f)]
    if not ours:
        return []  # the common case: pyroute2 is not even imported
    from pyroute2 import IPRoute

    removed = []
    with IPRoute() as ipr:
        for f in ours:
            _remove_filter(ipr, ifindex, parent, f)
            removed.append(f"clsact filter {f.name} prio {f.prio}")
    return removed


def list_attachments(pin_dir: str) -> list[Attachment]:
    """Our pinned links (any network namespace) and our legacy filters (this namespace)."""
    out: list[Attachment] = []
    ldir = links_dir(pin_dir)
    for name in sorted(os.listdir(ldir)) if os.path.isdir(ldir) else []:
        hook, device = _parse_link_pin(name)
        try:
            fd = bpfsys.obj_get(os.path.join(ldir, name))
        except OSError:
            continue
        try:
            info = bpfsys.link_info(fd)
        finally:
            os.close(fd)
        out.append(Attachment(device, hook, _prog_name(info.prog_id), info.prog_id))
    for idx, dev in socket.if_nameindex():
        for direction, (_, parent) in DIRECTIONS.items():
            for _prio, name, prog_id in legacy_programs(idx, parent):
                out.append(Attachment(dev, f"tc-{direction}", name, prog_id))
    return out


def detach_all(pin_dir: str) -> list[str]:
    """Remove every link, legacy filter and pin of ours. Returns what was removed.

    Only our own names are unlinked, and only on a bpf filesystem: a wrong --pin-dir never
    deletes anything else. Names of ours that are not there are skipped."""
    from pyroute2.netlink.exceptions import NetlinkError

    from cozyebpf.datapath.layout import ALL_MAPS

    removed: list[str] = []
    if os.path.isdir(pin_dir) and not bpfsys.on_bpffs(pin_dir):
        raise DatapathError(f"{pin_dir} is not on a bpf filesystem: not a cozyebpf pin dir")
    ldir = links_dir(pin_dir)
    if os.path.isdir(ldir):
        for name in sorted(os.listdir(ldir)):
            path = os.path.join(ldir, name)
            if detach_link(path):
                removed.append(path)
        with contextlib.suppress(OSError):  # not empty: something that is not ours
            os.rmdir(ldir)
    for idx, dev in socket.if_nameindex():
        for _, parent in DIRECTIONS.values():
            try:
                removed += [f"{dev}: {r}" for r in remove_legacy(idx, parent)]
            except NetlinkError as e:
                raise DatapathError(
                    f"removing our clsact filters from {dev} failed ({e}); this needs CAP_NET_ADMIN"
                ) from e
    if os.path.isdir(pin_dir):
        from cozyebpf.datapath.pins import drop_retired

        removed += drop_retired(pin_dir)  # prog arrays an agent stopped in its upgrade kept
        for spec in ALL_MAPS:
            path = os.path.join(pin_dir, spec.name)
            if os.path.exists(path):
                os.unlink(path)
                removed.append(path)
        try:
            os.rmdir(pin_dir)
            removed.append(pin_dir)
        except OSError as e:
            log.warning("kept %s: %s (it holds files that are not cozyebpf's)", pin_dir, e)
    return removed
