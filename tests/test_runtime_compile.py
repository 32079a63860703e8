"""torch.compile'd engine layers and head steps: same logits as eager, lossless decoding,
one compiled graph shared by all layers, and the K/V cache written in place (no copy of it).

Runs Inductor's CPU backend (a C++ compiler builds the kernels), so each new shape costs seconds;
the CUDA path is measured by benchmarks/bench_runtime.py --compile on the H200."""
from __future__ import annotations

import pytest
import torch

from test_runtime import PROMPTS, _head, tiny
from specheads.runtime import generate
from specheads.runtime.drafters import Eagle3Drafter, HybridDrafter, NGramDrafter, ngram_match
from specheads.runtime.drafters.hybrid import hybrid_choice
from specheads.runtime.engines.static import Generation
from specheads.runtime.engines.step import chain_draft, commit_rows
from specheads.heads.layers import RECOMPILE_LIMIT
from specheads.runtime.model import TargetModel

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def hf_model():
    return tiny("llama")


@pytest.fixture(scope="module")
def engines(hf_model):
    torch._dynamo.reset()
    hf = hf_model
    eager = TargetModel.from_hf(hf, max_batch=4, max_seq=160)
    compiled = TargetModel.from_hf(hf, max_batch=4, max_seq=160).compile_layers()
    return eager, compiled


def test_compiled_forward_matches_eager(engines):
    eager, compiled = engines
    ids = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(1))
    from torch._dynamo.utils import counters
    counters.clear()
    for m in (eager, compiled):
        m.reset()
    for n in (7, 1, 3, 1):
        t = sum(m.cache.lengths[0].item() for m in (eager,))
        a, b = eager(ids[:, t:t + n], aux_layer_ids=[1, 4]), compiled(ids[:, t:t + n], aux_layer_ids=[1, 4])
        torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b.aux, a.aux, atol=1e-5, rtol=1e-5)
        for m in (eager, compiled):
            m.commit(n)
    # the caches hold the same K/V: the in-place write reached the engine's own tensors
    torch.testing.assert_close(compiled.cache.k, eager.cache.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled.cache.v, eager.cache.v, atol=1e-5, rtol=1e-5)
    # four layers, several shapes: graphs are per shape (at most a static and a dynamic one), not per layer
    assert counters["stats"]["unique_graphs"] <= 2 * 3
    # and dynamo may keep more graphs than its default 8 (past the limit new shapes silently run eagerly)
    assert torch._dynamo.config.recompile_limit >= RECOMPILE_LIMIT
    # continuous batching's path: rows anywhere in the cache
    rows = torch.tensor([3, 1])
    for m in (eager, compiled):
        m.cache.lengths[rows] = 0
    a = eager(ids[:2, :5], rows=rows)
    b = compiled(ids[:2, :5], rows=rows)
    torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled.cache.k[:, rows], eager.cache.k[:, rows], atol=1e-5, rtol=1e-5)


def test_compiled_kv_write_is_in_place(engines, tmp_path, monkeypatch):
    """Inductor's code for a decode step writes K/V with an indexed store into the cache argument:
    no buffer the size of the cache is allocated (a scatter_ into the cache did copy all of it)."""
    _, compiled = engines
    from torch._inductor.utils import run_and_get_code
    compiled.reset()
    compiled.commit(5)
    slots = compiled.cache.slots
    torch._dynamo.reset()
    _, codes = run_and_get_code(lambda: compiled(torch.tensor([[1], [2], [3], [4]])))
    code = "\n".join(codes)
    cache_shape = f"({compiled.max_batch}, {compiled.args.num_kv_heads}, {slots}, {compiled.args.head_dim})"
    assert "index_put" in code
    assert f"empty_strided_cpu({cache_shape}" not in code


def test_compiled_decoding_is_lossless(engines):
    eager, compiled = engines
    plain = generate(eager, PROMPTS, 12, stop_token_ids=())
    assert generate(compiled, PROMPTS, 12, stop_token_ids=()).tokens == plain.tokens
    head = _head("eagle3", 48)
    d = Eagle3Drafter(head).compile()
    assert generate(compiled, PROMPTS, 12, drafter=d, k=3, stop_token_ids=()).tokens == plain.tokens
    # the compiled head drafts what the eager head drafts
    ref = generate(eager, PROMPTS, 12, drafter=Eagle3Drafter(head), k=3, stop_token_ids=())
    got = generate(compiled, PROMPTS, 12, drafter=d, k=3, stop_token_ids=())
    assert got.summary()["accepted"] == ref.summary()["accepted"]
    hybrid = HybridDrafter(Eagle3Drafter(head), NGramDrafter()).compile()
    assert generate(compiled, PROMPTS, 12, drafter=hybrid, k=3, stop_token_ids=()).tokens == plain.tokens


def _per_step(result):
    return [(r.request, r.num_proposed, r.num_accepted, r.num_emitted) for r in result.records]


def test_compiled_bookkeeping_and_drafters_match_eager(engines):
    """On a compiled engine the step's bookkeeping (chain_draft, commit_rows), the device n-gram
    match, the hybrid's choice and the head's units (first pass, greedy chain, one call) run through
    torch.compile: every step proposes, accepts and emits what the eager engine does."""
    eager, compiled = engines
    head = _head("eagle3", 48)
    prompts = PROMPTS + [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
    plain = generate(eager, prompts, 14, stop_token_ids=())
    cases = {
        "ngram": (lambda: NGramDrafter(backend="device"), lambda: NGramDrafter(backend="device").compile()),
        "head": (lambda: Eagle3Drafter(head), lambda: Eagle3Drafter(head).compile()),
        "hybrid": (lambda: HybridDrafter(Eagle3Drafter(head), NGramDrafter(backend="device"), min_match=2),
                   lambda: HybridDrafter(Eagle3Drafter(head), NGramDrafter(backend="device"), min_match=2).compile()),
    }
    for name, (make_eager, make_compiled) in cases.items():
        ref = generate(eager, prompts, 14, drafter=make_eager(), k=3, stop_token_ids=())
        d = make_compiled()
        got = generate(compiled, prompts, 14, drafter=d, k=3, stop_token_ids=())
        assert got.tokens == plain.tokens, name
        assert _per_step(got) == _per_step(ref), name
        if name == "hybrid":
            assert min(d.choice_counts().values()) > 0      # both sides were chosen
    # stop tokens and max_new_tokens cut rows at different steps (commit_rows' finishing logic)
    stops = [plain.tokens[0][4], plain.tokens[2][6]]
    ref = generate(eager, prompts, 11, drafter=NGramDrafter(backend="device"), k=3, stop_token_ids=stops)
    got = generate(compiled, prompts, 11, drafter=NGramDrafter(backend="device").compile(), k=3, stop_token_ids=stops)
    assert got.tokens == ref.tokens and got.finish_reasons == ref.finish_reasons
    assert "stop" in got.finish_reasons


def test_compiled_head_sampled_and_tree_paths(engines):
    """The head's other paths (sampled drafts, trees) call the compiled single head call: the same
    drafts and outputs as the eager head."""
    eager, compiled = engines
    from specheads.runtime.tree import TreeConfig
    head = _head("eagle3", 48)
    kw = dict(k=3, rule="rejection", temperature=0.8, seed=7, stop_token_ids=())
    ref = generate(eager, PROMPTS, 10, drafter=Eagle3Drafter(head), **kw)
    got = generate(compiled, PROMPTS, 10, drafter=Eagle3Drafter(head).compile(), **kw)
    assert got.tokens == ref.tokens and _per_step(got) == _per_step(ref)
    tree = TreeConfig(depth=3, topk=2, total_tokens=6)
    plain = generate(eager, PROMPTS, 10, stop_token_ids=())
    ref = generate(eager, PROMPTS, 10, drafter=Eagle3Drafter(head), tree=tree, stop_token_ids=())
    got = generate(compiled, PROMPTS, 10, drafter=Eagle3Drafter(head).compile(), tree=tree, stop_token_ids=())
    assert got.tokens == plain.tokens and _per_step(got) == _per_step(ref)


def test_layers_only_engine_leaves_inputs_and_bookkeeping_eager(engines, hf_model):
    """compile_layers(inputs=False, bookkeeping=False): the layers compiled, the forward's inputs and a
    step's bookkeeping eager (bench_runtime's compiled_layers engine, the A/B against the full compiled
    engine); it decodes what the eager engine decodes, step by step."""
    eager, _ = engines
    layers_only = TargetModel.from_hf(hf_model, max_batch=4, max_seq=160).compile_layers(inputs=False, bookkeeping=False)
    assert layers_only.compiled and not layers_only.compiled_bookkeeping
    assert layers_only._inputs == layers_only._inputs_impl
    gen = Generation(layers_only, PROMPTS, 4, drafter=NGramDrafter(backend="device"), k=3, stop_token_ids=())
    assert gen._commit_rows is commit_rows and gen._chain_draft is chain_draft
    plain = generate(eager, PROMPTS, 12, stop_token_ids=())
    ref = generate(eager, PROMPTS, 12, drafter=NGramDrafter(backend="device"), k=3, stop_token_ids=())
    got = generate(layers_only, PROMPTS, 12, drafter=NGramDrafter(backend="device").compile(), k=3,
                   stop_token_ids=())
    assert got.tokens == plain.tokens and _per_step(got) == _per_step(ref)


def test_head_compiled_without_units_calls_the_compiled_step(engines):
    """HeadDrafter.compile(units=False) (bench_runtime's compiled_as_r3 engine): only the head's call is
    compiled, and the eager first pass and greedy chain go through it; the hybrid built so leaves its
    n-gram match and choice eager. Both decode what the eager drafters decode, step by step."""
    eager, compiled = engines
    head = _head("eagle3", 48)
    d = Eagle3Drafter(head).compile(units=False)
    assert d._inner_step is d._step and d._step is not d._step_impl
    assert d._first_pass_fn == d._first_pass and d._greedy_chain_fn == d._greedy_chain
    calls = []
    step = d._step
    d._step = d._inner_step = lambda *a, **kw: calls.append(1) or step(*a, **kw)
    plain = generate(eager, PROMPTS, 10, stop_token_ids=())
    ref = generate(eager, PROMPTS, 10, drafter=Eagle3Drafter(head), k=3, stop_token_ids=())
    got = generate(compiled, PROMPTS, 10, drafter=d, k=3, stop_token_ids=())
    assert got.tokens == plain.tokens and _per_step(got) == _per_step(ref)
    assert calls                                           # the first pass and the chain took the compiled call
    hybrid = HybridDrafter(Eagle3Drafter(head), NGramDrafter(backend="device"), min_match=2).compile(units=False)
    assert hybrid._choose is hybrid_choice and hybrid.ngram._match is ngram_match
    ref = generate(eager, PROMPTS, 10, drafter=HybridDrafter(Eagle3Drafter(head), NGramDrafter(backend="device"),
                                                            min_match=2), k=3, stop_token_ids=())
    got = generate(compiled, PROMPTS, 10, drafter=hybrid, k=3, stop_token_ids=())
    assert got.tokens == plain.tokens and _per_step(got) == _per_step(ref)


@pytest.mark.parametrize("kind", ["eagle3", "peagle", "dflash", "hybrid"])
def test_a_compiled_drafter_compiles_nothing_in_later_runs(engines, kind):
    """A drafter compiled once serves run after run: the prompt's pass runs eagerly, as the target's
    prefill, so a later run's prompts (any width) recompile nothing. (It went through the compiled first
    pass once the root buffers existed: 6 s of a batch-1 prefill on an H100, 2026-12-07. The hybrid scored
    the prompt's tokens as if they verified its last proposals, through its compiled score, static in the
    prompt's width: 0.7 s of every prefill, H100, 2026-12-07.) The first run crosses an attention-width
    bucket, so the step units are dynamic in it; dynamo alone (backend "eager") shows the recompiles
    without Inductor's build time."""
    from torch._dynamo.utils import counters
    from test_runtime_parallel import CLASSES, _head as parallel_head
    eager, _ = engines
    if kind == "hybrid":
        d = HybridDrafter(Eagle3Drafter(_head("eagle3", 48)), NGramDrafter(backend="device"), min_match=2)
    elif kind == "eagle3":
        d = Eagle3Drafter(_head("eagle3", 48))
    else:
        d = CLASSES[kind](parallel_head(kind, 48))
    d.compile(backend="eager")
    prompts, new = [p * 3 for p in PROMPTS], 24          # widths 48 and 64
    plain = generate(eager, prompts, new, stop_token_ids=())
    assert generate(eager, prompts, new, drafter=d, k=3, stop_token_ids=()).tokens == plain.tokens
    for run in (prompts, [p * 2 for p in PROMPTS]):
        counters.clear()
        got = generate(eager, run, new, drafter=d, k=3, stop_token_ids=())
        assert counters["stats"].get("unique_graphs", 0) == 0, dict(counters["stats"])
    assert got.tokens == generate(eager, [p * 2 for p in PROMPTS], new, stop_token_ids=()).tokens
