"""The Go the labs' control plane needs is the one its modules say (issue 45, item 12): the higher
`go` line of cozylab/controlplane/kube/go.mod and etcd/go.mod (`cozylab.kubecp.spec.go_version`).
scripts/build-kube.sh reads it there and refuses an older Go before it builds anything, naming
the version and the go.mod; every "Go 1.N or newer" of the tree's documentation and scripts says
that version (they said 1.24 while etcd's go.mod said 1.26)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from cozylab.kubecp.spec import go_version

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "build-kube.sh"
#: what says which Go is needed: the documentation and the scripts (the CHANGELOG is history)
SAYS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "deploy" / "README.md"]
SAYS += sorted((REPO / "scripts").glob("*.sh"))
CLAIM = re.compile(r"\bGo (1\.\d+)(?:\.\d+)? or newer|\binstall Go (1\.\d+)")


def test_every_claim_of_the_go_needed_is_the_modules_one() -> None:
    need, mod = go_version()
    minor = ".".join(need.split(".")[:2])
    claims = {
        f"{path.relative_to(REPO)}: {m.group(0)}": m.group(1) or m.group(2)
        for path in SAYS
        for m in CLAIM.finditer(path.read_text())
    }
    assert claims, "the README no longer says which Go the control plane needs"
    wrong = [c for c, v in claims.items() if v != minor]
    assert wrong == [], f"{mod.relative_to(REPO)} says go {need}: {wrong}"
    # the script reads the version: it names none of its own
    assert not re.search(r"Go 1\.\d", SCRIPT.read_text()), "build-kube.sh names a Go version"


def test_an_older_go_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    """A Go older than the modules need (a fake `go` that says go1.24.4 and fails anything
    else): the script stops at once, names the Go it found, the version needed and the go.mod,
    and makes nothing in the cache (before, it went on to build and failed in `go build`, or a
    real Go 1.24 would have downloaded a newer toolchain: GOTOOLCHAIN is local now)."""
    need, mod = go_version()
    fake = tmp_path / "go"
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1 $2" = "env GOVERSION" ]; then echo go1.24.4; exit 0; fi\n'
        'echo "the fake go was asked: $*" >&2\n'
        "exit 1\n"
    )
    fake.chmod(0o755)
    cache = tmp_path / "cache"
    env = {**os.environ, "GO": str(fake), "COZYEBPF_KUBE_CACHE": str(cache)}
    p = subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert p.returncode != 0, p.stdout
    said = f"{fake} is go1.24.4, older than the Go {need} that {mod.relative_to(REPO)} needs"
    assert said in p.stderr, p.stderr
    assert "the fake go was asked" not in p.stderr, p.stderr
    assert not cache.exists(), list(cache.rglob("*"))
