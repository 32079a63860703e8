"""Run inside the ``speculators`` virtual environment (never the project's).

    python speculators_forward.py JOBS.json

JOBS.json: ``[{"model_dir", "inputs", "output", "ttt_steps"}, ...]``.  For
each job: ``SpeculatorModel.from_pretrained(model_dir)`` (which also loads
the verifier's embedding/lm_head/norm from ``verifier.name_or_path``), then
its teacher-forced forward on the tensors in ``inputs`` (safetensors:
``hidden_states [1, T, n_aux*H]`` raw concatenated aux states,
``input_ids [1, T]`` already shifted (x_{t+1} at t), ``position_ids [1, T]``
and ``document_ids [1, T]``).  The forward returns only the argmax draft
tokens; a forward hook on ``lm_head`` captures the logits of every TTT
step.  Writes ``output`` (safetensors: ``logits_{k}``, ``tokens_{k}``,
``d2t``/``t2d`` when present, ``logits_default_pos_0`` from a second run with
speculators' own default positions) and ``output + '.json'`` (class name,
library versions, which weights came from the checkpoint vs the verifier).
"""
import json
import sys
import time

t0 = time.time()
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import speculators  # noqa: E402,F401
from speculators import SpeculatorModel  # noqa: E402


def run(job: dict) -> dict:
    torch.manual_seed(0)
    t = time.time()
    model = SpeculatorModel.from_pretrained(job["model_dir"])
    load_s = time.time() - t
    model.eval()
    dtype = next(model.parameters()).dtype  # the dtype it loaded in (the config's torch_dtype)
    x = load_file(job["inputs"])
    x["hidden_states"] = x["hidden_states"].to(dtype)
    captured = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach().float().clone()))
    steps = int(job.get("ttt_steps", 3))
    with torch.no_grad():
        tokens = model(hidden_states=x["hidden_states"], input_ids=x["input_ids"], document_ids=x["document_ids"],
                       position_ids=x["position_ids"], ttt_steps=steps)
        first = list(captured)
        captured.clear()
        # speculators' own default positions (1 + arange): RoPE is relative, so the logits must not change
        model(hidden_states=x["hidden_states"], input_ids=x["input_ids"], document_ids=x["document_ids"],
              ttt_steps=1)
        default_pos = captured[0]
    hook.remove()
    out = {f"logits_{k}": lg for k, lg in enumerate(first)}
    out.update({f"tokens_{k}": tk.detach().clone() for k, tk in enumerate(tokens)})
    out["logits_default_pos_0"] = default_pos
    if getattr(model, "d2t", None) is not None:
        out["d2t"] = model.d2t.detach().clone()
        out["t2d"] = model.t2d.detach().clone()
    out["embed_tokens"] = model.embed_tokens.weight.detach().float().clone()
    out["verifier_lm_head"] = model.verifier_lm_head.weight.detach().float().clone()
    out["verifier_norm"] = model.verifier_norm.weight.detach().float().clone()
    save_file({k: v.contiguous() for k, v in out.items()}, job["output"])
    import importlib.metadata as md

    info = {
        "class": type(model).__name__,
        "speculators": md.version("speculators"),
        "torch": torch.__version__,
        "transformers": md.version("transformers"),
        "dtype": str(dtype).replace("torch.", ""),
        "attn_implementation": getattr(model, "_attn_impl", None),
        "aux_layer_ids": list(model.config.eagle_aux_hidden_state_layer_ids or []),
        "norm_before_residual": bool(model.config.norm_before_residual),
        "draft_vocab_size": int(model.config.draft_vocab_size),
        "use_draft_vocab": bool(getattr(model, "use_draft_vocab", False)),
        "fc_in_features": int(model.fc.in_features),
        "embed_finite": bool(torch.isfinite(model.embed_tokens.weight).all()),
        "lm_head_finite": bool(torch.isfinite(model.lm_head.weight).all()),
        "verifier_lm_head_finite": bool(torch.isfinite(model.verifier_lm_head.weight).all()),
        "speculative_tokens": int(model.config.speculators_config.proposal_methods[0].speculative_tokens),
        "verifier": model.config.speculators_config.verifier.name_or_path,
        "load_s": round(load_s, 2),
    }
    with open(job["output"] + ".json", "w") as f:
        json.dump(info, f, indent=2)
    return info


def main() -> int:
    jobs = json.load(open(sys.argv[1]))
    for job in jobs:
        info = run(job)
        print(json.dumps({"model_dir": job["model_dir"], **info}))
    print(f"total {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
