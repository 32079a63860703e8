"""Runtime: the parallel drafters (P-EAGLE, DFlash) with tiny random heads on the tiny Llama target:
greedy identity (static and continuous engines), the sampled distribution (two-sample χ²), the
proposals against the heads' training forwards, and the refusals."""

import pytest
import torch

from specheads.heads import HeadConfig, build_head
from specheads.runtime.drafters import (DFlashDrafter, DraftContext, HybridDrafter, PEagleDrafter, Verified,
                                        drafter_for_head, make_drafter)
from specheads.runtime.engines.continuous import Request, generate_continuous
from specheads.runtime.engines.static import generate
from specheads.runtime.model import TargetModel
from specheads.runtime.tree import TreeConfig

from test_runtime import PROMPTS, V, tiny  # tests/ is on sys.path (rootdir conftest)
from test_runtime_fast import guarded_generate

TPF = 3          # tokens one forward drafts: P-EAGLE num_depths, DFlash block_size - 1
CLASSES = {"peagle": PEagleDrafter, "dflash": DFlashDrafter}


def _head(kind, draft_vocab=None, seed=3, keep=None):
    """A random head; ``keep``: its draft vocabulary's target ids (default: ``draft_vocab`` random ones)."""
    draft_vocab = len(keep) if keep is not None else draft_vocab
    torch.manual_seed(seed)
    extra = {"num_depths": TPF} if kind == "peagle" else {"block_size": TPF + 1, "num_layers": 2}
    cfg = HeadConfig(kind=kind, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     target_vocab_size=V, draft_vocab_size=draft_vocab, aux_layer_ids=[1, 2, 3], mask_token_id=V - 1,
                     **extra)
    head = build_head(cfg).eval()
    with torch.no_grad():
        for p in head.parameters():        # confident, non-trivial logits (default init is near uniform)
            torch.nn.init.normal_(p, std=0.2)
    if draft_vocab:
        keep = (torch.tensor(keep) if keep is not None else
                torch.sort(torch.randperm(V, generator=torch.Generator().manual_seed(0))[:draft_vocab]).values)
        head.set_vocab_mapping(keep - torch.arange(draft_vocab))
    return head


@pytest.fixture(scope="module")
def llama():
    return TargetModel.from_hf(tiny("llama"), max_batch=4, max_seq=160)


# ------------------------------------------------------------------------------ greedy identity
@pytest.mark.parametrize("kind,dv", [("peagle", 48), ("peagle", None), ("dflash", 48), ("dflash", None)])
def test_greedy_drafted_equals_plain(llama, kind, dv):
    m = llama
    d = CLASSES[kind](_head(kind, dv))
    for prompts in (PROMPTS[:1], PROMPTS):
        plain = generate(m, prompts, 20, stop_token_ids=())
        for k in range(1, TPF + 1):
            r = generate(m, prompts, 20, drafter=d, k=k, stop_token_ids=())
            assert r.tokens == plain.tokens, (kind, len(prompts), k)
            s = r.summary()
            assert s["proposed"] == k * s["forwards_with_drafts"]


def _repeated(m):
    """The two tokens the tiny target's greedy output repeats after PROMPTS[0] and PROMPTS[2]."""
    plain = generate(m, PROMPTS, 24, stop_token_ids=())
    rep = sorted({plain.tokens[0][-1], plain.tokens[2][-1]})
    assert len(rep) == 2
    return rep


@pytest.mark.parametrize("kind", ["peagle", "dflash"])
def test_greedy_accepted_drafts_equal_plain(llama, kind):
    """Drafts the target accepts (several per step): a head whose draft vocabulary is the two tokens
    the tiny target repeats (rows 0 and 2 of PROMPTS) drafts them often; output still equals plain."""
    m = llama
    plain = generate(m, PROMPTS, 24, stop_token_ids=())
    d = CLASSES[kind](_head(kind, keep=_repeated(m)))
    for k in (2, TPF):
        r = generate(m, PROMPTS, 24, drafter=d, k=k, stop_token_ids=())
        assert r.tokens == plain.tokens, k
        assert r.summary()["tau"] > 1.3, (k, r.summary())
        for p, toks in zip(PROMPTS, plain.tokens):
            assert generate(m, [p], 24, drafter=d, k=k, stop_token_ids=()).tokens[0] == toks


@pytest.mark.parametrize("kind", ["peagle", "dflash"])
def test_steps_make_no_host_sync(llama, kind):
    """graph_safe: a whole speculative step is device work (greedy and sampled)."""
    d = CLASSES[kind](_head(kind, 48))
    assert d.graph_safe
    plain = generate(llama, PROMPTS, 12, stop_token_ids=())
    assert guarded_generate(llama, PROMPTS, 12, drafter=d, k=TPF, stop_token_ids=()).tokens == plain.tokens
    kw = dict(drafter=d, k=TPF, rule="rejection", temperature=0.7, seed=[1, 2, 3], stop_token_ids=())
    assert guarded_generate(llama, PROMPTS, 12, **kw).tokens == generate(llama, PROMPTS, 12, **kw).tokens


def _ragged(n=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 25, (n,), generator=g)
    prompts = [torch.randint(1, V - 1, (int(k),), generator=g).tolist() for k in lens]
    return prompts, [5, 17, 1, 30, 8, 12, 3][:n]


@pytest.mark.parametrize("kind,wrap", [("peagle", False), ("dflash", False), ("dflash", True)])
def test_continuous_batching_equals_one_at_a_time(llama, kind, wrap):
    """Rows admitted into a running batch draft from their own rows of the draft cache: each
    request's greedy tokens (and target forwards) equal its drafted run alone, which equals plain."""
    m = llama
    prompts, caps = _ragged()
    prompts, caps = prompts + [PROMPTS[0], PROMPTS[2]], caps + [20, 26]     # these accept drafts
    head = _head(kind, keep=_repeated(m))

    def drafter():
        return make_drafter("hybrid" if wrap else "head", head, min_match=2, ngram_backend="device")

    alone, forwards = [], []
    for p, n in zip(prompts, caps):
        r = generate(m, [p], n, drafter=drafter(), k=TPF, stop_token_ids=())
        assert r.tokens == generate(m, [p], n, stop_token_ids=()).tokens
        alone.append((r.tokens[0], r.finish_reasons[0]))
        forwards.append(len(r.records))
    assert sum(forwards) < sum(caps)
    for batch, sync_every in [(1, 4), (3, 2)]:
        reqs = [Request(p, n, stop_token_ids=(), tag=i) for i, (p, n) in enumerate(zip(prompts, caps))]
        got = {}
        generate_continuous(m, reqs, lambda r, toks, why: got.__setitem__(r.tag, (toks, why)), batch_size=batch,
                            sync_every=sync_every, drafter=drafter(), k=TPF)
        assert [got[i] for i in range(len(prompts))] == alone, (kind, batch)
        assert [r.target_forwards for r in reqs] == forwards, (kind, batch)


# ------------------------------------------------------------------------------ sampled: the target's distribution
@pytest.fixture(scope="module")
def wide():
    return TargetModel.from_hf(tiny("llama", seed=1), max_batch=256, max_seq=48)


def _draws(m, n, seed0=0, **kw):
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    out = []
    for start in range(0, n, m.max_batch):
        b = min(m.max_batch, n - start)
        out += generate(m, [prompt] * b, 4, temperature=0.7, stop_token_ids=(),
                        seed=[seed0 + start + i for i in range(b)], **kw).tokens
    return out


@pytest.fixture(scope="module")
def plain_draws(wide):
    return _draws(wide, 512, rule="onehot")


@pytest.mark.parametrize("kind", ["peagle", "dflash"])
def test_sampled_drafting_keeps_the_target_distribution(wide, plain_draws, kind):
    """Two-sample χ² of tokens 1..4, drafted (rule 'rejection', each draft drawn from the q it
    reports) vs plain."""
    from specheads.evaluate.lossless import chi_square_two_sample
    drafted = _draws(wide, 512, seed0=100_000, drafter=CLASSES[kind](_head(kind, 48)), k=TPF, rule="rejection")
    p = chi_square_two_sample(plain_draws, drafted, 4)
    assert min(p) > 0.01 / len(p), p


# ------------------------------------------------------------------------------ proposals vs the training forwards
def _steps(T0=7, counts=(3, 1, 4, 2)):
    """A verified-length schedule: the prompt, then each step's accepted + bonus count."""
    ends = [T0]
    for c in counts:
        ends.append(ends[-1] + c)
    return ends


def _drive(d, ids, aux, ends, k, sample):
    """Feed the drafter the schedule ``ends`` of verified lengths over the sequence ``ids`` / ``aux``
    (padded columns of junk, as the engine passes) and collect each step's proposal."""
    g = torch.Generator().manual_seed(7)
    ctx = DraftContext(device=torch.device("cpu"), max_seq=64, vocab_size=V, batch=1, sample_drafts=sample,
                       temperature=1.0, active_mask=torch.tensor([True]))
    d.start(ctx)
    out, start, W = [], 0, TPF + 1
    for end in ends:
        width = end - start if start == 0 else W
        nxt = torch.randint(0, V, (1, width), generator=g)       # junk past count
        nxt[0, :end - start] = ids[0, start + 1:end + 1]
        ax = torch.randn(1, width, aux.shape[-1], generator=g)
        ax[0, :end - start] = aux[0, start:end]
        d.update(Verified(torch.tensor([start]), torch.tensor([end - start]), nxt, aux=ax))
        ctx.draft_u = torch.rand(1, k, generator=g)
        out.append(d.propose(ctx, k))
        start = end
    return out


def _target_probs(head, dl):
    """Draft-vocab logits [..., Vd] -> softmax over the target vocabulary."""
    q = torch.zeros(dl.shape[:-1] + (V,))
    ids = head.draft_to_target(torch.arange(dl.shape[-1]))
    return q.index_copy(-1, ids, dl.float().softmax(-1))


@pytest.mark.parametrize("dv", [48, None])
def test_peagle_proposals_match_parallel_forward(dv):
    head = _head("peagle", dv)
    ends = _steps()
    T = ends[-1] + 2
    g = torch.Generator().manual_seed(1)
    ids, aux = torch.randint(0, V, (1, T), generator=g), torch.randn(1, T, 3 * 64, generator=g)
    roots = [e - 1 for e in ends]               # the last verified position of each step
    anchor = torch.cat([torch.arange(T), torch.tensor(roots).repeat_interleave(TPF - 1)])[None]
    depth = torch.cat([torch.zeros(T, dtype=torch.long), torch.arange(1, TPF).repeat(len(roots))])[None]
    with torch.no_grad():
        ref = head.parallel_forward(ids, aux, anchor, depth)[0]
    masks = ref[T:].view(len(roots), TPF - 1, -1)               # each step's mask entries, depth 1..K-1
    ref = torch.cat([ref[roots][:, None], masks], 1)            # [steps, K, Vd]: the root, then the masks
    greedy = _drive(PEagleDrafter(head), ids, aux, ends, TPF, sample=False)
    sampled = _drive(PEagleDrafter(head), ids, aux, ends, TPF, sample=True)
    for i in range(len(ends)):
        assert greedy[i].tokens[0].tolist() == head.draft_to_target(ref[i].argmax(-1)).tolist(), i
        torch.testing.assert_close(sampled[i].probs[0], _target_probs(head, ref[i]), atol=1e-5, rtol=1e-4)
        assert sampled[i].probs[0].gather(-1, sampled[i].tokens[0][:, None]).min() > 0     # drawn from its q
    short = _drive(PEagleDrafter(head), ids, aux, ends, 2, sample=False)      # k < K: the first k of them
    assert [s.tokens[0].tolist() for s in short] == [g.tokens[0, :2].tolist() for g in greedy]


@pytest.mark.parametrize("dv", [48, None])
def test_dflash_proposals_match_block_forward(dv):
    head = _head("dflash", dv)
    ends = _steps()
    T = ends[-1] + 2
    g = torch.Generator().manual_seed(2)
    ids, aux = torch.randint(0, V, (1, T), generator=g), torch.randn(1, T, 3 * 64, generator=g)
    with torch.no_grad():               # block j anchors at the verified length: the bonus token's position
        ref = head.block_forward_train(ids, aux, torch.tensor([ends]))[0, :, 1:]       # [steps, S-1, Vd]
    greedy = _drive(DFlashDrafter(head), ids, aux, ends, TPF, sample=False)
    sampled = _drive(DFlashDrafter(head), ids, aux, ends, TPF, sample=True)
    for i in range(len(ends)):
        assert greedy[i].tokens[0].tolist() == head.draft_to_target(ref[i].argmax(-1)).tolist(), i
        torch.testing.assert_close(sampled[i].probs[0], _target_probs(head, ref[i]), atol=1e-5, rtol=1e-4)
    short = _drive(DFlashDrafter(head), ids, aux, ends, 1, sample=False)      # the whole block runs for k = 1
    assert [s.tokens[0].tolist() for s in short] == [g.tokens[0, :1].tolist() for g in greedy]


# ------------------------------------------------------------------------------ registry and refusals
@pytest.mark.parametrize("kind", ["peagle", "dflash"])
def test_registry_and_refusals(llama, kind):
    m = llama
    head = _head(kind, 48)
    d = drafter_for_head(head)
    assert type(d) is CLASSES[kind] and d.tokens_per_forward == TPF and not d.supports_tree
    assert type(make_drafter("head", head)) is CLASSES[kind]
    assert isinstance(make_drafter("hybrid", head), HybridDrafter)
    what = "num_depths" if kind == "peagle" else "block_size - 1"
    with pytest.raises(ValueError, match=rf"k=4 drafts per step.*drafts {TPF} tokens \({what} = {TPF}\)"):
        generate(m, PROMPTS, 8, drafter=d, k=TPF + 1, stop_token_ids=())
    with pytest.raises(ValueError, match="k=4 drafts per step"):
        generate(m, PROMPTS, 8, drafter=make_drafter("hybrid", head), k=TPF + 1, stop_token_ids=())
    with pytest.raises(ValueError, match="k=5 drafts per step"):
        generate_continuous(m, [], lambda *a: None, batch_size=2, drafter=d, k=TPF + 2)
    with pytest.raises(ValueError, match="cannot draft trees"):
        generate(m, PROMPTS, 8, drafter=d, tree=TreeConfig(3, 2, 5), rule="tree_target_only", temperature=0.7,
                 stop_token_ids=())
    generate(m, PROMPTS[:1], 4, drafter=d, k=1, stop_token_ids=())
    with pytest.raises(ValueError, match="chains only"):
        d.propose_tree(d.ctx, TreeConfig(3, 2, 5))
    with pytest.raises(ValueError, match="k=4 drafts per step"):
        d.propose(d.ctx, TPF + 1)


def test_dflash_block_must_fit_max_seq(llama):
    """DFlash runs its whole block whatever k: the block's slots count against max_seq."""
    m = llama
    d = DFlashDrafter(_head("dflash"))
    prompt = [1] * 140
    n = m.max_seq - len(prompt) - 1 - 1          # fits k = 1 drafts, not the 4-slot block
    generate(m, [prompt], n, drafter=PEagleDrafter(_head("peagle")), k=1, stop_token_ids=())
    with pytest.raises(ValueError, match=r"\+ 4 draft slots"):
        generate(m, [prompt], n, drafter=d, k=1, stop_token_ids=())
    with pytest.raises(ValueError, match=r"\+ 4 draft slots"):
        generate_continuous(m, [Request(prompt, n)], lambda *a: None, batch_size=2, drafter=d, k=1)
    r = generate(m, [prompt], n - 3, drafter=d, k=1, stop_token_ids=())
    assert r.tokens == generate(m, [prompt], n - 3, stop_token_ids=()).tokens


def test_eval_defaults_k_to_tokens_per_forward():
    """`specheads eval` on a parallel head without eval.k: k = the tokens one forward drafts."""
    from specheads.config import EvalConfig
    from specheads.evaluate.stage import RunSpec, _default_parallel_k
    for kind in ("peagle", "dflash"):
        d = make_drafter("head", _head(kind))
        spec = RunSpec("head k=3 greedy", "dir", k=3)
        _default_parallel_k(spec, d, EvalConfig())
        assert (spec.k, spec.name) == (TPF, f"head k={TPF} greedy")
        spec = RunSpec("hybrid head k=3 greedy", "dir", k=3, hybrid=True)
        _default_parallel_k(spec, make_drafter("hybrid", _head(kind)), EvalConfig())
        assert spec.k == TPF
        spec = RunSpec("head k=2 greedy", "dir", k=2)
        _default_parallel_k(spec, d, EvalConfig(k=2))          # an explicit k stays
        assert spec.k == 2
