"""Sections 1-6: one probe per path a packet to or from a VM can take (from outside, out of the
VM, VM to VM's LB IP, pod to VM's LB IP, hairpin, a node to a VM's LB IP), each a row, run
concurrently."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from cozylab.cluster.rows import Case, Group
from cozylab.cluster.spec import CLIENT_IP, SERVER_IP, SERVER_TCP, SERVER_UDP, node_name

if TYPE_CHECKING:
    from cozylab.cluster.lab import ClusterLab

SHAPES = ("vm-a", "vm-b", "vm-c")  # sections 1, 2: filter, whole-IP, filter with allowICMP
#: (client, server) for section 3: same node FF, WW, FW, WF; across nodes FF, FW, WF, WW
VM_PAIRS = (
    ("vm-a", "vm-d"),
    ("vm-b", "vm-f"),
    ("vm-c", "vm-b"),
    ("vm-e", "vm-a"),
    ("vm-a", "vm-c"),
    ("vm-c", "vm-e"),
    ("vm-b", "vm-a"),
    ("vm-e", "vm-b"),
)
POD_PAIRS = (("p1", "vm-b"), ("p3", "vm-a"), ("p1", "vm-a"))  # section 4 (the last: one node)
HAIRPIN = ("vm-a", "vm-b")
HOST_PAIRS = ((1, "vm-a"), (1, "vm-b"))  # section 6: on the VM's node, on another
WORKERS = 8


def _both(
    lab: ClusterLab,
    scenario: str,
    case: str,
    ns: str,
    addr: str,
    port: tuple[int, int],
    want: str | None,
) -> list[Case]:
    """A TCP and a UDP echo from `ns` to addr (ports: TCP's, UDP's)."""
    return [
        Case(scenario, f"{case} {proto}", partial(lab.check, proto, ns, addr, p, want))
        for proto, p in zip(("tcp", "udp"), port, strict=True)
    ]


def _lb(lab: ClusterLab, name: str) -> str:
    lb = lab.workloads[name].lb_ip
    assert lb is not None, f"{name} is not a VM"
    return lb


def _same(lab: ClusterLab, a: str, b: str) -> str:
    w = lab.workloads
    return "same node" if w[a].node == w[b].node else "across nodes"


def external_to_vm(lab: ClusterLab) -> list[Case]:
    s, out = "1 external->vm", []
    for name in SHAPES:
        vm, label, lb = lab.workloads[name], lab.where(name), _lb(lab, name)
        for proto, port in (("tcp", 80), ("udp", 53)):
            check = partial(lab.check, proto, lab.client, lb, port, CLIENT_IP)
            out.append(Case(s, f"{label} {proto}/{port}", check))
        out.append(
            Case(s, f"{label} icmp", partial(lab.check_icmp, lb, vm.whole_ip or vm.allow_icmp))
        )
        check = partial(lab.check_unlisted, lb, vm.whole_ip)
        out.append(Case(s, f"{label} tcp/81 unlisted", check))
    return out


def vm_to_external(lab: ClusterLab) -> list[Case]:
    out = []
    for name in SHAPES:
        lb = lab.workloads[name].lb_ip
        ns = lab.pod_ns(name)
        ports = (SERVER_TCP, SERVER_UDP)
        out += _both(lab, "2 vm->external", lab.where(name), ns, SERVER_IP, ports, lb)
    return out


def vm_to_vm(lab: ClusterLab) -> list[Case]:
    out = []
    for a, b in VM_PAIRS:
        case = f"{lab.where(a)} -> {lab.where(b)} {_same(lab, a, b)}"
        want = lab.workloads[a].lb_ip
        out += _both(lab, "3 vm->vm-lb", case, lab.pod_ns(a), _lb(lab, b), (80, 53), want)
    return out


def pod_to_vm(lab: ClusterLab) -> list[Case]:
    s, out = "4 pod->vm-lb", []
    for a, b in POD_PAIRS:
        case, lb = f"{lab.where(a)} -> {lab.where(b)} {_same(lab, a, b)}", _lb(lab, b)
        out += _both(lab, s, case, lab.pod_ns(a), lb, (80, 53), None)
        if not lab.workloads[b].whole_ip:  # the port filter holds for in-cluster clients too
            check = partial(lab.check_unlisted, lb, False, lab.pod_ns(a))
            out.append(Case(s, f"{case} tcp/81 unlisted", check))
    return out


def hairpin(lab: ClusterLab) -> list[Case]:
    out = []
    for name in HAIRPIN:
        lb = _lb(lab, name)
        out += _both(lab, "5 hairpin", lab.where(name), lab.pod_ns(name), lb, (80, 53), lb)
    return out


def host_to_vm(lab: ClusterLab) -> list[Case]:
    s, out = "6 host->vm-lb", []
    for n, name in HOST_PAIRS:
        where = "the VM's node" if lab.workloads[name].node == n else "another node"
        case, lb = f"{node_name(n)} -> {lab.where(name)} ({where})", _lb(lab, name)
        out += _both(lab, s, case, lab.node(n), lb, (80, 53), None)
        if not lab.workloads[name].whole_ip:
            check = partial(lab.check_unlisted, lb, False, lab.node(n))
            out.append(Case(s, f"{case} tcp/81 unlisted", check))
    return out


def group(lab: ClusterLab) -> Group:
    """Sections 1-6, for the workloads of this lab, run `WORKERS` at a time."""
    cases = [
        *external_to_vm(lab),
        *vm_to_external(lab),
        *vm_to_vm(lab),
        *pod_to_vm(lab),
        *hairpin(lab),
        *host_to_vm(lab),
    ]
    return Group(cases, workers=WORKERS)
