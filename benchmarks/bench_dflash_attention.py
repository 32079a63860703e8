"""DFlash's training forward with dense against flex block attention: step time and peak memory by anchor count.

DFlash trains all blocks of a micro-batch in one forward (`DFlashHead.block_forward_train`). Its dense attention
materializes each layer's scores, [rows, heads, anchors a row x block, row length], and keeps them for the backward;
flex attention (`train.dflash_attention=flex`) builds a block mask and skips the context past each anchor. This
times the head's forward and backward (the frozen lm_head's logits included, a logsumexp loss on them) at the SmolLM2
recipe's shape for each anchor count and both paths, and prints a Markdown table (JSON with --out).

    python benchmarks/bench_dflash_attention.py [--rows 16 --length 2048 --anchors 2048,4096,8192] [--out r.json]

On a CPU torch runs flex attention unfused and has no backward for it: there the script times the forward alone, of
a small shape (--small), which checks that both paths run and agree, not their speed.
"""

from __future__ import annotations

import argparse
import time

import torch

from specheads.fileio import write_json_atomic
from specheads.heads import DFlashHead, HeadConfig

# SmolLM2-135M's head shape (recipes/smollm2_dflash_gpu.yaml): 5 layers, block 16, a 32,000-token draft vocabulary
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
               target_hidden_size=576, target_vocab_size=49152, draft_vocab_size=32000, num_layers=5, block_size=16)
SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             target_hidden_size=64, target_vocab_size=512, draft_vocab_size=256, num_layers=2, block_size=8)


def make_head(shape: dict, device, dtype) -> DFlashHead:
    cfg = HeadConfig(kind="dflash", aux_layer_ids=[1, 2, 3, 4, 5], qk_norm=True,
                     mask_token_id=shape["target_vocab_size"] - 1, **shape)
    torch.manual_seed(0)
    head = DFlashHead(cfg)
    for p in head.parameters():
        p.data.normal_(0, 0.02)
    return head.to(device=device, dtype=dtype)


def batch(head: DFlashHead, rows: int, length: int, anchors: int, device, dtype):
    """Rows of full length with ``anchors // rows`` random anchors each, sorted, as dflash_anchors draws them."""
    cfg = head.cfg
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.target_vocab_size - 1, (rows, length), generator=g)
    aux = torch.randn(rows, length, cfg.num_aux * cfg.target_hidden_size, generator=g)
    per_row = max(1, min(anchors // rows, length - cfg.block_size))
    anc = torch.stack([torch.randperm(length - cfg.block_size, generator=g)[:per_row] + 1 for _ in range(rows)])
    return ids.to(device), aux.to(device, dtype), anc.sort(1).values.to(device), torch.ones_like(ids).to(device)


def measure(head, inputs, attention: str, backward: bool, repeat: int) -> dict:
    device = inputs[0].device
    times = []
    out = None
    for i in range(repeat + 1):                         # the first call compiles (flex on CUDA): not timed
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        with torch.set_grad_enabled(backward):
            logits = head.block_forward_train(*inputs, attention=attention)
            if backward:
                logits.float().logsumexp(-1).mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t)
        out = logits.detach()
        head.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {"ms": 1000 * min(times), "peak_gib": peak, "logits": out}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--anchors", default="2048,4096,8192", help="blocks a micro-batch, comma-separated")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--small", action="store_true", help="a small head and batch (the CPU default)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    small = a.small or device.type == "cpu"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows, length = (4, 200) if small else (a.rows, a.length)
    anchors = [int(x) for x in a.anchors.split(",")] if not small else [16, 64]
    head = make_head(SMALL if small else SMOLLM2, device, dtype)
    backward = device.type == "cuda"
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "dtype": str(dtype).removeprefix("torch."), "rows": rows, "length": length, "backward": backward,
              "head": SMALL if small else SMOLLM2, "runs": []}
    print(f"DFlash block_forward_train on {result['device']} ({result['dtype']}), {rows} rows x {length} tokens, "
          f"{'forward and backward' if backward else 'forward only'}, best of {a.repeat}")
    print("| anchors a micro-batch | attention | ms | peak GiB | max abs difference from dense |")
    print("|---:|---|---:|---:|---:|")
    for n in anchors:
        inputs = batch(head, rows, length, n, device, dtype)
        dense = None
        for attention in ("dense", "flex"):
            try:
                r = measure(head, inputs, attention, backward, a.repeat)
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                result["runs"].append({"anchors": n, "attention": attention, "error": "out of memory"})
                print(f"| {n} | {attention} | out of memory | | |")
                continue
            logits = r.pop("logits")
            diff = None if dense is None else float((logits.float() - dense.float()).abs().max())
            dense = logits if attention == "dense" else dense
            result["runs"].append({"anchors": n, "attention": attention, **r, "max_abs_diff": diff})
            peak = "" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
            print(f"| {n} | {attention} | {r['ms']:.1f} | {peak} | {'' if diff is None else f'{diff:.2g}'} |")
    if a.out:
        write_json_atomic(a.out, result)
    return result


if __name__ == "__main__":
    main()
