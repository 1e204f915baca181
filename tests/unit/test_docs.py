"""The documents against the code (issue 46): one truth in every document.

- The README's table of the Events the agent records: every message the code can give a
  Service or EndpointSlice (each `Problem` and each bad field's message in cozyebpf/) has a row,
  and every row names words the code says, so neither can change alone.
- The kernels, the Kubernetes release and the defaults the operator's documents state are the
  code's own constants.
- Every relative link of the operator's documents reaches a file, and a heading there.
No figure is read from prose: measured figures live in files programs write (bench/results/,
bpf/verifier-budgets.json)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from cozyebpf.config import DEFAULT_GUARD
from cozyebpf.datapath import kernel, layout

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
#: the documents an operator reads, held to the code's constants and to their links
OPERATOR_DOCS = [
    README,
    REPO / "charts" / "cozyebpf" / "README.md",
    REPO / "deploy" / "README.md",
    REPO / "vagrant" / "README.md",
]
ALL_DOCS = [*OPERATOR_DOCS, *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "README.md"]


# -- the Events -------------------------------------------------------------------------------


def event_rows() -> list[list[list[str]]]:
    """The README's Events table: per row, its alternatives (`a` ... `b` or `c`), each a list of
    fragments that must appear in this order in one message."""
    text = README.read_text()
    table = text.partition("| the Event says | what it means | the fix |")[2]
    assert table, "the README has no table of the Events (| the Event says | ...)"
    rows = []
    for line in table.split("\n")[2:]:
        if not line.startswith("|"):
            break
        cell = line.split(" | ")[0].lstrip("| ")
        alternatives = [re.findall(r"`([^`]+)`", alt) for alt in re.split(r"(?<=`) or (?=`)", cell)]
        assert all(alternatives), f"a row of the Events table names no words: {line}"
        rows.append(alternatives)
    return rows


def _text(node: ast.expr) -> str | None:
    """A message's text with `{}` for each value put in; None when it is not written here."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def code_messages() -> dict[str, str]:
    """Every message the agent can give an object: the texts of `Problem(...)` and
    `_Invalid(...)` in cozyebpf/, and of the functions that write the others (the limits'
    and port security's), as 'file:line' -> text."""
    out = {}
    for path in sorted((REPO / "cozyebpf").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", getattr(node.func, "attr", ""))
            if name not in ("Problem", "_Invalid", "append"):
                continue
            texts = [t for t in map(_text, node.args) if t and len(t) > 20]
            if name == "append" and not (path.name == "limits.py" and texts):
                continue
            for t in texts[:1]:
                out[f"{path.relative_to(REPO)}:{node.lineno}"] = t
    portsec = (REPO / "cozyebpf" / "kube" / "portsec.py").read_text()
    fn = next(
        n
        for n in ast.walk(ast.parse(portsec))
        if isinstance(n, ast.FunctionDef) and n.name == "problem_message"
    )
    ret = next(n for n in ast.walk(fn) if isinstance(n, ast.Return))
    assert ret.value is not None
    parts = ret.value.values if isinstance(ret.value, ast.JoinedStr) else [ret.value]
    out["cozyebpf/kube/portsec.py:problem_message"] = "".join(
        p.value if isinstance(p, ast.Constant) else "{}" for p in parts
    )
    return out


def matches(alternatives: list[list[str]], message: str) -> bool:
    for fragments in alternatives:
        at = 0
        for f in fragments:
            at = message.find(f, at)
            if at < 0:
                break
            at += len(f)
        else:
            return True
    return False


def test_every_message_of_the_agent_has_a_row_in_the_readme() -> None:
    rows = event_rows()
    messages = code_messages()
    assert len(messages) > 30, f"the messages were not found in cozyebpf/: {messages}"
    missing = {where: m for where, m in messages.items() if not any(matches(r, m) for r in rows)}
    assert not missing, (
        "the README's Events table (Troubleshoot) has no row for these messages; add one "
        f"that says what each means and the fix: {missing}"
    )


def test_every_row_of_the_readme_is_a_message_of_the_agent() -> None:
    messages = list(code_messages().values())
    stale = [r for r in event_rows() if not any(matches([alt], m) for alt in r for m in messages)]
    assert not stale, f"rows of the README's Events table that no message says: {stale}"
    # each alternative of a row is said somewhere, not just one of them
    dead = [alt for r in event_rows() for alt in r if not any(matches([alt], m) for m in messages)]
    assert not dead, f"words of the README's Events table that no message says: {dead}"


def test_the_matching_cannot_pass_on_anything() -> None:
    """The rows do not match every message: a message nothing documents fails."""
    rows = event_rows()
    assert not any(matches(r, "is frobnicated beyond repair; call someone") for r in rows)


# -- one truth ----------------------------------------------------------------------------------


def _v(t: tuple[int, int]) -> str:
    return f"{t[0]}.{t[1]}"


@pytest.mark.parametrize("doc", OPERATOR_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_the_kernels_each_document_names_are_the_codes(doc: Path) -> None:
    text = " ".join(doc.read_text().split())
    for m in re.finditer(r"Linux (\d+\.\d+) or later", text):
        assert m.group(1) == _v(kernel.MINIMUM), f"{doc.name}: {m.group(0)}: the code refuses "
    for m in re.finditer(r"tcx from (\d+\.\d+)|needs? ≥ ?(\d+\.\d+)", text):
        said = m.group(1) or m.group(2)
        assert said == _v(kernel.TCX), f"{doc.name}: '{m.group(0)}', but tcx is {_v(kernel.TCX)}"


def test_the_readme_says_the_kernel_minimum_and_tcx() -> None:
    text = " ".join(README.read_text().split())
    assert f"Linux {_v(kernel.MINIMUM)} or later" in text
    assert f"tcx from {_v(kernel.TCX)}" in text


def kubernetes_release() -> str:
    mod = (REPO / "cozylab" / "controlplane" / "kube" / "go.mod").read_text()
    m = re.search(r"^\s*k8s\.io/kubernetes v(\d+\.\d+\.\d+)", mod, re.M)
    assert m, "cozylab/controlplane/kube/go.mod requires no k8s.io/kubernetes"
    return m.group(1)


def test_the_kubernetes_release_the_labs_prove_is_the_one_built() -> None:
    release = kubernetes_release()
    for doc in ALL_DOCS:
        for m in re.finditer(r"Kubernetes (1\.\d+\.\d+)", doc.read_text()):
            assert m.group(1) == release, f"{doc.relative_to(REPO)}: {m.group(0)}, built {release}"


def test_the_defaults_the_documents_state_are_the_codes() -> None:
    chart = (REPO / "charts" / "cozyebpf" / "README.md").read_text()
    values = (REPO / "charts" / "cozyebpf" / "values.yaml").read_text()
    m = re.search(r"^\| `agent\.maxServices` \| `?(\d+)`? \|", chart, re.M)
    assert m and int(m.group(1)) == layout.DEFAULT_MAX_SERVICES, "chart README's maxServices"
    assert re.search(rf"^\s*maxServices: {layout.DEFAULT_MAX_SERVICES}\b", values, re.M)
    readme = " ".join(README.read_text().split())
    assert f"`agent.guardPacketRate`, {DEFAULT_GUARD} by default" in readme
    m = re.search(r'^\s*guardPacketRate: "?([^"\s]+)"?', values, re.M)
    assert m and m.group(1) == DEFAULT_GUARD, "values.yaml's guardPacketRate"


# -- links --------------------------------------------------------------------------------------


def anchors(doc: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    out = set()
    for h in re.findall(r"^#+ (.+)$", doc.read_text(), re.M):
        slug = re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


@pytest.mark.parametrize("doc", ALL_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_reaches_a_file_and_a_heading(doc: Path) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
            broken.append(target)
    assert not broken, f"{doc.relative_to(REPO)}: links that reach nothing: {broken}"


def test_the_readmes_commands_are_what_the_real_node_lab_runs(tmp_path: Path) -> None:
    """Issue 46, item 5: the real-node lab runs the README's Install and Check blocks
    (cozylab/realnode/readme.py, the install step); here, quickly, that they are there with
    the placeholders the lab fills, and that a block or a placeholder gone is an error that
    says so, not a lab that installs some other way."""
    from cozylab.realnode.readme import blocks, filled

    install = blocks("Install")
    assert "helm install cozyebpf charts/cozyebpf" in install
    filled(install, **{"REGISTRY/cozyebpf": "lab/cozyebpf", "TAG": "t"})
    assert "cozyebpf status" in filled(blocks("Check that it works"), NODE="node-1")
    readme = tmp_path / "README.md"
    readme.write_text("## Install\n\nno commands\n\n## Check that it works\n```sh\nls NODES\n```\n")
    with pytest.raises(LookupError, match="no ```sh block"):
        blocks("Install", readme)
    with pytest.raises(LookupError, match="no placeholder NODE"):
        filled(blocks("Check that it works", readme), NODE="node-1")


def test_the_readmes_upgrade_and_operate_commands_are_what_the_lab_runs(tmp_path: Path) -> None:
    """The real-node lab upgrades with the README's *Upgrade and roll back* block (its chart
    and TAG filled) and runs the *Operate* table's `status` and `maps dump` in both forms; here
    that the block keeps the installed values, and that the rows fail on what they must."""
    from subprocess import CompletedProcess

    from cozylab.realnode.readme import forms, inline, operated, upgrade

    script = upgrade("/w/cozyebpf-1.2.3.tgz", "v1.2.3")
    assert "helm upgrade cozyebpf /w/cozyebpf-1.2.3.tgz" in script
    assert "--reset-then-reuse-values" in script and "image.tag=v1.2.3" in script
    readme = tmp_path / "README.md"
    readme.write_text("## Upgrade and roll back\n```sh\nhelm upgrade cozyebpf charts/x\n```\n")
    with pytest.raises(LookupError, match=r"no placeholder cozyebpf-X\.Y\.Z\.tgz"):
        upgrade("c.tgz", "t", readme)

    status = forms(inline("Operate", "cozyebpf status"))
    dump = forms(inline("Operate", "cozyebpf maps dump"))
    assert status == ["cozyebpf status", "cozyebpf status --json"]
    assert dump == ["cozyebpf maps dump", "cozyebpf maps dump --json"]
    lbs = ("203.0.113.10", "203.0.113.11")
    svcs = [
        {"lb_ip": lbs[0], "mode": "whole-ip", "service": "ns/vm"},
        {"lb_ip": lbs[1], "mode": "port-filter", "service": "ns/web"},
    ]

    def ran(out: str) -> CompletedProcess[str]:
        return CompletedProcess([], 0, out, "")

    good = {
        status[0]: ran("attached: eth0 xdp (cz_ingress)\nservices: 1 whole-IP, 1 port-filter (2)"),
        status[1]: ran(json.dumps({"datapath": {"attachments": [{}], "layout": {}}})),
        dump[0]: ran(f"  {lbs[0]} 10.0.0.1 ns/vm whole-ip\n  {lbs[1]} 10.0.0.2 ns/web port-filter"),
        dump[1]: ran(json.dumps({"services": svcs})),
    }
    assert all(ok for _, ok, _ in operated(status, dump, good, lbs))
    # the plain dump missing a Service's row, or naming it with another mode
    for text in (
        f"  {lbs[0]} 10.0.0.1 ns/vm whole-ip",
        f"  {lbs[0]} ns/vm port-filter\n  {lbs[1]} ns/web port-filter",
    ):
        rows = operated(status, dump, {**good, dump[0]: ran(text)}, lbs)
        assert [ok for _, ok, _ in rows] == [True, True, True, False], rows
    rows = operated(status, dump, {**good, status[0]: ran("attached: nothing")}, lbs)
    assert [ok for _, ok, _ in rows] == [True, True, False, True], rows
    rows = operated(status, dump, {**good, dump[1]: ran("not json")}, lbs)
    assert [ok for _, ok, _ in rows] == [True, False, True, False], rows
