"""Suffix decoding (runtime/drafters/suffix.py): the suffix tree against brute-force counts, the draft
rule (longest match, counts, probability cutoff, spec factor, depth), the cache's global tree across
requests and its eviction bound; then the drafter in the runtime on a tiny random Llama (greedy
outputs equal plain decoding in the static and continuous engines, drafts accepted on repetitive
prompts, sampled drafting keeps the target's distribution), the hybrid with suffix drafts, and eval."""

import random
from collections import Counter

import pytest
import torch

from specheads.evaluate.lossless import chi_square_two_sample
from specheads.runtime.drafters import (DRAFTER_KINDS, DraftContext, HybridDrafter, NGramDrafter, SuffixCache,
                                        SuffixDrafter, SuffixTree, Verified, forget_responses, make_drafter)
from specheads.runtime.engines.continuous import Request
from specheads.runtime.engines.static import generate
from specheads.runtime.model import TargetModel

from test_eval import _export_random_head, _recipe  # tests/ is on sys.path (rootdir conftest)
from test_runtime import PROMPTS, V, _head, tiny
from test_runtime_fast import REPETITIVE, _continuous, _ragged, _ragged_requests, llama  # noqa: F401 (fixture)


# ------------------------------------------------------------------------------ the tree
def _substrings(seqs, depth) -> Counter:
    c = Counter()
    for s in seqs:
        for i in range(len(s)):
            for n in range(1, min(depth, len(s) - i) + 1):
                c[tuple(s[i:i + n])] += 1
    return c


def _check_tree(tree: SuffixTree, seqs) -> None:
    """Every pattern's count is its number of occurrences; the structure holds its invariants: a child
    counts less than its node (equal counts are one edge), and there are at most two nodes a suffix."""
    for w, n in _substrings(seqs, tree.max_depth).items():
        assert tree.count(w) == n, (w, n, tree.count(w))
    assert tree.root.count == sum(len(s) for s in seqs)
    nodes, stack = 0, [tree.root]
    while stack:
        node = stack.pop()
        nodes += 1
        for key, child in node.children.items():
            assert child.parent is node and child.token == key and child.length >= 1
            assert 0 < child.count and (node is tree.root or child.count < node.count)
            stack.append(child)
    assert nodes <= 2 * tree.root.count + 1


@pytest.mark.parametrize("depth", [1, 2, 4, 24])
def test_suffix_tree_counts_equal_brute_force(depth):
    """Sequences grown a token at a time, interleaved, and removed: counts match a brute-force count of
    every substring up to the depth, over the sequences still in the tree."""
    rng = random.Random(depth)
    for trial in range(40):
        vocab = rng.choice([1, 2, 3, 6])                 # small vocabularies repeat a lot
        tree, seqs = SuffixTree(depth), {}
        for _ in range(rng.randint(1, 6)):
            if seqs and rng.random() < 0.3:
                sid = rng.choice(sorted(seqs))
                tree.remove(sid)
                del seqs[sid]
            else:
                for _ in range(rng.randint(1, 25)):
                    sid = rng.randint(0, 3)
                    tok = rng.randrange(vocab)
                    tree.append(sid, tok)
                    seqs.setdefault(sid, []).append(tok)
            _check_tree(tree, list(seqs.values()))
        for sid in list(seqs):
            tree.remove(sid)
        assert tree.root.count == 0 and not tree.root.children


def test_suffix_tree_memory_does_not_grow_with_depth():
    """A long novel sequence indexed twice: edges, not a node per token and depth."""
    seq = random.Random(0).choices(range(1000), k=3000)
    tree = SuffixTree(24)
    tree.extend(0, seq)
    tree.extend(1, seq)
    _check_tree(tree, [seq, seq])


def test_longest_match_and_counts():
    """The context's own last occurrence counts: "1 2" seen once before (then "3") and once at the end
    continues with probability 1/2; the two-token match scores higher than the one-token one."""
    tree = SuffixTree()
    tree.extend(0, [1, 2, 3, 1, 2])
    assert (tree.count((1, 2)), tree.count((1, 2, 3)), tree.count((2, 3, 1, 2)), tree.count((9,))) == (2, 1, 1, 0)
    d = tree.speculate([1, 2, 3, 1, 2], max_tokens=5)
    assert (d.tokens, d.probs, d.score, d.match_len) == ([3, 1], [0.5, 0.5], 1.0, 2)
    rep = [5, 6, 7, 8, 9] * 3 + [5, 6, 7]
    tree = SuffixTree()
    tree.extend(0, rep)
    d = tree.speculate(rep, max_tokens=8)
    assert d.tokens == [8, 9, 5, 6, 7, 8, 9, 5] and d.match_len == 8     # the longest match drafts the most
    assert d.probs[:5] == [pytest.approx(2 / 3)] * 5 and d.probs[5:] == [pytest.approx(1 / 3)] * 3
    assert tree.speculate([4, 4, 4], max_tokens=3).tokens == [] and tree.speculate([4], 3).match_len == 0


def test_most_frequent_continuation_and_probability_cutoff():
    """ "1 2" goes on with 3 (three times) or 4 (once) or ends (the context's end): 3 at 3/5, then "1" at
    the same probability; a cutoff above 3/5 drafts nothing; k caps the draft."""
    seq = [1, 2, 3] * 3 + [1, 2, 4, 1, 2]
    tree = SuffixTree()
    tree.extend(0, seq)
    d = tree.speculate(seq, max_tokens=5, min_token_prob=0.1)
    assert (d.tokens, d.probs, d.match_len) == ([3, 1], [0.6, 0.6], 2)
    assert tree.speculate(seq, 5, min_token_prob=0.6).tokens == [3, 1]
    assert tree.speculate(seq, 5, min_token_prob=0.61).tokens == []
    assert tree.speculate(seq, max_tokens=1).tokens == [3]


@pytest.mark.parametrize("factor,k,want", [(1.0, 5, [1]), (3.0, 5, [1, 2, 3]), (10.0, 4, [1, 2, 3, 4]), (0.5, 5, [])])
def test_spec_factor_scales_the_draft_with_the_match(factor, k, want):
    """Only "7" (one token) matches: the draft is at most floor(1 x factor) tokens long, and k."""
    seq = [7, 1, 2, 3, 4, 5, 9, 7]
    tree = SuffixTree()
    tree.extend(0, seq)
    assert tree.speculate(seq, k, max_spec_factor=factor).tokens == want


@pytest.mark.parametrize("vocab", [2, 5, 40])
def test_speculate_stopping_at_a_match_that_ends_its_sequence_changes_nothing(vocab):
    """speculate stops once the match's one occurrence ends its sequence (the context's own end, most
    often), where the stated rule tries every longer match: the drafts are the same, token for token,
    with the same probabilities and match lengths."""
    rng = random.Random(vocab)
    for depth, k, factor, min_prob in [(24, 3, 1.0, 0.1), (6, 5, 2.0, 0.0), (12, 4, 0.5, 0.3)]:
        tree, seqs = SuffixTree(depth), [[] for _ in range(4)]
        for step in range(300):
            i = rng.randrange(4)
            if step % 97 == 96:            # an eviction: the sequence's suffixes go, nodes join their only child
                tree.remove(i)
                seqs[i] = []
            t = rng.randrange(vocab)
            seqs[i].append(t)
            tree.append(i, t)
            # the row's own context (its end indexed, as in a local tree) and a slice from inside a sequence
            # (its occurrence goes on, as a prompt's pattern in the global tree of earlier responses)
            j = rng.randrange(4)
            a = rng.randrange(len(seqs[j]) + 1)
            for ctx in (seqs[i][-depth:], seqs[j][max(0, a - depth):a] + [rng.randrange(vocab)] * (a % 2)):
                got = tree.speculate(ctx, k, factor, min_prob)
                want = tree.speculate(ctx, k, factor, min_prob, every_match=True)
                assert (got.tokens, got.probs, got.score, got.match_len) == \
                    (want.tokens, want.probs, want.score, want.match_len)


def test_tree_depth_bounds_match_plus_draft():
    rep = [5, 6, 7, 8, 9] * 3 + [5, 6, 7]
    tree = SuffixTree(max_depth=4)
    tree.extend(0, rep)
    d = tree.speculate(rep, max_tokens=8)
    assert (d.tokens, d.match_len) == ([8, 9], 2)          # "6 7" + 2 drafted: 4 tokens deep


# ------------------------------------------------------------------------------ the cache
def test_global_tree_serves_later_requests():
    """A finished request's response (not its prompt) drafts for the next request; a running one's too;
    without a global tree (max_cached_requests=0) only the request's own tokens draft."""
    for cached in (10, 0):
        cache = SuffixCache(24, cached)
        cache.start_request(0, [1, 2, 3])
        cache.add_active_response(0, [10, 11, 12, 13, 14, 15])
        cache.stop_request(0)
        cache.start_request(1, [50, 10, 11, 12])
        d = cache.speculate(1, cache.tokens(1), 5)
        assert d.tokens == ([13, 14, 15] if cached else []), cached
        assert cache.global_tree.count((1, 2)) == 0 and cache.tokens(1) == [50, 10, 11, 12]
    cache = SuffixCache()
    cache.start_request(0, [1])
    cache.add_active_response(0, [20, 21, 22])           # still running
    cache.start_request(1, [5, 20])
    assert cache.speculate(1, [5, 20], 3).tokens == [21]  # a one-token match drafts one token
    assert cache.speculate(1, [20], 3).tokens == []       # the context's last token is never the whole match
    assert set(cache.local_trees) == {0, 1}


def test_eviction_keeps_at_most_max_cached_requests():
    """Oldest first: the evicted response is gone from the global tree (counts as if never added), also
    when its request is still running (its later tokens are not cached)."""
    cache = SuffixCache(24, 2)
    responses = {0: [30, 31, 32], 1: [40, 41, 42, 43], 2: [50, 51]}
    for req in (0, 1, 2):
        cache.start_request(req, [req])
        cache.add_active_response(req, responses[req][:2])
    assert list(cache.cached) == [1, 2]
    for req in (0, 1, 2):
        cache.add_active_response(req, responses[req][2:])
    assert cache.global_tree.count((30,)) == 0 and cache.global_tree.count((41, 42, 43)) == 1
    _check_tree(cache.global_tree, [responses[1], responses[2]])
    assert cache.tokens(0) == [0, 30, 31, 32]             # its own tree still has it
    cache.start_request(3, [9])
    assert list(cache.cached) == [2, 3]
    _check_tree(cache.global_tree, [responses[2]])


# ------------------------------------------------------------------------------ the drafter
def _context(tokens, lengths, active):
    B = len(lengths)
    return DraftContext(batch=B, device="cpu", max_seq=tokens.shape[1], vocab_size=V, tokens=tokens,
                        lengths=torch.tensor(lengths), active_mask=torch.tensor(active))


def test_drafter_rows_start_stop_and_reset_on_admit():
    """The prompt's update starts a request per row; a row that goes inactive stops its request (its
    response stays cached); a request admitted into the row drafts from its own prompt, not the last
    one's, and still sees the cached response."""
    d = SuffixDrafter()
    toks, _ = _ragged([[1, 2, 3, 1, 2, 3], [7, 8, 9, 4]], 16)
    ctx = _context(toks, [6, 4], [True, True])
    d.start(ctx)
    d.update(Verified(start=torch.zeros(2, dtype=torch.long), count=torch.tensor([5, 3]), next_tokens=toks[:, 1:6]))
    p = d.propose(ctx, 3)
    assert p.num.tolist() == [3, 0] and p.tokens[0].tolist() == [1, 2, 3] and p.match_len.tolist() == [3, 0]
    assert d.cache.global_tree.count((3,)) == 1 and d.cache.global_tree.count((4,)) == 1   # first tokens only
    ctx.tokens[0, 6:8] = torch.tensor([1, 2])                # row 0 emits "1 2" and finishes
    ctx.lengths[0], ctx.active_mask[0] = 8, False
    d.update(Verified(start=torch.tensor([5, 3]), count=torch.tensor([2, 0]), next_tokens=toks[:, :3]))
    assert len(d.cache.local_trees) == 2         # a step's update (maybe inside a CUDA graph) reads nothing back
    d.host_step(ctx, 3)                          # the engine's call between steps: the trees take the step in
    assert len(d.cache.local_trees) == 1 and d.cache.global_tree.count((3, 1, 2)) == 1
    assert d.propose(ctx, 3).num.tolist() == [0, 0]
    ctx.tokens[0, :6] = torch.tensor([9, 1, 2, 8, 1, 2])     # a new request takes row 0: prompt + first token
    ctx.lengths[0], ctx.active_mask[0] = 6, True
    d.admit(torch.tensor([0]), Verified(start=torch.zeros(1, dtype=torch.long), count=torch.tensor([5]),
                                        next_tokens=ctx.tokens[:1, 1:6]))
    p = d.propose(ctx, 3)
    assert p.tokens[0, :p.num[0]].tolist() == [8, 1]         # its own "1 2 -> 8 1", not the last request's "-> 3"
    assert d.cache.tokens(d._req[0]) == [9, 1, 2, 8, 1, 2] and len(d.cache.local_trees) == 2
    assert d.cache.global_tree.count((3, 1, 2)) == 1 and d.cache.global_tree.count((9,)) == 0
    forget_responses(d)
    assert not d.cache.cached and d.propose(ctx, 3).num.tolist() == [0, 0]


def test_make_drafter_suffix_and_hybrid_free_half():
    assert DRAFTER_KINDS == ("ngram", "head", "hybrid", "suffix")
    s = make_drafter("suffix", suffix_decoding_max_tree_depth=8, suffix_decoding_max_cached_requests=3,
                     suffix_decoding_max_spec_factor=2.0, suffix_decoding_min_token_prob=0.3)
    assert (s.max_tree_depth, s.max_cached_requests, s.max_spec_factor, s.min_token_prob) == (8, 3, 2.0, 0.3)
    # its trees are served between steps (host_step), so its steps, and a hybrid's, are captured in graphs
    assert s.graph_safe and s.has_host_step and not s.provides_probs
    head = _head("eagle3", 48)
    hyb = make_drafter("hybrid", head, free="suffix", min_match=2)
    assert isinstance(hyb, HybridDrafter) and isinstance(hyb.ngram, SuffixDrafter) and hyb.graph_safe
    assert hyb.has_host_step and not make_drafter("hybrid", head).has_host_step
    assert hyb.choice_counts() == {"suffix": 0, "head": 0}
    plain_hybrid = make_drafter("hybrid", head)                # the n-gram half, as before
    assert isinstance(plain_hybrid.ngram, NGramDrafter) and plain_hybrid.choice_counts() == {"ngram": 0, "head": 0}
    with pytest.raises(ValueError, match="free="):
        make_drafter("hybrid", head, free="tree")
    for bad in (dict(max_tree_depth=1), dict(max_spec_factor=0), dict(min_token_prob=1.5)):
        with pytest.raises(ValueError):
            SuffixDrafter(**bad)


# ------------------------------------------------------------------------------ in the runtime
def test_static_greedy_equals_plain_and_drafts_are_accepted(llama):
    """Rows of different lengths that stop at different times: greedy outputs equal plain decoding;
    the repetitive prompt's copies are drafted and accepted, and a second call also drafts from the
    first call's responses (the global tree)."""
    _, m = llama
    prompts = PROMPTS + [REPETITIVE]
    for stops in ((), (3, 27, 43)):
        plain = generate(m, prompts, 24, stop_token_ids=stops)
        d = SuffixDrafter()
        first = generate(m, prompts, 24, drafter=d, k=4, stop_token_ids=stops)
        again = generate(m, prompts, 24, drafter=d, k=4, stop_token_ids=stops)
        assert first.tokens == again.tokens == plain.tokens, stops
        s1, s2 = first.summary(), again.summary()
        assert s1["accepted"] > 0 and s1["tau"] > 1.0
        assert s2["accepted"] > s1["accepted"]              # the same answers, now cached
        assert not d.cache.local_trees and len(d.cache.cached) == 2 * len(prompts)


def test_hybrid_with_suffix_greedy_equals_plain(llama):
    _, m = llama
    prompts = PROMPTS + [REPETITIVE]
    plain = generate(m, prompts, 20, stop_token_ids=())
    hyb = make_drafter("hybrid", _head("eagle3", 48), min_match=1, free="suffix")
    got = generate(m, prompts, 20, drafter=hyb, k=3, stop_token_ids=())
    assert got.tokens == plain.tokens and sum(hyb.choice_counts().values()) > 0
    assert hyb.choice_counts()["suffix"] > 0


def test_continuous_greedy_equals_plain(llama):
    """Finished rows refilled with new requests (stops, length caps, sync intervals, the harvest one
    block behind): each request's greedy tokens equal plain decoding of it alone."""
    _, m = llama
    prompts, caps = _ragged_requests()
    prompts = [p + REPETITIVE[:i + 4] for i, p in enumerate(prompts)]    # something to copy
    stops = [3, 27, 43]
    alone = []
    for i, (p, n) in enumerate(zip(prompts, caps)):
        r = generate(m, [p], n, stop_token_ids=stops if i % 2 else ())
        alone.append((r.tokens[0], r.finish_reasons[0]))
    for batch, sync_every, pipelined in [(3, 4, False), (4, 1, False), (3, 4, True)]:
        d = SuffixDrafter()
        reqs = [Request(p, n, stop_token_ids=stops if i % 2 else (), tag=i)
                for i, (p, n) in enumerate(zip(prompts, caps))]
        got, stats = _continuous(m, reqs, batch, sync_every=sync_every, drafter=d, k=3, pipeline_harvest=pipelined)
        assert got == alone, (batch, pipelined)
        assert stats["tau"] > 1.0 and not d.cache.local_trees and len(d.cache.cached) == len(prompts)
    # the hybrid of a head and the suffix drafter serves too (both halves restart a row on admit)
    hyb = make_drafter("hybrid", _head("eagle3", 48), min_match=1, free="suffix")
    reqs = [Request(p, n, stop_token_ids=stops if i % 2 else (), tag=i) for i, (p, n) in enumerate(zip(prompts, caps))]
    got, _ = _continuous(m, reqs, 3, sync_every=4, drafter=hyb, k=3)
    assert got == alone


def test_continuous_refuses_a_host_drafter_without_row_state(llama):
    _, m = llama
    with pytest.raises(ValueError, match="keeps no state per request"):
        _continuous(m, [Request([1, 2, 3], 4, tag=0)], 2, drafter=NGramDrafter(backend="host"), k=3)


def test_continuous_sampled_equals_alone_without_a_global_tree(llama):
    """Sampled: a request draws its uniforms from its own seed; with local trees only its drafts depend on
    its own tokens alone, so its tokens equal the same drafter's run of it alone."""
    _, m = llama
    prompts, caps = _ragged_requests()
    kw = dict(temperature=0.9, top_k=20)
    alone = []
    for i, (p, n) in enumerate(zip(prompts, caps)):
        r = generate(m, [p], n, drafter=SuffixDrafter(max_cached_requests=0), k=3, rule="onehot", seed=[100 + i],
                     stop_token_ids=(), **kw)
        alone.append((r.tokens[0], r.finish_reasons[0]))
    reqs = [Request(p, n, seed=100 + i, stop_token_ids=(), tag=i) for i, (p, n) in enumerate(zip(prompts, caps))]
    got, _ = _continuous(m, reqs, 3, sync_every=2, drafter=SuffixDrafter(max_cached_requests=0), k=3, rule="onehot",
                         **kw)
    assert got == alone


def test_sampled_drafting_keeps_the_target_distribution():
    """One-hot verification of suffix drafts (the global tree shared by 64 rows of one prompt, so drafts
    come from the other samples too): per position, the tokens' distribution is plain sampling's."""
    m = TargetModel.from_hf(tiny("llama"), max_batch=64, max_seq=64)
    prompt, n, kw = REPETITIVE[:12], 6, dict(rule="onehot", temperature=1.0, stop_token_ids=())
    plain, drafted, accepted = [], [], 0
    for s in range(5):
        plain += generate(m, [prompt] * 64, n, seed=1000 * s, **kw).tokens
        r = generate(m, [prompt] * 64, n, drafter=SuffixDrafter(), k=3, seed=5000 + 1000 * s, **kw)
        drafted += r.tokens
        accepted += r.summary()["accepted"]
    assert accepted > 0
    p_values = chi_square_two_sample(plain, drafted, n)
    assert min(p for p in p_values if p is not None) > 1e-3, p_values


# ------------------------------------------------------------------------------ eval
def test_eval_suffix_runs(tiny_target_dir, tmp_path):
    """--compare suffix and hybrid_suffix: a weightless run and one per head, greedy lossless; the vLLM
    side-by-side does not take suffix decoding yet."""
    from specheads.cli import build_parser, eval_recipe
    from specheads.evaluate.stage import EvalError, plan_runs, run_eval

    with pytest.raises(EvalError, match="compare=hybrid_suffix needs a head"):
        plan_runs(_recipe(tmp_path, "--compare", "hybrid_suffix"))
    with pytest.raises(EvalError, match="engine=vllm"):
        plan_runs(_recipe(tmp_path, "--compare", "suffix", "--engine", "vllm"))
    specs = plan_runs(_recipe(tmp_path, "--compare", "suffix", "--rule", "rejection", "--temperature", "0.7"))
    assert [(s.name, s.drafter, s.rule) for s in specs] == [("suffix k=3 onehot", "suffix", "onehot")]
    _export_random_head(tmp_path / "h", hidden=64, target_hidden=64)
    args = build_parser().parse_args([
        "eval", "--target", str(tiny_target_dir), "--prompts", "builtin:demo_prompts", "--out", str(tmp_path / "ev"),
        "--head", str(tmp_path / "h"), "--compare", "suffix", "--compare", "hybrid_suffix", "--limit", "2",
        "--max-new-tokens", "12"])
    rep = run_eval(eval_recipe(args))
    assert [r["name"] for r in rep["runs"]] == ["head k=3 greedy", "suffix k=3 greedy", "hybrid_suffix head k=3 greedy"]
    suffix, hybrid = rep["runs"][1], rep["runs"][2]
    assert suffix["drafter"] == "suffix decoding" and hybrid["drafter"].endswith(" + suffix decoding")
    for r in rep["runs"]:
        assert r["lossless"]["identical"] == r["lossless"]["total"] == 2, r["name"]
