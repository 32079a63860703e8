"""The parallel drafters beside EAGLE-3 on the same rows: ``OUT/parallel.json`` and a Markdown table.

Reads what ``gpu_parallel.sh`` wrote under its directory (nothing is re-measured here): per head kind the
eval reports ``eval_{kind}_{set}/report.json``, the training metrics ``train_{kind}/metrics.jsonl`` and
``runtime_{kind}.json`` (bench_runtime), plus the script's timeline. Per head and eval set: τ (tokens per
target forward), α by position, τ per category with n-gram's beside it and their ratio, speedup and the
greedy lossless check; per head: training tokens/s and the held-out τ the trainer measured last; the goals
of the parallel drafters judged on what was measured (anything not run is said so).

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

from reference_summary import eval_set, machine, timeline  # noqa: E402
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
    out = {"steps": train[-1]["step"] if train else None,
           "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in train) if train else None,
           "heldout_sim_tau": ev[-1].get("sim_tau") if ev else None,
           "heldout_step_acc": ev[-1].get("step_acc") if ev else None,
           "head_config": head_config}
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


def summarize(root: Path, timeline_file: Path | None = None) -> dict:
    out = {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
           "stages": timeline(timeline_file), "heads": {}}
    for kind in KINDS:
        h = {"training": training(root / f"train_{kind}"), "evals": {}, "runtime": _load(root / f"runtime_{kind}.json")}
        for name in SETS:
            rep = _load(root / f"eval_{kind}_{name}" / "report.json")
            h["evals"][name] = head_vs_ngram(eval_set(rep)) if rep else "not run"
        if h["training"] is None and all(v == "not run" for v in h["evals"].values()):
            h = "not run"
        out["heads"][kind] = h
    out["goals"] = goals(out["heads"])
    return relative(out, root)


def _tau(heads: dict, kind: str, name: str):
    h = heads.get(kind)
    e = h["evals"].get(name) if isinstance(h, dict) else None
    return e["tau"] if isinstance(e, dict) else None


def _speedup(heads: dict, kind: str, batch: int, mode: str):
    """The head's speedup over plain decoding at ``batch`` in its runtime benchmark (``rows``: a static batch,
    ``serving``: continuous batching), None where not measured."""
    h = heads.get(kind)
    rt = h.get("runtime") if isinstance(h, dict) else None
    for r in (rt or {}).get(mode) or []:
        if r.get("batch") == batch and str(r.get("drafter", "")).startswith("head"):
            return r["speedup"]
    return None


def goals(heads: dict) -> dict:
    """The goals where their inputs were measured: τ from the evals, speedups from the runtime benchmark."""
    g = {}
    for name, want in (("mixed", 4.0), ("vicuna", 3.5)):
        t = _tau(heads, "dflash", name)
        g[f"dflash_tau_{name}>={want}"] = "not run" if t is None else {"value": t, "met": t >= want}
    p, e = _tau(heads, "peagle", "mixed"), _tau(heads, "eagle3", "mixed")
    g["peagle_tau>=eagle3_tau_same_k (mixed)"] = ("not run" if p is None or e is None
                                                   else {"peagle": p, "eagle3": e, "met": p >= e})
    d1, d8 = _speedup(heads, "dflash", 1, "rows"), _speedup(heads, "dflash", 8, "serving")
    g["dflash_speedup_batch1>=3.0"] = "not run" if d1 is None else {"value": d1, "met": d1 >= 3.0}
    g["dflash_speedup_served8>=1.5"] = "not run" if d8 is None else {"value": d8, "met": d8 >= 1.5}
    p1, e1 = _speedup(heads, "peagle", 1, "rows"), _speedup(heads, "eagle3", 1, "rows")
    g["peagle_speedup_batch1>=1.2x_eagle3"] = ("not run" if p1 is None or e1 is None
                                               else {"peagle": p1, "eagle3": e1, "met": p1 >= 1.2 * e1})
    for kind in ("peagle", "dflash"):
        h = heads.get(kind)
        m = h["evals"].get("mixed") if isinstance(h, dict) else None
        g[f"{kind}_over_ngram>={NGRAM_RATIO}_every_category"] = (
            "not run" if not isinstance(m, dict) else {"met": m["every_category_ratio_met"]})
    return g


def markdown(s: dict) -> str:
    lines = ["| head | eval set | k | τ | n-gram τ | speedup | α by position | lossless | train tok/s |",
             "|---|---|---:|---:|---:|---:|---|---|---:|"]
    for kind, h in s["heads"].items():
        if not isinstance(h, dict):
            lines.append(f"| {kind} | not run | | | | | | | |")
            continue
        tps = (h["training"] or {}).get("tokens_per_s_median")
        tps = f"{tps:,.0f}" if tps else "not measured"
        for name, e in h["evals"].items():
            if not isinstance(e, dict):
                continue
            alpha = ", ".join("–" if a is None else f"{a:.2f}" for a in (e["alpha"] or []))
            ll = e["lossless"] or {}
            speed = "–" if e["speedup"] is None else f"{e['speedup']:.2f}×"
            lines.append(f"| {kind} | {name} | {e['k']} | {e['tau']:.2f} | {e['ngram_tau']:.2f} | {speed} | {alpha} | "
                         f"{ll.get('identical')}/{ll.get('total')} | {tps} |")
    return "\n".join(lines) + "\n"


def runtime_markdown(s: dict) -> str:
    """Decode speed per head (bench_runtime): τ and speedup over plain decoding, static batches and served."""
    lines = ["| head | drafter | batch | mode | τ | tok/s | speedup | lossless |", "|---|---|---:|---|---:|---:|---:|---|"]
    for kind, h in s["heads"].items():
        rt = h.get("runtime") if isinstance(h, dict) else None
        if not rt:
            continue
        for mode, rows in (("static", rt.get("rows") or []), ("served", rt.get("serving") or [])):
            for r in rows:
                if r.get("drafter") == "plain":
                    continue
                lines.append(f"| {kind} | {r['drafter']} | {r['batch']} | {mode} | {r['tau']:.2f} | "
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
