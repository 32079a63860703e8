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

Integrity. Every rank writes its files, DeepSpeed saves (with
``save_latest=False``: DeepSpeed does not touch ``latest``), all ranks meet at a
barrier, then rank 0 reads every file of ``step_N/`` (all ranks' files: the
directory is shared), fsyncs it and records its sha256 and size in
``step_N/checksums.json``, and only then replaces ``latest`` (temporary file +
rename). A checkpoint without ``checksums.json`` is therefore either an
interrupted save or one written before checksums existed.

Choosing the checkpoint to resume (:func:`select_checkpoint`): the one
``latest`` names, verified against its checksums; if it fails (no checksums,
a missing, truncated or changed file), the newest older ``step_N`` that
verifies, printing what was skipped and why (the file, expected and actual
digest or size). Directories newer than ``latest`` are interrupted saves and
are skipped. Checkpoints written before checksums (no ``checksums.json``) are
the last resort: one is resumed only when no checksummed checkpoint verifies,
and only when every ``.pt`` file in it passes its zip CRC check and its JSON
files parse, with a printed warning that it is unverified. Checkpoints exist
but none qualifies -> :class:`CheckpointError` naming each and why.

``final/`` is written into a temporary sibling (``.final.tmp-*``), its
``meta.json`` records the sha256 of ``model.safetensors`` and
``head_config.json``, and the directory is renamed into place when complete.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch

from specheads.errors import SpecheadsError
from specheads.fileio import disk_full_guard, fsync_dir, publish_dir, write_json_atomic
from specheads.formats.trained import (CHECKSUMS, CKPT, CLIENT, FINAL, HEAD_CONFIG, LATEST, META, WEIGHTS,
                                       TrainedHeadError, checksum_problems, compute_checksums, file_sha256,
                                       read_checksums)
from specheads.rundir import ResumeMismatchError, client_world_size

_STEP_DIR = re.compile(r"step_(\d+)")


class CheckpointError(SpecheadsError, RuntimeError):
    """Checkpoints exist under ``train.out`` but none can be resumed (each fails its checksums or cannot be
    read)."""


class PreviousRunError(SpecheadsError, FileExistsError):
    """A run that does not resume was pointed at a train directory holding another run's checkpoints or
    ``final/`` (``train.overwrite=true`` removes them first)."""


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
    """The checkpoint ``latest`` names, when it exists (unverified: see :func:`select_checkpoint`)."""
    root = checkpoint_root(train_dir)
    latest = root / LATEST
    if not latest.is_file():
        return None
    tag = latest.read_text().strip()
    p = root / tag
    return p if tag and (p / CLIENT).is_file() else None


def step_dirs(train_dir) -> list[Path]:
    """Every ``checkpoints/step_N`` directory, newest (largest N) first."""
    root = checkpoint_root(train_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def _step_of(tag_dir: Path) -> int:
    m = _STEP_DIR.fullmatch(Path(tag_dir).name)
    return int(m.group(1)) if m else -1


def write_latest(train_dir, tag: str) -> None:
    """Point ``latest`` at ``tag`` atomically (temporary file, fsync, rename)."""
    root = checkpoint_root(train_dir)
    tmp = root / f".{LATEST}.tmp"
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    fsync_dir(root)


def _dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in Path(d).rglob("*") if f.is_file())


def _kept_checkpoint(train_dir, tag: str) -> str:
    """What a failed save of ``tag`` leaves to resume from, for the disk-full message."""
    prev = latest_checkpoint(train_dir)
    if prev is not None and prev.name != tag:
        return (f"the partial {tag} was removed and {checkpoint_root(train_dir) / LATEST} still names the previous "
                f"checkpoint {prev.name}, which is kept: free space and rerun with train.resume=true to resume from it")
    return (f"the partial {tag} was removed; there is no earlier checkpoint, so a rerun starts from step 0: "
            f"free space and rerun the same command")


def save_checkpoint(engine, train_dir, step: int, client: dict, rank_state: dict, rank: int,
                    head_cfg: dict, meta: dict) -> Path:
    """All ranks call this (DeepSpeed collective). ``client`` must be JSON-able.

    Order: every rank's files and DeepSpeed's save, a barrier, then rank 0 writes ``checksums.json``
    (covering all ranks' files) and only then advances ``latest``. A full disk anywhere in it is a
    ``DiskFullError``: the partial ``step_N`` is removed (by rank 0), ``latest`` is not advanced, and the
    message names the previous checkpoint a resume continues from. (With several ranks, the rank that hit the
    full disk exits; the launcher stops the others.)"""
    root = checkpoint_root(train_dir)
    tag = f"step_{step}"
    tag_dir = root / tag
    prev = latest_checkpoint(train_dir)
    # about as much as the previous checkpoint took
    needed = (lambda: _dir_bytes(prev) if prev is not None and prev.is_dir() and prev != tag_dir else None)

    def drop_partial() -> None:
        if rank == 0:
            shutil.rmtree(tag_dir, ignore_errors=True)
            for t in root.glob(f".{LATEST}.tmp"):
                t.unlink(missing_ok=True)

    if rank == 0:
        # a step_N left by an earlier attempt (a save interrupted, or the damaged checkpoint a resume skipped)
        # is replaced whole: none of its files may end up under the new checksums
        if tag_dir.exists():
            shutil.rmtree(tag_dir)
        tag_dir.mkdir(parents=True, exist_ok=True)
        # a universal copy of an earlier run's step_N would no longer match the step_N written now
        shutil.rmtree(universal_dir(tag_dir), ignore_errors=True)
    _barrier()
    with disk_full_guard(tag_dir, needed=needed, kept=lambda: _kept_checkpoint(train_dir, tag), action="",
                         cleanup=drop_partial):
        torch.save(rank_state, tag_dir / f"rank_{rank}.pt")
        if rank == 0:
            write_json_atomic(tag_dir / CLIENT, client)
            write_json_atomic(tag_dir / HEAD_CONFIG, head_cfg)
            write_json_atomic(tag_dir / META, meta)
        engine.save_checkpoint(str(root), tag=tag, client_state={"specheads": client}, save_latest=False)
        _barrier()  # every rank's files are written
        if rank == 0:
            write_json_atomic(tag_dir / CHECKSUMS, compute_checksums(tag_dir, fsync=True))
            write_latest(train_dir, tag)
    _barrier()
    return tag_dir


# ---------------------------------------------------------------- choosing the checkpoint to resume
def _legacy_problems(tag_dir: Path) -> list[str]:
    """What makes a checkpoint without checksums unreadable: a ``.pt`` file whose zip structure or CRCs
    fail (a truncated or flipped file), a JSON file that does not parse, no client state."""
    out = []
    if not (tag_dir / CLIENT).is_file():
        out.append(f"{tag_dir / CLIENT}: missing")
    for f in sorted(tag_dir.rglob("*")):
        if not f.is_file():
            continue
        try:
            if f.suffix == ".pt":
                with zipfile.ZipFile(f) as z:
                    bad = z.testzip()
                if bad is not None:
                    out.append(f"{f}: zip member {bad} fails its CRC check")
            elif f.suffix == ".json":
                json.loads(f.read_text())
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
            out.append(f"{f}: unreadable ({type(e).__name__}: {e})")
    return out


def _written_with_checksums(tag_dir: Path) -> bool:
    """Whether a checkpoint was written by a version that records checksums (its fingerprint carries the
    digests of its inputs): one of those without a checksums file is an interrupted save, not an old one."""
    try:
        fingerprint = json.loads((tag_dir / CLIENT).read_text()).get("fingerprint") or {}
    except (OSError, ValueError, AttributeError):
        return False
    return any(str(k).startswith("inputs.") for k in fingerprint)


def check_checkpoint(tag_dir: Path) -> tuple[str, list[str]]:
    """("verified", []) | ("unverified", []) (no checksums.json, readable) | ("bad", reasons)."""
    tag_dir = Path(tag_dir)
    try:
        recorded = read_checksums(tag_dir)
    except TrainedHeadError as e:
        return "bad", [str(e)]
    if recorded is None:
        if _written_with_checksums(tag_dir):
            return "bad", [f"no {CHECKSUMS}: a save that did not finish (this version writes it last)"]
        bad = _legacy_problems(tag_dir)
        return ("bad", [f"no {CHECKSUMS} and " + b for b in bad]) if bad else ("unverified", [])
    bad = checksum_problems(tag_dir, recorded)
    if not bad and not (tag_dir / CLIENT).is_file():
        bad = [f"{tag_dir / CLIENT}: missing"]
    return ("bad", bad) if bad else ("verified", [])


def select_checkpoint(train_dir, say=print) -> Path | None:
    """The checkpoint a resume loads (module docstring: ``latest`` if it verifies, else the newest older
    one that does, else an unverified one written before checksums); None when there is none at all.
    :class:`CheckpointError` when checkpoints exist and none qualifies."""
    root = checkpoint_root(train_dir)
    dirs = step_dirs(train_dir)
    named = None
    if (root / LATEST).is_file():
        tag = (root / LATEST).read_text().strip()
        named = root / tag if tag else None
        if named is not None and not named.is_dir():
            say(f"{root / LATEST} names {tag}, which does not exist: looking for the newest checkpoint that verifies")
            named = None
    if named is None and not dirs:
        return None
    skipped: list[str] = []
    if named is not None:
        newer = [d for d in dirs if _step_of(d) > _step_of(named)]
        for d in newer:
            say(f"skipping checkpoint {d}: newer than {root / LATEST} ({named.name}), an interrupted save")
            skipped.append(f"{d}: newer than latest ({named.name}), an interrupted save")
        order = [named] + [d for d in dirs if d != named and d not in newer]
    else:
        order = dirs
    unverified = None
    for d in order:
        status, why = check_checkpoint(d)
        if status == "verified":
            if d != order[0] or unverified is not None:
                say(f"resuming from {d}, the newest checkpoint that verifies")
            return d
        if status == "unverified":
            skipped.append(f"{d}: no {CHECKSUMS} (written before checksums, or an interrupted save)")
            if unverified is None:
                unverified = d
            continue
        say(f"skipping checkpoint {d}: it does not verify:\n  " + "\n  ".join(why))
        skipped.append(f"{d}: " + "; ".join(why))
    if unverified is not None:
        say(f"WARNING: no checkpoint under {root} verifies against a {CHECKSUMS}; resuming from {unverified}, "
            f"which has none (written before checksums, or an interrupted save): its files pass their zip CRC "
            f"checks but are not verified")
        return unverified
    raise CheckpointError(f"train.resume=true but no checkpoint under {root} can be resumed:\n  "
                          + "\n  ".join(skipped) +
                          "\nRestore a good checkpoint, or start over with train.resume=false train.overwrite=true.")


# ---------------------------------------------------------------- another run's outputs
_OUTPUTS = (CKPT, FINAL, "metrics.jsonl", "plots", "profile.txt", "diverged.json")


def previous_outputs(train_dir) -> list[Path]:
    """What an earlier run left in ``train_dir`` that a fresh start must not mix with its own: its
    checkpoints and ``final/``. (Its metrics alone, of a run stopped before any checkpoint, are replaced
    by a fresh start as before.)"""
    train_dir = Path(train_dir)
    out = []
    root = checkpoint_root(train_dir)
    if root.is_dir() and any(root.iterdir()):
        out.append(root)
    if (train_dir / FINAL).exists():
        out.append(train_dir / FINAL)
    return out


def remove_previous_outputs(train_dir, say=print) -> list[Path]:
    """``train.overwrite``: remove everything an earlier training run wrote in ``train_dir`` (checkpoints,
    ``final/``, metrics, plots, profile, divergence report) before this run writes anything."""
    gone = []
    for name in _OUTPUTS:
        p = Path(train_dir) / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
        else:
            continue
        gone.append(p)
    for p in Path(train_dir).glob(f".{FINAL}.*"):  # a final/ left half-written by a killed run
        shutil.rmtree(p, ignore_errors=True)
    if gone:
        say("train.overwrite=true: removed the earlier run's " + ", ".join(str(p) for p in gone))
    return gone


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
    try:
        path, _ = engine.load_checkpoint(str(src.parent), tag=src.name, load_optimizer_states=True,
                                         load_lr_scheduler_states=True)
    except (OSError, RuntimeError, EOFError, KeyError, ValueError, zipfile.BadZipFile) as e:
        # verified checkpoints do not get here damaged; one written before checksums may
        raise CheckpointError(f"DeepSpeed could not load the checkpoint {src} ({type(e).__name__}: {e})") from e
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load the checkpoint {src}")
    steps_to_param_device(engine.optimizer)
    f = tag_dir / f"rank_{rank if saved_world == world_size else 0}.pt"
    if not f.is_file():
        raise ResumeMismatchError(f"{tag_dir} has no {f.name}: the checkpoint is incomplete")
    try:
        return torch.load(f, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        raise CheckpointError(f"{f}: unreadable ({type(e).__name__}: {e})") from e


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
    """Plain safetensors of the head + head_config.json + meta.json (with their sha256 under ``checksums``),
    written into a temporary sibling and renamed into place as a whole: ``final/`` is the previous head
    or the new one, never a mix or half of one. A full disk is a ``DiskFullError`` saying the previous
    ``final/`` is unchanged and the last checkpoint (from which a resume writes ``final/``)."""
    train_dir = Path(train_dir)
    out = train_dir / FINAL
    train_dir.mkdir(parents=True, exist_ok=True)
    had = out.is_dir()
    last = latest_checkpoint(train_dir)
    tensors = {k: (v.float() if v.is_floating_point() else v).detach().cpu().contiguous()
               for k, v in state_dict.items()}
    kept = ((f"the previous {out} is unchanged" if had else f"no {out} was written")
            + (f"; the run's last checkpoint {last.name} is complete: free space and rerun with train.resume=true "
               f"to write {FINAL}/ from it" if last is not None else "; free space and rerun"))
    with disk_full_guard(out, kept=kept, action="", needed=sum(t.numel() * t.element_size() for t in tensors.values())):
        _write_final(train_dir, out, tensors, head_cfg, meta)
    return out


def recover_final(train_dir: Path) -> None:
    """Undo what a run killed while publishing ``final/`` left: a previous head renamed aside comes back when
    no ``final/`` is in place, and half-written temporary heads go. Where the filesystem swaps directories in
    one step (:func:`~specheads.fileio.publish_dir`) there is no such window; elsewhere there is one."""
    train_dir = Path(train_dir)
    out = train_dir / FINAL
    for old in sorted(train_dir.glob(f".{FINAL}.old-*")):
        if not out.exists() and (old / WEIGHTS).is_file():
            os.rename(old, out)
        else:
            shutil.rmtree(old, ignore_errors=True)
    for tmp in train_dir.glob(f".{FINAL}.tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)


def _write_final(train_dir: Path, out: Path, tensors: dict, head_cfg: dict, meta: dict) -> None:
    from safetensors.torch import save_file

    recover_final(train_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{FINAL}.tmp-", dir=train_dir))
    try:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt", "producer": "specheads.train"})
        write_json_atomic(tmp / HEAD_CONFIG, head_cfg)
        sums = {name: file_sha256(tmp / name, fsync=True) for name in (WEIGHTS, HEAD_CONFIG)}
        write_json_atomic(tmp / META, {**meta, "checksums": sums})
        publish_dir(tmp, out)  # the previous head and the new one swap whole
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
