"""This node's own addresses, read from the kernel and followed as they change: no LB IP may
take one (issue 31). A whole LB IP takes every packet to its address, so a Service whose LB IP
is the node's address would cut the node's SSH and kubelet off.

The agent's network namespace is the node's (the DaemonSet runs with hostNetwork). Addresses
on the `exclude`d devices are not the node's own: kube-proxy in IPVS mode binds every Service
address it handles to its dummy device kube-ipvs0."""

from __future__ import annotations

import logging
import select
import socket
import threading
from collections.abc import Callable, Iterable
from ipaddress import ip_address

from cozyebpf.datapath import rtnl
from cozyebpf.state import IPAddress

log = logging.getLogger(__name__)

#: devices whose addresses are Services', not the node's (kube-proxy's IPVS dummy device)
DEFAULT_EXCLUDE = ("kube-ipvs0",)


def _device(index: int) -> str:
    try:
        return socket.if_indextoname(index)
    except OSError:
        return f"ifindex {index}"


def read_local(exclude: Iterable[str] = DEFAULT_EXCLUDE) -> dict[IPAddress, str]:
    """This network namespace's addresses, each with its device (the first device by ifindex
    when two hold one address), but those on `exclude`d devices."""
    skip = set(exclude)
    out: dict[IPAddress, str] = {}
    for text, index in sorted(rtnl.addresses(), key=lambda a: a[1]):
        device = _device(index)
        if device in skip:
            continue
        try:
            ip = ip_address(text.split("%", 1)[0])
        except ValueError:
            continue
        out.setdefault(ip, device)
    return out


class LocalAddresses:
    """Follows this node's addresses: `take()` gives them when they changed since the last
    take (None: no change). A thread waits on rtnetlink's address notifications and reads the
    whole list again on each (addresses change rarely; a read is one dump)."""

    def __init__(self, exclude: Iterable[str] = DEFAULT_EXCLUDE) -> None:
        self.exclude = tuple(exclude)
        self.notify: Callable[[], None] = lambda: None
        self._lock = threading.Lock()
        self._events = rtnl.address_events()  # before the first read: no change is missed
        self._current = read_local(self.exclude)
        self._changed = True
        self._stop_r, self._stop_w = socket.socketpair()
        self._thread: threading.Thread | None = None

    def start(self, notify: Callable[[], None] | None = None) -> None:
        if notify is not None:
            self.notify = notify
        self._thread = threading.Thread(target=self._run, name="local-addresses", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        for s in (self._events, self._stop_r, self._stop_w):
            s.close()

    def alive(self) -> bool:
        return self._thread is None or self._thread.is_alive()

    def _run(self) -> None:
        while True:
            ready, _, _ = select.select([self._events, self._stop_r], [], [])
            if self._stop_r in ready:
                return
            try:
                while True:  # drain what queued up: one read covers them all
                    self._events.recv(1 << 16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                pass
            except OSError as e:  # ENOBUFS: notifications were lost; the read below covers it
                log.debug("address notifications: %s", e)
            try:
                now = read_local(self.exclude)
            except OSError as e:
                log.error("reading this node's addresses failed: %s; keeping the last read", e)
                continue
            with self._lock:
                if now == self._current:
                    continue
                self._current, self._changed = now, True
            self.notify()

    def take(self) -> dict[IPAddress, str] | None:
        """The node's addresses if they changed since the last take, else None."""
        with self._lock:
            if not self._changed:
                return None
            self._changed = False
            return dict(self._current)
