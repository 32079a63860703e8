"""Crash-safe small-file writes shared by every stage.

A JSON side file (manifest, checkpoint meta, export config, report) is
written to a temporary name in the same directory, flushed to disk and
renamed over the old one, so a killed run leaves either the old or the new
file and never half of one.

Also here: :func:`disk_full_guard` (a full disk at any write -> one :class:`DiskFullError` naming the
path, the bytes needed and free, and what was kept), :func:`publish_dir` (a directory written beside its
final name and renamed into place whole) and :func:`sha256_file`.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

from specheads.errors import SpecheadsError


def _json_default(o: Any):
    # torch dtypes, paths and the like become their names; anything else is a bug
    import torch

    if isinstance(o, torch.dtype):
        return str(o).removeprefix("torch.")
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (best effort: some filesystems refuse)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def tmp_path_for(path: str | Path) -> Path:
    """Where :func:`write_json_atomic` stages ``path`` (a resume removes a stale one by this name)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp")


def write_json_atomic(path: str | Path, doc: Any, *, sort_keys: bool = False) -> None:
    """Write ``doc`` as indented JSON to ``path`` atomically (tmp + fsync + rename); OSError on failure."""
    path = Path(path)
    tmp = tmp_path_for(path)
    data = (json.dumps(doc, indent=2, sort_keys=sort_keys, default=_json_default) + "\n").encode()
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


# ---------------------------------------------------------------- a full disk, said once and clearly
#
# Every stage turns a full disk (ENOSPC, or EDQUOT: over quota) at one of its writes into one
# ``DiskFullError`` line: the path being written, the bytes it needed when known, the bytes free there,
# and what was kept (the previous artefact, the finished part), so the CLI prints it without a
# traceback and the user knows that freeing space and rerunning is safe.

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_OS_ERROR_CODES = tuple(f"(os error {n})" for n in sorted(DISK_FULL_ERRNOS))  # how Rust (safetensors) says it
_TORCH_WRITE_FAILED = ("PytorchStreamWriter failed writing", "file write failed")  # torch.save loses errno


class DiskFullError(SpecheadsError):
    """A write failed because the disk (or the user's quota) is full; the message names the path, the
    bytes needed when known, the bytes free, and what was kept."""

    def __reduce__(self):  # the stage-specific subclasses are made on the fly: unpickle as the base class
        return (DiskFullError, (str(self),))


_DISK_FULL_CLASSES: dict[type, type] = {}


def disk_full_class(error: type[Exception] | None) -> type[DiskFullError]:
    """``DiskFullError``, also an instance of the stage's own ``error`` class (so ``except DumpError`` and
    ``pytest.raises(SynthesizeError)`` keep working); the CLI prints it as ``DiskFullError``."""
    if error is None or error is DiskFullError or issubclass(error, DiskFullError):
        return error or DiskFullError
    cls = _DISK_FULL_CLASSES.get(error)
    if cls is None:
        cls = type("DiskFullError", (DiskFullError, error), {"__module__": __name__,
                                                             "__qualname__": "DiskFullError"})
        _DISK_FULL_CLASSES[error] = cls
    return cls


def is_disk_full(e: BaseException) -> bool:
    """Whether ``e`` is a write refused for want of space: OSError ENOSPC/EDQUOT, safetensors' error for
    one (its Rust I/O error carries the errno in the text), or torch.save's writer failing (torch drops the
    errno; a failed write of a file torch opened itself is a full disk in practice)."""
    seen = set()
    while e is not None and id(e) not in seen:  # the cause chain: a wrapped OSError counts
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return True
        msg = str(e)
        if type(e).__name__ == "SafetensorError" and any(c in msg for c in _OS_ERROR_CODES):
            return True
        if isinstance(e, RuntimeError) and any(t in msg for t in _TORCH_WRITE_FAILED):
            return True
        e = e.__cause__ or e.__context__
    return False


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on the filesystem of ``path`` (its nearest existing parent); None when unknown."""
    p = Path(path)
    for q in (p, *p.parents):
        try:
            return shutil.disk_usage(q).free
        except OSError:
            continue
    return None


def _size(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n} bytes ({n / scale:.1f} {unit})"
    return f"{n} bytes"


def disk_full_message(path: str | Path, *, needed: int | None = None, kept: str | None = None,
                      action: str = "free space (or point the output elsewhere) and rerun the same command",
                      cause: BaseException | None = None) -> str:
    """``disk full while writing PATH (N bytes needed, M free): KEPT; ACTION``."""
    path = Path(path)
    if cause is not None and isinstance(cause, OSError) and cause.errno == errno.EDQUOT:
        what = "disk quota exceeded"
    else:
        what = "disk full"
    sizes = ([f"about {_size(needed)} needed"] if needed else []) + [f"{_size(free_bytes(path))} free"]
    return f"{what} while writing {path} ({', '.join(sizes)}): " + "; ".join(s for s in (kept, action) if s)


@contextmanager
def disk_full_guard(path: str | Path, *, kept: str | Callable[[], str] | None = None,
                    needed: int | Callable[[], int | None] | None = None,
                    action: str = "free space (or point the output elsewhere) and rerun the same command",
                    error: type[Exception] | None = None, cleanup: Callable[[], None] | None = None,
                    staging: str | Path | None = None):
    """Run the block; a full disk inside it (:func:`is_disk_full`) becomes one :class:`DiskFullError`
    (also an ``error``, the stage's class, when given) naming ``path`` — or the file the OSError names,
    when it is under ``path`` (or under ``staging``, the temporary sibling being written for ``path``: then
    named as its final place) — the bytes ``needed``, the bytes free and what was ``kept``. ``kept`` and
    ``needed`` may be callables, evaluated after ``cleanup`` (e.g. removing a partial output) has run.
    Any other exception passes unchanged."""
    try:
        yield
    except BaseException as e:
        if not is_disk_full(e):
            raise
        if cleanup is not None:
            try:
                cleanup()
            except OSError:
                pass
        where = Path(path)
        fn = getattr(e, "filename", None)
        if isinstance(fn, (str, os.PathLike)):
            fn = Path(fn)
            if staging is not None and Path(staging) in fn.parents:
                where = where / fn.relative_to(staging)
            elif fn != where and where in fn.parents:
                where = fn
        msg = disk_full_message(where, needed=needed() if callable(needed) else needed,
                                kept=kept() if callable(kept) else kept, action=action, cause=e)
        raise disk_full_class(error)(msg) from e


# ---------------------------------------------------------------- directories published whole
_RENAME_EXCHANGE = 2


def exchange_dirs(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where that is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def publish_dir(tmp: Path, out: Path) -> None:
    """Put the complete directory ``tmp`` in place of ``out`` (a sibling): swapped with the old one in one
    step where the filesystem can, else the old one renamed aside (``.NAME.old-PID``) and put back if the
    rename fails; the old one is then removed. Renames only: no free space needed."""
    tmp, out = Path(tmp), Path(out)
    fsync_dir(tmp)
    if not out.exists():
        os.rename(tmp, out)
        fsync_dir(out.parent)
        return
    if exchange_dirs(tmp, out):
        old = tmp  # the old directory now lies under the temporary name
    else:
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(old, out)
            raise
    fsync_dir(out.parent)
    shutil.rmtree(old, ignore_errors=True)


def sha256_file(path: str | Path, chunk: int = 16 << 20, *, fsync: bool = False) -> str:
    """sha256 of a file (``fsync``: also flush it to disk, for a file just written by someone else)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
        if fsync:
            try:
                os.fsync(f.fileno())
            except OSError:
                pass
    return h.hexdigest()
