"""The Qwen2.5-Coder-1.5B run of ``gpu_qwen.sh``: ``OUT/qwen2.5_coder_1.5b.json`` and a Markdown table; and the
held-out code set that run evaluates on.

``code-holdout`` writes the code eval set: the prompts of a code file no recipe trains on (code_alpaca_2k.json),
less every row whose instruction is the same as, or a near-duplicate of, an instruction of a file the recipe does
train on (new_codealpaca.json), with the counts beside it (``.summary.json``).

``summary`` reads what the stages wrote (nothing is re-measured here): per head kind (``eagle3``, ``peagle``,
``dflash``) the eval reports ``RUN/eval_{kind}_{set}/report.json`` and the training metrics
``RUN/train_{kind}/metrics.jsonl``; ``bench_runtime`` JSONs (``--runtime KIND=F``; ``model_free=F``: plain, n-gram
and suffix decoding without a head), ``bandwidth.py``'s JSON and the script's timeline. Per head and eval set: τ
of the head, n-gram, suffix decoding and the two hybrids, the head against the better model-free drafter (overall
and per category), and the hybrid that pairs the head with that one; decode speed per batch size, static and
served; the goals judged on what was measured (anything not run is said so). ``--merge F`` fills the heads this run
did not train from an earlier summary (each head kind is a run of its own), marked ``carried_over``. A head trained
with gpu_qwen.sh's TAG (``train_KIND_TAG``: a variant on the same rows, another learning rate say) is listed under
``KIND_TAG`` beside the recipe's head; the goals judge the recipe's heads.

    python benchmarks/qwen_summary.py code-holdout --src DATA/code_alpaca_2k.json \\
        --exclude DATA/new_codealpaca.json --out RUN/data/code_holdout.json
    python benchmarks/qwen_summary.py summary --run RUN --out OUT/qwen2.5_coder_1.5b.json [--md OUT/....md] \\
        [--timeline OUT/timeline.txt] [--bandwidth OUT/bandwidth.json] [--runtime eagle3=F ...] [--merge F ...]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from parallel_summary import training  # noqa: E402
from reference_summary import _load, eval_set, machine, timeline  # noqa: E402
from run_paths import relative  # noqa: E402
from specheads.config import SynthesizeConfig  # noqa: E402
from specheads.data.synthesize import normalized_text, word_shingles  # noqa: E402
from specheads.fileio import write_json_atomic  # noqa: E402
from specheads.train.run_log import read_metrics  # noqa: E402

TITLE = "Qwen2.5-Coder-1.5B-Instruct draft heads (GGUF Q4_K_M target, online training)"
KINDS = ("eagle3", "peagle", "dflash")
CODE_SET = "code_alpaca_2k_heldout"
SETS = {"mixed": "builtin:eval_mixed, 152 prompts in 7 categories, never trained on",
        "vicuna": "vicuna_bench_questions.jsonl, 80 prompts",
        "gsm8k_holdout": "gsm8k_train.jsonl, the rows data.holdout_fraction holds back",
        "code_holdout": f"{CODE_SET}: code_alpaca_2k.json, trained on by no source, less the instructions "
                        "new_codealpaca.json repeats (see code_holdout)"}
FREE = ("ngram", "suffix")
HYBRID_OF = {"ngram": "hybrid", "suffix": "hybrid_suffix"}  # the hybrid whose free half each drafter is
TAU_GOALS = {"mixed": 2.6, "code_holdout": 3.0}              # the EAGLE-3 head's τ at k = 3
RATIO = 1.3            # the EAGLE-3 head's τ against the better model-free drafter's, per category of the mixed set
MFU_GOAL = 0.40        # online training, the target's forward counted
BOUND_WITHIN = 2.0     # plain decoding at batch 1 within 2× of the memory-bandwidth bound
BUDGET_S = 1200        # prompts to an evaluated head on one H100
SPEED_GOALS = {1: 2.5, 8: 1.8, 32: 1.3}  # the best head's speedup over plain decoding: batch 1, 8 and 32 served
OVER_TAU = 0.85        # every drafter's speedup at batch 1 against its τ
NEAR = SynthesizeConfig.model_fields["dedup_threshold"].default  # word 3-gram Jaccard at which two prompts are one
DATA_STAGES = ("target", "synthesize", "regenerate", "prepare", "vocab", "code_holdout")


# --------------------------------------------------------------------------- the held-out code set

def code_holdout(src: Path, exclude: Path, out: Path) -> dict:
    """``src``'s rows less those whose instruction ``exclude`` repeats exactly or nearly (Jaccard of word 3-grams
    ≥ NEAR): the instruction is the request, and a training row asking the same thing of other code would make the
    held-out set partly seen. Writes ``out`` (the kept rows, ``src``'s format) and ``out``.summary.json."""
    rows, other = json.loads(src.read_text()), json.loads(exclude.read_text())
    seen = {normalized_text(r["instruction"]) for r in other}
    grams = [word_shingles(r["instruction"]) for r in other]
    index: dict[str, set[int]] = defaultdict(set)
    for i, g in enumerate(grams):
        for s in g:
            index[s].add(i)
    kept, exact, near = [], [], []
    for r in rows:
        ins = r["instruction"]
        if normalized_text(ins) in seen:
            exact.append(ins)
            continue
        g = word_shingles(ins)
        cands = set().union(*(index[s] for s in g if s in index))
        if any(len(g & grams[j]) / len(g | grams[j]) >= NEAR for j in cands):
            near.append(ins)
            continue
        kept.append(r)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, kept)
    summary = {"name": CODE_SET, "source": src.name, "excluded_against": exclude.name, "source_rows": len(rows),
               "same_instruction": len(exact), "near_duplicate_instruction": len(near), "near_threshold": NEAR,
               "kept": len(kept), "dropped": exact + near}
    write_json_atomic(out.with_suffix(".summary.json"), summary)
    print(f"{CODE_SET}: {len(kept)} of {len(rows)} {src.name} prompts kept ({len(exact)} with an instruction "
          f"{exclude.name} has, {len(near)} near-duplicates of one at Jaccard >= {NEAR}) -> {out}")
    return summary


# --------------------------------------------------------------------------- the summary

def versus_free(s: dict) -> dict:
    """One eval set: the head against the better model-free drafter, overall and per category, and the hybrid of
    the head with that drafter."""
    d = s["drafters"]
    head = d.get("head")
    free = {k: d[k] for k in FREE if k in d and d[k].get("tau") is not None}
    out = {"drafters": {k: {"tau": v.get("tau"), "speedup": v.get("speedup"), "k": v.get("k")} for k, v in d.items()},
           "prompts": s.get("prompts")}
    if head is None:
        return out
    best = max(free, key=lambda k: free[k]["tau"]) if free else None
    hybrid = d.get(HYBRID_OF[best]) if best else None
    cats = {}
    for c, t in (head.get("per_category") or {}).items():
        taus = {k: (v.get("per_category") or {}).get(c) for k, v in free.items()}
        taus = {k: v for k, v in taus.items() if v is not None}
        b = max(taus, key=taus.get) if taus else None
        cats[c] = {"head": t, **taus, "best_free": b, "ratio": t / taus[b] if b and taus[b] else None}
    out.update({"k": head.get("k"), "tau": head.get("tau"), "alpha": head.get("alpha"), "speedup": head.get("speedup"),
                "lossless": head.get("lossless"), "best_free": best,
                "best_free_tau": free[best]["tau"] if best else None,
                "ratio": head["tau"] / free[best]["tau"] if best and free[best]["tau"] else None,
                "hybrid_best": ({"name": HYBRID_OF[best], "tau": hybrid.get("tau"), "speedup": hybrid.get("speedup")}
                                if hybrid else None),
                "per_category": cats})
    return out


def flops_per_token(train: dict, rows: dict | None, bandwidth: dict | None) -> dict | None:
    """Model FLOPs of one trained token of an EAGLE-3 head trained online: bench_train.py's count of the head's step
    (TTT unroll forward and backward, the frozen lm_head's draft logits and full-vocabulary argmax) at the rows'
    mean length, plus the target's forward (2 per weight below the lm_head, attention over half the row)."""
    cfg_d = (train or {}).get("head_config")
    if not cfg_d or cfg_d.get("kind") != "eagle3" or not rows or not rows.get("rows") or not bandwidth:
        return None
    from bench_train import step_flops  # beside this file
    from specheads.heads import HeadConfig

    cfg = HeadConfig.from_dict(cfg_d)
    T = max(1, round(rows["tokens"] / rows["rows"]))
    K = train.get("ttt_steps") or 7
    head = step_flops(cfg, 1, T, K)["total"] / T
    w = bandwidth["weights"]
    body = w["parameters_read"] - cfg.target_vocab_size * cfg.target_hidden_size  # the lm_head is in `head`
    attn = 2 * 2 * (cfg_d.get("target_num_layers") or 0) * (T / 2) * cfg.num_attention_heads * cfg.head_dim
    return {"head": head, "target_forward": 2 * body + attn, "total": head + 2 * body + attn, "mean_row_tokens": T,
            "ttt_steps": K}


def head_training(train_dir: Path) -> dict | None:
    if not (train_dir / "metrics.jsonl").is_file():
        return None
    rows = read_metrics(train_dir)
    t = training(train_dir, rows)
    last = next((r for r in reversed(rows) if r.get("split") == "train"), None)
    t["ttt_steps"] = len(last["step_loss"]) if last and last.get("step_loss") else None
    t["elapsed_s"] = last.get("elapsed_s") if last else None
    return t


def runtime_rows(res: dict | None) -> dict | None:
    if res is None:
        return None
    same = ("lossless", "sequences_differing", "first_difference")
    keep = ("engine", "batch", "drafter", "tau", "tokens_per_s", "decode_tokens_per_s", "speedup", "decode_speedup",
            *same)
    serve = ("engine", "batch", "harvest", "drafter", "tau", "tokens_per_s", "speedup", *same)
    return {"device": res.get("device"), "dtype": res.get("dtype"), "k": res.get("k"),
            "new_tokens": res.get("new_tokens"), "rows": [{k: r.get(k) for k in keep} for r in res.get("rows", [])],
            "serving": [{k: r.get(k) for k in serve} for r in res.get("serving", [])]}


def _identical(r: dict) -> str:
    """A runtime row's greedy identity: yes, or how many sequences differ and from which token on."""
    if r.get("lossless") is None:
        return "—"
    if r["lossless"]:
        return "yes"
    n, at = r.get("sequences_differing"), r.get("first_difference")
    return "no" + (f" ({n} differ, first at token {at})" if n is not None else "")


def sweep_summary(eval_dir: Path) -> dict | str:
    """``eval --sweep``'s result for one head (``RUN/eval_sweep_KIND``): the recommendation per concurrency with
    its τ, speedup, identity and serving commands, each drafter's best k, and plain decoding's rate; from the
    report, or from ``sweep_partial.json`` when the sweep was cut short (``complete`` False, no recommendation)."""
    rep = _load(eval_dir / "report.json") or {}
    # the eval's report is written before its sweep starts: a sweep cut short is in sweep_partial.json alone
    sw = rep.get("sweep") or _load(eval_dir / "sweep_partial.json")
    if sw is None:
        return "not run"
    settings = rep.get("settings") or sw.get("settings") or {}
    # a cut sweep's points carry no counts of their own: they are the eval's prompts and settings
    sw = {"conversations": (rep.get("prompts") or {}).get("count"),
          "max_new_tokens": settings.get("max_new_tokens"), **sw}
    point = ("concurrency", "drafter", "k", "tau", "tokens_per_s", "tokens_per_s_passes", "speedup")
    serve = ("vllm_flag", "sglang", "sglang_note")

    def keep(p: dict) -> dict:
        ll = p.get("lossless") or {}
        return {**{k: p.get(k) for k in point}, "identical": ll.get("identical"), "total": ll.get("total"),
                **{k: (p.get("serving") or {}).get(k) for k in serve}}
    return {"complete": "recommendation" in sw, "dtype": settings.get("dtype"),
            "prompts": (rep.get("prompts") or {}).get("path"), "conversations": sw.get("conversations"),
            "max_new_tokens": sw.get("max_new_tokens"),
            "plain": [{k: p.get(k) for k in ("concurrency", "in_flight", "tokens_per_s")} for p in sw.get("plain", [])],
            "recommendation": [keep(p) for p in sw.get("recommendation", [])],
            "best": [keep(p) for p in sw.get("best", [])], "points": [keep(p) for p in sw.get("points", [])],
            "notes": sw.get("notes", [])}


def head_names(run: Path) -> list[tuple[str, str]]:
    """(name, kind) of every head in the run: each kind, then the variants it trained (gpu_qwen.sh TAG: a
    ``train_KIND_TAG`` folder; a tag has no '_', so ``train_eagle3_a_b`` is no variant of eagle3)."""
    out = []
    for kind in KINDS:
        out.append((kind, kind))
        tags = sorted(p.name[len(f"train_{kind}_"):] for p in run.glob(f"train_{kind}_*") if p.is_dir())
        out += [(f"{kind}_{t}", kind) for t in tags if "_" not in t]
    return out


def stage_seconds(stages: dict, name: str) -> dict:
    own = [n for n in stages if n in (f"train_{name}", f"export_{name}", *(f"eval_{name}_{s}" for s in SETS))]
    names = [n for n in DATA_STAGES if n in stages] + own
    return {"seconds": sum(stages[n]["seconds"] for n in names), "stages": names,
            "wall_s": (stages.get(f"prompts_to_eval_{name}") or {}).get("seconds")}


def run_device(timeline_file: Path | None) -> str | None:
    """The GPU the stages ran on: the ``name, memory MiB`` line gpu_qwen.sh writes under its first line."""
    if timeline_file is None or not Path(timeline_file).exists():
        return None
    for line in Path(timeline_file).read_text().splitlines():
        m = re.fullmatch(r"(.+), \d+ MiB", line.strip())
        if m:
            return m.group(1)
    return None


def summarize(run: Path, timeline_file: Path | None, bandwidth_file: Path | None, runtimes: dict) -> dict:
    data = run / "data"
    rows = _load(data / "rows" / "summary.json")
    bandwidth = _load(bandwidth_file)
    # "machine" is where this summary was written; "run_device" where the stages ran (gpu_qwen.sh's nvidia-smi line)
    out = {"title": TITLE, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
           "run_device": run_device(timeline_file),
           "data": {"synthesize": _load(data / "synthesize_summary.json"),
                    "regenerate": _load(data / "regenerate_summary.json"), "rows": rows},
           "code_holdout": _load(data / "code_holdout.summary.json"), "eval_sets": SETS,
           "stages": timeline(timeline_file), "bandwidth": bandwidth, "heads": {},
           # plain, n-gram and suffix decoding measured before any head exists (gpu_qwen.sh's runtime_model_free)
           "model_free_runtime": runtime_rows(_load(runtimes.get("model_free")))}
    if isinstance(out["code_holdout"], dict):
        out["code_holdout"].pop("dropped", None)  # their instructions stay in the .summary.json beside the set
    for name, kind in head_names(run):
        h = {"training": head_training(run / f"train_{name}"), "evals": {},
             "runtime": runtime_rows(_load(runtimes.get(name)))}
        for es in SETS:
            rep = _load(run / f"eval_{name}_{es}" / "report.json")
            h["evals"][es] = versus_free(eval_set(rep)) if rep else "not run"
        if h["training"] is None and all(v == "not run" for v in h["evals"].values()):
            # a runtime alone (a head trained in an earlier run, timed in this one): ``merge`` adds the rest
            out["heads"][name] = {"training": None, "evals": h["evals"], "runtime": h["runtime"]} if h["runtime"] \
                else "not run"
            continue
        if name != kind:
            h["kind"] = kind
        fl = flops_per_token(h["training"], rows, bandwidth)
        tps = (h["training"] or {}).get("tokens_per_s_median")
        peak = ((bandwidth or {}).get("matmul_peak") or {}).get("flops_per_s")
        h["mfu"] = ({"value": tps * fl["total"] / peak, "tokens_per_s": tps, "flops_per_token": fl,
                     "peak_flops_per_s": peak, "device": bandwidth.get("device")} if fl and tps and peak
                    else "not measured")
        h["time"] = stage_seconds(out["stages"], name)
        h["sweep"] = sweep_summary(run / f"eval_sweep_{name}")
        out["heads"][name] = h
    return out


def merge(summary: dict, earlier: dict, path: Path) -> None:
    # the rows an earlier head trained on: a run of other data sizes makes its τ no like-for-like comparison
    rows = ((earlier.get("data") or {}).get("rows") or {})
    origin = {"file": str(path), "date": earlier.get("date"), "machine": earlier.get("machine"),
              "run_device": earlier.get("run_device"), "rows": rows.get("rows"), "tokens": rows.get("tokens")}
    for kind, h in (earlier.get("heads") or {}).items():
        cur = summary["heads"].get(kind)
        own = isinstance(cur, dict) and (cur.get("training") or _evaluated(cur))
        if isinstance(h, dict) and not own:
            merged = h if "carried_over" in h else {"carried_over": origin, **h}
            rt = merged.get("runtime")
            if isinstance(rt, dict) and "carried_over" not in rt:  # the earlier run's timing, named as such
                merged = {**merged, "runtime": {"carried_over": merged["carried_over"], **rt}}
            if isinstance(cur, dict) and cur.get("runtime"):      # timed in this run: its rows win
                merged = {**merged, "runtime": cur["runtime"]}
            summary["heads"][kind] = merged
    if summary.get("bandwidth") is None and earlier.get("bandwidth"):
        summary["bandwidth"] = {"carried_over": origin, **earlier["bandwidth"]}
    if summary.get("model_free_runtime") is None and earlier.get("model_free_runtime"):
        summary["model_free_runtime"] = {"carried_over": origin, **earlier["model_free_runtime"]}


def _evaluated(h: dict) -> bool:
    """Whether a head's summary has any eval set measured."""
    return any(isinstance(e, dict) for e in h["evals"].values())


def _ev(summary: dict, kind: str, name: str):
    h = summary["heads"].get(kind)
    e = h["evals"].get(name) if isinstance(h, dict) else None
    return e if isinstance(e, dict) and e.get("tau") is not None else None


def plain_vs_bound(summary: dict) -> dict | None:
    """Plain decoding at batch 1 beside the bandwidth bound: bandwidth.py's own comparison, or, where it ran without
    a bench_runtime JSON (another kind's run), the plain row of any head's runtime (plain decoding has no head)."""
    bw = summary.get("bandwidth") or {}
    if bw.get("plain") or not bw.get("bound_tokens_per_s"):
        return bw.get("plain")
    for kind, h in summary["heads"].items():
        rt = h.get("runtime") if isinstance(h, dict) else None
        row = next((r for r in (rt or {}).get("rows", []) if r["drafter"] == "plain" and r["batch"] == 1), None)
        if row:
            return {"file": f"bench_runtime_{kind}", "engine": row["engine"], "device": rt["device"],
                    "dtype": rt["dtype"], "tokens_per_s": row["tokens_per_s"],
                    "decode_tokens_per_s": row["decode_tokens_per_s"],
                    "fraction_of_bound": row["decode_tokens_per_s"] / bw["bound_tokens_per_s"]}
    return None


def speed_rows(summary: dict, variants: bool = True):
    """(source, "static" | "served", row) for every decode-speed row: the model-free run's, then each head's. A run
    carried over from an earlier summary is named by its date, and its row of a drafter that this run timed again
    (same mode, batch, k and engine) is left out: the newer code's figure supersedes it. A carried plain row stays
    while a carried drafted row of its batch and mode does: it is their baseline. ``variants`` False leaves out the
    rows of TAG variants (heads with a ``kind`` of their own), which still supersede as above."""
    modes = (("static", "rows"), ("served", "serving"))
    sources = [("model_free", summary.get("model_free_runtime"))]
    sources += [(k, h.get("runtime")) for k, h in summary["heads"].items() if isinstance(h, dict)]

    def key(rt, mode, r):
        return mode, r["drafter"], r.get("batch"), rt.get("k"), r.get("engine")

    fresh = {key(rt, mode, r) for _, rt in sources if rt and "carried_over" not in rt
             for mode, field in modes for r in rt.get(field) or []}
    variant = {n for n, h in summary["heads"].items() if isinstance(h, dict) and "kind" in h}
    for src, rt in sources:
        if not variants and src in variant:
            continue
        co = (rt or {}).get("carried_over")
        label = f"{src} (from {co.get('date')})" if co else src
        for mode, field in modes:
            rows = (rt.get(field) or []) if rt else []
            superseded = [bool(co) and key(rt, mode, r) in fresh for r in rows]
            drafted = {r.get("batch") for r, old in zip(rows, superseded) if not old and r["drafter"] != "plain"}
            for r, old in zip(rows, superseded):
                if not old or (r["drafter"] == "plain" and r.get("batch") in drafted):
                    yield label, mode, r


def _drafts_with_head(drafter: str) -> bool:
    return drafter.startswith(("head", "hybrid"))


def speed_goals(summary: dict) -> dict:
    """The best head's speedup at batch 1 (one request) and served at 8 and 32 slots (continuous batching), and
    speedup ÷ τ of every drafter at batch 1, from the bench_runtime rows: the model-free run's and the recipe's heads'
    (a TAG variant's rows are listed, not judged)."""
    g, rows = {}, list(speed_rows(summary, variants=False))
    for batch, want in SPEED_GOALS.items():
        mode = "static" if batch == 1 else "served"
        name = f"best_head_speedup_{'batch' if batch == 1 else 'served'}{batch}>={want}"
        cand = [(r["speedup"], f"{src}: {r['drafter']}") for src, m, r in rows
                if m == mode and r.get("batch") == batch and _drafts_with_head(r["drafter"]) and r.get("speedup")]
        best = max(cand) if cand else None
        g[name] = "not run" if best is None else {"value": best[0], "met": best[0] >= want, "drafter": best[1]}
    ratios = {f"{src}: {r['drafter']}": r["speedup"] / r["tau"] for src, m, r in rows
              if m == "static" and r.get("batch") == 1 and r["drafter"] != "plain" and r.get("tau")
              and r.get("speedup")}
    g[f"every_drafter_speedup>={OVER_TAU}_tau_batch1"] = "not run" if not ratios else {
        "met": all(v >= OVER_TAU for v in ratios.values()), "ratios": ratios,
        "short": sorted(k for k, v in ratios.items() if v < OVER_TAU)}
    return g


def goals(summary: dict) -> dict:
    g = {}
    for name, want in TAU_GOALS.items():
        e = _ev(summary, "eagle3", name)
        g[f"eagle3_tau_k3_{name}>={want}"] = "not run" if e is None else {"value": e["tau"], "met": e["tau"] >= want}
    m = _ev(summary, "eagle3", "mixed")
    if m is None or not m.get("per_category"):
        g[f"eagle3_over_best_model_free>={RATIO}_every_category"] = "not run"
    else:
        cats = {c: v["ratio"] for c, v in m["per_category"].items()}
        g[f"eagle3_over_best_model_free>={RATIO}_every_category"] = {
            "met": all(r is not None and r >= RATIO for r in cats.values()), "ratios": cats,
            "short": sorted(c for c, r in cats.items() if r is None or r < RATIO)}
    plain = plain_vs_bound(summary)
    g[f"plain_batch1_within_{BOUND_WITHIN:g}x_of_bandwidth_bound"] = "not run" if not plain else {
        "value": plain["decode_tokens_per_s"], "bound": summary["bandwidth"]["bound_tokens_per_s"],
        "fraction": plain["fraction_of_bound"], "met": plain["fraction_of_bound"] >= 1 / BOUND_WITHIN,
        "device": summary["bandwidth"].get("device")}
    h = summary["heads"].get("eagle3")
    mfu = h.get("mfu") if isinstance(h, dict) else None
    g[f"online_training_mfu>={MFU_GOAL:.0%}"] = ({"value": mfu["value"], "met": mfu["value"] >= MFU_GOAL,
                                                  "device": mfu.get("device")}
                                                 if isinstance(mfu, dict) else "not measured")
    t = (h.get("time") or {}).get("seconds") if isinstance(h, dict) else None
    done = isinstance(h, dict) and all(isinstance(v, dict) for v in h["evals"].values())
    g[f"prompts_to_evaluated_head<={BUDGET_S}s"] = ({"value": t, "met": t <= BUDGET_S,
                                                      "device": summary.get("run_device")
                                                      or summary["machine"].get("gpu", "cpu")} if t and done
                                                     else "not run (some stage missing)")
    g.update(speed_goals(summary))
    return g


def _f(x, fmt="{:.2f}"):
    return "–" if x is None else fmt.format(x)


def markdown(s: dict) -> str:
    lines = [f"### {s['title']}", "",
             "| head | eval set | k | τ head | n-gram | suffix | hybrid n-gram | hybrid suffix | head ÷ best free | "
             "speedup | lossless |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for kind, h in s["heads"].items():
        if not isinstance(h, dict):
            lines.append(f"| {kind} | not run | | | | | | | | | |")
            continue
        if "carried_over" in h:
            co = h["carried_over"]
            rows = f", {co['rows']:,} rows" if co.get("rows") else ""
            kind = f"{kind} (from {co.get('date')}{rows})"
        div = (h.get("training") or {}).get("diverged")
        if div and not _evaluated(h):
            shape = f" (input_ids shape {div['input_ids_shape']})" if div.get("input_ids_shape") else ""
            lines.append(f"| {kind} | training diverged: {div.get('what')} at optimizer step {div.get('step')}{shape}; "
                         f"not evaluated | | | | | | | | | |")
            continue
        for name, e in h["evals"].items():
            if not isinstance(e, dict) or e.get("tau") is None:
                lines.append(f"| {kind} | {name}: not run | | | | | | | | | |")
                continue
            d = e["drafters"]
            tau = lambda k: _f((d.get(k) or {}).get("tau"))  # noqa: E731
            ll = e.get("lossless") or {}
            lines.append(f"| {kind} | {name} | {e['k']} | {e['tau']:.2f} | {tau('ngram')} | {tau('suffix')} | "
                         f"{tau('hybrid')} | {tau('hybrid_suffix')} | {_f(e['ratio'])}× ({e['best_free']}) | "
                         f"{_f(e['speedup'])}× | {ll.get('identical')}/{ll.get('total')} |")
    ch = s.get("code_holdout")
    if ch:
        lines += ["", f"Held-out code set `{ch['name']}`: {ch['kept']} of {ch['source_rows']} {ch['source']} prompts "
                  f"({ch['same_instruction']} with an instruction {ch['excluded_against']} has and "
                  f"{ch['near_duplicate_instruction']} near-duplicates of one, word 3-gram Jaccard ≥ "
                  f"{ch['near_threshold']}, left out)."]
    bw = s.get("bandwidth")
    if bw:
        p = plain_vs_bound(s)
        lines += ["", f"Memory-bandwidth bound at batch 1: {bw['bound_tokens_per_s']:,.0f} tok/s "
                  f"({bw['copy']['bytes_per_s'] / 1e9:,.0f} GB/s device copy ÷ {bw['weights']['bytes'] / 1e9:.2f} GB "
                  f"of {bw['weights']['dtype']} weights, {bw['device']}); plain decoding "
                  + (f"{p['decode_tokens_per_s']:,.0f} tok/s after the prefill = {p['fraction_of_bound']:.2f} of it."
                     if p else "not measured (RUNTIME=1).")]
    speed = list(speed_rows(s))
    if speed:
        lines += ["", "Decode speed (bench_runtime.py; static: one batch of B prompts; served: continuous batching "
                  "in B slots; speedup against plain decoding in the same run):", "",
                  "| run | batch | mode | drafter | τ | tok/s | speedup | after the prefill | speedup ÷ τ | "
                  "identical to plain |",
                  "|---|---:|---|---|---:|---:|---:|---:|---:|---|"]
        for src, mode, r in speed:
            over = r["speedup"] / r["tau"] if r.get("speedup") and r.get("tau") else None
            dsp = f"{_f(r['decode_speedup'])}×" if r.get("decode_speedup") is not None else "—"
            lines.append(f"| {src} | {r.get('batch')} | {mode} | {r['drafter']} | {_f(r.get('tau'))} | "
                         f"{_f(r.get('tokens_per_s'), '{:,.0f}')} | {_f(r.get('speedup'))}× | {dsp} | {_f(over)} | "
                         f"{_identical(r)} |")
    for kind, h in s["heads"].items():
        if isinstance(h, dict) and isinstance(h.get("mfu"), dict):
            m = h["mfu"]
            lines.append(f"\n{kind} online training: {m['tokens_per_s']:,.0f} tok/s × "
                         f"{m['flops_per_token']['total'] / 1e9:.2f} GFLOP a token (target forward "
                         f"{m['flops_per_token']['target_forward'] / 1e9:.2f}) = MFU {m['value']:.1%} of "
                         f"{m['peak_flops_per_s'] / 1e12:.3g} TFLOP/s ({m.get('device')}).")
        if isinstance(h, dict) and h.get("time") and _evaluated(h):
            lines.append(f"\n{kind}: prompts → evaluated head {h['time']['seconds']} s, the sum of its stages "
                         f"({', '.join(h['time']['stages'])}).")
    for kind, h in s["heads"].items():
        sw = h.get("sweep") if isinstance(h, dict) else None
        if isinstance(sw, dict):
            lines += sweep_markdown(kind, sw)
    lines += ["", "Goals:", ""]
    for name, v in s["goals"].items():
        lines.append(f"- {name}: " + (v if isinstance(v, str) else
                                      f"{'met' if v['met'] else 'missed'}"
                                      + (f" ({_f(v['value'], '{:.3g}')})" if v.get("value") is not None else "")
                                      + (f", {v['drafter']}" if v.get("drafter") else "")
                                      + (f", on {v['device']}" if v.get("device") else "")
                                      + (f", short: {', '.join(v['short'])}" if v.get("short") else "")))
    return "\n".join(lines) + "\n"


def sweep_markdown(kind: str, sw: dict) -> list[str]:
    """The serving sweep's recommendation per concurrency (or, cut short, the points it measured)."""
    plain = {p["concurrency"]: p["tokens_per_s"] for p in sw["plain"]}
    rows = sw["recommendation"] if sw["complete"] else sw["points"]
    head = (f"\n{kind} serving sweep (`eval --sweep`, continuous batching, {sw.get('conversations')} conversations of "
            f"the held-out code set, {sw.get('max_new_tokens')} new tokens, {sw.get('dtype')}): "
            + ("the recommended configuration per concurrency:" if sw["complete"]
               else "cut short, no recommendation; the points it measured:"))
    lines = [head, "", "| concurrency | drafter | k | τ | tok/s (plain) | speedup | identical to plain | vLLM |",
             "|---:|---|---:|---:|---:|---:|---|---|"]
    for p in rows:
        ident = f"{p['identical']}/{p['total']}" if p.get("total") else "—"
        flag = f"`{p['vllm_flag']}`" if p.get("vllm_flag") else "no flag (plain)"
        lines.append(f"| {p['concurrency']} | {p['drafter']} | {p['k'] or '—'} | {_f(p.get('tau'))} | "
                     f"{_f(p.get('tokens_per_s'), '{:,.0f}')} ({_f(plain.get(p['concurrency']), '{:,.0f}')}) | "
                     f"{_f(p.get('speedup'))}× | {ident} | {flag} |")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("code-holdout", help="write the held-out code eval set")
    c.add_argument("--src", type=Path, required=True)
    c.add_argument("--exclude", type=Path, required=True)
    c.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("summary", help="the run's summary JSON (and Markdown)")
    s.add_argument("--run", type=Path, required=True, help="the recipes' run_dir")
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--md", type=Path)
    s.add_argument("--timeline", type=Path)
    s.add_argument("--bandwidth", type=Path, help="bandwidth.py's JSON")
    s.add_argument("--runtime", action="append", default=[], metavar="KIND=FILE", help="bench_runtime.py's JSON")
    s.add_argument("--merge", type=Path, action="append", default=[], metavar="SUMMARY",
                   help="an earlier summary: the heads this run did not train")
    a = ap.parse_args(argv)
    if a.cmd == "code-holdout":
        return code_holdout(a.src, a.exclude, a.out)
    runtimes = dict(spec.split("=", 1) for spec in a.runtime)
    summary = summarize(a.run, a.timeline, a.bandwidth, {k: Path(v) for k, v in runtimes.items()})
    for path in a.merge:
        earlier = _load(path)
        if earlier is None:
            ap.error(f"--merge {path}: no such file")
        merge(summary, earlier, path)
    summary["goals"] = goals(summary)
    summary = relative(summary, a.run)
    write_json_atomic(a.out, summary)
    if a.md:
        a.md.write_text(markdown(summary))
    for name, v in summary["goals"].items():
        print(f"goal {name}: {v if isinstance(v, str) else ('met' if v['met'] else 'missed')}")
    print(f"wrote {a.out}")
    return summary


if __name__ == "__main__":
    main()
