"""Run a command under a container runtime's default seccomp profile, as the container of
`seccompProfile: RuntimeDefault` runs (issue 28, item 6):

    /usr/bin/python3 tests/support/seccomp_exec.py PROFILE CAPS -- COMMAND...

PROFILE is a profile in the runtime's JSON format; tests/fixtures/seccomp/containers-common.json
is the one CRI-O and podman use (`/usr/share/containers/seccomp.json` of Debian 12's
golang-github-containers-common 0.50.1, Apache-2.0, github.com/containers/common). CAPS are
the container's capabilities (comma-separated, CAP_SYS_ADMIN,...): rules that include or
exclude capabilities are chosen by them, as the runtime chooses them by the container's
bounding set. The filter is built with libseccomp (python3-seccomp, for /usr/bin/python3),
loaded into this process, and the command exec'd: it and every process it starts run under it.

Runs with /usr/bin/python3, not the venv's, and imports nothing of cozyebpf or tests.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import sys
from typing import Any

import seccomp  # python3-seccomp

ARCH = {"x86_64": "SCMP_ARCH_X86_64", "aarch64": "SCMP_ARCH_AARCH64"}[platform.machine()]
OPS = {
    "SCMP_CMP_NE": seccomp.NE,
    "SCMP_CMP_LT": seccomp.LT,
    "SCMP_CMP_LE": seccomp.LE,
    "SCMP_CMP_EQ": seccomp.EQ,
    "SCMP_CMP_GE": seccomp.GE,
    "SCMP_CMP_GT": seccomp.GT,
    "SCMP_CMP_MASKED_EQ": seccomp.MASKED_EQ,
}


def _kernel() -> tuple[int, ...]:
    return tuple(int(x) for x in platform.release().split("-")[0].split(".")[:2])


def _applies(rule: dict[str, Any], caps: set[str]) -> bool:
    """The runtime's choice (containers/common pkg/seccomp): every included capability held,
    none of the excluded; this architecture; a kernel at least minKernel."""
    inc, exc = rule.get("includes") or {}, rule.get("excludes") or {}
    if not set(inc.get("caps") or ()) <= caps or set(exc.get("caps") or ()) & caps:
        return False
    if inc.get("arches") and ARCH.removeprefix("SCMP_ARCH_").lower() not in _arches(inc):
        return False
    if exc.get("arches") and ARCH.removeprefix("SCMP_ARCH_").lower() in _arches(exc):
        return False
    need = inc.get("minKernel")
    return not need or _kernel() >= tuple(int(x) for x in need.split(".")[:2])


def _arches(part: dict[str, Any]) -> set[str]:
    names = {"amd64": "x86_64", "arm64": "aarch64"}
    return {names.get(a, a) for a in part.get("arches") or ()}


def _action(rule: dict[str, Any], default_errno: int) -> int:
    act = rule["action"]
    if act == "SCMP_ACT_ALLOW":
        return seccomp.ALLOW
    if act == "SCMP_ACT_ERRNO":
        return seccomp.ERRNO(rule.get("errnoRet") or default_errno)
    raise SystemExit(f"seccomp_exec: action {act} is not handled")


def build(profile: dict[str, Any], caps: set[str]) -> seccomp.SyscallFilter:
    default_errno = profile.get("defaultErrnoRet") or errno.EPERM
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO", profile["defaultAction"]
    f = seccomp.SyscallFilter(defaction=seccomp.ERRNO(default_errno))
    for rule in profile["syscalls"]:
        if not _applies(rule, caps):
            continue
        action = _action(rule, default_errno)
        args = [
            seccomp.Arg(a["index"], OPS[a["op"]], a["value"], a.get("valueTwo", 0))
            for a in rule.get("args") or ()
        ]
        # libseccomp cannot compare one argument twice in a rule: such conditions are
        # alternatives, one rule each (as the runtimes split them)
        indexes = [a["index"] for a in rule.get("args") or ()]
        groups = [[a] for a in args] if len(set(indexes)) < len(indexes) else [args]
        for name in rule["names"]:
            for group in groups:
                try:
                    f.add_rule(action, name, *group)
                except ValueError:  # not a syscall of this architecture or libseccomp
                    continue
    return f


def main(argv: list[str]) -> None:
    if len(argv) < 4 or argv[2] != "--":
        raise SystemExit(__doc__)
    with open(argv[0]) as fh:
        profile = json.load(fh)
    caps = {c.strip().upper() for c in argv[1].split(",") if c.strip()}
    build(profile, caps).load()
    os.execvp(argv[3], argv[3:])


if __name__ == "__main__":
    main(sys.argv[1:])
