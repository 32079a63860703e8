"""Recipe-level entry points of the data stages (called by ``specheads.cli``).

``run_prepare(recipe)``  sources (or the regenerated answers) -> token rows at
                         ``recipe.rows_dir`` (summary.json records the target).
``run_vocab(recipe)``    token rows -> ``recipe.vocab_dir`` (vocab.safetensors + vocab.json).
``run_regenerate(recipe)`` prompts -> the target's own answers (see data/regenerate.py).
"""

from __future__ import annotations

import logging

from .prepare import load_rows, load_summary, prepare_rows
from .vocab import VocabError, save_vocab, select_draft_vocab

log = logging.getLogger(__name__)

__all__ = ["run_prepare", "run_vocab", "run_regenerate"]


def _sources(recipe) -> list:
    if recipe.data.regenerate.enabled:
        path = recipe.regenerated_path
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: run `specheads data regenerate` first (data.regenerate.enabled is true)")
        return [{"path": str(path), "format": "auto"}]
    return list(recipe.data.sources)


def run_prepare(recipe) -> dict:
    from specheads.target import load_target

    # the tokenizer is what matters here; the target also gives the vocab size and identity
    target = load_target(
        recipe.target.source, dtype="float32", device="cpu", adapter=recipe.target.adapter,
        chat_template=recipe.target.chat_template,
    )
    summary = prepare_rows(
        _sources(recipe),
        target.tokenizer,
        recipe.data.max_length,
        recipe.rows_dir,
        holdout_fraction=recipe.data.holdout_fraction,
        extra={"target": target.identity(), "target_vocab_size": target.vocab_size},
    )
    print(
        f"token rows: {summary['rows']} rows, {summary['tokens']} tokens "
        f"({summary['masked_tokens']} loss-masked), {summary['skipped_no_assistant']} skipped without "
        f"assistant tokens, {summary['truncated']} truncated, {summary['holdout']} held out -> {recipe.rows_dir}"
    )
    return summary


def run_vocab(recipe) -> dict:
    rows_dir = recipe.rows_dir
    ds = load_rows(rows_dir)  # FileNotFoundError naming the stage to run when absent
    summary = load_summary(rows_dir)
    vt = summary.get("target_vocab_size")
    if vt is None:
        raise VocabError(f"{rows_dir}/summary.json has no target_vocab_size: rerun `specheads data prepare`")
    vd = recipe.vocab.draft_vocab_size or vt
    if vd > vt:
        raise VocabError(f"vocab.draft_vocab_size={vd} exceeds the target vocabulary ({vt})")
    ds = ds.select_columns(["input_ids", "loss_mask"])
    d2t, t2d, stats = select_draft_vocab(ds, vd, vt)
    stats["rows_dir"] = str(rows_dir)
    stats["target"] = summary.get("target")
    save_vocab(recipe.vocab_dir, d2t, t2d, stats)
    msg = f"draft vocab: {vd} of {vt} tokens, coverage {stats['coverage']:.2%} of masked tokens"
    if stats["filled"]:
        msg += f" ({stats['filled']} unseen ids added to fill)"
    if stats["identity"]:
        msg += " (identity: d2t/t2d omitted in exports)"
    print(f"{msg} -> {recipe.vocab_dir}")
    return stats


def run_regenerate(recipe, target=None) -> dict:
    from .regenerate import run_regenerate as _run

    return _run(recipe, target=target)
