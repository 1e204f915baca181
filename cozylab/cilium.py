"""The stand-in for Cilium's tc programs (cozylab/bpf/cilium_like.c), loaded with bcc: the
cluster lab's observer on each node's ovn0 and tunnel (or eth0) and the datapath tests' copy
on the node's uplink (tests/datapath/test_cilium_repro.py, test_zero_downtime.py).

A `Point` is where one entry program sits: a device in a namespace and its hooks: tcx ingress
and egress, appended at the tail, as Cilium attaches where the kernel has tcx; or legacy clsact
filters, as it attaches on a kernel without (before 6.6): priority 1 (its TCFilterPriority),
protocol all, handle 1, replaced in place when it attaches again (cilium
pkg/datapath/loader/tc.go, attachTCProgram: netlink.FilterReplace). Each point counts on its
own: packets to an LB IP, from one, dropped."""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from cozyebpf.datapath import bpfsys
from cozylab.netns import UPLINK, Lab

SOURCE = Path(__file__).resolve().parent / "bpf" / "cilium_like.c"
#: the hooks a point may have: tcx (appended at the tail) or a legacy clsact filter (Cilium's)
HOOKS = ("ingress", "egress", "tc-ingress", "tc-egress")
TC_PARENTS = {"tc-ingress": 0xFFFFFFF2, "tc-egress": 0xFFFFFFF3}
#: Cilium's legacy filters: priority, handle, protocol (ETH_P_ALL)
CILIUM_PRIO, CILIUM_HANDLE, ETH_P_ALL = 1, 1, 3
#: the port the tests' LB IP lists (test_cilium_repro: a whole-IP Service with spec.ports 22)
LISTED = 22


@dataclass(frozen=True)
class Point:
    ns: str
    dev: str
    hooks: tuple[str, ...] = ("ingress",)
    node: int = 0  # the cluster lab's node number, for its report

    @property
    def name(self) -> str:
        return f"{self.dev} {' + '.join(self.hooks)}"


@dataclass(frozen=True)
class Count:
    point: Point
    to_lb: int  # packets to an LB IP
    from_lb: int  # packets from one
    dropped: int


class CiliumLike:
    """The program, one entry per point, attached to every point's hooks. `lbs`: LB IP ->
    the port its Service lists (0: none; TCP and UDP to a listed port pass). `drop`: drop
    what Cilium's wildcard entry drops, else only count."""

    def __init__(
        self, lab: Lab, points: Sequence[Point], lbs: Mapping[str, int], drop: bool = True
    ) -> None:
        from bcc import BPF

        for p in points:
            if bad := set(p.hooks) - set(HOOKS):
                raise ValueError(f"{p.name}: unknown hooks {sorted(bad)}, not in {HOOKS}")
        self.points = list(points)
        text = SOURCE.read_text() + "".join(
            f"int cilium_like_{i}(struct __sk_buff *skb) {{ return observe(skb, {i}); }}\n"
            for i in range(1, len(self.points))
        )
        self.bpf: Any = BPF(text=text.encode(), cflags=[f"-DNPOINTS={len(self.points)}"])
        table = self.bpf[b"lbs"]
        for ip, port in lbs.items():
            table[table.Key(int.from_bytes(socket.inet_aton(ip), "little"))] = table.Leaf(port)
        self.bpf[b"cfg"][ctypes.c_int(0)] = ctypes.c_uint32(1 if drop else 0)
        self.lab = lab
        self.links: list[int] = []
        self._fds: list[tuple[int, str]] = []  # each point's program and name
        try:
            for i, p in enumerate(self.points):
                name = "cilium_like" if i == 0 else f"cilium_like_{i}"
                fd = self.bpf.load_func(name.encode(), BPF.SCHED_CLS).fd
                self._fds.append((fd, name))
                lab.in_ns(p.ns, partial(self._attach, p, fd, name))
        except BaseException:
            self.close()
            raise

    @classmethod
    def on_uplink(cls, lab: Lab, lb_ip: str, listed_port: int = LISTED) -> CiliumLike:
        """The copy of the datapath tests: one program on the node's uplink, tcx ingress and
        egress and a legacy clsact ingress filter, for one LB IP that lists `listed_port`."""
        return cls(
            lab,
            [Point(lab.node, UPLINK, ("ingress", "egress", "tc-ingress"))],
            {lb_ip: listed_port},
        )

    def _attach(self, p: Point, fd: int, name: str) -> None:
        """In p's namespace."""
        idx = socket.if_nametoindex(p.dev)
        for hook, kind in (("ingress", bpfsys.BPF_TCX_INGRESS), ("egress", bpfsys.BPF_TCX_EGRESS)):
            if hook in p.hooks:
                self.links.append(bpfsys.link_create(fd, idx, kind))
        for hook in ("tc-ingress", "tc-egress"):
            if hook in p.hooks:
                self._legacy(idx, fd, name, TC_PARENTS[hook])

    @staticmethod
    def _legacy(idx: int, fd: int, name: str, parent: int, anew: bool = False) -> None:
        """Cilium's legacy attach (in the point's namespace): the clsact qdisc, then its filter
        at priority 1, handle 1, protocol all, replaced where it is; `anew`: deleted first, as
        on a device Cilium attaches to for the first time (it goes in front of the others of
        its priority then)."""
        import errno

        from pyroute2 import IPRoute
        from pyroute2.netlink.exceptions import NetlinkError

        with IPRoute() as ipr:
            try:
                ipr.tc("add", "clsact", idx)
            except NetlinkError as e:
                if e.code != errno.EEXIST:
                    raise
            where: dict[str, Any] = {"parent": parent, "prio": CILIUM_PRIO, "protocol": ETH_P_ALL}
            if anew:
                ipr.tc("del-filter", "bpf", idx, CILIUM_HANDLE, **where)
            ipr.tc(
                "replace-filter",
                "bpf",
                idx,
                CILIUM_HANDLE,
                fd=fd,
                name=name,
                direct_action=True,
                **where,
            )

    def attach_legacy_again(self, anew: bool = False) -> None:
        """Every point's legacy filters attached again as Cilium does when it restarts
        (replaced in place), or `anew` (deleted and added: in front of the others)."""
        for p, (fd, name) in zip(self.points, self._fds, strict=True):
            for hook in ("tc-ingress", "tc-egress"):
                if hook in p.hooks:
                    self.lab.in_ns(
                        p.ns, partial(self._legacy_on, p.dev, fd, name, TC_PARENTS[hook], anew)
                    )

    def attach_tcx_anew(self) -> None:
        """Every point's tcx links detached and made again, appended at the tail, as Cilium
        attaches on a device for the first time (the same program: tcx refuses one program
        twice on a hook, so the old links go first)."""
        for fd in self.links:
            bpfsys.link_detach(fd)
            os.close(fd)
        self.links = []
        for p, (fd, name) in zip(self.points, self._fds, strict=True):
            tcx = replace(p, hooks=tuple(h for h in p.hooks if h in ("ingress", "egress")))
            self.lab.in_ns(p.ns, partial(self._attach, tcx, fd, name))

    @classmethod
    def _legacy_on(cls, dev: str, fd: int, name: str, parent: int, anew: bool) -> None:
        cls._legacy(socket.if_nametoindex(dev), fd, name, parent, anew)

    def counts(self) -> list[Count]:
        """What each point counted so far, in the order of `points`."""
        t = self.bpf[b"counts"]
        vals = [int(t[ctypes.c_int(i)].value) for i in range(len(self.points) * 3)]
        return [Count(p, *vals[i * 3 : i * 3 + 3]) for i, p in enumerate(self.points)]

    def to_lb(self) -> tuple[int, int]:
        """(packets to an LB IP, dropped) over every point: what Cilium would have seen and
        dropped of them (packets from an LB IP, cozyebpf's answers, are not its business)."""
        c = self.counts()
        return sum(x.to_lb for x in c), sum(x.dropped for x in c)

    def close(self) -> None:
        """Detach the tcx links and unload. A legacy filter stays with its device (its clsact
        qdisc may hold the agent's filters too); the namespace's end removes it."""
        for fd in self.links:
            with contextlib.suppress(OSError):
                bpfsys.link_detach(fd)
            with contextlib.suppress(OSError):
                os.close(fd)
        self.links.clear()
        self.bpf.cleanup()
