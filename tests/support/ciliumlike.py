"""A stand-in for Cilium's tc programs on the node's uplink (see bpf/cilium_like.c): attached
via tcx at the tail and as a legacy clsact filter on ingress, and via tcx on egress."""

from __future__ import annotations

import ctypes
import socket
from pathlib import Path

from cozyebpf.datapath import bpfsys
from cozylab.netns import UPLINK, Lab

LISTED = 22
TC_INGRESS_PARENT = 0xFFFFFFF2


class CiliumLike:
    """The stand-in program, attached to the node's uplink via tcx (tail) and a legacy
    clsact filter, both ingress; plus a tcx egress copy to check our place in that chain."""

    def __init__(self, lab: Lab, lb_ip: str, listed_port: int = LISTED) -> None:
        from bcc import BPF

        src = Path(__file__).parent / "bpf" / "cilium_like.c"
        lb_be32 = int.from_bytes(socket.inet_aton(lb_ip), "little")
        self.bpf = BPF(
            src_file=str(src).encode(),
            cflags=[f"-DLB_IP={lb_be32}U", f"-DLISTED_PORT={listed_port}"],
        )
        self.fd = self.bpf.load_func(b"cilium_like", BPF.SCHED_CLS).fd
        self.lab = lab
        self.links: list[int] = []

        def attach() -> None:
            from pyroute2 import IPRoute

            idx = socket.if_nametoindex(UPLINK)
            self.links.append(bpfsys.link_create(self.fd, idx, bpfsys.BPF_TCX_INGRESS))
            self.links.append(bpfsys.link_create(self.fd, idx, bpfsys.BPF_TCX_EGRESS))
            with IPRoute() as ipr:
                ipr.tc("add", "clsact", idx)
                ipr.tc(
                    "add-filter",
                    "bpf",
                    idx,
                    ":1",
                    fd=self.fd,
                    name="cilium_like",
                    parent=TC_INGRESS_PARENT,
                    prio=1,
                    direct_action=True,
                )

        lab.in_ns(lab.node, attach)

    def counts(self) -> tuple[int, int, int]:
        t = self.bpf[b"counts"]
        return tuple(t[ctypes.c_int(i)].value for i in range(3))  # type: ignore[return-value]

    def close(self) -> None:
        for fd in self.links:
            bpfsys.link_detach(fd)
        self.bpf.cleanup()
