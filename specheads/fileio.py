"""Crash-safe small-file writes shared by every stage.

A JSON side file (manifest, checkpoint meta, export config, report) is
written to a temporary name in the same directory, flushed to disk and
renamed over the old one, so a killed run leaves either the old or the new
file and never half of one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


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
