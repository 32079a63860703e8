"""speculators (vLLM) EAGLE-3 format: ``config.json`` + ``model.safetensors``.

The config has no top-level ``model_type``; vLLM recognises it through
``speculators_model_type`` and translates it (``update_eagle3``): it reads
``transformer_layer_config`` as the draft's HF config, ``draft_vocab_size``,
``target_hidden_size`` (when not null), ``norm_before_residual`` (default
TRUE when absent), ``norm_before_fc``/``fc_norm``/``norm_output`` (default
False), ``eagle_aux_hidden_state_layer_ids`` and the first proposal's
``speculative_tokens``.  All four norm flags are written explicitly.

Tensor names are the head's state-dict names (``layers.0.*``, ``fc.weight``,
``norm.weight``, ``lm_head.weight``, ``embed_tokens.weight``, ``d2t``,
``t2d``); ``d2t``/``t2d`` are omitted for a full draft vocabulary.

P-EAGLE (``peagle``) and DFlash (``dflash``) heads are dispatched to
``speculators_parallel.py`` (by ``HeadConfig.kind`` on save, by
``speculators_model_type`` on load); EAGLE-3 output is unchanged.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..fileio import write_json_atomic
from ..heads import Eagle3Head, HeadConfig, PEagleHead
from . import speculators_parallel as parallel
from .common import (DTYPE_NAMES, WEIGHTS_FILE, ExportError, ExportMeta, fill_meta, head_fields_from_layer_config,
                     layer_config_dict, load_into, load_tensors, prepare_out_dir, read_json, read_side, save_tensors, write_side)

FORMAT = "speculators"
SPECULATORS_VERSION = "0.9.0"
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def export_tensors(head: Eagle3Head, include_embedding: bool = True) -> dict[str, torch.Tensor]:
    sd = dict(head.state_dict())
    if head.cfg.full_vocab and not bool(head.d2t.any()):
        sd.pop("d2t"), sd.pop("t2d")
    if not include_embedding or not bool(sd["embed_tokens.weight"].any()):
        sd.pop("embed_tokens.weight")  # never write an unset (all-zero) embedding: vLLM then shares the target's
    return sd


def build_config(head: Eagle3Head, meta: ExportMeta, dtype: torch.dtype) -> dict:
    cfg = head.cfg
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": bool(cfg.norm_before_residual),
        "norm_before_fc": bool(cfg.norm_before_fc),
        "fc_norm": bool(cfg.fc_norm),
        "norm_output": bool(cfg.norm_output),
        "embed_requires_grad": False,
        "target_hidden_size": None if cfg.target_hidden_size == cfg.hidden_size else cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "transformer_layer_config": layer_config_dict(cfg, dtype),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{
                "proposal_type": "greedy",
                "speculative_tokens": int(meta.speculative_tokens),
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }],
            "verifier": {
                "name_or_path": meta.verifier_name_or_path,
                "architectures": list(meta.verifier_architectures),
            },
        },
        "torch_dtype": DTYPE_NAMES[dtype],
        "dtype": DTYPE_NAMES[dtype],
    }


def save(head: Eagle3Head, meta: ExportMeta | None, out_dir, dtype: torch.dtype = torch.bfloat16,
         include_embedding: bool = True) -> Path:
    kind = getattr(getattr(head, "cfg", None), "kind", None)
    if kind == "dflash":
        return parallel.save_dflash(head, meta, out_dir, dtype)
    if kind == "peagle":
        bad = parallel.peagle_refusals(head)
        if bad:
            raise ExportError("cannot write a speculators peagle head: " + "; ".join(bad))
    if not isinstance(head, Eagle3Head):
        raise ExportError(f"speculators format holds EAGLE-3 heads, got {type(head).__name__}")
    if not head.cfg.full_vocab and not bool(head.t2d.any()):
        raise ExportError("d2t/t2d are unset: draft vocab < target vocab needs the vocabulary mapping")
    meta = fill_meta(head, meta)
    out = prepare_out_dir(out_dir)
    config = build_config(head, meta, dtype)
    if kind == "peagle":  # the EAGLE-3 layout plus mask_hidden (already in the state dict) and K
        meta.speculative_tokens = head.cfg.num_depths
        config = parallel.peagle_config(config, head, meta)
    save_tensors(export_tensors(head, include_embedding), out / WEIGHTS_FILE, dtype)
    write_json_atomic(out / "config.json", config)
    write_side(out, FORMAT, head, meta, dtype)
    return out


def config_to_head_config(c: dict, where: str) -> HeadConfig:
    """The HeadConfig of an eagle3, peagle or dflash speculators config."""
    if c.get("speculators_model_type") == "dflash":
        return parallel.dflash_head_config(c, where)
    if c.get("speculators_model_type") not in ("eagle3", "peagle"):
        raise ExportError(f"{where}: speculators_model_type is {c.get('speculators_model_type')!r}, expected one "
                          "of 'eagle3', 'peagle', 'dflash'")
    tl = c.get("transformer_layer_config")
    if not isinstance(tl, dict):
        raise ExportError(f"{where}: missing field 'transformer_layer_config'")
    kw = head_fields_from_layer_config(tl, f"{where}: transformer_layer_config")
    aux = c.get("eagle_aux_hidden_state_layer_ids")
    if not aux:
        raise ExportError(f"{where}: missing field 'eagle_aux_hidden_state_layer_ids'")
    kw.update(kind="eagle3", num_layers=int(tl.get("num_hidden_layers", 1)), aux_layer_ids=list(aux),
              draft_vocab_size=int(c.get("draft_vocab_size") or kw["target_vocab_size"]),
              target_hidden_size=c.get("target_hidden_size") or kw["hidden_size"],
              # vLLM's default for a missing norm_before_residual is True
              norm_before_residual=bool(c.get("norm_before_residual", True)),
              norm_before_fc=bool(c.get("norm_before_fc", False)), fc_norm=bool(c.get("fc_norm", False)),
              norm_output=bool(c.get("norm_output", False)))
    if c["speculators_model_type"] != "peagle":
        return HeadConfig(**kw)
    kw.update(parallel.peagle_fields(c, where))
    try:
        return HeadConfig(**kw)
    except ValueError as e:
        raise ExportError(f"{where}: {e}") from None


def load(d, dtype: torch.dtype = torch.float32):
    d = Path(d)
    c = read_json(d / "config.json")
    if c.get("speculators_model_type") == "dflash":
        return parallel.load_dflash(d, c, dtype)
    cfg = config_to_head_config(c, str(d / "config.json"))
    side = read_side(d)
    if side and side.get("head_config"):
        extra = {k: v for k, v in side["head_config"].items()
                 if k in ("init_lm_head_from_target", "target_model_type", "target_num_layers",
                          "target_architectures", "tie_embeddings")}
        cfg = cfg.replace(**extra)
    head = PEagleHead(cfg) if cfg.kind == "peagle" else Eagle3Head(cfg)
    tensors = load_tensors(d)
    if cfg.kind == "peagle":
        parallel.check_peagle_tensors(tensors, str(d))
    optional = ["embed_tokens.weight"] + (["d2t", "t2d"] if cfg.full_vocab else [])
    load_into(head, tensors, str(d), optional=optional)
    head = head.to(dtype)
    spec = c.get("speculators_config") or {}
    meta = ExportMeta.from_dict(side.get("meta") if side else None)
    ver = spec.get("verifier") or {}
    meta.verifier_name_or_path = ver.get("name_or_path", meta.verifier_name_or_path)
    meta.verifier_architectures = list(ver.get("architectures") or meta.verifier_architectures)
    pm = spec.get("proposal_methods") or [{}]
    if pm[0].get("speculative_tokens") is not None:
        meta.speculative_tokens = int(pm[0]["speculative_tokens"])
    meta.aux_layer_ids = list(cfg.aux_layer_ids)
    meta.target_vocab_size = cfg.target_vocab_size
    if "embed_tokens.weight" not in tensors:
        meta.training = {**meta.training, "embedding_missing": True}
    return head, meta
