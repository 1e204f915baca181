"""The product holds only the product (issue 29): the wheel and the image carry `cozyebpf/`,
never the labs (`cozylab/`: the namespace labs, the cluster lab, the demo, the API double, the
fake datapath) nor `tests/`, and the product imports nothing of them."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.support.imports import imports

REPO = Path(__file__).resolve().parents[2]
LAB_MODULES = {"cluster", "netns", "demo", "kubeapi", "k8s", "fakedp"}


def test_the_wheel_holds_the_product_and_nothing_else(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for package in ("cozyebpf", "cozylab", "tests"):  # the labs lie beside it, as in a checkout
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(src),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = out.glob("cozyebpf-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"cozyebpf", wheel.name.split("-py3")[0] + ".dist-info"}, tops
    modules = {Path(n).stem for n in names if n.endswith(".py")}
    assert not modules & (LAB_MODULES | {"clusterlab", "lab", "fake"}), modules & LAB_MODULES
    assert "cozyebpf/cli.py" in names and "cozyebpf/datapath/bpf.py" in names
    # every module of the product: a package missing from pyproject.toml's list is not
    sources = {p.relative_to(REPO).as_posix() for p in (REPO / "cozyebpf").rglob("*.py")}
    assert sources - set(names) == set()


def test_the_image_copies_the_product_only() -> None:
    copies = [
        line.split()[1:-1]
        for line in (REPO / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ") and "--from=" not in line
    ]
    sources = {s.rstrip("/") for c in copies for s in c}
    assert "cozyebpf" in sources
    assert not sources & {"cozylab", "tests", "bench", "."}, sources


def test_the_product_imports_no_lab_and_no_test() -> None:
    bad = [
        f"{path.relative_to(REPO)}:{line}: {name}"
        for path, line, name in imports(sorted((REPO / "cozyebpf").rglob("*.py")))
        if name.split(".")[0] in ("cozylab", "tests", "bench")
    ]
    assert bad == []


def test_the_labs_import_nothing_from_tests() -> None:
    labs = sorted([*(REPO / "cozylab").rglob("*.py"), *(REPO / "bench").rglob("*.py")])
    bad = [
        f"{path.relative_to(REPO)}:{line}: {name}"
        for path, line, name in imports(labs)
        if name.split(".")[0] == "tests"
    ]
    assert bad == []


#: the longest a Python file of the product, the labs, the bench or the scripts may be (issue
#: 37: past it a file holds more than one concern; split it at its seams, as cozylab/cluster/)
MAX_LINES = 800


def test_no_python_file_outside_tests_is_over_800_lines() -> None:
    long = {
        path.relative_to(REPO).as_posix(): n
        for top in ("cozyebpf", "cozylab", "bench", "scripts")
        for path in sorted((REPO / top).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"split these at their seams: {long}"
