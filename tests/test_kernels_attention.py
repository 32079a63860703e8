"""Decode attention over the static KV cache: Triton kernel vs PyTorch reference, and the engine
running on either (one kernel instead of SDPA's re-layouts, workspace memset and attention).

Runs the Triton kernel through triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is
imported); ``TRITON_INTERPRET=0`` on a CUDA machine tests the compiled kernel (bf16 on tensor cores).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from specheads import kernels  # noqa: E402
from specheads.kernels import attention_ref  # noqa: E402
from specheads.runtime.model import TargetModel, additive_mask, build_attn_mask  # noqa: E402
from specheads.runtime.tree import ancestor_mask_reference  # noqa: E402

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _case(B, T, H, KvH, D, S, NB, rows, dtype, tree=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    qk = torch.randn(B, T, H + KvH, D, generator=g).to(dtype)
    q = qk[:, :, :H]                                            # a strided view, as in the engine
    kc = torch.randn(NB, KvH, S + 16, D, generator=g).to(dtype)
    vc = torch.randn(NB, KvH, S + 16, D, generator=g).to(dtype)
    lengths = torch.randint(0, S - T, (B,), generator=g)
    wp = lengths[:, None] + torch.arange(T)
    attn = None
    if tree:                                                    # each node sees its ancestors: a random tree
        attn = torch.stack([torch.tensor(ancestor_mask_reference(
            [int(torch.randint(-1, i, (1,), generator=g)) for i in range(T - 1)])) for _ in range(B)])
    vis = build_attn_mask(lengths, wp, attn, S)
    mask = additive_mask(vis, dtype, H // KvH)
    r = torch.randperm(NB, generator=g)[:B] if rows else None
    return [x.to(DEVICE) if torch.is_tensor(x) else x for x in (q, kc, vc, mask, S, r)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T,H,KvH,D,S,NB,rows,tree", [
    (1, 1, 9, 3, 64, 48, 1, False, False),      # SmolLM2's heads, one decode token
    (8, 4, 9, 3, 64, 200, 8, False, False),     # a chain verification at batch 8 (k = 3)
    (3, 4, 9, 3, 64, 70, 5, True, False),       # rows anywhere in the cache (continuous batching)
    (2, 7, 8, 8, 32, 96, 2, False, True),       # no grouping, a token tree
    (2, 16, 8, 2, 128, 160, 3, False, True),    # Llama-8B's head dim, G*T = 64 (one program's most)
    (2, 19, 12, 2, 128, 160, 3, True, False),   # Qwen2's 6 query heads a KV head, a P-EAGLE K 16 first pass of
                                                # 4 + 15 slots: G*T = 114, two programs of 64 rows
    (1, 32, 8, 1, 64, 96, 1, False, True),      # G*T = 256, the kernel's most: four programs, a token tree
    (4, 1, 4, 2, 16, 16, 4, False, False),      # the smallest width
])
def test_kernel_matches_reference(dtype, B, T, H, KvH, D, S, NB, rows, tree):
    args = _case(B, T, H, KvH, D, S, NB, rows, dtype, tree)
    want = attention_ref.decode_attention(*args)
    got = kernels.decode_attention(*args, backend="triton")
    assert got.shape == (B, T, H * D) and got.dtype == dtype
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=TOL[dtype], rtol=TOL[dtype])


def test_unsupported_shapes_use_the_reference():
    # a prefill: G*T above the kernel's rows goes to the reference on any backend
    args = _case(2, 90, 9, 3, 64, 128, 2, False, torch.float32)
    assert not kernels.attention_supported(args[0].shape, 3)
    torch.testing.assert_close(kernels.decode_attention(*args, backend="triton"), attention_ref.decode_attention(*args))
    from specheads.kernels import attention_triton
    with pytest.raises(ValueError, match="query rows"):
        attention_triton.decode_attention(*args)


def _engines(hf, compile_layers=False):
    out = []
    for backend in ("torch", "triton"):
        m = TargetModel.from_hf(hf, max_batch=3, max_seq=96, device=DEVICE)
        for layer in m.layers:
            layer.attn_backend = backend
        out.append(m.compile_layers() if compile_layers and backend == "triton" else m)
    return out


@pytest.mark.parametrize("compile_layers", [False, True])
def test_engine_on_the_kernel_equals_the_reference(compile_layers):
    """The engine's forward (prefill, decode, a 4-token verify) with the kernel equals the reference
    path; compiled, the kernel runs as the custom op ``specheads::decode_attention``."""
    from test_runtime import tiny
    if compile_layers:
        torch._dynamo.reset()
    ref, ker = _engines(tiny("llama").to(DEVICE), compile_layers)
    ids = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    t = 0
    for n in (9, 1, 4, 1):
        a = ref(ids[:, t:t + n], aux_layer_ids=[1, 4])
        b = ker(ids[:, t:t + n], aux_layer_ids=[1, 4])
        torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b.aux, a.aux, atol=1e-5, rtol=1e-5)
        for m in (ref, ker):
            m.commit(n)
        t += n


def test_greedy_decoding_on_the_kernel_is_unchanged():
    from test_runtime import PROMPTS, tiny
    from specheads.runtime.drafters import NGramDrafter
    from specheads.runtime.engines.static import generate
    ref, ker = _engines(tiny("llama").to(DEVICE))
    plain = generate(ref, PROMPTS, 12, stop_token_ids=()).tokens
    assert generate(ker, PROMPTS, 12, stop_token_ids=()).tokens == plain
    assert generate(ker, PROMPTS, 12, drafter=NGramDrafter(), k=3, stop_token_ids=()).tokens == plain


def test_head_drafting_on_the_kernel(monkeypatch):
    """A head's own attention (the runtime's DraftCache) on the kernel drafts what it drafts on SDPA."""
    from test_runtime import PROMPTS, _head, tiny
    from specheads.runtime.drafters import Eagle3Drafter
    from specheads.runtime.engines.static import generate
    hf, head = tiny("llama").to(DEVICE), _head("eagle3", 48).to(DEVICE)
    got = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("SPECHEADS_KERNELS", backend)
        m = TargetModel.from_hf(hf, max_batch=3, max_seq=96, device=DEVICE)
        d = Eagle3Drafter(head)
        r = generate(m, PROMPTS, 12, drafter=d, k=3, stop_token_ids=())
        assert d.state.cache.attn_backend == m.layers[0].attn_backend == backend
        got[backend] = (r.tokens, [s.num_accepted for s in r.records], d.state.root_logits.clone())
    assert got["triton"][0] == got["torch"][0] and got["triton"][1] == got["torch"][1]
    torch.testing.assert_close(got["triton"][2], got["torch"][2], atol=1e-4, rtol=1e-4)
    # the compiled head step calls the kernel as the custom op
    torch._dynamo.reset()
    d = Eagle3Drafter(head).compile()
    r = generate(m, PROMPTS, 12, drafter=d, k=3, stop_token_ids=())
    assert r.tokens == got["torch"][0] and [s.num_accepted for s in r.records] == got["torch"][1]


# ---------------------------------------------------------------------------- KV-cache write
def _write_case(B, T, KvH, D, S, NB, rows, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, 9 + 2 * KvH, D, generator=g).to(dtype)
    k = qkv[:, :, 9:9 + KvH].transpose(1, 2)                   # [B, KvH, T, D] views of one buffer, as in a layer
    v = qkv[:, :, 9 + KvH:].transpose(1, 2)
    kc = torch.randn(NB, KvH, S, D, generator=g).to(dtype)
    vc = torch.randn(NB, KvH, S, D, generator=g).to(dtype)
    start = torch.randint(0, S - T + 1, (B,), generator=g)
    wp = start[:, None] + torch.randperm(T, generator=g)[None]  # distinct slots per row, in any order
    r = torch.randperm(NB, generator=g)[:B] if rows else None
    return [x.to(DEVICE) if torch.is_tensor(x) else x for x in (kc, vc, k, v, wp, r)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T,KvH,D,S,NB,rows", [
    (1, 1, 3, 64, 48, 1, False),      # SmolLM2, one decode token
    (8, 4, 3, 64, 200, 8, False),     # a chain verification at batch 8 (k = 3)
    (3, 4, 3, 64, 70, 5, True),       # rows anywhere in the cache (continuous batching)
    (2, 16, 8, 128, 40, 3, False),    # Llama-8B's KV heads and head dim, a 16-node tree
    (2, 5, 5, 48, 32, 2, True),       # KvH and D not powers of two
])
def test_kv_cache_write_matches_reference(dtype, B, T, KvH, D, S, NB, rows):
    kc, vc, k, v, wp, r = _write_case(B, T, KvH, D, S, NB, rows, dtype)
    want = [kc.clone(), vc.clone()]
    attention_ref.kv_cache_write(*want, k, v, wp, r)
    kernels.kv_cache_write(kc, vc, k, v, wp, r, backend="triton")
    assert torch.equal(kc, want[0]) and torch.equal(vc, want[1])      # a copy: bit for bit
    rr = torch.arange(B, device=kc.device) if r is None else r
    for b in range(B):                                                 # and the contract itself
        for t in range(T):
            assert torch.equal(kc[rr[b], :, wp[b, t]], k[b, :, t]) and torch.equal(vc[rr[b], :, wp[b, t]], v[b, :, t])
    untouched = torch.ones(NB, S, dtype=torch.bool, device=kc.device)
    untouched[rr[:, None], wp] = False
    fresh = _write_case(B, T, KvH, D, S, NB, rows, dtype)             # the same seed: the caches before the write
    assert torch.equal(kc.permute(0, 2, 1, 3)[untouched], fresh[0].permute(0, 2, 1, 3)[untouched])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kv_cache_write_bad_arguments(backend):
    kc, vc, k, v, wp, r = _write_case(2, 4, 3, 64, 40, 2, False, torch.float32)
    with pytest.raises(ValueError, match="dtypes"):
        kernels.kv_cache_write(kc, vc, k.to(torch.bfloat16), v, wp, backend=backend)
    with pytest.raises(ValueError, match="write_pos"):
        kernels.kv_cache_write(kc, vc, k, v, wp[:, :2], backend=backend)
    with pytest.raises(ValueError, match="caches"):
        kernels.kv_cache_write(kc[:, :2], vc[:, :2], k, v, wp, backend=backend)
    with pytest.raises(ValueError, match="batch 2 > cache rows 1"):
        kernels.kv_cache_write(kc[:1], vc[:1], k, v, wp, backend=backend)
    with pytest.raises(ValueError, match="rows"):
        kernels.kv_cache_write(kc, vc, k, v, wp, torch.zeros(3, dtype=torch.long, device=kc.device), backend=backend)
