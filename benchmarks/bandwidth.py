"""Plain decoding's memory-bandwidth bound at batch 1, printed beside the measured figure.

At batch 1 a decode step reads every weight once, so ``copy bandwidth ÷ bytes of the weights`` bounds its tokens/s
from above (the KV cache and activations are left out, which only lowers the true bound). The bandwidth is a device
copy of ``--gib`` GiB, best of ``--repeat``, counting the bytes read and written; the weights are the target's
parameters at ``--dtype`` (bf16 by default, as bench_runtime decodes on a GPU) less the input embedding table, of
which a step reads one row (unless it is also the output head, read whole). ``--bench-runtime F`` takes plain
decoding at batch 1 from a bench_runtime.py JSON and compares it with the bound (goal: within 2×). The bf16 matmul
peak (bench_train.py's 8192³ measurement) is recorded too: the MFU of the training runs on the same GPU is
computed against it.

    python benchmarks/bandwidth.py --target qwen2.5-coder-1.5b-instruct-q4_k_m --bench-runtime OUT/bench_runtime.json \\
        --out OUT/bandwidth.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_train import matmul_peak  # noqa: E402
from specheads.fileio import write_json_atomic  # noqa: E402

WITHIN = 2.0  # the goal: plain decoding at batch 1 within 2× of the bound


def copy_bandwidth(device: torch.device, gib: float, repeat: int) -> dict:
    n = int(gib * 2 ** 30)
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # the first copy pays for page faults and allocator growth
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
    best = min(times)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # a copy reads and writes every byte
    return {"bytes": n, "repeat": repeat, "best_s": best, "bytes_per_s": 2 * n / best}


def decode_weight_bytes(model, dtype: torch.dtype) -> dict:
    """Bytes of the weights a batch-1 decode step reads, at ``dtype``."""
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight.data_ptr() == emb.data_ptr()
    params = sum(p.numel() for p in model.parameters())  # a tied table is one parameter, counted once
    read = params if tied else params - emb.numel()
    size = torch.empty((), dtype=dtype).element_size()
    return {"parameters": params, "input_embedding": emb.numel(), "tied_embeddings": tied, "parameters_read": read,
            "dtype": str(dtype).removeprefix("torch."), "bytes": read * size}


def plain_batch1(path: Path) -> dict | None:
    """Plain decoding at batch 1 from a bench_runtime.py JSON (its first engine)."""
    if not path.is_file():
        return None
    res = json.loads(path.read_text())
    rows = [r for r in res.get("rows", []) if r.get("drafter") == "plain" and r.get("batch") == 1]
    if not rows:
        return None
    r = rows[0]
    return {"file": str(path), "engine": r.get("engine"), "device": res.get("device"), "dtype": res.get("dtype"),
            "tokens_per_s": r["tokens_per_s"], "decode_tokens_per_s": r["decode_tokens_per_s"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="what bench_runtime.py --target takes (a name, GGUF or directory)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--gib", type=float, default=2.0, help="size of the copied buffer (at least 1 GiB on a GPU)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--bench-runtime", type=Path, help="bench_runtime.py's JSON: plain decoding at batch 1")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    from specheads.target import load_target

    # only the parameter shapes matter: the CPU copy the loaders make anyway, never the device's memory
    tgt = load_target(a.target, dtype=a.dtype, device="cpu")
    weights = decode_weight_bytes(tgt.model, getattr(torch, a.dtype))
    del tgt
    bw = copy_bandwidth(dev, a.gib, a.repeat)
    peak_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    n = 8192 if dev.type == "cuda" else 1024
    peak = matmul_peak(dev, peak_dtype, n, 20 if dev.type == "cuda" else 3)
    bound = bw["bytes_per_s"] / weights["bytes"]
    res = {"target": a.target, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "copy": bw, "weights": weights, "bound_tokens_per_s": bound,
           "matmul_peak": {"flops_per_s": peak, "dtype": str(peak_dtype).removeprefix("torch."), "n": n},
           "plain": None}
    print(f"device copy: {bw['bytes_per_s'] / 1e9:,.0f} GB/s (best of {a.repeat}, {a.gib:g} GiB read and written); "
          f"{weights['dtype']} weights read per step: {weights['bytes'] / 1e9:.2f} GB "
          f"-> bound {bound:,.0f} tok/s at batch 1")
    plain = plain_batch1(a.bench_runtime) if a.bench_runtime else None
    if plain is not None:
        frac = plain["decode_tokens_per_s"] / bound
        plain.update({"fraction_of_bound": frac, "goal": f"within {WITHIN:g}x of the bound",
                      "met": frac >= 1 / WITHIN})
        res["plain"] = plain
        print(f"plain decoding, batch 1 ({plain['engine']} engine, {plain['dtype']}): "
              f"{plain['decode_tokens_per_s']:,.0f} tok/s after the prefill ({plain['tokens_per_s']:,.0f} with it) "
              f"| bound {bound:,.0f} tok/s | {frac:.2f} of the bound -> goal "
              f"{'met' if plain['met'] else 'missed'}")
    elif a.bench_runtime:
        print(f"{a.bench_runtime}: no plain batch-1 row (bench_runtime not run, or failed)")
    print(f"matmul peak ({res['matmul_peak']['dtype']}, {n}³): {peak / 1e12:.3g} TFLOP/s")
    if a.out:
        write_json_atomic(a.out, res)
    return res


if __name__ == "__main__":
    main()
