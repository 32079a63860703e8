"""One machine-readable summary of a reference run: ``benchmarks/results/smollm2_reference/reference.json``.

Reads what the stages wrote (nothing is re-measured here): the synthesis and regeneration
summaries, the token rows' summary, the sweep, the eval reports and the runtime and training
benchmarks, and the timeline of ``gpu_reference.sh``. Per eval set: τ and α_i of every drafter
(head, n-gram, hybrid), τ per category, tokens/s and speedup, and whether the goals below
are met; the data curve (held-out τ against training tokens, one point per sweep run).
Paths in the summary are relative to the run directory (``run_paths.relative``), not the machine's.

    python benchmarks/reference_summary.py --run OUT/run --out OUT/reference.json \\
        --eval vicuna=OUT/run/eval_vicuna --eval gsm8k_holdout=... --eval mixed=... \\
        [--sweep DIR ...] [--bench-runtime F] [--bench-train F] [--timeline F] [--plot PNG]
    python benchmarks/reference_summary.py --from-summary OUT/reference.json --sweep LATER_SWEEP \\
        [--carry-over EARLIER/reference.json ...] [--parallel OUT2/parallel.json ...] [--plot PNG] \\
        --out benchmarks/results/smollm2_reference/reference.json

A time-limited run seldom runs everything. ``--from-summary F`` starts from a summary written on the machine
that ran it (its date, machine and figures stay; ``amended`` says when and where it was added to)
and adds what the other options name, e.g. the runs of a later ``--sweep`` (the first ``--sweep``
names the evaluated head, later ones only add runs). ``--carry-over F`` (repeatable) fills what
this run did not measure (eval sets marked not run, the ablations) from an earlier summary; each
section it fills is marked ``carried_over`` with the file, date and machine it was measured in, and
its curve points join this one's under their own data set. Goals are judged on this run's own
eval sets only.

``--parallel F`` (repeatable) puts the heads of a ``gpu_parallel.sh`` summary (``parallel.json``: P-EAGLE, DFlash,
EAGLE-3 at other k) beside this run's EAGLE-3 head: under ``parallel``, each head labelled ``HEAD (SOURCE)`` (the
file's stem, or its folder's for a ``parallel.json``; given again, a source replaces its heads) with its evals,
runtime speedups, training tokens/s and recipe, each file with its date, machine and goals, and its token rows against
this run's. The data stages are deterministic, so runs made apart on the same recipe share rows; code changes between
them may not, and the ratio says by how much.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from run_paths import relative  # noqa: E402
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
    if name.startswith("hybrid_suffix"):
        return "hybrid_suffix"
    if name.startswith("suffix") or d == "suffix":
        return "suffix"
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


def add_sweep(summary: dict, sweep: dict) -> None:
    """The first sweep names the head that was evaluated (its rate, its final run, the tokens/s goal); a later one
    only adds runs, e.g. the 30% point trained after the evals."""
    tr = summary.get("training")
    if not tr:
        summary["training"] = {"chosen_lr": sweep.get("best_lr"), "runs": list(sweep["runs"]),
                               "final": sweep.get("final")}
        tps = (sweep.get("final") or {}).get("train_tokens_per_s")
        summary["goals"][f"train_tokens_per_s>={TRAIN_TOKENS_PER_S}"] = {
            "value": tps, "met": tps is not None and tps >= TRAIN_TOKENS_PER_S}
        return
    known = {(r["name"], r.get("train_dir")) for r in tr["runs"]}
    tr["runs"] += [r for r in sweep["runs"] if (r["name"], r.get("train_dir")) not in known]


THIS_RUN = "this run"  # a curve point's "summary" when the summary holding it trained it


def curve_points(summary: dict, source: str) -> list[dict]:
    """Held-out τ against training tokens, one point per sweep run, labelled with the rows its share was drawn
    from (points of runs on different data sets stay apart) and with the summary that trained it: ``source``
    for this summary's own runs; points it carried over from other summaries keep their labels."""
    rows = (summary.get("data") or {}).get("rows") or {}
    own = [{"data_rows": rows.get("rows"), "data_tokens": rows.get("tokens"), "fraction": r.get("fraction"),
            "lr": r.get("lr"), "train_tokens": r.get("train_tokens"), "heldout_sim_tau": r.get("heldout_sim_tau"),
            "heldout_loss": r.get("heldout_loss"), "date": summary.get("date"), "summary": source}
           for r in (summary.get("training") or {}).get("runs") or []]
    return own + [p for p in summary.get("curve") or [] if p.get("summary") != THIS_RUN]


def carry_over(summary: dict, earlier: dict, path: Path) -> None:
    """Fill the eval sets this run did not measure and the ablations it did not train from an earlier summary,
    each marked with where it came from."""
    def marked(section: dict) -> dict:
        if "carried_over" in section:  # carried once already: the first origin stays
            return section
        if "summary_file" in section:  # a section that names the summary it was measured in
            origin = {"file": section["summary_file"], "date": section.get("date"), "machine": section.get("machine")}
        else:
            origin = {"file": str(path), "date": earlier.get("date"), "machine": earlier.get("machine")}
        return {"carried_over": origin, **section}

    for name, es in (earlier.get("eval_sets") or {}).items():
        mine = summary["eval_sets"].get(name)
        if "drafters" in es and (mine is None or mine.get("not_run")):
            summary["eval_sets"][name] = marked(es)
    if earlier.get("ablation") and not summary.get("ablation"):
        summary["ablation"] = marked(earlier["ablation"])


def merge_curve(points: list[dict]) -> list[dict]:
    """One point per run (data set, share, rate and tokens seen): the first summary that names it wins."""
    seen, out = set(), []
    for p in points:
        key = (p.get("data_tokens"), p.get("fraction"), p.get("lr"), p.get("train_tokens"))
        if key not in seen:
            seen.add(key)
            out.append(p)
    return sorted(out, key=lambda p: (p.get("data_tokens") or 0, p.get("train_tokens") or 0))


def plot_curve(points: list[dict], path: Path) -> None:
    from sweep_reference import plot_curves  # beside this file

    # one line per data set and learning rate: the points of a rate sweep are not a curve
    keys = sorted({(p.get("data_tokens") or 0, p.get("lr")) for p in points}, key=lambda k: (k[0], k[1] or 0))
    several_lrs = len({lr for _, lr in keys}) > 1
    lines = []
    for tokens, lr in keys:
        pts = [p for p in points if (p.get("data_tokens") or 0, p.get("lr")) == (tokens, lr)]
        rows = pts[0].get("data_rows")
        label = f"{rows:,} rows, {tokens / 1e6:.1f}M tokens" if rows and tokens else "unknown data set"
        if several_lrs and lr is not None:
            label += f", lr {lr:g}"
        lines.append((label, "o-", pts))
    plot_curves(lines, path, "reference head: held-out τ against data", legend_title="share of", size=(6.5, 4))


def runtime_head(runtime: dict | None, mode: str, batch: int) -> dict | None:
    """τ and speedup of the head's drafter at ``batch`` in a bench_runtime result (``rows``: static, ``serving``): the
    fastest of its rows (several engines); parallel_summary judges its speed goals by the same row."""
    rows = [r for r in (runtime or {}).get(mode) or []
            if r.get("batch") == batch and str(r.get("drafter", "")).startswith("head")]
    best = max(rows, key=lambda r: r.get("speedup") or 0.0, default=None)
    return None if best is None else {"tau": best.get("tau"), "speedup": best.get("speedup"),
                                      "lossless": best.get("lossless")}


def source_label(path: Path) -> str:
    """A parallel summary's name in labels: its file's stem, or its folder's where the file is gpu_parallel.sh's own
    ``parallel.json``."""
    p = Path(path)
    return p.parent.name if p.stem == "parallel" and p.parent.name else p.stem


def parallel_heads(summary: dict, parallel: dict, path: Path) -> None:
    """The evaluated heads of a parallel_summary.py result under ``summary["parallel"]``, with their source. Given
    again, a source replaces what it gave before; two files under one label are refused (ValueError)."""
    label = source_label(path)
    out = summary.setdefault("parallel", {"sources": {}, "heads": {}})
    known = out["sources"].get(label)
    if known and Path(known["file"]).resolve() != Path(path).resolve():
        raise ValueError(f"--parallel {path}: its label {label!r} is {known['file']}'s already; rename one of them")
    mine, theirs = ((summary.get("data") or {}).get("rows") or {}), parallel.get("data")
    theirs = theirs if isinstance(theirs, dict) else {}    # older summaries, or "not found"
    ratio = (theirs["tokens"] / mine["tokens"]) if theirs.get("tokens") and mine.get("tokens") else None
    out["sources"][label] = {"file": str(path), "date": parallel.get("created"), "machine": parallel.get("machine"),
                             "data": theirs or "not recorded", "tokens_vs_this_run": ratio,
                             "goals": parallel.get("goals")}
    out["heads"] = {k: v for k, v in out["heads"].items() if v.get("source") != label}
    for head, h in (parallel.get("heads") or {}).items():
        evals = {name: {k: e.get(k) for k in ("k", "tau", "ngram_tau", "alpha", "per_category", "lossless")}
                 for name, e in (h.get("evals") or {}).items() if isinstance(e, dict)} if isinstance(h, dict) else {}
        if not evals:
            continue
        t = h.get("training") or {}
        out["heads"][f"{head} ({label})"] = {
            "kind": h.get("kind"), "source": label, "evals": evals,
            "training": {k: t.get(k) for k in ("steps", "tokens_per_s_median", "heldout_sim_tau", "lr", "epochs",
                                               "data_fraction", "scheduler", "max_tokens_per_batch", "dflash_anchors",
                                               "dflash_attention")},
            "runtime": {"batch1": runtime_head(h.get("runtime"), "rows", 1),
                        "batch8": runtime_head(h.get("runtime"), "rows", 8),
                        "served8": runtime_head(h.get("runtime"), "serving", 8)}}


def side_by_side(summary: dict) -> list[dict]:
    """One row per head and eval set (mixed, Vicuna): this run's EAGLE-3 head first (an eval set carried over from an
    earlier summary is labelled with that one), then the parallel heads. ``train_tokens_per_s``: the EAGLE-3 sweep's
    final run's figure, the parallel heads' median step."""
    rows = []
    tps = ((summary.get("training") or {}).get("final") or {}).get("train_tokens_per_s")
    b1, b8 = (runtime_head(summary.get("runtime"), "rows", b) or {} for b in (1, 8))   # --bench-runtime's
    for name in ("mixed", "vicuna"):
        es = (summary.get("eval_sets") or {}).get(name) or {}
        head, ngram = (es.get("drafters") or {}).get("head"), (es.get("drafters") or {}).get("ngram")
        if head:
            carried = es.get("carried_over")
            rows.append({"head": f"eagle3 ({'this run' if not carried else Path(str(carried['file'])).stem})",
                         "kind": "eagle3", "set": name, "k": head.get("k"), "tau": head.get("tau"),
                         "ngram_tau": (ngram or {}).get("tau"),
                         "batch1_speedup": None if carried else b1.get("speedup"),
                         "batch8_speedup": None if carried else b8.get("speedup"),
                         "train_tokens_per_s": None if carried else tps})
    for label, h in (summary.get("parallel") or {}).get("heads", {}).items():
        for name in ("mixed", "vicuna"):
            e = h["evals"].get(name)
            if e:
                rt = h["runtime"]
                rows.append({"head": label, "kind": h["kind"], "set": name, "k": e["k"], "tau": e["tau"],
                             "ngram_tau": e["ngram_tau"], "batch1_speedup": (rt["batch1"] or {}).get("speedup"),
                             "batch8_speedup": (rt["batch8"] or {}).get("speedup"),
                             "train_tokens_per_s": h["training"]["tokens_per_s_median"]})
    return rows


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
        # a tree copied onto a machine without its commits still answers rev-parse with an older HEAD: the commit
        # names the code only where no tracked file differs from it
        info["git_dirty"] = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                                capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def judge_goals(summary: dict) -> None:
    """The head's τ goals on the eval sets this run measured (a carried-over set is no measurement of this run)."""
    for name, goal in GOALS.items():
        es = summary["eval_sets"].get(name, {})
        tau = None if "carried_over" in es else ((es.get("drafters") or {}).get("head") or {}).get("tau")
        summary["goals"][f"{name}_tau>={goal}"] = {"value": tau, "met": tau is not None and tau >= goal}
    mixed = summary["eval_sets"].get("mixed", {})
    if "drafters" in mixed and "carried_over" not in mixed:
        summary["goals"]["mixed_per_category"] = category_check(mixed)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, help="the recipe's run_dir")
    ap.add_argument("--from-summary", type=Path, help="start from this summary instead of a run_dir")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--eval", action="append", default=[], metavar="NAME=DIR")
    ap.add_argument("--sweep", type=Path, action="append", default=[],
                    help="a sweep's directory; the first names the evaluated head, later ones add runs")
    ap.add_argument("--bench-runtime", type=Path)
    ap.add_argument("--bench-train", type=Path)
    ap.add_argument("--timeline", type=Path)
    ap.add_argument("--ablation", type=Path, help="the ablation heads' directory (train_NAME/ inside)")
    ap.add_argument("--carry-over", type=Path, action="append", default=[], metavar="SUMMARY",
                    help="an earlier reference.json: fills what this run did not measure")
    ap.add_argument("--parallel", type=Path, action="append", default=[], metavar="PARALLEL_JSON",
                    help="a gpu_parallel.sh summary: its heads go beside this run's")
    ap.add_argument("--plot", type=Path, help="the data curve as a PNG")
    a = ap.parse_args(argv)
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if a.from_summary:
        if a.run is not None:
            ap.error("--run and --from-summary exclude each other: a summary is read from one of them")
        summary = _load(a.from_summary)
        if summary is None:
            ap.error(f"--from-summary {a.from_summary}: no such file")
        # the figures keep the date and machine they were measured on; this says when and where they were added to
        summary["amended"] = {"date": now, "machine": machine()}
        if a.timeline:
            summary["stages"] = timeline(a.timeline)
    elif a.run is None:
        ap.error("one of --run and --from-summary is required")
    else:
        data_dir = a.run / "data"
        summary = {
            "title": "SmolLM2-135M EAGLE-3 reference run",
            "date": now,
            "machine": machine(),
            "data": {"synthesize": _load(data_dir / "synthesize_summary.json"),
                     "regenerate": _load(data_dir / "regenerate_summary.json"),
                     "rows": _load(data_dir / "rows" / "summary.json")},
            "stages": timeline(a.timeline),
            "eval_sets": {},
            "goals": {},
        }
    for d in a.sweep:
        sweep = _load(d / "sweep.json")
        if sweep:
            add_sweep(summary, sweep)
    if a.ablation and Path(a.ablation).is_dir():
        summary["ablation"] = ablation(a.ablation)
    for spec in a.eval:
        name, _, d = spec.partition("=")
        rep = _load(Path(d) / "report.json")
        summary["eval_sets"][name] = eval_set(rep) if rep else {"not_run": True, "dir": d}
    points = curve_points(summary, THIS_RUN)
    for path in a.carry_over:
        earlier = _load(path)
        if earlier is None:
            ap.error(f"--carry-over {path}: no such file")
        carry_over(summary, earlier, path)
        points += curve_points(earlier, str(path))
    summary["curve"] = merge_curve([p for p in points if p.get("train_tokens") and p.get("heldout_sim_tau")])
    judge_goals(summary)
    # a benchmark file the run did not write leaves what the summary already holds
    for key, path in (("runtime", a.bench_runtime), ("train_bench", a.bench_train)):
        loaded = _load(path)
        if loaded is not None or key not in summary:
            summary[key] = loaded
    for path in a.parallel:
        parallel = _load(path)
        if parallel is None:
            ap.error(f"--parallel {path}: no such file")
        try:
            parallel_heads(summary, parallel, path)
        except ValueError as e:
            ap.error(str(e))
    if "parallel" in summary:
        summary["parallel"]["side_by_side"] = side_by_side(summary)
    if a.plot and summary["curve"]:
        plot_curve(summary["curve"], a.plot)
    summary = relative(summary, a.run)
    write_json_atomic(a.out, summary)
    for name, es in summary["eval_sets"].items():
        for kind, d in (es.get("drafters") or {}).items():
            sp = d.get("speedup")
            print(f"{name:>14} {kind:>8}: τ {d['tau']:.3f}  speedup {sp if sp is None else f'{sp:.2f}'}")
    for r in (summary.get("parallel") or {}).get("side_by_side", []):
        sp = " ".join(f"{b} {r[f'{b}_speedup']:.2f}×" for b in ("batch1", "batch8") if r[f"{b}_speedup"] is not None)
        ngram = "not run" if r["ngram_tau"] is None else f"{r['ngram_tau']:.3f}"
        print(f"{r['set']:>14} {r['head']}: k {r['k']}, τ {r['tau']:.3f} (n-gram {ngram}) {sp}")
    for g, v in summary["goals"].items():
        if "value" in v:
            print(f"goal {g}: {v['value']} -> {'met' if v['met'] else 'missed'}")
    print(f"wrote {a.out}")
    return summary


if __name__ == "__main__":
    main()
