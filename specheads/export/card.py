"""README.md model card for an exported head."""
from __future__ import annotations

import json
from pathlib import Path

from .common import ExportMeta, read_side


def launch_lines(target: str, d: str, k: int, fmt: str = "speculators") -> dict[str, str]:
    method = "eagle3"
    if fmt == "eagle":
        method = "eagle"
    lines = {"vllm": f"vllm serve {target} --speculative-config "
                     f"'{json.dumps({'method': method, 'model': d, 'num_speculative_tokens': k}, separators=(',', ':'))}'"}
    algo = "EAGLE3" if method == "eagle3" else "EAGLE"
    lines["sglang"] = (f"python -m sglang.launch_server --model {target} --speculative-algorithm {algo} "
                       f"--speculative-draft-model-path {d} --speculative-num-steps {k} "
                       f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}")
    return lines


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


def write_card(out_dir, meta: ExportMeta | None = None, *, fmt: str | None = None, report_json=None,
               target: str | None = None, model_path: str | None = None) -> Path:
    out = Path(out_dir)
    side = read_side(out) or {}
    meta = meta or ExportMeta.from_dict(side.get("meta"))
    fmt = fmt or side.get("format", "speculators")
    hc = side.get("head_config", {})
    target = target or meta.verifier_name_or_path or "TARGET"
    d = model_path or str(out)
    k = int(meta.speculative_tokens)
    lines = launch_lines(target, d, k, fmt)
    md = [f"# {hc.get('kind', 'draft').upper()} draft head for `{target}`", "",
          f"Exported by specheads {meta.specheads_version} in the **{fmt}** format.", "",
          "## Target", "", f"- verifier: `{target}` ({', '.join(meta.verifier_architectures) or 'unknown arch'})",
          f"- target vocabulary: {meta.target_vocab_size}",
          f"- aux hidden-state layers (HF index): {meta.aux_layer_ids}", ""]
    if hc:
        md += ["## Head", "", f"- hidden {hc.get('hidden_size')}, intermediate {hc.get('intermediate_size')}, "
               f"heads {hc.get('num_attention_heads')}/{hc.get('num_key_value_heads')} (head_dim {hc.get('head_dim')})",
               f"- layers {hc.get('num_layers')}, draft vocabulary {hc.get('draft_vocab_size')}",
               f"- norm_before_residual {hc.get('norm_before_residual')}, norm_before_fc {hc.get('norm_before_fc')}, "
               f"fc_norm {hc.get('fc_norm')}, norm_output {hc.get('norm_output')}", ""]
    md += ["## Data", "", f"{json.dumps(meta.data) if not isinstance(meta.data, str) else meta.data}", "",
           "## Recipe", "", f"recipe hash: `{meta.recipe_hash}`", "", "```json",
           json.dumps(meta.recipe, indent=2, sort_keys=True, default=str), "```", ""]
    if meta.training:
        md += ["## Training", "", "```json", json.dumps(meta.training, indent=2, default=str), "```", ""]
    if report_json:
        md += acceptance_section(json.loads(Path(report_json).read_text()), str(report_json))
    md += ["## Serve", "", "vLLM:", "", "```bash", lines["vllm"], "```", "", "SGLang:", "", "```bash",
           lines["sglang"], "```", ""]
    p = out / "README.md"
    p.write_text("\n".join(md))
    return p
