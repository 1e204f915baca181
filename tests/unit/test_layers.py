"""The control plane's layers, as the folders show them (docs/design.md, *The layers of the
control plane*): the datapath at the bottom, the pure model, the Kubernetes client side
(`cozyebpf.kube`) and the sources above them, the agent, the CLI and the servers on top. Each
test reads the imports of a layer's files (at the top or inside a function) and names every
one that reaches up."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support.imports import imports

PRODUCT = Path(__file__).resolve().parents[2] / "cozyebpf"


def _files(*parts: str) -> list[Path]:
    here = PRODUCT.joinpath(*parts)
    return sorted(here.glob("*.py")) if here.is_dir() else [here.with_suffix(".py")]


def _outside(paths: list[Path], allowed: tuple[str, ...], foreign: tuple[str, ...]) -> list[str]:
    """Each import of `paths` of a cozyebpf module not under one of `allowed`, or of one of the
    `foreign` packages, as file:line: module."""
    bad = []
    for path, line, name in imports(paths):
        top = name.split(".")[0]
        ours = name == "cozyebpf" or any(name == a or name.startswith(a + ".") for a in allowed)
        if (top == "cozyebpf" and not ours) or top in foreign:
            bad.append(f"{path.relative_to(PRODUCT)}:{line}: {name}")
    return bad


#: what the datapath may import of cozyebpf: itself, the state it programs, the errors
#: the package root itself holds only __version__ (the release the pins record)
BELOW_THE_DATAPATH = ("cozyebpf.datapath", "cozyebpf.state", "cozyebpf.errors")
#: what the model may import: itself and the state it computes
BELOW_THE_MODEL = ("cozyebpf.model", "cozyebpf.state")
#: what the Kubernetes client side may import: itself, the model's records and Problems, the
#: state, the errors, and the datapath's pure helpers (portsec: is_pattern)
BELOW_KUBE = ("cozyebpf.kube", "cozyebpf.model", "cozyebpf.state", "cozyebpf.errors")


def test_the_datapath_imports_nothing_above_it() -> None:
    """cozyebpf.datapath is the bottom layer: no module of it imports the model, the sources,
    the agent, the controller, the CLI or a presentation module (dump, monitor, ...), nor the
    kubernetes client."""
    assert _outside(_files("datapath"), BELOW_THE_DATAPATH, ("kubernetes",)) == []


def test_the_model_is_pure() -> None:
    """The model reads objects and computes the desired state: no datapath, no source, no
    Kubernetes client, no bcc (STYLE.md)."""
    assert _outside(_files("model"), BELOW_THE_MODEL, ("kubernetes", "bcc", "pyroute2")) == []


def test_the_kube_package_imports_nothing_above_it() -> None:
    """cozyebpf.kube (the client, Events, port security, the metrics' reviews) reaches neither
    the sources nor the agent, the controller, the CLI or the servers that use it."""
    allowed = (*BELOW_KUBE, "cozyebpf.datapath.attach")
    assert _outside(_files("kube"), allowed, ()) == []


def test_only_the_kube_client_imports_the_kubernetes_package() -> None:
    """The official client is imported in one module (`cozyebpf/kube/client.py`); the rest of
    the product talks to the API server through it (KubeRest, api_client)."""
    everything = sorted(PRODUCT.rglob("*.py"))
    users = sorted(
        {
            path.relative_to(PRODUCT).as_posix()
            for path, _, name in imports(everything)
            if name.split(".")[0] == "kubernetes"
        }
    )
    assert users == ["kube/client.py"]


def _circles(graph: dict[str, set[str]]) -> list[str]:
    """Each node of `graph` that reaches itself again, with the way round, as "a -> b -> a"."""

    def circle(start: str) -> list[str] | None:
        todo, seen = [(start, [start])], set()
        while todo:
            here, trail = todo.pop()
            for there in sorted(graph.get(here, ())):
                if there == start:
                    return [*trail, there]
                if there not in seen:
                    seen.add(there)
                    todo.append((there, [*trail, there]))
        return None

    return [" -> ".join(c) for m in sorted(graph) if (c := circle(m))]


def test_the_bench_has_no_import_circle() -> None:
    """bench/'s modules import one another in one direction (the parts measure, the reports
    summarize and draw): no module reaches, through others, back to itself. `from bench import
    x` counts as an import of bench.x."""
    bench = PRODUCT.parent / "bench"
    graph: dict[str, set[str]] = {p.stem: set() for p in bench.glob("*.py")}
    for path, _, name in imports(sorted(bench.glob("*.py"))):
        if name.startswith("bench."):
            graph[path.stem].add(name.split(".")[1])
    for path in sorted(bench.glob("*.py")):  # from bench import x, y
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "bench":
                graph[path.stem] |= {a.name for a in node.names if a.name in graph}
    assert _circles(graph) == []


def test_the_product_has_no_import_circle() -> None:
    """No module of cozyebpf/ reaches, through others, back to itself, counting the imports
    inside functions too (a circle broken only by importing late is still a circle).
    `from cozyebpf.a import b` counts as an import of cozyebpf.a.b where that is a module."""
    root = PRODUCT.parent

    def module(path: Path) -> str:
        parts = path.relative_to(root).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    files = sorted(PRODUCT.rglob("*.py"))
    graph: dict[str, set[str]] = {module(p): set() for p in files}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]
                targets = [n for n in names if n in graph] or [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[module(path)] |= {t for t in targets if t in graph and t != module(path)}
    # a package's __init__ hands its modules' names on: an arrow into it is not one back
    for pkg in [m for m in graph if (root / m.replace(".", "/") / "__init__.py").exists()]:
        graph[pkg] = {t for t in graph[pkg] if not t.startswith(pkg + ".")}
    assert _circles(graph) == []


BPF = PRODUCT.parent / "bpf"
_INCLUDE = re.compile(r'^#include "([^"]+)"', re.M)
_DEFINED = re.compile(r"^static __always_inline [^(]*?\b(\w+)\(", re.M)
_CALL = re.compile(r"\b(\w+)\(")


def _includes(path: Path) -> list[Path]:
    return [(path.parent / n).resolve() for n in _INCLUDE.findall(path.read_text())]


def test_bpf_includes_run_one_way() -> None:
    """bpf/: one entry file per hook, each including the headers it uses and no other entry
    file (bpf/cozyebpf.c alone gathers them); a header never includes an entry file, no
    header is an umbrella that only includes others, and no include runs in a circle."""
    entries = sorted(p for p in BPF.glob("*.c") if p.name != "cozyebpf.c")
    headers = sorted((BPF / "lib").glob("*.h"))
    assert {p.name for p in entries} == {"ingress.c", "ingress_tc.c", "egress.c", "pod.c"}
    bad = [
        f"{p.name} includes {i.name}"
        for p in entries + headers
        for i in _includes(p)
        if i.suffix == ".c"
    ]
    for h in headers:
        body = re.sub(r"/\*.*?\*/|//[^\n]*", "", h.read_text(), flags=re.S)
        if all(ln.startswith("#") or not ln.strip() for ln in body.splitlines()):
            bad.append(f"lib/{h.name} holds nothing but includes")
    graph = {p.name: {i.name for i in _includes(p)} for p in headers}
    bad += [f"circle: {c}" for c in _circles(graph)]
    assert bad == []


def test_each_bpf_entry_file_includes_what_it_calls() -> None:
    """An entry file includes, itself, the header of each function of bpf/lib it calls (not
    through another header), so that moving a function between headers shows where it is
    used."""
    where = {
        name: h.name
        for h in sorted((BPF / "lib").glob("*.h"))
        for name in _DEFINED.findall(h.read_text())
    }
    bad = []
    for entry in sorted(p for p in BPF.glob("*.c") if p.name != "cozyebpf.c"):
        text = re.sub(r"/\*.*?\*/|//[^\n]*", "", entry.read_text(), flags=re.S)
        own = set(_DEFINED.findall(text))
        direct = {i.name for i in _includes(entry)}
        for name in sorted(set(_CALL.findall(text)) - own):
            if name in where and where[name] not in direct:
                bad.append(f"{entry.name} calls {name} of lib/{where[name]} without including it")
    assert bad == []
