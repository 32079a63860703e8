"""README.md model card for an exported head."""
from __future__ import annotations

import json
from pathlib import Path

from .common import SIDE_FILE, ExportMeta, read_side


PARALLEL_KINDS = ("peagle", "dflash")   # one forward drafts a block; SGLang reads neither


def vllm_speculative_config(d: str, k: int, fmt: str = "speculators", kind: str | None = None) -> dict:
    """vLLM 0.32's SpeculativeConfig for the head folder ``d`` drafting ``k`` tokens per step. ``k`` of a
    parallel kind is what one forward drafts: P-EAGLE's K, DFlash's block_size - 1."""
    if kind == "peagle":    # P-EAGLE is eagle3 with parallel_drafting; dflash turns it on itself
        return {"method": "eagle3", "model": d, "num_speculative_tokens": k, "parallel_drafting": True}
    if kind == "dflash":
        return {"method": "dflash", "model": d, "num_speculative_tokens": k}
    return {"method": "eagle" if fmt == "eagle" else "eagle3", "model": d, "num_speculative_tokens": k}


def speculative_config_flag(spec: dict) -> str:
    """``--speculative-config '<JSON>'`` as ``vllm serve`` takes it (compact JSON, shell-quoted)."""
    return f"--speculative-config '{json.dumps(spec, separators=(',', ':'))}'"


def sglang_flags(d: str, k: int, fmt: str = "speculators", kind: str | None = None) -> str | None:
    """SGLang's speculative flags for a chain of ``k`` drafts; None for the parallel kinds (no SGLang reader)."""
    if kind in PARALLEL_KINDS:
        return None
    algo = "EAGLE" if fmt == "eagle" else "EAGLE3"
    return (f"--speculative-algorithm {algo} --speculative-draft-model-path {d} --speculative-num-steps {k} "
            f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}")


def launch_lines(target: str, d: str, k: int, fmt: str = "speculators", kind: str | None = None) -> dict[str, str]:
    """The serve commands; ``lines["sglang"]`` is None for the parallel kinds (SGLang serves neither)."""
    flags = sglang_flags(d, k, fmt, kind)
    return {"vllm": f"vllm serve {target} {speculative_config_flag(vllm_speculative_config(d, k, fmt, kind))}",
            "sglang": f"python -m sglang.launch_server --model {target} {flags}" if flags else None}


def _step_k(hc: dict, meta: ExportMeta) -> int:
    """The tokens one step drafts: the export's k, or what one forward of a parallel head drafts."""
    kind, k = hc.get("kind"), int(meta.speculative_tokens)
    if kind == "peagle":
        return int(hc.get("num_depths", k))
    if kind == "dflash":
        return int(hc.get("block_size", k + 1)) - 1
    return k


def acceptance_section(rep: dict, source: str) -> list[str]:
    """The runs of a `specheads eval` report.json as a table (same definitions as the report)."""
    p, st = rep.get("prompts", {}), rep.get("settings", {})
    md = ["## Measured acceptance", "",
          f"From `{source}` ({rep.get('created', '?')}): {p.get('count', '?')} prompts of {p.get('source', '?')}, "
          f"max_new_tokens {st.get('max_new_tokens')}, temperature {st.get('temperature')}, device {st.get('device')}. "
          "τ = tokens per target decode forward over all decode forwards; vLLM τ = 1 + accepted / drafts.", "",
          "| run | engine | τ | vLLM τ | acceptance rate | α_i | speedup | lossless |", "|---|---|---|---|---|---|---|---|"]

    def f(x):
        return "—" if x is None else (f"{x:.2f}" if isinstance(x, float) else str(x))

    for r in rep.get("runs", []):
        m = r.get("metrics", {})
        ll = r.get("lossless") or {}
        lossless = (f"{ll.get('identical')}/{ll.get('total')} identical" if ll.get("kind") == "greedy"
                    else ("χ² pass" if ll.get("passed") else "χ² fail") if ll else "—")
        md.append(f"| {r.get('name')} | {r.get('engine', 'specheads')} | {f(m.get('tau'))} | "
                  f"{f(m.get('vllm_mean_acceptance_length'))} | {f(m.get('acceptance_rate'))} | "
                  f"{' '.join(f(a) for a in m.get('alpha', []))} | {f(r.get('speedup'))} | {lossless} |")
    return md + [""]


def recommendation_section(rep: dict, source: str, out: Path, target: str, d: str, fmt: str, kind: str) -> list[str]:
    """This head's fastest k at each concurrency of a `specheads eval --sweep` report, with the commands that serve
    it (the same builders as the card's Serve section), and where plain decoding or another drafter was faster."""
    sw = rep.get("sweep") or {}
    here = Path(out).resolve()
    mine = sorted((b for b in sw.get("best", []) if b.get("head") and Path(b["head"]) == here),
                  key=lambda b: b["concurrency"])
    if not mine:
        return []
    st = rep.get("settings", {})
    md = ["## Recommended serving configuration", "",
          f"Measured by `specheads eval --sweep` (`{source}`, {rep.get('created', '?')}): {sw.get('conversations')} "
          f"conversations served with continuous batching, greedy, max_new_tokens {sw.get('max_new_tokens')}, device "
          f"{st.get('device')}. Per concurrency (requests in flight), the k with the best speedup over plain decoding "
          "at the same concurrency; τ = decode tokens per target decode forward.", "",
          "| concurrency | k | τ | speedup | lossless |", "|---|---|---|---|---|"]
    for b in mine:
        ll = b.get("lossless") or {}
        md.append(f"| {b['concurrency']} | {b['k']} | {b['tau']:.2f} | {b['speedup']:.2f}× | "
                  f"{ll.get('identical')}/{ll.get('total')} identical |")
    overall = {r["concurrency"]: r for r in sw.get("recommendation", [])}
    for b in mine:
        r = overall.get(b["concurrency"])
        if not r or (r.get("head") is not None and Path(r["head"]) == here):
            continue
        what = f"{r['drafter']}" + (f" k={r['k']}" if r.get("k") else "")
        if r.get("k") == 0:
            tail = ": serve without speculative decoding there."
        elif round(b["speedup"], 2) < 1:
            tail = "; this head is slower than plain decoding there."
        else:
            tail = "."
        md += ["", f"At concurrency {b['concurrency']}, {what} was faster ({r['speedup']:.2f}× against this head's "
                   f"{b['speedup']:.2f}×){tail}"]
    for k in dict.fromkeys(b["k"] for b in mine):
        concs = ", ".join(str(b["concurrency"]) for b in mine if b["k"] == k)
        lines = launch_lines(target, d, k, fmt, kind)
        md += ["", f"k = {k} (best at concurrency {concs}), vLLM:", "", "```bash", lines["vllm"], "```", ""]
        md += (["SGLang:", "", "```bash", lines["sglang"], "```"] if lines["sglang"]
               else [f"SGLang has no reader for a {kind} head."])
    return md + [""]


def _num(x, digits: int = 3):
    """Numbers as a person reads them: 3 significant digits, integers with thousands separators."""
    if isinstance(x, bool) or x is None:
        return "—" if x is None else str(x)
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.{digits}g}"
    return str(x)


def _table(rows: list[tuple[str, object]]) -> list[str]:
    return ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows if v not in (None, "", [], {})]


def _data_rows(data) -> list[tuple[str, object]]:
    if not isinstance(data, dict):
        return [("data", data)] if data else []
    rows = [("sources", ", ".join(f"`{s}`" for s in data.get("sources") or []) or None),
            ("answers", "regenerated by the target" if data.get("regenerated_by_target") else "as in the sources")]
    v = data.get("draft_vocab") or {}
    if v:
        rows += [("draft vocabulary", f"{_num(v.get('draft_vocab_size'))} of {_num(v.get('target_vocab_size'))} tokens"),
                 ("coverage of training tokens", f"{v['coverage']:.1%}" if isinstance(v.get("coverage"), float) else None)]
    return rows


def _training_rows(training: dict, recipe: dict) -> list[tuple[str, object]]:
    tr = (recipe or {}).get("train") or {}
    ev = training.get("eval") or {}
    rows = [("optimizer steps", _num(training.get("step"))), ("precision", training.get("precision")),
            ("GPUs / processes", _num(training.get("world_size"))),
            ("TTT steps", _num(tr.get("ttt_steps"))), ("learning rate", _num(tr.get("lr"))),
            ("epochs", _num(tr.get("epochs"))), ("warm start", training.get("warm_start")),
            ("LoRA", "yes" if training.get("lora") else None)]
    if ev:
        rows += [("held-out loss", _num(ev.get("loss"))),
                 ("held-out accuracy per TTT step", " · ".join(_num(a, 2) for a in ev.get("step_acc") or []) or None),
                 ("held-out simulated τ", _num(ev.get("sim_tau")))]
    return rows


RECIPE_FILE = "recipe.yaml"  # beside the card: the recipe that trained the head, to rerun it


def head_path_for_card(path: Path) -> str:
    """How the card names a file or folder: from the working directory when it lies below it, else by its name.
    Never an absolute path: a card travels with the head to other machines and to a model hub."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return path.name


def write_card(out_dir, meta: ExportMeta | None = None, *, fmt: str | None = None, report_json=None,
               target: str | None = None, model_path: str | None = None) -> Path:
    """README.md of an export, laid out like a model-hub card: what it is, how well it drafts, how to serve it.

    With a recipe in ``meta``, ``recipe.yaml`` is written beside the card so that its rerun line works.
    """
    import yaml

    out = Path(out_dir)
    side = read_side(out) or {}
    meta = meta or ExportMeta.from_dict(side.get("meta"))
    fmt = fmt or side.get("format", "speculators")
    hc = side.get("head_config", {})
    target = target or meta.verifier_name_or_path or "TARGET"
    d = model_path or head_path_for_card(out)
    kind = hc.get("kind", "draft")
    k = _step_k(hc, meta)
    lines = launch_lines(target, d, k, fmt, kind)
    how = {"peagle": f"It drafts K = {k} tokens in one forward (P-EAGLE, parallel drafting)",
           "dflash": f"It drafts a block of {k + 1} slots (the verified anchor + {k} drafted tokens) in one forward "
                     "(DFlash)"}.get(kind, f"It proposes {k} tokens per step")
    md = ["---", "library_name: specheads", f"base_model: {target}", f"tags: [speculative-decoding, {kind}, {fmt}]",
          "---", "", f"# {kind.upper()} draft head for `{target}`", "",
          f"A speculative-decoding draft head in the **{fmt}** layout, exported by specheads "
          f"{meta.specheads_version}. {how}; the target verifies them, so outputs are "
          "unchanged.", "", "## Target", ""]
    md += _table([("verifier", f"`{target}`"), ("architectures", ", ".join(meta.verifier_architectures) or None),
                  ("vocabulary", _num(meta.target_vocab_size)),
                  ("aux hidden-state layers (HF index)", meta.aux_layer_ids or None)]) + [""]
    if hc:
        md += ["## Head", ""] + _table([
            ("hidden / intermediate", f"{_num(hc.get('hidden_size'))} / {_num(hc.get('intermediate_size'))}"),
            ("attention heads (kv) × head_dim",
             f"{hc.get('num_attention_heads')} ({hc.get('num_key_value_heads')}) × {hc.get('head_dim')}"),
            ("decoder layers", hc.get("num_layers")), ("draft vocabulary", _num(hc.get("draft_vocab_size"))),
            ("kind", kind if kind in ("peagle", "dflash") else None),
            ("tokens per forward (K)", hc.get("num_depths") if kind == "peagle" else None),
            ("block size", hc.get("block_size") if kind == "dflash" else None),
            ("mask token id", hc.get("mask_token_id") if kind in ("peagle", "dflash") else None),
            ("norm_before_residual", hc.get("norm_before_residual") if kind != "dflash" else None)]) + [""]
    if report_json:
        rep = json.loads(Path(report_json).read_text())
        md += acceptance_section(rep, head_path_for_card(report_json))
        md += recommendation_section(rep, head_path_for_card(report_json), out, target, d, fmt, kind)
    md += ["## Serve", "", f"`{d}` is this head's folder; after moving it, give its new path.", "",
           "vLLM:", "", "```bash", lines["vllm"], "```", ""]
    md += (["SGLang:", "", "```bash", lines["sglang"], "```", ""] if lines["sglang"]
           else [f"SGLang has no reader for a {kind} head.", ""])
    data_rows = _data_rows(meta.data)
    if data_rows:
        md += ["## Data", ""] + _table(data_rows) + [""]
    if meta.training:
        md += ["## Training", ""] + _table(_training_rows(meta.training, meta.recipe)) + [""]
    written = []
    if meta.recipe:
        recipe_yaml = yaml.safe_dump(meta.recipe, sort_keys=False)
        (out / RECIPE_FILE).write_text(recipe_yaml)
        written.append(RECIPE_FILE)
        md += ["## Recipe", "", f"Recipe hash `{meta.recipe_hash}`; rerun with `specheads train {RECIPE_FILE}` "
               f"(the `{RECIPE_FILE}` beside this card).", "",
               f"<details><summary>{RECIPE_FILE}</summary>", "", "```yaml", recipe_yaml.rstrip(), "```", "",
               "</details>", ""]
    p = out / "README.md"
    p.write_text("\n".join(md))
    _refresh_checksums(out, side, [*written, p.name])
    return p


def _refresh_checksums(out: Path, side: dict, names: list[str]) -> None:
    """A sealed export (its side file records ``checksums``) keeps them true when its card is rewritten later
    (``specheads eval --update-card``)."""
    import hashlib

    from ..fileio import write_json_atomic

    sums = side.get("checksums")
    if not isinstance(sums, dict):
        return
    for name in names:
        sums[name] = hashlib.sha256((out / name).read_bytes()).hexdigest()
    write_json_atomic(out / SIDE_FILE, side)
