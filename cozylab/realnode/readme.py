"""The README's commands as the real-node lab runs them (issue 46, item 5): the shell blocks of
its *Install* and *Check that it works* sections, and the example of *Troubleshoot* (`explain`
and the output the README shows for it), taken from README.md at run time, their placeholders
(REGISTRY/cozyebpf, TAG, NODE, CLIENT, LB_IP) filled with the lab's, run with the lab's kubectl
and helm. A command of the README that changed and no longer works is a failing row of
the lab, not a stale page."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"


def blocks(section: str, readme: Path = README) -> str:
    """The `sh` blocks of the README's `## section`, in order, as one script; LookupError when
    the section or its blocks are gone (the lab's row then names what to put back)."""
    found = re.findall(r"^```sh\n(.*?)^```", _section(section, readme), re.S | re.M)
    if not found:
        raise LookupError(f"{readme.name}, '## {section}': no ```sh block")
    return "\n".join(found)


def filled(script: str, **values: str) -> str:
    """`script` with each placeholder (a key of `values`, as a whole word) replaced; LookupError
    when the script has no such placeholder (the README and the lab disagree)."""
    for name, value in values.items():
        pattern = rf"(?<![\w.-]){re.escape(name)}(?![\w.-])"
        if not re.search(pattern, script):
            raise LookupError(f"the README's commands have no placeholder {name}:\n{script}")
        script = re.sub(pattern, value.replace("\\", r"\\"), script)
    return script


def _section(section: str, readme: Path) -> str:
    text = readme.read_text()
    m = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    if m is None:
        raise LookupError(f"{readme.name} has no section '## {section}'")
    return m.group(1)


def _inline(section: str, command: str, readme: Path) -> tuple[re.Match[str], str]:
    body = _section(section, readme)
    m = re.search(rf"`({re.escape(command)}[^`]*)`", body)
    if m is None:
        raise LookupError(f"{readme.name}, '## {section}': no `{command} ...`")
    return m, body


def inline(section: str, command: str, readme: Path = README) -> str:
    """The first inline command of the README's `## section` that starts with `command`;
    LookupError when it is gone."""
    return _inline(section, command, readme)[0].group(1)


def forms(command: str) -> list[str]:
    """The commands a README line with optional flags stands for, each flag written `[--flag]`:
    `cozyebpf status [--json]` is `cozyebpf status` and `cozyebpf status --json`."""
    flags = re.findall(r"\s*\[(--[\w-]+)\]", command)
    bare = re.sub(r"\s*\[--[\w-]+\]", "", command)
    return [bare, *(f"{bare} {flag}" for flag in flags)]


def example(section: str, command: str, readme: Path = README) -> tuple[str, dict[str, str]]:
    """`inline`, and the output the README shows for it (the plain ``` block after it,
    `key: value` lines); LookupError when either is gone."""
    m, body = _inline(section, command, readme)
    out = re.search(r"^ *```\n(.*?)^ *```", body[m.end() :], re.S | re.M)
    if out is None:
        raise LookupError(f"{readme.name}, '## {section}': no output shown after `{m.group(1)}`")
    return m.group(1), parsed(out.group(1))


def parsed(output: str) -> dict[str, str]:
    """The `key: value` lines of a command's output (or of the README's example of it)."""
    return {
        k: v.strip()
        for k, sep, v in (ln.strip().partition(":") for ln in output.splitlines())
        if sep
    }


def operated(
    status: list[str],
    dump: list[str],
    runs: Mapping[str, subprocess.CompletedProcess[str]],
    lb_ips: tuple[str, str],
) -> list[tuple[str, bool, str]]:
    """The rows of the *Operate* commands `status` and `maps dump` (`forms`: plain, then
    --json) as they answered on a node with a whole-IP and a port-filter Service (`lb_ips`):
    (check, ok, what was said). The JSON forms name the attachments and both LB IPs; the plain
    forms, what an operator reads, say the same: XDP on eth0, one Service of each mode, a row
    per Service with its LB IP, Service and mode as --json has them."""
    said = {c: f"{p.stdout[-300:]} {p.stderr[-300:]}".strip() for c, p in runs.items()}
    rows = []
    try:
        dp = json.loads(runs[status[1]].stdout)["datapath"]
        ok = bool(dp.get("attachments")) and not dp.get("error")
        said[status[1]] = f"attachments {len(dp['attachments'])}, layout {dp.get('layout')}"
    except (ValueError, KeyError, TypeError) as e:
        ok, said[status[1]] = False, f"{type(e).__name__} {e}: {said[status[1]]}"
    rows.append((status[1], ok, said[status[1]]))
    svcs: dict[str, tuple[str, str]] = {}
    try:
        svcs = {
            s["lb_ip"]: (s["mode"], s["service"])
            for s in json.loads(runs[dump[1]].stdout)["services"]
        }
        said[dump[1]] = json.dumps(svcs)
    except (ValueError, KeyError, TypeError) as e:
        said[dump[1]] = f"{type(e).__name__} {e}: {said[dump[1]]}"
    rows.append((f"{dump[1]}: both Services programmed", set(lb_ips) <= set(svcs), said[dump[1]]))
    text = runs[status[0]].stdout
    rows.append(
        (
            f"{status[0]}: XDP on eth0, one Service of each mode",
            runs[status[0]].returncode == 0
            and "eth0 xdp" in text
            and "services: 1 whole-IP, 1 port-filter" in text,
            said[status[0]],
        )
    )
    table = [line.split() for line in runs[dump[0]].stdout.splitlines()]
    rows.append(
        (
            f"{dump[0]}: a row per Service, as --json says",
            runs[dump[0]].returncode == 0
            and set(lb_ips) <= set(svcs)
            and all(
                any({ip, service, mode} <= set(r) for r in table)
                for ip, (mode, service) in svcs.items()
            ),
            said[dump[0]],
        )
    )
    return rows


def upgrade(chart: str, tag: str, readme: Path = README) -> str:
    """The README's *Upgrade and roll back* commands with the new release's packaged chart
    (`chart`, for cozyebpf-X.Y.Z.tgz) and its image's tag; LookupError when they are gone."""
    return filled(
        blocks("Upgrade and roll back", readme), **{"cozyebpf-X.Y.Z.tgz": chart, "TAG": tag}
    )
