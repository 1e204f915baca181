"""The capabilities the agent needs, proven on the real kernel.

deploy/daemonset.yaml drops ALL capabilities and adds exactly MINIMAL. Here the agent runs as
root in a lab's node namespace under `capsh --drop=<every other capability>`: for uid 0 an exec
makes permitted = effective = the bounding set, which is what a container runtime gives a
container with `drop: [ALL]` + `add: [...]`. With exactly MINIMAL the agent must start, attach,
program the maps, forward ping and TCP through an LB IP, answer `maps dump`, replace its
programs in place on a restart, and `detach`. Then each capability of MINIMAL is dropped in turn
and the agent must fail at start, saying what failed. Why each one is needed:

- CAP_SYS_ADMIN: without it (and without CAP_BPF) creating the maps fails. CAP_BPF and
  CAP_PERFMON do not replace it: bcc implements BPF_TABLE_PINNED by looking the pinned map up
  by id (BPF_MAP_GET_FD_BY_ID in bpf_module.cc, BPFModule::create_maps), a command the kernel
  allows only with CAP_SYS_ADMIN. CAP_SYS_ADMIN stands in for CAP_BPF (creating maps, loading
  programs), CAP_PERFMON (the verifier's rules for variable packet-pointer arithmetic) and,
  inside bpf(2) only, CAP_NET_ADMIN (XDP and sched_cls programs, tcx queries), so those are
  not needed besides it.
- CAP_NET_ADMIN: rtnetlink, where CAP_SYS_ADMIN does not stand in: the clsact qdisc and filters
  of the egress hook on kernels without tcx (< 6.6) or with --tc-mode legacy, and nftables (the
  check for cozy-proxy's table).

Not needed (the first test passes without them): CAP_BPF, CAP_PERFMON, CAP_SYS_RESOURCE (BPF
memory is charged to the memory cgroup since Linux 5.11, not RLIMIT_MEMLOCK), CAP_IPC_LOCK,
CAP_NET_RAW, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH (root owns the pins), CAP_SYS_PTRACE.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import yaml

from cozylab.k8s import Svc, manifest
from cozylab.netns import CLIENT_IP, DEFAULT_PODS, UPLINK, Lab
from tests.support.contract import MINIMAL
from tests.support.env import TEST_CMD, unique_prefix
from tests.support.labtools import (
    AgentLab,
    interrupt,
    read_line_with,
    serve,
    tcp_echo,
    tcp_talk,
    wait_for,
)
from tests.support.packets import LB_WHOLE

pytestmark = pytest.mark.requires("capsh")  # and, as every test here, datapath

CAP_BITS = {"CAP_NET_ADMIN": 12, "CAP_SYS_ADMIN": 21}

POD1 = DEFAULT_PODS[0]
_pin_dirs = itertools.count(1)
WHOLE = Svc("vm-caps", LB_WHOLE, POD1.ip, [("TCP", 22)], whole_ip="true")


def _bounding_set() -> list[str]:
    """Names of the capabilities in this process's bounding set (what capsh can drop)."""
    with open("/proc/self/status") as f:
        mask = next(line.split()[1] for line in f if line.startswith("CapBnd:"))
    out = subprocess.run(["capsh", f"--decode={mask}"], capture_output=True, text=True).stdout
    return [c.upper() for c in out.strip().partition("=")[2].split(",") if c]


def only(caps: Sequence[str]) -> list[str]:
    """Command prefix that runs the rest of the command as root with exactly `caps` (bounding,
    permitted and effective set; inheritable and ambient empty). Under COZYEBPF_TEST_CMD
    (`make image-test`) that command enters the image first, which takes capabilities the
    agent does not get: scripts/image-exec.sh drops them itself, after the chroot."""
    if TEST_CMD:
        return ["env", f"COZYEBPF_TEST_CAPS={','.join(c.lower() for c in caps)}"]
    drop = [c.lower() for c in _bounding_set() if c not in caps]
    return ["capsh", f"--drop={','.join(drop)}", "--", "-c", 'exec "$@"', "capsh-exec"]


def _mask(caps: Sequence[str]) -> int:
    return sum(1 << CAP_BITS[c] for c in caps)


def _caps_of(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v, 16) for k, _, v in (line.partition(":") for line in f) if k[:3] == "Cap"}


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    lab = Lab(unique_prefix("cap"), pods=DEFAULT_PODS[:1]).up()
    try:
        yield lab
    finally:
        lab.down()


@pytest.fixture
def agent(lab: Lab, tmp_path: Path, cozyebpf_cmd: list[str]) -> Iterator[AgentLab]:
    """An AgentLab whose agent runs with exactly MINIMAL; each test has its own pin dir."""
    yield from _minimal_agent(lab, tmp_path, cozyebpf_cmd, [*only(MINIMAL)])


def _minimal_agent(
    lab: Lab, tmp_path: Path, cozyebpf_cmd: list[str], wrapper: list[str]
) -> Iterator[AgentLab]:
    """An AgentLab whose every command runs behind `wrapper`, with a pin dir of its own."""
    env = AgentLab(
        lab,
        f"/sys/fs/bpf/{lab.prefix}-{next(_pin_dirs)}",
        tmp_path / "services.yaml",
        tmp_path / "agent.log",
        [*wrapper, *cozyebpf_cmd],
    )
    env.manifest_path.write_text(manifest(WHOLE))
    try:
        yield env
    finally:
        if env.proc:
            env.stop_agent(signal.SIGKILL)
        env.close()
        # full capabilities: clean up whatever the test left
        lab.exec(lab.node, *cozyebpf_cmd, "detach", "--pin-dir", env.pin_dir, check=False)


def base_cmd(env: AgentLab) -> list[str]:
    """The agent's cozyebpf command without the prefix of `only(MINIMAL)`."""
    return env.cmd[len(only(MINIMAL)) :]


def run_as(env: AgentLab, caps: Sequence[str], *args: str) -> subprocess.CompletedProcess[str]:
    """A cozyebpf command in the node namespace with exactly `caps`."""
    return env.lab.exec(env.lab.node, *only(caps), *base_cmd(env), *args, check=False, timeout=60)


def run_once(env: AgentLab, caps: Sequence[str], *extra: str) -> subprocess.CompletedProcess[str]:
    """`cozyebpf run` in the foreground, for starts that must fail."""
    return run_as(
        env,
        caps,
        "run",
        "--manifests",
        str(env.manifest_path),
        "--devices",
        UPLINK,
        "--pin-dir",
        env.pin_dir,
        *extra,
    )


def dump(env: AgentLab, caps: Sequence[str]) -> dict[str, object]:
    p = run_as(env, caps, "maps", "dump", "--json", "--pin-dir", env.pin_dir)
    assert p.returncode == 0, p.stderr
    d: dict[str, object] = json.loads(p.stdout)
    return d


def attachments(d: dict[str, object]) -> dict[tuple[str, str], tuple[str, int]]:
    atts = d["attachments"]
    assert isinstance(atts, list)
    return {(a["device"], a["hook"]): (a["program"], a["prog_id"]) for a in atts}


def ping(env: AgentLab) -> bool:
    p = env.lab.exec(env.lab.client, "ping", "-c", "1", "-W", "2", LB_WHOLE, check=False)
    return p.returncode == 0


def assert_traffic_flows(env: AgentLab) -> None:
    lab = env.lab
    assert ping(env), "ping through the LB IP"
    with serve(lab, lab.pod_ns(POD1), socket.SOCK_STREAM, 4444, tcp_echo):
        answer = tcp_talk(lab, lab.client, LB_WHOLE, 4444, b"caps")
    assert answer == f"{CLIENT_IP} caps".encode()


def assert_tools_work(env: AgentLab, hook: str) -> None:
    """explain (through the program of `hook`), status and monitor with exactly MINIMAL."""
    pin = ("--pin-dir", env.pin_dir)
    if hook == "xdp":
        args = ["--from", CLIENT_IP, "--to", f"{LB_WHOLE}:22"]
        want = ("nat_ingress", POD1.ip)
    else:
        args = ["--direction", "egress", "--from", f"{POD1.ip}:22", "--to", f"{CLIENT_IP}:4000"]
        want = ("nat_egress", CLIENT_IP)
    p = run_as(env, MINIMAL, "explain", "--json", *args, *pin)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert (got["reason"], got["dst"], got["service"]) == (*want, "default/vm-caps")
    p = run_as(env, MINIMAL, "status", "--json", *pin)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["datapath"]["services"]["whole-ip"] == 1
    mon = env.lab.popen(
        env.lab.node,
        *only(MINIMAL),
        *base_cmd(env),
        "monitor",
        "--type",
        "all",
        *pin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert mon.stderr is not None
        text = "monitoring counted packets"
        assert text in read_line_with(mon.stderr, text)
        assert ping(env)
        out, err = interrupt(mon)
    finally:
        if mon.poll() is None:  # a failed assertion: no monitor outlives the test
            mon.kill()
            mon.wait()
    assert mon.returncode == 0 and "stopped; 0 events lost" in err, err
    assert f"{CLIENT_IP} -> {LB_WHOLE} default/vm-caps" in out, out


def test_the_daemonset_adds_exactly_the_minimal_set(repo_root: Path) -> None:
    for path in ("deploy/daemonset.yaml", "deploy/uninstall/uninstall.yaml"):
        (ds,) = yaml.safe_load_all((repo_root / path).read_text())
        spec = ds["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            caps = c["securityContext"]["capabilities"]
            if c["name"] == "done":  # the uninstall DaemonSet's idle container
                assert caps == {"drop": ["ALL"]}, path
                continue
            assert caps["drop"] == ["ALL"], path
            assert sorted(f"CAP_{a}" for a in caps["add"]) == sorted(MINIMAL), path


def test_the_agent_runs_with_exactly_the_minimal_set(agent: AgentLab) -> None:
    agent.start_agent()
    assert agent.proc is not None
    caps = _caps_of(agent.proc.pid)
    with open(f"/proc/{agent.proc.pid}/cmdline") as f:
        assert "cozyebpf" in f.read(), "the pid is the agent itself (capsh and bash exec'd)"
    want = _mask(MINIMAL)
    assert (caps["CapBnd"], caps["CapPrm"], caps["CapEff"]) == (want, want, want), caps
    assert caps["CapInh"] == caps["CapAmb"] == 0, caps

    agent.set_services(WHOLE)  # the maps are programmed
    assert_traffic_flows(agent)
    before = attachments(dump(agent, MINIMAL))
    assert {k: v[0] for k, v in before.items()} == {
        (UPLINK, "xdp"): "cz_ingress",
        (UPLINK, "tcx-egress"): "cz_egress",
    }

    # restart: the pinned links get the new programs in place
    links = agent.links()
    assert agent.stop_agent() == 0
    assert ping(agent), "the datapath stays while the agent is away"
    agent.start_agent()
    after = attachments(dump(agent, MINIMAL))
    assert after.keys() == before.keys()
    assert all(after[k][1] != before[k][1] for k in after), "new programs were attached"
    relinked = agent.links()
    assert relinked.keys() == links.keys() == {"xdp_uplink", "tcx-egress_uplink"}
    assert all(relinked[k][0] == links[k][0] for k in links), "the same links, updated"
    assert_traffic_flows(agent)

    # `maps dump` needs no capability at all; program names need BPF_PROG_GET_FD_BY_ID
    # (CAP_SYS_ADMIN) and fall back to "(unknown)"
    bare = attachments(dump(agent, ()))
    assert bare == {k: ("(unknown)", v[1]) for k, v in after.items()}

    # the tools run where the agent runs (kubectl exec), with its capabilities
    assert_tools_work(agent, "xdp")

    assert agent.stop_agent() == 0
    out = run_as(agent, MINIMAL, "detach", "--pin-dir", agent.pin_dir)
    assert out.returncode == 0 and "detached:" in out.stdout, out.stderr
    assert not os.path.exists(agent.pin_dir)
    assert not ping(agent), "no NAT any more"


def test_the_legacy_egress_hook_runs_with_the_minimal_set(agent: AgentLab) -> None:
    """The egress hook of kernels without tcx (< 6.6): a clsact filter, set up over rtnetlink."""
    agent.start_agent("--tc-mode", "legacy")
    agent.set_services(WHOLE)
    assert_traffic_flows(agent)  # the replies leave through the legacy filter (SNAT)
    assert_tools_work(agent, "tc-egress")
    assert agent.stop_agent() == 0
    out = run_as(agent, MINIMAL, "detach", "--pin-dir", agent.pin_dir)
    assert out.returncode == 0 and "clsact filter cz_egress" in out.stdout, out.stderr
    tc = agent.lab.exec(agent.lab.node, "tc", "filter", "show", "dev", UPLINK, "egress").stdout
    assert "cz_egress" not in tc


#: the container runtime's default seccomp profile (CRI-O's and podman's), as the chart asks
#: for it (seccompProfile: RuntimeDefault), for a container with exactly MINIMAL
RUNTIME_DEFAULT = [
    "/usr/bin/python3",
    str(Path(__file__).parents[1] / "support" / "seccomp_exec.py"),
    str(Path(__file__).parents[1] / "fixtures" / "seccomp" / "containers-common.json"),
    ",".join(MINIMAL),
    "--",
]


@pytest.fixture
def filtered(lab: Lab, tmp_path: Path, cozyebpf_cmd: list[str]) -> Iterator[AgentLab]:
    """As `agent`, every command also under the runtime's default seccomp filter."""
    if TEST_CMD:
        pytest.skip(
            "the image's entry (scripts/image-exec.sh: chroot, capsh) would run under the "
            "filter, which a runtime loads after it; the host's run covers the agent"
        )
    yield from _minimal_agent(lab, tmp_path, cozyebpf_cmd, [*only(MINIMAL), *RUNTIME_DEFAULT])


def test_the_daemonset_asks_for_the_runtimes_default_seccomp_profile(repo_root: Path) -> None:
    for path in ("deploy/daemonset.yaml", "deploy/uninstall/uninstall.yaml"):
        (ds,) = yaml.safe_load_all((repo_root / path).read_text())
        spec = ds["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            assert c["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, path


def test_the_agent_runs_under_the_runtimes_default_seccomp_profile(filtered: AgentLab) -> None:
    """The container runtime's default seccomp filter (tests/support/seccomp_exec.py) with the
    chart's capabilities: the agent (its compiler child, bcc and clang included) starts,
    attaches, programs the maps, forwards, restarts in place; the tools and `detach` work."""
    filtered.start_agent()
    assert filtered.proc is not None
    with open(f"/proc/{filtered.proc.pid}/status") as f:
        status = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    assert status["Seccomp"].strip() == "2" and status["Seccomp_filters"].strip() == "1"
    filtered.set_services(WHOLE)
    assert_traffic_flows(filtered)
    assert filtered.stop_agent() == 0
    filtered.start_agent()  # in place, under the filter too
    assert_traffic_flows(filtered)
    assert_tools_work(filtered, "xdp")
    assert filtered.stop_agent() == 0
    out = run_as(filtered, MINIMAL, "detach", "--pin-dir", filtered.pin_dir)
    assert out.returncode == 0 and "detached:" in out.stdout, out.stderr
    # the filter bites: without CAP_SYS_ADMIN the profile refuses bpf(2) itself (EPERM)
    nr = {"x86_64": 321, "aarch64": 280}[os.uname().machine]  # bpf(2)
    probe = (
        "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
        f"libc.syscall({nr}, 0, 0, 0); print(os.strerror(ctypes.get_errno()))"
    )
    no_admin = [*RUNTIME_DEFAULT[:3], "CAP_NET_ADMIN", "--"]
    p = filtered.lab.exec(
        filtered.lab.node, *no_admin, "/usr/bin/python3", "-c", probe, check=False
    )
    assert p.stdout.strip() == "Operation not permitted", (p.stdout, p.stderr)


def without(cap: str) -> list[str]:
    return [c for c in MINIMAL if c != cap]


def test_without_cap_sys_admin_the_agent_fails_at_start(agent: AgentLab) -> None:
    p = run_once(agent, without("CAP_SYS_ADMIN"))
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert agent.links() == {}, "nothing attached"
    # BPF_MAP_CREATE needs CAP_BPF or CAP_SYS_ADMIN (or a future message naming them)
    assert "create map cz_" in out or "CAP_SYS_ADMIN" in out, out
    assert "Operation not permitted" in out, out


def test_cap_bpf_and_cap_perfmon_do_not_replace_cap_sys_admin(agent: AgentLab) -> None:
    """The capabilities made for BPF are not enough: bcc opens the pinned maps by id."""
    p = run_once(agent, [*without("CAP_SYS_ADMIN"), "CAP_BPF", "CAP_PERFMON"])
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert agent.links() == {}, "nothing attached"
    # bcc opens the pinned maps with BPF_MAP_GET_FD_BY_ID: we check first and say so
    assert "loading the programs needs CAP_SYS_ADMIN (bcc opens the pinned maps by id)" in out, out


def test_without_cap_net_admin_the_agent_fails_at_start(agent: AgentLab) -> None:
    """The check for cozy-proxy's nftables table (and clsact, where there is no tcx) needs it:
    the agent stops at once and names the capability."""
    p = run_once(agent, without("CAP_NET_ADMIN"), "--tc-mode", "legacy")
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert agent.links() == {}, "nothing attached"
    assert "Operation not permitted" in out and "needs CAP_NET_ADMIN" in out, out


def test_without_cap_net_admin_the_cozy_proxy_table_check_fails_loudly(agent: AgentLab) -> None:
    lab = agent.lab
    lab.exec(lab.node, "nft", "add", "table", "ip", "cozy_proxy")
    log = agent.log_path.open("w")
    proc = lab.popen(
        lab.node,
        *only(without("CAP_NET_ADMIN")),
        *base_cmd(agent),
        "run",
        "--manifests",
        str(agent.manifest_path),
        "--devices",
        UPLINK,
        "--pin-dir",
        agent.pin_dir,
        "--remove-cozy-proxy-table",
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(
            lambda: proc.poll() is not None or "datapath ready" in agent.log(),
            30,
            "the agent to fail or attach",
        )
        table = lab.exec(lab.node, "nft", "list", "table", "ip", "cozy_proxy", check=False)
        out = agent.log()
        assert table.returncode == 0, "the table cannot have gone without CAP_NET_ADMIN"
        assert proc.poll() not in (None, 0), f"the agent went on although the table stays:\n{out}"
        assert "cozy_proxy" in out and "Operation not permitted" in out, out
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(20)
        lab.exec(lab.node, "nft", "delete", "table", "ip", "cozy_proxy", check=False)
