"""`cozyebpf monitor`: live events from the running datapath.

The programs write an event for every counted packet a monitor wants (bpf/lib/monitor.h) into
the pinned ring buffer `events`, but only while the switch in `monctl` is on: this module sets
it (and the rate of the token bucket that limits the events in BPF), reads the ring buffer
through mmap, as libbpf's ring_buffer__poll does, and turns it off again when it stops. One
monitor reads at a time: it holds an exclusive flock on the pin directory, which also tells the
agent (`MonitorGuard`) that a switch left on has a monitor behind it; a monitor that died
(SIGKILL) leaves the switch on, and the agent turns it off at its next check.

Events lost to the limit or to a full ring buffer are counted in `monstats` (and exported as
`cozyebpf_monitor_events_lost_total`); the monitor reports how many it missed while it ran.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import json
import mmap
import os
import select
import socket
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address
from typing import Any

from cozyebpf.datapath.layout import EVENTS, MON_ALL, MON_DROPS, MON_OFF, CzEvent
from cozyebpf.datapath.maps import PinnedMaps
from cozyebpf.datapath.pins import lock_pin_dir
from cozyebpf.datapath.reasons import REASONS
from cozyebpf.datapath.views import MonitorState
from cozyebpf.errors import CozyError

DEFAULT_RATE = 1000  # events per second, per node
MODES = {"drop": MON_DROPS, "all": MON_ALL}
PROTOS = {1: "icmp", 6: "tcp", 17: "udp", 47: "gre", 50: "esp", 58: "icmpv6", 132: "sctp"}
PORTED = (6, 17, 132)  # protocols whose events carry ports

_BUSY, _DISCARD = 1 << 31, 1 << 30  # BPF_RINGBUF_BUSY_BIT, BPF_RINGBUF_DISCARD_BIT
_HDR = 8  # BPF_RINGBUF_HDR_SZ
_U64 = struct.Struct("=Q")
_U32 = struct.Struct("=I")


def proto_name(n: int) -> str:
    return PROTOS.get(n, str(n))


class RingBuffer:
    """A BPF ring buffer read through its mmap'ed pages (the consumer position page, writable;
    the producer position page and the data pages mapped twice, read-only), records in order,
    busy ones waited for, discarded ones skipped."""

    def __init__(self, fd: int, size: int) -> None:
        page = mmap.PAGESIZE
        self.fd = fd
        self.size = size
        self.mask = size - 1
        self._cons = mmap.mmap(fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._prod = mmap.mmap(fd, page + 2 * size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page)
        self._data = page  # offset of the data pages in _prod
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    def close(self) -> None:
        self._cons.close()
        self._prod.close()

    def _positions(self) -> tuple[int, int]:
        return _U64.unpack_from(self._cons, 0)[0], _U64.unpack_from(self._prod, 0)[0]

    def skip(self) -> None:
        """Forget every record written so far (those of a monitor that is gone)."""
        _, prod = self._positions()
        self._cons[0:8] = _U64.pack(prod)

    def records(self) -> Iterator[bytes]:
        """Every record available now."""
        cons, prod = self._positions()
        while cons < prod:
            at = self._data + (cons & self.mask)
            length = _U32.unpack_from(self._prod, at)[0]
            if length & _BUSY:
                break  # being written: the next poll sees it
            n = length & ~(_BUSY | _DISCARD)
            if not length & _DISCARD:
                yield bytes(self._prod[at + _HDR : at + _HDR + n])
            cons += (n + _HDR + 7) & ~7
            self._cons[0:8] = _U64.pack(cons)

    def wait(self, timeout: float) -> None:
        """Until records may be there, or `timeout` seconds."""
        with contextlib.suppress(InterruptedError):
            self._poll.poll(int(timeout * 1000))


@dataclass(frozen=True)
class Event:
    time: float  # seconds since the epoch
    device: str
    direction: str  # ingress, egress
    reason: str
    proto: str
    src: str
    dst: str
    sport: int | None
    dport: int | None
    service: str | None  # namespace/name
    len: int

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["time"] = (
            dt.datetime.fromtimestamp(self.time, dt.UTC).isoformat(timespec="microseconds")[:-6]
            + "Z"
        )
        return d

    def line(self) -> str:
        def at(ip: str, port: int | None) -> str:
            if port is None:
                return ip
            return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"

        clock = dt.datetime.fromtimestamp(self.time).strftime("%H:%M:%S.%f")
        return (
            f"{clock} {self.device} {self.direction} {self.reason} {self.proto} "
            f"{at(self.src, self.sport)} -> {at(self.dst, self.dport)} "
            f"{self.service or '-'} len {self.len}"
        )


class Decoder:
    """struct cz_event -> Event: monotonic time to wall clock, ifindex to device name (in this
    network namespace), slot to Service (svcnames, looked up once per slot)."""

    def __init__(self, maps: PinnedMaps) -> None:
        self.maps = maps
        self.offset = time.time() - time.monotonic()  # bpf_ktime_get_ns is CLOCK_MONOTONIC
        self._devices: dict[int, str] = {}
        self._services: dict[int, str] = {}

    def device(self, ifindex: int) -> str:
        name = self._devices.get(ifindex)
        if name is None:
            try:
                name = socket.if_indextoname(ifindex)
            except OSError:
                name = f"if{ifindex}"
            self._devices[ifindex] = name
        return name

    def service(self, slot: int) -> str | None:
        if slot == 0:
            return None
        name = self._services.get(slot)
        if name is None:
            name = self.maps.service_of_slot(slot)
            if name:
                self._services[slot] = name
        return name or None

    def __call__(self, raw: bytes) -> Event:
        e = CzEvent.from_buffer_copy(raw.ljust(ctypes.sizeof(CzEvent), b"\0"))
        if e.v6:
            src, dst = str(IPv6Address(bytes(e.src))), str(IPv6Address(bytes(e.dst)))
        else:
            src, dst = str(IPv4Address(bytes(e.src)[:4])), str(IPv4Address(bytes(e.dst)[:4]))
        ported = e.proto in PORTED
        return Event(
            time=e.time_ns / 1e9 + self.offset,
            device=self.device(e.ifindex),
            direction="egress" if e.dir else "ingress",
            reason=REASONS[e.reason] if e.reason < len(REASONS) else str(e.reason),
            proto=proto_name(e.proto),
            src=src,
            dst=dst,
            sport=int.from_bytes(struct.pack("=H", e.sport), "big") if ported else None,
            dport=int.from_bytes(struct.pack("=H", e.dport), "big") if ported else None,
            service=self.service(e.slot),
            len=int(e.len),
        )


@dataclass
class Losses:
    """Events missed while this monitor ran (monstats, from its start)."""

    limit: int = 0
    full: int = 0

    def __str__(self) -> str:
        return (
            f"{self.limit + self.full} events lost ({self.limit} over the rate limit, "
            f"{self.full} to a full ring buffer)"
        )


class Monitor:
    """A running monitor: `start()` takes the lock and turns the events on, `poll()` returns
    what arrived, `stop()` turns them off and returns what was lost."""

    def __init__(self, pin_dir: str, kind: str = "drop", rate: int = DEFAULT_RATE) -> None:
        if kind not in MODES:
            raise CozyError(f"--type must be one of {', '.join(MODES)}, not {kind!r}")
        if rate < 1:
            raise CozyError(f"--rate must be at least 1 event per second, not {rate}")
        self.pin_dir = pin_dir
        self.mode = MODES[kind]
        self.rate = rate
        self.maps: PinnedMaps | None = None
        self.ring: RingBuffer | None = None
        self._lock: int | None = None
        self._base: MonitorState | None = None
        self.decode: Decoder | None = None

    def start(self) -> None:
        self.maps = PinnedMaps.open(self.pin_dir)
        try:
            self._lock = lock_pin_dir(self.pin_dir, wait=1.0)
            self.ring = RingBuffer(self.maps.fds[EVENTS.name], self.maps.layout.events.max_entries)
            self.ring.skip()
            self._base = self.maps.monitor_state()
            interval = max(1, 1_000_000_000 // self.rate)
            burst = max(1, self.rate // 10)  # a tenth of a second's worth at once
            self.maps.set_monitor(self.mode, interval, interval * burst)
            self.decode = Decoder(self.maps)
        except BaseException:
            self.close()
            raise

    def losses(self) -> Losses:
        assert self.maps is not None and self._base is not None
        now = self.maps.monitor_state()
        return Losses(now.lost_limit - self._base.lost_limit, now.lost_full - self._base.lost_full)

    def poll(self, timeout: float) -> list[Event]:
        assert self.ring is not None and self.decode is not None
        out = [self.decode(r) for r in self.ring.records()]
        if not out:
            self.ring.wait(timeout)
            out = [self.decode(r) for r in self.ring.records()]
        return out

    def stop(self) -> tuple[list[Event], Losses]:
        """Switch the events off; the events still in the ring buffer and the losses."""
        assert self.maps is not None
        self.maps.set_monitor(MON_OFF)
        rest = [self.decode(r) for r in self.ring.records()] if self.ring and self.decode else []
        losses = self.losses()
        self.close()
        return rest, losses

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        if self.maps is not None:
            self.maps.close()
            self.maps = None
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def run_monitor(
    pin_dir: str,
    kind: str,
    rate: int,
    emit: Callable[[str], None],
    note: Callable[[str], None],
    as_json: bool,
    stopped: Callable[[], bool],
) -> Losses:
    """The `monitor` command's loop: events as lines (or JSON objects) through `emit`, news of
    losses through `note`, until `stopped()`; the events are switched off on the way out,
    whatever happens."""
    mon = Monitor(pin_dir, kind, rate)
    mon.start()
    what = "dropped packets" if kind == "drop" else "counted packets"
    note(f"monitoring {what} of {pin_dir} (at most {rate} events/s); Ctrl-C to stop")
    shown = Losses()
    try:
        while not stopped():
            for ev in mon.poll(0.2):
                emit(json.dumps(ev.as_dict()) if as_json else ev.line())
            lost = mon.losses()
            if (lost.limit, lost.full) != (shown.limit, shown.full):
                note(f"so far {lost}")
                shown = lost
    finally:
        rest, lost = mon.stop()
    for ev in rest:
        emit(json.dumps(ev.as_dict()) if as_json else ev.line())
    note(f"stopped; {lost}")
    return lost
