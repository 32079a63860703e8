"""Training throughput of the EAGLE-3 head: tokens/s, peak memory and model FLOPs utilisation.

Configurations (synthetic aux/final states, no target model loaded):

* ``llama8b``  — Llama-3.1-8B-shaped head (H 4096, I 14336, 32 heads, 8 kv heads, target vocab
  128256, draft vocab 32000, aux [2, 16, 29]), seq 2048, TTT 7, bf16, on a GPU;
* ``smollm2``  — SmolLM2-135M-shaped head (H 576, I 1536, 9 heads, 3 kv heads, vocab 49152,
  draft vocab 32000, aux [2, 15, 27]), TTT 7: fp32 on the CPU (seq 256), or bf16 on the GPU
  with ``--smollm2-device cuda`` at each ``--smollm2-shapes`` B×T, i.e. the micro-batches a
  token budget (``train.max_tokens_per_batch``) makes: 16×256 is the old fixed micro-batch,
  the larger ones are budgets of 32k–128k tokens.

One measured step = target logits from ``final`` (frozen lm_head: draft-vocab logits and the
full-vocab argmax) + the TTT unroll forward + soft-CE losses + backward + AdamW step — the
same code the trainer runs (``train.losses.Objective``), without DeepSpeed (not installed on the
GPU image; with ZeRO-0 and one GPU it adds no compute).

MFU counts matmul FLOPs (2·m·n·k each, backward = 2× forward for trainable weights, 1× for the
fc whose input needs no gradient): fc once, per TTT step the layer (q/k/v over 2H, o, gate/up/
down), attention (scores and values over the dense T×T step-0 block as executed, plus the
diagonal keys) and the draft lm_head; plus the frozen target lm_head (draft-vocab logits and the
full-vocab argmax, forward only). The peak is a bf16 (GPU) / fp32 (CPU) matmul measured in the
same run.

    python benchmarks/bench_train.py --out bench_train.json              # both (GPU part skipped without CUDA)
    python benchmarks/bench_train.py --only llama8b --steps 5
    python benchmarks/bench_train.py --only smollm2 --smollm2-device cuda --smollm2-shapes 16x256,128x512
    python benchmarks/bench_train.py --only smollm2 --modes eager,compiled --batch 2 --cpu-seq 64
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specheads.heads import Eagle3Head, HeadConfig  # noqa: E402
from specheads.train.losses import Objective, TargetLogits  # noqa: E402

CONFIGS = {
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                    target_vocab_size=128256, draft_vocab_size=32000, aux_layer_ids=[2, 16, 29],
                    rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                    target_vocab_size=49152, draft_vocab_size=32000, aux_layer_ids=[2, 15, 27],
                    rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5),
}


def step_flops(cfg: HeadConfig, B: int, T: int, K: int) -> dict:
    H, I, Vd, Vt = cfg.hidden_size, cfg.intermediate_size, cfg.draft_vocab_size, cfg.target_vocab_size
    nh, nkv, hd, n = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.num_aux
    N = B * T
    fc = 2 * N * n * cfg.target_hidden_size * H
    layer = 2 * N * (2 * H * (nh + 2 * nkv) * hd + nh * hd * H + 3 * H * I)
    lm = 2 * N * H * Vd
    attn = []
    for k in range(K):
        dense = 2 * 2 * B * nh * T * T * hd  # QK^T and PV over the step-0 block
        diag = 2 * 2 * B * nh * T * k * hd  # the k diagonal keys (elementwise, counted as FLOPs)
        attn.append(dense + diag)
    fwd_train = fc + K * (layer + lm) + sum(attn)
    bwd = fc + 2 * (K * (layer + lm) + sum(attn))  # fc: weight grad only
    target = 2 * N * H * Vd + 2 * N * H * Vt  # frozen lm_head: draft logits + full argmax
    return {"fc": fc, "layer_per_step": layer, "lm_head_per_step": lm, "attention": sum(attn),
            "forward": fwd_train, "backward": bwd, "target_lm_head": target,
            "total": fwd_train + bwd + target, "head_only": fwd_train + bwd}


def matmul_peak(device, dtype, n: int, iters: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    return 2 * n ** 3 * iters / (time.perf_counter() - t)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench(name: str, device: torch.device, dtype: torch.dtype, B: int, T: int, K: int, steps: int,
          warmup: int, backend: str, compile: bool = False) -> dict:
    torch.manual_seed(0)
    cfg = HeadConfig(kind="eagle3", **CONFIGS[name])
    head = Eagle3Head(cfg).to(device=device, dtype=dtype)
    Vt, Vd, H = cfg.target_vocab_size, cfg.draft_vocab_size, cfg.hidden_size
    ids = torch.randperm(Vt)[:Vd].sort().values
    d2t = (ids - torch.arange(Vd)).to(device)
    head.set_vocab_mapping(d2t)
    lm_w = (torch.randn(Vt, H, device=device, dtype=dtype) * H ** -0.5)
    tl = TargetLogits(lm_w, d2t)
    obj = Objective(head, "eagle3", steps=K, decay=0.8, backend=backend, compile=compile).to(device)
    params = [p for p in obj.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), fused=device.type == "cuda")
    batch = {
        "input_ids": torch.randint(0, Vt, (B, T), device=device),
        "loss_mask": torch.ones(B, T, dtype=torch.long, device=device),
        "attention_mask": torch.ones(B, T, dtype=torch.long, device=device),
        "aux": torch.randn(B, T, cfg.num_aux * H, device=device, dtype=dtype),
        "final": torch.randn(B, T, H, device=device, dtype=dtype),
    }
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    def one():
        tv = tl(batch["final"])
        out = obj(batch, tv)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out

    for _ in range(warmup):
        one()
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        out = one()
    sync(device)
    dt = (time.perf_counter() - t) / steps
    fl = step_flops(cfg, B, T, K)
    res = {
        "config": name, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "dtype": str(dtype).replace("torch.", ""), "batch": B, "seq": T, "ttt_steps": K,
        "trainable_params": sum(p.numel() for p in params), "step_s": dt, "tokens_per_s": B * T / dt,
        "loss": float(out.loss.detach()), "flops": fl, "achieved_flops_per_s": fl["total"] / dt,
        "loss_backend": backend, "compiled": compile,
    }
    if device.type == "cuda":
        res["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    else:
        try:
            import resource

            res["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
        except ImportError:
            pass
    del obj, head, opt, batch, tl, lm_w
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def _shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in part.lower().split("x")) for part in text.split(",") if part]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=sorted(CONFIGS))
    ap.add_argument("--seq", type=int, default=2048, help="GPU sequence length (llama8b)")
    ap.add_argument("--cpu-seq", type=int, default=256, help="CPU sequence length (smollm2)")
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--backend", default="auto", help="soft-CE kernel backend: auto|triton|torch")
    ap.add_argument("--smollm2-device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--smollm2-shapes", default=None,
                    help="comma-separated BxT micro-batches for smollm2 (default: --batch x --cpu-seq)")
    ap.add_argument("--modes", default="eager",
                    help="comma list of eager,compiled: compiled = train.compile (the TTT unroll through "
                         "torch.compile; its warm-up steps include the compilation)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"eager", "compiled"}:
        ap.error(f"--modes: a comma list of eager,compiled; got {a.modes!r}")
    results = []
    todo = [a.only] if a.only else ["llama8b", "smollm2"]
    for name in todo:
        if name == "llama8b":
            if not torch.cuda.is_available():
                print("llama8b: no CUDA device here, skipped", file=sys.stderr)
                continue
            runs = [(torch.device("cuda"), torch.bfloat16, a.batch, a.seq)]
        elif a.smollm2_device == "cuda":
            if not torch.cuda.is_available():
                print("smollm2 on cuda: no CUDA device here, skipped", file=sys.stderr)
                continue
            runs = [(torch.device("cuda"), torch.bfloat16, *shape) for shape in _shapes(a.smollm2_shapes)]
        else:
            runs = [(torch.device("cpu"), torch.float32, *shape)
                    for shape in (_shapes(a.smollm2_shapes) if a.smollm2_shapes else [(a.batch, a.cpu_seq)])]
        for dev, dtype, B, T in runs:
            if dev.type == "cuda":
                peak, peak_kind = matmul_peak(dev, torch.bfloat16, 8192, 20), "bf16 8192³ matmul"
            else:
                peak, peak_kind = matmul_peak(dev, torch.float32, 1024, 10), "fp32 1024³ matmul"
            for mode in modes:
                # compiled: one more warm-up step, as the second shape-stable call may still recompile
                warm = (a.warmup if dev.type == "cuda" else 1) + (mode == "compiled")
                r = bench(name, dev, dtype, B, T, a.ttt, a.steps if dev.type == "cuda" else max(1, a.steps // 2),
                          warm, a.backend, compile=mode == "compiled")
                r["peak_flops_per_s"] = peak
                r["peak_kind"] = peak_kind
                r["mfu"] = r["achieved_flops_per_s"] / peak
                r["mfu_head_only"] = r["flops"]["head_only"] / r["step_s"] / peak
                results.append(r)
    print("| config | mode | device | dtype | B×T | TTT | step (s) | tokens/s | peak mem (GiB) | TFLOP/s | "
          "peak TFLOP/s | MFU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        mem = r.get("peak_mem_gib", r.get("peak_rss_gib", float("nan")))
        print(f"| {r['config']} | {'compiled' if r['compiled'] else 'eager'} | {r['device']} | {r['dtype']} | "
              f"{r['batch']}×{r['seq']} | {r['ttt_steps']} | "
              f"{r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {mem:.1f} | {r['achieved_flops_per_s'] / 1e12:.1f} | "
              f"{r['peak_flops_per_s'] / 1e12:.1f} ({r['peak_kind']}) | {100 * r['mfu']:.1f}% |")
    if a.out:
        a.out.write_text(json.dumps({"results": results, "torch": torch.__version__}, indent=2))
    return results


if __name__ == "__main__":
    main()
