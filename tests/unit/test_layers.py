"""The control plane's layers, as the folders show them (docs/design.md, *The layers of the
control plane*): the datapath at the bottom, the pure model, the Kubernetes client side
(`cozyebpf.kube`) and the sources above them, the agent, the CLI and the servers on top. Each
test reads the imports of a layer's files (at the top or inside a function) and names every
one that reaches up."""

from __future__ import annotations

import ast
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

    circles = {m: c for m in sorted(graph) if (c := circle(m))}
    assert circles == {}, " | ".join(" -> ".join(c) for c in circles.values())
