"""The hybrid drafter: per row and step, the n-gram (or suffix) proposal or the head's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import Drafter, DraftContext, Proposal, Verified
from .ngram import NGramDrafter
from .suffix import SuffixDrafter


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
    in the last ``generate`` call. Chains only.

    The free side (``ngram_drafter``) is an n-gram drafter unless given: a ``SuffixDrafter``
    takes its place as is (its ``match_len`` is the length of the suffix match it continues); its
    trees live on the host and are served between steps (``host_step``), so the step, the head's
    drafts included, is still captured in a CUDA graph."""

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
        self._proposed = False                        # whether the next update verifies a proposal of ours
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

    @property
    def has_host_step(self) -> bool:
        return any(getattr(d, "has_host_step", False) for d in (self.head, self.ngram))

    def host_step(self, ctx: DraftContext, k: int) -> None:
        for d in (self.head, self.ngram):
            if getattr(d, "has_host_step", False):
                d.host_step(ctx, k)

    @property
    def admits_rows(self) -> bool:
        """Both halves restart a row on ``admit`` (on the device, or as the suffix drafter on the host)."""
        return all(getattr(d, "graph_safe", False) or getattr(d, "admits_rows", False) for d in (self.head, self.ngram))

    def compile(self, units: bool = True, **compile_kwargs) -> "HybridDrafter":
        """The head's units, the n-gram match and the choice through torch.compile; ``units=False``:
        the head's call alone (``HeadDrafter.compile``), the n-gram side and the choice eager."""
        if hasattr(self.head, "compile"):
            self.head.compile(units=units, **compile_kwargs)
        if units:
            if hasattr(self.ngram, "compile"):
                self.ngram.compile(**compile_kwargs)
            kw = {"dynamic": False, **compile_kwargs}
            self._choose = torch.compile(hybrid_choice, **kw)
            self._score = torch.compile(hybrid_score, **kw)
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
        # the prefill's update carries the prompt, not a verification: scoring it would change nothing (nothing
        # is eligible) but would run the compiled score at the prompt's width, a recompile every new width
        self._proposed = False

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
        if self.adaptive and self._proposed and self._last is not None \
                and self._last[0].shape[0] == v.next_tokens.shape[0]:
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
            self._proposed = True
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
        return {"suffix" if isinstance(self.ngram, SuffixDrafter) else "ngram": n, "head": h}
