"""``specheads export``: trained head -> serving format, conversion, and checks.

- :func:`run_export` (the stage): the head trained by a recipe (``RunDir(recipe).train``),
  or read from a run / train / ``final/`` / checkpoint directory, written in
  ``recipe.export.format``; re-read the way vLLM/SGLang (and speculators) would,
  checked to give the trained head's outputs, with the README model card
  (holding ``{eval_dir}/report.json`` when present) and the launch lines.
- :func:`run_convert`: an exported head rewritten in another format, validated
  against the source head.
- :func:`run_check`: a directory validated as the readers would; with a target,
  also verifier, vocabulary and hidden size against the target's config (no weights);
  and every file against the sha256 the export recorded.

An export is published whole: it is written into a hidden sibling ``.{out}.tmp-{pid}``, validated
there, sealed (``specheads.json`` gets ``checksums``: the sha256 of every other file, and ``lineage``:
the trained weights it was made from), and only then renamed over ``out`` (the old export swapped
aside and removed). A run killed at any point leaves the old complete export or the new one, never a
mix; its leftover siblings are removed by the next export of ``out``, and never read as an export.
Both :func:`run_export` and :func:`run_convert` hold ``out``'s lock (:func:`specheads.rundir.output_lock`).

Every user-facing failure is an ``ExportError`` with a one-line message.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shutil
import sys
from pathlib import Path

import torch

from specheads.config import RecipeError, apply_overrides, load_recipe, recipe_from_dict
from specheads.formats import card
from specheads.fileio import disk_full_guard, fsync_dir, publish_dir, write_json_atomic
from specheads.fileio import sha256_file as file_sha256
from specheads.formats.common import (DTYPES, SIDE_FILE, ExportError, ExportMeta, read_json, read_side,
                                      tensor_shapes_dtypes)
from specheads.formats.convert import KIND_FORMATS, MODULES, detect_format, load_any, save
from specheads.formats.trained import _resolve as resolve_trained
from specheads.formats.trained import load_trained_head
from specheads.heads.config import target_mismatches
from specheads.rundir import RunDir, output_lock, stage_lock
from specheads.target import BUNDLED_HF_ID, TargetError, target_facts

from . import validate

FORMATS = tuple(MODULES)
PARALLEL_KINDS = ("peagle", "dflash")
ARCH_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM"}


def _out(msg: str = "") -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------- the trained head
def load_trained(path):
    """``(head, meta_dict)`` from a run dir / train dir / ``final/`` / checkpoint dir."""
    p = Path(path)
    if not p.exists():
        raise ExportError(f"{p}: no trained head here (no such directory; run `specheads train RECIPE` first?)")
    try:
        head, meta = load_trained_head(p)
    except FileNotFoundError as e:
        hint = ""
        if (p / "config.json").is_file():
            hint = " (it looks like an exported head: use --from DIR --format F --out OUT, or --check DIR)"
        raise ExportError(f"{p}: not a trained head — {e}{hint}") from None
    except (ValueError, KeyError, RuntimeError, json.JSONDecodeError) as e:  # RuntimeError: size mismatch
        msg = " ".join(str(e).split())
        raise ExportError(f"{p}: cannot load the trained head: {msg[:400]}") from None
    return head, (meta if isinstance(meta, dict) else {})


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
    ident = dict(trained.get("target") or {})
    verifier, archs = verifier_of(ident, head.cfg)
    recipe_d = recipe_dict if recipe_dict is not None else (trained.get("recipe") or {})
    verifier = (recipe_d.get("target") or {}).get("verifier") or verifier
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
    """The head must fit the target it was trained for (as its meta.json recorded it)."""
    errs = target_mismatches(head.cfg, trained.get("target") or {})
    if trained.get("aux_layer_ids") and list(trained["aux_layer_ids"]) != list(head.cfg.aux_layer_ids):
        errs.append(f"meta aux_layer_ids {trained['aux_layer_ids']} != head aux_layer_ids {head.cfg.aux_layer_ids}")
    if errs:
        raise ExportError(f"{where}: " + "; ".join(errs))


def check_vocab_mapping(head, where: str) -> None:
    cfg = head.cfg
    if cfg.kind in ("eagle3",) + PARALLEL_KINDS and not cfg.full_vocab and not bool(head.t2d.any()):
        raise ExportError(f"{where}: draft vocab {cfg.draft_vocab_size} < target vocab {cfg.target_vocab_size} but the "
                   "head has no d2t/t2d mapping (drafts would map to the wrong token ids); run `specheads vocab` "
                   "and retrain, or set vocab.draft_vocab_size=null")


def _check_format(fmt: str | None, kind: str | None = None) -> str:
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if kind is not None and fmt not in KIND_FORMATS.get(kind, ()):
        raise ExportError(f"a {kind} head cannot be written as {fmt!r}; formats for {kind}: "
                   f"{', '.join(KIND_FORMATS.get(kind, ()))}")
    return fmt


def _dtype(name: str):
    if name not in DTYPES:
        raise ExportError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


# ---------------------------------------------------------------- summary
def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def summary_lines(out: Path, rep, meta, fmt: str, files_in: Path | None = None, kind: str | None = None) -> list[str]:
    """What an export wrote (the files of ``files_in``, default ``out``), its validation and launch lines."""
    files = sorted(p for p in Path(files_in or out).iterdir() if p.is_file())
    total = sum(p.stat().st_size for p in files)
    lines = [f"exported {fmt} head to {out} ({_size(total)})"]
    lines += [f"  {p.name:<24} {_size(p.stat().st_size):>10}" for p in files]
    verdict = "PASS" if rep.ok else "FAIL"
    lines.append(f"validation ({', '.join(rep.readers)}): {verdict}")
    if rep.max_output_diff is not None:
        # bf16 storage rounds every weight, so the reloaded logits move a little; the tolerance says how much may
        how = {"peagle": "every depth of random anchors", "dflash": "random blocks"}.get(kind, "2 TTT steps")
        lines.append(f"  reloaded as the readers load it, the head's draft logits (random inputs, {how}) differ "
                     f"from the trained head's by at most {rep.max_output_diff:.3g} (tolerance {rep.output_tolerance:.3g}; "
                     f"largest logit {rep.output_scale:.3g})")
    lines += [f"  warning: {w}" for w in rep.warnings]
    target = meta.verifier_name_or_path or "TARGET"
    ll = card.launch_lines(target, str(out), int(meta.speculative_tokens), fmt, kind)
    if fmt in ("speculators", "sglang", "eagle", "dflash_native"):
        lines.append(f"vLLM:   {ll['vllm']}")
    if fmt in ("sglang", "eagle") and ll["sglang"]:
        lines.append(f"SGLang: {ll['sglang']}")
    if fmt == "mtp":
        lines.append("MTP: serve with the target (stitch the layers into a native-MTP target checkpoint, "
                     "specheads.formats.mtp.stitch_into_target)")
    return lines


# ---------------------------------------------------------------- export from a trained head
def trained_meta(path) -> dict:
    """A trained run's meta.json (target identity, recipe, summary) without loading weights."""
    p = Path(path)
    for d in (p, p / "final", p / "train" / "final"):
        if (d / "meta.json").is_file():
            try:
                meta = json.loads((d / "meta.json").read_text())
            except json.JSONDecodeError as e:
                raise ExportError(f"{d / 'meta.json'}: not valid JSON ({e})") from None
            return meta if isinstance(meta, dict) else {}
    return load_trained(p)[1]  # a checkpoint directory: its meta comes with the weights


def recipe_for_run(path, overrides: list[str] = ()):
    """The recipe a run was trained with (from its meta.json), re-rooted at the run directory.

    ``path`` is a run, train, ``final/`` or checkpoint directory; ``overrides``
    (``export.format=sglang``, ...) apply on top.
    """
    p = Path(path)
    if not p.is_dir():
        raise ExportError(f"{p}: no such recipe file or run/checkpoint directory")
    root = run_root(p)
    d = copy.deepcopy(trained_meta(p).get("recipe") or {})
    d["run_dir"] = str(root)
    try:
        return recipe_from_dict(apply_overrides(d, list(overrides)), f"{root} (recipe from meta.json)")
    except RecipeError as e:
        if overrides:
            raise
        print(f"specheads: warning: the recipe recorded in meta.json no longer validates ({e}); "
              "using defaults", file=sys.stderr)
        return load_recipe(None, [f"run_dir={root}"])


# ---------------------------------------------------------------- checksums, lineage, publishing
def _recorded_sha(v) -> str | None:
    """A recorded checksum, written as the hex digest or as {"sha256": hex, ...}."""
    if isinstance(v, dict):
        v = v.get("sha256")
    return v.removeprefix("sha256:") if isinstance(v, str) else None


def lineage_of(path) -> dict | None:
    """What an export is made from: the trained directory (``final/`` or a checkpoint) that
    ``load_trained`` reads for ``path``, its step and recipe hash, and the sha256 of its weights, read from
    what the trainer recorded (``final/meta.json``'s ``checksums``, a checkpoint's ``checksums.json``; the
    reader verifies them on load) or computed here when it recorded none. None when ``path`` holds none."""
    try:
        kind, d = resolve_trained(path)
    except (OSError, ValueError, LookupError):  # MissingInputError (a FileNotFoundError) included
        return None
    d = Path(d).resolve()
    try:
        meta = json.loads((d / "meta.json").read_text()) if (d / "meta.json").is_file() else {}
    except (OSError, ValueError):
        meta = {}
    meta = meta if isinstance(meta, dict) else {}
    if kind == "final":
        names, recorded = ["model.safetensors"], meta.get("checksums")
    else:  # the model states (ZeRO-3: the fp32 partitions are in the optimizer states)
        names = sorted(p.name for p in d.iterdir() if p.name.endswith(("model_states.pt", "optim_states.pt")))
        try:
            recorded = (json.loads((d / "checksums.json").read_text()) or {}).get("files") \
                if (d / "checksums.json").is_file() else None
        except (OSError, ValueError, AttributeError):
            recorded = None
    recorded = recorded if isinstance(recorded, dict) else {}
    files, by = {}, "train"
    for name in names:
        sha = _recorded_sha(recorded.get(name))
        if sha is None:
            sha, by = file_sha256(d / name), "export"
        files[name] = sha
    return {"source": str(d), "kind": kind, "step": meta.get("step"), "recipe_hash": meta.get("recipe_hash"),
            "sha256": files, "sha256_by": by}


def sealed_files(d: Path) -> list[Path]:
    """The files of an export that its checksums cover: all but ``specheads.json`` itself."""
    d = Path(d)
    return sorted((p for p in d.rglob("*") if p.is_file() and p.relative_to(d).as_posix() != SIDE_FILE),
                  key=lambda p: p.relative_to(d).as_posix())


def seal(d: Path, lineage: dict | None) -> None:
    """Record in ``d``'s side file the sha256 of every other file (``checksums``) and the trained weights it
    was made from (``lineage``); every file is flushed to disk first."""
    sums = {}
    for p in sealed_files(d):
        with open(p, "rb") as f:
            os.fsync(f.fileno())
        sums[p.relative_to(d).as_posix()] = file_sha256(p)
    side = read_side(d) or {}
    side["checksums"] = sums
    if lineage is not None:
        side["lineage"] = lineage
    write_json_atomic(d / SIDE_FILE, side)
    fsync_dir(d)


def checksum_report(d: Path) -> tuple[list[str], list[str], bool]:
    """(errors, warnings, whether checksums were recorded): each file of ``d`` against the sha256 its
    side file recorded; a file the export did not write is a warning."""
    d = Path(d)
    try:
        side = read_side(d) or {}
    except ExportError as e:
        return [str(e)], [], False
    sums = side.get("checksums")
    if not isinstance(sums, dict):
        return [], [], False
    errors = []
    for name, want in sorted(sums.items()):
        f = d / name
        if not f.is_file():
            errors.append(f"{f}: missing (the export recorded its sha256 {want})")
            continue
        try:
            have = file_sha256(f)
        except OSError as e:
            errors.append(f"{f}: cannot be read ({e})")
            continue
        if have != _recorded_sha(want):
            errors.append(f"{f}: sha256 {have} differs from the {want} recorded at export: the file changed "
                          "after it was exported (export again, or restore the file)")
    extra = [p.relative_to(d).as_posix() for p in sealed_files(d) if p.relative_to(d).as_posix() not in sums]
    warnings = [f"{d / n}: not written by the export (not in its checksums)" for n in extra]
    return errors, warnings, True


def _staging(out: Path) -> Path:
    return out.parent / f".{out.name}.tmp-{os.getpid()}"


def _leftovers(out: Path, kind: str) -> list[Path]:
    pat = re.compile(rf"\.{re.escape(out.name)}\.{kind}-\d+")
    return sorted(p for p in out.parent.iterdir() if pat.fullmatch(p.name)) if out.parent.is_dir() else []


def clear_leftovers(out: Path) -> None:
    """Remove what killed exports of ``out`` left beside it (the caller holds ``out``'s lock, so no live
    export owns them). Killed between moving the old export aside and renaming the new one in (only
    where the filesystem cannot swap two directories), the old one is put back first."""
    olds = _leftovers(out, "old")
    if olds and not out.exists():
        keep = max(olds, key=lambda p: p.stat().st_mtime)
        os.rename(keep, out)
        olds.remove(keep)
        print(f"specheads: restored {out} from {keep.name} (an export was killed while replacing it)",
              file=sys.stderr, flush=True)
    for p in _leftovers(out, "tmp") + olds:
        if p.is_symlink() or not p.is_dir():
            p.unlink(missing_ok=True)
        else:
            shutil.rmtree(p, ignore_errors=True)
        print(f"specheads: removed {p} (left by a killed export)", file=sys.stderr, flush=True)


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a directory; choose another --out")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise ExportError(f"{out}: output directory exists and is not an export directory; choose another --out")


def _write_sealed(out: Path, write, lineage: dict | None, needed: int | None = None):
    """Run ``write(tmp)`` (which writes and validates the export in ``tmp``, returning its report), seal the
    result and publish it as ``out``; nothing of it stays when anything fails, and ``out`` is left as it was
    when the report is not ok (ExportError). A full disk is a ``DiskFullError`` (an ``ExportError`` too)
    naming the file, about ``needed`` bytes and the bytes free, saying the previous export is unchanged."""
    if out.is_symlink():  # publish into the folder it names; the link stays
        out = out.resolve()
    clear_leftovers(out)
    tmp = _staging(out)
    shutil.rmtree(tmp, ignore_errors=True)
    had = (out / "config.json").is_file()
    kept = (f"the temporary directory {tmp.name} was removed and the previous export at {out} is unchanged" if had
            else f"the temporary directory {tmp.name} was removed; nothing was published at {out}")
    with disk_full_guard(out, staging=tmp, kept=kept, needed=needed, error=ExportError,
                         cleanup=lambda: shutil.rmtree(tmp, ignore_errors=True)):
        try:
            rep = write(tmp)
            rep.dir = str(out)
            rep.errors = [e.replace(str(tmp), str(out)) for e in rep.errors]
            rep.warnings = [w.replace(str(tmp), str(out)) for w in rep.warnings]
            if rep.ok:
                seal(tmp, lineage)
                publish_dir(tmp, out)
            return rep
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


@stage_lock("export")
def run_export(recipe, source=None, *, trained=None, echo: bool = True) -> Path:
    """Export the head trained by ``recipe`` (or the one in ``source``, a run/checkpoint directory).

    Format, k, dtype and output directory come from ``recipe.export``; returns the output
    directory. ``trained`` = ``(head, meta_dict)`` when the caller already loaded it."""
    x = recipe.export
    where = str(source or RunDir(recipe).train)
    head, tmeta = trained if trained is not None else load_trained(source or RunDir(recipe).train)
    fmt = _check_format(x.format, head.cfg.kind)
    dt = _dtype(x.dtype)
    out = RunDir(recipe).export
    check_head_vs_identity(head, tmeta, where)
    check_vocab_mapping(head, where)
    # a parallel head drafts what one forward gives (P-EAGLE's K, DFlash's block_size - 1), whatever export.k says
    k = head.cfg.tokens_per_forward if head.cfg.kind in PARALLEL_KINDS else x.k
    meta = build_meta(head, tmeta, k, tmeta.get("recipe") or recipe.to_dict())
    _check_out(out)
    head = head.float().eval()
    ident = tmeta.get("target") or {}
    report = RunDir(recipe).eval / "report.json"
    lines: list[str] = []

    def write(tmp: Path):
        try:
            save(head, meta, tmp, fmt, dtype=dt)
        except ValueError as e:
            raise ExportError(f"{where}: cannot write {fmt}: {e}") from None
        rep = validate.check(tmp, target_vocab_size=head.cfg.target_vocab_size,
                             verifier=meta.verifier_name_or_path, reference_head=head, dtype=dt, raise_on_error=False,
                             atol=_atol(dt))
        card.write_card(tmp, meta, fmt=fmt, report_json=report if report.is_file() else None,
                        model_path=card.head_path_for_card(out))
        lines.extend(summary_lines(out, rep, meta, fmt, files_in=tmp, kind=head.cfg.kind))
        return rep

    rep = _write_sealed(out, write, lineage_of(source or RunDir(recipe).train), needed=_head_bytes(head, dt))
    if rep.ok:
        lines = summary_lines(out, rep, meta, fmt, kind=head.cfg.kind)  # the files as published (the side file sealed)
    if echo:
        for line in lines:
            _out(line)
        if ident.get("adapter"):
            _out(f"note: the target carries the adapter {ident['adapter']}: serve the merged model as the verifier")
    if not rep.ok:
        raise ExportError(f"{out}: failed validation, so not published (any previous export there is unchanged): "
                          + "; ".join(rep.errors))
    return out


def _head_bytes(head, dtype) -> int:
    """About the bytes an export of ``head`` in ``dtype`` takes (its floating tensors cast, the rest as held)."""
    item = torch.empty((), dtype=dtype).element_size()
    return sum(t.numel() * (item if t.is_floating_point() else t.element_size()) for t in head.state_dict().values())


def _atol(dtype) -> float | None:
    # bf16 storage rounds every weight (rel. 2^-8): let validate scale its default; fp32 must be exact.
    return 1e-4 if dtype == torch.float32 else None


# ---------------------------------------------------------------- --from conversion
def run_convert(src, fmt, out, dtype="bfloat16", k=None, echo: bool = True) -> Path:
    """Rewrite the exported head in ``src`` as ``fmt`` in ``out`` and validate it against the source."""
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise ExportError(f"--from {src}: not a directory")
    src_fmt = detect_format(src)
    # a source sealed by our export must still hold what it recorded, before its weights are read: a flipped
    # byte in a tensor would otherwise be converted and published under new, matching checksums
    errors, _warnings, _sealed = checksum_report(src)
    if errors:
        raise ExportError(f"--from {src}: " + "; ".join(errors))
    head, meta, _ = load_any(src)
    _check_format(fmt, head.cfg.kind)
    if src.resolve() == out.resolve():
        raise ExportError(f"--out {out} is the --from directory; write the conversion elsewhere")
    if head.cfg.kind in PARALLEL_KINDS:  # one forward's tokens; --k cannot change a trained block
        meta = dataclasses.replace(meta, speculative_tokens=head.cfg.tokens_per_forward)
    elif k is not None:
        meta = dataclasses.replace(meta, speculative_tokens=int(k))
    if fmt == "speculators" and head.cfg.kind != "dflash" and not bool(head.embed_tokens.weight.any()):
        raise ExportError(f"--from {src}: has no embedding (a {src_fmt} head shares the target's) but the speculators "
                   "package needs one in the file; export from the trained run instead")
    check_vocab_mapping(head, str(src))
    dt = _dtype(dtype)
    lines: list[str] = []

    def write(tmp: Path):
        MODULES[fmt].save(head, meta, tmp, dtype=dt)
        rep = validate.check(tmp, target_vocab_size=head.cfg.target_vocab_size, reference_head=head, dtype=dt,
                             raise_on_error=False, atol=_atol(dt))
        card.write_card(tmp, meta, fmt=fmt, model_path=card.head_path_for_card(out))
        lines.extend(summary_lines(out, rep, meta, fmt, files_in=tmp, kind=head.cfg.kind))
        return rep

    side = read_side(src) or {}
    recorded = side.get("checksums") if isinstance(side.get("checksums"), dict) else {}
    sums, by = {}, "source export (verified)"
    for p in sorted(src.glob("*.safetensors")):
        sums[p.name] = _recorded_sha(recorded.get(p.name))
        if sums[p.name] is None:   # a peer's checkpoint records none: what was read is what is recorded
            sums[p.name], by = file_sha256(p), "export"
    lineage = {"source": str(src.resolve()), "kind": "export", "format": src_fmt, "sha256": sums,
               "sha256_by": by, "made_from": side.get("lineage")}
    with output_lock(out, "export"):
        _check_out(out)
        rep = _write_sealed(out, write, lineage, needed=_head_bytes(head, dt))
    if rep.ok:
        lines = summary_lines(out, rep, meta, fmt, kind=head.cfg.kind)
    if echo:
        _out(f"converted {src} ({src_fmt}) -> {fmt}")
        for line in lines:
            _out(line)
    if not rep.ok:
        raise ExportError(f"{out}: failed validation, so not published (any previous export there is unchanged): "
                          + "; ".join(rep.errors))
    return out


# ---------------------------------------------------------------- --check
def check_against_target(d: Path, facts: dict) -> list[str]:
    """Problems between an export dir and a target (verifier, vocab, hidden size, layer ids)."""
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
    native_ids = (c.get("dflash_config") or {}).get("target_layer_ids") if fmt == "dflash_native" else None
    vocab = (layer or {}).get("vocab_size", hc.get("target_vocab_size"))
    if vocab is not None and int(vocab) != facts["vocab_size"]:
        problems.append(f"{d}: vocab_size {vocab} != target vocabulary {facts['vocab_size']}")
    th = c.get("target_hidden_size") or hc.get("target_hidden_size") or (layer or {}).get("hidden_size")
    if fmt in ("speculators", "sglang", "dflash_native"):
        fc = tensor_shapes_dtypes(d).get("fc.weight")
        aux = (c.get("eagle_aux_hidden_state_layer_ids") or c.get("aux_hidden_state_layer_ids")  # dflash's name
               or ([int(i) + 1 for i in native_ids] if native_ids else None) or hc.get("aux_layer_ids") or [])
        if fc and aux and fc[0][1] % len(aux) == 0:
            th = fc[0][1] // len(aux)
        L = facts["num_hidden_layers"]
        bad = [i for i in aux if not 0 <= int(i) <= L]
        if bad:
            problems.append(f"{d}: aux layer ids {bad} out of range for a {L}-layer target")
        made_for = c.get("num_target_layers") if fmt == "dflash_native" else None
        if made_for is not None and int(made_for) != L:
            problems.append(f"{d}: num_target_layers {made_for} != the target's {L} layers")
    elif fmt == "mtp":
        L = c.get("num_hidden_layers")
        if L is not None and int(L) != facts["num_hidden_layers"]:
            problems.append(f"{d}: MTP layers numbered for a {L}-layer target, target has "
                            f"{facts['num_hidden_layers']}")
    if th is not None and int(th) != facts["hidden_size"]:
        problems.append(f"{d}: target hidden size {th} != target's hidden_size {facts['hidden_size']}")
    return problems


def run_check(d, target: str | None = None, echo: bool = True) -> int:
    """Validate ``d`` as vLLM/SGLang read it (and against ``target``'s config); 0 when it passes."""
    d = Path(d)
    try:
        facts = target_facts(target) if target else None
    except TargetError as e:
        raise ExportError(f"--target {target}: {e}") from None
    sum_errors, sum_warnings, sealed = checksum_report(d) if d.is_dir() else ([], [], False)
    try:
        rep = validate.check(d, target_vocab_size=facts["vocab_size"] if facts else None, raise_on_error=False)
    except ExportError as e:  # not a head directory at all (or a file so damaged that it cannot be read)
        if echo:
            _out(f"{d}: FAILED")
            for p in [*sum_errors, str(e)]:
                _out(f"  error: {p}")
        return 1
    problems = sum_errors + [p for p in rep.errors if p not in sum_errors]
    rep.warnings = sum_warnings + rep.warnings
    if sealed:
        rep.checked.append("sha256 of every file")
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
