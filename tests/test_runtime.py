"""Runtime: engine forward vs HF, KV rollback/compaction, trees, drafters, generate, metrics."""

import os

import torch

if not torch.cuda.is_available():
    # transformers' Llama imports triton: on a CPU machine triton must come up in interpreter mode
    # for tests/test_kernels_verify.py collected after this file (it sets the same default)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,  # noqa: E402
                          Qwen3ForCausalLM)

from specheads.runtime.drafters import (DraftModelDrafter, Drafter, Eagle1Drafter, Eagle3Drafter, MTPDrafter,
                                        NGramDrafter, Proposal)
from specheads.runtime.engines.static import generate
from specheads.runtime.metrics import StepRecord, summarize
from specheads.runtime.model import TargetModel, rope_inv_freq
from specheads.runtime.tree import (DraftTree, Expansion, TreeConfig, ancestor_mask, ancestor_mask_reference,
                                    build_dynamic_tree, build_tree_reference, tree_paths)

V = 64
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


def tiny(kind="llama", seed=0):
    torch.manual_seed(seed)
    common = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(rope_scaling=LLAMA3, **common)).eval()
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**common)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**common)).eval()


@pytest.fixture(scope="module")
def llama():
    hf = tiny("llama")
    return hf, TargetModel.from_hf(hf, max_batch=4, max_seq=160)


PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 10, 11, 12, 13]]


def hf_greedy(hf, prompt, n):
    ids = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return ids[0, len(prompt):].tolist()


# ------------------------------------------------------------------------------------------ engine
@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2"])
def test_engine_matches_hf(kind):
    hf = tiny(kind)
    m = TargetModel.from_hf(hf, max_batch=2, max_seq=64)
    assert torch.equal(m.inv_freq, hf.model.rotary_emb.inv_freq.float())
    ids = torch.randint(0, V, (2, 12))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    out = m(ids, aux_layer_ids=[0, 2, 4], return_final=True)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=1e-4)
    aux_ref = torch.cat([ref.hidden_states[i] for i in (0, 2, 4)], -1)
    torch.testing.assert_close(out.aux, aux_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.final, ref.hidden_states[-1], atol=1e-4, rtol=1e-4)
    # incremental: prefill 7, then 3 + 1 + 1
    m.reset()
    got, t = [], 0
    for n in (7, 3, 1, 1):
        got.append(m(ids[:, t:t + n]).logits)
        m.commit(n)
        t += n
    torch.testing.assert_close(torch.cat(got, 1), ref.logits, atol=1e-4, rtol=1e-4)


def test_rope_llama3_matches_hf():
    hf = tiny("llama")
    inv, scale = rope_inv_freq(16, 10000.0, LLAMA3)
    torch.testing.assert_close(inv, hf.model.rotary_emb.inv_freq.float())
    assert scale == 1.0


def test_per_row_lengths_and_rollback(llama):
    hf, m = llama
    a, b = torch.randint(0, V, (1, 10)), torch.randint(0, V, (1, 6))
    with torch.no_grad():
        ra, rb = hf(a).logits, hf(b).logits
    m.reset()
    ids = torch.zeros(2, 10, dtype=torch.long)
    ids[0], ids[1, :6] = a[0], b[0]
    m(ids)                                   # right-padded prefill, row 1 writes garbage at 6..9
    m.set_lengths([7, 4])
    m(torch.randint(0, V, (2, 3)))           # speculative junk at 7..9 / 4..6
    m.set_lengths([7, 4])                    # rollback
    out = m(torch.stack([a[0, 7:10], torch.cat([b[0, 4:6], torch.tensor([0])])]))
    torch.testing.assert_close(out.logits[0], ra[0, 7:10], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.logits[1, :2], rb[0, 4:6], atol=1e-4, rtol=1e-4)


def test_tree_forward_and_compaction(llama):
    """Each tree node's logits equal HF's on prompt + its path; after compacting an accepted
    path the cache continues exactly like a plain sequence."""
    hf, m = llama
    prompt = torch.randint(0, V, (1, 9))
    parents = torch.tensor([[-1, -1, 0, 0, 1, 2, 5]])
    tokens = torch.randint(0, V, (1, 7))
    depths = torch.tensor([[1, 1, 2, 2, 2, 3, 4]])
    tr = DraftTree(tokens=tokens, parents=parents, depths=depths)
    m.reset()
    m(prompt[:, :8])
    m.set_lengths([8])
    root = prompt[:, 8:9]
    L = torch.tensor([8])
    inp = torch.cat([root, tokens], 1)
    out = m(inp, tr.positions(L), L[:, None] + torch.arange(8), tr.ancestor_mask())
    paths = tree_paths(tr)
    for i, path in enumerate(paths):
        seq = torch.cat([prompt, torch.tensor([path])], 1)
        with torch.no_grad():
            ref = hf(seq).logits[0, -1]
        torch.testing.assert_close(out.logits[0, i + 1], ref, atol=1e-4, rtol=1e-4)
    # accept root -> idx 0 -> idx 2 -> idx 5 -> idx 6 (slots 8, 9, 11, 14, 15)
    m.compact(torch.tensor([[8, 9, 11, 14, 15]]), L)
    m.set_lengths([13])
    nxt = torch.randint(0, V, (1, 2))
    got = m(nxt).logits
    seq = torch.cat([prompt, tokens[:, [0, 2, 5, 6]], nxt], 1)
    with torch.no_grad():
        ref = hf(seq).logits[0, -2:]
    torch.testing.assert_close(got[0], ref, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------ trees
def test_ancestor_mask_matches_reference():
    parents = [-1, -1, 0, 0, 1, 2, 5, 5, -1]
    m = ancestor_mask(torch.tensor([parents]))
    assert m[0].tolist() == ancestor_mask_reference(parents)


@pytest.mark.parametrize("cfg", [TreeConfig(1, 3, 2), TreeConfig(3, 2, 5), TreeConfig(4, 3, 12), TreeConfig(3, 3, 21)])
def test_dynamic_tree_matches_reference(cfg):
    g = torch.Generator().manual_seed(1)
    table = {}

    def lp(path):                       # a fixed random draft distribution per path
        if path not in table:
            table[path] = torch.randn(20, generator=g).mul(3).log_softmax(-1)
        return table[path]

    B = 2

    def lp_row(b, path):                # row 1 has its own distributions: rows stay independent
        return lp(path) if b == 0 else lp(("r1",) + path)

    front = {b: [()] for b in range(B)}  # frontier paths, tracked through parent_slot

    def expand_tracking(e: Expansion):
        out = []
        for b in range(B):
            prev = front[b]
            cur = []
            for j in range(e.tokens.shape[1]):
                parent_path = prev[0] if e.level == 1 else prev[int(e.parent_slot[b, j])]
                cur.append(parent_path + (int(e.tokens[b, j]),))
            front[b] = cur
            out.append(torch.stack([lp_row(b, p) for p in cur]))
        return torch.stack(out)

    root_lp = torch.stack([lp_row(b, ()) for b in range(B)])
    tree = build_dynamic_tree(root_lp, expand_tracking, cfg)
    assert tree.tokens.shape == (B, cfg.total_tokens)
    for b in range(B):
        ref = build_tree_reference(lambda p, b=b: lp_row(b, p).tolist(), cfg)
        assert tree_paths(tree, b) == [p for p, _ in ref]
        assert all(par < i for i, par in enumerate(tree.parents[b].tolist()))


def test_tree_config_validation():
    with pytest.raises(ValueError):
        TreeConfig(2, 2, 7).validate()            # only 2 + 4 candidates
    with pytest.raises(ValueError):
        TreeConfig(0, 2, 1).validate()


# ------------------------------------------------------------------------------------------ drafters
def test_ngram_lookup():
    d = NGramDrafter(min_ngram=1, max_ngram=3)
    #          0  1  2  3  4  5  6  7  8  9
    hist = [5, 6, 7, 8, 5, 6, 9, 1, 5, 6]
    assert d.lookup(hist, 3) == [9, 1, 5]          # "5 6" right-most earlier match at 4
    assert d.lookup([1, 2, 3, 2, 3], 2) == [2, 3]  # longest: "2 3" at 1 -> [2, 3]
    assert d.lookup([1, 2, 3, 4], 3) == []         # no match
    assert d.lookup([4, 4], 5) == [4]              # proposes what exists
    assert NGramDrafter(2, 3).lookup([1, 2, 3, 1], 2) == []


class OracleChain(Drafter):
    """Proposes the known greedy continuation with a wrong token at every 3rd step."""
    def __init__(self, refs, prompts):
        self.full = [p + r for p, r in zip(prompts, refs)]
        self.n = 0

    def propose(self, ctx, k):
        toks, num = torch.zeros(ctx.batch, k, dtype=torch.long), []
        self.n += 1
        for b, h in enumerate(ctx.histories):
            cont = self.full[b][len(h):len(h) + k]
            if self.n % 3 == 0 and cont:
                cont[len(cont) // 2] = (cont[len(cont) // 2] + 1) % V
            toks[b, :len(cont)] = torch.tensor(cont, dtype=torch.long)
            num.append(len(cont) if b % 2 == 0 or self.n % 2 else 0)    # some rows/steps: no drafts
        return Proposal(toks, torch.tensor(num))


class OracleTree(Drafter):
    """A tree whose right answer sits on the *second* child at each level (slots not contiguous)."""
    supports_tree = True

    def __init__(self, refs, prompts):
        self.full = [p + r for p, r in zip(prompts, refs)]

    def propose_tree(self, ctx, cfg):
        toks, pars, deps = [], [], []
        for b, h in enumerate(ctx.histories):
            cont = self.full[b][len(h):len(h) + 3] + [0, 0, 0]
            t = [(cont[0] + 1) % V, cont[0], (cont[1] + 1) % V, cont[1], cont[2]]
            toks.append(t)
            pars.append([-1, -1, 1, 1, 3])
            deps.append([1, 1, 2, 2, 3])
        return DraftTree(torch.tensor(toks), torch.tensor(pars), torch.tensor(deps))


def test_greedy_drafted_equals_plain(llama):
    hf, m = llama
    n = 24
    refs = [hf_greedy(hf, p, n) for p in PROMPTS]
    plain = generate(m, PROMPTS, n, stop_token_ids=())
    assert plain.tokens == refs
    assert plain.summary()["tau"] == 1.0
    for drafter, kw in [(NGramDrafter(1, 3), {"k": 3}), (OracleChain(refs, PROMPTS), {"k": 4}),
                        (OracleTree(refs, PROMPTS), {"tree": TreeConfig(3, 2, 5)})]:
        r = generate(m, PROMPTS, n, drafter=drafter, stop_token_ids=(), **kw)
        assert r.tokens == refs, type(drafter).__name__
    assert r.summary()["tau"] > 3.0                          # the oracle tree is accepted to depth 3


def test_batched_equals_single(llama):
    _, m = llama
    batched = generate(m, PROMPTS, 16, drafter=NGramDrafter(1, 3), k=3, stop_token_ids=())
    for i, p in enumerate(PROMPTS):
        single = generate(m, [p], 16, drafter=NGramDrafter(1, 3), k=3, stop_token_ids=())
        assert single.tokens[0] == batched.tokens[i]
    # sampling: per-request generators make rows independent of batching
    kw = dict(drafter=NGramDrafter(1, 3), k=3, rule="onehot", temperature=0.9, top_k=20, stop_token_ids=())
    sb = generate(m, PROMPTS, 16, seed=[11, 12, 13], **kw)
    for i, p in enumerate(PROMPTS):
        assert generate(m, [p], 16, seed=[11 + i], **kw).tokens[0] == sb.tokens[i]
    assert generate(m, PROMPTS, 16, seed=[11, 12, 13], **kw).tokens == sb.tokens


def test_stop_tokens_finish_rows_independently(llama):
    _, m = llama
    plain = generate(m, PROMPTS, 12, stop_token_ids=())
    stop = plain.tokens[1][4]
    r = generate(m, PROMPTS, 12, drafter=NGramDrafter(1, 3), k=3, stop_token_ids=[stop])
    for i, toks in enumerate(plain.tokens):
        cut = toks.index(stop) + 1 if stop in toks else len(toks)
        assert r.tokens[i] == toks[:cut]
        assert r.finish_reasons[i] == ("stop" if stop in toks else "length")


def _head(kind, draft_vocab=None):
    from specheads.heads import HeadConfig, build_head
    torch.manual_seed(3)
    cfg = HeadConfig(kind=kind, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     target_vocab_size=V, draft_vocab_size=draft_vocab,
                     aux_layer_ids=[1, 2, 3] if kind == "eagle3" else [])
    head = build_head(cfg).eval()
    if draft_vocab:
        keep = torch.sort(torch.randperm(V, generator=torch.Generator().manual_seed(0))[:draft_vocab]).values
        head.set_vocab_mapping(keep - torch.arange(draft_vocab))
    return head


@pytest.mark.parametrize("kind,cls,dv", [("eagle3", Eagle3Drafter, 48), ("eagle1", Eagle1Drafter, None),
                                         ("mtp", MTPDrafter, None)])
def test_head_drafters_lossless_greedy(llama, kind, cls, dv):
    _, m = llama
    plain = generate(m, PROMPTS, 16, stop_token_ids=())
    head = _head(kind, dv)
    chain = generate(m, PROMPTS, 16, drafter=cls(head), k=3, stop_token_ids=())
    tree = generate(m, PROMPTS, 16, drafter=cls(head), tree=TreeConfig(3, 2, 5), stop_token_ids=())
    assert chain.tokens == plain.tokens
    assert tree.tokens == plain.tokens
    s = chain.summary()
    assert s["proposed"] == 3 * s["forwards_with_drafts"]
    # sampled runs are deterministic
    kw = dict(drafter=cls(head), k=2, rule="rejection", temperature=0.8, seed=5, stop_token_ids=())
    assert generate(m, PROMPTS, 8, **kw).tokens == generate(m, PROMPTS, 8, **kw).tokens
    kw = dict(drafter=cls(head), tree=TreeConfig(2, 2, 4), rule="tree_target_only", temperature=0.8, seed=5,
              stop_token_ids=())
    assert generate(m, PROMPTS, 8, **kw).tokens == generate(m, PROMPTS, 8, **kw).tokens


def test_eagle3_drafter_matches_head_without_cache(llama):
    """The first draft pass through the runtime's cache equals the head's plain causal forward."""
    _, m = llama
    head = _head("eagle3", 48)
    d = Eagle3Drafter(head)
    out = m(torch.tensor([PROMPTS[0]]), aux_layer_ids=d.aux_layer_ids)
    from specheads.runtime.drafters import DraftContext, Verified
    ctx = DraftContext(histories=[list(PROMPTS[0])], active=[True], device=torch.device("cpu"), max_seq=64,
                       vocab_size=V)
    d.start(ctx)
    nxt = torch.tensor([PROMPTS[0][1:] + [0]])
    d.update(Verified(torch.tensor([0]), torch.tensor([len(PROMPTS[0])]), nxt, aux=out.aux))
    lg, h, _ = d.root()                      # update() ran the first pass; its last position is the root
    pos = torch.arange(nxt.shape[1])[None]
    with torch.no_grad():
        ref_lg, ref_h = head.forward_step(nxt, head.project(out.aux), pos)
    torch.testing.assert_close(lg[0].float(), ref_lg[0, -1].float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h[0], ref_h[0, -1], atol=1e-5, rtol=1e-5)


def test_draft_model_drafter(llama):
    hf, m = llama
    dm = TargetModel.from_hf(hf, max_batch=4, max_seq=160)       # the target as its own draft
    r = generate(m, PROMPTS, 12, drafter=DraftModelDrafter(dm), k=3, stop_token_ids=())
    assert r.tokens == generate(m, PROMPTS, 12, stop_token_ids=()).tokens
    assert r.summary()["acceptance_rate"] == 1.0
    r = generate(m, PROMPTS, 12, drafter=DraftModelDrafter(dm), k=3, rule="rejection", temperature=0.7,
                 stop_token_ids=())
    assert r.summary()["acceptance_rate"] > 0.99          # q == p: every draft accepted


def test_bad_inputs(llama):
    _, m = llama
    ng = NGramDrafter()
    cases = [
        dict(prompts_token_ids=[list(range(1, 60)) * 3], max_new_tokens=4),          # longer than the cache
        dict(prompts_token_ids=[[1, 2]], max_new_tokens=159),                        # does not fit
        dict(prompts_token_ids=[[1, 2]], max_new_tokens=4, drafter=ng, k=0),
        dict(prompts_token_ids=[[1, 2]], max_new_tokens=4, drafter=ng, k=99),
        dict(prompts_token_ids=[[1, 2]], max_new_tokens=4, rule="nope"),
        dict(prompts_token_ids=[[1, 2]], max_new_tokens=4, drafter=ng, rule="onehot", temperature=0.0),
        dict(prompts_token_ids=[[1, 2]], max_new_tokens=4, drafter=ng, rule="rejection", temperature=1.0),
        dict(prompts_token_ids=[[1, 2]], max_new_tokens=4, drafter=ng, rule="greedy", temperature=1.0),
        dict(prompts_token_ids=[[1, 2]], max_new_tokens=4, drafter=ng, tree=TreeConfig(2, 2, 4)),
        dict(prompts_token_ids=[[1, 2]] * 5, max_new_tokens=4),                       # > max_batch
        dict(prompts_token_ids=[[]], max_new_tokens=4),
    ]
    for c in cases:
        with pytest.raises(ValueError):
            generate(m, **c)


# ------------------------------------------------------------------------------------------ metrics
def test_metrics_formulas():
    recs = [
        StepRecord(0, 0, num_proposed=3, num_accepted=3, num_emitted=4, accepted_per_pos=[True] * 3),
        StepRecord(0, 1, num_proposed=3, num_accepted=1, num_emitted=2, accepted_per_pos=[True, False, False]),
        StepRecord(0, 2, num_proposed=0, num_accepted=0, num_emitted=1),           # no drafts this forward
        StepRecord(1, 0, num_proposed=2, num_accepted=0, num_emitted=1, accepted_per_pos=[False, False]),
    ]
    s = summarize(recs, elapsed_s=2.0, generated_tokens=8)
    assert s["tau"] == pytest.approx((4 + 2 + 1 + 1) / 4)                 # all forwards
    assert s["vllm_mean_acceptance_length"] == pytest.approx(1 + 4 / 3)   # only forwards with drafts
    assert s["acceptance_rate"] == pytest.approx(4 / 8)
    assert s["alpha"] == pytest.approx([2 / 3, 1 / 2, 1 / 1])
    assert s["accepted_per_pos_rate"] == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    assert s["tokens_per_s"] == 4.0
    assert s["decode_forwards"] == 4 and s["forwards_with_drafts"] == 3


# ------------------------------------------------------------------------------------------ SmolLM2
@pytest.fixture(scope="module")
def smol(smollm2):
    return smollm2, TargetModel.from_hf(smollm2.model, max_batch=2, max_seq=256)


@pytest.mark.slow
def test_smollm2_logits_match_hf(smol):
    t, m = smol
    ids = t.tokenizer("The capital of France is Paris. The capital of Italy is", return_tensors="pt").input_ids
    with torch.no_grad():
        ref = t.model(ids).logits
    m.reset()
    n = ids.shape[1] - 3
    pre = m(ids[:, :n]).logits
    m.commit(n)
    dec = []
    for i in range(n, ids.shape[1]):
        dec.append(m(ids[:, i:i + 1]).logits)
        m.commit(1)
    got = torch.cat([pre] + dec, 1)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_smollm2_ngram_greedy_equals_plain(smol):
    t, m = smol
    msgs = ["Repeat the list: apple, banana, cherry, apple, banana, cherry.", "Write a Python function that adds two numbers."]
    prompts = [t.tokenizer.apply_chat_template([{"role": "user", "content": x}], add_generation_prompt=True,
                                               tokenize=True) for x in msgs]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    plain = generate(m, prompts, 32)
    ref = hf_greedy(t.model, prompts[0], len(plain.tokens[0]))
    assert plain.tokens[0] == ref
    spec = generate(m, prompts, 32, drafter=NGramDrafter(1, 3), k=3)
    assert spec.tokens == plain.tokens
    assert spec.summary()["tau"] >= 1.0
