"""Fused soft cross-entropy: Triton forward/backward vs the PyTorch reference with autograd.

Runs the Triton kernels through triton's CPU interpreter (TRITON_INTERPRET=1, set before
triton is imported); ``TRITON_INTERPRET=0`` on a CUDA machine tests the compiled kernels.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from specheads import kernels  # noqa: E402

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available() else "cpu"


def _run(backend, d, t, grad_out):
    d = d.detach().clone().requires_grad_()
    loss, agree = kernels.soft_cross_entropy_and_accuracy(d, t, backend=backend)
    (grad,) = torch.autograd.grad(loss, d, grad_out)
    return loss.detach(), agree, grad


@pytest.mark.parametrize("dtype, shape", [(torch.float32, (2, 3, 300)), (torch.float32, (4, 1500)),
                                          (torch.bfloat16, (5, 700))])
def test_matches_reference_with_autograd(dtype, shape):
    g = torch.Generator().manual_seed(0)
    d = (torch.randn(*shape, generator=g) * 3).to(dtype).to(DEVICE)
    t = (torch.randn(*shape, generator=g) * 3).to(dtype).to(DEVICE)
    d.view(-1, shape[-1])[0] *= 40  # a row with large logits (online log-sum-exp must hold)
    t.view(-1, shape[-1])[1] = d.view(-1, shape[-1])[1]  # identical rows: loss = entropy, agree
    grad_out = torch.randn(shape[:-1], generator=g).to(DEVICE)
    la, aa, ga = _run("triton", d, t, grad_out)
    lb, ab, gb = _run("torch", d, t, grad_out)
    assert la.dtype == torch.float32 and la.shape == shape[:-1] and aa.dtype == torch.bool
    assert ga.dtype == dtype and ga.shape == shape
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
    assert torch.equal(aa, ab) and bool(aa.view(-1)[1])
    if dtype == torch.float32:
        torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-6)
    else:  # both round an fp32 gradient to bf16; allow one bf16 ulp
        torch.testing.assert_close(ga.float(), gb.float(), rtol=1.6e-2, atol=1e-5)


def test_loss_only_and_target_gets_no_gradient():
    g = torch.Generator().manual_seed(1)
    d = torch.randn(6, 33, generator=g).to(DEVICE).requires_grad_()
    t = torch.randn(6, 33, generator=g).to(DEVICE).requires_grad_()
    for backend in ("triton", "torch"):
        loss = kernels.soft_cross_entropy(d, t, backend=backend)
        gd, gt = torch.autograd.grad(loss.sum(), (d, t), allow_unused=True)
        assert gt is None and gd is not None
        torch.testing.assert_close(gd.sum(-1), torch.zeros(6, device=DEVICE), atol=1e-6, rtol=0)


def test_argmax_agreement_ties_lowest_index():
    d = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 0.0, 0.0], [0.0, 1.0, 0.0, 1.0]])
    t = torch.tensor([[0.0, 5.0, 1.0, 5.0], [1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    for backend in ("triton", "torch"):
        _, agree = kernels.soft_cross_entropy_and_accuracy(d.to(DEVICE), t.to(DEVICE), backend=backend)
        assert agree.tolist() == [True, True, False]


def test_shape_mismatch_rejected():
    with pytest.raises(ValueError):
        kernels.soft_cross_entropy(torch.zeros(2, 4), torch.zeros(2, 5), backend="torch")


@pytest.mark.parametrize("dtype, shift", [(torch.float32, 1), (torch.bfloat16, 3), (torch.float32, 0)])
def test_shifted_matches_gathered_rows(dtype, shift):
    """Position t of the draft against t + shift of the target, only where valid: the same numbers as
    gathering those rows and calling the plain loss, a zero gradient elsewhere, -1 argmax elsewhere."""
    g = torch.Generator().manual_seed(2)
    B, T, V = 3, 7, 1100
    d = (torch.randn(B, T, V, generator=g) * 3).to(dtype).to(DEVICE)
    t = (torch.randn(B, T, V, generator=g) * 3).float().to(DEVICE)  # the trainer's target is fp32
    d[1, 2, 5] = 60.0  # a known argmax, and a large logit for the online log-sum-exp
    valid = torch.rand(B, T, generator=g).to(DEVICE) < 0.6
    valid[1, 2] = True
    valid[0, T - 1] = True  # t + shift outside the row (for shift >= 1): must not count
    grad_out = torch.randn(B, T, generator=g).to(DEVICE)
    counts = valid & (torch.arange(T, device=DEVICE) + shift < T)
    b, p = counts.nonzero(as_tuple=True)
    want = kernels.soft_cross_entropy(d[b, p].float(), t[b, p + shift], backend="torch")
    for backend in ("triton", "torch"):
        x = d.detach().clone().requires_grad_()
        loss, am = kernels.soft_cross_entropy_shifted(x, t, valid, shift, backend=backend)
        (grad,) = torch.autograd.grad(loss, x, grad_out)
        assert loss.shape == (B, T) and loss.dtype == torch.float32 and am.dtype == torch.int64
        assert grad.dtype == dtype and grad.shape == (B, T, V)
        torch.testing.assert_close(loss[b, p], want, rtol=1e-5, atol=1e-5)
        assert bool((loss[~counts] == 0).all()) and bool((am[~counts] == -1).all())
        assert torch.equal(am[b, p], d[b, p].float().argmax(-1)) and int(am[1, 2]) == 5
        assert bool((grad[~counts] == 0).all())
        ref = (torch.softmax(d[b, p].float(), -1) - torch.softmax(t[b, p + shift], -1)) * grad_out[b, p, None]
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)
        torch.testing.assert_close(grad[b, p].float(), ref.to(dtype).float(), **tol)


def test_shifted_rejects_bad_arguments():
    d, t = torch.zeros(2, 3, 4), torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="bool"):
        kernels.soft_cross_entropy_shifted(d, t, torch.ones(2, 3), 1, backend="torch")
    with pytest.raises(ValueError, match=r"\[B, T, V\]"):
        kernels.soft_cross_entropy_shifted(d[0], t[0], torch.ones(3, dtype=torch.bool), 1, backend="torch")
    with pytest.raises(ValueError, match="shift"):
        kernels.soft_cross_entropy_shifted(d, t, torch.ones(2, 3, dtype=torch.bool), -1, backend="torch")


def test_training_step_loss_same_on_both_backends():
    """The trainer's per-step loss (distill_step): Triton reads rows in place, torch gathers them; same
    loss, hits, count and gradient, with padding, masked and out-of-vocabulary positions."""
    from specheads.train.losses import TargetView, distill_step

    g = torch.Generator().manual_seed(3)
    B, T, V = 2, 9, 300
    tl = (torch.randn(B, T, V, generator=g) * 2).to(DEVICE)
    am = tl.argmax(-1)
    in_vocab = torch.rand(B, T, generator=g).to(DEVICE) < 0.8
    in_vocab[0, 3] = True
    tv = TargetView(tl, torch.where(in_vocab, am, -1), in_vocab)
    loss_mask = (torch.rand(B, T, generator=g) < 0.7).long().to(DEVICE)
    loss_mask[0, 4] = 1  # step 1 at t = 1 predicts x_4 from target row 3
    attn = torch.ones(B, T, dtype=torch.long, device=DEVICE)
    attn[1, 6:] = 0
    logits = (torch.randn(B, T, V, generator=g) * 2).to(torch.bfloat16).to(DEVICE)
    logits[0, 1] = tl[0, 3].to(torch.bfloat16)  # one certain hit at k = 1
    for k in range(3):
        out = {}
        for backend in ("triton", "torch"):
            x = logits.detach().clone().requires_grad_()
            r = distill_step(x, tv, loss_mask, k, attn, backend=backend)
            (grad,) = torch.autograd.grad(r.loss, x)
            out[backend] = (r.loss.detach(), int(r.hits), int(r.count), grad)
        (la, ha, ca, ga), (lb, hb, cb, gb) = out["triton"], out["torch"]
        assert (ha, ca) == (hb, cb) and ca > 0 and (k != 1 or ha >= 1)
        torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ga.float(), gb.float(), rtol=1.6e-2, atol=1e-6)
