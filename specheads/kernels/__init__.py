"""Verification, sampling, loss, decode-attention and KV-cache-write kernels: Triton kernels beside PyTorch twins.

Each public function dispatches on ``backend``:

* ``"torch"``  — the plain-PyTorch reference (``*_ref.py``);
* ``"triton"`` — the Triton kernel (``*_triton.py``); on CPU tensors it needs
  ``TRITON_INTERPRET=1`` set before triton is first imported;
* ``"auto"``   — Triton for CUDA tensors (falls back to torch, with a warning, if
  triton cannot be imported), torch for CPU tensors unless the environment variable
  ``SPECHEADS_KERNELS=triton``; ``SPECHEADS_KERNELS=torch`` forces torch everywhere.

Triton is imported lazily, on the first Triton call. Both twins of a kernel have the
same signature and return the same thing; the verify rules agree bit for bit (explicit
uniforms + exact integer inverse-CDF sampling, see ``_common``), ``target_probs`` and
``soft_cross_entropy`` to float rounding. This package imports nothing from the rest
of specheads.

Randomness always enters as explicit uniform tensors in [0, 1) (float32), e.g.
``uniform_accept = torch.rand(B, K, device=dev)``, ``uniform_sample = torch.rand(B, device=dev)``.
"""

from __future__ import annotations

import os
import warnings

import torch

from . import attention_ref, sampling_ref, soft_ce_ref, verify_ref
from ._common import GREEDY_EPS, TreeVerifyOutput, VerifyOutput, attention_supported

__all__ = [
    "VerifyOutput", "TreeVerifyOutput", "GREEDY_EPS", "triton_available", "resolve_backend",
    "target_probs", "greedy_verify", "rejection_verify", "onehot_verify", "tree_verify",
    "soft_cross_entropy", "soft_cross_entropy_and_accuracy", "soft_cross_entropy_shifted",
    "decode_attention", "attention_supported", "kv_cache_write",
]

_BACKENDS = ("auto", "triton", "torch")
_triton_ok: bool | None = None


def triton_available() -> bool:
    """True if triton imports (checked once)."""
    global _triton_ok
    if _triton_ok is None:
        try:
            import triton  # noqa: F401
            _triton_ok = True
        except Exception:  # ImportError, or a broken install
            _triton_ok = False
    return _triton_ok


def resolve_backend(backend: str, tensor: torch.Tensor) -> str:
    """Return "triton" or "torch" for a call on ``tensor`` (see module docstring)."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    env = os.environ.get("SPECHEADS_KERNELS", "").strip().lower()
    if env == "torch":
        return "torch"
    if tensor.is_cuda or env == "triton":
        if triton_available():
            return "triton"
        if env == "triton":
            raise RuntimeError("SPECHEADS_KERNELS=triton but triton cannot be imported")
        warnings.warn("triton is not importable; using the PyTorch reference kernels", stacklevel=3)
    return "torch"


def _impl(family: str, backend: str, tensor: torch.Tensor):
    """The module of ``family`` (verify, sampling, soft_ce) for the resolved backend."""
    if resolve_backend(backend, tensor) == "triton":
        # imported on first use: triton is an optional dependency
        from . import sampling_triton, soft_ce_triton, verify_triton

        return {"verify": verify_triton, "sampling": sampling_triton, "soft_ce": soft_ce_triton}[family]
    return {"verify": verify_ref, "sampling": sampling_ref, "soft_ce": soft_ce_ref}[family]


# ---------------------------------------------------------------------------- sampling
def target_probs(logits: torch.Tensor, temperature, top_k=None, top_p=None, *, backend: str = "auto") -> torch.Tensor:
    """Temperature, then top-k (0 = off), then top-p (1.0 = off), renormalised -> float32 probs.

    logits [B, N, V] or [M, V]; each parameter a number or a tensor with one value per
    request ([B] / [M]) or per row. temperature < 1e-5 = greedy one-hot (lowest index
    among ties). Ties at the top-k / top-p threshold are all kept. See ``sampling_ref``.
    """
    return _impl("sampling", backend, logits).target_probs(logits, temperature, top_k, top_p)


# ---------------------------------------------------------------------------- verification
def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor, *, backend: str = "auto") -> VerifyOutput:
    """Accept drafts [B, K] while they equal argmax(target_logits [B, K+1, V]) (lowest index on ties).

    Returns VerifyOutput(num_accepted int64 [B], out_tokens int64 [B, K+1]): accepted drafts, then
    the target argmax at position num_accepted (correction or bonus), then -1.
    """
    return _impl("verify", backend, target_logits).greedy_verify(draft_tokens, target_logits)


def rejection_verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     uniform_accept: torch.Tensor, uniform_sample: torch.Tensor, *,
                     backend: str = "auto") -> VerifyOutput:
    """Speculative sampling with draft probabilities: accept iff u*q(x) < p(x); resample from
    norm(max(0, p - q)) at the first rejection, bonus from target_probs[:, K] when all accepted.

    draft_tokens [B, K] (-1 = no draft), draft_probs [B, K, V], target_probs [B, K+1, V],
    uniform_accept [B, K], uniform_sample [B]. Returns VerifyOutput.
    """
    return _impl("verify", backend, target_probs).rejection_verify(draft_tokens, draft_probs, target_probs,
                                                                  uniform_accept, uniform_sample)


def onehot_verify(draft_tokens: torch.Tensor, target_probs: torch.Tensor, uniform_accept: torch.Tensor,
                  uniform_sample: torch.Tensor, *, backend: str = "auto") -> VerifyOutput:
    """Speculative sampling with one-hot drafts (q = delta_x): accept iff u < p(x); on rejection
    draw from p with x zeroed. Shapes as ``rejection_verify`` without draft_probs."""
    return _impl("verify", backend, target_probs).onehot_verify(draft_tokens, target_probs, uniform_accept,
                                                               uniform_sample)


def tree_verify(candidates: torch.Tensor, retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor,
                target_probs: torch.Tensor, coins: torch.Tensor, coin_final: torch.Tensor, max_depth: int,
                threshold_single: float = 1.0, threshold_acc: float = 1.0, *,
                backend: str = "auto") -> TreeVerifyOutput:
    """Target-only tree verification with SGLang's semantics (``tree_speculative_sampling_target_only``).

    candidates / retrive_next_token / retrive_next_sibling / coins [B, N] (local node indices,
    -1 terminated; node 0 = root), target_probs [B, N, V], coin_final [B], max_depth = draft levels
    that may be accepted. threshold_single = threshold_acc = 1.0 is lossless. Returns
    TreeVerifyOutput(accept_index [B, D+1], num_accepted [B], next_token [B], out_tokens [B, D+1]).
    See ``verify_ref.tree_verify`` for the exact rule.
    """
    return _impl("verify", backend, target_probs).tree_verify(
        candidates, retrive_next_token, retrive_next_sibling, target_probs, coins, coin_final, max_depth,
        threshold_single, threshold_acc)


# ---------------------------------------------------------------------------- training loss
def soft_cross_entropy(draft_logits: torch.Tensor, target_logits: torch.Tensor, *,
                       backend: str = "auto") -> torch.Tensor:
    """Per-row -sum softmax(target) * log_softmax(draft) (float32 [...]); differentiable w.r.t.
    draft_logits only (the target is a constant). bf16 / fp32 inputs, fp32 math."""
    return _impl("soft_ce", backend, draft_logits).soft_cross_entropy(draft_logits, target_logits)


def soft_cross_entropy_and_accuracy(draft_logits: torch.Tensor, target_logits: torch.Tensor, *,
                                    backend: str = "auto"):
    """(loss float32 [...], agree bool [...]) where agree = argmax(draft) == argmax(target),
    lowest index on ties."""
    return _impl("soft_ce", backend, draft_logits).soft_cross_entropy_and_accuracy(draft_logits, target_logits)


def soft_cross_entropy_shifted(draft_logits: torch.Tensor, target_logits: torch.Tensor, valid: torch.Tensor,
                               shift: int, *, backend: str = "auto"):
    """A training step's soft-CE: draft position t [B, T, V] against target position ``t + shift``, at the
    ``valid`` [B, T] positions (bool; a position whose ``t + shift`` falls outside the row does not count).
    Returns (loss float32 [B, T], 0 elsewhere; draft_argmax int64 [B, T], -1 elsewhere); differentiable
    w.r.t. draft_logits only, with a zero gradient at the positions that do not count."""
    return _impl("soft_ce", backend, draft_logits).soft_cross_entropy_shifted(draft_logits, target_logits, valid,
                                                                             shift)


# ---------------------------------------------------------------------------- decode attention
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor, kv_len: int,
                     rows: torch.Tensor | None = None, *, backend: str = "auto") -> torch.Tensor:
    """Attention of T new tokens over one layer's static KV cache -> o [B, T, H*D] (see ``attention_ref``).

    q [B, T, H, D]; k_cache / v_cache [max_batch, KvH, slots, D], batch row b reading cache row
    ``rows[b]`` (None: b) up to slot ``kv_len``; additive mask [B, 1, G*T, kv_len], G = H // KvH.
    Shapes the kernel does not take (``attention_supported``: prefills) run the reference on any
    backend. Under ``torch.compile`` the kernel is the custom op ``specheads::decode_attention``
    (opaque to Inductor, captured in CUDA graphs like any kernel); pass ``backend`` resolved
    ("triton" / "torch") there, as the runtime does, so that nothing is decided while tracing."""
    if resolve_backend(backend, q) == "triton" and attention_supported(q.shape, k_cache.shape[1]):
        if torch.compiler.is_compiling():
            return torch.ops.specheads.decode_attention(q, k_cache, v_cache, mask, kv_len, rows)
        from . import attention_triton

        return attention_triton.decode_attention(q, k_cache, v_cache, mask, kv_len, rows)
    return attention_ref.decode_attention(q, k_cache, v_cache, mask, kv_len, rows)


@torch.library.custom_op("specheads::decode_attention", mutates_args=())
def _decode_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor,
                         kv_len: int, rows: torch.Tensor | None) -> torch.Tensor:
    from . import attention_triton

    return attention_triton.decode_attention(q, k_cache, v_cache, mask, kv_len, rows)


@_decode_attention_op.register_fake
def _(q, k_cache, v_cache, mask, kv_len, rows):
    B, T, H, D = q.shape
    return q.new_empty(B, T, H * D)


# ---------------------------------------------------------------------------- KV-cache write
def kv_cache_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   write_pos: torch.Tensor, rows: torch.Tensor | None = None, *, backend: str = "auto") -> None:
    """In place: the new tokens' K/V ``k`` / ``v`` [B, KvH, T, D] go to slots ``write_pos`` [B, T] of cache
    rows ``rows`` [B] (None: the first B) of one layer's ``k_cache`` / ``v_cache`` [max_batch, KvH, slots, D]
    (see ``attention_ref``). Under ``torch.compile`` the kernel is the custom op ``specheads::kv_cache_write``
    (mutating the caches; Inductor neither copies nor fuses them); pass ``backend`` resolved, as
    ``decode_attention``."""
    if resolve_backend(backend, k) == "triton":
        if torch.compiler.is_compiling():
            torch.ops.specheads.kv_cache_write(k_cache, v_cache, k, v, write_pos, rows)
            return
        from . import attention_triton

        attention_triton.kv_cache_write(k_cache, v_cache, k, v, write_pos, rows)
        return
    attention_ref.kv_cache_write(k_cache, v_cache, k, v, write_pos, rows)


@torch.library.custom_op("specheads::kv_cache_write", mutates_args=("k_cache", "v_cache"))
def _kv_cache_write_op(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       write_pos: torch.Tensor, rows: torch.Tensor | None) -> None:
    from . import attention_triton

    attention_triton.kv_cache_write(k_cache, v_cache, k, v, write_pos, rows)


@_kv_cache_write_op.register_fake
def _(k_cache, v_cache, k, v, write_pos, rows):
    return None
