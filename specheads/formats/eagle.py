"""EAGLE-1 original layout (SafeAILab/EAGLE), for vLLM ``eagle`` and SGLang ``EAGLE``.

``config.json`` is a one-layer LlamaConfig plus ``"bias"`` (whether fc has a
bias; the EAGLE repo's ``ea_model`` reads it, default True).  Tensors:
``fc.weight [H, 2H]``, ``fc.bias [H]`` (when biased), ``layers.0.*`` without
``input_layernorm``, ``embed_tokens.weight``.  No lm_head: both readers
share the target's (load() leaves ``head.lm_head`` to ``init_from_target``).

Architectures: SGLang resolves ``LlamaForCausalLMEagle`` (its EAGLE drafts
use that name); vLLM's EAGLEConfig prefixes "Eagle" to the draft's
architecture (``LlamaForCausalLM`` -> ``EagleLlamaForCausalLM``).  The
default here is SGLang's; pass ``architectures=["LlamaForCausalLM"]`` for
the original/vLLM spelling.  Known reader gap: vLLM v1's ``llama_eagle.py``
builds ``fc`` WITHOUT bias and skips ``fc.bias`` silently — the validator
flags a non-zero bias for the vLLM reader.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..fileio import write_json_atomic
from ..heads import Eagle1Head, HeadConfig
from .common import (WEIGHTS_FILE, ExportError, ExportMeta, fill_meta, head_fields_from_layer_config,
                     layer_config_dict, load_into, load_tensors, prepare_out_dir, read_json, read_side, save_tensors, write_side)

FORMAT = "eagle"
ARCHS = ("LlamaForCausalLMEagle", "LlamaForCausalLM", "EagleLlamaForCausalLM")


def export_tensors(head: Eagle1Head) -> dict[str, torch.Tensor]:
    return {k: v for k, v in head.state_dict().items() if not k.startswith("lm_head.")}


def save(head: Eagle1Head, meta: ExportMeta | None, out_dir, dtype: torch.dtype = torch.bfloat16,
         architectures: list[str] | None = None) -> Path:
    if not isinstance(head, Eagle1Head):
        raise ExportError(f"eagle format holds EAGLE-1 heads, got {type(head).__name__}")
    meta = fill_meta(head, meta)
    out = prepare_out_dir(out_dir)
    c = layer_config_dict(head.cfg, dtype)
    c["architectures"] = list(architectures or ["LlamaForCausalLMEagle"])
    c["model_type"] = "llama"
    c["bias"] = bool(head.cfg.fc_bias)
    save_tensors(export_tensors(head), out / WEIGHTS_FILE, dtype)
    write_json_atomic(out / "config.json", c)
    write_side(out, FORMAT, head, meta, dtype)
    return out


def load(d, dtype: torch.dtype = torch.float32):
    d = Path(d)
    c = read_json(d / "config.json")
    where = str(d / "config.json")
    archs = c.get("architectures") or []
    if not any(a in ARCHS for a in archs):
        raise ExportError(f"{where}: architectures {archs} is not an EAGLE-1 draft ({list(ARCHS)})")
    tensors = load_tensors(d)
    kw = head_fields_from_layer_config(c, where)
    kw.update(kind="eagle1", num_layers=int(c.get("num_hidden_layers", 1)),
              fc_bias=bool(c.get("bias", "fc.bias" in tensors)))
    head = Eagle1Head(HeadConfig(**kw))
    load_into(head, tensors, str(d), optional=["lm_head.weight", "embed_tokens.weight"])
    head = head.to(dtype)
    side = read_side(d)
    meta = ExportMeta.from_dict(side.get("meta") if side else None)
    meta.target_vocab_size = kw["target_vocab_size"]
    return head, meta
