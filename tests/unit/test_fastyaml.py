"""fastyaml builds the same objects as PyYAML's SafeLoader: for random documents in every
style PyYAML writes (block, flow, quoted), for the scalars YAML 1.1 resolves (booleans such as
`yes`, octal and sexagesimal integers, floats, nulls, timestamps), and for manifests as users
write them; what it leaves out (anchors, aliases, merge keys, tags) is refused with
Unsupported, never read differently. The manifest source then falls back to PyYAML."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from cozyebpf.sources import fastyaml
from cozyebpf.sources.manifest import ManifestSource

# plain scalars that YAML 1.1 resolves to something other than a string, and near misses
TRICKY = [
    "yes",
    "No",
    "ON",
    "off",
    "y",
    "n",
    "true",
    "False",
    "~",
    "null",
    "Null",
    "",
    "0x1F",
    "0o17",
    "017",
    "0b101",
    "1_000",
    "+12",
    "-0",
    "1:20",
    "190:20:30",
    "1.5",
    "1e3",
    "1.0e+3",
    ".inf",
    "-.Inf",
    ".nan",
    "2024-01-01",
    "2024-01-01T00:00:00Z",
    "2001-12-14 21:59:43.10 -5",
    "=",
    "<<",
    "10.244.0.5",
    "010.1.2.3",
    "192.0.2.1:80",
    "TCP",
    "- x",
    "#not a comment",
    "a: b",
    "'q'",
    "2001:db8::1",
    "-",
    "?",
    "1,000",
]

scalars = st.one_of(
    st.sampled_from(TRICKY),
    st.text(max_size=12),
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=False),
    st.booleans(),
    st.none(),
)
keys = st.one_of(st.sampled_from(TRICKY[:20]), st.text(min_size=1, max_size=8), st.integers())
values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(keys, children, max_size=4)
    ),
    max_leaves=20,
)
documents = st.lists(st.one_of(values, st.dictionaries(keys, values, max_size=5)), max_size=4)


def safe(text: str) -> list[Any]:
    return list(yaml.load_all(text, Loader=yaml.SafeLoader))


def fast(text: str) -> list[Any]:
    return [doc for doc, _ in fastyaml.documents(text)]


@settings(max_examples=300, deadline=None)
@given(
    docs=documents,
    flow=st.sampled_from([None, True, False]),
    style=st.sampled_from([None, '"', "'"]),
)
def test_random_documents_read_as_safeloader_reads_them(
    docs: list[Any], flow: bool | None, style: str | None
) -> None:
    text = yaml.safe_dump_all(docs, default_flow_style=flow, default_style=style)
    try:
        got = fast(text)
    except fastyaml.Unsupported:
        # quoted styles tag non-strings explicitly (!!int "0"); merge keys and the value tag
        assert "!!" in text or "<<" in text or "=" in text
        return
    assert got == safe(text)


@pytest.mark.parametrize("value", TRICKY)
def test_plain_scalars_resolve_as_in_yaml_1_1(value: str) -> None:
    text = f"a: {value}\nb: [{value}]\n" if value and value[0] not in "-?#'" else f"a: '{value}'\n"
    try:
        want = safe(text)
    except yaml.YAMLError:
        with pytest.raises((yaml.YAMLError, fastyaml.Unsupported)):
            fast(text)
        return
    try:
        got = fast(text)
    except fastyaml.Unsupported:
        assert value in ("=", "<<")  # the value tag and a merge key: left to PyYAML
        return
    assert got == want


@pytest.mark.parametrize(
    "text",
    [
        "a: &x 1\nb: *x\n",
        "base: &b {x: 1}\nderived:\n  <<: *b\n  y: 2\n",
        "a: !!str 1\n",
        "a: !custom 1\n",
        "? [1, 2]\n: complex key\n",
        "--- !!set\n? a\n",
    ],
    ids=["alias", "merge-key", "str-tag", "local-tag", "complex-key", "set-tag"],
)
def test_what_it_leaves_out_is_refused(text: str) -> None:
    with pytest.raises(fastyaml.Unsupported):
        fast(text)


def test_the_manifest_source_falls_back_for_what_fastyaml_refuses(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(
        "kind: List\nitems:\n- kind: Service\n  metadata: &m\n    name: a\n    namespace: x\n"
        "- kind: Service\n  metadata:\n    <<: *m\n    name: b\n"
    )
    names = [
        (o["metadata"]["namespace"], o["metadata"]["name"]) for o in ManifestSource(path).load()
    ]
    assert names == [("x", "a"), ("x", "b")]


def test_document_lines_name_where_a_document_starts() -> None:
    text = "a: 1\n---\n\n# comment\nb: 2\n--- \n- x\n"
    assert [(d, line + 1) for d, line in fastyaml.documents(text)] == [
        ({"a": 1}, 1),
        ({"b": 2}, 5),
        (["x"], 7),
    ]
