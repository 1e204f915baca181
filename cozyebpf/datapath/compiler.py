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

What the compiler and the verifier print (the child's stderr) goes to the agent's stderr line by
line (`forward_output`), but for clang's "loop not unrolled" warnings (`UNROLL_WARNING`: there
were five at every start, from a `#pragma unroll` of bpf/lib/flow.h that could not apply; the
pragma is gone, this keeps any that come back out of the log): they are counted in one DEBUG
line of the agent's log instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

from cozyebpf.errors import CozyError, DatapathError

log = logging.getLogger(__name__)

MAX_MESSAGE = 1 << 16
#: clang's warning that a loop under `#pragma unroll` stayed a loop, as bcc prints it
#: ("warning: FILE:LINE:COL: loop not unrolled: the optimizer was unable to perform the
#: requested transformation; ..."): that exact warning class, nothing else
UNROLL_WARNING = re.compile(rb"^warning: (\S+:\d+:\d+): loop not unrolled: ")


def forward_output(stream: IO[bytes], out_fd: int = 2) -> int:
    """Copy the compiler child's stderr to `out_fd` line by line until it closes, leaving out
    `UNROLL_WARNING` lines (one DEBUG record says how many and where); how many it left out.
    Reads to the end even when `out_fd` fails, so that the child never blocks on a full
    pipe."""
    left_out: dict[str, int] = {}
    writable = True
    for line in iter(stream.readline, b""):
        m = UNROLL_WARNING.match(line)
        if m:
            where = m.group(1).decode(errors="replace")
            left_out[where] = left_out.get(where, 0) + 1
            continue
        while writable and line:
            try:
                line = line[os.write(out_fd, line) :]
            except OSError:
                writable = False
    stream.close()
    if left_out:
        log.debug(
            "compiler: %d 'loop not unrolled' warning(s) left out (%s): a `#pragma unroll` "
            "loop stayed a loop, which the verifier takes as a bounded loop",
            sum(left_out.values()),
            ", ".join(f"{where} x{n}" for where, n in sorted(left_out.items())),
        )
    return sum(left_out.values())


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
            self.proc = subprocess.Popen(
                cmd, pass_fds=[child.fileno()], env=os.environ.copy(), stderr=subprocess.PIPE
            )
        finally:
            child.close()
        assert self.proc.stderr is not None
        self._output = threading.Thread(
            target=forward_output, args=(self.proc.stderr,), name="compiler-output", daemon=True
        )
        self._output.start()

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
        self._output.join(10)  # its output (the verifier's log) is out before our error
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
        self._output.join(10)
        self._sock.close()


if __name__ == "__main__":
    sys.exit(main())
