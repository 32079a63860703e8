"""Fused soft cross-entropy in Triton — same contract as ``soft_ce_ref``.

Forward: one program per row streams both logit rows in ``BLOCK_V`` chunks with an
online log-sum-exp for each (running max + rescaled sum) and a running
``sum_v exp(t_v - m_t) * d_v`` so that ``loss = lse_d - sum_v softmax(t)_v d_v``; it
also tracks both argmaxes (lowest index among ties). Only ``lse_d`` and ``lse_t``
([rows] float32) are kept for backward — no probability tensor is ever materialised.
Backward: a 2-D grid (rows x vocab chunks) writes
``grad_d = (exp(d - lse_d) - exp(t - lse_t)) * grad_loss`` in the draft dtype.

``soft_cross_entropy_shifted`` runs the same two kernels over every position of [B, T, V] logits,
reading the target row ``t + shift`` in place and skipping positions that are not valid (loss 0,
gradient 0, written by the kernels themselves). The training step used to gather the valid rows of
both operands first: on the H200 (SmolLM2 head, 2026-12-03) those gathers, their backward and the
zero fill took ~27% of the trainer's device time and kept a copy of every step's target rows alive
for backward; a ``nonzero`` per step also synchronised with the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_soft_ce, check_soft_ce_shifted
from ._triton_compat import patch_interpreter

__all__ = ["soft_cross_entropy", "soft_cross_entropy_and_accuracy", "soft_cross_entropy_shifted"]

patch_interpreter()


@triton.jit
def _row_loss(d_ptr, t_ptr, base_d, base_t, V, BLOCK_V: tl.constexpr):
    """One row pair: (loss, lse_d, lse_t, argmax_d, argmax_t), streamed in BLOCK_V chunks."""
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
        d = tl.load(d_ptr + base_d + cols, mask=mask, other=float("-inf")).to(tl.float32)
        t = tl.load(t_ptr + base_t + cols, mask=mask, other=float("-inf")).to(tl.float32)
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
    return lse_d - w / s_t, lse_d, lse_t, am_d, am_t


@triton.jit
def _row_grad(d_ptr, t_ptr, base_d, base_t, lse_d, lse_t, g, cols, mask):
    d = tl.load(d_ptr + base_d + cols, mask=mask, other=0.0).to(tl.float32)
    t = tl.load(t_ptr + base_t + cols, mask=mask, other=0.0).to(tl.float32)
    return (tl.exp(d - lse_d) - tl.exp(t - lse_t)) * g


@triton.jit
def _soft_ce_fwd_kernel(d_ptr, t_ptr, loss_ptr, lse_d_ptr, lse_t_ptr, agree_ptr, V, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    loss, lse_d, lse_t, am_d, am_t = _row_loss(d_ptr, t_ptr, row * V, row * V, V, BLOCK_V)
    tl.store(loss_ptr + row, loss)
    tl.store(lse_d_ptr + row, lse_d)
    tl.store(lse_t_ptr + row, lse_t)
    tl.store(agree_ptr + row, (am_d == am_t).to(tl.int8))


@triton.jit
def _soft_ce_bwd_kernel(d_ptr, t_ptr, lse_d_ptr, lse_t_ptr, g_ptr, grad_ptr, V, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    grad = _row_grad(d_ptr, t_ptr, row * V, row * V, tl.load(lse_d_ptr + row), tl.load(lse_t_ptr + row),
                     tl.load(g_ptr + row), cols, mask)
    tl.store(grad_ptr + row * V + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _soft_ce_shifted_fwd_kernel(d_ptr, t_ptr, valid_ptr, loss_ptr, lse_d_ptr, lse_t_ptr, am_ptr, T, SHIFT, V,
                                BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * T + t; its target row is b * T + t + SHIFT
    ok = (tl.load(valid_ptr + row) != 0) & (row % T + SHIFT < T)
    if ok:
        loss, lse_d, lse_t, am_d, _ = _row_loss(d_ptr, t_ptr, row * V, (row + SHIFT) * V, V, BLOCK_V)
        tl.store(loss_ptr + row, loss)
        tl.store(lse_d_ptr + row, lse_d)
        tl.store(lse_t_ptr + row, lse_t)
        tl.store(am_ptr + row, am_d.to(tl.int64))
    else:
        tl.store(loss_ptr + row, 0.0)
        tl.store(lse_d_ptr + row, 0.0)
        tl.store(lse_t_ptr + row, 0.0)
        tl.store(am_ptr + row, -1)


@triton.jit
def _soft_ce_shifted_bwd_kernel(d_ptr, t_ptr, valid_ptr, lse_d_ptr, lse_t_ptr, g_ptr, grad_ptr, T, SHIFT, V,
                                BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    ok = (tl.load(valid_ptr + row) != 0) & (row % T + SHIFT < T)
    if ok:
        grad = _row_grad(d_ptr, t_ptr, row * V, (row + SHIFT) * V, tl.load(lse_d_ptr + row),
                         tl.load(lse_t_ptr + row), tl.load(g_ptr + row), cols, mask)
        tl.store(grad_ptr + row * V + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(grad_ptr + row * V + cols, tl.zeros([BLOCK_V], dtype=grad_ptr.dtype.element_ty), mask=mask)


def _launch(V: int, device: torch.device) -> dict:
    """BLOCK_V and num_warps of every kernel here."""
    bv = min(triton.next_power_of_2(V), 4096 if device.type == "cuda" else 1024)
    return {"BLOCK_V": bv, "num_warps": 8 if bv >= 2048 else 4}


def _row_buffers(M: int, device: torch.device, argmax_dtype: torch.dtype):
    """loss, lse_d, lse_t (float32 [M]) and the per-row argmax output."""
    return [torch.empty(M, dtype=torch.float32, device=device) for _ in range(3)] + [
        torch.empty(M, dtype=argmax_dtype, device=device)]


def _forward(d: torch.Tensor, t: torch.Tensor):
    M, V = d.shape
    loss, lse_d, lse_t, agree = _row_buffers(M, d.device, torch.int8)
    if M:
        _soft_ce_fwd_kernel[(M,)](d, t, loss, lse_d, lse_t, agree, V, **_launch(V, d.device))
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
            cfg = _launch(V, d.device)
            _soft_ce_bwd_kernel[(M, triton.cdiv(V, cfg["BLOCK_V"]))](d, t, lse_d, lse_t, g, grad, V, **cfg)
        return grad.reshape(ctx.shape), None


def soft_cross_entropy_and_accuracy(draft_logits: torch.Tensor, target_logits: torch.Tensor):
    check_soft_ce(draft_logits, target_logits)
    return _SoftCrossEntropy.apply(draft_logits, target_logits)


def soft_cross_entropy(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    return soft_cross_entropy_and_accuracy(draft_logits, target_logits)[0]


class _SoftCrossEntropyShifted(torch.autograd.Function):
    @staticmethod
    def forward(ctx, draft_logits, target_logits, valid, shift):
        B, T, V = draft_logits.shape
        d = draft_logits.contiguous()
        t = target_logits.detach().contiguous()
        v = valid.contiguous().view(torch.int8)
        M = B * T
        loss, lse_d, lse_t, am = _row_buffers(M, d.device, torch.int64)
        if M:
            _soft_ce_shifted_fwd_kernel[(M,)](d, t, v, loss, lse_d, lse_t, am, T, shift, V, **_launch(V, d.device))
        ctx.save_for_backward(d, t, v, lse_d, lse_t)
        ctx.shift = shift
        ctx.mark_non_differentiable(am)
        return loss.view(B, T), am.view(B, T)

    @staticmethod
    def backward(ctx, grad_loss, grad_am):
        d, t, v, lse_d, lse_t = ctx.saved_tensors
        B, T, V = d.shape
        g = grad_loss.reshape(B * T).to(torch.float32).contiguous()
        grad = torch.empty_like(d)
        if B * T:
            cfg = _launch(V, d.device)
            _soft_ce_shifted_bwd_kernel[(B * T, triton.cdiv(V, cfg["BLOCK_V"]))](d, t, v, lse_d, lse_t, g, grad, T,
                                                                                  ctx.shift, V, **cfg)
        return grad, None, None, None


def soft_cross_entropy_shifted(draft_logits: torch.Tensor, target_logits: torch.Tensor, valid: torch.Tensor,
                               shift: int):
    check_soft_ce_shifted(draft_logits, target_logits, valid, shift)
    return _SoftCrossEntropyShifted.apply(draft_logits, target_logits, valid, shift)
