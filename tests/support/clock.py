"""Time without waiting: a clock for code that takes `clock=` (the agent's timers, the manifest
source's wait for a whole file), which moves only when the test says, and age_flows for the
programs, whose clock is the kernel's; so that no test waits for wall-clock time or depends on
how fast the machine is."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cozyebpf.datapath.maps import PinnedMaps


class FakeClock:
    """Monotonic seconds that advance only by advance()."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, "a monotonic clock does not go back"
        self.now += seconds


def age_flows(maps: PinnedMaps, ns: int) -> None:
    """Make the datapath's flow state `ns` older, as if that much time had passed: every flow
    entry's last-seen time and every CPU's seen slot (its entry time and when it was checked).
    The programs read the kernel's coarse clock, which no test can drive: this ages what they
    compare it with instead of waiting."""
    import ctypes

    from cozyebpf.datapath import bpfsys, layout
    from cozyebpf.datapath.maps import possible_cpus

    val = layout.Flow4Val()
    for spec in (maps.layout.flow4, maps.layout.flow6):
        fd = maps.fds[spec.name]
        for raw in bpfsys.map_keys(fd, spec.key_size):
            key = ctypes.create_string_buffer(raw, len(raw))
            if bpfsys.map_lookup(fd, key, val):
                closing = val.last_seen_ns & layout.FLOW_CLOSING
                val.last_seen_ns = ((val.last_seen_ns & ~layout.FLOW_CLOSING) - ns) | closing
                bpfsys.map_update(fd, key, val)
    ncpu = possible_cpus()
    for spec, slot_type in (
        (maps.layout.seen4, layout.Flow4Seen),
        (maps.layout.seen6, layout.Flow6Seen),
    ):
        size = ctypes.sizeof(slot_type)
        fd = maps.fds[spec.name]
        for i in range(spec.max_entries):
            buf = ctypes.create_string_buffer(size * ncpu)
            if not bpfsys.map_lookup(fd, ctypes.c_uint32(i), buf):
                continue
            for cpu in range(ncpu):
                slot = slot_type.from_buffer(buf, cpu * size)
                if slot.checked:
                    slot.checked -= ns
                    slot.time -= min(ns, slot.time)
            bpfsys.map_update(fd, ctypes.c_uint32(i), buf)
