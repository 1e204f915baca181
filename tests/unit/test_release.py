"""The release holds together (issue 30): one version in every place that names it, a
CHANGELOG section for it, and `make release` (scripts/release.py) producing what a platform
vendors: the packaged chart, the release notes (the image needs a builder and is not built
here: scripts/image-test.sh builds and tests the same Dockerfile)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from click.testing import CliRunner

from cozyebpf import __version__
from cozyebpf.cli import main
from cozyebpf.datapath.layout import LAYOUT_VERSION, OLDEST_COMPATIBLE
from tests.support.prereqs import find_helm

REPO = Path(__file__).resolve().parents[2]


def load_release() -> ModuleType:
    spec = importlib.util.spec_from_file_location("release", REPO / "scripts" / "release.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


release = load_release()


@pytest.fixture(scope="module")
def helm() -> str:
    found = find_helm()
    assert found is not None, "checked at collection (tests/support/prereqs.py, FIXTURES)"
    return found


def test_every_place_names_the_same_release() -> None:
    assert release.problems(REPO) == []
    v = release.versions(REPO)
    assert v["pyproject.toml"] == __version__
    assert v["Chart.yaml appVersion"] == v["Chart.yaml version"] == __version__
    assert v["values.yaml image.tag"] == f"v{__version__}"
    assert release.layout(REPO) == (LAYOUT_VERSION, OLDEST_COMPATIBLE)


def copy_release_files(dest: Path) -> Path:
    for rel in (
        "pyproject.toml",
        "cozyebpf/__init__.py",
        "cozyebpf/datapath/layout.py",
        "charts/cozyebpf/Chart.yaml",
        "charts/cozyebpf/values.yaml",
        "deploy/daemonset.yaml",
        "deploy/uninstall/uninstall.yaml",
        "CHANGELOG.md",
    ):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, dest / rel)
    return dest


@pytest.mark.parametrize(
    ("rel", "old", "new", "problem"),
    [
        ("charts/cozyebpf/Chart.yaml", f'appVersion: "{__version__}"', 'appVersion: "9.9.9"',
         f"Chart.yaml appVersion says 9.9.9, want {__version__}"),
        ("charts/cozyebpf/Chart.yaml", f"version: {__version__}\n", "version: 0.0.1\n",
         f"Chart.yaml version says 0.0.1, want {__version__}"),
        ("cozyebpf/__init__.py", __version__, "0.0.1",
         f"cozyebpf/__init__.py says 0.0.1, want {__version__}"),
        ("charts/cozyebpf/values.yaml", f"tag: v{__version__}", "tag: latest",
         f"values.yaml image.tag says latest, want v{__version__}"),
        ("deploy/uninstall/uninstall.yaml", f"cozyebpf:v{__version__}", "cozyebpf:latest",
         f"deploy/uninstall/uninstall.yaml says latest, want v{__version__}"),
        ("CHANGELOG.md", f"## [{__version__}] - ", "## [0.0.1] - ",
         f"CHANGELOG.md has no section ## [{__version__}] - YYYY-MM-DD"),
        ("CHANGELOG.md", "## [Unreleased]\n", "",
         "CHANGELOG.md: the first section must be ## [Unreleased]"),
    ],
    ids=["appVersion", "chart-version", "package", "image-tag", "uninstall", "changelog",
         "unreleased"],
)  # fmt: skip
def test_a_place_out_of_step_is_named(
    tmp_path: Path, rel: str, old: str, new: str, problem: str
) -> None:
    repo = copy_release_files(tmp_path)
    text = (repo / rel).read_text()
    assert old in text
    (repo / rel).write_text(text.replace(old, new))
    assert [x for x in release.problems(repo) if problem in x] != []


def test_the_release_notes_are_the_changelog_section() -> None:
    changelog = (REPO / "CHANGELOG.md").read_text()
    body = release.notes(changelog, __version__)
    assert f"ap layout {LAYOUT_VERSION}" in body.split("\n\n")[0]  # its opening names it
    assert "## [" not in body and "### Changed" in body and "### Fixed" in body
    assert release.notes("## [Unreleased]\n\n## [1.0.0] - 2026-01-01\n\nx\n", "1.0.0") == "x\n"


def test_version_names_the_release_and_the_map_layout() -> None:
    r = CliRunner().invoke(main, ["--version"])
    assert r.exit_code == 0
    assert r.output == (
        f"cozyebpf {__version__} (map layout {LAYOUT_VERSION}; agents of layout "
        f"{OLDEST_COMPATIBLE} or newer can run on its maps)\n"
    )


def test_make_release_packages_the_chart_and_the_notes(helm: str, tmp_path: Path) -> None:
    out = tmp_path / "dist"
    p = subprocess.run(
        [sys.executable, str(REPO / "scripts/release.py"), "--no-image", "--out", str(out)],
        capture_output=True,
        text=True,
        env={"HELM": helm, "PATH": "/usr/bin:/bin"},
    )
    assert p.returncode == 0, p.stderr
    chart = out / f"cozyebpf-{__version__}.tgz"
    with tarfile.open(chart) as t:
        meta = yaml.safe_load(t.extractfile("cozyebpf/Chart.yaml").read())  # type: ignore[union-attr]
        values = yaml.safe_load(t.extractfile("cozyebpf/values.yaml").read())  # type: ignore[union-attr]
        assert not [n for n in t.getnames() if "/ci/" in n], "ci/ stays out (.helmignore)"
    assert (meta["version"], meta["appVersion"]) == (__version__, __version__)
    assert values["image"]["tag"] == f"v{__version__}"
    notes = (out / "RELEASE-NOTES.md").read_text()
    assert notes.startswith(f"# cozyebpf {__version__}\n")
    assert f"Image: `ghcr.io/cozystack/cozyebpf:v{__version__}`" in notes
    assert f"Map layout: {LAYOUT_VERSION}" in notes and "### Changed" in notes
    sums = (out / "SHA256SUMS").read_text().split()
    assert sums[1::2] == [chart.name, "RELEASE-NOTES.md"]
    assert f"git tag -a v{__version__}" in p.stdout


def test_status_names_the_layout_and_release_of_the_maps() -> None:
    """`cozyebpf status` on a node whose maps a newer release wrote, which this one cannot run
    on: the layout, the release and why (the agent exited: unreachable)."""
    from cozyebpf.status import render

    d = {
        "datapath": {
            "pin_dir": "/sys/fs/bpf/cozyebpf",
            "attachments": [{"device": "eth0", "hook": "xdp", "program": "cz_ingress"}],
            "layout": {"layout_version": 7, "oldest": 7, "written_by": "0.3.0"},
            "error": "the maps in /sys/fs/bpf/cozyebpf have layout 7, written by cozyebpf "
            "0.3.0, and need layout 7 or newer; ... cannot read them",
        },
        "agent": {"error": "cannot reach the agent at http://127.0.0.1:9810/status"},
    }
    lines = render(d).splitlines()
    assert lines[1:4] == [
        "attached: eth0 xdp (cz_ingress)",
        "map layout: 7 (written by cozyebpf 0.3.0; layout 7 or newer runs on it)",
        "maps: " + d["datapath"]["error"],
    ]
