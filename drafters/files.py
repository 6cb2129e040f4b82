"""sha256 of files and directories by content, for caches, resumes and provenance that must not trust a
name (offline features and resumed runs: the data file; tau caches and merges: a drafter's files; the GGUF
cache: a target file). Knows nothing about what the files hold.
"""

import hashlib
from pathlib import Path


def file_sha256(path) -> str:
    digest = hashlib.sha256()
    _update(digest, Path(path))
    return digest.hexdigest()


def dir_sha256(path, names=None) -> str:
    """sha256 over (relative path, bytes) of every file under path, sorted; names: only these
    relative paths (a missing one counts as empty, under its own name)."""
    root = Path(path)
    files = sorted(names) if names is not None else sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    digest = hashlib.sha256()
    for name in files:
        digest.update(name.encode() + b"\0")
        if (root / name).is_file():
            _update(digest, root / name)
        digest.update(b"\0")
    return digest.hexdigest()


def data_sha256(path: str) -> str | None:
    """A data.path's content: its file's sha256, a folder's dir_sha256; None for a Hub dataset name (no
    local bytes: the per-example token check of offline features still runs)."""
    root = Path(path)
    if not root.exists():
        return None
    return file_sha256(root) if root.is_file() else dir_sha256(root)


def _update(digest, file: Path) -> None:
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
