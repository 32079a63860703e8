"""specheads command line: parse, load a recipe, call one stage.

Every stage command takes a recipe file and dotted ``key=value`` overrides;
``--dry-run`` prints the resolved recipe and what would run without loading
any weights. Stage modules are imported lazily so that ``--help`` and
``--dry-run`` stay instant.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specheads.config import RecipeError, load_recipe

STAGES = {
    "data prepare": "conversations → token rows (chat template + assistant-only loss mask)",
    "data regenerate": "answer the prompts with the target itself (self-distillation data)",
    "vocab": "draft vocabulary (d2t/t2d) from the masked tokens of the token rows",
    "dump": "run the target over the token rows and store aux + final hidden states",
    "train": "train the draft head (DeepSpeed)",
    "export": "write the trained head in a serving format and validate it",
    "eval": "acceptance report in the bundled runtime (with and without drafting)",
}


def _add_recipe_args(p: argparse.ArgumentParser, optional: bool = False) -> None:
    if optional:
        p.add_argument("recipe", nargs="?", help="recipe YAML")
    else:
        p.add_argument("recipe", help="recipe YAML (e.g. recipes/smollm2_eagle3.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides (e.g. train.lr=3e-4)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved recipe and the plan; load nothing")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specheads", description="Train, export and measure speculative-decoding draft heads.")
    sub = ap.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="data stages").add_subparsers(dest="data_command", required=True)
    _add_recipe_args(data.add_parser("prepare", help=STAGES["data prepare"]))
    _add_recipe_args(data.add_parser("regenerate", help=STAGES["data regenerate"]))

    _add_recipe_args(sub.add_parser("vocab", help=STAGES["vocab"]))

    p = sub.add_parser("dump", help=STAGES["dump"])
    _add_recipe_args(p, optional=True)
    p.add_argument("--inspect", metavar="DIR", help="print a store's manifest summary and check every shard")

    _add_recipe_args(sub.add_parser("train", help=STAGES["train"]))

    p = sub.add_parser("export", help=STAGES["export"])
    p.add_argument("source", nargs="?", help="recipe YAML, run directory or checkpoint directory")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides when SOURCE is a recipe")
    p.add_argument("--format", choices=["speculators", "sglang", "eagle", "mtp"])
    p.add_argument("--out", help="output directory")
    p.add_argument("--k", type=int, help="number of speculative tokens written into the config")
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--from", dest="from_dir", metavar="DIR", help="convert an exported head (any supported format)")
    p.add_argument("--check", metavar="DIR", help="validate an exported directory as vLLM and SGLang would read it")
    p.add_argument("--target", help="with --check: the target the head must match (checks verifier, vocab, hidden size)")
    p.add_argument("--dry-run", action="store_true")

    p = sub.add_parser("eval", help=STAGES["eval"])
    p.add_argument("recipe", nargs="?", help="recipe YAML (optional when --target/--head/--prompts are given)")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--target", help="target: HF id, directory, .gguf or smollm2-135m")
    p.add_argument("--head", action="append", help="head directory (repeat to compare several heads)")
    p.add_argument("--prompts", help="prompt file (any supported format) or builtin:demo_prompts")
    p.add_argument("--k", type=int, action="append", help="draft length (repeat to compare several k)")
    p.add_argument("--tree", help="EAGLE-2 tree: depth,topk,tokens")
    p.add_argument("--temperature", type=float)
    p.add_argument("--rule", action="append", choices=["greedy", "rejection", "onehot", "tree_target_only"],
                   help="verification rule (repeat to compare rules)")
    p.add_argument("--compare", action="append", help="extra drafters to compare: ngram")
    p.add_argument("--engine", choices=["specheads", "vllm"], default="specheads",
                   help="vllm: also run the same prompts in vLLM and put both side by side")
    p.add_argument("--thresholds", help="tree_target_only: also run relaxed thresholds single,acc (e.g. 0.05,0.5); "
                   "the report must show they fail the χ² test")
    p.add_argument("--chi-square-draws", type=int, help="sampled draws per prompt for the χ² lossless check")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--limit", type=int)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--out", help="report directory")
    p.add_argument("--dry-run", action="store_true")
    return ap


def _print_plan(recipe, stage: str, what: list[str]) -> None:
    print(f"# specheads {stage} — dry run (nothing loaded)")
    print(recipe.to_yaml().rstrip())
    print("# would run:")
    for line in what:
        print(f"#   {line}")


def _plan(recipe, stage: str) -> list[str]:
    t = recipe.target
    target = f"load target {t.source} ({t.dtype}, device {t.device}{', adapter ' + t.adapter if t.adapter else ''})"
    srcs = ", ".join(s.path for s in recipe.data.sources)
    if stage == "data prepare":
        src = str(recipe.regenerated_path) if recipe.data.regenerate.enabled else srcs
        return [f"load tokenizer of {t.source}", f"read {src}",
                f"tokenize with the chat template, max_length {recipe.data.max_length}",
                f"write token rows to {recipe.rows_dir}"]
    if stage == "data regenerate":
        g = recipe.data.regenerate
        return [target, f"read prompts from {srcs} (holdout {recipe.data.holdout_fraction:.0%} kept out)",
                f"generate ≤{g.max_new_tokens} tokens each, temperature {g.temperature}, batch {g.batch_size}",
                f"append conversations to {recipe.regenerated_path} (resumable)"]
    if stage == "vocab":
        return [f"read token rows from {recipe.rows_dir}",
                f"select {recipe.vocab.draft_vocab_size} draft tokens, write d2t/t2d to {recipe.vocab_dir}"]
    if stage == "dump":
        return [target, f"read token rows from {recipe.rows_dir}",
                f"capture aux layers {recipe.head.aux_layer_ids or 'default [2, L//2, L-3]'} + final state",
                f"write {recipe.dump.dtype} shards to {recipe.dump_dir}"]
    if stage == "train":
        tr = recipe.train
        feed = f"dump {recipe.dump_dir}" if recipe.dump.mode == "offline" else "online feed (target in process)"
        return [target if recipe.dump.mode == "online" else f"load target {t.source} (embedding, lm_head, identity)",
                f"feed: {feed}", f"train {recipe.head.kind} head: TTT {tr.ttt_steps}, lr {tr.lr}, ZeRO-{tr.zero_stage}, "
                f"{tr.precision}, micro-batch {tr.micro_batch_size} × accum {tr.grad_accum}",
                f"checkpoints and metrics under {recipe.train_dir}"]
    if stage == "export":
        return [f"load the trained head from {recipe.train_dir}",
                f"write {recipe.export.format} ({recipe.export.dtype}, k={recipe.export.k}) to {recipe.export_dir}",
                "validate it as vLLM and SGLang would read it"]
    if stage == "eval":
        e = recipe.eval
        return [target, f"prompts {e.prompts} (split {e.split}, limit {e.limit})",
                f"generate ≤{e.max_new_tokens} tokens with and without drafting: head {e.head or recipe.export_dir}, "
                f"k={e.k}, rule {e.rule}, temperature {e.temperature}, compare {e.compare}",
                f"write report.json, report.md and plots to {recipe.eval_dir}"]
    return []


def _recipe(args):
    return load_recipe(args.recipe, args.overrides)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except RecipeError as e:
        print(f"specheads: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # clear one-line errors for the failures we name; tracebacks otherwise
        if getattr(e, "specheads_user_error", False) or type(e).__name__ in {
            "DataError", "TargetError", "DumpError", "DumpMismatchError", "ExportError", "TrainError", "EvalError",
            "VocabError", "RuntimeInputError", "TemplateError", "FileNotFoundError", "RegenerateError", "VllmError",
        }:
            print(f"specheads: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        raise


def _dispatch(args) -> int:
    cmd = args.command
    if cmd == "data":
        stage = f"data {args.data_command}"
        recipe = _recipe(args)
        if args.dry_run:
            _print_plan(recipe, stage, _plan(recipe, stage))
            return 0
        from specheads.data import stage as data_stage

        if args.data_command == "prepare":
            data_stage.run_prepare(recipe)
        else:
            data_stage.run_regenerate(recipe)
        return 0

    if cmd == "vocab":
        recipe = _recipe(args)
        if args.dry_run:
            _print_plan(recipe, "vocab", _plan(recipe, "vocab"))
            return 0
        from specheads.data import stage as data_stage

        data_stage.run_vocab(recipe)
        return 0

    if cmd == "dump":
        if args.inspect:
            from specheads.dump.inspect import format_report, inspect_store

            report = inspect_store(args.inspect)
            print(format_report(report))
            return 0 if report.get("ok", False) else 1
        if not args.recipe:
            raise RecipeError("dump needs a recipe (or --inspect DIR)")
        recipe = _recipe(args)
        if args.dry_run:
            _print_plan(recipe, "dump", _plan(recipe, "dump"))
            return 0
        from specheads.dump.writer import run_dump

        run_dump(recipe)
        return 0

    if cmd == "train":
        recipe = _recipe(args)
        if args.dry_run:
            _print_plan(recipe, "train", _plan(recipe, "train"))
            return 0
        from specheads.train.loop import run_train

        summary = run_train(recipe)
        # the per-step losses live in metrics.jsonl; the console gets the headline
        print(json.dumps({k: v for k, v in summary.items() if k != "losses"}, indent=2, default=str))
        return 0

    if cmd == "export":
        from specheads.export import stage as export_stage

        return export_stage.main(args)

    if cmd == "eval":
        if args.dry_run and args.recipe:
            recipe = _recipe(args)
            _print_plan(recipe, "eval", _plan(recipe, "eval"))
            return 0
        from specheads.runtime import eval as eval_stage

        return eval_stage.main(args)
    raise AssertionError(cmd)


if __name__ == "__main__":
    sys.exit(main())
