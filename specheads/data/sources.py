"""Where prompts and conversations come from, and which of them are held out.

The holdout split is a pure function of a row's id, so regeneration,
preparation and evaluation agree on it without sharing any state: a prompt
held out for evaluation is never trained on.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from specheads.errors import MissingInputError

BUILTIN = {
    # the project's own small, varied prompt set (chat, code, math, summarising, extraction)
    "builtin:demo_prompts": Path(__file__).resolve().parent.parent / "assets" / "demo_prompts.jsonl",
    # categories, openers and copy-task templates of `data synthesize` (data.synthesize.seeds)
    "builtin:synthesize_seeds": Path(__file__).resolve().parent.parent / "assets" / "synthesize_seeds.yaml",
    # the mixed evaluation set: 7 categories, copy-heavy tasks included, all drawn from rows of the
    # reference recipe's public prompt files that holdout_fraction 0.05 keeps out of training
    # (benchmarks/build_eval_set.py)
    "builtin:eval_mixed": Path(__file__).resolve().parent.parent / "assets" / "eval_mixed.jsonl",
}


def resolve_source(path: str) -> Path:
    if path.startswith("builtin:"):
        if path not in BUILTIN:
            raise MissingInputError(f"unknown built-in data {path!r}; known: {', '.join(BUILTIN)}")
        return BUILTIN[path]
    p = Path(path)
    if not p.exists():
        raise MissingInputError(f"data file not found: {path}")
    return p


def is_holdout(row_id: str, fraction: float, seed: int = 0) -> bool:
    """Deterministic holdout membership by a hash of the row id (stable across stages and runs)."""
    if fraction <= 0:
        return False
    digest = hashlib.sha256(f"{seed}:{row_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_holdout(items: list[dict], fraction: float, seed: int = 0, key: str = "id") -> tuple[list[dict], list[dict]]:
    train, held = [], []
    for it in items:
        (held if is_holdout(str(it[key]), fraction, seed) else train).append(it)
    return train, held
