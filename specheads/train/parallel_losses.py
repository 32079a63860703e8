"""Training objectives of the parallel drafters: P-EAGLE (K depths in one forward, conditional
drop-token sampling) and DFlash (random anchor blocks in one forward, decayed per block slot).

Alignment is the one rule of ``losses.py``: a prediction of token x_u is trained against the
target's distribution ``softmax(lm_head(final_{u-1}))`` over the draft vocabulary and counts iff
``loss_mask[u]`` (an assistant token, not padding) and the target's full-vocabulary argmax at u-1 is
a draft token. P-EAGLE depth d at anchor t predicts x_{t+2+d} (EAGLE-3's TTT step d), DFlash slot
j of the block anchored at a predicts x_{a+j} (TTT step j-1 at position a-1), so both reuse
``counted_positions``.

Sampling (which depths, which anchors) draws from a generator seeded by the recipe's seed and the
batch's tokens: a resumed run samples the batches it has left exactly as an uninterrupted one.
"""
from __future__ import annotations

import math

import torch

from specheads.kernels import soft_cross_entropy_shifted

from .losses import LossOutput, StepResult, TargetView, _combine, counted_positions


def batch_generator(seed: int, input_ids: torch.Tensor) -> torch.Generator:
    """A CPU generator fixed by the seed and the batch's content (one host read of two sums)."""
    ids = input_ids.long()
    key = int(ids.sum()) * 1_000_003 + int((ids * torch.arange(1, ids.shape[1] + 1, device=ids.device)).sum())
    return torch.Generator().manual_seed((int(seed) * 0x9E3779B1 + key) % (1 << 63))


def _gathered_step(logits, tv: TargetView, rows: torch.Tensor, valid: torch.Tensor, backend: str):
    """Soft-CE of draft logits [B, N, V] against target rows ``rows [B, N]`` at the ``valid`` entries:
    (per-entry loss [B, N], hits [B, N] bool)."""
    B, N = rows.shape
    r = rows.clamp(0, tv.logits.shape[1] - 1).to(tv.logits.device)
    target = tv.logits.gather(1, r[..., None].expand(B, N, tv.logits.shape[-1])).to(logits.device)
    ce, draft_argmax = soft_cross_entropy_shifted(logits, target, valid, 0, backend=backend)
    with torch.no_grad():
        want = tv.argmax.to(logits.device).gather(1, r.to(logits.device))
        hits = (draft_argmax == want) & valid
    return ce, hits


def _per_group(ce, hits, valid, group, n_groups: int) -> list[StepResult]:
    out = []
    for g in range(n_groups):
        m = valid & (group == g)
        count = m.sum()
        out.append(StepResult((ce * m).sum() / count.clamp(min=1), (hits & m).sum(), count))
    return out


# ---------------------------------------------------------------- P-EAGLE
def cod_sample(loss_mask, in_vocab, attention_mask, depths: int, keep_ratio: float, keep_min: float,
               gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Conditional drop-token sampling (as speculators' P-EAGLE): depth 0 at every position; depth d
    keeps ``max(keep_ratio**d, keep_min)`` of the positions whose depth-d prediction is trained, drawn
    among the anchors depth d-1 kept, so every kept entry has its whole rollout. Returns ``anchor``
    and ``depth`` ``[B, N]``, depth-0 entries first in position order, then each depth's (-1 pads a
    row to the longest)."""
    B, T = loss_mask.shape
    rows = []
    for b in range(B):
        anchors, depth = [torch.arange(T)], [torch.zeros(T, dtype=torch.long)]
        kept = torch.arange(T)
        for d in range(1, depths):
            ok = counted_positions(loss_mask[b:b + 1], in_vocab[b:b + 1], d,
                                   None if attention_mask is None else attention_mask[b:b + 1])[0].cpu()
            cand = kept[ok[kept]]
            size = int(int(ok.sum()) * max(keep_ratio ** d, keep_min))
            if size <= 0 or cand.numel() == 0:
                break
            if cand.numel() > size:
                cand = cand[torch.randperm(cand.numel(), generator=gen)[:size]].sort().values
            anchors.append(cand)
            depth.append(torch.full((cand.numel(),), d, dtype=torch.long))
            kept = cand
        rows.append((torch.cat(anchors), torch.cat(depth)))
    N = max(a.numel() for a, _ in rows)
    anchor = torch.zeros(B, N, dtype=torch.long)
    depth = torch.full((B, N), -1, dtype=torch.long)
    for b, (a, d) in enumerate(rows):
        anchor[b, :a.numel()], depth[b, :d.numel()] = a, d
    dev = loss_mask.device
    return anchor.to(dev), depth.to(dev)


def peagle_loss(head, batch: dict, tv: TargetView, depths: int, keep_ratio: float, keep_min: float,
                seed: int = 0, backend: str = "auto") -> LossOutput:
    """Soft-CE of every sampled (anchor, depth) entry, depths weighted equally (speculators, SpecForge)."""
    ids, attn, lm = batch["input_ids"], batch.get("attention_mask"), batch["loss_mask"]
    anchor, depth = cod_sample(lm, tv.in_vocab, attn, depths, keep_ratio, keep_min, batch_generator(seed, ids))
    logits = head.parallel_forward(ids, batch["aux"].to(head.fc.weight.dtype), anchor, depth, attn)
    valid = torch.zeros_like(depth, dtype=torch.bool)
    for d in range(depths):
        ok = counted_positions(lm, tv.in_vocab, d, attn)
        valid |= (depth == d) & ok.gather(1, anchor)
    ce, hits = _gathered_step(logits, tv, anchor + 1 + depth.clamp(min=0), valid, backend)
    return _combine(_per_group(ce, hits, valid, depth, depths), [1.0] * depths)


# ---------------------------------------------------------------- DFlash
def dflash_anchors(loss_mask, in_vocab, attention_mask, count: int, gen: torch.Generator):
    """Random anchors, up to ``count // rows`` (at least one) from each row of the micro-batch, drawn uniformly
    among the row's positions a >= 1 whose first drafted token x_{a+1} is trained. Per row, as SpecForge and
    speculators anchor each sequence: the blocks' tensors are [rows, anchors a row, block_size, ...] (the logits
    x draft vocabulary, the block attention x the row's length), so rows x anchors a row stays within ``count``
    however uneven the rows are. ``count`` sets the density (``bench_dflash_anchors.py``). Returns
    ``anchors [B, A]`` (sorted within a row) and ``valid [B, A]``."""
    ok = counted_positions(loss_mask, in_vocab, 0, attention_mask).cpu()      # [B, T] at t = a - 1
    B = ok.shape[0]
    per_row = max(1, count // B)
    picks = []
    for b in range(B):
        pos = ok[b].nonzero(as_tuple=True)[0]
        if pos.numel() > per_row:
            pos = pos[torch.randperm(pos.numel(), generator=gen)[:per_row]]
        picks.append((pos + 1).sort().values)
    A = max(1, max(p.numel() for p in picks))
    anchors = torch.ones(B, A, dtype=torch.long)
    valid = torch.zeros(B, A, dtype=torch.bool)
    for b, p in enumerate(picks):
        anchors[b, :p.numel()], valid[b, :p.numel()] = p, True
    dev = loss_mask.device
    return anchors.to(dev), valid.to(dev)


def dflash_weights(block_size: int, gamma: float) -> list[float]:
    """Slot j's weight exp(-(j-1)/gamma), j = 1 .. block_size-1 (the published DFlash decay)."""
    return [math.exp(-(j - 1) / gamma) for j in range(1, block_size)]


def dflash_loss(head, batch: dict, tv: TargetView, anchors_per_batch: int, gamma: float, seed: int = 0,
                backend: str = "auto", attention: str = "dense") -> LossOutput:
    """Soft-CE of every drafted slot of every block, slot j weighted by :func:`dflash_weights` (``attention``:
    the head's block attention, "dense" or "flex")."""
    ids, attn, lm = batch["input_ids"], batch.get("attention_mask"), batch["loss_mask"]
    S = head.cfg.block_size
    anchors, ok = dflash_anchors(lm, tv.in_vocab, attn, anchors_per_batch, batch_generator(seed, ids))
    logits = head.block_forward_train(ids, batch["aux"], anchors, attn, attention)    # [B, A, S, V]
    B, A = anchors.shape
    slot = torch.arange(S, device=anchors.device).expand(B, A, S)
    valid = torch.zeros(B, A, S, dtype=torch.bool, device=anchors.device)
    for j in range(1, S):
        c = counted_positions(lm, tv.in_vocab, j - 1, attn)
        valid[:, :, j] = ok & c.gather(1, (anchors - 1).clamp(min=0))
    rows = (anchors[:, :, None] + slot - 1).reshape(B, A * S)
    ce, hits = _gathered_step(logits.reshape(B, A * S, -1), tv, rows, valid.reshape(B, A * S), backend)
    groups = (slot - 1).reshape(B, A * S)
    return _combine(_per_group(ce, hits, valid.reshape(B, A * S), groups, S - 1), dflash_weights(S, gamma))
