"""Re-read an export directory the way vLLM, SGLang and speculators would,
and fail on anything they would misread or silently ignore.

Reader rules encoded here (vLLM 0.32 ``llama_eagle3``/``llama_eagle`` +
``speculators/algos.py``; SGLang ``llama_eagle3``/``llama_eagle`` +
``model_runner``; speculators 0.9.0 ``Eagle3DraftModel``):

- vLLM maps ``midlayer.`` -> ``layers.0.``, renames ``d2t`` ->
  ``draft_id_to_target_id``, ignores ``t2d``, shares the target embedding
  when ``embed_tokens.weight`` is absent, raises on an unknown name but keeps
  random/zero defaults for a MISSING tensor; with a speculators config it
  assumes ``norm_before_residual: true`` when absent.  Aux layer ids: the
  top-level field first (HF index), else ``eagle_config`` (taken as HF index).
- SGLang reads the ids only from ``eagle_config`` and adds 1 (output index),
  has no ``norm_before_residual`` and silently skips every name it does not
  know (missing and misnamed tensors both go unnoticed).
- speculators 0.9.0 builds ``fc`` as ``3*hidden_size`` (3 aux layers, no
  ``target_hidden_size``) and leaves a missing ``embed_tokens.weight`` as uninitialised memory
  (it takes the verifier's only when that memory holds a NaN; seen with speculators 0.9.0).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from specheads.formats import dflash_native as dflash_fmt
from specheads.formats import eagle as eagle_fmt
from specheads.formats import mtp as mtp_fmt
from specheads.formats import sglang as sglang_fmt
from specheads.formats import speculators as spec_fmt
from specheads.formats import speculators_parallel as parallel_fmt
from specheads.formats.common import ExportError, read_json, tensor_shapes_dtypes
from specheads.formats.convert import detect_format, load_any
from specheads.heads import DFlashHead, Eagle1Head, Eagle3Head, MTPHead, PEagleHead
from specheads.layer_ids import hf_to_output_index, output_to_hf_index

ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64,
             "BOOL": torch.bool}
FLOAT_OK = ("BF16", "F16", "F32")
DEFAULT_READERS = {"speculators": ("vllm", "speculators"), "sglang": ("sglang", "vllm"),
                   "eagle": ("vllm", "sglang"), "mtp": ("vllm", "sglang"), "dflash_native": ("vllm",)}
SPEC_ARCHS = {"eagle3": "Eagle3Speculator", "peagle": "PEagleSpeculator", "dflash": "DFlashSpeculator"}


@dataclass
class ValidationReport:
    dir: str
    format: str
    readers: tuple
    checked: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    max_output_diff: float | None = None
    output_tolerance: float | None = None
    output_scale: float | None = None

    @property
    def ok(self) -> bool:
        return not self.errors

    def __str__(self) -> str:
        lines = [f"{self.dir} [{self.format}] readers={list(self.readers)}: {'OK' if self.ok else 'FAILED'}"]
        lines += [f"  error: {e}" for e in self.errors] + [f"  warning: {w}" for w in self.warnings]
        if self.max_output_diff is not None:
            lines.append(f"  max |output - reference| = {self.max_output_diff:.3g}")
        return "\n".join(lines)


def _expected(head_cls, cfg) -> dict[str, tuple]:
    with torch.device("meta"):
        h = head_cls(cfg)
    return {k: tuple(v.shape) for k, v in h.state_dict().items()}


def _compare_tensors(rep, where, found: dict, expected: dict, required: set, optional: set, reader_note: str,
                     dtype=None):
    for name, (shape, dt) in found.items():
        if name not in expected:
            rep.errors.append(f"{where}: unexpected tensor {name!r} ({reader_note})")
            continue
        if tuple(shape) != tuple(expected[name]):
            rep.errors.append(f"{where}: tensor {name!r} has shape {tuple(shape)}, expected {tuple(expected[name])}")
    for name in sorted(required):
        if name not in found:
            rep.errors.append(f"{where}: missing tensor {name!r} (vLLM keeps its initial values silently; "
                              "SGLang skips it)")
    floats = {n: dt for n, (s, dt) in found.items() if n not in ("d2t", "t2d")}
    kinds = set(floats.values())
    bad = {n: dt for n, dt in floats.items() if dt not in FLOAT_OK}
    for n, dt in bad.items():
        rep.errors.append(f"{where}: tensor {n!r} has dtype {dt}, expected a float dtype (BF16/F16/F32)")
    if len(kinds - set(bad.values())) > 1:
        rep.errors.append(f"{where}: mixed float dtypes {sorted(kinds)}")
    if dtype is not None:
        want = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}[dtype]
        wrong = [n for n, dt in floats.items() if dt in FLOAT_OK and dt != want]
        if wrong:
            rep.errors.append(f"{where}: tensors {wrong[:3]} are {floats[wrong[0]]}, expected {want}")
    if "d2t" in found and found["d2t"][1] != "I64":
        rep.errors.append(f"{where}: tensor 'd2t' has dtype {found['d2t'][1]}, expected int64")
    if "t2d" in found and found["t2d"][1] != "BOOL":
        rep.errors.append(f"{where}: tensor 't2d' has dtype {found['t2d'][1]}, expected bool")
    rep.checked.append("tensor names, shapes and dtypes")


def _flags_explicit(rep, where, c, flags, defaults):
    for f in flags:
        if f not in c:
            rep.errors.append(f"{where}: norm flag {f!r} is implicit (vLLM assumes {defaults[f]}); write it explicitly")
        elif not isinstance(c[f], bool):
            rep.errors.append(f"{where}: field {f!r} must be a bool, got {c[f]!r}")


def _check_common_cfg(rep, where, c, target_vocab_size):
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "vocab_size", "max_position_embeddings", "num_hidden_layers"):
        if key not in c:
            rep.errors.append(f"{where}: missing field {key!r}")
    if "rope_theta" not in c and not (isinstance(c.get("rope_parameters"), dict) and
                                      "rope_theta" in c["rope_parameters"]):
        rep.errors.append(f"{where}: missing field 'rope_theta'")
    if target_vocab_size is not None and c.get("vocab_size") not in (None, target_vocab_size):
        rep.errors.append(f"{where}: vocab_size {c.get('vocab_size')} != target vocabulary {target_vocab_size}")


def _check_vocab_map(rep, d: Path, found, cfg):
    if cfg.full_vocab:
        return
    if "d2t" not in found:
        rep.errors.append(f"{d}: missing tensor 'd2t' while draft_vocab_size {cfg.draft_vocab_size} < "
                          f"target vocab {cfg.target_vocab_size} (drafts would map to the wrong token ids)")
        return
    from specheads.formats.common import load_tensors
    t = load_tensors(d)
    d2t = t.get("d2t")
    if d2t is None:
        return
    ids = torch.arange(d2t.numel()) + d2t.to(torch.int64)
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.target_vocab_size:
        rep.errors.append(f"{d}: d2t maps draft ids outside [0, {cfg.target_vocab_size})")
    if "t2d" in t and int(t["t2d"].sum()) != cfg.draft_vocab_size:
        rep.errors.append(f"{d}: t2d marks {int(t['t2d'].sum())} tokens, expected {cfg.draft_vocab_size}")


def _check_verifier(rep, where, spec_verifier: dict, verifier):
    if verifier is None:
        return
    if isinstance(verifier, str):
        name, archs = verifier, None
    elif isinstance(verifier, dict):
        name, archs = verifier.get("name_or_path"), verifier.get("architectures")
    else:
        name = getattr(verifier, "name_or_path", None) or getattr(verifier, "_name_or_path", None)
        archs = getattr(verifier, "architectures", None)
    if name is not None and spec_verifier.get("name_or_path") not in (name,):
        rep.errors.append(f"{where}: verifier name_or_path {spec_verifier.get('name_or_path')!r} != given target "
                          f"{name!r}")
    if archs and spec_verifier.get("architectures") and list(archs) != list(spec_verifier["architectures"]):
        rep.errors.append(f"{where}: verifier architectures {spec_verifier['architectures']} != target {list(archs)}")


# ------------------------------------------------------------------ formats
def _check_proposal(rep, where, c: dict, algorithm: str, verifier):
    """A speculators config's ``speculators_config``: the algorithm, the first proposal's speculative_tokens
    (returned; None when missing) and the verifier vLLM reads."""
    sc = c.get("speculators_config")
    k = None
    try:
        k = sc["proposal_methods"][0]["speculative_tokens"]
        sc["verifier"]["name_or_path"]
        if sc.get("algorithm") != algorithm:
            rep.errors.append(f"{where}: speculators_config.algorithm {sc.get('algorithm')!r} != {algorithm!r}")
    except (KeyError, IndexError, TypeError):
        rep.errors.append(f"{where}: speculators_config lacks proposal_methods[0].speculative_tokens or "
                          "verifier.name_or_path (vLLM rejects it)")
        sc, k = {"verifier": {}}, None
    _check_verifier(rep, where, sc.get("verifier") or {}, verifier)
    return k


def _check_speculators(rep, d: Path, c: dict, target_vocab_size, verifier, dtype):
    where = str(d / "config.json")
    smt = c.get("speculators_model_type")
    if smt == "dflash":
        return _check_speculators_dflash(rep, d, c, target_vocab_size, verifier, dtype)
    if "model_type" in c:
        rep.errors.append(f"{where}: top-level 'model_type' must be absent in a speculators config")
    for key in ("speculators_version", "draft_vocab_size"):
        if key not in c:
            rep.errors.append(f"{where}: missing field {key!r}")
    if c.get("architectures") != [SPEC_ARCHS[smt]]:
        rep.warnings.append(f"{where}: architectures {c.get('architectures')} (speculators writes ['{SPEC_ARCHS[smt]}'])")
    _flags_explicit(rep, where, c, spec_fmt.NORM_FLAGS,  # vLLM's update_peagle defaults norm_before_residual to False
                    {"norm_before_residual": smt != "peagle", "norm_before_fc": False, "fc_norm": False,
                     "norm_output": False})
    if not c.get("eagle_aux_hidden_state_layer_ids"):
        rep.errors.append(f"{where}: missing field 'eagle_aux_hidden_state_layer_ids' (vLLM would capture its "
                          "default layers)")
    if "target_hidden_size" not in c:
        rep.warnings.append(f"{where}: 'target_hidden_size' absent (write null when equal)")
    tl = c.get("transformer_layer_config")
    if not isinstance(tl, dict):
        rep.errors.append(f"{where}: missing field 'transformer_layer_config'")
        return None
    _check_common_cfg(rep, f"{where}: transformer_layer_config", tl, target_vocab_size)
    if tl.get("model_type", "llama") not in ("llama", "qwen3"):
        rep.errors.append(f"{where}: transformer_layer_config.model_type {tl.get('model_type')!r} (vLLM maps only "
                          "llama/qwen3)")
    _check_proposal(rep, where, c, smt, verifier)
    rep.checked.append("speculators/vLLM config fields")
    if rep.errors:
        return None
    try:
        cfg = spec_fmt.config_to_head_config(c, where)
    except (ExportError, ValueError) as e:
        rep.errors.append(str(e))
        return None
    found = tensor_shapes_dtypes(d)
    expected = _expected(PEagleHead if cfg.kind == "peagle" else Eagle3Head, cfg)
    optional = {"embed_tokens.weight", "d2t", "t2d"}
    required = set(expected) - optional  # a peagle head's mask_hidden included: vLLM refuses to run without it
    if not cfg.full_vocab:
        required |= {"d2t"}
    _compare_tensors(rep, str(d), found, expected, required, optional, "vLLM raises on unknown names", dtype)
    _check_vocab_map(rep, d, found, cfg)
    if "embed_tokens.weight" not in found:
        msg = f"{d}: no 'embed_tokens.weight' (vLLM shares the target's; speculators 0.9.0 leaves it uninitialised)"
        (rep.errors if "speculators" in rep.readers else rep.warnings).append(msg)
    if "speculators" in rep.readers:
        if cfg.num_aux != 3 or cfg.target_hidden_size != cfg.hidden_size:
            rep.errors.append(f"{where}: speculators 0.9.0 builds fc as 3*hidden_size; this head has "
                              f"{cfg.num_aux} aux layers of width {cfg.target_hidden_size}")
    return cfg


def _dflash_tensors(rep, d: Path, cfg, dtype, reader_note: str) -> None:
    """Tensors of a DFlash directory (speculators or native): the target's embedding optional, lm_head and
    d2t only with a draft vocabulary smaller than the target's, never mask_hidden."""
    found = tensor_shapes_dtypes(d)
    if "mask_hidden" in found:
        rep.errors.append(f"{d}: tensor 'mask_hidden' present (vLLM's qwen3_dflash asserts there is none)")
        found = {k: v for k, v in found.items() if k != "mask_hidden"}
    expected = _expected(DFlashHead, cfg)
    optional = {"embed_tokens.weight"} | ({"lm_head.weight", "d2t", "t2d"} if cfg.full_vocab else {"t2d"})
    required = set(expected) - optional
    _compare_tensors(rep, str(d), found, expected, required, optional, reader_note, dtype)
    _check_vocab_map(rep, d, found, cfg)
    if cfg.full_vocab and "lm_head.weight" in found:
        rep.warnings.append(f"{d}: 'lm_head.weight' with a full draft vocabulary: speculators replaces it with the "
                            "verifier's, vLLM uses it")


def _check_speculators_dflash(rep, d: Path, c: dict, target_vocab_size, verifier, dtype):
    where = str(d / "config.json")
    if "model_type" in c:
        rep.errors.append(f"{where}: top-level 'model_type' must be absent in a speculators config")
    for key in ("speculators_version", "draft_vocab_size", "block_size", "aux_hidden_state_layer_ids",
                "mask_token_id"):
        if c.get(key) is None:
            rep.errors.append(f"{where}: missing field {key!r}")
    if c.get("architectures") != [SPEC_ARCHS["dflash"]]:
        rep.warnings.append(f"{where}: architectures {c.get('architectures')} (speculators writes ['DFlashSpeculator'])")
    if c.get("sample_from_anchor"):
        rep.errors.append(f"{where}: sample_from_anchor is true (the anchor is the verified token; specheads' "
                          "DFlash drafts block_size - 1 tokens)")
    if c.get("sliding_window_non_causal", True) is False:
        rep.errors.append(f"{where}: sliding_window_non_causal is false: vLLM 0.32 then runs every draft layer "
                          "causally, but the block attends both ways")
    tl = c.get("transformer_layer_config")
    if not isinstance(tl, dict):
        rep.errors.append(f"{where}: missing field 'transformer_layer_config'")
        return None
    _check_common_cfg(rep, f"{where}: transformer_layer_config", tl, target_vocab_size)
    k = _check_proposal(rep, where, c, "dflash", verifier)
    if k is not None and c.get("block_size") is not None and k != int(c["block_size"]) - 1:
        rep.errors.append(f"{where}: speculative_tokens {k} != block_size - 1 = {int(c['block_size']) - 1}")
    rep.checked.append("speculators/vLLM dflash config fields")
    if rep.errors:
        return None
    try:
        cfg = parallel_fmt.dflash_head_config(c, where)
    except (ExportError, ValueError) as e:
        rep.errors.append(str(e))
        return None
    _dflash_tensors(rep, d, cfg, dtype, "vLLM raises on unknown names")
    if "speculators" in rep.readers and cfg.target_hidden_size != cfg.hidden_size:
        rep.errors.append(f"{where}: speculators 0.9.0 builds DFlash's fc as n_aux*hidden_size; this head reads "
                          f"aux states of width {cfg.target_hidden_size}")
    return cfg


def _check_dflash_native(rep, d: Path, c: dict, target_vocab_size, verifier, dtype):
    where = str(d / "config.json")
    _check_common_cfg(rep, where, c, target_vocab_size)
    if c.get("model_type") != "qwen3":
        rep.errors.append(f"{where}: model_type {c.get('model_type')!r} != 'qwen3' (DFlash layers have q_norm/k_norm)")
    L = c.get("num_target_layers")
    ids = (c.get("dflash_config") or {}).get("target_layer_ids") or []
    if L is None:
        rep.warnings.append(f"{where}: no 'num_target_layers' (which target the layer ids were picked for is unknown)")
    elif any(not 0 <= int(i) < int(L) for i in ids):
        rep.errors.append(f"{where}: dflash_config.target_layer_ids {ids} out of range for {L} target layers "
                          "(output-of-layer numbering: 0 .. L-1)")
    rep.checked.append("native DFlash config fields")
    if rep.errors:
        return None
    try:
        cfg = dflash_fmt.config_to_head_config(c, where)
    except (ExportError, ValueError) as e:
        rep.errors.append(str(e))
        return None
    _dflash_tensors(rep, d, cfg, dtype, "vLLM raises on unknown names")
    return cfg


def _check_sglang(rep, d: Path, c: dict, target_vocab_size, verifier, dtype):
    where = str(d / "config.json")
    _check_common_cfg(rep, where, c, target_vocab_size)
    if c.get("model_type") != "llama":
        rep.errors.append(f"{where}: model_type {c.get('model_type')!r} != 'llama'")
    if c.get("num_hidden_layers") != 1:
        rep.errors.append(f"{where}: num_hidden_layers {c.get('num_hidden_layers')} != 1")
    if c.get("tie_word_embeddings", True) is not False:
        rep.errors.append(f"{where}: tie_word_embeddings must be false (else SGLang uses the embedding as lm_head)")
    if "draft_vocab_size" not in c:
        rep.errors.append(f"{where}: missing field 'draft_vocab_size' (SGLang would load the target lm_head)")
    if "target_hidden_size" in c and c["target_hidden_size"] is None:
        rep.errors.append(f"{where}: 'target_hidden_size' is null (readers use hasattr(); omit it when equal)")
    ec = c.get("eagle_config") if isinstance(c.get("eagle_config"), dict) else {}
    top = c.get("eagle_aux_hidden_state_layer_ids")
    nested = ec.get("eagle_aux_hidden_state_layer_ids")
    if not nested and "sglang" in rep.readers:
        rep.errors.append(f"{where}: missing field 'eagle_config.eagle_aux_hidden_state_layer_ids' (SGLang would "
                          "capture its default layers)")
    if not top and not nested:
        rep.errors.append(f"{where}: missing field 'eagle_aux_hidden_state_layer_ids'")
    if top and nested and list(top) != output_to_hf_index(nested):
        rep.errors.append(f"{where}: eagle_config ids {nested} (SGLang output index) and top-level ids {top} "
                          "(HF index) name different layers")
    if not top and nested and "vllm" in rep.readers:
        rep.errors.append(f"{where}: only eagle_config ids {nested}: vLLM reads them as HF indices, SGLang as "
                          "output indices (off by one); write the top-level field too")
    if c.get("norm_before_residual") and "sglang" in rep.readers:
        rep.errors.append(f"{where}: norm_before_residual=true is ignored by SGLang")
    if "norm_before_residual" not in c:
        rep.warnings.append(f"{where}: norm_before_residual implicit (vLLM and SGLang both use False here)")
    rep.checked.append("SGLang/vLLM config fields")
    if rep.errors:
        return None
    try:
        cfg = sglang_fmt.config_to_head_config(c, where)
    except (ExportError, ValueError) as e:
        rep.errors.append(str(e))
        return None
    found = tensor_shapes_dtypes(d)
    for n in found:
        if n.startswith("layers.0.") and "sglang" in rep.readers:
            rep.errors.append(f"{d}: tensor {n!r} must be named 'midlayer.*' for SGLang (it would skip it)")
    mapped = {sglang_fmt.from_sglang_name(n): v for n, v in found.items()}
    expected = _expected(Eagle3Head, cfg)
    optional = {"embed_tokens.weight", "d2t", "t2d"}
    required = (set(expected) - optional) | (set() if cfg.full_vocab else {"d2t"})
    _compare_tensors(rep, str(d), mapped, expected, required, optional, "SGLang skips unknown names silently", dtype)
    _check_vocab_map(rep, d, mapped, cfg)
    return cfg


def _check_eagle(rep, d: Path, c: dict, target_vocab_size, verifier, dtype):
    where = str(d / "config.json")
    _check_common_cfg(rep, where, c, target_vocab_size)
    if rep.errors:
        return None
    found = tensor_shapes_dtypes(d)
    from specheads.formats.common import head_fields_from_layer_config
    from ..heads import HeadConfig
    kw = head_fields_from_layer_config(c, where)
    kw.update(kind="eagle1", num_layers=int(c.get("num_hidden_layers", 1)),
              fc_bias=bool(c.get("bias", "fc.bias" in found)))
    cfg = HeadConfig(**kw)
    expected = {k: v for k, v in _expected(Eagle1Head, cfg).items() if not k.startswith("lm_head.")}
    if "lm_head.weight" in found:
        rep.errors.append(f"{d}: tensor 'lm_head.weight' present; EAGLE-1 readers share the target lm_head "
                          "(vLLM has no such parameter)")
        found = {k: v for k, v in found.items() if k != "lm_head.weight"}
    _compare_tensors(rep, str(d), found, expected, set(expected) - {"embed_tokens.weight"},
                     {"embed_tokens.weight"}, "no EAGLE-1 reader has this parameter", dtype)
    if "fc.bias" in found and "vllm" in rep.readers:
        from specheads.formats.common import load_tensors
        if bool(load_tensors(d)["fc.bias"].float().abs().max() > 0):
            rep.errors.append(f"{d}: non-zero 'fc.bias': vLLM v1 llama_eagle builds fc without bias and drops it "
                              "(validate with readers=('sglang',) or train with head.fc_bias=false)")
    return cfg


def _check_mtp(rep, d: Path, c: dict, target_vocab_size, verifier, dtype):
    where = str(d / "config.json")
    D = c.get("num_nextn_predict_layers")
    if not D:
        rep.errors.append(f"{where}: missing field 'num_nextn_predict_layers'")
        return None
    L = c.get("num_hidden_layers")
    if L is None:
        rep.errors.append(f"{where}: missing field 'num_hidden_layers'")
        return None
    found = tensor_shapes_dtypes(d)
    try:
        head, _ = mtp_fmt.load(d)
    except ExportError as e:
        rep.errors.append(str(e))
        return None
    exp = {k: tuple(v.shape) for k, v in mtp_fmt.export_tensors(head, int(L)).items()}
    mine = {k: v for k, v in found.items() if k.startswith("model.layers.") and int(k.split(".")[2]) >= int(L)}
    _compare_tensors(rep, str(d), mine, exp, set(exp), set(), "not an MTP layer name", dtype)
    return head.cfg


CHECKS = {"speculators": _check_speculators, "sglang": _check_sglang, "eagle": _check_eagle, "mtp": _check_mtp,
          "dflash_native": _check_dflash_native}


def check(d, *, target_vocab_size=None, verifier=None, reference_head=None, readers=None, dtype=None,
          raise_on_error: bool = True, atol: float | None = None) -> ValidationReport:
    d = Path(d)
    fmt = detect_format(d)
    c = read_json(d / "config.json")
    rep = ValidationReport(str(d), fmt, tuple(readers or DEFAULT_READERS[fmt]))
    cfg = CHECKS[fmt](rep, d, c, target_vocab_size, verifier, dtype)
    if rep.ok and reference_head is not None:
        _compare_outputs(rep, d, reference_head, atol)
    if raise_on_error and rep.errors:
        raise ExportError(str(rep))
    return rep


def _parallel_outputs(ref, head, ids, g):
    """Both heads' logits of one parallel forward on random aux states: every depth of every anchor
    (P-EAGLE), or blocks at a few anchors (DFlash)."""
    cfg = ref.cfg
    B, T = ids.shape
    aux = torch.randn(B, T, cfg.num_aux * cfg.target_hidden_size, generator=g)
    if isinstance(ref, DFlashHead):
        anchors = torch.tensor([[1, T // 2], [2, T - 2]])
        return [ref.block_forward_train(ids, aux, anchors)], [head.block_forward_train(ids, aux, anchors)]
    K = cfg.num_depths
    anchor = torch.arange(T).repeat_interleave(K)[None].expand(B, -1)
    depth = torch.arange(K).repeat(T)[None].expand(B, -1)
    return [ref.parallel_forward(ids, aux, anchor, depth)], [head.parallel_forward(ids, aux, anchor, depth)]


@torch.no_grad()
def _compare_outputs(rep, d: Path, ref, atol):
    head, _, _ = load_any(d)
    if isinstance(ref, (PEagleHead, DFlashHead)) and type(head) is not type(ref):
        rep.errors.append(f"{d}: reloads as a {type(head).__name__}, the reference is a {type(ref).__name__}")
        return
    if isinstance(head, (Eagle1Head, MTPHead)) and not bool(head.lm_head.weight.any()):
        head.lm_head.weight.copy_(ref.lm_head.weight.float())  # shared target lm_head is not exported
    if isinstance(head, DFlashHead) and not bool(head.lm_head.weight.any()):
        head.lm_head.weight.copy_(ref.lm_head.weight.float())  # a full-vocabulary DFlash head shares the target's
    if not bool(head.embed_tokens.weight.any()):
        head.embed_tokens.weight.copy_(ref.embed_tokens.weight.float())  # shared target embedding
    ref = ref.float().eval()
    head.eval()
    g = torch.Generator().manual_seed(1234)
    cfg = ref.cfg
    T = 8
    ids = torch.randint(0, cfg.target_vocab_size, (2, T), generator=g)
    pos = torch.arange(T)[None].expand(2, T)
    if isinstance(ref, (PEagleHead, DFlashHead)):
        a, b = _parallel_outputs(ref, head, ids, g)
    elif isinstance(ref, Eagle3Head):
        from ..heads import ttt_forward
        aux = torch.randn(2, T, cfg.num_aux * cfg.target_hidden_size, generator=g)
        a, b = ttt_forward(ref, ids, aux, steps=2), ttt_forward(head, ids, aux, steps=2)
    elif isinstance(ref, Eagle1Head):
        f = torch.randn(2, T, cfg.hidden_size, generator=g)
        a, b = [ref.forward_step(ids, f, pos)[0]], [head.forward_step(ids, f, pos)[0]]
    else:
        f = torch.randn(2, T, cfg.hidden_size, generator=g)
        a, b = ref.forward_train(ids, f)[0], head.forward_train(ids, f)[0]
    diff = max(float((x - y).abs().max()) for x, y in zip(a, b))
    scale = max(float(x.abs().max()) for x in a)
    tol = atol if atol is not None else 0.03 * max(1.0, scale)
    rep.max_output_diff, rep.output_tolerance, rep.output_scale = diff, tol, scale
    rep.checked.append("outputs vs reference head")
    if diff > tol:
        rep.errors.append(f"{d}: reloaded head's logits differ from the reference by {diff:.3g} (> {tol:.3g})")
