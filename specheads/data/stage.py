"""Recipe-level entry points of the token-row and vocabulary stages (called by ``specheads.cli``).

``run_prepare(recipe)``  sources (or the regenerated answers) -> token rows at
                         ``RunDir(recipe).rows`` (summary.json records the target).
``run_vocab(recipe)``    token rows -> ``RunDir(recipe).vocab`` (vocab.safetensors + vocab.json).

The generating stages have their own modules: ``run_regenerate`` (data/regenerate.py) and
``run_synthesize`` (data/synthesize.py); all four are imported from ``specheads.data``.
"""

from __future__ import annotations

import json
import logging

from specheads.rundir import RunDir, check_stage_inputs, stage_inputs, stage_lock
from specheads.errors import MissingInputError
from .prepare import load_rows, load_summary, prepare_rows
from .sources import resolve_source
from .vocab import VOCAB_JSON, VocabError, save_vocab, select_draft_vocab

log = logging.getLogger(__name__)

__all__ = ["run_prepare", "run_vocab", "check_rows", "check_vocab"]


def _sources(recipe) -> list:
    if recipe.data.regenerate.enabled:
        path = RunDir(recipe).regenerated
        if not path.exists():
            raise MissingInputError(f"{path} not found: run `specheads data regenerate` first (data.regenerate.enabled is true)")
        meta = path.with_name(path.name + ".meta.json")
        recorded = json.loads(meta.read_text()).get("recipe_inputs") if meta.is_file() else None
        check_stage_inputs(recorded, recipe, "regenerate", path, "specheads data regenerate RECIPE")
        return [{"path": str(path), "format": "auto"}]
    return list(recipe.data.sources)


def check_rows(recipe) -> dict:
    """The token rows' summary, refused when the rows were prepared from other settings."""
    rows = RunDir(recipe).rows
    summary = load_summary(rows)
    check_stage_inputs(summary.get("recipe_inputs"), recipe, "prepare", rows, "specheads data prepare RECIPE")
    return summary


def check_vocab(recipe) -> None:
    """Refuse a draft vocabulary selected from other rows or for another draft_vocab_size."""
    vocab = RunDir(recipe).vocab
    stats_file = vocab / VOCAB_JSON
    if stats_file.is_file():
        recorded = json.loads(stats_file.read_text()).get("recipe_inputs")
        check_stage_inputs(recorded, recipe, "vocab", vocab, "specheads vocab RECIPE")


@stage_lock("prepare")
def run_prepare(recipe) -> dict:
    from specheads.target import load_tokenizer_for, target_facts_for

    sources = _sources(recipe)  # a missing file fails here, before anything loads
    for src in sources:
        resolve_source(src["path"] if isinstance(src, dict) else src.path)
    # the tokenizer and the config are all this stage needs: no weights
    facts = target_facts_for(recipe)
    rows = RunDir(recipe).rows
    identity = {"name": recipe.target.source, "model_type": facts["model_type"],
                "num_layers": facts["num_hidden_layers"], "hidden_size": facts["hidden_size"],
                "vocab_size": facts["vocab_size"], "adapter": recipe.target.adapter}
    summary = prepare_rows(
        sources,
        load_tokenizer_for(recipe),
        recipe.data.max_length,
        rows,
        holdout_fraction=recipe.data.holdout_fraction,
        num_proc=recipe.data.num_proc,
        extra={"target": identity, "target_vocab_size": facts["vocab_size"],
               "recipe_inputs": stage_inputs(recipe, "prepare")},
    )
    print(
        f"token rows: {summary['rows']} rows, {summary['tokens']} tokens "
        f"({summary['masked_tokens']} loss-masked), {summary['skipped_no_assistant']} skipped without "
        f"assistant tokens, {summary['truncated']} truncated, {summary['holdout']} held out -> {rows}"
    )
    return summary


@stage_lock("vocab")
def run_vocab(recipe) -> dict:
    rows_dir, vocab_dir = RunDir(recipe).rows, RunDir(recipe).vocab
    summary = check_rows(recipe)  # MissingInputError naming the stage to run when absent
    ds = load_rows(rows_dir)
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
    stats["recipe_inputs"] = stage_inputs(recipe, "vocab")
    save_vocab(vocab_dir, d2t, t2d, stats)
    msg = f"draft vocab: {vd} of {vt} tokens, coverage {stats['coverage']:.2%} of masked tokens"
    if stats["filled"]:
        msg += f" ({stats['filled']} unseen ids added to fill)"
    if stats["identity"]:
        msg += " (identity: d2t/t2d omitted in exports)"
    print(f"{msg} -> {vocab_dir}")
    return stats
