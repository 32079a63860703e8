"""speculators (vLLM) layouts of the parallel drafters: P-EAGLE (``peagle``) and DFlash (``dflash``).

``speculators.py`` dispatches here on ``HeadConfig.kind`` (save) and on ``speculators_model_type`` (load).

**P-EAGLE** is the EAGLE-3 layout (same tensors, same ``transformer_layer_config`` with
``num_hidden_layers`` = the head's layers) plus ``mask_hidden [1, 1, n_aux*Ht]``, ``mask_token_id`` and
``proposal_methods[0].speculative_tokens`` = K (``num_depths``). vLLM 0.32 (``update_peagle``) turns it
into ``method: eagle3, parallel_drafting: true`` and reads ``mask_token_id`` (as ``pard_token``),
``norm_before_residual`` (default **False** here, unlike EAGLE-3) and ``norm_before_fc``; it does *not*
pass on ``fc_norm`` / ``norm_output``, so a head using them would run differently there and is refused.
vLLM raises when ``mask_hidden`` is missing under parallel drafting; we refuse it earlier.

**DFlash** (speculators 0.9.0 ``DFlashSpeculatorConfig``): ``block_size``, ``aux_hidden_state_layer_ids``
(HF index, as ours; vLLM converts them to ``dflash_config.target_layer_ids = [i - 1 ...]``),
``mask_token_id``, ``draft_vocab_size``, ``target_hidden_size``, ``sample_from_anchor: false`` (the anchor
is the verified token: ``block_size - 1`` drafts) and a Qwen3 ``transformer_layer_config`` whose
``num_hidden_layers`` is the draft's depth. Tensors are the head's without ``embed_tokens`` (both readers
take the target's); ``lm_head`` is written only for a draft vocabulary smaller than the target's (then
with ``d2t``/``t2d``), exactly what speculators saves: for a full vocabulary it is the target's lm_head.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..fileio import write_json_atomic
from ..heads import DFlashHead, HeadConfig, PEagleHead
from .common import (DTYPE_NAMES, WEIGHTS_FILE, ExportError, ExportMeta, fill_meta, head_fields_from_layer_config,
                     layer_config_dict, load_into, load_tensors, prepare_out_dir, read_side, save_tensors, write_side)

KINDS = ("peagle", "dflash")
# what a reloaded head takes from our side file (never a reader field)
SIDE_FIELDS = ("init_lm_head_from_target", "target_model_type", "target_num_layers", "target_architectures",
               "tie_embeddings")


def _proposal(meta: ExportMeta, tokens: int, algorithm: str) -> dict:
    return {
        "algorithm": algorithm,
        "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(tokens), "verifier_accept_k": 1,
                              "accept_tolerance": 0.0}],
        "verifier": {"name_or_path": meta.verifier_name_or_path,
                     "architectures": list(meta.verifier_architectures)},
    }


# ------------------------------------------------------------------ P-EAGLE
def peagle_refusals(head) -> list[str]:
    cfg = head.cfg
    bad = []
    if cfg.fc_norm or cfg.norm_output:
        bad.append("fc_norm/norm_output are set, but vLLM 0.32's update_peagle does not pass them on "
                   "(it would run the head without them)")
    if cfg.mask_token_id is None:
        bad.append("HeadConfig.mask_token_id is missing (vLLM requires 'mask_token_id' in a peagle config)")
    mh = getattr(head, "mask_hidden", None)
    if mh is None:
        bad.append("tensor 'mask_hidden' is missing (vLLM refuses parallel drafting without it)")
    elif not bool(torch.isfinite(mh).all()):
        bad.append("tensor 'mask_hidden' holds non-finite values")
    return bad


def peagle_config(base: dict, head: PEagleHead, meta: ExportMeta) -> dict:
    """The EAGLE-3 config ``base`` (speculators.build_config) turned into a P-EAGLE one."""
    c = dict(base)
    c["architectures"] = ["PEagleSpeculator"]
    c["speculators_model_type"] = "peagle"
    c["mask_token_id"] = int(head.cfg.mask_token_id)
    c["speculators_config"] = _proposal(meta, head.cfg.num_depths, "peagle")
    return c


def peagle_fields(c: dict, where: str) -> dict:
    """The HeadConfig fields a peagle config adds to the EAGLE-3 ones."""
    if c.get("mask_token_id") is None:
        raise ExportError(f"{where}: missing field 'mask_token_id' (vLLM requires it for peagle)")
    if c.get("fc_norm") or c.get("norm_output"):
        raise ExportError(f"{where}: fields 'fc_norm'/'norm_output' are set, but vLLM 0.32 ignores them for peagle")
    try:
        k = int(c["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    except (KeyError, IndexError, TypeError):
        raise ExportError(f"{where}: missing field 'speculators_config.proposal_methods[0].speculative_tokens' "
                          "(P-EAGLE's K)") from None
    # vLLM's update_peagle defaults norm_before_residual to False (EAGLE-3's default is True)
    return dict(kind="peagle", mask_token_id=int(c["mask_token_id"]), num_depths=k,
                norm_before_residual=bool(c.get("norm_before_residual", False)))


def check_peagle_tensors(tensors: dict, where: str) -> None:
    if "mask_hidden" not in tensors:
        raise ExportError(f"{where}: missing tensor 'mask_hidden' (a peagle head needs it; vLLM refuses "
                          "parallel drafting without it)")


# ------------------------------------------------------------------ DFlash
def dflash_tensors(head: DFlashHead) -> dict[str, torch.Tensor]:
    sd = dict(head.state_dict())
    sd.pop("embed_tokens.weight")
    if head.cfg.full_vocab:
        # the target's own lm_head: speculators drops it on save and takes the verifier's on load
        for k in ("lm_head.weight", "d2t", "t2d"):
            sd.pop(k)
    return sd


def dflash_config(head: DFlashHead, meta: ExportMeta, dtype: torch.dtype) -> dict:
    cfg = head.cfg
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_version": "0.9.0",
        "draft_vocab_size": cfg.draft_vocab_size,
        "block_size": int(cfg.block_size),
        "target_hidden_size": None if cfg.target_hidden_size == cfg.hidden_size else cfg.target_hidden_size,
        "aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "mask_token_id": int(cfg.mask_token_id),
        # vLLM 0.32 sets dflash_config.causal = not this flag for EVERY layer (speculators only reads it for
        # sliding-window layers, which we never build): our blocks attend both ways, so true
        "sliding_window_non_causal": True,
        "sample_from_anchor": False,
        "transformer_layer_config": layer_config_dict(cfg, dtype),
        "speculators_config": _proposal(meta, cfg.block_size - 1, "dflash"),
        "torch_dtype": DTYPE_NAMES[dtype],
        "dtype": DTYPE_NAMES[dtype],
    }


def dflash_refusals(head) -> list[str]:
    bad = []
    if head.cfg.mask_token_id is None:
        bad.append("HeadConfig.mask_token_id is missing (vLLM requires 'mask_token_id' in a dflash config)")
    if not head.cfg.full_vocab and not bool(head.t2d.any()):
        bad.append("d2t/t2d are unset: draft vocab < target vocab needs the vocabulary mapping")
    return bad


def save_dflash(head: DFlashHead, meta: ExportMeta | None, out_dir, dtype: torch.dtype = torch.bfloat16) -> Path:
    if not isinstance(head, DFlashHead):
        raise ExportError(f"speculators dflash layout holds DFlash heads, got {type(head).__name__}")
    bad = dflash_refusals(head)
    if bad:
        raise ExportError("cannot write a speculators dflash head: " + "; ".join(bad))
    meta = fill_meta(head, meta)
    meta.speculative_tokens = head.cfg.block_size - 1
    out = prepare_out_dir(out_dir)
    save_tensors(dflash_tensors(head), out / WEIGHTS_FILE, dtype)
    write_json_atomic(out / "config.json", dflash_config(head, meta, dtype))
    write_side(out, "speculators", head, meta, dtype)
    return out


def dflash_head_config(c: dict, where: str) -> HeadConfig:
    tl = c.get("transformer_layer_config")
    if not isinstance(tl, dict):
        raise ExportError(f"{where}: missing field 'transformer_layer_config'")
    kw = head_fields_from_layer_config(tl, f"{where}: transformer_layer_config")
    for key in ("aux_hidden_state_layer_ids", "mask_token_id", "block_size"):
        if c.get(key) is None:
            raise ExportError(f"{where}: missing field {key!r} (vLLM's update_dflash requires it)")
    if c.get("sample_from_anchor"):
        raise ExportError(f"{where}: sample_from_anchor is true; specheads' DFlash drafts from the mask slots only "
                          "(block_size - 1 tokens)")
    kw.update(kind="dflash", num_layers=int(tl.get("num_hidden_layers", 1)),
              aux_layer_ids=list(c["aux_hidden_state_layer_ids"]), mask_token_id=int(c["mask_token_id"]),
              block_size=int(c["block_size"]),
              draft_vocab_size=int(c.get("draft_vocab_size") or kw["target_vocab_size"]),
              target_hidden_size=c.get("target_hidden_size") or kw["hidden_size"])
    try:
        return HeadConfig(**kw)
    except ValueError as e:
        raise ExportError(f"{where}: {e}") from None


def load_dflash_tensors(head: DFlashHead, tensors: dict, where: str) -> None:
    """Load a DFlash state dict where the target's pieces may be absent (left zero: the target fills them)."""
    cfg = head.cfg
    if "mask_hidden" in tensors:
        raise ExportError(f"{where}: unexpected tensor 'mask_hidden' (DFlash embeds masked slots through "
                          "mask_token_id; vLLM refuses it)")
    optional = ["embed_tokens.weight"] + (["lm_head.weight", "d2t", "t2d"] if cfg.full_vocab else [])
    if not cfg.full_vocab and "d2t" in tensors and "t2d" not in tensors:
        optional.append("t2d")
    load_into(head, tensors, where, optional=optional)
    if "t2d" not in tensors and "d2t" in tensors:
        head.set_vocab_mapping(tensors["d2t"])
    if cfg.full_vocab and "d2t" not in tensors:
        head.set_vocab_mapping(None)


def load_dflash(d: Path, c: dict, dtype: torch.dtype = torch.float32):
    where = str(d / "config.json")
    cfg = dflash_head_config(c, where)
    side = read_side(d)
    if side and side.get("head_config"):
        cfg = cfg.replace(**{k: v for k, v in side["head_config"].items() if k in SIDE_FIELDS})
    head = DFlashHead(cfg)
    tensors = load_tensors(d)
    load_dflash_tensors(head, tensors, str(d))
    head = head.to(dtype)
    meta = ExportMeta.from_dict(side.get("meta") if side else None)
    ver = (c.get("speculators_config") or {}).get("verifier") or {}
    meta.verifier_name_or_path = ver.get("name_or_path", meta.verifier_name_or_path)
    meta.verifier_architectures = list(ver.get("architectures") or meta.verifier_architectures)
    meta.speculative_tokens = cfg.block_size - 1
    meta.aux_layer_ids = list(cfg.aux_layer_ids)
    meta.target_vocab_size = cfg.target_vocab_size
    return head, meta
