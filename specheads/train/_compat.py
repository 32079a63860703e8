"""The one adapter between the trainer and the other stages' contracts.

Everything the trainer needs from ``heads/``, ``kernels/``, ``dump/``,
``data/`` and ``export/`` is reached through the functions below, so a
contract change touches this file only.  Where a module is optional
(``kernels`` may be absent, ``export`` lands later), a plain-PyTorch
fallback or a clear error lives here too.
"""
from __future__ import annotations

import importlib
import inspect

import torch
import torch.nn.functional as F


# ---------------------------------------------------------------- heads
def head_classes() -> dict:
    from specheads.heads import HEAD_CLASSES

    return HEAD_CLASSES


def head_config_cls():
    from specheads.heads import HeadConfig

    return HeadConfig


def ttt_forward(head, input_ids, aux, attention_mask, steps):
    """EAGLE-3 unroll: list of per-step draft logits [B, T, Vd]; step k at t predicts x_{t+2+k}."""
    from specheads.heads.ttt import ttt_forward as _ttt

    return _ttt(head, input_ids, aux, attention_mask, steps)


def eagle1_forward(head, input_ids, final, attention_mask):
    """Teacher-forced EAGLE-1 step: input x_{t+1} and f_t -> (logits [B,T,Vt], f̂_{t+1} [B,T,H])."""
    from specheads.heads.layers import causal_mask
    from specheads.heads.mtp import shift_left

    B, T = input_ids.shape
    pos = torch.arange(T, device=input_ids.device)[None].expand(B, T)
    mask = causal_mask(T, input_ids.device)[None, None]
    if attention_mask is not None:
        mask = mask & attention_mask.bool()[:, None, None, :]
    return head.forward_step(shift_left(input_ids, 1, 0), final, pos, mask)


def mtp_forward(head, input_ids, final, attention_mask):
    """List (per depth d) of logits [B, T, V]; depth d at i predicts x_{i+2+d}."""
    logits, _ = head.forward_train(input_ids, final, attention_mask)
    return logits


# ---------------------------------------------------------------- kernels
def _torch_soft_ce(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    logp = F.log_softmax(draft_logits.float(), dim=-1)
    p = F.softmax(target_logits.float(), dim=-1)
    return -(p * logp).sum(-1)


_SOFT_CE = {}


def soft_cross_entropy(draft_logits: torch.Tensor, target_logits: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """loss[M] = -Σ_v softmax(target)[v] · log_softmax(draft)[v]; differentiable in ``draft_logits``.

    Uses ``specheads.kernels.soft_cross_entropy`` (fused Triton kernel chunked
    over the vocabulary, or its PyTorch reference); falls back to plain
    PyTorch when the kernels package is not installed.
    """
    fn = _SOFT_CE.get("fn")
    if fn is None:
        try:
            mod = importlib.import_module("specheads.kernels")
            fn = getattr(mod, "soft_cross_entropy")
            takes_backend = "backend" in inspect.signature(fn).parameters
        except (ImportError, AttributeError):
            fn, takes_backend = None, False
        _SOFT_CE["fn"] = fn or _torch_soft_ce
        _SOFT_CE["backend"] = takes_backend
        fn = _SOFT_CE["fn"]
    if fn is _torch_soft_ce:
        if backend == "triton":
            raise RuntimeError("train.loss_kernel='triton' but specheads.kernels.soft_cross_entropy is not available")
        return _torch_soft_ce(draft_logits, target_logits)
    if _SOFT_CE["backend"]:
        return fn(draft_logits, target_logits, backend=backend)
    return fn(draft_logits, target_logits)


# ---------------------------------------------------------------- data / dump / export
def make_feed(recipe, target=None, split: str = "train", rank: int = 0, world_size: int = 1):
    try:
        from specheads.dump.feed import make_feed as _make_feed
    except ImportError as e:
        raise RuntimeError(
            "specheads.dump.feed is not available: pass feed= to run_train, or install the dump stage"
        ) from e
    return _make_feed(recipe, target=target, split=split, rank=rank, world_size=world_size)


def load_vocab(vocab_dir):
    from specheads.data.vocab import load_vocab as _load_vocab

    return _load_vocab(vocab_dir)


def load_exported_head(path):
    """``(head, meta, fmt)`` from an exported head directory (any supported format)."""
    try:
        from specheads.export.convert import load_any
    except ImportError as e:
        raise RuntimeError(
            f"head.warm_start={path!r} needs specheads.export.convert.load_any, which is not installed"
        ) from e
    return load_any(path)
