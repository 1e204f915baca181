"""`cozyebpf explain`: what the running datapath does with one packet, and why.

It builds the packet, runs the program attached for that device and direction with
BPF_PROG_RUN against the live maps, and reads the decision back: verdict, reason, Service and
the packet as it would leave. It sends nothing and changes nothing. How the program knows
(bpf/lib/dryrun.h): the frame carries an 802.1Q priority tag (VLAN 0), which the fast path
never takes, so the full path decides it, by the same semantics (tests/datapath/test_differential.py
holds both to one reference model); and a marker only BPF_PROG_RUN's caller can set (XDP
metadata before the frame, or skb->cb for tc), by which the full path skips every side effect
(counters, flow and fragment entries, monitor events) and records its decision with the
marker's nonce in the per-CPU map `dryrun`. The fast path checks nothing: a dry run costs it
nothing.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
from dataclasses import asdict, dataclass
from ipaddress import IPv4Address, IPv6Address, ip_address
from typing import Any

from cozyebpf.datapath import attach, bpfsys, kernel
from cozyebpf.datapath.layout import DRY_MAGIC, DryRes
from cozyebpf.datapath.maps import PinnedMaps
from cozyebpf.datapath.reasons import REASONS
from cozyebpf.errors import CozyError
from cozyebpf.model.limits import describe
from cozyebpf.monitor import proto_name
from cozyebpf.state import IPAddress, Limits

PROTOS = {"tcp": 6, "udp": 17, "sctp": 132, "icmp": 1, "icmpv6": 58}
PORTED = (6, 17, 132)
INGRESS_HOOKS = ("xdp", "tcx-ingress", "tc-ingress")
EGRESS_HOOKS = ("tcx-egress", "tc-egress")
POD_HOOK = "cz_pod_ingress"  # not explained: see _attachment
ROUTE_PROG = "cz_route_tc"  # host routing behind XDP: it decides nothing
NOT_OURS = 0xFFFFFFFF
XDP_DROP, XDP_PASS = 1, 2
TC_NEXT, TC_DROP = -1, 2
SRC_MAC, DST_MAC = bytes.fromhex("020000000001"), bytes.fromhex("020000000002")
VLAN_TAG = struct.pack("!HH", 0x8100, 0)  # 802.1Q, priority 0, VLAN 0: the full path's
PAYLOAD = b"cozyebpf explain"


class ExplainError(CozyError):
    pass


def parse_endpoint(text: str, what: str) -> tuple[IPAddress, int | None]:
    """IP, IP:PORT, [IPv6]:PORT or a bare IPv6 address."""
    host, port = text, None
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ExplainError(f"{what} {text!r}: write an IPv6 address with a port as [IP]:PORT")
        port = rest[1:] or None
    elif text.count(":") == 1:
        host, port = text.split(":")
    try:
        ip = ip_address(host)
    except ValueError:
        raise ExplainError(f"{what} {text!r}: {host!r} is not an IP address") from None
    if port is None:
        return ip, None
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ExplainError(f"{what} {text!r}: {port!r} is not a port")
    return ip, int(port)


def parse_proto(text: str) -> int:
    if text.lower() in PROTOS:
        return PROTOS[text.lower()]
    if text.isdigit() and 0 <= int(text) < 256:
        return int(text)
    raise ExplainError(f"--proto {text!r}: one of {', '.join(PROTOS)} or a protocol number")


def inet_csum(data: bytes) -> int:
    """The Internet checksum of `data` (RFC 1071); bench/ and the tests' packet models use it
    too."""
    if len(data) % 2:
        data += b"\0"
    s: int = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def build_packet(
    src: IPAddress, dst: IPAddress, proto: int, sport: int, dport: int, payload: bytes = PAYLOAD
) -> bytes:
    """An IP packet (no link header) with valid checksums: TCP SYN, UDP datagram, SCTP INIT
    header, ICMP/ICMPv6 echo request (its identifier `sport`), or a bare payload for any other
    protocol; `payload` after the header."""
    v6 = src.version == 6
    if proto == 6:
        l4 = struct.pack("!HHIIBBHHH", sport, dport, 1, 0, 5 << 4, 0x02, 64240, 0, 0) + payload
        at = 16
    elif proto == 17:
        l4 = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload
        at = 6
    elif proto == 132:
        l4 = struct.pack("!HHII", sport, dport, 0, 0) + payload  # CRC32c: nobody checks it here
        at = -1
    elif proto in (1, 58) and (proto == 58) == v6:
        l4 = struct.pack("!BBHHH", 128 if v6 else 8, 0, 0, sport or 1, 1) + payload
        at = 2
    else:
        l4, at = payload, -1
    if v6:
        pseudo = src.packed + dst.packed + struct.pack("!I3xB", len(l4), proto)
    else:
        pseudo = src.packed + dst.packed + struct.pack("!xBH", proto, len(l4))
    if at >= 0:
        covered = l4 if proto == 1 else pseudo + l4  # ICMPv4 does not cover the IP header
        csum = inet_csum(covered) or (0xFFFF if proto == 17 else 0)
        l4 = l4[:at] + struct.pack("!H", csum) + l4[at + 2 :]
    if v6:
        return struct.pack("!IHBB", 6 << 28, len(l4), proto, 64) + src.packed + dst.packed + l4
    hdr = struct.pack("!BBHHHBBH", 0x45, 0, 20 + len(l4), 1, 0, 64, proto, 0)
    hdr += src.packed + dst.packed
    hdr = hdr[:10] + struct.pack("!H", inet_csum(hdr)) + hdr[12:]
    return hdr + l4


@dataclass(frozen=True)
class Explanation:
    verdict: str  # pass, drop
    reason: str | None  # a `maps dump` reason; None: not for a managed address
    service: str | None  # namespace/name
    src: str  # as it would leave
    dst: str
    sport: int | None
    dport: int | None
    hint: str
    device: str
    direction: str
    proto: str
    path: str = ""  # how a packet let through goes on (_path): host routing or the stack

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def text(self, given: tuple[str, str, int | None, int | None]) -> str:
        def at(ip: str, port: int | None) -> str:
            if port is None:
                return ip
            return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"

        src, dst, sport, dport = given
        lines = [
            f"packet:  {self.proto} {at(src, sport)} -> {at(dst, dport)} ({self.direction} on "
            f"{self.device})",
            f"verdict: {self.verdict}",
            f"reason:  {self.reason or '(not for a managed address: not counted)'}",
            f"service: {self.service or '-'}",
        ]
        if (self.src, self.dst) != (src, dst):
            lines.append(f"leaves:  {at(self.src, self.sport)} -> {at(self.dst, self.dport)}")
        elif self.verdict == "pass":
            lines.append("leaves:  unchanged")
        lines.append(f"hint:    {self.hint}")
        if self.path:
            lines.append(f"path:    {self.path}")
        return "\n".join(lines)


def _attachment(pin_dir: str, direction: str, device: str | None) -> attach.Attachment:
    hooks = INGRESS_HOOKS if direction == "ingress" else EGRESS_HOOKS
    # the uplinks' programs: the pod-facing hook (tcx ingress of --pod-devices) decides by the
    # node's routes, which a dry run does not have
    found = [
        a
        for a in attach.list_attachments(pin_dir)
        if a.hook in hooks and a.prog_id and a.program not in (POD_HOOK, ROUTE_PROG)
    ]
    if device is not None:
        found = [a for a in found if a.device == device]
        if not found:
            raise ExplainError(
                f"no cozyebpf {direction} program is attached to {device} (see `cozyebpf status`)"
            )
    devices = sorted({a.device for a in found})
    if not devices:
        raise ExplainError(
            f"no cozyebpf {direction} program is attached (pins in {pin_dir}; is `cozyebpf "
            "run` running on this node?)"
        )
    if len(devices) > 1:
        raise ExplainError(f"cozyebpf is attached to {', '.join(devices)}: name one with --device")
    return found[0]


def _parse_output(frame: bytes) -> tuple[str, str, int | None, int | None]:
    """Addresses and ports of a frame (Ethernet + IP) as it leaves."""
    ip = frame[14:]
    src: IPAddress
    dst: IPAddress
    if frame[12:14] == b"\x86\xdd":
        src, dst, proto, l4 = IPv6Address(ip[8:24]), IPv6Address(ip[24:40]), ip[6], ip[40:]
    else:
        ihl = (ip[0] & 0xF) * 4
        src, dst, proto, l4 = IPv4Address(ip[12:16]), IPv4Address(ip[16:20]), ip[9], ip[ihl:]
    if proto in PORTED and len(l4) >= 4:
        sport, dport = struct.unpack("!HH", l4[:4])
        return str(src), str(dst), sport, dport
    return str(src), str(dst), None, None


def _hint(
    reason: str | None,
    service: str | None,
    direction: str,
    src: IPAddress,
    dst: IPAddress,
    proto: int,
    dport: int | None,
    leaves: tuple[str, str, int | None, int | None],
    refused: str | None = None,
    limits: Limits | None = None,
    shaped: bool = False,
) -> str:
    svc = service or "its Service"
    name = proto_name(proto)
    if reason is None:
        if direction == "egress":
            return (
                f"{src} is not the pod IP of a Service cozyebpf manages here: its packets leave "
                "untranslated, from the pod IP"
            )
        if refused:
            return refused
        return (
            f"{dst} is not an LB IP or pod IP that cozyebpf manages here, so the packet passes "
            "untouched; check that the Service is labelled service.kubernetes.io/"
            "service-proxy-name=<the proxy name>, has the IP in status.loadBalancer and a ready "
            "endpoint (`cozyebpf status` lists the problems)"
        )
    if reason == "drop_port":
        return (
            f"port {dport}/{name} is not in spec.ports of {svc}; add it, or set "
            'networking.cozystack.io/wholeIP: "true"'
        )
    if reason == "drop_icmp":
        return (
            f"{svc} filters ports and does not allow ICMP; set "
            'networking.cozystack.io/allowICMP: "true" (or wholeIP: "true")'
        )
    if reason == "drop_proto":
        return (
            f"{name} has no ports, and {svc} filters ports; set "
            'networking.cozystack.io/wholeIP: "true" to let every protocol through'
        )
    if reason == "drop_malformed":
        return "the packet is malformed (truncated or invalid headers): it is never translated"
    if reason == "drop_spoofed":
        return (
            f"the packet claims the pod IP of {svc} but did not come from the device that IP is "
            "routed to: only that pod may send as it (a spoofed source, or a route that sends "
            "the pod's traffic back another way)"
        )
    if reason == "drop_limit":
        said = describe(limits) if limits is not None else "its limits"
        kind = "ingress" if direction == "ingress" else "egress"
        if kind == "egress" and shaped:
            return (
                f"over the egress limit of {svc} ({said}), shaped (fq on the uplinks): its "
                "queue already holds the burst's time of packets, so one that would leave later "
                "is dropped (networking.cozystack.io/egressBandwidth)"
            )
        return (
            f"over the {kind} limit of {svc} ({said}): its bucket is empty now, so packets "
            "beyond the rate are dropped until it refills (networking.cozystack.io/"
            "ingressBandwidth, ingressPacketRate, egressBandwidth; the node's "
            "--guard-packet-rate where the Service sets no packet rate)"
        )
    if reason == "drop_missed_tail_call":
        return (
            "the program that decides this packet (the full path, bpf/lib/tail.h) is missing "
            "from its pinned prog array, so every such packet is dropped: the agent puts it in "
            "before it attaches; restart the agent (or `cozyebpf detach` the programs)"
        )
    if reason.startswith("drop_"):
        return f"dropped as {reason}: see docs/datapath-semantics.md"
    to = leaves[1] if direction == "ingress" else leaves[0]
    if direction == "egress":
        return f"nothing to change: the pod's packet leaves as {to} ({svc})"
    if reason == "pass_port":
        return f"nothing to change: port {dport}/{name} is open on {svc}; it goes to {to}"
    if reason == "pass_reply":
        return f"nothing to change: a reply to a connection the pod opened; it goes to {to}"
    if reason == "pass_icmp":
        return f"nothing to change: {svc} allows ICMP; it goes to {to}"
    if reason == "pass_learn":
        return (
            f"nothing to change: the pod of {svc} is migrating, and TCP that opens no "
            f"connection may answer a flow recorded on the node it left; it goes to {to}"
        )
    return f"nothing to change: {svc} takes every port and protocol; it goes to {to}"


def reserved_why(dst: IPAddress, agent_address: str | None) -> str | None:
    """Why a packet to `dst`, which no entry matched, is not ours although it may look so: a
    Service the agent refused asks for `dst` (an address in use), or `dst` is this node's own
    address, which no LB IP may take (issue 31). None: neither."""
    if agent_address:
        from cozyebpf.status import fetch_agent

        for r in fetch_agent(agent_address).get("refused", []):
            if r.get("lb_ip") == str(dst):
                return (
                    f"{dst} is not ours: {r['service']} asks for it as its LB IP but is not "
                    f"programmed, since {dst} is {r['why']} (a whole LB IP would take every "
                    "packet to it); the packet goes where it would without cozyebpf. Give the "
                    "Service an address of its own (`cozyebpf status` lists the refusals)"
                )
    from cozyebpf.sources.local import read_local

    device = read_local().get(dst)
    if device is not None:
        return (
            f"{dst} is not ours: it is this node's address on {device}, which no LB IP may "
            "take; the packet goes to the node itself"
        )
    return None


def _path(
    maps: PinnedMaps, a: attach.Attachment, direction: str, v6: bool, in_device: str | None
) -> str:
    """How a packet the program lets through goes on (--host-routing; bpf/lib/route.h)."""
    if not maps.host_routing():
        return "the node's stack routes it (--host-routing off)"
    if direction == "ingress":
        if a.hook == "xdp" and kernel.xdp_meta() is not None:  # compiled without the mark
            return (
                "the node's stack routes it (host routing behind XDP marks frames with "
                "bpf_xdp_adjust_meta, which this kernel refuses; --ingress-hook tcx routes them)"
            )
        how = "marked by XDP, " if a.hook == "xdp" else ""
        return (
            f"host routing: {how}handed to the device the node's FIB names (bpf_redirect_neigh, "
            "TTL - 1), past netfilter; the stack when TTL <= 1, too big for that device, or "
            "taken by the full path (fragments, IP options, a VLAN tag, ICMP errors)"
        )
    pod_hook = in_device is not None and any(
        x.program == POD_HOOK and x.device == in_device
        for x in attach.list_attachments(maps.pin_dir)
    )
    if pod_hook:
        rest = (
            "; the stack, untranslated, when its hop limit is 1, too big, or with extension "
            "headers or ICMPv6 (the uplink's egress translates it)"
            if v6
            else "; the stack when TTL <= 1, too big, or taken by the full path"
        )
        return (
            f"host routing: translated by the pod-facing hook on {in_device} and handed there "
            f"to the uplink (past netfilter){rest}"
        )
    return "the node's stack routes it (host routing starts at a pod-facing hook)"


# (81 lines: argument checks, the dry run and the verdict's fields in the order they are
# printed)
def explain(
    pin_dir: str,
    src_text: str,
    dst_text: str,
    proto_text: str = "tcp",
    direction: str = "ingress",
    device: str | None = None,
    in_device: str | None = None,
    agent_address: str | None = None,
) -> tuple[Explanation, tuple[str, str, int | None, int | None]]:
    """Run the packet through the attached program (a dry run); the explanation and the
    packet as given (src, dst, sport, dport). `in_device` (egress): the device it entered the
    node by, for the source check (None: the node's own packet). `agent_address`: the
    agent's --health-address, asked why an address no entry matches is refused."""
    if direction not in ("ingress", "egress"):
        raise ExplainError(f"--direction must be ingress or egress, not {direction!r}")
    in_ifindex = 0
    if in_device is not None:
        if direction != "egress":
            raise ExplainError("--from-device goes with --direction egress")
        try:
            in_ifindex = socket.if_nametoindex(in_device)
        except OSError:
            raise ExplainError(
                f"--from-device {in_device}: no such device in this network namespace"
            ) from None
    src, sport = parse_endpoint(src_text, "--from")
    dst, dport = parse_endpoint(dst_text, "--to")
    if src.version != dst.version:
        raise ExplainError(f"--from {src} and --to {dst} are of different address families")
    proto = parse_proto(proto_text)
    if proto in PORTED:
        if dport is None:
            raise ExplainError(
                f"{proto_name(proto)} needs a destination port: --to {dst_text}:PORT"
            )
        sport = 40000 if sport is None else sport
    elif proto in (1, 58):
        if (proto == 58) != (src.version == 6):
            raise ExplainError(f"{proto_name(proto)} does not go with IPv{src.version}")
        sport = dport = None
    else:
        sport = dport = None
    given = (str(src), str(dst), sport, dport)
    a = _attachment(pin_dir, direction, device)
    packet = build_packet(src, dst, proto, sport or 0, dport or 0)
    fd = bpfsys.prog_fd_by_id(a.prog_id)
    try:
        with PinnedMaps.open(pin_dir) as maps:
            run = dry_run(maps, fd, a.hook == "xdp", packet, in_ifindex)
            reason = None
            service = None
            if run.result is not None and run.result.reason != NOT_OURS:
                n = run.result.reason
                reason = REASONS[n] if n < len(REASONS) else str(n)
                service = maps.service_of_slot(run.result.slot) or None
            leaves = _parse_output(run.frame) if not run.drop else given
            refused = None
            if reason is None and direction == "ingress":
                refused = reserved_why(dst, agent_address)
            limits = maps.limits().get(service, (None, {}))[0] if service else None
            hint = _hint(
                reason,
                service,
                direction,
                src,
                dst,
                proto,
                dport,
                leaves,
                refused,
                limits,
                maps.shaped(),
            )
            path = "" if run.drop else _path(maps, a, direction, src.version == 6, in_device)
    finally:
        os.close(fd)
    return (
        Explanation(
            verdict="drop" if run.drop else "pass",
            reason=reason,
            service=service,
            src=leaves[0],
            dst=leaves[1],
            sport=leaves[2],
            dport=leaves[3],
            hint=hint,
            device=a.device,
            direction=direction,
            proto=proto_name(proto),
            path=path,
        ),
        given,
    )


@dataclass(frozen=True)
class DryRun:
    drop: bool
    frame: bytes  # as the program left it, without the tag
    result: DryRes | None  # what the full path recorded; None: it did not decide the frame


def dry_run(
    maps: PinnedMaps, prog_fd: int, xdp: bool, packet: bytes, in_ifindex: int = 0
) -> DryRun:
    """Run an IP packet through a loaded program of ours (XDP or tc) as a dry run: with the
    802.1Q tag that sends it to the full path and the marker that makes the full path change
    nothing (bpf/lib/dryrun.h). tc: `in_ifindex` is the skb's ingress_ifindex (the device it
    entered the node by; 0: the node's own)."""
    ethertype = b"\x86\xdd" if packet[0] >> 4 == 6 else b"\x08\x00"
    frame = DST_MAC + SRC_MAC + VLAN_TAG + ethertype + packet
    nonce = secrets.randbits(64) | 1  # odd: the program records nonce | 1
    marker = struct.pack("=QQ", DRY_MAGIC, nonce)
    if xdp:  # struct xdp_md: data (the metadata's length), data_end, data_meta
        data = marker + frame
        ctx = struct.pack("=III", len(marker), len(data), 0)
    else:  # struct __sk_buff up to cb[5] (offset 48): ingress_ifindex (36), cb[0..3] the marker
        data = frame
        ctx = bytes(36) + struct.pack("=I", in_ifindex) + bytes(8) + marker + bytes(4)
    r = bpfsys.prog_test_run(prog_fd, data, ctx=ctx)
    out = r.data[len(marker) :] if xdp else r.data  # XDP returns the metadata too
    if out[12:14] == VLAN_TAG[:2]:
        out = out[:12] + out[16:]
    result = None
    for raw in maps.percpu(maps.layout.dryrun, 0) or []:  # on whichever CPU it ran
        res = DryRes.from_buffer_copy(raw)
        if res.nonce == nonce:
            result = res
    return DryRun(r.retval == (XDP_DROP if xdp else TC_DROP), out, result)
