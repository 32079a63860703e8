"""Run inside the ``speculators`` virtual environment (never the project's).

    python speculators_parallel_load.py JOBS.json

JOBS.json: ``[{"model_dir", "output"}, ...]``. For each job: ``SpeculatorModel.from_pretrained(model_dir)``
(a peagle or dflash export; the verifier's embedding / lm_head come from ``verifier.name_or_path``), then
writes ``output`` (safetensors: the model's state dict as loaded, fp32) and ``output + '.json'`` (class,
config fields speculators read)."""
import json
import sys

import torch
from safetensors.torch import save_file

from speculators import SpeculatorModel


def run(job: dict) -> dict:
    torch.manual_seed(0)
    model = SpeculatorModel.from_pretrained(job["model_dir"]).eval()
    cfg = model.config
    sd = {k: v.detach().float().contiguous().clone() for k, v in model.state_dict().items()
          if v.is_floating_point()}
    for k in ("d2t", "t2d"):
        if getattr(model, k, None) is not None:
            sd[k] = getattr(model, k).detach().clone().contiguous()
    save_file(sd, job["output"])
    info = {"class": type(model).__name__, "speculators_model_type": cfg.speculators_model_type,
            "mask_token_id": getattr(cfg, "mask_token_id", None),
            "block_size": getattr(cfg, "block_size", None),
            "aux": list(getattr(cfg, "eagle_aux_hidden_state_layer_ids", None)
                        or getattr(cfg, "aux_hidden_state_layer_ids", None) or []),
            "num_layers": len(model.layers),
            "speculative_tokens": int(cfg.speculators_config.proposal_methods[0].speculative_tokens),
            "use_draft_vocab": bool(getattr(model, "use_draft_vocab", False))}
    with open(job["output"] + ".json", "w") as f:
        json.dump(info, f)
    return info


if __name__ == "__main__":
    for j in json.load(open(sys.argv[1])):
        print(json.dumps(run(j)))
