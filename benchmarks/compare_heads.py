"""Do two saved heads compute the same thing? Draft logits of the TTT unroll on random inputs.

    python benchmarks/compare_heads.py RUN/train/final RUN/train/checkpoints/step_N [--export DIR] --out X.json

The first two are read with ``formats.trained.load_trained_head`` (``final/`` holds the head the
trainer gathered from its ZeRO shards; a checkpoint is re-assembled from the DeepSpeed states by
DeepSpeed's own ``zero_to_fp32``), ``--export`` with ``formats.convert.load_any``. Under ZeRO-3 no
rank holds the whole head, so equal logits show the gathering was complete and in order.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specheads.formats.convert import load_any  # noqa: E402
from specheads.formats.trained import load_trained_head  # noqa: E402
from specheads.heads import ttt_forward  # noqa: E402


def logits(head, ids, aux, steps: int) -> list[torch.Tensor]:
    with torch.no_grad():
        return [x.float() for x in ttt_forward(head.float().eval(), ids, aux, steps=steps)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reference", type=Path)
    ap.add_argument("other", type=Path)
    ap.add_argument("--export", type=Path)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    ref, _ = load_trained_head(args.reference)
    cfg = ref.cfg
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.target_vocab_size, (1, 16), generator=g)
    aux = torch.randn(1, 16, cfg.num_aux * cfg.target_hidden_size, generator=g)
    a = logits(ref, ids, aux, args.steps)
    scale = max(float(x.abs().max()) for x in a)
    res = {"reference": str(args.reference), "logit_scale": scale}
    other, _ = load_trained_head(args.other)
    res["other"] = {"dir": str(args.other),
                    "max_abs_diff": max(float((x - y).abs().max()) for x, y in zip(a, logits(other, ids, aux, args.steps))),
                    "params_equal": all(torch.equal(p.float(), q.float()) for p, q in
                                        zip(ref.state_dict().values(), other.state_dict().values()))}
    if args.export:
        head, _meta, fmt = load_any(args.export)
        if not bool(head.embed_tokens.weight.any()):
            head.embed_tokens.weight.data.copy_(ref.embed_tokens.weight)
        res["export"] = {"dir": str(args.export), "format": fmt, "max_abs_diff": max(
            float((x - y).abs().max()) for x, y in zip(a, logits(head, ids, aux, args.steps)))}
    print(json.dumps(res, indent=1))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
