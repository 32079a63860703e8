"""One decode step's data and bookkeeping: what the target verifies (``Draft``), the verify
rule's answer (``Verdict``) and the commit's bookkeeping as pure tensor functions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model import ForwardOutput
from ..tree import DraftTree


@dataclass
class Draft:
    """What the target verifies this step: ``tokens [B, 1+K]`` = each row's last emitted
    token (not in the cache yet) followed by its K drafts (chain) or tree nodes."""
    active: torch.Tensor                  # [B] bool: the rows still generating when the step began
    tokens: torch.Tensor                  # [B, 1+K]
    num: torch.Tensor                     # [B] real drafts per row (0: finished row or no drafter)
    tree: DraftTree | None = None
    probs: torch.Tensor | None = None     # [B, K, V] draft probabilities (rule 'rejection')

    @property
    def K(self) -> int:
        return self.tokens.shape[1] - 1


@dataclass
class Verdict:
    """The verify rule's answer: row b emits ``tokens[b, :num_accepted[b] + 1]`` (the accepted
    drafts, then the correction or bonus token)."""
    num_accepted: torch.Tensor            # [B] (0 for finished rows)
    tokens: torch.Tensor                  # [B, W] (W = K+1 for chains, depth+1 for trees)
    slots: torch.Tensor                   # [B, W] slot of accepted position i, as an offset from the
                                          #        row's cache length (chain: i; tree: root + path)
    out: ForwardOutput                    # the verify forward (aux / final for the drafter)


# Pure tensor functions of a step's bookkeeping. On a compiled engine they run through torch.compile
# (``fused``): eagerly they are ~60 small kernels a step, about a tenth of a graphed SmolLM2 step at
# batch 1, and they are what a drafted step has more of than a plain one.
def chain_draft(active, hist, hist_len, prop_tokens, prop_num, K: int):
    """A step's input for a chain: (tokens [B, 1+K] = each row's last token and its drafts (0-padded
    past the proposal), num [B] (0 for finished rows))."""
    B = hist.shape[0]
    last = hist.gather(1, (hist_len - 1)[:, None])
    w = min(K, prop_tokens.shape[1])
    drafts = torch.zeros(B, K, dtype=torch.long, device=hist.device)
    drafts[:, :w] = prop_tokens[:, :w]
    num = torch.where(active, prop_num.clamp(max=K), 0)
    return torch.cat([last, drafts], 1), num


def commit_rows(hist, hist_len, prompt_len, max_new, stops, stopped, active, rec, step, flag, lengths,
                act, num, depth, n_acc, toks):
    """The commit's bookkeeping, in place: append each active row's emitted tokens ``toks[:, :n]``
    (n = accepted + 1, cut at a stop token or max_new_tokens) to ``hist``, record the step in
    ``rec``, advance the cache ``lengths`` by what each row kept, finish rows, set ``flag``.
    Returns (start, committed): each row's cache length before the step and the positions it kept."""
    B, W = toks.shape
    cache_len = lengths[:B]
    pos = torch.arange(W, device=toks.device)
    is_stop = (toks[:, :, None] == stops[:, None, :]).any(-1) & (pos <= n_acc[:, None])
    any_stop = is_stop.any(1)
    first_stop = torch.where(any_stop, is_stop.long().argmax(1), W)
    room = max_new - (hist_len - prompt_len)
    n_emit = torch.minimum(torch.minimum(n_acc + 1, room), first_stop + 1)
    n_emit = torch.where(act, n_emit, 0)
    hit = act & any_stop & (first_stop < n_emit)
    idx = (hist_len[:, None] + pos).clamp(max=hist.shape[1] - 1)
    hist.scatter_(1, idx, torch.where(pos < n_emit[:, None], toks, hist.gather(1, idx)))
    row = torch.stack([act.long(), num, n_acc, n_emit, torch.where(num > 0, depth, 0)])
    rec.index_copy_(0, step.clamp(max=rec.shape[0] - 1), row[None])
    committed = torch.where(act, n_acc + 1, 0)
    start = cache_len.clone()
    cache_len += committed
    hist_len += n_emit
    finished = hit | (hist_len - prompt_len >= max_new)
    stopped |= hit
    active &= ~finished
    step += 1
    flag.copy_(torch.stack([active.any().long(), cache_len.max()]))
    return start, committed


_COMPILED: dict = {}


def fused(fn, on: bool):
    """``fn`` through torch.compile (one compiled function per process; static shapes: a step's
    shapes are fixed per captured graph) when ``on``, else ``fn``."""
    if not on:
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn]
