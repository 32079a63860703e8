"""The real trainer (DeepSpeed ZeRO) on one or several GPUs: tokens/s, MFU, peak memory, loss curve.

Launch one process per GPU; every rank writes ``OUT/TAG.rank{r}.json``:

    torchrun --nproc_per_node 2 benchmarks/bench_multigpu.py --zero 2 --tag z2_w2 --out results/
    torchrun --nproc_per_node 1 benchmarks/bench_multigpu.py --zero 2 --accum 2 --tag z2_w1 --out results/

Unlike ``bench_train.py`` (the loss code alone, one GPU) this drives ``specheads.train.loop.run_train``:
DeepSpeed engine, ZeRO stage, gradient accumulation, checkpoint and ``final/`` gathering. The
head is the Llama-3.1-8B-shaped EAGLE-3 head of ``bench_train.py``; the target is that shape
with only its embedding and lm_head materialised (the trainer needs nothing else of it with a
given feed), and the feed is random aux/final states generated per row from the row's index,
so row i is the same on every rank and for every world size. Micro-batches are laid out as the
real feed lays them out (global micro-batch list, rank r takes r, r+W, ...): with the same
global batch (micro × accumulation × ranks) a run on 1 GPU and on 2 GPUs sees the same rows in
every optimizer step, so their loss curves must agree within bf16 noise.

Resume on another number of GPUs: ``--kill-at-step S`` (with ``--save-every S``) kills
every rank right after the step-S checkpoint is written; the same command with ``--resume`` on
another number of GPUs and the ``--accum`` that keeps the global batch continues it::

    torchrun --nproc_per_node 2 benchmarks/bench_multigpu.py --zero 2 --accum 1 --save-every 6 --kill-at-step 6 \
        --tag z2_2to1_killed --out results/ --run-dir /tmp/mg/z2_2to1
    torchrun --nproc_per_node 1 benchmarks/bench_multigpu.py --zero 2 --accum 2 --save-every 6 --resume \
        --tag z2_2to1 --out results/ --run-dir /tmp/mg/z2_2to1
    python benchmarks/bench_multigpu.py --resume-report --out results/   # JSON + plot of the curves

``--shape tiny --device cpu`` runs the same on a CPU (gloo) in seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_train import CONFIGS, matmul_peak, step_flops  # noqa: E402
from run_paths import relative  # noqa: E402

from specheads.config import load_recipe  # noqa: E402
from specheads.heads import HeadConfig  # noqa: E402
from specheads.target import Target  # noqa: E402
from specheads.train.loop import run_train  # noqa: E402

# A CPU smoke-test shape (aux layer ids as the 8B's: the target's decoder stays on the meta device anyway).
SHAPES = {**CONFIGS, "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                  target_vocab_size=256, draft_vocab_size=128, aux_layer_ids=[2, 16, 29],
                                  rope_theta=10000.0, max_position_embeddings=4096, rms_norm_eps=1e-5)}


def shaped_target(shape: dict, num_layers: int, device: torch.device) -> Target:
    """A target of the given shape whose decoder stays on the meta device (no memory, never run)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
                      num_attention_heads=shape["num_attention_heads"], num_key_value_heads=shape["num_key_value_heads"],
                      vocab_size=shape["target_vocab_size"], num_hidden_layers=num_layers,
                      rope_theta=shape["rope_theta"], max_position_embeddings=shape["max_position_embeddings"],
                      rms_norm_eps=shape["rms_norm_eps"], tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    g = torch.Generator(device=device).manual_seed(0)
    V, H = cfg.vocab_size, cfg.hidden_size
    emb = torch.nn.Embedding(V, H, device=device, dtype=torch.bfloat16)
    lm = torch.nn.Linear(H, V, bias=False, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        emb.weight.normal_(0, 0.02, generator=g)
        lm.weight.normal_(0, H ** -0.5, generator=g)
    model.model.embed_tokens, model.lm_head = emb, lm
    model.requires_grad_(False)
    t = Target(model=model, tokenizer=None, name="random-llama-3.1-8b-shape", source="synthetic")
    t._identity = "synthetic-llama8b-shape"  # the weight fingerprint would read the meta decoder
    return t


class RandomFeed:
    """Random rows (ids, aux, final) that depend only on the row index; the real feed's batch layout."""

    def __init__(self, n_rows: int, seq: int, micro: int, hidden: int, n_aux: int, vocab: int, rank: int, world: int,
                 device: torch.device, kill_after: int | None = None):
        self.n_rows, self.seq, self.micro, self.hidden, self.n_aux, self.vocab = n_rows, seq, micro, hidden, n_aux, vocab
        self.rank, self.world, self.device = rank, world, device
        self.epoch, self.index = 0, 0
        self.kill_after, self.served = kill_after, 0  # micro-batches this process serves before it kills itself

    def __len__(self) -> int:
        return (self.n_rows // self.micro) // self.world

    def _row(self, i: int) -> dict:
        g = torch.Generator(device=self.device).manual_seed(1_000_003 * i + 17)
        d = dict(device=self.device, generator=g)
        return {"input_ids": torch.randint(0, self.vocab, (self.seq,), **d),
                "aux": torch.randn(self.seq, self.n_aux * self.hidden, dtype=torch.bfloat16, **d),
                "final": torch.randn(self.seq, self.hidden, dtype=torch.bfloat16, **d) * 2.0}

    def __iter__(self):
        while self.index < len(self):
            if self.served == self.kill_after:
                # asked for the first micro-batch after the kill step: its checkpoint is on disk
                print(f"rank {self.rank}: killed after {self.served} micro-batches", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            self.served += 1
            micro_batch = self.index * self.world + self.rank  # global micro-batch index
            rows = [self._row(micro_batch * self.micro + j) for j in range(self.micro)]
            self.index += 1
            batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
            ones = torch.ones(self.micro, self.seq, dtype=torch.int64, device=self.device)
            batch.update(loss_mask=ones, attention_mask=ones.clone(),
                         row_ids=torch.arange(micro_batch * self.micro, (micro_batch + 1) * self.micro))
            yield batch
        self.epoch += 1
        self.index = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "world_size": self.world,
                "global_position": self.index * self.world}

    def load_state_dict(self, st: dict) -> None:
        """As ``dump.feed.Feed``: a state of another world size continues at the same global micro-batch."""
        consumed = int(st.get("global_position", st["index"] * self.world))
        if consumed % self.world:
            raise ValueError(f"{consumed} global micro-batches consumed do not divide by {self.world} ranks")
        self.epoch, self.index = int(st["epoch"]), consumed // self.world


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    ap.add_argument("--zero", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--tag")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--run-dir", type=Path, help="default: OUT/runs/TAG")
    ap.add_argument("--device", default="cuda", help="cuda (one process per GPU) or cpu (a smoke test)")
    ap.add_argument("--save-every", type=int, help="checkpoint interval (default: --steps)")
    ap.add_argument("--kill-at-step", type=int, help="SIGKILL every rank right after this step's checkpoint")
    ap.add_argument("--resume", action="store_true", help="continue the run dir's latest checkpoint")
    ap.add_argument("--resume-report", action="store_true",
                    help="no training: OUT/resume_n_to_m.json and .png from the resume runs' results in OUT")
    args = ap.parse_args(argv)
    if args.resume_report:
        return resume_report(args.out)
    if not args.tag:
        ap.error("--tag is required")

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shape = SHAPES[args.shape]
    target = shaped_target(shape, 32 if args.shape == "llama8b" else 30, device)
    n_aux = len(shape["aux_layer_ids"])
    run_dir = args.run_dir or args.out / "runs" / args.tag
    recipe = load_recipe(None, [
        f"run_dir={run_dir}", "train.precision=bf16", f"train.zero_stage={args.zero}",
        f"train.micro_batch_size={args.micro}", f"train.grad_accum={args.accum}", f"train.max_steps={args.steps}",
        f"train.ttt_steps={args.ttt}", f"train.lr={args.lr}", "train.warmup_steps=2", "train.eval_every=0",
        f"train.save_every={args.save_every or args.steps}", f"train.resume={str(args.resume).lower()}",
        "train.logging.wandb=disabled", f"data.max_length={args.seq}",
        f"head.aux_layer_ids={shape['aux_layer_ids']}", f"vocab.draft_vocab_size={shape['draft_vocab_size']}",
        "dump.mode=offline"])
    Vt, Vd = shape["target_vocab_size"], shape["draft_vocab_size"]
    ids = torch.randperm(Vt, generator=torch.Generator().manual_seed(0))[:Vd].sort().values
    t2d = torch.zeros(Vt, dtype=torch.bool)
    t2d[ids] = True
    vocab = (ids - torch.arange(Vd), t2d, {"draft_vocab_size": Vd, "target_vocab_size": Vt, "synthetic": True})
    feed = RandomFeed(args.rows, args.seq, args.micro, shape["hidden_size"], n_aux, Vt, rank, world, device,
                      kill_after=args.kill_at_step * args.accum if args.kill_at_step else None)
    cuda = device.type == "cuda"
    peak = matmul_peak(device, torch.bfloat16, 8192 if cuda else 512, 20 if cuda else 2)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.time()
    summary = run_train(recipe, target=target, feed=feed, vocab=vocab, progress=False)
    wall = time.time() - t0
    rows = [json.loads(x) for x in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r.get("split", "train") == "train"]
    steady = [r["tokens_per_s"] for r in train_rows[3:]] or [r["tokens_per_s"] for r in train_rows]
    tok_s = sorted(steady)[len(steady) // 2]  # median over steps after warm-up, all ranks' tokens
    cfg = HeadConfig(kind="eagle3", **shape)
    start = summary["start_step"]
    fl = step_flops(cfg, 1, args.seq, args.ttt)
    per_token = fl["total"] / args.seq
    res = {
        "tag": args.tag, "rank": rank, "world_size": world, "zero_stage": args.zero, "shape": args.shape,
        "seq": args.seq, "micro_batch": args.micro, "grad_accum": args.accum,
        "global_batch_sequences": args.micro * args.accum * world, "ttt_steps": args.ttt, "steps": args.steps,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu", "bf16_matmul_peak_tflops": peak / 1e12,
        "tokens_per_s": tok_s, "tokens_per_s_per_gpu": tok_s / world,
        "mfu": per_token * tok_s / (peak * world), "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2 ** 30 if cuda else None,
        # head weights + fp32 masters + Adam moments on this GPU (what ZeRO partitions), before any activation
        "state_mem_gib": summary.get("state_memory_gib"),
        "losses": [r["loss"] for r in train_rows], "resumed_at_step": start or None,
        "wall_s": wall, "final_dir": summary["final_dir"],
        "checkpoint": summary["checkpoint"],
    }
    res = relative(res, run_dir)  # the run's own paths, not the machine's
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.tag}.rank{rank}.json").write_text(json.dumps(res, indent=1))
    if rank == 0:
        print(f"{args.tag}: {tok_s:,.0f} tok/s on {world} GPU(s), MFU {res['mfu']:.1%}, peak {res['peak_mem_gib'] or 0:.1f} GiB, "
              f"trained state {res['state_mem_gib'] or 0:.2f} GiB (rank 0), loss {res['losses'][0]:.3f} -> "
              f"{res['losses'][-1]:.3f}", flush=True)
    return 0


def resume_report(out: Path) -> int:
    """Curves of the N -> M resumes (``z{Z}_2to1``, ``z{Z}_1to2``) against the uninterrupted runs of the
    same global batch (``z{Z}_w2``, ``z{Z}_w1``): ``resume_n_to_m.json`` and ``resume_n_to_m.png``."""
    def losses(tag):
        f = out / f"{tag}.rank0.json"
        return json.loads(f.read_text()) if f.is_file() else None

    report = {}
    for z in (1, 2, 3):
        ref = {w: losses(f"z{z}_w{w}") for w in (1, 2)}
        for tag, before, after in ((f"z{z}_2to1", 2, 1), (f"z{z}_1to2", 1, 2)):
            r = losses(tag)
            if r is None:
                continue
            s = r["resumed_at_step"]
            row = {"zero_stage": z, "gpus_before": before, "gpus_after": after, "killed_after_step": s,
                   "grad_accum_after": r["grad_accum"], "losses": r["losses"], "resume_wall_s": r["wall_s"]}
            for w in (1, 2):
                if ref[w] is not None and s:
                    d = [abs(a - b) for a, b in zip(r["losses"][s:], ref[w]["losses"][s:])]
                    row[f"max_abs_diff_after_resume_vs_{w}gpu_run"] = max(d) if d else None
                    row[f"uninterrupted_{w}gpu_losses"] = ref[w]["losses"]
            report[tag] = row
    if not report:
        print(f"no resume results (z*_2to1.rank0.json, z*_1to2.rank0.json) in {out}", file=sys.stderr)
        return 1
    (out / "resume_n_to_m.json").write_text(json.dumps(report, indent=1))
    for tag, row in report.items():
        diffs = {k: v for k, v in row.items() if k.startswith("max_abs_diff")}
        print(f"{tag}: killed after step {row['killed_after_step']}, resumed on {row['gpus_after']} GPU(s) "
              f"(grad_accum {row['grad_accum_after']}), loss -> {row['losses'][-1]:.4f}, {diffs}", flush=True)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(report), figsize=(4.5 * len(report), 3.6), squeeze=False)
    for ax, (tag, row) in zip(axes[0], report.items()):
        steps = range(1, len(row["losses"]) + 1)
        for w in (1, 2):
            if f"uninterrupted_{w}gpu_losses" in row:
                ax.plot(steps, row[f"uninterrupted_{w}gpu_losses"], lw=4 if w == 2 else 2, alpha=0.35,
                        label=f"uninterrupted, {w} GPU")
        s = row["killed_after_step"]
        ax.plot(steps, row["losses"], "k.-", lw=1,
                label=f"{row['gpus_before']} GPU -> killed -> {row['gpus_after']} GPU")
        ax.axvline(s + 0.5, color="r", ls=":", lw=1)
        ax.set(title=f"ZeRO-{row['zero_stage']}: {row['gpus_before']} -> {row['gpus_after']} GPU(s)",
               xlabel="optimizer step", ylabel="train loss")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "resume_n_to_m.png", dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
