"""The bench's variants of the product's programs, built without switches in the product's C.

A variant is a file of bench/bpf/variants/: it includes a product source (`#include
"../../../bpf/egress.c"`) and then defines again the one or two functions it varies. `build`
flattens it as the loader does (every quoted include inlined once), puts each function defined
twice in place of the product's definition (so everything that calls it, before or after, calls
the variant's) and loads the result like a product source. A function the product no longer
defines, or defines differently named, is an error that names it: the variant must follow.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

from cozyebpf.datapath import loader
from cozyebpf.datapath.loader import Program

VARIANTS = Path(__file__).resolve().parent / "bpf" / "variants"

#: a function's definition at the start of a line: `static __always_inline int name(`
_DEFINITION = re.compile(r"^static __always_inline [^;{}()]*?\b(\w+)\(", re.M)


def _end_of_body(text: str, start: int) -> int:
    """The index after the closing brace of the function whose definition starts at `start`."""
    depth = 0
    i = text.index("{", start)
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError(f"no end of the function at offset {start}")


def splice(text: str, what: str) -> str:
    """`text` (a flattened variant) with each function defined twice reduced to one: the later
    definition (the variant's) in the place of the earlier (the product's)."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for m in _DEFINITION.finditer(text):
        spans.setdefault(m.group(1), []).append((m.start(), _end_of_body(text, m.start())))
    twice = {name: s for name, s in spans.items() if len(s) > 1}
    if not twice:
        raise ValueError(f"{what} defines no function of the product again: nothing to vary")
    edits: list[tuple[int, int, str]] = []  # (start, end, new text)
    for name, defs in twice.items():
        if len(defs) != 2:
            raise ValueError(f"{what}: {name} is defined {len(defs)} times")
        (p0, p1), (v0, v1) = defs
        edits += [(p0, p1, text[v0:v1]), (v0, v1, "")]
    for start, end, new in sorted(edits, reverse=True):  # from the end: offsets stay right
        text = text[:start] + new + text[end:]
    return text


def build(
    variant: str, func: str, prog_type: str, pin_dir: str, extra: Sequence[str] = ()
) -> Program:
    """Compile bench/bpf/variants/<variant> and load `func` from it, as loader.load does a
    product source (its full paths into the pinned prog arrays included)."""
    path = VARIANTS / variant
    text = splice(loader.flatten(path), str(path))
    with tempfile.TemporaryDirectory(prefix="czbench-variant-") as tmp:
        source = Path(tmp) / variant
        source.write_text(text)
        return loader.load(str(source), func, prog_type, pin_dir, extra)
