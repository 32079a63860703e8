"""Sampling transform (temperature -> top-k -> top-p): Triton kernel vs PyTorch reference.

Runs the Triton kernel through triton's CPU interpreter (TRITON_INTERPRET=1, set before
triton is imported); ``TRITON_INTERPRET=0`` on a CUDA machine tests the compiled kernel.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from specheads import kernels  # noqa: E402

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available() else "cpu"


def _both(logits, temperature, top_k, top_p):
    args = [logits.to(DEVICE)] + [t.to(DEVICE) if torch.is_tensor(t) else t for t in (temperature, top_k, top_p)]
    a = kernels.target_probs(*args, backend="triton").cpu()
    b = kernels.target_probs(*args, backend="torch").cpu()
    assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape == logits.shape
    return a, b


def _boundary_rows(logits, temperature, top_k, top_p, rel=1e-5):
    """Rows whose top-p decision is within float rounding: some cumulative mass of the sorted
    top-k survivors is within ``rel`` of ``top_p * Z_k``. Only there may the kernel (block-order
    sums) and the reference (sorted cumsum) keep different sets."""
    V = logits.shape[-1]
    x = logits.reshape(-1, V).double()
    M = x.shape[0]
    T = torch.as_tensor(temperature, dtype=torch.float64).reshape(-1)
    k = torch.as_tensor(top_k).reshape(-1)
    p = torch.as_tensor(top_p, dtype=torch.float64).reshape(-1)
    T, k, p = (t.repeat_interleave(M // t.numel()) for t in (T, k, p))
    e = torch.exp((x - x.amax(-1, keepdim=True)) / T.clamp(min=1e-5)[:, None])
    s = e.sort(-1, descending=True).values
    kk = torch.where((k > 0) & (k < V), k, V)
    s = torch.where(torch.arange(V)[None] < kk[:, None], s, 0.0)  # (ties beyond k: tolerance covers)
    cum = s.cumsum(-1)
    target = p * cum[:, -1]
    near = ((cum - target[:, None]).abs() <= rel * cum[:, -1:]).any(-1)
    return near & (p < 1) & (T >= 1e-5)


def _check(logits, temperature, top_k, top_p):
    a, b = _both(logits, temperature, top_k, top_p)
    V = logits.shape[-1]
    a2, b2 = a.reshape(-1, V), b.reshape(-1, V)
    assert torch.allclose(a2.sum(-1), torch.ones(a2.shape[0]), atol=1e-5)
    same = ((a2 > 0) == (b2 > 0)).all(-1)
    boundary = _boundary_rows(logits, temperature, top_k, top_p)
    assert (same | boundary).all(), f"kept sets differ off the boundary in rows {(~same & ~boundary).nonzero()}"
    torch.testing.assert_close(a2[same], b2[same], atol=2e-6, rtol=1e-5)
    return a, b


def test_random_per_request_params():
    g = torch.Generator().manual_seed(0)
    B, N, V = 12, 3, 67
    logits = torch.randn(B, N, V, generator=g) * 3
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.3, 2.0, 0.5, 1.0, 1e-6, 0.9, 1.0, 3.0, 0.3])
    top_k = torch.tensor([5, 0, 0, 3, 67, 7, 1, 4, 100, 0, 20, 2])
    top_p = torch.tensor([1.0, 0.9, 0.8, 0.5, 0.3, 0.95, 0.5, 0.5, 0.0, 1.0, 0.99, 0.7])
    a, b = _check(logits, temperature, top_k, top_p)
    kept = (b > 0).sum(-1)
    assert (kept[1] == 1).all() and (kept[7] == 1).all()  # greedy rows
    assert (kept[6] == 1).all() and (kept[3] <= 3).all()
    assert (kept[9] == V).all()  # everything off
    # bf16 logits, [M, V] layout, scalar parameters
    _check(logits.reshape(-1, V).bfloat16(), 0.8, 10, 0.9)


def test_topk_topp_definitions():
    g = torch.Generator().manual_seed(1)
    M, V = 16, 50
    logits = torch.randn(M, V, generator=g) * 2
    top_p = torch.rand(M, generator=g) * 0.9 + 0.05
    _, b = _check(logits, 1.0, 0, top_p)
    base = torch.softmax(logits, -1)
    for r in range(M):
        kept = b[r] > 0
        mass = base[r][kept].sum()
        smallest = base[r][kept].min()
        assert mass >= top_p[r] - 1e-6 and mass - smallest < top_p[r] + 1e-6  # smallest set reaching top_p
        torch.testing.assert_close(b[r][kept], base[r][kept] / mass)
    _, b = _check(logits, 1.0, 7, 1.0)
    assert ((b > 0).sum(-1) == 7).all()
    top_vals = logits.topk(7, -1).values[:, -1:]
    assert ((b > 0) == (logits >= top_vals)).all()


def test_ties_at_thresholds_are_kept():
    # integer logits: the 4th largest value (3.0) is tied 3 ways -> top_k = 4 keeps 6 tokens
    logits = torch.tensor([[5.0, 4.0, 3.0, 3.0, 3.0, 1.0, 0.0, 5.0]])
    a, b = _check(logits, 1.0, 4, 1.0)
    assert (b[0] > 0).tolist() == [True, True, True, True, True, False, False, True]
    # top_p reached inside the tie group {2,3,4}: the whole group is kept
    e = torch.exp(logits[0] - 5)
    mass_top3 = float(e[[0, 1, 7]].sum() / e.sum())
    p = mass_top3 + 0.5 * float(e[2] / e.sum())
    a, b = _check(logits, 1.0, 0, p)
    assert (b[0] > 0).tolist() == [True, True, True, True, True, False, False, True]
    # greedy: ties to the lowest index, top-k / top-p ignored
    a, b = _check(logits, 0.0, 3, 0.5)
    assert b[0].tolist() == [1.0] + [0.0] * 7


def test_multi_block_vocab():
    g = torch.Generator().manual_seed(2)
    M, V = 3, 1500  # two vocabulary blocks in the interpreter
    logits = torch.randn(M, V, generator=g) * 4
    _check(logits, torch.tensor([1.0, 0.6, 0.0]), torch.tensor([40, 0, 5]), torch.tensor([0.8, 0.9, 1.0]))


def test_bad_parameter_shape():
    with pytest.raises(ValueError):
        kernels.target_probs(torch.zeros(2, 3, 5), torch.ones(3), backend="torch")
