"""Open vSwitch and OVN's daemons and databases of the real-OVN lab: started per chassis and
centrally, each a child with a pidfile, stopped by its pid (also a killed run's leftovers)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from cozylab.cluster.spec import (
    node_ip,
    node_name,
)
from cozylab.netns import run, wait_for
from cozylab.realovn.spec import OVN_SCHEMAS, OVS_SCHEMA


@dataclasses.dataclass
class Daemon:
    name: str
    proc: subprocess.Popen[str]
    pidfile: Path


class Ovn:
    """The OVS and OVN daemons of the lab, each a child of this process with a pidfile under
    `root` (one directory per node, `central` for NB, SB and northd), and their clients."""

    def __init__(
        self, root: Path, nsenter: Callable[[str], list[str]], logdir: Path | None = None
    ) -> None:
        self.root = root
        #: the daemons' logs (kept after the run; `root`, with the sockets, is removed)
        self.logdir = logdir or root
        self.nsenter = nsenter
        self.daemons: list[Daemon] = []
        self.central = root / "central"
        self.nb = f"unix:{self.central / 'nb.sock'}"
        self.sb = f"unix:{self.central / 'sb.sock'}"

    @staticmethod
    def stop_leftovers(root: Path) -> list[str]:
        """Stop the daemons of an earlier run that used `root` (its pidfiles; a pid counts
        only while its command line still names `root`), remove `root`. Returns what it
        stopped."""
        stopped = []
        for pidfile in sorted(root.glob("*/*.pid")) if root.is_dir() else []:
            with contextlib.suppress(ValueError, OSError):
                pid = int(pidfile.read_text().split()[0])
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                if str(root).encode() in cmdline:
                    os.kill(pid, signal.SIGTERM)
                    stopped.append(f"{pidfile.name}:{pid}")
                    with contextlib.suppress(TimeoutError):
                        wait_for(lambda pid=pid: _gone(pid), 5, f"pid {pid} to exit")  # type: ignore[misc]
                    if not _gone(pid):
                        os.kill(pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)
        return stopped

    def start(self, name: str, ns: str | None, argv: Sequence[str], **env: str) -> Daemon:
        """A daemon in the foreground, as a child (its pidfile `<dir>/<name>.pid`, its log
        `<dir>/<name>.log`), killed with this process's thread if that dies (setpriv)."""
        rundir = Path(env.get("OVS_RUNDIR") or self.central)
        pidfile = rundir / f"{name}.pid"
        logs = self.logdir / rundir.name
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / f"{name}.log"
        cmd = [
            *(self.nsenter(ns) if ns else []),
            *(["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []),
            *argv,
            "--no-chdir",
            f"--pidfile={pidfile}",
            f"--log-file={log}",
        ]
        with (logs / f"{name}.out").open("a") as out:
            proc = subprocess.Popen(
                cmd,
                text=True,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
            )
        daemon = Daemon(name, proc, pidfile)
        self.daemons.append(daemon)

        def started() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited ({proc.returncode}) at start: {' '.join(cmd)}\n"
                    + _tail(log)
                    + _tail(logs / f"{name}.out")
                )
            return pidfile.exists()

        wait_for(started, 15, f"{name} to write {pidfile}")
        return daemon

    def stop(self) -> None:
        """Every daemon by its pid, last started first (controllers before databases)."""
        for d in reversed(self.daemons):
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGTERM)
                try:
                    d.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    d.proc.kill()
                    d.proc.wait()
        self.daemons.clear()

    # -- central --------------------------------------------------------------------------

    def start_central(self) -> None:
        self.central.mkdir(parents=True, exist_ok=True)
        for db in ("nb", "sb"):
            path = self.central / f"{db}.db"
            run("ovsdb-tool", "create", str(path), str(OVN_SCHEMAS[db]))
            self.start(
                f"{db}db",
                None,
                [
                    "ovsdb-server",
                    str(path),
                    f"--remote=punix:{self.central / f'{db}.sock'}",
                    f"--unixctl={self.central / f'{db}.ctl'}",
                ],
            )
        for db in ("nb", "sb"):
            wait_for(lambda db=db: (self.central / f"{db}.sock").exists(), 10, f"the {db} socket")  # type: ignore[misc]
        self.start(
            "northd",
            None,
            [
                "ovn-northd",
                f"--ovnnb-db={self.nb}",
                f"--ovnsb-db={self.sb}",
                f"--unixctl={self.central / 'northd.ctl'}",
            ],
            OVN_RUNDIR=str(self.central),
        )

    def nbctl(self, *args: str) -> str:
        return run("ovn-nbctl", f"--db={self.nb}", "--timeout=20", *args).stdout.strip()

    def sbctl(self, *args: str) -> str:
        return run("ovn-sbctl", f"--db={self.sb}", "--timeout=20", *args).stdout.strip()

    # -- a chassis --------------------------------------------------------------------------

    def node_dir(self, n: int) -> Path:
        return self.root / node_name(n)

    def vsctl(self, n: int, *args: str) -> str:
        db = f"unix:{self.node_dir(n) / 'db.sock'}"
        return run("ovs-vsctl", f"--db={db}", "--timeout=20", *args).stdout.strip()

    def start_vswitch(self, n: int, ns: str) -> None:
        """ovsdb-server and ovs-vswitchd of node n, in its namespace, with their own run
        directory (trap 2)."""
        d = self.node_dir(n)
        d.mkdir(parents=True, exist_ok=True)
        run("ovsdb-tool", "create", str(d / "conf.db"), str(OVS_SCHEMA))
        env = {"OVS_RUNDIR": str(d), "OVS_DBDIR": str(d), "OVN_RUNDIR": str(d)}
        self.start(
            "ovsdb",
            ns,
            [
                "ovsdb-server",
                str(d / "conf.db"),
                f"--remote=punix:{d / 'db.sock'}",
                f"--unixctl={d / 'ovsdb.ctl'}",
            ],
            **env,
        )
        wait_for(lambda: (d / "db.sock").exists(), 10, f"{node_name(n)}'s db socket")
        self.vsctl(n, "--no-wait", "init")
        self.start(
            "vswitchd",
            ns,
            ["ovs-vswitchd", f"unix:{d / 'db.sock'}", f"--unixctl={d / 'vswitchd.ctl'}"],
            **env,
        )

    def start_controller(self, n: int, ns: str) -> None:
        """start-ovs.sh: a random system-id, hostname = the node's name (requested-chassis
        names it), geneve, the node's address as the tunnel endpoint; then ovn-controller."""
        d = self.node_dir(n)
        self.vsctl(
            n,
            "set",
            "open",
            ".",
            f"external_ids:system-id={uuid.uuid4()}",
            f"external_ids:hostname={node_name(n)}",
            f"external_ids:ovn-remote={self.sb}",
            "external_ids:ovn-encap-type=geneve",
            f"external_ids:ovn-encap-ip={node_ip(n)}",
            "external_ids:ovn-bridge-datapath-type=netdev",
        )
        env = {"OVS_RUNDIR": str(d), "OVN_RUNDIR": str(d)}
        self.start("ovn-controller", ns, ["ovn-controller", f"unix:{d / 'db.sock'}"], **env)


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _tail(path: Path, chars: int = 1500) -> str:
    with contextlib.suppress(OSError):
        return path.read_text()[-chars:]
    return ""
