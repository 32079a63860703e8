"""Where served greedy outputs part from each request decoded alone, and by how much the target preferred
its own token there: a bug in the serving loop or a near-tie that the kernels' rounding flips?

    python benchmarks/serving_divergence.py --device cuda --engines eager,compiled --slots 8 --out div.json

For each engine: every request alone (one slot: the reference), then the same stream through ``--slots``
slots with continuous batching for each harvest (plain, and with the n-gram drafter). A request whose
tokens differ from its reference is re-scored at its first differing position by the target in fp32 (the
Hugging Face model on the prompt plus the reference's prefix): ``margin`` is the fp32 logit of the
reference token minus that of the served one. Rounding flips a near-tie (margins of a few hundredths in
bf16); a loop that loses or misplaces state parts where the target is sure (margins of whole logits).

On the H200 (2026-12-03) the compiled bf16 engine's served outputs differed between harvests and slot
counts while the eager engine's had been identical in every row (2026-12-02): this tells which it is.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runtime import ENGINE_PARTS, ENGINES, serve_prompts, serve_stream  # noqa: E402

from specheads.runtime.drafters import NGramDrafter  # noqa: E402
from specheads.runtime.model import TargetModel  # noqa: E402
from specheads.target import load_target  # noqa: E402


def serve(m, stream, slots, new, graphs, **kw):
    """The tokens and counts of one pass, with bench_runtime's serving settings (refills gathered)."""
    st, outputs, _ = serve_stream(m, stream, slots, new, use_cuda_graphs=graphs, refill_at=max(1, slots // 8), **kw)
    return outputs, st


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def margins(hf32, stream, reference, served, device):
    """Per differing request: position, reference and served token, the fp32 logit margin between them and
    the fp32 gap between the reference's top two tokens there."""
    out = []
    for i, (ref, got) in enumerate(zip(reference, served)):
        pos = first_difference(ref, got)
        if pos is None:
            continue
        row = {"request": i, "position": pos, "reference_len": len(ref), "served_len": len(got)}
        if pos < min(len(ref), len(got)):            # not just one stopping earlier at the same tokens
            ids = torch.tensor([stream[i][0] + ref[:pos]], device=device)
            logits = hf32(input_ids=ids).logits[0, -1].float()
            top2 = logits.topk(2).values
            row.update(reference_token=ref[pos], served_token=got[pos],
                       margin=(logits[ref[pos]] - logits[got[pos]]).item(),
                       top2_gap=(top2[0] - top2[1]).item())
        out.append(row)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--engines", default="eager,compiled")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--requests", type=int, default=152)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", default="builtin:eval_mixed")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    tgt = load_target(a.target, dtype=dtype, device=a.device)
    hf32 = load_target(a.target, dtype="float32", device=a.device).model
    stream = serve_prompts(tgt.tokenizer, a.prompts, a.requests)
    graphs = a.device == "cuda" and not a.no_graphs
    max_seq = max(len(p) for p, _ in stream) + a.new_tokens + 64
    res = {"target": a.target, "dtype": dtype, "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
           "slots": a.slots, "requests": len(stream), "new_tokens": a.new_tokens, "torch": torch.__version__, "runs": []}
    alone_by_engine = {}
    for eng in [e.strip() for e in a.engines.split(",") if e.strip()]:
        m = TargetModel.from_hf(tgt.model, max_batch=a.slots, max_seq=max_seq)
        if ENGINES[eng] is not None:
            m.compile_layers(**ENGINE_PARTS.get(eng, {}), **ENGINES[eng])
        t0 = time.perf_counter()
        alone, _ = serve(m, stream, 1, a.new_tokens, graphs)
        alone_by_engine[eng] = alone
        print(f"{eng}: every request alone ({time.perf_counter() - t0:.0f} s)", flush=True)
        runs = [("alone", None, alone)]
        for harvest in ("sync", "pipelined"):
            for name, drafter in (("plain", None), ("ngram", NGramDrafter(backend="device"))):
                kw = dict(pipeline_harvest=harvest == "pipelined")
                if drafter is not None:
                    kw.update(drafter=drafter, k=3)
                outs, st = serve(m, stream, a.slots, a.new_tokens, graphs, **kw)
                runs.append((f"{name} {harvest}", st, outs))
        first = next(iter(alone_by_engine.values()))
        for label, st, outs in runs:
            same = margins(hf32, stream, alone, outs, a.device)
            # the first engine's two references are one list: its differences are scored once
            to_first = same if first is alone else margins(hf32, stream, first, outs, a.device)
            for ref_name, diff in (("alone, same engine", same), ("alone, first engine", to_first)):
                scored = [d["margin"] for d in diff if "margin" in d]
                row = {"engine": eng, "run": label, "against": ref_name, "tokens": sum(len(o) for o in outs),
                       "differing_requests": len(diff),
                       "median_abs_margin": statistics.median(abs(x) for x in scored) if scored else None,
                       "max_abs_margin": max((abs(x) for x in scored), default=None), "differences": diff}
                res["runs"].append(row)
                print(f"{eng:9} {label:16} vs {ref_name:20}: {row['tokens']} tokens, {len(diff)} requests differ"
                      + (f", |fp32 margin| median {row['median_abs_margin']:.3f} max {row['max_abs_margin']:.3f}"
                         if scored else ""), flush=True)
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
