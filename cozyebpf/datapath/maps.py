"""The pinned maps as the control plane sees them: `PinnedMaps` opens or prepares the pins
(pins.py), reads them into a MapState (`read_state`) and programs a MapDiff (`apply`), through
plain bpf(2) calls (no compilation needed, so `maps dump` is instant). The values' encoding is
in codec.py, the flows in flows.py, single lookups, counters and the monitor's switch in
views.py.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import struct
import sys
import time
from array import array
from collections.abc import Iterable, Mapping, Sequence
from ipaddress import IPv4Network, IPv6Network
from itertools import islice

from cozyebpf.datapath import bpfsys
from cozyebpf.datapath.buckets import (
    FQ_HORIZON_NS,
    buckets_of,
    limit_clock_ns,
    limit_val,
    limits_of,
)
from cozyebpf.datapath.codec import (
    ALLOW_KEY,
    Mirror,
    addr_val,
    address,
    allow_key,
    flags_of,
    pod_entry,
    range_key,
    range_of,
    same_addr_val,
    service_entry,
)
from cozyebpf.datapath.flows import (
    DEFAULT_FLOW_TIMEOUTS,
    Flow,
    FlowEntry,
    FlowTables,
    coarse_now_ns,
)
from cozyebpf.datapath.hints import HINT_LB, HINT_POD, AddrHints, Words
from cozyebpf.datapath.layout import (
    DEFAULT_MAX_SERVICES,
    F_RANGES,
    K_LB,
    K_POD,
    LAYOUT_VERSION,
    META,
    SAME_SINCE,
    BucketVal,
    Layout,
    LimitVal,
    be16,
    map_specs,
    possible_cpus,
)
from cozyebpf.datapath.pins import (
    DEFAULT_PIN_DIR,
    closed_on_error,
    ensure_pins,
    meta_value,
    open_pins,
)
from cozyebpf.datapath.views import MonitorState, ServiceCounters, Views
from cozyebpf.errors import DatapathError
from cozyebpf.state import (
    NO_LIMITS,
    AllowedPort,
    Capacity,
    IPAddress,
    Limits,
    MapDiff,
    MapLimit,
    MapState,
    Proto,
    Ranges,
)

log = logging.getLogger(__name__)

#: addr values encoded and written per batch (_write_addrs)
WRITE_CHUNK = 8192


class PinnedMaps(Views, FlowTables):
    """File descriptors of every cozyebpf map under one pin directory, and the mirror of the
    state they hold. `sizes` is each map's size (max entries) where it depends on the number of
    Services: an addr map holds the LB IPs and the pod IPs of its family (a pod IP that is also
    an LB IP once), an allow map the allowed ports, a flow map the flows the pods opened;
    `capacity()` says it in the model's terms."""

    def __init__(self, pin_dir: str, fds: dict[str, int], layout: Layout) -> None:
        super().__init__(pin_dir, fds, layout)
        self.sizes = {s.name: s.max_entries for s in layout.all if not s.fixed}
        self._m: Mirror | None = None  # the mirror; None: read the maps before the next apply
        self._repair = False  # read_state rewrites addr values that disagree (the agent's)
        #: the address hints (rolehint, addrhint) as this process last wrote them (None: not
        #: yet)
        self._hints: AddrHints | None = None

    @classmethod
    def open(cls, pin_dir: str = DEFAULT_PIN_DIR) -> PinnedMaps:
        """Open existing pins (for `maps dump`), whatever their size; every map must be there
        with our layout."""
        fds, layout = open_pins(pin_dir)
        return cls(pin_dir, fds, layout)

    @classmethod
    def ensure(
        cls,
        pin_dir: str = DEFAULT_PIN_DIR,
        max_services: int = DEFAULT_MAX_SERVICES,
        service_slots: int | None = None,
    ) -> PinnedMaps:
        """Open the pins, creating any that are missing and migrating those of another layout
        (pins.ensure_pins), every map sized for `max_services` Services, `service_slots` of
        them counted on their own (layout.map_specs). These are the agent's maps: `read_state`
        repairs what a write that stopped half way left."""
        layout = map_specs(max_services, service_slots)
        p = ensure_pins(pin_dir, layout)
        with closed_on_error(p.fds, pin_dir):
            maps = cls(pin_dir, p.fds, layout)
            if "flowcfg" in p.created or p.version != LAYOUT_VERSION:
                maps.set_flow_timeouts(**DEFAULT_FLOW_TIMEOUTS)  # before any program reads it
            maps._repair = True
            maps._hint_rebuild(maps._items(layout.addr4))  # before any program of ours reads it
            maps._old_flows = p.old_flows
            if p.reseed:
                maps.seed_flow_hints()
                maps.hints_need_seed = True
            if p.version is not None and 1 < p.version < LAYOUT_VERSION:
                log.warning(
                    "upgrading maps in %s from layout version %d to %d: %s created beside "
                    "the maps kept; every address gets its Service's counter slot at the "
                    "first sync",
                    pin_dir,
                    p.version,
                    LAYOUT_VERSION,
                    ", ".join(n for n in p.created if SAME_SINCE.get(n, 0) > p.version),
                )
            # this layout, the oldest that can run on it, this release (after everything else:
            # an agent stopped half way leaves the layout it found)
            bpfsys.map_update(p.fds[META.name], ctypes.c_uint32(0), meta_value())
        if p.created:
            log.info("created maps in %s: %s", pin_dir, ", ".join(p.created))
        kept = [s.name for s in layout.all if s.name not in p.created]
        if kept:
            log.info("adopted pinned maps in %s: %s", pin_dir, ", ".join(kept))
        return maps

    def __enter__(self) -> PinnedMaps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading -------------------------------------------------------------------------

    def _read_addrs(self, m: Mirror) -> tuple[MapState, dict[bytes, bytes], set[bytes]]:
        """services and pods from addr4/addr6 (into `m` too), the raw values by key, and the
        pod IPs that some value marks restricted (F_RANGES). The Service of each role is the
        one svcnames names its slot for ("" without one)."""
        st = MapState()
        raw: dict[bytes, bytes] = {}
        restricted: set[bytes] = set()
        name = self.slots.name
        pods: list[tuple[bytes, bytes, int, str]] = []  # set after every LB role (set_pod)
        for spec, n in ((self.layout.addr4, 4), (self.layout.addr6, 16)):
            for kraw, vraw in self._items(spec):
                addr, v = address(kraw), addr_val(vraw, n)
                if v.flags & F_RANGES:
                    restricted.add(v.pod_ip if v.kind & K_LB else kraw)
                if v.kind & K_POD and v.pod_flags & F_RANGES:
                    restricted.add(kraw)
                if v.kind & K_LB:
                    flags, svc = v.flags & ~F_RANGES, name(v.in_slot)
                    m.link(kraw, v.pod_ip, flags, svc)
                    st.services[addr] = service_entry(v.pod_ip, flags, svc)
                if v.kind & K_POD:
                    flags, svc = v.pod_flags & ~F_RANGES, name(v.out_slot)
                    pods.append((kraw, v.lb_ip, flags, svc))
                    st.pods[addr] = pod_entry(v.lb_ip, flags, svc)
                raw[kraw] = vraw
        for kraw, lb, flags, svc in pods:
            m.set_pod(kraw, lb, flags, svc)
        return st, raw, restricted

    def _read_ranges(self, restricted: set[bytes]) -> dict[IPAddress, Ranges]:
        """The source ranges of every pod an addr value marks restricted (none: no source).
        Entries of a pod that no value marks (a write that stopped half way) are never looked
        at by the programs; the agent's maps (ensure) delete them here."""
        nets: dict[bytes, set[IPv4Network | IPv6Network]] = {p: set() for p in restricted}
        stray: list[bytes] = []
        for spec in (self.layout.range4, self.layout.range6):
            for raw in self._keys(spec):
                pod, net = range_of(raw)
                if pod in nets:
                    nets[pod].add(net)
                else:
                    stray.append(raw)
        if stray and self._repair:
            log.warning("%d source-range entries of unrestricted pods: deleted", len(stray))
            self._write_ranges(stray, delete=True)
        return {address(p): frozenset(v) for p, v in nets.items()}

    def _read_limits(self) -> dict[str, Limits]:
        """The limits of the Services with an active slot (the `limits` map, by slot)."""
        out: dict[str, Limits] = {}
        if self.layout.limits.name not in self.fds:  # an older agent's pins, opened to read
            return out
        for slot, service in self.slots.active().items():
            raw = self._lookup(self.layout.limits, slot.to_bytes(4, sys.byteorder))
            if raw is not None and (limits := limits_of(LimitVal.from_buffer_copy(raw))):
                out[service] = limits
        return out

    def limits(self) -> dict[str, tuple[Limits, dict[str, float]]]:
        """Each Service with limits: its Limits and, for each of its buckets (buckets_of's
        names), the share of its burst left now (1.0 full, 0.0 empty) as the programs left
        it: the bucket's time against the programs' clock (limit_clock_ns; none where that
        cannot be read). Shaped egress (shaped()): the egress bucket is the shaper's, its next
        departure (out_edt) against the monotonic clock, its burst the shaper's horizon."""
        out: dict[str, tuple[Limits, dict[str, float]]] = {}
        if self.layout.buckets.name not in self.fds:
            return out
        now = limit_clock_ns()
        shaped = self.shaped()
        mono = time.monotonic_ns()  # CLOCK_MONOTONIC: bpf_ktime_get_ns, the shaper's
        self._read_slots()
        for service, lim in self._read_limits().items():
            raw = self._lookup(
                self.layout.buckets, self.slots.slot(service).to_bytes(4, sys.byteorder)
            )
            b = BucketVal.from_buffer_copy(raw) if raw is not None else BucketVal()
            times = {"ingress_bytes": b.in_bytes, "ingress_packets": b.in_pkts}
            times["egress_bytes"] = b.out_bytes
            left: dict[str, float] = {}
            for name, bucket in buckets_of(lim).items():
                if name == "egress_bytes" and shaped:
                    left[name] = bucket.left(b.out_edt, mono, FQ_HORIZON_NS)
                elif now is not None:  # (None: the programs' clock cannot be read here)
                    left[name] = bucket.left(times[name], now)
            out[service] = (lim, left)
        return out

    def uncounted(self) -> tuple[set[str], int]:
        """The Services the maps hold (as of the last read or write) without an active slot
        (all taken), and how many slots there are."""
        if self._m is None:
            return set(), self.slots.capacity
        refs, refused = self._m.refs, self.slots.refused
        for gone in [s for s in refused if s not in refs]:  # (a refused Service deleted since)
            refused.discard(gone)
        return {s for s in refused if not self.slots.slot(s)}, self.slots.capacity

    def set_guard(self, pps: int | None) -> None:
        """The node's guard of `pps` packets per second (None: none) as the limits of slot 0:
        the slot of every Service without one of its own (all taken: --counted-services), whose
        LB IPs carry F_LIMIT where it is limited, so that those Services share the guard's one
        bucket rather than have no limit at all (docs/behaviour.md, Limits per public IP). Its
        bucket starts full when the guard's rate changes, as any Service's (_write_limits)."""
        if self.layout.limits.name not in self.fds:
            return
        lim = Limits(ingress_pps=pps, guard=True) if pps else NO_LIMITS
        key, new = (0).to_bytes(4, sys.byteorder), limit_val(lim)
        raw = self._lookup(self.layout.limits, key)
        old = LimitVal.from_buffer_copy(raw) if raw is not None else LimitVal()
        self._update_batch(self.layout.limits, [key], [bytes(new)])
        if fields := _changed_buckets(old, new):
            self._reset_buckets([(key, fields)])

    def guard_slot(self) -> Limits:
        """The limits of slot 0 (set_guard)."""
        raw = self._lookup(self.layout.limits, (0).to_bytes(4, sys.byteorder))
        return limits_of(LimitVal.from_buffer_copy(raw)) if raw is not None else NO_LIMITS

    def _write_limits(self, limits: Mapping[str, Limits]) -> None:
        """Each Service's limits at its slot (no limit: zeros). A Service without a slot of its
        own (all taken: --counted-services) has none of its own enforced, as it has no counters
        of its own (ServiceSlots.activate logs that once; README, *Limits of this version*): it
        shares slot 0's, the node's guard (set_guard). A bucket whose limit changes starts full
        (its time 0; egress: the shaper's too), once the new limit is written: its time was
        charged at the old rate (a raised 1 packet/s limit that a flood had emptied would drop
        for up to 64 s more, 1 kbit/s for minutes)."""
        keys, values, changed = [], [], []
        if self.layout.limits.name not in self.fds:
            return
        for service, lim in limits.items():
            slot = self.slots.slot(service)
            if slot:
                key = slot.to_bytes(4, sys.byteorder)
                new = limit_val(lim)
                raw = self._lookup(self.layout.limits, key)
                old = LimitVal.from_buffer_copy(raw) if raw is not None else LimitVal()
                if fields := _changed_buckets(old, new):
                    changed.append((key, fields))
                keys.append(key)
                values.append(bytes(new))
        self._update_batch(self.layout.limits, keys, values)
        self._reset_buckets(changed)

    def _reset_buckets(self, changed: list[tuple[bytes, tuple[str, ...]]]) -> None:
        """Each slot's named bucket times zeroed (full); its other buckets as the programs
        left them (a charge between the read and the write is lost: at most a packet's)."""
        if not changed or self.layout.buckets.name not in self.fds:
            return
        keys, values = [], []
        for key, fields in changed:
            raw = self._lookup(self.layout.buckets, key)
            b = BucketVal.from_buffer_copy(raw) if raw is not None else BucketVal()
            for f in fields:
                setattr(b, f, 0)
            keys.append(key)
            values.append(bytes(b))
        self._update_batch(self.layout.buckets, keys, values)

    def _read_allowed(self, m: Mirror) -> set[AllowedPort]:
        """The allowed ports (into `m` too)."""
        out: set[AllowedPort] = set()
        for spec, n in ((self.layout.allow4, 4), (self.layout.allow6, 16)):
            for kraw, _ in self._items(spec):
                pod, proto_n, _, port = ALLOW_KEY[n].unpack(kraw)
                try:
                    proto = Proto(proto_n)
                except ValueError:
                    # not something we write, and not representable in a MapState: it stays
                    # (harmless: the filter only looks up TCP, UDP and SCTP)
                    log.warning("%s holds an entry with unknown protocol %d", spec.name, proto_n)
                    continue
                out.add(AllowedPort(address(pod), proto, port))
                m.add_port(pod, proto_n, port)
        return out

    def read_state(self) -> MapState:
        """Everything in addr4/addr6 and allow4/allow6, as one MapState; it refreshes the
        mirror. The agent's maps (ensure) also rewrite here any addr value that disagrees with
        the state (its inline ports are not part of a MapState, so no diff would repair them)."""
        self._read_slots()
        m = Mirror()
        st, raw, restricted = self._read_addrs(m)
        st.allowed = self._read_allowed(m)
        st.ranges = self._read_ranges(restricted)
        st.limits = self._read_limits()
        m.ranges = {p.packed: nets for p, nets in st.ranges.items()}
        self._m = m
        if self._repair:
            self._hint_rebuild(raw.items())
            # a write that stopped half way: the slots that addresses carry are active, the
            # others parked
            active = set(self.slots.active().values())
            self.slots.activate(sorted(set(m.refs) - active))
            self.slots.park(sorted(active - set(m.refs)))
            stale = [
                k
                for k, v in raw.items()
                if (want := m.value(k, self.slots.slot)) is not None and not same_addr_val(want, v)
            ]
            if stale:
                log.warning(
                    "%d addr entries disagreed with the allowed ports (edited by hand?): rewritten",
                    len(stale),
                )
                self._write_addrs(stale)
        return st

    def capacity(self) -> Capacity:
        """The maps' sizes in the model's terms: what fits (--max-services sets them)."""
        return Capacity(
            tuple(
                MapLimit(spec.name, self.sizes[spec.name], kinds)
                for spec, kinds in (
                    # LB IPs and pod IPs share addr4 (an address that is both counts twice)
                    (self.layout.addr4, (("services", 4), ("pods", 4))),
                    (self.layout.allow4, (("allowed", 4),)),
                    (self.layout.addr6, (("services", 6), ("pods", 6))),
                    (self.layout.allow6, (("allowed", 6),)),
                    (self.layout.range4, (("ranges", 4),)),
                    (self.layout.range6, (("ranges", 6),)),
                )
            )
        )

    # -- programming ---------------------------------------------------------------------

    def _write_addrs(self, addrs: Sequence[bytes]) -> None:
        """Write the mirror's values of `addrs` (packed; all of them must have one), encoded
        and written WRITE_CHUNK at a time (a cold start's 200,000 values and their batch's
        buffer at once were 30 MB of its peak)."""
        assert self._m is not None
        for spec, n in ((self.layout.addr4, 4), (self.layout.addr6, 16)):
            mine = [a for a in addrs if len(a) == n]
            for i in range(0, len(mine), WRITE_CHUNK):
                part = mine[i : i + WRITE_CHUNK]
                values = [self._m.value(a, self.slots.slot) for a in part]
                assert all(v is not None for v in values), "an address without a value"
                self._update_batch(spec, part, values)  # type: ignore[arg-type]

    def _delete_addrs(self, addrs: Iterable[bytes]) -> None:
        for spec, n in ((self.layout.addr4, 4), (self.layout.addr6, 16)):
            self._delete_batch(spec, [a for a in addrs if len(a) == n])

    # (longer than 80 lines: the diff into the mirror and the writes in their one safe order,
    # kept in one place so that the order is read, and reviewed, at once)
    def apply(self, d: MapDiff) -> None:
        """Apply `d` in an order that never opens a hole: counter slots given to the Services
        that come (slots.py), addresses that are neither LB nor pod IP any more deleted (nothing
        that stays uses them, and a full map then has room for what comes), allowed ports added,
        then every addr value that changes (services, pods and the inline ports of the addresses
        whose pod's allowed ports change) written, allowed ports deleted, the slots of Services
        that went parked; one BPF_MAP_UPDATE_BATCH / DELETE_BATCH per map and step (a kernel
        without batch operations gets one call per entry). A diff that mixes families in an
        entry is refused before anything is written."""
        errors = d.family_errors()
        if errors:
            raise DatapathError(
                f"refusing to program maps in {self.pin_dir}: an entry mixes address families "
                f"({'; '.join(errors)})"
            )
        if self._m is None:
            self.read_state()
        if self._hints is None:  # not written by this process: what addr4 holds, as the mirror
            self._hint_rebuild(self._items(self.layout.addr4))
        m = self._m
        assert m is not None
        touched: set[bytes] = set()
        ported: set[bytes] = set()
        named: set[str | None] = set()  # the Services of roles that change
        # the mirror first (in apply_to's order), then the values it gives
        # the IPv4 keys whose roles may change, and the roles they had (none: not kept; at a
        # cold start no key has one): the address hints' bits change with them
        rolekeys: set[bytes] = set()
        before: dict[bytes, int] = {}

        def seen(key: bytes) -> bytes:
            if len(key) == 4 and key not in rolekeys:
                rolekeys.add(key)
                if r := _roles_in(m, key):
                    before[key] = r
            touched.add(key)
            return key

        for lb, s in d.services_set.items():
            key = seen(lb.packed)
            named.add(m.unlink(key))
            m.link(key, s.pod_ip.packed, flags_of(s), s.service)
            named.add(s.service)
        for p, e in d.pods_set.items():
            key = seen(p.packed)
            named.add(m.del_pod(key))
            m.set_pod(key, e.lb_ip.packed, flags_of(e), e.service)
            named.add(e.service)
        # the ports after the roles: a pod's key is then the object its LB role holds
        for a in d.allowed_add:
            pod = a.pod_ip.packed
            m.add_port(pod, int(a.proto), a.port)
            ported.add(pod)
        for lb in d.services_del:
            named.add(m.unlink(seen(lb.packed)))
        for p in d.pods_del:
            named.add(m.del_pod(seen(p.packed)))
        for a in d.allowed_del:
            pod = a.pod_ip.packed
            m.del_port(pod, int(a.proto), a.port)
            ported.add(pod)
        for pod in ported:
            touched.update(m.lbs(pod))
            if pod in m.pod:
                touched.add(pod)
        # source ranges: a pod's networks are added before and removed after the addr values
        # that (un)mark it restricted, so that no source it accepts is ever refused
        range_add, range_del, flipped = _ranges_change(m, d)
        for pod in flipped:
            touched.update(m.lbs(pod))
            if pod in m.pod:
                touched.add(pod)
        sets = [a for a in touched if a in m.svc or a in m.pod]
        dels = [a for a in touched if a not in m.svc and a not in m.pod]
        services = sorted(n for n in named if n)
        try:
            self.slots.activate(n for n in services if n in m.refs)
            self._write_limits(d.limits_set)  # before the flags that make them read
            self._delete_addrs(dels)
            self._write_allowed(d.allowed_add)
            self._write_ranges(range_add)
            # the roles that come: bits before the keys
            self._hint_change(before, ((k, _roles_in(m, k)) for k in rolekeys), gain=True)
            self._write_addrs(sets)
            self._delete_allowed(d.allowed_del)
            self._write_ranges(range_del, delete=True)
            # the roles gone: bits after the keys
            self._hint_change(before, ((k, _roles_in(m, k)) for k in rolekeys), gain=False)
            self._write_limits(dict.fromkeys(d.limits_del - d.limits_set.keys(), NO_LIMITS))
            self.slots.park(n for n in services if n not in m.refs)
        except bpfsys.BpfError as e:
            self._m = None  # the maps hold part of it: read them again before the next apply
            self._hints = None  # and the hints from them (their counts follow the mirror)
            hint = " (map full?)" if e.errno in (errno.E2BIG, errno.ENOSPC) else ""
            raise DatapathError(f"programming maps in {self.pin_dir} failed: {e}{hint}") from e

    def _hint_write(self, words: Words) -> None:
        """Write the hints' words named; a map with more than a quarter of its words to write
        is written whole, in one batch of two buffers (a cold start sets a word per key: a
        list of a key and a value per word was 30 MB of its peak at 100,000 Services)."""
        assert self._hints is not None
        for name, ws in words.items():
            if not ws:
                continue
            arr = self._hints.words[name]
            spec = getattr(self.layout, name)
            if len(ws) * 4 > len(arr) and not self._no_batch:
                try:
                    keys = array("I", range(len(arr))).tobytes()
                    bpfsys.map_update_batch(self.fds[name], keys, arr.tobytes(), len(arr))
                    continue
                except bpfsys.BpfError as e:
                    if e.errno not in bpfsys.BATCH_UNSUPPORTED:
                        raise
                    self._no_batch = True  # (one call per word, below)
            order = sorted(ws)
            self._update_batch(
                spec,
                [struct.pack("=I", w) for w in order],
                [struct.pack("=Q", arr[w]) for w in order],
            )

    def _hint_rebuild(self, raw: Iterable[tuple[bytes, bytes]]) -> None:
        """addrhint and rolehint from addr4's entries as read, (key, value) pairs: every word
        the first time, then the words that differ from what this process last wrote
        (bpf/lib/types.h). O(addr4): at a start and a full read."""
        roles = []
        for k, v in raw:
            if len(k) == 4:
                kind = addr_val(v, 4).kind
                roles.append(
                    (k, (HINT_POD if kind & K_POD else 0) | (HINT_LB if kind & K_LB else 0))
                )
        old, self._hints = self._hints, AddrHints(self.layout).rebuild(roles)
        self._hint_write(self._hints.every_word() if old is None else self._hints.differ(old))

    def _hint_change(
        self, before: Mapping[bytes, int], after: Iterable[tuple[bytes, int]], gain: bool
    ) -> None:
        """Give the IPv4 keys in `after` their roles' bits, `before` the roles they had
        (AddrHints.change), and write the words that changed."""
        assert self._hints is not None
        self._hint_write(self._hints.change(before, after, gain))

    def _write_ranges(self, keys: list[bytes], delete: bool = False) -> None:
        """Add or delete range4/range6 keys, one call each (an LPM trie has no batch
        operations on every kernel; a pod has few ranges)."""
        one = ctypes.c_uint8(1)
        for k in keys:
            spec = (
                self.layout.range4 if len(k) == self.layout.range4.key_size else self.layout.range6
            )
            key = ctypes.create_string_buffer(k, len(k))
            if delete:
                bpfsys.map_delete(self.fds[spec.name], key)
            else:
                bpfsys.map_update(self.fds[spec.name], key, one)

    def _write_allowed(self, ports: Iterable[AllowedPort]) -> None:
        """The allow4/allow6 keys of `ports`, encoded and written WRITE_CHUNK at a time (a cold
        start's 200,000 keys at once were 16 MB of its peak at 100,000 Services)."""
        it = iter(ports)
        while part := [allow_key(a) for a in islice(it, WRITE_CHUNK)]:
            for spec in (self.layout.allow4, self.layout.allow6):
                size = spec.key_size
                mine = [k for k in part if len(k) == size]
                self._update_batch(spec, mine, [b"\x01"] * len(mine))

    def _delete_allowed(self, ports: set[AllowedPort]) -> None:
        for spec, version in ((self.layout.allow4, 4), (self.layout.allow6, 6)):
            self._delete_batch(spec, [allow_key(a) for a in ports if a.version == version])


__all__ = [
    "DEFAULT_FLOW_TIMEOUTS",
    "DEFAULT_MAX_SERVICES",
    "DEFAULT_PIN_DIR",
    "Flow",
    "FlowEntry",
    "MonitorState",
    "PinnedMaps",
    "ServiceCounters",
    "be16",
    "coarse_now_ns",
    "possible_cpus",
]


def _ranges_change(m: Mirror, d: MapDiff) -> tuple[list[bytes], list[bytes], set[bytes]]:
    """`d`'s source ranges into the mirror: the range keys to add and to delete, and the pods
    that became restricted or stopped being (their addr values change)."""
    range_add: list[bytes] = []
    range_del: list[bytes] = []
    flipped: set[bytes] = set()
    for p, nets in d.ranges_set.items():
        pod = p.packed
        old = m.ranges.get(pod)
        if old is None:
            flipped.add(pod)
            old = frozenset()
        range_add += [range_key(pod, n) for n in nets - old]
        range_del += [range_key(pod, n) for n in old - nets]
        m.ranges[pod] = nets
    for p in d.ranges_del:
        pod = p.packed
        old = m.ranges.pop(pod, None)
        if old is not None:
            flipped.add(pod)
            range_del += [range_key(pod, n) for n in old]
    return range_add, range_del, flipped


def _roles_in(m: Mirror, key: bytes) -> int:
    """The roles `key` has in the mirror, as rolehint keeps them."""
    return (HINT_POD if key in m.pod else 0) | (HINT_LB if key in m.svc else 0)


#: the bucket times (struct cz_bucket) that each limit (struct cz_limit) charges
_BUCKETS_OF_LIMIT = (
    ("in_bytes", ("in_bytes",)),
    ("in_pkts", ("in_pkts",)),
    ("out_bytes", ("out_bytes", "out_edt")),
)


def _changed_buckets(old: LimitVal, new: LimitVal) -> tuple[str, ...]:
    """The bucket times whose limit differs between `old` and `new` (its rate or its burst)."""
    out: list[str] = []
    for limit, times in _BUCKETS_OF_LIMIT:
        a, b = getattr(old, limit), getattr(new, limit)
        if (a.unit, a.tol) != (b.unit, b.tol):
            out += times
    return tuple(out)
