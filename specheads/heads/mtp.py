"""DeepSeek-V3 style multi-token-prediction head.

Depth d (0-based; DeepSeek's k = d+1) at position i::

    h' = eh_proj(cat[enorm(embed(t_{i+1+d})), hnorm(h_i^{d})])   (embedding FIRST)
    h  = decoder_block(h')                 (input_layernorm, self_attn, post_attention_layernorm, mlp)
    logits = lm_head(shared_head.norm(h))  predicts t_{i+2+d}

``h_i^0`` is the target's final hidden state (after its final norm, as vLLM
passes it).  Parameters inside the head::

    layers.{d}.enorm.weight, layers.{d}.hnorm.weight, layers.{d}.eh_proj.weight [H, 2H]
    layers.{d}.input_layernorm.weight, layers.{d}.self_attn.{q,k,v,o}_proj.weight
    layers.{d}.post_attention_layernorm.weight, layers.{d}.mlp.{gate,up,down}_proj.weight
    layers.{d}.shared_head.norm.weight
    embed_tokens.weight, lm_head.weight   frozen copies of the target's (shared by all depths)

The exporter maps ``layers.{d}.*`` to ``model.layers.{L+d}.*`` (L = target
layers) and writes the shared head as ``shared_head.head`` per depth.
"""
from __future__ import annotations

import torch
from torch import nn

from .config import HeadConfig
from .layers import MLP, Attention, RMSNorm, RotaryEmbedding, causal_mask


class SharedHead(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(H, eps)
        self.hnorm = RMSNorm(H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = MLP(cfg)
        self.shared_head = SharedHead(cfg)

    def forward(self, embeds, hidden, cos, sin, attention_mask=None, kv_cache=None, cache_positions=None,
                layer_idx: int = 0):
        h = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, attention_mask, kv_cache, cache_positions,
                               layer_idx)
        return h + self.mlp(self.post_attention_layernorm(h))


class MTPHead(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        if cfg.kind != "mtp":
            raise ValueError(f"MTPHead needs kind='mtp', got {cfg.kind!r}")
        if not cfg.full_vocab or cfg.target_hidden_size != cfg.hidden_size:
            raise ValueError("MTP shares the target embedding and lm_head: full vocab and H == H_t required")
        self.cfg = cfg
        H, V = cfg.hidden_size, cfg.target_vocab_size
        self.embed_tokens = nn.Embedding(V, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList([MTPLayer(cfg) for _ in range(cfg.num_mtp_depths)])
        self.lm_head = nn.Linear(H, V, bias=False)
        self.lm_head.weight.requires_grad_(False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    @torch.no_grad()
    def init_from_target(self, embed_weight, lm_head_weight, d2t=None, copy_lm_head=None) -> None:
        self.embed_tokens.weight.copy_(embed_weight)
        self.lm_head.weight.copy_(lm_head_weight)
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)

    def draft_to_target(self, ids):
        return ids

    def forward_step(self, input_ids, hidden, position_ids, attention_mask=None, kv_cache=None,
                     cache_positions=None, depth: int = 0, inputs_embeds=None):
        """One depth: input_ids [B, T] = t_{i+1+depth}; hidden = h^{depth}.
        Returns ``(logits [B, T, V], h^{depth+1} [B, T, H])`` (h is pre-norm).
        A KV cache is indexed by depth (layer_idx = depth)."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if kv_cache is not None and cache_positions is None and not hasattr(kv_cache, "attend"):
            cache_positions = position_ids[0]
        cos, sin = self.rotary(position_ids)
        layer = self.layers[depth]
        h = layer(inputs_embeds, hidden, cos, sin, attention_mask, kv_cache, cache_positions, depth)
        return self.lm_head(layer.shared_head.norm(h)), h

    def forward_train(self, input_ids, hidden, attention_mask=None, position_ids=None, pad_token_id: int = 0):
        """Teacher-forced pass over all depths (causal attention within each
        depth).  input_ids [B, T] (x_0..x_{T-1}), hidden [B, T, H] = target
        final hidden.  Returns lists (one per depth) of logits [B, T, V]
        (depth d at i predicts x_{i+2+d}) and hidden states."""
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device)[None].expand(B, T)
        mask = causal_mask(T, input_ids.device)[None, None]
        if attention_mask is not None:
            mask = mask & attention_mask.bool()[:, None, None, :]
        logits, hiddens = [], []
        for d in range(self.cfg.num_mtp_depths):
            ids = shift_left(input_ids, 1 + d, pad_token_id)
            lg, hidden = self.forward_step(ids, hidden, position_ids, mask, depth=d)
            logits.append(lg)
            hiddens.append(hidden)
        return logits, hiddens

    forward = forward_train


def shift_left(ids: torch.Tensor, n: int, pad: int = 0) -> torch.Tensor:
    """ids[:, n:] padded at the end with ``pad`` back to length T."""
    B, T = ids.shape
    n = min(n, T)
    return torch.cat([ids[:, n:], ids.new_full((B, n), pad)], dim=1)
