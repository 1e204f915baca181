"""A namespace lab: client -- node -- pods, built from veth pairs, for the demo and the tests.

    client ns                node ns                               pod ns (one per pod)
    eth0 198.51.100.2/24 === uplink 198.51.100.1/24
                             lxc-podN (10.244.0.1/32) =========== eth0 10.244.1.N0/32
                             routes 10.244.1.N0/32 dev lxc-podN      default via 10.244.0.1

The node routes a /32 (and an IPv6 /128 from 2001:db8:244::/64) to each pod veth, as Cilium
does; the client is also 2001:db8:100::2 behind the node's 2001:db8:100::1. The client's
default route points at the node, so LB IPs (203.0.113.0/24, 2001:db8:113::/64) reach the
node's uplink, where cozyebpf runs. Neighbour entries are static and MACs fixed, so packets are
predictable byte for byte. Only documentation ranges and 10.244.0.0/16 are used, and only
inside these namespaces.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

T = TypeVar("T")

CLONE_NEWNET = 0x40000000

CLIENT_IP = "198.51.100.2"
NODE_UPLINK_IP = "198.51.100.1"
NODE_POD_GW = "10.244.0.1"
# IPv6, all in the documentation prefix 2001:db8::/32
CLIENT_IP6 = "2001:db8:100::2"
NODE_UPLINK_IP6 = "2001:db8:100::1"
NODE_POD_GW6 = "2001:db8:244::1"
CLIENT_MAC = "02:00:00:00:00:01"
UPLINK_MAC = "02:00:00:00:00:02"
UPLINK = "uplink"


@dataclass(frozen=True)
class Pod:
    name: str
    ip: str
    index: int

    @property
    def mac(self) -> str:  # the pod's eth0
        return f"02:00:00:00:{self.index:02x}:02"

    @property
    def host_mac(self) -> str:  # the node's lxc-<name>
        return f"02:00:00:00:{self.index:02x}:01"

    @property
    def host_dev(self) -> str:
        return f"lxc-{self.name}"

    @property
    def ip6(self) -> str:
        return f"2001:db8:244::{self.index:x}0"


DEFAULT_PODS = (
    Pod("pod1", "10.244.1.10", 1),
    Pod("pod2", "10.244.1.20", 2),
    Pod("pod3", "10.244.1.30", 3),
)

_libc = ctypes.CDLL(None, use_errno=True)


def wait_for(
    pred: Callable[[], T], timeout: float = 10.0, what: str | Callable[[], str] = "condition"
) -> T:
    """Poll `pred` until it returns something truthy and return that; raise TimeoutError
    naming `what` (or what it returns, computed at the timeout) and the last result."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = pred()
        except Exception as e:  # not there yet
            last = e
        else:
            if last:
                return cast(T, last)
        time.sleep(0.02)
    desc = what() if callable(what) else what
    raise TimeoutError(f"timed out after {timeout}s waiting for {desc} (last: {last!r})")


def run(
    *cmd: str, check: bool = True, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(cmd, capture_output=True, text=True, input=input)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def in_netns(ns: str, fn: Callable[[], T]) -> T:
    """Run `fn` in a thread that has entered only the network namespace `ns` (/run/netns/ns, or
    a path: a real Pod's /proc/<pid>/ns/net). Sockets (netlink included) it opens stay in `ns`;
    file descriptors stay usable by the caller; BPF_PROG_RUN from it runs in `ns`
    (bpf_fib_lookup asks that namespace's routes)."""
    out: dict[str, Any] = {}

    def worker() -> None:
        try:
            fd = os.open(ns if ns.startswith("/") else f"/run/netns/{ns}", os.O_RDONLY)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns {ns}")
            finally:
                os.close(fd)
            out["result"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            out["err"] = e

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    if "err" in out:
        raise out["err"]
    result: T = out["result"]
    return result


@dataclass
class Lab:
    prefix: str = "cz"
    pods: Sequence[Pod] = DEFAULT_PODS

    @property
    def client(self) -> str:
        return f"{self.prefix}-client"

    @property
    def node(self) -> str:
        return f"{self.prefix}-node"

    def pod_ns(self, pod: Pod) -> str:
        return f"{self.prefix}-{pod.name}"

    @property
    def all_namespaces(self) -> list[str]:
        return [self.client, self.node, *(self.pod_ns(p) for p in self.pods)]

    # -- building ------------------------------------------------------------------------

    def up(self) -> Lab:
        self.down()
        for ns in self.all_namespaces:
            self.add_namespace(ns)
        self.sysctl(self.node, "net.ipv4.ip_forward", "1")
        self.sysctl(self.node, "net.ipv6.conf.all.forwarding", "1")
        c, n = self.client, self.node
        self.veth(n, UPLINK, UPLINK_MAC, c, "eth0", CLIENT_MAC)
        self.ip(c, "addr", "add", f"{CLIENT_IP}/24", "dev", "eth0")
        self.ip(c, "link", "set", "eth0", "up")
        self.ip(c, "route", "add", "default", "via", NODE_UPLINK_IP)
        self.neigh(c, NODE_UPLINK_IP, UPLINK_MAC, "eth0")
        self.ip(c, "-6", "addr", "add", f"{CLIENT_IP6}/64", "dev", "eth0", "nodad")
        self.ip(c, "-6", "route", "add", "default", "via", NODE_UPLINK_IP6)
        self.neigh(c, NODE_UPLINK_IP6, UPLINK_MAC, "eth0")
        self.ip(n, "addr", "add", f"{NODE_UPLINK_IP}/24", "dev", UPLINK)
        self.ip(n, "link", "set", UPLINK, "up")
        self.neigh(n, CLIENT_IP, CLIENT_MAC, UPLINK)
        self.ip(n, "-6", "addr", "add", f"{NODE_UPLINK_IP6}/64", "dev", UPLINK, "nodad")
        self.neigh(n, CLIENT_IP6, CLIENT_MAC, UPLINK)
        for p in self.pods:
            pns = self.pod_ns(p)
            self.veth(n, p.host_dev, p.host_mac, pns, "eth0", p.mac)
            self.ip(n, "addr", "add", f"{NODE_POD_GW}/32", "dev", p.host_dev)
            self.ip(n, "link", "set", p.host_dev, "up")
            self.ip(n, "route", "add", f"{p.ip}/32", "dev", p.host_dev)
            self.neigh(n, p.ip, p.mac, p.host_dev)
            self.ip(pns, "addr", "add", f"{p.ip}/32", "dev", "eth0")
            self.ip(pns, "link", "set", "eth0", "up")
            self.ip(pns, "route", "add", NODE_POD_GW, "dev", "eth0")
            self.ip(pns, "route", "add", "default", "via", NODE_POD_GW)
            self.neigh(pns, NODE_POD_GW, p.host_mac, "eth0")
            self.ip(n, "-6", "addr", "add", f"{NODE_POD_GW6}/128", "dev", p.host_dev, "nodad")
            self.ip(n, "-6", "route", "add", f"{p.ip6}/128", "dev", p.host_dev)
            self.neigh(n, p.ip6, p.mac, p.host_dev)
            self.ip(pns, "-6", "addr", "add", f"{p.ip6}/128", "dev", "eth0", "nodad")
            self.ip(pns, "-6", "route", "add", NODE_POD_GW6, "dev", "eth0")
            self.ip(pns, "-6", "route", "add", "default", "via", NODE_POD_GW6)
            self.neigh(pns, NODE_POD_GW6, p.host_mac, "eth0")
        return self

    def add_namespace(self, ns: str) -> None:
        """A new namespace, lo up, no reverse-path filter, IPv6 without DAD or RAs."""
        run("ip", "netns", "add", ns)
        self.ip(ns, "link", "set", "lo", "up")
        for key in ("all", "default"):
            self.sysctl(ns, f"net.ipv4.conf.{key}.rp_filter", "0")
            self.sysctl(ns, f"net.ipv6.conf.{key}.accept_dad", "0")
            self.sysctl(ns, f"net.ipv6.conf.{key}.accept_ra", "0")

    def down(self) -> None:
        existing = run("ip", "netns", "list", check=False).stdout.split()
        for ns in self.all_namespaces:
            if ns in existing:
                run("ip", "netns", "del", ns, check=False)

    def __enter__(self) -> Lab:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- doing things inside -------------------------------------------------------------

    def veth(self, ns: str, name: str, mac: str, peer_ns: str, peer: str, peer_mac: str) -> None:
        """A veth pair with fixed MACs: `name` in `ns`, `peer` in `peer_ns`."""
        self.ip(
            ns,
            "link",
            "add",
            name,
            "address",
            mac,
            "type",
            "veth",
            "peer",
            "name",
            peer,
            "address",
            peer_mac,
            "netns",
            peer_ns,
        )

    def neigh(self, ns: str, ip: str, mac: str, dev: str) -> None:
        """A permanent neighbour entry: no ARP in the lab, so no first packet is lost."""
        self.ip(ns, "neigh", "replace", ip, "lladdr", mac, "dev", dev, "nud", "permanent")

    def ip(self, ns: str, *args: str) -> subprocess.CompletedProcess[str]:
        return run("ip", "-n", ns, *args)

    def sysctl(self, ns: str, key: str, value: str) -> None:
        self.exec(ns, "sysctl", "-q", "-w", f"{key}={value}")

    def nsenter(self, ns: str) -> list[str]:
        """Command prefix that enters only the network namespace (unlike `ip netns exec`, it
        keeps /sys, so bpffs pins stay visible)."""
        return ["nsenter", f"--net=/run/netns/{ns}"]

    def exec(
        self, ns: str, *cmd: str, check: bool = True, timeout: float = 30, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        p = subprocess.run(
            [*self.nsenter(ns), *cmd], capture_output=True, text=True, timeout=timeout, input=input
        )
        if check and p.returncode != 0:
            raise RuntimeError(
                f"[{ns}] {' '.join(cmd)} failed ({p.returncode}): "
                f"{p.stdout.strip()} {p.stderr.strip()}"
            )
        return p

    def popen(self, ns: str, *cmd: str, **kw: Any) -> subprocess.Popen[str]:
        return subprocess.Popen([*self.nsenter(ns), *cmd], text=True, **kw)

    def in_ns(self, ns: str, fn: Callable[[], T]) -> T:
        """Run `fn` in a thread inside `ns` (`in_netns`)."""
        return in_netns(ns, fn)

    def ns_socket(self, ns: str, family: int, type: int, proto: int = 0) -> socket.socket:
        """A socket created inside `ns` (a socket keeps the namespace it was made in)."""
        return self.in_ns(ns, lambda: socket.socket(family, type, proto))

    def packet_socket(self, ns: str, dev: str) -> socket.socket:
        """An AF_PACKET socket bound to `dev` in `ns`, for sending and capturing frames."""
        s = self.ns_socket(ns, socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
        s.bind((dev, 0))
        return s


PACKET_OUTGOING = 4


def drain(sock: socket.socket) -> None:
    sock.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        while True:
            sock.recv(65535)
    sock.setblocking(True)


def capture(
    sock: socket.socket, timeout: float = 1.0, incoming_only: bool = True
) -> Iterator[bytes]:
    """Frames received on a packet socket until `timeout` passes without one."""
    sock.settimeout(timeout)
    while True:
        try:
            data, addr = sock.recvfrom(65535)
        except TimeoutError:
            return
        if incoming_only and addr[2] == PACKET_OUTGOING:
            continue
        yield data


def cozy_proxy_ruleset(mappings: Sequence[tuple[str, str]]) -> str:
    """The stateless 1:1 NAT of cozy-proxy's nftables mode (table `ip cozy_proxy`, maps
    svc_pod/pod_svc) for (LB IP, pod IP) pairs: the approach that Cilium 1.19's wildcard
    LB entries break, kept here to reproduce that failure and as a benchmark baseline."""
    svc_pod = ", ".join(f"{lb} : {pod}" for lb, pod in mappings)
    pod_svc = ", ".join(f"{pod} : {lb}" for lb, pod in mappings)
    return f"""
table ip cozy_proxy {{
    map svc_pod {{ type ipv4_addr : ipv4_addr; elements = {{ {svc_pod} }} }}
    map pod_svc {{ type ipv4_addr : ipv4_addr; elements = {{ {pod_svc} }} }}
    chain egress_snat {{
        type filter hook prerouting priority raw; policy accept;
        ip saddr set ip saddr map @pod_svc
    }}
    chain ingress_dnat {{
        type filter hook prerouting priority mangle; policy accept;
        ip daddr set ip daddr map @svc_pod
    }}
}}
"""
