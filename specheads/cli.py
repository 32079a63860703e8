"""specheads command line: parse, load a recipe, call one stage.

Every stage is ``run_<stage>(recipe)``, imported from its package (``STAGE_ENTRIES``). A stage command takes a recipe file
and dotted ``key=value`` overrides; the flags of ``export`` and ``eval`` are
turned into overrides of the same recipe keys, so a flag and the recipe can
never disagree. ``--dry-run`` prints the resolved recipe and what would run
without loading any weights. Stage modules are imported lazily so that
``--help`` and ``--dry-run`` stay instant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from specheads.config import Recipe, RecipeError, load_recipe
from specheads.errors import SpecheadsError, UsageError
from specheads.rundir import RunDir

STAGES = {
    "data synthesize": "user prompts written by the target itself (steered categories, copy-heavy tasks, de-duplicated)",
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


def _recipe_default(key: str):
    """The schema's default of a dotted recipe key (what a flag falls back to without a recipe value)."""
    node = Recipe()
    for part in key.split("."):
        node = getattr(node, part)
    return node


# eval without a recipe: every prompt, and only the drafters named on the command line
EVAL_STANDALONE = {"eval.split": "all", "data.holdout_fraction": 0, "eval.limit": None, "eval.head": [],
                   "eval.compare": []}


def _document_defaults(p: argparse.ArgumentParser, flags: dict[str, str], standalone: dict | None = None) -> None:
    """Every flag's help names its recipe key and that key's default."""
    for action in p._actions:
        key = flags.get(action.dest)
        if key and action.help and "default" not in action.help:
            if standalone and key in standalone:
                action.help += (f"; default: the recipe's value ({_recipe_default(key)!r} in the schema), "
                                f"{standalone[key]!r} without a recipe")
            else:
                action.help += f"; default: the recipe's value, else {_recipe_default(key)!r}"


def build_parser() -> argparse.ArgumentParser:
    from specheads import __version__

    ap = argparse.ArgumentParser(prog="specheads", description="Train, export and measure speculative-decoding draft heads.")
    ap.add_argument("--version", action="version", version=f"specheads {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="data stages").add_subparsers(dest="data_command", required=True)
    _add_recipe_args(data.add_parser("prepare", help=STAGES["data prepare"]))
    _add_recipe_args(data.add_parser("regenerate", help=STAGES["data regenerate"]))
    _add_recipe_args(data.add_parser("synthesize", help=STAGES["data synthesize"]))

    _add_recipe_args(sub.add_parser("vocab", help=STAGES["vocab"]))

    p = sub.add_parser("dump", help=STAGES["dump"])
    _add_recipe_args(p, optional=True)
    p.add_argument("--inspect", metavar="DIR", help="print a store's manifest summary and check every shard")

    _add_recipe_args(sub.add_parser("train", help=STAGES["train"]))

    p = sub.add_parser("export", help=STAGES["export"])
    p.add_argument("source", nargs="?", help="recipe YAML, run directory or checkpoint directory")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides (the recipe's, or the run's recorded one)")
    p.add_argument("--format", choices=["speculators", "sglang", "eagle", "mtp", "dflash_native"], help="= export.format")
    p.add_argument("--out", help="output directory (= export.out; default: {run_dir}/export/{format})")
    p.add_argument("--k", type=int, help="number of speculative tokens written into the config (= export.k)")
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], help="= export.dtype")
    p.add_argument("--from", dest="from_dir", metavar="DIR", help="convert an exported head (any supported format)")
    p.add_argument("--check", metavar="DIR", help="validate an exported directory as vLLM and SGLang would read it")
    p.add_argument("--target", help="with --check: the target the head must match (checks verifier, vocab, hidden size)")
    p.add_argument("--dry-run", action="store_true", help="print what would run; load nothing")
    _document_defaults(p, EXPORT_FLAGS)

    p = sub.add_parser("eval", help=STAGES["eval"])
    p.add_argument("recipe", nargs="?", help="recipe YAML (optional when --target/--prompts/--out are given)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides (e.g. eval.limit=8)")
    p.add_argument("--target", help="target: HF id, directory, .gguf or smollm2-135m (= target.source)")
    p.add_argument("--head", action="append", help="head directory (repeat to compare several heads; = eval.head)")
    p.add_argument("--prompts", help="prompt file (any supported format) or builtin:demo_prompts (= eval.prompts)")
    p.add_argument("--k", type=int, action="append", help="draft length (repeat to compare several k; = eval.k)")
    p.add_argument("--tree", help="EAGLE-2 tree: depth,topk,tokens (= eval.tree)")
    p.add_argument("--temperature", type=float, help="= eval.temperature")
    p.add_argument("--rule", action="append", choices=["greedy", "rejection", "onehot", "tree_target_only"],
                   help="verification rule (repeat to compare rules; = eval.rule)")
    p.add_argument("--compare", action="append", choices=["ngram", "hybrid", "hybrid_fixed", "suffix", "hybrid_suffix"],
                   help="drafters to put beside the heads: ngram, hybrid (each head + n-gram where its match is "
                   "long, scored per row), hybrid_fixed (the same without the per-row score), suffix (suffix "
                   "decoding, vLLM's method 'suffix'), hybrid_suffix (each head + suffix decoding, scored per row) "
                   "(= eval.compare)")
    p.add_argument("--engine", choices=["specheads", "vllm"],
                   help="vllm: also run the same prompts in vLLM and put both side by side (= eval.engine)")
    p.add_argument("--thresholds", help="tree_target_only: also run relaxed thresholds single,acc (e.g. 0.05,0.5); "
                   "the report must show they fail the χ² test (= eval.thresholds)")
    p.add_argument("--chi-square-draws", type=int,
                   help="sampled draws per prompt for the χ² lossless check (= eval.chi_square_draws)")
    p.add_argument("--batch-size", type=int, help="= eval.batch_size")
    p.add_argument("--limit", type=int, help="= eval.limit")
    p.add_argument("--max-new-tokens", type=int, help="= eval.max_new_tokens")
    p.add_argument("--out", help="report directory (= eval.out; default: {run_dir}/eval)")
    p.add_argument("--update-card", action="store_true", default=None,
                   help="write the measured acceptance (and the --sweep's recommended serving configuration) into the "
                   "README.md model card of each evaluated specheads export (without it, eval leaves the head "
                   "directories untouched; = eval.update_card)")
    p.add_argument("--sweep", action="store_true", default=None,
                   help="also serve the prompts with continuous batching at every eval.sweep.concurrency, plain and "
                   "with every head (and n-gram / suffix decoding of --compare) at every eval.sweep.k, and recommend "
                   "the fastest configuration per concurrency with its vLLM --speculative-config and SGLang flags "
                   "(report; the card with --update-card) (= eval.sweep.enabled)")
    p.add_argument("--sweep-k", type=int, action="append", help="a k of the sweep (repeat for several; = eval.sweep.k)")
    p.add_argument("--concurrency", type=int, action="append",
                   help="requests in flight of the sweep (repeat for several; = eval.sweep.concurrency)")
    p.add_argument("--sweep-repeat", type=int,
                   help="timed passes a sweep point, its rate their median (= eval.sweep.repeat)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved recipe and the plan; load nothing")
    _document_defaults(p, EVAL_FLAGS, EVAL_STANDALONE)
    return ap


# --- flags -> recipe overrides --------------------------------------------------------------


def _flag_overrides(args, mapping: dict[str, str]) -> list[str]:
    """``key=value`` overrides for the flags that were given (values as JSON, which YAML reads)."""
    out = []
    for attr, key in mapping.items():
        v = getattr(args, attr, None)
        if v is not None:
            out.append(f"{key}={json.dumps(v)}")
    return out


EXPORT_FLAGS = {"format": "export.format", "out": "export.out", "k": "export.k", "dtype": "export.dtype"}
EVAL_FLAGS = {"target": "target.source", "head": "eval.head", "prompts": "eval.prompts", "k": "eval.k",
              "tree": "eval.tree", "temperature": "eval.temperature", "rule": "eval.rule", "compare": "eval.compare",
              "engine": "eval.engine", "thresholds": "eval.thresholds", "chi_square_draws": "eval.chi_square_draws",
              "batch_size": "eval.batch_size", "limit": "eval.limit", "max_new_tokens": "eval.max_new_tokens",
              "out": "eval.out", "update_card": "eval.update_card", "sweep": "eval.sweep.enabled",
              "sweep_k": "eval.sweep.k", "concurrency": "eval.sweep.concurrency",
              "sweep_repeat": "eval.sweep.repeat"}


def eval_recipe(args) -> Recipe:
    """The eval recipe: the file's (if any), then its overrides, then the flags."""
    flags = _flag_overrides(args, EVAL_FLAGS)
    if args.recipe:
        recipe = load_recipe(args.recipe, list(args.overrides) + flags)
    else:
        missing = [f for f, attr in (("--target", "target"), ("--prompts", "prompts"), ("--out", "out"))
                   if getattr(args, attr) is None]
        if missing:
            raise RecipeError(f"eval without a recipe needs {', '.join(missing)}")
        standalone = [f"{k}={json.dumps(v)}" for k, v in EVAL_STANDALONE.items()]
        recipe = load_recipe(None, standalone + list(args.overrides) + flags)
    sweep_flags = ("sweep_k", "concurrency", "sweep_repeat")
    if any(getattr(args, a, None) for a in sweep_flags) and not recipe.eval.sweep.enabled:
        raise RecipeError("--sweep-k, --concurrency and --sweep-repeat set the sweep's k, concurrency and timed "
                          "passes, but the sweep is off: add --sweep (or eval.sweep.enabled: true)")
    return recipe


def export_recipe(args) -> tuple[Recipe, Path | None]:
    """(recipe, source dir or None): a recipe file, or the recipe a run recorded in its meta.json."""
    overrides = list(args.overrides) + _flag_overrides(args, EXPORT_FLAGS)
    p = Path(args.source)
    if p.is_file():
        if p.suffix not in (".yaml", ".yml", ".json"):
            raise UsageError(f"{p}: SOURCE must be a recipe YAML, a run directory or a checkpoint directory")
        return load_recipe(p, overrides), None
    from specheads.export.stage import recipe_for_run

    return recipe_for_run(p, overrides), p


# --- dry-run plans --------------------------------------------------------------------------


def _print_plan(recipe: Recipe | None, stage: str, what: list[str]) -> None:
    print(f"# specheads {stage} — dry run (nothing loaded)")
    if recipe is not None:
        print(recipe.to_yaml().rstrip())
    print("# would run:")
    for line in what:
        print(f"#   {line}")


def _plan(recipe: Recipe, stage: str) -> list[str]:
    t, paths = recipe.target, RunDir(recipe)
    target = f"load target {t.source} ({t.dtype}, device {t.device}{', adapter ' + t.adapter if t.adapter else ''})"
    srcs = ", ".join(s.path for s in recipe.data.sources)
    if stage == "data prepare":
        src = str(paths.regenerated) if recipe.data.regenerate.enabled else srcs
        return [f"load tokenizer of {t.source}", f"read {src}",
                f"tokenize with the chat template, max_length {recipe.data.max_length}",
                f"write token rows to {paths.rows}"]
    if stage == "data regenerate":
        g = recipe.data.regenerate
        return [target, f"read prompts from {srcs} (holdout {recipe.data.holdout_fraction:.0%} kept out)",
                f"generate ≤{g.max_new_tokens} tokens each, temperature {g.temperature}, batch {g.batch_size}",
                f"append conversations to {paths.regenerated} (resumable)"]
    if stage == "data synthesize":
        s, c = recipe.data.synthesize, recipe.data.synthesize.copy_tasks
        docs = f"documents from {c.documents}" if c.documents else f"documents the target writes (≤{c.document_tokens} tokens)"
        return [target, f"write {s.num_prompts} user prompts (≤{s.max_new_tokens} tokens, {s.turns} turn(s) each, "
                f"temperature {s.temperature}, batch {s.batch_size}) steered by {s.seeds}",
                f"{c.fraction:.0%} copy-heavy ({', '.join(c.tasks)}) wrapping {docs}, ≤{c.max_prompt_tokens} tokens",
                f"drop degenerate, exact and near-duplicate prompts (threshold {s.dedup_threshold})",
                f"append prompts to {paths.synthesized} (resumable); summary and category plot beside it"]
    if stage == "vocab":
        return [f"read token rows from {paths.rows}",
                f"select {recipe.vocab.draft_vocab_size} draft tokens, write d2t/t2d to {paths.vocab}"]
    if stage == "dump":
        return [target, f"read token rows from {paths.rows}",
                f"capture aux layers {recipe.head.aux_layer_ids or 'default [2, L//2, L-3]'} + final state",
                f"write {recipe.dump.dtype} shards to {paths.dump}"]
    if stage == "train":
        tr = recipe.train
        feed = f"dump {paths.dump}" if recipe.dump.mode == "offline" else "online feed (target in process)"
        return [target if recipe.dump.mode == "online" else f"load target {t.source} (embedding, lm_head, identity)",
                f"feed: {feed}", f"train {recipe.head.kind} head: TTT {tr.ttt_steps}, lr {tr.lr}, ZeRO-{tr.zero_stage}, "
                f"{tr.precision}, micro-batch {tr.micro_batch_size} × accum {tr.grad_accum}",
                f"checkpoints and metrics under {paths.train}"]
    if stage == "export":
        x = recipe.export
        return [f"load the trained head from {paths.train} (final/ or the latest checkpoint)",
                f"write {x.format} ({x.dtype}, k={x.k}) to {paths.export}",
                "validate it as vLLM and SGLang would read it; compare reloaded outputs with the trained head",
                f"write README.md (with {paths.eval}/report.json when it exists)"]
    if stage == "eval":
        e = recipe.eval
        head = e.head if e.head is not None else str(paths.export)
        what = [target, f"prompts {e.prompts} (split {e.split}, limit {e.limit})",
                f"generate ≤{e.max_new_tokens} tokens with and without drafting: head {head}, "
                f"k={e.k}, rule {e.rule}, temperature {e.temperature}, compare {e.compare}, engine {e.engine}"]
        if e.sweep.enabled:
            what.append(f"sweep: serve with continuous batching at concurrency {e.sweep.concurrency}, plain and each "
                        f"head (and {[c for c in e.compare if c in ('ngram', 'suffix')] or 'no'} weightless drafter) "
                        f"at k {e.sweep.k}; recommend the fastest per concurrency")
        return what + [f"write report.json, report.md and plots to {paths.eval}"]
    return []


def train_summary(s: dict) -> str:
    """Three lines for a person: what ran, how well it learnt, where it is."""
    minutes = s["elapsed_s"] / 60
    lines = [f"trained {s['kind']} head: steps {s['start_step']} → {s['steps']} of {s['total_steps']}, "
             f"{s['tokens']:,} tokens at {s['tokens_per_s']:,.0f} tok/s ({s['train_loop_s'] / 60:.1f} min training, "
             f"{minutes:.1f} min with set-up, evaluation and saving; {s['world_size']} process(es), {s['precision']}"
             + (f"; {100 * s['padding_fraction']:.1f}% of token slots padding" if s.get("padding_fraction") is not None
                else "")
             + (f"; peak device memory {s['peak_memory_gib']:.1f} GiB ({s['peak_reserved_gib']:.1f} reserved)"
                if s.get("peak_memory_gib") is not None else "") + ")"]
    ev = s.get("eval") or {}
    if ev.get("loss") is not None:
        acc = " · ".join(f"{a:.2f}" for a in ev.get("step_acc", []))
        line = f"held-out: loss {ev['loss']:.3f}, accuracy per step {acc or '—'}"
        if ev.get("sim_tau") is not None:
            line += f", simulated τ {ev['sim_tau']:.2f}"
        lines.append(line)
    lines.append(f"head: {s['final_dir']}   metrics: {s['metrics']}   plots: {', '.join(s['plots']) or '—'}")
    return "\n".join(lines)


# --- dispatch -------------------------------------------------------------------------------

# every recipe-driven stage: command -> (its package, its entry ``run_<stage>(recipe)``)
STAGE_ENTRIES = {
    "data prepare": ("data", "run_prepare"), "data regenerate": ("data", "run_regenerate"),
    "data synthesize": ("data", "run_synthesize"), "vocab": ("data", "run_vocab"), "dump": ("dump", "run_dump"),
    "train": ("train", "run_train"), "export": ("export", "run_export"), "eval": ("evaluate", "run_eval"),
}


def stage_entry(stage: str):
    """``run_<stage>`` of a stage command, its package imported only now (``--help`` and ``--dry-run`` load
    no stage)."""
    package, name = STAGE_ENTRIES[stage]
    if package == "data":
        import specheads.data as pkg
    elif package == "dump":
        import specheads.dump as pkg
    elif package == "train":
        import specheads.train as pkg
    elif package == "export":
        import specheads.export as pkg
    else:
        import specheads.evaluate as pkg
    return getattr(pkg, name)



def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except SpecheadsError as e:
        print(f"specheads{_rank_label()}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2 if isinstance(e, RecipeError) else 1


def _rank_label() -> str:
    """' (rank R of W)' in a multi-process launch: a fault one rank hits (its disk full, say) is said by that rank
    alone, among the launcher's lines about the ranks it then stops."""
    world, rank = os.environ.get("WORLD_SIZE", "1"), os.environ.get("RANK", "0")
    return f" (rank {rank} of {world})" if world.isdigit() and int(world) > 1 else ""


def _stage_recipe(args, stage: str):
    """The recipe of a plain stage command, or None when --dry-run printed the plan."""
    recipe = load_recipe(args.recipe, args.overrides)
    if args.dry_run:
        _print_plan(recipe, stage, _plan(recipe, stage))
        return None
    return recipe


def _dispatch(args) -> int:
    cmd = args.command
    if cmd == "dump" and args.inspect:
        from specheads.dump.inspect import format_report, inspect_store

        report = inspect_store(args.inspect)
        print(format_report(report))
        return 0 if report.get("ok", False) else 1
    if cmd == "dump" and not args.recipe:
        raise RecipeError("dump needs a recipe (or --inspect DIR)")

    if cmd in ("data", "vocab", "dump", "train"):
        stage = f"data {args.data_command}" if cmd == "data" else cmd
        recipe = _stage_recipe(args, stage)
        if recipe is None:
            return 0
        result = stage_entry(stage)(recipe)
        if stage == "train" and int(os.environ.get("RANK", "0")) == 0:  # one summary, not one per process
            print(train_summary(result))  # every number of the run is in metrics.jsonl
        return 0

    if cmd == "export":
        return _export(args)

    if cmd == "eval":
        recipe = eval_recipe(args)
        if args.dry_run:
            from specheads.rundir import is_run_dir

            # a plan may name heads, prompts and a GGUF that later stages or another machine provide;
            # a run directory given as the target is a mistake on any machine
            if is_run_dir(recipe.target.source):
                raise UsageError(f"target.source: {recipe.target.source} is not a model directory (no config.json); "
                                 "it looks like a specheads run directory: give the target model its head was "
                                 "trained for (the run's recipe names it in target.source)")
            _print_plan(recipe, "eval", _plan(recipe, "eval"))
            return 0
        stage_entry("eval")(recipe)
        return 0
    raise AssertionError(cmd)


def _export(args) -> int:
    """Three modes: export a trained head (the stage), --from DIR (convert), --check DIR (validate)."""
    check, from_dir, source = args.check, args.from_dir, args.source
    if check and from_dir:
        raise UsageError("--check and --from are separate modes; give one")
    if args.target and not check:
        raise UsageError("--target goes with --check DIR (an export takes its target from the trained head)")
    if (check or from_dir) and (source or args.overrides):
        raise UsageError(f"{'--check' if check else '--from'} takes no SOURCE/overrides (got {source!r})")
    if from_dir and not (args.format and args.out):
        raise UsageError("--from DIR needs --format F and --out OUT")
    if not (check or from_dir or source):
        raise UsageError("give a SOURCE (recipe YAML, run directory or checkpoint directory), --from DIR or --check DIR")
    if args.k is not None and not 1 <= args.k <= 16:
        raise UsageError(f"--k {args.k}: the number of speculative tokens must be in 1..16")

    if check:
        if args.dry_run:
            plan = [f"read {check}/config.json and tensor headers; check them as vLLM and SGLang read them"]
            if args.target:
                plan.append(f"read the config of {args.target} (no weights); compare verifier, vocab, hidden size")
            _print_plan(None, "export", plan)
            return 0
        from specheads.export.stage import run_check

        return run_check(check, args.target)
    if from_dir:
        if args.dry_run:
            _print_plan(None, "export", [f"load the exported head in {from_dir} (format detected)",
                                         f"write {args.format} ({args.dtype or 'bfloat16'}) to {args.out}",
                                         "validate it and compare outputs with the source head"])
            return 0
        from specheads.export.stage import run_convert

        run_convert(from_dir, args.format, args.out, dtype=args.dtype or "bfloat16", k=args.k)
        return 0
    recipe, source_dir = export_recipe(args)
    if args.dry_run:
        plan = _plan(recipe, "export")
        if source_dir is not None:
            plan[0] = f"load the trained head from {source_dir} (final/ or the latest checkpoint)"
        _print_plan(recipe, "export", plan)
        return 0
    stage_entry("export")(recipe, source_dir)
    return 0


def entry() -> None:
    """The ``specheads`` command: :func:`main`, and a rank of a multi-process launch (torchrun, deepspeed) ends
    without the interpreter's teardown, where DeepSpeed's leftover gloo threads can abort it
    (``train.engine.finish_process``)."""
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "torch" in sys.modules:
        from specheads.train.engine import finish_process

        finish_process(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
