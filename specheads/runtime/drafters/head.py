"""Hidden-state head drafters: EAGLE-3, EAGLE-1 and MTP (chains and trees), and the head's KV cache
(``parallel.py`` builds P-EAGLE and DFlash on these).

They call the head through the contract in docs/ARCHITECTURE.md: ``head.project(aux)``
(EAGLE-3), ``head.forward_step(input_ids, hidden, position_ids, attention_mask=None,
kv_cache=None) -> (draft_logits, hidden_out)``, ``head.draft_to_target(ids)``. The KV cache
handed to the head is ``DraftCache`` below: heads' attention calls ``kv_cache.attend(layer_idx,
q, k, v, mask, attn_module)`` and the cache writes the new K/V at the slots and with the
visibility the runtime set beforehand. That is the only coupling to ``specheads.heads``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specheads import kernels
from specheads.heads.layers import allow_recompiles, fuse_projections

from ..model import additive_mask, build_attn_mask, round_up
from ..tree import DraftTree, Expansion, TreeConfig, build_dynamic_tree
from .base import Drafter, DraftContext, DraftVocabError, Proposal, Verified, pick_draft


class DraftCache:
    """Static per-layer KV for a head, driven by the runtime: before each head call the runtime
    sets ``write_pos [B, T]`` and ``mask [B, 1, T, kv_len]``; the head's attention calls
    ``attend``. ``lengths[b]`` = valid slots of row b (rollback = lower it). Allocates
    ``max_seq`` rounded up to a multiple of 16 slots."""

    def __init__(self, num_layers, batch, kv_heads, max_seq, head_dim, dtype, device):
        self.slots = round_up(max_seq)
        shape = (batch, kv_heads, self.slots, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.max_seq = max_seq
        self.write_pos = self.mask = self.kernel_mask = self.rows = None
        self.kv_len = self.slots
        # the engine's decode attention kernel on a GPU (as in the target's layers), SDPA on a CPU
        self.attn_backend = kernels.resolve_backend("auto", self.lengths)

    def prepare(self, write_pos: torch.Tensor, mask: torch.Tensor, kv_len: int, groups: int = 1,
                rows: torch.Tensor | None = None) -> None:
        """Before a head call: where its T new K/V go, what each sees (bool [B, 1, T, kv_len]),
        ``groups`` = query heads per KV head (the kernel's additive mask has a row per query head)
        and ``rows`` [B] the cache row of each batch row (None: the first B; continuous batching
        admits new requests into freed rows this way)."""
        self.write_pos, self.mask, self.kv_len, self.rows = write_pos.clamp(max=self.max_seq - 1), mask, kv_len, rows
        self.kernel_mask = None
        if self.attn_backend == "triton":
            self.kernel_mask = additive_mask(mask, self.k[0].dtype, groups)

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, write_pos: torch.Tensor,
              rows: torch.Tensor | None = None) -> None:
        """K/V [B, KvH, T, D] into slots ``write_pos`` [B, T] of cache rows ``rows`` (None: the first B)
        without a query: DFlash's context enters the cache as keys and values only."""
        K, V = self.k[layer_idx], self.v[layer_idx]
        kernels.kv_cache_write(K, V, k.to(K.dtype), v.to(V.dtype), write_pos.clamp(max=self.max_seq - 1), rows,
                               backend=self.attn_backend)

    def attend(self, layer_idx, q, k, v, attention_mask=None, attn_module=None):
        """q [B, H, T, D], k / v [B, KvH, T, D] of the new tokens -> o [B, H, T, D]."""
        B, H, T, D = q.shape
        KvH = k.shape[1]
        K, V = self.k[layer_idx], self.v[layer_idx]
        kernels.kv_cache_write(K, V, k.to(K.dtype), v.to(V.dtype), self.write_pos, self.rows, backend=self.attn_backend)
        scale = getattr(attn_module, "scale", None)
        # kernels.decode_attention runs its reference where the kernel does not take the shape
        if (self.kernel_mask is not None and self.kernel_mask.shape[2] == T * (H // KvH) and q.dtype == K.dtype
                and scale in (None, D ** -0.5)):
            o = kernels.decode_attention(q.transpose(1, 2), K, V, self.kernel_mask, self.kv_len, self.rows,
                                         backend=self.attn_backend)
            return o.view(B, T, H, D).transpose(1, 2)
        K, V = (K[:B], V[:B]) if self.rows is None else (K[self.rows], V[self.rows])
        return F.scaled_dot_product_attention(
            q, K[:, :, :self.kv_len].to(q.dtype), V[:, :, :self.kv_len].to(q.dtype),
            attn_mask=self.mask, scale=scale, enable_gqa=q.shape[1] != KvH)



def head_config(head):
    for name in ("config", "cfg"):
        c = getattr(head, name, None)
        if c is not None and hasattr(c, "kind"):
            return c
    raise TypeError("head has no HeadConfig at .config or .cfg")


class _HeadState:
    """A head drafter's device state for one (batch, max_seq, dtype, device): its KV cache and
    the root of the next draft (the first pass's output at the last verified position)."""

    def __init__(self, cache: DraftCache):
        self.cache = cache
        self.root_logits: torch.Tensor | None = None    # [B, Vd]; P-EAGLE: [B, K, Vd] (its mask slots' after it)
        self.root_h: torch.Tensor | None = None         # [B, H]
        self.root_pos: torch.Tensor | None = None       # [B] position of the root


class HeadDrafter(Drafter):
    """Shared logic of EAGLE-3, EAGLE-1 and MTP drafting (chain and tree).

    ``update`` runs the head's first pass over the newly verified tokens at once and keeps
    its output at each row's last verified position (the root) in static buffers;
    ``propose`` drafts from the root. Every tensor that lives from one step to the next is
    a buffer updated in place, so a whole speculative step can be replayed from a CUDA
    graph (``graph_safe``). Buffers are kept per (batch, max_seq) and reused by later calls."""

    kind = "eagle3"
    uses_aux = True             # the first pass reads fc(target aux states); False: the target's final state
    mask_slots = 0              # slots the first pass appends after each row's root (P-EAGLE's depths 2..K)
    supports_tree = True
    provides_probs = True
    graph_safe = True

    def __init__(self, head, name: str | None = None, target_vocab_size: int | None = None):
        self.head = head.eval()
        self.cfg = head_config(head)
        if self.cfg.kind != self.kind:
            raise ValueError(f"{type(self).__name__} needs a '{self.kind}' head, got '{self.cfg.kind}'")
        self.name = name or getattr(head, "name", None) or f"{self.cfg.kind} head"
        bad = self.vocab_problems()
        if bad:
            raise DraftVocabError(f"{self.name}: vocabulary mapping does not fit: " + "; ".join(bad))
        if target_vocab_size is not None:
            self.check_target(target_vocab_size)
        if self.uses_aux:
            self.aux_layer_ids = tuple(self.cfg.aux_layer_ids)
        else:
            self.needs_final = True
        self._states: dict = {}
        self._prompt_pass = False
        self.state: _HeadState | None = None
        self.cache: DraftCache | None = None
        self.ctx: DraftContext | None = None
        # the three units a step runs; ``compile`` swaps in torch.compile'd ones. ``_inner_step`` is the
        # head call inside the first pass and the greedy chain: the plain one, inlined when those are compiled
        self._step, self._first_pass_fn, self._greedy_chain_fn = self._step_impl, self._first_pass, self._greedy_chain
        self._inner_step = self._step_impl

    def compile(self, units: bool = True, **compile_kwargs) -> "HeadDrafter":
        """Run the head's units through ``torch.compile`` (the head module itself is untouched): the
        first pass over the verified tokens, a greedy chain of draft steps, and one head call for
        the other paths, each with its masks and cache indices. Eagerly a drafted cycle is a few
        hundred small kernels, and they are what makes a head's speedup fall short of its tau.
        ``units=False`` compiles the head call alone, the first pass and the chain around it eager (the
        engine ``bench_runtime.py --engines compiled_as_r3`` times)."""
        compile_kwargs.setdefault("dynamic", True)     # as TargetModel.compile_layers
        allow_recompiles()
        self._step = torch.compile(self._step_impl, **compile_kwargs)
        if units:
            self._first_pass_fn = torch.compile(self._first_pass, **compile_kwargs)
            self._greedy_chain_fn = torch.compile(self._greedy_chain, **compile_kwargs)
        else:
            self._inner_step = self._step
        return self

    # -- vocabulary checks (before generation)
    def vocab_problems(self, target_vocab: int | None = None) -> list[str]:
        """What does not fit in the head's vocabulary mapping, alone (``target_vocab`` None)
        or against a target with ``target_vocab`` tokens."""
        c, h = self.cfg, self.head
        Vd, Vt = int(c.draft_vocab_size), int(c.target_vocab_size)
        V = Vt if target_vocab is None else int(target_vocab)
        errs = []
        if target_vocab is not None and Vt != V:
            errs.append(f"it was built for a target vocabulary of {Vt} tokens, the target has {V}")
        lm = getattr(h, "lm_head", None)
        if lm is not None and lm.weight.shape[0] != Vd:
            errs.append(f"lm_head has {lm.weight.shape[0]} rows, draft_vocab_size is {Vd}")
        emb = getattr(h, "embed_tokens", None)
        if emb is not None and emb.weight.shape[0] < V:
            errs.append(f"embed_tokens has {emb.weight.shape[0]} rows, the target vocabulary has {V} tokens")
        d2t, t2d = getattr(h, "d2t", None), getattr(h, "t2d", None)
        if d2t is not None and Vd != Vt:
            if tuple(d2t.shape) != (Vd,):
                errs.append(f"d2t has shape {tuple(d2t.shape)}, expected ({Vd},)")
            else:
                ids = torch.arange(Vd, device=d2t.device) + d2t.long()
                lo, hi = int(ids.min()), int(ids.max())
                if lo < 0 or hi >= min(V, Vt):
                    errs.append(f"d2t maps draft ids to target ids {lo}..{hi}, outside the target vocabulary "
                                f"0..{min(V, Vt) - 1}")
        if t2d is not None and t2d.numel() != V:
            errs.append(f"t2d has {t2d.numel()} entries, the target vocabulary has {V}")
        return errs

    def check_target(self, vocab_size: int) -> None:
        bad = self.vocab_problems(vocab_size)
        if bad:
            raise DraftVocabError(f"{self.name} does not fit this target: " + "; ".join(bad))

    # -- the coupling to heads/: everything below goes through these three methods
    def _input_hidden(self, v: Verified) -> torch.Tensor:
        if self.uses_aux:
            return self.head.project(v.aux)
        return v.final

    def _step_impl(self, ids, hidden, positions, write_pos, mask, kv_len, step: int = 0, rows=None):
        """One head call (raw draft logits, hidden). ``step`` = 0 for the first pass, s for the
        s-th draft token after it (MTP uses depth s mod num_mtp_depths, as vLLM's MTP proposer does);
        ``rows``: the cache rows of the batch rows (None: the first B)."""
        self.cache.prepare(write_pos, mask, kv_len, self.cfg.num_attention_heads // self.cfg.num_key_value_heads,
                           rows)
        p = next(self.head.parameters())
        kw = {"depth": step % max(1, self.cfg.num_mtp_depths)} if self.kind == "mtp" else {}
        return self.head.forward_step(ids, hidden.to(p.dtype), positions, attention_mask=None, kv_cache=self.cache,
                                      **kw)

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

    def _sample(self, ctx: DraftContext, dl: torch.Tensor, s: int):
        """A sampled draft token (target id) and its probabilities over the target vocabulary."""
        return pick_draft(ctx, self._target_logits(dl.float(), ctx.vocab_size), s)

    def _kv_len(self) -> int:
        kv = None if self.ctx is None else self.ctx.kv_len
        return self.cache.slots if kv is None else min(round_up(kv), self.cache.slots)

    # --
    def start(self, ctx: DraftContext) -> None:
        # q/k/v and gate/up as one GEMM each (refreshed in place: the head's parameters may have changed
        # since the last call, and captured graphs read these very buffers)
        fuse_projections(self.head)
        p = next(self.head.parameters())
        c = self.cfg
        key = (ctx.batch, ctx.max_seq, p.dtype, str(ctx.device))
        st = self._states.get(key)
        if st is None:
            # P-EAGLE's mask slots follow the verified tokens in the same pass: their spare room past max_seq
            st = self._states[key] = _HeadState(DraftCache(max(c.num_layers, c.num_mtp_depths), ctx.batch,
                                                           c.num_key_value_heads, ctx.max_seq + self.mask_slots,
                                                           c.head_dim, p.dtype, ctx.device))
        st.cache.lengths.zero_()
        self.state, self.cache, self.ctx = st, st.cache, ctx
        self._prompt_pass = True        # the next update is the prompt's (see update)

    @torch.no_grad()
    def update(self, v: Verified) -> None:
        """The first pass over the newly verified tokens; its output at each row's last verified
        position becomes the root of the next draft."""
        if self.state is None:
            raise RuntimeError("update() before start()")
        st, B = self.state, v.next_tokens.shape[0]
        states = v.aux if self.uses_aux else v.final
        if self._prompt_pass or st.root_logits is None or st.root_logits.shape[0] != B:
            # the prompt's pass runs eagerly, as the target's prefill: its width is the prompts', which would
            # recompile the compiled first pass in every run after the first (6 s of a batch-1 prefill on an
            # H100, 2026-12-07). The first one sizes the root buffers every later pass writes in place:
            # captured graphs read and write these very tensors
            self._prompt_pass = False
            sized = st.root_logits is not None and st.root_logits.shape[0] == B
            out = self._first_pass(v.start, v.count, v.next_tokens, states, self._kv_len(),
                                   (st.root_logits, st.root_h, st.root_pos) if sized else None, eager=True)
            if not sized:
                st.root_logits, st.root_h, st.root_pos = (t.clone() for t in out)
            return
        self._first_pass_fn(v.start, v.count, v.next_tokens, states, self._kv_len(),
                            (st.root_logits, st.root_h, st.root_pos))

    @torch.no_grad()
    def admit(self, rows: torch.Tensor, v: Verified) -> None:
        """The first pass over the new requests' prompts alone (eager, like the target's prefill),
        into their rows of the draft cache and of the root buffers."""
        st = self.state
        if st is None:
            raise RuntimeError("admit() before start()")
        self._prompt_pass = False        # a served batch's prompts come through here, each decode step to update
        states = v.aux if self.uses_aux else v.final
        out = self._first_pass(v.start, v.count, v.next_tokens, states, min(round_up(v.next_tokens.shape[1]),
                                                                            self.cache.slots), rows=rows)
        B = self.ctx.batch
        if st.root_logits is None or st.root_logits.shape[0] != B:
            # sized once, then written in place: captured step graphs read these very tensors
            st.root_logits, st.root_h, st.root_pos = (t.new_zeros((B,) + t.shape[1:]) for t in out)
        for buf, t in zip((st.root_logits, st.root_h, st.root_pos), out):
            buf[rows] = t

    def _first_pass(self, start, count, next_tokens, states, kv_len: int, roots=None, rows=None,
                    eager: bool = False):
        """``update``'s pass: the head over positions start .. start+W-1 of each row; the root
        (logits, hidden, position) at its last verified one goes to ``roots`` (or is returned).
        ``rows``: the cache rows of the batch rows (``admit``; None: the first B); ``eager``: the head
        call uncompiled (a prompt's pass). With ``mask_slots`` (P-EAGLE) the root logits are [B, 1 + n, Vd]:
        the root's, then those of the n mask slots the same pass runs right after it."""
        c = self.cache
        dev = next_tokens.device
        hidden = self.head.project(states) if self.uses_aux else states
        if self.mask_slots:
            next_tokens, hidden = self._with_mask_slots(next_tokens, hidden, count)
            kv_len = min(round_up(kv_len + self.mask_slots), c.slots)
        B, W = next_tokens.shape
        at = slice(0, B) if rows is None else rows
        c.lengths[at] = start
        pos = start[:, None] + torch.arange(W, device=dev)
        mask = build_attn_mask(c.lengths[at], pos.clamp(max=kv_len - 1), None, kv_len)
        if rows is None and not eager:
            logits, h = self._inner_step(next_tokens, hidden, pos, pos, mask, kv_len)
        else:     # admission: eager, as the target's prefill (its prompt widths would recompile a compiled step)
            logits, h = self._step_impl(next_tokens, hidden, pos, pos, mask, kv_len, rows=rows)
        last = (count - 1).clamp(min=0)
        r = torch.arange(B, device=dev)
        c.lengths[at] = start + count
        if self.mask_slots:     # the root's logits, then each mask slot's: [B, 1 + mask_slots, Vd]
            cols = last[:, None] + torch.arange(1 + self.mask_slots, device=dev)
            root_logits = logits.gather(1, cols[..., None].expand(-1, -1, logits.shape[-1]))
        else:
            root_logits = logits[r, last]
        out = (root_logits, h[r, last], start + last)
        if roots is None:
            return out
        for buf, t in zip(roots, out):
            buf.copy_(t)
        return None

    def root(self):
        """(draft logits [B, Vd], hidden [B, H], position [B]) at each row's last verified token (P-EAGLE's
        logits: [B, K, Vd], the root's then its mask slots')."""
        st = self.state
        if st is None or st.root_logits is None:
            raise RuntimeError("propose() before update(): the drafter has no target states")
        return st.root_logits, st.root_h, st.root_pos

    @torch.no_grad()
    def propose(self, ctx: DraftContext, k: int) -> Proposal:
        logits, h, pos = self.root()
        if not ctx.sample_drafts:
            return Proposal(self._greedy_chain_fn(logits, h, pos, ctx.active_mask, k, self._kv_len()),
                            torch.where(ctx.active_mask, k, 0), None)
        c, B = self.cache, ctx.batch
        kv_len = self._kv_len()
        base = c.lengths[:B].clone()
        toks, qs = [], []
        for s in range(k):
            if s > 0:
                logits, h = self._chain_step(toks[-1], h, pos, base, s, kv_len, self._step)
            t, q = self._sample(ctx, logits, s)
            toks.append(t)
            qs.append(q)
        c.lengths[:B] = base
        num = torch.where(ctx.active_mask, k, 0)
        return Proposal(torch.stack(toks, 1), num, torch.stack(qs, 1))

    def _chain_step(self, last_tok, h, pos, base, s: int, kv_len: int, step_fn):
        """Draft step s >= 1 of a chain: the head on the last draft token at slot base + s - 1."""
        c, B = self.cache, base.shape[0]
        wp = (base + s - 1)[:, None]
        c.lengths[:B] = base + s - 1
        mask = build_attn_mask(c.lengths[:B], wp.clamp(max=kv_len - 1), None, kv_len)
        logits, h = step_fn(last_tok[:, None], h[:, None], (pos + s)[:, None], wp, mask, kv_len, s)
        return logits[:, 0], h[:, 0]

    def _greedy_chain(self, logits, h, pos, active, k: int, kv_len: int):
        """k greedy draft tokens [B, k] (target ids) from the root; the head cache's lengths are
        left as they were (the drafts' K/V past them is overwritten by the next first pass)."""
        c, B = self.cache, active.shape[0]
        base = c.lengths[:B].clone()
        toks = []
        for s in range(k):
            if s > 0:
                logits, h = self._chain_step(toks[-1], h, pos, base, s, kv_len, self._inner_step)
            # the draft-vocab argmax mapped to a target id (d2t is increasing, so this is the argmax
            # of the target-vocab logits, ties included) without widening to the target vocab
            toks.append(self._to_target(logits.argmax(-1)))
        c.lengths[:B] = base
        return torch.stack(toks, 1)

    @torch.no_grad()
    def propose_tree(self, ctx: DraftContext, cfg: TreeConfig) -> DraftTree:
        logits, h_root, pos = self.root()
        c, B, k = self.cache, ctx.batch, cfg.topk
        kv_len = self._kv_len()
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
            slots = torch.arange(kv_len, device=ctx.device)
            mask = (slots[None, None, :] < base[:, None, None]).expand(B, k, kv_len).clone()
            tree_slots = base[:, None] + torch.arange(n_tree, device=ctx.device)       # [B, n_tree]
            mask.scatter_(2, tree_slots[:, None, :].expand(B, k, n_tree).clamp(max=kv_len - 1), vis)
            wp = tree_slots[:, -k:]
            positions = (pos + level)[:, None].expand(B, k)
            lg, h = self._step(e.tokens, hid, positions, wp, mask[:, None], kv_len, level)
            state["h"], state["vis"] = h, vis
            return lg.float().log_softmax(-1)

        root_lp = logits.float().log_softmax(-1)
        tree = build_dynamic_tree(root_lp, expand, cfg, map_ids=self._to_target)
        c.lengths[:B] = base
        return tree


class Eagle3Drafter(HeadDrafter):
    kind = "eagle3"


class Eagle1Drafter(HeadDrafter):
    kind = "eagle1"
    uses_aux = False


class MTPDrafter(HeadDrafter):
    kind = "mtp"
    uses_aux = False
