"""What tools read from the maps without a full walk of the state: one address's entry by one
lookup, the counters (node-wide and per Service), the maps' fill, and the monitor's switch."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from cozyebpf.datapath import bpfsys
from cozyebpf.datapath.codec import AddrVal, addr_val, allow_key, pod_entry, service_entry
from cozyebpf.datapath.layout import COUNTED, K_LB, K_POD, MonCtl, MonStat, StatVal, SvcStat
from cozyebpf.datapath.pins import Pins
from cozyebpf.datapath.reasons import REASONS, SVC_DROP_REASONS
from cozyebpf.datapath.slots import decode_name, split_service
from cozyebpf.state import AllowedPort, IPAddress, PodEntry, ServiceEntry


@dataclass(frozen=True)
class ServiceCounters:
    """One Service's counters (svcstats, summed over CPUs): packets and bytes accepted per
    direction, and dropped packets per reason (every drop reason, zeros included)."""

    service: str  # "namespace/name"
    slot: int
    in_packets: int
    in_bytes: int
    out_packets: int
    out_bytes: int
    drops: dict[str, int]

    @property
    def namespace(self) -> str:
        return split_service(self.service)[0]

    @property
    def name(self) -> str:
        return split_service(self.service)[1]


@dataclass(frozen=True)
class MonitorState:
    """The monitor's switch and rate (monctl) and its counters (monstats, summed over CPUs)."""

    mode: int  # layout.MON_*
    interval_ns: int
    burst_ns: int
    events: int
    lost_limit: int
    lost_full: int


class Views(Pins):
    """Lookups, counters and the monitor's switch of a pin directory."""

    def _addr(self, addr: IPAddress) -> AddrVal | None:
        spec = self.layout.addr4 if addr.version == 4 else self.layout.addr6
        raw = self._lookup(spec, addr.packed)
        return None if raw is None else addr_val(raw, len(addr.packed))

    def lookup_service(self, lb: IPAddress) -> ServiceEntry | None:
        """The entry of one LB IP, by a single lookup (no map walk): for probes and tools that
        must not depend on the map layout."""
        v = self._addr(lb)
        if v is None or not v.kind & K_LB:
            return None
        return service_entry(v.pod_ip, v.flags, self.service_of_slot(v.in_slot))

    def lookup_pod(self, pod: IPAddress) -> PodEntry | None:
        """The entry of one pod IP, by a single lookup."""
        v = self._addr(pod)
        if v is None or not v.kind & K_POD:
            return None
        return pod_entry(v.lb_ip, v.pod_flags, self.service_of_slot(v.out_slot))

    def has_allowed(self, a: AllowedPort) -> bool:
        """Whether the allowed-port entry `a` is programmed, by a single lookup."""
        spec = self.layout.allow4 if a.version == 4 else self.layout.allow6
        return self._lookup(spec, allow_key(a)) is not None

    def entries(self) -> dict[str, tuple[int, int]]:
        """map -> (entries, capacity), for the maps in COUNTED (a batch walk per map; a
        kernel without batch operations walks the keys)."""
        out = {}
        for name in COUNTED:
            spec = getattr(self.layout, name)
            fd = self.fds[name]
            try:
                n = bpfsys.map_count(fd, spec.key_size, spec.value_size)
            except bpfsys.BpfError as e:
                if e.errno not in bpfsys.BATCH_UNSUPPORTED:
                    raise
                n = len(bpfsys.map_keys(fd, spec.key_size))
            out[name] = (n, spec.max_entries)
        return out

    def counters(self) -> dict[str, dict[str, int]]:
        """Per-reason totals, summed over CPUs."""
        out: dict[str, dict[str, int]] = {}
        for idx, name in enumerate(REASONS):
            per_cpu = self.percpu(self.layout.stats, idx)
            if per_cpu is None:
                continue
            vals = [StatVal.from_buffer_copy(v) for v in per_cpu]
            out[name] = {
                "packets": sum(v.packets for v in vals),
                "bytes": sum(v.bytes for v in vals),
            }
        return out

    def service_counters(self) -> list[ServiceCounters]:
        """The counters of every Service with an active slot (one whose addresses carry it),
        sorted by Service."""
        self._read_slots()
        out = []
        for slot, service in self.slots.active().items():
            per_cpu = self.percpu(self.layout.svcstats, slot)
            if per_cpu is None:
                continue
            vals = [SvcStat.from_buffer_copy(v) for v in per_cpu]
            drops = {r: sum(int(v.drops[i]) for v in vals) for i, r in enumerate(SVC_DROP_REASONS)}
            out.append(
                ServiceCounters(
                    service,
                    slot,
                    sum(int(v.in_packets) for v in vals),
                    sum(int(v.in_bytes) for v in vals),
                    sum(int(v.out_packets) for v in vals),
                    sum(int(v.out_bytes) for v in vals),
                    drops,
                )
            )
        return sorted(out, key=lambda c: c.service)

    def service_of_slot(self, slot: int) -> str:
        """The Service named for `slot` in svcnames (active or parked), or "" (one lookup)."""
        if slot <= 0:
            return ""
        raw = self._lookup(self.layout.svcnames, bytes(ctypes.c_uint32(slot)))
        return "" if raw is None else decode_name(raw).service

    def service_names(self) -> dict[int, str]:
        """slot -> Service, for every active slot."""
        self._read_slots()
        return self.slots.active()

    def monitor_state(self) -> MonitorState:
        ctl = MonCtl()
        bpfsys.map_lookup(self.fds[self.layout.monctl.name], ctypes.c_uint32(0), ctl)
        st = [MonStat.from_buffer_copy(v) for v in self.percpu(self.layout.monstats, 0) or []]
        return MonitorState(
            int(ctl.mode),
            int(ctl.interval_ns),
            int(ctl.burst_ns),
            sum(int(v.events) for v in st),
            sum(int(v.lost_limit) for v in st),
            sum(int(v.lost_full) for v in st),
        )

    def set_monitor(self, mode: int, interval_ns: int = 0, burst_ns: int = 0) -> None:
        """Switch the monitor's events on (layout.MON_DROPS, MON_ALL) at a rate, or off; the
        token bucket starts full."""
        ctl = MonCtl(mode=mode, interval_ns=interval_ns, burst_ns=burst_ns, tat=0)
        bpfsys.map_update(self.fds[self.layout.monctl.name], ctypes.c_uint32(0), ctl)
