"""DFlash draft head: a few decoder layers that draft a whole block in one forward, reading the
target's context through their keys and values.

The target states of several layers (``aux_layer_ids``, HF index) at each verified position are
fused, ``ctx = hidden_norm(fc(aux))``, and every layer projects ``ctx`` with its own ``k_proj`` /
``v_proj`` (then ``k_norm`` and rotary at the context position): the context enters as K/V only,
never as a query. A block is B slots at positions a .. a+B-1: the anchor token x_a (the token the
target verified last, not yet in its cache) then B - 1 mask tokens. The block attends to the
context before a and to itself, in both directions. Slot j >= 1 predicts x_{a+j}; slot 0 predicts
nothing. Layers are Qwen3-style (``q_norm``, ``k_norm``) whatever the target, as every DFlash reader
builds them. The embedding and ``lm_head`` are the target's, frozen (``lm_head`` restricted to the
draft vocabulary through d2t/t2d).

State dict (the speculators ``dflash`` layout)::

    embed_tokens.weight  [Vt, H]    frozen copy of the target embedding (not exported)
    fc.weight            [H, n*Ht]  hidden_norm.weight [H]
    layers.{i}.input_layernorm.weight, layers.{i}.self_attn.{q,k,v,o}_proj.weight,
    layers.{i}.self_attn.{q,k}_norm.weight, layers.{i}.post_attention_layernorm.weight,
    layers.{i}.mlp.{gate,up,down}_proj.weight
    norm.weight, lm_head.weight [Vd, H] (frozen target rows), d2t [Vd], t2d [Vt]
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from .config import HeadConfig
from .layers import DecoderLayer, RMSNorm, RotaryEmbedding, allow_recompiles, apply_rope, repeat_kv
from .vocab import DraftVocabMixin


class DFlashHead(DraftVocabMixin, nn.Module):
    kind = "dflash"

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        if cfg.kind != "dflash":
            raise ValueError(f"DFlashHead needs kind='dflash', got {cfg.kind!r}")
        self.cfg = cfg
        H, Ht, n = cfg.hidden_size, cfg.target_hidden_size, cfg.num_aux
        self.embed_tokens = nn.Embedding(cfg.target_vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(n * Ht, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_vocab_buffers()

    @torch.no_grad()
    def init_from_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                         d2t: torch.Tensor | None = None, copy_lm_head: bool | None = None) -> None:
        """The target's embedding and its lm_head rows at the draft vocabulary, both frozen."""
        if embed_weight.shape != self.embed_tokens.weight.shape:
            raise ValueError(f"target embedding {tuple(embed_weight.shape)} != "
                             f"embed_tokens {tuple(self.embed_tokens.weight.shape)}")
        self.embed_tokens.weight.copy_(embed_weight)
        self.set_vocab_mapping(d2t)
        ids = self.draft_to_target(torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device))
        self.lm_head.weight.copy_(lm_head_weight[ids.to(lm_head_weight.device)])

    # ---------------------------------------------------------------- the context
    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """[..., n_aux*Ht] -> the fused context states [..., H]."""
        return self.hidden_norm(self.fc(aux))

    def context_kv(self, ctx: torch.Tensor, position_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's K/V of the context: ``ctx [B, T, H]`` at ``position_ids [B, T]`` -> per layer
        ``(k, v)``, each ``[B, kv_heads, T, head_dim]`` (k normed and rotated)."""
        cos, sin = self.rotary(position_ids)
        out = []
        for layer in self.layers:
            attn = layer.self_attn
            B, T, _ = ctx.shape
            k = attn.k_proj(ctx).view(B, T, attn.num_kv_heads, attn.head_dim)
            v = attn.v_proj(ctx).view(B, T, attn.num_kv_heads, attn.head_dim)
            k = attn.k_norm(k) if attn.k_norm is not None else k
            out.append((apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)))
        return out

    # ---------------------------------------------------------------- drafting (runtime)
    def forward_block(self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv_cache,
                      attention_mask: torch.Tensor | None = None, cache_positions: torch.Tensor | None = None) -> torch.Tensor:
        """One block forward against a KV cache that already holds the context's K/V (written from
        :meth:`context_kv`): ``input_ids [B, S]`` (anchor then mask tokens), ``position_ids [B, S]``.
        A cache with ``attend`` (the runtime's) writes the block's own K/V and applies the visibility
        the caller set; a :class:`StaticKVCache` takes ``cache_positions`` and a bool
        ``attention_mask [B, 1, S, max_len]``. Returns draft logits ``[B, S, Vd]``."""
        cos, sin = self.rotary(position_ids)
        h = self.embed_tokens(input_ids).to(self.fc.weight.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, attention_mask, kv_cache, cache_positions, i)
        return self.lm_head(self.norm(h))

    forward = forward_block

    # ---------------------------------------------------------------- training
    def block_forward_train(self, input_ids: torch.Tensor, aux: torch.Tensor, anchors: torch.Tensor,
                            attention_mask: torch.Tensor | None = None, attention: str = "dense") -> torch.Tensor:
        """Every block of every row in one forward: ``anchors [B, A]`` (positions; the blocks of a row
        never see each other). Block j's slot s sits at position ``anchors[:, j] + s`` and sees the
        context before its anchor and its own block. ``attention``: "dense" (:func:`_context_block_attention`,
        the scores against the whole row, any device) or "flex" (:func:`_flex_context_block_attention`, torch's
        flex attention with a block mask: no score matrix, and key blocks no query sees are skipped; its backward
        needs CUDA). Returns logits ``[B, A, block_size, Vd]``."""
        if attention not in ("dense", "flex"):
            raise ValueError(f"DFlash block attention must be 'dense' or 'flex', got {attention!r}")
        B, T = input_ids.shape
        A, S = anchors.shape[1], self.cfg.block_size
        pos = torch.arange(T, device=input_ids.device)[None].expand(B, T)
        ctx_kv = self.context_kv(self.context(aux.to(self.fc.weight.dtype)), pos)
        ids = torch.full((B, A, S), int(self.cfg.mask_token_id), dtype=input_ids.dtype, device=input_ids.device)
        ids[:, :, 0] = input_ids.gather(1, anchors.clamp(0, T - 1))
        bpos = (anchors[:, :, None] + torch.arange(S, device=anchors.device)).reshape(B, A * S)
        if attention == "flex":
            mask = context_block_mask(anchors, attention_mask, T, S)        # a BlockMask over [context | blocks]
        else:
            mask = _context_visibility(anchors, attention_mask, T, S)       # bool [B, 1, A*S, T] over the context
        cos, sin = self.rotary(bpos)
        h = self.embed_tokens(ids.reshape(B, A * S)).to(self.fc.weight.dtype)
        for layer, (kc, vc) in zip(self.layers, ctx_kv):
            x = layer.input_layernorm(h)
            q, kb, vb = layer.self_attn.project_qkv(x, cos, sin)
            if attention == "flex":
                o = _flex_context_block_attention(q, kc, vc, kb, vb, mask, layer.self_attn.scale)
            else:
                o = _context_block_attention(q, kc, vc, kb, vb, mask, S, layer.self_attn.scale)
            h = h + layer.self_attn.o_proj(o.transpose(1, 2).reshape(B, A * S, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.norm(h)).view(B, A, S, -1)


def _context_visibility(anchors: torch.Tensor, attention_mask: torch.Tensor | None, T: int, S: int) -> torch.Tensor:
    """Which context keys each block query sees: those before its anchor and inside ``attention_mask``,
    bool ``[B, 1, A*S, T]``."""
    B, A = anchors.shape
    visible = torch.arange(T, device=anchors.device)[None, None, :] < anchors[:, :, None]          # [B, A, T]
    if attention_mask is not None:
        visible = visible & attention_mask.bool()[:, None, :]
    return visible[:, :, None, :].expand(B, A, S, T).reshape(B, 1, A * S, T)


def _context_block_attention(q, kc, vc, kb, vb, visible, S: int, scale: float) -> torch.Tensor:
    """Attention of block queries over [context | own block], without the dense [A*S, T + A*S] grid:
    scores against the context (masked by ``visible``) and against the S keys of the query's own
    block, one softmax over both. q [B, h, A*S, D]; kc/vc [B, kvh, T, D]; kb/vb [B, kvh, A*S, D]."""
    B, Hq, N, D = q.shape
    rep = Hq // kc.shape[1]
    kc, vc, kb, vb = (repeat_kv(x, rep) for x in (kc, vc, kb, vb))
    A = N // S
    s_ctx = (q @ kc.transpose(-1, -2)) * scale
    s_ctx = s_ctx.masked_fill(~visible, torch.finfo(s_ctx.dtype).min)
    qb = q.view(B, Hq, A, S, D)
    s_blk = (qb @ kb.view(B, Hq, A, S, D).transpose(-1, -2)) * scale                   # [B, h, A, S, S]
    s_blk = s_blk.reshape(B, Hq, N, S)
    p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1).float(), dim=-1).to(q.dtype)
    p_ctx, p_blk = p[..., :kc.shape[2]], p[..., kc.shape[2]:]
    out = p_ctx @ vc
    out = out + (p_blk.view(B, Hq, A, S, S) @ vb.view(B, Hq, A, S, D)).reshape(B, Hq, N, D)
    return out


def context_block_mask(anchors: torch.Tensor, attention_mask: torch.Tensor | None, T: int, S: int) -> BlockMask:
    """The visibility of :func:`_context_block_attention` as a flex ``BlockMask`` over keys [context (T) | the
    blocks (A*S)]: query i belongs to block i // S of its row, which sees the context before its anchor (and inside
    ``attention_mask``) and the S keys of its own block."""
    B, A = anchors.shape
    keep = attention_mask.bool() if attention_mask is not None else None

    def mask_mod(b, h, q_idx, kv_idx):
        # defensive: the clamps keep every index in range should a tile's padded index reach mask_mod
        block = torch.clamp(q_idx // S, max=A - 1)
        ctx = (kv_idx < T) & (kv_idx < anchors[b, block])
        if keep is not None:
            ctx = ctx & keep[b, torch.clamp(kv_idx, max=T - 1)]
        return ctx | ((kv_idx >= T) & ((kv_idx - T) // S == block))

    # on CUDA a compiled builder makes the mask tile by tile; eager builds the dense [Q, KV] grid first
    build = _compiled("create_block_mask", create_block_mask) if anchors.is_cuda else create_block_mask
    return build(mask_mod, B, None, A * S, T + A * S, device=anchors.device)


_COMPILED: dict = {}


def _compiled(name: str, fn):
    """``fn`` compiled once, with dynamic shapes: rows, row length and anchors change every micro-batch. Past
    dynamo's recompile limit a frame runs uncompiled, and uncompiled flex attention materializes the very score
    matrix it exists to avoid: hence :func:`allow_recompiles`."""
    if name not in _COMPILED:
        allow_recompiles()
        _COMPILED[name] = torch.compile(fn, dynamic=True)
    return _COMPILED[name]


def _flex_context_block_attention(q, kc, vc, kb, vb, block_mask: BlockMask, scale: float) -> torch.Tensor:
    """:func:`_context_block_attention`'s contract through flex attention: the keys are [context | every block]
    and ``block_mask`` (:func:`context_block_mask`) says which each query sees. Compiled on CUDA (one kernel, no
    score matrix); elsewhere torch runs it unfused, forward only."""
    k, v = torch.cat([kc, kb], 2), torch.cat([vc, vb], 2)
    fn = _compiled("flex_attention", flex_attention) if q.is_cuda else flex_attention
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


__all__ = ["DFlashHead", "context_block_mask"]
