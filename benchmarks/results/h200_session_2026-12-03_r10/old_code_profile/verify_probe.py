"""Why does a batch-8 verify forward (T=4) cost 1.75x a plain batch-8 step? Random SmolLM2 weights, bf16,
the compiled engine. (1) graphed forward GPU ms for (B, T) shapes at kv_len 128/256; (2) F.linear per
M for the layer shapes; (3) attention kernel per (B, T); (4) profiler tables of eager-compiled forwards."""
import json, os, sys, time
import torch, torch.nn.functional as F
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from bench_runtime import random_smollm2
from specheads.runtime.model import TargetModel
from specheads import kernels

out = {}
dev = torch.device("cuda")
tgt = random_smollm2("bfloat16", "cuda")
m = TargetModel.from_hf(tgt.model, max_batch=64, max_seq=512)
m.compile_layers()

def gtime(fn, n=50):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=m.graph_pool()):
        fn()
    g.replay(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n): g.replay()
    e1.record(); torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n

fw = {}
for kv in (128, 256):
    for B, T in [(1, 1), (1, 4), (8, 1), (8, 2), (8, 4), (16, 1), (32, 1), (16, 4), (48, 1), (48, 4)]:
        m.cache.set_lengths([kv - 20] * 64)
        ids = torch.randint(0, 49152, (B, T), device=dev)
        wp = m.cache.lengths[:B, None] + torch.arange(T, device=dev)
        def f(): return m(ids, wp, wp, None, kv_len=kv)
        try:
            fw[f"B{B}_T{T}_kv{kv}"] = gtime(f)
        except Exception as e:
            fw[f"B{B}_T{T}_kv{kv}"] = repr(e)[:200]
        print("forward", B, T, kv, fw[f"B{B}_T{T}_kv{kv}"], flush=True)
out["forward_graph_ms"] = fw

lin = {}
W = {"wqkv": m.layers[0].wqkv.weight, "wo": m.layers[0].wo.weight, "gate_up": m.layers[0].w_gate_up.weight,
     "down": m.layers[0].w_down.weight, "lm_head": m.lm_head.weight}
for name, w in W.items():
    for M in (1, 4, 8, 16, 32, 64):
        x = torch.randn(M, w.shape[1], device=dev, dtype=w.dtype)
        def f(x=x, w=w):
            for _ in range(10): F.linear(x, w)
        lin[f"{name}_M{M}"] = 1e3 * gtime(f) / 10      # us per call
    print("linear", name, {k: round(v, 2) for k, v in lin.items() if k.startswith(name)}, flush=True)
out["linear_us"] = lin

att = {}
for kv in (128, 256):
    for B, T in [(1, 1), (1, 4), (8, 1), (8, 4), (32, 1), (48, 4)]:
        q = torch.randn(B, T, 9, 64, device=dev, dtype=torch.bfloat16)
        k = m.cache.k[0]; v = m.cache.v[0]
        mask = torch.zeros(B, 1, 3 * T, kv, device=dev, dtype=torch.bfloat16)
        def f(q=q, mask=mask, kv=kv):
            for _ in range(10): kernels.decode_attention(q, k, v, mask, kv, None, backend="triton")
        att[f"B{B}_T{T}_kv{kv}"] = 1e3 * gtime(f) / 10
    print("attention", {k: round(v, 2) for k, v in att.items()}, flush=True)
out["attention_us"] = att

from torch.profiler import ProfilerActivity, profile
tables = {}
for B, T in [(8, 1), (8, 4), (32, 1)]:
    m.cache.set_lengths([108] * 64)
    ids = torch.randint(0, 49152, (B, T), device=dev)
    wp = m.cache.lengths[:B, None] + torch.arange(T, device=dev)
    for _ in range(3): m(ids, wp, wp, None, kv_len=128)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        m(ids, wp, wp, None, kv_len=128); torch.cuda.synchronize()
    t = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25)
    tables[f"B{B}_T{T}"] = t
    print(f"\n### profile B{B} T{T}\n" + t, flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "verify_probe.json"), "w"), indent=1)
open(os.path.join(os.environ.get("OUT", "."), "verify_probe_tables.txt"), "w").write(
    "\n\n".join(f"### {k}\n{v}" for k, v in tables.items()))
