"""Benchmark the specheads kernels: Triton vs the PyTorch reference.

    python benchmarks/bench_kernels.py --out runs/bench_kernels.json            # CUDA (H200)
    python benchmarks/bench_kernels.py --device cpu --out /tmp/bench.json        # tiny CPU smoke run

Verify kernels (greedy, rejection, one-hot, tree) and the sampling transform at batch 64,
k = 4, vocab 128256, fp32 probabilities; soft cross-entropy forward + backward at
M = 16384, Vd = 32000, bf16. Times are medians (``triton.testing.do_bench`` on CUDA, a
wall-clock median on CPU). Bandwidth = bytes the rule must touch (unique bytes read +
written, counted from the actual outcome: e.g. rejection reads the target and draft rows
only where it samples) / time, compared with a device-to-device copy of a large tensor
measured in the same run (copy bandwidth counts read + write). On CPU, Triton runs in
the interpreter (``TRITON_INTERPRET=1``) and the shapes are scaled down: only a smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path


def _parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--tree-nodes", type=int, default=8, help="nodes per request for tree_verify (root included)")
    ap.add_argument("--ce-rows", type=int, default=None)
    ap.add_argument("--ce-vocab", type=int, default=None)
    ap.add_argument("--copy-mib", type=int, default=None, help="size of the copy-bandwidth tensor")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


ARGS = _parse()
if ARGS.device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specheads import kernels  # noqa: E402


def _device() -> torch.device:
    if ARGS.device:
        return torch.device(ARGS.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


DEV = _device()
CUDA = DEV.type == "cuda"
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def bench(fn, reps_cpu: int = 3) -> float:
    """Median milliseconds of fn()."""
    if CUDA:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))
    fn()
    times = []
    for _ in range(reps_cpu):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(mib: int) -> float:
    n = mib * 2**20 // 4
    src = torch.empty(n, dtype=torch.float32, device=DEV).uniform_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms * 1e-3)  # read + write, bytes/s


def machine_info(copy_mib: int) -> dict:
    info = {"device": torch.cuda.get_device_name(DEV) if CUDA else platform.processor() or "cpu",
            "torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    info["interpreter"] = os.environ.get("TRITON_INTERPRET") == "1"
    info["copy_bandwidth_GBps"] = copy_bandwidth(copy_mib) / 1e9
    return info


def recorder(rows: list, bw_copy: float):
    """record(name, shape, triton fn, torch fn, bytes moved, extra): times both and appends a result row."""
    def record(name, shape, fn_t, fn_r, nbytes, extra=None):
        t_ms = bench(fn_t)
        r_ms = bench(fn_r)
        row = {"kernel": name, "shape": shape, "triton_ms": t_ms, "torch_ms": r_ms, "speedup": r_ms / t_ms,
               "bytes": int(nbytes), "triton_GBps": nbytes / (t_ms * 1e-3) / 1e9,
               "torch_GBps": nbytes / (r_ms * 1e-3) / 1e9,
               "triton_pct_copy": 100 * nbytes / (t_ms * 1e-3) / bw_copy}
        row.update(extra or {})
        rows.append(row)
        print(f"  {name:<22} triton {t_ms:9.3f} ms   torch {r_ms:9.3f} ms", flush=True)
    return record


def bench_verify(record, g, B: int, K: int, V: int) -> None:
    """greedy, rejection and one-hot verification, and target_probs with and without top-k / top-p."""
    # drafts that the target often (not always) agrees with: peaked target, draft = noisy target
    logits = torch.randn(B, K + 1, V, device=DEV, generator=g) * 4
    p = torch.softmax(logits, -1)
    q = torch.softmax(logits[:, :K] + torch.randn(B, K, V, device=DEV, generator=g) * 2, -1)
    x = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, K)
    ua = torch.rand(B, K, device=DEV, generator=g)
    us = torch.rand(B, device=DEV, generator=g)
    f4 = 4

    out = kernels.greedy_verify(x, logits, backend="triton")
    record("greedy_verify", [B, K, V], lambda: kernels.greedy_verify(x, logits, backend="triton"),
           lambda: kernels.greedy_verify(x, logits, backend="torch"), B * (K + 1) * V * f4,
           {"mean_accepted": out.num_accepted.float().mean().item()})

    out = kernels.rejection_verify(x, q, p, ua, us, backend="triton")
    two_rows = (out.num_accepted < K).sum().item()
    record("rejection_verify", [B, K, V], lambda: kernels.rejection_verify(x, q, p, ua, us, backend="triton"),
           lambda: kernels.rejection_verify(x, q, p, ua, us, backend="torch"),
           (B + two_rows) * V * f4 + B * K * 3 * f4,
           {"mean_accepted": out.num_accepted.float().mean().item()})

    out = kernels.onehot_verify(x, p, ua, us, backend="triton")
    record("onehot_verify", [B, K, V], lambda: kernels.onehot_verify(x, p, ua, us, backend="triton"),
           lambda: kernels.onehot_verify(x, p, ua, us, backend="torch"), B * V * f4 + B * K * 2 * f4,
           {"mean_accepted": out.num_accepted.float().mean().item()})

    temp = torch.full((B,), 0.8, device=DEV)
    topk = torch.full((B,), 50, dtype=torch.long, device=DEV)
    topp = torch.full((B,), 0.9, device=DEV)
    record("target_probs (t,k,p)", [B, K + 1, V],
           lambda: kernels.target_probs(logits, temp, topk, topp, backend="triton"),
           lambda: kernels.target_probs(logits, temp, topk, topp, backend="torch"), 2 * B * (K + 1) * V * f4)
    record("target_probs (t only)", [B, K + 1, V],
           lambda: kernels.target_probs(logits, temp, 0, 1.0, backend="triton"),
           lambda: kernels.target_probs(logits, temp, 0, 1.0, backend="torch"), 2 * B * (K + 1) * V * f4)


def bench_tree(record, g, B: int, V: int, N: int) -> None:
    """tree verification of an N-node EAGLE-style tree, target-only."""
    f4 = 4
    # tree: root + a chain of depth K + side branches, one per level (a small EAGLE-style tree)
    cand = torch.randint(0, V, (B, N), device=DEV, generator=g)
    nt = torch.full((B, N), -1, dtype=torch.long, device=DEV)
    ns = torch.full((B, N), -1, dtype=torch.long, device=DEV)
    depth = 0
    main_chain, i = 0, 1
    while i < N:  # node `main_chain` gets children i (continues the chain) and maybe i+1 (a side leaf)
        nt[:, main_chain] = i
        if i + 1 < N:
            ns[:, i] = i + 1
        main_chain, i, depth = i, i + 2, depth + 1
    tree_logits = torch.randn(B, N, V, device=DEV, generator=g) * 4
    for node in range(N):  # make the target like the first child of each node
        c = nt[0, node].item()
        if c >= 0:
            tree_logits[:, node].scatter_add_(1, cand[:, c:c + 1], torch.full((B, 1), 8.0, device=DEV))
    tp = torch.softmax(tree_logits, -1)
    coins = torch.rand(B, N, device=DEV, generator=g)
    cf = torch.rand(B, device=DEV, generator=g)
    out = kernels.tree_verify(cand, nt, ns, tp, coins, cf, depth, backend="triton")
    record("tree_verify", [B, N, V], lambda: kernels.tree_verify(cand, nt, ns, tp, coins, cf, depth, backend="triton"),
           lambda: kernels.tree_verify(cand, nt, ns, tp, coins, cf, depth, backend="torch"), B * V * f4,
           {"mean_accepted": out.num_accepted.float().mean().item(), "max_depth": depth})


def bench_soft_ce(record, g, M: int, Vd: int) -> dict:
    """the fused soft cross-entropy, forward + backward and forward alone; returns the peak extra memory (CUDA)."""
    d = (torch.randn(M, Vd, device=DEV, generator=g) * 2).bfloat16().requires_grad_()
    t = (torch.randn(M, Vd, device=DEV, generator=g) * 2).bfloat16()
    go = torch.ones(M, device=DEV)

    def fwd_bwd(backend):
        def fn():
            loss = kernels.soft_cross_entropy(d, t, backend=backend)
            torch.autograd.grad(loss, d, go)
        return fn

    mem = {}
    for backend in ("triton", "torch"):
        if CUDA:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fwd_bwd(backend)()
            torch.cuda.synchronize()
            mem[backend] = (torch.cuda.max_memory_allocated() - base) / 2**20
    record("soft_ce fwd+bwd bf16", [M, Vd], fwd_bwd("triton"), fwd_bwd("torch"), 5 * M * Vd * 2,
           {"peak_extra_MiB_triton": mem.get("triton"), "peak_extra_MiB_torch": mem.get("torch")})
    record("soft_ce fwd bf16", [M, Vd], lambda: kernels.soft_cross_entropy(d.detach(), t, backend="triton"),
           lambda: kernels.soft_cross_entropy(d.detach(), t, backend="torch"), 2 * M * Vd * 2)
    return mem


def print_report(info: dict, rows: list, mem: dict, copy_mib: int) -> None:
    bw_copy = info["copy_bandwidth_GBps"] * 1e9
    print()
    print(f"device: {info['device']}  torch {info['torch']}  triton {info['triton']}"
          f"{'  (interpreter)' if info['interpreter'] else ''}")
    print(f"device-to-device copy: {bw_copy / 1e9:.0f} GB/s (read + write, {copy_mib} MiB)")
    print()
    print("| kernel | shape | triton ms | torch ms | speedup | triton GB/s | % of copy BW |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kernel']} | {'x'.join(map(str, r['shape']))} | {r['triton_ms']:.3f} | {r['torch_ms']:.3f} | "
              f"{r['speedup']:.1f}x | {r['triton_GBps']:.0f} | {r['triton_pct_copy']:.0f}% |")
    if mem:
        print(f"\nsoft-CE fwd+bwd peak extra memory: triton {mem['triton']:.0f} MiB, torch {mem['torch']:.0f} MiB")
    if ARGS.out:
        Path(ARGS.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ARGS.out).write_text(json.dumps({"info": info, "results": rows}, indent=2))
        print(f"\nwrote {ARGS.out}")


def main():
    B = ARGS.batch or (64 if CUDA else 4)
    V = ARGS.vocab or (128256 if CUDA else 4096)
    copy_mib = ARGS.copy_mib or (4096 if CUDA else 64)
    g = torch.Generator(device=DEV).manual_seed(ARGS.seed)
    info = machine_info(copy_mib)
    rows: list = []
    record = recorder(rows, info["copy_bandwidth_GBps"] * 1e9)
    bench_verify(record, g, B, ARGS.k, V)
    bench_tree(record, g, B, V, ARGS.tree_nodes)
    mem = bench_soft_ce(record, g, ARGS.ce_rows or (16384 if CUDA else 32), ARGS.ce_vocab or (32000 if CUDA else 2048))
    print_report(info, rows, mem, copy_mib)

if __name__ == "__main__":
    main()
