"""Decode attention in Triton — same contract as ``attention_ref.decode_attention``.

Why a kernel: at batch 1 a compiled decode step is bound by launches (H200, 2026-12-01: 11 kernels
per layer, ~1 ms a step for SmolLM2-135M). Through SDPA the attention of one decode layer is a q
re-layout copy, cuDNN's workspace memset, the attention, and (for T > 1) an output re-layout copy.
Here it is one kernel that reads q and the cache where they lie and writes o in the layout the
output projection reads.

One program per (batch row, KV head, block of query rows) holds up to ``ROWS_PER_PROGRAM`` of the G*T query
rows of that head (``BLOCK_M`` >= 16 for ``tl.dot``) and streams the row's first ``kv_len`` cache slots in
blocks of ``BLOCK_N`` with an online softmax (flash attention's recurrence, in exp2), accumulating in
float32. Meant for decode and verification (G*T up to ``ATTENTION_MAX_ROWS``: Qwen2's 6 query heads a KV head
times a P-EAGLE first pass of 4 + 15 slots fit, in two programs); prefills use the reference. fp32 inputs
multiply in IEEE fp32 (no TF32), so fp32 runs keep their fp32 accuracy.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._common import ATTENTION_MAX_ROWS, attention_supported, check_kv_cache_write
from ._triton_compat import patch_interpreter

__all__ = ["decode_attention", "kv_cache_write"]

patch_interpreter()

# triton's CPU interpreter multiplies half-type dots as integers (numpy has no bf16): there the
# operands are widened to fp32 first; compiled kernels multiply bf16 on the tensor cores
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
_LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
# query rows a program holds: 64 x a head dim of 128 in fp32 is the accumulator the kernel was sized for; more
# rows take more programs, each streaming the row's cache again
ROWS_PER_PROGRAM = 64


@triton.jit
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, m_ptr, o_ptr, rows_ptr, sm_scale, T, kv_len,
                             sq_b, sq_t, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sm_b, sm_r, so_b, so_t,
                             G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             HAS_ROWS: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    r = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)   # query row r = g*T + t (the mask's row order)
    rmask = r < G * T
    g = r // T
    t = r % T
    head = kvh * G + g
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sq_b + t[:, None] * sq_t + head[:, None] * sq_h + d[None, :],
                mask=rmask[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    if HAS_ROWS:
        crow = tl.load(rows_ptr + b).to(tl.int64)
    else:
        crow = b
    k_base = k_ptr + crow * sk_b + kvh * sk_h
    v_base = v_ptr + crow * sv_b + kvh * sv_h
    m_base = m_ptr + b * sm_b + r[:, None] * sm_r
    scale = sm_scale * _LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(0, kv_len, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < kv_len
        k = tl.load(k_base + n[:, None] * sk_s + d[None, :], mask=nmask[:, None], other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        bias = tl.load(m_base + n[None, :], mask=rmask[:, None] & nmask[None, :], other=float("-inf"))
        s = s * scale + bias.to(tl.float32) * _LOG2E
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)     # a row that has seen nothing yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + n[:, None] * sv_s + d[None, :], mask=nmask[:, None], other=0.0)
        if DOT_F32:
            v = v.to(tl.float32)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + b * so_b + t[:, None] * so_t + head[:, None] * D + d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=rmask[:, None])


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor,
                     kv_len: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    B, T, H, D = q.shape
    KvH = k_cache.shape[1]
    G = H // KvH
    if not attention_supported(q.shape, KvH):
        raise ValueError(f"decode_attention kernel: G*T = {G * T} query rows (max {ATTENTION_MAX_ROWS}) and a power-of-two "
                         f"head dim are needed, got H={H}, KvH={KvH}, T={T}, D={D}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or mask.stride(-1) != 1:
        raise ValueError("decode_attention kernel: the caches and the mask need a contiguous last dim")
    if mask.shape[:3] != (B, 1, G * T) or mask.shape[3] < kv_len:
        raise ValueError(f"mask {tuple(mask.shape)} must be [B, 1, G*T, >= kv_len] = [{B}, 1, {G * T}, {kv_len}]")
    o = torch.empty(B, T, H * D, dtype=q.dtype, device=q.device)
    if B == 0 or T == 0:
        return o
    BLOCK_M = min(ROWS_PER_PROGRAM, max(16, triton.next_power_of_2(G * T)))
    BLOCK_N = 64 if D <= 64 else 32
    rows_arg = rows if rows is not None else o       # a placeholder pointer, never read without HAS_ROWS
    _decode_attention_kernel[(B, KvH, triton.cdiv(G * T, BLOCK_M))](
        q, k_cache, v_cache, mask, o, rows_arg, D ** -0.5, T, kv_len,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), mask.stride(0), mask.stride(2),
        o.stride(0), o.stride(1),
        G=G, D=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HAS_ROWS=rows is not None, IEEE=q.dtype == torch.float32,
        DOT_F32=_INTERPRETED,
        num_warps=4, num_stages=2)
    return o


# The K/V write of a decode or verify step. Why a kernel: under torch.compile the write was an ``index_put_``
# that Inductor fused with RoPE, and with a symbolic T (verification: T = k+1) that kernel took 14.4 us a layer
# on the H200 against 1.7 us at T = 1 (2026-12-03, batch 8: 431 of a verify step's 1,217 us of kernels).
# One program per (batch row, new token) copies that token's KvH x D keys and values where they lie.
@triton.jit
def _kv_cache_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, wp_ptr, rows_ptr, T,
                           sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, skc_b, skc_h, skc_s, svc_b, svc_h, svc_s, swp_b, swp_t,
                           KVH: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                           HAS_ROWS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    slot = tl.load(wp_ptr + b * swp_b + t * swp_t).to(tl.int64)
    if HAS_ROWS:
        crow = tl.load(rows_ptr + b).to(tl.int64)
    else:
        crow = b
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    m = (h < KVH) & (d < D)
    k = tl.load(k_ptr + b * sk_b + h * sk_h + t * sk_t + d, mask=m)
    tl.store(kc_ptr + crow * skc_b + h * skc_h + slot * skc_s + d, k, mask=m)
    v = tl.load(v_ptr + b * sv_b + h * sv_h + t * sv_t + d, mask=m)
    tl.store(vc_ptr + crow * svc_b + h * svc_h + slot * svc_s + d, v, mask=m)


def kv_cache_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   write_pos: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    B, KvH, T, D = check_kv_cache_write(k_cache, v_cache, k, v, write_pos, rows)
    if any(x.stride(-1) != 1 for x in (k, v, k_cache, v_cache)):
        raise ValueError("kv_cache_write kernel: k, v and the caches need a contiguous last dim")
    if B == 0 or T == 0:
        return
    rows_arg = rows if rows is not None else write_pos      # a placeholder pointer, never read without HAS_ROWS
    _kv_cache_write_kernel[(B * T,)](
        k, v, k_cache, v_cache, write_pos, rows_arg, T,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        write_pos.stride(0), write_pos.stride(1),
        KVH=KvH, BLOCK_H=triton.next_power_of_2(KvH), D=D, BLOCK_D=triton.next_power_of_2(D),
        HAS_ROWS=rows is not None, num_warps=1)
