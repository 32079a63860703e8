"""Build the draft head a recipe asks for, shaped by the target it drafts for.

``build_head(recipe, target, vocab=None) -> BuiltHead``:

* ``HeadConfig.from_target_config`` (one decoder layer shaped like the
  target's), EAGLE-3 aux layer ids from the recipe or the target's default
  (``Target.aux_layer_ids``; EAGLE-1 and MTP read no aux states);
* draft vocabulary from the vocab stage (``RunDir(recipe).vocab``) for EAGLE-3
  when ``vocab.draft_vocab_size`` is smaller than the target vocab
  (EAGLE-1 and MTP share the target's lm_head: full vocabulary);
* frozen target embedding; ``lm_head`` rows from the target's lm_head at the
  draft ids when ``head.init_lm_head_from_target``;
* warm start from an exported head directory (``export.convert.load_any``);
* optional LoRA adapters (peft) on the warm-started head.

Every contradiction between the recipe, the vocab, a warm-start head and the
target is a :class:`HeadShapeError` that says what differs.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from specheads.data.vocab import load_vocab
from specheads.errors import SpecheadsError
from specheads.formats.convert import load_any
from specheads.heads.lora import inject_lora
from specheads.heads import HEAD_CLASSES, HeadConfig
from specheads.heads.config import AUX_KINDS, PARALLEL_KINDS, target_mismatches
from specheads.rundir import RunDir

log = logging.getLogger("specheads.train")


class HeadShapeError(SpecheadsError, ValueError):
    pass


# heads with their own (possibly smaller) draft vocabulary; EAGLE-1 and MTP share the target's lm_head
DRAFT_VOCAB_KINDS = ("eagle3", "peagle", "dflash")


@dataclass
class BuiltHead:
    head: nn.Module  # the module trained (LoRA layers injected when enabled)
    cfg: object  # HeadConfig
    d2t: torch.Tensor | None
    t2d: torch.Tensor | None
    vocab_stats: dict = field(default_factory=dict)
    lora: bool = False
    warm_start: dict | None = None  # {"path", "format", "meta"}


def target_weights(target) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(embedding [Vt, H], lm_head weight [Vt, H], lm_head bias or None) of a target."""
    emb = target.embed_tokens.weight
    lm = target.lm_head
    return emb.detach(), lm.weight.detach(), (lm.bias.detach() if getattr(lm, "bias", None) is not None else None)


def resolve_vocab(recipe, target, vocab=None):
    """(d2t, t2d, stats); (None, None, stats) for the full vocabulary."""
    Vt = int(target.vocab_size)
    kind = recipe.head.kind
    want = recipe.vocab.draft_vocab_size
    if kind not in DRAFT_VOCAB_KINDS:
        if want is not None and want < Vt:
            log.info("head.kind=%s shares the target lm_head: training over the full vocabulary (%d), "
                     "vocab.draft_vocab_size=%s is ignored", kind, Vt, want)
        return None, None, {"draft_vocab_size": Vt, "target_vocab_size": Vt, "identity": True}
    if vocab is None:
        if want is None or want >= Vt:
            return None, None, {"draft_vocab_size": Vt, "target_vocab_size": Vt, "identity": True}
        vdir = RunDir(recipe).vocab
        if not (vdir / "vocab.safetensors").is_file() and not vdir.is_dir():
            raise HeadShapeError(
                f"vocab.draft_vocab_size={want} < target vocab {Vt} but no draft vocabulary at {vdir}: "
                f"run `specheads vocab` first (or set vocab.draft_vocab_size=null for the full vocabulary)")
        vocab = load_vocab(vdir)
    d2t, t2d, stats = vocab
    d2t = None if d2t is None else torch.as_tensor(d2t, dtype=torch.int64)
    t2d = None if t2d is None else torch.as_tensor(t2d, dtype=torch.bool)
    if d2t is None:
        return None, None, dict(stats or {})
    if t2d is not None and t2d.numel() != Vt:
        raise HeadShapeError(
            f"draft vocabulary was built for a target vocab of {t2d.numel()} tokens, but the target "
            f"{target.name} has {Vt}: rebuild it with `specheads vocab`")
    if want is not None and d2t.numel() != want and want < Vt:
        raise HeadShapeError(
            f"vocab.draft_vocab_size={want} but the vocabulary at {RunDir(recipe).vocab} has {d2t.numel()} "
            f"tokens: rebuild it or set vocab.draft_vocab_size={d2t.numel()}")
    ids = torch.arange(d2t.numel()) + d2t
    if d2t.numel() and (int(ids.min()) < 0 or int(ids.max()) >= Vt):
        raise HeadShapeError(f"d2t maps draft ids outside the target vocabulary of {Vt} tokens")
    if d2t.numel() == Vt:
        return None, None, dict(stats or {})
    return d2t, t2d, dict(stats or {})


DEFAULT_NUM_LAYERS = {"peagle": 4, "dflash": 5}   # speculators' P-EAGLE and the published DFlash heads


def default_mask_token_id(target) -> int:
    """The token masked slots embed when the recipe names none: the target's last id. The embedding is
    frozen, so the head learns what that row means in a masked slot; only an anchor equal to it (a
    token the target's tokenizer never produces in text) could be confused with a mask."""
    return int(target.vocab_size) - 1


def head_config(recipe, target, draft_vocab_size: int):
    h = recipe.head
    try:
        aux = target.aux_layer_ids(h.aux_layer_ids, kind=h.kind) if h.kind in AUX_KINDS else []
    except ValueError as e:
        raise HeadShapeError(str(e)) from None
    over = dict(num_layers=h.num_layers or DEFAULT_NUM_LAYERS.get(h.kind, 1),
                norm_before_residual=h.norm_before_residual,
                init_lm_head_from_target=h.init_lm_head_from_target, num_mtp_depths=h.num_mtp_depths,
                mtp_loss_weights=h.mtp_loss_weights)
    if h.kind in PARALLEL_KINDS:
        mask = h.mask_token_id if h.mask_token_id is not None else default_mask_token_id(target)
        if mask >= int(target.vocab_size):
            raise HeadShapeError(f"head.mask_token_id={mask} is outside the target vocabulary "
                                 f"(0..{int(target.vocab_size) - 1})")
        over.update(num_depths=h.num_depths, block_size=h.block_size, mask_token_id=int(mask))
    if h.fc_bias is not None:
        if h.fc_bias and h.kind in AUX_KINDS:
            raise HeadShapeError("head.fc_bias=true: EAGLE-3 heads have no fc bias (speculators and SGLang read none)")
        over["fc_bias"] = bool(h.fc_bias)
    if h.intermediate_size is not None:
        over["intermediate_size"] = int(h.intermediate_size)
    try:
        return HeadConfig.from_target_config(target.config, h.kind, draft_vocab_size=draft_vocab_size,
                                             aux_layer_ids=aux, **over)
    except ValueError as e:
        raise HeadShapeError(f"head config: {e}") from None


def check_head_against_target(cfg, target, where: str = "head") -> None:
    """Shape facts of a head config that must agree with the target (``heads.config.target_mismatches``)."""
    errs = target_mismatches(cfg, target.identity())
    if errs:
        raise HeadShapeError(f"{where} contradicts the target {target.name}: " + "; ".join(errs))


def _warm_start(recipe, target, cfg, d2t):
    path = recipe.head.warm_start
    head, meta, fmt = load_any(path)
    wcfg = head.cfg
    where = f"head.warm_start={path} ({fmt})"
    if wcfg.kind != cfg.kind:
        raise HeadShapeError(f"{where} is a {wcfg.kind} head but head.kind={cfg.kind}")
    check_head_against_target(wcfg, target, where)
    diffs = [f"{k}: {getattr(wcfg, k)} (warm start) != {getattr(cfg, k)} (recipe)"
             for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                       "head_dim", "draft_vocab_size", "aux_layer_ids", "num_layers", "norm_before_residual")
             + (("num_mtp_depths",) if cfg.kind == "mtp" else ())
             + (("num_depths", "mask_token_id") if cfg.kind == "peagle" else ())
             + (("block_size", "mask_token_id") if cfg.kind == "dflash" else ())
             if getattr(wcfg, k) != getattr(cfg, k)]
    if diffs:
        raise HeadShapeError(f"{where} does not match the recipe's head: " + "; ".join(diffs))
    if d2t is not None and hasattr(head, "d2t") and not torch.equal(head.d2t.cpu(), d2t.cpu()):
        raise HeadShapeError(f"{where} uses a different draft vocabulary (d2t) than {RunDir(recipe).vocab}")
    tid = (meta or {}).get("target", {}) if isinstance(meta, dict) else {}
    if isinstance(tid, dict) and tid.get("config_hash") and tid["config_hash"] != target.config_hash:
        log.warning("%s was trained for target %s (%s), training for %s (%s)", where, tid.get("name"),
                    tid.get("config_hash"), target.name, target.config_hash)
    return head, {"path": str(path), "format": fmt, "meta": meta if isinstance(meta, dict) else {}}


def _add_lora(head, lcfg):
    """Trainable LoRA adapters (the layout ``formats.trained`` reads back) on a frozen head."""
    head.requires_grad_(False)
    head = inject_lora(head, r=lcfg.r, alpha=lcfg.alpha, dropout=lcfg.dropout, target_modules=lcfg.target_modules)
    n = 0
    for name, p in head.named_parameters():
        if "lora_" in name:
            p.requires_grad_(True)
            n += p.numel()
    if n == 0:
        raise HeadShapeError(f"head.lora.target_modules={lcfg.target_modules} matched no module of the head")
    return head


def build_head(recipe, target, vocab=None) -> BuiltHead:
    """The head a recipe describes, initialised from (and checked against) the target."""
    Vt = int(target.vocab_size)
    d2t, t2d, stats = resolve_vocab(recipe, target, vocab)
    Vd = int(d2t.numel()) if d2t is not None else Vt
    cfg = head_config(recipe, target, Vd)
    check_head_against_target(cfg, target, "recipe head")
    emb, lm_w, _ = target_weights(target)
    if tuple(emb.shape) != (Vt, cfg.hidden_size) and cfg.kind not in ("eagle3", "peagle"):
        raise HeadShapeError(f"target embedding {tuple(emb.shape)} != ({Vt}, {cfg.hidden_size})")
    warm = None
    if recipe.head.warm_start:
        head, warm = _warm_start(recipe, target, cfg, d2t)
        cfg = head.cfg
        head = head.float()
        with torch.no_grad():  # the embedding is the target's, frozen (some formats leave it out)
            head.embed_tokens.weight.copy_(emb.to(head.embed_tokens.weight.dtype))
            head.embed_tokens.weight.requires_grad_(False)
            if cfg.kind in ("eagle1", "mtp"):
                head.lm_head.weight.copy_(lm_w)
                head.lm_head.weight.requires_grad_(False)
            if cfg.kind == "dflash":  # the target's rows, frozen (an export leaves them out at full vocabulary)
                ids = head.draft_to_target(torch.arange(cfg.draft_vocab_size, device=head.d2t.device))
                head.lm_head.weight.copy_(lm_w[ids.to(lm_w.device)].to(head.lm_head.weight.dtype))
                head.lm_head.weight.requires_grad_(False)
    else:
        head = HEAD_CLASSES[cfg.kind](cfg)
        if hasattr(head, "embed_tokens") and tuple(head.embed_tokens.weight.shape) != tuple(emb.shape):
            raise HeadShapeError(f"target embedding {tuple(emb.shape)} does not fit the head's "
                                 f"embed_tokens {tuple(head.embed_tokens.weight.shape)}: the head's hidden "
                                 f"size must equal the target's")
        head.init_from_target(emb.float().cpu(), lm_w.float().cpu(), d2t)
    lora = bool(recipe.head.lora.enabled)
    if lora:
        if not recipe.head.warm_start:
            log.warning("head.lora.enabled without head.warm_start: LoRA adapters on a freshly initialised head")
        head = _add_lora(head, recipe.head.lora)
    return BuiltHead(head=head, cfg=cfg, d2t=d2t, t2d=t2d, vocab_stats=stats, lora=lora, warm_start=warm)
