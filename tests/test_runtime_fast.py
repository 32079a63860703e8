"""Runtime: the device n-gram proposer, a speculative step without host syncs, the
hybrid drafter, vocabulary checks, the fast layer pieces. All on the CPU (tiny random models);
tests/test_runtime_cuda.py runs the CUDA-only parts."""

import contextlib
import sys

import pytest
import torch
import torch.nn.functional as F

from specheads.errors import SpecheadsError
from specheads.kernels import attention_ref
from specheads.runtime.drafters import (DRAFTER_KINDS, DraftContext, Drafter, DraftVocabError, Eagle3Drafter,
                                        HybridDrafter, NGramDrafter, Proposal, drafter_for_head, make_drafter,
                                        Verified, ngram_match)
from specheads.runtime.engines.continuous import Request, generate_continuous
from specheads.runtime.engines.graphs import KV_BUCKET_MIN
from specheads.runtime.engines.static import Generation, generate
from specheads.runtime.model import (TargetModel, additive_mask, apply_rope, apply_rope_fast, build_attn_mask,
                                     signed_sin)
from specheads.runtime.tree import TreeConfig
from specheads.runtime.verify import tree_links, tree_links_reference

from test_runtime import PROMPTS, V, _head, tiny  # tests/ is on sys.path (rootdir conftest)


@pytest.fixture(scope="module")
def llama():
    hf = tiny("llama")
    return hf, TargetModel.from_hf(hf, max_batch=4, max_seq=160)


REPETITIVE = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
NOVEL = [3, 14, 15, 9, 26, 53, 58, 62, 35, 8, 43, 12]


# ------------------------------------------------------------------------------ host-sync guard
_ALLOWED = ("/specheads/kernels/", "/triton/")      # the kernels' torch references may sync (CUDA runs Triton)


def _allowed() -> bool:
    f = sys._getframe(2)
    while f is not None:
        if any(a in f.f_code.co_filename for a in _ALLOWED):
            return True
        f = f.f_back
    return False


@contextlib.contextmanager
def no_host_sync():
    """Fail on anything that would make the host wait for the device on a GPU: reading a tensor's
    value (item, tolist, bool/int/float/index, cpu, numpy) or building a tensor from host data."""
    T = torch.Tensor
    saved = {n: getattr(T, n) for n in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__",
                                          "__index__")}
    saved_fns = {"tensor": torch.tensor, "as_tensor": torch.as_tensor}

    def guard(name, fn):
        def wrapped(*a, **kw):
            if not _allowed():
                raise AssertionError(f"host sync in a speculative step: Tensor.{name}")
            return fn(*a, **kw)
        return wrapped

    def guard_new(name, fn):
        def wrapped(data, *a, **kw):
            if not isinstance(data, torch.Tensor) and not _allowed():
                raise AssertionError(f"host data -> device in a speculative step: torch.{name}")
            return fn(data, *a, **kw)
        return wrapped

    try:
        for n, fn in saved.items():
            setattr(T, n, guard(n, fn))
        torch.tensor = guard_new("tensor", saved_fns["tensor"])
        torch.as_tensor = guard_new("as_tensor", saved_fns["as_tensor"])
        yield
    finally:
        for n, fn in saved.items():
            setattr(T, n, fn)
        torch.tensor, torch.as_tensor = saved_fns["tensor"], saved_fns["as_tensor"]


def test_the_guard_catches_syncs():
    x = torch.ones(3)
    for bad in (lambda: x.sum().item(), lambda: bool(x.any()), lambda: x.tolist(), lambda: int(x[0]),
                lambda: torch.tensor([1, 2]), lambda: x[:x.sum().long()]):
        with pytest.raises(AssertionError), no_host_sync():
            bad()
    with no_host_sync():                                   # device-side ops are fine
        torch.where(x > 0, x, 0).cumsum(0).argmax()


def guarded_generate(model, prompts, n, pipelined=None, **kw):
    """generate() with every speculative step under ``no_host_sync`` (and optionally the lagged
    flag loop that CUDA uses)."""
    gen = Generation(model, prompts, n, **kw)
    gen.prefill()
    step = gen.step

    def checked():
        with no_host_sync():
            step()

    gen.step = checked
    if pipelined is not None:
        gen.pipelined = pipelined
    gen.run()
    return gen.result()


# ------------------------------------------------------------------------------ device n-gram
def _ragged(histories, S):
    toks = torch.randint(0, 1000, (len(histories), S))         # junk past each row's length
    for b, h in enumerate(histories):
        toks[b, :len(h)] = torch.tensor(h)
    return toks, torch.tensor([len(h) for h in histories])


@pytest.mark.parametrize("occurrence", ["latest", "earliest"])
@pytest.mark.parametrize("min_n,max_n,k", [(1, 3, 3), (1, 4, 5), (2, 4, 2), (3, 3, 4), (1, 1, 1)])
def test_ngram_match_equals_host_reference(occurrence, min_n, max_n, k):
    g = torch.Generator().manual_seed(min_n * 100 + max_n * 10 + k)
    hist = []
    for i in range(40):
        n = int(torch.randint(1, 60, (1,), generator=g))
        vocab = [3, 5, 12, 50][i % 4]                          # small vocabularies repeat a lot
        hist.append(torch.randint(0, vocab, (n,), generator=g).tolist())
    hist += [REPETITIVE, NOVEL, [7], [7, 7], [1, 2, 1], [4, 4, 4, 4, 4], list(range(30)) + list(range(5))]
    ref = NGramDrafter(min_n, max_n, occurrence, backend="host")
    toks, lens = _ragged(hist, 72)
    drafts, num, mlen = ngram_match(toks, lens, k, min_n, max_n, occurrence)
    for b, h in enumerate(hist):
        want, n = ref.match(h, k)
        assert num[b].item() == len(want), (b, h)
        assert drafts[b, :len(want)].tolist() == want, (b, h)
        assert drafts[b, len(want):].eq(0).all()
        assert mlen[b].item() == n, (b, h)


def test_ngram_drafter_backends_propose_the_same():
    hist = [REPETITIVE, NOVEL, [1, 2, 3, 1, 2], [9]]
    toks, lens = _ragged(hist, 40)
    base = dict(device=torch.device("cpu"), max_seq=40, vocab_size=V, batch=4, tokens=toks, lengths=lens,
                active_mask=torch.tensor([True, True, True, False]))
    host, dev = NGramDrafter(backend="host"), NGramDrafter(backend="device")
    ctx = DraftContext([list(h) for h in hist], [True, True, True, False], **base)
    for d in (host, dev):
        d.start(ctx)
    assert dev.graph_safe and not host.graph_safe
    a, b = host.propose(ctx, 3), dev.propose(ctx, 3)
    assert a.num.tolist() == b.num.tolist() == [3, 0, 3, 0]          # "1 2" -> 3 1 2
    for r in range(4):
        assert a.tokens[r, :a.num[r]].tolist() == b.tokens[r, :b.num[r]].tolist()
    assert a.match_len.tolist()[:3] == b.match_len.tolist()[:3]
    auto = NGramDrafter()
    auto.start(ctx)
    assert not auto.on_device                                 # auto: the host reference off CUDA
    with pytest.raises(ValueError):
        NGramDrafter(backend="gpu")


def test_device_ngram_generation_equals_host_and_plain(llama):
    _, m = llama
    prompts = PROMPTS + [REPETITIVE]
    plain = generate(m, prompts, 20, stop_token_ids=())
    host = generate(m, prompts, 20, drafter=NGramDrafter(1, 3, backend="host"), k=3, stop_token_ids=())
    dev = guarded_generate(m, prompts, 20, drafter=NGramDrafter(1, 3, backend="device"), k=3, stop_token_ids=())
    assert host.tokens == dev.tokens == plain.tokens
    sh, sd = host.summary(), dev.summary()
    assert sd["accepted"] == sh["accepted"] > 0
    assert sd["proposed"] == sh["proposed"]
    assert sd["tau"] == sh["tau"] > 1.0


# ------------------------------------------------------------------------------ no host syncs
@pytest.mark.parametrize("mode", ["plain", "plain_sampled", "ngram_onehot", "eagle3", "eagle3_rejection",
                                  "eagle3_tree", "eagle3_tree_sampled", "eagle1", "mtp", "hybrid",
                                  "hybrid_rejection"])
def test_speculative_step_never_syncs(llama, mode):
    """Every step of a graph-safe run reads nothing back from the device (what a CUDA graph needs)
    and gives the same tokens as the normal loop."""
    _, m = llama
    kw = {"stop_token_ids": ()}
    sampled = dict(temperature=0.8, top_k=20, seed=4)
    if mode == "plain_sampled":
        kw.update(rule="onehot", **sampled)
    elif mode == "ngram_onehot":
        kw.update(drafter=NGramDrafter(1, 3, backend="device"), k=3, rule="onehot", **sampled)
    elif mode.startswith("eagle3"):
        d = Eagle3Drafter(_head("eagle3", 48))
        if "tree" in mode:
            kw.update(drafter=d, tree=TreeConfig(3, 2, 5))
            if mode.endswith("sampled"):
                kw.update(rule="tree_target_only", **sampled)
        else:
            kw.update(drafter=d, k=3)
            if mode.endswith("rejection"):
                kw.update(rule="rejection", **sampled)
    elif mode in ("eagle1", "mtp"):
        kw.update(drafter=drafter_for_head(_head(mode)), k=2)
    elif mode.startswith("hybrid"):
        kw.update(drafter=make_drafter("hybrid", _head("eagle3", 48), min_match=2, ngram_backend="device"), k=3)
        if mode.endswith("rejection"):
            kw.update(rule="rejection", **sampled)
    prompts = PROMPTS + [REPETITIVE]
    got = guarded_generate(m, prompts, 14, **kw)
    ref = generate(m, prompts, 14, **kw)
    assert got.tokens == ref.tokens
    assert [r.as_dict() for r in got.records] == [r.as_dict() for r in ref.records]
    if "temperature" not in kw:
        assert got.tokens == generate(m, prompts, 14, stop_token_ids=()).tokens


def test_lagged_flag_loop_gives_the_same_result(llama):
    """The CUDA loop reads the 'any row active' flag one step late: one extra step touches no
    active row, and the attention width always covers every row."""
    _, m = llama
    seen = []
    orig = TargetModel.forward

    def spy(self, input_ids, positions=None, write_pos=None, *a, kv_len=None, **kw):
        if write_pos is not None and kv_len is not None:
            seen.append((write_pos.max() + 1, kv_len))          # read after the run (no sync in a step)
        return orig(self, input_ids, positions, write_pos, *a, kv_len=kv_len, **kw)

    d = Eagle3Drafter(_head("eagle3", 48))
    kw = dict(drafter=d, k=3, stop_token_ids=())
    ref = generate(m, PROMPTS, 30, **kw)
    TargetModel.forward = spy
    try:
        lag = guarded_generate(m, PROMPTS, 30, pipelined=True, **kw)
    finally:
        TargetModel.forward = orig
    assert lag.tokens == ref.tokens
    assert [r.as_dict() for r in lag.records] == [r.as_dict() for r in ref.records]
    assert lag.target_forwards == ref.target_forwards
    assert seen and all(int(need) <= kv for need, kv in seen)


def test_kv_bucket_bounds():
    class G(Generation):
        def __init__(self):           # only what _bucket reads
            pass

    g = G()
    g.model = type("M", (), {"cache": type("C", (), {"slots": 1024})()})()
    g.capture, g.inner_graphs, g.dev = True, False, torch.device("cpu")
    assert [g._bucket(n) for n in (1, 128, 129, 600, 5000)] == [KV_BUCKET_MIN, 128, 256, 1024, 1024]
    g.capture = False
    assert [g._bucket(n) for n in (1, 17, 600, 5000)] == [16, 32, 608, 1024]
    g.dev = torch.device("cuda")                    # eager GPU steps use the graphs' widths
    assert [g._bucket(n) for n in (1, 129, 5000)] == [KV_BUCKET_MIN, 256, 1024]


def test_host_view_is_pulled_when_read(llama):
    """A drafter that reads ctx.histories sees prompt + emitted tokens, current at every step."""
    _, m = llama
    log = []

    class Spy(Drafter):
        def propose(self, ctx, k):
            log.append(([list(h) for h in ctx.histories], list(ctx.active)))
            return Proposal(torch.zeros(ctx.batch, 0, dtype=torch.long), torch.zeros(ctx.batch, dtype=torch.long))

    r = generate(m, PROMPTS, 6, drafter=Spy(), k=2, stop_token_ids=())
    assert len(log) == 5
    for step, (hists, act) in enumerate(log):
        assert act == [True] * 3
        for b, h in enumerate(hists):
            assert h == PROMPTS[b] + r.tokens[b][:step + 1]


def test_workspace_reused_across_calls_and_k(llama):
    """The device state lives on the engine per shape and is reset by each call: a later call with
    another k, prompts or max_new_tokens gives exactly what a fresh engine gives."""
    hf, _ = llama
    m = TargetModel.from_hf(hf, max_batch=4, max_seq=160)
    d = Eagle3Drafter(_head("eagle3", 48))
    for k, n, prompts in [(2, 10, PROMPTS), (4, 12, PROMPTS[::-1]), (1, 11, PROMPTS)]:
        a = generate(m, prompts, n, drafter=d, k=k, stop_token_ids=())
        fresh = TargetModel.from_hf(hf, max_batch=4, max_seq=160)
        b = generate(fresh, prompts, n, drafter=Eagle3Drafter(_head("eagle3", 48)), k=k, stop_token_ids=())
        assert a.tokens == b.tokens and [r.as_dict() for r in a.records] == [r.as_dict() for r in b.records]
    assert len(m.workspaces) == 1 and len(d._states) == 1


def test_stops_and_lengths_at_different_steps(llama):
    _, m = llama
    plain = generate(m, PROMPTS + [REPETITIVE], 16, stop_token_ids=())
    stop = plain.tokens[1][3]
    d = make_drafter("hybrid", _head("eagle3", 48), min_match=2, ngram_backend="device")
    r = guarded_generate(m, PROMPTS + [REPETITIVE], 16, drafter=d, k=3, stop_token_ids=[stop, 10_000])
    for i, toks in enumerate(plain.tokens):
        cut = toks.index(stop) + 1 if stop in toks else len(toks)
        assert r.tokens[i] == toks[:cut]
        assert r.finish_reasons[i] == ("stop" if stop in toks else "length")
    assert sum(x.num_emitted for x in r.records if x.request == 1) + 1 == len(r.tokens[1])


def test_first_token_can_finish_everything(llama):
    _, m = llama
    plain = generate(m, PROMPTS, 1, stop_token_ids=())
    r = generate(m, PROMPTS, 5, drafter=NGramDrafter(backend="device"), stop_token_ids=[t[0] for t in plain.tokens])
    assert r.tokens == plain.tokens and r.finish_reasons == ["stop"] * 3
    assert r.records == [] and r.target_forwards == 0
    assert generate(m, PROMPTS, 1, drafter=NGramDrafter(backend="device"), stop_token_ids=()).tokens == plain.tokens


# ------------------------------------------------------------------------------ trees
def test_tree_links_on_device_match_the_walk():
    g = torch.Generator().manual_seed(0)
    for N in (1, 2, 7, 20):
        parents = torch.stack([torch.tensor([int(torch.randint(-1, i, (1,), generator=g)) for i in range(N)])
                               for _ in range(5)])
        a, b = tree_links(parents), tree_links_reference(parents)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ------------------------------------------------------------------------------ hybrid
def test_hybrid_is_lossless_and_chooses_by_match_length(llama):
    _, m = llama
    head = _head("eagle3", 48)
    prompts = [REPETITIVE, NOVEL, PROMPTS[2]]
    plain = generate(m, prompts, 24, stop_token_ids=())
    hyb = HybridDrafter(Eagle3Drafter(head), NGramDrafter(1, 4, backend="device"), min_match=3)
    r = generate(m, prompts, 24, drafter=hyb, k=3, stop_token_ids=())
    assert r.tokens == plain.tokens
    # repetitive text (this tiny target soon repeats one token: 57 25 25 25 ...) drafts from its n-grams
    loop = plain.tokens[2]
    assert loop[2:] == [loop[2]] * 22
    rep = generate(m, [PROMPTS[2]], 24, drafter=hyb, k=3, stop_token_ids=())
    c = hyb.choice_counts()
    assert c["ngram"] >= 2 * c["head"] and c["head"] <= 4, c         # head only until the loop shows
    assert rep.summary()["accepted"] > 0
    # a novel prompt drafts from the head (its first steps have no 3-token match)
    generate(m, [NOVEL], 1 + 1, drafter=hyb, k=3, stop_token_ids=())       # one decode step
    assert hyb.choice_counts() == {"ngram": 0, "head": 1}
    assert hyb.use_ngram.tolist() == [False]
    # the head's drafts are exactly those of the head alone on a novel prompt
    alone = generate(m, [NOVEL], 2, drafter=Eagle3Drafter(head), k=3, stop_token_ids=())
    mixed = generate(m, [NOVEL], 2, drafter=hyb, k=3, stop_token_ids=())
    assert [x.as_dict() for x in alone.records] == [x.as_dict() for x in mixed.records]
    # min_match above max_ngram: never the n-gram; host n-gram backend also works
    never = HybridDrafter(Eagle3Drafter(head), NGramDrafter(1, 3, backend="host"), min_match=4)
    assert generate(m, prompts, 24, drafter=never, k=3, stop_token_ids=()).tokens == plain.tokens
    assert never.choice_counts()["ngram"] == 0 and not never.graph_safe
    with pytest.raises(ValueError):
        HybridDrafter(Eagle3Drafter(head), min_match=0)


def test_hybrid_sampled_rejection_is_reproducible(llama):
    _, m = llama
    kw = dict(k=3, rule="rejection", temperature=0.9, seed=[3, 4], stop_token_ids=())
    mk = lambda: make_drafter("hybrid", _head("eagle3", 48), min_match=2, ngram_backend="device")  # noqa: E731
    a = generate(m, [REPETITIVE, NOVEL], 12, drafter=mk(), **kw)
    b = generate(m, [REPETITIVE, NOVEL], 12, drafter=mk(), **kw)
    assert a.tokens == b.tokens
    single = generate(m, [NOVEL], 12, drafter=mk(), **{**kw, "seed": [4]})
    assert single.tokens[0] == a.tokens[1]                     # a request's draws do not depend on the batch


def test_make_drafter():
    head = _head("eagle3", 48)
    assert DRAFTER_KINDS == ("ngram", "head", "hybrid", "suffix")
    ng = make_drafter("ngram", min_ngram=2, max_ngram=3, occurrence="earliest", ngram_backend="host")
    assert isinstance(ng, NGramDrafter) and (ng.min_ngram, ng.max_ngram, ng.occurrence) == (2, 3, "earliest")
    assert isinstance(make_drafter("head", head), Eagle3Drafter)
    h = make_drafter("hybrid", head, min_match=4, name="my-head")
    assert isinstance(h, HybridDrafter) and h.min_match == 4 and h.head.name == "my-head"
    assert h.aux_layer_ids == (1, 2, 3) and h.provides_probs and not h.supports_tree
    assert make_drafter("hybrid", Eagle3Drafter(head)).head.head is head
    with pytest.raises(ValueError):
        make_drafter("hybrid")
    with pytest.raises(ValueError):
        make_drafter("tree")


# ------------------------------------------------------------------------------ vocabulary checks
def test_head_with_a_bad_vocab_mapping_is_refused(llama):
    _, m = llama
    head = _head("eagle3", 48)
    head.d2t[-1] += 40                                        # the last draft id now maps past the target
    with pytest.raises(DraftVocabError, match="my-head.*d2t maps draft ids to target ids"):
        drafter_for_head(head, name="my-head")
    assert issubclass(DraftVocabError, SpecheadsError)

    head = _head("eagle3", 48)
    head.t2d = torch.ones(V + 5, dtype=torch.bool)              # t2d for another vocabulary
    with pytest.raises(DraftVocabError, match="t2d has 69 entries"):
        Eagle3Drafter(head)


def test_head_for_another_target_is_refused_before_generation(llama):
    from specheads.heads import HeadConfig, build_head
    _, m = llama
    cfg = HeadConfig(kind="eagle3", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2, target_vocab_size=2 * V, draft_vocab_size=48, aux_layer_ids=[1, 2, 3])
    head = build_head(cfg).eval()
    keep = torch.arange(48) * 2 + 10                          # target ids 10..104: fine for its own vocab
    head.set_vocab_mapping(keep - torch.arange(48))
    d = drafter_for_head(head)                                # consistent on its own
    calls = []
    orig = TargetModel.forward
    TargetModel.forward = lambda self, *a, **kw: calls.append(1) or orig(self, *a, **kw)
    try:
        with pytest.raises(DraftVocabError, match="eagle3 head does not fit.*vocabulary of 128 tokens, the target "
                                                  "has 64.*d2t maps draft ids to target ids 10..104"):
            generate(m, PROMPTS, 4, drafter=d, k=2)
        with pytest.raises(DraftVocabError):
            generate(m, PROMPTS, 4, drafter=HybridDrafter(d), k=2)
    finally:
        TargetModel.forward = orig
    assert calls == []                                        # refused before the target ran
    with pytest.raises(DraftVocabError):
        drafter_for_head(head, target_vocab_size=V)


# ------------------------------------------------------------------------------ layer pieces
def test_fast_rope_equals_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 16, generator=g)                 # [B, T, heads, D]
    ang = torch.randn(2, 5, 8, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    ref = apply_rope(x.transpose(1, 2), cos, sin).transpose(1, 2)
    got = apply_rope_fast(x, cos[:, :, None], signed_sin(sin)[:, :, None])
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("T", [1, 4])
def test_decode_attention_reference_equals_repeated_kv(T):
    g = torch.Generator().manual_seed(T)
    B, H, KvH, D, S = 2, 6, 2, 8, 32
    q = torch.randn(B, T, H, D, generator=g)
    k, v = torch.randn(B, KvH, S, D, generator=g), torch.randn(B, KvH, S, D, generator=g)
    lengths = torch.tensor([5, 11])
    wp = lengths[:, None] + torch.arange(T)
    vis = build_attn_mask(lengths, wp, None, S)
    got = attention_ref.decode_attention(q, k, v, additive_mask(vis, q.dtype, H // KvH), S)
    kr, vr = k.repeat_interleave(H // KvH, 1), v.repeat_interleave(H // KvH, 1)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), kr, vr, attn_mask=vis)
    torch.testing.assert_close(got, ref.transpose(1, 2).reshape(B, T, H * D), atol=1e-5, rtol=1e-5)


def test_cache_slots_round_up(llama):
    hf, _ = llama
    m = TargetModel.from_hf(hf, max_batch=1, max_seq=70)
    assert m.max_seq == 70 and m.cache.slots == 80 and m.cache.k.shape[3] == 80
    with pytest.raises(ValueError):
        generate(m, [[1, 2]], 69)                              # the logical max_seq still bounds a request


def test_rows_reach_max_new_tokens_at_different_steps(llama):
    """One row drafts well (its text repeats), one does not: they hit max_new_tokens at different
    steps; each gets exactly max_new_tokens, the finished row's cache stays frozen, and its
    records stop when it does."""
    _, m = llama
    prompts = [PROMPTS[2], NOVEL]
    plain = generate(m, prompts, 20, stop_token_ids=())
    r = guarded_generate(m, prompts, 20, drafter=NGramDrafter(1, 4, backend="device"), k=4, stop_token_ids=())
    assert r.tokens == plain.tokens and r.finish_reasons == ["length", "length"]
    steps = [sum(1 for x in r.records if x.request == b) for b in (0, 1)]
    assert steps[0] < steps[1], steps
    for b in (0, 1):
        assert sum(x.num_emitted for x in r.records if x.request == b) + 1 == 20
    assert r.target_forwards == max(steps)
    # the cache holds at least every emitted token but the last (a cut step may have committed more)
    assert all(n >= len(p) + 19 for n, p in zip(m.cache.lengths[:2].tolist(), prompts))


# ------------------------------------------------------------------------------ sampled drafting is lossless
@pytest.fixture(scope="module")
def wide():
    return TargetModel.from_hf(tiny("llama", seed=1), max_batch=256, max_seq=48)


def _draws(m, n, seed0=0, **kw):
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    out = []
    for start in range(0, n, m.max_batch):
        b = min(m.max_batch, n - start)
        out += generate(m, [prompt] * b, 4, temperature=0.3, stop_token_ids=(),
                        seed=[seed0 + start + i for i in range(b)], **kw).tokens
    return out


@pytest.mark.parametrize("mode,lossless", [("ngram_onehot", True), ("eagle3_rejection", True),
                                           ("hybrid_rejection", True), ("eagle3_tree", True),
                                           ("eagle3_tree_relaxed", False)])
def test_sampled_drafting_keeps_the_target_distribution(wide, mode, lossless):
    """Two-sample χ² of tokens 1..4, drafted vs plain (the device step, per-request uniforms).
    The relaxed tree thresholds are lossy by design: the same test must see it."""
    from specheads.evaluate.lossless import chi_square_two_sample
    head = _head("eagle3", 48)
    kw = {"ngram_onehot": dict(drafter=NGramDrafter(1, 3, backend="device"), k=3, rule="onehot"),
          "eagle3_rejection": dict(drafter=Eagle3Drafter(head), k=3, rule="rejection"),
          "hybrid_rejection": dict(drafter=make_drafter("hybrid", head, min_match=1, ngram_backend="device"), k=3,
                                   rule="rejection"),
          "eagle3_tree": dict(drafter=Eagle3Drafter(head), tree=TreeConfig(3, 2, 5), rule="tree_target_only"),
          "eagle3_tree_relaxed": dict(drafter=Eagle3Drafter(head), tree=TreeConfig(3, 2, 5), rule="tree_target_only",
                                      thresholds=(0.05, 0.05))}[mode]
    n = 512
    plain = _draws(wide, n, rule="onehot")
    drafted = _draws(wide, n, seed0=100_000, **kw)
    p = chi_square_two_sample(plain, drafted, 4)
    if lossless:
        assert min(p) > 0.01 / len(p), p
    else:
        assert min(p) < 1e-6, p


def test_state_buffers_outlive_batch_changes(llama):
    """Captured step graphs point at the workspace's and the drafters' buffers: alternating batch
    sizes (eval's last, smaller batch) must never free or reallocate the buffers of another size."""
    _, m = llama
    hyb = make_drafter("hybrid", _head("eagle3", 48), min_match=2, ngram_backend="device")

    def ptrs(B):
        ws = [w for key, w in m.workspaces.items() if key[0] == B]
        st = hyb.head._states[(B, m.max_seq, torch.float32, "cpu")]
        tensors = [st.cache.lengths, st.root_logits, st.root_h, st.root_pos, *st.cache.k, *st.cache.v,
                   *hyb._bufs[(B, "cpu")]] + [t for w in ws for t in vars(w).values() if isinstance(t, torch.Tensor)]
        return [t.data_ptr() for t in tensors]

    kw = dict(drafter=hyb, k=3, stop_token_ids=())
    first = generate(m, PROMPTS, 10, **kw)
    before = ptrs(3)
    generate(m, PROMPTS[:2], 10, **kw)
    again = generate(m, PROMPTS, 10, **kw)
    assert ptrs(3) == before
    assert again.tokens == first.tokens


# ------------------------------------------------------------------------------ continuous batching
def _ragged_requests(n=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, V, (int(k),), generator=g).tolist() for k in torch.randint(1, 30, (n,), generator=g)]
    return prompts, [5, 17, 1, 30, 8, 12, 3, 25, 9][:n]


def _continuous(m, requests, batch, **kw):
    got = {}
    stats = generate_continuous(m, requests, lambda r, toks, why: got.__setitem__(r.tag, (toks, why)),
                                batch_size=batch, **kw)
    return [got[i] for i in range(len(got))], stats


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_continuous_batching_equals_one_at_a_time(llama, temperature):
    """Ragged prompts, different length caps, early stops (stop ids for every other request):
    each request's tokens equal generate() of it alone, whatever the batch and sync interval;
    sampled ones draw from their own seed (a request joins mid-chunk of the batch's uniforms)."""
    _, m = llama
    prompts, caps = _ragged_requests()
    kw = dict(rule="onehot", temperature=temperature, top_k=20) if temperature else {}
    alone = []
    for i, (p, n) in enumerate(zip(prompts, caps)):
        r = generate(m, [p], n, seed=[100 + i], stop_token_ids=[3, 27, 43] if i % 2 else (), **kw)
        alone.append((r.tokens[0], r.finish_reasons[0]))
    assert any(why == "stop" for _, why in alone) and any(why == "length" for _, why in alone)
    prefills = {}
    for batch, sync_every, refill_at, pipelined in [(1, 8, 1, False), (3, 4, 1, False), (4, 1, 1, False),
                                                    (4, 1, 3, False), (1, 8, 1, True), (3, 4, 1, True),
                                                    (4, 1, 3, True)]:
        reqs = [Request(p, n, seed=100 + i, stop_token_ids=[3, 27, 43] if i % 2 else (), tag=i)
                for i, (p, n) in enumerate(zip(prompts, caps))]
        got, stats = _continuous(m, reqs, batch, temperature=temperature, top_k=20, sync_every=sync_every,
                                 refill_at=refill_at, pipeline_harvest=pipelined)
        assert got == alone, (batch, sync_every, refill_at, pipelined)
        assert stats["requests"] == 9 and stats["tokens"] == sum(len(t) for t, _ in alone)
        if pipelined:
            continue
        prefills[refill_at] = stats["prefills"]
        if (batch, refill_at) == (3, 1):
            # slots are refilled: fewer decode steps than fixed batches that wait for their longest row
            assert stats["steps"] < sum(max(caps[i:i + 3]) - 1 for i in range(0, 9, 3))
    # free slots gathered before a refill: fewer, larger prefills, the same tokens
    assert prefills[3] < prefills[1]


def test_continuous_follow_ups_and_refusals(llama):
    """on_finish's next request (a conversation's next turn) is served; a request that does not
    fit the cache is refused by name."""
    _, m = llama
    seen = []

    def on_finish(r, toks, why):
        seen.append(r.tag)
        if r.tag < 3:
            return Request(r.prompt + toks + [5], 4, tag=r.tag + 10)
        return None

    for pipelined in (False, True):
        seen.clear()
        stats = generate_continuous(m, (Request([1, 2, 3], 4, tag=i) for i in range(3)), on_finish, batch_size=2,
                                    pipeline_harvest=pipelined)
        assert sorted(seen) == [0, 1, 2, 10, 11, 12] and stats["requests"] == 6
    with pytest.raises(ValueError, match="max_seq=160"):
        generate_continuous(m, [Request([1] * 150, 20)], lambda *a: None, batch_size=2)
    with pytest.raises(ValueError, match="batch_size 5"):
        generate_continuous(m, [], lambda *a: None, batch_size=5)
    with pytest.raises(ValueError, match="refill_at must be >= 1"):
        generate_continuous(m, [], lambda *a: None, batch_size=2, refill_at=0)


def test_hybrid_score_counts_what_the_target_accepted():
    """hybrid_score: each kept proposal's agreement with the emitted tokens (within the known count and
    its own num), folded into the running score only on rows where the n-gram was a candidate; the
    choice then goes to the n-gram only where its score is at least the head's."""
    from specheads.runtime.drafters.hybrid import hybrid_choice, hybrid_score

    ng = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    hd = torch.tensor([[1, 9, 9], [4, 5, 6], [7, 8, 9]])
    last = (ng.clone(), torch.tensor([3, 2, 3]), hd.clone(), torch.tensor([3, 3, 3]),
            torch.tensor([True, True, False]))
    emitted = torch.tensor([[1, 2, 3, 0], [4, 5, 6, 7], [7, 8, 9, 1]])
    score = torch.zeros(3, 2)
    hybrid_score(score, last, emitted, torch.tensor([4, 4, 4]), decay=0.5)
    # row 0: n-gram 3 agree, head 1; row 1: n-gram capped by its num (2), head 3; row 2: not a candidate
    assert score.tolist() == [[1.5, 0.5], [1.0, 1.5], [0.0, 0.0]]
    assert not last[4].any()                                     # consumed
    hybrid_score(score, (*last[:4], torch.tensor([True, False, False])), emitted, torch.tensor([2, 4, 4]), 0.5)
    assert score[0].tolist() == [1.75, 0.75]                     # only 2 tokens known: 2 against 1
    counts, use_ngram = torch.zeros(2, dtype=torch.long), torch.zeros(3, dtype=torch.bool)
    _, _, use = hybrid_choice(ng, torch.tensor([3, 3, 3]), torch.tensor([4, 4, 4]), hd, torch.tensor([3, 3, 3]),
                              torch.ones(3, dtype=torch.bool), counts, use_ngram, 3, score)
    assert use.tolist() == [True, False, True]                   # row 1: the head has done better
    _, _, fixed = hybrid_choice(ng, torch.tensor([3, 3, 3]), torch.tensor([4, 4, 4]), hd, torch.tensor([3, 3, 3]),
                                torch.ones(3, dtype=torch.bool), counts, use_ngram, 3)
    assert fixed.tolist() == [True, True, True]


def test_adaptive_hybrid_keeps_the_better_drafter(llama):
    """With a head that is always right (a second copy of the target as the draft model) and an
    n-gram allowed on any 1-token match, the fixed rule keeps taking the worse n-gram drafts; the
    adaptive one learns per row to keep the head. Both stay lossless."""
    from specheads.runtime.drafters import DraftModelDrafter

    hf, m = llama
    oracle = DraftModelDrafter(TargetModel.from_hf(hf, max_batch=4, max_seq=160))
    prompts = [NOVEL, REPETITIVE[:9] + NOVEL]
    plain = generate(m, prompts, 32, stop_token_ids=())
    taus = {}
    for adaptive in (False, True):
        hyb = HybridDrafter(oracle, NGramDrafter(1, 4, backend="host"), min_match=1, adaptive=adaptive)
        r = generate(m, prompts, 32, drafter=hyb, k=3, stop_token_ids=())
        assert r.tokens == plain.tokens
        taus[adaptive] = r.summary()["tau"]
        if adaptive:
            assert hyb.choice_counts()["head"] > hyb.choice_counts()["ngram"]
    alone = generate(m, prompts, 32, drafter=oracle, k=3, stop_token_ids=()).summary()["tau"]
    assert taus[True] > taus[False] and taus[True] >= 0.9 * alone, (taus, alone)


# ------------------------------------------------------------------------------ continuous batching with a drafter
def test_head_admit_equals_the_batch_prefill(llama):
    """A head drafter's first pass over requests admitted into rows of a running batch leaves the
    same roots and draft cache in those rows as the first pass of a batch prefill of the same prompts."""
    _, m = llama
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2][:7]]
    B = len(prompts)
    T = max(len(p) for p in prompts)
    lens = torch.tensor([len(p) for p in prompts])
    ids = torch.zeros(B, T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.tensor(p)
    head = _head("eagle3")
    out = m(ids, aux_layer_ids=[1, 2, 3], kv_len=T)
    nxt = torch.cat([ids[:, 1:], torch.zeros(B, 1, dtype=torch.long)], 1)
    nxt[torch.arange(B), lens - 1] = out.logits[torch.arange(B), lens - 1].argmax(-1)   # each row's first token

    def fresh():
        d = Eagle3Drafter(head)
        d.start(DraftContext(device=torch.device("cpu"), max_seq=m.max_seq, vocab_size=V, batch=B))
        return d

    whole = fresh()
    whole.update(Verified(start=torch.zeros(B, dtype=torch.long), count=lens, next_tokens=nxt, aux=out.aux))
    parts = fresh()
    for rows in ([2, 0], [1]):
        r = torch.tensor(rows)
        W = int(lens[r].max())
        parts.admit(r, Verified(start=torch.zeros(len(rows), dtype=torch.long), count=lens[r], next_tokens=nxt[r, :W],
                                aux=out.aux[r, :W]))
    for a, b in zip(whole.root(), parts.root()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert parts.cache.lengths.tolist() == lens.tolist()
    for b in range(B):
        n = int(lens[b])
        torch.testing.assert_close(whole.cache.k[0][b, :, :n], parts.cache.k[0][b, :, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(whole.cache.v[0][b, :, :n], parts.cache.v[0][b, :, :n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["ngram", "head", "hybrid", "eagle1", "mtp"])
def test_continuous_batching_with_a_drafter_equals_one_at_a_time(llama, kind):
    """Drafted continuous batching: each request's greedy tokens equal plain decoding of it alone,
    and it takes as many target forwards as when drafted alone (its drafts come from its own row's
    state: the head's admitted first pass, the n-gram's history, the hybrid's score, all reset when
    a request takes over a row)."""
    _, m = llama
    prompts, caps = _ragged_requests()
    prompts = [p + REPETITIVE[:i + 4] for i, p in enumerate(prompts)]       # something for the n-gram to copy
    head_kind = {"eagle1": "eagle1", "mtp": "mtp"}.get(kind, "eagle3")

    def drafter():
        ng = NGramDrafter(1, 4, backend="device")
        if kind == "ngram":
            return ng
        hd = drafter_for_head(_head(head_kind, draft_vocab=48 if head_kind == "eagle3" else None))
        return HybridDrafter(hd, ng, min_match=1) if kind == "hybrid" else hd

    stops = [3, 27, 43]
    alone, forwards = [], []
    for i, (p, n) in enumerate(zip(prompts, caps)):
        st = stops if i % 2 else ()
        plain = generate(m, [p], n, stop_token_ids=st)
        r = generate(m, [p], n, drafter=drafter(), k=3, stop_token_ids=st)
        assert r.tokens == plain.tokens
        alone.append((r.tokens[0], r.finish_reasons[0]))
        forwards.append(sum(1 for rec in r.records))
    d = drafter()
    for batch, sync_every, pipelined in [(3, 4, False), (4, 1, False), (3, 4, True)]:
        reqs = [Request(p, n, stop_token_ids=stops if i % 2 else (), tag=i) for i, (p, n) in enumerate(zip(prompts, caps))]
        got, stats = _continuous(m, reqs, batch, sync_every=sync_every, drafter=d, k=3, pipeline_harvest=pipelined)
        assert got == alone, (kind, batch, pipelined)
        assert [r.target_forwards for r in sorted(reqs, key=lambda r: r.tag)] == forwards, (kind, batch, pipelined)
        decode = sum(len(t) - 1 for t, _ in alone)
        assert stats["decode_tokens"] == decode and stats["row_steps"] == sum(forwards)
        assert stats["tau"] == pytest.approx(decode / sum(forwards))
    if kind == "ngram":
        assert stats["tau"] > 1.2           # the copied tails are drafted and accepted


def test_continuous_batching_refuses_host_drafters(llama):
    _, m = llama
    with pytest.raises(ValueError, match="host view"):
        generate_continuous(m, [Request([1, 2, 3], 4)], lambda *a: None, batch_size=2,
                            drafter=NGramDrafter(backend="host"))
    with pytest.raises(ValueError, match="'rejection' needs draft probabilities"):
        generate_continuous(m, [], lambda *a: None, batch_size=2, drafter=NGramDrafter(backend="device"),
                            temperature=0.7, rule="rejection")
    with pytest.raises(ValueError, match="does not fit temperature"):
        generate_continuous(m, [], lambda *a: None, batch_size=2, rule="rejection")
    with pytest.raises(ValueError, match="draft slots"):
        generate_continuous(m, [Request([1] * 140, 18)], lambda *a: None, batch_size=2,
                            drafter=NGramDrafter(backend="device"), k=3)


@pytest.mark.parametrize("kind,rule", [("ngram", "onehot"), ("head", "rejection"), ("hybrid", "rejection")])
def test_sampled_continuous_batching_with_a_drafter_equals_one_at_a_time(llama, kind, rule):
    """Sampled drafting under continuous batching: each request draws its uniforms from its own
    seed in its own order, so its tokens equal the same drafter's sampled run of it alone."""
    _, m = llama
    prompts, caps = _ragged_requests()

    def drafter():
        ng = NGramDrafter(1, 4, backend="device")
        if kind == "ngram":
            return ng
        hd = drafter_for_head(_head("eagle3", draft_vocab=48))
        return HybridDrafter(hd, ng, min_match=1) if kind == "hybrid" else hd

    kw = dict(temperature=0.9, top_k=20)
    alone = []
    for i, (p, n) in enumerate(zip(prompts, caps)):
        r = generate(m, [p], n, drafter=drafter(), k=3, rule=rule, seed=[100 + i], stop_token_ids=(), **kw)
        alone.append((r.tokens[0], r.finish_reasons[0]))
    for pipelined in (False, True):
        reqs = [Request(p, n, seed=100 + i, stop_token_ids=(), tag=i) for i, (p, n) in enumerate(zip(prompts, caps))]
        got, _ = _continuous(m, reqs, 3, sync_every=2, drafter=drafter(), k=3, rule=rule, pipeline_harvest=pipelined,
                             **kw)
        assert got == alone, pipelined
