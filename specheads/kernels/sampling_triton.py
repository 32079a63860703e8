"""Sampling transform in Triton — same contract and rules as ``sampling_ref.target_probs``.

No sort: each program owns ``BLOCK_M`` rows and streams the vocabulary in blocks.
The top-k threshold (the k-th largest value) and the top-p threshold (largest t with
mass(e >= t) >= p * Z_k) are found by bisection over the bit patterns of non-negative
float32 values (their integer order is their float order): 30 halvings of
[0, bits(1.0) + 1] pin the exact float value, each halving one pass that counts /
sums the entries >= the probe. Cost: up to ~64 passes over a row when both top-k and
top-p are on, 3 passes otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import GREEDY_EPS, sampling_params
from ._triton_compat import patch_interpreter

__all__ = ["target_probs"]

patch_interpreter()

_EPS: tl.constexpr = tl.constexpr(GREEDY_EPS)
_ONE_BITS_PLUS_1: tl.constexpr = tl.constexpr(0x3F800000 + 1)  # bits(1.0) + 1: above every e
_BISECT_STEPS: tl.constexpr = tl.constexpr(30)  # 2**30 > 0x3F800001


@triton.jit
def _block_e(x_ptr, rows, rmask, cols, V, m, ts):
    """e = exp((x - m) / T) for a [BLOCK_M, BLOCK_V] tile; -1 in lanes outside the row."""
    m2 = rmask[:, None] & (cols < V)[None, :]
    x = tl.load(x_ptr + rows[:, None] * V + cols[None, :], mask=m2, other=float("-inf")).to(tl.float32)
    e = tl.exp((x - m[:, None]) / ts[:, None])
    return tl.where(m2, e, -1.0)


@triton.jit
def _target_probs_kernel(x_ptr, temp_ptr, topk_ptr, topp_ptr, out_ptr, M, V,
                         BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    cols0 = tl.arange(0, BLOCK_V)
    T = tl.load(temp_ptr + rows, mask=rmask, other=1.0)
    k = tl.load(topk_ptr + rows, mask=rmask, other=0)
    p = tl.load(topp_ptr + rows, mask=rmask, other=1.0)
    greedy = T < _EPS
    ts = tl.where(greedy, 1.0, T)

    # pass: row max and argmax (lowest index among ties)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    am = tl.zeros([BLOCK_M], tl.int32)
    for start in range(0, V, BLOCK_V):
        cols = start + cols0
        m2 = rmask[:, None] & (cols < V)[None, :]
        x = tl.load(x_ptr + rows[:, None] * V + cols[None, :], mask=m2, other=float("-inf")).to(tl.float32)
        bm = tl.max(x, 1)
        bi = tl.min(tl.where((x == bm[:, None]) & m2, cols[None, :], V), 1)
        upd = bm > m
        am = tl.where(upd, bi, am)
        m = tl.where(upd, bm, m)
    m = tl.where(rmask, m, 0.0)  # rows past M: keep the arithmetic finite

    # top-k: largest t with count(e >= t) >= k  (= the k-th largest e; ties all kept)
    need_k = rmask & (~greedy) & (k > 0) & (k < V)
    lo = tl.zeros([BLOCK_M], tl.int32)
    hi = tl.full([BLOCK_M], _ONE_BITS_PLUS_1, tl.int32)
    if tl.sum(need_k.to(tl.int32), 0) > 0:
        for _ in range(0, _BISECT_STEPS):
            mid = lo + (hi - lo) // 2
            v = mid.to(tl.float32, bitcast=True)
            cnt = tl.zeros([BLOCK_M], tl.int64)
            for start in range(0, V, BLOCK_V):
                e = _block_e(x_ptr, rows, rmask, start + cols0, V, m, ts)
                cnt += tl.sum((e >= v[:, None]).to(tl.int64), 1)
            ok = cnt >= k
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
    t_k = tl.where(need_k, lo.to(tl.float32, bitcast=True), 0.0)

    # top-p on the top-k survivors: largest t >= t_k with mass(e >= t) >= p * Z_k
    need_p = rmask & (~greedy) & (p < 1.0)
    lo = t_k.to(tl.int32, bitcast=True)
    hi = tl.full([BLOCK_M], _ONE_BITS_PLUS_1, tl.int32)
    if tl.sum(need_p.to(tl.int32), 0) > 0:
        z_k = tl.zeros([BLOCK_M], tl.float32)
        for start in range(0, V, BLOCK_V):
            e = _block_e(x_ptr, rows, rmask, start + cols0, V, m, ts)
            z_k += tl.sum(tl.where(e >= t_k[:, None], e, 0.0), 1)
        target = p * z_k
        for _ in range(0, _BISECT_STEPS):
            mid = lo + (hi - lo) // 2
            v = mid.to(tl.float32, bitcast=True)
            mass = tl.zeros([BLOCK_M], tl.float32)
            for start in range(0, V, BLOCK_V):
                e = _block_e(x_ptr, rows, rmask, start + cols0, V, m, ts)
                mass += tl.sum(tl.where(e >= v[:, None], e, 0.0), 1)
            ok = mass >= target
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
    t = tl.where(need_p, lo.to(tl.float32, bitcast=True), t_k)

    z = tl.zeros([BLOCK_M], tl.float32)
    for start in range(0, V, BLOCK_V):
        e = _block_e(x_ptr, rows, rmask, start + cols0, V, m, ts)
        z += tl.sum(tl.where(e >= t[:, None], e, 0.0), 1)
    z = tl.where(z > 0, z, 1.0)
    for start in range(0, V, BLOCK_V):
        cols = start + cols0
        m2 = rmask[:, None] & (cols < V)[None, :]
        e = _block_e(x_ptr, rows, rmask, cols, V, m, ts)
        probs = tl.where(e >= t[:, None], e / z[:, None], 0.0)
        onehot = tl.where(cols[None, :] == am[:, None], 1.0, 0.0)
        probs = tl.where(greedy[:, None], onehot, probs)
        tl.store(out_ptr + rows[:, None] * V + cols[None, :], probs, mask=m2)


def target_probs(logits: torch.Tensor, temperature, top_k=None, top_p=None) -> torch.Tensor:
    M, V, T, k, p = sampling_params(logits, temperature, top_k, top_p)
    x = logits.reshape(M, V).contiguous()
    out = torch.empty((M, V), dtype=torch.float32, device=logits.device)
    if M == 0:
        return out.reshape(logits.shape)
    cuda = logits.device.type == "cuda"
    BLOCK_V = min(triton.next_power_of_2(V), 4096 if cuda else 1024)
    BLOCK_M = min(triton.next_power_of_2(M), max(1, (4096 if cuda else 65536) // BLOCK_V), 1024)
    num_warps = 8 if BLOCK_M * BLOCK_V >= 4096 else 4
    _target_probs_kernel[(triton.cdiv(M, BLOCK_M),)](x, T, k, p, out, M, V, BLOCK_M=BLOCK_M, BLOCK_V=BLOCK_V,
                                                       num_warps=num_warps)
    return out.reshape(logits.shape)
