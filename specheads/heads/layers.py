"""Building blocks shared by the heads: RMSNorm, rotary embedding (default,
linear and llama3 scaling), GQA attention with optional Qwen3 q/k norm and
pluggable KV caches, SwiGLU MLP, and a pre-norm decoder layer.

Attention masks: a boolean mask (True = may attend) or an additive float
mask, broadcastable to ``[B, heads, T_q, T_k]``.  With no mask and no cache
the attention is causal.  Masked scores use ``finfo.min`` (not -inf) so a
fully masked row (padding) yields finite values instead of NaN.

KV caches: any object with ``update(layer_idx, k, v, cache_positions) ->
(k_all, v_all)`` (``StaticKVCache`` below), or with ``attend(layer_idx, q, k,
v, attention_mask, scale) -> out`` when the cache owns the attention pattern
(``TTTCache`` in ``heads/ttt.py``).  ``k``/``v`` are ``[B, kv_heads, T, head_dim]``
after rotary embedding.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import HeadConfig


def sdpa_without_cudnn(device: torch.device):
    """A context in which SDPA on a GPU picks its memory-efficient (or math) kernel, never cuDNN's; a no-op off the
    GPU. Its callers say why they want it (the runtime's prefills, every head's training forward)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


# ---------------------------------------------------------------- compiling
RECOMPILE_LIMIT = 64


def allow_recompiles(limit: int = RECOMPILE_LIMIT) -> None:
    """Let dynamo keep up to ``limit`` graphs per compiled function (its default: 8) in this process.

    Past the limit dynamo runs every new shape eagerly and says so only in a log line. Training's compiled head
    forwards need a graph per length bucket, DFlash's flex attention (uncompiled, it materializes the scores) one per
    kind of shape, and the runtime's decode steps more still: a decode layer specialises where a slice of the cache
    is the whole cache (batch = max_batch, width = every slot) and at sizes of 1 (one row, one token), so plain and
    drafted decoding at batch 1, 8 and 48 need more than 8 graphs. On the H200 (2026-12-01) compiled drafted decoding
    at batch 8 and 48 was then barely faster than eager while compiled plain decoding was 1.6x faster."""
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), limit))


# ---------------------------------------------------------------- rotary
def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the rope variants we support."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not rope_scaling:
        return inv, 1.0
    rtype = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rtype == "default":
        return inv, 1.0
    if rtype == "linear":
        return inv / float(rope_scaling["factor"]), 1.0
    if rtype == "llama3":
        factor = float(rope_scaling["factor"])
        low = float(rope_scaling.get("low_freq_factor", 1.0))
        high = float(rope_scaling.get("high_freq_factor", 4.0))
        old_len = float(rope_scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, out), 1.0
    raise NotImplementedError(f"rope_type {rtype!r} is not supported by specheads (default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float = 10000.0, rope_scaling: dict | None = None):
        super().__init__()
        inv, scale = rope_inv_freq(head_dim, theta, rope_scaling)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.attention_scaling = scale

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype = torch.float32):
        """position_ids [B, T] -> (cos, sin) each [B, T, head_dim] (computed in fp32)."""
        freqs = position_ids.to(torch.float32)[..., None] * self.inv_freq.to(position_ids.device)[None, None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, T, d]; cos/sin [B, T, d]."""
    cos = cos[:, None].to(x.dtype)
    sin = sin[:, None].to(x.dtype)
    return x * cos + rotate_half(x) * sin


# ---------------------------------------------------------------- masks
def causal_mask(T: int, device=None) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


def to_additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return out.masked_fill(~mask, torch.finfo(dtype).min)
    return mask.to(dtype)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


class StaticKVCache:
    """A preallocated KV cache: ``[B, kv_heads, max_len, head_dim]`` per layer.

    ``update`` writes ``k``/``v`` at ``cache_positions`` (``[T]`` or ``[B, T]``
    slot indices) and returns the whole buffers; the caller's mask (or the
    default: key slot j visible iff j <= cache_position of the query) selects
    what is attended.  Rolling back = just overwriting slots later.
    """

    def __init__(self, num_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype=torch.float32, device=None):
        self.k = [torch.zeros(batch, kv_heads, max_len, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.max_len = max_len

    @classmethod
    def for_head(cls, cfg: HeadConfig, batch: int, max_len: int, dtype=torch.float32, device=None) -> "StaticKVCache":
        return cls(cfg.num_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim, dtype, device)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, cache_positions: torch.Tensor):
        K, V = self.k[layer_idx], self.v[layer_idx]
        if cache_positions.dim() == 1:
            K[:, :, cache_positions] = k.to(K.dtype)
            V[:, :, cache_positions] = v.to(V.dtype)
        else:
            for b in range(k.shape[0]):
                K[b, :, cache_positions[b]] = k[b].to(K.dtype)
                V[b, :, cache_positions[b]] = v[b].to(V.dtype)
        return K, V

    def default_mask(self, cache_positions: torch.Tensor) -> torch.Tensor:
        """[B or 1, 1, T, max_len] boolean: slot j visible iff j <= query slot."""
        pos = cache_positions if cache_positions.dim() == 2 else cache_positions[None]
        slots = torch.arange(self.max_len, device=pos.device)
        return (slots[None, None, :] <= pos[:, :, None])[:, None]


# ---------------------------------------------------------------- modules
class Attention(nn.Module):
    def __init__(self, cfg: HeadConfig, in_dim: int | None = None):
        super().__init__()
        in_dim = in_dim or cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(in_dim, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.scale = self.head_dim ** -0.5
        # [q; k; v] in one matrix for inference (fuse_projections); not saved, never trained
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)

    def fuse(self) -> None:
        """Copy q/k/v into one matrix (allocated once, then refreshed in place: CUDA graphs keep its address)."""
        self.qkv_weight, self.qkv_bias = _fused_copy((self.q_proj, self.k_proj, self.v_proj),
                                                     self.qkv_weight, self.qkv_bias)

    def project_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        B, T, _ = x.shape
        if self.qkv_weight is not None and not torch.is_grad_enabled():
            nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = F.linear(x, self.qkv_weight, self.qkv_bias).split([nq, nkv, nkv], -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q, k, v, mask):
        """Plain attention over the given keys; mask bool/additive or None (= causal)."""
        n_rep = self.num_heads // self.num_kv_heads
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        if mask is None:
            mask = causal_mask(q.shape[2], q.device) if q.shape[2] == k.shape[2] else None
        add = to_additive(mask, q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=add, scale=self.scale)

    def forward(self, x, cos, sin, attention_mask=None, kv_cache=None, cache_positions=None, layer_idx: int = 0):
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x, cos, sin)
        if kv_cache is not None and hasattr(kv_cache, "attend"):
            o = kv_cache.attend(layer_idx, q, k, v, attention_mask, self)
        elif kv_cache is not None:
            if cache_positions is None:
                raise ValueError("a KV cache needs cache_positions (slot indices of the new tokens)")
            k, v = kv_cache.update(layer_idx, k, v, cache_positions)
            if attention_mask is None:
                attention_mask = kv_cache.default_mask(cache_positions)
            o = self.attend(q, k, v, attention_mask)
        else:
            o = self.attend(q, k, v, attention_mask)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        H, I, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(H, I, bias=b)
        self.up_proj = nn.Linear(H, I, bias=b)
        self.down_proj = nn.Linear(I, H, bias=b)
        if cfg.hidden_act not in ("silu", "swish", "gelu", "gelu_pytorch_tanh"):
            raise NotImplementedError(f"hidden_act {cfg.hidden_act!r}")
        self.act = cfg.hidden_act
        self.register_buffer("gate_up_weight", None, persistent=False)    # [gate; up], as Attention.qkv_weight
        self.register_buffer("gate_up_bias", None, persistent=False)

    def fuse(self) -> None:
        self.gate_up_weight, self.gate_up_bias = _fused_copy((self.gate_proj, self.up_proj), self.gate_up_weight,
                                                             self.gate_up_bias)

    def forward(self, x):
        if self.gate_up_weight is not None and not torch.is_grad_enabled():
            g, u = F.linear(x, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)
        else:
            g, u = self.gate_proj(x), self.up_proj(x)
        g = F.silu(g) if self.act in ("silu", "swish") else F.gelu(g, approximate="tanh" if "tanh" in self.act else "none")
        return self.down_proj(g * u)


def _fused_copy(linears, weight, bias):
    """The linears' weights (and biases) stacked along the output dim, written into ``weight`` / ``bias``
    when those fit (in place), else into new tensors."""
    ws = [m.weight for m in linears]
    bs = [m.bias for m in linears] if linears[0].bias is not None else None
    rows = sum(w.shape[0] for w in ws)
    fits = (weight is not None and weight.shape == (rows, *ws[0].shape[1:]) and weight.dtype == ws[0].dtype
            and weight.device == ws[0].device)
    with torch.no_grad():
        if not fits:
            return torch.cat(ws), (torch.cat(bs) if bs else None)
        torch.cat(ws, out=weight)
        if bs:
            torch.cat(bs, out=bias)
    return weight, bias


def fuse_projections(module: nn.Module) -> nn.Module:
    """Inference: every Attention's q/k/v and every MLP's gate/up projection as one matrix each, so a
    draft step runs 2 GEMMs where it ran 5 (vLLM loads its heads the same way, QKVParallelLinear and
    MergedColumnParallelLinear). A small head's GEMMs are latency-sized: on the H200 (2026-12-02) each
    took ~3.8 us whatever its width, 25 of them in a drafted SmolLM2 cycle.

    The fused matrices are copies: call this again after the parameters change (the runtime's drafters
    do at the start of every generation). They are used only with autograd off, so a training forward
    always runs through the parameters, and they are not part of ``state_dict``."""
    for m in module.modules():
        if isinstance(m, (Attention, MLP)):
            m.fuse()
    return module


class DecoderLayer(nn.Module):
    """Standard pre-norm Llama/Qwen3 decoder layer (H wide).

    ``input_layernorm=False`` gives EAGLE-1's first layer (no input norm;
    the parameter does not exist)."""

    def __init__(self, cfg: HeadConfig, input_layernorm: bool = True):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if input_layernorm else None
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, cos, sin, attention_mask=None, kv_cache=None, cache_positions=None, layer_idx: int = 0):
        x = self.input_layernorm(h) if self.input_layernorm is not None else h
        h = h + self.self_attn(x, cos, sin, attention_mask, kv_cache, cache_positions, layer_idx)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3FirstLayer(nn.Module):
    """EAGLE-3 layer 0, wired as vLLM's ``llama_eagle3.LlamaDecoderLayer`` (layer_idx 0):

    e = input_layernorm(embeds); x = hidden_norm(hidden)
    residual = x if norm_before_residual else hidden
    h = residual + o_proj(attn(cat[e, x]))           (q/k/v take 2H)
    out = h + mlp(post_attention_layernorm(h))       (= vLLM's mlp_out + residual)
    """

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, in_dim=2 * cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds, hidden, cos, sin, attention_mask=None, kv_cache=None, cache_positions=None):
        e = self.input_layernorm(embeds)
        x = self.hidden_norm(hidden)
        residual = x if self.norm_before_residual else hidden
        h = residual + self.self_attn(torch.cat([e, x], dim=-1), cos, sin, attention_mask, kv_cache,
                                      cache_positions, 0)
        return h + self.mlp(self.post_attention_layernorm(h))
