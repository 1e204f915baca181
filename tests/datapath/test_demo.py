"""The README's main command: the demo runs end to end and shows what it promises."""

from __future__ import annotations

import shlex
import subprocess
import sys


def test_demo_runs_and_cleans_up(cozyebpf_cmd: list[str]) -> None:
    # the demo (lab, traffic) runs here; every cozyebpf command in it is `cozyebpf_cmd`
    demo = [sys.executable, "-m", "cozylab.demo", "--cozyebpf-cmd", shlex.join(cozyebpf_cmd)]
    p = subprocess.run(demo, capture_output=True, text=True, timeout=180)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    for line in (
        "hello from pod1 (port 8080 is not in spec.ports)",
        "hello from pod2 on a listed port",
        "curl: (28) Connection timed out",  # port 8081 of the filtered Service
        "client saw a connection from 203.0.113.10 (pod1 is 10.244.1.10)",
        "client saw a connection from 203.0.113.20 (pod2 is 10.244.1.20)",
        "203.0.113.20  10.244.1.20  tenant-demo/vm-filtered  port-filter  yes   tcp/80",
        "lab removed, datapath detached",
    ):
        assert line in out, f"missing {line!r} in the demo output:\n{out}"
    # the demo's agent serves no /status (no --health-address): `maps dump` asks none and says
    # nothing about one (it used to print "refused Services unknown: cannot reach the agent")
    assert "refused Services unknown" not in out and "cannot reach the agent" not in out, out
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "czdemo-" not in netns
