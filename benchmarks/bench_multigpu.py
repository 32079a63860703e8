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
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_train import CONFIGS, matmul_peak, step_flops  # noqa: E402

from specheads.config import load_recipe  # noqa: E402
from specheads.heads import HeadConfig  # noqa: E402
from specheads.target import Target  # noqa: E402
from specheads.train.loop import run_train  # noqa: E402


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
                 device: torch.device):
        self.n_rows, self.seq, self.micro, self.hidden, self.n_aux, self.vocab = n_rows, seq, micro, hidden, n_aux, vocab
        self.rank, self.world, self.device = rank, world, device
        self.epoch, self.index = 0, 0

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
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, st: dict) -> None:
        self.epoch, self.index = int(st["epoch"]), int(st["index"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(CONFIGS), default="llama8b")
    ap.add_argument("--zero", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--tag", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--run-dir", type=Path, help="default: OUT/runs/TAG")
    ap.add_argument("--device", default="cuda", help="cuda (one process per GPU) or cpu (a smoke test)")
    args = ap.parse_args(argv)

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shape = CONFIGS[args.shape]
    target = shaped_target(shape, 32 if args.shape == "llama8b" else 30, device)
    n_aux = len(shape["aux_layer_ids"])
    run_dir = args.run_dir or args.out / "runs" / args.tag
    recipe = load_recipe(None, [
        f"run_dir={run_dir}", "train.precision=bf16", f"train.zero_stage={args.zero}",
        f"train.micro_batch_size={args.micro}", f"train.grad_accum={args.accum}", f"train.max_steps={args.steps}",
        f"train.ttt_steps={args.ttt}", f"train.lr={args.lr}", "train.warmup_steps=2", "train.eval_every=0",
        f"train.save_every={args.steps}", "train.logging.wandb=disabled", f"data.max_length={args.seq}",
        f"head.aux_layer_ids={shape['aux_layer_ids']}", f"vocab.draft_vocab_size={shape['draft_vocab_size']}",
        "dump.mode=offline"])
    Vt, Vd = shape["target_vocab_size"], shape["draft_vocab_size"]
    ids = torch.randperm(Vt, generator=torch.Generator().manual_seed(0))[:Vd].sort().values
    t2d = torch.zeros(Vt, dtype=torch.bool)
    t2d[ids] = True
    vocab = (ids - torch.arange(Vd), t2d, {"draft_vocab_size": Vd, "target_vocab_size": Vt, "synthetic": True})
    feed = RandomFeed(args.rows, args.seq, args.micro, shape["hidden_size"], n_aux, Vt, rank, world, device)
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
    fl = step_flops(cfg, 1, args.seq, args.ttt)
    per_token = fl["total"] / args.seq
    res = {
        "tag": args.tag, "rank": rank, "world_size": world, "zero_stage": args.zero, "shape": args.shape,
        "seq": args.seq, "micro_batch": args.micro, "grad_accum": args.accum,
        "global_batch_sequences": args.micro * args.accum * world, "ttt_steps": args.ttt, "steps": args.steps,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu", "bf16_matmul_peak_tflops": peak / 1e12,
        "tokens_per_s": tok_s, "tokens_per_s_per_gpu": tok_s / world,
        "mfu": per_token * tok_s / (peak * world), "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2 ** 30 if cuda else None,
        "losses": [r["loss"] for r in train_rows], "wall_s": wall, "final_dir": summary["final_dir"],
        "checkpoint": summary["checkpoint"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.tag}.rank{rank}.json").write_text(json.dumps(res, indent=1))
    if rank == 0:
        print(f"{args.tag}: {tok_s:,.0f} tok/s on {world} GPU(s), MFU {res['mfu']:.1%}, peak {res['peak_mem_gib'] or 0:.1f} GiB "
              f"(rank 0), loss {res['losses'][0]:.3f} -> {res['losses'][-1]:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
