"""Shared contract pieces of the kernels: constants, result types, argument checks.

Imported by both the PyTorch references and the Triton modules, so that the two
sides of every kernel agree on shapes and numbers by construction. Nothing here
imports triton or any other specheads package.

Exact sampling (why the verify kernels match their references bit for bit)
--------------------------------------------------------------------------
Every categorical draw in the verify kernels is an inverse-CDF draw with an
explicit uniform ``u`` in [0, 1). Floating-point cumulative sums depend on the
summation order (a Triton block scan is not ``torch.cumsum``), so instead each
weight ``w`` (a float32 probability or residual ``max(p - q, 0)``) is turned into
an integer ``floor(w * 2**40)`` (a power-of-two scaling, exact in float32,
then truncation: deterministic elementwise). Integer sums are associative, so
the total ``S`` and every prefix sum are identical whatever the order. The draw
is the first index ``i`` whose inclusive prefix sum exceeds
``R = min(floor(float64(u) * float64(S)), S - 1)`` (one correctly rounded
float64 product). Effect on the distribution: weights below 2**-40 (~9e-13)
become 0 and every weight loses < 2**-40 — far below anything measurable.
Acceptance tests (``u * q < p``, ``coin * thr <= acc``) are single correctly
rounded float32 operations, identical on both sides as well.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

#: weights are quantised to integers ``floor(w * 2**SCALE_BITS)`` before sampling
SCALE_BITS = 40
SCALE = float(2**SCALE_BITS)

#: temperatures below this mean greedy (one-hot at the argmax), as in vLLM
GREEDY_EPS = 1e-5

#: threshold_acc is capped from below like SGLang does (``fmaxf(threshold_acc, 1e-9)``)
MIN_THRESHOLD_ACC = 1e-9


class VerifyOutput(NamedTuple):
    """Result of a chain verification (greedy, rejection, one-hot).

    num_accepted: int64 [B] — accepted draft tokens (0..K).
    out_tokens:   int64 [B, K+1] — the accepted drafts, then the correction/bonus
                  token at position ``num_accepted``, then -1 padding.
    """

    num_accepted: torch.Tensor
    out_tokens: torch.Tensor


class TreeVerifyOutput(NamedTuple):
    """Result of target-only tree verification.

    accept_index: int64 [B, max_depth+1] — local node indices of the accepted path;
                  column 0 is the root (0), then one node per accepted depth, -1 padded.
    num_accepted: int64 [B] — accepted draft nodes, root excluded (SGLang's accept_token_num).
    next_token:   int64 [B] — token sampled at the last accepted node.
    out_tokens:   int64 [B, max_depth+1] — tokens of the accepted nodes (root excluded),
                  then ``next_token`` at position ``num_accepted``, -1 padded (same layout
                  as VerifyOutput.out_tokens).
    """

    accept_index: torch.Tensor
    num_accepted: torch.Tensor
    next_token: torch.Tensor
    out_tokens: torch.Tensor


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_chain(draft_tokens, target_probs, draft_probs=None, uniform_accept=None, uniform_sample=None):
    """Validate chain-verify arguments; return (B, K, V)."""
    _need(draft_tokens.dim() == 2, f"draft_tokens must be [B, K], got {tuple(draft_tokens.shape)}")
    _need(not draft_tokens.is_floating_point(), "draft_tokens must be an integer tensor")
    B, K = draft_tokens.shape
    _need(target_probs.dim() == 3 and target_probs.shape[:2] == (B, K + 1),
          f"target must be [B, K+1, V] = [{B}, {K + 1}, V], got {tuple(target_probs.shape)}")
    V = target_probs.shape[2]
    _need(V >= 1, "empty vocabulary")
    if draft_probs is not None:
        _need(tuple(draft_probs.shape) == (B, K, V),
              f"draft_probs must be [B, K, V] = [{B}, {K}, {V}], got {tuple(draft_probs.shape)}")
    if uniform_accept is not None:
        _need(tuple(uniform_accept.shape) == (B, K),
              f"uniform_accept must be [B, K] = [{B}, {K}], got {tuple(uniform_accept.shape)}")
    if uniform_sample is not None:
        _need(tuple(uniform_sample.shape) == (B,),
              f"uniform_sample must be [B] = [{B}], got {tuple(uniform_sample.shape)}")
    devs = {t.device for t in (draft_tokens, target_probs, draft_probs, uniform_accept, uniform_sample)
            if t is not None}
    _need(len(devs) == 1, f"all tensors must be on one device, got {devs}")
    return B, K, V


def check_tree(candidates, retrive_next_token, retrive_next_sibling, target_probs, coins, coin_final,
               max_depth):
    """Validate tree-verify arguments; return (B, N, V)."""
    _need(candidates.dim() == 2, f"candidates must be [B, N], got {tuple(candidates.shape)}")
    B, N = candidates.shape
    for name, t in (("retrive_next_token", retrive_next_token), ("retrive_next_sibling", retrive_next_sibling),
                    ("coins", coins)):
        _need(tuple(t.shape) == (B, N), f"{name} must be [B, N] = [{B}, {N}], got {tuple(t.shape)}")
    _need(target_probs.dim() == 3 and target_probs.shape[:2] == (B, N),
          f"target_probs must be [B, N, V], got {tuple(target_probs.shape)}")
    _need(tuple(coin_final.shape) == (B,), f"coin_final must be [B], got {tuple(coin_final.shape)}")
    _need(int(max_depth) >= 0, "max_depth must be >= 0")
    devs = {t.device for t in (candidates, retrive_next_token, retrive_next_sibling, target_probs, coins,
                               coin_final)}
    _need(len(devs) == 1, f"all tensors must be on one device, got {devs}")
    return B, N, target_probs.shape[2]


def sampling_params(logits: torch.Tensor, temperature, top_k, top_p):
    """Broadcast sampling parameters to one value per row of ``logits`` viewed as [M, V].

    Each parameter may be a Python number, a 0-d tensor, a tensor of shape [B] (one
    per request, with logits [B, N, V] or [M, V]) or of shape ``logits.shape[:-1]``.
    Returns (M, V, temperature f32 [M], top_k int64 [M], top_p f32 [M]).
    """
    _need(logits.dim() >= 1, "logits must have a vocabulary dimension")
    lead = tuple(logits.shape[:-1])
    V = logits.shape[-1]
    M = 1
    for s in lead:
        M *= s

    def per_row(x, dtype, default):
        if x is None:
            x = default
        t = torch.as_tensor(x, dtype=dtype, device=logits.device)
        if t.dim() == 0:
            return t.expand(M).contiguous()
        if tuple(t.shape) == lead:
            return t.reshape(M).contiguous()
        if len(lead) >= 1 and t.dim() == 1 and t.shape[0] == lead[0]:
            rest = M // lead[0] if lead[0] else 0
            return t[:, None].expand(lead[0], rest).reshape(M).contiguous()
        raise ValueError(f"sampling parameter of shape {tuple(t.shape)} does not fit logits {tuple(logits.shape)}")

    return (M, V, per_row(temperature, torch.float32, 1.0), per_row(top_k, torch.int64, 0),
            per_row(top_p, torch.float32, 1.0))


def check_soft_ce(draft_logits, target_logits):
    _need(draft_logits.shape == target_logits.shape,
          f"draft and target logits must have one shape, got {tuple(draft_logits.shape)} "
          f"and {tuple(target_logits.shape)}")
    _need(draft_logits.dim() >= 1 and draft_logits.shape[-1] >= 1, "logits need a vocabulary dimension")
    _need(draft_logits.is_floating_point() and target_logits.is_floating_point(), "logits must be float")
    _need(draft_logits.device == target_logits.device, "draft and target logits on different devices")


def check_soft_ce_shifted(draft_logits, target_logits, valid, shift):
    check_soft_ce(draft_logits, target_logits)
    _need(draft_logits.dim() == 3, f"shifted soft-CE takes [B, T, V] logits, got {tuple(draft_logits.shape)}")
    _need(tuple(valid.shape) == tuple(draft_logits.shape[:2]) and valid.dtype == torch.bool,
          f"valid must be a bool [B, T] = {tuple(draft_logits.shape[:2])} mask, got {valid.dtype} {tuple(valid.shape)}")
    _need(valid.device == draft_logits.device, "valid mask on another device than the logits")
    _need(isinstance(shift, int) and shift >= 0, f"shift must be an int >= 0, got {shift!r}")


def check_kv_cache_write(k_cache, v_cache, k, v, write_pos, rows=None):
    """Validate ``kv_cache_write`` arguments; return (B, KvH, T, D). Traced by torch.compile on a CPU
    engine: each message is formatted only on failure (formatting a symbolic size specialises it)."""
    if not (k.dim() == 4 and k.shape == v.shape):
        raise ValueError(f"k and v must be one [B, KvH, T, D] shape, got {tuple(k.shape)}, {tuple(v.shape)}")
    B, KvH, T, D = k.shape
    if not (k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.shape[1] == KvH
            and k_cache.shape[3] == D):
        raise ValueError(f"caches must be one [max_batch, {KvH}, slots, {D}] shape, got {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    if not (k.dtype == k_cache.dtype and v.dtype == v_cache.dtype):
        raise ValueError(f"k / v dtypes {k.dtype} / {v.dtype} must be the caches' ({k_cache.dtype} / {v_cache.dtype})")
    if not (write_pos.dim() == 2 and write_pos.shape[0] == B and write_pos.shape[1] == T
            and write_pos.dtype == torch.long):
        raise ValueError(f"write_pos must be int64 [B, T] = [{B}, {T}], got {write_pos.dtype} {tuple(write_pos.shape)}")
    if rows is not None and not (rows.dim() == 1 and rows.shape[0] == B and rows.dtype == torch.long):
        raise ValueError(f"rows must be int64 [B] = [{B}], got {rows.dtype} {tuple(rows.shape)}")
    if rows is None and B > k_cache.shape[0]:
        raise ValueError(f"batch {B} > cache rows {k_cache.shape[0]}")
    return B, KvH, T, D


#: most query rows (G query heads per KV head x T new tokens) the decode attention kernel holds
ATTENTION_MAX_ROWS = 256   # query rows (G*T): decode and verification; in blocks of 64 a program (the Triton
                           # kernel); prefills, longer, go to the reference


def attention_supported(q_shape, kv_heads: int) -> bool:
    """Shapes the decode attention kernel takes (``q_shape`` = [B, T, H, D]): G*T <= ATTENTION_MAX_ROWS
    and a power-of-two head dim >= 16; longer inputs (prefills) go to the reference."""
    _, T, H, D = q_shape
    return (H // kv_heads) * T <= ATTENTION_MAX_ROWS and D >= 16 and D & (D - 1) == 0
