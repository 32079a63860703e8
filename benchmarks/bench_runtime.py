"""Runtime speed: plain decode tokens/s (our engine vs HF generate) and speculative speedup.

    python benchmarks/bench_runtime.py --device cuda --cuda-graphs --out runs/bench_runtime.json
    python benchmarks/bench_runtime.py --device cpu --batches 1,8 --new-tokens 32 --head runs/x/export

Greedy, fixed number of new tokens (no early stop), same prompts for every row set.
Speculative rows run at batch 1 with an exported head (--head DIR, any export format)
and/or the n-gram drafter; speedup = tokens/s with drafting / tokens/s without, same engine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specheads.runtime.drafters import NGramDrafter, drafter_for_head
from specheads.runtime.generate import generate
from specheads.runtime.model import TargetModel
from specheads.target import load_target

QUESTIONS = [
    "Explain how a hash map works, then list its typical operations with their costs.",
    "Write a Python function that returns the n-th Fibonacci number, and explain it.",
    "Summarise the causes of the French Revolution in five bullet points.",
    "Translate to French: 'The weather is nice today, let us go for a walk in the park.'",
    "Repeat this list twice: red, green, blue, yellow, purple, orange.",
    "What is the difference between TCP and UDP? Answer briefly.",
    "Give three tips for writing clear technical documentation.",
    "Solve: a train travels 120 km in 1.5 hours. What is its average speed?",
]


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def prompts_for(tok, n):
    out = []
    for i in range(n):
        ids = tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                      add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids))
    return out


def bench_engine(m, prompts, new, **kw):
    generate(m, prompts, min(new, 8), stop_token_ids=(), **kw)                  # warm-up / capture
    r = generate(m, prompts, new, stop_token_ids=(), **kw)
    toks = sum(len(t) for t in r.tokens)
    return {"tokens": toks, "seconds": r.elapsed_s, "tokens_per_s": toks / r.elapsed_s, **{
        k: v for k, v in r.summary().items() if k in ("tau", "vllm_mean_acceptance_length", "acceptance_rate")}}


class _Random:
    """Stand-in for a loaded Target: SmolLM2-135M's architecture, random weights."""
    def __init__(self, model):
        self.model, self.tokenizer = model, None
        self.embed_tokens = model.get_input_embeddings()


def random_smollm2(dtype, device):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                      max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    return _Random(LlamaForCausalLM(cfg).to(device=device, dtype=getattr(torch, dtype)).eval())


@torch.no_grad()
def bench_hf(model, tok, prompts, new, dev):
    if tok is None:                                  # random prompts: left-pad by hand
        T = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts], device=dev)
        att = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts], device=dev)
        enc = {"input_ids": ids, "attention_mask": att}
        pad = 0
    else:
        tok.padding_side = "left"
        texts = [tok.decode(p) for p in prompts]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(dev)
        pad = tok.pad_token_id
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad, eos_token_id=None)
    model.generate(**enc, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
    sync(dev)
    t0 = time.perf_counter()
    out = model.generate(**enc, **kw)
    sync(dev)
    dt = time.perf_counter() - t0
    toks = (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]
    return {"tokens": toks, "seconds": dt, "tokens_per_s": toks / dt}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: bf16 on cuda, fp32 on cpu)")
    ap.add_argument("--target", default="smollm2-135m", help="target to load (default: the bundled SmolLM2 GGUF)")
    ap.add_argument("--cuda-graphs", action="store_true")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--head", default=None, help="exported head directory for the speculative row")
    ap.add_argument("--no-ngram", action="store_true", help="skip the n-gram speculative row")
    ap.add_argument("--no-hf", action="store_true", help="skip HF generate")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--random-weights", action="store_true",
                    help="SmolLM2-135M architecture with random weights and random prompts (no GGUF needed; "
                         "speed only; acceptance figures are meaningless)")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    dtype = a.dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    batches = [int(b) for b in a.batches.split(",")]
    if a.random_weights:
        tgt = random_smollm2(dtype, a.device)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 49152, (40 + 7 * (i % 8),), generator=g).tolist() for i in range(max(batches))]
    else:
        tgt = load_target(a.target, dtype=dtype, device=a.device)
        prompts = prompts_for(tgt.tokenizer, max(batches))
    max_seq = max(len(p) for p in prompts) + a.new_tokens + 64
    m = TargetModel.from_hf(tgt.model, max_batch=max(batches), max_seq=max_seq)
    graphs = a.cuda_graphs and dev.type == "cuda"
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "dtype": dtype,
           "cuda_graphs": graphs, "new_tokens": a.new_tokens, "plain": [], "speculative": []}
    for B in batches:
        row = {"batch": B, "engine": bench_engine(m, prompts[:B], a.new_tokens, use_cuda_graphs=graphs)}
        if not a.no_hf:
            row["hf"] = bench_hf(tgt.model, tgt.tokenizer, prompts[:B], a.new_tokens, dev)
        res["plain"].append(row)
    base = res["plain"][0]["engine"] if batches[0] == 1 else bench_engine(m, prompts[:1], a.new_tokens,
                                                                           use_cuda_graphs=graphs)
    drafters = [] if a.no_ngram else [("ngram", NGramDrafter(1, 3))]
    if a.head:
        from specheads.export import load_any
        head, _meta, fmt = load_any(a.head)
        emb = getattr(head, "embed_tokens", None)
        if emb is not None and not emb.weight.abs().sum():            # exports without the embedding
            emb.weight.data.copy_(tgt.embed_tokens.weight.to(emb.weight))
        head = head.to(device=dev, dtype=m.dtype).eval()
        drafters.append((f"{head.cfg.kind}:{Path(a.head).name}", drafter_for_head(head)))
    for name, d in drafters:
        r = bench_engine(m, prompts[:1], a.new_tokens, drafter=d, k=a.k, use_cuda_graphs=graphs)
        r.update(drafter=name, k=a.k, speedup=r["tokens_per_s"] / base["tokens_per_s"])
        res["speculative"].append(r)

    print(f"\n### Plain greedy decode, SmolLM2-135M, {res['device']}, {dtype}, graphs={graphs}, "
          f"{a.new_tokens} new tokens\n")
    print("| batch | engine tok/s | HF generate tok/s | engine / HF |\n|---:|---:|---:|---:|")
    for r in res["plain"]:
        hf = r.get("hf", {}).get("tokens_per_s")
        eng = r["engine"]["tokens_per_s"]
        hf_s = f"{hf:.1f}" if hf else "-"
        ratio = f"{eng / hf:.2f}x" if hf else "-"
        print(f"| {r['batch']} | {eng:.1f} | {hf_s} | {ratio} |")
    if res["speculative"]:
        print(f"\n### Speculative decoding, batch 1, k={a.k} (baseline {base['tokens_per_s']:.1f} tok/s)\n")
        print("| drafter | tok/s | speedup | tau | vLLM 1+acc/drafts | acceptance rate |\n|---|---:|---:|---:|---:|---:|")
        for r in res["speculative"]:
            print(f"| {r['drafter']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['tau']:.2f} | "
                  f"{r['vllm_mean_acceptance_length']:.2f} | {r['acceptance_rate']:.2f} |")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
