"""--pod-devices: names, patterns and `auto` (cozyebpf/datapath/attach.py). Run in the test
process's network namespace, where `lo` exists and `ovn0` does not (the cluster lab proves the
hook itself, with ovn0 and with per-pod veths)."""

from __future__ import annotations

import socket

import pytest

from cozyebpf.datapath.attach import is_pattern, match_pod_devices, resolve_pod_devices
from cozyebpf.errors import DatapathError


def test_auto_without_ovn0_and_none_mean_no_hook() -> None:
    names = [n for _, n in socket.if_nameindex()]
    assert "ovn0" not in names, "this test needs a namespace without Kube-OVN's ovn0"
    assert resolve_pod_devices("auto", ["lo"]) == []
    assert resolve_pod_devices("none", ["lo"]) == []
    assert resolve_pod_devices(" , ", ["lo"]) == []


def test_names_must_exist_and_must_not_be_uplinks() -> None:
    assert resolve_pod_devices("lo", ["eth9"]) == ["lo"]
    with pytest.raises(DatapathError, match=r"'nosuchdev0' does not exist.*--pod-devices"):
        resolve_pod_devices("lo,nosuchdev0", ["eth9"])
    with pytest.raises(DatapathError, match="lo is in both --devices and --pod-devices"):
        resolve_pod_devices("lo", ["lo"])


def test_patterns_are_kept_and_match_what_is_there_now() -> None:
    assert is_pattern("lxc*") and is_pattern("cali?") and not is_pattern("ovn0")
    # a pattern that matches nothing yet is fine: per-pod veths come later
    assert resolve_pod_devices("lxc*,l?", ["eth9"]) == ["lxc*", "l?"]
    assert match_pod_devices(["lxc*", "l?"], ["eth9"]) == ["lo"]
    assert match_pod_devices(["l?", "lo"], ["eth9"]) == ["lo"]  # each device once
    assert match_pod_devices(["l?"], ["lo"]) == []  # never an uplink
