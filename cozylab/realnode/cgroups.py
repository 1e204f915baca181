"""The lab's own cgroup subtree (`Subtree`): one directory per mounted cgroup hierarchy (each v1
controller, and the unified cgroup2 of a hybrid machine), /<CGROUP_ROOT>/<prefix>/..., that
holds every process the lab starts and everything they start (containerd's shims, the Pods'
containers under the kubelet's cgroup root). Stopping the lab kills what is left in it and
removes it, deepest first: nothing of the machine's own cgroups is touched."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from cozylab.realnode.spec import CGROUP_FS, CGROUP_ROOT


def hierarchies() -> list[Path]:
    """The mount points of the machine's cgroup hierarchies (v1 controllers, name=systemd, the
    unified cgroup2), from /proc/self/mountinfo."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        fstype, mountpoint = fields[sep + 1], Path(fields[4])
        if fstype in ("cgroup", "cgroup2") and mountpoint.is_relative_to(CGROUP_FS):
            found.append(mountpoint)
    return sorted(set(found))


class Subtree:
    """/<CGROUP_ROOT>/<prefix> in every hierarchy."""

    def __init__(self, prefix: str) -> None:
        self.rel = f"{CGROUP_ROOT}/{prefix}"
        self.roots = hierarchies()

    def path(self, sub: str = "") -> str:
        """The cgroup path of `sub` as the kubelet's --cgroup-root takes it (/a/b)."""
        return "/" + "/".join(p for p in (self.rel, sub) if p)

    def make(self, sub: str = "") -> None:
        """Create `sub` (and its parents) in every hierarchy; cpuset's get their parent's CPUs
        and memory nodes (a v1 cpuset without them takes no task)."""
        parts = [p for p in f"{self.rel}/{sub}".split("/") if p]
        for root in self.roots:
            d = root
            for part in parts:
                parent, d = d, d / part
                if not d.exists():
                    d.mkdir()
                for f in ("cpuset.cpus", "cpuset.mems"):
                    if (d / f).exists() and not (d / f).read_text().strip():
                        (d / f).write_text((parent / f).read_text())

    def wrapper(self, sub: str) -> list[str]:
        """A command prefix that moves itself into `sub` of every hierarchy, then runs the
        rest (so that whatever the command starts stays in the lab's subtree)."""
        procs = " ".join(f"{r}/{self.rel}/{sub}/cgroup.procs" for r in self.roots)
        script = f'for f in {procs}; do echo $$ > "$f"; done; exec "$@"'
        return ["sh", "-c", script, "cgroup-enter"]

    def _dirs(self) -> list[Path]:
        """Every directory of the subtree in every hierarchy, deepest first."""
        out: list[Path] = []
        for root in self.roots:
            top = root / self.rel
            if top.is_dir():
                out += [Path(d) for d, _, _ in os.walk(top)]
        return sorted(out, key=lambda p: len(p.parts), reverse=True)

    def existing(self) -> list[Path]:
        """The subtree's directories that exist, in every hierarchy."""
        return [root / self.rel for root in self.roots if (root / self.rel).exists()]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self._dirs():
            with contextlib.suppress(OSError):
                found |= {int(x) for x in (d / "cgroup.procs").read_text().split()}
        return found

    def kill(self, timeout: float = 20) -> list[int]:
        """SIGKILL every process of the subtree until none is left; the pids killed."""
        killed: set[int] = set()
        deadline = time.monotonic() + timeout
        while pids := self.pids():
            for pid in pids - {os.getpid()}:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed |= pids
            if time.monotonic() > deadline:
                raise TimeoutError(f"processes left in the cgroup {self.rel}: {sorted(pids)}")
            time.sleep(0.05)
        return sorted(killed)

    def remove(self) -> None:
        """Kill what is left, then remove the subtree, deepest first."""
        self.kill()
        for d in self._dirs():
            for attempt in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # a task that just exited is still being released
                    if attempt == 99:
                        raise
                    time.sleep(0.05)
        for root in self.roots:
            with contextlib.suppress(OSError):
                (root / CGROUP_ROOT).rmdir()  # if no other lab uses it
