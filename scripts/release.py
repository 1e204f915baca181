"""`make release`: what a platform vendors, for the version in pyproject.toml.

    .venv/bin/python scripts/release.py [--out DIR] [--no-image] [--builder podman]

1. Checks that the release is consistent (`problems`): pyproject.toml's version, cozyebpf's
   `__version__`, the chart's `version` and `appVersion`, the image tag (values.yaml,
   deploy/daemonset.yaml, deploy/uninstall/uninstall.yaml: "v" and the version) are in step, the
   version is X.Y.Z, and CHANGELOG.md has a section `## [X.Y.Z] - YYYY-MM-DD` under an
   `## [Unreleased]` one, and pyproject.toml names the previous release (a version not newer:
   the same between releases, when the tree still says the last one; and its commit, which
   must be in git). tests/unit/test_release.py runs the same check in CI.
2. The packaged chart: `helm package charts/cozyebpf` -> DIR/cozyebpf-X.Y.Z.tgz.
3. The release notes: that CHANGELOG section, with the artefacts' names -> DIR/RELEASE-NOTES.md.
4. The image (unless --no-image): `<builder> build` of the Dockerfile, tagged
   IMAGE:vX.Y.Z (IMAGE: the chart's image.repository), with --build-arg VERSION=X.Y.Z (the
   image's org.opencontainers.image.version label), saved as DIR/cozyebpf-image-vX.Y.Z.tar
   (podman: an OCI archive). It needs the builder and a Debian mirror (the Dockerfile runs
   apt-get); behind a private index see the Dockerfile's build secrets, or
   scripts/image-test.sh, which builds and tests the same Dockerfile offline from a local base.
5. DIR/SHA256SUMS, and the steps that publish it (tag, push), printed: they are left to a
   human.

DIR defaults to dist/release-X.Y.Z. Environment: HELM (default: .venv/bin/helm, else helm on
PATH).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)$")
SECTION = re.compile(r"^## \[([^\]]+)\](?: - (\d{4}-\d{2}-\d{2}))?\s*$", re.M)


def _read(repo: Path, rel: str) -> str:
    return (repo / rel).read_text()


def versions(repo: Path = REPO) -> dict[str, str]:
    """Every place that names the release, and what it says there."""
    chart = yaml.safe_load(_read(repo, "charts/cozyebpf/Chart.yaml"))
    values = yaml.safe_load(_read(repo, "charts/cozyebpf/values.yaml"))
    init = re.search(r'^__version__ = "([^"]+)"$', _read(repo, "cozyebpf/__init__.py"), re.M)
    out = {
        "pyproject.toml": tomllib.loads(_read(repo, "pyproject.toml"))["project"]["version"],
        "cozyebpf/__init__.py": init.group(1) if init else "(none)",
        "Chart.yaml version": str(chart["version"]),
        "Chart.yaml appVersion": str(chart["appVersion"]),
        "values.yaml image.tag": str(values["image"]["tag"]),
    }
    repo_image = values["image"]["repository"]
    for rel in ("deploy/daemonset.yaml", "deploy/uninstall/uninstall.yaml"):
        tags = set(re.findall(rf"image: \"?{re.escape(repo_image)}:([^\"\s]+)", _read(repo, rel)))
        out[rel] = ",".join(sorted(tags)) or "(none)"
    return out


def layout(repo: Path = REPO) -> tuple[int, int]:
    """(LAYOUT_VERSION, OLDEST_COMPATIBLE) of cozyebpf/datapath/layout.py."""
    text = _read(repo, "cozyebpf/datapath/layout.py")
    found = [
        re.search(rf"^{n} = (\d+)$", text, re.M) for n in ("LAYOUT_VERSION", "OLDEST_COMPATIBLE")
    ]
    return tuple(int(m.group(1)) if m else 0 for m in found)  # type: ignore[return-value]


def problems(repo: Path = REPO) -> list[str]:
    """Why this tree is not a consistent release ([] when it is)."""
    v = versions(repo)
    version = v["pyproject.toml"]
    out = []
    if not SEMVER.match(version):
        out.append(f"pyproject.toml's version {version!r} is not X.Y.Z (semantic versioning)")
    tag = f"v{version}"
    for where, have in v.items():
        want = tag if where.startswith(("values.yaml", "deploy/")) else version
        if have != want:
            out.append(f"{where} says {have}, want {want} (pyproject.toml's version {version})")
    prev = previous_release(repo)
    if not SEMVER.match(prev.get("version", "")) or not prev.get("commit"):
        out.append("pyproject.toml: [tool.cozyebpf.previous-release] needs version and commit")
    elif SEMVER.match(version) and _key(prev["version"]) > _key(version):
        # (the same version between releases: the tree still says the last release, which the
        # upgrade tests run against it; a release bumps the version past it)
        out.append(f"the previous release {prev['version']} is newer than {version}")
    sections = SECTION.findall(_read(repo, "CHANGELOG.md"))
    names = [name for name, _ in sections]
    if not names or names[0] != "Unreleased":
        out.append("CHANGELOG.md: the first section must be ## [Unreleased]")
    dated = dict(sections)
    if version not in dated:
        out.append(f"CHANGELOG.md has no section ## [{version}] - YYYY-MM-DD")
    elif not dated[version]:
        out.append(f"CHANGELOG.md: ## [{version}] has no date (## [{version}] - YYYY-MM-DD)")
    elif len(names) > 1 and names[1] != version:
        out.append(f"CHANGELOG.md: ## [{version}] must follow ## [Unreleased]")
    return out


def previous_release(repo: Path = REPO) -> dict[str, str]:
    """pyproject.toml's [tool.cozyebpf.previous-release]: the version and commit of the
    release before this one (the upgrade and rollback tests run it)."""
    tool = tomllib.loads(_read(repo, "pyproject.toml")).get("tool", {})
    return dict(tool.get("cozyebpf", {}).get("previous-release", {}))


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("."))


def notes(changelog: str, version: str) -> str:
    """The body of CHANGELOG's section for `version`."""
    heads = list(SECTION.finditer(changelog))
    for i, m in enumerate(heads):
        if m.group(1) == version:
            end = heads[i + 1].start() if i + 1 < len(heads) else len(changelog)
            return changelog[m.end() : end].strip() + "\n"
    raise KeyError(f"CHANGELOG.md has no section for {version}")


def find_helm() -> str:
    env = os.environ.get("HELM")
    if env:
        return env
    venv = REPO / ".venv" / "bin" / "helm"
    if venv.exists():
        return str(venv)
    found = shutil.which("helm")
    if not found:
        sys.exit("release.py: no helm: run scripts/setup.sh (or set HELM)")
    return found


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/release.py", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="output directory (default dist/release-X.Y.Z)")
    ap.add_argument("--no-image", action="store_true", help="skip building the image")
    ap.add_argument("--builder", default="podman", help="podman (default), buildah or docker")
    args = ap.parse_args(argv)

    found = problems(REPO)
    if found:
        print("release.py: not a consistent release:", *found, sep="\n  ", file=sys.stderr)
        return 1
    version = versions(REPO)["pyproject.toml"]
    prev = previous_release(REPO)["commit"]
    known = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{prev}^{{commit}}"])
    if known.returncode != 0:
        print(f"release.py: the previous release's commit {prev} is not in git", file=sys.stderr)
        return 1
    values = yaml.safe_load(_read(REPO, "charts/cozyebpf/values.yaml"))
    image = f"{values['image']['repository']}:v{version}"
    out: Path = args.out or REPO / "dist" / f"release-{version}"
    out.mkdir(parents=True, exist_ok=True)

    subprocess.run(
        [find_helm(), "package", str(REPO / "charts/cozyebpf"), "--destination", str(out)],
        check=True,
    )
    chart = out / f"cozyebpf-{version}.tgz"
    artefacts = [chart]

    lay, oldest = layout(REPO)
    body = notes(_read(REPO, "CHANGELOG.md"), version)
    (out / "RELEASE-NOTES.md").write_text(
        f"# cozyebpf {version}\n\n"
        f"- Chart: `{chart.name}` (chart version {version}, appVersion {version})\n"
        f"- Image: `{image}`\n"
        f"- Map layout: {lay} (agents of layout {oldest} or newer can run on its maps; "
        "README, *Upgrade and roll back*)\n\n"
        f"{body}"
    )
    artefacts.append(out / "RELEASE-NOTES.md")

    if not args.no_image:
        archive = out / f"cozyebpf-image-v{version}.tar"
        b = args.builder
        build = [b, "build"] if b != "buildah" else [b, "bud"]
        built = subprocess.run(
            [*build, "-t", image, "--build-arg", f"VERSION={version}", "-f", "Dockerfile", "."],
            cwd=REPO,
        )
        if built.returncode != 0:
            print(
                f"release: `{b} build` of the Dockerfile failed (exit {built.returncode}, its "
                "output is above): it pulls debian:bookworm-slim and runs apt-get, so it needs "
                "a registry and a Debian mirror. The chart and the notes are in "
                f"{out}; build the image where both are reachable, or run "
                "`make release RELEASE_ARGS=--no-image` (scripts/image-test.sh builds and tests "
                "the same Dockerfile from a local base)",
                file=sys.stderr,
            )
            return 1
        save = [b, "save", "-o", str(archive)]
        if b == "podman":
            save += ["--format", "oci-archive"]
        if b == "buildah":
            save = [b, "push", image, f"oci-archive:{archive}"]
        else:
            save.append(image)
        subprocess.run(save, check=True)
        artefacts.append(archive)

    (out / "SHA256SUMS").write_text("".join(f"{sha256(a)}  {a.name}\n" for a in artefacts))
    print(f"cozyebpf {version} in {out}:")
    for a in [*artefacts, out / "SHA256SUMS"]:
        print(f"  {a.name}")
    print(
        "\nTo publish (by hand):\n"
        f"  git tag -a v{version} -m 'cozyebpf {version}' && git push origin v{version}\n"
        f"  {args.builder} push {image}"
        + ("  (after building it: drop --no-image)" if args.no_image else "")
        + f"\n  helm push {chart} oci://ghcr.io/cozystack/charts\n"
        f"  a GitHub release for v{version} with RELEASE-NOTES.md and the files above"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
