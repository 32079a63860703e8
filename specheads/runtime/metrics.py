"""Acceptance metrics (docs/conventions.md, "Acceptance metrics") from per-decode-step records.

One record = one target decode forward for one request (the prefill forward is not a
decode forward and has no record).

- tau (acceptance length) = mean over ALL decode forwards of (accepted + 1), including
  forwards that carried no drafts.
- vllm_mean_acceptance_length = 1 + accepted / drafts, over forwards that carried drafts
  only (vLLM's figure: num_accepted_tokens / num_drafts + 1).
- alpha[i] = P(draft i accepted | drafts 1..i-1 accepted), over forwards that proposed a
  draft at position i (i = 1-based position, reported 0-based in the list).
- acceptance_rate = accepted drafts / proposed drafts.
- accepted_per_pos_rate[i] = vLLM's num_accepted_tokens_per_pos[i] / num_drafts.
- tokens_per_s = generated tokens / wall time (when given).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class StepRecord:
    request: int
    step: int                    # decode step index within the request (0-based)
    num_proposed: int            # draft tokens sent to the target in this forward
    num_accepted: int            # accepted drafts (along the accepted path for trees)
    num_emitted: int             # tokens actually appended (may be cut by EOS / max_new_tokens)
    depth_proposed: int = -1     # chain length offered (tree: its depth); -1 = num_proposed
    accepted_per_pos: list[bool] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def _get(r, key):
    return r[key] if isinstance(r, dict) else getattr(r, key)


def summarize(records, elapsed_s: float | None = None, generated_tokens: int | None = None) -> dict:
    n = len(records)
    prop = [int(_get(r, "num_proposed")) for r in records]
    acc = [int(_get(r, "num_accepted")) for r in records]
    depth = []
    for r, p in zip(records, prop):
        d = int(_get(r, "depth_proposed")) if (isinstance(r, dict) and "depth_proposed" in r) or hasattr(r, "depth_proposed") else -1
        depth.append(p if d < 0 else d)
    with_drafts = [i for i in range(n) if prop[i] > 0]
    total_prop, total_acc = sum(prop), sum(acc)
    max_depth = max(depth, default=0)
    alpha, per_pos = [], []
    for i in range(1, max_depth + 1):
        reached = sum(1 for j in range(n) if depth[j] >= i and acc[j] >= i - 1)
        ok = sum(1 for j in range(n) if depth[j] >= i and acc[j] >= i)
        alpha.append(ok / reached if reached else float("nan"))
        per_pos.append(sum(1 for j in with_drafts if acc[j] >= i) / len(with_drafts) if with_drafts else float("nan"))
    out = {
        "decode_forwards": n,
        "forwards_with_drafts": len(with_drafts),
        "proposed": total_prop,
        "accepted": total_acc,
        "tau": (sum(acc) + n) / n if n else float("nan"),
        "vllm_mean_acceptance_length": (1 + sum(acc[i] for i in with_drafts) / len(with_drafts))
        if with_drafts else float("nan"),
        "acceptance_rate": total_acc / total_prop if total_prop else float("nan"),
        "alpha": alpha,
        "accepted_per_pos_rate": per_pos,
    }
    if generated_tokens is None:
        generated_tokens = sum(int(_get(r, "num_emitted")) for r in records) if records else 0
    out["generated_tokens"] = generated_tokens
    if elapsed_s is not None:
        out["elapsed_s"] = elapsed_s
        out["tokens_per_s"] = generated_tokens / elapsed_s if elapsed_s > 0 else float("nan")
    return out
