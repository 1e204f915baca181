"""Compile and load the programs in a short-lived child process.

bcc compiles with an in-process LLVM that stays mapped (and much of it resident) for the life
of the process: about 200 MB for a compilation that takes seconds once. The agent therefore
never imports bcc. It runs this module as a child, which compiles bpf/cozyebpf.c against the
pinned maps (`loader.compile_source`), loads each requested program (the verifier runs here) and
passes the program file descriptors back over a Unix socket (SCM_RIGHTS), then exits; the agent
keeps only the descriptors and works with bpf(2) alone.

    python -P -c BOOTSTRAP PACKAGE_ROOT --pin-dir DIR --socket-fd N PROGRAM:TYPE:COPIES ...

The child imports the agent's own package and nothing from its working directory: `-P` keeps
the working directory off sys.path (which `python -m` would put first, so that a `cozyebpf/`
lying there would run with CAP_SYS_ADMIN), and BOOTSTRAP puts PACKAGE_ROOT, the directory the
agent's `cozyebpf` came from, first instead (`child_command`).

A program is loaded COPIES times (instances with their own ids): tcx refuses one program
twice on a hook, and putting our program back in front of the tcx chain needs a second one.
The reply is one message: a JSON header ({"programs": [[name, type], ...]} with one entry per
passed descriptor, or {"error": message}) and the descriptors.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from cozyebpf.errors import CozyError, DatapathError

MAX_MESSAGE = 1 << 16


@dataclass(frozen=True)
class Request:
    """One program to load: its function name, its type ("xdp" or "sched_cls") and how many
    instances."""

    name: str
    prog_type: str
    copies: int = 1

    def __str__(self) -> str:
        return f"{self.name}:{self.prog_type}:{self.copies}"

    @classmethod
    def parse(cls, text: str) -> Request:
        name, prog_type, copies = text.split(":")
        return cls(name, prog_type, int(copies))


def _child(pin_dir: str, requests: Sequence[Request], sock: socket.socket) -> int:
    from cozyebpf.datapath import loader

    fds: list[int] = []
    names: list[list[str]] = []
    try:
        module = loader.compile_source("cozyebpf.c", pin_dir)
        for r in requests:
            prog = loader.load_from(module, r.name, r.prog_type)
            fds.append(prog.fd)
            names.append([r.name, r.prog_type])
            for _ in range(r.copies - 1):
                prog = prog.load_again()
                fds.append(prog.fd)
                names.append([r.name, r.prog_type])
    except CozyError as e:
        socket.send_fds(sock, [json.dumps({"error": str(e)}).encode()], [])
        return 1
    socket.send_fds(sock, [json.dumps({"programs": names}).encode()], fds)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cozyebpf.datapath.compiler")
    ap.add_argument("--pin-dir", required=True)
    ap.add_argument("--socket-fd", type=int, required=True)
    ap.add_argument("programs", nargs="+", type=Request.parse)
    args = ap.parse_args(argv)
    # the agent stops us when it stops; a terminal's Ctrl-C is the agent's to handle
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with socket.socket(fileno=args.socket_fd) as sock:
        return _child(args.pin_dir, args.programs, sock)


#: the child's entry: the agent's package root (argv[1]) first on sys.path, unless -P's path
#: (the standard library, site-packages) holds it already; then main()
BOOTSTRAP = (
    "import sys; root = sys.argv.pop(1); "
    "sys.path.insert(0, root) if root not in sys.path else None; "
    "from cozyebpf.datapath.compiler import main; sys.exit(main())"
)


def package_root() -> str:
    """The directory holding the `cozyebpf` package this process runs (site-packages, or a
    source checkout)."""
    # cozyebpf/datapath/compiler.py: three levels below the root
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_command(pin_dir: str, socket_fd: int, requests: Sequence[Request]) -> list[str]:
    """The compiler child's command line: this Python, isolated from the working directory
    (-P), running this process's own cozyebpf (`BOOTSTRAP`)."""
    return [
        sys.executable,
        "-P",
        "-c",
        BOOTSTRAP,
        package_root(),
        "--pin-dir",
        pin_dir,
        "--socket-fd",
        str(socket_fd),
        *map(str, requests),
    ]


class Compilation:
    """A running child compilation; `result()` waits for the loaded programs."""

    def __init__(self, pin_dir: str, requests: Sequence[Request]) -> None:
        self.requests = list(requests)
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = parent
        cmd = child_command(pin_dir, child.fileno(), self.requests)
        try:
            self.proc = subprocess.Popen(cmd, pass_fds=[child.fileno()], env=os.environ.copy())
        finally:
            child.close()

    def fileno(self) -> int:
        """Readable once the child answered (or died): for select()."""
        return self._sock.fileno()

    def done(self) -> bool:
        import select

        return bool(select.select([self._sock], [], [], 0)[0])

    def result(self) -> list[tuple[str, str, int]]:
        """(name, type, fd) per loaded instance, in the order requested. Raises DatapathError
        with the child's message (the compiler's own output went to stderr)."""
        try:
            msg, fds, _flags, _addr = socket.recv_fds(self._sock, MAX_MESSAGE, 64)
        finally:
            self._sock.close()
        code = self.proc.wait()
        if not msg:
            raise DatapathError(
                f"the compiler process exited ({code}) without an answer; its output is above"
            )
        header = json.loads(msg)
        if "error" in header:
            for fd in fds:
                os.close(fd)
            raise DatapathError(header["error"])
        names = header["programs"]
        if len(names) != len(fds):
            for fd in fds:
                os.close(fd)
            raise DatapathError(f"the compiler passed {len(fds)} programs for {len(names)} names")
        return [(n, t, fd) for (n, t), fd in zip(names, fds, strict=True)]

    def cancel(self) -> None:
        """Stop the child (the agent is stopping)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._sock.close()


if __name__ == "__main__":
    sys.exit(main())
