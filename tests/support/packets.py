"""Addresses of the tests (one place, as cilium's pkt_defs_common.py) and whole-packet
comparison with a readable diff."""

from __future__ import annotations

import difflib

from scapy.layers.inet import ICMP, IP, TCP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Packet

from cozylab import netns as lab

CLIENT = lab.CLIENT_IP  # 198.51.100.2: the outside peer
OTHER_CLIENT = "198.51.100.3"  # a second outside peer, never seen by the pods
LB_WHOLE = "203.0.113.10"  # whole-IP Service -> POD_WHOLE
LB_FILT = "203.0.113.20"  # port-filter Service -> POD_FILT (no ICMP)
LB_ICMP = "203.0.113.30"  # port-filter Service with allowICMP -> POD_ICMP
LB_UNKNOWN = "203.0.113.99"  # nobody's
POD_WHOLE = "10.244.1.10"
POD_FILT = "10.244.1.20"
POD_ICMP = "10.244.1.30"
POD_OTHER = "10.244.1.40"  # a pod without a Service

MAC_A = "02:00:00:00:aa:01"
MAC_B = "02:00:00:00:aa:02"


def show(frame: bytes) -> str:
    p = Ether(frame)
    return f"{p.command()}\n{p.show2(dump=True)}"


def assert_frame(got: bytes, want: bytes | Packet, what: str = "") -> None:
    """Whole-frame equality; on failure both packets are printed as scapy and a field diff."""
    want_b = bytes(want)
    if got == want_b:
        return
    diff = "\n".join(
        difflib.unified_diff(
            show(want_b).splitlines(), show(got).splitlines(), "expected", "got", lineterm=""
        )
    )
    raise AssertionError(
        f"{what}: frames differ\n{diff}\nexpected {want_b.hex()}\ngot      {got.hex()}"
    )


def checksums_ok(frame: bytes) -> list[str]:
    """Which checksums of an IPv4 frame do not verify (empty: all good). scapy recomputes
    each one; a UDP checksum of 0 means "none" and is accepted."""
    p = Ether(frame)
    bad = []
    if IP not in p:
        return ["not IPv4"]
    ip = p[IP]
    fresh = IP(bytes(ip.copy().__class__(bytes(ip))))  # parse again
    re_ip = fresh.copy()
    del re_ip.chksum
    if IP(bytes(re_ip)).chksum != ip.chksum:
        bad.append(f"ip {ip.chksum:#06x}")
    for layer in (TCP, UDP, ICMP):
        if layer in ip and not (ip.frag or ip.flags.MF):
            l4 = ip[layer]
            if layer is UDP and l4.chksum == 0:
                continue
            again = ip.copy()
            del again[layer].chksum
            want = IP(bytes(again))[layer].chksum
            if want != l4.chksum:
                bad.append(f"{layer.__name__.lower()} {l4.chksum:#06x} (want {want:#06x})")
    return bad


def partial_checksum_ok(frame: bytes) -> bool:
    """For a frame captured on a veth before checksum offload ran (CHECKSUM_PARTIAL), the
    TCP/UDP checksum field holds the folded pseudo-header sum, not a full checksum. True when
    that sum matches the frame's (translated) addresses, i.e. the NIC would complete a valid
    checksum."""
    import socket
    import struct

    ip = Ether(frame)[IP]
    l4 = bytes(ip.payload)
    ph = socket.inet_aton(ip.src) + socket.inet_aton(ip.dst)
    ph += struct.pack("!BBH", 0, ip.proto, len(l4))
    s = sum(struct.unpack(f"!{len(ph) // 2}H", ph))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    field = {6: 16, 17: 6}[ip.proto]
    return int.from_bytes(l4[field : field + 2], "big") == s
