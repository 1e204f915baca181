"""The absolute imports of Python files, for the tests that hold the layers apart."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path


def imports(paths: Iterable[Path]) -> Iterator[tuple[Path, int, str]]:
    """(file, line, module) of every absolute import in `paths`, at the top or inside a
    function (`from x import y` gives x)."""
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                yield from ((path, node.lineno, a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                yield path, node.lineno, node.module or ""
