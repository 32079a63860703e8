"""Do two training runs follow the same loss curve? Step by step, from their metrics.jsonl.

    python benchmarks/compare_loss_curves.py A/metrics.jsonl B/metrics.jsonl [--labels a,b] [--out X.json] [--plot X.png]
    python benchmarks/compare_loss_curves.py --from X.json --plot X.png      (the plot of a saved comparison)

Used for offline (a dump) against online (the target inside the trainer) on the same rows and
batches: the curves should agree up to the dump's storage rounding (bf16 or fp8 states against
the target's own). Prints a table of the train and held-out losses at the steps both logged, the
largest difference, and each run's median tokens/s.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specheads.train.run_log import read_metrics  # noqa: E402


def by_step(rows: list[dict], split: str) -> dict[int, dict]:
    return {r["step"]: r for r in rows if r.get("split") == split}


def compare(a: list[dict], b: list[dict]) -> dict:
    out = {}
    for split in ("train", "eval"):
        ra, rb = by_step(a, split), by_step(b, split)
        steps = sorted(set(ra) & set(rb))
        diffs = [abs(ra[s]["loss"] - rb[s]["loss"]) for s in steps]
        out[split] = {
            "steps": steps,
            "loss_a": [ra[s]["loss"] for s in steps],
            "loss_b": [rb[s]["loss"] for s in steps],
            "max_abs_diff": max(diffs) if diffs else None,
            "max_rel_diff": max((d / max(1e-9, abs(ra[s]["loss"])) for d, s in zip(diffs, steps)), default=None),
        }
    for key, rows in (("a", a), ("b", b)):
        tps = [r["tokens_per_s"] for r in rows if r.get("split") == "train" and "tokens_per_s" in r]
        out[f"median_tokens_per_s_{key}"] = statistics.median(tps) if tps else None
    return out


def plot(res: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    la, lb = res["labels"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, split in zip(axes, ("train", "eval")):
        r = res[split]
        ax.plot(r["steps"], r["loss_a"], label=la, lw=1.5)
        ax.plot(r["steps"], r["loss_b"], label=lb, lw=1, ls="--")
        ax.set_title(f"{split} loss")
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", nargs="?")
    ap.add_argument("b", nargs="?")
    ap.add_argument("--labels", default="a,b")
    ap.add_argument("--out")
    ap.add_argument("--plot", help="PNG of both curves, train and held-out")
    ap.add_argument("--from", dest="saved", help="a comparison written by --out (instead of A and B)")
    args = ap.parse_args(argv)
    if args.saved:
        res = json.loads(Path(args.saved).read_text())
        la, lb = res["labels"]
    else:
        if not (args.a and args.b):
            ap.error("two metrics files, or --from a saved comparison")
        la, lb = args.labels.split(",")
        res = compare(read_metrics(args.a), read_metrics(args.b))
        res["labels"] = [la, lb]
        res["files"] = [args.a, args.b]
    print(f"| split | steps compared | max |loss {la} - loss {lb}| | max relative |")
    print("|---|---:|---:|---:|")
    for split in ("train", "eval"):
        r = res[split]
        if r["steps"]:
            print(f"| {split} | {len(r['steps'])} | {r['max_abs_diff']:.3g} | {r['max_rel_diff']:.3g} |")
        else:
            print(f"| {split} | 0 | — | — |")
    print(f"median train tokens/s: {la} {res['median_tokens_per_s_a']}, {lb} {res['median_tokens_per_s_b']}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    if args.plot:
        plot(res, args.plot)
    return 0 if res["train"]["steps"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
