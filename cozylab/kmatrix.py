"""The kernel matrix (issue 36): the datapath's tests on the kernels cozyebpf's users run, each
booted from Debian's packages under qemu, and on this machine's own kernel.

    make kernel-matrix                    (scripts/kernel-matrix.sh: setup, the cache, this)
    python -m cozylab.kmatrix [--kernels 6.1,6.12,host] [--plan full|ci] [--json FILE]

scripts/kernel-guests.sh builds what the guests boot, once, into a cache outside the checkout
(COZYEBPF_GUEST_CACHE, default /var/cache/cozyebpf/kernel-matrix): a Debian 12 root file
system (`rootfs.img`), each kernel of the matrix with its initramfs (`boot/`) and `kernels`, one
line per kernel: its release, the two directories of its own headers and of the fallback
headers (the DaemonSet image's: linux-headers-amd64 of Debian 12) as the guest sees them.

A guest boots under `qemu-system-x86_64 -accel tcg` (software emulation: KVM hangs nested
guests here after the kernel decompresses), its disk opened with snapshot=on (nothing it writes
stays), the checkout shared read-only over 9p at the path it has here, so that its `.venv`
(python3.11 and bcc of Debian 12 in the guest too) runs there as it is, and a results
directory shared writable. Its init (/sbin/cz-guest-init, written by kernel-guests.sh) mounts
what the tests need and runs `run.sh` of the results directory, which this module writes: per
phase it links /lib/modules/<release>/{build,source} to a set of headers (the image's fallback,
or the kernel's own where Debian has them) and runs pytest on the phase's test files (CI=true:
a missing prerequisite fails), with a JUnit report and the verifier's counts
(tests/datapath/test_verifier_budgets.py writes them to $COZYEBPF_VERIFIER_COUNTS). Then the
guest powers off. This machine's row runs the same phase with pytest here: its kernel is not a
Debian package and there is no /boot, so it cannot be booted as a guest.

What a guest leaves out: it has no NIC (the tests make their own veths in namespaces) and one
or two emulated CPUs, about 15-20 times slower than this machine's; `COZYEBPF_TEST_SLOWDOWN`
tells the tests so (it scales the bounds they wait for a hang, never an expectation).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click

from cozyebpf.datapath.kernel import version as kernel_version

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("COZYEBPF_GUEST_CACHE", "/var/cache/cozyebpf/kernel-matrix"))
BUILD_HINT = "run scripts/kernel-guests.sh (as root; 3 to 5 minutes the first time)"

#: the tests of each plan: "ci" what CI runs on every run (compile, load, budgets, and shaped
#: egress, which needs the fq that this machine's kernel lacks: the 6.12 guest), "full" what
#: `make kernel-matrix` runs on every kernel with the image's headers; "own" what it runs
#: with a kernel's own headers (they differ from the image's: the compile)
TESTS = {
    "ci": ("tests/datapath/test_verifier_budgets.py", "tests/datapath/test_shaping.py"),
    "full": (
        "tests/datapath/test_verifier_budgets.py",
        "tests/datapath/test_shaping.py",
        "tests/datapath/test_prog_run.py",
        "tests/datapath/test_differential.py",
        "tests/datapath/test_kernel_paths.py",
    ),
    "own": ("tests/datapath/test_verifier_budgets.py",),
}
#: map states of the differential test in a guest (2,000 on this machine): its frames run
#: through the real programs as everywhere; generating them is Python, emulated
GUEST_DIFF_EXAMPLES = 200
#: how much slower a guest runs the tests than this machine (TCG): the factor the tests' bounds
#: for a hang get (tests/support/env.py, SLOWDOWN)
GUEST_SLOWDOWN = 20


class GuestError(Exception):
    """Something a guest needs is missing; the message says what and the fix."""


@dataclass(frozen=True)
class Headers:
    """A set of kernel headers as bcc finds them: /lib/modules/<release>/{build,source}."""

    build: str
    source: str

    @property
    def name(self) -> str:
        """The release they are of (linux-headers-<release>)."""
        return os.path.basename(self.build).removeprefix("linux-headers-")


@dataclass(frozen=True)
class Kernel:
    """A kernel of the matrix: its release and headers (its own, and the image's fallback)."""

    release: str
    own: Headers
    fallback: Headers

    @property
    def line(self) -> str:
        """major.minor: 6.1, 6.12."""
        return kernel_line(self.release)


def kernel_line(release: str) -> str:
    """The major.minor of a kernel release ("6.12.118+deb12-amd64" -> "6.12")."""
    major, minor = kernel_version(release)
    return f"{major}.{minor}"


def guest_kernels(cache: Path = CACHE) -> list[Kernel]:
    """The kernels the cache holds, in its order (scripts/kernel-guests.sh's `kernels`)."""
    path = cache / "kernels"
    if not (path.is_file() and (cache / "rootfs.img").is_file()):
        raise GuestError(f"no kernel-matrix cache in {cache}: {BUILD_HINT}")
    out = []
    for line in path.read_text().splitlines():
        release, *dirs = line.split()
        if len(dirs) != 4:
            raise GuestError(f"{path}: a line that is not 'release build source build source'")
        for name in (f"vmlinuz-{release}", f"initrd.img-{release}"):
            if not (cache / "boot" / name).is_file():
                raise GuestError(f"{cache}/boot has no {name}: {BUILD_HINT}")
        out.append(Kernel(release, Headers(*dirs[:2]), Headers(*dirs[2:])))
    return out


def qemu_binary() -> str:
    found = shutil.which("qemu-system-x86_64")
    if found is None:
        raise GuestError(
            "qemu-system-x86_64 is not installed (apt-get install qemu-system-x86; "
            "scripts/kernel-guests.sh installs it)"
        )
    return found


def missing() -> str | None:
    """What the guests lack here (qemu, the cache), or None: tests/support/prereqs.py."""
    try:
        qemu_binary()
        guest_kernels()
    except GuestError as e:
        return str(e)
    return None


@dataclass(frozen=True)
class Phase:
    """One pytest run: its tests, compiled against which headers ("fallback" or "own")."""

    headers: str
    tests: tuple[str, ...]


def phases(kernel: Kernel | None, plan: str, tests: Sequence[str] = ()) -> list[Phase]:
    """What runs on `kernel` (None: this machine): the plan's tests (or `tests`) with the
    image's headers, and for "full" the compile again with the kernel's own where Debian has
    them."""
    out = [Phase("fallback", tuple(tests) or TESTS[plan])]
    if plan == "full" and kernel is not None and kernel.own != kernel.fallback:
        out.append(Phase("own", TESTS["own"]))
    return out


@dataclass
class Failure:
    test: str
    message: str


@dataclass
class Result:
    """One row of the table: a phase on a kernel."""

    kernel: str
    where: str  # "guest" or "this machine"
    headers: str
    tests: list[str]
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    passed_tests: list[str] = field(default_factory=list)  # classname::name of each
    complete: bool = False  # the phase ran to its end and left its report
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.complete and self.failed == 0 and self.passed > 0


def read_junit(path: Path, result: Result) -> None:
    """Passed, failed (failures and errors), skipped and the failures of a JUnit report."""
    root = ET.parse(path).getroot()
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            result.failed += 1
            text = (bad.get("message") or bad.text or "").strip()
            result.failures.append(Failure(name, text.splitlines()[0][:300] if text else ""))
        elif case.find("skipped") is not None:
            result.skipped += 1
        else:
            result.passed += 1
            result.passed_tests.append(name)


def read_counts(path: Path) -> dict[str, int]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return {str(k): int(v) for k, v in data.get("counts", {}).items()}


def pytest_args(tests: Sequence[str], junit: str) -> list[str]:
    return [
        *("-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist"),
        *("-v", "--no-header", "-ra", f"--junitxml={junit}", *tests),
    ]


# -- a guest ---------------------------------------------------------------------------------


def run_script(kernel: Kernel, plan: Sequence[Phase], repo: Path, slowdown: int) -> str:
    """The guest's /results/run.sh: each phase's headers linked, then its pytest."""
    py = shlex.quote(str(repo / ".venv" / "bin" / "python"))
    lines = [
        "# written by cozylab/kmatrix.py; run by /sbin/cz-guest-init in the guest",
        f"cd {shlex.quote(str(repo))} || exit 1",
        "export CI=true HOME=/tmp LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1",
        "export HYPOTHESIS_STORAGE_DIRECTORY=/tmp/hypothesis TERM=dumb",
        f"export COZYEBPF_TEST_SLOWDOWN={slowdown} CZ_DIFF_EXAMPLES={GUEST_DIFF_EXAMPLES}",
        'mods="/lib/modules/$(uname -r)"',
        'uptime() { cut -d" " -f1 /proc/uptime; }',
    ]
    for i, ph in enumerate(plan):
        hdr = kernel.own if ph.headers == "own" else kernel.fallback
        args = " ".join(shlex.quote(a) for a in pytest_args(ph.tests, f"/results/{i}.xml"))
        lines += [
            f'echo "cz-phase {i} start $(uptime)"',
            'mkdir -p "$mods" && rm -rf "$mods/build" "$mods/source"',
            f'ln -s {shlex.quote(hdr.build)} "$mods/build"',
            f'ln -s {shlex.quote(hdr.source)} "$mods/source"',
            f"COZYEBPF_VERIFIER_COUNTS=/results/{i}.counts.json {py} {args}",
            f'echo "cz-phase {i} end rc=$? $(uptime)"',
        ]
    return "\n".join(lines) + "\n"


def _die_with_parent() -> None:
    """In the child: killed when the process that started it dies (no qemu left behind)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1bc|\r")
#: pytest -v: a test's id starts a line, its verdict ends one (the same, unless the test printed
#: lines of its own in between, as test_verifier_budgets does)
PYTEST_TEST = re.compile(r"^(tests/\S+::\S+)")
PYTEST_VERDICT = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+\[\s*\d+%\]$")


def qemu_command(
    kernel: Kernel, cache: Path, repo: Path, results: Path, smp: int, memory_mb: int
) -> list[str]:
    boot = cache / "boot"
    append = (
        "console=ttyS0 root=/dev/vda rw rootwait init=/sbin/cz-guest-init panic=-1 quiet "
        f"cz.repo={repo}"
    )
    return [
        qemu_binary(),
        *("-machine", "q35", "-accel", "tcg,thread=multi", "-cpu", "max"),
        *("-smp", str(smp), "-m", str(memory_mb), "-nographic", "-no-reboot", "-nic", "none"),
        *("-kernel", str(boot / f"vmlinuz-{kernel.release}")),
        *("-initrd", str(boot / f"initrd.img-{kernel.release}"), "-append", append),
        *("-drive", f"file={cache / 'rootfs.img'},format=raw,if=virtio,snapshot=on"),
        *("-virtfs", f"local,path={repo},mount_tag=repo,security_model=none,readonly=on,id=repo"),
        *("-virtfs", f"local,path={results},mount_tag=results,security_model=none,id=results"),
    ]


def run_guest(
    kernel: Kernel,
    plan: Sequence[Phase],
    *,
    cache: Path = CACHE,
    repo: Path = REPO,
    smp: int = 2,
    memory_mb: int = 3072,
    timeout: float = 3600.0,
    slowdown: int = GUEST_SLOWDOWN,
    say: Callable[[str], None] = print,
    keep: Path | None = None,
) -> list[Result]:
    """Boot `kernel` and run `plan` in it; a Result per phase. The console goes to
    console.log in the results directory (`keep`, else a temporary one)."""
    if not (repo / ".venv" / "bin" / "python").exists():
        raise GuestError(f"{repo}/.venv does not exist: run scripts/setup.sh first")
    tmp = tempfile.TemporaryDirectory(prefix="czkm-") if keep is None else None
    results = keep if tmp is None else Path(tmp.name)
    assert results is not None
    results.mkdir(parents=True, exist_ok=True)
    tag = f"[{kernel.release}]"
    try:
        (results / "run.sh").write_text(run_script(kernel, plan, repo, slowdown))
        cmd = qemu_command(kernel, cache, repo, results, smp, memory_mb)
        rows = [
            Result(kernel.release, "guest", _headers_label(kernel, ph.headers), list(ph.tests))
            for ph in plan
        ]
        started = time.monotonic()
        say(f"{tag} booting under qemu (TCG, {smp} CPUs, {memory_mb} MB)")
        phase_start: dict[int, float] = {}
        with (results / "console.log").open("w") as log:
            log.write(f"# {shlex.join(cmd)}\n")
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
            assert proc.stdout is not None
            try:
                timed_out = _follow(proc, log, timeout, started, tag, say, rows, phase_start, plan)
            finally:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
        total = time.monotonic() - started
        for i, row in enumerate(rows):
            junit = results / f"{i}.xml"
            if junit.is_file():
                read_junit(junit, row)
                row.complete = True
            row.counts = read_counts(results / f"{i}.counts.json")
            if not row.complete:
                row.note = (
                    f"timed out after {timeout:.0f} s"
                    if timed_out
                    else f"the guest stopped before the phase ended (qemu exited {proc.returncode})"
                )
        _phase_seconds(rows, phase_start, started + total)
        say(f"{tag} done in {_mmss(total)} (console: {results / 'console.log'})")
        if not all(r.complete for r in rows):
            tail = (results / "console.log").read_text()[-3000:]
            say(f"{tag} the guest's last output:\n{tail}")
        return rows
    finally:
        if tmp is not None:
            tmp.cleanup()


def _phase_seconds(rows: list[Result], starts: dict[int, float], end: float) -> None:
    """Each phase from its start to the next phase's (or the guest's end)."""
    for i, row in enumerate(rows):
        if i in starts:
            row.seconds = starts.get(i + 1, end) - starts[i]


def _follow(
    proc: subprocess.Popen[bytes],
    log: Any,
    timeout: float,
    started: float,
    tag: str,
    say: Callable[[str], None],
    rows: list[Result],
    phase_start: dict[int, float],
    plan: Sequence[Phase],
) -> bool:
    """Read the console until qemu exits (False) or `timeout` passes (True): log every line,
    say the phases, each failure as it comes and every minute how far the tests are."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buf = b""
    counted = {"passed": 0, "failed": 0, "skipped": 0}
    current = [""]  # the test running
    next_note = started + 60
    while True:
        now = time.monotonic()
        if now - started > timeout:
            say(f"{tag} TIMEOUT after {timeout:.0f} s: stopping the guest")
            return True
        if now >= next_note:
            next_note = now + 60
            say(
                f"{tag} {_mmss(now - started)}: {counted['passed']} passed, "
                f"{counted['failed']} failed so far"
            )
        ready, _, _ = select.select([fd], [], [], 1.0)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return False
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for raw in lines:
            line = ANSI.sub("", raw.decode(errors="replace"))
            log.write(line + "\n")
            log.flush()
            _note(line, tag, say, counted, phase_start, plan, current)


def _note(
    line: str,
    tag: str,
    say: Callable[[str], None],
    counted: dict[str, int],
    phase_start: dict[int, float],
    plan: Sequence[Phase],
    current: list[str],
) -> None:
    if line.startswith("cz-guest-init:"):
        say(f"{tag} {line.removeprefix('cz-guest-init: ')}")
        return
    m = re.match(r"cz-phase (\d+) (start|end)(.*)", line)
    if m:
        i = int(m.group(1))
        if m.group(2) == "start":
            phase_start[i] = time.monotonic()
            ph = plan[i]
            say(f"{tag} phase {i + 1}/{len(plan)}: {ph.headers} headers: {' '.join(ph.tests)}")
        else:
            say(f"{tag} phase {i + 1}/{len(plan)} ended:{m.group(3)}")
        return
    verdict = _verdict(line, current)
    if verdict is not None:
        key = {"PASSED": "passed", "XFAIL": "passed", "SKIPPED": "skipped"}.get(verdict, "failed")
        counted[key] += 1
        if key == "failed":
            say(f"{tag} {verdict}: {current[0]}")
    elif "Kernel panic" in line or "BUG:" in line:
        say(f"{tag} {line}")


def _verdict(line: str, current: list[str]) -> str | None:
    """A pytest -v line: the verdict it ends with, if any; `current` holds the id of the test
    that last started (a line that starts with one)."""
    m = PYTEST_TEST.match(line)
    if m:
        current[0] = m.group(1)
    v = PYTEST_VERDICT.search(line)
    return v.group(1) if v else None


def _headers_label(kernel: Kernel, which: str) -> str:
    hdr = kernel.own if which == "own" else kernel.fallback
    return f"{hdr.name} ({'own' if which == 'own' else 'image fallback'})"


# -- this machine ----------------------------------------------------------------------------


def host_headers() -> str:
    build = Path(f"/lib/modules/{os.uname().release}/build")
    target = os.path.realpath(build)
    name = os.path.basename(target).removeprefix("linux-headers-")
    if name.endswith(os.uname().release):
        return f"{name} (own)"
    return f"{name} (image fallback, as setup.sh links)"


def run_host(
    tests: Sequence[str], *, repo: Path = REPO, say: Callable[[str], None] = print
) -> Result:
    """The tests with pytest on this machine (its kernel is not bootable as a guest)."""
    release = os.uname().release
    row = Result(release, "this machine", host_headers(), list(tests))
    with tempfile.TemporaryDirectory(prefix="czkm-host-") as d:
        junit, counts = Path(d) / "host.xml", Path(d) / "counts.json"
        env = {**os.environ, "COZYEBPF_VERIFIER_COUNTS": str(counts)}
        say(f"[{release}] this machine: {' '.join(tests)}")
        started = time.monotonic()
        with (Path(d) / "pytest.log").open("w") as log:
            proc = subprocess.Popen(
                [str(repo / ".venv" / "bin" / "python"), *pytest_args(tests, str(junit))],
                cwd=repo,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            assert proc.stdout is not None
            current = [""]
            for line in proc.stdout:
                log.write(line)
                verdict = _verdict(line.rstrip("\n"), current)
                if verdict in ("FAILED", "ERROR"):
                    say(f"[{release}] {verdict}: {current[0]}")
            proc.wait()
        row.seconds = time.monotonic() - started
        if junit.is_file():
            read_junit(junit, row)
            row.complete = True
        else:
            row.note = f"pytest exited {proc.returncode} without a report"
        row.counts = read_counts(counts)
    say(f"[{release}] done in {_mmss(row.seconds)}")
    return row


# -- the table -------------------------------------------------------------------------------


def _mmss(seconds: float) -> str:
    return f"{int(seconds) // 60}m{int(seconds) % 60:02d}s"


def table(rows: Sequence[Result]) -> str:
    """One table, a column per run (kernel and headers) and this machine's last: the tests
    passed and failed, the time, and each program's verified instructions (beside this
    machine's: the difference in per cent)."""
    if not rows:
        return "(no runs)"
    host = next((r for r in rows if r.where == "this machine"), None)
    programs: list[str] = []
    for r in rows:
        programs += [p for p in r.counts if p not in programs]
    head = ["", *(f"Linux {r.kernel}" for r in rows)]
    body: list[list[str]] = [
        ["where", *(r.where for r in rows)],
        ["headers", *(r.headers for r in rows)],
        ["tests passed", *(str(r.passed) for r in rows)],
        [
            "tests failed",
            *(str(r.failed) if r.complete else f"{r.failed} + INCOMPLETE" for r in rows),
        ],
        ["tests skipped", *(str(r.skipped) for r in rows)],
        ["time", *(_mmss(r.seconds) for r in rows)],
        ["verified instructions", *("" for _ in rows)],
    ]
    for p in programs:
        cells = [f"  {p}"]
        for r in rows:
            n = r.counts.get(p)
            if n is None:
                cells.append("-")
                continue
            base = host.counts.get(p) if host is not None and r is not host else None
            diff = f" ({(n - base) / base * 100:+.0f}%)" if base and n != base else ""
            cells.append(f"{n:,}{diff}")
        body.append(cells)
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]

    def fmt(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    out = [fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [fmt(cells) for cells in body]
    return "\n".join(out)


def failures(rows: Iterable[Result]) -> str:
    lines = []
    for r in rows:
        for f in r.failures:
            lines.append(f"Linux {r.kernel}, {r.headers}: {f.test}: {f.message}")
        if r.note:
            lines.append(f"Linux {r.kernel}, {r.headers}: {r.note}")
    return "\n".join(lines)


# -- the command -----------------------------------------------------------------------------


def select_kernels(spec: str, available: Sequence[Kernel]) -> tuple[list[Kernel], bool]:
    """--kernels: the guests (by line, 6.1 or 6.12, or release) and whether this machine too."""
    if spec == "all":
        return list(available), True
    chosen: list[Kernel] = []
    host = False
    for word in (w.strip() for w in spec.split(",") if w.strip()):
        if word == "host":
            host = True
            continue
        found = [k for k in available if word in (k.line, k.release)]
        if not found:
            names = ", ".join(f"{k.line} ({k.release})" for k in available)
            raise GuestError(
                f"--kernels: no guest kernel {word!r}; the cache has {names}, and host"
            )
        chosen += [k for k in found if k not in chosen]
    return chosen, host


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--kernels",
    default="all",
    show_default=True,
    help="Which: all, or a comma-separated list of guest kernels (6.1, 6.12 or a release) and "
    "'host' (this machine).",
)
@click.option(
    "--plan",
    type=click.Choice(["full", "ci"]),
    default="full",
    show_default=True,
    help="full: budgets, BPF_PROG_RUN, the differential and the agent's paths (plus the "
    "compile with a kernel's own headers); ci: compile, load and budgets only.",
)
@click.option(
    "--tests",
    "test_files",
    default="",
    help="Comma-separated test files (or node ids) to run instead of the plan's, with the "
    "image's headers, e.g. tests/datapath/test_kernel_paths.py.",
)
@click.option("--smp", default=2, show_default=True, help="CPUs of each guest.")
@click.option("--memory", "memory_mb", default=3072, show_default=True, help="MB per guest.")
@click.option(
    "--timeout", default=5400, show_default=True, help="Seconds a guest may take at most."
)
@click.option("--json", "as_json", type=click.Path(dir_okay=False), help="Write the rows here.")
@click.option(
    "--keep",
    type=click.Path(file_okay=False),
    help="Keep each guest's results (console.log, JUnit reports) in DIR/<release>.",
)
def main(
    kernels: str,
    plan: str,
    test_files: str,
    smp: int,
    memory_mb: int,
    timeout: int,
    as_json: str | None,
    keep: str | None,
) -> None:
    """Run the datapath's tests on each kernel of the matrix and print one table."""
    if os.geteuid() != 0:
        raise click.ClickException("run as root (BPF, namespaces; qemu's 9p shares)")
    try:
        guests, host = select_kernels(kernels, guest_kernels())
        if guests:
            qemu_binary()
    except GuestError as e:
        raise click.ClickException(str(e)) from None
    started = time.monotonic()

    def say(text: str) -> None:
        click.echo(f"kernel-matrix {_mmss(time.monotonic() - started)} {text}")
        sys.stdout.flush()  # as it happens, also into a file or a pipe

    tests = [t.strip() for t in test_files.split(",") if t.strip()]
    rows: list[Result] = []
    for k in guests:
        out = Path(keep) / k.release if keep else None
        try:
            rows += run_guest(
                k,
                phases(k, plan, tests),
                smp=smp,
                memory_mb=memory_mb,
                timeout=timeout,
                say=say,
                keep=out,
            )
        except GuestError as e:
            raise click.ClickException(str(e)) from None
    if host:
        rows.append(run_host(phases(None, plan, tests)[0].tests, say=say))
    click.echo(f"\nkernel matrix ({plan}), {_mmss(time.monotonic() - started)} in all:\n")
    click.echo(table(rows))
    bad = failures(rows)
    if bad:
        click.echo("\nfailed:\n" + bad)
    if as_json:
        Path(as_json).write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    if not all(r.ok for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
