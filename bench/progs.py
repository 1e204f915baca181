"""The bench's own BPF programs (bench/bpf/*.c), compiled with bcc like the product's."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cozyebpf.datapath import bpfsys

BPF_DIR = Path(__file__).resolve().parent / "bpf"
XDP_TX, XDP_DROP, XDP_PASS = 3, 1, 2


@dataclass
class Generator:
    """bench_gen: copies a 60-byte template over each live frame, then XDP_TX (or another
    verdict: XDP_DROP measures the generator alone)."""

    bpf: Any
    fd: int

    @classmethod
    def load(cls, verdict: int = XDP_TX) -> Generator:
        from bcc import BPF

        b = BPF(src_file=str(BPF_DIR / "gen.c").encode(), cflags=[f"-DGEN_VERDICT={verdict}"])
        return cls(b, b.load_func(b"bench_gen", BPF.XDP).fd)

    def set_frame(self, frame: bytes, spread: int = 1) -> None:
        """The template; `spread` > 1 (IPv4): each frame to the next of that many consecutive
        destination addresses from the frame's, in turn (bpf/gen.c)."""
        assert len(frame) == 60, len(frame)
        t = self.bpf[b"gen_tmpl"]
        v = t.Leaf()
        ctypes.memmove(ctypes.addressof(v), frame + bytes(4), 64)
        v.spread = spread
        t[ctypes.c_int(0)] = v


@dataclass
class Sinks:
    """bench_count / bench_drop / bench_pass / bench_tc_next."""

    bpf: Any
    count_fd: int
    drop_fd: int
    pass_fd: int
    tc_next_fd: int

    @classmethod
    def load(cls) -> Sinks:
        from bcc import BPF

        b = BPF(src_file=str(BPF_DIR / "sink.c").encode())
        return cls(
            b,
            b.load_func(b"bench_count", BPF.XDP).fd,
            b.load_func(b"bench_drop", BPF.XDP).fd,
            b.load_func(b"bench_pass", BPF.XDP).fd,
            b.load_func(b"bench_tc_next", BPF.SCHED_CLS).fd,
        )

    def counted(self) -> int:
        """Frames counted by every attached bench_count instance (they share the map)."""
        return int(self.bpf[b"sink_count"].sum(0).value)


def attach_xdp_native(prog_fd: int, ifindex: int) -> int:
    """An unpinned native-XDP link (closing the fd detaches it). Call inside the namespace."""
    return bpfsys.link_create(prog_fd, ifindex, bpfsys.BPF_XDP, flags=bpfsys.XDP_FLAGS_DRV_MODE)


@dataclass
class MinimalNat:
    """bench_min_nat (bench/bpf/minimal_nat.c): the issue's "minimal XDP NAT with no extras";
    bench_min_snat (snat_fd), its egress half in tcx."""

    bpf: Any
    fd: int
    snat_fd: int

    @classmethod
    def load(cls) -> MinimalNat:
        from bcc import BPF

        b = BPF(src_file=str(BPF_DIR / "minimal_nat.c").encode())
        return cls(
            b,
            b.load_func(b"bench_min_nat", BPF.XDP).fd,
            b.load_func(b"bench_min_snat", BPF.SCHED_CLS).fd,
        )

    def seed(
        self, services: dict[str, tuple[str, bool]], allowed: list[tuple[str, int, int]]
    ) -> None:
        """services: LB IP -> (pod IP, port filter); allowed: (pod IP, proto number, port)."""
        import socket
        import struct

        svc, allow, pods = self.bpf[b"min_svc4"], self.bpf[b"min_allow4"], self.bpf[b"min_pod4"]
        for lb, (pod, pf) in services.items():
            k = svc.Key.from_buffer_copy(socket.inet_aton(lb))
            v = svc.Leaf.from_buffer_copy(socket.inet_aton(pod) + struct.pack("=I", int(pf)))
            svc[k] = v
            pods[pods.Key.from_buffer_copy(socket.inet_aton(pod))] = pods.Leaf.from_buffer_copy(
                socket.inet_aton(lb)
            )
        for pod, proto, port in allowed:
            k = allow.Key.from_buffer_copy(
                socket.inet_aton(pod) + struct.pack("!BBH", proto, 0, port)
            )
            allow[k] = allow.Leaf(1)


@dataclass
class Parts:
    """bench/bpf/parts.c: the parts of a packet's cost, one program each (see progrun)."""

    bpf: Any
    fds: dict[str, int]

    NAMES = ("addr_hit", "addr_miss", "flow_hit", "hint", "count", "rewrite", "fib")

    @classmethod
    def load(cls) -> Parts:
        from bcc import BPF

        b = BPF(src_file=str(BPF_DIR / "parts.c").encode())
        return cls(b, {n: b.load_func(f"parts_{n}".encode(), BPF.XDP).fd for n in cls.NAMES})

    def seed(self, dst: str, src: str, sport: int, dport: int, proto: int) -> None:
        """The frame's destination in the address map (among 20000 others) and its flow, as a
        reply of (dst, dport) to (src, sport), in the flow map."""
        import socket
        import struct

        addr, flows = self.bpf[b"parts_addr4"], self.bpf[b"parts_flow4"]
        for i in range(20000):
            addr[addr.Key.from_buffer_copy(struct.pack("!I", (10 << 24) + i))] = addr.Leaf()
        addr[addr.Key.from_buffer_copy(socket.inet_aton(dst))] = addr.Leaf()
        key = (
            socket.inet_aton(dst)
            + socket.inet_aton(src)
            + struct.pack("!HHB3x", dport, sport, proto)
        )
        flows[flows.Key.from_buffer_copy(key)] = ctypes.c_uint64(1)
