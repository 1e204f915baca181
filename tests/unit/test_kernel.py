"""What the datapath does on each kernel (cozyebpf/datapath/kernel.py, issue 36): the kernel
matrix's lines and the ones between, and a kernel older than the oldest it proved refused
before anything is touched."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from cozyebpf.datapath import kernel
from cozyebpf.datapath.bpf import BpfDatapath
from cozyebpf.errors import DatapathError


@pytest.mark.parametrize(
    ("release", "notes"),
    [
        ("6.18.44-fc-v1272", []),  # this machine until 2026-12-07; Talos 1.12, 1.13
        ("6.18.44-fc-v1300", []),  # this machine since (the helper it refuses: below)
        ("6.12.118+deb12-amd64", []),  # Talos 1.9-1.11
        ("6.6.0", []),
        ("6.5.13", ["no tcx"]),
        ("6.1.0-57-amd64", ["no tcx", "no BPF_FIB_LOOKUP_SKIP_NEIGH"]),  # Debian 12
        ("7.3.4+deb13-amd64", []),
    ],
)
def test_what_each_kernel_lacks_is_worked_around_and_said(release: str, notes: list[str]) -> None:
    got = kernel.check(release)
    assert len(got) == len(notes), got
    for line, what in zip(got, notes, strict=True):
        assert f"Linux {release} has {what}" in line


@pytest.mark.parametrize("release", ["5.15.0-91-generic", "5.10.0-28-amd64", "4.19.0"])
def test_a_kernel_older_than_6_1_is_refused_naming_it_and_the_minimum(release: str) -> None:
    with pytest.raises(DatapathError) as e:
        kernel.check(release)
    msg = str(e.value)
    assert f"Linux {release} is older than 6.1" in msg
    assert "Linux 6.1 or later" in msg and "ring buffer" in msg


def test_a_release_without_a_version_is_an_error() -> None:
    with pytest.raises(DatapathError, match="cannot read a kernel version"):
        kernel.check("unknown")


@pytest.fixture
def old_kernel(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    real = os.uname()
    fake = os.uname_result((real.sysname, real.nodename, "5.15.0-91-generic", "", real.machine))
    monkeypatch.setattr(os, "uname", lambda: fake)
    yield


def test_the_agent_refuses_an_old_kernel_before_it_touches_anything(
    old_kernel: None, tmp_path: Path
) -> None:
    """prepare() is the agent's first step on the kernel: the check comes before the devices
    are looked up and before any map is pinned (this pin dir is never made)."""
    pin = f"{tmp_path}/pins"
    dp = BpfDatapath(["no-such-device"], pin_dir=pin)
    with pytest.raises(DatapathError, match=r"older than 6\.1"):
        dp.prepare()
    assert not os.path.exists(pin)


REFUSED = (
    "load program cz_probe_meta: Invalid argument: 0: R1=ctx() R10=fp0\n"
    "1: (85) call bpf_xdp_adjust_meta#54\n"
    "program of this type cannot use helper bpf_xdp_adjust_meta#54\n"
    "processed 2 insns (limit 1000000) max_states_per_insn 0 total_states 0"
)


@pytest.mark.parametrize(
    ("refused", "err"),
    [(True, "EINVAL"), (False, ""), (False, "EPERM")],
    ids=["refused", "allowed", "no-privilege"],
)
def test_a_kernel_that_refuses_the_metadata_helper_gets_programs_without_the_mark(
    monkeypatch: pytest.MonkeyPatch, refused: bool, err: str
) -> None:
    """kernel.xdp_meta keeps the verifier's verdict, not its statistics; the loader compiles
    with CZ_NO_XDP_META exactly where the kernel refused (a probe refused for want of a
    privilege tells nothing: the programs' own load then says what is wrong), and the log
    line says so."""
    import errno

    from cozyebpf.datapath import bpfsys, loader

    loads: list[bytes] = []

    def prog_load(prog_type: int, insns: bytes, name: str, attach: int = 0) -> int:
        loads.append(insns)
        assert prog_type == bpfsys.BPF_PROG_TYPE_XDP and attach == bpfsys.BPF_XDP
        if err:
            raise bpfsys.BpfError(getattr(errno, err), REFUSED)
        return os.open("/dev/null", os.O_RDONLY)

    monkeypatch.setattr(bpfsys, "prog_load", prog_load)
    monkeypatch.setattr(kernel, "hz", lambda: 250)
    kernel.xdp_meta.cache_clear()
    try:
        said = kernel.xdp_meta()
        flags = loader.cflags("/nonexistent", layout=loader.pinned_layout("/nonexistent"))
        note = kernel.xdp_meta_note("6.18.44-fc-v1300")
    finally:
        kernel.xdp_meta.cache_clear()
    # r2 = -4; call 54; r0 = XDP_PASS; exit: the helper's number in the call's immediate
    assert len(loads) == 1 and len(loads[0]) == 32
    assert int.from_bytes(loads[0][12:16], "little", signed=True) == 54
    if refused:
        assert said == "program of this type cannot use helper bpf_xdp_adjust_meta#54"
        assert "-DCZ_NO_XDP_META" in flags
        assert note is not None and note.startswith(
            "Linux 6.18.44-fc-v1300 refuses bpf_xdp_adjust_meta in XDP programs (program of"
        )
        assert "host routing leaves the uplink's frames to the stack" in note
    else:
        assert said is None and note is None
        assert "-DCZ_NO_XDP_META" not in flags
