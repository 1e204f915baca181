"""Per-Service counter slots: which Service counts where.

Every Service with entries in the maps has a slot: an index into the per-CPU array `svcstats`
(bpf/lib/types.h, struct svc_stat) that the addr values of its addresses carry (`in_slot` for
ingress, `out_slot` for egress), so that a packet reaches its Service's counters without a
lookup more. The pinned hash `svcnames` says which Service each slot belongs to, so that any
process (the agent's metrics, `maps dump`, `explain`, `monitor`, `status`) can name it and a
new agent (a restart, an upgrade) keeps every Service's slot and counters.

A slot is *active* while an address carries it. When a Service's last address goes (it is
deleted, or has no ready endpoint for a while), its slot is *parked*: name and counters stay,
its series are no longer exported, and the same Service gets the slot back, counters going on,
should it return. A Service that needs a new slot gets one that was never named, else the slot
parked longest; either starts from zero (its counters are cleared before any address carries
it). A slot is given out only at the start of a write and parked only at its end, so a slot
freed by one write is never reused within it.
"""

from __future__ import annotations

import ctypes
import heapq
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from sys import intern

from cozyebpf.datapath import bpfsys
from cozyebpf.datapath.layout import NAME_LEN, SvcName, SvcStat

log = logging.getLogger(__name__)


def split_service(service: str) -> tuple[str, str]:
    """("namespace", "name") of "namespace/name"."""
    ns, _, name = service.partition("/")
    return ns, name


@dataclass(frozen=True)
class SlotName:
    """One entry of svcnames."""

    service: str  # "namespace/name"
    active: bool


def decode_name(raw: bytes) -> SlotName:
    v = SvcName.from_buffer_copy(raw)
    ns = v.ns.decode(errors="replace")
    name = v.name.decode(errors="replace")
    # interned: the model composes the same string (compose.py), so a Service's name read
    # back from the maps (every full sync) is one string with the model's, not a copy
    return SlotName(intern(f"{ns}/{name}"), bool(v.active))


def encode_name(service: str, active: bool) -> SvcName:
    ns, name = split_service(service)
    bns, bname = ns.encode(), name.encode()
    if len(bns) >= NAME_LEN or len(bname) >= NAME_LEN:
        raise ValueError(f"Service name {service!r} is longer than Kubernetes allows")
    return SvcName(ns=bns, name=bname, active=int(active))


#: slots named or cleared per batch (activate): 4,096 slots' counters on 2 CPUs are 1.3 MB
CHUNK = 4096


class ServiceSlots:
    """The slots of one pin directory: loaded from svcnames, given out and parked by
    PinnedMaps.apply() (which keeps the addr values in step)."""

    def __init__(
        self,
        names_fd: int,
        stats_fd: int,
        capacity: int,
        ncpu: int,
        cleared: tuple[tuple[int, int], ...] = (),
    ) -> None:
        self.names_fd = names_fd
        self.stats_fd = stats_fd
        #: (fd, value size) of the other arrays indexed by slot (limits, buckets): zeroed with
        #: the counters when a slot is given to another Service
        self.cleared = cleared
        self.capacity = capacity  # slots 1..capacity
        self.ncpu = ncpu
        self._slot: dict[str, int] = {}  # Service -> its slot (active or parked)
        # slot -> Service ("": none) and whether it is active, indexed by slot: arrays of the
        # map's size, where a dict and a set cost about 200 bytes per Service at 100,000
        self._name: list[str] = [""] * (capacity + 1)
        self._active = bytearray(capacity + 1)
        self._parked: dict[int, None] = {}  # parked slots, parked longest first
        self._free: list[int] = []  # a heap of slots below _next that nobody holds
        self._next = 1  # every slot from here on was never named
        self._warned = False
        #: the Services activate() found no slot for (they may be gone since: uncounted)
        self.refused: set[str] = set()

    # -- reading -------------------------------------------------------------------------

    def load(self, entries: Iterable[tuple[bytes, bytes]]) -> None:
        """Take the state from svcnames' (key, value) pairs."""
        self._slot, self._parked = {}, {}
        self._name, self._active = [""] * (self.capacity + 1), bytearray(self.capacity + 1)
        for kraw, vraw in entries:
            slot = int.from_bytes(kraw, "little")
            if not 0 < slot <= self.capacity:
                continue  # not one we give out (a smaller map after a resize): ignored
            entry = decode_name(vraw)
            self._slot[entry.service] = slot
            self._name[slot] = entry.service
            if entry.active:
                self._active[slot] = 1
            else:
                self._parked[slot] = None
        self._next = max((s for s, name in enumerate(self._name) if name), default=0) + 1
        self._free = [s for s in range(1, self._next) if not self._name[s]]
        heapq.heapify(self._free)

    def slot(self, service: str) -> int:
        """The active slot of `service`, or 0 (none: its traffic is not counted per Service)."""
        slot = self._slot.get(service, 0)
        return slot if self._active[slot] else 0

    def name(self, slot: int) -> str:
        """The Service `slot` is named for (active or parked), or ""."""
        return self._name[slot] if 0 <= slot < len(self._name) else ""

    def active(self) -> dict[int, str]:
        """slot -> Service, for the active slots."""
        return {s: self._name[s] for s, on in enumerate(self._active) if on}

    # -- changing ------------------------------------------------------------------------

    def activate(self, services: Iterable[str]) -> None:
        """Give each of `services` its slot (its parked one, else a new one, cleared) before
        any address carries it. Without a free slot a Service is not counted (logged once).
        The slots' names and clearing are written in batches before it returns, one per map
        and CHUNK slots (a cold start names every Service: one call each took seconds at
        100,000; the cleared counters of 100,000 slots in one batch were 32 MB, most of the
        cold start's peak)."""
        names: list[tuple[int, bytes]] = []
        clears: list[int] = []
        for service in services:
            if len(names) >= CHUNK:
                self._flush(names, clears)
                names, clears = [], []
            slot = self._slot.get(service)
            if slot is not None:
                if not self._active[slot]:
                    names.append((slot, bytes(encode_name(service, True))))
                    self._parked.pop(slot, None)
                    self._active[slot] = 1
                continue
            slot = self._take()
            if slot is None:
                self.refused.add(service)
                if not self._warned:
                    log.warning(
                        "no free per-Service counter slot for %s (all %d are taken; "
                        "--counted-services sets how many): its traffic is counted node-wide "
                        "only, as that of every other Service without one (this warning is "
                        "logged once)",
                        service,
                        self.capacity,
                    )
                    self._warned = True
                continue
            old = self._name[slot]
            if old:
                del self._slot[old]
            clears.append(slot)
            names.append((slot, bytes(encode_name(service, True))))
            self.refused.discard(service)
            self._slot[service] = slot
            self._name[slot] = service
            self._active[slot] = 1
        self._flush(names, clears)

    def _flush(self, names: list[tuple[int, bytes]], clears: list[int]) -> None:
        """Clear the slots given to new Services, then name them (and the reactivated)."""
        # (a failed write leaves these dicts ahead of the maps: the full resync that follows
        # reads svcnames again, PinnedMaps.read_state)
        if clears:
            self._clear(clears)
        self._write(names)

    def park(self, services: Iterable[str]) -> None:
        """Park the slots of `services` (no address carries them any more)."""
        for service in services:
            slot = self._slot.get(service)
            if slot is None or not self._active[slot]:
                continue
            self._write([(slot, bytes(encode_name(service, False)))])
            self._active[slot] = 0
            self._parked[slot] = None

    def _take(self) -> int | None:
        """A slot for a new Service: never named, else the one parked longest."""
        while self._free:
            slot = heapq.heappop(self._free)
            if not self._name[slot]:
                return slot
        if self._next <= self.capacity:
            self._next += 1
            return self._next - 1
        if self._parked:
            slot = next(iter(self._parked))
            del self._parked[slot]
            return slot
        return None

    def _write(self, names: list[tuple[int, bytes]]) -> None:
        """Name each slot: (slot, its encoded svcnames value)."""
        if names:
            _update(self.names_fd, [s for s, _ in names], [v for _, v in names])

    def _clear(self, slots: list[int]) -> None:
        """Zero the slots' counters on every CPU, their limits and their buckets: a slot given
        to a Service starts from zero (and with full buckets: no other Service's debt)."""
        stride = (ctypes.sizeof(SvcStat) + 7) // 8 * 8
        _update(self.stats_fd, slots, [bytes(stride * self.ncpu)] * len(slots))
        for fd, size in self.cleared:
            _update(fd, slots, [bytes(size)] * len(slots))


def _update(fd: int, slots: list[int], values: list[bytes]) -> None:
    """Write an array's `slots`: one batch, or one call each where the kernel has no batch
    operations."""
    try:
        keys = b"".join(s.to_bytes(4, "little") for s in slots)
        bpfsys.map_update_batch(fd, keys, b"".join(values), len(slots))
        return
    except bpfsys.BpfError as e:
        if e.errno not in bpfsys.BATCH_UNSUPPORTED:
            raise
    for slot, v in zip(slots, values, strict=True):
        bpfsys.map_update(fd, ctypes.c_uint32(slot), ctypes.create_string_buffer(v, len(v)))
