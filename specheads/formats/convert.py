"""Format detection, load-anything, and format conversion."""
from __future__ import annotations

from pathlib import Path

import torch

from . import dflash_native, eagle, mtp, sglang, speculators
from .common import ExportError, read_json, read_side

MODULES = {"speculators": speculators, "sglang": sglang, "eagle": eagle, "mtp": mtp, "dflash_native": dflash_native}
SPECULATORS_TYPES = ("eagle3", "peagle", "dflash")
# the formats that can hold each head kind (the others would drop what makes the head work)
KIND_FORMATS = {"eagle3": ("speculators", "sglang"), "eagle1": ("eagle",), "mtp": ("mtp",),
                "peagle": ("speculators",), "dflash": ("speculators", "dflash_native")}


def check_kind_format(kind: str, fmt: str) -> None:
    """A head kind written in a format that cannot hold it is an ExportError naming both."""
    if fmt not in MODULES:
        raise ExportError(f"unknown format {fmt!r}; choose one of {sorted(MODULES)}")
    if kind in KIND_FORMATS and fmt not in KIND_FORMATS[kind]:
        raise ExportError(f"a {kind} head cannot be written as {fmt!r}; formats for {kind}: "
                          f"{', '.join(KIND_FORMATS[kind])}")


def detect_format(d) -> str:
    d = Path(d)
    if not d.is_dir():
        raise ExportError(f"{d}: not a directory")
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ExportError(f"{d}: not a head directory (no config.json)")
    c = read_json(cfg_path)
    if "speculators_model_type" in c:
        if c["speculators_model_type"] not in SPECULATORS_TYPES:
            raise ExportError(f"{cfg_path}: speculators_model_type {c['speculators_model_type']!r} is not supported "
                              f"(only {', '.join(repr(t) for t in SPECULATORS_TYPES)})")
        return "speculators"
    if dflash_native.is_native(c):
        return "dflash_native"
    archs = c.get("architectures") or []
    if any(a in sglang.ARCHS for a in archs):
        return "sglang"
    if c.get("num_nextn_predict_layers"):
        return "mtp"
    if any(a in eagle.ARCHS for a in archs):
        side = read_side(d)
        if side and side.get("format") not in (None, "eagle"):
            raise ExportError(f"{d}: {side.get('format')} side file but an EAGLE-1 config")
        if c.get("num_hidden_layers", 1) <= 2 and "fc.weight" in _names(d):
            return "eagle"
    raise ExportError(f"{cfg_path}: not a draft head (architectures {archs}; no speculators_model_type, "
                      "no num_nextn_predict_layers)")


def _names(d: Path) -> set[str]:
    from .common import tensor_shapes_dtypes
    try:
        return set(tensor_shapes_dtypes(d))
    except ExportError:
        return set()


def load_any(d, dtype: torch.dtype = torch.float32, **kw):
    """-> (head, meta, format)."""
    fmt = detect_format(d)
    head, meta = MODULES[fmt].load(d, dtype=dtype, **kw)
    return head, meta, fmt


def convert(src, fmt: str, out, dtype: torch.dtype = torch.bfloat16, **save_kw) -> Path:
    if fmt not in MODULES:
        raise ExportError(f"unknown format {fmt!r}; choose one of {sorted(MODULES)}")
    head, meta, _ = load_any(src)
    if head.cfg.kind in ("peagle", "dflash"):
        check_kind_format(head.cfg.kind, fmt)
    return MODULES[fmt].save(head, meta, out, dtype=dtype, **save_kw)


def save(head, meta, out_dir, fmt: str, dtype: torch.dtype = torch.bfloat16, **kw) -> Path:
    if fmt not in MODULES:
        raise ExportError(f"unknown format {fmt!r}; choose one of {sorted(MODULES)}")
    if head.cfg.kind in ("peagle", "dflash"):  # a P-EAGLE head is an Eagle3Head: sglang's save would take it
        check_kind_format(head.cfg.kind, fmt)
    return MODULES[fmt].save(head, meta, out_dir, dtype=dtype, **kw)


def load_head_for(d, target, dtype: torch.dtype = torch.float32):
    """``(head, meta)``: an exported head made whole for ``target`` and checked against it.

    Layouts that share the target's weights (SGLang's leaves out the embedding;
    EAGLE-1 and MTP use the target's lm_head) get them copied in; a head whose
    shapes, layer ids or recorded target identity do not fit is an ExportError
    naming the directory — before any generation starts.
    """
    from specheads.heads.config import target_mismatches

    head, meta, _fmt = load_any(d, dtype=dtype)
    if head.cfg.kind == "dflash":  # checked before the target's rows are copied in; the depth fixes the layer ids
        problems = dflash_native.target_problems(head.cfg, target.identity())
        if problems:
            raise ExportError(f"{d}: head does not match the target: " + "; ".join(problems))
    emb = getattr(head, "embed_tokens", None)
    if emb is not None and not bool(emb.weight.any()):
        emb.weight.data.copy_(target.embed_tokens.weight.to(emb.weight.dtype))
    lm = getattr(head, "lm_head", None)
    if head.cfg.kind in ("eagle1", "mtp") and lm is not None and not bool(lm.weight.any()):
        lm.weight.data.copy_(target.lm_head.weight.to(lm.weight.dtype))
    if head.cfg.kind == "dflash" and lm is not None and not bool(lm.weight.any()):
        # a full-vocabulary DFlash head ships no lm_head: it is the target's (draft ids = target ids)
        ids = head.draft_to_target(torch.arange(head.cfg.draft_vocab_size, device=head.d2t.device))
        lm.weight.data.copy_(target.lm_head.weight[ids.to(target.lm_head.weight.device)].to(lm.weight.dtype))
    problems = target_mismatches(head.cfg, target.identity(), trained_for=meta.target_config if meta else None)
    if problems:
        raise ExportError(f"{d}: head does not match the target: " + "; ".join(problems))
    return head, meta
