"""Content fingerprints of the files a run reads, so a later step can tell that they changed (offline
features: drafters.features; resuming a training run: drafters.training). Knows nothing else."""

import hashlib
from pathlib import Path


def data_sha256(path: str) -> str | None:
    """sha256 of the data file's bytes (a folder: of every file's relative path and bytes, sorted);
    None for a Hub dataset name (no local bytes: the per-example token check still runs)."""
    root = Path(path)
    if not root.exists():
        return None
    digest = hashlib.sha256()
    for file in [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()):
        if file != root:
            digest.update(str(file.relative_to(root)).encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
