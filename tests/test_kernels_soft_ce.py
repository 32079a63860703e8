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
