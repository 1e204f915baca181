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
        ("6.18.44-fc-v1272", []),  # this machine; Talos 1.12, 1.13
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
