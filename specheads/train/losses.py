"""Training losses for the draft heads, and the per-step metrics that go with them.

Alignment (one rule for every head; derived from EAGLE-3 / SpecForge)
--------------------------------------------------------------------
A batch row holds tokens ``x_0..x_{T-1}``, the target's aux states
``aux_t`` and its final-normed states ``final_t`` (so the target's
next-token distribution *for* ``x_{t+1}`` is ``softmax(lm_head(final_t))``).

EAGLE-3 step k (``ttt_forward``), EAGLE-1 (k = 0 only) and MTP depth d
(k = d) produce logits at position t from the input token ``x_{t+1+k}``;
those logits predict ``x_{t+2+k}``. Hence for step k at position t:

* target distribution: ``softmax(lm_head(final_{t+1+k}))`` restricted to the
  draft vocabulary (target ids ``arange(Vd) + d2t``);
* the position counts iff ``t+2+k < T``, ``loss_mask[t+2+k] == 1`` (the
  predicted token is a trained/assistant token, and not padding), and the
  target's argmax over its FULL vocabulary at ``final_{t+1+k}`` is in the
  draft vocabulary (``t2d``).

SpecForge (``specforge/core/eagle3.py``) builds the same target and input
shifts — ``padding(logits, left=False)`` then ``target_p_padded[:, k:k+T]``
gives ``logits[t+1+k]``, and the input ids are shifted left by 1 and then
once more per step — but multiplies by ``loss_mask[t+k]`` (its mask is
never shifted by the initial +1, and the predicted token sits at t+2+k).
We weight by the mask of the *predicted* token instead, which is what
"assistant-only loss" means; the two differ only at the two tokens at each
edge of an assistant span.

Loss per step = mean soft cross-entropy over the counted positions; total =
Σ_k loss_decay^k · loss_k (EAGLE-3), SmoothL1(feature) + w·CE (EAGLE-1),
Σ_d w_d · loss_d (MTP).  Accuracy of step k = fraction of counted positions
where the draft argmax equals the target argmax; the simulated acceptance
length is ``τ = 1 + Σ_k Π_{j≤k} acc_j``.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specheads.heads.layers import allow_recompiles, causal_mask, sdpa_without_cudnn
from specheads.heads.ttt import ttt_forward
from specheads.kernels import soft_cross_entropy_shifted


# ---------------------------------------------------------------- target side (frozen)
@dataclass
class TargetView:
    """The frozen target's view of one batch, row t = lm_head(final_t)."""

    logits: torch.Tensor  # [B, T, V'] (V' = the head's output vocab), float32
    argmax: torch.Tensor  # [B, T] int64: target argmax as an index of the head's vocab (-1 if outside)
    in_vocab: torch.Tensor  # [B, T] bool: target argmax (full vocab) is in the head's vocab


class TargetLogits:
    """Target logits from ``final`` states with the frozen target lm_head, restricted to the draft vocab.

    Never part of the trained module: it lives outside the DeepSpeed engine.
    The full-vocabulary argmax (needed for the in-draft-vocab mask) is
    computed in row chunks so a 128k vocabulary never materialises [B,T,Vt].

    ``tf32``: an fp32 lm_head multiplies on TF32 tensor cores (CUDA only; fp32 accumulation and
    output). The trainer turns it on for bf16 training: the states arrive in bf16 anyway, and in
    plain fp32 these two GEMMs (draft vocabulary and full-vocabulary argmax) took ~3 TFLOP per
    32k-token micro-batch at fp32's ~60 TFLOP/s on the H200, a tenth of each step.
    """

    def __init__(self, lm_head_weight: torch.Tensor, d2t: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, chunk_elems: int = 1 << 26, tf32: bool = False):
        self.tf32 = bool(tf32)
        W = lm_head_weight.detach()
        self.Vt = W.shape[0]
        self.W_full = W
        self.b_full = None if bias is None else bias.detach()
        self.chunk_elems = chunk_elems
        if d2t is None or d2t.numel() == self.Vt:
            self.target_ids = None
            self.W = W
            self.b = self.b_full
            self.t2d_index = None
        else:
            ids = torch.arange(d2t.numel(), device=d2t.device) + d2t.to(torch.int64)
            ids = ids.to(W.device)
            self.target_ids = ids
            self.W = W[ids].contiguous()
            self.b = None if bias is None else self.b_full[ids]
            idx = torch.full((self.Vt,), -1, dtype=torch.int64, device=W.device)
            idx[ids] = torch.arange(ids.numel(), device=W.device)
            self.t2d_index = idx

    @property
    def vocab_size(self) -> int:
        return self.W.shape[0]

    def to(self, device):
        for name in ("W_full", "b_full", "W", "b", "target_ids", "t2d_index"):
            v = getattr(self, name)
            if v is not None:
                setattr(self, name, v.to(device))
        return self

    @torch.no_grad()
    def __call__(self, final: torch.Tensor) -> TargetView:
        if self.tf32 and self.W.is_cuda and self.W.dtype == torch.float32:
            with _tf32_matmuls():
                return self._view(final)
        return self._view(final)

    def _view(self, final: torch.Tensor) -> TargetView:
        B, T, H = final.shape
        x = final.reshape(B * T, H).to(device=self.W.device, dtype=self.W.dtype)
        logits = F.linear(x, self.W, self.b).float()
        if self.target_ids is None:
            am = logits.argmax(-1)
            in_vocab = torch.ones_like(am, dtype=torch.bool)
        else:
            rows = max(1, self.chunk_elems // self.Vt)
            full_am = torch.cat([F.linear(x[i:i + rows], self.W_full, self.b_full).argmax(-1)
                                 for i in range(0, x.shape[0], rows)])
            am = self.t2d_index[full_am]
            in_vocab = am >= 0
        return TargetView(logits.view(B, T, -1), am.view(B, T), in_vocab.view(B, T))


@contextmanager
def _tf32_matmuls():
    """fp32 CUDA matmuls on TF32 tensor cores inside the block, restored after (process-wide otherwise)."""
    mm = torch.backends.cuda.matmul
    if hasattr(mm, "fp32_precision"):       # torch >= 2.9
        old = mm.fp32_precision
        mm.fp32_precision = "tf32"
        try:
            yield
        finally:
            mm.fp32_precision = old
        return
    old = mm.allow_tf32
    mm.allow_tf32 = True
    try:
        yield
    finally:
        mm.allow_tf32 = old


# ---------------------------------------------------------------- alignment
def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """y[:, t] = x[:, t+n] (0/False past the end); works for [B, T, ...]."""
    T = x.shape[1]
    n = min(n, T)
    pad = torch.full((x.shape[0], n) + tuple(x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x[:, n:], pad], dim=1)


def counted_positions(loss_mask: torch.Tensor, in_vocab: torch.Tensor, k: int,
                      attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] bool: positions t whose step-k prediction (token x_{t+2+k}) is trained on.

    ``loss_mask[t+2+k]`` (and ``attention_mask[t+2+k]``) and ``in_vocab[t+1+k]``
    (the target's argmax at final_{t+1+k} is a draft-vocab token)."""
    m = loss_mask.bool()
    if attention_mask is not None:
        m = m & attention_mask.bool()
    return shift_left(m, 2 + k, False) & shift_left(in_vocab.bool(), 1 + k, False)


@dataclass
class StepResult:
    loss: torch.Tensor  # scalar (differentiable)
    hits: torch.Tensor  # scalar int64
    count: torch.Tensor  # scalar int64


def distill_step(logits: torch.Tensor, tv: TargetView, loss_mask: torch.Tensor, k: int,
                 attention_mask: torch.Tensor | None = None, backend: str = "auto") -> StepResult:
    """Soft-CE of step-k logits [B, T, V'] against the target distribution (alignment in the module doc).

    The loss kernel reads draft row t and target row t+1+k in place at the counted positions: no
    gathered copies, and no ``nonzero`` (a host sync) per step."""
    valid = counted_positions(loss_mask, tv.in_vocab, k, attention_mask).to(logits.device)
    count = valid.sum()
    ce, draft_argmax = soft_cross_entropy_shifted(logits, tv.logits.to(logits.device), valid, 1 + k,
                                                  backend=backend)
    loss = ce.sum() / count.clamp(min=1)
    with torch.no_grad():
        want = shift_left(tv.argmax.to(logits.device), 1 + k, -1)
        hits = ((draft_argmax == want) & valid).sum()
    return StepResult(loss, hits, count)


def simulated_tau(accs) -> float:
    """τ = 1 + Σ_k Π_{j≤k} acc_j (chain drafting, greedy verification)."""
    tau, prod = 1.0, 1.0
    for a in accs:
        prod *= float(a)
        tau += prod
    return tau


# ---------------------------------------------------------------- objectives
@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    step_losses: list  # detached scalars, one per step / depth
    hits: list  # int64 scalars
    counts: list  # int64 scalars
    extra: dict = field(default_factory=dict)  # detached scalars (e.g. EAGLE-1 feature loss)


def eagle1_forward(head, input_ids, final, attention_mask):
    """Teacher-forced EAGLE-1 step: input x_{t+1} and f_t -> (logits [B,T,Vt], f̂_{t+1} [B,T,H])."""
    B, T = input_ids.shape
    pos = torch.arange(T, device=input_ids.device)[None].expand(B, T)
    mask = causal_mask(T, input_ids.device)[None, None]
    if attention_mask is not None:
        mask = mask & attention_mask.bool()[:, None, None, :]
    return head.forward_step(shift_left(input_ids, 1, 0), final, pos, mask)


def eagle3_loss(head, batch: dict, tv: TargetView, steps: int, decay: float, backend: str = "auto",
                forward=ttt_forward) -> LossOutput:
    aux = batch["aux"]
    aux = aux.to(head.fc.weight.dtype)
    logits = forward(head, batch["input_ids"], aux, batch.get("attention_mask"), steps)
    return _combine([distill_step(lg, tv, batch["loss_mask"], k, batch.get("attention_mask"), backend)
                     for k, lg in enumerate(logits)], [decay ** k for k in range(len(logits))])


def eagle1_loss(head, batch: dict, tv: TargetView, ce_weight: float, backend: str = "auto",
                forward=eagle1_forward) -> LossOutput:
    """SmoothL1(f̂_{t+1}, final_{t+1}) + ce_weight · soft-CE(lm_head(f̂_{t+1}), lm_head(final_{t+1}))."""
    final = batch["final"].to(head.fc.weight.dtype)
    attn = batch.get("attention_mask")
    logits, feat = forward(head, batch["input_ids"], final, attn)
    tok = distill_step(logits, tv, batch["loss_mask"], 0, attn, backend)
    valid = counted_positions(batch["loss_mask"], tv.in_vocab, 0, attn)
    b, t = valid.nonzero(as_tuple=True)
    if b.numel():
        vloss = F.smooth_l1_loss(feat[b, t].float(), final[b, t + 1].float(), reduction="none").mean(-1).mean()
    else:
        vloss = feat.sum() * 0.0
    total = vloss + ce_weight * tok.loss
    return LossOutput(total, [tok.loss.detach()], [tok.hits], [tok.count],
                      {"feature_loss": vloss.detach(), "token_loss": tok.loss.detach()})


def mtp_forward(head, input_ids, final, attention_mask):
    return head.forward_train(input_ids, final, attention_mask)


def mtp_loss(head, batch: dict, tv: TargetView, weights: list[float], backend: str = "auto",
             forward=mtp_forward) -> LossOutput:
    final = batch["final"].to(head.lm_head.weight.dtype)
    logits, _ = forward(head, batch["input_ids"], final, batch.get("attention_mask"))
    return _combine([distill_step(lg, tv, batch["loss_mask"], d, batch.get("attention_mask"), backend)
                     for d, lg in enumerate(logits)], weights)


def _combine(results: list[StepResult], weights: list[float]) -> LossOutput:
    total = sum(w * r.loss for w, r in zip(weights, results))
    return LossOutput(total, [r.loss.detach() for r in results], [r.hits for r in results],
                      [r.count for r in results])


def mtp_weights(recipe_head, num_depths: int, decay: float) -> list[float]:
    """head.mtp_loss_weights, else loss_decay^d per depth."""
    if recipe_head.mtp_loss_weights is not None:
        return [float(w) for w in recipe_head.mtp_loss_weights]
    return [decay ** d for d in range(num_depths)]


class Objective(nn.Module):
    """The module DeepSpeed trains: the head plus its loss. ``forward(batch, target_view) -> LossOutput``.

    The target (lm_head, and in online mode the whole model) stays outside:
    its outputs arrive as a :class:`TargetView`.
    """

    def __init__(self, head: nn.Module, kind: str, *, steps: int = 7, decay: float = 0.8,
                 eagle1_ce_weight: float = 0.1, mtp_weights: list[float] | None = None,
                 backend: str = "auto", compile: bool = False, static_shapes: bool = False,
                 peagle_keep: tuple[float, float] = (0.7, 0.2), dflash_anchors: int = 512,
                 dflash_gamma: float = 4.0, dflash_attention: str = "dense", seed: int = 0):
        super().__init__()
        self.head = head
        self.kind = kind
        self.peagle_keep, self.dflash_anchors, self.dflash_gamma, self.dflash_attention, self.seed = (
            tuple(peagle_keep), int(dflash_anchors), float(dflash_gamma), dflash_attention, int(seed))
        self.steps = steps
        self.decay = decay
        self.eagle1_ce_weight = eagle1_ce_weight
        self.mtp_weights = mtp_weights
        self.backend = backend
        # Only the head's forward is compiled: the loss selects valid positions with nonzero()
        # (data-dependent shapes) and runs its own Triton soft-CE kernel, so it stays eager.
        forward = {"eagle3": ttt_forward, "eagle1": eagle1_forward, "mtp": mtp_forward}.get(kind)
        # dynamic from the first batch: token-budget micro-batches change shape every step; with
        # ``static_shapes`` (train.length_buckets) one graph per bucket shape, each compiled once
        if compile and forward is not None and static_shapes:
            allow_recompiles()               # a graph per bucket (and eval's), past dynamo's default of 8
        self._forward = (torch.compile(forward, dynamic=not static_shapes) if compile and forward is not None
                         else forward)

    @property
    def num_steps(self) -> int:
        if self.kind in ("peagle", "dflash"):
            return self.head.cfg.tokens_per_forward
        if self.kind == "eagle3":
            return self.steps
        if self.kind == "eagle1":
            return 1
        return len(self.mtp_weights)

    def forward(self, batch: dict, tv: TargetView) -> LossOutput:
        # Heads call SDPA with an explicit mask (Attention.attend: EAGLE-1, MTP, P-EAGLE). With torch 2.11 on
        # H100/H200, cuDNN's SDPA backward returns NaN query gradients for a masked call whose length is 64 mod 128
        # once a query row's logsumexp falls below ln(FLT_MAX) (pytorch/pytorch#196678); DeepSpeed's unfused
        # optimizer then reports an inf gradient norm. A P-EAGLE run on Qwen2.5-Coder-1.5B stopped that way
        # (BENCHMARKS.md; this cause suspected, not reproduced). The backward runs the kernel its forward chose, and
        # a compiled forward the kernel the flags allowed when traced: the context is entered around every call.
        with sdpa_without_cudnn(batch["input_ids"].device):
            return self._loss(batch, tv)

    def _loss(self, batch: dict, tv: TargetView) -> LossOutput:
        if self.kind == "eagle3":
            return eagle3_loss(self.head, batch, tv, self.steps, self.decay, self.backend, self._forward)
        if self.kind == "eagle1":
            return eagle1_loss(self.head, batch, tv, self.eagle1_ce_weight, self.backend, self._forward)
        if self.kind == "mtp":
            return mtp_loss(self.head, batch, tv, self.mtp_weights, self.backend, self._forward)
        # sampled entries and anchors give data-dependent shapes: these two stay eager (train.compile aside)
        if self.kind == "peagle":
            from .parallel_losses import peagle_loss

            return peagle_loss(self.head, batch, tv, self.head.cfg.num_depths, *self.peagle_keep, seed=self.seed,
                               backend=self.backend)
        if self.kind == "dflash":
            from .parallel_losses import dflash_loss

            return dflash_loss(self.head, batch, tv, self.dflash_anchors, self.dflash_gamma, seed=self.seed,
                               backend=self.backend, attention=self.dflash_attention)
        raise ValueError(f"unknown head kind {self.kind!r}")
