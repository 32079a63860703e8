"""Fused soft cross-entropy in Triton — same contract as ``soft_ce_ref``.

Forward: one program per row streams both logit rows in ``BLOCK_V`` chunks with an
online log-sum-exp for each (running max + rescaled sum) and a running
``sum_v exp(t_v - m_t) * d_v`` so that ``loss = lse_d - sum_v softmax(t)_v d_v``; it
also tracks both argmaxes (lowest index among ties). Only ``lse_d`` and ``lse_t``
([rows] float32) are kept for backward — no probability tensor is ever materialised.
Backward: a 2-D grid (rows x vocab chunks) writes
``grad_d = (exp(d - lse_d) - exp(t - lse_t)) * grad_loss`` in the draft dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_soft_ce
from ._triton_compat import patch_interpreter

__all__ = ["soft_cross_entropy", "soft_cross_entropy_and_accuracy"]

patch_interpreter()


@triton.jit
def _soft_ce_fwd_kernel(d_ptr, t_ptr, loss_ptr, lse_d_ptr, lse_t_ptr, agree_ptr, V, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * V
    cols0 = tl.arange(0, BLOCK_V)
    m_d = float("-inf")
    s_d = 0.0
    m_t = float("-inf")
    s_t = 0.0
    w = 0.0  # sum exp(t - m_t) * d
    am_d = 0
    am_t = 0
    for start in range(0, V, BLOCK_V):
        cols = start + cols0
        mask = cols < V
        d = tl.load(d_ptr + base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        t = tl.load(t_ptr + base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        bm_d = tl.max(d, 0)
        bm_t = tl.max(t, 0)
        bi_d = tl.min(tl.where((d == bm_d) & mask, cols, V), 0)
        bi_t = tl.min(tl.where((t == bm_t) & mask, cols, V), 0)
        am_d = tl.where(bm_d > m_d, bi_d, am_d)
        am_t = tl.where(bm_t > m_t, bi_t, am_t)
        new_d = tl.maximum(m_d, bm_d)
        new_t = tl.maximum(m_t, bm_t)
        s_d = s_d * tl.exp(m_d - new_d) + tl.sum(tl.exp(d - new_d), 0)
        et = tl.exp(t - new_t)
        scale_t = tl.exp(m_t - new_t)
        s_t = s_t * scale_t + tl.sum(et, 0)
        w = w * scale_t + tl.sum(et * tl.where(mask, d, 0.0), 0)
        m_d = new_d
        m_t = new_t
    lse_d = m_d + tl.log(s_d)
    lse_t = m_t + tl.log(s_t)
    tl.store(loss_ptr + row, lse_d - w / s_t)
    tl.store(lse_d_ptr + row, lse_d)
    tl.store(lse_t_ptr + row, lse_t)
    tl.store(agree_ptr + row, (am_d == am_t).to(tl.int8))


@triton.jit
def _soft_ce_bwd_kernel(d_ptr, t_ptr, lse_d_ptr, lse_t_ptr, g_ptr, grad_ptr, V, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    base = row * V
    d = tl.load(d_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    t = tl.load(t_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    lse_d = tl.load(lse_d_ptr + row)
    lse_t = tl.load(lse_t_ptr + row)
    g = tl.load(g_ptr + row)
    grad = (tl.exp(d - lse_d) - tl.exp(t - lse_t)) * g
    tl.store(grad_ptr + base + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)


def _block_v(V: int, device: torch.device) -> int:
    return min(triton.next_power_of_2(V), 4096 if device.type == "cuda" else 1024)


def _forward(d: torch.Tensor, t: torch.Tensor):
    M, V = d.shape
    dev = d.device
    loss = torch.empty(M, dtype=torch.float32, device=dev)
    lse_d = torch.empty(M, dtype=torch.float32, device=dev)
    lse_t = torch.empty(M, dtype=torch.float32, device=dev)
    agree = torch.empty(M, dtype=torch.int8, device=dev)
    if M:
        BV = _block_v(V, dev)
        _soft_ce_fwd_kernel[(M,)](d, t, loss, lse_d, lse_t, agree, V, BLOCK_V=BV, num_warps=8 if BV >= 2048 else 4)
    return loss, lse_d, lse_t, agree.bool()


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, draft_logits, target_logits):
        shape = draft_logits.shape
        V = shape[-1]
        d = draft_logits.reshape(-1, V).contiguous()
        t = target_logits.detach().reshape(-1, V).contiguous()
        loss, lse_d, lse_t, agree = _forward(d, t)
        ctx.save_for_backward(d, t, lse_d, lse_t)
        ctx.shape = shape
        ctx.mark_non_differentiable(agree)
        return loss.reshape(shape[:-1]), agree.reshape(shape[:-1])

    @staticmethod
    def backward(ctx, grad_loss, grad_agree):
        d, t, lse_d, lse_t = ctx.saved_tensors
        M, V = d.shape
        g = grad_loss.reshape(M).to(torch.float32).contiguous()
        grad = torch.empty_like(d)
        if M:
            BV = _block_v(V, d.device)
            _soft_ce_bwd_kernel[(M, triton.cdiv(V, BV))](d, t, lse_d, lse_t, g, grad, V, BLOCK_V=BV,
                                                          num_warps=8 if BV >= 2048 else 4)
        return grad.reshape(ctx.shape), None


def soft_cross_entropy_and_accuracy(draft_logits: torch.Tensor, target_logits: torch.Tensor):
    check_soft_ce(draft_logits, target_logits)
    return _SoftCrossEntropy.apply(draft_logits, target_logits)


def soft_cross_entropy(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    return soft_cross_entropy_and_accuracy(draft_logits, target_logits)[0]
