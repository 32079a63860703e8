"""The draft vocabulary of a head: ``d2t`` / ``t2d`` buffers (conventions in docs/conventions.md).

``target_id = draft_id + d2t[draft_id]``; ``t2d[target_id]`` is True for the target ids the draft
vocabulary holds. A full draft vocabulary has ``d2t`` all zero and ``t2d`` all True.
"""
from __future__ import annotations

import torch


class DraftVocabMixin:
    """``set_vocab_mapping`` and ``draft_to_target`` for a head with ``cfg`` and ``d2t`` / ``t2d`` buffers."""

    def register_vocab_buffers(self) -> None:
        cfg = self.cfg
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(cfg.target_vocab_size, dtype=torch.bool) if cfg.full_vocab
                             else torch.zeros(cfg.target_vocab_size, dtype=torch.bool))

    def set_vocab_mapping(self, d2t: torch.Tensor | None, t2d: torch.Tensor | None = None) -> None:
        Vd, Vt = self.cfg.draft_vocab_size, self.cfg.target_vocab_size
        if d2t is None:
            if not self.cfg.full_vocab:
                raise ValueError(f"draft vocab {Vd} < target vocab {Vt} needs a d2t mapping")
            self.d2t.zero_()
            self.t2d.fill_(True)
            return
        d2t = torch.as_tensor(d2t, dtype=torch.int64).to(self.d2t.device)
        if d2t.shape != (Vd,):
            raise ValueError(f"d2t has shape {tuple(d2t.shape)}, expected ({Vd},)")
        target_ids = torch.arange(Vd, device=d2t.device) + d2t
        if int(target_ids.min()) < 0 or int(target_ids.max()) >= Vt:
            raise ValueError("d2t maps draft ids outside the target vocabulary")
        self.d2t.copy_(d2t)
        if t2d is None:
            t2d = torch.zeros(Vt, dtype=torch.bool, device=d2t.device)
            t2d[target_ids] = True
        t2d = torch.as_tensor(t2d, dtype=torch.bool)
        if t2d.shape != (Vt,):
            raise ValueError(f"t2d has shape {tuple(t2d.shape)}, expected ({Vt},)")
        self.t2d.copy_(t2d)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

