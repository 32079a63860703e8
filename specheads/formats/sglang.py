"""SGLang EAGLE-3 format (also SpecForge's checkpoint layout).

HF-style ``config.json``: ``architectures: ["LlamaForCausalLMEagle3"]``,
``model_type: "llama"``, ``num_hidden_layers: 1``, ``vocab_size`` (target),
``draft_vocab_size``, ``tie_word_embeddings: false``.  Tensors as the
speculators layout with ``midlayer.*`` in place of ``layers.0.*`` and no
embedding (SGLang shares the target's).

Layer ids: SGLang reads ONLY ``eagle_config.eagle_aux_hidden_state_layer_ids``
and adds 1 to each (``set_eagle3_layers_to_capture``: "the ith layer takes
the output of the (i-1)th layer"), i.e. it expects the output-of-layer
numbering that SpecForge uses.  vLLM reads the top-level field first (HF
numbering) and only falls back to ``eagle_config``.  So we write the HF ids
at the top level and the converted ids in ``eagle_config``; both readers
then capture the same layers.

SGLang's ``LlamaForCausalLMEagle3`` has no ``norm_before_residual`` (the
residual is always the raw hidden), no q/k norm, no input_norm/fc_norm and
names extra layers differently, so those heads are refused here.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..fileio import write_json_atomic
from ..heads import Eagle3Head, HeadConfig
from .common import (DTYPE_NAMES, WEIGHTS_FILE, ExportError, ExportMeta, fill_meta, head_fields_from_layer_config,
                     layer_config_dict, load_into, load_tensors, prepare_out_dir,
                     read_json, read_side, save_tensors, write_side)
from ..layer_ids import default_eagle3_layer_ids, hf_to_output_index, output_to_hf_index
from .speculators import export_tensors

FORMAT = "sglang"
ARCHS = ("LlamaForCausalLMEagle3",)


def sglang_unsupported(cfg: HeadConfig) -> list[str]:
    bad = []
    if cfg.norm_before_residual:
        bad.append("norm_before_residual=True (SGLang always uses the raw hidden as residual)")
    if cfg.qk_norm:
        bad.append("qk_norm=True (SGLang's LlamaForCausalLMEagle3 has no q_norm/k_norm)")
    if cfg.num_layers != 1:
        bad.append(f"num_layers={cfg.num_layers} (SGLang names extra layers 'additional_layers' with other norms)")
    if cfg.norm_before_fc or cfg.fc_norm or cfg.norm_output:
        bad.append("norm_before_fc/fc_norm/norm_output (not implemented by SGLang)")
    if cfg.attention_bias or cfg.mlp_bias:
        bad.append("attention/mlp bias (SGLang builds q/k/v without bias)")
    return bad


def to_sglang_name(name: str) -> str:
    return "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name


def from_sglang_name(name: str) -> str:
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def build_config(head: Eagle3Head, meta: ExportMeta, dtype: torch.dtype) -> dict:
    cfg = head.cfg
    c = layer_config_dict(cfg, dtype, num_hidden_layers=1)
    c["architectures"] = list(ARCHS)
    c["model_type"] = "llama"
    c["draft_vocab_size"] = cfg.draft_vocab_size
    if cfg.target_hidden_size != cfg.hidden_size:  # both readers use hasattr(): never write null
        c["target_hidden_size"] = cfg.target_hidden_size
    c["norm_before_residual"] = bool(cfg.norm_before_residual)
    c["norm_before_fc"] = bool(cfg.norm_before_fc)
    c["fc_norm"] = bool(cfg.fc_norm)
    c["norm_output"] = bool(cfg.norm_output)
    c["eagle_aux_hidden_state_layer_ids"] = list(cfg.aux_layer_ids)
    c["eagle_config"] = {
        "eagle_aux_hidden_state_layer_ids": hf_to_output_index(cfg.aux_layer_ids),
        "use_aux_hidden_state": True,
    }
    c["num_speculative_tokens"] = int(meta.speculative_tokens)
    return c


def save(head: Eagle3Head, meta: ExportMeta | None, out_dir, dtype: torch.dtype = torch.bfloat16) -> Path:
    if not isinstance(head, Eagle3Head) or head.cfg.kind != "eagle3":
        raise ExportError(f"sglang format holds EAGLE-3 heads, got {type(head).__name__} ({head.cfg.kind}): SGLang "
                          f"has no reader for parallel drafting; export it as speculators for vLLM")
    bad = sglang_unsupported(head.cfg)
    if bad:
        raise ExportError("head cannot be expressed in SGLang's LlamaForCausalLMEagle3: " + "; ".join(bad))
    meta = fill_meta(head, meta)
    out = prepare_out_dir(out_dir)
    tensors = {to_sglang_name(k): v for k, v in export_tensors(head, include_embedding=False).items()}
    save_tensors(tensors, out / WEIGHTS_FILE, dtype)
    write_json_atomic(out / "config.json", build_config(head, meta, dtype))
    write_side(out, FORMAT, head, meta, dtype)
    return out


def config_to_head_config(c: dict, where: str, aux_layer_ids=None, target_num_layers=None) -> HeadConfig:
    archs = c.get("architectures") or []
    if not any(a in ARCHS for a in archs):
        raise ExportError(f"{where}: architectures {archs} is not {list(ARCHS)}")
    kw = head_fields_from_layer_config(c, where)
    aux = c.get("eagle_aux_hidden_state_layer_ids")
    if not aux and isinstance(c.get("eagle_config"), dict) and c["eagle_config"].get("eagle_aux_hidden_state_layer_ids"):
        aux = output_to_hf_index(c["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    if not aux:
        aux = aux_layer_ids
    if not aux and target_num_layers:
        L = int(target_num_layers)
        aux = default_eagle3_layer_ids(L)  # SGLang's default when the config names none
    if not aux:
        raise ExportError(f"{where}: missing field 'eagle_aux_hidden_state_layer_ids' (top level or in "
                          "eagle_config); pass aux_layer_ids= or target_num_layers=")
    kw.update(kind="eagle3", num_layers=1, aux_layer_ids=list(aux),
              draft_vocab_size=int(c.get("draft_vocab_size") or kw["target_vocab_size"]),
              target_hidden_size=c.get("target_hidden_size") or kw["hidden_size"],
              norm_before_residual=False, qk_norm=False)
    return HeadConfig(**kw)


def load(d, dtype: torch.dtype = torch.float32, aux_layer_ids=None, target_num_layers=None):
    """Read an SGLang/SpecForge EAGLE-3 directory.  SpecForge checkpoints may
    carry ``embed_tokens.weight`` and may lack layer ids (give them)."""
    d = Path(d)
    c = read_json(d / "config.json")
    cfg = config_to_head_config(c, str(d / "config.json"), aux_layer_ids, target_num_layers)
    side = read_side(d)
    head = Eagle3Head(cfg)
    tensors = {from_sglang_name(k): v for k, v in load_tensors(d).items()}
    optional = ["embed_tokens.weight"] + (["d2t", "t2d"] if cfg.full_vocab else [])
    if not cfg.full_vocab and "t2d" not in tensors and "d2t" in tensors:
        optional.append("t2d")
    load_into(head, tensors, str(d), optional=optional)
    if "t2d" not in tensors and "d2t" in tensors:
        head.set_vocab_mapping(tensors["d2t"])
    head = head.to(dtype)
    meta = ExportMeta.from_dict(side.get("meta") if side else None)
    meta.aux_layer_ids = list(cfg.aux_layer_ids)
    meta.target_vocab_size = cfg.target_vocab_size
    if c.get("num_speculative_tokens"):
        meta.speculative_tokens = int(c["num_speculative_tokens"])
    return head, meta
