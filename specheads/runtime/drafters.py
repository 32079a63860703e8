"""Drafters: who proposes the tokens the target verifies.

Protocol (duck-typed; subclass ``Drafter`` for the defaults):

- ``aux_layer_ids`` / ``needs_final``: which target states the drafter consumes.
- ``start(ctx)``: a new ``generate`` call begins (allocate or reuse caches).
- ``update(v: Verified)``: the target has verified new tokens. For each row, positions
  ``start .. start+count-1`` are now final in the target cache; ``next_tokens`` holds the
  token at position+1 of each (the accepted drafts and then the bonus token; columns past
  ``count`` are padding), ``aux`` / ``final`` the target states at those positions. (vLLM's
  eagle proposer semantics: the draft's first pass covers each newly verified token with
  the state of the previous position.) After the prompt, ``start=0`` and ``count=len(prompt)``.
- ``propose(ctx, k) -> Proposal``: up to k draft tokens per row (+ draft probs q when the
  drafter samples, i.e. ``ctx.sample_drafts``).
- ``propose_tree(ctx, cfg) -> DraftTree`` for drafters with ``supports_tree``.
- ``check_target(vocab_size)``: refuse a target the drafter does not fit (``DraftVocabError``),
  called by ``generate`` before anything runs.
- ``graph_safe``: True when ``update``/``propose`` only run device ops with shapes fixed by
  (batch, k, tree), read the device view of the context (never ``ctx.histories`` /
  ``ctx.active``) and carry state between steps only in buffers updated in place. The
  engine then captures whole speculative steps in CUDA graphs and never syncs per step
  for the drafter. Drafters that read the host view (the CPU n-gram reference, the
  standalone draft model, custom drafters) run eagerly with one host sync per step.

Hidden-state drafters (EAGLE-3, EAGLE-1, MTP) call the head through the contract in
docs/ARCHITECTURE.md: ``head.project(aux)`` (EAGLE-3), ``head.forward_step(input_ids,
hidden, position_ids, attention_mask=None, kv_cache=None) -> (draft_logits, hidden_out)``,
``head.draft_to_target(ids)``. The KV cache handed to the head is ``DraftCache`` below:
heads' attention calls ``kv_cache.attend(layer_idx, q, k, v, mask, attn_module)`` and the
cache writes the new K/V at the slots and with the visibility the runtime set beforehand.
That is the only coupling to ``specheads.heads``.

Builders: ``drafter_for_head(head)`` (the class for a head's kind), ``make_drafter(kind,
head=None, ...)`` for ``"ngram"``, ``"head"`` and ``"hybrid"`` (``HybridDrafter``: per row and
step the n-gram proposal when its match is at least ``min_match`` tokens long, else the head's).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from specheads import kernels
from specheads.errors import SpecheadsError
from specheads.heads.layers import fuse_projections

from .model import TargetModel, additive_mask, allow_recompiles, build_attn_mask, round_up
from .tree import DraftTree, Expansion, TreeConfig, build_dynamic_tree
from .verify import sample_inverse_cdf, target_probs


class DraftVocabError(SpecheadsError, ValueError):
    """A draft head's vocabulary mapping (d2t, t2d, vocabulary sizes) does not fit the target."""


# ---------------------------------------------------------------------------- state
class DraftContext:
    """What the engine tells a drafter.

    Device view (current at every step, CUDA-graph safe): ``tokens [B, S]`` each row's
    prompt + emitted tokens (slots >= ``lengths[b]`` hold junk), ``lengths [B]``,
    ``active_mask [B]`` bool, ``draft_u [B, n]`` this step's uniforms for sampled drafts
    (column s for draft step s), ``kv_len``: a host-side bound on the cache slots any row
    reaches this step (the attention width; part of a captured graph's shape).

    Host view: ``histories`` (per row: prompt + emitted tokens; the last one is not in the
    cache yet) and ``active`` (list of bool). Inside ``generate`` they are pulled from the
    device when read (a host sync), so only drafters that are not ``graph_safe`` use them.
    """

    def __init__(self, histories=None, active=None, device=None, max_seq: int = 0, vocab_size: int = 0,
                 sample_drafts: bool = False, temperature=0.0, top_k=0, top_p=1.0, generators=None, *,
                 batch: int | None = None, tokens=None, lengths=None, active_mask=None, kv_len: int | None = None,
                 draft_u=None, pull=None):
        self._histories, self._active, self._pull = histories, active, pull
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.batch = batch if batch is not None else len(histories)
        self.max_seq, self.vocab_size = max_seq, vocab_size
        self.sample_drafts = sample_drafts
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p   # numbers or 0-d device tensors
        self.generators = generators or []
        self.tokens, self.lengths, self._active_mask = tokens, lengths, active_mask
        self.kv_len, self.draft_u = kv_len, draft_u

    @property
    def histories(self) -> list[list[int]]:
        if self._pull is not None:
            self._pull()
        return self._histories

    @property
    def active(self) -> list[bool]:
        if self._pull is not None:
            self._pull()
        return self._active

    @property
    def active_mask(self) -> torch.Tensor:
        if self._active_mask is None:           # a context built by hand (tests, standalone use)
            return torch.tensor(self.active, dtype=torch.bool, device=self.device)
        return self._active_mask


@dataclass
class Verified:
    start: torch.Tensor          # [B] position of the first newly verified token
    count: torch.Tensor          # [B] number of newly verified positions (0 for finished rows)
    next_tokens: torch.Tensor    # [B, n] token at position+1 of each verified position (n >= count)
    aux: torch.Tensor | None = None
    final: torch.Tensor | None = None


@dataclass
class Proposal:
    tokens: torch.Tensor                  # [B, K] target ids (padding: 0)
    num: torch.Tensor                     # [B] valid drafts per row
    probs: torch.Tensor | None = None     # [B, K, V] draft distribution the tokens were drawn from
    match_len: torch.Tensor | None = None  # [B] n-gram drafters: length of the matched suffix (0 = none)


class Drafter:
    aux_layer_ids: tuple = ()
    needs_final: bool = False
    supports_tree: bool = False
    provides_probs: bool = False
    graph_safe: bool = False

    def check_target(self, vocab_size: int) -> None:
        pass

    def start(self, ctx: DraftContext) -> None:
        pass

    def update(self, v: Verified) -> None:
        pass

    def admit(self, rows: torch.Tensor, v: Verified) -> None:
        """New requests take over rows ``rows`` [n] of a running batch (continuous batching):
        ``v`` holds their prompts' verified states (n rows, start 0); every other row keeps its
        state. Only drafters whose state lives on the device, row by row, can do this."""
        raise NotImplementedError(f"{type(self).__name__} keeps a host view of the batch; it cannot take new "
                                  f"requests into a running batch")

    def propose(self, ctx: DraftContext, k: int) -> Proposal:
        raise NotImplementedError

    def propose_tree(self, ctx: DraftContext, cfg: TreeConfig) -> DraftTree:
        raise NotImplementedError(f"{type(self).__name__} does not draft trees")


def _pick(ctx: DraftContext, logits_t: torch.Tensor, step: int = 0):
    """Choose one draft token per row from target-vocab logits [B, V]: argmax, or a sample from
    q = target_probs(logits) with the step's uniforms ``ctx.draft_u[:, step]`` when
    ctx.sample_drafts. Returns (ids [B], q [B, V] or None)."""
    if not ctx.sample_drafts:
        return logits_t.argmax(-1), None
    if ctx.draft_u is None:
        raise RuntimeError("sampled drafts need ctx.draft_u (the engine's per-step draft uniforms)")
    q = target_probs(logits_t, ctx.temperature, ctx.top_k, ctx.top_p)
    return sample_inverse_cdf(q, ctx.draft_u[:, step]), q


# ---------------------------------------------------------------------------- n-gram
def ngram_match(tokens: torch.Tensor, lengths: torch.Tensor, k: int, min_ngram: int = 1, max_ngram: int = 4,
                occurrence: str = "latest", active: torch.Tensor | None = None):
    """Batched prompt lookup on the device (vLLM's ``ngram_gpu`` idea), without a host sync.

    tokens [B, S] (row b's history in slots < lengths[b], junk after), lengths [B] >= 1.
    Same rule as ``NGramDrafter.lookup``: the longest suffix n-gram, n in [min_ngram,
    max_ngram], that also occurs ending before the last token; its latest (or earliest)
    occurrence; the up to k tokens that followed it. Returns (drafts [B, k] (0-padded),
    num [B], match_len [B] (n of the match, 0 = none)).

    How: for every slot j, ``run[j]`` = how many tokens ending at j equal the history's
    last tokens (capped at max_ngram); an n-gram match ends at j iff run[j] >= n.
    """
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
    B, S = tokens.shape
    dev = tokens.device
    j = torch.arange(S, device=dev)
    win = F.pad(tokens, (max_ngram - 1, 0), value=-1).unfold(1, max_ngram, 1)   # [B, S, n]: win[b, j, n-1-t] = tok[j-t]
    last = (lengths - 1).clamp(min=0)
    suffix = win.gather(1, last.view(B, 1, 1).expand(B, 1, max_ngram))         # the history's last max_ngram tokens
    eq = (win == suffix).flip(-1).to(torch.int32)                                # [b, j, t]: tok[j-t] == tok[L-1-t]
    run = torch.minimum(eq.cumprod(-1).sum(-1), j + 1)                           # (-1 == -1 left of slot 0: capped)
    run = torch.where(j[None, :] <= (lengths - 2)[:, None], run, 0)             # must end before the last token
    best = run.amax(1)
    has = best >= min_ngram
    hit = (run >= best[:, None]) & has[:, None]
    if occurrence == "latest":
        end = torch.where(hit, j, -1).amax(1)
    elif occurrence == "earliest":
        end = torch.where(hit, j, S).amin(1)
    else:
        raise ValueError(f"occurrence must be 'latest' or 'earliest', got {occurrence!r}")
    start = end + 1
    num = torch.where(has, (lengths - start).clamp(min=0, max=k), 0)
    if active is not None:
        num = torch.where(active, num, 0)
    ar = torch.arange(k, device=dev)
    idx = (start[:, None] + ar).clamp(0, S - 1)
    drafts = torch.where(ar[None, :] < num[:, None], tokens.gather(1, idx), 0)
    return drafts, num, torch.where(has, best, 0)


class NGramDrafter(Drafter):
    """Prompt lookup: match the last n tokens (n = max_ngram .. min_ngram, longest first) in the
    request's own history (prompt + generated); take the right-most earlier occurrence and
    propose up to k tokens that followed it. Proposes nothing when no n-gram matches.

    ``occurrence="earliest"`` takes the left-most match instead, which is vLLM's rule (its
    n-gram proposer), so the two engines can be compared draft for draft.

    ``backend``: ``"host"`` = the NumPy reference over ``ctx.histories`` (one host sync per
    step); ``"device"`` = ``ngram_match`` over the engine's device token buffer (no sync,
    CUDA-graph safe); ``"auto"`` (default) = device on CUDA, host elsewhere. Both give the
    same drafts."""

    BACKENDS = ("auto", "device", "host")

    def __init__(self, min_ngram: int = 1, max_ngram: int = 4, occurrence: str = "latest", backend: str = "auto"):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if occurrence not in ("latest", "earliest"):
            raise ValueError(f"occurrence must be 'latest' or 'earliest', got {occurrence!r}")
        if backend not in self.BACKENDS:
            raise ValueError(f"backend must be one of {self.BACKENDS}, got {backend!r}")
        self.min_ngram, self.max_ngram, self.occurrence, self.backend = min_ngram, max_ngram, occurrence, backend
        self.on_device = backend == "device"
        self._match = ngram_match

    def compile(self, **compile_kwargs) -> "NGramDrafter":
        """The device match through ``torch.compile``: eagerly it is ~40 small kernels a step, as many
        as the rest of a step's bookkeeping. Shapes are static (the engine's token buffer)."""
        compile_kwargs.setdefault("dynamic", False)
        allow_recompiles()
        self._match = torch.compile(ngram_match, **compile_kwargs)
        return self

    @property
    def graph_safe(self) -> bool:
        return self.on_device

    def start(self, ctx: DraftContext) -> None:
        self.on_device = self.backend == "device" or (self.backend == "auto" and ctx.device.type == "cuda")

    def match(self, history: list[int], k: int) -> tuple[list[int], int]:
        """The reference: (proposed tokens, n of the matched n-gram or 0)."""
        arr = np.asarray(history, dtype=np.int64)
        L = len(arr)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            suffix = arr[L - n:]
            win = np.lib.stride_tricks.sliding_window_view(arr[:L - 1], n)   # starts 0 .. L-1-n
            hits = np.nonzero((win == suffix).all(axis=1))[0]
            if len(hits):
                i = int(hits[-1] if self.occurrence == "latest" else hits[0])
                return arr[i + n:i + n + k].tolist(), n
        return [], 0

    def lookup(self, history: list[int], k: int) -> list[int]:
        return self.match(history, k)[0]

    def admit(self, rows: torch.Tensor, v: Verified) -> None:
        if not self.on_device:         # the host proposer's view of the batch grows, it is never reset per row
            super().admit(rows, v)
        # on the device the match reads the engine's token buffer, whose rows the engine resets

    def propose(self, ctx: DraftContext, k: int) -> Proposal:
        if self.on_device:
            if ctx.tokens is None:
                raise RuntimeError("the device n-gram proposer needs ctx.tokens / ctx.lengths (the engine's buffer)")
            drafts, num, n = self._match(ctx.tokens, ctx.lengths, k, self.min_ngram, self.max_ngram, self.occurrence,
                                         ctx.active_mask)
            return Proposal(drafts, num, None, n)
        B = ctx.batch
        found = [self.match(h, k) if a else ([], 0) for h, a in zip(ctx.histories, ctx.active)]
        K = max([len(p) for p, _ in found] + [0])
        toks = torch.zeros(B, K, dtype=torch.long)
        for b, (p, _) in enumerate(found):
            toks[b, :len(p)] = torch.tensor(p, dtype=torch.long)
        num = torch.tensor([len(p) for p, _ in found], dtype=torch.long)
        n = torch.tensor([m for _, m in found], dtype=torch.long)
        return Proposal(toks.to(ctx.device), num.to(ctx.device), None, n.to(ctx.device))


# ---------------------------------------------------------------------------- draft KV cache
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


# ---------------------------------------------------------------------------- heads
def _head_config(head):
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
        self.root_logits: torch.Tensor | None = None    # [B, Vd]
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
    supports_tree = True
    provides_probs = True
    graph_safe = True

    def __init__(self, head, name: str | None = None, target_vocab_size: int | None = None):
        self.head = head.eval()
        self.cfg = _head_config(head)
        if self.cfg.kind != self.kind:
            raise ValueError(f"{type(self).__name__} needs a '{self.kind}' head, got '{self.cfg.kind}'")
        self.name = name or getattr(head, "name", None) or f"{self.cfg.kind} head"
        bad = self.vocab_problems()
        if bad:
            raise DraftVocabError(f"{self.name}: vocabulary mapping does not fit: " + "; ".join(bad))
        if target_vocab_size is not None:
            self.check_target(target_vocab_size)
        if self.kind == "eagle3":
            self.aux_layer_ids = tuple(self.cfg.aux_layer_ids)
        else:
            self.needs_final = True
        self._states: dict = {}
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
        hundred small kernels, and they are what makes a head's speedup fall short of its tau (issue 14).
        ``units=False`` compiles the head call alone, the first pass and the chain around it eager (the
        engine of the third H200 sitting, which ``bench_runtime.py --engines compiled_as_r3`` times)."""
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
        if self.kind == "eagle3":
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
        return _pick(ctx, self._target_logits(dl.float(), ctx.vocab_size), s)

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
            st = self._states[key] = _HeadState(DraftCache(max(c.num_layers, c.num_mtp_depths), ctx.batch,
                                                           c.num_key_value_heads, ctx.max_seq, c.head_dim,
                                                           p.dtype, ctx.device))
        st.cache.lengths.zero_()
        self.state, self.cache, self.ctx = st, st.cache, ctx

    @torch.no_grad()
    def update(self, v: Verified) -> None:
        """The first pass over the newly verified tokens; its output at each row's last verified
        position becomes the root of the next draft."""
        if self.state is None:
            raise RuntimeError("update() before start()")
        st, B = self.state, v.next_tokens.shape[0]
        states = v.aux if self.kind == "eagle3" else v.final
        if st.root_logits is None or st.root_logits.shape[0] != B:
            # the prompt's pass (eager) sizes the root buffers every later pass writes in place:
            # captured graphs read and write these very tensors
            st.root_logits, st.root_h, st.root_pos = (t.clone() for t in self._first_pass(
                v.start, v.count, v.next_tokens, states, self._kv_len()))
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
        states = v.aux if self.kind == "eagle3" else v.final
        out = self._first_pass(v.start, v.count, v.next_tokens, states, min(round_up(v.next_tokens.shape[1]),
                                                                            self.cache.slots), rows=rows)
        B = self.ctx.batch
        if st.root_logits is None or st.root_logits.shape[0] != B:
            # sized once, then written in place: captured step graphs read these very tensors
            st.root_logits, st.root_h, st.root_pos = (t.new_zeros((B,) + t.shape[1:]) for t in out)
        for buf, t in zip((st.root_logits, st.root_h, st.root_pos), out):
            buf[rows] = t

    def _first_pass(self, start, count, next_tokens, states, kv_len: int, roots=None, rows=None):
        """``update``'s pass: the head over positions start .. start+W-1 of each row; the root
        (logits, hidden, position) at its last verified one goes to ``roots`` (or is returned).
        ``rows``: the cache rows of the batch rows (``admit``; None: the first B)."""
        c = self.cache
        B, W = next_tokens.shape
        dev = next_tokens.device
        at = slice(0, B) if rows is None else rows
        c.lengths[at] = start
        pos = start[:, None] + torch.arange(W, device=dev)
        mask = build_attn_mask(c.lengths[at], pos.clamp(max=kv_len - 1), None, kv_len)
        hidden = self.head.project(states) if self.kind == "eagle3" else states
        if rows is None:
            logits, h = self._inner_step(next_tokens, hidden, pos, pos, mask, kv_len)
        else:     # admission: eager, as the target's prefill (its prompt widths would recompile a compiled step)
            logits, h = self._step_impl(next_tokens, hidden, pos, pos, mask, kv_len, rows=rows)
        last = (count - 1).clamp(min=0)
        r = torch.arange(B, device=dev)
        c.lengths[at] = start + count
        out = (logits[r, last], h[r, last], start + last)
        if roots is None:
            return out
        for buf, t in zip(roots, out):
            buf.copy_(t)
        return None

    def root(self):
        """(draft logits [B, Vd], hidden [B, H], position [B]) at each row's last verified token."""
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


class MTPDrafter(HeadDrafter):
    kind = "mtp"


# ---------------------------------------------------------------------------- hybrid
def hybrid_choice(ngram_tokens, ngram_num, match_len, head_tokens, head_num, active, counts, use_ngram,
                  min_match: int, score=None, last=None):
    """Per row: the n-gram proposal when its match is >= min_match tokens, it proposes something and
    (with ``score`` [B, 2], the adaptive rule) it has done at least as well as the head on this row's
    earlier such steps; else the head's. Returns (tokens [B, k], num [B], use [B]); records the choice
    in ``use_ngram``, adds the active rows' choices to ``counts`` (n-gram, head) and, with ``last``
    (n-gram tokens, n-gram num, head tokens, head num, eligible), keeps both proposals for
    :func:`hybrid_score`; all in place."""
    eligible = (match_len >= min_match) & (ngram_num > 0)
    use = eligible if score is None else eligible & (score[:, 0] >= score[:, 1])
    tokens = torch.where(use[:, None], ngram_tokens, head_tokens)
    num = torch.where(use, ngram_num, head_num)
    use_ngram.copy_(use & active)
    counts += torch.stack([(use & active).sum(), (~use & active).sum()])
    if last is not None:
        for buf, t in zip(last, (ngram_tokens, ngram_num, head_tokens, head_num, eligible & active)):
            buf.copy_(t)
    return tokens, num, use


def hybrid_score(score, last, next_tokens, count, decay: float):
    """After verification: how many of each kept proposal's tokens the target accepted (or, for the
    proposal not verified, would have: its agreement with the tokens the target emitted, which is
    exact up to the accepted length + 1 and a lower bound past it), folded into the per-row running
    score [B, 2] (n-gram, head) on the rows where both were candidates. Greedy or sampled, the rule
    looks only at the past, so verification stays exact."""
    ng_tok, ng_num, hd_tok, hd_num, eligible = last
    W = min(ng_tok.shape[1], next_tokens.shape[1])
    j = torch.arange(W, device=next_tokens.device)[None]
    known = j < count[:, None]

    def accepted(tok, num):
        return ((tok[:, :W] == next_tokens[:, :W]) & known & (j < num[:, None])).long().cumprod(1).sum(1)

    a = torch.stack([accepted(ng_tok, ng_num), accepted(hd_tok, hd_num)], 1).to(score.dtype)
    score.copy_(torch.where(eligible[:, None], decay * score + (1 - decay) * a, score))
    eligible.zero_()


class HybridDrafter(Drafter):
    """A head and an n-gram drafter together: per row and step, the n-gram proposal when its
    match is at least ``min_match`` tokens long (and it proposes something), otherwise the
    head's. ``adaptive`` (the default) adds a per-row check: both proposals exist every step, so
    after each verification the drafter scores both against what the target emitted, and on the
    rows where the n-gram was a candidate it keeps a running score of each side (decay
    ``score_decay``); the n-gram wins only while its score is at least the head's. A strong head
    thus keeps math, where a 3-token match is a worse bet than the head (H200, 2026-12-02: the
    fixed rule's τ 2.55 against the head's 2.59), while copying still goes to the n-gram.
    Verification is unchanged, so the output is lossless whatever is chosen.

    The head runs every step (its first pass keeps its cache current); with rule
    'rejection' the n-gram rows carry one-hot draft probabilities (q = δ_x, which is
    one-hot verification). ``choice_counts()``: how many drafting row-steps took each side
    in the last ``generate`` call. Chains only."""

    supports_tree = False

    def __init__(self, head_drafter: Drafter, ngram_drafter: Drafter | None = None, min_match: int = 3,
                 adaptive: bool = True, score_decay: float = 0.7):
        if min_match < 1:
            raise ValueError(f"min_match must be >= 1, got {min_match}")
        if not 0.0 <= score_decay < 1.0:
            raise ValueError(f"score_decay must be in [0, 1), got {score_decay}")
        self.head = head_drafter
        self.ngram = ngram_drafter if ngram_drafter is not None else NGramDrafter()
        self.min_match = int(min_match)
        self.adaptive = bool(adaptive)
        self.score_decay = float(score_decay)
        self.score: torch.Tensor | None = None        # [B, 2] running (n-gram, head) acceptance, adaptive rule
        self._last = None                             # both proposals of the last step, for hybrid_score
        self.aux_layer_ids = tuple(getattr(head_drafter, "aux_layer_ids", ()) or ())
        self.needs_final = bool(getattr(head_drafter, "needs_final", False))
        self.provides_probs = bool(getattr(head_drafter, "provides_probs", False))
        self.counts: torch.Tensor | None = None       # [2]: (n-gram, head) row-steps with drafts chosen
        self.use_ngram: torch.Tensor | None = None    # [B] the last step's choice
        self._bufs: dict = {}                         # per (batch, device), never freed: graphs point at them
        self._choose = hybrid_choice
        self._score = hybrid_score

    @property
    def graph_safe(self) -> bool:
        return bool(getattr(self.head, "graph_safe", False) and getattr(self.ngram, "graph_safe", False))

    def compile(self, units: bool = True, **compile_kwargs) -> "HybridDrafter":
        """The head's units, the n-gram match and the choice through torch.compile; ``units=False``:
        the head's call alone (``HeadDrafter.compile``), the n-gram side and the choice eager."""
        if hasattr(self.head, "compile"):
            self.head.compile(units=units, **compile_kwargs)
        if units:
            if hasattr(self.ngram, "compile"):
                self.ngram.compile(**compile_kwargs)
            self._choose = torch.compile(hybrid_choice, dynamic=False)
            self._score = torch.compile(hybrid_score, dynamic=False)
        return self

    def check_target(self, vocab_size: int) -> None:
        self.head.check_target(vocab_size)
        self.ngram.check_target(vocab_size)

    def start(self, ctx: DraftContext) -> None:
        self.head.start(ctx)
        self.ngram.start(ctx)
        key = (ctx.batch, str(ctx.device))
        if key not in self._bufs:
            self._bufs[key] = (torch.zeros(2, dtype=torch.long, device=ctx.device),
                               torch.zeros(ctx.batch, dtype=torch.bool, device=ctx.device),
                               torch.zeros(ctx.batch, 2, dtype=torch.float32, device=ctx.device))
        self.counts, self.use_ngram, self.score = self._bufs[key]
        self.counts.zero_()
        self.use_ngram.zero_()
        self.score.zero_()
        if self._last is not None:
            self._last[4].zero_()           # nothing proposed yet in this generation

    def _last_bufs(self, B: int, k: int, dev) -> tuple:
        key = ("last", B, k, str(dev))
        if key not in self._bufs:
            z = lambda *shape, dtype=torch.long: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
            self._bufs[key] = (z(B, k), z(B), z(B, k), z(B), z(B, dtype=torch.bool))
        return self._bufs[key]

    def admit(self, rows: torch.Tensor, v: Verified) -> None:
        self.head.admit(rows, v)
        self.ngram.admit(rows, v)
        self.score[rows] = 0.0          # a new request starts with no record on either side
        self.use_ngram[rows] = False
        if self._last is not None and self._last[4].shape[0] == self.score.shape[0]:
            self._last[4][rows] = False  # its row's last proposals were the previous request's

    def update(self, v: Verified) -> None:
        if self.adaptive and self._last is not None and self._last[0].shape[0] == v.next_tokens.shape[0]:
            self._score(self.score, self._last, v.next_tokens, v.count, self.score_decay)
        self.head.update(v)
        self.ngram.update(v)

    @torch.no_grad()
    def propose(self, ctx: DraftContext, k: int) -> Proposal:
        ph = self.head.propose(ctx, k)
        pn = self.ngram.propose(ctx, k)
        dev = ph.tokens.device
        nt = pn.tokens.to(dev)
        nt = F.pad(nt, (0, k - nt.shape[1])) if nt.shape[1] < k else nt[:, :k]
        nn_ = pn.num.to(dev).clamp(max=k)
        ml = pn.match_len.to(dev) if pn.match_len is not None else torch.zeros_like(nn_)
        if self.adaptive:
            self._last = self._last_bufs(nt.shape[0], k, dev)
        tokens, num, use = self._choose(nt, nn_, ml, ph.tokens[:, :k], ph.num, ctx.active_mask, self.counts,
                                        self.use_ngram, self.min_match, self.score if self.adaptive else None,
                                        self._last if self.adaptive else None)
        probs = None
        if ctx.sample_drafts:
            q = torch.zeros(nt.shape + (ph.probs.shape[-1],), dtype=ph.probs.dtype, device=dev)
            q.scatter_(2, nt[..., None], 1.0)                              # one-hot: q = δ_x
            probs = torch.where(use[:, None, None], q, ph.probs[:, :k])
        return Proposal(tokens, num, probs)

    def choice_counts(self) -> dict:
        n, h = (0, 0) if self.counts is None else self.counts.tolist()
        return {"ngram": n, "head": h}


# ---------------------------------------------------------------------------- draft model
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
            t, q = _pick(ctx, lt, s)
            toks.append(t)
            qs.append(q)
            if s < k - 1:
                for b, tb in enumerate(t.tolist()):
                    self.cached[b].append(tb)
        num = torch.tensor([k if a else 0 for a in ctx.active], dtype=torch.long, device=dev)
        return Proposal(torch.stack(toks, 1), num, torch.stack(qs, 1) if ctx.sample_drafts else None)


# ---------------------------------------------------------------------------- builders
def drafter_for_head(head, name: str | None = None, target_vocab_size: int | None = None) -> HeadDrafter:
    """The drafter class for a head's kind (eagle3 / eagle1 / mtp). Refuses (``DraftVocabError``)
    a head whose vocabulary mapping is inconsistent, or does not fit ``target_vocab_size``."""
    kind = _head_config(head).kind
    cls = {"eagle3": Eagle3Drafter, "eagle1": Eagle1Drafter, "mtp": MTPDrafter}[kind]
    return cls(head, name=name, target_vocab_size=target_vocab_size)


DRAFTER_KINDS = ("ngram", "head", "hybrid")


def make_drafter(kind: str, head=None, *, name: str | None = None, target_vocab_size: int | None = None,
                 min_match: int = 3, min_ngram: int = 1, max_ngram: int = 4, occurrence: str = "latest",
                 ngram_backend: str = "auto", adaptive: bool = True) -> Drafter:
    """A runtime drafter by name (the builder the eval stage calls):

    - ``"ngram"``: ``NGramDrafter(min_ngram, max_ngram, occurrence, ngram_backend)`` (device
      proposer on CUDA, the host reference elsewhere, with ``ngram_backend="auto"``);
    - ``"head"``: ``drafter_for_head(head)`` (``head``: a head module or a HeadDrafter);
    - ``"hybrid"``: ``HybridDrafter(head drafter, n-gram drafter, min_match, adaptive)``.
    """
    if kind not in DRAFTER_KINDS:
        raise ValueError(f"unknown drafter {kind!r}; use one of {DRAFTER_KINDS}")
    if kind == "ngram":
        return NGramDrafter(min_ngram, max_ngram, occurrence, ngram_backend)
    if head is None:
        raise ValueError(f"drafter {kind!r} needs a head")
    hd = head if isinstance(head, Drafter) else drafter_for_head(head, name=name, target_vocab_size=target_vocab_size)
    if kind == "head":
        return hd
    return HybridDrafter(hd, NGramDrafter(min_ngram, max_ngram, occurrence, ngram_backend), min_match=min_match,
                         adaptive=adaptive)
