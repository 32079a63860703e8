"""Append-only JSONL outputs of the generating stages (``data regenerate``, ``data synthesize``).

Generation is slow, so its output must survive a kill and a full disk, and a
rerun must continue it rather than start over or mix in data made otherwise:

- rows are appended whole and flushed + fsynced, so a kill loses at most the
  row being written; :func:`read_rows` cuts a torn last line off (and says so);
- a full disk raises the stage's own error saying that what was written is
  safe and how to resume (the torn line it may leave is cut off on resume);
- every good row survives a resume: a bad line in the middle (not JSON, or a
  row without its required fields) is set aside in ``<name>.bad.jsonl`` with
  its line number, counted and named, and the good rows after it are kept;
  only a torn last line (no newline, not parseable) is ever dropped;
- every row carries the sha256 of its own content (``_sha256``, 16 hex digits),
  so a flipped byte inside a string, which still parses, is caught as a bad
  line too, here and by every later reader of the file (:func:`verify_lines`);
- a ``.meta.json`` sidecar records the settings that made the file; a rerun
  with other settings is refused, naming what differs, so a resume can never
  mix two recipes' data in one file.
"""

from __future__ import annotations

from specheads.errors import SpecheadsError
from specheads.rundir import stage_input_diff
from specheads.fileio import (disk_full_class, disk_full_guard, free_bytes, fsync_dir, is_disk_full, tmp_path_for,
                              write_json_atomic)

import hashlib
import json
import os
import sys
import time
from pathlib import Path

# The key of a row's own checksum. The underscore keeps it apart from any data field; readers drop it.
LINE_CHECKSUM = "_sha256"


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


def row_digest(row: dict) -> str:
    """The checksum of a row's content, ``LINE_CHECKSUM`` itself left out: canonical JSON (sorted keys), so it
    does not depend on how a writer spaced or ordered the line."""
    body = {k: v for k, v in row.items() if k != LINE_CHECKSUM}
    text = json.dumps(body, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def with_checksum(row: dict) -> dict:
    return {**row, LINE_CHECKSUM: row_digest(row)}


def checksum_problem(row: dict, required: bool) -> str | None:
    """Why ``row``'s own checksum does not hold (None when it does). ``required``: the file was written with
    checksums (its sidecar says so), so a row without one was changed by hand or by a flipped byte in the key."""
    got = row.get(LINE_CHECKSUM)
    if got is None:
        return f"no {LINE_CHECKSUM!r} (every row of this file was written with one)" if required else None
    want = row_digest(row)
    if got != want:
        return (f"{LINE_CHECKSUM} {got!r} does not match its content ({want!r}): the line changed after it was "
                f"written (a flipped byte or an edit)")
    return None


def check_settings(out: Path, doc: dict, error: type[Exception], out_key: str, command: str) -> None:
    """Compare ``doc`` (target identity + settings) with the sidecar of ``out``; write it on a first run.
    A file begun before rows carried checksums goes on without requiring them (the rest must match)."""
    doc = {**doc, "line_checksums": LINE_CHECKSUM}
    old = recorded_settings(out)
    if old is not None:
        if "line_checksums" not in old:
            doc.pop("line_checksums")
        if old != doc:
            diff = [k for k in sorted(set(doc) | set(old)) if old.get(k) != doc.get(k)]
            raise error(f"{out} already holds data generated with other settings (differing: {', '.join(diff)}); "
                        f"choose another {out_key} or delete it")
    elif out.exists() and out.stat().st_size > 0:
        raise error(f"{out} exists but was not written by `{command}` (no {meta_path(out).name}); "
                    f"choose another {out_key}")
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        with disk_full_guard(meta_path(out), error=error, kept=f"nothing was generated yet ({out} is untouched)"):
            write_json_atomic(meta_path(out), doc)


def verify_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, why) for every line of ``path`` whose own checksum does not hold: what a reader that
    loads the file some other way (``datasets``, which rewrites rows) runs first. Lines that do not parse are
    left to that reader's own errors."""
    required = bool((recorded_settings(path) or {}).get("line_checksums"))
    found = []
    with open(path, "rb") as f:
        for n, line in enumerate(f, start=1):
            try:
                row = json.loads(line) if line.strip() else None
            except ValueError:
                continue
            why = checksum_problem(row, required) if isinstance(row, dict) else None
            if why:
                found.append((n, why))
    return found


def bad_path(out: Path) -> Path:
    """Where :func:`read_rows` sets aside the bad lines of ``out`` (appended, one JSON record per line)."""
    return out.with_name(out.name + ".bad.jsonl")


def _parse(line: bytes, required: tuple[str, ...], checksummed: bool = False) -> tuple[dict | None, str | None]:
    """(row, None) for a good line, else (None, why it is bad)."""
    try:
        row = json.loads(line)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError alike
        return None, f"not JSON ({e})"
    if not isinstance(row, dict):
        return None, f"a JSON {type(row).__name__}, not an object"
    missing = [k for k in required if k not in row]
    if missing:
        return None, f"no {', '.join(repr(k) for k in missing)}"
    why = checksum_problem(row, checksummed)
    return (None, why) if why else (row, None)


def _lines_named(numbers: list[int], most: int = 10) -> str:
    shown = ", ".join(str(n) for n in numbers[:most])
    return shown + (f" and {len(numbers) - most} more" if len(numbers) > most else "")


def read_rows(out: Path, required: tuple[str, ...] = ("id",), error: type[Exception] = SpecheadsError) -> list[dict]:
    """The good rows already written to ``out``, in order, with ``out`` made to hold them alone.

    A good row is a JSON object with every ``required`` key whose own checksum holds (one is required where
    the sidecar says the file was written with them); rows are returned without it. A bad line anywhere but at the end (or a complete
    last line that is bad) is appended to :func:`bad_path` with its line number and why, then removed from
    ``out``; the good rows on both sides of it are kept. A torn last line (no trailing newline and not JSON:
    a write cut short by a kill or a full disk) is cut off. Either is printed (stderr) naming the file, the line
    numbers and the counts. ``out`` is rewritten atomically (tmp + fsync + rename) only when a bad line left it;
    a torn line alone is truncated, which needs no free space. ``error``: the stage's error for a failed rewrite.
    """
    if not out.exists():
        return []
    rows: list[dict] = []
    bad: list[tuple[int, bytes, str]] = []  # (line number, line, why)
    good_end = 0  # bytes up to the end of the last good line (the truncation point when nothing else is wrong)
    torn: tuple[int, int] | None = None  # (line number, bytes)
    unterminated_good = False  # a good last line without its newline
    n = 0
    checksummed = bool((recorded_settings(out) or {}).get("line_checksums"))
    with open(out, "rb") as f:
        pos = 0
        for n, line in enumerate(f, start=1):
            pos += len(line)
            ends = line.endswith(b"\n")
            row, why = _parse(line, required, checksummed)
            if row is not None:
                row.pop(LINE_CHECKSUM, None)
                rows.append(row)
                good_end = pos
                unterminated_good = not ends
            elif not ends and why.startswith("not JSON"):
                torn = (n, len(line))
            else:
                bad.append((n, line, why))
    if not bad and torn is None and not unterminated_good:
        return rows
    if bad:
        _set_aside(out, bad, error)
        _rewrite_without(out, {b[0] for b in bad} | ({torn[0]} if torn else set()), error)
    else:
        # only a torn tail (or a missing last newline): truncate in place, which a full disk still allows
        with open(out, "r+b") as f:
            f.truncate(good_end)
            if unterminated_good:
                f.seek(good_end)
                f.write(b"\n")
            f.flush()
            os.fsync(f.fileno())
    said = [f"{out}: kept {len(rows)} good row(s)"]
    if bad:
        said.append(f"set aside {len(bad)} bad line(s) (line {_lines_named([b[0] for b in bad])}: "
                    f"{bad[0][2]}{'; ...' if len(bad) > 1 else ''}) in {bad_path(out)}")
    if torn is not None:
        said.append(f"dropped a torn last line (line {torn[0]}, {torn[1]} bytes without a newline: "
                    f"a write cut short by a kill or a full disk)")
    print("; ".join(said), file=sys.stderr)
    return rows


def _set_aside(out: Path, bad: list[tuple[int, bytes, str]], error: type[Exception]) -> None:
    when = time.strftime("%Y-%m-%dT%H:%M:%S")
    text = "".join(json.dumps({"file": out.name, "line": n, "reason": why, "set_aside": when,
                               "text": line.rstrip(b"\n").decode("utf-8", "backslashreplace")},
                              ensure_ascii=False) + "\n" for n, line, why in bad)
    try:
        with open(bad_path(out), "a", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise error(f"{out} has {len(bad)} bad line(s) (line {_lines_named([b[0] for b in bad])}) that could not "
                    f"be set aside in {bad_path(out)} ({e}); nothing was changed") from e


def _rewrite_without(out: Path, drop: set[int], error: type[Exception]) -> None:
    """Rewrite ``out`` without the lines numbered ``drop`` (tmp + fsync + rename: all or nothing)."""
    tmp = tmp_path_for(out)
    try:
        with open(out, "rb") as src, open(tmp, "wb") as dst:
            for n, line in enumerate(src, start=1):
                if n not in drop:
                    dst.write(line if line.endswith(b"\n") else line + b"\n")
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise error(f"could not rewrite {out} without its bad line(s) ({e}); they are copied to {bad_path(out)} "
                    f"and {out} is unchanged: free space and rerun the same command") from e


def append_rows(f, out: Path, rows: list[dict], error: type[Exception], safe: str) -> None:
    """Append ``rows`` to the open file ``f`` (of ``out``) and make them durable before returning.

    ``safe`` says what is already on disk, for the disk-full message (e.g. "12 conversations of this run").
    """
    try:
        f.write("".join(json.dumps(with_checksum(r), ensure_ascii=False) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())
    except OSError as e:
        if is_disk_full(e):
            free = free_bytes(out)
            raise disk_full_class(error)(
                f"disk full while writing {out}; {safe} are safely written, rerun the same command to resume "
                f"(a torn last line is cut off then; {'unknown' if free is None else free} bytes free)") from e
        raise
