"""bpf(2)'s syscall number, chosen by machine at import (x86_64 and arm64, which the Dockerfile
builds), and the error on a machine without a known number."""

from __future__ import annotations

import errno
import platform
import subprocess
import sys

import pytest

from cozyebpf.datapath import bpfsys


@pytest.mark.parametrize(
    ("machine", "number"),
    [("x86_64", 321), ("amd64", 321), ("AMD64", 321), ("aarch64", 280), ("arm64", 280)],
)
def test_the_syscall_number_by_machine(machine: str, number: int) -> None:
    assert bpfsys.sys_bpf_number(machine) == number


@pytest.mark.parametrize("machine", ["riscv64", "s390x", "i686", ""])
def test_an_unknown_machine_has_no_number(machine: str) -> None:
    assert bpfsys.sys_bpf_number(machine) is None


@pytest.mark.parametrize(
    ("machine", "number"), [("aarch64", 280), ("x86_64", 321), ("riscv64", None)]
)
def test_the_number_is_chosen_at_import_from_platform_machine(
    machine: str, number: int | None
) -> None:
    # a fresh interpreter: reloading bpfsys here would give the other modules a second BpfError
    code = (
        "import platform\n"
        f"platform.machine = lambda: {machine!r}\n"
        "from cozyebpf.datapath import bpfsys\n"
        "print(bpfsys.MACHINE, bpfsys.SYS_BPF)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.split() == [machine, str(number)]


def test_an_unknown_machine_fails_at_the_first_call_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bpfsys, "MACHINE", "riscv64")
    monkeypatch.setattr(bpfsys, "SYS_BPF", None)
    called = []
    monkeypatch.setattr(bpfsys, "_libc", type("NoLibc", (), {"syscall": called.append})())
    with pytest.raises(bpfsys.BpfError) as e:
        bpfsys.obj_get("/sys/fs/bpf/nothing")
    assert e.value.errno == errno.ENOSYS
    assert "riscv64" in str(e.value)
    assert called == []  # no syscall with a wrong number


def test_this_machine_has_its_number() -> None:
    # the machines the tests and the image run on are the known ones
    assert bpfsys.SYS_BPF == bpfsys.sys_bpf_number(platform.machine()) is not None
