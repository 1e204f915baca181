"""YAML documents from libyaml's events, built without PyYAML's composer and constructor.

PyYAML's C loader (CSafeLoader) parses in C but composes nodes and constructs objects in
Python, node by node: about 2.3 s for the 9 MB manifest of 10k Services here, most of it in
that Python layer. Manifests use a small part of YAML (mappings, sequences, plain and quoted
scalars), so this module builds the objects straight from the C parser's events, resolving
plain scalars with the same implicit resolvers as SafeLoader (YAML 1.1: `yes` is true, `010`
is 8, unquoted timestamps are datetimes) and constructing non-strings with SafeLoader's own
constructors: the result is SafeLoader's, about three times faster.

Anything else (anchors and aliases, explicit tags, merge keys, complex keys) raises
Unsupported, and the caller reads the file with CSafeLoader instead; a YAML error is raised as
PyYAML raises it. tests/unit/test_fastyaml.py checks the results against SafeLoader.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import yaml
from yaml.events import (
    AliasEvent,
    DocumentEndEvent,
    MappingEndEvent,
    MappingStartEvent,
    ScalarEvent,
    SequenceEndEvent,
    SequenceStartEvent,
    StreamEndEvent,
)
from yaml.nodes import ScalarNode

STR = "tag:yaml.org,2002:str"
MAP = "tag:yaml.org,2002:map"
SEQ = "tag:yaml.org,2002:seq"
MERGE = "tag:yaml.org,2002:merge"


class Unsupported(Exception):
    """The text uses YAML that this reader leaves to PyYAML."""


def available() -> bool:
    return hasattr(yaml, "CSafeLoader")


class _Reader:
    def __init__(self, text: str) -> None:
        self.loader = yaml.CSafeLoader(text)
        self.resolvers = self.loader.yaml_implicit_resolvers
        self.wildcard = self.resolvers.get(None, [])
        self.constructors = yaml.constructor.SafeConstructor.yaml_constructors
        self._cache: dict[str, str] = {}

    def tag(self, value: str) -> str:
        """The tag SafeLoader's resolver gives a plain scalar."""
        tag = self._cache.get(value)
        if tag is not None:
            return tag
        tag = STR
        for t, regexp in self.resolvers.get(value[0] if value else "", []) + self.wildcard:
            if regexp.match(value):
                tag = t
                break
        if len(self._cache) < 4096:
            self._cache[value] = tag
        return tag

    def scalar(self, ev: Any) -> Any:
        if ev.anchor is not None or (ev.tag is not None and ev.tag != "!"):
            raise Unsupported("an anchor or an explicit tag")
        if not ev.implicit[0]:  # quoted (or a "!" tag on a plain one): a string
            return ev.value
        tag = self.tag(ev.value)
        if tag == STR:
            return ev.value
        if tag == MERGE or tag not in self.constructors:
            raise Unsupported(f"the tag {tag}")
        node = ScalarNode(tag, ev.value, ev.start_mark, ev.end_mark, ev.style)
        return self.constructors[tag](self.loader, node)

    def value(self, ev: Any) -> Any:
        get: Any = self.loader.get_event
        cls = type(ev)
        if cls is ScalarEvent:
            return self.scalar(ev)
        if cls is MappingStartEvent:
            if ev.anchor is not None or (ev.tag is not None and ev.tag not in ("!", MAP)):
                raise Unsupported("an anchor or an explicit tag")
            out: dict[Any, Any] = {}
            while True:
                k = get()
                if type(k) is MappingEndEvent:
                    return out
                if type(k) is not ScalarEvent:
                    raise Unsupported("a complex key or an alias")
                key = self.scalar(k)
                out[key] = self.value(get())
        if cls is SequenceStartEvent:
            if ev.anchor is not None or (ev.tag is not None and ev.tag not in ("!", SEQ)):
                raise Unsupported("an anchor or an explicit tag")
            items: list[Any] = []
            while True:
                item = get()
                if type(item) is SequenceEndEvent:
                    return items
                items.append(self.value(item))
        if cls is AliasEvent:
            raise Unsupported("an alias")
        raise Unsupported(f"the event {cls.__name__}")  # pragma: no cover (libyaml's order)


def documents(text: str) -> Iterator[tuple[Any, int]]:
    """(document, its first line, from 0) for each document of `text`; raises Unsupported or
    yaml.YAMLError (never at the same place SafeLoader would not)."""
    r = _Reader(text)
    get: Any = r.loader.get_event
    try:
        get()  # StreamStartEvent
        while True:
            if type(get()) is StreamEndEvent:  # else a DocumentStartEvent
                return
            content = get()
            doc = r.value(content)
            end = get()
            assert type(end) is DocumentEndEvent, end
            yield doc, content.start_mark.line
    finally:
        r.loader.dispose()
