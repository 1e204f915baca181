"""Which processes the real-node lab counts as its own (`RealNodeLab.processes`, its "nothing
left" check): its own, found by directory, cgroup or network namespace, and never another lab's
that runs the same binaries beside it (stop 54's CI: the cluster lab's etcd and kube-apiserver,
running on the other worker, were reported as the real-node lab's leftovers)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cozylab.realnode.lab import RealNodeLab, ours

DIRS = ("/tmp/x/real-node0", "/var/lib/cozylab-realnode/rn1")
REL = "cozylab/rn1"
NET = {"net:[4026532001]"}
HOST = "net:[4026531840]"
MACHINE_CG = "0::/init.scope\n"


@pytest.mark.parametrize(
    ("cmd", "cwd", "cgroups", "net"),
    [
        ("etcd --data-dir=/tmp/x/real-node0/cp", "/", MACHINE_CG, HOST),
        ("kubelet", "/tmp/x/real-node0/node1", MACHINE_CG, HOST),
        ("kubelet --root-dir /var/lib/cozylab-realnode/rn1", "/", MACHINE_CG, HOST),
        ("containerd-shim", "/", "0::/cozylab/rn1/node1/system\n", HOST),
        ("containerd-shim", "/", "4:memory:/cozylab/rn1\n0::/\n", HOST),
        ("sleep 60", "/", MACHINE_CG, "net:[4026532001]"),
    ],
)
def test_the_labs_own(cmd: str, cwd: str, cgroups: str, net: str) -> None:
    assert ours(cmd, cwd, cgroups, net, DIRS, REL, NET)


@pytest.mark.parametrize(
    ("cmd", "cwd", "cgroups", "net"),
    [
        # the cluster lab's control plane on the other worker: the same binaries, its own dirs
        ("etcd --data-dir=/tmp/y/cp0", "/tmp/y/cp0", MACHINE_CG, "net:[4026532999]"),
        # a neighbour whose names only start like ours
        ("etcd --data-dir=/tmp/x/real-node01/cp", "/tmp/x/real-node01", MACHINE_CG, HOST),
        ("kubelet", "/", "0::/cozylab/rn12/node1\n", HOST),
        ("kubelet", "/", "0::/cozylab/rn1x\n", HOST),
    ],
)
def test_not_the_labs(cmd: str, cwd: str, cgroups: str, net: str) -> None:
    assert not ours(cmd, cwd, cgroups, net, DIRS, REL, NET)


@pytest.fixture
def sleeper(tmp_path: Path) -> Iterator[tuple[Path, int, int]]:
    """Two real processes: one started in the lab's directory, one in another lab's."""
    lab, other = tmp_path / "real-node0", tmp_path / "cp0"
    for d in (lab / "cp", other):
        d.mkdir(parents=True)
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    a = subprocess.Popen(argv, cwd=lab / "cp")
    b = subprocess.Popen(argv, cwd=other)
    try:
        yield lab, a.pid, b.pid
    finally:
        for p in (a, b):
            p.kill()
            p.wait()


def test_processes_are_the_labs_own_only(sleeper: tuple[Path, int, int]) -> None:
    lab_dir, mine, theirs = sleeper
    lab = RealNodeLab(f"rnunit{os.getpid()}", lab_dir, log=lambda _: None)
    pids = {pid for pid, _ in lab.processes()}
    assert mine in pids
    assert theirs not in pids
    assert os.getpid() not in pids


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a network namespace (root)")
def test_a_process_in_a_namespace_of_the_lab_that_is_there(tmp_path: Path) -> None:
    """A process in one of the lab's network namespaces counts while the namespace is there;
    once its name is gone it is not looked for (the kernel gives a deleted namespace's inode
    number to the next one made: a CI run found another test's agent that way)."""
    lab = RealNodeLab(f"rnns{os.getpid()}", tmp_path / "real-node0", log=lambda _: None)
    subprocess.run(["ip", "netns", "add", lab.tor], check=True)
    p = None
    try:
        p = subprocess.Popen(["nsenter", f"--net=/run/netns/{lab.tor}", "sleep", "60"], cwd="/")
        for _ in range(100):  # until nsenter has entered and exec'd sleep
            if Path(f"/proc/{p.pid}/cmdline").read_bytes().startswith(b"sleep"):
                break
            time.sleep(0.02)
        assert p.pid in {pid for pid, _ in lab.processes()}
        subprocess.run(["ip", "netns", "del", lab.tor], check=True)
        assert p.pid not in {pid for pid, _ in lab.processes()}
    finally:
        if p is not None:
            p.kill()
            p.wait()
        subprocess.run(["ip", "netns", "del", lab.tor], check=False, capture_output=True)
