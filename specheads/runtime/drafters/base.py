"""What every drafter shares: the protocol (``Drafter``), what the engine tells a drafter
(``DraftContext``), what it proposes (``Proposal``) and what the target verified (``Verified``).

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
- ``has_host_step`` / ``host_step(ctx, k)``: a drafter whose proposals come from host state
  (suffix decoding's trees) and is still ``graph_safe``: the engine calls ``host_step`` after the
  prefill, after new rows are admitted and after every step, outside any graph (one host sync);
  it takes in what the rows emitted and writes the next proposals into device buffers that
  ``propose`` returns, so the step itself, the head of a hybrid included, runs in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specheads.errors import SpecheadsError

from ..tree import DraftTree, TreeConfig
from ..verify import sample_inverse_cdf, target_probs


class DraftVocabError(SpecheadsError, ValueError):
    """A draft head's vocabulary mapping (d2t, t2d, vocabulary sizes) does not fit the target."""


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
    has_host_step: bool = False

    def check_target(self, vocab_size: int) -> None:
        pass

    def start(self, ctx: DraftContext) -> None:
        pass

    def update(self, v: Verified) -> None:
        pass

    def host_step(self, ctx: DraftContext, k: int) -> None:
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



def pick_draft(ctx: DraftContext, logits_t: torch.Tensor, step: int = 0):
    """Choose one draft token per row from target-vocab logits [B, V]: argmax, or a sample from
    q = target_probs(logits) with the step's uniforms ``ctx.draft_u[:, step]`` when
    ctx.sample_drafts. Returns (ids [B], q [B, V] or None)."""
    if not ctx.sample_drafts:
        return logits_t.argmax(-1), None
    if ctx.draft_u is None:
        raise RuntimeError("sampled drafts need ctx.draft_u (the engine's per-step draft uniforms)")
    q = target_probs(logits_t, ctx.temperature, ctx.top_k, ctx.top_p)
    return sample_inverse_cdf(q, ctx.draft_u[:, step]), q
