"""The flows the pods opened (flow4/flow6), their hints (flowhint), the fast paths' seen slots
(seen4/seen6) and the flows' configuration (flowcfg: timeouts, and the node's part).

The egress program records a flow and sets its bit in the programs' half of the flow hint;
the ingress fast path trusts a clear bit to mean "no such flow". Flows that user space writes,
or that older programs recorded, get their bits in user space's half (`seed_flow_hints`).
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from cozyebpf.datapath import bpfsys
from cozyebpf.datapath.codec import address, packer
from cozyebpf.datapath.layout import (
    CFG_HOST_ROUTING,
    CFG_POD_DEVICES,
    CFG_SHAPED,
    FLOW_CLOSING,
    UPLINKS_MAX,
    Flow4Key,
    Flow4Val,
    Flow6Key,
    FlowCfg,
    flow_hint_bit,
    possible_cpus,
)
from cozyebpf.datapath.pins import Pins, copy_entries
from cozyebpf.errors import DatapathError
from cozyebpf.state import IPAddress

#: flowcfg is read, changed and written whole; the agent's threads do it one at a time
_CFG_LOCK = threading.Lock()

#: the flows' idle timeouts by default (seconds), as Linux conntrack's: UDP, ICMP echo, TCP
#: established, TCP after a FIN or RST (cozyebpf run --flow-timeout-*)
DEFAULT_FLOW_TIMEOUTS = {"udp": 120, "icmp": 30, "tcp": 432000, "tcp_closing": 10}
#: a timeout of 0 ("never") as the programs see it (bpf/lib/lookup.h, flow_fresh)
NEVER_NS = 1 << 62
_TIMEOUTS = ("udp", "icmp", "tcp", "tcp_closing")  # flow_cfg.timeout_ns[] (CZ_TO_*)

_FLOW_RAW = ("pod_ip", "remote_ip", "reserved")
#: by the length of the addresses
_FLOW_KEY = {4: packer(Flow4Key, _FLOW_RAW, "!"), 16: packer(Flow6Key, _FLOW_RAW, "!")}
_U32, _U64 = struct.Struct("=I"), struct.Struct("=Q")


class Flow(NamedTuple):
    """A flow-table entry: ICMP echo flows have the identifier as pod_port and remote_port 0."""

    pod_ip: IPAddress
    remote_ip: IPAddress
    pod_port: int
    remote_port: int
    proto: int

    @classmethod
    def of_key(cls, raw: bytes) -> Flow:
        """The flow of a flow4/flow6 key."""
        n = 4 if len(raw) == _FLOW_KEY[4].size else 16
        pod, remote, pod_port, remote_port, proto, _ = _FLOW_KEY[n].unpack(raw)
        return cls(address(pod), address(remote), pod_port, remote_port, proto)

    def key(self) -> bytes:
        pod = self.pod_ip.packed
        return _FLOW_KEY[len(pod)].pack(pod, self.remote_ip.packed, *self[2:], b"")


@dataclass(frozen=True)
class FlowEntry:
    """A flow with its value: when the pod last sent on it (CLOCK_MONOTONIC_COARSE ns) and
    whether it sent a FIN or RST."""

    flow: Flow
    last_seen_ns: int
    closing: bool

    def age_s(self, now_ns: int) -> float:
        """Seconds since the pod last sent on the flow (refreshed at most once a second)."""
        return max(0, now_ns - self.last_seen_ns) / 1e9

    def as_dict(self, now_ns: int) -> dict[str, object]:
        """For `maps dump`."""
        f = self.flow
        return {
            "pod_ip": str(f.pod_ip),
            "remote_ip": str(f.remote_ip),
            "pod_port": f.pod_port,
            "remote_port": f.remote_port,
            "proto": {1: "icmp", 6: "tcp", 17: "udp", 58: "icmpv6", 132: "sctp"}.get(
                f.proto, str(f.proto)
            ),
            "age_s": round(self.age_s(now_ns), 1),
            "closing": self.closing,
        }


def coarse_now_ns() -> int:
    """The programs' clock for flows (bpf_ktime_get_coarse_ns)."""
    return time.clock_gettime_ns(getattr(time, "CLOCK_MONOTONIC_COARSE", 6))  # 6 on Linux


class FlowTables(Pins):
    """The flow maps, hints, seen slots and flowcfg of a pin directory."""

    def seed_flow_hints(self) -> int:
        """Set the flow-hint bit of every flow in flow4/flow6 in user space's half (copying
        first the flows a resized flow map's predecessor got meanwhile). Call it once the
        egress program of this layout runs, before the ingress program that trusts the hints
        is attached: flows recorded by older programs have no bit yet. The number of flows."""
        for spec, old_fd in self._old_flows:
            new_fd = self.fds[spec.name]
            have = set(bpfsys.map_keys(new_fd, spec.key_size))
            missing = [k for k in bpfsys.map_keys(old_fd, spec.key_size) if k not in have]
            copy_entries(spec, old_fd, new_fd, missing)
            os.close(old_fd)
        self._old_flows = []
        self.forget_seen()  # the flow maps were rebuilt or copied: no slot vouches for them
        keys = [*self._keys(self.layout.flow4), *self._keys(self.layout.flow6)]
        self._set_hints(Flow.of_key(k) for k in keys)
        return len(keys)

    def _set_hints(self, flows: Iterable[Flow]) -> None:
        """OR the flows' bits into user space's words (user space is their only writer)."""
        log2 = self.layout.hint_log2
        bits: dict[int, int] = {}
        for f in flows:
            b = flow_hint_bit(
                f.pod_ip.packed, f.remote_ip.packed, f.pod_port, f.remote_port, f.proto, log2
            )
            word = 2 * (b >> 6) + 1  # user space's word of the pair (bpf/lib/types.h)
            bits[word] = bits.get(word, 0) | 1 << (b & 63)
        if not bits:
            return
        fd = self.fds[self.layout.flowhint.name]
        keys, values = [], []
        for idx, mask in bits.items():
            cur = ctypes.c_uint64()
            bpfsys.map_lookup(fd, ctypes.c_uint32(idx), cur)
            keys.append(_U32.pack(idx))
            values.append(_U64.pack(cur.value | mask))
        self._update_batch(self.layout.flowhint, keys, values)

    def forget_seen(self) -> None:
        """Zero every CPU's seen4/seen6 slots (types.h, struct flow4_seen): the fast paths then
        look every flow up again. Whoever writes, deletes or replaces flow entries calls this
        after, so that no slot vouches for an entry that changed under it."""
        for spec in (self.layout.seen4, self.layout.seen6):
            keys = [_U32.pack(i) for i in range(spec.max_entries)]
            zero = bytes(spec.value_size * possible_cpus())
            self._update_batch(spec, keys, [zero] * len(keys))

    def add_flows(
        self, flows: Iterable[Flow], last_seen_ns: int | None = None, closing: bool = False
    ) -> None:
        """Write flow-table entries as the egress program records them (with their hint
        bits), last seen now unless said: for tests, benchmarks and tools."""
        fl = list(flows)
        self._set_hints(fl)
        seen = coarse_now_ns() if last_seen_ns is None else last_seen_ns
        val = Flow4Val(last_seen_ns=seen | (FLOW_CLOSING if closing else 0))
        for f in fl:
            spec = self.layout.flow4 if f.pod_ip.version == 4 else self.layout.flow6
            key = f.key()
            bpfsys.map_update(self.fds[spec.name], ctypes.create_string_buffer(key, len(key)), val)
        self.forget_seen()

    def flows(self) -> set[Flow]:
        """Every entry of flow4 and flow6."""
        return {
            Flow.of_key(k) for s in (self.layout.flow4, self.layout.flow6) for k in self._keys(s)
        }

    def flow_entries(self) -> list[FlowEntry]:
        """Every flow with its value (when the pod last sent, closing or not)."""
        out = []
        for spec in (self.layout.flow4, self.layout.flow6):
            for kraw, vraw in self._items(spec):
                (v,) = _U64.unpack(vraw)  # struct flow4_val
                out.append(FlowEntry(Flow.of_key(kraw), v & ~FLOW_CLOSING, bool(v & FLOW_CLOSING)))
        return out

    def flows_by_pod(self) -> dict[IPAddress, int]:
        """Number of flow4 and flow6 entries per pod IP."""
        out: dict[IPAddress, int] = {}
        for spec, n in ((self.layout.flow4, 4), (self.layout.flow6, 16)):
            for raw in self._keys(spec):
                pod = address(raw[:n])  # pod_ip comes first
                out[pod] = out.get(pod, 0) + 1
        return out

    # -- flowcfg -------------------------------------------------------------------------

    def _flow_cfg(self) -> FlowCfg:
        cfg = FlowCfg()
        bpfsys.map_lookup(self.fds[self.layout.flowcfg.name], ctypes.c_uint32(0), cfg)
        return cfg

    def _set_flow_cfg(self, cfg: FlowCfg) -> None:
        bpfsys.map_update(self.fds[self.layout.flowcfg.name], ctypes.c_uint32(0), cfg)

    def set_flow_timeouts(self, udp: float, icmp: float, tcp: float, tcp_closing: float) -> None:
        """The flows' idle timeouts in seconds (0: never), read by the programs (flowcfg)."""
        for t in (udp, icmp, tcp, tcp_closing):
            if t < 0:
                raise ValueError(f"a flow timeout cannot be negative: {t}")
        with _CFG_LOCK:
            cfg = self._flow_cfg()
            for i, t in enumerate((udp, icmp, tcp, tcp_closing)):
                cfg.timeout_ns[i] = int(t * 1e9) if t else NEVER_NS
            self._set_flow_cfg(cfg)

    def bump_fib_gen(self) -> int:
        """The routes changed: every FIB answer the programs cached (bpf/lib/fib.h,
        cz_fib4_cached) is asked again. Returns the new generation."""
        with _CFG_LOCK:
            cfg = self._flow_cfg()
            cfg.fib_gen = (cfg.fib_gen + 1) & 0xFFFFFFFF
            self._set_flow_cfg(cfg)
            return int(cfg.fib_gen)

    def flow_timeouts(self) -> dict[str, float]:
        """The timeouts the programs apply, in seconds (0: never)."""
        t = [int(x) for x in self._flow_cfg().timeout_ns]
        return {n: 0 if t[i] >= NEVER_NS else t[i] / 1e9 for i, n in enumerate(_TIMEOUTS)}

    def set_node(
        self, uplinks: Sequence[int], pod_devices: bool, host_routing: bool = False
    ) -> None:
        """The node's part of flowcfg (bpf/lib/fib.h): the uplinks' ifindexes, whether
        pod-facing hooks are attached (which turns the cluster paths on), and whether what the
        tc programs translate is handed to its next device (--host-routing)."""
        if len(uplinks) > UPLINKS_MAX:
            raise DatapathError(
                f"{len(uplinks)} uplink devices; the programs know at most {UPLINKS_MAX}"
            )
        with _CFG_LOCK:
            cfg = self._flow_cfg()
            for i in range(UPLINKS_MAX):
                cfg.uplinks[i] = uplinks[i] if i < len(uplinks) else 0
            cfg.flags = (
                (cfg.flags & CFG_SHAPED)  # set_shaped's, as the uplinks' qdiscs decide
                | (CFG_POD_DEVICES if pod_devices else 0)
                | (CFG_HOST_ROUTING if host_routing else 0)
            )
            cfg.fib_gen = (cfg.fib_gen + 1) & 0xFFFFFFFF  # the uplinks decide what is cached
            self._set_flow_cfg(cfg)

    def node_config(self) -> tuple[list[int], bool]:
        """The uplinks' ifindexes and whether the cluster paths are on (set_node)."""
        cfg = self._flow_cfg()
        return [int(i) for i in cfg.uplinks if i], bool(cfg.flags & CFG_POD_DEVICES)

    def fib_gen(self) -> int:
        """The generation of the programs' cached FIB answers (bump_fib_gen)."""
        return int(self._flow_cfg().fib_gen)

    def set_shaped(self, shaped: bool) -> bool:
        """Whether egress limits are shaped (every uplink's root qdisc is fq: bpf/lib/limit.h,
        cz_shape) or policed. Whether that changed."""
        with _CFG_LOCK:
            cfg = self._flow_cfg()
            flags = (cfg.flags & ~CFG_SHAPED) | (CFG_SHAPED if shaped else 0)
            if flags == cfg.flags:
                return False
            cfg.flags = flags
            self._set_flow_cfg(cfg)
            return True

    def shaped(self) -> bool:
        """Whether egress limits are shaped, not policed (set_shaped)."""
        return bool(self._flow_cfg().flags & CFG_SHAPED)

    def host_routing(self) -> bool:
        """Whether the programs hand what they translate to its next device (set_node)."""
        return bool(self._flow_cfg().flags & CFG_HOST_ROUTING)
