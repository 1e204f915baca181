"""A stop lands only where it leaves the node whole (issue 28, item 4): `cozyebpf run` signalled
at random moments of its start, and right as it attaches, leaves every hook and every map
either as it was before the start or as the whole new datapath has it; never the egress hook
without the ingress one, never half a map batch.

A stop is never an error (issue 37, item 3): signalled inside the attachment check and inside
a map batch (tests/support/held_agent.py holds the agent there until the signal), the agent
finishes that section, logs no ERROR and writes nothing after it, not even a change that was
waiting."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cozyebpf.datapath import attach, bpfsys
from cozyebpf.state import MapState
from cozylab.k8s import Svc, manifest
from cozylab.netns import DEFAULT_PODS, UPLINK
from tests.support.env import TEST_CMD
from tests.support.labtools import AgentLab, agent_lab, wait_for
from tests.support.packets import LB_FILT, LB_ICMP, LB_WHOLE

PODS = DEFAULT_PODS[:2]
SERVICES = (
    Svc("vm1", LB_WHOLE, PODS[0].ip, [("TCP", 22)], whole_ip="true"),
    Svc("vm2", LB_FILT, PODS[1].ip, [("TCP", 80), ("UDP", 53)]),
)
WHOLE, FILT = SERVICES
#: a third Service (its pod is not in the lab: the maps do not care)
VM3 = Svc("vm3", LB_ICMP, DEFAULT_PODS[2].ip, [("TCP", 443)])
POD_DEVICES = ",".join(p.host_dev for p in PODS)
#: (device, hook) of the whole datapath: the uplink's ingress and egress, a pod-facing hook on
#: each pod's veth
HOOKS = ((UPLINK, "xdp"), (UPLINK, "tcx-egress"), *((p.host_dev, "tcx-ingress") for p in PODS))
#: moments: at random over the whole start (compiling, programming the maps, attaching), a
#: third, and right after the first link of a fresh start is pinned (the attach in progress),
#: the rest. Each moment after the compilation costs one (3-5 s on this 2-core machine shared
#: with other runs), so 24 by default fit in about 2 minutes; CZ_STOP_MOMENTS asks for more (50
#: were run for issue 28: CHANGELOG).
MOMENTS = int(os.environ.get("CZ_STOP_MOMENTS", "24"))
SPREAD, AT_ATTACH = MOMENTS // 3, MOMENTS - MOMENTS // 3


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, cozyebpf_cmd: list[str]) -> Iterator[AgentLab]:
    tmp = tmp_path_factory.mktemp("stops")
    with agent_lab("sp", tmp, cozyebpf_cmd, PODS, manifest(*SERVICES)) as env:
        yield env


def hooks(env: AgentLab) -> dict[tuple[str, str], tuple[int, ...]]:
    """The programs on each hook of HOOKS, from the kernel (not from our pins)."""

    def q() -> dict[tuple[str, str], tuple[int, ...]]:
        out: dict[tuple[str, str], tuple[int, ...]] = {}
        for dev, hook in HOOKS:
            idx = socket.if_nametoindex(dev)
            if hook == "xdp":
                cur = attach.current_xdp(idx)
                out[(dev, hook)] = () if cur is None else (cur[0],)
            else:
                kind = bpfsys.BPF_TCX_EGRESS if hook == "tcx-egress" else bpfsys.BPF_TCX_INGRESS
                out[(dev, hook)] = tuple(bpfsys.prog_query(idx, kind)[0])
        return out

    return env.lab.in_ns(env.lab.node, q)


def maps(env: AgentLab) -> MapState:
    return env.maps_state() if os.path.exists(env.pin_dir) else MapState()


def start(env: AgentLab) -> subprocess.Popen[str]:
    log = env.log_path.open("a")
    return env.lab.popen(
        env.lab.node,
        *env.cmd,
        "run",
        "--manifests",
        str(env.manifest_path),
        "--devices",
        UPLINK,
        "--pod-devices",
        POD_DEVICES,
        "--pin-dir",
        env.pin_dir,
        "--log-level",
        "debug",
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def first_link(env: AgentLab, proc: subprocess.Popen[str]) -> None:
    """Return as soon as the agent pinned its first link (polled every 0.2 ms)."""
    links = attach.links_dir(env.pin_dir)
    deadline = time.monotonic() + 120  # a bound for a hang: a loaded machine compiles slowly
    while time.monotonic() < deadline:
        try:
            if os.listdir(links):
                return
        except FileNotFoundError:
            pass
        assert proc.poll() is None, f"the agent exited before attaching:\n{env.log()[-3000:]}"
        time.sleep(0.0002)
    raise TimeoutError("the agent's first link")


def detach(env: AgentLab) -> None:
    env.lab.in_ns(env.lab.node, lambda: attach.detach_all(env.pin_dir))


def test_a_stop_at_any_moment_of_the_start_leaves_the_node_whole(env: AgentLab) -> None:
    rng = random.Random(os.environ.get("CZ_STOP_SEED", "28"))
    # the whole datapath once, unhurried: what a finished start leaves, and how long it takes
    t0 = time.monotonic()
    env.start_agent_on(UPLINK, "--pod-devices", POD_DEVICES)
    ready = time.monotonic() - t0
    wait_for(lambda: len(maps(env).services) == 2, 10, "the first sync")
    desired = maps(env)
    assert env.stop_agent() == 0
    detach(env)
    moments = ["spread"] * SPREAD + ["attach"] * AT_ATTACH
    rng.shuffle(moments)
    seen: dict[str, int] = {}
    outcomes: dict[str, int] = {}
    for i, kind in enumerate(moments):
        if kind == "attach" and os.path.exists(attach.links_dir(env.pin_dir)):
            detach(env)  # a fresh start: its first pinned link marks the attach
        before_hooks, before_maps = hooks(env), maps(env)
        offset = len(env.log())
        proc = start(env)
        try:
            if kind == "spread":
                time.sleep(rng.uniform(0, ready * 1.2))
            else:
                first_link(env, proc)
                time.sleep(rng.uniform(0, 0.003))
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        log = env.log()[offset:]
        where = f"moment {i} ({kind}); agent log:\n{log[-3000:]}"
        # a signal before the handler is installed (the interpreter starting) kills: nothing
        # was done yet, which the checks below confirm
        early = rc == -signal.SIGTERM and "got SIGTERM" not in log
        assert (rc == 0 or early) and "Traceback" not in log, where
        after_hooks, after_maps = hooks(env), maps(env)
        old = {p for ids in before_hooks.values() for p in ids}
        whole = all(len(ids) == 1 and ids[0] not in old for ids in after_hooks.values())
        assert after_hooks == before_hooks or whole, (before_hooks, after_hooks, where)
        assert after_maps in (before_maps, desired), (after_maps, where)
        for line in log.splitlines():
            if "stopping once" in line:
                what = line.split("stopping once ", 1)[1].split(" is done")[0]
                seen[what] = seen.get(what, 0) + 1
        outcome = "unchanged" if after_hooks == before_hooks else "whole"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(f"\n{len(moments)} stops: {outcomes}; held by {seen}; a start took {ready:.1f}s")
    # the moments met what they are for: stops held by an attach in progress, and both ends
    assert seen.get("attaching the programs", 0) > 0, seen
    assert outcomes.get("unchanged", 0) > 0 and outcomes.get("whole", 0) > 0, outcomes


def held_agent(env: AgentLab, repo_root: Path, arm: Path) -> tuple[subprocess.Popen[str], int]:
    """`cozyebpf run` through tests/support/held_agent.py (the seam that holds it inside the
    section named in `arm`), ready and synced; (the process, where its log starts)."""
    offset = len(env.log())
    proc = env.lab.popen(
        env.lab.node,
        env.cmd[0],
        "-m",
        "tests.support.held_agent",
        str(arm),
        "run",
        "--manifests",
        str(env.manifest_path),
        "--devices",
        UPLINK,
        "--pin-dir",
        env.pin_dir,
        "--check-interval",
        "0.2",
        "--poll-interval",
        "0.1",
        "--log-level",
        "debug",
        stdout=env.log_path.open("a"),
        stderr=subprocess.STDOUT,
        cwd=str(repo_root),
    )
    try:
        wait_for(  # a bound for a hang: a loaded machine compiles slowly
            lambda: "datapath ready" in env.log()[offset:] or proc.poll() is not None,
            120,
            "the agent to attach",
        )
        assert proc.poll() is None, env.log()[offset:]
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, offset


def put(env: AgentLab, *svcs: Svc) -> None:
    """The manifest, replaced at once (a rename, as the README recommends)."""
    tmp = env.manifest_path.with_suffix(".tmp")
    tmp.write_text(manifest(*svcs))
    os.replace(tmp, env.manifest_path)


def lbs(env: AgentLab) -> set[str]:
    return {str(lb) for lb in maps(env).services}


@pytest.mark.parametrize(
    ("section", "trigger", "written"),
    [
        # the check runs every 0.2 s: it is entered without a change
        ("checking the attachments", (), {LB_WHOLE}),
        # vm2 arrives: its batch is held, and completed whole once the stop comes
        ("writing the maps", (LB_FILT,), {LB_WHOLE, LB_FILT}),
    ],
    ids=["attachment-check", "map-batch"],
)
def test_a_stop_inside_a_section_is_no_error_and_nothing_is_written_after_it(
    env: AgentLab,
    repo_root: Path,
    tmp_path: Path,
    section: str,
    trigger: tuple[str, ...],
    written: set[str],
) -> None:
    """The agent is held inside `section` (the attachment check, or the map batch of a new
    Service); meanwhile one more Service (vm3) is put in the manifest and handed to the agent.
    Then SIGTERM: the section finishes, the agent exits 0 with no ERROR in its log, and vm3 is
    not in the maps (no batch after the stop). Before issue 37 the check's `except Exception`
    logged the held stop as "checking the attachments failed", and the tick went on to write
    vm3's batch."""
    if TEST_CMD:
        pytest.skip("the seam wraps this tree's agent, not COZYEBPF_TEST_CMD's")
    if os.path.exists(env.pin_dir):
        detach(env)
    put(env, WHOLE)
    arm = tmp_path / "arm"
    proc, offset = held_agent(env, repo_root, arm)
    try:
        wait_for(lambda: lbs(env) == {LB_WHOLE}, 10, "the first sync")
        arm.write_text(section)
        now = {LB_WHOLE, *trigger}
        if trigger:
            put(env, *(s for s in (WHOLE, FILT) if s.lb_ip in now))
        wait_for(lambda: f"held in {section}" in env.log()[offset:], 30, f"{section} held")
        held = len(env.log())
        put(env, *(s for s in (WHOLE, FILT) if s.lb_ip in now), VM3)
        # the manifest's watch thread handed vm3 over: the agent's next take() would get it
        wait_for(lambda: "held-agent: notified" in env.log()[held:], 10, "vm3 handed to the agent")
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = env.log()[offset:]
    assert rc == 0, log[-3000:]
    assert [line for line in log.splitlines() if " ERROR " in line] == [], log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert f"{section} done; stopping" in log, log[-3000:]
    assert lbs(env) == written, log[-3000:]  # the held section whole, nothing after it
