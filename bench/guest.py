"""`python -m bench.guest [--kernel 6.12] [--timeout S] -- [bench's arguments]`: the bench in a
kernel-matrix guest (cozylab/kmatrix.py: a Debian kernel booted under qemu, the checkout shared
read-only), for what this machine's kernel lacks: sch_fq, which the limits part's
egress-shaped rows need (this VM's 6.18 is built without CONFIG_NET_SCH_FQ and without
modules; Debian's 6.1 and 6.12 have it as a module).

    python -m bench.guest -- --quick --only limits --limits-accuracy-only

The guest runs `python -m bench` with the arguments after `--`, compiled against the image's
headers as kmatrix's first phase is; its results JSON is copied to
bench/results/guest-<release>-<started>.json and its table printed here.

What a guest measures and what not: its CPUs are emulated (TCG, 15-20 times slower than this
machine; KVM hangs nested guests here), so rates that the emulated path cannot carry are "not
reachable" there, and its timing is the emulator's: a guest's figures say what shaping does to
TCP's goodput, retransmissions and drops at the limits the guest reaches, not what a node
carries. The emulator's two threads take this machine's two CPUs while it runs.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import BENCH, RESULTS, log
from cozylab import kmatrix


def run_script(kernel: kmatrix.Kernel, repo: Path, args: list[str]) -> str:
    """The guest's /results/run.sh: the image's headers linked, then `python -m bench`."""
    py = shlex.quote(str(repo / ".venv" / "bin" / "python"))
    hdr = kernel.fallback
    return "\n".join(
        [
            "# written by bench/guest.py; run by /sbin/cz-guest-init in the guest",
            f"cd {shlex.quote(str(repo))} || exit 1",
            "export HOME=/tmp LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1",
            f"export PYTHONPATH={shlex.quote(str(repo))} COZYEBPF_BENCH_RESULTS=/results",
            'mods="/lib/modules/$(uname -r)"',
            'mkdir -p "$mods" && rm -rf "$mods/build" "$mods/source"',
            f'ln -s {shlex.quote(hdr.build)} "$mods/build"',
            f'ln -s {shlex.quote(hdr.source)} "$mods/source"',
            f"{py} -m bench {shlex.join(args)}",
            'echo "cz-bench exited $?"',
        ]
    )


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.guest", description=__doc__)
    ap.add_argument("--kernel", default="6.12", help="the matrix's kernel line (6.1, 6.12)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds before qemu is killed")
    ap.add_argument("--memory", type=int, default=4096, help="the guest's memory, MB")
    ap.add_argument("bench_args", nargs="*", help="python -m bench's arguments (after --)")
    args = ap.parse_args()
    kernels = {k.line: k for k in kmatrix.guest_kernels()}
    if args.kernel not in kernels:
        ap.error(f"no {args.kernel} guest: the matrix has {', '.join(kernels)}")
    kernel, repo = kernels[args.kernel], kmatrix.REPO
    if not (repo / ".venv").resolve().is_relative_to(repo):
        ap.error(f"{repo}/.venv is outside the checkout the guest sees: run scripts/setup.sh")
    with tempfile.TemporaryDirectory(prefix="czbench-guest-") as tmp:
        results = Path(tmp)
        (results / "run.sh").write_text(run_script(kernel, repo, args.bench_args) + "\n")
        cmd = kmatrix.qemu_command(kernel, kmatrix.CACHE, repo, results, 2, args.memory)
        log(f"bench.guest: {kernel.release} under qemu (TCG): python -m bench {args.bench_args}")
        t0 = time.monotonic()
        with subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            preexec_fn=kmatrix._die_with_parent,
        ) as proc:
            assert proc.stdout is not None
            rc = None
            timer = threading.Timer(args.timeout, proc.kill)
            timer.start()
            try:
                for line in proc.stdout:  # the guest's console: its bench's log and table
                    line = kmatrix.ANSI.sub("", line.rstrip("\n"))
                    print(line, flush=True)
                    if line.startswith("cz-bench exited "):
                        rc = int(line.split()[-1])
            finally:
                timer.cancel()
                if proc.poll() is None:
                    proc.kill()
        if rc is None:
            log(f"bench.guest: the guest ended before the bench did (timeout {args.timeout:.0f} s)")
        log(f"bench.guest: the guest ran {time.monotonic() - t0:.0f} s")
        for js in sorted(results.glob("*.json")):
            out = RESULTS / f"guest-{kernel.release}-{js.name}"
            RESULTS.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(js, out)
            log(f"bench.guest: written {out.relative_to(BENCH.parent)}")
    return 1 if rc is None else rc


if __name__ == "__main__":
    sys.exit(main())
