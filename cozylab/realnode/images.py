"""The images the lab's nodes run, as archives for `ctr images import` (no registry is reachable
here): the pause (sandbox) image and the backends' echo image, written from the binaries that
scripts/build-node.sh built (`oci.write_image`), and the agent's images, built from the
Dockerfile by scripts/build-agent-image.sh (`agent_image`)."""

from __future__ import annotations

import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

from cozylab.realnode.oci import write_image
from cozylab.realnode.spec import (
    AGENT_REPOSITORY,
    ECHO_IMAGE,
    NODE_CACHE,
    PAUSE_IMAGE,
    node_bin_dir,
)

REPO = Path(__file__).resolve().parents[2]
#: the tag of this checkout's image (a build of main is installed with image.tag set to it),
#: and the tag the lab gives it again for a second build of main
MAIN_TAG, MAIN_TAG_B = "main-a", "main-b"


def lab_images() -> list[Path]:
    """The pause and echo images' archives (written next to their binaries once)."""
    d = node_bin_dir()
    out = []
    for name, binary, entry, cmd, dirs in (
        (PAUSE_IMAGE, "pause", ["/pause"], [], []),
        (ECHO_IMAGE, "echo", ["/echo"], ["serve"], ["tmp"]),
    ):
        archive = d / f"{binary}-image.tar"
        if not archive.exists():
            write_image(
                archive,
                name,
                {binary: (d / binary, 0o755)},
                entry,
                cmd,
                dirs=dirs,
                labels={"org.opencontainers.image.source": "cozylab (scripts/build-node.sh)"},
            )
        out.append(archive)
    return out


def agent_image(tree: Path, ref: str, version: str) -> Path:
    """The agent's image built from `tree`'s Dockerfile (a checkout, or a release's tree from
    git), named `ref`, as scripts/build-agent-image.sh builds and caches it; its archive."""
    p = subprocess.run(
        [
            "bash",
            str(REPO / "scripts" / "build-agent-image.sh"),
            "--tree",
            str(tree),
            "--ref",
            ref,
            "--version",
            version,
        ],
        capture_output=True,
        text=True,
    )
    if p.returncode != 0:
        raise RuntimeError(f"scripts/build-agent-image.sh failed: {p.stderr[-3000:]}")
    return Path(p.stdout.strip().splitlines()[-1])


@dataclass(frozen=True)
class Release:
    """An agent to install: its chart (a directory or a packaged chart), its image's tag, the
    image archive the nodes import, and its name in the rows."""

    name: str
    chart: Path
    tag: str
    archive: Path
    #: the tag is the chart's default (a release): helm is given no image value
    default_tag: bool = False
    #: a release's source tree (its release commit's), None for this checkout
    tree: Path | None = None


def previous_release(repo: Path = REPO) -> tuple[str, str]:
    """The previous release's version and commit, as pyproject.toml names them."""
    prev = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["cozyebpf"][
        "previous-release"
    ]
    return str(prev["version"]), str(prev["commit"])


def release_of(workdir: Path, helm: list[str], version: str, commit: str) -> Release:
    """A release as a user gets it, from its release commit: its tree (`git archive`), its chart
    packaged (`helm package`, as `make release` does), its image built from its Dockerfile and
    named as its chart's default image (the chart installs it with no image value)."""
    tree = workdir / f"release-{version}"
    if not tree.exists():
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", "--format=tar", commit], capture_output=True
        )
        if archive.returncode != 0:
            raise RuntimeError(
                f"the release {version}'s commit {commit} is not in {REPO}: "
                + archive.stderr.decode().strip()
            )
        tree.mkdir(parents=True)
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    values = (tree / "charts" / "cozyebpf" / "values.yaml").read_text()
    tag = f"v{version}"
    if f"tag: {tag}" not in values:
        raise RuntimeError(f"the release {version}'s chart does not name the image tag {tag}")
    out = subprocess.run(
        [*helm, "package", str(tree / "charts" / "cozyebpf"), "-d", str(workdir)],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(f"helm package of {version}'s chart: {out.stderr.strip()}")
    chart = Path(out.stdout.strip().rpartition(": ")[2])
    archive_path = agent_image(tree, f"{AGENT_REPOSITORY}:{tag}", version)
    return Release(version, chart, tag, archive_path, default_tag=True, tree=tree)


def main_release(tag: str = MAIN_TAG) -> Release:
    """This checkout: its chart directory and its image, built from its Dockerfile, under `tag`
    (a user of a build that is not a release sets image.tag)."""
    import cozyebpf

    archive_path = agent_image(REPO, f"{AGENT_REPOSITORY}:{tag}", cozyebpf.__version__)
    return Release("main", REPO / "charts" / "cozyebpf", tag, archive_path)


def main() -> None:
    """`python -m cozylab.realnode.images` (scripts/setup.sh --real-node): build, or find in
    the cache, the agent's images of this checkout and of the previous release."""
    import time

    t0 = time.monotonic()
    version, commit = previous_release()
    work = NODE_CACHE / "trees"
    work.mkdir(parents=True, exist_ok=True)
    prev = release_of(work, [str(REPO / ".venv" / "bin" / "helm")], version, commit)
    this = main_release(MAIN_TAG)
    print(
        f"==> agent images in {time.monotonic() - t0:.0f}s: {prev.name} {prev.archive}, "
        f"main {this.archive}"
    )


if __name__ == "__main__":
    main()
