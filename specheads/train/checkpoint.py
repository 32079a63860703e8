"""Checkpoints (exact resume) and the ``final/`` head directory the export stage reads.

The layout (names and the reader, ``load_trained_head``) is defined in
:mod:`specheads.formats.trained`; this module writes it:
``checkpoints/step_N/`` (DeepSpeed states + ``client_state.json`` +
``rank_{r}.pt`` + ``head_config.json``/``meta.json``), ``checkpoints/latest``
and ``final/`` (``model.safetensors``, ``head_config.json``, ``meta.json``).

Resuming on another number of ranks (N -> M) keeps the global batch
(ranks × ``train.grad_accum`` × micro-batch): the run must pass the
``train.grad_accum`` that does (2 ranks × 1 -> 1 rank × 2). What DeepSpeed
saved is re-sharded its own way:

* ZeRO-1/2/3: the optimizer state is partitioned per rank, and DeepSpeed
  refuses a ZeRO checkpoint of another data-parallel size. Rank 0 converts it
  once with DeepSpeed's ``ds_to_universal`` into ``checkpoints/step_N.universal/``
  (written under a temporary name, then renamed; reused by a later resume) and
  the engine, built with ``"checkpoint": {"load_universal": true}``, loads
  weights, Adam moments and the fp32 master copy from it for its own partition.
  Frozen weights and buffers are not in a universal checkpoint: they come from
  the recipe, target and vocabulary, which the fingerprint pins.
* ZeRO-0: every rank holds the whole optimizer state in
  ``mp_rank_00_model_states.pt``, so it loads unchanged on any world size
  (``ds_to_universal`` needs ZeRO partition files and does not apply).

Every rank then takes the data position and RNG states of saved rank 0: the
feed continues at the same global batch (``Feed.load_state_dict`` maps
``global_position``), and all ranks share one RNG stream as a fresh run does.

A checkpoint is written only from a finite state: the trainer checks the
loss before every backward and the gradient norm after every step, and
stops without saving when either is NaN/inf, so ``latest`` always names the
last good state. What a checkpoint must share with the run resuming it (the
fingerprint, the client state's fields) is :mod:`specheads.rundir`'s.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from specheads.formats.trained import CKPT, CLIENT, FINAL, HEAD_CONFIG, LATEST, META, WEIGHTS
from specheads.fileio import write_json_atomic
from specheads.rundir import ResumeMismatchError, client_world_size


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
        # a state saved by a process that saw more GPUs (another launch) sets the devices this one has
        for i, s in enumerate(st["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


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
        # a universal copy of an earlier run's step_N would no longer match the step_N written now
        shutil.rmtree(universal_dir(tag_dir), ignore_errors=True)
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


def saved_world_size(tag_dir: Path) -> int:
    """The number of ranks that wrote a checkpoint."""
    return client_world_size(read_client_state(tag_dir))


def needs_universal(tag_dir: Path | None, world_size: int, zero_stage: int) -> bool:
    """Whether resuming ``tag_dir`` on ``world_size`` ranks goes through a universal checkpoint: the
    engine must then be built with ``"checkpoint": {"load_universal": true}``."""
    return tag_dir is not None and zero_stage > 0 and saved_world_size(tag_dir) != world_size


def universal_dir(tag_dir: Path) -> Path:
    return Path(tag_dir).with_name(Path(tag_dir).name + ".universal")


def universal_copy(tag_dir: Path, rank: int, say=print) -> Path:
    """DeepSpeed's universal form of a ZeRO checkpoint (``ds_to_universal``), beside it; rank 0 converts
    it the first time, every rank waits for it."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    tag_dir = Path(tag_dir)
    out = universal_dir(tag_dir)
    if rank == 0 and not out.is_dir():
        say(f"{tag_dir.name} was written on {saved_world_size(tag_dir)} rank(s): converting it to a DeepSpeed "
            f"universal checkpoint {out} to re-shard the ZeRO optimizer state")
        # Converted under a temporary name and renamed when complete, so an interrupted conversion is
        # never taken for a finished one (ds_to_universal also drops a `latest_universal` file beside
        # its output: it stays in the temporary folder).
        work = tag_dir.parent / f".{out.name}.partial"
        shutil.rmtree(work, ignore_errors=True)
        # One worker: its process pool would fork a process that holds CUDA and NCCL state.
        args = argparse.Namespace(input_folder=str(tag_dir), output_folder=str(work / out.name),
                                  num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                                  strict=True, inject_missing_state=True)
        stdout, sys.stdout = sys.stdout, sys.stderr  # its progress lines are a log, not the command's output
        try:
            ds_to_universal(args)
        finally:
            sys.stdout = stdout
        os.replace(work / out.name, out)
        shutil.rmtree(work, ignore_errors=True)
    _barrier()
    if not out.is_dir():
        raise RuntimeError(f"the universal checkpoint {out} is missing after rank 0 converted it "
                           f"(do all ranks see the same checkpoint directory?)")
    return out


def load_checkpoint(engine, tag_dir: Path, rank: int, world_size: int, zero_stage: int, say=print) -> dict:
    """Load model/optimizer/scheduler into ``engine``; returns this rank's state (feed + RNG).

    On another world size than the checkpoint's, ZeRO states load through a universal checkpoint
    (the engine must have been built for it: :func:`needs_universal`), and every rank gets saved
    rank 0's state."""
    tag_dir = Path(tag_dir)
    saved_world = saved_world_size(tag_dir)
    src = tag_dir
    if needs_universal(tag_dir, world_size, zero_stage):
        if not engine.load_universal_checkpoint():
            raise RuntimeError("the DeepSpeed engine was built without checkpoint.load_universal: "
                               "it cannot load a checkpoint written on another number of ranks")
        src = universal_copy(tag_dir, rank, say)
    elif saved_world != world_size:
        say(f"{tag_dir.name} was written on {saved_world} rank(s), this run has {world_size}: ZeRO stage 0 keeps "
            f"the whole optimizer state on every rank, loading it as saved")
    path, _ = engine.load_checkpoint(str(src.parent), tag=src.name, load_optimizer_states=True,
                                     load_lr_scheduler_states=True)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint {src}")
    steps_to_param_device(engine.optimizer)
    f = tag_dir / f"rank_{rank if saved_world == world_size else 0}.pt"
    if not f.is_file():
        raise ResumeMismatchError(f"{tag_dir} has no {f.name}: the checkpoint is incomplete")
    return torch.load(f, map_location="cpu", weights_only=False)


def steps_to_param_device(optimizer) -> int:
    """Put each parameter's Adam ``step`` beside the parameter, as fp32; returns how many moved.

    DeepSpeed's universal-checkpoint loader writes ``step`` as a CPU tensor, and torch's fused
    AdamW (the fallback when DeepSpeed's own cannot be built) then fails its first step with
    "state_steps is on cpu" (seen on 2 H200s, ZeRO-3 resumed on another GPU count). torch's own
    ``load_state_dict`` makes the same move for fused optimizers."""
    inner = getattr(optimizer, "optimizer", optimizer)       # DeepSpeed's ZeRO/bf16 wrapper holds torch's
    if not isinstance(inner, torch.optim.Optimizer) or not inner.defaults.get("fused"):
        return 0
    moved = 0
    # by state, not by param_groups: ZeRO-3 empties the groups' params between its sub-group steps
    for p, st in inner.state.items():
        step = st.get("step")
        if step is None or not torch.is_tensor(p):
            continue
        if not torch.is_tensor(step) or step.device != p.device or step.dtype != torch.float32:
            st["step"] = torch.as_tensor(step, dtype=torch.float32).to(p.device).reshape(())
            moved += 1
    return moved


def _barrier():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.cuda.is_available():
            # NCCL allocates outside PyTorch's cache: after a long batch the cache can hold the whole
            # GPU, and the barrier's few bytes then fail ("Failed to CUDA calloc"); hand them back first
            torch.cuda.empty_cache()
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
