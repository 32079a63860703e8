"""The trainer's on-disk layout, and the reader that turns it back into a head.

Layout under ``RunDir(recipe).train`` (the trainer writes it, ``specheads.train.checkpoint``)::

    checkpoints/latest                  tag of the newest verified checkpoint (written by the trainer,
                                        atomically, only after that checkpoint's checksums.json)
    checkpoints/step_N/                 DeepSpeed model + optimizer + scheduler states
        client_state.json               resume fingerprint (settings and input digests), step,
                                        target identity, head config
        rank_{r}.pt                     per-rank data position (feed.state_dict()) and RNG states
        head_config.json, meta.json     so a checkpoint alone can be loaded as a head
        checksums.json                  sha256 and size of every other file in step_N/ (all ranks'),
                                        written last: a checkpoint without it is incomplete, or was
                                        written by a version before checksums
    checkpoints/step_N.universal/       DeepSpeed universal copy of step_N, made when a ZeRO-1/2/3
                                        run resumes on another number of ranks (reused after)
    final/model.safetensors             plain head weights (LoRA merged), fp32
    final/head_config.json              HeadConfig.to_dict()
    final/meta.json                     target identity, aux layer ids, vocab stats, recipe, step,
                                        ``inputs`` (sha256 of the dump manifest or the token rows'
                                        summary.json, and of the vocabulary file) and ``checksums``
                                        (sha256 of model.safetensors and head_config.json)

``final/`` is written under a temporary sibling name and renamed into place when complete, so it
is either the whole previous head or the whole new one. The reader verifies the checksums it finds
(``final/meta.json``'s, a checkpoint's ``checksums.json``) and raises :class:`TrainedHeadError`
naming the file and both digests on a mismatch, or the file and the read error on an unreadable one;
heads written before checksums (none recorded) load unverified.

``load_trained_head(path) -> (head, meta)`` reads any of: a run dir, a train
dir, its ``final/``, a checkpoints dir or one checkpoint (ZeRO-3 partitions
and LoRA adapters included: adapters are merged on load, with the LoRA layout
of :mod:`specheads.heads.lora` that the trainer trains and saves).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specheads.errors import MissingInputError, SpecheadsError
from specheads.fileio import sha256_file as file_sha256
from specheads.heads import HEAD_CLASSES, HeadConfig
from specheads.heads.lora import inject_lora, merged_state_dict

CKPT = "checkpoints"  # under the train dir
LATEST = "latest"  # in CKPT: the tag of the newest complete checkpoint
FINAL = "final"  # under the train dir
WEIGHTS = "model.safetensors"  # in FINAL
HEAD_CONFIG = "head_config.json"  # in FINAL and in each checkpoint
META = "meta.json"  # in FINAL and in each checkpoint
CLIENT = "client_state.json"  # in each checkpoint: resume fingerprint and step
CHECKSUMS = "checksums.json"  # in each checkpoint: sha256 of every other file, written last


class TrainedHeadError(SpecheadsError, ValueError):
    """A trained head or checkpoint on disk is damaged: a file does not match its recorded sha256, is
    missing, or cannot be read."""


# ---------------------------------------------------------------- checksums
def checksummed_files(d: Path) -> list[Path]:
    """The files of a checkpoint directory that its ``checksums.json`` covers (all but itself and
    temporary ``.*.tmp`` files), sorted by relative path."""
    d = Path(d)
    return sorted((p for p in d.rglob("*") if p.is_file() and p.name != CHECKSUMS
                   and not (p.name.startswith(".") and p.name.endswith(".tmp"))),
                  key=lambda p: p.relative_to(d).as_posix())


def compute_checksums(d: Path, *, fsync: bool = False) -> dict:
    """``checksums.json``'s document for directory ``d``: {relative path: {sha256, bytes}}."""
    d = Path(d)
    return {"algorithm": "sha256",
            "files": {p.relative_to(d).as_posix(): {"sha256": file_sha256(p, fsync=fsync), "bytes": p.stat().st_size}
                      for p in checksummed_files(d)}}


def checksum_problems(d: Path, recorded: dict) -> list[str]:
    """What in ``d`` does not match ``recorded`` ({relative path: sha256 or {sha256, bytes}}): one line
    per file naming it and the expected and actual digest (or size, or why it cannot be read)."""
    d = Path(d)
    out = []
    for name, want in recorded.items():
        want_sha = want.get("sha256") if isinstance(want, dict) else want
        want_bytes = want.get("bytes") if isinstance(want, dict) else None
        if not isinstance(want_sha, str):
            out.append(f"{d}: the checksum recorded for {name} is malformed ({want!r})")
            continue
        f = d / name
        if not f.is_file():
            out.append(f"{f}: missing (recorded sha256 {want_sha})")
            continue
        try:
            size = f.stat().st_size
            if want_bytes is not None and size != want_bytes:
                out.append(f"{f}: {size} bytes, expected {want_bytes} (truncated or rewritten; "
                           f"recorded sha256 {want_sha})")
                continue
            have = file_sha256(f)
        except OSError as e:
            out.append(f"{f}: cannot be read ({e})")
            continue
        if have != want_sha:
            out.append(f"{f}: sha256 {have}, expected {want_sha}")
    return out


def read_checksums(d: Path) -> dict | None:
    """A checkpoint's recorded {relative path: {sha256, bytes}}, or None when it has no ``checksums.json``;
    :class:`TrainedHeadError` when that file is unreadable."""
    f = Path(d) / CHECKSUMS
    if not f.is_file():
        return None
    try:
        doc = json.loads(f.read_text())
        files = doc["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not a mapping")
        return files
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TrainedHeadError(f"{f}: unreadable checksums ({type(e).__name__}: {e})") from None


def verify_checkpoint_files(d: Path) -> bool:
    """Check a checkpoint directory against its ``checksums.json``: True when it verifies, False when it has
    none (written before checksums); :class:`TrainedHeadError` naming each bad file otherwise."""
    recorded = read_checksums(d)
    if recorded is None:
        return False
    bad = checksum_problems(d, recorded)
    if bad:
        raise TrainedHeadError(f"checkpoint {d} does not match its {CHECKSUMS}: " + "; ".join(bad))
    return True


def _read_json(f: Path) -> dict:
    try:
        return json.loads(Path(f).read_text())
    except (OSError, ValueError) as e:
        raise TrainedHeadError(f"{f}: unreadable ({type(e).__name__}: {e})") from None


# ---------------------------------------------------------------- reading
def _resolve(path) -> tuple[str, Path]:
    """("final" | "checkpoint", directory) for any path a user may give."""
    p = Path(path)
    for cand in (p, p / FINAL, p / "train" / FINAL):
        if (cand / WEIGHTS).is_file() and (cand / HEAD_CONFIG).is_file():
            return "final", cand
    for cand in (p, p / CKPT, p / "train" / CKPT):
        if (cand / LATEST).is_file():
            return "checkpoint", cand / (cand / LATEST).read_text().strip()
    if (p / HEAD_CONFIG).is_file() and any(p.glob("*model_states.pt")):
        return "checkpoint", p
    raise MissingInputError(
        f"{path}: no trained head here (looked for final/{WEIGHTS}, a train dir, or a DeepSpeed checkpoint)")


def _checkpoint_module_state(tag_dir: Path) -> dict:
    """The head's weights from a DeepSpeed checkpoint (gathered from the partitions under ZeRO-3)."""
    files = sorted(tag_dir.glob("mp_rank_*_model_states.pt"))
    sd = None
    if files:
        try:
            blob = torch.load(files[0], map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001 - torch raises many kinds for a damaged file
            raise TrainedHeadError(f"{files[0]}: unreadable checkpoint file ({type(e).__name__}: {e})") from None
        sd = blob.get("module")
    if not sd or any(v.numel() == 0 for v in sd.values() if torch.is_tensor(v)):  # ZeRO-3: partitioned
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        try:
            sd = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
        except Exception as e:  # noqa: BLE001
            raise TrainedHeadError(f"{tag_dir}: cannot gather the ZeRO-3 weights ({type(e).__name__}: {e})") from None
    return {k[len("head."):]: v for k, v in sd.items() if k.startswith("head.")}


def load_trained_head(path) -> tuple[nn.Module, dict]:
    """``(head, meta)`` from a run dir, a train dir, its ``final/`` or a checkpoint (LoRA merged), fp32, eval mode.

    :class:`~specheads.errors.MissingInputError` when ``path`` holds no trained head;
    :class:`TrainedHeadError` when a file does not match its recorded sha256 (``final/meta.json``'s
    ``checksums``, a checkpoint's ``checksums.json``) or cannot be read, naming the file;
    ``ValueError`` when the weights do not fit the recorded head config.
    """
    kind, d = _resolve(path)
    meta = _read_json(d / META) if (d / META).is_file() else {}
    if kind == "final":
        bad = checksum_problems(d, meta.get("checksums") or {})
        if bad:
            raise TrainedHeadError(f"{d} does not match the checksums in its {META}: " + "; ".join(bad))
    else:
        verify_checkpoint_files(d)
    cfg = HeadConfig.from_dict(_read_json(d / HEAD_CONFIG))
    head = HEAD_CLASSES[cfg.kind](cfg)
    if kind == "final":
        from safetensors.torch import load_file

        try:
            sd = load_file(str(d / WEIGHTS))
        except Exception as e:  # noqa: BLE001 - SafetensorError, OSError: a truncated or damaged file
            raise TrainedHeadError(f"{d / WEIGHTS}: unreadable safetensors file ({type(e).__name__}: {e})") from None
    else:
        sd = _checkpoint_module_state(d)
        if any("lora_" in k for k in sd):
            lora = meta["lora"]
            h = inject_lora(head, r=lora["r"], alpha=lora["alpha"], dropout=lora["dropout"],
                            target_modules=lora["target_modules"])
            h.load_state_dict(sd, strict=True)
            sd = merged_state_dict(h)
            head = HEAD_CLASSES[cfg.kind](cfg)
    missing, unexpected = head.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("inv_freq")]
    if missing or unexpected:
        raise ValueError(f"{d}: weights do not fit the head config: missing {missing}, unexpected {unexpected}")
    head.embed_tokens.weight.requires_grad_(False)
    return head.float().eval(), meta
