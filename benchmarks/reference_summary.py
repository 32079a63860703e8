"""One machine-readable summary of a reference run: ``benchmarks/results/reference.json``.

Reads what the stages wrote (nothing is re-measured here): the synthesis and regeneration
summaries, the token rows' summary, the sweep, the eval reports and the runtime and training
benchmarks, and the timeline of ``h200_reference.sh``. Per eval set: τ and α_i of every drafter
(head, n-gram, hybrid), τ per category, tokens/s and speedup, and whether the issue's goals
are met.

    python benchmarks/reference_summary.py --run runs/smollm2_eagle3_h200 --out OUT/reference.json \\
        --eval vicuna=runs/.../eval_vicuna --eval gsm8k_holdout=... --eval mixed=... \\
        [--sweep DIR] [--bench-runtime F] [--bench-train F] [--timeline F]
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specheads.fileio import write_json_atomic  # noqa: E402

GOALS = {"vicuna": 2.5, "gsm8k_holdout": 2.8}  # τ, greedy, chain k = 3, 128 new tokens
TRAIN_TOKENS_PER_S = 200_000  # the SmolLM2 head with TTT 7, in the trainer
CATEGORY_RATIO = 1.3  # the head's τ against n-gram's, in every category of the mixed set


def _load(path: Path | None):
    if path is None or not Path(path).exists():
        return None
    return json.loads(Path(path).read_text())


def _kind(run: dict) -> str:
    d = str(run.get("drafter") or run.get("name"))
    name = str(run.get("name", ""))
    if name.startswith("hybrid_fixed") or "fixed rule" in d:
        return "hybrid_fixed"
    if name.startswith("hybrid") or "hybrid" in d:
        return "hybrid"
    if name.startswith("ngram") or d == "ngram":
        return "ngram"
    return "head"


def eval_set(report: dict) -> dict:
    out = {"prompts": report.get("prompts"), "settings": report.get("settings"),
           "baseline_tokens_per_s": (report.get("baseline") or {}).get("tokens_per_s"), "drafters": {}}
    for run in report["runs"]:
        m = run["metrics"]
        key = _kind(run) if run.get("rule") == "greedy" and not run.get("tree") else run["name"]
        if key == "head" and not str(run.get("name", "")).startswith("head"):
            key = run["name"]  # several heads side by side (the ablations): each under its own label
        out["drafters"][key] = {
            "name": run["name"], "k": run.get("k"), "rule": run.get("rule"), "tau": m.get("tau"),
            "alpha": m.get("alpha"), "acceptance_rate": m.get("acceptance_rate"),
            "tokens_per_s": run.get("tokens_per_s"), "speedup": run.get("speedup"),
            "per_category": run.get("per_category"), "lossless": run.get("lossless"),
        }
    return out


def category_check(mixed: dict) -> dict:
    d = mixed["drafters"]
    if not all(k in d for k in ("head", "ngram")):
        return {"checked": False}
    head, ngram = d["head"]["per_category"] or {}, d["ngram"]["per_category"] or {}
    hybrid = (d.get("hybrid") or {}).get("per_category") or {}
    rows = {}
    for cat in sorted(head):
        h, n = head[cat], ngram.get(cat)
        rows[cat] = {"head": h, "ngram": n, "hybrid": hybrid.get(cat), "head_over_ngram": h / n if n else None,
                     "head_goal_met": bool(n and h >= CATEGORY_RATIO * n),
                     "hybrid_at_least_best": (hybrid.get(cat) is not None and n is not None
                                              and hybrid[cat] >= max(h, n) - 1e-9)}
    return {"checked": True, "ratio_goal": CATEGORY_RATIO, "categories": rows,
            "head_goal_met_everywhere": all(r["head_goal_met"] for r in rows.values()),
            "hybrid_goal_met_everywhere": all(r["hybrid_at_least_best"] for r in rows.values())}


def ablation(root: Path) -> dict:
    """The ablation heads' training figures (held-out τ, tokens/s: the sweep's own) and the online-vs-offline
    comparison."""
    from sweep_reference import figures  # beside this file

    heads = {d.name[len("train_"):]: {"train_dir": str(d), **figures(d)} for d in sorted(Path(root).glob("train_*"))}
    # what the answers and states heads trained on: the rows from the sources' own answers against the target's,
    # and each dump's dtype and size
    answers = {}
    for d in sorted((Path(root) / "answers").glob("*")):
        rows, manifest = _load(d / "summary.json"), _load(d / "manifest.json")
        if rows:
            answers[d.name] = {k: rows.get(k) for k in ("rows", "tokens", "masked_tokens", "holdout", "truncated")}
        elif manifest:
            counts = manifest.get("counts") or {}
            answers[d.name] = {"dtype": manifest.get("dtype"), "tokens": counts.get("tokens"),
                               "bytes": counts.get("bytes")}
    return {"heads": heads, "answers": answers, "online_vs_offline": _load(Path(root) / "online_vs_offline.json")}


def timeline(path: Path | None) -> dict:
    if path is None or not Path(path).exists():
        return {}
    out = {}
    for line in Path(path).read_text().splitlines():
        m = re.search(r"end (\S+) rc=(\d+) (\d+)s", line)
        if m:
            out[m.group(1)] = {"rc": int(m.group(2)), "seconds": int(m.group(3))}
    return out


def machine() -> dict:
    info = {"host": platform.node(), "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                            check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, required=True, help="the recipe's run_dir")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--eval", action="append", default=[], metavar="NAME=DIR")
    ap.add_argument("--sweep", type=Path)
    ap.add_argument("--bench-runtime", type=Path)
    ap.add_argument("--bench-train", type=Path)
    ap.add_argument("--timeline", type=Path)
    ap.add_argument("--ablation", type=Path, help="the ablation heads' directory (train_NAME/ inside)")
    a = ap.parse_args(argv)
    data_dir = a.run / "data"
    summary = {
        "title": "SmolLM2-135M EAGLE-3 reference run",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "data": {"synthesize": _load(data_dir / "synthesize_summary.json"),
                 "regenerate": _load(data_dir / "regenerate_summary.json"),
                 "rows": _load(data_dir / "rows" / "summary.json")},
        "stages": timeline(a.timeline),
        "eval_sets": {},
        "goals": {},
    }
    sweep = _load(a.sweep / "sweep.json") if a.sweep else None
    if sweep:
        summary["training"] = {"chosen_lr": sweep.get("best_lr"), "runs": sweep["runs"], "final": sweep.get("final")}
        tps = (sweep.get("final") or {}).get("train_tokens_per_s")
        summary["goals"][f"train_tokens_per_s>={TRAIN_TOKENS_PER_S}"] = {
            "value": tps, "met": tps is not None and tps >= TRAIN_TOKENS_PER_S}
    if a.ablation and Path(a.ablation).is_dir():
        summary["ablation"] = ablation(a.ablation)
    for spec in a.eval:
        name, _, d = spec.partition("=")
        rep = _load(Path(d) / "report.json")
        summary["eval_sets"][name] = eval_set(rep) if rep else {"not_run": True, "dir": d}
    for name, goal in GOALS.items():
        es = summary["eval_sets"].get(name, {})
        tau = ((es.get("drafters") or {}).get("head") or {}).get("tau")
        summary["goals"][f"{name}_tau>={goal}"] = {"value": tau, "met": tau is not None and tau >= goal}
    if "mixed" in summary["eval_sets"] and "drafters" in summary["eval_sets"]["mixed"]:
        summary["goals"]["mixed_per_category"] = category_check(summary["eval_sets"]["mixed"])
    summary["runtime"] = _load(a.bench_runtime)
    summary["train_bench"] = _load(a.bench_train)
    write_json_atomic(a.out, summary)
    for name, es in summary["eval_sets"].items():
        for kind, d in (es.get("drafters") or {}).items():
            sp = d.get("speedup")
            print(f"{name:>14} {kind:>8}: τ {d['tau']:.3f}  speedup {sp if sp is None else f'{sp:.2f}'}")
    for g, v in summary["goals"].items():
        if "value" in v:
            print(f"goal {g}: {v['value']} -> {'met' if v['met'] else 'missed'}")
    print(f"wrote {a.out}")
    return summary


if __name__ == "__main__":
    main()
