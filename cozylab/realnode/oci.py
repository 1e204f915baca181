"""Images of static binaries, written as OCI image archives (`write_image`), for the real-node
lab's own images (the pause image and the backend): no image registry is reachable here, and a
binary with nothing else needs no builder. The archive is an OCI image layout in a tar (the
format `ctr images import` and `podman load` read): one layer, a config, a manifest and an
index whose manifest carries the image's name (`io.containerd.image.name` for containerd,
`org.opencontainers.image.ref.name` for the others)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path

#: a fixed time for every file and the config: the same inputs give the same image
EPOCH = 0


def _blob(tar: tarfile.TarFile, data: bytes, media_type: str) -> dict[str, object]:
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size, info.mtime, info.mode = len(data), EPOCH, 0o644
    tar.addfile(info, io.BytesIO(data))
    return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}


def _layer(files: Mapping[str, tuple[Path, int]], dirs: Sequence[str]) -> tuple[bytes, str]:
    """The layer (gzip) and its diff ID (the sha256 of the uncompressed tar)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as t:
        for d in dirs:
            info = tarfile.TarInfo(d.strip("/"))
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755, 0
            t.addfile(info)
        for dest, (src, mode) in sorted(files.items()):
            data = src.read_bytes()
            info = tarfile.TarInfo(dest.strip("/"))
            info.size, info.mode, info.mtime = len(data), mode, EPOCH
            t.addfile(info, io.BytesIO(data))
    plain = raw.getvalue()
    return gzip.compress(plain, mtime=EPOCH), "sha256:" + hashlib.sha256(plain).hexdigest()


def write_image(
    archive: Path,
    name: str,
    files: Mapping[str, tuple[Path, int]],
    entrypoint: Sequence[str],
    cmd: Sequence[str] = (),
    env: Sequence[str] = ("PATH=/",),
    dirs: Sequence[str] = (),
    labels: Mapping[str, str] | None = None,
) -> str:
    """Write the image `name` (e.g. localhost/cozylab/echo:1) of `files` ({path in the image:
    (file here, mode)}, and the empty directories `dirs`) to `archive`; return its manifest's
    digest."""
    layer, diff_id = _layer(files, dirs)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": {
            "Entrypoint": list(entrypoint),
            "Cmd": list(cmd),
            "Env": list(env),
            "Labels": dict(labels or {}),
        },
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "cozylab/realnode/oci.py"}],
    }
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_name(archive.name + ".tmp")
    with tarfile.open(tmp, "w") as tar:
        cfg = _blob(
            tar,
            json.dumps(config, sort_keys=True).encode(),
            "application/vnd.oci.image.config.v1+json",
        )
        lay = _blob(tar, layer, "application/vnd.oci.image.layer.v1.tar+gzip")
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": cfg,
            "layers": [lay],
        }
        man = _blob(
            tar,
            json.dumps(manifest, sort_keys=True).encode(),
            manifest["mediaType"],  # type: ignore[arg-type]
        )
        index = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {
                    **man,
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {
                        "io.containerd.image.name": name,
                        "org.opencontainers.image.ref.name": name.rpartition(":")[2],
                    },
                }
            ],
        }
        for fname, doc in (("oci-layout", {"imageLayoutVersion": "1.0.0"}), ("index.json", index)):
            data = json.dumps(doc, sort_keys=True).encode()
            info = tarfile.TarInfo(fname)
            info.size, info.mtime, info.mode = len(data), EPOCH, 0o644
            tar.addfile(info, io.BytesIO(data))
    tmp.rename(archive)
    return str(man["digest"])
