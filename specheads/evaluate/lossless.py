"""Lossless checks: drafting must not change what the target generates.

Greedy: every drafted answer equals the plain answer token for token; a
divergence is reported with the target's top-2 logit margin at that point
(a tiny margin means numerical noise between batched and unbatched kernels,
a large one a real bug). Sampling: the drafted and plain token distributions
at the first positions must be the same (two-sample χ² over many draws).
"""

from __future__ import annotations

from collections import Counter

import torch

from specheads.runtime.chat import render_prompt
from specheads.runtime.engines.static import generate


def greedy_lossless(plain, drafted, target, tokenizer) -> dict:
    total = identical = 0
    divergences = []
    for p, d in zip(plain, drafted):
        for turn, (pt, dt) in enumerate(zip(p.answer_tokens, d.answer_tokens)):
            total += 1
            if pt == dt:
                identical += 1
                continue
            pos = next((i for i, (a, b) in enumerate(zip(pt, dt)) if a != b), min(len(pt), len(dt)))
            prefix = p.prompt_tokens[turn] + pt[:pos]
            with torch.no_grad():
                logits = target.model(torch.tensor([prefix], device=target.device)).logits[0, -1].float()
            top = torch.topk(logits, 2).values
            divergences.append({
                "prompt_id": p.id, "turn": turn, "position": pos,
                "plain_token": tokenizer.decode(pt[pos:pos + 1]) if pos < len(pt) else "<end>",
                "drafted_token": tokenizer.decode(dt[pos:pos + 1]) if pos < len(dt) else "<end>",
                "logit_margin": float(top[0] - top[1]),
            })
            if len(pt) != len(dt) and pt[:pos] == dt[:pos] and pos == min(len(pt), len(dt)):
                divergences[-1]["note"] = "one sequence is a prefix of the other (stopped at a different length)"
    return {"kind": "greedy", "total": total, "identical": identical, "divergences": divergences}


def chi_square_two_sample(samples_a: list[list[int]], samples_b: list[list[int]], positions: int,
                          min_expected: float = 5.0) -> list[float]:
    """Per-position two-sample χ² homogeneity p-values (rare tokens pooled into one bin)."""
    from scipy.stats import chi2_contingency

    pvals = []
    for pos in range(positions):
        a = Counter(s[pos] for s in samples_a if len(s) > pos)
        b = Counter(s[pos] for s in samples_b if len(s) > pos)
        na, nb = sum(a.values()), sum(b.values())
        if na < 10 or nb < 10:
            break
        keys = sorted(set(a) | set(b), key=lambda t: -(a[t] + b[t]))
        rows, other = [], [0, 0]
        for t in keys:
            exp = (a[t] + b[t]) * min(na, nb) / (na + nb)
            if exp >= min_expected:
                rows.append([a[t], b[t]])
            else:
                other[0] += a[t]
                other[1] += b[t]
        if sum(other):
            rows.append(other)
        if len(rows) < 2:
            pvals.append(1.0)  # one token only on both sides: identical distributions
            continue
        pvals.append(float(chi2_contingency(rows)[1]))
    return pvals


def chi_square_check(engine, tokenizer, prompts, spec, drafter, *, draws: int, temperature: float, top_k: int,
                     top_p: float, seed: int, positions: int = 4) -> dict:
    """Many sampled draws of the first few tokens, drafted vs plain, for the first two prompts."""
    pvals = []
    for it in prompts[:2]:
        msgs = ([{"role": "system", "content": it["system"]}] if it.get("system") else []) + \
               [{"role": "user", "content": it["turns"][0]}]
        ids = render_prompt(tokenizer, msgs)
        plain, drafted = [], []
        bs = max(1, min(engine.max_batch, draws))
        for start in range(0, draws, bs):
            n = min(bs, draws - start)
            seeds = [seed * 1_000_003 + start + i for i in range(n)]
            r0 = generate(engine, [ids] * n, positions, rule="onehot", temperature=temperature, top_k=top_k,
                          top_p=top_p, seed=seeds, stop_token_ids=())
            r1 = generate(engine, [ids] * n, positions, drafter=drafter, k=spec.k, tree=spec.tree_config(),
                          rule=spec.rule, temperature=temperature, top_k=top_k, top_p=top_p,
                          thresholds=spec.thresholds, seed=[x + 500_000 for x in seeds], stop_token_ids=())
            plain += r0.tokens
            drafted += r1.tokens
        pvals += chi_square_two_sample(plain, drafted, positions)
    level = 0.01 / max(1, len(pvals))
    p_min = min(pvals) if pvals else float("nan")
    return {"kind": "chi_square", "draws": draws, "p_values": pvals, "p_min": p_min, "alpha_level": level,
            "passed": bool(pvals) and p_min > level, "expect": spec.expect}
