"""Why a drafted step at batch 1 costs ~0.14 ms more in bench_runtime's run than in its profile (2026-12-04):
the same compiled engine and graphs, traced (1) in a whole generate() of 128 tokens, as the bench times it, and
(2) as profile_steps runs it (a 64-token Generation, steps 3..13). Per step: span and busy us; per kernel name:
us a step in each context."""
import collections, json, os, sys, time
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
sys.path.insert(0, ".")
from benchmarks.bench_runtime import random_smollm2
from specheads.runtime.drafters import NGramDrafter
from specheads.runtime.generate import Generation, generate
from specheads.runtime.model import TargetModel

tgt = random_smollm2("bfloat16", "cuda")
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, 49152, (40,), generator=g).tolist()]
m = TargetModel.from_hf(tgt.model, max_batch=8, max_seq=40 + 128 + 3 + 64).compile_layers(**({"dynamic": False} if os.environ.get("STATIC") else {}))
out = {}
ORDER = sys.argv[2].split(",") if len(sys.argv) > 2 else ["plain", "ngram"]

def steps_of(prof):
    ev = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    steps, cur = [], []
    for e in ev:
        cur.append(e)
        if e.name.startswith("Memcpy DtoH"):
            steps.append(cur); cur = []
    return steps

def summary(steps, label):
    spans = [s[-1].time_range.end - s[0].time_range.start for s in steps] or [0.0]
    per = collections.defaultdict(float)
    for s in steps:
        for e in s:
            per[e.name[:70]] += (e.time_range.end - e.time_range.start) / len(steps)
    print(f"{label}: {len(steps)} steps, span median {sorted(spans)[len(spans)//2]:.0f} us, first/last 5: "
          f"{[round(x) for x in spans[:5]]} {[round(x) for x in spans[-5:]]}", flush=True)
    return {"spans": spans, "per_kernel": dict(per)}

for name in ORDER:
    d = None if name == "plain" else NGramDrafter().compile()
    kw = dict(drafter=d, k=3) if d else {}
    generate(m, prompts, 128, stop_token_ids=(), use_cuda_graphs=True, **kw)          # capture
    torch.cuda.synchronize(); t = time.perf_counter()
    r = generate(m, prompts, 128, stop_token_ids=(), use_cuda_graphs=True, **kw)
    print(name, "timed run", round(r.elapsed_s * 1e3, 1), "ms", r.summary()["tau"], flush=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        generate(m, prompts, 128, stop_token_ids=(), use_cuda_graphs=True, **kw)
        torch.cuda.synchronize()
    full = summary(steps_of(prof), f"{name} whole generate")
    from benchmarks.bench_runtime import graph_timeline
    tl = graph_timeline(prof, len(steps_of(prof)))
    print(json.dumps(tl["graph_gaps"][:4]), flush=True)
    gen = Generation(m, prompts, 64, drafter=d, k=3, stop_token_ids=(), use_cuda_graphs=True)
    gen.prefill(); gen.run(max_steps=3); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        gen.run(max_steps=10); torch.cuda.synchronize()
    early = summary(steps_of(prof), f"{name} profile-like")
    out[name] = {"full": full, "early": early}
    keys = sorted(set(full["per_kernel"]) | set(early["per_kernel"]), key=lambda k: -abs(full["per_kernel"].get(k, 0) - early["per_kernel"].get(k, 0)))
    for k in keys[:12]:
        print(f"   {full['per_kernel'].get(k, 0):8.1f} {early['per_kernel'].get(k, 0):8.1f}  {k}")
json.dump(out, open(sys.argv[1], "w"))
