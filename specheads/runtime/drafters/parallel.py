"""Parallel drafters: heads that draft several tokens per forward (P-EAGLE, DFlash), chains only.

- ``PEagleDrafter``: one head forward a step. EAGLE-3's first pass over the newly verified tokens
  (``HeadDrafter.update``) runs with K - 1 mask slots placed right after each row's root: the
  mask token with hidden ``fc(mask_hidden)`` at positions root+1 .. root+K-1, causal as the
  training forward's depths are. The root's logits give draft 1 and mask slot d's draft d+1, as
  vLLM's parallel drafting (``llm_base_proposer.py``) appends its mask tokens to the pass. In a
  padded batch the mask slots replace each row's padding columns from its count on, so they take
  the very slots and positions that follow the row's verified tokens; ``propose`` only reads.
- ``DFlashDrafter``: the draft cache holds the context K/V (``head.context_kv`` of the target's
  aux states) of every verified position; a step runs one block [anchor, mask x (S-1)] at positions
  L .. L+S-1 (L: the row's verified length; the anchor is the last verified token, not yet in the
  target's cache), which sees the slots < L and its whole block; draft j is block slot j's.

Each draft is drawn from its own slot's distribution (returned as the proposal's q), so
speculative sampling stays exact: no slot reads another slot's drawn token.
"""

from __future__ import annotations

import torch

from ..tree import DraftTree, TreeConfig
from .base import DraftContext, Proposal, Verified, pick_draft
from .head import HeadDrafter


class _ParallelMixin:
    """What both parallel drafters share: k against the tokens one forward drafts, no trees, and
    each slot's draft (argmax, or a sample with its q) from the slots' draft-vocab logits."""

    supports_tree = False

    @property
    def tokens_per_forward(self) -> int:
        return int(self.cfg.tokens_per_forward)

    def check_k(self, k: int) -> None:
        """Refuse k above what one forward drafts (the engine calls this before generation)."""
        n = self.tokens_per_forward
        if k > n:
            what = "num_depths" if self.kind == "peagle" else "block_size - 1"
            raise ValueError(f"{self.name}: k={k} drafts per step, but one forward of this {self.kind} head drafts "
                             f"{n} tokens ({what} = {n}); use k <= {n}")

    def draft_slots(self, k: int) -> int:
        """Slots past a row's verified length that a step of k drafts needs within max_seq: k. P-EAGLE's pass also
        writes its K-1 mask slots there, but into the draft cache's own spare slots past max_seq (HeadDrafter.start),
        and the drafts a step keeps lie within k. DFlash's block overrides this."""
        return k

    def propose_tree(self, ctx: DraftContext, cfg: TreeConfig) -> DraftTree:
        raise ValueError(f"{type(self).__name__} drafts chains only ({self.kind} drafts all its tokens in one "
                         f"forward, with no branches): use k, not a tree")

    def _proposal(self, ctx: DraftContext, dl: torch.Tensor, k: int) -> Proposal:
        """dl [B, k, Vd]: slot s's draft-vocab logits -> the proposal (greedy or sampled)."""
        num = torch.where(ctx.active_mask, k, 0)
        if not ctx.sample_drafts:
            # d2t is increasing: the draft-vocab argmax mapped is the target-vocab argmax (ties included)
            return Proposal(self._to_target(dl.argmax(-1)), num, None)
        toks, qs = [], []
        for s in range(k):
            t, q = pick_draft(ctx, self._target_logits(dl[:, s].float(), ctx.vocab_size), s)
            toks.append(t)
            qs.append(q)
        return Proposal(torch.stack(toks, 1), num, torch.stack(qs, 1))


class PEagleDrafter(_ParallelMixin, HeadDrafter):
    """P-EAGLE: a step is EAGLE-3's first pass with K - 1 mask slots after each row's root, one
    forward. Every step is fixed-shape device work with state in buffers updated in place:
    ``graph_safe``."""

    kind = "peagle"
    uses_aux = True

    @property
    def mask_slots(self) -> int:
        return self.tokens_per_forward - 1

    def start(self, ctx: DraftContext) -> None:
        super().start(ctx)
        with torch.no_grad():
            m = self.head.mask_state().detach()
        st = self.state
        # refreshed in place: captured graphs read this very buffer, the head may have been retrained since
        if getattr(st, "mask_h", None) is None or st.mask_h.shape != m.shape:
            st.mask_h = m.clone()
        else:
            st.mask_h.copy_(m)

    def _with_mask_slots(self, next_tokens, hidden, count):
        """The pass's inputs [B, W + n]: each row's verified columns, then from its count on the mask
        token and hidden (its padding columns, and n more, become mask slots; those past count + n are
        padding whose outputs nothing reads)."""
        B, W = next_tokens.shape
        n = self.mask_slots
        col = torch.arange(W + n, device=next_tokens.device)
        verified = (col[None] < count[:, None])
        ids = torch.cat([next_tokens, next_tokens.new_zeros(B, n)], 1)
        ids = torch.where(verified, ids, int(self.cfg.mask_token_id))
        mask_h = self.state.mask_h.to(hidden.dtype)
        hidden = torch.cat([hidden, mask_h.expand(B, n, hidden.shape[-1])], 1)
        return ids, torch.where(verified[..., None], hidden, mask_h)

    @torch.no_grad()
    def propose(self, ctx: DraftContext, k: int) -> Proposal:
        self.check_k(k)
        logits, _, _ = self.root()          # [B, K, Vd]: the root's and the mask slots' from the last pass
        return self._proposal(ctx, logits[:, :k], k)


class DFlashDrafter(_ParallelMixin, HeadDrafter):
    """DFlash: ``update`` writes the verified positions' context K/V into the draft cache (no
    query); ``propose`` runs the block. The block always has ``block_size`` slots (its attention
    is bidirectional, so fewer slots would change the drafts), so a step writes that many slots
    past the row's length (``draft_slots``; the engine sizes its checks by it). Fixed-shape device
    work with state in buffers updated in place: ``graph_safe``."""

    kind = "dflash"
    uses_aux = True

    def __init__(self, head, name: str | None = None, target_vocab_size: int | None = None):
        super().__init__(head, name=name, target_vocab_size=target_vocab_size)
        self._context_fn, self._block_fn = self._write_context, self._block

    def compile(self, units: bool = True, **compile_kwargs) -> "DFlashDrafter":
        """The context write and the block through ``torch.compile`` (``units`` is accepted for
        HeadDrafter's signature: a DFlash step has no inner head call to compile alone)."""
        compile_kwargs.setdefault("dynamic", True)
        self._context_fn = torch.compile(self._write_context, **compile_kwargs)
        self._block_fn = torch.compile(self._block, **compile_kwargs)
        return self

    def draft_slots(self, k: int) -> int:
        return int(self.cfg.block_size)

    def _write_context(self, start, count, next_tokens, aux, rows=None):
        """The context K/V of positions start .. start+W-1 into their slots (the padded columns past
        ``count`` land past the new length, invisible, and are overwritten later); the cache lengths
        become start + count. Returns each row's anchor (its last verified next token) [B]."""
        c = self.cache
        B, W = next_tokens.shape
        at = slice(0, B) if rows is None else rows
        pos = start[:, None] + torch.arange(W, device=next_tokens.device)
        p = next(self.head.parameters())
        kv = self.head.context_kv(self.head.context(aux.to(p.dtype)), pos)
        for i, (k, v) in enumerate(kv):
            c.write(i, k, v, pos, rows)
        c.lengths[at] = start + count
        return next_tokens.gather(1, (count - 1).clamp(min=0)[:, None])[:, 0]

    def _block(self, anchor, kv_len: int):
        """Draft logits [B, S-1, Vd] of block slots 1 .. S-1: the block [anchor, mask x (S-1)] at slots
        L .. L+S-1, seeing the slots < L and its whole block (the cache lengths stay L)."""
        c, B, S = self.cache, anchor.shape[0], int(self.cfg.block_size)
        L = c.lengths[:B]
        ar = torch.arange(S, device=anchor.device)
        pos = L[:, None] + ar
        ids = torch.where(ar[None] == 0, anchor[:, None], int(self.cfg.mask_token_id))
        slots = torch.arange(kv_len, device=anchor.device)
        mask = (slots[None] < (L + S)[:, None])[:, None, None, :].expand(B, 1, S, kv_len)
        c.prepare(pos, mask, kv_len, self.cfg.num_attention_heads // self.cfg.num_key_value_heads)
        return self.head.forward_block(ids, pos, c)[:, 1:]

    @torch.no_grad()
    def update(self, v: Verified) -> None:
        st = self.state
        if st is None:
            raise RuntimeError("update() before start()")
        # the prompt's context eagerly, as the target's prefill (its width would recompile the compiled write)
        fn, self._prompt_pass = (self._write_context if self._prompt_pass else self._context_fn), False
        a = fn(v.start, v.count, v.next_tokens, v.aux)
        if getattr(st, "anchor", None) is None or st.anchor.shape[0] != a.shape[0]:
            st.anchor = a.clone()       # sized by the prompt's pass, then written in place (graphs read it)
        else:
            st.anchor.copy_(a)

    @torch.no_grad()
    def admit(self, rows: torch.Tensor, v: Verified) -> None:
        st = self.state
        if st is None:
            raise RuntimeError("admit() before start()")
        self._prompt_pass = False
        a = self._write_context(v.start, v.count, v.next_tokens, v.aux, rows=rows)   # eager, as the prefill
        B = self.ctx.batch
        if getattr(st, "anchor", None) is None or st.anchor.shape[0] != B:
            st.anchor = a.new_zeros(B)
        st.anchor[rows] = a

    def root(self):
        raise NotImplementedError("DFlashDrafter keeps no root: its block starts at the anchor token")

    @torch.no_grad()
    def propose(self, ctx: DraftContext, k: int) -> Proposal:
        self.check_k(k)
        st = self.state
        if st is None or getattr(st, "anchor", None) is None:
            raise RuntimeError("propose() before update(): the drafter has no target states")
        dl = self._block_fn(st.anchor, self._kv_len())
        return self._proposal(ctx, dl[:, :k], k)
