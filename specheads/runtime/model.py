"""Target engine: a small Llama-family forward over Hugging Face weights (gpt-fast style).

Supports Llama, Mistral (no sliding window), Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm).

KV cache layout: ``k, v: [layers, B, kv_heads, max_seq, head_dim]`` plus ``lengths [B]``
(how many slots of each row are valid). Rows are left-aligned: row b's token at position
p lives in slot p. A forward writes the new tokens' K/V at ``write_pos`` (default
``lengths + arange(T)``) and every new token sees (a) all of its row's cached prefix
(slots < lengths[b]) and (b) the new tokens allowed by ``attn_mask [B, T, T]`` (causal
when omitted; an ancestor mask for a token tree). The forward never changes
``lengths``: the caller commits accepted tokens (``commit``), rolls back
(``set_lengths``) and, after tree verification, moves the accepted path into place
(``compact``).

Decode cost: at batch 1 a step is bound by kernel launches, not by the
weights, so the layer is written for few kernels: one fused RMSNorm, RoPE on q and k
together from tables cast to the model dtype once (``x*cos + roll(x)*sin±``, equal to
HF's ``rotate_half`` form), the attention mask built once per forward as an additive
mask, and grouped-query attention as plain attention over the KV heads with the query
heads of a group stacked as extra query rows (no K/V repeat): on a GPU one Triton kernel
that reads q and the cache in place (``kernels.decode_attention``), SDPA on a CPU and for
prefills. A forward attends over ``kv_len`` slots only (rounded up to a multiple of 16,
the alignment SDPA's kernels want); the cache allocates its slots rounded up the same way.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specheads import kernels
from specheads.errors import SpecheadsError
from specheads.heads.config import rope_from_config  # one RoPE config parser and
from specheads.heads.layers import allow_recompiles, rope_inv_freq, sdpa_without_cudnn  # one RoPE for heads and engine


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------
@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    hidden_act: str = "silu"
    model_type: str = "llama"
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf_config(cls, cfg) -> "ModelArgs":
        mt = getattr(cfg, "model_type", "llama")
        if mt not in ("llama", "mistral", "qwen2", "qwen3"):
            raise ValueError(f"runtime supports llama, mistral, qwen2, qwen3; got model_type={mt!r}")
        theta, scaling = rope_from_config(cfg)
        heads = cfg.num_attention_heads
        eos = getattr(cfg, "eos_token_id", None)
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_norm_eps=float(cfg.rms_norm_eps),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=getattr(cfg, "max_position_embeddings", 4096),
            qkv_bias=mt == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
            o_bias=bool(getattr(cfg, "attention_bias", False)) and mt != "qwen2",
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=mt == "qwen3",
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            hidden_act=getattr(cfg, "hidden_act", "silu"),
            model_type=mt,
            eos_token_ids=eos,
        )


# --------------------------------------------------------------------------------------------
# Building blocks (also used by the drafters' own layers)
# --------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm as one fused kernel (``F.rms_norm``, fp32 accumulation).
    Identical maths in fp32; for half types the weight is applied before the one rounding
    to the activation dtype (HF rounds, then scales in the half type): a last-bit difference
    that buys 3 kernels per norm. Plain and speculative decoding share it, so greedy
    outputs stay identical to each other."""
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def round_up(n: int, multiple: int = 16) -> int:
    return -(-int(n) // multiple) * multiple


def rope_tables(inv_freq: torch.Tensor, scale: float, max_seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_seq, head_dim] in fp32, the same arithmetic as HF's rotary embedding."""
    pos = torch.arange(max_seq, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq.float()[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * scale, emb.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/sin [B, T, D] (fp32). HF's rotate_half convention (reference form)."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: ``rotate_half(x) * sin == x.roll(D/2, -1) * signed_sin(sin)``
    exactly (a negation is exact), so RoPE is ``addcmul(x * cos, x.roll(D/2), signed_sin)``."""
    h = sin.shape[-1] // 2
    return torch.cat([-sin[..., :h], sin[..., h:]], -1)


def apply_rope_fast(x: torch.Tensor, cos: torch.Tensor, sin_s: torch.Tensor) -> torch.Tensor:
    """x [..., D]; cos / sin_s broadcastable, in x's dtype; three kernels."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_s)


def build_attn_mask(lengths: torch.Tensor, write_pos: torch.Tensor, attn_mask: torch.Tensor | None,
                    kv_len: int) -> torch.Tensor:
    """Boolean visibility [B, 1, T, kv_len]: the row's cached prefix plus the new tokens
    allowed by ``attn_mask [B, T, T]`` (causal if None), placed at their write slots."""
    B, T = write_pos.shape
    slots = torch.arange(kv_len, device=lengths.device)
    vis = (slots[None, :] < lengths[:, None])[:, None, :].expand(B, T, kv_len).clone()
    if attn_mask is None:
        attn_mask = torch.ones(T, T, dtype=torch.bool, device=lengths.device).tril()[None].expand(B, T, T)
    vis.scatter_(2, write_pos[:, None, :].expand(B, T, T).clamp(max=kv_len - 1), attn_mask.bool())
    return vis[:, None]


def additive_mask(vis: torch.Tensor, dtype: torch.dtype, groups: int = 1) -> torch.Tensor:
    """Bool visibility [B, 1, T, S] -> additive mask [B, 1, groups*T, S] in ``dtype`` (0 / -inf),
    rows repeated per query group (row g*T + t is query t of group member g). Every row must
    see at least one slot (a new token always sees itself)."""
    if groups > 1:
        vis = vis.repeat(1, 1, groups, 1)
    return torch.zeros((), dtype=dtype, device=vis.device).masked_fill(~vis, float("-inf"))


def prefill_attention(model: "TargetModel"):
    """The attention kernels of a prefill on a GPU: memory-efficient (or math), not cuDNN.

    A prefill's shape (rows, prompt length, attention width) changes from call to call, and
    cuDNN's attention builds a plan per shape (the likely cause): on the H200 (2026-12-01)
    regeneration and synthesis spent 5.0 s of their ~17 s on the host in 3,900 prefill attention
    calls (1.3 ms each). Decode steps keep cuDNN: their few shapes are captured once in CUDA
    graphs. Only the prompt's own forward changes kernel, the same for a drafted and a plain run,
    so outputs stay identical between them. A compiled engine keeps what it traced (no switch
    under torch.compile)."""
    if model.compiled:
        return contextlib.nullcontext()
    return sdpa_without_cudnn(model.device)


class KVCacheTooLarge(SpecheadsError, MemoryError):
    """The static KV cache for ``max_batch`` rows of ``max_seq`` slots does not fit the device's free memory.
    ``fits`` is the largest batch that would (0: not even one row). Stages re-raise it naming their setting."""

    def __init__(self, message: str, needed: int, free: int, fits: int):
        super().__init__(message)
        self.needed, self.free, self.fits = needed, free, fits


def free_device_bytes(device) -> int | None:
    """Free memory of a CUDA device (None elsewhere: host memory is not checked)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return int(torch.cuda.mem_get_info(device)[0])


def check_kv_cache_fits(num_layers, batch, kv_heads, max_seq, head_dim, dtype, device, headroom: float = 0.9):
    """Refuse, before allocating, a KV cache (K and V) larger than ``headroom`` of the device's free memory:
    ``torch.zeros`` would fail half-way with a bare OutOfMemoryError that names no setting. The engine's
    activations and logits need the rest."""
    free = free_device_bytes(device)
    if free is None:
        return
    per_row = 2 * num_layers * kv_heads * round_up(max_seq) * head_dim * dtype.itemsize
    if per_row * batch <= headroom * free:
        return
    fits = int(headroom * free // per_row)
    gib = 2 ** 30
    raise KVCacheTooLarge(
        f"the KV cache for {batch} rows of {max_seq} tokens ({num_layers} layers, {dtype}) needs "
        f"{per_row * batch / gib:.1f} GiB, but {torch.device(device)} has {free / gib:.1f} GiB free: "
        f"{fits} rows would fit", per_row * batch, free, fits)


class KVCache:
    """Static cache for ``num_layers`` layers; ``lengths[b]`` = valid slots of row b.
    ``slots`` (allocated) = ``max_seq`` rounded up to a multiple of 16."""

    def __init__(self, num_layers, batch, kv_heads, max_seq, head_dim, dtype, device):
        check_kv_cache_fits(num_layers, batch, kv_heads, max_seq, head_dim, dtype, device)
        self.slots = round_up(max_seq)
        shape = (num_layers, batch, kv_heads, self.slots, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.max_batch, self.max_seq = batch, max_seq

    def set_lengths(self, lengths) -> None:
        n = len(lengths)
        self.lengths[:n] = torch.as_tensor(lengths, dtype=torch.long).to(self.lengths.device)

    def compact(self, src_slots: torch.Tensor, dst_start: torch.Tensor) -> None:
        """Move slots ``src_slots [B, n]`` of each row to ``dst_start[b] + arange(n)`` (all layers).
        Used after tree verification to put the accepted path's K/V in sequence order."""
        B, n = src_slots.shape
        if n == 0:
            return
        rows = torch.arange(B, device=src_slots.device)[:, None]
        dst = dst_start.to(src_slots.device)[:, None] + torch.arange(n, device=src_slots.device)
        for c in (self.k, self.v):
            moved = c[:, rows, :, src_slots]            # [B, n, L, KvH, D] (a copy)
            c[:, rows, :, dst] = moved


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------
@dataclass
class ForwardOutput:
    logits: torch.Tensor | None          # [B, T or n, V]
    aux: torch.Tensor | None = None      # [B, T, n_aux*H] (HF hidden-state indices, concatenated)
    final: torch.Tensor | None = None    # [B, T, H] output of the final norm


class Layer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.a = a
        qkv_out = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
        self.input_norm = nn.Parameter(torch.ones(a.hidden_size))
        self.post_norm = nn.Parameter(torch.ones(a.hidden_size))
        self.wqkv = nn.Linear(a.hidden_size, qkv_out, bias=a.qkv_bias)
        self.wo = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=a.o_bias)
        self.w_gate_up = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=a.mlp_bias)
        self.w_down = nn.Linear(a.intermediate_size, a.hidden_size, bias=a.mlp_bias)
        if a.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(a.head_dim))
            self.k_norm = nn.Parameter(torch.ones(a.head_dim))
        # "triton" | "torch", resolved once per device by TargetModel (never while tracing)
        self.attn_backend = "torch"

    def forward(self, x, delta, cos, sin_s, k_cache, v_cache, write_pos, mask, kv_len, rows=None):
        """The layer's input is ``x + delta`` (``delta`` None: ``x``): the previous layer's MLP output is
        added here, not there, so that under torch.compile the residual add and this layer's RMSNorm
        are one kernel (vLLM's fused add-norm; one launch fewer per layer in a launch-bound decode step).
        Returns ``(x_in, x_mid, delta_out)``: the layer's input (HF's hidden state before this layer),
        the residual after attention, and the MLP's output, still to be added.

        x, delta [B, T, H]; cos / sin_s [B, T, 1, D] in x's dtype (``signed_sin``); mask: additive
        [B, 1, G*T, kv_len] (``additive_mask``); the layer's cache [max_batch, KvH, slots, D];
        ``write_pos`` [B, T] the slots where the T new K/V go; ``rows`` [B] the
        cache row of each x row (None: the first B rows).

        The K/V write is ``kernels.kv_cache_write``: on a GPU a kernel that Inductor neither fuses
        nor copies around (its own fused RoPE + ``index_put_`` cost 8x as much at T = 4 as at
        T = 1 on the H200), on a CPU an ``index_put_`` in place."""
        a = self.a
        if delta is not None:
            x = x + delta
        B, T, _ = x.shape
        nh, nkv, D = a.num_heads, a.num_kv_heads, a.head_dim
        h = rms_norm(x, self.input_norm, a.rms_norm_eps)
        qkv = self.wqkv(h).view(B, T, nh + 2 * nkv, D)
        if a.qk_norm:
            qk = torch.cat([rms_norm(qkv[:, :, :nh], self.q_norm, a.rms_norm_eps),
                            rms_norm(qkv[:, :, nh:nh + nkv], self.k_norm, a.rms_norm_eps)], 2)
        else:
            qk = qkv[:, :, :nh + nkv]
        qk = apply_rope_fast(qk, cos, sin_s)                        # q and k in one pass
        k = qk[:, :, nh:].transpose(1, 2)                           # [B, KvH, T, D]
        v = qkv[:, :, nh + nkv:].transpose(1, 2)
        kernels.kv_cache_write(k_cache, v_cache, k, v, write_pos, rows, backend=self.attn_backend)
        o = kernels.decode_attention(qk[:, :, :nh], k_cache, v_cache, mask, kv_len, rows, backend=self.attn_backend)
        x_mid = x + self.wo(o)
        h = rms_norm(x_mid, self.post_norm, a.rms_norm_eps)
        gate, up = self.w_gate_up(h).chunk(2, dim=-1)
        return x, x_mid, self.w_down(F.silu(gate) * up)


class TargetModel(nn.Module):
    def __init__(self, args: ModelArgs, max_batch: int = 1, max_seq: int = 2048,
                 inv_freq: torch.Tensor | None = None, rope_scale: float = 1.0):
        super().__init__()
        if args.hidden_act not in ("silu", "swish"):
            raise ValueError(f"runtime supports SwiGLU (silu) MLPs only, got {args.hidden_act!r}")
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Layer(args) for _ in range(args.num_layers))
        self.norm = nn.Parameter(torch.ones(args.hidden_size))
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if inv_freq is None:
            inv_freq, rope_scale = rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling)
        self.register_buffer("inv_freq", inv_freq.float().clone(), persistent=False)
        self.rope_scale = float(rope_scale)
        self.cache: KVCache | None = None
        self.compiled = self.compiled_bookkeeping = False
        self._inputs = self._inputs_impl
        self._graphs = None
        self.workspaces: dict = {}       # generate's per-shape device state and step graphs
        self._graph_pool = None
        self.setup_caches(max_batch, max_seq)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    @torch.no_grad()
    def from_hf(cls, hf_model, max_batch: int = 1, max_seq: int = 2048, dtype=None, device=None):
        """Copy the weights of a HF Llama/Mistral/Qwen2/Qwen3 causal LM into the engine."""
        cfg = hf_model.config
        args = ModelArgs.from_hf_config(cfg)
        gen = getattr(hf_model, "generation_config", None)
        if gen is not None and getattr(gen, "eos_token_id", None) is not None:
            e = gen.eos_token_id
            args.eos_token_ids = sorted(set(args.eos_token_ids) | set([e] if isinstance(e, int) else e))
        sw = getattr(cfg, "sliding_window", None)
        if sw and (args.model_type == "mistral" or getattr(cfg, "use_sliding_window", False)) and max_seq > sw:
            raise NotImplementedError(f"sliding-window attention (window {sw}) < max_seq {max_seq}")
        dtype = dtype or next(hf_model.parameters()).dtype
        device = torch.device(device) if device is not None else next(hf_model.parameters()).device
        base = hf_model.model
        inv_freq, scale = None, 1.0
        rot = getattr(base, "rotary_emb", None)
        if rot is not None and hasattr(rot, "inv_freq"):
            inv_freq, scale = rot.inv_freq.detach().float().cpu(), float(getattr(rot, "attention_scaling", 1.0))
        with torch.device("meta"):
            m = cls(args, max_batch=1, max_seq=1, inv_freq=torch.zeros(args.head_dim // 2), rope_scale=scale)
        m.to_empty(device="cpu")
        m.inv_freq.copy_(inv_freq if inv_freq is not None else rope_inv_freq(
            args.head_dim, args.rope_theta, args.rope_scaling)[0])
        m.embed.weight.copy_(base.embed_tokens.weight)
        for layer, hl in zip(m.layers, base.layers):
            at, mlp = hl.self_attn, hl.mlp
            layer.input_norm.copy_(hl.input_layernorm.weight)
            layer.post_norm.copy_(hl.post_attention_layernorm.weight)
            layer.wqkv.weight.copy_(torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight]))
            if args.qkv_bias:
                layer.wqkv.bias.copy_(torch.cat([at.q_proj.bias, at.k_proj.bias, at.v_proj.bias]))
            layer.wo.weight.copy_(at.o_proj.weight)
            if args.o_bias:
                layer.wo.bias.copy_(at.o_proj.bias)
            if args.qk_norm:
                layer.q_norm.copy_(at.q_norm.weight)
                layer.k_norm.copy_(at.k_norm.weight)
            layer.w_gate_up.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
            if args.mlp_bias:
                layer.w_gate_up.bias.copy_(torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias]))
                layer.w_down.bias.copy_(mlp.down_proj.bias)
            layer.w_down.weight.copy_(mlp.down_proj.weight)
        m.norm.copy_(base.norm.weight)
        m.lm_head.weight.copy_(hf_model.get_output_embeddings().weight)
        inv = m.inv_freq.float().clone()
        m = m.to(device=device, dtype=dtype).eval().requires_grad_(False)
        m.inv_freq = inv.to(device)
        m.setup_caches(max_batch, max_seq)
        return m

    def setup_caches(self, max_batch: int, max_seq: int) -> None:
        """(Re)allocate the KV cache and the RoPE tables; drops captured CUDA graphs."""
        a = self.args
        dev = self.embed.weight.device
        if dev.type == "meta":
            return
        self.cache = KVCache(a.num_layers, max_batch, a.num_kv_heads, max_seq, a.head_dim,
                             self.embed.weight.dtype, dev)
        cos, sin = rope_tables(self.inv_freq.float().cpu(), self.rope_scale, max_seq)
        self.cos, self.sin = cos.to(dev), sin.to(dev)
        # HF computes cos/sin in fp32 and casts them to the activation dtype: cast the tables once
        dt = self.embed.weight.dtype
        self.cos_t, self.sin_t = cos.to(dev, dt), signed_sin(sin).to(dev, dt)
        # decode attention: the Triton kernel on a GPU (one kernel instead of SDPA's re-layout copies,
        # workspace memset and attention), the PyTorch reference on a CPU (``kernels.resolve_backend``)
        backend = kernels.resolve_backend("auto", self.cos_t)
        for layer in self.layers:
            layer.attn_backend = backend
        self._graphs = None
        self.workspaces = {}
        self._graph_pool = None

    def graph_pool(self):
        """One CUDA-graph memory pool for every graph of this engine (they never run concurrently)."""
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        return self._graph_pool

    @property
    def max_seq(self) -> int:
        return self.cache.max_seq

    @property
    def max_batch(self) -> int:
        return self.cache.max_batch

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    # ---- cache bookkeeping --------------------------------------------------------------
    def reset(self) -> None:
        self.cache.lengths.zero_()

    def set_lengths(self, lengths) -> None:
        """KV rollback (or commit): row b keeps its first lengths[b] slots."""
        self.cache.set_lengths(lengths)

    def commit(self, n) -> None:
        """Advance each row's length by n (int or [B])."""
        n = torch.as_tensor(n, dtype=torch.long, device=self.cache.lengths.device)
        B = n.numel() if n.dim() else self.max_batch
        self.cache.lengths[:B] += n

    def compact(self, src_slots: torch.Tensor, dst_start: torch.Tensor) -> None:
        self.cache.compact(src_slots, dst_start)

    def compile_layers(self, inputs: bool = True, bookkeeping: bool = True, **compile_kwargs) -> "TargetModel":
        """``torch.compile`` each decoder layer (gpt-fast's lever for launch-bound decoding): Inductor
        fuses RMSNorm, RoPE, the K/V write and the SwiGLU elementwise work into a few kernels; the
        forward's inputs (mask, RoPE rows, write index, embeddings) are compiled too, and ``generate``
        compiles a step's bookkeeping on a compiled engine. The
        layers share one compiled graph per input shape (parameters are graph inputs), so 30 layers
        cost one compilation; the first call of a new shape compiles (seconds), which is why
        ``generate`` runs a new shape eagerly once before capturing it in a CUDA graph. Shapes are
        dynamic from the first call (``dynamic=True``; sizes 0 and 1 still specialise), so a growing
        attention width or another batch does not compile again inside a timed run. Outputs equal the
        eager layers' up to floating-point reassociation (tests/test_runtime_compile.py).

        ``inputs=False`` / ``bookkeeping=False`` leave the forward's inputs / a step's bookkeeping
        eager (the layers alone compiled, as before 2026-12-01 noon): on the H200 the engine with both
        compiled made drafted steps faster at batch 1 and slower at batch 8 and 48 (BENCHMARKS.md),
        and ``bench_runtime.py --engines compiled,compiled_layers`` tells the two apart."""
        compile_kwargs.setdefault("dynamic", True)
        allow_recompiles()
        for layer in self.layers:
            layer.compile(**compile_kwargs)
        if inputs:
            self._inputs = torch.compile(self._inputs_impl, **compile_kwargs)
        self.compiled = True
        self.compiled_bookkeeping = bookkeeping
        return self

    # ---- forward ------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                write_pos: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                aux_layer_ids=(), return_final: bool = False, logits_index: torch.Tensor | None = None,
                kv_len: int | None = None, compute_logits: bool = True,
                rows: torch.Tensor | None = None) -> ForwardOutput:
        """input_ids [B, T]. positions/write_pos [B, T] default to lengths[:, None] + arange(T).
        attn_mask [B, T, T] bool among the new tokens (None = causal). logits_index [B, n]
        selects which of the T positions get logits (None = all). kv_len bounds the attended
        slots (None = the whole cache); it must exceed every write slot and is rounded up to a
        multiple of 16. ``rows`` [B] (long, on the device): the cache rows the batch's rows are
        (default: the first B) - continuous batching prefills refilled slots this way while the
        other rows keep their cache. Nothing here reads a device value on the host (CUDA-graph safe).
        """
        B, T = input_ids.shape
        c = self.cache
        if B > c.max_batch:
            raise ValueError(f"batch {B} > cache max_batch {c.max_batch}")
        kv_len = c.slots if kv_len is None else min(round_up(kv_len), c.slots)
        x, mask, cos, sin_s, write_pos = self._inputs(input_ids, positions, write_pos, attn_mask, kv_len, rows)
        want = {int(i) for i in aux_layer_ids}
        L = self.args.num_layers
        captured = {}
        delta = None
        for i, layer in enumerate(self.layers):
            x_in, x, delta = layer(x, delta, cos, sin_s, c.k[i], c.v[i], write_pos, mask, kv_len, rows)
            if i in want:
                captured[i] = x_in
        final = rms_norm(x + delta, self.norm, self.args.rms_norm_eps)
        captured[L] = final
        aux = torch.cat([captured[int(i)] for i in aux_layer_ids], -1) if len(aux_layer_ids) else None
        logits = None
        if compute_logits:
            h = final
            if logits_index is not None:
                h = final.gather(1, logits_index[:, :, None].expand(-1, -1, final.shape[-1]))
            logits = self.lm_head(h)
        return ForwardOutput(logits=logits, aux=aux, final=final if return_final else None)

    def _inputs_impl(self, input_ids, positions, write_pos, attn_mask, kv_len: int, rows):
        """What every layer of a forward reads: the embeddings, the additive attention mask, the RoPE
        rows, the K/V write slots (``compile_layers`` compiles this too: ~20 small kernels eagerly)."""
        c, a = self.cache, self.args
        T = input_ids.shape[1]
        lengths = c.lengths[:input_ids.shape[0]] if rows is None else c.lengths[rows]
        ar = torch.arange(T, device=input_ids.device)
        if write_pos is None:
            write_pos = lengths[:, None] + ar
        if positions is None:
            positions = lengths[:, None] + ar
        write_pos = write_pos.clamp(max=c.max_seq - 1)
        vis = build_attn_mask(lengths, write_pos, attn_mask, kv_len)
        mask = additive_mask(vis, self.dtype, a.num_heads // a.num_kv_heads)
        positions = positions.clamp(max=c.max_seq - 1)
        cos, sin_s = self.cos_t[positions][:, :, None], self.sin_t[positions][:, :, None]   # [B, T, 1, D]
        return self.embed(input_ids), mask, cos, sin_s, write_pos

    # ---- CUDA graphs --------------------------------------------------------------------
    def graphed_step(self, input_ids, positions, write_pos, attn_mask, aux_layer_ids=(),
                     return_final=False, kv_len: int | None = None) -> ForwardOutput:
        """A decode/verify forward replayed from a CUDA graph captured per (B, T, kv_len) shape.
        Inputs are copied into static buffers; the outputs are fresh copies. (``generate``
        captures whole speculative steps instead when its drafter allows; this is the
        per-forward graph for drafters that run on the host.)"""
        if self.device.type != "cuda":
            return self.forward(input_ids, positions, write_pos, attn_mask, aux_layer_ids, return_final,
                                kv_len=kv_len)
        if self._graphs is None:
            self._graphs = CudaGraphs(self)
        kv = self.cache.slots if kv_len is None else min(round_up(kv_len), self.cache.slots)
        return self._graphs.run(input_ids, positions, write_pos, attn_mask, tuple(aux_layer_ids), return_final, kv)


class CudaGraphs:
    """One captured graph per (B, T, aux ids, final, kv_len) key; all share the engine's pool.
    The graph attends over the first kv_len slots and reads the row lengths from the cache
    tensor, so nothing in it depends on host values."""

    def __init__(self, model: TargetModel):
        self.model = model
        self.graphs: dict = {}
        self.pool = model.graph_pool()

    def run(self, input_ids, positions, write_pos, attn_mask, aux_ids, return_final, kv_len):
        B, T = input_ids.shape
        key = (B, T, aux_ids, return_final, kv_len)
        if attn_mask is None:
            attn_mask = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril()[None].expand(B, T, T)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(key, input_ids, positions, write_pos, attn_mask)
            self.graphs[key] = entry
        else:
            st = entry["in"]
            st["ids"].copy_(input_ids)
            st["pos"].copy_(positions)
            st["wp"].copy_(write_pos)
            st["mask"].copy_(attn_mask)
            entry["graph"].replay()
        out = entry["out"]
        return ForwardOutput(
            logits=out.logits.clone(),
            aux=None if out.aux is None else out.aux.clone(),
            final=None if out.final is None else out.final.clone(),
        )

    def _capture(self, key, input_ids, positions, write_pos, attn_mask):
        _, _, aux_ids, return_final, kv_len = key
        st = {"ids": input_ids.clone(), "pos": positions.clone(), "wp": write_pos.clone(),
              "mask": attn_mask.clone().contiguous()}
        m = self.model

        def step():
            return m.forward(st["ids"], st["pos"], st["wp"], st["mask"], aux_ids, return_final, kv_len=kv_len)

        # Warm-up runs write exactly what the real step writes (same inputs), so they are harmless.
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = step()
        g.replay()
        return {"graph": g, "in": st, "out": out}
