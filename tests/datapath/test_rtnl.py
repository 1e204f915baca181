"""cozyebpf's own rtnetlink reads (cozyebpf/datapath/rtnl.py) give what pyroute2 gives: the
XDP program of a device, the cls_bpf filters of a clsact direction, the devices of the default
route (multipath included), the qdiscs of a device. In a lab namespace, with real programs
attached."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from cozyebpf.datapath import attach, bpfsys, rtnl
from cozylab.netns import DEFAULT_PODS, UPLINK, Lab
from tests.support.env import unique_prefix


@pytest.fixture
def lab() -> Iterator[Lab]:
    with Lab(unique_prefix("rt"), pods=DEFAULT_PODS[:2]) as lab:
        yield lab


_MODULES: list[object] = []  # bcc modules keep their programs' fds open


def trivial(prog_type: int, name: str) -> int:
    """A loaded program that returns XDP_PASS / TC_ACT_UNSPEC."""
    from bcc import BPF

    text = f"int {name}(void *ctx) {{ return {2 if prog_type == BPF.XDP else -1}; }}"
    module = BPF(text=text.encode())
    _MODULES.append(module)
    return int(module.load_func(name.encode(), prog_type).fd)


def pyroute2_xdp(ifindex: int) -> int | None:
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        xdp = ipr.get_links(ifindex)[0].get_attr("IFLA_XDP")
    prog_id = dict(xdp.get("attrs", [])).get("IFLA_XDP_PROG_ID") if xdp else None
    return int(prog_id) if prog_id else None


def test_xdp_program_of_a_device(lab: Lab) -> None:
    from bcc import BPF

    def check() -> None:
        idx = socket.if_nametoindex(UPLINK)
        assert rtnl.xdp_program(idx) is None and pyroute2_xdp(idx) is None
        fd = trivial(BPF.XDP, "some_xdp")
        link = bpfsys.link_create(fd, idx, bpfsys.BPF_XDP, flags=attach.XDP_MODES["native"])
        try:
            prog_id = bpfsys.prog_info(fd).id
            assert rtnl.xdp_program(idx) == (prog_id, 1)  # native
            assert pyroute2_xdp(idx) == prog_id
            assert attach.current_xdp(idx) == (prog_id, "xdp")
        finally:
            bpfsys.link_detach(link)
        assert rtnl.xdp_program(idx) is None

    lab.in_ns(lab.node, check)


def test_bpf_filters_of_a_clsact_direction(lab: Lab) -> None:
    from bcc import BPF
    from pyroute2 import IPRoute

    def check() -> None:
        idx = socket.if_nametoindex(UPLINK)
        assert rtnl.bpf_filters(idx, attach.TC_EGRESS_PARENT) == []  # no clsact at all
        fds = [trivial(BPF.SCHED_CLS, n) for n in ("cz_egress", "other_prog")]
        with IPRoute() as ipr:
            ipr.tc("add", "clsact", idx)
            for prio, (fd, name) in enumerate(
                zip(fds, ("cz_egress", "other_prog"), strict=True), start=3
            ):
                ipr.tc(
                    "add-filter",
                    "bpf",
                    idx,
                    parent=attach.TC_EGRESS_PARENT,
                    prio=prio,
                    fd=fd,
                    name=name,
                    direct_action=True,
                )
            theirs = sorted(
                (f["info"] >> 16, f.get_attr("TCA_OPTIONS").get_attr("TCA_BPF_NAME"))
                for f in ipr.get_filters(idx, parent=attach.TC_EGRESS_PARENT)
                if f.get_attr("TCA_OPTIONS") and f.get_attr("TCA_OPTIONS").get_attr("TCA_BPF_NAME")
            )
        ours = sorted(rtnl.bpf_filters(idx, attach.TC_EGRESS_PARENT))
        assert ours == theirs
        assert [p for p, _ in ours] == [3, 4]
        assert attach.legacy_filters(idx, attach.TC_EGRESS_PARENT) == [(3, "cz_egress")]
        assert attach.remove_legacy(idx, attach.TC_EGRESS_PARENT) == [
            "clsact filter cz_egress prio 3"
        ]
        assert [n for _, n in rtnl.bpf_filters(idx, attach.TC_EGRESS_PARENT)] == [theirs[1][1]]
        assert rtnl.bpf_filters(idx, attach.TC_INGRESS_PARENT) == []

    lab.in_ns(lab.node, check)


def test_tc_filters_in_the_order_the_kernel_runs_them(lab: Lab) -> None:
    """rtnl.tc_filters: priority, protocol, handle and name of each filter as pyroute2 reads
    them, and its program, in the kernel's order: by priority, and of one priority the filter
    added last first (a replaced one keeps its place). remove_legacy takes our filter by its
    handle and leaves another's of the same priority (removing by priority took both)."""
    from bcc import BPF
    from pyroute2 import IPRoute

    parent = attach.TC_INGRESS_PARENT
    idx = lab.in_ns(lab.node, lambda: socket.if_nametoindex(UPLINK))

    def add(ipr: IPRoute, cmd: str, fd: int, name: str, prio: int, handle: int) -> None:
        where = {"parent": parent, "prio": prio, "protocol": attach.ETH_P_ALL}
        ipr.tc(cmd, "bpf", idx, handle, fd=fd, name=name, direct_action=True, **where)

    def check() -> None:
        fds = {n: trivial(BPF.SCHED_CLS, n) for n in ("cz_egress", "cil", "late")}
        with IPRoute() as ipr:
            ipr.tc("add", "clsact", idx)
            add(ipr, "add-filter", fds["cil"], "cil", 1, 1)
            add(ipr, "add-filter", fds["late"], "late", 2, 7)
            add(ipr, "add-filter", fds["cz_egress"], "cz_egress", 1, attach.LEGACY_HANDLES[0])
            add(ipr, "replace-filter", fds["cil"], "cil", 1, 1)  # in place
            pr2 = [
                (f["info"] >> 16, socket.ntohs(f["info"] & 0xFFFF), f["handle"], name)
                for f in ipr.get_filters(idx, parent=parent)
                if f.get_attr("TCA_OPTIONS")
                and (name := f.get_attr("TCA_OPTIONS").get_attr("TCA_BPF_NAME"))
            ]
        got = rtnl.tc_filters(idx, parent)
        assert [(f.prio, f.protocol, f.handle, f.name) for f in got] == pr2
        assert [f.prog_id for f in got] == [bpfsys.prog_info(fds[f.name]).id for f in got]
        assert [(f.name, f.handle) for f in got] == [
            ("cz_egress", attach.LEGACY_HANDLES[0]),
            ("cil", 1),
            ("late", 7),
        ]
        assert attach.legacy_first(idx, parent) is True
        assert attach.remove_legacy(idx, parent) == ["clsact filter cz_egress prio 1"]
        assert [f.name for f in rtnl.tc_filters(idx, parent)] == ["cil", "late"]
        assert attach.legacy_first(idx, parent) is None

    lab.in_ns(lab.node, check)


def test_default_route_devices(lab: Lab) -> None:
    from pyroute2 import IPRoute

    def names() -> list[str]:
        return [socket.if_indextoname(i) for i in rtnl.default_route_devices()]

    assert lab.in_ns(lab.client, names) == ["eth0"]
    assert lab.in_ns(lab.node, names) == []  # the node has no default route
    # a multipath default route: every next hop
    node = lab.node
    lab.ip(
        node,
        "route",
        "add",
        "default",
        "nexthop",
        "dev",
        UPLINK,
        "nexthop",
        "dev",
        DEFAULT_PODS[0].host_dev,
    )
    assert lab.in_ns(node, names) == [UPLINK, DEFAULT_PODS[0].host_dev]

    def theirs() -> list[int]:
        with IPRoute() as ipr:
            out = []
            for r in ipr.get_default_routes(family=socket.AF_INET):
                out += [r.get_attr("RTA_OIF")] + [
                    h["oif"] for h in r.get_attr("RTA_MULTIPATH") or []
                ]
            return [i for i in out if i]

    assert lab.in_ns(node, rtnl.default_route_devices) == lab.in_ns(node, theirs)


def test_qdiscs_of_a_device_and_whether_fq_holds_its_egress(lab: Lab) -> None:
    """rtnl.qdiscs gives the qdiscs pyroute2 gives (kind, handle, parent), and egress_qdisc
    what the agent decides shaping on (bpf.py, _shaping): a veth's noqueue, a tbf root, an mq
    root of pfifo_fast children (the uplink with two transmit queues), a clsact beside them not
    counted as a root. fq itself needs a kernel with it (test_shaping.py, in the CI guest)."""
    from pyroute2 import IPRoute

    from cozyebpf.datapath.bpf import egress_qdisc

    def both() -> tuple[list[rtnl.Qdisc], list[rtnl.Qdisc], tuple[bool, str]]:
        idx = socket.if_nametoindex(UPLINK)
        with IPRoute() as ipr:
            theirs = [
                rtnl.Qdisc(q.get_attr("TCA_KIND"), q["handle"], q["parent"])
                for q in ipr.get_qdiscs(idx)
            ]
        return rtnl.qdiscs(idx), theirs, egress_qdisc(idx)

    node = lab.node
    ours, theirs, held = lab.in_ns(node, both)
    assert ours == theirs and [q.kind for q in ours] == ["noqueue"], ours
    assert held == (False, "noqueue")
    lab.exec(node, "tc", "qdisc", "add", "dev", UPLINK, "clsact")
    lab.exec(node, "tc", "qdisc", "add", "dev", UPLINK, "root", "tbf", "rate", "1mbit",
             "burst", "32kbit", "latency", "400ms")  # fmt: skip
    ours, theirs, held = lab.in_ns(node, both)
    assert ours == theirs and {q.kind for q in ours} == {"tbf", "clsact"}, ours
    assert held == (False, "tbf")
    lab.exec(node, "tc", "qdisc", "del", "dev", UPLINK, "root")
    lab.exec(node, "ethtool", "-L", UPLINK, "tx", "2")
    lab.exec(node, "tc", "qdisc", "add", "dev", UPLINK, "root", "handle", "1:", "mq")
    ours, theirs, held = lab.in_ns(node, both)
    assert ours == theirs, (ours, theirs)
    assert held == (False, "mq of pfifo_fast"), ours
    assert sorted(q.parent for q in ours if q.kind == "pfifo_fast") == [0x10001, 0x10002], ours
