"""Conversations -> token rows, saved as a ``datasets`` Arrow directory.

``prepare_rows`` loads every source, renders and tokenizes each
conversation (:func:`specheads.data.template.tokenize_conversation`), drops
rows without a single loss-masked token (prompt-only conversations, or
answers cut off by ``max_length``) and writes

    out_dir/            datasets.Dataset.save_to_disk layout
        summary.json    counts (see prepare_rows)
        checksums.json  sha256 and size of every other file, checked by every reader (load_rows)

Columns: ``input_ids`` (list of int32), ``loss_mask`` (list of uint8),
``conv_id``, ``source`` (the source's path as given), ``category`` (str or
null). Everything is written into a temporary sibling directory and renamed
into place at the end, so ``out_dir`` is either the complete previous result
or the complete new one, never half-written; a full disk says so (``DiskFullError``)
and keeps the previous rows. Readers (vocab, dump, the online feed: all through
:func:`load_rows`) refuse a file whose sha256 differs from ``checksums.json``
(:class:`RowsCorruptError`, naming the file and both digests).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable

from specheads.errors import MissingInputError, SpecheadsError
from specheads.fileio import disk_full_guard, publish_dir, sha256_file, write_json_atomic
from .formats import load_conversations, quiet_datasets
from .sources import split_holdout
from .template import tokenize_conversation, tokenizer_name

__all__ = ["prepare_rows", "load_rows", "load_summary", "rows_features", "verify_rows", "RowsCorruptError",
           "SUMMARY_FILE", "CHECKSUMS_FILE"]

log = logging.getLogger(__name__)

SUMMARY_FILE = "summary.json"
CHECKSUMS_FILE = "checksums.json"  # sha256 and size of every other file of the rows


def rows_features():
    import datasets

    seq = getattr(datasets, "List", None) or datasets.Sequence
    return datasets.Features(
        {
            "input_ids": seq(datasets.Value("int32")),
            "loss_mask": seq(datasets.Value("uint8")),
            "conv_id": datasets.Value("string"),
            "source": datasets.Value("string"),
            "category": datasets.Value("string"),
        }
    )


def _source(spec: Any) -> tuple[str, str, int | None]:
    """``(path, format, limit)`` of a source: a path, a dict or a config object
    with ``path`` / ``format`` / ``limit``."""
    if isinstance(spec, (str, os.PathLike)):
        return str(spec), "auto", None
    get = spec.get if isinstance(spec, dict) else (lambda k, d=None: getattr(spec, k, d))
    path = get("path")
    if path is None:
        raise ValueError(f"data source {spec!r} has no 'path'")
    limit = get("limit")
    return str(path), str(get("format") or "auto"), (int(limit) if limit is not None else None)


# Worker state for num_proc > 1 (set once per process by the pool initializer).
_WORKER: dict = {}


def _init_worker(tokenizer, max_length, chat_template):
    _WORKER.update(tokenizer=tokenizer, max_length=max_length, chat_template=chat_template)


def _tokenize_one(messages):
    return tokenize_conversation(_WORKER["tokenizer"], messages, _WORKER["max_length"], _WORKER["chat_template"])


# ``num_proc=None`` tokenizes in worker processes only from this many conversations: a spawned worker takes seconds
# to start (it imports torch and transformers), and one process tokenizes ~1,000-3,000 conversations a second.
# Measured: 9,035 Qwen2.5 conversations took 7.1 s in one process and 7.7 s in two on a 2-core CPU, and the
# 9,071-conversation Qwen recipe's stage 93 s with 8 processes on an H100 host against 41-53 s with one (the pool's
# start-up there is not broken down); 41,270 conversations 36.6 s in one process and 22.3 s in two (CPU)
AUTO_POOL_MIN_CONVERSATIONS = 20_000
AUTO_MAX_PROCS = 8


def auto_num_proc(conversations: int) -> int:
    """Tokenizing processes for ``conversations``: up to 8 of the cores this process may run on, one below
    :data:`AUTO_POOL_MIN_CONVERSATIONS` (20,000)."""
    if conversations < AUTO_POOL_MIN_CONVERSATIONS:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(AUTO_MAX_PROCS, cores))


@contextmanager
def _worker_pool(num_proc: int, tokenizer, max_length, chat_template):
    """One pool of ``num_proc`` tokenizing processes for every source; None where ``num_proc`` <= 1 (tokenize in
    this process)."""
    if num_proc <= 1:
        yield None
        return
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # never fork a process that may hold torch threads
    with ctx.Pool(num_proc, initializer=_init_worker, initargs=(tokenizer, max_length, chat_template)) as pool:
        yield pool


def _tokenized(convs: list[dict], tokenizer, max_length, chat_template, pool, procs: int,
               desc: str) -> Iterable[dict]:
    from tqdm.auto import tqdm

    if pool is None or len(convs) < 2 * procs:
        for conv in tqdm(convs, desc=desc, unit="conv", leave=False):
            yield tokenize_conversation(tokenizer, conv["messages"], max_length, chat_template)
        return
    chunk = max(1, min(256, len(convs) // (8 * procs)))
    it = pool.imap(_tokenize_one, (c["messages"] for c in convs), chunksize=chunk)   # in order: rows as serial
    yield from tqdm(it, total=len(convs), desc=desc, unit="conv", leave=False)


def prepare_rows(
    sources: list,
    tokenizer: Any,
    max_length: int,
    out_dir: str | Path,
    num_proc: int | None = 1,
    limit: int | None = None,
    *,
    chat_template: str | None = None,
    holdout_fraction: float = 0.0,
    extra: dict | None = None,
) -> dict:
    """Tokenize ``sources`` (``[{"path", "format"}]``; ``format`` defaults to
    ``auto``) into token rows at ``out_dir``; return the summary written to
    ``out_dir/summary.json``:

    ``rows, tokens, masked_tokens, skipped_no_assistant, skipped, truncated,
    conversations (tokenized, holdout excluded), holdout, max_length,
    holdout_fraction, tokenizer, chat_template_sha256, sources: {path:
    {format, conversations, holdout, rows, skipped_no_assistant, truncated,
    tokens, masked_tokens}}``.

    ``limit`` caps the conversations taken from EACH source (its first
    ``limit``; a source's own ``limit`` applies too, the smaller wins).
    ``holdout_fraction`` keeps that share of conversations out
    (:func:`~specheads.data.sources.split_holdout`: by conversation id, seed 0;
    counted as ``holdout``)
    so evaluation can use them. ``extra`` is merged into the summary.
    ``truncated`` counts kept rows that were cut at
    ``max_length``. ``num_proc`` tokenizing processes (None: :func:`auto_num_proc`
    of the conversations); the rows are the same for any count. Errors in the data (``DataError``) or the template
    (``TemplateError``) raise before anything is written.
    """
    import datasets

    if not sources:
        raise ValueError("no data sources")
    if max_length is None or int(max_length) <= 0:
        raise ValueError(f"max_length must be a positive integer, got {max_length!r}")
    out_dir = Path(out_dir)
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)

    # Load (and validate) every source first: a bad file fails before any tokenizing.
    loaded = _load_sources(sources, limit, holdout_fraction)
    procs = auto_num_proc(sum(len(convs) for _, _, convs, _ in loaded)) if num_proc is None else int(num_proc)
    with _worker_pool(procs, tokenizer, max_length, chat_template) as pool:
        columns, per_source, totals = _tokenize_sources(loaded, tokenizer, max_length, chat_template, pool, procs)

    summary = dict(
        totals,
        skipped=totals["skipped_no_assistant"],
        max_length=int(max_length),
        holdout_fraction=float(holdout_fraction),
        tokenizer=tokenizer_name(tokenizer),
        chat_template_sha256=hashlib.sha256(template.encode()).hexdigest() if template else None,
        sources=per_source,
    )
    if extra:
        summary.update(extra)  # e.g. {"target": target.identity()}
    _write_rows(datasets.Dataset.from_dict(columns, features=rows_features()), summary, out_dir)
    return summary


def _load_sources(sources: list, limit: int | None, holdout_fraction: float) -> list[tuple]:
    """(path, format, conversations kept, count held out) of each source, each capped at its first ``limit``."""
    loaded = []
    for spec in sources:
        path, fmt, own_limit = _source(spec)
        convs = load_conversations(path, fmt)
        caps = [int(c) for c in (limit, own_limit) if c is not None]
        if caps:
            convs = convs[: min(caps)]
        convs, held = split_holdout(convs, holdout_fraction)
        loaded.append((path, fmt, convs, len(held)))
    return loaded


def _tokenize_sources(loaded: list[tuple], tokenizer, max_length: int, chat_template, pool, procs: int):
    """(columns, per-source counts, totals) of the token rows of the loaded sources; a conversation without
    assistant tokens makes no row."""
    columns: dict[str, list] = {k: [] for k in ("input_ids", "loss_mask", "conv_id", "source", "category")}
    per_source: dict[str, dict] = {}
    totals = dict(rows=0, tokens=0, masked_tokens=0, skipped_no_assistant=0, truncated=0, conversations=0, holdout=0)
    for path, fmt, convs, n_held in loaded:
        stats = per_source.setdefault(
            path,
            dict(format=fmt, conversations=0, holdout=0, rows=0, skipped_no_assistant=0, truncated=0, tokens=0, masked_tokens=0),
        )
        stats["conversations"] += len(convs)
        totals["conversations"] += len(convs)
        stats["holdout"] += n_held
        totals["holdout"] += n_held
        desc = f"tokenize {Path(path).name}"
        for conv, row in zip(convs, _tokenized(convs, tokenizer, max_length, chat_template, pool, procs, desc)):
            masked = sum(row["loss_mask"])
            if masked == 0:
                stats["skipped_no_assistant"] += 1
                totals["skipped_no_assistant"] += 1
                continue
            columns["input_ids"].append(row["input_ids"])
            columns["loss_mask"].append(row["loss_mask"])
            columns["conv_id"].append(conv["id"])
            columns["source"].append(path)
            columns["category"].append(conv.get("category"))
            n = len(row["input_ids"])
            for d in (stats, totals):
                d["rows"] += 1
                d["tokens"] += n
                d["masked_tokens"] += masked
                d["truncated"] += int(row["truncated"])
    return columns, per_source, totals


def _leftovers(out_dir: Path) -> list[Path]:
    """What killed runs of prepare left beside ``out_dir``: ``.NAME.tmp-*`` and ``.NAME.old-*``."""
    if not out_dir.parent.is_dir():
        return []
    return sorted(p for p in out_dir.parent.iterdir()
                  if p.name.startswith((f".{out_dir.name}.tmp-", f".{out_dir.name}.old-")))


def _clear_leftovers(out_dir: Path) -> None:
    """Remove a killed prepare's partial siblings of ``out_dir``; a previous result moved aside by one that was
    killed before renaming the new rows in is put back first."""
    left = _leftovers(out_dir)
    olds = [p for p in left if p.name.startswith(f".{out_dir.name}.old-") and (p / SUMMARY_FILE).is_file()]
    if olds and not out_dir.exists():
        keep = max(olds, key=lambda p: p.stat().st_mtime)
        os.rename(keep, out_dir)
        left.remove(keep)
        log.warning("restored %s from %s (a prepare was killed while replacing it)", out_dir, keep.name)
    for p in left:
        shutil.rmtree(p, ignore_errors=True)


def rows_checksums(d: Path, *, fsync: bool = False) -> dict:
    """``{"format", "files": {relative path: {"sha256", "bytes"}}}`` of every file in the rows directory ``d``
    but ``checksums.json`` itself (the Arrow files, ``dataset_info.json``, ``state.json``, ``summary.json``)."""
    files = {}
    for f in sorted(p for p in Path(d).rglob("*") if p.is_file()):
        rel = f.relative_to(d).as_posix()
        if rel == CHECKSUMS_FILE:
            continue
        if fsync:
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        files[rel] = {"sha256": sha256_file(f), "bytes": f.stat().st_size}
    return {"format": "specheads-rows-checksums", "version": 1, "files": files}


def _write_rows(ds, summary: dict, out_dir: Path) -> None:
    """``ds``, ``summary.json`` and ``checksums.json`` (the sha256 of every other file) at ``out_dir``, written
    into a temporary sibling and renamed into place whole (:func:`specheads.fileio.publish_dir`): a previous
    result is replaced only once the new one is complete. A full disk is a ``DiskFullError`` naming the file,
    the bytes needed and free; the temporary sibling is removed and the previous rows are kept."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _clear_leftovers(out_dir)
    had_rows = (out_dir / SUMMARY_FILE).is_file()
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))

    def kept() -> str:
        return (f"the partial rows were removed and the previous token rows at {out_dir} are unchanged" if had_rows
                else f"the partial rows were removed; nothing was written to {out_dir}")

    try:
        with disk_full_guard(out_dir, staging=tmp, kept=kept, needed=lambda: int(ds.data.nbytes) or None,
                             cleanup=lambda: shutil.rmtree(tmp, ignore_errors=True)):
            with quiet_datasets():  # one line of summary says what was written
                ds.save_to_disk(str(tmp))
            write_json_atomic(tmp / SUMMARY_FILE, summary)
            write_json_atomic(tmp / CHECKSUMS_FILE, rows_checksums(tmp, fsync=True))
            publish_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _VERIFIED.pop(str(out_dir.resolve()), None)


class RowsCorruptError(SpecheadsError, ValueError):
    """A file of the token rows does not match the sha256 ``data prepare`` recorded (changed, truncated or
    missing): the rows must be prepared again."""


_VERIFIED: dict[str, tuple] = {}  # rows directories verified by this process, by their files' (size, mtime)


def _signature(path: Path) -> tuple:
    return tuple((f.relative_to(path).as_posix(), f.stat().st_size, f.stat().st_mtime_ns)
                 for f in sorted(path.rglob("*")) if f.is_file())


def verify_rows(path: str | Path) -> bool:
    """Check every file of the token rows at ``path`` against its recorded sha256 (``checksums.json``);
    :class:`RowsCorruptError` naming the file and both digests on a mismatch. False (with a warning) for rows
    prepared before checksums existed. A directory already verified by this process and unchanged since
    (sizes and mtimes) is not read again."""
    path = Path(path)
    f = path / CHECKSUMS_FILE
    if not f.is_file():
        log.warning("%s has no %s (prepared before rows were checksummed): not verified; rerun "
                    "`specheads data prepare` to add it", path, CHECKSUMS_FILE)
        return False
    key, sig = str(path.resolve()), _signature(path)
    if _VERIFIED.get(key) == sig:
        return True
    try:
        recorded = json.loads(f.read_text())["files"]
        assert isinstance(recorded, dict)
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        raise RowsCorruptError(f"{f}: unreadable ({type(e).__name__}: {e}); rerun `specheads data prepare`") from None
    for name, rec in sorted(recorded.items()):
        want = rec.get("sha256") if isinstance(rec, dict) else rec
        p = path / name
        if not p.is_file():
            raise RowsCorruptError(f"token rows {path}: {name} is missing ({CHECKSUMS_FILE} records sha256 "
                                   f"{want}); rerun `specheads data prepare`")
        have = sha256_file(p)
        if have != want:
            raise RowsCorruptError(f"token rows {path}: {name} has sha256 {have}, but {CHECKSUMS_FILE} records "
                                   f"{want}: the file changed after `specheads data prepare` wrote it (damaged "
                                   f"or edited); rerun `specheads data prepare`")
    _VERIFIED[key] = sig
    return True


def load_rows(path: str | Path):
    """The token rows written by :func:`prepare_rows` (a ``datasets.Dataset``), verified against their
    ``checksums.json`` first (:func:`verify_rows`)."""
    import datasets

    path = Path(path)
    if not (path / SUMMARY_FILE).exists():
        raise MissingInputError(f"no token rows at {path} (missing {SUMMARY_FILE}; run the data stage first)")
    verify_rows(path)
    return datasets.load_from_disk(str(path))


def load_summary(path: str | Path) -> dict:
    f = Path(path) / SUMMARY_FILE
    if not f.is_file():
        raise MissingInputError(f"no token rows at {path} (missing {SUMMARY_FILE}; run `specheads data prepare` first)")
    return json.loads(f.read_text())
