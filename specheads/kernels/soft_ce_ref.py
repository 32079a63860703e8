"""Soft cross-entropy for draft-head training in plain PyTorch — twin of ``soft_ce_triton``.

``soft_cross_entropy(draft_logits, target_logits) -> loss`` with
``loss[r] = -sum_v softmax(target[r])_v * log_softmax(draft[r])_v`` (float32, shape
``draft_logits.shape[:-1]``). Inputs bf16 / fp16 / fp32 of one shape [..., Vd]; math in
float32. The target is a constant: no gradient flows into ``target_logits`` (it is
detached), the gradient w.r.t. the draft logits is
``(softmax(draft) - softmax(target)) * grad_loss`` in the draft's dtype.

``soft_cross_entropy_and_accuracy`` also returns ``agree`` (bool, same shape as loss):
argmax(draft) == argmax(target) per row, ties to the lowest index.

``soft_cross_entropy_shifted(draft [B, T, V], target [B, T, V], valid [B, T], shift)`` is the
training step's form: position t of the draft against position ``t + shift`` of the target, at the
``valid`` positions only (whose ``t + shift`` must lie inside the row). Returns ``loss`` float32
[B, T] (0 where not valid) and ``draft_argmax`` int64 [B, T] (-1 where not valid); the gradient
w.r.t. the draft logits is zero at positions that are not valid. Here the valid rows are gathered
(one copy of each operand) and the loss scattered back; the Triton twin reads the rows in place.
"""

from __future__ import annotations

import torch

from ._common import check_soft_ce, check_soft_ce_shifted

__all__ = ["soft_cross_entropy", "soft_cross_entropy_and_accuracy", "soft_cross_entropy_shifted"]


def _argmax_lowest(x: torch.Tensor) -> torch.Tensor:
    m = x.amax(-1, keepdim=True)
    idx = torch.arange(x.shape[-1], device=x.device)
    return torch.where(x == m, idx, x.shape[-1]).amin(-1)


def soft_cross_entropy(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    check_soft_ce(draft_logits, target_logits)
    logp = torch.log_softmax(draft_logits.float(), dim=-1)
    pt = torch.softmax(target_logits.detach().float(), dim=-1)
    return -(pt * logp).sum(-1)


def soft_cross_entropy_and_accuracy(draft_logits: torch.Tensor, target_logits: torch.Tensor):
    loss = soft_cross_entropy(draft_logits, target_logits)
    with torch.no_grad():
        agree = _argmax_lowest(draft_logits.detach().float()) == _argmax_lowest(target_logits.detach().float())
    return loss, agree


def soft_cross_entropy_shifted(draft_logits: torch.Tensor, target_logits: torch.Tensor, valid: torch.Tensor,
                               shift: int):
    check_soft_ce_shifted(draft_logits, target_logits, valid, shift)
    B, T, _ = draft_logits.shape
    valid = valid & (torch.arange(T, device=valid.device) + shift < T)
    b, t = valid.nonzero(as_tuple=True)
    draft_rows = draft_logits[b, t]
    rows = soft_cross_entropy(draft_rows, target_logits[b, t + shift])
    loss = torch.zeros((B, T), dtype=torch.float32, device=draft_logits.device).index_put((b, t), rows)
    with torch.no_grad():
        draft_argmax = torch.full((B, T), -1, dtype=torch.int64, device=draft_logits.device)
        draft_argmax[b, t] = _argmax_lowest(draft_rows.detach().float())
    return loss, draft_argmax
