"""Training logs: always a local ``metrics.jsonl``; wandb when enabled; PNG curves at the end.

Rows of ``metrics.jsonl`` (one JSON object per line):

* train rows: ``{"split": "train", "step", "loss", "step_loss": [..], "step_acc": [..],
  "sim_tau", "lr", "grad_norm", "tokens_per_s", "tokens", "elapsed_s", ...}``
* eval rows: ``{"split": "eval", "step", "loss", "step_loss", "step_acc", "sim_tau", "positions"}``

wandb runs in ``recipe.train.logging.wandb`` mode (offline by default) with
``WANDB_DIR`` inside the train dir; a wandb failure never stops training.
"""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from specheads.fileio import disk_full_guard, tmp_path_for

log = logging.getLogger("specheads.train")

METRICS = "metrics.jsonl"


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


class RunLogger:
    def __init__(self, recipe, train_dir, *, rank: int = 0, resume_step: int | None = None,
                 run_config: dict | None = None):
        self.rank = rank
        self.dir = Path(train_dir)
        self.path = self.dir / METRICS
        self.wandb = None
        self.every = max(1, int(recipe.train.logging.every))
        self.last_step = resume_step
        if rank != 0:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.is_file():
            # Drop what an interrupted run logged past the checkpoint we resume from (and a torn or bad line,
            # named by _scan: it holds no step to keep).
            keep = [json.dumps(r) for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            tmp = tmp_path_for(self.path)  # rewritten beside it and renamed: a full disk keeps the old file
            with self._disk_full_guard():
                try:
                    with open(tmp, "w") as f:
                        f.write("".join(k + "\n" for k in keep))
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, self.path)
                finally:
                    tmp.unlink(missing_ok=True)
        elif resume_step is None and self.path.is_file():
            self.path.unlink()
        self.last_step = resume_step
        with self._disk_full_guard():
            self._fh = open(self.path, "a", buffering=1)
        mode = recipe.train.logging.wandb
        if mode != "disabled":
            try:
                os.environ["WANDB_DIR"] = str(self.dir)
                os.environ.setdefault("WANDB_SILENT", "true")
                import wandb

                self.wandb = wandb.init(project=recipe.train.logging.project, name=recipe.name,
                                        dir=str(self.dir), mode=mode, config=run_config or recipe.to_dict(),
                                        reinit="finish_previous")
            except Exception as e:  # noqa: BLE001 - logging must never stop a run
                log.warning("wandb disabled (%s: %s); metrics still go to %s", type(e).__name__, e, self.path)
                self.wandb = None

    def log(self, row: dict) -> None:
        if self.rank != 0:
            return
        row = {k: _clean(v) for k, v in row.items()}
        with self._disk_full_guard():
            self._fh.write(json.dumps(row) + "\n")
        self.last_step = row.get("step", self.last_step)
        if self.wandb is not None:
            split = row.get("split", "train")
            flat = {}
            for k, v in row.items():
                if k in ("split", "step"):
                    continue
                if isinstance(v, list):
                    for i, x in enumerate(v):
                        if isinstance(x, (int, float)):
                            flat[f"{split}/{k}_{i}"] = x
                elif isinstance(v, (int, float)):
                    flat[f"{split}/{k}"] = v
            try:
                self.wandb.log(flat, step=int(row["step"]))
            except Exception as e:  # noqa: BLE001
                log.warning("wandb.log failed: %s", e)

    def _disk_full_guard(self):
        """A full disk at ``metrics.jsonl``: one ``DiskFullError`` saying what the file and the checkpoints keep."""
        from specheads.train.checkpoint import latest_checkpoint

        def kept() -> str:
            last = latest_checkpoint(self.dir)
            logged = (f"{self.path.name} holds the rows up to step {self.last_step}" if self.last_step is not None
                      else f"{self.path.name} holds the rows logged so far")
            return logged + (f"; the checkpoint {last.name} is kept: free space and rerun with train.resume=true "
                             f"to resume from it" if last is not None else
                             "; no checkpoint was written yet: free space and rerun")
        return disk_full_guard(self.path, kept=kept, action="")

    def close(self, plot: bool = True) -> list[Path]:
        if self.rank != 0:
            return []
        try:
            self._fh.close()
        except OSError:  # a row a full disk refused, still buffered: it is lost, the file keeps what it has
            pass
        if self.wandb is not None:
            try:
                self.wandb.finish()
            except Exception:  # noqa: BLE001
                pass
        if plot:
            try:
                return plot_metrics(self.path, self.dir / "plots")
            except Exception as e:  # noqa: BLE001
                log.warning("plotting failed: %s", e)
        return []


def read_metrics(path) -> list[dict]:
    """The rows of a ``metrics.jsonl`` (or of the one in a train directory), in order.

    A run killed mid-write leaves a torn last line: it is skipped, and said. A bad line elsewhere (not a JSON
    object) is skipped and named with its line number, so that a plot or a summary still reads every good row.
    """
    p = Path(path)
    if p.is_dir():
        p = p / METRICS
    rows, bad, torn = [], [], None
    data = p.read_bytes()
    lines = data.split(b"\n")
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif n == len(lines):  # the last line, without a newline: a write cut short
            torn = (n, len(line))
        else:
            bad.append(n)
    if bad:
        shown = ", ".join(map(str, bad[:10])) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
        log.warning("%s: skipped %d bad line(s) (not a JSON object): line %s; read %d good row(s)",
                    p, len(bad), shown, len(rows))
    if torn is not None:
        log.warning("%s: skipped a torn last line (line %d, %d bytes without a newline: a write cut short)",
                    p, *torn)
    return rows


def plot_metrics(metrics_path, out_dir) -> list[Path]:
    """loss.png (train and eval loss) and acc.png (per-step accuracy, simulated τ) with matplotlib/Agg."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [r for r in rows if r.get("split") == "train"]
    ev = [r for r in rows if r.get("split") == "eval"]
    if not train and not ev:
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def num(x):
        try:
            return float(x)
        except (TypeError, ValueError):
            return float("nan")

    def save(fig, name: str) -> Path:
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        return out / name

    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot([r["step"] for r in train], [num(r["loss"]) for r in train], label="train", lw=1)
    if ev:
        ax.plot([r["step"] for r in ev], [num(r["loss"]) for r in ev], "o-", label="eval")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title("loss")
    ax.legend()
    p1 = save(fig, "loss.png")

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    src = ev if ev else train
    n = max((len(r.get("step_acc") or []) for r in src), default=0)
    for k in range(n):
        pts = [(r["step"], num(r["step_acc"][k])) for r in src if len(r.get("step_acc") or []) > k]
        # k is the draft position (TTT unroll step), not the optimizer step on the x-axis
        a1.plot([s for s, _ in pts], [a for _, a in pts], label=f"draft token {k + 1} (TTT step {k})", lw=1)
    a1.set_xlabel("optimizer step")
    a1.set_ylabel("top-1 accuracy" + (" (held out)" if ev else " (train)"))
    a1.set_title("accuracy per draft position")
    if n:
        a1.legend(fontsize=7)
    for name, rs in (("train", train), ("eval", ev)):
        if rs:
            a2.plot([r["step"] for r in rs], [num(r.get("sim_tau")) for r in rs], label=name)
    a2.set_xlabel("optimizer step")
    a2.set_ylabel("simulated acceptance length τ")
    a2.set_title("1 + Σ_k Π_{j≤k} acc_j")
    a2.legend()
    return [p1, save(fig, "acc.png")]
