"""60-byte Ethernet/IPv4/UDP frames built by hand (no scapy needed), with valid checksums."""

from __future__ import annotations

import socket
import struct

from cozyebpf.explain import inet_csum

FRAME_LEN = 60  # the minimum Ethernet frame without FCS: 14 + 20 + 8 + 18 bytes of payload


def mac(text: str) -> bytes:
    return bytes(int(b, 16) for b in text.split(":"))


def udp_frame(
    src_mac: str, dst_mac: str, src: str, dst: str, sport: int, dport: int, ttl: int = 64
) -> bytes:
    payload = b"cozyebpf-bench-pkt"[: FRAME_LEN - 42].ljust(FRAME_LEN - 42, b"\0")
    ulen = 8 + len(payload)
    s, d = socket.inet_aton(src), socket.inet_aton(dst)
    pseudo = s + d + struct.pack("!BBH", 0, socket.IPPROTO_UDP, ulen)
    udp = struct.pack("!HHHH", sport, dport, ulen, 0) + payload
    uc = inet_csum(pseudo + udp) or 0xFFFF
    udp = udp[:6] + struct.pack("!H", uc) + udp[8:]
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + ulen, 1, 0, ttl, socket.IPPROTO_UDP, 0, s, d)
    ip = ip[:10] + struct.pack("!H", inet_csum(ip)) + ip[12:]
    frame = mac(dst_mac) + mac(src_mac) + b"\x08\x00" + ip + udp
    assert len(frame) == FRAME_LEN
    return frame
