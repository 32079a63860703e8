"""Runtime on a GPU: CUDA-graph steps give the same tokens as eager steps, whole speculative steps
are captured (no host sync inside), the device n-gram proposer equals the host reference, and
shapes that were not captured (a larger k, another tree, a wider attention) capture anew.
Skipped without CUDA."""

import pytest
import torch

from specheads.runtime.drafters import (Eagle3Drafter, HybridDrafter, NGramDrafter, SuffixDrafter, drafter_for_head,
                                        forget_responses, make_drafter, ngram_match)
from specheads.runtime.engines.continuous import Request, generate_continuous
from specheads.runtime.engines.static import Generation, generate
from specheads.runtime.model import TargetModel
from specheads.runtime.tree import TreeConfig

from test_runtime import PROMPTS, V, _head, tiny  # tests/ is on sys.path (rootdir conftest)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

REPETITIVE = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]


@pytest.fixture(scope="module")
def cuda_llama():
    hf = tiny("llama").cuda()
    return hf, TargetModel.from_hf(hf, max_batch=4, max_seq=160)


def test_cuda_logits_match_hf(cuda_llama):
    hf, m = cuda_llama
    ids = torch.randint(0, V, (2, 12), device="cuda")
    with torch.no_grad():
        ref = hf(ids).logits
    m.reset()
    torch.testing.assert_close(m(ids).logits, ref, atol=2e-4, rtol=2e-4)


def _kw(mode):
    kw = {"stop_token_ids": ()}
    sampled = dict(temperature=0.8, top_k=20, seed=3)
    if mode == "ngram_host":
        kw.update(drafter=NGramDrafter(1, 3, backend="host"), k=3)
    elif mode == "ngram":
        kw.update(drafter=NGramDrafter(1, 3), k=3)                       # auto = the device proposer on CUDA
    elif mode.startswith("eagle3"):
        kw.update(drafter=Eagle3Drafter(_head("eagle3", 48).cuda()))
        kw.update(tree=TreeConfig(3, 2, 5)) if "tree" in mode else kw.update(k=3)
        if mode == "eagle3_rejection":
            kw.update(rule="rejection", **sampled)
        if mode == "eagle3_tree_sampled":
            kw.update(rule="tree_target_only", **sampled)
    elif mode in ("eagle1", "mtp"):
        kw.update(drafter=drafter_for_head(_head(mode).cuda()), k=2)
    elif mode == "hybrid":
        kw.update(drafter=make_drafter("hybrid", _head("eagle3", 48).cuda(), min_match=2), k=3)
    elif mode == "suffix":          # no cache of responses: every run drafts alike
        kw.update(drafter=SuffixDrafter(max_cached_requests=0), k=3)
    elif mode == "hybrid_suffix":
        kw.update(drafter=HybridDrafter(Eagle3Drafter(_head("eagle3", 48).cuda()), SuffixDrafter(max_cached_requests=0),
                                        min_match=2), k=3)
    elif mode == "sampled":
        kw.update(drafter=NGramDrafter(1, 3), k=3, rule="onehot", **sampled)
    elif mode == "plain_sampled":
        kw.update(rule="onehot", **sampled)
    return kw


MODES = ["plain", "plain_sampled", "ngram", "ngram_host", "eagle3", "eagle3_tree", "eagle3_rejection",
         "eagle3_tree_sampled", "eagle1", "mtp", "hybrid", "sampled", "suffix", "hybrid_suffix"]


@pytest.mark.parametrize("mode", MODES)
def test_cuda_graphs_match_eager(cuda_llama, mode):
    _, m = cuda_llama
    kw = _kw(mode)
    prompts = PROMPTS + [REPETITIVE]
    eager = generate(m, prompts, 20, **kw)
    graphed = generate(m, prompts, 20, use_cuda_graphs=True, **kw)
    again = generate(m, prompts, 20, use_cuda_graphs=True, **kw)        # replays the captured graphs
    assert graphed.tokens == eager.tokens
    assert again.tokens == eager.tokens
    assert [r.as_dict() for r in graphed.records] == [r.as_dict() for r in eager.records]
    st, st2 = graphed.graph_stats, again.graph_stats
    assert st["failed"] == 0 and st2["failed"] == 0, (st, st2)
    if mode != "ngram_host":                                   # whole steps in graphs
        assert st2["captured"] == 0 and st2["replayed"] >= again.target_forwards - 1, st2
        assert st2["eager"] == 0, st2
    if "sampled" not in mode and "rejection" not in mode:
        assert eager.tokens == generate(m, prompts, 20, stop_token_ids=()).tokens


@pytest.mark.parametrize("mode", ["plain", "ngram", "eagle3", "eagle3_tree", "eagle3_rejection", "hybrid", "mtp",
                                  "suffix", "hybrid_suffix"])
def test_eager_steps_never_sync(cuda_llama, mode):
    """torch's sync debug mode raises on any host sync inside a step (what capture needs); suffix
    decoding's trees are served between steps (host_step), outside it."""
    _, m = cuda_llama
    gen = Generation(m, PROMPTS, 12, **_kw(mode))
    gen.prefill()
    step = gen.step

    def checked():
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")

    gen.step = checked
    gen.run()
    r = gen.result()
    assert r.tokens == generate(m, PROMPTS, 12, **_kw(mode)).tokens


def test_device_ngram_equals_host_on_cuda():
    g = torch.Generator().manual_seed(0)
    hist = [torch.randint(0, v, (int(torch.randint(2, 90, (1,), generator=g)),), generator=g).tolist()
            for v in (3, 5, 9, 40) for _ in range(12)]
    toks = torch.randint(0, 100, (len(hist), 96))
    for b, h in enumerate(hist):
        toks[b, :len(h)] = torch.tensor(h)
    lens = torch.tensor([len(h) for h in hist])
    for occ in ("latest", "earliest"):
        ref = NGramDrafter(1, 4, occ, backend="host")
        d, n, ml = ngram_match(toks.cuda(), lens.cuda(), 5, 1, 4, occ)
        for b, h in enumerate(hist):
            want, w = ref.match(h, 5)
            assert d[b, :len(want)].tolist() == want and n[b].item() == len(want) and ml[b].item() == w


def test_uncaptured_shapes_capture_anew(cuda_llama):
    """A larger k, another tree and a wider attention (longer sequences) than captured before
    give exactly the eager result: each new shape runs eagerly once and is captured."""
    hf, _ = cuda_llama
    m = TargetModel.from_hf(hf, max_batch=4, max_seq=600)
    d = Eagle3Drafter(_head("eagle3", 48).cuda())
    for kw in (dict(k=2), dict(k=5), dict(tree=TreeConfig(2, 2, 3)), dict(tree=TreeConfig(4, 3, 10))):
        g = generate(m, PROMPTS, 300, drafter=d, stop_token_ids=(), use_cuda_graphs=True, **kw)
        e = generate(m, PROMPTS, 300, drafter=d, stop_token_ids=(), **kw)
        assert g.tokens == e.tokens
        assert g.graph_stats["failed"] == 0
        assert g.graph_stats["captured"] >= 2, g.graph_stats        # 300 tokens cross attention widths 128 -> 512
    assert generate(m, PROMPTS, 300, stop_token_ids=()).tokens == g.tokens


@pytest.mark.parametrize("mode", ["eagle3", "hybrid", "plain"])
def test_graphs_survive_alternating_batch_sizes(cuda_llama, mode):
    """eval's batches: full, smaller last one, full again - the graphs captured for each size keep
    pointing at live buffers and replay correctly."""
    _, m = cuda_llama
    kw = _kw(mode)
    ref = {n: generate(m, PROMPTS[:n], 16, **kw).tokens for n in (3, 2)}
    for n in (3, 2, 3, 2):
        r = generate(m, PROMPTS[:n], 16, use_cuda_graphs=True, **kw)
        assert r.tokens == ref[n] and r.graph_stats["failed"] == 0


@pytest.mark.parametrize("hybrid", [False, True])
def test_suffix_drafts_from_cached_responses_in_graphs(cuda_llama, hybrid):
    """Suffix decoding with its cache of responses (vLLM's default): a second call drafts from the first
    call's answers, served between graph replays (host_step); the graphed calls take the eager calls' steps
    exactly, and the second call drafts more than the first."""
    _, m = cuda_llama
    sd = SuffixDrafter()
    d = HybridDrafter(Eagle3Drafter(_head("eagle3", 48).cuda()), sd, min_match=1) if hybrid else sd
    prompts = PROMPTS + [REPETITIVE]
    runs = []
    for graphs in (False, True, True):
        forget_responses(d)
        calls = [generate(m, prompts, 20, drafter=d, k=3, stop_token_ids=(), use_cuda_graphs=graphs) for _ in "12"]
        runs.append([(r.tokens, [x.as_dict() for x in r.records]) for r in calls])
        if graphs:
            assert calls[1].graph_stats["failed"] == 0 and calls[1].graph_stats["eager"] == 0, calls[1].graph_stats
    assert runs[0] == runs[1] == runs[2]
    plain = generate(m, prompts, 20, stop_token_ids=()).tokens
    assert runs[0][0][0] == plain and runs[0][1][0] == plain
    if not hybrid:
        accepted = [sum(x["num_accepted"] for x in recs) for _, recs in runs[0]]
        assert accepted[1] > accepted[0], accepted


def test_hybrid_on_cuda_takes_both_sides(cuda_llama):
    _, m = cuda_llama
    hyb = HybridDrafter(Eagle3Drafter(_head("eagle3", 48).cuda()), NGramDrafter(1, 4), min_match=3)
    r = generate(m, [PROMPTS[2], [3, 14, 15, 9, 26, 53, 58, 62, 35, 8, 43, 12]], 24, drafter=hyb, k=3,
                 stop_token_ids=(), use_cuda_graphs=True)
    assert r.tokens == generate(m, [PROMPTS[2], [3, 14, 15, 9, 26, 53, 58, 62, 35, 8, 43, 12]], 24,
                                stop_token_ids=()).tokens
    c = hyb.choice_counts()
    assert c["ngram"] > 0 and c["head"] > 0, c
    assert r.graph_stats["failed"] == 0


@pytest.mark.slow
def test_smollm2_graphs_on_cuda(smollm2):
    """The real target on the GPU: plain, device n-gram and hybrid-with-n-gram give the same greedy
    tokens under graphs and eagerly."""
    t = smollm2
    m = TargetModel.from_hf(t.model, max_batch=2, max_seq=256, dtype=torch.float32, device="cuda")
    msgs = ["Repeat the list: apple, banana, cherry, apple, banana, cherry.", "Write a Python function that adds."]
    prompts = []
    for x in msgs:
        ids = t.tokenizer.apply_chat_template([{"role": "user", "content": x}], add_generation_prompt=True,
                                              tokenize=True)
        prompts.append(list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids))
    plain = generate(m, prompts, 48)
    for d in (None, NGramDrafter(1, 3)):
        g = generate(m, prompts, 48, drafter=d, k=3, use_cuda_graphs=True)
        assert g.tokens == plain.tokens and g.graph_stats["failed"] == 0


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_continuous_batching_graphs_equal_eager(cuda_llama, temperature):
    """Continuous batching on a GPU: slots refilled between replays of the captured step give
    the tokens of the eager loop, and the step is replayed, not re-captured, across refills."""
    _, m = cuda_llama
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, V, (int(n),), generator=g).tolist() for n in torch.randint(1, 30, (9,), generator=g)]
    caps = [5, 17, 1, 30, 8, 12, 3, 25, 9]

    def run(graphs, pipelined):
        got = {}
        reqs = [Request(p, n, seed=7 + i, stop_token_ids=[3, 27, 43] if i % 2 else (), tag=i)
                for i, (p, n) in enumerate(zip(prompts, caps))]
        stats = generate_continuous(m, reqs, lambda r, t, why: got.__setitem__(r.tag, (t, why)), batch_size=3,
                                    temperature=temperature, top_k=20, use_cuda_graphs=graphs, sync_every=4,
                                    pipeline_harvest=pipelined)
        return [got[i] for i in range(9)], stats

    eager, _ = run(False, False)
    graphed, stats = run(True, True)       # the harvest one block behind, the device's default
    assert graphed == eager and stats["failed"] == 0 and stats["replayed"] > stats["captured"] > 0
    assert run(True, False)[0] == eager


@pytest.mark.parametrize("kind", ["ngram", "eagle3", "hybrid", "suffix", "hybrid_suffix"])
def test_continuous_batching_with_a_drafter_graphs_equal_eager(cuda_llama, kind):
    """Drafted continuous batching on a GPU: whole speculative steps replayed from their graphs
    while slots are refilled (the head's admitted first pass runs between replays) give the eager
    loop's tokens and forwards, equal to plain decoding, on the eager and the compiled engine."""
    hf, m = cuda_llama
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, V, (int(n),), generator=g).tolist() + REPETITIVE[:4 + i]
               for i, n in enumerate(torch.randint(1, 30, (9,), generator=g))]
    caps = [5, 17, 1, 30, 8, 12, 3, 25, 9]

    def drafter():
        ng = NGramDrafter(1, 4, backend="device")
        if kind == "ngram":
            return ng
        sd = SuffixDrafter(max_cached_requests=0)        # no cache of responses: every run drafts alike
        if kind == "suffix":
            return sd
        hd = drafter_for_head(_head("eagle3", draft_vocab=48).cuda())
        if kind == "hybrid_suffix":
            return HybridDrafter(hd, sd, min_match=1)
        return HybridDrafter(hd, ng, min_match=1) if kind == "hybrid" else hd

    def run(engine, d, graphs):
        got = {}
        reqs = [Request(p, n, stop_token_ids=[3, 27, 43] if i % 2 else (), tag=i)
                for i, (p, n) in enumerate(zip(prompts, caps))]
        stats = generate_continuous(engine, reqs, lambda r, t, why: got.__setitem__(r.tag, (t, why)), batch_size=3,
                                    use_cuda_graphs=graphs, sync_every=4, drafter=d, k=3)
        return [got[i] for i in range(9)], [r.target_forwards for r in reqs], stats

    plain, _, _ = run(m, None, False)
    eager, fwd, _ = run(m, drafter(), False)
    assert eager == plain
    graphed, fwd_g, stats = run(m, drafter(), True)
    assert (graphed, fwd_g) == (eager, fwd) and stats["failed"] == 0 and stats["replayed"] > stats["captured"] > 0
    mc = TargetModel.from_hf(hf, max_batch=4, max_seq=160).compile_layers()
    d = drafter()
    compiled, fwd_c, stats = run(mc, d.compile() if hasattr(d, "compile") else d, True)   # suffix: nothing to compile
    assert (compiled, fwd_c) == (eager, fwd) and stats["failed"] == 0


@pytest.mark.parametrize("mode", ["plain", "ngram", "eagle3", "hybrid", "eagle3_tree", "eagle3_rejection"])
def test_compiled_engine_graphs_match_eager(cuda_llama, mode):
    """The compiled engine (layers, forward inputs, step bookkeeping) with compiled drafters, whole
    steps in CUDA graphs: the same steps and tokens as the eager engine (fp32), replayed again."""
    hf, m = cuda_llama
    mc = TargetModel.from_hf(hf, max_batch=4, max_seq=160).compile_layers()
    kw = _kw(mode)
    prompts = PROMPTS + [REPETITIVE]
    eager = generate(m, prompts, 20, **kw)
    if kw.get("drafter") is not None:
        kw = {**kw, "drafter": kw["drafter"].compile()}
    for _ in range(2):                                            # capture, then replay
        got = generate(mc, prompts, 20, use_cuda_graphs=True, **kw)
        assert got.tokens == eager.tokens
        assert [r.as_dict() for r in got.records] == [r.as_dict() for r in eager.records]
        assert got.graph_stats["failed"] == 0
    assert got.graph_stats["eager"] == 0 and got.graph_stats["captured"] == 0


def test_bench_step_times_cover_every_step(cuda_llama):
    """bench_runtime.step_times: CUDA events around every decode step, grouped by attention width;
    every step of the run is counted once, with a positive GPU time and a non-negative idle gap."""
    from test_runtime_bench import _bench
    bench = _bench()
    _, m = cuda_llama
    for kw in ({}, {"drafter": Eagle3Drafter(_head("eagle3", 48).cuda()), "k": 3}):
        ref = generate(m, PROMPTS, 30, stop_token_ids=(), use_cuda_graphs=True, **kw)
        times = bench.step_times(m, PROMPTS, 30, use_cuda_graphs=True, **kw)
        launches = ref.graph_stats["replayed"] + ref.graph_stats["eager"]      # the same run, step for step
        assert sum(t["steps"] for t in times.values()) == launches
        assert all(t["step_ms"] > 0 and t["gap_ms"] >= 0 for t in times.values())
        assert all(int(kv) % 16 == 0 for kv in times)
