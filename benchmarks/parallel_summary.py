"""The parallel drafters beside EAGLE-3 on the same rows: ``OUT/parallel.json`` and a Markdown table.

Reads what ``gpu_parallel.sh`` wrote under its directory (nothing is re-measured here): per head (named by its
kind and size, ``dflash_b16``, ``peagle_k4``; a bare kind in older runs) the eval reports
``eval_{head}_{set}/report.json``, the training metrics ``train_{head}/metrics.jsonl`` and its recipe in
``final/meta.json``, and ``runtime_{head}.json`` (bench_runtime), plus the script's timeline and the token rows'
counts (``RUN/data/rows/summary.json``, to put runs made apart side by side). Per head and eval
set: τ (tokens per target forward), α by position, τ per category with n-gram's beside it and their ratio, speedup
and the greedy lossless check; per head: training tokens/s, its lr, epochs and DFlash anchors, and the held-out τ
the trainer measured last; the goals of the parallel drafters judged on what was measured, each kind by its best
head (anything not run is said so).

    python benchmarks/parallel_summary.py OUT/run/parallel --timeline OUT/timeline.txt --out OUT/parallel.json \\
        [--md OUT/parallel.md]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from reference_summary import eval_set, machine, runtime_head, timeline  # noqa: E402
from run_paths import relative  # noqa: E402
from specheads.fileio import write_json_atomic  # noqa: E402
from specheads.train.run_log import read_metrics  # noqa: E402

KINDS = ("eagle3", "peagle", "dflash")
SETS = ("mixed", "vicuna", "gsm8k")
NGRAM_RATIO = 1.3   # each parallel head's τ against n-gram's, in every category of the mixed set


def _load(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def training(train_dir: Path, rows: list[dict] | None = None) -> dict | None:
    """The run's training figures from its metrics.jsonl (``rows``: those already read)."""
    f = train_dir / "metrics.jsonl"
    if not f.is_file():
        return None
    rows = read_metrics(f) if rows is None else rows
    train = [r for r in rows if r.get("split") == "train" and r.get("tokens_per_s")]
    # the step-0 eval is the untrained head's: not a held-out figure of this head
    ev = [r for r in rows if r.get("split") == "eval" and r.get("step")]
    head_config = _load(train_dir / "final" / "head_config.json")
    recipe_train = ((_load(train_dir / "final" / "meta.json") or {}).get("recipe") or {}).get("train") or {}
    out = {"steps": train[-1]["step"] if train else None,
           "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in train) if train else None,
           "heldout_sim_tau": ev[-1].get("sim_tau") if ev else None,
           "heldout_step_acc": ev[-1].get("step_acc") if ev else None,
           "head_config": head_config,
           **{k: recipe_train.get(k) for k in ("lr", "epochs", "dflash_anchors", "dflash_attention", "data_fraction",
                                               "scheduler", "max_tokens_per_batch")}}
    div = _load(train_dir / "diverged.json")
    # the trainer stopped here (specheads.train.step.diverged): what, where, which rows; a resumed run that finished
    # leaves the file behind, and its final/ says it is stale
    if div and not (train_dir / "final").is_dir():
        out["diverged"] = {k: div.get(k) for k in ("what", "step", "epoch", "input_ids_shape", "rows")}
    return out


def head_vs_ngram(s: dict) -> dict | None:
    d = s["drafters"]
    head = next((v for k, v in d.items() if k not in ("ngram", "hybrid", "hybrid_fixed")), None)
    ngram = d.get("ngram")
    if head is None or ngram is None:
        return None
    cats = {c: {"head": t, "ngram": (ngram.get("per_category") or {}).get(c)}
            for c, t in (head.get("per_category") or {}).items()}
    for v in cats.values():
        v["ratio"] = v["head"] / v["ngram"] if v["ngram"] else None
    return {"tau": head["tau"], "ngram_tau": ngram["tau"], "speedup": head["speedup"], "k": head["k"],
            "alpha": head["alpha"], "lossless": head["lossless"], "per_category": cats,
            "every_category_ratio_met": bool(cats) and all(v["ratio"] is not None and v["ratio"] >= NGRAM_RATIO
                                                           for v in cats.values())}


def head_names(root: Path) -> list[str]:
    """The heads with a training or an eval under ``root``: ``train_{head}`` and ``eval_{head}_{set}``."""
    names = {p.name[len("train_"):] for p in root.glob("train_*") if p.is_dir()}
    for name in SETS:
        names |= {p.name[len("eval_"):-len(name) - 1] for p in root.glob(f"eval_*_{name}") if p.is_dir()}
    return sorted(names, key=lambda n: (KINDS.index(kind_of(n)) if kind_of(n) in KINDS else len(KINDS), n))


def kind_of(head: str) -> str:
    return head.split("_")[0]


def summarize(root: Path, timeline_file: Path | None = None) -> dict:
    rows = _load(root.parent / "data" / "rows" / "summary.json") or {}    # gpu_parallel.sh: root is RUN/parallel
    out = {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
           "stages": timeline(timeline_file),
           "data": {k: rows.get(k) for k in ("rows", "tokens", "masked_tokens")} if rows else "not found",
           "heads": {}}
    for head in head_names(root):
        h = {"kind": kind_of(head), "training": training(root / f"train_{head}"), "evals": {},
             "runtime": _load(root / f"runtime_{head}.json")}
        for name in SETS:
            rep = _load(root / f"eval_{head}_{name}" / "report.json")
            h["evals"][name] = head_vs_ngram(eval_set(rep)) if rep else "not run"
        out["heads"][head] = h
    for kind in KINDS:
        if not any(kind_of(head) == kind for head in out["heads"]):
            out["heads"][kind] = "not run"
    out["goals"] = goals(out["heads"])
    return relative(out, root)


def _of_kind(heads: dict, kind: str) -> list[dict]:
    return [h for name, h in heads.items() if kind_of(name) == kind and isinstance(h, dict)]


def _eval(h: dict, name: str) -> dict | None:
    e = h["evals"].get(name)
    return e if isinstance(e, dict) else None


def _tau(heads: dict, kind: str, name: str):
    """The best τ of ``kind``'s heads on eval set ``name``, None where none was evaluated."""
    taus = [e["tau"] for h in _of_kind(heads, kind) if (e := _eval(h, name))]
    return max(taus) if taus else None


def _head_k(h: dict) -> int | None:
    """The k a head's runtime benchmark drafted (its eval's where the benchmark does not say)."""
    rt = h.get("runtime") or {}
    if rt.get("k") is not None:
        return rt["k"]
    return next((e["k"] for name in SETS if (e := _eval(h, name))), None)


def _speedup(heads: dict, kind: str, batch: int, mode: str, k: int | None = None):
    """The best speedup over plain decoding at ``batch`` of ``kind``'s heads (those drafting ``k`` tokens, if
    given) in their runtime benchmark (``rows``: a static batch, ``serving``: continuous batching), None where
    not measured."""
    got = [r["speedup"] for h in _of_kind(heads, kind) if k is None or _head_k(h) == k
           if (r := runtime_head(h.get("runtime"), mode, batch)) and r["speedup"] is not None]
    return max(got) if got else None


def _best_by_k(heads: dict, kind: str) -> dict[int, dict]:
    """k -> the mixed-set eval of ``kind``'s head with the highest τ at that k."""
    best: dict[int, dict] = {}
    for h in _of_kind(heads, kind):
        e = _eval(h, "mixed")
        if e and (e["k"] not in best or e["tau"] > best[e["k"]]["tau"]):
            best[e["k"]] = e
    return best


def _same_k(heads: dict) -> list[tuple[dict, dict]]:
    """(P-EAGLE, EAGLE-3) mixed-set evals drafting the same k, the best head of each kind at that k."""
    e3 = _best_by_k(heads, "eagle3")
    return [(p, e3[k]) for k, p in sorted(_best_by_k(heads, "peagle").items()) if k in e3]


def goals(heads: dict) -> dict:
    """The goals where their inputs were measured: τ from the evals, speedups from the runtime benchmark; each
    kind by its best head."""
    g = {}
    for name, want in (("mixed", 4.0), ("vicuna", 3.5)):
        t = _tau(heads, "dflash", name)
        g[f"dflash_tau_{name}>={want}"] = "not run" if t is None else {"value": t, "met": t >= want}
    pairs = _same_k(heads)
    g["peagle_tau>=eagle3_tau_same_k (mixed)"] = (
        "not run" if not pairs else [{"k": p["k"], "peagle": p["tau"], "eagle3": e["tau"], "met": p["tau"] >= e["tau"]}
                                     for p, e in pairs])
    d1, d8 = _speedup(heads, "dflash", 1, "rows"), _speedup(heads, "dflash", 8, "serving")
    g["dflash_speedup_batch1>=3.0"] = "not run" if d1 is None else {"value": d1, "met": d1 >= 3.0}
    g["dflash_speedup_served8>=1.5"] = "not run" if d8 is None else {"value": d8, "met": d8 >= 1.5}
    speed = [(p["k"], p1, e1) for p, _ in pairs if (p1 := _speedup(heads, "peagle", 1, "rows", p["k"])) is not None
             and (e1 := _speedup(heads, "eagle3", 1, "rows", p["k"])) is not None]
    g["peagle_speedup_batch1>=1.2x_eagle3"] = (
        "not run" if not speed
        else [{"k": k, "peagle": p1, "eagle3": e1, "met": p1 >= 1.2 * e1} for k, p1, e1 in speed])
    for kind in ("peagle", "dflash"):
        ms = [e for h in _of_kind(heads, kind) if (e := _eval(h, "mixed"))]
        g[f"{kind}_over_ngram>={NGRAM_RATIO}_every_category"] = (
            "not run" if not ms else {"met": any(m["every_category_ratio_met"] for m in ms)})
    return g


def _recipe(h: dict) -> str:
    """A head's training in a few words: lr (and its schedule where not cosine), epochs, data fraction, tokens a
    micro-batch, DFlash's anchors a micro-batch and its block attention where it is not the dense default."""
    t = h["training"] or {}
    sched = f" {t['scheduler']}" if t.get("scheduler") not in (None, "cosine") else ""
    words = [f"lr {t['lr']:g}{sched}" if t.get("lr") is not None else None,
             f"{t['epochs']:g} ep" if t.get("epochs") is not None else None,
             f"{t['data_fraction']:g} of rows" if t.get("data_fraction") not in (None, 1, 1.0) else None,
             f"{t['max_tokens_per_batch'] / 1024:g}k-token micro-batches" if t.get("max_tokens_per_batch") else None,
             f"{t['dflash_anchors']} anchors" if t.get("dflash_anchors") and h["kind"] == "dflash" else None,
             f"{t['dflash_attention']} attention" if t.get("dflash_attention") not in (None, "dense")
             and h["kind"] == "dflash" else None]
    return ", ".join(w for w in words if w) or "–"


def markdown(s: dict) -> str:
    lines = ["| head | eval set | k | τ | n-gram τ | speedup | α by position | lossless | train tok/s | training |",
             "|---|---|---:|---:|---:|---:|---|---|---:|---|"]
    for head, h in s["heads"].items():
        if not isinstance(h, dict):
            lines.append(f"| {head} | not run | | | | | | | | |")
            continue
        tps = (h["training"] or {}).get("tokens_per_s_median")
        tps = f"{tps:,.0f}" if tps else "not measured"
        recipe = _recipe(h)
        if not any(isinstance(e, dict) for e in h["evals"].values()):
            lines.append(f"| {head} | not evaluated | | | | | | | {tps} | {recipe} |")
        for name, e in h["evals"].items():
            if not isinstance(e, dict):
                continue
            alpha = ", ".join("–" if a is None else f"{a:.2f}" for a in (e["alpha"] or []))
            ll = e["lossless"] or {}
            speed = "–" if e["speedup"] is None else f"{e['speedup']:.2f}×"
            lines.append(f"| {head} | {name} | {e['k']} | {e['tau']:.2f} | {e['ngram_tau']:.2f} | {speed} | {alpha} | "
                         f"{ll.get('identical')}/{ll.get('total')} | {tps} | {recipe} |")
    return "\n".join(lines) + "\n"


def runtime_markdown(s: dict) -> str:
    """Decode speed per head (bench_runtime): τ and speedup over plain decoding, static batches and served."""
    lines = ["| head | drafter | batch | mode | τ | tok/s | speedup | lossless |", "|---|---|---:|---|---:|---:|---:|---|"]
    for head, h in s["heads"].items():
        rt = h.get("runtime") if isinstance(h, dict) else None
        if not rt:
            continue
        for mode, rows in (("static", rt.get("rows") or []), ("served", rt.get("serving") or [])):
            for r in rows:
                if r.get("drafter") == "plain":
                    continue
                lines.append(f"| {head} | {r['drafter']} | {r['batch']} | {mode} | {r['tau']:.2f} | "
                             f"{r['tokens_per_s']:,.0f} | {r['speedup']:.2f}× | {'yes' if r.get('lossless') else 'NO'} |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path, help="gpu_parallel.sh's directory (RUN/parallel)")
    ap.add_argument("--timeline", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--md", type=Path)
    args = ap.parse_args(argv)
    s = summarize(args.root, args.timeline)
    write_json_atomic(args.out, s)
    if args.md:
        rt = runtime_markdown(s)
        args.md.write_text(markdown(s) + (f"\nDecode speed (bench_runtime, compiled, CUDA graphs):\n\n{rt}" if rt else ""))
    print(f"wrote {args.out}")
    return s


if __name__ == "__main__":
    main()
