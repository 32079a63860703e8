"""`specheads eval`: acceptance of draft heads in the bundled runtime, with lossless checks.

For every prompt (multi-turn prompts turn by turn) the target generates once
without drafting (the baseline: tokens/s and the reference outputs) and once
per run (head × k × rule, plus n-gram or suffix decoding when compared). The report gives τ,
vLLM's τ, acceptance rate, α_i, τ per category, tokens/s and speedup, and the
lossless checks: greedy outputs must equal the baseline token for token;
sampled outputs must keep the target's per-position token distribution
(two-sample χ² against plain sampling). With ``eval.sweep`` (``--sweep``) the
report also holds the serving sweep (``evaluate/sweep.py``): every drafter at every
k and concurrency under continuous batching, and the configuration to serve with.
"""

from __future__ import annotations

import datetime as _dt
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from specheads.data.formats import load_prompts
from specheads.data.sources import resolve_source, split_holdout
from specheads.errors import SpecheadsError
from specheads.evaluate.inputs import input_problems
from specheads.evaluate.lossless import chi_square_check, greedy_lossless
from specheads.evaluate.report import json_safe, write_report
from specheads.evaluate.sweep import SWEEP_PARTIAL, Candidate, WEIGHTLESS_LABEL, build_candidates, run_sweep
from specheads.fileio import tmp_path_for, write_json_atomic
from specheads.formats.convert import load_head_for
from specheads.runtime.chat import chat_generate
from specheads.runtime.drafters import forget_responses, make_drafter
from specheads.runtime.engines.static import parallel_drafter
from specheads.runtime.metrics import summarize
from specheads.runtime.model import TargetModel
from specheads.rundir import RunDir, RunLockedError, output_lock, stage_lock
from specheads.runtime.tree import TreeConfig
from specheads.target import load_target_for


class EvalError(SpecheadsError, ValueError):
    pass


WEIGHTLESS = ("ngram", "suffix")   # drafters of eval.compare that need no head; their drafts are chains


@dataclass
class RunSpec:
    name: str
    drafter: str                  # "ngram" | "suffix" | head directory
    k: int = 3
    tree: str | None = None       # "depth,topk,tokens"
    rule: str = "greedy"
    thresholds: tuple[float, float] = (1.0, 1.0)
    expect: str = "pass"          # "fail" for deliberately lossy settings (relaxed thresholds)
    hybrid: bool = False          # the head with n-gram drafts where the n-gram match is long enough
    adaptive: bool = True         # hybrid: the n-gram only while it has done at least as well as the head
    free: str = "ngram"           # hybrid: what the head is paired with, "ngram" or "suffix"

    def tree_config(self) -> TreeConfig | None:
        return parse_tree(self.tree) if self.tree else None


def parse_tree(tree: str) -> TreeConfig:
    try:
        d, tk, n = (int(x) for x in tree.split(","))
    except ValueError:
        raise EvalError(f"eval.tree {tree!r}: expected depth,topk,tokens (e.g. 4,4,16)") from None
    cfg = TreeConfig(d, tk, n)
    try:
        cfg.validate()
    except ValueError as e:
        raise EvalError(f"eval.tree {tree!r}: {e}") from None
    return cfg


# --- what to run: every check here happens before any weights load -------------------------


def plan_runs(recipe) -> list[RunSpec]:
    """The report's runs from ``recipe.eval``: heads × rules × k, then the compared drafters."""
    e = recipe.eval
    if e.split == "holdout" and recipe.data.holdout_fraction <= 0:
        raise EvalError("eval.split=holdout needs data.holdout_fraction > 0")
    heads = _heads(recipe)
    ks, rules = e.as_list("k"), e.as_list("rule")
    tree = e.tree
    if tree:
        parse_tree(tree)
    problems = input_problems(recipe, heads)
    if problems:
        raise EvalError("eval cannot start:\n  " + "\n  ".join(problems))
    runs: list[RunSpec] = []
    for h in heads:
        label = Path(h).name if len(heads) > 1 else "head"
        for rule in rules:
            if tree:
                runs.append(RunSpec(f"{label} tree {tree} {rule}", h, k=ks[0], tree=tree, rule=rule))
                continue
            runs += [RunSpec(f"{label} k={k} {rule}", h, k=k, rule=rule) for k in ks]
    chain_rules = [r for r in rules if r != "tree_target_only"]  # n-gram, suffix and hybrid drafts are chains
    if "suffix" in e.compare and e.engine == "vllm":
        raise EvalError("eval.compare=suffix with eval.engine=vllm: the side-by-side runs in vLLM do not map "
                        "suffix decoding yet; compare it with engine=specheads")
    for kind in WEIGHTLESS:
        if kind in e.compare:
            # one-hot drafts: rejection with draft probabilities reduces to the one-hot rule
            for rule in dict.fromkeys("onehot" if r == "rejection" else r for r in chain_rules):
                runs += [RunSpec(f"{kind} k={k} {rule}", kind, k=k, rule=rule) for k in ks]
    # hybrid_fixed: the match-length rule alone (no per-row score), side by side with the adaptive one
    for kind, adaptive, free in (("hybrid", True, "ngram"), ("hybrid_fixed", False, "ngram"),
                                 ("hybrid_suffix", True, "suffix")):
        if kind not in e.compare:
            continue
        if not heads:
            raise EvalError(f"eval.compare={kind} needs a head (eval.head / --head): it mixes a head with {free}")
        for h in heads:
            label = Path(h).name if len(heads) > 1 else "head"
            for rule in chain_rules:
                runs += [RunSpec(f"{kind} {label} k={k} {rule}", h, k=k, rule=rule, hybrid=True, adaptive=adaptive,
                                 free=free) for k in ks]
    if e.thresholds:
        a, b = (float(x) for x in e.thresholds.split(","))
        for r in list(runs):
            if r.rule == "tree_target_only" and r.drafter not in WEIGHTLESS:
                runs.append(RunSpec(f"{r.name} relaxed({a},{b})", r.drafter, k=r.k, tree=r.tree, rule=r.rule,
                                    thresholds=(a, b), expect="fail"))
    if not runs:
        raise EvalError("eval: nothing to compare — give a head (eval.head / --head) or a weightless drafter "
                        "(eval.compare / --compare ngram or suffix)")
    return runs


def _heads(recipe) -> list[str]:
    e = recipe.eval
    return e.as_list("head") if e.head is not None else [str(RunDir(recipe).export)]


def plan_sweep(recipe) -> tuple[list[Candidate], list[str]]:
    """The sweep's drafters (``eval.sweep``): each head, then n-gram and suffix decoding where eval.compare names
    them; and what it leaves out, as report notes. Called after ``plan_runs`` has checked the inputs."""
    e = recipe.eval
    heads = _heads(recipe)
    names = [Path(h).name for h in heads]
    # the report's name of each head: its folder's, or the path given where two folders share a name
    labels = ["head"] if len(heads) == 1 else [h if names.count(n) > 1 else n for h, n in zip(heads, names)]
    cands = [Candidate(label, h, list(e.sweep.k)) for label, h in zip(labels, heads)]
    cands += [Candidate(WEIGHTLESS_LABEL[w], w, list(e.sweep.k), kind=w) for w in WEIGHTLESS if w in e.compare]
    notes = []
    hybrids = [c for c in e.compare if c.startswith("hybrid")]
    if hybrids:
        notes.append(f"eval.compare {', '.join(hybrids)}: not swept (neither vLLM nor SGLang serves a head with "
                     "n-gram or suffix drafts)")
    if e.tree:
        notes.append(f"eval.tree {e.tree}: not swept (continuous batching and vLLM 0.32 verify chains; the sweep "
                     "serves chains of k drafts)")
    if not cands:
        raise EvalError("eval.sweep: nothing to sweep — give a head (eval.head / --head), or ngram or suffix in "
                        "eval.compare / --compare")
    return cands, notes


def load_eval_prompts(recipe) -> tuple[list[dict], str]:
    e = recipe.eval
    path = resolve_source(e.prompts)
    items = load_prompts(path)
    if e.split == "holdout":
        _, items = split_holdout(items, recipe.data.holdout_fraction)
    items = [it for it in items if it["turns"] and all(t.strip() for t in it["turns"])]
    if e.limit:
        items = items[: e.limit]
    if not items:
        raise EvalError(f"no prompts left from {e.prompts} (split {e.split}, limit {e.limit})")
    return items, str(path)


def build_drafter(spec: RunSpec, target, dtype, device, min_match: int = 3, compile: bool = False):
    """The runtime drafter of a run: n-gram, suffix decoding, or a head directory made whole for (and
    checked against) the target, alone or in a hybrid with n-gram or suffix decoding (its head step
    torch.compile'd with ``compile``)."""
    if spec.drafter == "suffix":
        return make_drafter("suffix")          # host trees: nothing to compile
    if spec.drafter == "ngram":
        d = make_drafter("ngram")
        return d.compile() if compile else d
    head, _meta = load_head_for(spec.drafter, target)
    d = make_drafter("hybrid" if spec.hybrid else "head", head.to(device=device, dtype=dtype).eval(),
                     name=spec.drafter, target_vocab_size=target.vocab_size, min_match=min_match,
                     adaptive=spec.adaptive, free=spec.free)
    return d.compile() if compile else d


def drafter_label(spec: RunSpec) -> str:
    """The report's name of a run's drafter."""
    if spec.drafter in WEIGHTLESS:
        return {"ngram": "n-gram", "suffix": "suffix decoding"}[spec.drafter]
    if not spec.hybrid:
        return spec.drafter
    free = "n-gram" if spec.free == "ngram" else "suffix decoding"
    return f"hybrid{'' if spec.adaptive else ' (fixed rule)'}: {spec.drafter} + {free}"


def _default_parallel_k(spec: RunSpec, drafter, e) -> None:
    """A parallel head (P-EAGLE, DFlash) drafts a fixed number of tokens per forward: without an
    explicit eval.k its runs take k = that number (known only once the head is loaded), not 3."""
    par = parallel_drafter(drafter)
    if par is None or "k" in e.model_fields_set or spec.tree:
        return
    k = par.tokens_per_forward
    spec.name, spec.k = spec.name.replace(f"k={spec.k}", f"k={k}"), k


# --- the evaluation ------------------------------------------------------------------------


def _engine_for(target, prompts: list[dict], e) -> TargetModel:
    tok = target.tokenizer
    # cache sized for the longest conversation: every turn's prompt plus every answer plus draft slack
    longest = max(sum(len(tok(t, add_special_tokens=False)["input_ids"]) + 64 for t in it["turns"]) + len(it["turns"])
                  * (e.max_new_tokens + 40) for it in prompts)
    max_pos = int(getattr(target.config, "max_position_embeddings", 4096) or 4096)
    batch = max(e.batch_size, min(64, e.chi_square_draws) if e.chi_square_draws else 1,
                min(max(e.sweep.concurrency), len(prompts)) if e.sweep.enabled else 1)
    engine = TargetModel.from_hf(target.model, max_batch=batch, max_seq=min(max_pos, longest + 64))
    return engine.compile_layers() if e.compile else engine


def _per_category(results) -> dict:
    by = defaultdict(list)
    for r in results:
        by[r.category or "uncategorised"].extend(r.records)
    return {c: summarize(recs)["tau"] for c, recs in sorted(by.items()) if recs}


class _Progress:
    """One bar per run, counted in generated tokens."""

    def __init__(self, total: int, label: str):
        self.bar = tqdm(total=total, desc=label, unit="tok", leave=False)

    def __enter__(self):
        return lambda n: self.bar.update(n)

    def __exit__(self, *exc):
        self.bar.close()


@stage_lock("eval")
def run_eval(recipe, target=None) -> dict:
    """Plain decoding, then every planned run; writes report.json/.md and plots to ``RunDir(recipe).eval``."""
    e = recipe.eval
    specs = plan_runs(recipe)
    sweep = plan_sweep(recipe) if e.sweep.enabled else None
    if e.engine == "vllm":
        from specheads.evaluate.vllm_compare import find_vllm_python

        find_vllm_python()  # a missing or unsupported vLLM fails before any of our runs
    prompts, prompt_path = load_eval_prompts(recipe)
    if target is None:
        target = load_target_for(recipe)
    tok = target.tokenizer
    engine = _engine_for(target, prompts, e)
    cuda_graphs = engine.device.type == "cuda"
    n_tokens = len(prompts) * e.max_new_tokens
    sampling = e.temperature > 0
    plain_rule = "onehot" if sampling else "greedy"
    common = dict(max_new_tokens=e.max_new_tokens, batch_size=e.batch_size, temperature=e.temperature,
                  top_k=e.top_k, top_p=e.top_p, seed=recipe.seed, use_cuda_graphs=cuda_graphs)

    # untimed warm-ups, at the run's batch size, before the plain baseline and before every drafted
    # run: the first calls of a shape pay one-off costs (allocator, CUDA-graph capture, compilation
    # with eval.compile) that would otherwise land inside the timed runs and skew every speedup
    warm = {**common, "max_new_tokens": min(8, e.max_new_tokens)}
    chat_generate(engine, tok, prompts[:e.batch_size], **warm, rule=plain_rule)
    with _Progress(n_tokens, "plain") as cb:
        plain, plain_s = chat_generate(engine, tok, prompts, rule=plain_rule, progress=cb, **common)
    plain_tokens = sum(len(a) for r in plain for a in r.answer_tokens)
    baseline = {"name": "plain (no drafting)", "engine": "specheads", "temperature": e.temperature,
                "tokens_per_s": plain_tokens / plain_s if plain_s else float("nan"), "generated_tokens": plain_tokens,
                "seconds": plain_s}

    runs, drafters = [], {}

    def drafter_for(spec: RunSpec):
        key = (spec.drafter, spec.hybrid, spec.adaptive, spec.free)
        if key not in drafters:
            drafters[key] = build_drafter(spec, target, engine.dtype, engine.device, e.hybrid_min_match, e.compile)
        return drafters[key]

    for spec in specs:
        drafter = drafter_for(spec)
        _default_parallel_k(spec, drafter, e)
        chat_generate(engine, tok, prompts[:e.batch_size], drafter=drafter, k=spec.k, tree=spec.tree_config(),
                      rule=spec.rule, thresholds=spec.thresholds, **warm)
        forget_responses(drafter)           # suffix decoding: not the warm-up's (or an earlier run's) answers
        with _Progress(n_tokens, spec.name) as cb:
            res, secs = chat_generate(engine, tok, prompts, drafter=drafter, k=spec.k, tree=spec.tree_config(),
                                      rule=spec.rule, thresholds=spec.thresholds, progress=cb, **common)
        records = [rec for r in res for rec in r.records]
        m = summarize(records, secs, sum(len(a) for r in res for a in r.answer_tokens))
        run = {"name": spec.name, "engine": "specheads", "drafter": drafter_label(spec),
               "k": spec.k, "tree": spec.tree, "rule": spec.rule, "thresholds": list(spec.thresholds),
               "temperature": e.temperature, "metrics": m, "per_category": _per_category(res),
               "tokens_per_s": m.get("tokens_per_s"),
               "speedup": (m["tokens_per_s"] / baseline["tokens_per_s"]) if baseline["tokens_per_s"] else None}
        if not sampling:
            run["lossless"] = greedy_lossless(plain, res, target, tok)
        elif e.chi_square_draws:
            run["lossless"] = chi_square_check(engine, tok, prompts, spec, drafter, draws=e.chi_square_draws,
                                               temperature=e.temperature, top_k=e.top_k, top_p=e.top_p,
                                               seed=recipe.seed)
        runs.append(run)
        print(f"{spec.name}: τ={m['tau']:.3f} (vLLM τ {m['vllm_mean_acceptance_length']:.3f}), "
              f"acceptance rate {m['acceptance_rate']:.3f}, {run['tokens_per_s']:.1f} tok/s, "
              f"speedup {run['speedup']:.2f}×", flush=True)

    report = {
        "title": f"Acceptance report — {target.name}",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "target": target.identity(),
        "prompts": {"source": e.prompts, "path": prompt_path, "split": e.split, "count": len(prompts),
                    "turns": sum(len(p["turns"]) for p in prompts),
                    "per_category": dict(sorted(Counter(p.get("category") or "uncategorised" for p in prompts).items()))},
        "settings": {"max_new_tokens": e.max_new_tokens, "batch_size": e.batch_size, "temperature": e.temperature,
                     "top_k": e.top_k, "top_p": e.top_p, "device": str(engine.device), "dtype": str(engine.dtype),
                     "cuda_graphs": cuda_graphs, "compiled": e.compile, "seed": recipe.seed},
        "baseline": baseline,
        "runs": runs,
        "notes": [],
    }
    out = RunDir(recipe).eval
    partial = out / SWEEP_PARTIAL
    for stale in (partial, tmp_path_for(partial)):     # an earlier sweep's, cut short: not this run's points
        stale.unlink(missing_ok=True)
    if sweep is not None:
        cands, notes = sweep
        build_candidates(cands, lambda h: drafter_for(RunSpec(h, h)), e.compile, notes)
        report["sweep"] = _sweep_keeping_points(report, out, partial, engine, target, prompts, recipe, cands, notes)
    if e.engine == "vllm":
        from specheads.evaluate.vllm_compare import add_vllm_runs

        report = add_vllm_runs(report, recipe, prompts, target, plain=plain)
    paths = write_report(report, out)
    partial.unlink(missing_ok=True)         # the report holds the whole sweep now
    print(f"report: {paths['md']} ({len(paths['plots'])} plots)")
    if e.update_card:  # only when asked: evaluating a head leaves its directory byte-identical
        _update_model_cards(specs, paths["json"])
    return report


def _sweep_keeping_points(report: dict, out: Path, partial: Path, engine, target, prompts, recipe, cands,
                          notes) -> dict:
    """The serving sweep (``run_sweep``), which serves every point twice over (warm-up, timed): the eval's own
    report is published first, and ``partial`` holds the points measured so far, then the finished sweep with its
    recommendation until the final report replaces it, so a sweep cut short (a time limit, a lost machine) or a
    failure after it loses none of them. A write that fails is a warning: the sweep goes on."""
    write_report(report, out)
    warned = []

    def keep(doc: dict) -> None:
        try:
            write_json_atomic(partial, json_safe({"created": report["created"], "settings": report["settings"],
                                                  **doc}))
        except OSError as err:
            if not warned:
                warned.append(err)
                print(f"warning: {partial} not written ({err}); the sweep goes on", flush=True)

    sweep = run_sweep(engine, target, prompts, recipe, cands, notes, progress=keep)
    keep({"complete": True, **sweep})
    return sweep


def _update_model_cards(specs: list[RunSpec], report_json: str) -> None:
    """With ``eval.update_card`` (``--update-card``): evaluated specheads exports get the measured acceptance
    in their model card (README.md, rewritten in the head directory)."""
    from specheads.formats.card import write_card

    for d in dict.fromkeys(r.drafter for r in specs if r.drafter not in WEIGHTLESS):
        if (Path(d) / "specheads.json").is_file():
            try:
                with output_lock(d, "eval"):  # the head directory is the export's output: no export may run
                    write_card(d, report_json=report_json)
            except (OSError, RunLockedError) as e:  # a read-only or busy head directory keeps its card
                print(f"model card of {d} not updated: {e}")
