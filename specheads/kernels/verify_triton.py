"""Triton verification kernels — same contract as ``verify_ref`` (bit-identical outputs).

Each program handles a tile of ``BLOCK_B`` requests and streams the vocabulary in
``BLOCK_V`` blocks. On a GPU with a large vocabulary the tile is one request
(``BLOCK_B = 1``); for small vocabularies (and under ``TRITON_INTERPRET=1``) many
requests share a program. Kernels never synchronise with the host, so the wrappers
can be captured in CUDA graphs (outputs are allocated with ``torch.empty``).

Sampling is the exact integer inverse CDF described in ``_common``: pass 1 sums the
quantised residual and target weights, pass 2 scans blocks until every request of
the tile has found its token (early exit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_compat import patch_interpreter
from ._common import MIN_THRESHOLD_ACC, SCALE, TreeVerifyOutput, VerifyOutput, check_chain, check_tree

__all__ = ["greedy_verify", "rejection_verify", "onehot_verify", "tree_verify"]

patch_interpreter()

_SCALE: tl.constexpr = tl.constexpr(SCALE)


def _tiles(B: int, V: int, device: torch.device, max_block_v: int = 4096):
    """Pick (BLOCK_B, BLOCK_V, num_warps) for a [B, V] problem."""
    BLOCK_V = min(triton.next_power_of_2(max(V, 1)), max_block_v if device.type == "cuda" else 1024)
    budget = 4096 if device.type == "cuda" else 65536  # elements per tile
    BLOCK_B = min(triton.next_power_of_2(max(B, 1)), max(1, budget // BLOCK_V), 1024)
    num_warps = 8 if BLOCK_B * BLOCK_V >= 4096 else 4
    return BLOCK_B, BLOCK_V, num_warps


# ----------------------------------------------------------------------------------------
# greedy
# ----------------------------------------------------------------------------------------
@triton.jit
def _argmax_rows_kernel(x_ptr, out_ptr, R, V, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    cols0 = tl.arange(0, BLOCK_V)
    best = tl.full([BLOCK_R], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK_R], tl.int32)
    for start in range(0, V, BLOCK_V):
        cols = start + cols0
        m2 = rmask[:, None] & (cols < V)[None, :]
        x = tl.load(x_ptr + rows[:, None] * V + cols[None, :], mask=m2, other=float("-inf")).to(tl.float32)
        bm = tl.max(x, 1)
        bi = tl.min(tl.where((x == bm[:, None]) & m2, cols[None, :], V), 1)
        upd = bm > best  # strict: the earlier block keeps ties -> lowest index
        best_i = tl.where(upd, bi, best_i)
        best = tl.where(upd, bm, best)
    tl.store(out_ptr + rows, best_i.to(tl.int64), mask=rmask)


@triton.jit
def _greedy_accept_kernel(draft_ptr, am_ptr, num_ptr, out_ptr, B, K, BLOCK_B: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    alive = rmask
    n = tl.zeros([BLOCK_B], tl.int64)
    for i in range(0, K):
        x = tl.load(draft_ptr + rows * K + i, mask=rmask, other=-1)
        a = tl.load(am_ptr + rows * (K + 1) + i, mask=rmask, other=-2)
        alive = alive & (x == a)
        n += alive.to(tl.int64)
    for i in range(0, K + 1):
        a = tl.load(am_ptr + rows * (K + 1) + i, mask=rmask, other=-1)
        tl.store(out_ptr + rows * (K + 1) + i, tl.where(i <= n, a, -1), mask=rmask)
    tl.store(num_ptr + rows, n, mask=rmask)


def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> VerifyOutput:
    B, K, V = check_chain(draft_tokens, target_logits)
    dev = draft_tokens.device
    x = draft_tokens.to(torch.int64).contiguous()
    t = target_logits.contiguous()
    R = B * (K + 1)
    am = torch.empty(R, dtype=torch.int64, device=dev)
    BR, BV, nw = _tiles(R, V, dev)
    if R > 0:
        _argmax_rows_kernel[(triton.cdiv(R, BR),)](t, am, R, V, BLOCK_R=BR, BLOCK_V=BV, num_warps=nw)
    num = torch.empty(B, dtype=torch.int64, device=dev)
    out = torch.empty((B, K + 1), dtype=torch.int64, device=dev)
    BB = min(triton.next_power_of_2(max(B, 1)), 1024 if dev.type != "cuda" else 128)
    if B > 0:
        _greedy_accept_kernel[(triton.cdiv(B, BB),)](x, am, num, out, B, K, BLOCK_B=BB, num_warps=4)
    return VerifyOutput(num, out)


# ----------------------------------------------------------------------------------------
# rejection sampling (draft probs) and one-hot drafts
# ----------------------------------------------------------------------------------------
@triton.jit
def _chain_verify_kernel(draft_ptr, q_ptr, p_ptr, ua_ptr, us_ptr, num_ptr, out_ptr, B, K, V,
                         HAS_Q: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    cols0 = tl.arange(0, BLOCK_V)

    # --- acceptance: sequential over the K drafts, one scalar gather per request ---
    alive = rmask
    n = tl.zeros([BLOCK_B], tl.int64)
    for i in range(0, K):
        x = tl.load(draft_ptr + rows * K + i, mask=rmask, other=-1)
        valid = x >= 0
        xs = tl.where(valid, x, 0)
        lm = alive & valid
        p = tl.load(p_ptr + (rows * (K + 1) + i) * V + xs, mask=lm, other=0.0).to(tl.float32)
        u = tl.load(ua_ptr + rows * K + i, mask=lm, other=1.0).to(tl.float32)
        if HAS_Q:
            q = tl.load(q_ptr + (rows * K + i) * V + xs, mask=lm, other=1.0).to(tl.float32)
            acc = lm & (u * q < p)
        else:
            acc = lm & (u < p)
        alive = acc
        n += alive.to(tl.int64)

    # --- the token after the accepted prefix: residual (or target) inverse CDF ---
    has_x = rmask & (n < K)
    xr = tl.load(draft_ptr + rows * K + tl.where(has_x, n, 0), mask=has_x, other=-1)
    has_x = has_x & (xr >= 0)
    prow = (rows * (K + 1) + n) * V
    qrow = (rows * K + tl.where(has_x, n, 0)) * V

    tot_r = tl.zeros([BLOCK_B], tl.int64)
    tot_p = tl.zeros([BLOCK_B], tl.int64)
    for start in range(0, V, BLOCK_V):
        cols = start + cols0
        m2 = rmask[:, None] & (cols < V)[None, :]
        p = tl.load(p_ptr + prow[:, None] + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        if HAS_Q:
            q = tl.load(q_ptr + qrow[:, None] + cols[None, :], mask=m2 & has_x[:, None], other=0.0).to(tl.float32)
            r = tl.maximum(p - q, 0.0)
        else:
            r = tl.where(cols[None, :] == xr[:, None], 0.0, p)
        tot_r += tl.sum((r * _SCALE).to(tl.int64), 1)
        tot_p += tl.sum((p * _SCALE).to(tl.int64), 1)

    use_r = tot_r > 0
    total = tl.where(use_r, tot_r, tot_p)
    us = tl.load(us_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    thr = (us.to(tl.float64) * total.to(tl.float64)).to(tl.int64)
    thr = tl.minimum(thr, total - 1)
    found = tl.full([BLOCK_B], -1, tl.int64)
    carry = tl.zeros([BLOCK_B], tl.int64)
    searching = rmask & (total > 0)
    n_search = tl.sum(searching.to(tl.int32), 0)
    start = 0
    while (start < V) & (n_search > 0):
        cols = start + cols0
        m2 = rmask[:, None] & (cols < V)[None, :]
        p = tl.load(p_ptr + prow[:, None] + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        if HAS_Q:
            q = tl.load(q_ptr + qrow[:, None] + cols[None, :], mask=m2 & has_x[:, None], other=0.0).to(tl.float32)
            r = tl.maximum(p - q, 0.0)
        else:
            r = tl.where(cols[None, :] == xr[:, None], 0.0, p)
        w = tl.where(use_r[:, None], (r * _SCALE).to(tl.int64), (p * _SCALE).to(tl.int64))
        c = tl.cumsum(w, 1) + carry[:, None]
        hit = (c > thr[:, None]) & m2
        idx = tl.min(tl.where(hit, cols[None, :], V), 1).to(tl.int64)
        newly = searching & (idx < V)
        found = tl.where(newly, idx, found)
        searching = searching & ~newly
        carry += tl.sum(w, 1)
        n_search = tl.sum(searching.to(tl.int32), 0)
        start += BLOCK_V

    # --- outputs: accepted drafts, then the sampled token, then -1 ---
    for i in range(0, K + 1):
        xi = tl.load(draft_ptr + rows * K + i, mask=rmask & (i < K), other=-1)
        val = tl.where(i < n, xi, tl.where(i == n, found, -1))
        tl.store(out_ptr + rows * (K + 1) + i, val, mask=rmask)
    tl.store(num_ptr + rows, n, mask=rmask)


def _chain(draft_tokens, draft_probs, target_probs, uniform_accept, uniform_sample) -> VerifyOutput:
    B, K, V = check_chain(draft_tokens, target_probs, draft_probs, uniform_accept, uniform_sample)
    dev = draft_tokens.device
    x = draft_tokens.to(torch.int64).contiguous()
    p = target_probs.contiguous()
    q = draft_probs.contiguous() if draft_probs is not None else p  # dummy pointer when HAS_Q=False
    ua = uniform_accept.to(torch.float32).contiguous()
    us = uniform_sample.to(torch.float32).contiguous()
    num = torch.empty(B, dtype=torch.int64, device=dev)
    out = torch.empty((B, K + 1), dtype=torch.int64, device=dev)
    if B == 0:
        return VerifyOutput(num, out)
    BB, BV, nw = _tiles(B, V, dev)
    _chain_verify_kernel[(triton.cdiv(B, BB),)](x, q, p, ua, us, num, out, B, K, V, HAS_Q=draft_probs is not None,
                                                BLOCK_B=BB, BLOCK_V=BV, num_warps=nw)
    return VerifyOutput(num, out)


def rejection_verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     uniform_accept: torch.Tensor, uniform_sample: torch.Tensor) -> VerifyOutput:
    return _chain(draft_tokens, draft_probs, target_probs, uniform_accept, uniform_sample)


def onehot_verify(draft_tokens: torch.Tensor, target_probs: torch.Tensor, uniform_accept: torch.Tensor,
                  uniform_sample: torch.Tensor) -> VerifyOutput:
    return _chain(draft_tokens, None, target_probs, uniform_accept, uniform_sample)


# ----------------------------------------------------------------------------------------
# target-only tree verification (SGLang semantics)
# ----------------------------------------------------------------------------------------
@triton.jit
def _zero_children(r, cols, first_child, cand_ptr, ns_ptr, base):
    """Zero the entries of ``r`` [BB, BV] at the tokens of the sibling list starting at first_child."""
    c = first_child
    n_left = tl.sum((c >= 0).to(tl.int32), 0)
    while n_left > 0:
        has = c >= 0
        cc = tl.where(has, c, 0)
        t = tl.load(cand_ptr + base + cc, mask=has, other=-1)
        r = tl.where(cols[None, :] == t[:, None], 0.0, r)
        c = tl.load(ns_ptr + base + cc, mask=has, other=-1)
        n_left = tl.sum((c >= 0).to(tl.int32), 0)
    return r


@triton.jit
def _tree_verify_kernel(cand_ptr, nt_ptr, ns_ptr, p_ptr, coins_ptr, cf_ptr, acc_idx_ptr, num_ptr, next_ptr,
                        out_ptr, B, N, V, D, thr_single, thr_acc,
                        BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    base = rows * N
    cols0 = tl.arange(0, BLOCK_V)

    cur = tl.load(nt_ptr + base, mask=rmask, other=-1).to(tl.int64)
    last = tl.zeros([BLOCK_B], tl.int64)
    depth = tl.zeros([BLOCK_B], tl.int64)
    coin = tl.load(coins_ptr + base, mask=rmask, other=0.0).to(tl.float32)
    pacc = tl.zeros([BLOCK_B], tl.float32)
    tl.store(acc_idx_ptr + rows * (D + 1), tl.zeros([BLOCK_B], tl.int64), mask=rmask)
    active = rmask & (cur >= 0) & (depth < D)
    n_active = tl.sum(active.to(tl.int32), 0)
    while n_active > 0:
        cs = tl.where(active, cur, 0)
        tok = tl.load(cand_ptr + base + cs, mask=active, other=0).to(tl.int64)
        pt = tl.load(p_ptr + (base + last) * V + tok, mask=active, other=0.0).to(tl.float32)
        pacc = tl.where(active, pacc + pt, pacc)
        acc = active & ((coin * thr_acc <= pacc) | (pt >= thr_single))
        rej = active & ~acc
        depth += acc.to(tl.int64)
        tl.store(acc_idx_ptr + rows * (D + 1) + depth, cs, mask=acc)
        tl.store(out_ptr + rows * (D + 1) + depth - 1, tok, mask=acc)
        child = tl.load(nt_ptr + base + cs, mask=acc, other=-1).to(tl.int64)
        sib = tl.load(ns_ptr + base + cs, mask=rej, other=-1).to(tl.int64)
        new_coin = tl.load(coins_ptr + base + cs, mask=acc, other=0.0).to(tl.float32)
        coin = tl.where(acc, new_coin, coin)
        last = tl.where(acc, cs, last)
        pacc = tl.where(acc, 0.0, pacc)
        cur = tl.where(acc, child, tl.where(rej, sib, cur))
        active = rmask & (cur >= 0) & (depth < D)
        n_active = tl.sum(active.to(tl.int32), 0)

    # children of the last accepted node were all rejected (unless max depth was reached)
    first_child = tl.load(nt_ptr + base + last, mask=rmask & (depth < D), other=-1).to(tl.int64)
    prow = (base + last) * V
    tot_r = tl.zeros([BLOCK_B], tl.int64)
    tot_p = tl.zeros([BLOCK_B], tl.int64)
    for start in range(0, V, BLOCK_V):
        cols = start + cols0
        m2 = rmask[:, None] & (cols < V)[None, :]
        p = tl.load(p_ptr + prow[:, None] + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        r = _zero_children(p, cols, first_child, cand_ptr, ns_ptr, base)
        tot_r += tl.sum((r * _SCALE).to(tl.int64), 1)
        tot_p += tl.sum((p * _SCALE).to(tl.int64), 1)

    use_r = tot_r > 0
    total = tl.where(use_r, tot_r, tot_p)
    u = tl.load(cf_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    thr = (u.to(tl.float64) * total.to(tl.float64)).to(tl.int64)
    thr = tl.minimum(thr, total - 1)
    found = tl.full([BLOCK_B], -1, tl.int64)
    carry = tl.zeros([BLOCK_B], tl.int64)
    searching = rmask & (total > 0)
    n_search = tl.sum(searching.to(tl.int32), 0)
    start = 0
    while (start < V) & (n_search > 0):
        cols = start + cols0
        m2 = rmask[:, None] & (cols < V)[None, :]
        p = tl.load(p_ptr + prow[:, None] + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        r = _zero_children(p, cols, first_child, cand_ptr, ns_ptr, base)
        w = tl.where(use_r[:, None], (r * _SCALE).to(tl.int64), (p * _SCALE).to(tl.int64))
        c = tl.cumsum(w, 1) + carry[:, None]
        hit = (c > thr[:, None]) & m2
        idx = tl.min(tl.where(hit, cols[None, :], V), 1).to(tl.int64)
        newly = searching & (idx < V)
        found = tl.where(newly, idx, found)
        searching = searching & ~newly
        carry += tl.sum(w, 1)
        n_search = tl.sum(searching.to(tl.int32), 0)
        start += BLOCK_V

    tl.store(next_ptr + rows, found, mask=rmask)
    tl.store(num_ptr + rows, depth, mask=rmask)
    tl.store(out_ptr + rows * (D + 1) + depth, found, mask=rmask)
    for j in range(1, D + 1):
        tl.store(acc_idx_ptr + rows * (D + 1) + j, tl.full([BLOCK_B], -1, tl.int64), mask=rmask & (j > depth))
        tl.store(out_ptr + rows * (D + 1) + j, tl.full([BLOCK_B], -1, tl.int64), mask=rmask & (j > depth))


def tree_verify(candidates: torch.Tensor, retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor,
                target_probs: torch.Tensor, coins: torch.Tensor, coin_final: torch.Tensor, max_depth: int,
                threshold_single: float = 1.0, threshold_acc: float = 1.0) -> TreeVerifyOutput:
    B, N, V = check_tree(candidates, retrive_next_token, retrive_next_sibling, target_probs, coins, coin_final,
                         max_depth)
    D = int(max_depth)
    dev = candidates.device
    cand = candidates.to(torch.int64).contiguous()
    nt = retrive_next_token.to(torch.int64).contiguous()
    ns = retrive_next_sibling.to(torch.int64).contiguous()
    p = target_probs.contiguous()
    cn = coins.to(torch.float32).contiguous()
    cf = coin_final.to(torch.float32).contiguous()
    accept_index = torch.empty((B, D + 1), dtype=torch.int64, device=dev)
    num = torch.empty(B, dtype=torch.int64, device=dev)
    nxt = torch.empty(B, dtype=torch.int64, device=dev)
    out = torch.empty((B, D + 1), dtype=torch.int64, device=dev)
    if B == 0:
        return TreeVerifyOutput(accept_index, num, nxt, out)
    BB, BV, nw = _tiles(B, V, dev)
    _tree_verify_kernel[(triton.cdiv(B, BB),)](
        cand, nt, ns, p, cn, cf, accept_index, num, nxt, out, B, N, V, D,
        float(threshold_single), max(float(threshold_acc), MIN_THRESHOLD_ACC),
        BLOCK_B=BB, BLOCK_V=BV, num_warps=nw)
    return TreeVerifyOutput(accept_index, num, nxt, out)
