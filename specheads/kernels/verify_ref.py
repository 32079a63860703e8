"""Plain-PyTorch verification rules — the reference twins of ``verify_triton``.

Same function names, signatures and outputs as the Triton module; the two agree
bit for bit (see ``_common`` for why sampling is exact). Everything is vectorised
over the batch; the only Python loops are over tree steps.

Conventions shared by all rules
-------------------------------
* ``B`` requests, ``K`` draft tokens, ``V`` vocabulary. Target rows are
  ``[B, K+1, V]``: row ``i`` is the target distribution for the token after
  ``i`` accepted drafts (row ``K`` gives the bonus token).
* A draft token < 0 means "no draft here" (variable-length drafts padded with -1):
  verification stops there and the next token is drawn from the plain target row.
* Argmax ties resolve to the LOWEST index (written out explicitly, not left to
  ``torch.argmax``).
* Probabilities are read as float32 (any float dtype accepted); uniforms are float32
  in [0, 1). A zero-mass target row (invalid input) yields token -1.
"""

from __future__ import annotations

import torch

from ._common import (MIN_THRESHOLD_ACC, SCALE, TreeVerifyOutput, VerifyOutput, check_chain, check_tree)

__all__ = ["argmax_lowest", "sample_inverse_cdf", "greedy_verify", "rejection_verify", "onehot_verify",
           "tree_verify"]


def argmax_lowest(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Argmax along ``dim`` with ties resolved to the lowest index (int64)."""
    x = x.float()
    m = x.amax(dim=dim, keepdim=True)
    n = x.shape[dim]
    shape = [1] * x.dim()
    shape[dim] = n
    idx = torch.arange(n, device=x.device).view(shape)
    return torch.where(x == m, idx, n).amin(dim=dim)


def sample_inverse_cdf(residual: torch.Tensor, fallback: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Exact inverse-CDF draw per row (see ``_common``).

    residual, fallback: float32 [B, V] non-negative weights (unnormalised); the draw uses
    ``residual`` unless its quantised mass is 0, then ``fallback``; -1 if both are 0.
    u: float32 [B] in [0, 1). Returns int64 [B].
    """
    wr = (residual.float() * SCALE).to(torch.int64)
    wp = (fallback.float() * SCALE).to(torch.int64)
    tot_r = wr.sum(-1)
    tot_p = wp.sum(-1)
    use_r = tot_r > 0
    w = torch.where(use_r[:, None], wr, wp)
    total = torch.where(use_r, tot_r, tot_p)
    r = (u.double() * total.double()).to(torch.int64)
    r = torch.minimum(r, total - 1)
    cum = w.cumsum(-1)
    idx = (cum <= r[:, None]).sum(-1)  # first index whose inclusive prefix sum exceeds r
    return torch.where(total > 0, idx, torch.full_like(idx, -1))


def _assemble(x: torch.Tensor, n: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    B, K = x.shape
    pos = torch.arange(K + 1, device=x.device)
    xk = torch.cat([x, x.new_full((B, 1), -1)], dim=1)
    out = torch.where(pos[None, :] < n[:, None], xk, -1)
    return torch.where(pos[None, :] == n[:, None], tok[:, None], out)


def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> VerifyOutput:
    """Greedy verification: accept drafts while they equal the target argmax.

    draft_tokens: int [B, K]; target_logits: float [B, K+1, V] — logits or probabilities
    (anything whose argmax is the target's greedy choice). The correction / bonus token
    is the target argmax at position ``num_accepted``.
    """
    B, K, V = check_chain(draft_tokens, target_logits)
    x = draft_tokens.long()
    am = argmax_lowest(target_logits, -1)  # [B, K+1]
    n = (x == am[:, :K]).long().cumprod(1).sum(1)
    pos = torch.arange(K + 1, device=x.device)
    out = torch.where(pos[None, :] <= n[:, None], am, -1)
    return VerifyOutput(n, out)


def _chain(draft_tokens, draft_probs, target_probs, uniform_accept, uniform_sample) -> VerifyOutput:
    B, K, V = check_chain(draft_tokens, target_probs, draft_probs, uniform_accept, uniform_sample)
    dev = draft_tokens.device
    x = draft_tokens.long()
    rows = torch.arange(B, device=dev)
    valid = x >= 0
    xs = x.clamp(min=0)
    if K > 0:
        p_x = target_probs[:, :K].gather(2, xs[..., None])[..., 0].float()
        q_x = draft_probs.gather(2, xs[..., None])[..., 0].float() if draft_probs is not None else 1.0
        accept = valid & (uniform_accept.float() * q_x < p_x)
        n = accept.long().cumprod(1).sum(1)
        xn = torch.where(n < K, x[rows, n.clamp(max=K - 1)], -1)  # the rejected draft, if any
    else:
        n = torch.zeros(B, dtype=torch.long, device=dev)
        xn = torch.full((B,), -1, dtype=torch.long, device=dev)
    p_n = target_probs[rows, n].float()
    has = xn >= 0
    if draft_probs is not None:
        q_n = draft_probs[rows, n.clamp(max=max(K - 1, 0))].float() if K > 0 else torch.zeros_like(p_n)
        q_n = torch.where(has[:, None], q_n, 0.0)
        res = torch.clamp_min(p_n - q_n, 0.0)
    else:
        cols = torch.arange(V, device=dev)
        res = torch.where(cols[None, :] == xn[:, None], 0.0, p_n)
    tok = sample_inverse_cdf(res, p_n, uniform_sample.float())
    return VerifyOutput(n, _assemble(x, n, tok))


def rejection_verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     uniform_accept: torch.Tensor, uniform_sample: torch.Tensor) -> VerifyOutput:
    """Standard speculative sampling with draft probabilities.

    Accept draft i iff ``uniform_accept[b, i] * q(x_i) < p(x_i)`` (= u < min(1, p/q)
    without a division); at the first rejection draw from norm(max(0, p - q)) with
    ``uniform_sample``; when all K are accepted draw the bonus from ``target_probs[:, K]``.
    draft_tokens int [B, K]; draft_probs [B, K, V]; target_probs [B, K+1, V];
    uniform_accept [B, K]; uniform_sample [B].
    """
    return _chain(draft_tokens, draft_probs, target_probs, uniform_accept, uniform_sample)


def onehot_verify(draft_tokens: torch.Tensor, target_probs: torch.Tensor, uniform_accept: torch.Tensor,
                  uniform_sample: torch.Tensor) -> VerifyOutput:
    """Speculative sampling with a one-hot draft (q = delta_x; vLLM's default without draft probs).

    Accept iff ``u < p(x)``; on rejection draw from p with x zeroed (renormalised).
    """
    return _chain(draft_tokens, None, target_probs, uniform_accept, uniform_sample)


def tree_verify(candidates: torch.Tensor, retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor,
                target_probs: torch.Tensor, coins: torch.Tensor, coin_final: torch.Tensor, max_depth: int,
                threshold_single: float = 1.0, threshold_acc: float = 1.0) -> TreeVerifyOutput:
    """Target-only tree verification (SGLang ``tree_speculative_sampling_target_only``).

    candidates [B, N] tokens of the tree nodes (node 0 = root = last verified token);
    retrive_next_token [B, N] first child of each node, retrive_next_sibling [B, N] next
    sibling (both -1 terminated, local node indices); target_probs [B, N, V] the target
    distribution at each node; coins [B, N] one uniform per node (used to test that node's
    children); coin_final [B]; max_depth = number of draft levels that may be accepted
    (SGLang's num_speculative_tokens - 1).

    From the root, walk depth by depth: with the current node's coin ``c`` and a running
    sum ``acc`` over its children in sibling order, child ``x`` is accepted iff
    ``c * threshold_acc <= acc + p(x)`` or ``p(x) >= threshold_single`` (SGLang writes
    ``c <= acc / threshold_acc``; the product form avoids a division whose rounding
    differs between devices, identical at threshold_acc = 1). On acceptance descend and
    reset ``acc``; when every child is rejected (or there is none) stop. The next token is
    drawn with ``coin_final`` from the target at the last accepted node with the tokens of
    its rejected children zeroed (SGLang: relu(target - draft_probs) with draft_probs set to
    the target at rejected tokens) — or from the plain target if max_depth was reached.

    With threshold_single = threshold_acc = 1 this is lossless: accepting the first child
    whose cumulative target mass reaches the coin is an inverse-CDF draw from p restricted
    to the children, and the residual draw covers the rest, so every emitted token has
    exactly the target distribution (sequential rejection sampling of one-hot drafts among
    siblings). Sibling tokens must be distinct for this (as tree builders produce).
    Uses ``<=`` like SGLang, so a coin of exactly 0 accepts a zero-probability first child.
    """
    B, N, V = check_tree(candidates, retrive_next_token, retrive_next_sibling, target_probs, coins, coin_final,
                         max_depth)
    D = int(max_depth)
    dev = candidates.device
    cand = candidates.long()
    nt = retrive_next_token.long()
    ns = retrive_next_sibling.long()
    coins_f = coins.float()
    thr_s = torch.tensor(float(threshold_single), dtype=torch.float32, device=dev)
    thr_a = torch.tensor(max(float(threshold_acc), MIN_THRESHOLD_ACC), dtype=torch.float32, device=dev)
    rows = torch.arange(B, device=dev)

    accept_index = torch.full((B, D + 1), -1, dtype=torch.long, device=dev)
    accept_index[:, 0] = 0
    out = torch.full((B, D + 1), -1, dtype=torch.long, device=dev)
    cur = nt[:, 0].clone()
    last = torch.zeros(B, dtype=torch.long, device=dev)
    depth = torch.zeros(B, dtype=torch.long, device=dev)
    coin = coins_f[:, 0].clone()
    pacc = torch.zeros(B, dtype=torch.float32, device=dev)
    active = (cur >= 0) & (depth < D)
    while bool(active.any()):
        cs = torch.where(active, cur, 0)
        tok = torch.where(active, cand[rows, cs], 0)
        pt = torch.where(active, target_probs[rows, last, tok].float(), 0.0)
        pacc = torch.where(active, pacc + pt, pacc)
        acc = active & ((coin * thr_a <= pacc) | (pt >= thr_s))
        rej = active & ~acc
        depth = depth + acc.long()
        accept_index[rows[acc], depth[acc]] = cs[acc]
        out[rows[acc], depth[acc] - 1] = tok[acc]
        coin = torch.where(acc, coins_f[rows, cs], coin)
        last = torch.where(acc, cs, last)
        pacc = torch.where(acc, 0.0, pacc)
        cur = torch.where(acc, nt[rows, cs], torch.where(rej, ns[rows, cs], cur))
        active = (cur >= 0) & (depth < D)

    p_last = target_probs[rows, last].float()
    res = p_last.clone()
    c = torch.where(depth < D, nt[rows, last], -1)  # children of the last node: all rejected
    while bool((c >= 0).any()):
        has = c >= 0
        cc = c.clamp(min=0)
        res[rows[has], cand[rows, cc][has]] = 0.0
        c = torch.where(has, ns[rows, cc], -1)
    tok = sample_inverse_cdf(res, p_last, coin_final.float())
    out[rows, depth] = tok
    return TreeVerifyOutput(accept_index, depth, tok, out)
