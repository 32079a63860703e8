"""Checkpoints (exact resume) and the ``final/`` head directory the export stage reads.

The layout (names and the reader, ``load_trained_head``) is defined in
:mod:`specheads.export.trained`; this module writes it:
``checkpoints/step_N/`` (DeepSpeed states + ``client_state.json`` +
``rank_{r}.pt`` + ``head_config.json``/``meta.json``), ``checkpoints/latest``
and ``final/`` (``model.safetensors``, ``head_config.json``, ``meta.json``).

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

from specheads.errors import SpecheadsError
from specheads.export.trained import CKPT, CLIENT, FINAL, HEAD_CONFIG, LATEST, META, WEIGHTS
from specheads.fileio import write_json_atomic


class ResumeMismatchError(SpecheadsError, ValueError):
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
    latest = root / LATEST
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
        write_json_atomic(tag_dir / CLIENT, client)
        write_json_atomic(tag_dir / HEAD_CONFIG, head_cfg)
        write_json_atomic(tag_dir / META, meta)
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
    write_json_atomic(out / HEAD_CONFIG, head_cfg)
    write_json_atomic(out / META, meta)
    return out
