"""The traffic that runs while the agents change (helm upgrade, rollback, a killed agent), as
the upgrade labs measure it (issue 45's set), between the client and the real backend Pods:

- `udp`: a UDP echo stream at 500 datagrams/s from the client to the whole-IP LB IP (the vm's
  echo on port 7): every datagram lost is counted;
- `chat`: a long-lived TCP connection from the client through the port filter (web's echo on
  TCP 7), a line every 20 ms;
- `download`: a download the port-filtered Pod opened to the client (only its flow lets the
  data in: a lost flow stalls it for good);
- `opened`: a long-lived TCP connection the port-filtered Pod opened to the client's echo hub,
  which answers with the source address it saw (the LB IP, every round);
- `flows`: new UDP flows the port-filtered Pod opens every few ms to the client's echo hub.

The Pods' side runs in their real network namespaces (/proc/<pid>/ns/net of their containers,
found through their node's containerd), the client's in the client namespace."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from cozylab.realnode.lab import RealNodeLab
from cozylab.realnode.spec import CLIENT_IP, LB_FILTERED, LB_WHOLE
from cozylab.realnode.workloads import NAMESPACE, VM, WEB
from cozylab.traffic import Download, EchoHub, NewFlows, Pusher, TcpChat, UdpStream, flowing

#: the client's servers: the echo hub (TCP and UDP) and the download's pusher
HUB_TCP, HUB_UDP, PUSHER = 9100, 9105, 9107
UDP_RATE = 500.0


def pod_name(lab: RealNodeLab, app: str) -> str:
    """The running Pod of `app` (web's Deployment, or the vm Pod)."""
    if app == VM:
        return VM
    pods = [
        p
        for p in lab.admin.list("Pod", NAMESPACE)
        if p["metadata"].get("labels", {}).get("app") == app
        and not p["metadata"].get("deletionTimestamp")
        and p.get("status", {}).get("phase") == "Running"
    ]
    if len(pods) != 1:
        raise LookupError(f"{len(pods)} running Pods of {app}")
    return str(pods[0]["metadata"]["name"])


@dataclass
class Streams:
    udp: UdpStream
    chat: TcpChat
    download: Download
    opened: TcpChat
    flows: NewFlows

    def all(self) -> list[Any]:
        return [self.udp, self.chat, self.download, self.opened, self.flows]

    def flowing(self, timeout: float = 60) -> None:
        flowing(self.all(), udp=100, tcp=30, other=100, timeout=timeout)

    def results(self) -> list[tuple[str, bool, str]]:
        """(check, ok, what was seen) per stream, once they stopped."""
        lost = self.udp.lost()
        sources = {peer for _, peer in self.opened.echoes}
        return [
            (
                f"UDP echo to the whole-IP LB IP at {UDP_RATE:.0f}/s: none lost",
                not lost and len(self.udp.sent) > 100,
                self.udp.summary(),
            ),
            (
                "TCP through the port filter: the connection lives",
                self.chat.error is None and self.chat.rounds > 50,
                f"{self.chat.rounds} rounds, longest pause "
                f"{self.chat.longest_pause() * 1000:.0f} ms"
                + (f", {self.chat.error}" if self.chat.error else ""),
            ),
            (
                "the download the Pod opened never stalls",
                self.download.error is None and self.download.total > 0,
                f"{self.download.total // 1024} KiB, longest pause "
                f"{self.download.longest_pause() * 1000:.0f} ms"
                + (f", {self.download.error}" if self.download.error else ""),
            ),
            (
                "the connection the Pod opened lives, seen as its LB IP",
                self.opened.error is None and self.opened.rounds > 50 and sources == {LB_FILTERED},
                f"{self.opened.rounds} rounds from {', '.join(sorted(sources)) or 'nobody'}"
                + (f", {self.opened.error}" if self.opened.error else ""),
            ),
            (
                "new UDP flows the Pod opens: none lost",
                not self.flows.lost and self.flows.sent > 100,
                f"{len(self.flows.lost)} of {self.flows.sent} lost",
            ),
        ]


@contextmanager
def streams(lab: RealNodeLab) -> Iterator[Streams]:
    """Start the servers and the streams; yield them running; stop them at the end."""
    with ExitStack() as stack:
        hub = EchoHub()
        stack.callback(hub.close)
        hub.serve(lab.net, lab.client, socket.SOCK_STREAM, HUB_TCP)
        hub.serve(lab.net, lab.client, socket.SOCK_DGRAM, HUB_UDP)
        stack.enter_context(Pusher(lab.net, lab.client, PUSHER, chunk=1024, every=0.002))
        web_ns = lab.pod_netns(NAMESPACE, pod_name(lab, WEB))
        s = Streams(
            UdpStream(lab.net, lab.client, (LB_WHOLE, 7), rate=UDP_RATE),
            TcpChat(lab.net, lab.client, (LB_FILTERED, 7)),
            Download(lab.net, web_ns, (CLIENT_IP, PUSHER), stall=10),
            TcpChat(lab.net, web_ns, (CLIENT_IP, HUB_TCP)),
            NewFlows(lab.net, web_ns, (CLIENT_IP, HUB_UDP)),
        )
        for stream in s.all():
            stream.start()
            stack.callback(stream.stop)
        yield s
