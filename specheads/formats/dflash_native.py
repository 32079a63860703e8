"""The native DFlash layout (z-lab's published drafts), the one vLLM's ``qwen3_dflash`` loads with
``--speculative-config '{"method": "dflash", ...}'``.

``config.json`` is a Qwen3 config of the draft (``model_type: "qwen3"``, ``num_hidden_layers`` = draft
layers) plus::

    "architectures": ["DFlashDraftModel"],
    "block_size": B,                      # anchor + B - 1 drafted tokens
    "num_target_layers": L,               # the target it was made for
    "dflash_config": {"mask_token_id": m, "target_layer_ids": [...]}

``target_layer_ids`` number a target layer by its **output** (0 = output of decoder layer 0), one lower
than our HF hidden-state index: ours = theirs + 1 (vLLM's ``update_dflash`` does the reverse for a
speculators config). The embedding (HF index 0) has no native number, so such a head is refused.

Tensors (vLLM ``DFlashQwen3ForCausalLM.load_weights`` prefixes ``model.`` itself): ``fc.weight``,
``hidden_norm.weight``, ``layers.{i}.*`` (Qwen3 layers with ``q_norm``/``k_norm``), ``norm.weight``;
``embed_tokens.weight`` and ``lm_head.weight`` are optional (absent: the target's, shared), and vLLM
refuses ``mask_hidden``. We write ``lm_head``/``d2t``/``t2d`` only for a draft vocabulary smaller than the
target's (``draft_vocab_size`` then in the config), as the speculators layout does.

An imported head records where it came from in its meta (``training["imported_from"]``) and the target
facts the file states (``target_config``), so :func:`target_problems` can say what differs from the
target it is used with.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..fileio import write_json_atomic
from ..heads import DFlashHead, HeadConfig
from ..heads.config import target_mismatches
from .common import (WEIGHTS_FILE, ExportError, ExportMeta, fill_meta, head_fields_from_layer_config,
                     layer_config_dict, load_tensors, prepare_out_dir, read_json, read_side, save_tensors,
                     tensor_shapes_dtypes, write_side)
from .speculators_parallel import SIDE_FIELDS, dflash_refusals, dflash_tensors, load_dflash_tensors

FORMAT = "dflash_native"
ARCHS = ("DFlashDraftModel",)


def is_native(c: dict) -> bool:
    return "speculators_model_type" not in c and any(a in ARCHS for a in c.get("architectures") or []) \
        and isinstance(c.get("dflash_config"), dict)


def _num_target_layers(head: DFlashHead, meta: ExportMeta) -> int:
    L = head.cfg.target_num_layers or (meta.target_config or {}).get("num_hidden_layers")
    if not L:
        raise ExportError("the native DFlash layout needs the target's layer count ('num_target_layers'): set "
                          "HeadConfig.target_num_layers or meta.target_config['num_hidden_layers']")
    return int(L)


def build_config(head: DFlashHead, meta: ExportMeta, dtype: torch.dtype) -> dict:
    cfg = head.cfg
    c = layer_config_dict(cfg, dtype)
    c["architectures"] = list(ARCHS)
    c["block_size"] = int(cfg.block_size)
    c["num_target_layers"] = _num_target_layers(head, meta)
    c["dflash_config"] = {"mask_token_id": int(cfg.mask_token_id),
                          "target_layer_ids": [int(i) - 1 for i in cfg.aux_layer_ids]}
    if not cfg.full_vocab:
        c["draft_vocab_size"] = cfg.draft_vocab_size
    if cfg.target_hidden_size != cfg.hidden_size:  # vLLM reads it with getattr(): never write null
        c["target_hidden_size"] = cfg.target_hidden_size
    return c


def save(head: DFlashHead, meta: ExportMeta | None, out_dir, dtype: torch.dtype = torch.bfloat16) -> Path:
    if not isinstance(head, DFlashHead):
        raise ExportError(f"dflash_native format holds DFlash heads, got {type(head).__name__}")
    bad = dflash_refusals(head)
    if 0 in head.cfg.aux_layer_ids:
        bad.append("aux_layer_ids include 0 (the embedding), which the native 'target_layer_ids' (output of "
                   "layer i) cannot name")
    if bad:
        raise ExportError("cannot write a native DFlash head: " + "; ".join(bad))
    meta = fill_meta(head, meta)
    meta.speculative_tokens = head.cfg.block_size - 1
    config = build_config(head, meta, dtype)
    out = prepare_out_dir(out_dir)
    save_tensors(dflash_tensors(head), out / WEIGHTS_FILE, dtype)
    write_json_atomic(out / "config.json", config)
    write_side(out, FORMAT, head, meta, dtype)
    return out


def config_to_head_config(c: dict, where: str) -> HeadConfig:
    if not is_native(c):
        raise ExportError(f"{where}: not a native DFlash config (architectures {c.get('architectures')}, "
                          "needs 'DFlashDraftModel' and 'dflash_config')")
    dc = c["dflash_config"]
    kw = head_fields_from_layer_config(c, where)
    ids = dc.get("target_layer_ids")
    if not ids:
        raise ExportError(f"{where}: missing field 'dflash_config.target_layer_ids'")
    if dc.get("mask_token_id") is None:
        raise ExportError(f"{where}: missing field 'dflash_config.mask_token_id'")
    if c.get("block_size") is None:
        raise ExportError(f"{where}: missing field 'block_size'")
    if any(int(i) < 0 for i in ids):
        raise ExportError(f"{where}: dflash_config.target_layer_ids {ids} has a negative layer")
    kw.update(kind="dflash", num_layers=int(c.get("num_hidden_layers", 1)),
              aux_layer_ids=[int(i) + 1 for i in ids],  # output of layer i = HF hidden-state index i + 1
              mask_token_id=int(dc["mask_token_id"]), block_size=int(c["block_size"]),
              draft_vocab_size=int(c.get("draft_vocab_size") or kw["target_vocab_size"]),
              target_hidden_size=c.get("target_hidden_size") or kw["hidden_size"],
              target_num_layers=c.get("num_target_layers"))
    try:
        return HeadConfig(**kw)
    except ValueError as e:
        raise ExportError(f"{where}: {e}") from None


def load(d, dtype: torch.dtype = torch.float32, target: dict | None = None):
    """``(head, meta)`` of a native DFlash directory. With ``target`` (a target identity: ``hidden_size``,
    ``vocab_size``, ``num_layers``), a head made for another target is an ExportError naming what differs."""
    d = Path(d)
    where = str(d / "config.json")
    c = read_json(d / "config.json")
    cfg = config_to_head_config(c, where)
    side = read_side(d)
    if side and side.get("head_config"):
        cfg = cfg.replace(**{k: v for k, v in side["head_config"].items()
                             if k in SIDE_FIELDS and not (k == "target_num_layers" and v is None)})
    head = DFlashHead(cfg)
    load_dflash_tensors(head, load_tensors(d), str(d))
    head = head.to(dtype)
    meta = ExportMeta.from_dict(side.get("meta") if side else None)
    meta.speculative_tokens = cfg.block_size - 1
    meta.aux_layer_ids = list(cfg.aux_layer_ids)
    meta.target_vocab_size = cfg.target_vocab_size
    facts = {"num_hidden_layers": c.get("num_target_layers"), "hidden_size": cfg.target_hidden_size,
             "vocab_size": cfg.target_vocab_size}
    meta.target_config = {**(meta.target_config or {}), **{k: v for k, v in facts.items() if v is not None}}
    if not side:  # a foreign checkpoint: say where it came from
        meta.training = {**meta.training, "imported_from": {
            "format": FORMAT, "path": str(d.resolve()), "architectures": list(c.get("architectures") or []),
            "dflash_config": dict(c["dflash_config"]), "num_target_layers": c.get("num_target_layers"),
            "embedding_shared": "embed_tokens.weight" not in tensor_shapes_dtypes(d),
            "lm_head_shared": cfg.full_vocab}}
    if target is not None:
        problems = target_problems(cfg, target)
        if problems:
            raise ExportError(f"{d}: DFlash head made for another target: " + "; ".join(problems))
    return head, meta


def target_problems(cfg: HeadConfig, target: dict) -> list[str]:
    """What stops a DFlash head from drafting for ``target`` (an identity): the shared checks plus the
    target's depth, which fixes what the layer ids mean."""
    errs = target_mismatches(cfg, target)
    have, want = cfg.target_num_layers, target.get("num_layers")
    if have is not None and want is not None and int(have) != int(want):
        errs.append(f"num_target_layers {have} != target's {want} layers (the layer ids "
                    f"{[i - 1 for i in cfg.aux_layer_ids]} were picked for a {have}-layer target)")
    return errs
