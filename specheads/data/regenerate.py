"""Self-distillation data: answer the prompts with the target itself.

Draft heads accept far more when trained on the target's own answers. This
stage reads prompts in any supported format (multi-turn: each user turn in
order, feeding back the target's earlier answers), generates with the
runtime's engine under continuous batching (fixed batches when a draft head
is given: drafting decodes in lockstep), and appends OpenAI-messages JSONL.

Resumable: conversations are appended whole (one line, flushed and fsynced
as each completes); a rerun skips the ids already written and drops a torn last
line, so no prompt is generated twice and none is lost; a corrupted line in the
middle is set aside (``regenerated.jsonl.bad.jsonl``) and the good ones around it kept. Deterministic: each
conversation's seed comes from its id, so its answer does not depend on
batching or on where a previous run stopped. The output has a sidecar
``.meta.json`` naming the target and settings; a different recipe's output
at the same path is refused.
"""

from __future__ import annotations

import time

from specheads.errors import SpecheadsError
from specheads.fileio import disk_full_guard, write_json_atomic
from specheads.rundir import RunDir, stage_inputs, stage_lock

from .appendlog import append_rows, check_recipe_inputs, check_settings, read_rows


class RegenerateError(SpecheadsError, ValueError):
    """Regeneration cannot start or resume (another recipe's output, no prompts, ...)."""


OUT_KEY = "data.regenerate.out"
SUMMARY_NAME = "regenerate_summary.json"


def _settings_doc(recipe, target) -> dict:
    g = recipe.data.regenerate
    return {
        "target": {"name": target.name, "config_hash": target.config_hash},
        "sources": [s.model_dump() for s in recipe.data.sources],
        "holdout_fraction": recipe.data.holdout_fraction,
        "max_new_tokens": g.max_new_tokens, "temperature": g.temperature, "top_p": g.top_p, "top_k": g.top_k,
        "max_prompt_tokens": g.max_prompt_tokens, "seed": recipe.seed,
        "recipe_inputs": stage_inputs(recipe, "regenerate"),
    }


def load_prompt_items(recipe) -> tuple[list[dict], dict]:
    from specheads.data.formats import load_prompts
    from specheads.data.sources import resolve_source, split_holdout

    items, stats = [], {"empty": 0, "held_out": 0}
    for src in recipe.data.sources:
        empty: list[str] = []
        rows = load_prompts(resolve_source(src.path), src.format, skipped_empty=empty)
        stats["empty"] += len(empty)
        if src.limit:
            rows = rows[: src.limit]
        for r in rows:
            if not r["turns"] or any(not t.strip() for t in r["turns"]):
                stats["empty"] += 1
                continue
            items.append(r)
    train, held = split_holdout(items, recipe.data.holdout_fraction)
    stats["held_out"] = len(held)
    return train, stats


@stage_lock("regenerate")
def run_regenerate(recipe, target=None) -> dict:
    import torch
    from tqdm import tqdm

    from specheads.runtime.chat import chat_generate
    from specheads.runtime.model import KVCacheTooLarge, TargetModel
    from specheads.target import load_target_for

    g = recipe.data.regenerate
    out = RunDir(recipe).regenerated
    items, stats = load_prompt_items(recipe)
    check_recipe_inputs(out, recipe, "regenerate", RegenerateError, OUT_KEY)
    if target is None:
        target = load_target_for(recipe)
    check_settings(out, _settings_doc(recipe, target), RegenerateError, OUT_KEY, "specheads data regenerate")
    # every good conversation already written counts as done; bad lines are set aside, a torn last one dropped
    done = {str(r["id"]) for r in read_rows(out, ("id", "messages"), RegenerateError)}
    todo = [it for it in items if str(it["id"]) not in done]
    # length-sorted: the prompts prefilled together pad less; order does not change outputs
    todo.sort(key=lambda it: sum(len(t) for t in it["turns"]))
    max_turns = max((len(it["turns"]) for it in todo), default=1)
    max_seq = g.max_prompt_tokens * max_turns + max_turns * (g.max_new_tokens + 32) + 64
    max_seq = min(max_seq, int(getattr(target.config, "max_position_embeddings", 8192) or 8192))
    dtype = getattr(torch, g.dtype) if g.dtype else target.dtype
    drafter = None
    if g.head:
        from specheads.formats.convert import load_head_for
        from specheads.runtime.drafters import drafter_for_head

        head, _meta = load_head_for(g.head, target)
        drafter = drafter_for_head(head.to(device=target.device, dtype=dtype).eval())
        drafter = drafter.compile() if g.compile else drafter
    try:
        engine = TargetModel.from_hf(target.model, max_batch=g.batch_size, max_seq=max_seq, dtype=dtype)
    except KVCacheTooLarge as e:
        # every row's cache holds the longest conversation: 1024 rows of 5,536 tokens took 122 GiB for SmolLM2
        fix = (f"set data.regenerate.batch_size <= {e.fits} or lower those" if e.fits else
               "not one row fits: lower those")
        raise RegenerateError(
            f"data.regenerate.batch_size={g.batch_size}: {e}. Each row holds the longest conversation ({max_turns} "
            f"turn(s) of up to data.regenerate.max_prompt_tokens={g.max_prompt_tokens} prompt and "
            f"data.regenerate.max_new_tokens={g.max_new_tokens} new tokens): {fix}") from None
    if g.compile:
        engine.compile_layers()
    sampling = g.temperature > 0
    written = {"conversations": 0, "tokens": 0, "skipped_overlong": 0}
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    # the bar moves by finished conversations only (tokens would promise an ETA of hours after the warm-up)
    bar = tqdm(total=len(todo), desc="regenerate", unit="conv", smoothing=0)
    finished = [0]
    f = open(out, "a", encoding="utf-8")

    def move_bar(_tokens=0):
        if finished[0]:
            bar.update(finished[0])
            finished[0] = 0
            bar.set_postfix(tok_s=f"{written['tokens'] / max(1e-9, time.time() - t0):.0f}")

    def on_done(res):
        finished[0] += 1
        if res.finish_reasons and res.finish_reasons[0].startswith("skipped"):
            written["skipped_overlong"] += 1
            return
        line = {"id": res.id, "category": res.category, "messages": res.messages,
                "finish_reasons": res.finish_reasons}
        append_rows(f, out, [line], RegenerateError, f"{written['conversations']} conversations of this run")
        written["conversations"] += 1
        written["tokens"] += sum(len(a) for a in res.answer_tokens)

    try:
        chat_generate(engine, target.tokenizer, todo, max_new_tokens=g.max_new_tokens, batch_size=g.batch_size,
                      drafter=drafter, k=g.k, rule="onehot" if sampling else "greedy", temperature=g.temperature,
                      top_k=g.top_k, top_p=g.top_p, seed=recipe.seed, max_prompt_tokens=g.max_prompt_tokens,
                      use_cuda_graphs=engine.device.type == "cuda", on_done=on_done, progress=move_bar,
                      continuous=True, refill_at=g.refill_at)
    finally:
        f.close()
        move_bar()
        bar.close()
    elapsed = time.time() - t0
    summary = {"out": str(out), "already_done": len(done), "prompts": len(items), **stats, **written,
               "seconds": elapsed, "tokens_per_s": written["tokens"] / elapsed if elapsed else 0.0,
               "batch_size": g.batch_size, "device": str(engine.device), "dtype": str(engine.dtype).replace("torch.", ""),
               "drafter": g.head, "compiled": g.compile}
    # this run's figures beside the output (a resumed run writes its own part's)
    with disk_full_guard(out.parent / SUMMARY_NAME, error=RegenerateError,
                         kept=f"every regenerated conversation is safely written to {out}; only this summary "
                              f"is missing"):
        write_json_atomic(out.parent / SUMMARY_NAME, summary)
    print(f"regenerated {written['conversations']} conversations ({written['tokens']} tokens, "
          f"{summary['tokens_per_s']:.0f} tok/s); {len(done)} already done, {stats['empty']} empty and "
          f"{written['skipped_overlong']} overlong prompts skipped, {stats['held_out']} held out -> {out}")
    return summary
