"""Dump throughput vs a forward-only pass of the target, and bytes per stored token.

    python benchmarks/bench_dump.py --device cpu --rows 32
    python benchmarks/bench_dump.py --device cuda --rows 4096 --out bench_dump.json
    python benchmarks/bench_dump.py --device cuda --target random:llama-8b --rows 512

The forward-only baseline runs the target's decoder (no lm_head, no capture) over the
same rows in length-sorted batches of the same ``batch_tokens``; the dump is the full
``run_dump`` (row hashing, capture, strip padding, bf16/fp8 conversion, device→host copy,
sha256, write, fsync, rename, manifest) into a fresh directory. ratio = dump tokens/s ÷
forward tokens/s (goal ≥ 0.8). Rows are random token ids with lengths uniform in
[--min-len, --max-len] (fixed seed).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specheads.config import Recipe  # noqa: E402
from specheads.dump import run_dump  # noqa: E402
from specheads.dump.store import bytes_per_token, pack_batches  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_llama(name: str, device: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    from specheads.target import Target

    shapes = {
        "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256),
        "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                        num_key_value_heads=3, vocab_size=49152),
        "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256),
    }[name]
    cfg = LlamaConfig(max_position_embeddings=8192, **shapes)
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model.eval().requires_grad_(False)
    return Target(model=model, tokenizer=None, name=f"random-{name}", source=f"random:{name}")


def forward_only(target, rows, batch_tokens: int) -> float:
    """Seconds for the decoder forward over all rows (length-sorted, same batch budget)."""
    lens = [len(r["input_ids"]) for r in rows]
    device = target.device
    t0 = time.perf_counter()
    with torch.inference_mode():
        for batch in pack_batches(lens, batch_tokens):
            width = lens[batch[0]]
            inp = torch.zeros(len(batch), width, dtype=torch.long)
            att = torch.zeros(len(batch), width, dtype=torch.long)
            for j, r in enumerate(batch):
                inp[j, :lens[r]] = torch.tensor(rows[r]["input_ids"])
                att[j, :lens[r]] = 1
            padded = bool(int(att.sum()) != att.numel())
            target.decoder(input_ids=inp.to(device), attention_mask=att.to(device) if padded else None,
                           use_cache=False)
    sync(device)
    return time.perf_counter() - t0


def io_probe(where: str | None, size: int = 1 << 30) -> dict:
    """Raw sequential write+fsync and sha256 speed on this machine (the dump's I/O ceiling)."""
    import hashlib
    import os

    buf = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    mv = memoryview(buf)
    t = time.perf_counter()
    hashlib.sha256(mv).hexdigest()
    sha = size / (time.perf_counter() - t) / 1e6
    fd, path = tempfile.mkstemp(dir=where)
    try:
        t = time.perf_counter()
        with os.fdopen(fd, "wb") as f:
            for off in range(0, size, 64 << 20):
                f.write(mv[off:off + (64 << 20)])
            f.flush()
            os.fsync(f.fileno())
        wr = size / (time.perf_counter() - t) / 1e6
    finally:
        os.unlink(path)
    return {"write_fsync_MBps": wr, "sha256_MBps": sha, "bytes": size}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--target", default="smollm2-135m", help="a load_target source, or random:llama-8b / random:llama-1b / random:smollm2")
    ap.add_argument("--dtype", default=None, help="target dtype (default: float32 on cpu, bfloat16 on cuda)")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--batch-tokens", type=int, default=None, help="default: 4096 on cpu, 16384 on cuda")
    ap.add_argument("--shard-tokens", type=int, default=65536,
                    help="small enough that the benchmark has several shards (a real dump has many)")
    ap.add_argument("--stored", default="bfloat16,fp8", help="comma list of dump dtypes to time")
    ap.add_argument("--writer-threads", type=int, default=None)
    ap.add_argument("--dir", default=None, help="where to write the dumps (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=1, help="timed passes of each (best is reported)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)

    device = torch.device(a.device)
    tdtype = a.dtype or ("float32" if device.type == "cpu" else "bfloat16")
    batch_tokens = a.batch_tokens or (4096 if device.type == "cpu" else 16384)
    t0 = time.perf_counter()
    if a.target.startswith("random:"):
        from specheads.target import resolve_dtype

        target = random_llama(a.target.split(":", 1)[1], a.device, resolve_dtype(tdtype))
    else:
        from specheads.target import load_target

        target = load_target(a.target, dtype=tdtype, device=a.device, require_chat_template=False)
    load_s = time.perf_counter() - t0
    _ = target.config_hash  # computed once, outside the timings

    g = np.random.default_rng(0)
    vocab = min(target.vocab_size, 32000)
    rows = [{"input_ids": g.integers(0, vocab, int(n)).tolist(), "loss_mask": [1] * int(n)}
            for n in g.integers(a.min_len, a.max_len + 1, a.rows)]
    tokens = sum(len(r["input_ids"]) for r in rows)

    # warm-up (kernels, allocator, oneDNN primitives)
    forward_only(target, rows[: max(1, len(rows) // 8)], batch_tokens)

    base = tempfile.mkdtemp(prefix="bench_dump_", dir=a.dir)
    results = {"forward_s": [], "dump_s": {k: [] for k in a.stored.split(",")}, "bytes": {}}
    try:
        for _ in range(a.repeat):
            results["forward_s"].append(forward_only(target, rows, batch_tokens))
            for stored in a.stored.split(","):
                d = Path(base, stored)
                shutil.rmtree(d, ignore_errors=True)
                recipe = Recipe(run_dir=base, dump={"dir": str(d), "dtype": stored, "batch_tokens": batch_tokens,
                                                    "shard_tokens": a.shard_tokens},
                                data={"max_length": a.max_len}, target={"device": a.device})
                sync(device)
                t = time.perf_counter()
                m = run_dump(recipe, target=target, rows=rows, progress=False, writer_threads=a.writer_threads)
                sync(device)
                results["dump_s"][stored].append(time.perf_counter() - t)
                results["bytes"][stored] = m["counts"]["bytes"]
                shutil.rmtree(d, ignore_errors=True)
            results["forward_s"].append(forward_only(target, rows, batch_tokens))
    finally:
        shutil.rmtree(base, ignore_errors=True)

    io = io_probe(a.dir)
    fwd = min(results["forward_s"])
    fwd_tps = tokens / fwd
    n_aux = 3
    table = []
    for stored, times in results["dump_s"].items():
        best = min(times)
        table.append({
            "stored": stored, "dump_s": best, "dump_tok_s": tokens / best, "ratio": (tokens / best) / fwd_tps,
            "bytes_per_token": results["bytes"][stored] / tokens,
            "bytes_per_token_formula": bytes_per_token(stored, n_aux, target.hidden_size),
            "io_ceiling_tok_s": io["write_fsync_MBps"] * 1e6 / (results["bytes"][stored] / tokens),
        })
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    report = {
        "device": str(device), "device_name": dev_name, "torch": torch.__version__, "target": a.target,
        "target_dtype": tdtype, "hidden_size": target.hidden_size, "num_layers": target.num_layers,
        "rows": a.rows, "tokens": tokens, "batch_tokens": batch_tokens, "shard_tokens": a.shard_tokens,
        "threads": torch.get_num_threads(), "load_s": load_s, "forward_s": fwd, "forward_tok_s": fwd_tps,
        "forward_runs_s": results["forward_s"], "results": table, "io_probe": io,
    }
    print(f"\n### dump throughput — {a.target} ({tdtype}) on {dev_name}, {a.rows} rows, {tokens} tokens, "
          f"batch_tokens {batch_tokens}\n")
    print("| stored | tokens/s | ratio to forward-only | bytes/token | disk ceiling tokens/s |")
    print("|---|---:|---:|---:|---:|")
    print(f"| forward only | {fwd_tps:,.0f} | 1.00 | — | — |")
    for r in table:
        print(f"| {r['stored']} | {r['dump_tok_s']:,.0f} | {r['ratio']:.2f} | {r['bytes_per_token']:,.0f} | "
              f"{r['io_ceiling_tok_s']:,.0f} |")
    print(f"\nI/O probe: write+fsync {io['write_fsync_MBps']:,.0f} MB/s, sha256 {io['sha256_MBps']:,.0f} MB/s "
          f"(disk ceiling = write+fsync speed / bytes per token)")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2))
        print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
