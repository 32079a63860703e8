"""Draft-vocabulary selection (EAGLE-3 ``d2t`` / ``t2d``).

The draft vocabulary is the ``draft_vocab_size`` most frequent target tokens
among the loss-masked (assistant) tokens of the training rows, sorted by
token id. Ties in frequency go to the lower token id. When the data holds
fewer distinct masked tokens than ``draft_vocab_size``, the rest is filled
with the lowest-id tokens not seen (they have count 0, and the same tie rule
picks them), and ``stats["filled"]`` says how many.

``d2t[i] = target_id(i) - i`` (int64 ``[Vd]``), ``t2d`` is bool ``[Vt]``
(True where a target token is in the draft vocabulary): the convention of
EAGLE-3, vLLM and speculators. When the draft vocabulary is the whole target
vocabulary the mapping is the identity (``d2t`` all zeros, ``t2d`` all True),
``stats["identity"]`` is True, and exports omit both tensors.

Files (``save_vocab``): ``out_dir/vocab.safetensors`` (``d2t``, ``t2d``) and
``out_dir/vocab.json`` (the stats).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from specheads.errors import SpecheadsError
from specheads.fileio import disk_full_guard, fsync_dir, write_json_atomic

__all__ = ["VocabError", "select_draft_vocab", "count_masked_tokens", "save_vocab", "load_vocab", "VOCAB_TENSORS", "VOCAB_JSON"]

class VocabError(SpecheadsError, ValueError):
    """Bad input to draft-vocabulary selection, or an inconsistent vocab file."""


VOCAB_TENSORS = "vocab.safetensors"
VOCAB_JSON = "vocab.json"


def _pair(row: Any) -> tuple[Any, Any]:
    if isinstance(row, dict):
        return row["input_ids"], row["loss_mask"]
    input_ids, loss_mask = row
    return input_ids, loss_mask


def count_masked_tokens(rows: Iterable, target_vocab_size: int) -> np.ndarray:
    """Frequency of each target token id among loss-masked positions.
    ``rows`` yields ``(input_ids, loss_mask)`` pairs or dicts with those keys
    (a ``datasets.Dataset`` of token rows works)."""
    counts = np.zeros(int(target_vocab_size), dtype=np.int64)
    buf: list[np.ndarray] = []
    buffered = 0

    def flush():
        nonlocal buffered
        if buf:
            ids = np.concatenate(buf)
            if ids.size and (ids.min() < 0 or ids.max() >= target_vocab_size):
                bad = int(ids.max()) if ids.max() >= target_vocab_size else int(ids.min())
                raise VocabError(f"token id {bad} is outside the target vocabulary [0, {target_vocab_size})")
            counts[:] += np.bincount(ids, minlength=target_vocab_size)[: target_vocab_size]
            buf.clear()
            buffered = 0

    for n, row in enumerate(rows):
        input_ids, loss_mask = _pair(row)
        ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
        mask = np.asarray(loss_mask).reshape(-1).astype(bool)
        if ids.shape != mask.shape:
            raise VocabError(f"row {n}: input_ids has {ids.size} tokens but loss_mask has {mask.size}")
        sel = ids[mask]
        buf.append(sel)
        buffered += sel.size
        if buffered >= 1 << 22:
            flush()
    flush()
    return counts


def select_draft_vocab(rows: Iterable, draft_vocab_size: int, target_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(d2t int64[Vd], t2d bool[Vt], stats)`` — see the module docstring.

    ``stats``: ``draft_vocab_size``, ``target_vocab_size``, ``masked_tokens``
    (total loss-masked tokens counted), ``distinct_tokens`` (distinct masked
    token ids seen), ``coverage`` (share of masked tokens whose id is in the
    draft vocabulary), ``filled`` (unseen ids added to reach the size),
    ``identity``.
    """
    vd, vt = int(draft_vocab_size), int(target_vocab_size)
    if vt <= 0:
        raise VocabError(f"target_vocab_size must be positive, got {vt}")
    if not 0 < vd <= vt:
        raise VocabError(f"draft_vocab_size must be in [1, target_vocab_size={vt}], got {vd}")
    counts = count_masked_tokens(rows, vt)
    total = int(counts.sum())
    if total == 0:
        raise VocabError("no loss-masked tokens in the rows: cannot choose a draft vocabulary")
    distinct = int(np.count_nonzero(counts))
    # stable sort on -count keeps ascending id order among equal counts: ties go to the
    # lower id, and unseen ids (count 0) come after every seen id, lowest id first.
    chosen = np.sort(np.argsort(-counts, kind="stable")[:vd])
    covered = int(counts[chosen].sum())
    d2t = torch.from_numpy(chosen - np.arange(vd, dtype=np.int64))
    t2d = torch.zeros(vt, dtype=torch.bool)
    t2d[torch.from_numpy(chosen)] = True
    stats = {
        "draft_vocab_size": vd,
        "target_vocab_size": vt,
        "masked_tokens": total,
        "distinct_tokens": distinct,
        "coverage": covered / total,
        "filled": max(0, vd - distinct),
        "identity": vd == vt,
    }
    if stats["identity"]:
        stats["note"] = "draft vocab = target vocab: identity mapping; d2t/t2d are omitted in exports"
    return d2t, t2d, stats


def save_vocab(out_dir: str | Path, d2t: torch.Tensor, t2d: torch.Tensor, stats: dict) -> Path:
    """Write ``vocab.safetensors`` (d2t int64, t2d bool) and ``vocab.json``: both are written to temporary
    names first and renamed only once both are complete (a previous pair is never mixed with a new one).
    A full disk is a ``DiskFullError`` naming the file; the temporary files go, the previous vocabulary stays."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    d2t = torch.as_tensor(d2t, dtype=torch.int64).contiguous()
    t2d = torch.as_tensor(t2d, dtype=torch.bool).contiguous()
    if t2d.ndim != 1 or d2t.ndim != 1 or int(t2d.sum()) != d2t.numel():
        raise VocabError(f"inconsistent d2t {tuple(d2t.shape)} / t2d (true entries: {int(t2d.sum())})")
    meta = {"draft_vocab_size": str(d2t.numel()), "target_vocab_size": str(t2d.numel())}
    had = (out_dir / VOCAB_TENSORS).is_file()
    staged: list[tuple[Path, str]] = []

    def drop_staged() -> None:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)

    kept = (f"the temporary files were removed and the previous vocabulary in {out_dir} is unchanged" if had
            else f"the temporary files were removed; no vocabulary was written to {out_dir}")
    try:
        for name, write, size in (
            (VOCAB_TENSORS, lambda p: save_file({"d2t": d2t, "t2d": t2d}, str(p), metadata=meta),
             d2t.numel() * 8 + t2d.numel() + 1024),
            (VOCAB_JSON, lambda p: write_json_atomic(p, stats), None),
        ):
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=out_dir)
            os.close(fd)
            staged.append((Path(tmp), name))
            with disk_full_guard(out_dir / name, kept=kept, needed=size, cleanup=drop_staged):
                write(tmp)
        for tmp, name in staged:
            os.replace(tmp, out_dir / name)
        fsync_dir(out_dir)
    finally:
        drop_staged()
    return out_dir


def load_vocab(out_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(d2t, t2d, stats)`` as saved by :func:`save_vocab` (checked for consistency)."""
    from safetensors.torch import load_file

    out_dir = Path(out_dir)
    tensors = load_file(str(out_dir / VOCAB_TENSORS))
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    stats = json.loads((out_dir / VOCAB_JSON).read_text())
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise VocabError(f"{out_dir}: d2t must be int64 and t2d bool, got {d2t.dtype} / {t2d.dtype}")
    target_ids = d2t + torch.arange(d2t.numel())
    if (
        int(t2d.sum()) != d2t.numel()
        or (target_ids.numel() and (int(target_ids.min()) < 0 or int(target_ids.max()) >= t2d.numel()))
        or not bool((target_ids[1:] > target_ids[:-1]).all())
        or not bool(t2d[target_ids].all())
    ):
        raise VocabError(f"{out_dir}: d2t and t2d disagree")
    return d2t, t2d, stats
