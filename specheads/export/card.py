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
        rep = json.loads(Path(report_json).read_text())
        md += ["## Measured acceptance", ""]
        keys = [("acceptance_length", "acceptance length τ (tokens per decode forward)"),
                ("vllm_acceptance_length", "vLLM figure 1 + accepted/drafts"),
                ("acceptance_rate", "acceptance rate"), ("per_position_acceptance", "α_i per position"),
                ("speedup", "speedup")]
        for key, label in keys:
            if key in rep:
                md.append(f"- {label}: {rep[key]}")
        md += ["", "```json", json.dumps(rep, indent=2, default=str), "```", ""]
    md += ["## Serve", "", "vLLM:", "", "```bash", lines["vllm"], "```", "", "SGLang:", "", "```bash",
           lines["sglang"], "```", ""]
    p = out / "README.md"
    p.write_text("\n".join(md))
    return p
