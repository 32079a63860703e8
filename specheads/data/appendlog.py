"""Append-only JSONL outputs of the generating stages (``data regenerate``, ``data synthesize``).

Generation is slow, so its output must survive a kill and a full disk, and a
rerun must continue it rather than start over or mix in data made otherwise:

- rows are appended whole and flushed + fsynced, so a kill loses at most the
  row being written; :func:`read_rows` cuts a torn last line off;
- a full disk raises the stage's own error saying that what was written is
  safe and how to resume (the torn line it may leave is cut off on resume);
- a ``.meta.json`` sidecar records the settings that made the file; a rerun
  with other settings is refused, naming what differs, so a resume can never
  mix two recipes' data in one file.
"""

from __future__ import annotations

from specheads.rundir import stage_input_diff
from specheads.fileio import write_json_atomic

import errno
import json
import os
from pathlib import Path


def meta_path(out: Path) -> Path:
    return out.with_name(out.name + ".meta.json")


def recorded_settings(out: Path) -> dict | None:
    meta = meta_path(out)
    return json.loads(meta.read_text()) if meta.is_file() else None


def check_recipe_inputs(out: Path, recipe, stage: str, error: type[Exception], out_key: str) -> None:
    """Refuse ``out`` when it was written from other recipe settings; needs no weights, so it runs first."""
    recorded = (recorded_settings(out) or {}).get("recipe_inputs")
    diff = stage_input_diff(recorded, recipe, stage)
    if diff:
        raise error(f"{out} already holds data generated with other settings (differing: {', '.join(diff)}); "
                    f"choose another {out_key} or delete it")


def check_settings(out: Path, doc: dict, error: type[Exception], out_key: str, command: str) -> None:
    """Compare ``doc`` (target identity + settings) with the sidecar of ``out``; write it on a first run."""
    old = recorded_settings(out)
    if old is not None:
        if old != doc:
            diff = [k for k in sorted(set(doc) | set(old)) if old.get(k) != doc.get(k)]
            raise error(f"{out} already holds data generated with other settings (differing: {', '.join(diff)}); "
                        f"choose another {out_key} or delete it")
    elif out.exists() and out.stat().st_size > 0:
        raise error(f"{out} exists but was not written by `{command}` (no {meta_path(out).name}); "
                    f"choose another {out_key}")
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(meta_path(out), doc)


def read_rows(out: Path) -> list[dict]:
    """The rows already written, in order; a torn last line (killed mid-write) is cut off the file."""
    if not out.exists():
        return []
    rows, good = [], 0
    with open(out, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            try:
                row = json.loads(line)
                str(row["id"])
            except (ValueError, KeyError, TypeError):
                break
            rows.append(row)
            good += len(line)
    if good != out.stat().st_size:
        with open(out, "r+b") as f:
            f.truncate(good)
    return rows


def append_rows(f, out: Path, rows: list[dict], error: type[Exception], safe: str) -> None:
    """Append ``rows`` to the open file ``f`` (of ``out``) and make them durable before returning.

    ``safe`` says what is already on disk, for the disk-full message (e.g. "12 conversations of this run").
    """
    try:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise error(f"disk full while writing {out}; {safe} are safely written, "
                        f"rerun the same command to resume") from e
        raise
