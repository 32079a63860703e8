"""EAGLE-1 draft head (original SafeAILab layout, loadable by vLLM `eagle`
and SGLang `EAGLE`).

    embed_tokens.weight [Vt, H]      frozen copy of the target embedding
    fc.weight [H, 2H], fc.bias [H]   over cat[embed(x_{t+1}), f_t]  (embedding first)
    layers.0.*                       decoder layer WITHOUT input_layernorm
    layers.{i>0}.*                   ordinary decoder layers
    (no final norm)

``f_t`` is the target's final hidden state (output of its final norm).  The
head predicts ``f_{t+1}`` (the residual stream after the last layer, as
vLLM's ``llama_eagle`` returns ``hidden_states + residual``) and the token
distribution ``target_lm_head(f_{t+1})``.

Decision on the lm_head: the head owns ``lm_head`` (``nn.Linear(H, Vt)``,
frozen, ``requires_grad=False``) filled by ``init_from_target``.  It is part
of ``state_dict`` for training checkpoints, but the EAGLE exporter never
writes it (vLLM and SGLang share the target's lm_head); after loading an
export, call ``init_from_target`` (or ``set_lm_head``) with the target's.
"""
from __future__ import annotations

import torch
from torch import nn

from .config import HeadConfig
from .layers import DecoderLayer, RotaryEmbedding


class Eagle1Head(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        if cfg.kind != "eagle1":
            raise ValueError(f"Eagle1Head needs kind='eagle1', got {cfg.kind!r}")
        if not cfg.full_vocab:
            raise ValueError("EAGLE-1 uses the target lm_head: draft_vocab_size must equal target_vocab_size")
        if cfg.target_hidden_size != cfg.hidden_size:
            raise ValueError("EAGLE-1 needs hidden_size == target_hidden_size")
        self.cfg = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.target_vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(2 * H, H, bias=bool(cfg.fc_bias))
        self.layers = nn.ModuleList([DecoderLayer(cfg, input_layernorm=False)] +
                                    [DecoderLayer(cfg) for _ in range(cfg.num_layers - 1)])
        self.lm_head = nn.Linear(H, cfg.target_vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    @torch.no_grad()
    def init_from_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, d2t=None,
                         copy_lm_head=None) -> None:
        self.embed_tokens.weight.copy_(embed_weight)
        self.set_lm_head(lm_head_weight)

    @torch.no_grad()
    def set_lm_head(self, lm_head_weight: torch.Tensor) -> None:
        if lm_head_weight.shape != self.lm_head.weight.shape:
            raise ValueError(f"target lm_head {tuple(lm_head_weight.shape)} != {tuple(self.lm_head.weight.shape)}")
        self.lm_head.weight.copy_(lm_head_weight)
        self.lm_head.weight.requires_grad_(False)

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def forward_step(self, input_ids, features, position_ids, attention_mask=None, kv_cache=None,
                     cache_positions=None, inputs_embeds=None):
        """input_ids [B, T] = x_{t+1}; features [B, T, H] = f_t.
        Returns ``(logits [B, T, Vt], next_feature [B, T, H])``."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if kv_cache is not None and cache_positions is None and not hasattr(kv_cache, "attend"):
            cache_positions = position_ids[0]
        cos, sin = self.rotary(position_ids)
        h = self.fc(torch.cat([inputs_embeds, features], dim=-1))
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, attention_mask, kv_cache, cache_positions, i)
        return self.lm_head(h), h

    forward = forward_step
