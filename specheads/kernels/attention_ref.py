"""Decode attention over a static KV cache in plain PyTorch — twin of ``attention_triton``.

``decode_attention(q, k_cache, v_cache, mask, kv_len, rows=None) -> o``:

* ``q`` [B, T, H, D]: the new tokens' queries (RoPE applied; any strides, last dim contiguous);
* ``k_cache`` / ``v_cache`` [max_batch, KvH, slots, D]: one layer's cache, the new tokens' K/V
  already written; batch row b reads cache row ``rows[b]`` (``rows`` None: row b), slots < ``kv_len``;
* ``mask`` [B, 1, G*T, kv_len], additive (0 / -inf) in any float dtype, G = H // KvH query heads
  per KV head; mask row ``g*T + t`` is query t of group member g (``runtime.model.additive_mask``);
* ``o`` [B, T, H*D] in q's dtype: softmax(q k^T / sqrt(D) + mask) v with Hugging Face's
  ``repeat_kv`` pairing (query head h reads KV head h // G).

Every query row must see at least one slot. The G query heads of a KV head become G*T query rows of
one attention over that head (no K/V repeat).

``kv_cache_write(k_cache, v_cache, k, v, write_pos, rows=None)``, in place: the new tokens' K/V
``k`` / ``v`` [B, KvH, T, D] (any strides, last dim contiguous; the caches' dtype) go to
``k_cache[rows[b], :, write_pos[b, t]]`` (``rows`` None: row b); ``write_pos`` [B, T] int64 inside the
cache, distinct per row (a repeated slot keeps one of its writes, which one is not defined).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import check_kv_cache_write

__all__ = ["decode_attention", "kv_cache_write"]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor,
                     kv_len: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    B, T, H, D = q.shape
    KvH = k_cache.shape[1]
    G = H // KvH
    if rows is None:
        k, v = k_cache[:B, :, :kv_len], v_cache[:B, :, :kv_len]
    else:
        k, v = k_cache[rows, :, :kv_len], v_cache[rows, :, :kv_len]
    qg = q.reshape(B, T, KvH, G, D).permute(0, 2, 3, 1, 4).reshape(B, KvH, G * T, D)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask.to(q.dtype))
    return o.view(B, KvH, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H * D)


def kv_cache_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   write_pos: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    B, KvH, _, _ = check_kv_cache_write(k_cache, v_cache, k, v, write_pos, rows)
    # ``index_put_``, not ``scatter_``: under torch.compile (the CPU engine) a scatter into the cache copies all of it
    r = torch.arange(B, device=k.device) if rows is None else rows
    index = (r[:, None, None], torch.arange(KvH, device=k.device)[None, :, None], write_pos[:, None, :])
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)
