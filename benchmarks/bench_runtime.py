"""Runtime speed: plain decode and speculative decoding with each drafter, side by side,
at several batch sizes, on the real SmolLM2 weights (the bundled GGUF) by default.

    python benchmarks/bench_runtime.py --device cuda --cuda-graphs --batches 1,8,48 --out runs/bench.json
    python benchmarks/bench_runtime.py --device cuda --cuda-graphs --head runs/x/export/speculators --profile
    python benchmarks/bench_runtime.py --device cpu --batches 1 --new-tokens 16
    python benchmarks/bench_runtime.py --device cuda --cuda-graphs --engines eager,compiled --head DIR

Drafters: ``plain`` (no drafting), ``ngram`` (the device proposer on CUDA, the host reference
on a CPU), ``head`` (``--head DIR``: an exported head, any format) and ``hybrid`` (head +
n-gram, ``--min-match``); on request also ``hybrid_fixed`` (without the per-row score), ``suffix``
(suffix decoding, vLLM's defaults: trees on the host, cached responses cleared before each timed run)
and ``hybrid_suffix`` (head + suffix decoding). Greedy, a fixed number of new tokens (no early stop), the same
prompts for every drafter; each run is done once untimed (captures the CUDA graphs of every
shape it meets) and then timed. Per batch and drafter: τ (tokens per target forward, docs/conventions.md),
tokens/s, speedup (tokens/s ÷ plain tokens/s at the same batch) and speedup ÷ τ (1.0 = drafting
is free). ``--engines eager,compiled`` times every row on both engines in one run; the last
column is tokens/s over the first engine's plain decoding. Plain decoding is timed once more after the drafted
rows of each batch ("re-timed after"), and each drafted row's speedup ÷ τ is given against that run too: on the
H200 the graphed steps of whichever kind of step a process captured second ran ~0.12 ms slower (2026-12-04,
BENCHMARKS.md), and the drafted rows always come second. Prints a Markdown table; ``--out`` writes JSON and ``--plot`` (default: the JSON path
with .png) a plot of speedup against batch size per drafter.

``--isolate``: every row in a process of its own (plain included; this script again, one row a call), as a server
runs one kind of decoding: the in-process rows share a process whose graphed steps ran slower once a second kind
had been captured (H200, 2026-12-04). Rows are compared across the processes (speedup, outputs); the Inductor and
Triton caches are shared, so only the first process compiles from scratch.

``--serve N``: serving as well, at every --batches size (concurrency 1 too): the first N prompts of
``--serve-prompts`` (default the mixed eval set, 152 prompts in 7 categories) as a stream of
requests through B slots with continuous batching (``generate_continuous``: a finished request's
slot takes the next one at once, as in a server; stops at EOS), plain and with each drafter (suffix
decoding's trees live on the host and are served between steps, the steps themselves in graphs). A
static batch runs until its slowest row is done, so a drafter's τ there overstates what the batch
gains; served, every row's forwards are its own. Per row: τ (decode tokens per row-step), tok/s
(prefills included), speedup over plain serving, speedup ÷ τ and τ per category.

``--profile``: a torch.profiler table of one plain and one drafted decode step at the first --batches size
(or ``--profile-batch``, one of them: on 2026-12-03 a batch-8 verify step cost 1.75x a plain step against
1.16x at batch 1) on the last --engines engine (without graphs, so the kernels are visible), and the time per
step with and without CUDA graphs; with graphs, also the graphed steps' device timeline (busy against span, the
longest idle gaps between two kernels), and ``--trace PREFIX`` writes their Chrome traces.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from specheads.data.formats import load_prompts
from specheads.data.sources import resolve_source
from specheads.runtime.drafters import NGramDrafter, drafter_for_head, forget_responses, make_drafter
from specheads.runtime.engines.continuous import Request, generate_continuous
from specheads.runtime.engines.static import Generation, generate
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
    "Write a SQL query that returns the ten most recent orders with their customer names.",
    "Describe the water cycle for a ten-year-old.",
    "List the planets of the solar system with one fact about each.",
    "Rewrite this sentence in the passive voice: 'The committee approved the new budget.'",
    "What are the pros and cons of remote work? Use a table.",
    "Write a haiku about autumn, then explain its structure.",
    "Convert 72 degrees Fahrenheit to Celsius and show the steps.",
    "Write a bash one-liner that counts the lines of every .py file in a directory.",
]
# hybrid_fixed: without the per-row score; hybrid_suffix: the head with suffix decoding instead of n-gram
DRAFTERS = ("plain", "ngram", "head", "hybrid", "hybrid_fixed", "suffix", "hybrid_suffix")
HEADED = ("head", "hybrid", "hybrid_fixed", "hybrid_suffix")          # the rows that need --head
# engine name -> torch.compile options for the target's layers and the head's step (None: eager). At batch 1
# a compiled decode step is ~50% cuBLAS GEMMs of ~3.8 us each for ~1.7 MB of weights (launch-latency bound,
# H200 2026-12-01): max-autotune lets Inductor time its own Triton GEMMs against them for these shapes
# (they came within ~5% of cuBLAS, and tuning took minutes on an H200, 2026-12-01).
ENGINES = {"eager": None, "compiled": {}, "compiled_layers": {}, "compiled_eager_inputs": {}, "compiled_as_r3": {},
           "autotune": {"mode": "max-autotune-no-cudagraphs"}}
# An A/B of the compiled parts (H200, 2026-12-01/02: compiling the forward's inputs, a step's bookkeeping and the
# drafters' units each made a step faster). Each engine leaves one more part eager, so neighbouring rows tell which
# part pays:
#   compiled_eager_inputs: the forward's inputs eager;
#   compiled_layers: the inputs and the bookkeeping eager (the target's layers compiled, drafters as "compiled");
#   compiled_as_r3: that, and the drafters' units eager too (the head's call compiled, its first pass and chain,
#   the n-gram match and the hybrid's choice eager)
ENGINE_PARTS = {"compiled_layers": {"inputs": False, "bookkeeping": False},
                "compiled_eager_inputs": {"inputs": False},
                "compiled_as_r3": {"inputs": False, "bookkeeping": False}}
DRAFTER_UNITS = {"compiled_as_r3": False}            # HeadDrafter.compile(units=...): default True

sys.path.insert(0, str(Path(__file__).resolve().parent))  # runtime_profile.py, runtime_report.py beside this file
from runtime_profile import RecompileLimitHits, graph_timeline, kernel_count, sort_key  # noqa: E402
from runtime_report import markdown, plot, table_rows  # noqa: E402


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


def identity(got: list, ref: list) -> dict:
    """Greedy drafted outputs against plain decoding's: ``lossless``, and where they are not identical, how many
    sequences differ and the earliest token where one does (bf16 runs: where a near-tie flipped, see
    print_report)."""
    diff = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), min(len(g), len(r)))
            for g, r in zip(got, ref) if g != r]
    if len(got) != len(ref):
        diff.append(0)
    return {"lossless": not diff, **({"sequences_differing": len(diff), "first_difference": min(diff)} if diff else {})}


def bench_engine(m, prompts, new, repeat=1, warm_up=True, **kw):
    """Untimed run (compiles kernels, captures graphs), then the best of ``repeat`` timed runs, then (CUDA, with
    ``warm_up``) the per-step times of one more run. ``warm_up=False``: the shapes were run before; timed runs only."""
    if warm_up:
        generate(m, prompts, new, stop_token_ids=(), **kw)
    best = None
    for _ in range(repeat):
        forget_responses(kw.get("drafter"))     # suffix decoding: no timed run drafts from an earlier run's answers
        r = generate(m, prompts, new, stop_token_ids=(), **kw)
        if best is None or r.elapsed_s < best.elapsed_s:
            best = r
    toks = sum(len(t) for t in best.tokens)
    s = best.summary()
    # decode_tokens_per_s leaves the prefill out: the steady rate the graphed steps reach
    return {"tokens": toks, "seconds": best.elapsed_s, "tokens_per_s": toks / best.elapsed_s,
            "prefill_s": best.prefill_s,
            "decode_tokens_per_s": (toks - len(prompts)) / max(1e-9, best.elapsed_s - best.prefill_s),
            "tau": s["tau"], "vllm_mean_acceptance_length": s["vllm_mean_acceptance_length"],
            "acceptance_rate": s["acceptance_rate"], "target_forwards": best.target_forwards,
            "graph_stats": best.graph_stats, "outputs": best.tokens,
            **({"step_times": step_times(m, prompts, new, **kw)} if m.device.type == "cuda" and warm_up else {})}


def step_times(m, prompts, new, **kw):
    """One more (untimed) run with CUDA events around every decode step: per attention width, the median
    GPU time of a step and of the device's idle gap before it. The timed rate divided per step mixes the
    two with the run's fixed costs; on the H200 (2026-12-02) a drafted cycle came out ~0.14 ms longer in
    the timed runs than in the profile's early steps while a plain step did not, and this tells whether
    the kernels grow with the context or the device waits for the host."""
    forget_responses(kw.get("drafter"))
    gen = Generation(m, prompts, new, stop_token_ids=(), **kw)
    gen.prefill()
    marks = []
    launch, host_step = gen._launch, gen._host_step
    ends = []

    def timed():
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        launch()                      # the step, then the drafter's host work (suffix decoding), timed apart
        marks.append((gen.kv_len, start, ends.pop()))

    def step_end_then_host_step():
        end = torch.cuda.Event(enable_timing=True)
        end.record()                  # the step's end: a drafter's host work counts as the gap before the next
        ends.append(end)
        host_step()

    gen._launch, gen._host_step = timed, step_end_then_host_step
    gen.run()
    torch.cuda.synchronize()
    by = {}
    for i, (kv, start, end) in enumerate(marks):
        d = by.setdefault(kv, {"step": [], "gap": []})
        d["step"].append(start.elapsed_time(end))
        if i:
            d["gap"].append(marks[i - 1][2].elapsed_time(start))
    return {str(kv): {"steps": len(d["step"]), "step_ms": statistics.median(d["step"]),
                      "gap_ms": statistics.median(d["gap"]) if d["gap"] else 0.0} for kv, d in sorted(by.items())}


def serve_prompts(tok, source, n):
    """The first ``n`` prompts of a prompt file (first user turn, chat template applied) with their
    categories: the request stream of the serving rows."""
    out = []
    for it in load_prompts(resolve_source(source))[:n]:
        msgs = ([{"role": "system", "content": it["system"]}] if it.get("system") else []) + \
            [{"role": "user", "content": it["turns"][0]}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        out.append((list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids), it.get("category") or "uncategorised"))
    return out


def serve_stream(m, stream, B, new, **kw):
    """``stream`` [(prompt ids, category)] through B slots with continuous batching, once: the counts,
    each request's tokens in stream order, and the finished requests."""
    got, reqs = {}, [Request(p, new, tag=i) for i, (p, _) in enumerate(stream)]
    st = generate_continuous(m, reqs, lambda r, toks, why: got.__setitem__(r.tag, toks), batch_size=B, **kw)
    return st, [got[i] for i in range(len(reqs))], reqs


def bench_serving(m, stream, B, new, repeat=1, **kw):
    """``serve_stream``: one untimed run (captures the step graphs of every width), then the best of
    ``repeat``."""
    serve_stream(m, stream, B, new, **kw)
    best = None
    for _ in range(repeat):
        forget_responses(kw.get("drafter"))     # suffix decoding: no timed run drafts from an earlier run's answers
        run = serve_stream(m, stream, B, new, **kw)
        if best is None or run[0]["seconds"] < best[0]["seconds"]:
            best = run
    st, outputs, reqs = best
    by: dict = {}
    for r, (_, cat) in zip(reqs, stream):
        d = by.setdefault(cat, [0, 0])
        d[0] += len(outputs[r.tag]) - 1
        d[1] += r.target_forwards
    return {"requests": len(stream), "tokens": st["tokens"], "seconds": st["seconds"],
            "tokens_per_s": st["tokens"] / st["seconds"], "tau": st["tau"], "steps": st["steps"],
            "prefills": st["prefills"], "syncs": st["syncs"], "replayed": st.get("replayed", 0),
            "tau_by_category": {c: t / f if f else 0.0 for c, (t, f) in sorted(by.items())}, "outputs": outputs}


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


def load_head(path, tgt, m):
    """An exported head made whole for (and checked against) the target, as the eval stage loads it."""
    if hasattr(tgt, "identity"):
        from specheads.formats.convert import load_head_for
        head, _meta = load_head_for(path, tgt)
    else:                                                          # random weights: no identity to check
        from specheads.formats import load_any
        head, _meta, _fmt = load_any(path)
        emb = getattr(head, "embed_tokens", None)
        if emb is not None and not bool(emb.weight.any()):
            emb.weight.data.copy_(tgt.embed_tokens.weight.to(emb.weight))
    head = head.to(device=m.device, dtype=m.dtype).eval()
    return drafter_for_head(head, name=Path(path).name, target_vocab_size=m.args.vocab_size)


def random_head(tgt, m, draft_vocab: int = 32000):
    """An untrained EAGLE-3 head for the target (its embedding and the lm_head rows of the first ``draft_vocab``
    ids, the default aux layers): what a drafted step costs does not depend on what the head learned."""
    from specheads.heads import HeadConfig, build_head
    from specheads.layer_ids import default_eagle3_layer_ids
    cfg = tgt.model.config
    vd = min(draft_vocab, cfg.vocab_size)
    # the EAGLE-3 default layers ([2, 15, 27] for SmolLM2), without repeats on a target of a few layers
    aux = sorted(set(default_eagle3_layer_ids(cfg.num_hidden_layers)))
    hc = HeadConfig.from_target_config(cfg, "eagle3", draft_vocab_size=vd, aux_layer_ids=aux)
    torch.manual_seed(0)
    head = build_head(hc)
    head.init_from_target(tgt.model.get_input_embeddings().weight.detach().float().cpu(),
                          tgt.model.get_output_embeddings().weight.detach().float().cpu(),
                          d2t=torch.zeros(vd, dtype=torch.long) if vd < cfg.vocab_size else None)
    head = head.to(device=m.device, dtype=m.dtype).eval()
    return drafter_for_head(head, name="random eagle3", target_vocab_size=m.args.vocab_size)


# ------------------------------------------------------------------------------ profile
def profile_steps(m, prompts, drafters, k, graphs, dev, steps=10, skip=0, trace=None):
    """Per drafter: ms per decode step of ``prompts`` as one batch (eager and graphed) and a profiler
    table of one eager step; ``skip`` more steps run first, so the timed ones attend over a longer
    context (the tail of a 128-token run reads the 256-slot attention width, its start 128). Graphed, the
    steps are profiled once more (``graph_timeline``; ``trace``: a path prefix for their Chrome traces)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    out = {}
    for name, d in drafters:
        row = {}
        for mode in ([False, True] if graphs else [False]):
            # never finishes: warm-up, the timed steps and (graphed) the profiled ones, each at most k + 1 tokens
            runs = 2 * steps if mode else steps
            new = min((runs + skip + 6) * (k + 1), m.max_seq - max(map(len, prompts)) - k - 2)
            gen = Generation(m, prompts, new, drafter=d, k=k, stop_token_ids=(), use_cuda_graphs=mode)
            gen.prefill()
            gen.run(max_steps=3 + skip)                # warm-up: kernels compiled, graphs captured
            sync(dev)
            t0, n0 = time.perf_counter(), gen.t
            gen.run(max_steps=steps)
            sync(dev)
            ms = 1e3 * (time.perf_counter() - t0) / max(gen.t - n0, 1)
            row["graphs_ms_per_step" if mode else "eager_ms_per_step"] = ms
            if mode and dev.type == "cuda":
                n1 = gen.t
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    gen.run(max_steps=steps)
                    sync(dev)
                row.update(graph_timeline(prof, max(gen.t - n1, 1),
                                          f"{trace}_{name.split()[0]}.json" if trace else None))
            if not mode:
                with profile(activities=acts) as prof:
                    gen.run(max_steps=1)
                    sync(dev)
                try:
                    table = prof.key_averages().table(sort_by=sort_key(dev), row_limit=40)
                except (KeyError, AttributeError, ValueError):
                    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40)
                row["table"] = table
                row.update(kernel_count(prof))
        out[name] = row
    return out


# ------------------------------------------------------------------------------ output
def isolated(a, batches, wanted) -> dict:
    """--isolate: each (engine, batch, row) timed by this script in a process of its own, then tabled as one run."""
    child = [sys.executable, str(Path(__file__).resolve()), "--device", a.device, "--target", a.target,
             "--new-tokens", str(a.new_tokens), "--k", str(a.k), "--min-match", str(a.min_match),
             "--repeat", str(a.repeat)]
    for flag, on in (("--cuda-graphs", a.cuda_graphs), ("--random-weights", a.random_weights),
                     ("--random-head", a.random_head)):
        child += [flag] if on else []
    child += ["--dtype", a.dtype] if a.dtype else []
    child += ["--head", a.head] if a.head else []
    res, reference = None, {}
    with tempfile.TemporaryDirectory() as tmp:
        for eng in [e.strip() for e in a.engines.split(",") if e.strip()]:
            for B in batches:
                t0 = time.perf_counter()
                rows = []
                for name in ["plain"] + [w for w in wanted if w != "plain"]:
                    out = Path(tmp) / f"{eng}_{B}_{name}.json"
                    cmd = child + ["--engines", eng, "--batches", str(B), "--drafters", name,
                                   "--isolated-row", name, "--out", str(out)]
                    done = subprocess.run(cmd)
                    if done.returncode:
                        raise SystemExit(f"--isolate: the {name} row ({eng}, batch {B}) failed "
                                         f"(exit {done.returncode}): {' '.join(cmd)}")
                    got = json.loads(out.read_text())
                    if "row" not in got:               # head/hybrid without a head: the row does not exist
                        continue
                    r = got.pop("row")
                    res = res or {**got, "engines": [], "rows": [], "hf": {}, "isolated": True}
                    rows.append((r.pop("drafter"), r))
                base = rows[0][1]
                base.update(identity(base["outputs"], reference.setdefault(B, base["outputs"])))
                for _name, r in rows[1:]:
                    r.update(identity(r["outputs"], base["outputs"]))
                res["rows"] += table_rows(eng, B, rows)
                res["engines"] = list(dict.fromkeys(res["engines"] + [eng]))
                print(f"{eng} engine, batch {B} done ({time.perf_counter() - t0:.0f} s, {len(rows)} processes)",
                      flush=True)
    print()
    print(markdown(res))
    lossy = [(r["engine"], r["batch"], r["drafter"]) for r in res["rows"] if r.get("lossless") is False]
    print(f"\ngreedy outputs identical to plain decoding: {'all rows' if not lossy else f'NOT for {lossy}'}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=2))
    plot_path = a.plot or (str(Path(a.out).with_suffix(".png")) if a.out else None)
    if plot_path and res["rows"]:
        plot(res, plot_path)
    return res


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked before anything loads; adds the parsed lists (batch_sizes, wanted, engine_names,
    harvests) to the namespace."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: bf16 on cuda, fp32 on cpu)")
    ap.add_argument("--target", default="smollm2-135m", help="target to load (default: the bundled SmolLM2 GGUF)")
    ap.add_argument("--cuda-graphs", action="store_true")
    ap.add_argument("--batches", default="1,8,48")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--head", default=None, help="exported head directory (enables the head and hybrid rows)")
    ap.add_argument("--min-match", type=int, default=3, help="hybrid: shortest n-gram match that wins over the head")
    ap.add_argument("--drafters", default=",".join(DRAFTERS[:4]),
                    help=f"comma list of {DRAFTERS} (head/hybrid* need --head)")
    ap.add_argument("--engines", default="eager",
                    help="comma list of " + ",".join(ENGINES) + ": compiled = torch.compile'd engine layers, "
                         "forward inputs, step bookkeeping and drafter units (TargetModel.compile_layers, "
                         "HeadDrafter.compile); compiled_layers = the same with the forward's inputs and the "
                         "bookkeeping eager; compiled_eager_inputs = only the inputs eager; autotune = compiled "
                         "with Inductor's max-autotune GEMM search; all timed in the same run")
    ap.add_argument("--repeat", type=int, default=1, help="timed runs per row (the fastest counts)")
    ap.add_argument("--hf", action="store_true", help="also time Hugging Face generate (plain)")
    ap.add_argument("--profile", action="store_true", help="profile one plain and one drafted step at the first --batches size (last engine)")
    ap.add_argument("--profile-only", action="store_true", help="only the profile (no table)")
    ap.add_argument("--profile-all", action="store_true", help="profile every drafter, not only the last one")
    ap.add_argument("--profile-batch", type=int, default=None,
                    help="the batch size of the profiled steps (default: the first --batches size)")
    ap.add_argument("--trace", default=None, metavar="PREFIX",
                    help="with --profile and --cuda-graphs: Chrome traces of the graphed steps, PREFIX_<drafter>.json")
    ap.add_argument("--profile-skip", type=int, default=0,
                    help="decode steps run before the profiled ones (a longer context; needs --new-tokens to fit)")
    ap.add_argument("--serve", type=int, default=0, metavar="N",
                    help="also serve N requests with continuous batching at every --batches size")
    ap.add_argument("--serve-prompts", default="builtin:eval_mixed", help="the served prompts (any prompt file)")
    ap.add_argument("--serve-sync-every", type=int, default=4, help="serving: decode steps between host reads")
    ap.add_argument("--serve-harvest", default="sync",
                    help="serving: 'pipelined' (read a snapshot one block behind), 'sync' (read the live state), "
                         "or both, comma-separated")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--plot", default=None, help="PNG of speedup against batch size (default: --out with .png)")
    ap.add_argument("--random-weights", action="store_true",
                    help="SmolLM2-135M architecture with random weights and random prompts (no GGUF needed; "
                         "speed only; acceptance figures are meaningless)")
    ap.add_argument("--isolate", action="store_true",
                    help="every row (plain included) in a process of its own; no profile or serving with it")
    ap.add_argument("--isolated-row", default=None, help=argparse.SUPPRESS)   # a child of --isolate: one row
    ap.add_argument("--random-head", action="store_true",
                    help="an untrained EAGLE-3 head for the head and hybrid rows instead of --head (step costs only: "
                         "with --random-weights, the batch-8 verify A/B of 2026-12-03 needs no file at all)")
    a = ap.parse_args(argv)
    if a.head and a.random_head:
        ap.error("--head and --random-head: pick one")
    a.batch_sizes = [int(b) for b in a.batches.split(",")]
    a.wanted = [d.strip() for d in a.drafters.split(",") if d.strip()]
    bad = [d for d in a.wanted if d not in DRAFTERS]
    if bad:
        ap.error(f"unknown drafters {bad}; choose from {DRAFTERS}")
    if a.isolate and (a.profile or a.profile_only or a.profile_all or a.serve or a.hf):
        ap.error("--isolate times the static rows only: no --profile, --serve or --hf with it")
    if a.isolated_row:
        a.wanted = [] if a.isolated_row == "plain" else [a.isolated_row]
    if a.profile_batch is not None and a.profile_batch not in a.batch_sizes:
        ap.error(f"--profile-batch {a.profile_batch} must be one of --batches {a.batch_sizes}")
    if a.serve and a.random_weights:
        ap.error("--serve needs the real target (its tokenizer and chat template)")
    a.harvests = [h.strip() for h in a.serve_harvest.split(",") if h.strip()]
    if not a.harvests or set(a.harvests) - {"pipelined", "sync"}:
        ap.error(f"--serve-harvest: pipelined, sync or both, comma-separated; got {a.serve_harvest!r}")
    a.engine_names = [e.strip() for e in a.engines.split(",") if e.strip()]
    if not a.engine_names or set(a.engine_names) - set(ENGINES):
        ap.error(f"--engines: a comma list of {','.join(ENGINES)}; got {a.engines!r}")
    return a


def load_inputs(a, dtype: str):
    """The target, the static batch's prompts (the largest batch's worth), the target's name and the served
    request stream (empty without --serve)."""
    n = max(a.batch_sizes)
    if a.random_weights:
        tgt = random_smollm2(dtype, a.device)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 49152, (40 + 7 * (i % 8),), generator=g).tolist() for i in range(n)]
        target_name = "SmolLM2-135M (random weights)"
    else:
        tgt = load_target(a.target, dtype=dtype, device=a.device)
        prompts = prompts_for(tgt.tokenizer, n)
        target_name = getattr(tgt, "name", a.target)
    stream = serve_prompts(tgt.tokenizer, a.serve_prompts, a.serve) if a.serve else []
    return tgt, prompts, target_name, stream


def make_drafters(a, eng: str, head, units: bool) -> list:
    """(name, factory) per wanted drafter of one engine: a fresh drafter per batch (so suffix decoding starts
    with no cached responses); factory(serve=True): its n-gram side on the device on a CPU too (continuous
    batching needs row state per request; the host n-gram reference keeps none)."""
    kw_eng = ENGINES[eng]
    drafters = []
    for name in a.wanted:
        if name == "ngram":                                  # 1..4, the eval default
            def ngram(serve=False, kw=kw_eng, units=units):
                d = NGramDrafter(backend="device" if serve else "auto")
                return d if kw is None or not units else d.compile(**kw)
            drafters.append(("ngram", ngram))
        elif name == "suffix":
            drafters.append(("suffix", lambda serve=False: make_drafter("suffix")))
        elif name in HEADED and head is not None:
            if name == "head":
                drafters.append((f"head ({head.cfg.kind})", lambda serve=False, h=head: h))
            else:
                # compiled: the n-gram side and the choice too (the head's units already are)
                def hybrid(serve=False, h=head, kw=kw_eng, ad=name != "hybrid_fixed", units=units,
                           free="suffix" if name == "hybrid_suffix" else "ngram"):
                    d = make_drafter("hybrid", h, min_match=a.min_match, adaptive=ad, free=free,
                                     ngram_backend="device" if serve else "auto")
                    return d if kw is None else d.compile(units=units, **kw)
                label = {"hybrid": "hybrid", "hybrid_fixed": "hybrid fixed", "hybrid_suffix": "hybrid suffix"}[name]
                drafters.append((f"{label} (min_match {a.min_match})", hybrid))
    return drafters


def build_engines(a, tgt, max_seq: int) -> dict:
    """engine name -> (TargetModel, [(drafter name, factory)]), each engine with its own model and head."""
    engines = {}
    for eng in a.engine_names:
        m = TargetModel.from_hf(tgt.model, max_batch=max(a.batch_sizes), max_seq=max_seq)
        needs_head = any(w in HEADED for w in a.wanted)
        head = (load_head(a.head, tgt, m) if a.head else random_head(tgt, m) if a.random_head else None) \
            if needs_head else None
        units = DRAFTER_UNITS.get(eng, True)
        if ENGINES[eng] is not None:
            m.compile_layers(**ENGINE_PARTS.get(eng, {}), **ENGINES[eng])
            head = head.compile(units=units, **ENGINES[eng]) if head is not None else None
        engines[eng] = (m, make_drafters(a, eng, head, units))
    return engines


def isolated_row(a, engines, prompts, graphs, res, save) -> dict:
    """A child of --isolate: one row, outputs included, for the parent to compare."""
    (m, drafters), = engines.values()
    B, = a.batch_sizes
    if a.isolated_row != "plain" and not drafters:  # head or hybrid without --head: no such row
        save()
        return res
    name, make = ("plain", None) if a.isolated_row == "plain" else drafters[0]
    kw = dict(drafter=make(), k=a.k) if make else {}
    res["row"] = {"drafter": name, **bench_engine(m, prompts[:B], a.new_tokens, a.repeat, use_cuda_graphs=graphs, **kw)}
    save()
    return res


def bench_static(a, engines, tgt, prompts, graphs, dev, res, save) -> None:
    """The static-batch rows: per engine and batch, plain, every drafter, then plain again."""
    reference = {}                            # batch -> the first engine's plain outputs
    for eng, (m, drafters) in engines.items():
        for B in a.batch_sizes:
            t0 = time.perf_counter()
            base = bench_engine(m, prompts[:B], a.new_tokens, a.repeat, use_cuda_graphs=graphs)
            base.update(identity(base["outputs"], reference.setdefault(B, base["outputs"])))
            rows = [("plain", base)]
            for name, make in drafters:
                r = bench_engine(m, prompts[:B], a.new_tokens, a.repeat, drafter=make(), k=a.k,
                                 use_cuda_graphs=graphs)
                r.update(identity(r["outputs"], base["outputs"]))
                rows.append((name, r))
            # plain once more, after the drafted rows: on the H200 (2026-12-04) every graphed step of a process
            # ran ~0.12 ms slower once a second kind of step had been captured, plain or drafted, whichever came
            # first; the drafted rows always come second, so their speedup is also given against this run
            after = (bench_engine(m, prompts[:B], a.new_tokens, a.repeat, warm_up=False, use_cuda_graphs=graphs)
                     if drafters else base)
            res["rows"] += table_rows(eng, B, rows, after)
            if a.hf and eng == a.engine_names[0]:
                res["hf"][str(B)] = bench_hf(tgt.model, tgt.tokenizer, prompts[:B], a.new_tokens, dev)
            print(f"{eng} engine, batch {B} done ({time.perf_counter() - t0:.0f} s with warm-up and "
                  f"compilation)", flush=True)
            save()                    # what is measured so far survives a run cut short by a time limit


def bench_serve(a, engines, stream, graphs, res, save) -> None:
    """--serve: the request stream through B slots with continuous batching, plain and with each drafter."""
    res["serve_prompts"], res["serving"] = a.serve_prompts, []
    for eng, (m, drafters) in engines.items():
        for B, harvest in [(b, h) for b in a.batch_sizes for h in a.harvests]:
            t0 = time.perf_counter()
            # refills gathered: a prefill is one eager forward, dearer than the idle slots it saves
            kw = dict(use_cuda_graphs=graphs, sync_every=a.serve_sync_every, refill_at=max(1, B // 8),
                      pipeline_harvest=harvest == "pipelined")
            base = bench_serving(m, stream, B, a.new_tokens, a.repeat, **kw)
            rows = [("plain", base)]
            for name, make in drafters:
                d = make(serve=True)
                rows.append((name, bench_serving(m, stream, B, a.new_tokens, a.repeat, drafter=d, k=a.k, **kw)))
            for name, r in rows:
                sp = r["tokens_per_s"] / base["tokens_per_s"]
                res["serving"].append({"engine": eng, "batch": B, "harvest": harvest, "drafter": name, "speedup": sp,
                                       "speedup_over_tau": sp / r["tau"], "plain_tokens_per_s": base["tokens_per_s"],
                                       **identity(r["outputs"], base["outputs"]),
                                       **{k: v for k, v in r.items() if k != "outputs"}})
            print(f"{eng} engine, serving at {B} slots ({harvest} harvest) done ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
            save()


def print_report(a, res, limit_hits, dtype: str) -> None:
    print()
    print(markdown(res))
    if any(ENGINES[e] is not None for e in a.engine_names):
        print(f"\ntorch.compile recompile limit hit {len(limit_hits.hits)} time(s)"
              + (f" ({'; '.join(limit_hits.hits)}): those shapes ran eagerly" if limit_hits.hits else ""))
    lossy = [(r["engine"], r["batch"], r["drafter"]) for r in res["rows"] + res.get("serving", [])
             if r.get("lossless") is False]
    # static rows: against the first engine's plain batch; serving rows: against plain serving through the same
    # slots and harvest (whose batches differ from the drafted run's: bf16 kernels that are not batch-invariant
    # can flip near-ties there)
    print(f"\ngreedy outputs identical to plain decoding: {'all rows' if not lossy else f'NOT for {lossy}'}"
          + (" (bf16: batch-variant kernels can flip near-ties; fp32 rows are exact)" if lossy and dtype == "bfloat16"
             else ""))


def run_profile(a, engines, prompts, graphs, dev, res) -> None:
    """--profile: one plain and one (or, --profile-all, every) drafted step on the last engine, printed."""
    m, drafters = engines[a.engine_names[-1]]              # the last engine: the one under study
    chosen = [("plain", None)]
    # the last requested drafter (hybrid > head > ngram), or every one with --profile-all
    for name, make in (drafters if a.profile_all else drafters[::-1][:1]):
        chosen.append((name, make()))
    pb = a.profile_batch or a.batch_sizes[0]
    prof = profile_steps(m, prompts[:pb], chosen, a.k, graphs, dev, skip=a.profile_skip, trace=a.trace)
    res["profile_skip"], res["profile_batch"] = a.profile_skip, pb
    res["profile"] = {n: {k: v for k, v in r.items() if k != "table"} for n, r in prof.items()}
    for name, r in prof.items():
        times = ", ".join(f"{k.replace('_ms_per_step', '')} {v:.2f} ms/step" for k, v in r.items()
                          if k.endswith("_ms_per_step"))
        if "kernels_per_step" in r:
            times += f"; {r['kernels_per_step']} kernels, {r['kernel_us_per_step']:.0f} µs of them"
        print(f"\n### Profile: one {name} decode step, batch {pb} ({times})\n")
        print(r["table"])
        if "graph_span_us_per_step" in r:
            print(f"\nGraphed: {r['graph_kernels_per_step']:.0f} device ops a step, busy "
                  f"{r['graph_busy_us_per_step']:.0f} µs of a {r['graph_span_us_per_step']:.0f} µs span; "
                  "the longest gaps (µs a step):\n")
            for g in r["graph_gaps"]:
                print(f"- {g['us_per_step']:.1f} ({g['count']} gaps): {g['between']}")


def main(argv=None):
    a = parse_args(argv)
    if a.isolate:
        return isolated(a, a.batch_sizes, a.wanted)
    dev = torch.device(a.device)
    dtype = a.dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    tgt, prompts, target_name, stream = load_inputs(a, dtype)
    max_seq = max(len(p) for p in prompts + [p for p, _ in stream]) + a.new_tokens + a.k + 64
    graphs = a.cuda_graphs and dev.type == "cuda"
    engines = build_engines(a, tgt, max_seq)
    res = {"target": target_name, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
           "dtype": dtype, "cuda_graphs": graphs, "new_tokens": a.new_tokens, "k": a.k,
           "head": a.head or ("random (untrained)" if a.random_head else None),
           "min_match": a.min_match, "torch": torch.__version__, "engines": a.engine_names, "rows": [], "hf": {},
           # decode attention: "triton" (kernels.decode_attention) or "torch" (SDPA; SPECHEADS_KERNELS=torch)
           "attention": next(iter(engines.values()))[0].layers[0].attn_backend}

    def save():
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(res, indent=2))

    if a.isolated_row:
        return isolated_row(a, engines, prompts, graphs, res, save)
    if not a.profile_only:
        limit_hits = RecompileLimitHits()
        bench_static(a, engines, tgt, prompts, graphs, dev, res, save)
        if stream:
            bench_serve(a, engines, stream, graphs, res, save)
        res["recompile_limit_hits"] = limit_hits.detach()
        print_report(a, res, limit_hits, dtype)
    if a.profile or a.profile_only or a.profile_all:
        run_profile(a, engines, prompts, graphs, dev, res)
    save()
    plot_path = a.plot or (str(Path(a.out).with_suffix(".png")) if a.out else None)
    if plot_path and res["rows"]:
        plot(res, plot_path)
    return res


if __name__ == "__main__":
    main()
