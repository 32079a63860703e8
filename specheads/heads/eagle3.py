"""EAGLE-3 draft head with the speculators parameter layout.

State dict (H = hidden, Ht = target hidden, n = number of aux layers,
Vt/Vd = target/draft vocab)::

    embed_tokens.weight            [Vt, H]   frozen copy of the target embedding
    fc.weight                      [H, n*Ht] no bias
    input_norm.weight              [n*Ht]    only with norm_before_fc
    fc_norm.{i}.weight             [Ht]      only with fc_norm
    layers.0.input_layernorm.weight, layers.0.hidden_norm.weight
    layers.0.self_attn.{q,k,v}_proj.weight   [*, 2H]
    layers.0.self_attn.o_proj.weight
    layers.0.self_attn.{q,k}_norm.weight     only with qk_norm (Qwen3)
    layers.0.post_attention_layernorm.weight
    layers.0.mlp.{gate,up,down}_proj.weight
    layers.{i>0}.*                 ordinary H-wide decoder layers
    norm.weight, lm_head.weight    [Vd, H]
    d2t  int64 [Vd]   (buffer: target_id = draft_id + d2t[draft_id])
    t2d  bool  [Vt]   (buffer)

One draft step (vLLM ``Eagle3LlamaForCausalLM``): the hidden fed in is
``fc(aux)`` at the first step and the previous step's pre-norm output after
that; ``forward_step`` returns ``(lm_head(norm(h)), h)`` where ``h`` is the
pre-norm state (or the normed one when ``norm_output``).
"""
from __future__ import annotations

import torch
from torch import nn

from .config import HeadConfig
from .layers import DecoderLayer, Eagle3FirstLayer, RMSNorm, RotaryEmbedding
from .vocab import DraftVocabMixin


class Eagle3Head(DraftVocabMixin, nn.Module):
    kind = "eagle3"

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        if cfg.kind != self.kind:
            raise ValueError(f"{type(self).__name__} needs kind={self.kind!r}, got {cfg.kind!r}")
        if cfg.fc_bias:
            raise ValueError("EAGLE-3 fc has no bias in every reader (vLLM, SGLang, speculators)")
        self.cfg = cfg
        H, Ht, n = cfg.hidden_size, cfg.target_hidden_size, cfg.num_aux
        self.embed_tokens = nn.Embedding(cfg.target_vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.input_norm = RMSNorm(n * Ht, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = nn.ModuleList([RMSNorm(Ht, cfg.rms_norm_eps) for _ in range(n)]) if cfg.fc_norm else None
        self.fc = nn.Linear(n * Ht, H, bias=False)
        self.layers = nn.ModuleList([Eagle3FirstLayer(cfg)] + [DecoderLayer(cfg) for _ in range(cfg.num_layers - 1)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_vocab_buffers()

    @torch.no_grad()
    def init_from_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None = None,
                         d2t: torch.Tensor | None = None, copy_lm_head: bool | None = None) -> None:
        """Copy the target embedding (frozen), set d2t/t2d, and (when
        ``copy_lm_head``, default ``cfg.init_lm_head_from_target``) start
        ``lm_head`` from the target lm_head rows of the draft vocabulary."""
        if embed_weight.shape != self.embed_tokens.weight.shape:
            raise ValueError(f"target embedding {tuple(embed_weight.shape)} != "
                             f"embed_tokens {tuple(self.embed_tokens.weight.shape)}")
        self.embed_tokens.weight.copy_(embed_weight)
        self.embed_tokens.weight.requires_grad_(False)
        self.set_vocab_mapping(d2t)
        copy = self.cfg.init_lm_head_from_target if copy_lm_head is None else copy_lm_head
        if copy and lm_head_weight is not None:
            ids = self.draft_to_target(torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device))
            rows = lm_head_weight[ids.to(lm_head_weight.device)]
            if rows.shape != self.lm_head.weight.shape:
                raise ValueError(f"target lm_head rows {tuple(rows.shape)} != lm_head {tuple(self.lm_head.weight.shape)}")
            self.lm_head.weight.copy_(rows)

    # ---------------------------------------------------------------- inference
    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """[..., n_aux*Ht] -> [..., H] (optional input_norm / fc_norm first)."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def decode(self, embeds, hidden, position_ids, attention_mask=None, kv_cache=None, cache_positions=None):
        """Run the layers; returns the pre-norm hidden state [B, T, H]."""
        cos, sin = self.rotary(position_ids)
        h = self.layers[0](embeds, hidden, cos, sin, attention_mask, kv_cache, cache_positions)
        for i, layer in enumerate(self.layers[1:], start=1):
            h = layer(h, cos, sin, attention_mask, kv_cache, cache_positions, i)
        return h

    def forward_step(self, input_ids, hidden, position_ids, attention_mask=None, kv_cache=None,
                     cache_positions=None, inputs_embeds=None):
        """One draft forward.  input_ids [B, T] (target ids of x_{t+1}),
        hidden [B, T, H] (fc(aux) or the previous step's returned hidden),
        position_ids [B, T].  With ``kv_cache``, ``cache_positions`` are the
        slots written (default: ``position_ids[0]``).

        Returns ``(draft_logits [B, T, Vd], hidden_out [B, T, H])``."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if kv_cache is not None and cache_positions is None and not hasattr(kv_cache, "attend"):
            cache_positions = position_ids[0]
        h = self.decode(inputs_embeds, hidden, position_ids, attention_mask, kv_cache, cache_positions)
        normed = self.norm(h)
        logits = self.lm_head(normed)
        return logits, (normed if self.cfg.norm_output else h)

    forward = forward_step
