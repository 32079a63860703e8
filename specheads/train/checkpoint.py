"""Checkpoints (exact resume) and the ``final/`` head directory the export stage reads.

Layout under ``recipe.train_dir``::

    checkpoints/latest                  tag of the newest complete checkpoint (DeepSpeed)
    checkpoints/step_N/                 DeepSpeed model + optimizer + scheduler states
        client_state.json               resume fingerprint, step, target identity, head config
        rank_{r}.pt                     per-rank data position (feed.state_dict()) and RNG states
        head_config.json, meta.json     so a checkpoint alone can be loaded as a head
    final/model.safetensors             plain head weights (LoRA merged), fp32
    final/head_config.json              HeadConfig.to_dict()
    final/meta.json                     target identity, aux layer ids, vocab stats, recipe, step

A checkpoint is written only from a finite state: the trainer checks the
loss before every backward and the gradient norm after every step, and
stops without saving when either is NaN/inf, so ``latest`` always names the
last good state.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import torch

from . import _compat

CKPT = "checkpoints"
FINAL = "final"
WEIGHTS = "model.safetensors"
HEAD_CONFIG = "head_config.json"
META = "meta.json"
CLIENT = "client_state.json"


class ResumeMismatchError(ValueError):
    pass


# ---------------------------------------------------------------- fingerprint
# Recipe fields that change what (or how) a run trains: a checkpoint resumes only when they agree.
RESUME_FIELDS = [
    "seed",
    "head",
    "train.ttt_steps", "train.loss_decay", "train.eagle1_ce_weight", "train.epochs", "train.max_steps",
    "train.micro_batch_size", "train.grad_accum", "train.max_tokens_per_batch", "train.lr",
    "train.min_lr_ratio", "train.warmup_steps", "train.weight_decay", "train.betas", "train.grad_clip",
    "train.scheduler", "train.zero_stage", "train.precision",
    "vocab.draft_vocab_size",
    "data.max_length",
]


def _flatten(d, prefix=""):
    out = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = d
    return out


def resume_fingerprint(recipe, target_identity: dict, d2t: torch.Tensor | None, world_size: int,
                       precision: str) -> dict:
    """Flat {dotted key: value} of everything a resumed run must share with its checkpoint."""
    import hashlib

    rd = recipe.to_dict()
    fp = {}
    for f in RESUME_FIELDS:
        node = rd
        for part in f.split("."):
            node = node[part]
        fp.update(_flatten(node, f + ".") if isinstance(node, dict) else {f: node})
    fp["target.config_hash"] = target_identity.get("config_hash")
    fp["vocab.d2t_sha256"] = (hashlib.sha256(d2t.cpu().numpy().tobytes()).hexdigest()[:16]
                              if d2t is not None else None)
    fp["world_size"] = int(world_size)
    fp["effective_precision"] = precision
    return json.loads(json.dumps(fp))  # lists/tuples normalised as JSON would


def compare_fingerprints(saved: dict, current: dict, where: str) -> None:
    keys = sorted(set(saved) | set(current))
    diffs = [f"  {k}: {saved.get(k, '<absent>')!r} (checkpoint) != {current.get(k, '<absent>')!r} (this run)"
             for k in keys if saved.get(k) != current.get(k)]
    if diffs:
        raise ResumeMismatchError(
            f"cannot resume from {where}: it was written by a different recipe/target/vocab; "
            f"these fields differ:\n" + "\n".join(diffs) +
            "\nSet train.resume=false (or use another run_dir) to start a new run, or restore the recipe.")


# ---------------------------------------------------------------- RNG
def rng_state() -> dict:
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


# ---------------------------------------------------------------- save / load (DeepSpeed)
def checkpoint_root(train_dir) -> Path:
    return Path(train_dir) / CKPT


def latest_checkpoint(train_dir) -> Path | None:
    root = checkpoint_root(train_dir)
    latest = root / "latest"
    if not latest.is_file():
        return None
    tag = latest.read_text().strip()
    p = root / tag
    return p if (p / CLIENT).is_file() else None


def save_checkpoint(engine, train_dir, step: int, client: dict, rank_state: dict, rank: int,
                    head_cfg: dict, meta: dict) -> Path:
    """All ranks call this (DeepSpeed collective). ``client`` must be JSON-able."""
    root = checkpoint_root(train_dir)
    tag = f"step_{step}"
    tag_dir = root / tag
    if rank == 0:
        tag_dir.mkdir(parents=True, exist_ok=True)
    _barrier()
    # The sidecar files go first: DeepSpeed writes `latest` last, so a tag it names is complete.
    torch.save(rank_state, tag_dir / f"rank_{rank}.pt")
    if rank == 0:
        _write_json(tag_dir / CLIENT, client)
        _write_json(tag_dir / HEAD_CONFIG, head_cfg)
        _write_json(tag_dir / META, meta)
    engine.save_checkpoint(str(root), tag=tag, client_state={"specheads": client}, save_latest=True)
    _barrier()
    return tag_dir


def read_client_state(tag_dir: Path) -> dict:
    return json.loads((Path(tag_dir) / CLIENT).read_text())


def load_checkpoint(engine, tag_dir: Path, rank: int) -> dict:
    """Load model/optimizer/scheduler into ``engine``; returns this rank's state (feed + RNG)."""
    tag_dir = Path(tag_dir)
    path, _ = engine.load_checkpoint(str(tag_dir.parent), tag=tag_dir.name, load_optimizer_states=True,
                                     load_lr_scheduler_states=True)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint {tag_dir}")
    f = tag_dir / f"rank_{rank}.pt"
    if not f.is_file():
        raise ResumeMismatchError(f"{tag_dir} has no state for rank {rank} (was it written with another world size?)")
    return torch.load(f, map_location="cpu", weights_only=False)


def _barrier():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _write_json(path: Path, obj) -> None:
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------- final/
def save_final(train_dir, state_dict: dict, head_cfg: dict, meta: dict) -> Path:
    """Plain safetensors of the head + head_config.json + meta.json (written atomically)."""
    from safetensors.torch import save_file

    out = Path(train_dir) / FINAL
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.float() if v.is_floating_point() else v).detach().cpu().contiguous()
               for k, v in state_dict.items()}
    tmp = out / (WEIGHTS + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt", "producer": "specheads.train"})
    os.replace(tmp, out / WEIGHTS)
    _write_json(out / HEAD_CONFIG, head_cfg)
    _write_json(out / META, meta)
    return out


def _resolve(path) -> tuple[str, Path]:
    p = Path(path)
    for cand in (p, p / FINAL, p / "train" / FINAL):
        if (cand / WEIGHTS).is_file() and (cand / HEAD_CONFIG).is_file():
            return "final", cand
    for cand in (p, p / CKPT):
        if (cand / "latest").is_file():
            tag = (cand / "latest").read_text().strip()
            return "checkpoint", cand / tag
    for cand in (p / "train" / CKPT,):
        if (cand / "latest").is_file():
            return "checkpoint", cand / (cand / "latest").read_text().strip()
    if (p / HEAD_CONFIG).is_file() and any(p.glob("*model_states.pt")):
        return "checkpoint", p
    raise FileNotFoundError(
        f"{path}: no trained head here (looked for final/{WEIGHTS}, a train dir, or a DeepSpeed checkpoint)")


def _checkpoint_module_state(tag_dir: Path) -> dict:
    files = sorted(tag_dir.glob("mp_rank_*_model_states.pt"))
    sd = None
    if files:
        blob = torch.load(files[0], map_location="cpu", weights_only=False)
        sd = blob.get("module")
    if not sd or any(v.numel() == 0 for v in sd.values() if torch.is_tensor(v)):  # ZeRO-3: partitioned
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        sd = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    return {k[len("head."):]: v for k, v in sd.items() if k.startswith("head.")}


def load_trained_head(path) -> tuple[torch.nn.Module, dict]:
    """``(head, meta)`` from a run dir, a train dir, its ``final/`` or a checkpoint (LoRA merged)."""
    kind, d = _resolve(path)
    HeadConfig = _compat.head_config_cls()
    cfg = HeadConfig.from_dict(json.loads((d / HEAD_CONFIG).read_text()))
    meta = json.loads((d / META).read_text()) if (d / META).is_file() else {}
    head = _compat.head_classes()[cfg.kind](cfg)
    if kind == "final":
        from safetensors.torch import load_file

        sd = load_file(str(d / WEIGHTS))
    else:
        sd = _checkpoint_module_state(d)
        if any("lora_" in k for k in sd):
            from types import SimpleNamespace

            from .builder import _add_lora, merged_state_dict

            lora = SimpleNamespace(**meta["lora"])
            h = _add_lora(head, lora)
            h.load_state_dict(sd, strict=True)
            sd = merged_state_dict(h)
            head = _compat.head_classes()[cfg.kind](cfg)
    missing, unexpected = head.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("inv_freq")]
    if missing or unexpected:
        raise ValueError(f"{d}: weights do not fit the head config: missing {missing}, unexpected {unexpected}")
    head.embed_tokens.weight.requires_grad_(False)
    return head.float().eval(), meta
