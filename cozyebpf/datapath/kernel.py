"""What cozyebpf does on each kernel, as the kernel matrix proved it (issue 36: `make
kernel-matrix`; README, *Install*; docs/design.md, *The kernel matrix*).

- Linux 6.6 and later (Talos 1.9-1.11: 6.12; Talos 1.12, 1.13: 6.18): every tc program on tcx,
  placed before every other program of its hook (BPF_F_BEFORE).
- Linux 6.1 to 6.5 (Debian 12: 6.1) has no tcx: the tc programs are legacy clsact filters that
  run first, at priority 1 beside Cilium's (attach.LEGACY_PRIO); where Cilium adds its filter
  anew after ours, the attachment check puts ours back in front (within --check-interval).
  Before 6.5 bpf_fib_lookup has no BPF_FIB_LOOKUP_SKIP_NEIGH: the programs ask again without
  it (bpf/lib/fib.h), and host routing takes two lookups where it takes one on 6.5.
- A kernel whose verifier refuses bpf_xdp_adjust_meta in XDP programs (seen on a 6.18 build,
  6.18.44-fc-v1300, where upstream allows it; `xdp_meta()` asks the kernel itself at start):
  the programs are compiled without the metadata mark (-DCZ_NO_XDP_META), so behind XDP
  ingress host routing leaves the uplink's frames to the stack, as on a driver without XDP
  metadata; every decision and drop stays in XDP.
- Older than 6.1: refused at start. Nothing older is proven: the verifier of an older kernel
  counts and prunes differently (6.1 rejected programs 6.12 took, until issue 36 changed
  them), and the programs use helpers of 5.8 to 5.12 (the ring buffer, bpf_redirect_neigh,
  bpf_ktime_get_coarse_ns, the FIB's MTU answer).
"""

from __future__ import annotations

import errno
import functools
import gzip
import os
import re
import time
from pathlib import Path

from cozyebpf.errors import DatapathError

#: the oldest kernel the programs are proven on (the kernel matrix's oldest guest)
MINIMUM = (6, 1)
#: tcx (and BPF_F_BEFORE); before it, legacy clsact filters
TCX = (6, 6)
#: BPF_FIB_LOOKUP_SKIP_NEIGH; before it, the FIB is asked again without
FIB_SKIP_NEIGH = (6, 5)


def version(release: str) -> tuple[int, int]:
    """(major, minor) of a kernel release: "6.12.118+deb12-amd64" -> (6, 12)."""
    m = re.match(r"(\d+)\.(\d+)", release)
    if m is None:
        raise DatapathError(f"cannot read a kernel version from the release {release!r}")
    return int(m.group(1)), int(m.group(2))


def check(release: str | None = None) -> list[str]:
    """Refuse a kernel older than MINIMUM (DatapathError naming it, the reason and the
    minimum); else what this kernel lacks that the datapath works around, one line each, for
    the log ([] on 6.6 and later)."""
    release = release or os.uname().release
    v = version(release)
    if v < MINIMUM:
        raise DatapathError(
            f"Linux {release} is older than {MINIMUM[0]}.{MINIMUM[1]}, the oldest kernel "
            f"cozyebpf's programs are proven on (the kernel matrix: 6.1, 6.12 and 6.18); an "
            f"older verifier is not known to accept them, and they need the ring buffer, "
            f"bpf_redirect_neigh and the FIB's MTU answer (Linux 5.8 to 5.12). Run the node "
            f"on Linux {MINIMUM[0]}.{MINIMUM[1]} or later (Debian 12, Talos 1.9 and later)"
        )
    notes = []
    if v < TCX:
        notes.append(
            f"Linux {release} has no tcx (6.6): the tc programs are clsact filters, first at "
            f"priority 1"
        )
    if v < FIB_SKIP_NEIGH:
        notes.append(
            f"Linux {release} has no BPF_FIB_LOOKUP_SKIP_NEIGH (6.5): the FIB is asked "
            f"again without it"
        )
    return notes


#: bpf_xdp_adjust_meta's number in enum bpf_func_id
HELPER_XDP_ADJUST_META = 54


@functools.cache
def xdp_meta() -> str | None:
    """Whether this kernel lets XDP programs call bpf_xdp_adjust_meta: None if it does (or the
    probe cannot tell: a load refused for another reason than EINVAL), else the verifier's
    refusal. Asked of the kernel itself, as libbpf's helper probes do: a
    four-instruction XDP program calls it (r1 is the context) and is closed at once."""
    from cozyebpf.datapath import bpfsys  # the syscall module; the model imports this file

    call = bpfsys.insn(0xB7, dst=2, imm=-4)  # r2 = -4
    call += bpfsys.insn(0x85, imm=HELPER_XDP_ADJUST_META)  # call bpf_xdp_adjust_meta
    call += bpfsys.insn(0xB7, dst=0, imm=2) + bpfsys.insn(0x95)  # return XDP_PASS
    try:
        fd = bpfsys.prog_load(bpfsys.BPF_PROG_TYPE_XDP, call, "cz_probe_meta", bpfsys.BPF_XDP)
    except OSError as e:
        if e.errno != errno.EINVAL:  # not the verifier's answer (no privilege, say): the
            return None  # programs' own load will say what is wrong, as without the probe
        # the verifier's verdict: the log's last line but its statistics
        lines = [x for x in str(e.strerror or e).splitlines() if not x.startswith("processed ")]
        return lines[-1].strip() if lines else "refused (EINVAL)"
    os.close(fd)
    return None


def xdp_meta_note(release: str | None = None) -> str | None:
    """The log line for a kernel that refuses bpf_xdp_adjust_meta, None where it allows it."""
    refusal = xdp_meta()
    if refusal is None:
        return None
    return (
        f"Linux {release or os.uname().release} refuses bpf_xdp_adjust_meta in XDP programs "
        f"({refusal}): behind XDP ingress, host routing leaves the uplink's frames to the "
        f"stack, as on a driver without XDP metadata (the pod-facing side and "
        f"--ingress-hook tcx still route)"
    )


#: the ticks per second kernels are built with (CONFIG_HZ's choices)
_HZ_CHOICES = (100, 250, 300, 1000)


def _config_hz(release: str) -> int | None:
    """CONFIG_HZ from the kernel's config: /proc/config.gz (CONFIG_IKCONFIG_PROC), else
    /boot/config-<release> (Debian's packages install it)."""
    for path, opener in (
        (Path("/proc/config.gz"), gzip.open),
        (Path(f"/boot/config-{release}"), open),
    ):
        try:
            with opener(path, "rt") as f:
                for line in f:
                    if line.startswith("CONFIG_HZ="):
                        return int(line.split("=", 1)[1])
        except (OSError, ValueError):
            continue
    return None


def _timer_list() -> tuple[int, int] | None:
    """(ktime ns, jiffies) as /proc/timer_list says them (root only), or None."""
    try:
        text = Path("/proc/timer_list").read_text()
    except OSError:
        return None
    now = re.search(r"^now at (\d+) nsecs", text, re.M)
    jiffies = re.search(r"^jiffies: (\d+)", text, re.M)
    if now is None or jiffies is None:
        return None
    return int(now.group(1)), int(jiffies.group(1))


def _measured_hz() -> int | None:
    """The tick rate measured from /proc/timer_list over 100 ms, as the nearest CONFIG_HZ
    choice (None: the file is not readable)."""
    a = _timer_list()
    time.sleep(0.1)
    b = _timer_list()
    if a is None or b is None or b[0] <= a[0]:
        return None
    hz = (b[1] - a[1]) * 1e9 / (b[0] - a[0])
    return min(_HZ_CHOICES, key=lambda c: abs(c - hz))


@functools.cache
def hz(release: str | None = None) -> int | None:
    """The kernel's tick rate (CONFIG_HZ), for the limits' clock (bpf/lib/limit.h: jiffies,
    which the verifier inlines, where bpf_ktime_get_coarse_ns is a helper call that costs
    15 ns on a CPU with return-stack mitigations); None where neither the config nor
    /proc/timer_list tells (the programs then read the coarse clock)."""
    return _config_hz(release or os.uname().release) or _measured_hz()


def jiffies_ns() -> int | None:
    """Now on the limits' clock (jiffies times the tick's length, as the programs read it), or
    None when the tick rate or jiffies are not known here."""
    rate = hz()
    now = _timer_list()
    if rate is None or now is None:
        return None
    return now[1] * (1_000_000_000 // rate)
