"""EAGLE-3 training-time test (TTT) unroll.

Semantics (B rows of T tokens x_0..x_{T-1}; ``aux`` the target's
concatenated aux hidden states at each position; steps N):

- step k (0-based) at position t consumes the token x_{t+1+k}: ``input_ids``
  shifted left by 1+k and padded at the end with ``pad_token_id``.  Its
  logits at t predict x_{t+2+k}.
- hidden input: ``fc(aux_t)`` at k = 0, else the step k-1 output at t
  (pre-norm, or normed with ``norm_output``).  Gradients flow through it.
- RoPE position of step k at t: ``position_ids[t] + k`` — as in vLLM, where
  draft step k for a request whose last verified token sits at t runs at
  position t+k.
- attention of step k at t sees (a) step-0 keys at positions s <= t that are
  not padding, and (b) the "diagonal" keys (t, j) of every step 1 <= j <= k
  (for k = 0 the own key is already in (a)).  That is exactly the KV a
  chain-drafting runtime holds: the prefix written at step 0 plus the
  keys the earlier draft steps wrote for this query.

Two implementations share the ``TTTCache`` attention hook:
``impl="diag"`` (default) scores the step-0 block with one matmul and the
diagonal keys with elementwise products (like SpecForge), O(T^2 + kT);
``impl="mask"`` concatenates the keys of all steps and uses
``build_ttt_mask`` (O(k T^2), kept as a readable cross-check).
"""
from __future__ import annotations

import torch

from .layers import causal_mask, repeat_kv, to_additive
from .mtp import shift_left


def build_ttt_mask(T: int, k: int, attention_mask: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """Boolean mask for step ``k`` queries over the concatenated keys
    ``[step 0 | step 1 | ... | step k]`` (each T long): shape ``[T, (k+1)*T]``,
    or ``[B, T, (k+1)*T]`` when a ``[B, T]`` padding ``attention_mask`` is given
    (padding only removes step-0 keys; diagonal keys belong to the query)."""
    eye = torch.eye(T, dtype=torch.bool, device=device)
    blocks = [causal_mask(T, device)] + [eye] * k
    m = torch.cat(blocks, dim=1)
    if attention_mask is not None:
        valid = attention_mask.to(device=m.device).bool()
        key_valid = torch.cat([valid] + [torch.ones_like(valid)] * k, dim=1)  # [B, (k+1)T]
        m = m[None] & key_valid[:, None, :]
    return m


class TTTCache:
    """Per-layer store of the keys/values of every TTT step so far; it owns
    the attention (``Attention.forward`` delegates to ``attend``)."""

    def __init__(self, T: int, attention_mask: torch.Tensor | None = None, impl: str = "diag", device=None):
        if impl not in ("diag", "mask"):
            raise ValueError("impl must be 'diag' or 'mask'")
        self.T, self.impl, self.attention_mask, self.device = T, impl, attention_mask, device
        self.k: dict[int, list[torch.Tensor]] = {}
        self.v: dict[int, list[torch.Tensor]] = {}
        base = causal_mask(T, device)[None, None]
        if attention_mask is not None:
            base = base & attention_mask.bool()[:, None, None, :]
        self.base = base  # [B or 1, 1, T, T]

    def attend(self, layer_idx, q, k, v, _mask, attn):
        ks = self.k.setdefault(layer_idx, [])
        vs = self.v.setdefault(layer_idx, [])
        ks.append(k)
        vs.append(v)
        n_rep = attn.num_heads // attn.num_kv_heads
        if self.impl == "mask":
            K = repeat_kv(torch.cat(ks, dim=2), n_rep)
            V = repeat_kv(torch.cat(vs, dim=2), n_rep)
            m = build_ttt_mask(self.T, len(ks) - 1, self.attention_mask, q.device)
            m = m[:, None] if m.dim() == 3 else m[None, None]
            scores = (q @ K.transpose(-1, -2)) * attn.scale + to_additive(m, q.dtype)
            p = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            return p @ V
        k0, v0 = repeat_kv(ks[0], n_rep), repeat_kv(vs[0], n_rep)
        s0 = (q @ k0.transpose(-1, -2)) * attn.scale + to_additive(self.base, q.dtype)
        if len(ks) == 1:
            p = torch.softmax(s0.float(), dim=-1).to(q.dtype)
            return p @ v0
        kd = [repeat_kv(x, n_rep) for x in ks[1:]]
        vd = [repeat_kv(x, n_rep) for x in vs[1:]]
        sd = torch.stack([(q * x).sum(-1) for x in kd], dim=-1) * attn.scale  # [B, h, T, k]
        p = torch.softmax(torch.cat([s0, sd], dim=-1).float(), dim=-1).to(q.dtype)
        out = p[..., : self.T] @ v0
        for j, x in enumerate(vd):
            out = out + p[..., self.T + j, None] * x
        return out


def ttt_forward(head, input_ids, aux, attention_mask=None, steps: int = 7, *, position_ids=None,
                pad_token_id: int = 0, impl: str = "diag", return_hidden: bool = False):
    """Unroll ``steps`` EAGLE-3 draft steps over whole sequences.

    input_ids [B, T] int64 (target ids), aux [B, T, n_aux*H_t],
    attention_mask [B, T] (1 = real token) or None.  Returns the list of
    draft logits per step ``[B, T, Vd]``; with ``return_hidden`` also the
    list of hidden states fed forward (``[B, T, H]``).  For convenience
    ``ttt_forward(head, ids, aux, 3)`` reads the int as ``steps``."""
    if isinstance(attention_mask, int) and not isinstance(attention_mask, bool):
        steps, attention_mask = attention_mask, None
    B, T = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(T, device=input_ids.device)[None].expand(B, T)
    cache = TTTCache(T, attention_mask, impl, input_ids.device)
    hidden = head.project(aux)
    logits, hiddens = [], []
    for k in range(steps):
        ids_k = shift_left(input_ids, 1 + k, pad_token_id)
        lg, hidden = head.forward_step(ids_k, hidden, position_ids + k, kv_cache=cache)
        logits.append(lg)
        hiddens.append(hidden)
    return (logits, hiddens) if return_hidden else logits
