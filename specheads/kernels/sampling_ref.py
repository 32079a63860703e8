"""Sampling transform (temperature, top-k, top-p) in plain PyTorch — twin of ``sampling_triton``.

``target_probs(logits, temperature, top_k, top_p) -> float32 probs`` of the same shape
as ``logits`` ([B, N, V] or [M, V], any float dtype; math in float32).

Rules (both implementations):

* temperature < 1e-5 (vLLM's epsilon) means greedy: one-hot at the argmax of the logits,
  ties to the LOWEST index; top-k / top-p are then ignored.
* otherwise ``e = exp((logits - max) / temperature)`` (unnormalised, max entry 1).
* top-k (k > 0 and k < V; 0 = off): threshold ``t_k`` = the k-th largest ``e``; keep every
  token with ``e >= t_k``. **Ties at the threshold are all kept**, so more than k tokens
  survive when the k-th value is tied.
* top-p (p < 1; 1.0 = off), applied after top-k to the renormalised survivors (vLLM / HF
  order): threshold ``t_p`` = the largest value ``t`` with ``mass(e >= t) >= p * Z_k``
  (``Z_k`` = kept mass after top-k), i.e. the smallest set of top tokens whose mass reaches
  p, again keeping every token tied with the last one. p <= 0 keeps the argmax (and ties).
* output = kept ``e`` / their sum.

The Triton kernel finds the same thresholds by bisection over float32 bit patterns
(no sort). Top-k decisions only compare values and so agree exactly; top-p compares
float sums whose rounding depends on summation order, so the kept sets can differ
only when a cumulative mass lies within float rounding of ``p * Z_k``.
"""

from __future__ import annotations

import torch

from ._common import GREEDY_EPS, sampling_params

__all__ = ["target_probs"]


def target_probs(logits: torch.Tensor, temperature, top_k=None, top_p=None) -> torch.Tensor:
    """Apply temperature, then top-k, then top-p; return renormalised float32 probabilities.

    temperature / top_k / top_p: a number, or a tensor with one value per request
    ([B] for logits [B, N, V] or [M] for [M, V]) or per row (logits.shape[:-1]).
    """
    M, V, T, k, p = sampling_params(logits, temperature, top_k, top_p)
    x = logits.reshape(M, V).float()
    dev = x.device
    greedy = T < GREEDY_EPS
    t_safe = torch.where(greedy, torch.ones_like(T), T)
    m = x.amax(-1, keepdim=True)
    e = torch.exp((x - m) / t_safe[:, None])

    srt = torch.sort(e, dim=-1, descending=True).values
    use_k = (k > 0) & (k < V)
    kk = torch.where(use_k, k, V).clamp(min=1)
    t_k = torch.where(use_k, srt.gather(1, (kk - 1)[:, None])[:, 0], 0.0)
    ek = torch.where(e >= t_k[:, None], e, 0.0)

    z_k = ek.sum(-1)
    srt_k = torch.sort(ek, dim=-1, descending=True).values
    cum = srt_k.cumsum(-1)
    first = (cum < (p * z_k)[:, None]).sum(-1).clamp(max=V - 1)  # first position reaching p * Z_k
    t_p = srt_k.gather(1, first[:, None])[:, 0]
    use_p = p < 1.0
    t = torch.where(use_p, torch.maximum(t_p, t_k), t_k)
    kept = torch.where(e >= t[:, None], e, 0.0)
    probs = kept / kept.sum(-1, keepdim=True)

    cols = torch.arange(V, device=dev)
    am = torch.where(x == m, cols, V).amin(-1)
    onehot = (cols[None, :] == am[:, None]).float()
    probs = torch.where(greedy[:, None], onehot, probs)
    return probs.reshape(logits.shape)
