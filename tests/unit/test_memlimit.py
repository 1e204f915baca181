"""The agent says when it is near its memory limit (issue 48): its cgroup's working set against
`memory.max` (v2) or `memory.limit_in_bytes` (v1), a Problem on its Node above 85 % (logged,
and an Event in `default`), resolved below 80 %; the metrics serve both figures. Cgroup files
are laid out in a temporary directory (v2, v1, a cgroup namespace's root), and once for real:
a v1 memory cgroup this test creates, limits, puts a process in and removes."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cozyebpf.agent import Agent
from cozyebpf.kube.events import EventRecorder
from cozyebpf.memlimit import CgroupMemory, Memory, MemoryWatch
from cozyebpf.metrics import registry_for
from cozyebpf.sources import ChangeSet
from cozylab.fakedp import FakeDatapath
from cozylab.kubeapi import FakeKubeAPI
from tests.support.clock import FakeClock
from tests.support.sources import IdleSource

MiB = 1 << 20


class Empty(IdleSource):
    """A source read completely, with no Service."""

    def take(self) -> ChangeSet:
        return ChangeSet()


def v2(
    tmp: Path, used: int, limit: str, inactive: int = 0, rel: str = "kubepods/pod1/c1"
) -> CgroupMemory:
    proc = tmp / "cgroup"
    proc.write_text(f"0::/{rel}\n")
    d = tmp / "fs" / rel
    d.mkdir(parents=True, exist_ok=True)
    (d / "memory.current").write_text(f"{used}\n")
    (d / "memory.max").write_text(f"{limit}\n")
    (d / "memory.stat").write_text(
        f"anon {used}\nfile 0\ninactive_file {inactive}\nactive_file 0\n"
    )
    return CgroupMemory(str(tmp / "fs"), str(proc))


def test_v2_working_set_and_limit(tmp_path: Path) -> None:
    cg = v2(tmp_path, 900 * MiB, str(1000 * MiB), inactive=50 * MiB)
    assert cg.read() == Memory(850 * MiB, 1000 * MiB)
    assert v2(tmp_path, 900 * MiB, "max").read() == Memory(900 * MiB, None)


def test_v2_in_a_cgroup_namespace_reads_the_mount_root(tmp_path: Path) -> None:
    cg = v2(tmp_path, 10 * MiB, str(20 * MiB), rel="")
    assert cg.read() == Memory(10 * MiB, 20 * MiB)


def test_v1_memory_controller(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("5:cpu,cpuacct:/x\n4:memory:/kubepods/pod1\n0::/\n")
    d = tmp_path / "fs" / "memory" / "kubepods" / "pod1"
    d.mkdir(parents=True)
    (d / "memory.usage_in_bytes").write_text(f"{300 * MiB}\n")
    (d / "memory.limit_in_bytes").write_text(f"{400 * MiB}\n")
    (d / "memory.stat").write_text(f"cache 0\ntotal_inactive_file {20 * MiB}\n")
    cg = CgroupMemory(str(tmp_path / "fs"), str(proc))
    assert cg.read() == Memory(280 * MiB, 400 * MiB)
    (d / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert cg.read() == Memory(280 * MiB, None)


def test_nothing_readable_is_no_figure(tmp_path: Path) -> None:
    assert CgroupMemory(str(tmp_path), str(tmp_path / "missing")).read() is None
    assert MemoryWatch("n", CgroupMemory(str(tmp_path), str(tmp_path / "missing"))).check(1) is None


def test_a_warning_above_85_percent_until_below_80(tmp_path: Path) -> None:
    w = MemoryWatch("node-a", v2(tmp_path, 840 * MiB, str(1000 * MiB)))
    assert w.check(100) is None  # 84 %: nothing said
    v2(tmp_path, 860 * MiB, str(1000 * MiB))
    p = w.check(70000)
    assert p is not None and (p.ref.kind, p.ref.namespace, p.ref.name) == ("Node", "", "node-a")
    assert "860 MiB, 86% of its memory limit of 1000 MiB, with 70000 Services" in p.message
    assert "agent.maxServices" in p.message and "resources.limits.memory" in p.message
    v2(tmp_path, 900 * MiB, str(1000 * MiB))
    assert w.check(70000) is p  # one warning, its words kept while open (one Event)
    v2(tmp_path, 810 * MiB, str(1000 * MiB))
    assert w.check(70000) is p  # 81 %: still open
    v2(tmp_path, 790 * MiB, str(1000 * MiB))
    assert w.check(70000) is None
    v2(tmp_path, 990 * MiB, "max")
    assert w.check(70000) is None  # no limit: nothing to warn about


def test_the_agent_reports_it_once_and_lists_it_until_resolved(tmp_path: Path) -> None:
    clock = FakeClock()
    cg = v2(tmp_path, 900 * MiB, str(1000 * MiB))
    agent = Agent(Empty(), FakeDatapath(), clock=clock, memory=MemoryWatch("node-a", cg))
    seen: list[str] = []
    agent.on_problems = lambda ps: seen.extend(str(p) for p in ps)
    agent.tick()
    assert len(seen) == 1 and seen[0].startswith("Node node-a: the cozyebpf agent uses 900 MiB")
    assert [str(p) for p in agent.problems()] == seen
    clock.advance(agent.check_interval)
    agent.tick()
    assert len(seen) == 1
    v2(tmp_path, 100 * MiB, str(1000 * MiB))
    clock.advance(agent.check_interval)
    agent.tick()
    assert agent.problems() == []
    # the metrics: the working set and the limit, as read at the scrape
    samples = {
        s.name: s.value
        for fam in registry_for("/nonexistent", agent).collect()
        for s in fam.samples
    }
    assert samples["cozyebpf_agent_memory_bytes"] == 100 * MiB
    assert samples["cozyebpf_agent_memory_limit_bytes"] == 1000 * MiB


def test_the_warning_is_an_event_on_the_node_in_default(tmp_path: Path) -> None:
    p = MemoryWatch("node-a", v2(tmp_path, 900 * MiB, str(1000 * MiB))).check(5)
    assert p is not None
    api = FakeKubeAPI()
    api.start()
    rec = EventRecorder(api.api_client(), "node-a")
    rec.start()
    try:
        rec.record([p])
        end = time.monotonic() + 10
        while rec.sent < 1 and time.monotonic() < end:
            time.sleep(0.01)
        (ev,) = api.events("default")
        assert ev["involvedObject"] == {
            "apiVersion": "v1",
            "kind": "Node",
            "namespace": "",
            "name": "node-a",
        }
        assert ev["message"] == p.message and ev["type"] == "Warning"
    finally:
        rec.stop()
        api.stop()


V1_MEMORY = Path("/sys/fs/cgroup/memory")


@pytest.mark.skipif(
    os.geteuid() != 0 or not (V1_MEMORY / "memory.limit_in_bytes").exists(),
    reason="needs root and a cgroup v1 memory hierarchy at /sys/fs/cgroup/memory",
)
def test_a_real_v1_cgroup_near_its_limit() -> None:
    """A memory cgroup of 64 MiB, a process in it that holds about 58 MiB: the watch, reading
    that process's /proc/<pid>/cgroup, warns; the cgroup's own files, not a copy."""
    cg = V1_MEMORY / f"cozyebpf-test-{os.getpid()}"
    cg.mkdir()
    child = None
    try:
        (cg / "memory.limit_in_bytes").write_text(str(64 * MiB))
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; print('started', flush=True); sys.stdin.readline(); "
                "b = bytearray(58 << 20); b[::4096] = b'x' * len(b[::4096]); "
                "print('held', flush=True); sys.stdin.readline()",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdin is not None and child.stdout is not None
        # Moved once the interpreter has started: a v1 cgroup charges what a task faults in
        # after it joins, page cache included. Moved at once, its start-up came too: 61.8 MiB
        # at the cgroup's peak here instead of 58.25, 2 MiB short of the limit; in CI (a fresh
        # clone, its venv read for the first time) the child went over and the OOM killed it.
        assert child.stdout.readline().strip() == "started"
        (cg / "cgroup.procs").write_text(str(child.pid))
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "held"
        watch = MemoryWatch("node-a", CgroupMemory(proc=f"/proc/{child.pid}/cgroup"))
        p = watch.check(1)
        assert watch.last is not None and watch.last.limit == 64 * MiB, watch.last
        assert p is not None, watch.last
        assert "of its memory limit of 64 MiB" in p.message
    finally:
        if child is not None:
            child.kill()
            child.wait()
        for _ in range(50):
            with contextlib.suppress(OSError):
                cg.rmdir()
            if not cg.exists():
                break
            time.sleep(0.1)
