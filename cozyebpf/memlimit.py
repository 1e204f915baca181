"""The agent's memory against its cgroup's limit (issue 48): the pod's memory is limited, and
everything charged to its cgroup counts against that limit, the pinned maps and per-Service
counters included, beside the agent's own memory. Above `WARN_AT` of the limit, the agent says
so (a Problem on its Node: the log, and a Warning Event), naming what to raise.

The cgroup is the process's own (`/proc/self/cgroup`): v2's `memory.max` and `memory.current`,
or v1's `memory.limit_in_bytes` and `memory.usage_in_bytes` (its `memory` controller), both under
/sys/fs/cgroup. Inside a container with a cgroup namespace, the process's path is `/` and the
files are at the mount's root. The memory counted is the working set, as the kubelet counts it
for eviction: usage minus the inactive file pages (`memory.stat`'s `inactive_file`, v1's
`total_inactive_file`), which the kernel reclaims before it kills anything. No limit (`max`, or
v1's "unlimited", a page counter's maximum), or no readable file: nothing is said. The
metrics serve both (`cozyebpf_agent_memory_bytes`, `cozyebpf_agent_memory_limit_bytes`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from cozyebpf.model import ObjectRef, Problem

log = logging.getLogger(__name__)

#: the share of the limit above which the agent warns, and below which the warning is resolved
WARN_AT = 0.85
RESOLVE_AT = 0.80
#: v1 reports "no limit" as the page counter's maximum, rounded down to a page
_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class Memory:
    """The cgroup's working set and limit (None: none), in bytes."""

    used: int
    limit: int | None

    @property
    def share(self) -> float:
        return self.used / self.limit if self.limit else 0.0


def _int(path: Path) -> int | None:
    """The number in `path`; -1 for "max"; None when unreadable."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return -1
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _dirs(root: Path, rel: str) -> list[Path]:
    """The cgroup's directory: `rel` under `root`, or `root` itself (a cgroup namespace)."""
    rel = rel.strip("/")
    return [root / rel, root] if rel else [root]


class CgroupMemory:
    """Reads the process's cgroup memory (see the module docstring). `root` and `proc` are the
    cgroup mount and `/proc/self/cgroup` (tests give their own)."""

    def __init__(self, root: str = "/sys/fs/cgroup", proc: str = "/proc/self/cgroup") -> None:
        self.root = Path(root)
        self.proc = Path(proc)

    def _v2_v1(self) -> tuple[str | None, str | None]:
        v2 = v1 = None
        try:
            lines = self.proc.read_text().splitlines()
        except OSError:
            return None, None
        for line in lines:
            hid, _, rest = line.partition(":")
            controllers, _, path = rest.partition(":")
            if hid == "0" and controllers == "":
                v2 = path
            elif "memory" in controllers.split(","):
                v1 = path
        return v2, v1

    def read(self) -> Memory | None:
        """The working set and the limit, or None: nothing readable."""
        v2, v1 = self._v2_v1()
        if v1 is not None:
            for d in _dirs(self.root / "memory", v1):
                limit = _int(d / "memory.limit_in_bytes")
                usage = _int(d / "memory.usage_in_bytes")
                if limit is not None and usage is not None:
                    inactive = _stat(d / "memory.stat", "total_inactive_file")
                    unlimited = limit < 0 or limit >= _V1_UNLIMITED
                    return Memory(max(0, usage - inactive), None if unlimited else limit)
        if v2 is not None:
            for d in _dirs(self.root, v2):
                limit = _int(d / "memory.max")
                usage = _int(d / "memory.current")
                if limit is not None and usage is not None:
                    inactive = _stat(d / "memory.stat", "inactive_file")
                    return Memory(max(0, usage - inactive), None if limit < 0 else limit)
        return None


def rss() -> int:
    """The process's resident memory, in bytes (0 if unreadable)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def near_limit(node: str, m: Memory, services: int) -> Problem:
    """The warning of an agent whose memory is above WARN_AT of its limit."""
    mib = 1 << 20
    assert m.limit is not None
    return Problem(
        ObjectRef("Node", "", node),
        f"the cozyebpf agent uses {m.used // mib} MiB, {m.share:.0%} of its memory limit of "
        f"{m.limit // mib} MiB, with {services} Services; the kernel "
        "kills it at the limit. Raise the chart's agent.maxServices to the Services "
        "this node needs (the chart computes the memory from it and agent.countedServices), or "
        "the agent's resources.requests.memory and resources.limits.memory if set by hand",
    )


class MemoryWatch:
    """Checks the memory against the limit; `check(services)` returns the open warning (a
    Problem) or None, with hysteresis: it opens above WARN_AT and closes below RESOLVE_AT."""

    def __init__(self, node: str, cgroup: CgroupMemory | None = None) -> None:
        self.node = node
        self.cgroup = cgroup or CgroupMemory()
        self.last: Memory | None = None
        self.problem: Problem | None = None

    def check(self, services: int) -> Problem | None:
        m = self.last = self.cgroup.read()
        if (
            m is None
            or m.limit is None
            or m.share < RESOLVE_AT
            or (self.problem is None and m.share <= WARN_AT)
        ):
            self.problem = None
        elif self.problem is None:  # once: an open warning keeps its words (one Event)
            self.problem = near_limit(self.node, m, services)
        return self.problem
