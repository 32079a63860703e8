"""Head configuration shared by every draft head (EAGLE-3, EAGLE-1, MTP, P-EAGLE, DFlash).

`HeadConfig` is a plain dataclass: it holds what the modules need to build
themselves and what the exporters need to write a config a reader (vLLM,
SGLang, speculators) understands.  No I/O here.

Conventions:
- ``aux_layer_ids`` use the Hugging Face ``output_hidden_states`` index
  (0 = embedding output, i = input of decoder layer i).
- ``target_hidden_size`` is the target's hidden size (H_t); the head's own
  width is ``hidden_size`` (H).  EAGLE-3's ``fc`` maps ``n_aux*H_t -> H``.
- ``draft_vocab_size`` == ``target_vocab_size`` means "full vocabulary"
  (``d2t`` all zero, ``t2d`` all True, both omitted on export).
- Parallel drafters draft several tokens in one forward: P-EAGLE ``num_depths``
  (K) tokens, DFlash ``block_size - 1`` (the block's first slot is the
  anchor, the token the target just verified). Their masked slots read the
  embedding of ``mask_token_id``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

KINDS = ("eagle3", "eagle1", "mtp", "peagle", "dflash")
AUX_KINDS = ("eagle3", "peagle", "dflash")  # heads that read the target's aux hidden states
PARALLEL_KINDS = ("peagle", "dflash")  # heads that draft a whole block in one forward


@dataclass
class HeadConfig:
    kind: str = "eagle3"
    hidden_size: int = 64
    intermediate_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None          # default hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None     # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    max_position_embeddings: int = 2048
    target_hidden_size: int | None = None  # default hidden_size
    target_vocab_size: int = 256
    draft_vocab_size: int | None = None  # default target_vocab_size
    aux_layer_ids: list[int] = field(default_factory=list)  # HF hidden-state index
    num_layers: int = 1
    # EAGLE-3 flags (the four flags vLLM reads; all written explicitly on export)
    norm_before_residual: bool = False
    norm_before_fc: bool = False         # RMSNorm over the whole n_aux*H_t input (`input_norm`)
    fc_norm: bool = False                # one RMSNorm per aux chunk (`fc_norm.{i}`)
    norm_output: bool = False            # feed back the normed (not pre-norm) hidden
    qk_norm: bool = False                # Qwen3-style per-head q_norm / k_norm
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    fc_bias: bool | None = None          # EAGLE-1: True (original layout); EAGLE-3: must be False
    tie_embeddings: bool = False
    init_lm_head_from_target: bool = True
    # MTP
    num_mtp_depths: int = 1
    mtp_loss_weights: list[float] | None = None
    # parallel drafters (P-EAGLE, DFlash)
    num_depths: int = 4                  # P-EAGLE: tokens drafted per forward (K)
    block_size: int = 8                  # DFlash: anchor + block_size - 1 drafted tokens
    mask_token_id: int | None = None     # the token id the masked slots embed
    # informational (filled by from_target_config, used by exporters)
    target_model_type: str = "llama"
    target_num_layers: int | None = None
    target_architectures: list[str] = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_id: Any = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"HeadConfig.kind must be one of {KINDS}, got {self.kind!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError("hidden_size is not divisible by num_attention_heads; give head_dim")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.target_vocab_size
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.draft_vocab_size > self.target_vocab_size:
            raise ValueError("draft_vocab_size cannot exceed target_vocab_size")
        if self.fc_bias is None:
            self.fc_bias = self.kind == "eagle1"
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm are mutually exclusive")
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        if self.kind in AUX_KINDS and not self.aux_layer_ids:
            raise ValueError(f"a {self.kind} head needs aux_layer_ids (HF hidden-state index)")
        if self.kind == "dflash":
            self.qk_norm = True          # every DFlash reader builds Qwen3-style layers (q_norm, k_norm)
            if self.block_size < 2:
                raise ValueError(f"a DFlash block needs the anchor and at least one slot, got block_size {self.block_size}")
        if self.kind == "peagle" and self.num_depths < 1:
            raise ValueError(f"P-EAGLE needs num_depths >= 1, got {self.num_depths}")
        if self.kind in PARALLEL_KINDS:
            if self.mask_token_id is None:
                raise ValueError(f"a {self.kind} head needs mask_token_id (the token its masked slots embed)")
            if not 0 <= int(self.mask_token_id) < self.target_vocab_size:
                raise ValueError(f"mask_token_id {self.mask_token_id} is outside the target vocabulary "
                                 f"0..{self.target_vocab_size - 1}")
        if self.mtp_loss_weights is not None:
            self.mtp_loss_weights = [float(w) for w in self.mtp_loss_weights]
            if len(self.mtp_loss_weights) != self.num_mtp_depths:
                raise ValueError("mtp_loss_weights needs one weight per MTP depth")

    # ------------------------------------------------------------------ helpers
    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def tokens_per_forward(self) -> int:
        """Draft tokens one forward of a parallel drafter gives (1 for the others)."""
        return {"peagle": self.num_depths, "dflash": self.block_size - 1}.get(self.kind, 1)

    @property
    def full_vocab(self) -> bool:
        return self.draft_vocab_size == self.target_vocab_size

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HeadConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown HeadConfig fields: {sorted(unknown)}")
        return cls(**d)

    def replace(self, **kw) -> "HeadConfig":
        return dataclasses.replace(self, **kw)

    # --------------------------------------------------------- from a target
    @classmethod
    def from_target_config(
        cls,
        hf_config: Any,
        kind: str,
        draft_vocab_size: int | None = None,
        aux_layer_ids: list[int] | None = None,
        **overrides: Any,
    ) -> "HeadConfig":
        """Build a head config shaped like one decoder layer of the target.

        ``hf_config`` is a transformers config (Llama, Mistral, Qwen2, Qwen3;
        multimodal configs are unwrapped through ``text_config``).  Rope is
        read from ``rope_parameters`` (transformers 5) or ``rope_theta`` /
        ``rope_scaling`` (transformers 4).  ``qk_norm`` defaults to True for
        Qwen3 targets.  Any field can be overridden by keyword.
        """
        c = getattr(hf_config, "text_config", None) or hf_config
        get = (lambda k, d=None: c.get(k, d)) if isinstance(c, dict) else (lambda k, d=None: getattr(c, k, d))
        hidden = int(get("hidden_size"))
        heads = int(get("num_attention_heads"))
        head_dim = get("head_dim") or hidden // heads
        theta, scaling = rope_from_config(c)
        model_type = get("model_type", "llama") or "llama"
        vocab = int(get("vocab_size"))
        kw: dict[str, Any] = dict(
            kind=kind,
            hidden_size=hidden,
            intermediate_size=int(get("intermediate_size")),
            num_attention_heads=heads,
            num_key_value_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=int(get("max_position_embeddings", 2048)),
            target_hidden_size=hidden,
            target_vocab_size=vocab,
            draft_vocab_size=int(draft_vocab_size) if draft_vocab_size else vocab,
            aux_layer_ids=list(aux_layer_ids or []),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            hidden_act=get("hidden_act", "silu") or "silu",
            target_model_type=model_type,
            target_num_layers=get("num_hidden_layers"),
            target_architectures=list(get("architectures") or []),
            bos_token_id=get("bos_token_id"),
            eos_token_id=get("eos_token_id"),
            tie_embeddings=False,
        )
        kw.update(overrides)
        return cls(**kw)


def rope_from_config(c: Any) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from a transformers 4 or 5 config."""
    get = (lambda k, d=None: c.get(k, d)) if isinstance(c, dict) else (lambda k, d=None: getattr(c, k, d))
    params = get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", get("rope_theta", 10000.0))
        rtype = params.get("rope_type", params.get("type", "default"))
        scaling = None
        if rtype not in (None, "default"):
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
            scaling["rope_type"] = rtype
        return float(theta), scaling
    theta = get("rope_theta", 10000.0) or 10000.0
    scaling = get("rope_scaling")
    if isinstance(scaling, dict):
        scaling = dict(scaling)
        rtype = scaling.get("rope_type", scaling.get("type", "default"))
        if rtype in (None, "default"):
            scaling = None
        else:
            scaling["rope_type"] = rtype
    else:
        scaling = None
    return float(theta), scaling


def target_mismatches(cfg: HeadConfig, target: dict, trained_for: dict | None = None) -> list[str]:
    """What stops a head from drafting for a target, one line each (empty: they fit).

    ``target`` is a target identity (``Target.identity()`` or the one a
    checkpoint recorded): ``hidden_size``, ``vocab_size``, ``num_layers`` and
    optionally ``name`` / ``config_hash``. ``trained_for`` is the identity the
    head was trained against; a different ``config_hash`` means another
    target (a fine-tune included). Trainer, export and eval all ask here.
    """
    errs = []
    hidden, vocab, layers = target.get("hidden_size"), target.get("vocab_size"), target.get("num_layers")
    if hidden is not None and int(cfg.target_hidden_size) != int(hidden):
        errs.append(f"head expects target hidden size {cfg.target_hidden_size}, target has {hidden}")
    if hidden is not None and cfg.kind in ("eagle1", "mtp", "dflash") and int(cfg.hidden_size) != int(hidden):
        errs.append(f"{cfg.kind} hidden_size {cfg.hidden_size} != target hidden size {hidden}")
    if vocab is not None and cfg.target_vocab_size and int(cfg.target_vocab_size) != int(vocab):
        errs.append(f"head expects target vocab {cfg.target_vocab_size}, target has {vocab}")
    if layers is not None and cfg.aux_layer_ids:
        bad = [i for i in cfg.aux_layer_ids if not 0 <= int(i) <= int(layers)]
        if bad:
            errs.append(f"aux_layer_ids {bad} out of range for a target with {layers} layers")
    was = (trained_for or {}).get("config_hash")
    if was and target.get("config_hash") and was != target["config_hash"]:
        errs.append(f"head was trained for target {trained_for.get('name')!r} (config hash {was}), "
                    f"this target is {target.get('name')!r} ({target['config_hash']})")
    return errs
