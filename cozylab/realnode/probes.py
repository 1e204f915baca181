"""One-shot probes of the real-node lab, each as a user would try it: from the client namespace
(TCP, UDP, ICMP to an LB IP), from a backend Pod through the API (`kubectl exec`: its egress as
the far side sees it), and on a node (what is attached and pinned)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
from dataclasses import dataclass

from cozylab.realnode.lab import RealNodeLab
from cozylab.traffic import describe

#: what a probe saw: True when it got what it expected, and what that was
Seen = tuple[bool, str]


def tcp(lab: RealNodeLab, ip: str, port: int, send: bytes, timeout: float = 2.0) -> str:
    """Connect from the client, send `send`, return the first answer (or the error)."""
    s = lab.net.ns_socket(lab.client, socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect((ip, port))
        s.sendall(send)
        return s.recv(4096).decode(errors="replace")
    except OSError as e:
        return describe(e)
    finally:
        s.close()


def udp(lab: RealNodeLab, ip: str, port: int, send: bytes, timeout: float = 2.0) -> str:
    s = lab.net.ns_socket(lab.client, socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(timeout)
    try:
        s.sendto(send, (ip, port))
        data, src = s.recvfrom(4096)
        return f"{data.decode(errors='replace')} from {src[0]}"
    except OSError as e:
        return describe(e)
    finally:
        s.close()


def ping(lab: RealNodeLab, ip: str) -> Seen:
    p = lab.net.exec(lab.client, "ping", "-c", "1", "-W", "2", ip, check=False)
    m = re.search(r"from (\S+): icmp_seq=1", p.stdout)
    return p.returncode == 0, (f"echo reply from {m.group(1).rstrip(':')}" if m else "no reply")


def http(lab: RealNodeLab, ip: str) -> str:
    """GET / (the echo answers with its Pod's name and the client's address as it saw it)."""
    return tcp(lab, ip, 80, f"GET / HTTP/1.0\r\nHost: {ip}\r\n\r\n".encode()).rpartition("\r\n")[2]


def egress(lab: RealNodeLab, namespace: str, pod: str, proto: str, dst: str) -> Seen:
    """`kubectl exec POD -- /echo dial PROTO DST` (a connection the Pod opens to the client's
    echo hub, which answers with the source address it saw): (answered, that address)."""
    p = lab.kubectl(
        "exec", "-n", namespace, pod, "--", "/echo", "dial", proto, dst, "hello", check=False
    )
    if p.returncode != 0:
        return False, f"kubectl exec: {p.stderr.strip() or p.stdout.strip()}"
    seen, _, rest = p.stdout.strip().partition(" ")
    return rest == "hello", seen


@dataclass(frozen=True)
class Datapath:
    """What a node has of cozyebpf, read in the node's own namespaces (as an operator on the
    node would: ip link, its bpffs)."""

    xdp: bool
    pins: list[str]

    @property
    def attached(self) -> bool:
        return self.xdp and bool(self.pins)


def datapath(lab: RealNodeLab, node: str, pin_dir: str = "/sys/fs/bpf/cozyebpf") -> Datapath:
    n = lab.node(node)
    link = subprocess.run(
        [*n.enter(), "ip", "-j", "-d", "link", "show", "eth0"],
        capture_output=True,
        text=True,
        check=True,
    )
    (info,) = json.loads(link.stdout)
    ls = subprocess.run([*n.enter(), "ls", "-1", pin_dir], capture_output=True, text=True)
    return Datapath("xdp" in info, ls.stdout.split() if ls.returncode == 0 else [])


def slices_ready(lab: RealNodeLab, namespace: str) -> dict[str, list[tuple[str, bool, str]]]:
    """The EndpointSlices of `namespace` as the API has them: per Service, each endpoint's
    first address, its Ready condition and its Pod."""
    out: dict[str, list[tuple[str, bool, str]]] = {}
    for s in lab.admin.list("EndpointSlice", namespace):
        out[s["metadata"]["labels"]["kubernetes.io/service-name"]] = [
            (
                e["addresses"][0],
                bool(e.get("conditions", {}).get("ready")),
                e.get("targetRef", {}).get("name", ""),
            )
            for e in s.get("endpoints") or []
        ]
    return out


def warnings(lab: RealNodeLab, namespace: str, name: str, saying: str) -> list[str]:
    """The messages of the Warning Events about the object `name` that contain `saying`."""
    events = lab.kubectl(
        "get",
        "events",
        "-n",
        namespace,
        "--field-selector",
        f"involvedObject.name={name},type=Warning",
        "-o",
        "json",
    ).stdout
    return [e["message"] for e in json.loads(events)["items"] if saying in e["message"]]
