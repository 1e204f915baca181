"""`python -m cozylab.realnode` (`make real-node-lab`): the images, the lab, the story, the table
of its rows; exit status 1 when a row failed."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from cozylab.realnode.images import (
    MAIN_TAG,
    MAIN_TAG_B,
    Release,
    main_release,
    previous_release,
    release_of,
)
from cozylab.realnode.lab import REPO, RealNodeLab
from cozylab.realnode.spec import AGENT_REPOSITORY
from cozylab.realnode.story import Row, Story


def format_rows(rows: list[Row]) -> str:
    width = max((len(r.step) for r in rows), default=4)
    lines = [f"{'step':<{width}}  result  check: what was seen"]
    lines += [f"{r.step:<{width}}  {r.result:<6}  {r.check}: {r.detail}" for r in rows]
    passed = sum(r.ok for r in rows)
    lines.append(f"{passed} of {len(rows)} checks passed")
    return "\n".join(lines)


def run(workdir: Path, prefix: str = "rn", previous: tuple[str, str] | None = None) -> list[Row]:
    """Build (or take from the cache) the images, run the story on a new lab, take it down."""
    t0 = time.monotonic()
    helm = [str(REPO / ".venv" / "bin" / "helm")]
    version, commit = previous or previous_release()
    prev = release_of(workdir, helm, version, commit)
    main = main_release(MAIN_TAG)
    main_b = Release("main (second build)", main.chart, MAIN_TAG_B, main.archive)
    print(
        f"images ready in {time.monotonic() - t0:.0f}s: {prev.archive.name} ({prev.name}), "
        f"{main.archive.name} (main)",
        flush=True,
    )
    lab = RealNodeLab(prefix, workdir)
    lab.up([prev.archive, main.archive])
    rows: list[Row] = []
    try:
        lab.tag_image(f"{AGENT_REPOSITORY}:{main.tag}", f"{AGENT_REPOSITORY}:{main_b.tag}")
        story = Story(lab, prev, main, main_b, say=lambda s: print(s, flush=True))
        try:
            rows = story.run()
        finally:
            if any(not r.ok for r in story.rows):
                (workdir / "describe.txt").write_text(lab.describe())
    finally:
        lab.down()
    left = lab.leftovers()
    rows.append(
        Row(
            "nothing left",
            "no process, cgroup, mount, namespace, directory or changed sysctl of the lab",
            not any(left.values()),
            "; ".join(f"{k}: {v}" for k, v in left.items() if v) or "none",
        )
    )
    print(f"the real-node lab took {time.monotonic() - t0:.0f}s")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m cozylab.realnode", description=__doc__)
    ap.add_argument(
        "--workdir",
        type=Path,
        help="where logs and the releases' trees go (default: a new temporary directory)",
    )
    ap.add_argument(
        "--previous",
        metavar="VERSION@COMMIT",
        help="another release than pyproject.toml's previous one",
    )
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="cozylab-realnode-"))
    workdir.mkdir(parents=True, exist_ok=True)
    previous = None
    if args.previous:
        version, _, commit = args.previous.partition("@")
        previous = (version, commit)
    rows = run(workdir, previous=previous)
    print(format_rows(rows))
    print(f"logs: {workdir}")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
