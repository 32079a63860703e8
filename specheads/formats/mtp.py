"""MTP export (DeepSeek-V3 layout).

Tensors, for depth d and target layer count L::

    model.layers.{L+d}.enorm.weight, .hnorm.weight, .eh_proj.weight
    model.layers.{L+d}.input_layernorm.weight, .post_attention_layernorm.weight
    model.layers.{L+d}.self_attn.{q,k,v,o}_proj.weight (+ q_norm/k_norm)
    model.layers.{L+d}.mlp.{gate,up,down}_proj.weight
    model.layers.{L+d}.shared_head.norm.weight
    model.layers.{L+d}.shared_head.head.weight      (the target lm_head, shared)
    model.layers.{L+d}.embed_tokens.weight          (the target embedding, shared)

``save`` writes a standalone draft directory: ``config.json`` is the
target's config (``meta.target_config``, or a Llama config built from the
head) with ``num_nextn_predict_layers = D``.  For targets with native MTP
(DeepSeek-V3 and kin) ``stitch_into_target`` copies a safetensors target
checkpoint and adds these layers plus ``num_nextn_predict_layers``.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ..fileio import write_json_atomic
from ..heads import HeadConfig, MTPHead
from .common import (WEIGHTS_FILE, ExportError, ExportMeta, fill_meta, head_fields_from_layer_config,
                     layer_config_dict, load_into, load_tensors, prepare_out_dir, read_json, read_side, save_tensors, write_side)

FORMAT = "mtp"


def _num_target_layers(head: MTPHead, meta: ExportMeta) -> int:
    L = head.cfg.target_num_layers or meta.target_config.get("num_hidden_layers")
    if not L:
        raise ExportError("MTP export needs the target's layer count (HeadConfig.target_num_layers or "
                          "meta.target_config['num_hidden_layers'])")
    return int(L)


def export_tensors(head: MTPHead, L: int) -> dict[str, torch.Tensor]:
    out = {}
    sd = head.state_dict()
    for name, t in sd.items():
        if name.startswith("layers."):
            _, d, rest = name.split(".", 2)
            out[f"model.layers.{L + int(d)}.{rest}"] = t
    for d in range(head.cfg.num_mtp_depths):
        out[f"model.layers.{L + d}.shared_head.head.weight"] = sd["lm_head.weight"]
        out[f"model.layers.{L + d}.embed_tokens.weight"] = sd["embed_tokens.weight"]
    return out


def save(head: MTPHead, meta: ExportMeta | None, out_dir, dtype: torch.dtype = torch.bfloat16) -> Path:
    if not isinstance(head, MTPHead):
        raise ExportError(f"mtp format holds MTP heads, got {type(head).__name__}")
    meta = fill_meta(head, meta)
    L = _num_target_layers(head, meta)
    out = prepare_out_dir(out_dir)
    c = dict(meta.target_config) if meta.target_config else layer_config_dict(head.cfg, dtype, num_hidden_layers=L)
    c["num_hidden_layers"] = L
    c["num_nextn_predict_layers"] = head.cfg.num_mtp_depths
    tensors = {k: v.clone() for k, v in export_tensors(head, L).items()}  # shared storage -> separate tensors
    save_tensors(tensors, out / WEIGHTS_FILE, dtype)
    write_json_atomic(out / "config.json", c)
    write_side(out, FORMAT, head, meta, dtype, {"mtp_layer_offset": L})
    return out


def load(d, dtype: torch.dtype = torch.float32):
    d = Path(d)
    c = read_json(d / "config.json")
    where = str(d / "config.json")
    D = c.get("num_nextn_predict_layers")
    if not D:
        raise ExportError(f"{where}: missing field 'num_nextn_predict_layers'")
    L = int(c["num_hidden_layers"])
    side = read_side(d)
    if side and side.get("head_config"):
        cfg = HeadConfig.from_dict(side["head_config"])
    else:
        kw = head_fields_from_layer_config(c, where)
        kw.update(kind="mtp", num_mtp_depths=int(D), target_num_layers=L)
        cfg = HeadConfig(**kw)
    head = MTPHead(cfg)
    raw = load_tensors(d)
    tensors = {}
    for name, t in raw.items():
        parts = name.split(".")
        if len(parts) < 4 or parts[0] != "model" or parts[1] != "layers" or int(parts[2]) < L:
            continue
        d_ = int(parts[2]) - L
        rest = ".".join(parts[3:])
        if rest == "shared_head.head.weight":
            if d_ == 0:
                tensors["lm_head.weight"] = t
            continue
        if rest == "embed_tokens.weight":
            if d_ == 0:
                tensors["embed_tokens.weight"] = t
            continue
        tensors[f"layers.{d_}.{rest}"] = t
    load_into(head, tensors, str(d))
    head = head.to(dtype)
    meta = ExportMeta.from_dict(side.get("meta") if side else None)
    return head, meta


def stitch_into_target(target_dir, mtp_dir, out_dir) -> Path:
    """Copy a safetensors target checkpoint and add the MTP layers of
    ``mtp_dir`` (a directory written by ``save``) as ``model-mtp.safetensors``,
    updating ``model.safetensors.index.json`` and ``num_nextn_predict_layers``."""
    target_dir, mtp_dir, out = Path(target_dir), Path(mtp_dir), Path(out_dir)
    tc = read_json(target_dir / "config.json")
    mc = read_json(mtp_dir / "config.json")
    L = int(tc["num_hidden_layers"])
    if int(mc["num_hidden_layers"]) != L:
        raise ExportError(f"{mtp_dir / 'config.json'}: MTP layers were numbered for a {mc['num_hidden_layers']}-layer "
                          f"target, {target_dir} has {L}")
    for key in ("hidden_size", "vocab_size"):
        if key in mc and key in tc and mc[key] != tc[key]:
            raise ExportError(f"{mtp_dir / 'config.json'}: {key}={mc[key]} but target has {tc[key]}")
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out}: output directory is not empty")
    shutil.copytree(target_dir, out, dirs_exist_ok=True)
    mtp = {k: v for k, v in load_tensors(mtp_dir).items() if k.startswith(f"model.layers.")}
    with_dtype = next(iter(mtp.values())).dtype
    save_tensors(mtp, out / "model-mtp.safetensors", with_dtype)
    idx_path = out / "model.safetensors.index.json"
    if idx_path.is_file():
        idx = read_json(idx_path, "index")
    else:
        files = sorted(p.name for p in out.glob("*.safetensors") if p.name != "model-mtp.safetensors")
        idx = {"metadata": {}, "weight_map": {}}
        for f in files:
            for name in _names(out / f):
                idx["weight_map"][name] = f
    clash = [k for k in mtp if k in idx["weight_map"]]
    if clash:
        raise ExportError(f"{target_dir}: target already has tensors {clash[:3]}... (MTP layers present?)")
    for k in mtp:
        idx["weight_map"][k] = "model-mtp.safetensors"
    write_json_atomic(idx_path, idx)
    tc["num_nextn_predict_layers"] = int(mc["num_nextn_predict_layers"])
    write_json_atomic(out / "config.json", tc)
    return out


def _names(path: Path) -> list[str]:
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as h:
        return list(h.keys())
