"""DFlash's anchor density against what it learns, on the CPU.

DFlash trains on random anchors: each anchor's block drafts the tokens after it, so the anchors a micro-batch takes
(`train.dflash_anchors`) decide how many of its positions supervise the head, and how much block forward it computes.
This trains small heads with the project's own heads and losses and prints held-out accuracy of the first drafted
token (DFlash slot 1) by step, and the CPU seconds, for several anchor counts, with EAGLE-3's first TTT step beside
them: both see the same information (the target's features before the anchor, and the anchor token).

The task is synthetic so that it is small and exact: x_{t+1} = P[x_{t-1} mod 2][x_t] (two fixed permutations), the
target's final hidden state at t is a unit embedding of x_{t+1} (its logits pick x_{t+1}), and its aux states are
fixed random projections of [final state, token embedding].

    python benchmarks/bench_dflash_anchors.py [--steps 300] [--anchors 16,64,128,all] [--out results.json]
"""

from __future__ import annotations

import argparse
import time

import torch

from specheads.fileio import write_json_atomic
from specheads.heads import HeadConfig, build_head
from specheads.train.losses import Objective, TargetLogits

V, H, T, AUX = 256, 64, 64, 3          # vocabulary, hidden size, row length, aux layers
ROWS = 16                               # rows a micro-batch: ROWS x (T - 4) trained positions
TARGET = {"hidden_size": H, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
          "vocab_size": V, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
          "num_hidden_layers": 4, "model_type": "llama"}


class Task:
    """The synthetic target: its rows, aux states and final hidden states (seeded)."""

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        unit = torch.randn(V, H, generator=g)
        self.lm_head = unit / unit.norm(dim=-1, keepdim=True) * 3.0
        self.embed = torch.randn(V, H, generator=g) * 0.5
        self.perm = torch.stack([torch.randperm(V, generator=g), torch.randperm(V, generator=g)])
        self.proj = [torch.randn(2 * H, H, generator=g) / (2 * H) ** 0.5 for _ in range(AUX)]

    def rows(self, n: int, seed: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        ids = torch.empty(n, T, dtype=torch.long)
        ids[:, :2] = torch.randint(0, V, (n, 2), generator=g)
        for i in range(2, T):
            ids[:, i] = self.perm[ids[:, i - 2] % 2, ids[:, i - 1]]
        following = torch.cat([ids[:, 1:], self.perm[ids[:, -2] % 2, ids[:, -1]][:, None]], 1)
        final = self.lm_head[following]
        aux = torch.cat([torch.cat([final, self.embed[ids]], -1) @ p for p in self.proj], -1)
        loss_mask = torch.ones(n, T, dtype=torch.long)
        loss_mask[:, :4] = 0                               # a short "prompt": its positions are not trained
        return {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": torch.ones(n, T, dtype=torch.long),
                "aux": aux, "final": final}


def head_for(task: Task, kind: str, **head_kw):
    torch.manual_seed(0)
    cfg = HeadConfig.from_target_config(TARGET, kind, draft_vocab_size=V, aux_layer_ids=[1, 2, 3], **head_kw)
    head = build_head(cfg)
    head.init_from_target(task.embed.clone(), task.lm_head, None)
    return head


def train(task: Task, data: dict, held: dict, kind: str, steps: int, anchors: int, every: int, lr: float,
          **head_kw) -> dict:
    """Train one head for ``steps`` micro-batches; held-out accuracy of the first draft every ``every`` steps."""
    head = head_for(task, kind, **head_kw)
    obj = Objective(head, kind, steps=3, decay=0.8, dflash_anchors=anchors, dflash_gamma=4.0, backend="torch")
    # held out: every position anchors a block, so each count is the whole held-out set's
    ev = Objective(head, kind, steps=3, decay=0.8, dflash_anchors=10 ** 9, dflash_gamma=4.0, backend="torch")
    logits = TargetLogits(task.lm_head)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    n, points, trained, cpu = data["input_ids"].shape[0], [], 0, 0.0
    for step in range(1, steps + 1):
        t0 = time.process_time()
        idx = torch.arange((step - 1) * ROWS, step * ROWS) % n
        batch = {k: v[idx] for k, v in data.items()}
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, step / 20)
        out = obj(batch, logits(batch["final"]))
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        opt.step()
        cpu += time.process_time() - t0
        trained += int(out.counts[0])
        if step % every == 0 or step == steps:
            with torch.no_grad():
                e = ev(held, logits(held["final"]))
            points.append({"step": step, "first_draft_accuracy": int(e.hits[0]) / max(1, int(e.counts[0])),
                           "cpu_s": cpu, "first_drafts_trained": trained})
    return {"points": points, "first_drafts_per_batch": trained / steps}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=50, help="held-out accuracy every this many steps")
    p.add_argument("--anchors", default="16,64,128,all", help="anchors a micro-batch, split evenly over its "
                   f"{ROWS} rows (comma-separated; 'all': every trained position, {ROWS * (T - 4)})")
    p.add_argument("--block", type=int, default=8, help="DFlash block size")
    p.add_argument("--layers", type=int, default=2, help="DFlash layers")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    task = Task()
    data, held = task.rows(4096, 1), task.rows(128, 2)
    positions = ROWS * (T - 4)
    runs = {"eagle3 (TTT 3)": {"anchors": positions,
                               **train(task, data, held, "eagle3", a.steps, positions, a.every, a.lr)}}
    for spec in a.anchors.split(","):
        count = positions if spec == "all" else int(spec)
        runs[f"dflash, {count} anchors"] = {"anchors": count, **train(
            task, data, held, "dflash", a.steps, count, a.every, a.lr, block_size=a.block, num_layers=a.layers,
            mask_token_id=V - 1)}
    steps = [pt["step"] for pt in next(iter(runs.values()))["points"]]
    print(f"held-out accuracy of the first draft by step; {positions} trained positions a micro-batch, "
          f"DFlash block {a.block}, {a.layers} layers, lr {a.lr}, one CPU thread")
    print("| head | anchors / batch | density | " + " | ".join(f"step {s}" for s in steps) + " | CPU s |")
    print("|---|---:|---:|" + "---:|" * len(steps) + "---:|")
    for name, r in runs.items():
        accs = " | ".join(f"{pt['first_draft_accuracy']:.3f}" for pt in r["points"])
        print(f"| {name} | {r['anchors']} | {r['anchors'] / positions:.1%} | {accs} | {r['points'][-1]['cpu_s']:.0f} |")
    result = {"task": "x_{t+1} = P[x_{t-1} mod 2][x_t]", "vocab": V, "hidden": H, "rows_per_batch": ROWS,
              "row_length": T, "trained_positions_per_batch": positions, "block_size": a.block,
              "layers": a.layers, "lr": a.lr, "steps": a.steps, "torch": torch.__version__, "runs": runs}
    if a.out:
        write_json_atomic(a.out, result)
    return result


if __name__ == "__main__":
    main()
