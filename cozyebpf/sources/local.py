"""This node's own addresses, read from the kernel and followed as they change: no LB IP may
take one (issue 31). A whole LB IP takes every packet to its address, so a Service whose LB IP
is the node's address would cut the node's SSH and kubelet off.

The agent's network namespace is the node's (the DaemonSet runs with hostNetwork). Addresses
on the `exclude`d devices are not the node's own: kube-proxy in IPVS mode binds every Service
address it handles to its dummy device kube-ipvs0."""

from __future__ import annotations

import logging
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
        events = rtnl.address_events()  # before the first read: no change is missed
        self._current = read_local(self.exclude)
        self._changed = True
        self._follow = rtnl.Follow(events, self._reread, "local-addresses")

    def start(self, notify: Callable[[], None] | None = None) -> None:
        if notify is not None:
            self.notify = notify
        self._follow.start()

    def stop(self) -> None:
        self._follow.stop()

    def alive(self) -> bool:
        return self._follow.alive()

    def _reread(self) -> None:
        try:
            now = read_local(self.exclude)
        except OSError as e:
            log.error("reading this node's addresses failed: %s; keeping the last read", e)
            return
        with self._lock:
            if now == self._current:
                return
            self._current, self._changed = now, True
        self.notify()

    def take(self) -> dict[IPAddress, str] | None:
        """The node's addresses if they changed since the last take, else None."""
        with self._lock:
            if not self._changed:
                return None
            self._changed = False
            return dict(self._current)
