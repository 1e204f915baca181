"""The demo (`scripts/demo.sh`): a namespace lab, `cozyebpf run` on examples/services.yaml,
traffic through the LB IPs, `cozyebpf maps dump`, then everything torn down.

Everything happens inside namespaces it creates (client, node, pod1..3); nothing is attached
to the machine's own interfaces and no packet leaves the lab.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import click

from cozylab.netns import CLIENT_IP, DEFAULT_PODS, UPLINK, Lab

PIN_DIR = "/sys/fs/bpf/cozyebpf-demo"
LB_WHOLE, LB_FILT = "203.0.113.10", "203.0.113.20"
POD1, POD2 = DEFAULT_PODS[0], DEFAULT_PODS[1]


def step(title: str) -> None:
    click.secho(f"\n==> {title}", bold=True)


def show(lab: Lab, ns: str, *cmd: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    where = ns.split("-", 1)[1]
    click.secho(f"[{where}]$ {' '.join(cmd)}", fg="cyan")
    p = lab.exec(ns, *cmd, check=False, timeout=20)
    out = (p.stdout + p.stderr).rstrip()
    if out:
        click.echo(out)
    if ok and p.returncode != 0:
        raise click.ClickException(f"expected success: {' '.join(cmd)} (exit {p.returncode})")
    if not ok and p.returncode == 0:
        raise click.ClickException(f"expected failure: {' '.join(cmd)}")
    return p


@contextlib.contextmanager
def http_server(lab: Lab, pod_ns: str, port: int, text: str) -> Iterator[None]:
    with tempfile.TemporaryDirectory() as d:
        Path(d, "index.html").write_text(text)
        srv = lab.popen(
            pod_ns,
            sys.executable,
            "-m",
            "http.server",
            str(port),
            "--directory",
            d,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            for _ in range(50):  # until it listens
                if lab.exec(pod_ns, "ss", "-ltn", f"sport = :{port}", check=False).stdout.count(
                    "LISTEN"
                ):
                    break
                time.sleep(0.1)
            yield
        finally:
            srv.send_signal(signal.SIGTERM)
            srv.wait(5)


def who_connects(lab: Lab, port: int) -> tuple[socket.socket, list[str]]:
    """A TCP server in the client namespace that records the source address it sees."""
    seen: list[str] = []
    s = lab.ns_socket(lab.client, socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((CLIENT_IP, port))
    s.listen(1)

    def accept() -> None:
        with contextlib.suppress(OSError):
            conn, peer = s.accept()
            seen.append(peer[0])
            conn.close()

    threading.Thread(target=accept, daemon=True).start()
    return s, seen


def start_agent(lab: Lab, cli: list[str], services: Path, log: IO[str]) -> subprocess.Popen[str]:
    """`cozyebpf run` on the node, logging to `log`; returns once it programmed the maps and
    attached (its log shown), or raises with its log."""
    agent = lab.popen(
        lab.node,
        *cli,
        "run",
        "--manifests",
        str(services),
        "--devices",
        UPLINK,
        "--pin-dir",
        PIN_DIR,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    # the maps are filled while the programs compile (tens of seconds on a loaded
    # machine): wait for both, as long as the tests give an agent to start
    ready = False
    for _ in range(1200):
        text = Path(log.name).read_text()
        ready = "programmed:" in text and "datapath ready" in text
        if ready or agent.poll() is not None:
            break
        time.sleep(0.1)
    click.echo(Path(log.name).read_text().rstrip())
    if agent.poll() is not None:
        raise click.ClickException("the agent stopped; see its log above")
    if not ready:
        raise click.ClickException(
            "the agent did not program the maps and attach its programs within 120 s; "
            "see its log above (a busy machine compiles slowly: run the demo again)"
        )
    return agent


def show_whole_ip(lab: Lab) -> None:
    step("whole-IP (vm-whole): every port of the LB IP reaches pod1")
    show(lab, lab.client, "ping", "-c", "2", "-W", "2", LB_WHOLE)
    with http_server(
        lab, lab.pod_ns(POD1), 8080, "hello from pod1 (port 8080 is not in spec.ports)\n"
    ):
        show(lab, lab.client, "curl", "-sS", "-m", "3", f"http://{LB_WHOLE}:8080/")


def show_port_filter(lab: Lab) -> None:
    step("port filter (vm-filtered): only spec.ports (tcp/80) and, with allowICMP, ping")
    with (
        http_server(lab, lab.pod_ns(POD2), 80, "hello from pod2 on a listed port\n"),
        http_server(lab, lab.pod_ns(POD2), 8081, "you should not see this\n"),
    ):
        show(lab, lab.client, "curl", "-sS", "-m", "3", f"http://{LB_FILT}:80/")
        show(lab, lab.client, "curl", "-sS", "-m", "2", f"http://{LB_FILT}:8081/", ok=False)
    show(lab, lab.client, "ping", "-c", "1", "-W", "2", LB_FILT)


def show_egress(lab: Lab) -> None:
    step("egress: the pods' own connections leave with the LB IP as source")
    for pod, port in ((POD1, 7001), (POD2, 7002)):
        srv, seen = who_connects(lab, port)
        show(lab, lab.pod_ns(pod), "nc", "-z", "-w", "2", CLIENT_IP, str(port))
        time.sleep(0.2)
        srv.close()
        click.secho(
            f"client saw a connection from {seen[0] if seen else 'nobody'} "
            f"({pod.name} is {pod.ip})",
            fg="green",
        )


@click.command()
@click.option(
    "--manifests",
    type=click.Path(exists=True, dir_okay=False),
    default=str(Path(__file__).resolve().parent.parent / "examples" / "services.yaml"),
    show_default=True,
)
@click.option(
    "--cozyebpf-cmd",
    default=shlex.join([sys.executable, "-m", "cozyebpf"]),
    show_default="this Python's `-m cozyebpf`",
    help="The cozyebpf command (shell words) for run, maps dump and detach; the tests pass "
    "theirs (from the image under `make image-test`).",
)
def main(manifests: str, cozyebpf_cmd: str) -> None:
    """Run cozyebpf in a namespace lab and show what it does."""
    if os.geteuid() != 0:
        raise click.ClickException("the demo needs root (it makes namespaces and loads BPF)")
    cli = shlex.split(cozyebpf_cmd)
    lab = Lab("czdemo")
    agent: subprocess.Popen[str] | None = None
    with (
        tempfile.TemporaryDirectory(prefix="cozyebpf-demo-") as tmp,
        Path(tmp, "agent.log").open("w+") as log,
    ):
        # the agent reads a copy in /tmp: a cozyebpf command in a container (the image under
        # `make image-test`) sees the host's /tmp but not the repository
        shutil.copyfile(manifests, Path(tmp, "services.yaml"))
        try:
            step("building the lab: client -- node (uplink) -- pod1, pod2, pod3")
            lab.up()
            click.echo(
                f"client {CLIENT_IP}; pod1 {POD1.ip}; pod2 {POD2.ip}; LB IPs {LB_WHOLE}, {LB_FILT}"
            )
            step(f"starting `cozyebpf run --manifests {manifests} --devices {UPLINK}` on the node")
            agent = start_agent(lab, cli, Path(tmp, "services.yaml"), log)
            show_whole_ip(lab)
            show_port_filter(lab)
            show_egress(lab)
            step("cozyebpf maps dump (read from the pins by another process)")
            show(lab, lab.node, *cli, "maps", "dump", "--pin-dir", PIN_DIR)
        finally:
            step("tearing down")
            if agent is not None and agent.poll() is None:
                agent.send_signal(signal.SIGTERM)
                agent.wait(20)
            subprocess.run(
                [*lab.nsenter(lab.node), *cli, "detach", "--pin-dir", PIN_DIR], capture_output=True
            )
            lab.down()
            click.echo("lab removed, datapath detached")


if __name__ == "__main__":
    main()
