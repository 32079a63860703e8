"""Drafters: who proposes the tokens the target verifies.

Protocol (duck-typed; subclass ``Drafter`` for the defaults):

- ``aux_layer_ids`` / ``needs_final``: which target states the drafter consumes.
- ``start(ctx)``: a new ``generate`` call begins (allocate caches).
- ``update(v: Verified)``: the target has verified new tokens. For each row, positions
  ``start .. start+count-1`` are now final in the target cache; ``next_tokens`` holds the
  token at position+1 of each (the accepted drafts and then the bonus token), ``aux`` /
  ``final`` the target states at those positions. (vLLM's eagle proposer semantics: the
  draft's first pass covers each newly verified token with the state of the previous
  position.) After the prompt, ``start=0`` and ``count=len(prompt)``.
- ``propose(ctx, k) -> Proposal``: up to k draft tokens per row (+ draft probs q when the
  drafter samples, i.e. ``ctx.sample_drafts``).
- ``propose_tree(ctx, cfg) -> DraftTree`` for drafters with ``supports_tree``.

Hidden-state drafters (EAGLE-3, EAGLE-1, MTP) call the head through the contract in
docs/ARCHITECTURE.md: ``head.project(aux)`` (EAGLE-3), ``head.forward_step(input_ids,
hidden, position_ids, attention_mask=None, kv_cache=None) -> (draft_logits, hidden_out)``,
``head.draft_to_target(ids)``. The KV cache handed to the head is ``DraftCache`` below:
heads' attention calls ``kv_cache.attend(layer_idx, q, k, v, mask, attn_module)`` and the
cache writes the new K/V at the slots and with the visibility the runtime set beforehand.
That is the only coupling to ``specheads.heads``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from .model import TargetModel, build_attn_mask
from .tree import DraftTree, Expansion, TreeConfig, build_dynamic_tree
from .verify import sample_inverse_cdf, target_probs


# ---------------------------------------------------------------------------- state
@dataclass
class DraftContext:
    """What the engine tells a drafter each step."""
    histories: list[list[int]]           # prompt + emitted tokens; the last one is not in the cache yet
    active: list[bool]
    device: torch.device
    max_seq: int
    vocab_size: int
    sample_drafts: bool = False           # draw drafts from q and return q (rule 'rejection')
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    generators: list[torch.Generator] = field(default_factory=list)

    @property
    def batch(self) -> int:
        return len(self.histories)

    def uniforms(self, n: int) -> torch.Tensor:
        """[B, n] uniforms, row b from request b's generator."""
        return torch.stack([torch.rand(n, generator=g) for g in self.generators]).to(self.device)


@dataclass
class Verified:
    start: torch.Tensor          # [B] position of the first newly verified token
    count: torch.Tensor          # [B] number of newly verified positions (0 for finished rows)
    next_tokens: torch.Tensor    # [B, n] token at position+1 of each verified position
    aux: torch.Tensor | None = None
    final: torch.Tensor | None = None


@dataclass
class Proposal:
    tokens: torch.Tensor                  # [B, K] target ids (padding: 0)
    num: torch.Tensor                     # [B] valid drafts per row
    probs: torch.Tensor | None = None     # [B, K, V] draft distribution the tokens were drawn from


class Drafter:
    aux_layer_ids: tuple = ()
    needs_final: bool = False
    supports_tree: bool = False
    provides_probs: bool = False

    def start(self, ctx: DraftContext) -> None:
        pass

    def update(self, v: Verified) -> None:
        pass

    def propose(self, ctx: DraftContext, k: int) -> Proposal:
        raise NotImplementedError

    def propose_tree(self, ctx: DraftContext, cfg: TreeConfig) -> DraftTree:
        raise NotImplementedError(f"{type(self).__name__} does not draft trees")


def _pick(ctx: DraftContext, logits_t: torch.Tensor):
    """Choose one draft token per row from target-vocab logits [B, V]: argmax, or a sample from
    q = target_probs(logits) when ctx.sample_drafts. Returns (ids [B], q [B, V] or None)."""
    if not ctx.sample_drafts:
        return logits_t.argmax(-1), None
    q = target_probs(logits_t, ctx.temperature, ctx.top_k, ctx.top_p)
    return sample_inverse_cdf(q, ctx.uniforms(1)[:, 0]), q


# ---------------------------------------------------------------------------- n-gram
class NGramDrafter(Drafter):
    """Prompt lookup: match the last n tokens (n = max_ngram .. min_ngram, longest first) in the
    request's own history (prompt + generated); take the right-most earlier occurrence and
    propose up to k tokens that followed it. Proposes nothing when no n-gram matches.

    ``occurrence="earliest"`` takes the left-most match instead, which is vLLM's rule (its
    n-gram proposer), so the two engines can be compared draft for draft."""

    def __init__(self, min_ngram: int = 1, max_ngram: int = 4, occurrence: str = "latest"):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if occurrence not in ("latest", "earliest"):
            raise ValueError(f"occurrence must be 'latest' or 'earliest', got {occurrence!r}")
        self.min_ngram, self.max_ngram, self.occurrence = min_ngram, max_ngram, occurrence

    def lookup(self, history: list[int], k: int) -> list[int]:
        arr = np.asarray(history, dtype=np.int64)
        L = len(arr)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            suffix = arr[L - n:]
            win = np.lib.stride_tricks.sliding_window_view(arr[:L - 1], n)   # starts 0 .. L-1-n
            hits = np.nonzero((win == suffix).all(axis=1))[0]
            if len(hits):
                i = int(hits[-1] if self.occurrence == "latest" else hits[0])
                return arr[i + n:i + n + k].tolist()
        return []

    def propose(self, ctx: DraftContext, k: int) -> Proposal:
        B = ctx.batch
        props = [self.lookup(h, k) if a else [] for h, a in zip(ctx.histories, ctx.active)]
        K = max([len(p) for p in props] + [0])
        toks = torch.zeros(B, K, dtype=torch.long)
        for b, p in enumerate(props):
            toks[b, :len(p)] = torch.tensor(p, dtype=torch.long)
        num = torch.tensor([len(p) for p in props], dtype=torch.long)
        return Proposal(toks.to(ctx.device), num.to(ctx.device), None)


# ---------------------------------------------------------------------------- draft KV cache
class DraftCache:
    """Static per-layer KV for a head, driven by the runtime: before each head call the runtime
    sets ``write_pos [B, T]`` and ``mask [B, 1, T, kv_len]``; the head's attention calls
    ``attend``. ``lengths[b]`` = valid slots of row b (rollback = lower it)."""

    def __init__(self, num_layers, batch, kv_heads, max_seq, head_dim, dtype, device):
        shape = (batch, kv_heads, max_seq, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.max_seq = max_seq
        self.write_pos = self.mask = None
        self.kv_len = max_seq

    def prepare(self, write_pos: torch.Tensor, mask: torch.Tensor, kv_len: int) -> None:
        self.write_pos, self.mask, self.kv_len = write_pos.clamp(max=self.max_seq - 1), mask, kv_len

    def attend(self, layer_idx, q, k, v, attention_mask=None, attn_module=None):
        B, KvH, T, D = k.shape
        idx = self.write_pos[:, None, :, None].expand(B, KvH, T, D)
        K, V = self.k[layer_idx], self.v[layer_idx]
        K.scatter_(2, idx, k.to(K.dtype))
        V.scatter_(2, idx, v.to(V.dtype))
        scale = getattr(attn_module, "scale", None)
        return F.scaled_dot_product_attention(
            q, K[:, :, :self.kv_len].to(q.dtype), V[:, :, :self.kv_len].to(q.dtype),
            attn_mask=self.mask, scale=scale, enable_gqa=q.shape[1] != KvH)


# ---------------------------------------------------------------------------- heads
def _head_config(head):
    for name in ("config", "cfg"):
        c = getattr(head, name, None)
        if c is not None and hasattr(c, "kind"):
            return c
    raise TypeError("head has no HeadConfig at .config or .cfg")


class HeadDrafter(Drafter):
    """Shared logic of EAGLE-3, EAGLE-1 and MTP drafting (chain and tree)."""

    kind = "eagle3"
    supports_tree = True
    provides_probs = True

    def __init__(self, head):
        self.head = head.eval()
        self.cfg = _head_config(head)
        if self.cfg.kind != self.kind:
            raise ValueError(f"{type(self).__name__} needs a '{self.kind}' head, got '{self.cfg.kind}'")
        if self.kind == "eagle3":
            self.aux_layer_ids = tuple(self.cfg.aux_layer_ids)
        else:
            self.needs_final = True
        self.cache: DraftCache | None = None
        self.pending: Verified | None = None

    # -- the coupling to heads/: everything below goes through these three methods
    def _input_hidden(self, v: Verified) -> torch.Tensor:
        if self.kind == "eagle3":
            return self.head.project(v.aux)
        return v.final

    def _step(self, ids, hidden, positions, write_pos, mask, kv_len, step: int = 0):
        """One head call. ``step`` = 0 for the first pass, s for the s-th draft token after it
        (MTP uses depth s mod num_mtp_depths, as vLLM's MTP proposer does)."""
        self.cache.prepare(write_pos, mask, kv_len)
        p = next(self.head.parameters())
        kw = {"depth": step % max(1, self.cfg.num_mtp_depths)} if self.kind == "mtp" else {}
        logits, h = self.head.forward_step(ids, hidden.to(p.dtype), positions, attention_mask=None,
                                           kv_cache=self.cache, **kw)
        return logits.float(), h

    def _to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.cfg.draft_vocab_size == self.cfg.target_vocab_size:
            return draft_ids
        return self.head.draft_to_target(draft_ids)

    def _target_logits(self, dl: torch.Tensor, V: int) -> torch.Tensor:
        """Draft-vocab logits [..., Vd] -> target-vocab logits [..., V] (-inf off the draft vocab)."""
        if dl.shape[-1] == V:
            return dl
        ids = self._to_target(torch.arange(dl.shape[-1], device=dl.device))
        out = torch.full(dl.shape[:-1] + (V,), float("-inf"), device=dl.device)
        return out.index_copy(-1, ids, dl)

    # --
    def start(self, ctx: DraftContext) -> None:
        p = next(self.head.parameters())
        c = self.cfg
        self.cache = DraftCache(max(c.num_layers, c.num_mtp_depths), ctx.batch, c.num_key_value_heads, ctx.max_seq, c.head_dim,
                                p.dtype, ctx.device)
        self.pending = None

    def update(self, v: Verified) -> None:
        self.pending = v

    @torch.no_grad()
    def _first_pass(self, ctx):
        v = self.pending
        if v is None:
            raise RuntimeError("propose() before update(): the drafter has no target states")
        c = self.cache
        B, T = v.next_tokens.shape
        c.lengths[:B] = v.start
        pos = v.start[:, None] + torch.arange(T, device=ctx.device)
        kv_len = min(int((v.start + T).max()), c.max_seq)
        mask = build_attn_mask(c.lengths[:B], pos.clamp(max=kv_len - 1), None, kv_len)
        logits, h = self._step(v.next_tokens, self._input_hidden(v), pos, pos, mask, kv_len)
        last = (v.count - 1).clamp(min=0)
        rows = torch.arange(B, device=ctx.device)
        c.lengths[:B] = v.start + v.count
        # the root: the last verified position; its output drafts the first token
        return logits[rows, last], h[rows, last], v.start + last

    @torch.no_grad()
    def propose(self, ctx: DraftContext, k: int) -> Proposal:
        logits, h, pos = self._first_pass(ctx)
        c, B, V = self.cache, ctx.batch, ctx.vocab_size
        base = c.lengths[:B].clone()
        toks, qs = [], []
        for s in range(k):
            if s > 0:
                wp = (base + s - 1)[:, None]
                kv_len = min(int(wp.max()) + 1, c.max_seq)
                c.lengths[:B] = base + s - 1
                mask = build_attn_mask(c.lengths[:B], wp.clamp(max=kv_len - 1), None, kv_len)
                logits, h = self._step(toks[-1][:, None], h[:, None], (pos + s)[:, None], wp, mask, kv_len, s)
                logits, h = logits[:, 0], h[:, 0]
            t, q = _pick(ctx, self._target_logits(logits, V))
            toks.append(t)
            qs.append(q)
        c.lengths[:B] = base
        num = torch.tensor([k if a else 0 for a in ctx.active], dtype=torch.long, device=ctx.device)
        probs = torch.stack(qs, 1) if ctx.sample_drafts else None
        return Proposal(torch.stack(toks, 1), num, probs)

    @torch.no_grad()
    def propose_tree(self, ctx: DraftContext, cfg: TreeConfig) -> DraftTree:
        logits, h_root, pos = self._first_pass(ctx)
        c, B, k = self.cache, ctx.batch, cfg.topk
        base = c.lengths[:B].clone()
        state = {"h": h_root[:, None].expand(B, k, h_root.shape[-1]), "vis": None}
        rows = torch.arange(B, device=ctx.device)[:, None]

        def expand(e: Expansion) -> torch.Tensor:
            level = e.level
            if level == 1:
                hid = state["h"]
                vis_prev = torch.zeros(B, k, 0, dtype=torch.bool, device=ctx.device)
            else:
                hid = state["h"][rows, e.parent_slot]
                vis_prev = state["vis"][rows, e.parent_slot]                  # [B, k, (level-1)*k]
            vis = torch.cat([vis_prev, torch.eye(k, dtype=torch.bool, device=ctx.device).expand(B, k, k)], -1)
            n_tree = level * k
            kv_len = min(int(base.max()) + n_tree, c.max_seq)
            slots = torch.arange(kv_len, device=ctx.device)
            mask = (slots[None, None, :] < base[:, None, None]).expand(B, k, kv_len).clone()
            tree_slots = base[:, None] + torch.arange(n_tree, device=ctx.device)       # [B, n_tree]
            mask.scatter_(2, tree_slots[:, None, :].expand(B, k, n_tree).clamp(max=kv_len - 1), vis)
            wp = tree_slots[:, -k:]
            positions = (pos + level)[:, None].expand(B, k)
            lg, h = self._step(e.tokens, hid, positions, wp, mask[:, None], kv_len, level)
            state["h"], state["vis"] = h, vis
            return lg.log_softmax(-1)

        root_lp = logits.log_softmax(-1)
        tree = build_dynamic_tree(root_lp, expand, cfg, map_ids=self._to_target)
        c.lengths[:B] = base
        return tree


class Eagle3Drafter(HeadDrafter):
    kind = "eagle3"


class Eagle1Drafter(HeadDrafter):
    kind = "eagle1"


class MTPDrafter(HeadDrafter):
    kind = "mtp"


# ---------------------------------------------------------------------------- draft model
class DraftModelDrafter(Drafter):
    """A standalone small LM (same vocabulary) with its own static cache. Each step it
    catches up on the tokens its cache lacks (the common prefix with the history is kept)
    and then drafts k tokens autoregressively."""

    provides_probs = True

    def __init__(self, model: TargetModel):
        self.model = model
        self.cached: list[list[int]] = []

    def start(self, ctx: DraftContext) -> None:
        if self.model.max_batch < ctx.batch or self.model.max_seq < ctx.max_seq:
            self.model.setup_caches(max(ctx.batch, self.model.max_batch), max(ctx.max_seq, self.model.max_seq))
        if self.model.args.vocab_size > ctx.vocab_size:
            raise ValueError("draft model vocabulary is larger than the target's")
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
        for s in range(k):
            if s > 0:
                kv_len = min(int(m.cache.lengths[:B].max()) + 1, m.max_seq)
                logits = m(toks[-1][:, None], kv_len=kv_len).logits[:, 0]
                m.commit(1)
            V = ctx.vocab_size
            lt = logits.float() if logits.shape[-1] == V else F.pad(logits.float(), (0, V - logits.shape[-1]), value=float("-inf"))
            t, q = _pick(ctx, lt)
            toks.append(t)
            qs.append(q)
            if s < k - 1:
                for b, tb in enumerate(t.tolist()):
                    self.cached[b].append(tb)
        num = torch.tensor([k if a else 0 for a in ctx.active], dtype=torch.long, device=dev)
        return Proposal(torch.stack(toks, 1), num, torch.stack(qs, 1) if ctx.sample_drafts else None)


def drafter_for_head(head) -> HeadDrafter:
    """The drafter class for a head's kind (eagle3 / eagle1 / mtp)."""
    kind = _head_config(head).kind
    return {"eagle3": Eagle3Drafter, "eagle1": Eagle1Drafter, "mtp": MTPDrafter}[kind](head)
