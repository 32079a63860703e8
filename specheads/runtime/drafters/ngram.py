"""Prompt lookup: drafts copied from the request's own history (prompt + generated)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from specheads.heads.layers import allow_recompiles

from .base import Drafter, DraftContext, Proposal, Verified


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
