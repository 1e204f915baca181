"""The manifest source: Kubernetes objects from a multi-document YAML file, re-read on change.

The file holds Services and EndpointSlices as `kubectl get -o yaml` prints them (one object per
document, or one `kind: List` with `items`). The agent polls `changed()` and calls `load()` when
it returns True; a file that cannot be read or parsed raises SourceError, and the agent keeps the
previous state programmed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from cozyebpf.errors import SourceError

_KEEP = "the previous state stays programmed"
Signature = tuple[int, int, int]  # (st_mtime_ns, st_size, st_ino)


def _what(value: object) -> str:
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return f"a {type(value).__name__}"


def _position(data: str | bytes, offset: int) -> str:
    """`offset` into `data` as "line L, column C" (both from 1; a column counts characters in
    text, bytes in data that could not be decoded)."""
    if isinstance(data, bytes):
        line, start = data.count(b"\n", 0, offset), data.rfind(b"\n", 0, offset) + 1
    else:
        line, start = data.count("\n", 0, offset), data.rfind("\n", 0, offset) + 1
    return f"line {line + 1}, column {offset - start + 1}"


class ManifestSource:
    """A YAML manifest file as a source of Kubernetes objects."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._loaded: Signature | None = None  # signature of the content last parsed

    def _signature(self) -> Signature | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def changed(self) -> bool:
        """True on the first call, when the file's (mtime, size, inode) differ from what the last
        load() parsed (an in-place write or an editor's atomic rename), and while the file cannot
        be stat'ed, so that load() reports why."""
        sig = self._signature()
        return sig is None or sig != self._loaded

    def load(self) -> list[dict[str, Any]]:
        """The objects in the file: one per non-empty document, the `items` of a `kind: List`
        flattened. Raises SourceError naming the file (and, for YAML errors, line and column).

        A file that parsed, or failed to parse, is not reported as changed again until it is
        rewritten; a file that could not be read is.
        """
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                data = f.read()
        except FileNotFoundError:
            raise SourceError(f"{self.path}: no such file; {_KEEP}") from None
        except OSError as e:
            raise SourceError(f"{self.path}: cannot be read: {e.strerror or e}; {_KEEP}") from e
        self._loaded = (st.st_mtime_ns, st.st_size, st.st_ino)
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise SourceError(
                f"{self.path}: {_position(data, e.start)}: byte 0x{data[e.start]:02x} is not "
                f"valid UTF-8; save the file as UTF-8; {_KEEP}"
            ) from None
        return self._parse(text)

    def _parse(self, text: str) -> list[dict[str, Any]]:
        """Parse with libyaml (CSafeLoader, 4-8x faster: bench/); a file it refuses is parsed
        again with the pure-Python loader, whose messages the errors below are written for."""
        fast = getattr(yaml, "CSafeLoader", None)
        if fast is not None:
            try:
                return self._parse_with(text, fast)
            except SourceError:
                pass  # let the precise parser say it
        return self._parse_with(text, yaml.SafeLoader)

    def _parse_with(self, text: str, loader_class: Any) -> list[dict[str, Any]]:
        objects: list[dict[str, Any]] = []
        try:
            loader = loader_class(text)
        except yaml.reader.ReaderError as e:  # the reader checks every character up front
            raise SourceError(self._reader_message(text, e)) from None
        try:
            number = 0
            while loader.check_node():
                node = loader.get_node()
                if node is None:
                    break
                number += 1
                doc = loader.construct_document(node)
                where = f"document {number} (line {node.start_mark.line + 1})"
                if doc is None:
                    continue
                if not isinstance(doc, Mapping):
                    raise SourceError(
                        f"{self.path}: {where} is {_what(doc)}, not a Kubernetes object; "
                        f"fix its indentation or remove it; {_KEEP}"
                    )
                if doc.get("kind") == "List":
                    items = doc.get("items")
                    if items is None:
                        continue
                    if not isinstance(items, list):
                        raise SourceError(
                            f"{self.path}: {where}: items of a List must be a list but is "
                            f"{_what(items)}; fix the file; {_KEEP}"
                        )
                    for i, item in enumerate(items):
                        if item is None:
                            continue
                        if not isinstance(item, Mapping):
                            raise SourceError(
                                f"{self.path}: {where}: items[{i}] is {_what(item)}, not a "
                                f"Kubernetes object; fix or remove it; {_KEEP}"
                            )
                        objects.append(dict(item))
                else:
                    objects.append(dict(doc))
        except yaml.MarkedYAMLError as e:
            raise SourceError(self._yaml_message(e)) from None
        except yaml.reader.ReaderError as e:
            raise SourceError(self._reader_message(text, e)) from None
        except yaml.YAMLError as e:
            raise SourceError(f"{self.path}: {e}; {_KEEP}") from None
        finally:
            loader.dispose()
        return objects

    def _reader_message(self, text: str, e: yaml.reader.ReaderError) -> str:
        char = f"#x{e.character:04x}" if isinstance(e.character, int) else repr(e.character)
        return (
            f"{self.path}: {_position(text, e.position)}: character {char} is not allowed in "
            f"YAML; remove it; {_KEEP}"
        )

    def _yaml_message(self, e: yaml.MarkedYAMLError) -> str:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        what = e.problem or e.context or "invalid YAML"
        if e.problem and e.context:
            what += f" ({e.context}"
            if e.context_mark:
                what += f" that starts at line {e.context_mark.line + 1}"
            what += ")"
        return f"{self.path}: {where}{what}; {_KEEP}"
