"""Data generation speed: `data regenerate` and `data synthesize` against the engine's plain decode.

    python benchmarks/bench_generate.py --device cuda --batch 64,256 --prompts 2048 --new-tokens 256 --out X.json
    python benchmarks/bench_generate.py --device cpu --batch 4 --prompts 8 --new-tokens 16   # a quick check

For each batch size of --batch, three rows run in one process on the same target (real SmolLM2-135M
weights by default) at that batch size. `plain decode` is the ceiling: one full batch of prompts
decoded for exactly --new-tokens tokens (no early stop, greedy), after a warm-up (on CUDA, with CUDA
graphs). Both stages decode with continuous batching. `regenerate`
answers --prompts prompts of the built-in set (greedy, stops at EOS, writes JSONL as the stage does);
`synthesize` writes --prompts user prompts with the recipe's default mix (sampled, documents for the
copy-heavy ones, filters, de-duplication). Their tok/s count the generated tokens (documents and
dropped messages included) over the stage's wall time once its engine is built (generation, filters
and writing). The table goes to stdout; --out writes every number as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import time
from pathlib import Path

import torch

from specheads.config import load_recipe
from specheads.data.formats import load_prompts
from specheads.data.regenerate import run_regenerate
from specheads.data.synthesize import run_synthesize
from specheads.runtime.chat import render_prompt
from specheads.runtime.engines.static import generate
from specheads.runtime.model import TargetModel
from specheads.target import load_target


def plain_decode(target, batch: int, new_tokens: int, graphs: bool, compile: bool = False) -> dict:
    builtin = load_prompts("builtin:demo_prompts")
    prompts = [render_prompt(target.tokenizer, [{"role": "user", "content": builtin[i % len(builtin)]["turns"][0]}])
               for i in range(batch)]
    engine = TargetModel.from_hf(target.model, max_batch=batch, max_seq=max(map(len, prompts)) + new_tokens + 8)
    if compile:
        engine.compile_layers()
    generate(engine, prompts, min(new_tokens, 8), stop_token_ids=(), use_cuda_graphs=graphs)  # warm-up / capture
    r = generate(engine, prompts, new_tokens, stop_token_ids=(), use_cuda_graphs=graphs)
    tokens = sum(len(t) for t in r.tokens)
    return {"sequences": len(prompts), "tokens": tokens, "seconds": r.elapsed_s, "tokens_per_s": tokens / r.elapsed_s}


def stage_row(run, recipe, target, tokens_key: str, sequences_key: str) -> dict:
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # the stage's one-line report; the table says it all
        s = run(recipe, target=target)
    wall = time.perf_counter() - t0
    return {"sequences": s[sequences_key], "tokens": s[tokens_key], "seconds": s["seconds"],
            "tokens_per_s": s[tokens_key] / s["seconds"] if s["seconds"] else 0.0, "wall_s_with_setup": wall,
            "summary": {k: v for k, v in s.items() if not isinstance(v, (dict, list))}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: bf16 on cuda, fp32 on cpu)")
    ap.add_argument("--target", default="smollm2-135m", help="target to load (default: the bundled SmolLM2 GGUF)")
    ap.add_argument("--batch", default="64", help="batch size of the three rows; several: 64,256")
    ap.add_argument("--prompts", type=int, default=256, help="conversations to regenerate and prompts to synthesize")
    ap.add_argument("--new-tokens", type=int, default=128,
                    help="max new tokens: plain decode, regenerated answers, synthesized messages and documents")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the engine's layers in all three rows (data.*.compile in the stages)")
    ap.add_argument("--refill-at", type=int, default=1,
                    help="continuous batching: free slots gathered before one prefill (data.*.refill_at)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    graphs = a.device == "cuda"  # the stages use CUDA graphs on a GPU; plain decode does the same
    target = load_target(a.target, dtype=dtype, device=a.device)
    batches = [int(b) for b in str(a.batch).split(",")]
    res = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "dtype": dtype,
           "target": a.target, "batches": batches, "prompts": a.prompts, "new_tokens": a.new_tokens,
           "cuda_graphs": graphs, "compiled": a.compile, "refill_at": a.refill_at, "by_batch": {}}
    for batch in batches:
        res["by_batch"][batch] = rows = run_batch(a, target, dtype, batch, graphs)
        print_table(a, res, batch, rows)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=2))
    return res


def _relative(obj, root):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from run_paths import relative  # beside this file

    return relative(obj, root)


def run_batch(a, target, dtype: str, batch: int, graphs: bool) -> dict:
    rows = {"plain decode": plain_decode(target, batch, a.new_tokens, graphs, a.compile)}
    with tempfile.TemporaryDirectory() as tmp:
        common = [f"target.source={a.target}", f"target.dtype={dtype}", f"target.device={a.device}", "seed=0"]
        # the built-in prompts, repeated under new ids when more are asked for than it has
        prompts = load_prompts("builtin:demo_prompts")
        src = Path(tmp, "prompts.jsonl")
        src.write_text("".join(json.dumps({"id": f"{p['id']}#{i // len(prompts)}", "turns": p["turns"],
                                           "category": p["category"]}) + "\n"
                               for i, p in ((i, prompts[i % len(prompts)]) for i in range(a.prompts))))
        regen = load_recipe(None, common + [f"run_dir={tmp}/regen", f"data.sources=[{{path: {src}}}]",
                                            "data.holdout_fraction=0", "data.regenerate.enabled=true",
                                            f"data.regenerate.batch_size={batch}",
                                            f"data.regenerate.compile={str(a.compile).lower()}",
                                            f"data.regenerate.refill_at={a.refill_at}",
                                            f"data.regenerate.max_new_tokens={a.new_tokens}"])
        rows["data regenerate"] = stage_row(run_regenerate, regen, target, "tokens", "conversations")
        synth = load_recipe(None, common + [f"run_dir={tmp}/synth", f"data.synthesize.num_prompts={a.prompts}",
                                            f"data.synthesize.batch_size={batch}",
                                            f"data.synthesize.compile={str(a.compile).lower()}",
                                            f"data.synthesize.refill_at={a.refill_at}",
                                            f"data.synthesize.max_new_tokens={a.new_tokens}",
                                            f"data.synthesize.copy_tasks.document_tokens={a.new_tokens}"])
        rows["data synthesize"] = stage_row(run_synthesize, synth, target, "generated_tokens", "written")
        rows = _relative(rows, tmp)  # the stages' summaries name files in the temporary run directory

    plain = rows["plain decode"]["tokens_per_s"]
    for row in rows.values():
        row["vs_plain"] = row["tokens_per_s"] / plain if plain else 0.0
    return rows


def print_table(a, res: dict, batch: int, rows: dict) -> None:
    print(f"\n### Generation speed, {a.target}, {res['device']}, {res['dtype']}, batch {batch}, "
          f"≤{a.new_tokens} new tokens, CUDA graphs {res['cuda_graphs']}, compiled {res['compiled']}, "
          f"refill at {a.refill_at} free slots\n")
    print("| run | sequences | generated tokens | seconds | tok/s | ÷ plain decode |\n|---|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['sequences']} | {r['tokens']} | {r['seconds']:.1f} | {r['tokens_per_s']:.1f} | "
              f"{r['vs_plain']:.2f} |")
    s = rows["data synthesize"]["summary"]
    print(f"\nsynthesize: {s['written']} prompts written of {s['attempts']} attempts, near-duplicate rate "
          f"{s['near_duplicate_rate']:.1%}, {s['copy_heavy']} copy-heavy")


if __name__ == "__main__":
    main()
