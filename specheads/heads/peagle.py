"""P-EAGLE (parallel EAGLE) draft head: the EAGLE-3 head (speculators layout, usually 4 layers) that
drafts K tokens in one forward.

Depth 0 at position t is EAGLE-3's first step: token x_{t+1}, hidden ``fc(aux_t)``, position t.
Depth d >= 1 of the same anchor t reads the mask token's embedding and ``fc(mask_hidden)``, a learned
stand-in for target states that do not exist yet, at position t + d. Depth d at anchor t attends to
depth 0 at every anchor s <= t and to depths 1..d of its own anchor: what vLLM's proposer computes
when it appends K - 1 mask slots after the last verified token and runs the head causally. The
logits at (t, d) predict x_{t+2+d}, the token EAGLE-3's TTT step d predicts.

State dict: :class:`Eagle3Head`'s plus ``mask_hidden [1, 1, n_aux*Ht]`` (vLLM reads it flat and
projects it through ``fc``, as here).
"""
from __future__ import annotations

import torch
from torch import nn

from .config import HeadConfig
from .eagle3 import Eagle3Head


class PEagleHead(Eagle3Head):
    kind = "peagle"

    def __init__(self, cfg: HeadConfig):
        super().__init__(cfg)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, cfg.num_aux * cfg.target_hidden_size))

    def mask_state(self) -> torch.Tensor:
        """``fc(mask_hidden)`` [H]: the hidden every masked slot reads."""
        return self.project(self.mask_hidden.reshape(1, -1))[0]

    def parallel_forward(self, input_ids: torch.Tensor, aux: torch.Tensor, anchor: torch.Tensor,
                         depth: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """All depths of the sampled anchors in one forward (training).

        ``input_ids [B, T]``, ``aux [B, T, n_aux*Ht]``; ``anchor``/``depth [B, N]`` the entries to run
        (depth -1: padding). Depth-0 entries carry token ``x_{anchor+1}`` and ``aux_anchor``, deeper ones
        the mask token and ``mask_hidden``. Returns draft logits ``[B, N, Vd]``; entry (t, d) predicts
        ``x_{t+2+d}``."""
        B, T = input_ids.shape
        real = depth == 0
        a = anchor.clamp(0, T - 1)
        nxt = torch.cat([input_ids[:, 1:], input_ids.new_zeros(B, 1)], dim=1)
        ids = torch.where(real, nxt.gather(1, a), torch.full_like(a, int(self.cfg.mask_token_id)))
        states = aux.gather(1, a[..., None].expand(B, a.shape[1], aux.shape[-1]))
        states = torch.where(real[..., None], states, self.mask_hidden.to(states.dtype).reshape(1, 1, -1))
        mask = parallel_mask(anchor, depth, attention_mask)
        logits, _ = self.forward_step(ids, self.project(states), (a + depth.clamp(min=0)), attention_mask=mask[:, None])
        return logits


def parallel_mask(anchor: torch.Tensor, depth: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[B, N, N] bool: entry q sees key k iff k is depth 0 at an anchor <= q's (and not padding), or k
    is in q's own rollout at a depth <= q's. Padding entries (depth -1) see only themselves."""
    aq, ak = anchor[:, :, None], anchor[:, None, :]
    dq, dk = depth[:, :, None], depth[:, None, :]
    ctx = (dk == 0) & (ak <= aq)
    if attention_mask is not None:
        key_ok = attention_mask.bool().gather(1, anchor.clamp(0, attention_mask.shape[1] - 1))
        ctx = ctx & key_ok[:, None, :]
    own = (ak == aq) & (dk >= 1) & (dk <= dq)
    m = (ctx | own) & (dq >= 0) & (dk >= 0)
    eye = torch.eye(anchor.shape[1], dtype=torch.bool, device=anchor.device)[None]
    return m | (eye & (dq < 0))
