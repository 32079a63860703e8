"""The trainer's on-disk layout, and the reader that turns it back into a head.

Layout under ``RunDir(recipe).train`` (the trainer writes it, ``specheads.train.checkpoint``)::

    checkpoints/latest                  tag of the newest complete checkpoint (DeepSpeed)
    checkpoints/step_N/                 DeepSpeed model + optimizer + scheduler states
        client_state.json               resume fingerprint, step, target identity, head config
        rank_{r}.pt                     per-rank data position (feed.state_dict()) and RNG states
        head_config.json, meta.json     so a checkpoint alone can be loaded as a head
    checkpoints/step_N.universal/       DeepSpeed universal copy of step_N, made when a ZeRO-1/2/3
                                        run resumes on another number of ranks (reused after)
    final/model.safetensors             plain head weights (LoRA merged), fp32
    final/head_config.json              HeadConfig.to_dict()
    final/meta.json                     target identity, aux layer ids, vocab stats, recipe, step

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

from specheads.errors import MissingInputError
from specheads.heads import HEAD_CLASSES, HeadConfig
from specheads.heads.lora import inject_lora, merged_state_dict

CKPT = "checkpoints"  # under the train dir
LATEST = "latest"  # in CKPT: the tag of the newest complete checkpoint
FINAL = "final"  # under the train dir
WEIGHTS = "model.safetensors"  # in FINAL
HEAD_CONFIG = "head_config.json"  # in FINAL and in each checkpoint
META = "meta.json"  # in FINAL and in each checkpoint
CLIENT = "client_state.json"  # in each checkpoint: resume fingerprint and step


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
        blob = torch.load(files[0], map_location="cpu", weights_only=False)
        sd = blob.get("module")
    if not sd or any(v.numel() == 0 for v in sd.values() if torch.is_tensor(v)):  # ZeRO-3: partitioned
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        sd = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    return {k[len("head."):]: v for k, v in sd.items() if k.startswith("head.")}


def load_trained_head(path) -> tuple[nn.Module, dict]:
    """``(head, meta)`` from a run dir, a train dir, its ``final/`` or a checkpoint (LoRA merged), fp32, eval mode.

    :class:`~specheads.errors.MissingInputError` when ``path`` holds no trained head;
    ``ValueError`` when the weights do not fit the recorded head config.
    """
    kind, d = _resolve(path)
    cfg = HeadConfig.from_dict(json.loads((d / HEAD_CONFIG).read_text()))
    meta = json.loads((d / META).read_text()) if (d / META).is_file() else {}
    head = HEAD_CLASSES[cfg.kind](cfg)
    if kind == "final":
        from safetensors.torch import load_file

        sd = load_file(str(d / WEIGHTS))
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
