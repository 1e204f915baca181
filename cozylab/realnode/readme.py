"""The README's commands as the real-node lab runs them (issue 46, item 5): the shell blocks of
its *Install* and *Check that it works* sections, and the example of *Troubleshoot* (`explain`
and the output the README shows for it), taken from README.md at run time, their placeholders
(REGISTRY/cozyebpf, TAG, NODE, CLIENT, LB_IP) filled with the lab's, run with the lab's kubectl
and helm. A command of the README that changed and no longer works is a failing row of
the lab, not a stale page."""

from __future__ import annotations

import re
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
