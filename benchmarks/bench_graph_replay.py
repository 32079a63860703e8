"""Does a CUDA graph replay slower once a process holds more graphs? (issue 14; H200, 2026-12-04)

    python benchmarks/bench_graph_replay.py --graphs 8 --out runs/graph_replay.json

On the H200 the graphed decode steps of a process ran ~0.12 ms (~13%) slower once a second kind of step had been
captured, graphs captured earlier included, with the kernels as fast as before and the extra time idle between them
(BENCHMARKS.md, eleventh sitting; results/h200_session_2026-12-04_r11/graph_order/). This isolates the question
from the runtime: one "step" of ``--layers`` blocks shaped like a SmolLM2 layer (four bf16 projections of the
layer's shapes, a norm, a SiLU-gate, residual adds: ~12 small kernels a block) is captured as graph 0 and timed,
then ``--graphs`` more graphs of the same step, each on its own weights, are captured one by one; after each
capture graph 0 and the newest graph are timed again (CUDA events around ``--reps`` back-to-back replays, median
of ``--trials``). ``--compile``: each block through ``torch.compile`` (Inductor's Triton kernels for the norms and
the elementwise work, as in the runtime's layers), and with ``--new-kernels`` each new graph at one more row, so
that it compiles and loads kernels of its own (the runtime's second kind of step did). If graph 0's replay time
grows with the number of graphs held, the runtime should hold fewer step graphs (one per batch shape rather than
one per attention width as well); if it grows only with ``--new-kernels``, with the kernels loaded.
``--no-capture`` is the control: the same new steps are built and run once (their kernels compiled and loaded)
but not captured, so graph 0 is the only graph; if graph 0 still slows down, neither the graphs held nor the
capture are the cause, and what is left is the kernels loaded or the time the process has run. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specheads.runtime.model import allow_recompiles  # noqa: E402


H, I, QKV = 576, 1536, 960                   # SmolLM2's hidden size, MLP width, q+k+v width


def block(h, norm, wqkv, wo, wgu, wd):
    a = F.rms_norm(h, (H,), norm, 1e-5)
    qkv = F.linear(a, wqkv)
    h = h + F.linear(qkv[:, :H].contiguous(), wo)
    a = F.rms_norm(h, (H,), norm, 1e-5)
    gate, up = F.linear(a, wgu).chunk(2, -1)
    return h + F.linear(F.silu(gate) * up, wd)


def make_step(layers: int, rows: int, device, fn=block):
    """A step function of ``layers`` blocks with weights of their own, and its static input."""
    ws = [[torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for n, k in
           ((QKV, H), (H, H), (2 * I, H), (H, I))] for _ in range(layers)]
    norm = torch.ones(H, device=device, dtype=torch.bfloat16)
    x = torch.randn(rows, H, device=device, dtype=torch.bfloat16)

    def step():
        h = x
        for w in ws:
            h = fn(h, norm, *w)
        return h

    return step


def capture(step, pool):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        step()
    return g


def replay_us(g, reps: int, trials: int) -> float:
    times = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graphs", type=int, default=8, help="graphs captured after graph 0")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rows", type=int, default=1, help="rows of the step's input (batch x new tokens)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--shared-pool", action="store_true", help="one memory pool for every graph, as the runtime does")
    ap.add_argument("--compile", action="store_true", help="the blocks through torch.compile (Triton kernels)")
    ap.add_argument("--new-kernels", action="store_true", help="with --compile: graph i at rows + i (kernels of its own)")
    ap.add_argument("--no-capture", action="store_true",
                    help="control: the new steps run once eagerly instead of being captured (graph 0 the only graph)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (CUDA graphs)")
    if a.new_kernels and not a.compile:
        ap.error("--new-kernels needs --compile")
    dev = torch.device("cuda")
    pool = torch.cuda.graph_pool_handle() if a.shared_pool else None
    fn = block
    if a.compile:
        allow_recompiles(4 * (a.graphs + 1))
        fn = torch.compile(block, dynamic=False)
    steps = [make_step(a.layers, a.rows, dev, fn)]
    graphs = [capture(steps[0], pool)]
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": a.layers, "rows": a.rows,
           "shared_pool": a.shared_pool, "compile": a.compile, "new_kernels": a.new_kernels,
           "no_capture": a.no_capture,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows_timed": []}
    print("| steps built | graphs held | graph 0 µs / replay | newest graph µs / replay |\n|---:|---:|---:|---:|")
    for n in range(a.graphs + 1):
        if n:
            steps.append(make_step(a.layers, a.rows + (n if a.new_kernels else 0), dev, fn))
            if a.no_capture:
                steps[-1]()
                torch.cuda.synchronize()
            else:
                graphs.append(capture(steps[-1], pool))
        first, newest = replay_us(graphs[0], a.reps, a.trials), replay_us(graphs[-1], a.reps, a.trials)
        res["rows_timed"].append({"steps": n + 1, "graphs": len(graphs), "graph0_us": first, "newest_us": newest})
        print(f"| {n + 1} | {len(graphs)} | {first:.1f} | {newest:.1f} |", flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
