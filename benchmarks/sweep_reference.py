"""The reference recipe's small sweep: learning rate, then data size, by held-out τ.

1. learning rate: one run per ``--lrs`` value on the smallest ``--fractions`` share of the
   training rows (``train.data_fraction``; the subsets are nested);
2. data size: the best rate on each larger share, up to the whole set.

Each run is ``specheads train RECIPE`` in its own process and directory (``train.out``), so
DeepSpeed starts clean. The score is the trainer's held-out simulated τ (teacher-forced
accuracy on ``train.eval_fraction`` of the rows, ``τ = 1 + Σ_k Π_{j≤k} acc_j``) at the end of
the run. Every finished run is appended to ``sweep.json`` at once; a rerun skips the finished
ones and resumes an interrupted one from its last checkpoint (``train.resume=true``).

Writes ``OUT/sweep.json`` (runs, best lr, the full-data run's directory), ``OUT/sweep.md`` and
``OUT/tau_vs_tokens.png`` (held-out τ against training tokens).

    python benchmarks/sweep_reference.py recipes/smollm2_eagle3_gpu.yaml --out runs/x/sweep \\
        --fractions 0.1,0.3,1 --lrs 3e-4,1e-3,3e-3 [overrides ...]

A second call with more ``--fractions`` (the same rates and overrides; with several rates, the same smallest
share) adds their runs to the same ``sweep.json`` and plot.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specheads.fileio import write_json_atomic  # noqa: E402
from specheads.train.run_log import read_metrics  # noqa: E402


def run_name(fraction: float, lr: float) -> str:
    return f"f{fraction:g}_lr{lr:g}"


def figures(train_dir: Path) -> dict:
    """Held-out τ and loss of the run's last eval (None before its first), the training tokens it saw and its
    tokens/s over the last 20 logged windows (also read by reference_summary.py for the ablation heads)."""
    rows = read_metrics(train_dir) if (Path(train_dir) / "metrics.jsonl").exists() else []
    evals = [r for r in rows if r.get("split") == "eval"]
    train = [r for r in rows if r.get("split") == "train"]
    last = evals[-1] if evals else {}
    return {"heldout_sim_tau": last.get("sim_tau"), "heldout_loss": last.get("loss"),
            "heldout_step_acc": last.get("step_acc"), "step": last.get("step"),
            "train_tokens": sum(int(r.get("tokens", 0)) for r in train),
            "train_tokens_per_s": (sum(r["tokens_per_s"] for r in train[-20:]) / len(train[-20:])) if train else None}


def score(train_dir: Path) -> dict:
    """:func:`figures` of a finished run, which must have a held-out eval."""
    f = figures(train_dir)
    if f["heldout_sim_tau"] is None:
        raise SystemExit(f"{train_dir}: no held-out eval row in metrics.jsonl (is train.eval_fraction > 0?)")
    return f


def train_one(recipe: str, out: Path, fraction: float, lr: float, overrides: list[str], done: dict) -> dict:
    name = run_name(fraction, lr)
    if name in done:
        print(f"[sweep] {name}: done before, τ {done[name]['heldout_sim_tau']:.3f}", flush=True)
        return done[name]
    tdir = out / name
    resume = (tdir / "checkpoints").is_dir()
    cmd = [sys.executable, "-m", "specheads.cli", "train", recipe, f"train.data_fraction={fraction}",
           f"train.lr={lr}", f"train.out={tdir}", f"train.resume={'true' if resume else 'false'}", *overrides]
    print(f"[sweep] {name}: {'resuming' if resume else 'training'}", flush=True)
    t0 = time.time()
    subprocess.run(cmd, check=True)
    result = {"name": name, "fraction": fraction, "lr": lr, "train_dir": str(tdir), "seconds": time.time() - t0,
              **score(tdir)}
    print(f"[sweep] {name}: held-out τ {result['heldout_sim_tau']:.3f} after {result['train_tokens']:,} tokens "
          f"({result['seconds']:.0f} s)", flush=True)
    return result


def plot_curves(lines: list[tuple[str, str, list[dict]]], path: Path, title: str, legend_title: str | None = None,
                size: tuple[float, float] = (6, 4)) -> None:
    """Held-out τ against training tokens: one line per ``(label, marker style, runs)``, each run (``train_tokens``,
    ``heldout_sim_tau``, ``fraction``) annotated with its share of the rows. Also drawn by reference_summary.py."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    for label, style, runs in lines:
        pts = sorted(runs, key=lambda r: r["train_tokens"])
        ax.plot([r["train_tokens"] for r in pts], [r["heldout_sim_tau"] for r in pts], style, label=label)
        for r in pts:
            if r.get("fraction") is not None:
                ax.annotate(f"{r['fraction']:.0%}", (r["train_tokens"], r["heldout_sim_tau"]),
                            textcoords="offset points", xytext=(4, -10), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("training tokens seen")
    ax.set_ylabel("held-out simulated τ (k = TTT steps)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(title=legend_title, fontsize=8 if legend_title else None)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(runs: list[dict], best_lr: float, path: Path) -> None:
    lines = [(f"lr {lr:g}" + (" (chosen)" if lr == best_lr else ""), "o-" if lr == best_lr else "x",
              [r for r in runs if r["lr"] == lr]) for lr in sorted({r["lr"] for r in runs})]
    plot_curves(lines, path, "reference sweep: τ against data")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--fractions", default="0.1,0.3,1")
    ap.add_argument("--lrs", default="3e-4,1e-3,3e-3")
    ap.add_argument("overrides", nargs="*", help="dotted recipe overrides for every run")
    a = ap.parse_intermixed_args(argv)  # overrides may follow the options
    fractions = sorted(float(x) for x in a.fractions.split(","))
    lrs = [float(x) for x in a.lrs.split(",")]
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "sweep.json"
    state = json.loads(path.read_text()) if path.exists() else {"recipe": a.recipe, "runs": []}
    # A later pass may add data shares (the reference run trains 10% and 100% first, 30% when time is left). With
    # several rates the rate is chosen on the smallest share, so that share must then stay what it was
    moved = len(lrs) > 1 and state.get("fractions", fractions)[0] != fractions[0]
    if state.get("recipe") != a.recipe or moved \
            or state.get("lrs", lrs) != lrs or state.get("overrides", a.overrides) != a.overrides:
        raise SystemExit(f"{path} belongs to another sweep (recipe, smallest fraction, lrs or overrides differ): "
                         f"use another --out")
    state.update(fractions=sorted(set(state.get("fractions", [])) | set(fractions)), lrs=lrs, overrides=a.overrides)
    done = {r["name"]: r for r in state["runs"]}

    def record(r: dict) -> None:
        if r["name"] not in done:
            done[r["name"]] = r
            state["runs"].append(r)
            write_json_atomic(path, state)

    for lr in lrs:
        record(train_one(a.recipe, a.out, fractions[0], lr, a.overrides, done))
    best_lr = max(lrs, key=lambda lr: done[run_name(fractions[0], lr)]["heldout_sim_tau"])
    for f in fractions[1:]:
        record(train_one(a.recipe, a.out, f, best_lr, a.overrides, done))
    state["best_lr"] = best_lr
    state["final"] = done[run_name(max(state["fractions"]), best_lr)]
    write_json_atomic(path, state)
    plot(state["runs"], best_lr, a.out / "tau_vs_tokens.png")
    lines = ["| data share | lr | training tokens | held-out τ | held-out loss | tok/s | time (s) |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(state["runs"], key=lambda r: (r["fraction"], r["lr"])):
        tps = f"{r['train_tokens_per_s']:,.0f}" if r.get("train_tokens_per_s") else "–"
        lines.append(f"| {r['fraction']:.0%} | {r['lr']:g} | {r['train_tokens']:,} | {r['heldout_sim_tau']:.3f} | "
                     f"{r['heldout_loss']:.3f} | {tps} | {r['seconds']:.0f} |")
    (a.out / "sweep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"[sweep] chosen lr {best_lr:g}; full-data head: {state['final']['train_dir']}")
    return state


if __name__ == "__main__":
    main()
