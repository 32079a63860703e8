"""Shared pieces of the exporters: errors, run metadata, safetensors I/O,
the one-layer Llama/Qwen3 config dict, and the layer-id conversion used by
SGLang's ``eagle_config``.

Every export directory also gets ``specheads.json`` (format, full
``HeadConfig``, ``ExportMeta``).  Readers ignore it; our loaders use it for
what the reader config cannot say, and fall back to the reader config alone
for foreign checkpoints (SpecForge, speculators, EAGLE originals).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specheads.errors import SpecheadsError
from ..heads.config import HeadConfig
from ..fileio import write_json_atomic
from ..target import resolve_dtype

SIDE_FILE = "specheads.json"
WEIGHTS_FILE = "model.safetensors"
# the dtypes a serving engine loads a head in (names and torch dtypes from the one table in target.py)
DTYPES = {name: resolve_dtype(name) for name in ("bfloat16", "float16", "float32")}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class ExportError(SpecheadsError):
    """An export/import/validation failure; the message names the file, tensor or field."""


@dataclass
class ExportMeta:
    verifier_name_or_path: str | None = None
    verifier_architectures: list[str] = field(default_factory=list)
    aux_layer_ids: list[int] = field(default_factory=list)      # HF hidden-state index
    speculative_tokens: int = 3                                 # k
    target_vocab_size: int | None = None
    target_config: dict = field(default_factory=dict)
    recipe: dict = field(default_factory=dict)
    recipe_hash: str | None = None
    data: Any = None
    training: dict = field(default_factory=dict)
    specheads_version: str = "0.1.0"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "ExportMeta":
        d = dict(d or {})
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def with_recipe_hash(self) -> "ExportMeta":
        if self.recipe and not self.recipe_hash:
            blob = json.dumps(self.recipe, sort_keys=True, default=str).encode()
            self.recipe_hash = hashlib.sha256(blob).hexdigest()
        return self


def fill_meta(head, meta: ExportMeta | None) -> ExportMeta:
    """Copy what the head knows into the meta (aux ids, vocab, verifier archs)."""
    meta = dataclasses.replace(meta) if meta is not None else ExportMeta()
    cfg: HeadConfig = head.cfg
    if cfg.aux_layer_ids and not meta.aux_layer_ids:
        meta.aux_layer_ids = list(cfg.aux_layer_ids)
    if cfg.aux_layer_ids and meta.aux_layer_ids and list(meta.aux_layer_ids) != list(cfg.aux_layer_ids):
        raise ExportError(f"meta.aux_layer_ids {meta.aux_layer_ids} != head aux_layer_ids {cfg.aux_layer_ids}")
    if meta.target_vocab_size is None:
        meta.target_vocab_size = cfg.target_vocab_size
    elif meta.target_vocab_size != cfg.target_vocab_size:
        raise ExportError(f"meta.target_vocab_size {meta.target_vocab_size} != head target vocab {cfg.target_vocab_size}")
    if not meta.verifier_architectures:
        meta.verifier_architectures = list(cfg.target_architectures or meta.target_config.get("architectures") or [])
    return meta.with_recipe_hash()


# ------------------------------------------------------------------ files
def read_json(path: Path, what: str = "config") -> dict:
    if not path.is_file():
        raise ExportError(f"{path}: missing {what} file")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{path}: not valid JSON ({e})") from e


def cast_tensors(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in tensors.items():
        v = v.detach().cpu()
        if v.is_floating_point():
            v = v.to(dtype)
        out[k] = v.contiguous()
    return out


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, dtype: torch.dtype) -> None:
    tmp = Path(str(path) + ".tmp")
    save_file(cast_tensors(tensors, dtype), str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)


def weight_files(d: Path) -> list[Path]:
    idx = d / "model.safetensors.index.json"
    if idx.is_file():
        names = sorted(set(read_json(idx, "index")["weight_map"].values()))
        return [d / n for n in names]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        bins = sorted(d.glob("*.bin"))
        if bins:
            return bins
        raise ExportError(f"{d}: no *.safetensors weights")
    return files


def load_tensors(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in weight_files(d):
        if f.suffix == ".bin":
            out.update(torch.load(f, map_location="cpu", weights_only=True))
            continue
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def tensor_shapes_dtypes(d: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Names -> (shape, safetensors dtype string) without loading data."""
    out = {}
    for f in weight_files(d):
        if f.suffix == ".bin":
            for k, v in torch.load(f, map_location="cpu", weights_only=True).items():
                out[k] = (tuple(v.shape), str(v.dtype))
            continue
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                out[k] = (tuple(sl.get_shape()), sl.get_dtype())
    return out


def write_side(out: Path, fmt: str, head, meta: ExportMeta, dtype: torch.dtype, extra: dict | None = None) -> None:
    side = {"format": fmt, "dtype": DTYPE_NAMES.get(dtype, str(dtype)), "head_config": head.cfg.to_dict(),
            "meta": meta.to_dict()}
    side.update(extra or {})
    write_json_atomic(out / SIDE_FILE, side)


def read_side(d: Path) -> dict | None:
    p = d / SIDE_FILE
    return read_json(p, SIDE_FILE) if p.is_file() else None


def prepare_out_dir(out_dir) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out


# ------------------------------------------------------------------ configs
def layer_config_dict(cfg: HeadConfig, dtype: torch.dtype | None = None, num_hidden_layers: int | None = None) -> dict:
    """A full HF LlamaConfig (or Qwen3Config when qk_norm) dict describing the
    head's decoder layer(s); ``vocab_size`` is the target's.  Rope is written
    both ways (``rope_theta``/``rope_scaling`` and transformers-5
    ``rope_parameters``) so old and new readers agree."""
    qwen3 = bool(cfg.qk_norm)
    rope_params = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope_params = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    d = {
        "architectures": ["Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLM"],
        "model_type": "qwen3" if qwen3 else "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.num_layers if num_hidden_layers is None else num_hidden_layers,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "rope_parameters": rope_params,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.target_vocab_size,
        "hidden_act": cfg.hidden_act,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
    }
    if cfg.bos_token_id is not None:
        d["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_id is not None:
        d["eos_token_id"] = cfg.eos_token_id
    if dtype is not None:
        d["torch_dtype"] = d["dtype"] = DTYPE_NAMES.get(dtype, str(dtype))
    return d


def head_fields_from_layer_config(d: dict, where: str) -> dict:
    """HeadConfig keyword arguments from a HF layer config dict."""
    from ..heads.config import rope_from_config
    try:
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        out = dict(
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            target_vocab_size=int(d["vocab_size"]),
            hidden_act=d.get("hidden_act", "silu"),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=d.get("model_type") in ("qwen3", "qwen3_moe"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
        )
    except KeyError as e:
        raise ExportError(f"{where}: missing field {e.args[0]!r}") from e
    theta, scaling = rope_from_config(d)
    out["rope_theta"], out["rope_scaling"] = theta, scaling
    return out


def check_state_dict(head, tensors: dict[str, torch.Tensor], where: str, optional=()) -> None:
    """Every head tensor present with the right shape, nothing unknown."""
    own = head.state_dict()
    for name, t in tensors.items():
        if name not in own:
            raise ExportError(f"{where}: unexpected tensor {name!r} (misnamed?)")
        if tuple(t.shape) != tuple(own[name].shape):
            raise ExportError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, "
                              f"expected {tuple(own[name].shape)}")
    missing = [n for n in own if n not in tensors and n not in optional]
    if missing:
        raise ExportError(f"{where}: missing tensor(s) {missing}")


def load_into(head, tensors: dict[str, torch.Tensor], where: str, optional=()) -> None:
    check_state_dict(head, tensors, where, optional)
    own = head.state_dict()
    with torch.no_grad():
        for name in optional:  # absent shared tensors (target embedding / lm_head) are zero, not random
            if name not in tensors and name in own and own[name].is_floating_point():
                own[name].zero_()
        for name, t in tensors.items():
            target = own[name]
            target.copy_(t.to(target.dtype) if target.is_floating_point() else t.to(target.dtype))
