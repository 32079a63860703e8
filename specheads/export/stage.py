"""``specheads export``: trained head -> serving format, conversion, and checks.

Three modes (``main(args)`` dispatches on the parsed CLI arguments):

- ``specheads export SOURCE [key=value ...] [--format F] [--out D] [--k K] [--dtype T]``
  SOURCE is a recipe YAML (the head is read from ``recipe.train_dir``), a run
  directory, a train directory, its ``final/`` or a checkpoint directory.
  Writes the head in the chosen format, re-reads it the way vLLM/SGLang (and
  speculators) would, checks that the reloaded head gives the trained head's
  outputs, writes the README model card (with ``{eval_dir}/report.json`` when
  present) and prints a summary with the launch lines.
- ``specheads export --from DIR --format F --out D``: convert an exported
  head between formats, then validate the result against the source head.
- ``specheads export --check DIR [--target T]``: validate a directory as the
  readers would; with ``--target`` also check verifier, vocabulary and hidden
  size against the target's config (config only, no weights).  Exit 0 on
  pass, 1 on failure.

``--dry-run`` prints the plan and loads nothing.  Every user-facing failure
is an ``ExportError`` with a one-line message (the CLI prints it).

The trainer's contract (``specheads.train.checkpoint.load_trained_head``) is
reached only through :func:`load_trained` below.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

FORMATS = ("speculators", "sglang", "eagle", "mtp")
KIND_FORMATS = {"eagle3": ("speculators", "sglang"), "eagle1": ("eagle",), "mtp": ("mtp",)}
DTYPE_NAMES = ("bfloat16", "float32", "float16")
ARCH_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM"}
# Config facts of the bundled target, so `--check --target smollm2-135m` reads nothing heavy.
BUNDLED_FACTS = {"smollm2-135m": {"hidden_size": 576, "vocab_size": 49152, "num_hidden_layers": 30,
                                  "model_type": "llama", "architectures": ["LlamaForCausalLM"]}}


def _err(msg: str):
    from .common import ExportError

    return ExportError(msg)


def _out(msg: str = "") -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------- trainer adapter
def load_trained(path):
    """``(head, meta_dict)`` from a run dir / train dir / ``final/`` / checkpoint dir.

    Uses the trainer's ``load_trained_head``; falls back to reading the
    ``final/`` layout (model.safetensors + head_config.json + meta.json)
    directly when the trainer module is unavailable.
    """
    p = Path(path)
    if not p.exists():
        raise _err(f"{p}: no trained head here (no such directory; run `specheads train RECIPE` first?)")
    try:
        from specheads.train.checkpoint import load_trained_head
    except ImportError:
        load_trained_head = _load_final_dir
    try:
        head, meta = load_trained_head(p)
    except FileNotFoundError as e:
        hint = ""
        if (p / "config.json").is_file():
            hint = " (it looks like an exported head: use --from DIR --format F --out OUT, or --check DIR)"
        raise _err(f"{p}: not a trained head — {e}{hint}") from None
    except (ValueError, KeyError, RuntimeError, json.JSONDecodeError) as e:  # RuntimeError: size mismatch
        msg = " ".join(str(e).split())
        raise _err(f"{p}: cannot load the trained head: {msg[:400]}") from None
    return head, (meta if isinstance(meta, dict) else {})


def _load_final_dir(p: Path):
    from safetensors.torch import load_file

    from ..heads import HeadConfig, build_head

    for d in (p, p / "final", p / "train" / "final"):
        if (d / "model.safetensors").is_file() and (d / "head_config.json").is_file():
            cfg = HeadConfig.from_dict(json.loads((d / "head_config.json").read_text()))
            head = build_head(cfg)
            missing, unexpected = head.load_state_dict(load_file(str(d / "model.safetensors")), strict=False)
            missing = [k for k in missing if not k.endswith("inv_freq")]
            if missing or unexpected:
                raise ValueError(f"weights do not fit the head config: missing {missing}, unexpected {unexpected}")
            meta = json.loads((d / "meta.json").read_text()) if (d / "meta.json").is_file() else {}
            return head.float().eval(), meta
    raise FileNotFoundError("no final/model.safetensors + head_config.json here")


def run_root(path) -> Path:
    """The run directory that holds a train dir / final dir / checkpoint."""
    p = Path(path).resolve()
    if p.name.startswith("step_") and p.parent.name == "checkpoints":
        p = p.parent.parent
    elif p.name == "checkpoints":
        p = p.parent
    elif p.name == "final":
        p = p.parent
    if p.name == "train" and not (p / "train").is_dir():
        p = p.parent
    return p


# ---------------------------------------------------------------- metadata
def verifier_of(identity: dict, head_cfg) -> tuple[str | None, list[str]]:
    from specheads.target import BUNDLED_HF_ID

    name = identity.get("name")
    verifier = BUNDLED_HF_ID.get(name, name) if name else None
    archs = list(identity.get("architectures") or getattr(head_cfg, "target_architectures", None) or [])
    if not archs:
        mt = identity.get("model_type") or getattr(head_cfg, "target_model_type", None)
        if mt in ARCH_BY_MODEL_TYPE:
            archs = [ARCH_BY_MODEL_TYPE[mt]]
    return verifier, archs


def build_meta(head, trained: dict, k: int, recipe_dict: dict | None = None):
    """ExportMeta from the trainer's meta.json (target identity, vocab stats, recipe, summary)."""
    from .common import ExportMeta

    ident = dict(trained.get("target") or {})
    verifier, archs = verifier_of(ident, head.cfg)
    recipe_d = recipe_dict if recipe_dict is not None else (trained.get("recipe") or {})
    data = None
    if recipe_d:
        srcs = [s.get("path") for s in (recipe_d.get("data") or {}).get("sources", []) if isinstance(s, dict)]
        regen = ((recipe_d.get("data") or {}).get("regenerate") or {}).get("enabled")
        data = {"sources": srcs, "regenerated_by_target": bool(regen)}
    if trained.get("vocab") is not None:
        data = {**(data or {}), "draft_vocab": trained.get("vocab")}
    training = {k_: trained[k_] for k_ in ("step", "precision", "world_size", "eval", "lora", "warm_start")
                if trained.get(k_) is not None}
    if ident:
        training["target"] = ident
    return ExportMeta(
        verifier_name_or_path=verifier,
        verifier_architectures=archs,
        aux_layer_ids=list(trained.get("aux_layer_ids") or getattr(head.cfg, "aux_layer_ids", []) or []),
        speculative_tokens=int(k),
        target_vocab_size=ident.get("vocab_size") or head.cfg.target_vocab_size,
        recipe=recipe_d or {},
        recipe_hash=trained.get("recipe_hash"),
        data=data,
        training=training,
    )


def check_head_vs_identity(head, trained: dict, where: str) -> None:
    """Shape facts of the head must agree with the target it was trained for."""
    ident = trained.get("target") or {}
    cfg = head.cfg
    errs = []
    if ident.get("vocab_size") is not None and int(ident["vocab_size"]) != cfg.target_vocab_size:
        errs.append(f"target vocab {ident['vocab_size']} != head target_vocab_size {cfg.target_vocab_size}")
    if ident.get("hidden_size") is not None and int(ident["hidden_size"]) != cfg.target_hidden_size:
        errs.append(f"target hidden size {ident['hidden_size']} != head target_hidden_size {cfg.target_hidden_size}")
    L = ident.get("num_layers")
    if L is not None and cfg.aux_layer_ids and not all(0 <= int(i) <= int(L) for i in cfg.aux_layer_ids):
        errs.append(f"aux_layer_ids {cfg.aux_layer_ids} out of range for a {L}-layer target")
    if trained.get("aux_layer_ids") and list(trained["aux_layer_ids"]) != list(cfg.aux_layer_ids):
        errs.append(f"meta aux_layer_ids {trained['aux_layer_ids']} != head aux_layer_ids {cfg.aux_layer_ids}")
    if errs:
        raise _err(f"{where}: " + "; ".join(errs))


def check_vocab_mapping(head, where: str) -> None:
    cfg = head.cfg
    if cfg.kind == "eagle3" and not cfg.full_vocab and not bool(head.t2d.any()):
        raise _err(f"{where}: draft vocab {cfg.draft_vocab_size} < target vocab {cfg.target_vocab_size} but the "
                   "head has no d2t/t2d mapping (drafts would map to the wrong token ids); run `specheads vocab` "
                   "and retrain, or set vocab.draft_vocab_size=null")


def _check_format(fmt: str | None, kind: str | None = None) -> str:
    if fmt not in FORMATS:
        raise _err(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if kind is not None and fmt not in KIND_FORMATS.get(kind, ()):
        raise _err(f"a {kind} head cannot be written as {fmt!r}; formats for {kind}: "
                   f"{', '.join(KIND_FORMATS.get(kind, ()))}")
    return fmt


def _dtype(name: str):
    from .common import DTYPES

    if name not in DTYPES:
        raise _err(f"unknown dtype {name!r}; choose one of {', '.join(DTYPE_NAMES)}")
    return DTYPES[name]


# ---------------------------------------------------------------- summary
def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def summary_lines(out: Path, rep, meta, fmt: str) -> list[str]:
    from .card import launch_lines

    files = sorted(p for p in Path(out).iterdir() if p.is_file())
    total = sum(p.stat().st_size for p in files)
    lines = [f"exported {fmt} head to {out} ({_size(total)})"]
    lines += [f"  {p.name:<24} {_size(p.stat().st_size):>10}" for p in files]
    verdict = "PASS" if rep.ok else "FAIL"
    diff = f", max |reloaded - trained| = {rep.max_output_diff:.3g}" if rep.max_output_diff is not None else ""
    lines.append(f"validation ({', '.join(rep.readers)}): {verdict}{diff}")
    lines += [f"  warning: {w}" for w in rep.warnings]
    target = meta.verifier_name_or_path or "TARGET"
    ll = launch_lines(target, str(out), int(meta.speculative_tokens), fmt)
    if fmt in ("speculators", "sglang", "eagle"):
        lines.append(f"vLLM:   {ll['vllm']}")
    if fmt in ("sglang", "eagle"):
        lines.append(f"SGLang: {ll['sglang']}")
    if fmt == "mtp":
        lines.append("MTP: serve with the target (stitch the layers into a native-MTP target checkpoint, "
                     "specheads.export.mtp.stitch_into_target)")
    return lines


# ---------------------------------------------------------------- export from a trained head
def _resolve_source(source: str, overrides: list[str]):
    """-> (recipe or None, head location, run root)."""
    from specheads.config import load_recipe

    p = Path(source)
    if p.is_file():
        if p.suffix not in (".yaml", ".yml", ".json"):
            raise _err(f"{p}: SOURCE must be a recipe YAML, a run directory or a checkpoint directory")
        recipe = load_recipe(p, overrides)
        return recipe, recipe.train_dir, Path(recipe.run_dir)
    if not p.is_dir():
        raise _err(f"{p}: no such recipe file or run/checkpoint directory")
    return None, p, run_root(p)


def _recipe_for_dir(trained: dict, root: Path, overrides: list[str]):
    """The training recipe (from meta.json) re-rooted at ``root``, with command-line overrides."""
    import copy

    from specheads.config import RecipeError, apply_overrides, load_recipe, recipe_from_dict

    d = copy.deepcopy(trained.get("recipe") or {})
    d["run_dir"] = str(root)
    try:
        return recipe_from_dict(apply_overrides(d, list(overrides)), f"{root} (recipe from meta.json)")
    except RecipeError as e:
        if overrides:
            raise
        print(f"specheads: warning: the recipe recorded in meta.json no longer validates ({e}); "
              "using defaults", file=sys.stderr)
        return load_recipe(None, [f"run_dir={root}"])


def run_export(recipe, fmt=None, out=None, k=None, dtype=None, *, source=None, trained=None,
               echo: bool = True) -> Path:
    """Export the head trained by ``recipe`` (or loaded from ``source``); returns the output dir.

    ``trained`` = ``(head, meta_dict)`` when the caller already loaded it."""
    from . import card, validate
    from .convert import save

    where = str(source or recipe.train_dir)
    head, tmeta = trained if trained is not None else load_trained(source or recipe.train_dir)
    fmt = _check_format(fmt or recipe.export.format, head.cfg.kind)
    k = int(k if k is not None else recipe.export.k)
    if not 1 <= k <= 16:
        raise _err(f"--k {k}: the number of speculative tokens must be in 1..16")
    dt = _dtype(dtype or recipe.export.dtype)
    if out is None:
        out = recipe.export.out or Path(recipe.run_dir) / "export" / fmt
    out = Path(out)
    check_head_vs_identity(head, tmeta, where)
    check_vocab_mapping(head, where)
    meta = build_meta(head, tmeta, k, tmeta.get("recipe") or recipe.to_dict())
    if out.exists() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise _err(f"{out}: output directory exists and is not an export directory; choose another --out")
    head = head.float().eval()
    try:
        save(head, meta, out, fmt, dtype=dt)
    except ValueError as e:
        raise _err(f"{where}: cannot write {fmt}: {e}") from None
    ident = tmeta.get("target") or {}
    rep = validate.check(out, target_vocab_size=head.cfg.target_vocab_size,
                         verifier=meta.verifier_name_or_path, reference_head=head, dtype=dt, raise_on_error=False,
                         atol=_atol(dt))
    report = Path(recipe.eval_dir) / "report.json"
    card.write_card(out, meta, fmt=fmt, report_json=report if report.is_file() else None)
    if echo:
        for line in summary_lines(out, rep, meta, fmt):
            _out(line)
        if ident.get("adapter"):
            _out(f"note: the target carries the adapter {ident['adapter']}: serve the merged model as the verifier")
    if not rep.ok:
        raise _err(f"{out}: written but failed validation: " + "; ".join(rep.errors))
    return out


def _atol(dtype) -> float | None:
    import torch

    # bf16 storage rounds every weight (rel. 2^-8): let validate scale its default; fp32 must be exact.
    return 1e-4 if dtype == torch.float32 else None


# ---------------------------------------------------------------- --from conversion
def run_convert(src, fmt, out, dtype="bfloat16", k=None, echo: bool = True) -> Path:
    import dataclasses

    from . import card, validate
    from .convert import MODULES, detect_format, load_any

    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise _err(f"--from {src}: not a directory")
    src_fmt = detect_format(src)
    head, meta, _ = load_any(src)
    _check_format(fmt, head.cfg.kind)
    if src.resolve() == out.resolve():
        raise _err(f"--out {out} is the --from directory; write the conversion elsewhere")
    if k is not None:
        meta = dataclasses.replace(meta, speculative_tokens=int(k))
    if fmt == "speculators" and not bool(head.embed_tokens.weight.any()):
        raise _err(f"--from {src}: has no embedding (a {src_fmt} head shares the target's) but the speculators "
                   "package needs one in the file; export from the trained run instead")
    check_vocab_mapping(head, str(src))
    dt = _dtype(dtype)
    MODULES[fmt].save(head, meta, out, dtype=dt)
    rep = validate.check(out, target_vocab_size=head.cfg.target_vocab_size, reference_head=head, dtype=dt,
                         raise_on_error=False, atol=_atol(dt))
    card.write_card(out, meta, fmt=fmt)
    if echo:
        _out(f"converted {src} ({src_fmt}) -> {fmt}")
        for line in summary_lines(out, rep, meta, fmt):
            _out(line)
    if not rep.ok:
        raise _err(f"{out}: written but failed validation: " + "; ".join(rep.errors))
    return out


# ---------------------------------------------------------------- --check
def target_facts(target: str) -> dict:
    """hidden_size / vocab_size / num_hidden_layers / architectures / verifier of a target, config only."""
    from specheads.target import BUNDLED_HF_ID

    if target in BUNDLED_FACTS:
        return {**BUNDLED_FACTS[target], "verifier": BUNDLED_HF_ID[target], "aliases": {target}}
    p = Path(target)
    if target.endswith(".gguf"):
        if not p.is_file():
            raise _err(f"--target {target}: GGUF file not found")
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(p.parent, gguf_file=p.name)
    else:
        if p.exists() and not (p / "config.json").is_file():
            raise _err(f"--target {target}: not a model directory (no config.json)")
        try:
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(target)
        except (OSError, ValueError) as e:
            raise _err(f"--target {target}: cannot read its config ({str(e).splitlines()[0]})") from None
    c = getattr(cfg, "text_config", None) or cfg
    arch = list(getattr(cfg, "architectures", None) or [])
    return {"hidden_size": int(c.hidden_size), "vocab_size": int(c.vocab_size),
            "num_hidden_layers": int(c.num_hidden_layers), "model_type": c.model_type, "architectures": arch,
            "verifier": target, "aliases": {target, str(p.resolve()) if p.exists() else target}}


def check_against_target(d: Path, facts: dict) -> list[str]:
    """Problems between an export dir and a target (verifier, vocab, hidden size, layer ids)."""
    from .common import read_json, read_side, tensor_shapes_dtypes
    from .convert import detect_format

    problems = []
    c = read_json(d / "config.json")
    side = read_side(d) or {}

    fmt = detect_format(d)
    # verifier name (speculators writes it; others: the side file)
    ver = ((c.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    if ver is None:
        ver = (side.get("meta") or {}).get("verifier_name_or_path")
    if ver is not None and ver not in facts["aliases"] | {facts["verifier"]}:
        problems.append(f"{d}: verifier {ver!r} is not the target {facts['verifier']!r}")
    archs = ((c.get("speculators_config") or {}).get("verifier") or {}).get("architectures")
    if archs and facts.get("architectures") and list(archs) != list(facts["architectures"]):
        problems.append(f"{d}: verifier architectures {archs} != target {facts['architectures']}")
    hc = side.get("head_config") or {}
    layer = c.get("transformer_layer_config") if fmt == "speculators" else c
    vocab = (layer or {}).get("vocab_size", hc.get("target_vocab_size"))
    if vocab is not None and int(vocab) != facts["vocab_size"]:
        problems.append(f"{d}: vocab_size {vocab} != target vocabulary {facts['vocab_size']}")
    th = c.get("target_hidden_size") or hc.get("target_hidden_size") or (layer or {}).get("hidden_size")
    if fmt in ("speculators", "sglang"):
        fc = tensor_shapes_dtypes(d).get("fc.weight")
        aux = c.get("eagle_aux_hidden_state_layer_ids") or hc.get("aux_layer_ids") or []
        if fc and aux and fc[0][1] % len(aux) == 0:
            th = fc[0][1] // len(aux)
        L = facts["num_hidden_layers"]
        bad = [i for i in aux if not 0 <= int(i) <= L]
        if bad:
            problems.append(f"{d}: aux layer ids {bad} out of range for a {L}-layer target")
    elif fmt == "mtp":
        L = c.get("num_hidden_layers")
        if L is not None and int(L) != facts["num_hidden_layers"]:
            problems.append(f"{d}: MTP layers numbered for a {L}-layer target, target has "
                            f"{facts['num_hidden_layers']}")
    if th is not None and int(th) != facts["hidden_size"]:
        problems.append(f"{d}: target hidden size {th} != target's hidden_size {facts['hidden_size']}")
    return problems


def run_check(d, target: str | None = None, echo: bool = True) -> int:
    from . import validate
    from .common import ExportError

    d = Path(d)
    facts = target_facts(target) if target else None
    try:
        rep = validate.check(d, target_vocab_size=facts["vocab_size"] if facts else None, raise_on_error=False)
    except ExportError as e:  # not a head directory at all
        if echo:
            _out(f"{d}: FAILED\n  error: {e}")
        return 1
    problems = list(rep.errors)
    if facts:
        try:
            problems += [p for p in check_against_target(d, facts) if p not in problems]
        except ExportError as e:
            problems.append(str(e))
    if echo:
        verdict = "OK" if not problems else "FAILED"
        _out(f"{d} [{rep.format}] readers={list(rep.readers)}"
             f"{' target=' + target if target else ''}: {verdict}")
        for p in problems:
            _out(f"  error: {p}")
        for w in rep.warnings:
            _out(f"  warning: {w}")
        if rep.checked:
            _out(f"  checked: {', '.join(rep.checked)}{', target config' if facts else ''}")
    return 0 if not problems else 1


# ---------------------------------------------------------------- CLI
def _plan_lines(args) -> list[str]:
    if args.check:
        lines = [f"read {args.check}/config.json and tensor headers; check them as vLLM and SGLang read them"]
        if args.target:
            lines.append(f"read the config of {args.target} (no weights); compare verifier, vocab, hidden size")
        return lines
    if args.from_dir:
        return [f"load the exported head in {args.from_dir} (format detected)",
                f"write {args.format} ({args.dtype or 'bfloat16'}) to {args.out}",
                "validate it and compare outputs with the source head"]
    p = Path(args.source)
    if p.is_file():
        from specheads.config import load_recipe

        recipe = load_recipe(p, args.overrides)
        fmt = args.format or recipe.export.format
        out = args.out or recipe.export.out or Path(recipe.run_dir) / "export" / fmt
        src, evald = recipe.train_dir, recipe.eval_dir
        k, dt = args.k or recipe.export.k, args.dtype or recipe.export.dtype
    else:
        root = run_root(p)
        exp = _peek_export_section(p)  # meta.json only: no weights
        fmt = args.format or exp.get("format", "speculators")
        out = args.out or exp.get("out") or root / "export" / fmt
        src, evald = p, root / "eval"
        k, dt = args.k or exp.get("k", 3), args.dtype or exp.get("dtype", "bfloat16")
    return [f"load the trained head from {src} (final/ or the latest checkpoint)",
            f"write {fmt} ({dt}, k={k}) to {out}",
            "validate it as vLLM and SGLang would read it; compare reloaded outputs with the trained head",
            f"write README.md (with {evald}/report.json when it exists)"]


def _peek_export_section(p: Path) -> dict:
    for d in (p, p / "final", p / "train" / "final"):
        if (d / "meta.json").is_file():
            try:
                return dict((json.loads((d / "meta.json").read_text()).get("recipe") or {}).get("export") or {})
            except (json.JSONDecodeError, AttributeError):
                return {}
    return {}


def main(args) -> int:
    check, from_dir = getattr(args, "check", None), getattr(args, "from_dir", None)
    source, overrides = getattr(args, "source", None), list(getattr(args, "overrides", None) or [])
    if check and from_dir:
        raise _err("--check and --from are separate modes; give one")
    if args.target and not check:
        raise _err("--target goes with --check DIR (an export takes its target from the trained head)")
    if check or from_dir:
        if source or overrides:
            raise _err(f"{'--check' if check else '--from'} takes no SOURCE/overrides (got {source!r})")
    if from_dir:
        if not args.format or not args.out:
            raise _err("--from DIR needs --format F and --out OUT")
        _check_format(args.format)
    elif not check:
        if not source:
            raise _err("give a SOURCE (recipe YAML, run directory or checkpoint directory), --from DIR or --check DIR")
        if args.format:
            _check_format(args.format)
    if args.k is not None and not 1 <= args.k <= 16:
        raise _err(f"--k {args.k}: the number of speculative tokens must be in 1..16")

    if args.dry_run:
        _out("# specheads export — dry run (nothing loaded)")
        _out("# would run:")
        for line in _plan_lines(args):
            _out(f"#   {line}")
        return 0

    if check:
        return run_check(check, args.target)
    if from_dir:
        run_convert(from_dir, args.format, args.out, dtype=args.dtype or "bfloat16", k=args.k)
        return 0
    recipe, loc, root = _resolve_source(source, overrides)
    if recipe is None:
        trained = load_trained(loc)
        recipe = _recipe_for_dir(trained[1], root, overrides)
        run_export(recipe, args.format, args.out, args.k, args.dtype, source=loc, trained=trained)
    else:
        run_export(recipe, args.format, args.out, args.k, args.dtype)
    return 0
