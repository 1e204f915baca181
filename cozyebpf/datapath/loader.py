"""Compile and load the C programs in bpf/ with bcc.

bcc rewrites map accesses (`map.lookup(&k)`) only in the main file of a compilation, so the
loader inlines our own quoted `#include "lib/x.h"` headers into one source text, each once, with
`#line` markers so that compiler and verifier messages still name the real file and line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cozyebpf.datapath import bpfsys, kernel
from cozyebpf.datapath.layout import DEFAULT_MAX_SERVICES, Layout, map_specs
from cozyebpf.errors import DatapathError

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


def bpf_dir() -> Path:
    """Where the C sources are: $COZYEBPF_BPF_DIR, else bpf/ beside the package."""
    env = os.environ.get("COZYEBPF_BPF_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent.parent / "bpf"


def flatten(path: Path, seen: set[Path] | None = None) -> str:
    """`path` with its quoted includes (relative to the including file) inlined, each once."""
    seen = set() if seen is None else seen
    path = path.resolve()
    if path in seen:
        return ""
    seen.add(path)
    out = [f'#line 1 "{path}"']
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        m = _INCLUDE.match(line)
        if m:
            inc = (path.parent / m.group(1)).resolve()
            if not inc.is_file():
                raise DatapathError(f"{path}:{n}: included file {m.group(1)} not found")
            out.append(flatten(inc, seen))
            out.append(f'#line {n + 1} "{path}"')
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def _pinned_size(pin_dir: str, name: str) -> int | None:
    try:
        fd = bpfsys.obj_get(os.path.join(pin_dir, name))
    except OSError:
        return None
    try:
        return bpfsys.map_info(fd).max_entries
    finally:
        os.close(fd)


def pinned_layout(pin_dir: str) -> Layout:
    """The layout of the maps pinned in `pin_dir` (their sizes derive from the number of
    Services and of counted Services, `PinnedMaps.ensure(max_services=..., service_slots=...)`);
    the default where there are none."""
    addr = _pinned_size(pin_dir, "addr4")
    if addr is None:
        return map_specs(DEFAULT_MAX_SERVICES)
    stats = _pinned_size(pin_dir, "svcstats")
    return map_specs(addr // 2, None if stats is None else stats - 1)


def cflags(pin_dir: str, extra: Sequence[str] = (), layout: Layout | None = None) -> list[str]:
    """-D flags of the pin dir and the map sizes (bcc opens a pinned map only when the
    declaration matches it): `layout`, else the layout of the maps pinned in `pin_dir`; and of
    what this kernel refuses (CZ_NO_XDP_META: kernel.xdp_meta)."""
    lay = layout or pinned_layout(pin_dir)
    flags = [f'-DCZ_PIN_DIR="{pin_dir}"']
    sizes = {s.macro: s.max_entries for s in lay.all if s.macro}  # seen4 and seen6 share one
    flags += [f"-D{macro}={n}" for macro, n in sizes.items()]
    flags += [f"-DCZ_FLOWHINT_LOG2={lay.hint_log2}", f"-DCZ_ROLEHINT_LOG2={lay.role_hint_log2}"]
    rate = kernel.hz()  # the limits' clock: jiffies of this length (bpf/lib/limit.h)
    flags += [f"-DCZ_NS_PER_JIFFY={1_000_000_000 // rate if rate else 0}"]
    if kernel.xdp_meta() is not None:  # the verifier refuses bpf_xdp_adjust_meta here
        flags.append("-DCZ_NO_XDP_META")
    flags += ["-Wno-unused-function", *extra]
    return flags


@dataclass
class Program:
    """A loaded program. `bpf` is bcc's module where this process compiled it (it keeps the
    fd alive); None for a program passed by the compiler child, whose fd we own."""

    name: str
    fd: int
    bpf: Any
    kind: int | str = 0  # bcc's program type, or "xdp"/"sched_cls"

    def load_again(self) -> Program:
        """A second instance of the same program (a new fd and id, no compilation): tcx
        refuses to attach one program twice to the same hook."""
        assert self.bpf is not None, "only a program compiled in this process"
        self.bpf.funcs.pop(self.name.encode(), None)
        fn = self.bpf.load_func(self.name.encode(), self.kind)
        return Program(self.name, fn.fd, self.bpf, self.kind)


CAP_SYS_ADMIN = 21


def has_capability(cap: int) -> bool:
    """Is `cap` in this process's effective set?"""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> cap & 1)
    return False


def compile_source(source: str, pin_dir: str, extra: Sequence[str] = ()) -> Any:
    """Compile bpf/<source> with bcc (`extra`: more compiler flags, e.g. the benchmark's
    -DCZ_NO_SVC_STATS); the bcc module. The pinned maps must exist already
    (PinnedMaps.ensure), so bcc only opens them."""
    from bcc import BPF  # imported here: the model and the CLI's help work without bcc

    if not has_capability(CAP_SYS_ADMIN):
        # bcc opens pinned maps by id (BPF_MAP_GET_FD_BY_ID), which needs CAP_SYS_ADMIN
        raise DatapathError(
            "loading the programs needs CAP_SYS_ADMIN (bcc opens the pinned maps by id); "
            "run as root or add SYS_ADMIN and NET_ADMIN to the container's capabilities"
        )
    path = bpf_dir() / source
    if not path.is_file():
        raise DatapathError(f"BPF source {path} not found; set COZYEBPF_BPF_DIR")
    try:
        return BPF(text=flatten(path).encode(), cflags=cflags(pin_dir, extra))
    except Exception as e:  # bcc raises bare Exception; the compiler printed the details
        raise DatapathError(
            f"compiling {path} failed ({e}); see the compiler output above. Are kernel "
            f"headers installed at /lib/modules/{os.uname().release}/build?"
        ) from e


#: entry program -> (its full path, the pinned prog array and slot it is reached through;
#: bpf/lib/tail.h)
SLOW_PATHS = {
    "cz_ingress": ("cz_ingress_slow", "cz_tail_xdp", 0),
    "cz_ingress_tc": ("cz_ingress_tc_slow", "cz_tail_tc", 0),
    "cz_egress": ("cz_egress_slow", "cz_tail_tc", 1),
    "cz_pod_ingress": ("cz_pod_ingress_slow", "cz_tail_tc", 3),
}
#: entry program -> the further programs it or its full path hands frames to, as SLOW_PATHS: the
#: decision for a packet from outside a pod's source ranges (CZ_OUTSIDE in bpf/lib/ingress.h),
#: and the entry programs' rare paths
MORE_PATHS = {
    "cz_ingress": (("cz_ingress_outside", "cz_tail_xdp", 1),),
    "cz_ingress_tc": (
        ("cz_ingress_tc_outside", "cz_tail_tc", 2),
        ("cz_ingress_tc_route", "cz_tail_rare", 2),  # host routing (CZ_RARE_ROUTE_IN)
        ("cz_ingress_tc6", "cz_tail_rare", 3),  # what is not IPv4 (CZ_RARE_TC6)
    ),
    # the rare paths of the entry programs (bpf/lib/tail.h, CZ_RARE_*)
    "cz_egress": (("cz_egress_to_lb", "cz_tail_rare", 0),),
    "cz_pod_ingress": (("cz_pod_route6", "cz_tail_rare", 1),),
}


def _load_one(module: Any, func: str, kind: int) -> Any:
    try:
        return module.load_func(func.encode(), kind)
    except Exception as e:
        raise DatapathError(f"the kernel rejected {func}: {e}; the verifier log is above") from e


def load_from(module: Any, func: str, prog_type: str) -> Program:
    """Load `func` of a compiled module as prog_type ("xdp" or "sched_cls"). An entry program
    gets its full path (SLOW_PATHS) loaded and put into its pinned prog array first, so it is
    complete before anyone can attach it."""
    import ctypes

    from bcc import BPF

    kind = {"xdp": BPF.XDP, "sched_cls": BPF.SCHED_CLS}[prog_type]
    for slow, array, slot in (*MORE_PATHS.get(func, ()), *filter(None, [SLOW_PATHS.get(func)])):
        fn = _load_one(module, slow, kind)
        module[array.encode()][ctypes.c_int(slot)] = ctypes.c_int(fn.fd)
    fn = _load_one(module, func, kind)
    return Program(func, fn.fd, module, kind)


def slow_program_fd(program: Program, name: str | None = None) -> int | None:
    """The fd of an entry program's full path (SLOW_PATHS), or of another program it hands
    frames to (`name`, MORE_PATHS), or None."""
    slow = SLOW_PATHS.get(program.name)
    if slow is None or program.bpf is None:  # or passed by the compiler child: not kept
        return None
    fn = program.bpf.funcs.get((name or slow[0]).encode())
    return None if fn is None else int(fn.fd)


def load(
    source: str, func: str, prog_type: str, pin_dir: str, extra: Sequence[str] = ()
) -> Program:
    """Compile bpf/<source> and load `func` from it."""
    return load_from(compile_source(source, pin_dir, extra), func, prog_type)
