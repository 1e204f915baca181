"""The README's commands as the real-node lab runs them (issue 46, item 5): the shell blocks of
its *Install* and *Check that it works* sections, taken from README.md at run time, their
placeholders (REGISTRY/cozyebpf, TAG, NODE) filled with the lab's, run by bash with the lab's
kubectl and helm. A command of the README that changed and no longer works is a failing row of
the lab, not a stale page."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"


def blocks(section: str, readme: Path = README) -> str:
    """The `sh` blocks of the README's `## section`, in order, as one script; LookupError when
    the section or its blocks are gone (the lab's row then names what to put back)."""
    text = readme.read_text()
    m = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    if m is None:
        raise LookupError(f"{readme.name} has no section '## {section}'")
    found = re.findall(r"^```sh\n(.*?)^```", m.group(1), re.S | re.M)
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
