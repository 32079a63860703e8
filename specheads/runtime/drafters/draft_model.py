"""A standalone draft model: a small LM of the same vocabulary drafting autoregressively."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model import TargetModel
from .base import Drafter, DraftContext, DraftVocabError, Proposal, pick_draft


class DraftModelDrafter(Drafter):
    """A standalone small LM (same vocabulary) with its own static cache. Each step it
    catches up on the tokens its cache lacks (the common prefix with the history is kept)
    and then drafts k tokens autoregressively. Reads the host view of the context."""

    provides_probs = True

    def __init__(self, model: TargetModel):
        self.model = model
        self.cached: list[list[int]] = []

    def check_target(self, vocab_size: int) -> None:
        if self.model.args.vocab_size > vocab_size:
            raise DraftVocabError(f"draft model vocabulary ({self.model.args.vocab_size}) is larger than the "
                                  f"target's ({vocab_size})")

    def start(self, ctx: DraftContext) -> None:
        if self.model.max_batch < ctx.batch or self.model.max_seq < ctx.max_seq:
            self.model.setup_caches(max(ctx.batch, self.model.max_batch), max(ctx.max_seq, self.model.max_seq))
        self.check_target(ctx.vocab_size)
        self.model.reset()
        self.cached = [[] for _ in range(ctx.batch)]

    @torch.no_grad()
    def propose(self, ctx: DraftContext, k: int) -> Proposal:
        m, B, dev = self.model, ctx.batch, ctx.device
        keep, feed = [], []
        for b, hist in enumerate(ctx.histories):
            old = self.cached[b]
            n = 0
            lim = min(len(old), len(hist) - 1)          # always re-feed at least the last token
            while n < lim and old[n] == hist[n]:
                n += 1
            keep.append(n)
            feed.append(hist[n:] if ctx.active[b] else hist[-1:])
            self.cached[b] = list(hist)
        m.set_lengths(keep)
        T = max(len(f) for f in feed)
        ids = torch.zeros(B, T, dtype=torch.long)
        for b, f in enumerate(feed):
            ids[b, :len(f)] = torch.tensor(f)
        cnt = torch.tensor([len(f) for f in feed], device=dev)
        ids = ids.to(dev)
        kv_len = min(max(keep) + T, m.max_seq)
        out = m(ids, logits_index=(cnt - 1)[:, None], kv_len=kv_len)
        m.commit(cnt)
        toks, qs = [], []
        logits = out.logits[:, 0]
        longest = max(len(h) for h in ctx.histories)
        for s in range(k):
            if s > 0:
                kv_len = min(longest + s, m.max_seq)
                logits = m(toks[-1][:, None], kv_len=kv_len).logits[:, 0]
                m.commit(1)
            V = ctx.vocab_size
            lt = logits.float() if logits.shape[-1] == V else F.pad(logits.float(), (0, V - logits.shape[-1]), value=float("-inf"))
            t, q = pick_draft(ctx, lt, s)
            toks.append(t)
            qs.append(q)
            if s < k - 1:
                for b, tb in enumerate(t.tolist()):
                    self.cached[b].append(tb)
        num = torch.tensor([k if a else 0 for a in ctx.active], dtype=torch.long, device=dev)
        return Proposal(torch.stack(toks, 1), num, torch.stack(qs, 1) if ctx.sample_drafts else None)
