"""Tests for specheads.heads (tiny random configs, CPU, fp32)."""
import pytest
import torch
import torch.nn.functional as F

from specheads.heads import (Eagle1Head, Eagle3Head, HeadConfig, MTPHead, StaticKVCache, build_ttt_mask,
                             ttt_forward)
from specheads.heads.layers import RotaryEmbedding

torch.set_num_threads(1)

H, I, NH, KV, VT, VD = 64, 96, 4, 2, 200, 128
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def e3cfg(**kw):
    base = dict(kind="eagle3", hidden_size=H, intermediate_size=I, num_attention_heads=NH, num_key_value_heads=KV,
                target_vocab_size=VT, draft_vocab_size=VD, aux_layer_ids=[2, 4, 6])
    base.update(kw)
    return HeadConfig(**base)


def randomize(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight") or ".norm." in name or name.endswith("_norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return m


def make_e3(seed=0, **kw):
    cfg = e3cfg(**kw)
    h = randomize(Eagle3Head(cfg), seed)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randperm(cfg.target_vocab_size, generator=g)[: cfg.draft_vocab_size].sort().values
    h.set_vocab_mapping(ids - torch.arange(cfg.draft_vocab_size))
    return h.eval()


# ----------------------------------------------------------------- layout
def shapes(m):
    return {k: tuple(v.shape) for k, v in m.state_dict().items()}


def test_eagle3_names_and_shapes_match_speculators_layout():
    h = make_e3()
    assert shapes(h) == {
        "embed_tokens.weight": (VT, H), "fc.weight": (H, 3 * H),
        "layers.0.input_layernorm.weight": (H,), "layers.0.hidden_norm.weight": (H,),
        "layers.0.self_attn.q_proj.weight": (NH * 16, 2 * H), "layers.0.self_attn.k_proj.weight": (KV * 16, 2 * H),
        "layers.0.self_attn.v_proj.weight": (KV * 16, 2 * H), "layers.0.self_attn.o_proj.weight": (H, NH * 16),
        "layers.0.post_attention_layernorm.weight": (H,), "layers.0.mlp.gate_proj.weight": (I, H),
        "layers.0.mlp.up_proj.weight": (I, H), "layers.0.mlp.down_proj.weight": (H, I),
        "norm.weight": (H,), "lm_head.weight": (VD, H), "d2t": (VD,), "t2d": (VT,),
    }
    assert h.d2t.dtype == torch.int64 and h.t2d.dtype == torch.bool
    assert not h.embed_tokens.weight.requires_grad
    assert "d2t" in h.state_dict() and "t2d" in h.state_dict()  # persistent buffers


def test_eagle3_variants_layout():
    h = Eagle3Head(e3cfg(qk_norm=True, num_layers=2, target_hidden_size=48, head_dim=32))
    s = shapes(h)
    assert s["fc.weight"] == (H, 3 * 48)
    assert s["layers.0.self_attn.q_norm.weight"] == (32,) and s["layers.0.self_attn.k_norm.weight"] == (32,)
    assert s["layers.0.self_attn.q_proj.weight"] == (NH * 32, 2 * H)
    assert s["layers.1.self_attn.q_proj.weight"] == (NH * 32, H)
    assert "layers.1.input_layernorm.weight" in s and "layers.1.hidden_norm.weight" not in s
    h2 = Eagle3Head(e3cfg(norm_before_fc=True))
    assert shapes(h2)["input_norm.weight"] == (3 * H,)
    h3 = Eagle3Head(e3cfg(fc_norm=True))
    assert shapes(h3)["fc_norm.2.weight"] == (H,)


def test_eagle1_layout():
    cfg = HeadConfig(kind="eagle1", hidden_size=H, intermediate_size=I, num_attention_heads=NH,
                     num_key_value_heads=KV, target_vocab_size=VT)
    s = shapes(Eagle1Head(cfg))
    assert s["fc.weight"] == (H, 2 * H) and s["fc.bias"] == (H,)
    assert "layers.0.input_layernorm.weight" not in s
    assert s["layers.0.post_attention_layernorm.weight"] == (H,)
    assert s["embed_tokens.weight"] == (VT, H) and s["lm_head.weight"] == (VT, H)
    assert "norm.weight" not in s


def test_mtp_layout():
    cfg = HeadConfig(kind="mtp", hidden_size=H, intermediate_size=I, num_attention_heads=NH,
                     num_key_value_heads=KV, target_vocab_size=VT, num_mtp_depths=2)
    s = shapes(MTPHead(cfg))
    for d in range(2):
        p = f"layers.{d}."
        assert s[p + "enorm.weight"] == (H,) and s[p + "hnorm.weight"] == (H,)
        assert s[p + "eh_proj.weight"] == (H, 2 * H)
        assert s[p + "shared_head.norm.weight"] == (H,)
        for n in ("input_layernorm", "post_attention_layernorm"):
            assert s[p + n + ".weight"] == (H,)
        assert s[p + "self_attn.q_proj.weight"] == (NH * 16, H)
        assert s[p + "mlp.down_proj.weight"] == (H, I)


# ----------------------------------------------------------------- config
def test_from_target_config_llama_and_qwen3():
    from transformers import LlamaConfig, Qwen3Config
    lc = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                     num_hidden_layers=8, vocab_size=256, rms_norm_eps=1e-5,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **{k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"}})
    c = HeadConfig.from_target_config(lc, "eagle3", draft_vocab_size=128, aux_layer_ids=[2, 4, 5])
    assert (c.hidden_size, c.head_dim, c.num_key_value_heads, c.target_vocab_size) == (64, 16, 2, 256)
    assert c.rope_theta == 500000.0 and c.rope_scaling["rope_type"] == "llama3" and not c.qk_norm
    assert c.rms_norm_eps == 1e-5 and c.target_num_layers == 8
    qc = Qwen3Config(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                     num_hidden_layers=4, vocab_size=256, head_dim=32)
    q = HeadConfig.from_target_config(qc, "eagle3", aux_layer_ids=[1, 2, 3])
    assert q.qk_norm and q.head_dim == 32 and q.rope_scaling is None and q.draft_vocab_size == 256
    assert HeadConfig.from_dict(q.to_dict()) == q
    with pytest.raises(ValueError):
        HeadConfig.from_dict({**q.to_dict(), "bogus": 1})


def test_llama3_rope_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    lc = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters={"rope_theta": 500000.0, **LLAMA3_ROPE})
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](lc, "cpu")
    ours = RotaryEmbedding(16, 500000.0, LLAMA3_ROPE).inv_freq
    torch.testing.assert_close(ours, ref.float())


# ----------------------------------------------------------------- TTT mask
def slow_ttt_mask(T, k, valid=None):
    m = torch.zeros(T, (k + 1) * T, dtype=torch.bool)
    for t in range(T):
        for j in range(k + 1):
            for s in range(T):
                if j == 0:
                    ok = s <= t and (valid is None or bool(valid[s]))
                else:
                    ok = s == t
                m[t, j * T + s] = ok
    return m


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_build_ttt_mask_matches_explicit(k):
    T = 6
    assert torch.equal(build_ttt_mask(T, k), slow_ttt_mask(T, k))
    am = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]])
    got = build_ttt_mask(T, k, am)
    for b in range(2):
        assert torch.equal(got[b], slow_ttt_mask(T, k, am[b]))


# ----------------------------------------------------------------- TTT forward
CONFIGS = {
    "llama": {},
    "two_layers_qk_norm_llama3_rope": dict(num_layers=2, qk_norm=True, rope_scaling=LLAMA3_ROPE, rope_theta=5e5),
    "norm_before_residual_norm_output": dict(norm_before_residual=True, norm_output=True, target_hidden_size=48),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ttt_forward_equals_step_by_step_inference(name):
    """ttt_forward logits == a slow chain-drafting run with a static KV cache:
    for each t, prefill step 0 over 0..t, then draft steps 1..K one token at a
    time at position t+k in cache slot t+k (what vLLM does)."""
    head = make_e3(**CONFIGS[name])
    cfg = head.cfg
    T, K = 7, 4  # steps 0..3
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VT, (1, T), generator=g)
    aux = torch.randn(1, T, 3 * cfg.target_hidden_size, generator=g)
    with torch.no_grad():
        fast = ttt_forward(head, ids, aux, steps=K)
        ids_pad = torch.cat([ids, torch.zeros(1, K + 1, dtype=torch.long)], dim=1)
        hid0 = head.project(aux)
        for t in range(T):
            cache = StaticKVCache.for_head(cfg, 1, T + K + 1)
            pos = torch.arange(t + 1)[None]
            lg, h = head.forward_step(ids_pad[:, 1: t + 2], hid0[:, : t + 1], pos, kv_cache=cache)
            torch.testing.assert_close(lg[0, t], fast[0][0, t], rtol=1e-4, atol=1e-4)
            h = h[:, t: t + 1]
            for k in range(1, K):
                p = torch.tensor([[t + k]])
                lg, h = head.forward_step(ids_pad[:, t + 1 + k: t + 2 + k], h, p, kv_cache=cache)
                torch.testing.assert_close(lg[0, 0], fast[k][0, t], rtol=1e-4, atol=1e-4)


def test_ttt_diag_equals_mask_impl_with_padding_and_grad():
    head = make_e3(num_layers=2)
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, VT, (2, 8), generator=g)
    aux = torch.randn(2, 8, 3 * H, generator=g)
    am = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    a, ha = ttt_forward(head, ids, aux, am, steps=4, return_hidden=True)
    b = ttt_forward(head, ids, aux, am, steps=4, impl="mask")
    # fp32 through two layers and four steps: the two impls sum in another order (1.4e-5 seen on one CPU kind)
    for x, y in zip(a, b):
        assert torch.isfinite(x).all()
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
    assert len(ha) == 4 and ha[0].shape == (2, 8, H)
    sum(x.float().logsumexp(-1).sum() for x in a).backward()
    assert head.fc.weight.grad is not None and head.embed_tokens.weight.grad is None
    # row 0 is unaffected by the padding of row 1 (no cross-row leakage)
    solo = ttt_forward(head, ids[:1], aux[:1], steps=4)
    torch.testing.assert_close(solo[3], a[3][:1], rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------- norm_before_residual
def rms(x, w, eps=1e-6):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("nbr", [False, True])
def test_norm_before_residual_hand_formula(nbr):
    head = make_e3(seed=3, norm_before_residual=nbr)
    L = head.layers[0]
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VT, (1, 1), generator=g)
    hidden = 3.0 * torch.randn(1, 1, H, generator=g)
    with torch.no_grad():
        logits, h_out = head.forward_step(ids, hidden, torch.zeros(1, 1, dtype=torch.long))
        e = rms(head.embed_tokens.weight[ids], L.input_layernorm.weight)
        x = rms(hidden, L.hidden_norm.weight)
        residual = x if nbr else hidden
        cat = torch.cat([e, x], -1)
        # one token: softmax over a single key is 1, so attention = o_proj(v) (v repeated per GQA group)
        v = cat @ L.self_attn.v_proj.weight.T
        v = v.view(1, 1, KV, 16).repeat_interleave(NH // KV, dim=2).reshape(1, 1, NH * 16)
        h = residual + v @ L.self_attn.o_proj.weight.T
        hn = rms(h, L.post_attention_layernorm.weight)
        mlp = (F.silu(hn @ L.mlp.gate_proj.weight.T) * (hn @ L.mlp.up_proj.weight.T)) @ L.mlp.down_proj.weight.T
        out = h + mlp
        ref_logits = rms(out, head.norm.weight) @ head.lm_head.weight.T
    torch.testing.assert_close(h_out, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


def test_norm_before_residual_flag_changes_output():
    a, b = make_e3(seed=3), make_e3(seed=3, norm_before_residual=True)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    ids = torch.randint(0, VT, (1, 5))
    aux = 3 * torch.randn(1, 5, 3 * H)
    with torch.no_grad():
        la, lb = ttt_forward(a, ids, aux, steps=1)[0], ttt_forward(b, ids, aux, steps=1)[0]
    assert (la - lb).abs().max() > 1e-3


# ----------------------------------------------------------------- misc
def test_init_from_target_and_draft_to_target():
    head = Eagle3Head(e3cfg())
    emb, lm = torch.randn(VT, H), torch.randn(VT, H)
    sel = torch.randperm(VT, generator=torch.Generator().manual_seed(4))[:VD].sort().values
    head.init_from_target(emb, lm, sel - torch.arange(VD))
    assert torch.equal(head.embed_tokens.weight, emb) and not head.embed_tokens.weight.requires_grad
    assert torch.equal(head.lm_head.weight, lm[sel])
    assert torch.equal(head.draft_to_target(torch.tensor([0, 5, VD - 1])), sel[[0, 5, VD - 1]])
    assert int(head.t2d.sum()) == VD and bool(head.t2d[sel].all())
    with pytest.raises(ValueError):
        head.set_vocab_mapping(None)  # draft < target needs d2t


def test_eagle1_and_mtp_forward():
    cfg = HeadConfig(kind="eagle1", hidden_size=H, intermediate_size=I, num_attention_heads=NH,
                     num_key_value_heads=KV, target_vocab_size=VT)
    e1 = randomize(Eagle1Head(cfg))
    ids, f = torch.randint(0, VT, (2, 5)), torch.randn(2, 5, H)
    pos = torch.arange(5)[None].expand(2, 5)
    logits, nxt = e1.forward_step(ids, f, pos)
    assert logits.shape == (2, 5, VT) and nxt.shape == (2, 5, H)
    torch.testing.assert_close(logits, nxt @ e1.lm_head.weight.T)
    mcfg = HeadConfig(kind="mtp", hidden_size=H, intermediate_size=I, num_attention_heads=NH,
                      num_key_value_heads=KV, target_vocab_size=VT, num_mtp_depths=2)
    m = randomize(MTPHead(mcfg))
    with torch.no_grad():
        lgs, hs = m.forward_train(ids, f)
        assert len(lgs) == 2 and lgs[1].shape == (2, 5, VT)
        # depth 1 at position 0 only depends on the prefix: compare with a 1-token run
        l0, h0 = m.forward_step(ids[:, 1:2], f[:, :1], pos[:, :1], depth=0)
        l1, _ = m.forward_step(ids[:, 2:3], h0, pos[:, :1], depth=1)
        torch.testing.assert_close(l1[:, 0], lgs[1][:, 0], rtol=1e-5, atol=1e-5)


def test_fused_projections_equal_the_separate_ones_and_stay_out_of_training():
    """fuse_projections (the runtime's drafters): q/k/v and gate/up as one GEMM each give the separate
    projections' outputs, are not saved, are refreshed in place after the parameters change, and a
    forward with autograd on (training) still runs through the parameters."""
    from specheads.heads.layers import fuse_projections
    head = make_e3(seed=3, attention_bias=True, mlp_bias=True)
    keys = set(head.state_dict())
    ids, hidden = torch.randint(0, VT, (2, 5)), torch.randn(2, 5, H)
    pos = torch.arange(5)[None].expand(2, 5)
    with torch.no_grad():
        ref = head.forward_step(ids, hidden, pos)
        fuse_projections(head)
        got = head.forward_step(ids, hidden, pos)
    attn, mlp = head.layers[0].self_attn, head.layers[0].mlp
    assert attn.qkv_weight is not None and set(head.state_dict()) == keys
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    # the parameters change: the next fuse refreshes the same buffer (captured graphs keep its address)
    buf = attn.qkv_weight
    with torch.no_grad():
        attn.k_proj.weight.mul_(0.5)
        changed = head.forward_step(ids, hidden, pos)[0]
        fuse_projections(head)
        refreshed = head.forward_step(ids, hidden, pos)[0]
    assert attn.qkv_weight is buf
    with torch.no_grad():
        attn.qkv_weight = attn.qkv_bias = mlp.gate_up_weight = mlp.gate_up_bias = None
        unfused = head.forward_step(ids, hidden, pos)[0]
    torch.testing.assert_close(refreshed, unfused, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(changed, unfused)                    # stale until refreshed
    # autograd on: the parameters, not the (re-fused) copies, get the gradient
    fuse_projections(head)
    head.forward_step(ids, hidden, pos)[0].float().square().mean().backward()
    assert attn.q_proj.weight.grad is not None and attn.q_proj.weight.grad.abs().sum() > 0
    assert mlp.gate_proj.weight.grad is not None and mlp.up_proj.weight.grad.abs().sum() > 0
