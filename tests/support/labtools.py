"""The namespace lab with a real `cozyebpf run` agent on the node, driven by a manifest file."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from cozyebpf.datapath import attach, bpfsys
from cozyebpf.datapath.maps import PinnedMaps
from cozyebpf.state import MapState
from cozylab.k8s import Svc, manifest
from cozylab.netns import DEFAULT_PODS, UPLINK, Lab, Pod, capture, drain, wait_for
from tests.support.env import hang_bound

T = TypeVar("T")


@dataclass
class AgentLab:
    lab: Lab
    pin_dir: str
    manifest_path: Path
    log_path: Path
    cmd: list[str]
    proc: subprocess.Popen[str] | None = None
    #: where the agent takes Services from; default: --manifests <manifest_path>
    source_args: list[str] | None = None
    #: extra environment for the agent (e.g. COZYEBPF_BPF_DIR for an upgrade)
    env: dict[str, str] = field(default_factory=dict)
    #: the agent's working directory (None: the tests')
    cwd: str | None = None
    #: a command prefix the agent runs under (e.g. cozylab.cluster.agents.in_cluster_wrapper)
    wrapper: list[str] = field(default_factory=list)
    _sockets: list[socket.socket] = field(default_factory=list)

    # -- agent ---------------------------------------------------------------------------

    def start_agent(self, *extra: str) -> None:
        self.start_agent_on(UPLINK, *extra)

    def start_agent_on(self, devices: str, *extra: str) -> None:
        offset = len(self.log())
        log = self.log_path.open("a")
        self.proc = self.lab.popen(
            self.lab.node,
            *self.wrapper,
            *self.cmd,
            "run",
            *(self.source_args or ["--manifests", str(self.manifest_path)]),
            "--devices",
            devices,
            "--pin-dir",
            self.pin_dir,
            "--poll-interval",
            "0.1",
            "--log-level",
            "debug",
            *extra,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            cwd=self.cwd,
        )
        wait_for(  # a bound for a hang, not an expectation: a loaded machine compiles slowly
            lambda: "datapath ready" in self.log()[offset:] or self.proc_exited(),
            hang_bound(120),
            "the agent to attach",
        )
        assert not self.proc_exited(), self.log()[offset:]

    def proc_exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def stop_agent(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=20)
        self.proc = None
        return rc

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def maps_state(self) -> MapState:
        with PinnedMaps.open(self.pin_dir) as m:
            return m.read_state()

    def links(self) -> dict[str, tuple[int, int]]:
        """The pinned bpf_links (<pin dir>/links/<hook>_<device>): name -> (link id, program
        id). A link replaced in place keeps its id and gets a new program."""
        out = {}
        d = attach.links_dir(self.pin_dir)
        for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
            fd = bpfsys.obj_get(os.path.join(d, name))
            try:
                info = bpfsys.link_info(fd)
            finally:
                os.close(fd)
            out[name] = (info.id, info.prog_id)
        return out

    def map_ids(self) -> dict[str, int]:
        """The maps pinned in the pin dir: name -> map id (adopted maps keep theirs)."""
        out = {}
        for entry in sorted(os.scandir(self.pin_dir), key=lambda e: e.name):
            if entry.is_file():
                fd = bpfsys.obj_get(entry.path)
                try:
                    out[entry.name] = bpfsys.map_info(fd).id
                finally:
                    os.close(fd)
        return out

    def agent_status(self, address: str) -> dict[str, Any]:
        """The agent's /status (its --health-address, in the node namespace): syncs, sync
        errors, problems, ..."""
        import json

        p = self.lab.exec(self.lab.node, "curl", "-sf", f"http://{address}/status")
        return json.loads(p.stdout)  # type: ignore[no-any-return]

    def layout_version(self) -> int:
        """The map layout version the pin dir's `meta` map records."""
        import ctypes

        from cozyebpf.datapath import layout

        fd = bpfsys.obj_get(os.path.join(self.pin_dir, layout.META.name))
        try:
            val = layout.MetaVal()
            assert bpfsys.map_lookup(fd, ctypes.c_uint32(0), val), "meta holds no version"
            return int(val.layout_version)
        finally:
            os.close(fd)

    def counters(self) -> dict[str, int]:
        with PinnedMaps.open(self.pin_dir) as m:
            return {k: v["packets"] for k, v in m.counters().items()}

    def set_services(self, *svcs: Svc, expect: Sequence[Svc] | None = None) -> None:
        """Write the manifest (atomically, as editors and ConfigMap mounts do) and wait until
        the maps hold exactly the LB IPs of `expect` (default: all `svcs`) with their modes."""
        expected = svcs if expect is None else expect
        tmp = self.manifest_path.with_suffix(".tmp")
        tmp.write_text(manifest(*svcs))
        os.replace(tmp, self.manifest_path)

        want = {
            lb: (pod, s.whole_ip != "true", s.allow_icmp == "true")
            for s in expected
            for lb, pod in ((s.lb_ip, s.pod_ip), (s.lb_ip6, s.pod_ip6))
            if lb and pod
        }

        def programmed() -> bool:
            have = {
                str(lb): (str(e.pod_ip), e.port_filter, e.allow_icmp)
                for lb, e in self.maps_state().services.items()
            }
            if have != want:
                raise AssertionError(f"maps hold {have}, want {want}")
            return True

        wait_for(programmed, 10, lambda: f"the maps; agent log:\n{self.log()[-3000:]}")

    # -- traffic -------------------------------------------------------------------------

    def packet_socket(self, ns: str, dev: str) -> socket.socket:
        s = self.lab.packet_socket(ns, dev)
        self._sockets.append(s)
        return s

    def send_and_capture(
        self, frame: bytes, pod: Pod, match: Callable[[bytes], bool], timeout: float = 1.0
    ) -> list[bytes]:
        """Send `frame` from the client's eth0; return the frames at `pod`'s eth0 that match."""
        tx = self.packet_socket(self.lab.client, "eth0")
        rx = self.packet_socket(self.lab.pod_ns(pod), "eth0")
        drain(rx)
        tx.send(frame)
        return [f for f in capture(rx, timeout) if match(f)]

    def close(self) -> None:
        for s in self._sockets:
            s.close()
        self._sockets.clear()

    def teardown(self) -> None:
        """Stop the agent (SIGKILL if it still runs), detach the datapath, remove the lab."""
        if self.proc:
            self.stop_agent(signal.SIGKILL)
        self.close()
        subprocess.run(
            [*self.lab.nsenter(self.lab.node), *self.cmd, "detach", "--pin-dir", self.pin_dir],
            capture_output=True,
        )
        self.lab.down()


def load_programs(pin: str) -> dict[str, Any]:
    """The three programs of the datapath loaded with the maps pinned in `pin` (not attached):
    "xdp", "tc" (tc ingress) and "egress", for BPF_PROG_RUN."""
    from cozyebpf.datapath import loader

    return {
        "xdp": loader.load("ingress.c", "cz_ingress", "xdp", pin),
        "tc": loader.load("ingress_tc.c", "cz_ingress_tc", "sched_cls", pin),
        "egress": loader.load("egress.c", "cz_egress", "sched_cls", pin),
    }


def read_line_with(stream: Any, text: str, lines: int = 5) -> str:
    """The first of a process's next `lines` output lines that contains `text` (lines before it,
    such as the image entrypoint's log, are skipped), or all of them when none does."""
    seen = []
    for _ in range(lines):
        line = stream.readline()
        if text in line or not line:
            return str(line)
        seen.append(line)
    return "".join(seen)


def interrupt(proc: subprocess.Popen[Any], timeout: float = 10) -> tuple[Any, Any]:
    """SIGINT to a process and its output once it ended; killed if it does not end in time
    (the timeout is raised then), so that no process outlives a failed test."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise


@contextlib.contextmanager
def agent_lab(
    tag: str,
    tmp: Path,
    cmd: list[str],
    pods: Sequence[Pod] = DEFAULT_PODS,
    manifest_text: str = "",
    **kw: Any,
) -> Iterator[AgentLab]:
    """A lab with its own namespaces and pin dir, and an AgentLab to drive the agent in it;
    everything is removed afterwards, also when the test fails."""
    from tests.support.env import unique_prefix

    lab = Lab(unique_prefix(tag), pods=pods).up()
    env = AgentLab(
        lab, f"/sys/fs/bpf/{lab.prefix}", tmp / "services.yaml", tmp / "agent.log", cmd, **kw
    )
    env.manifest_path.write_text(manifest_text)
    try:
        yield env
    finally:
        env.teardown()


@contextlib.contextmanager
def serve(
    lab: Lab,
    ns: str,
    kind: int,
    port: int,
    handler: Callable[[socket.socket], None],
    family: int = socket.AF_INET,
) -> Iterator[socket.socket]:
    """A TCP or UDP server socket in `ns` on the any-address:port, handled in a thread."""
    s = lab.ns_socket(ns, family, kind)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
    if kind == socket.SOCK_STREAM:
        s.listen(8)
    stop = threading.Event()

    def loop() -> None:
        s.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                handler(s)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield s
    finally:
        stop.set()
        t.join(2)
        s.close()


def tcp_echo(s: socket.socket) -> None:
    """Accept one connection; answer "<peer ip> <data>"."""
    conn, peer = s.accept()
    with conn:
        conn.settimeout(2)
        data = conn.recv(1024)
        conn.sendall(f"{peer[0]} ".encode() + data)


def udp_echo(s: socket.socket) -> None:
    data, peer = s.recvfrom(2048)
    s.sendto(f"{peer[0]} ".encode() + data, peer)


def tcp_talk(lab: Lab, ns: str, addr: str, port: int, data: bytes, timeout: float = 3) -> bytes:
    """Connect from `ns` to addr:port, send `data`, return the answer (raises on timeout)."""
    with lab.ns_socket(ns, socket.AF_INET, socket.SOCK_STREAM) as c:
        c.settimeout(timeout)
        c.connect((addr, port))
        c.sendall(data)
        return c.recv(1024)


def udp_talk(
    lab: Lab, ns: str, addr: str, port: int, data: bytes, timeout: float = 3
) -> tuple[bytes, tuple[str, int]]:
    """Send one datagram from `ns`; return the answer and the address it came from."""
    with lab.ns_socket(ns, socket.AF_INET, socket.SOCK_DGRAM) as c:
        c.settimeout(timeout)
        c.sendto(data, (addr, port))
        answer, peer = c.recvfrom(2048)
        return answer, peer


def mark_pins(pin_dir: str, version: int, oldest: int, release: str = "0.3.0") -> None:
    """Make the pins say that release `release`, with layout `version`, wrote them, and that
    layout `oldest` or newer can run on them (0: not recorded): the maps of another release,
    played by this one's (its agent stopped)."""
    import ctypes

    from cozyebpf.datapath.layout import MetaVal
    from cozyebpf.datapath.pins import release_parts

    major, minor, patch = release_parts(release)
    fd = bpfsys.obj_get(f"{pin_dir}/meta")
    try:
        val = MetaVal(
            layout_version=version,
            oldest_compatible=oldest,
            release_major=major,
            release_minor=minor,
            release_patch=patch,
        )
        bpfsys.map_update(fd, ctypes.c_uint32(0), val)
    finally:
        os.close(fd)


def dry_run_witness(m: PinnedMaps) -> tuple[Any, ...]:
    """Everything a dry run (explain's) must leave as it is: the counters, node-wide and per
    Service, the flows, the fragments' count and the monitor's state."""
    return (
        m.counters(),
        [c.__dict__ for c in m.service_counters()],
        m.flows(),
        m.entries()["frag4"],
        m.monitor_state(),
    )
