"""Files written whole or not at all, and sha256 of files and directories by content, for caches,
resumes and provenance that must not trust a name (offline features and resumed runs: the data file;
tau caches and merges: a drafter's files; the GGUF cache: a target file). Knows nothing about what
the files hold. (Directories, checkpoints and exports, are staged and renamed by their writers:
drafters.checkpoint, drafters.export.common.)
"""

import errno
import fcntl
import hashlib
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from drafters.errors import UserError

_LOCKS: dict[Path, object] = {}  # lock file -> its open file: held until this process exits or locks it again


class InUseError(UserError):
    pass


class OutputError(UserError):
    """An output that cannot be written, found before any work is done: the message names the path."""


def check_writable(path, what: str, *, directory: bool) -> Path:
    """Refuse, before any work, an output that cannot be written: `path` is a directory to write into, or a file.
    Creates nothing: the nearest folder that exists must be a directory where a file can be created (tried with a
    temporary file, so it holds for root too). A file path that is a directory, a folder that is a file, or a
    read-only location raises OutputError naming `what` and the path."""
    path = Path(path)
    if not directory and path.is_dir():
        raise OutputError(f"{what} {path} is a directory; give a file path")
    folder = path if directory else path.parent
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise OutputError(f"{what} {path} cannot be written (Not a directory: {existing} is a file); choose "
                          "another location")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".write-check-"):
            pass
    except OSError as err:
        raise OutputError(f"{what} {path} cannot be written ({err.strerror or err}); choose a writable "
                          "location") from None
    if not directory and path.exists() and not os.access(path, os.W_OK):
        raise OutputError(f"{what} {path} exists and is read-only; choose another path or make it writable")
    return path


def hold_lock(path, what: str) -> None:
    """Take the exclusive lock `path` (created; it records our PID) for the rest of this process, so that two
    runs started at once never write into one place: the second is refused, naming the holder's PID. The lock
    is flock(2), so it goes with its process: a killed run leaves a file but no lock, and never blocks a resume.
    Locking the same path again from this process (runs one after another in one process) renews it."""
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    old = _LOCKS.pop(path, None)
    if old is not None:
        old.close()
    f = open(path, "a+", encoding="utf-8")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise InUseError(f"{what} is in use by another run (PID {holder}, holding {path}); wait for it to "
                         "finish or stop it, or choose another directory") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    _LOCKS[path] = f


@contextmanager
def atomic_path(path):
    """with atomic_path(p) as tmp: write tmp -> renamed to p on success (readers see the old file or the
    complete new one, never a partial one); removed on any error. tmp is in p's directory (same file
    system, so the rename is atomic) and gets the mode a plain open() would give."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        # mkstemp creates 0600, and a writer that replaces the file (safetensors) keeps that: give it the mode a
        # plain open() would, 0666 less the umask
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def move_dir_into_place(new: Path, dest: Path, tag: str) -> None:
    """Rename the complete directory `new` to `dest` (same file system). An existing `dest` is moved aside
    first (to .NAME.old-TAG, deleted afterwards), so a reader never sees neither and a crash keeps one."""
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{tag}")
        dest.rename(old)
        new.rename(dest)
        shutil.rmtree(old)
    else:
        new.rename(dest)


def file_sha256(path) -> str:
    digest = hashlib.sha256()
    _update(digest, Path(path))
    return digest.hexdigest()


def drafter_sha256(path) -> str:
    """Content of a drafter directory (a checkpoint or an export): its top-level .json and .safetensors files. What
    a cached result or a reused export must agree on, since a checkpoint can change under the same path."""
    path = Path(path)
    names = [p.name for p in path.iterdir() if p.is_file() and not p.name.startswith(".")
             and p.suffix in (".json", ".safetensors")]
    return dir_sha256(path, names)


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


def disk_full(err: BaseException) -> bool:
    """ENOSPC as an OSError, or as the writers report it: safetensors ("I/O error: No space left on
    device (os error 28)") and torch.save raise their own exception types; torch.save says "file write
    failed", or, when the disk fills inside its zip writer, "[enforce fail at inline_container.cc] .
    unexpected pos N vs M" (a short write: seen on a full 300 KB tmpfs)."""
    if isinstance(err, OSError):
        return err.errno == errno.ENOSPC
    text = str(err)
    return "No space left on device" in text or "os error 28" in text or (
        isinstance(err, RuntimeError) and ("file write failed" in text or "unexpected pos" in text))
