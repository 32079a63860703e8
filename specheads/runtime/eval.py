"""`specheads eval`: acceptance of draft heads in the bundled runtime, with lossless checks.

For every prompt (multi-turn prompts turn by turn) the target generates once
without drafting (the baseline: tokens/s and the reference outputs) and once
per run (head × k × rule, plus n-gram when compared). The report gives τ,
vLLM's τ, acceptance rate, α_i, τ per category, tokens/s and speedup, and the
lossless checks: greedy outputs must equal the baseline token for token;
sampled outputs must keep the target's per-position token distribution
(two-sample χ² against plain sampling).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch


class EvalError(ValueError):
    pass


@dataclass
class RunSpec:
    name: str
    drafter: str                  # "ngram" | head directory
    k: int = 3
    tree: str | None = None       # "depth,topk,tokens"
    rule: str = "greedy"
    thresholds: tuple[float, float] = (1.0, 1.0)
    expect: str = "pass"          # "fail" for deliberately lossy settings (relaxed thresholds)


@dataclass
class EvalSettings:
    target: str
    prompts: str
    runs: list[RunSpec]
    out: Path
    target_dtype: str = "float32"
    device: str = "auto"
    adapter: str | None = None
    chat_template: str | None = None
    split: str = "all"
    holdout_fraction: float = 0.0
    limit: int | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 128
    batch_size: int = 1
    chi_square_draws: int = 0
    seed: int = 0
    engine: str = "specheads"
    notes: list[str] = field(default_factory=list)


# --- settings from a recipe or from flags ---------------------------------------------------


def _tree_name(tree):
    return f"tree {tree}" if tree else None


def settings_from_args(args) -> EvalSettings:
    recipe = None
    if args.recipe:
        from specheads.config import load_recipe

        recipe = load_recipe(args.recipe, args.overrides)
    e = recipe.eval if recipe else None
    target = args.target or (recipe.target.source if recipe else None)
    if not target:
        raise EvalError("eval needs --target (or a recipe)")
    heads = args.head or ([e.head or str(recipe.export_dir)] if recipe else [])
    prompts = args.prompts or (e.prompts if recipe else None)
    if not prompts:
        raise EvalError("eval needs --prompts FILE (or a recipe)")
    ks = args.k or [e.k if e else 3]
    rules = args.rule or [e.rule if e else "greedy"]
    temperature = args.temperature if args.temperature is not None else (e.temperature if e else 0.0)
    tree = args.tree or (e.tree if e else None)
    if tree:
        _parse_tree(tree)
    compare = args.compare if args.compare is not None else (e.compare if e else [])
    runs: list[RunSpec] = []
    for h in heads:
        label = Path(h).name if len(heads) > 1 else "head"
        for rule in rules:
            if tree:
                runs.append(RunSpec(f"{label} {_tree_name(tree)} {rule}", h, k=ks[0], tree=tree, rule=rule))
                continue
            for k in ks:
                runs.append(RunSpec(f"{label} k={k} {rule}", h, k=k, rule=rule))
    for c in compare:
        if c != "ngram":
            raise EvalError(f"--compare {c!r}: only 'ngram' is a weightless drafter; pass heads with --head")
        # n-gram drafts are one-hot: rejection with draft probabilities reduces to the one-hot rule
        for rule in dict.fromkeys("onehot" if r == "rejection" else r for r in rules):
            if rule == "tree_target_only":
                continue
            for k in ks:
                runs.append(RunSpec(f"ngram k={k} {rule}", "ngram", k=k, rule=rule))
    if args.thresholds:
        a, b = (float(x) for x in args.thresholds.split(","))
        for r in list(runs):
            if r.rule == "tree_target_only" and r.drafter != "ngram":
                runs.append(RunSpec(f"{r.name} relaxed({a},{b})", r.drafter, k=r.k, tree=r.tree, rule=r.rule,
                                    thresholds=(a, b), expect="fail"))
    out = Path(args.out) if args.out else (recipe.eval_dir if recipe else None)
    if out is None:
        raise EvalError("eval needs --out DIR (or a recipe)")
    s = EvalSettings(
        target=target, prompts=prompts, runs=runs, out=out, temperature=temperature,
        target_dtype=recipe.target.dtype if recipe else "float32",
        device=recipe.target.device if recipe else "auto",
        adapter=recipe.target.adapter if recipe else None,
        chat_template=recipe.target.chat_template if recipe else None,
        split=(e.split if e else "all"), holdout_fraction=recipe.data.holdout_fraction if recipe else 0.0,
        limit=args.limit if args.limit is not None else (e.limit if e else None),
        top_k=e.top_k if e else 0, top_p=e.top_p if e else 1.0,
        max_new_tokens=args.max_new_tokens or (e.max_new_tokens if e else 128),
        batch_size=args.batch_size or (e.batch_size if e else 1),
        chi_square_draws=args.chi_square_draws if args.chi_square_draws is not None else (e.chi_square_draws if e else 0),
        seed=recipe.seed if recipe else 0, engine=args.engine,
    )
    validate_settings(s)
    return s


def _parse_tree(tree: str):
    from specheads.runtime.tree import TreeConfig

    try:
        d, tk, n = (int(x) for x in tree.split(","))
    except ValueError:
        raise EvalError(f"--tree {tree!r}: expected depth,topk,tokens (e.g. 4,4,16)") from None
    cfg = TreeConfig(d, tk, n)
    try:
        cfg.validate()
    except ValueError as e:
        raise EvalError(f"--tree {tree!r}: {e}") from None
    return cfg


def validate_settings(s: EvalSettings) -> None:
    if s.split == "holdout" and s.holdout_fraction <= 0:
        raise EvalError("eval.split=holdout needs data.holdout_fraction > 0")
    for r in s.runs:
        if not 1 <= r.k <= 16:
            raise EvalError(f"run {r.name!r}: k={r.k} out of range 1..16")
        if r.rule not in ("greedy", "rejection", "onehot", "tree_target_only"):
            raise EvalError(f"run {r.name!r}: unknown rule {r.rule!r}")
        if s.temperature == 0 and r.rule in ("rejection", "onehot"):
            raise EvalError(f"rule {r.rule!r} samples: it needs --temperature > 0")
        if s.temperature > 0 and r.rule == "greedy":
            raise EvalError("rule 'greedy' is for temperature 0: use --rule rejection, onehot or tree_target_only")
        if r.tree:
            _parse_tree(r.tree)
        if r.drafter != "ngram" and not Path(r.drafter).is_dir():
            raise EvalError(f"head directory not found: {r.drafter}")


# --- the evaluation ------------------------------------------------------------------------


def _load_prompts(s: EvalSettings) -> tuple[list[dict], str]:
    from specheads.data.formats import load_prompts
    from specheads.data.sources import resolve_source, split_holdout

    path = resolve_source(s.prompts)
    items = load_prompts(path)
    if s.split == "holdout":
        _, items = split_holdout(items, s.holdout_fraction)
    items = [it for it in items if it["turns"] and all(t.strip() for t in it["turns"])]
    if s.limit:
        items = items[: s.limit]
    if not items:
        raise EvalError(f"no prompts left from {s.prompts} (split {s.split}, limit {s.limit})")
    return items, str(path)


def check_head_matches_target(head, meta, target, where: str) -> None:
    cfg = head.cfg
    th = getattr(cfg, "target_hidden_size", None) or cfg.hidden_size
    problems = []
    if th != target.hidden_size:
        problems.append(f"head expects target hidden size {th}, target has {target.hidden_size}")
    if cfg.target_vocab_size and cfg.target_vocab_size != target.vocab_size:
        problems.append(f"head expects target vocab {cfg.target_vocab_size}, target has {target.vocab_size}")
    ids = list(getattr(cfg, "aux_layer_ids", None) or [])
    if ids and max(ids) > target.num_layers:
        problems.append(f"head's aux layer ids {ids} exceed the target's {target.num_layers} layers")
    tc = (meta.target_config or {}) if meta is not None else {}
    if tc.get("config_hash") and tc["config_hash"] != target.config_hash:
        problems.append(f"head was trained for target {tc.get('name')!r} (config hash {tc['config_hash']}), "
                        f"this target is {target.name!r} ({target.config_hash})")
    if problems:
        raise EvalError(f"{where}: head does not match the target: " + "; ".join(problems))


def _build_drafter(spec: RunSpec, target, dtype, device):
    from specheads.runtime.drafters import NGramDrafter, drafter_for_head

    if spec.drafter == "ngram":
        return NGramDrafter()
    from specheads.export.convert import load_any

    head, meta, _fmt = load_any(spec.drafter)
    if getattr(head, "embed_tokens", None) is not None and float(head.embed_tokens.weight.abs().sum()) == 0:
        # exports that share the target's embedding (SGLang layout) leave it out
        head.embed_tokens.weight.data.copy_(target.embed_tokens.weight.to(head.embed_tokens.weight.dtype))
    lm = getattr(head, "lm_head", None)
    if head.cfg.kind in ("eagle1", "mtp") and lm is not None and float(lm.weight.abs().sum()) == 0:
        lm.weight.data.copy_(target.lm_head.weight.to(lm.weight.dtype))
    check_head_matches_target(head, meta, target, spec.drafter)
    head = head.to(device=device, dtype=dtype).eval()
    return drafter_for_head(head)


def _tree_cfg(tree: str | None):
    return _parse_tree(tree) if tree else None


def _per_category(results, summarize) -> dict:
    by = defaultdict(list)
    for r in results:
        by[r.category or "uncategorised"].extend(r.records)
    return {c: summarize(recs)["tau"] for c, recs in sorted(by.items()) if recs}


def _greedy_lossless(plain, drafted, target, tokenizer) -> dict:
    total = identical = 0
    divergences = []
    for p, d in zip(plain, drafted):
        for turn, (pt, dt) in enumerate(zip(p.answer_tokens, d.answer_tokens)):
            total += 1
            if pt == dt:
                identical += 1
                continue
            pos = next((i for i, (a, b) in enumerate(zip(pt, dt)) if a != b), min(len(pt), len(dt)))
            prefix = p.prompt_tokens[turn] + pt[:pos]
            with torch.no_grad():
                logits = target.model(torch.tensor([prefix], device=target.device)).logits[0, -1].float()
            top = torch.topk(logits, 2).values
            divergences.append({
                "prompt_id": p.id, "turn": turn, "position": pos,
                "plain_token": tokenizer.decode(pt[pos:pos + 1]) if pos < len(pt) else "<end>",
                "drafted_token": tokenizer.decode(dt[pos:pos + 1]) if pos < len(dt) else "<end>",
                "logit_margin": float(top[0] - top[1]),
            })
            if len(pt) != len(dt) and pt[:pos] == dt[:pos] and pos == min(len(pt), len(dt)):
                divergences[-1]["note"] = "one sequence is a prefix of the other (stopped at a different length)"
    return {"kind": "greedy", "total": total, "identical": identical, "divergences": divergences}


def chi_square_two_sample(samples_a: list[list[int]], samples_b: list[list[int]], positions: int,
                          min_expected: float = 5.0) -> list[float]:
    """Per-position two-sample χ² homogeneity p-values (rare tokens pooled into one bin)."""
    from scipy.stats import chi2_contingency

    pvals = []
    for pos in range(positions):
        a = Counter(s[pos] for s in samples_a if len(s) > pos)
        b = Counter(s[pos] for s in samples_b if len(s) > pos)
        na, nb = sum(a.values()), sum(b.values())
        if na < 10 or nb < 10:
            break
        keys = sorted(set(a) | set(b), key=lambda t: -(a[t] + b[t]))
        rows, other = [], [0, 0]
        for t in keys:
            exp = (a[t] + b[t]) * min(na, nb) / (na + nb)
            if exp >= min_expected:
                rows.append([a[t], b[t]])
            else:
                other[0] += a[t]
                other[1] += b[t]
        if sum(other):
            rows.append(other)
        if len(rows) < 2:
            pvals.append(1.0)  # one token only on both sides: identical distributions
            continue
        pvals.append(float(chi2_contingency(rows)[1]))
    return pvals


def _chi_square_check(engine, tokenizer, prompts, spec, drafter, s: EvalSettings, positions: int = 4) -> dict:
    """Many sampled draws of the first few tokens, drafted vs plain, for the first prompts."""
    from specheads.runtime.chat import render_prompt
    from specheads.runtime.generate import generate

    draws = s.chi_square_draws
    pvals = []
    for it in prompts[:2]:
        msgs = ([{"role": "system", "content": it["system"]}] if it.get("system") else []) + \
               [{"role": "user", "content": it["turns"][0]}]
        ids = render_prompt(tokenizer, msgs)
        plain, drafted = [], []
        bs = max(1, min(engine.max_batch, draws))
        for start in range(0, draws, bs):
            n = min(bs, draws - start)
            seeds = [s.seed * 1_000_003 + start + i for i in range(n)]
            r0 = generate(engine, [ids] * n, positions, rule="onehot", temperature=s.temperature, top_k=s.top_k,
                          top_p=s.top_p, seed=seeds, stop_token_ids=())
            r1 = generate(engine, [ids] * n, positions, drafter=drafter, k=spec.k, tree=_tree_cfg(spec.tree),
                          rule=spec.rule, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                          thresholds=spec.thresholds, seed=[x + 500_000 for x in seeds], stop_token_ids=())
            plain += r0.tokens
            drafted += r1.tokens
        pvals += chi_square_two_sample(plain, drafted, positions)
    level = 0.01 / max(1, len(pvals))
    p_min = min(pvals) if pvals else float("nan")
    return {"kind": "chi_square", "draws": draws, "p_values": pvals, "p_min": p_min, "alpha_level": level,
            "passed": bool(pvals) and p_min > level, "expect": spec.expect}


def run_eval(s: EvalSettings, target=None) -> dict:
    from tqdm import tqdm

    from specheads.runtime.chat import chat_generate
    from specheads.runtime.metrics import summarize
    from specheads.runtime.model import TargetModel
    from specheads.runtime.report import write_report
    from specheads.target import load_target

    prompts, prompt_path = _load_prompts(s)
    if target is None:
        target = load_target(s.target, dtype=s.target_dtype, device=s.device, adapter=s.adapter,
                             chat_template=s.chat_template)
    tok = target.tokenizer
    # cache sized for the longest conversation: every turn's prompt plus every answer plus draft slack
    longest = max(sum(len(tok(t, add_special_tokens=False)["input_ids"]) + 64 for t in it["turns"]) + len(it["turns"])
                  * (s.max_new_tokens + 40) for it in prompts)
    max_pos = int(getattr(target.config, "max_position_embeddings", 4096) or 4096)
    max_seq = min(max_pos, longest + 64)
    batch = max(s.batch_size, min(64, s.chi_square_draws) if s.chi_square_draws else 1)
    engine = TargetModel.from_hf(target.model, max_batch=batch, max_seq=max_seq)
    cuda_graphs = engine.device.type == "cuda"
    n_tokens = len(prompts) * s.max_new_tokens
    common = dict(max_new_tokens=s.max_new_tokens, batch_size=s.batch_size, temperature=s.temperature,
                  top_k=s.top_k, top_p=s.top_p, seed=s.seed, use_cuda_graphs=cuda_graphs)

    def progress_bar(label):
        bar = tqdm(total=n_tokens, desc=label, unit="tok", leave=False)
        return bar, (lambda n: bar.update(n))

    sampling = s.temperature > 0
    # untimed warm-up: the first calls pay one-off costs (allocator, graph capture) that would
    # otherwise land on the plain baseline and inflate every speedup
    chat_generate(engine, tok, prompts[:1], **{**common, "max_new_tokens": min(8, s.max_new_tokens)},
                  rule="onehot" if sampling else "greedy")
    bar, cb = progress_bar("plain")
    plain, plain_s = chat_generate(engine, tok, prompts, rule="onehot" if sampling else "greedy", progress=cb, **common)
    bar.close()
    plain_tokens = sum(len(a) for r in plain for a in r.answer_tokens)
    baseline = {"name": "plain (no drafting)", "engine": "specheads", "temperature": s.temperature,
                "tokens_per_s": plain_tokens / plain_s if plain_s else float("nan"), "generated_tokens": plain_tokens,
                "seconds": plain_s}
    runs = []
    drafters = {}
    for spec in s.runs:
        if spec.drafter not in drafters:
            drafters[spec.drafter] = _build_drafter(spec, target, engine.dtype, engine.device)
        drafter = drafters[spec.drafter]
        bar, cb = progress_bar(spec.name)
        res, secs = chat_generate(engine, tok, prompts, drafter=drafter, k=spec.k, tree=_tree_cfg(spec.tree),
                                  rule=spec.rule, thresholds=spec.thresholds, progress=cb, **common)
        bar.close()
        records = [rec for r in res for rec in r.records]
        gen = sum(len(a) for r in res for a in r.answer_tokens)
        m = summarize(records, secs, gen)
        run = {"name": spec.name, "engine": "specheads", "drafter": "n-gram" if spec.drafter == "ngram" else spec.drafter,
               "k": spec.k, "tree": spec.tree, "rule": spec.rule, "thresholds": list(spec.thresholds),
               "temperature": s.temperature, "metrics": m, "per_category": _per_category(res, summarize),
               "tokens_per_s": m.get("tokens_per_s"),
               "speedup": (m["tokens_per_s"] / baseline["tokens_per_s"]) if baseline["tokens_per_s"] else None}
        if not sampling:
            run["lossless"] = _greedy_lossless(plain, res, target, tok)
        elif s.chi_square_draws:
            run["lossless"] = _chi_square_check(engine, tok, prompts, spec, drafter, s)
        runs.append(run)
        print(f"{spec.name}: τ={m['tau']:.3f} (vLLM τ {m['vllm_mean_acceptance_length']:.3f}), "
              f"acceptance rate {m['acceptance_rate']:.3f}, {run['tokens_per_s']:.1f} tok/s, "
              f"speedup {run['speedup']:.2f}×", flush=True)
    report = {
        "title": f"Acceptance report — {target.name}",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "target": target.identity(),
        "prompts": {"source": s.prompts, "path": prompt_path, "split": s.split, "count": len(prompts),
                    "turns": sum(len(p["turns"]) for p in prompts)},
        "settings": {"max_new_tokens": s.max_new_tokens, "batch_size": s.batch_size, "temperature": s.temperature,
                     "top_k": s.top_k, "top_p": s.top_p, "device": str(engine.device), "dtype": str(engine.dtype),
                     "cuda_graphs": cuda_graphs, "seed": s.seed},
        "baseline": baseline,
        "runs": runs,
        "notes": s.notes,
    }
    if s.engine == "vllm":
        from specheads.runtime import vllm_compare

        report = vllm_compare.add_vllm_runs(report, s, prompts, target=target, plain=plain)
    paths = write_report(report, s.out)
    print(f"report: {paths['md']} ({len(paths['plots'])} plots)")
    _update_model_cards(s, paths["json"])
    return report


def _update_model_cards(s: EvalSettings, report_json: str) -> None:
    """Evaluated specheads exports get the measured acceptance in their model card."""
    from specheads.export.card import write_card

    for d in dict.fromkeys(r.drafter for r in s.runs if r.drafter != "ngram"):
        if (Path(d) / "specheads.json").is_file():
            try:
                write_card(d, report_json=report_json)
            except OSError as e:  # a read-only head directory keeps its card
                print(f"model card of {d} not updated: {e}")


def main(args) -> int:
    s = settings_from_args(args)
    if s.engine == "vllm":
        from specheads.runtime.vllm_compare import find_vllm_python

        find_vllm_python()  # a missing or unsupported vLLM fails before any of our runs
    if getattr(args, "dry_run", False):
        print(json.dumps({"target": s.target, "prompts": s.prompts, "runs": [r.__dict__ for r in s.runs],
                          "out": str(s.out)}, indent=2, default=str))
        return 0
    run_eval(s)
    return 0
