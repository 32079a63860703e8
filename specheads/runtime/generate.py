"""The speculative decoding loop: draft -> verify -> accept, batched, one engine for all.

Plain decoding is the same loop with no drafter (one token per forward). Each request
finishes on its own (stop token or max_new_tokens); finished rows stay in the batch with
frozen cache lengths until every request is done.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .drafters import DraftContext, Drafter, Verified
from .metrics import StepRecord, summarize
from .model import TargetModel
from .tree import TreeConfig
from .verify import CHAIN_RULES, RULES, TREE_RULES, sample_inverse_cdf, target_probs, verify_chain, verify_tree

MAX_K = 32


@dataclass
class GenerateResult:
    tokens: list[list[int]]                   # generated tokens per request (prompt excluded)
    finish_reasons: list[str]                 # "stop" | "length"
    records: list[StepRecord] = field(default_factory=list)
    elapsed_s: float = 0.0
    prefill_s: float = 0.0
    target_forwards: int = 0                  # batched decode forwards (prefill excluded)

    def summary(self) -> dict:
        s = summarize(self.records, self.elapsed_s, sum(len(t) for t in self.tokens))
        s["target_forwards"] = self.target_forwards
        s["prefill_s"] = self.prefill_s
        return s


def _check(model, prompts, max_new_tokens, drafter, k, tree, rule, temperature, top_k, top_p, thresholds):
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; use one of {RULES}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0 and rule != "greedy":
        raise ValueError(f"rule {rule!r} samples: it needs temperature > 0 (use rule='greedy' for temperature 0)")
    if temperature > 0 and rule == "greedy":
        raise ValueError("rule 'greedy' is for temperature 0; for sampling use 'rejection', 'onehot' "
                         "or (trees) 'tree_target_only'")
    if top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need top_k >= 0 and 0 < top_p <= 1, got top_k={top_k}, top_p={top_p}")
    if not all(0 < float(t) <= 1 for t in thresholds) or len(thresholds) != 2:
        raise ValueError(f"thresholds must be two numbers in (0, 1], got {thresholds}")
    if len(prompts) > model.max_batch:
        raise ValueError(f"{len(prompts)} prompts > engine max_batch {model.max_batch}")
    spec = 0
    if drafter is not None:
        if tree is not None:
            tree.validate()
            if not getattr(drafter, "supports_tree", False):
                raise ValueError(f"{type(drafter).__name__} cannot draft trees")
            if rule not in TREE_RULES:
                raise ValueError(f"rule {rule!r} is for chains; trees take {TREE_RULES}")
            spec = tree.total_tokens
        else:
            if not 1 <= k <= MAX_K:
                raise ValueError(f"k must be in 1..{MAX_K}, got {k}")
            if rule not in CHAIN_RULES:
                raise ValueError(f"rule {rule!r} is for trees; chains take {CHAIN_RULES}")
            if rule == "rejection" and not getattr(drafter, "provides_probs", False):
                raise ValueError(f"rule 'rejection' needs draft probabilities; {type(drafter).__name__} "
                                 f"proposes one-hot drafts: use rule='onehot'")
            spec = k
    elif rule not in ("greedy", "onehot", "rejection"):
        raise ValueError(f"rule {rule!r} needs a drafter with a tree")
    longest = max(len(p) for p in prompts)
    need = longest + max_new_tokens + spec + 1
    if longest >= model.max_seq or need > model.max_seq:
        raise ValueError(f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} + {spec} draft slots "
                         f"needs a cache of {need} positions; the engine has max_seq={model.max_seq}")


@torch.no_grad()
def generate(model: TargetModel, prompts_token_ids: list[list[int]], max_new_tokens: int,
             drafter: Drafter | None = None, k: int = 3, tree: TreeConfig | None = None,
             rule: str = "greedy", temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             thresholds=(1.0, 1.0), seed: int | list[int] = 0, stop_token_ids=None,
             use_cuda_graphs: bool = False) -> GenerateResult:
    """Generate for a batch of token-id prompts; see the module docstring.

    seed: one int (request i gets seed + i) or one seed per request. stop_token_ids: None =
    the target's EOS ids, () = never stop early. Rule 'rejection' needs draft probs (EAGLE
    heads and draft models give them; n-gram drafts are one-hot: use 'onehot')."""
    _check(model, prompts_token_ids, max_new_tokens, drafter, k, tree, rule, temperature, top_k, top_p, thresholds)
    dev = model.device
    B = len(prompts_token_ids)
    stops = set(model.args.eos_token_ids if stop_token_ids is None else stop_token_ids)
    seeds = [seed + i for i in range(B)] if isinstance(seed, int) else list(seed)
    if len(seeds) != B:
        raise ValueError("seed list must have one seed per prompt")
    gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
    graphs = use_cuda_graphs and dev.type == "cuda"
    sampling = temperature > 0

    # a fixed number of uniforms per request and step, whatever the batch drafted: a request's
    # random stream (and so its tokens) does not depend on the other requests in the batch
    n_draw = 1 + (0 if drafter is None else (tree.total_tokens if tree is not None else k))

    def uniforms(n):
        return torch.stack([torch.rand(2, n_draw, generator=g) for g in gens], 1)[:, :, :n].to(dev)  # [2, B, n]

    aux_ids = tuple(getattr(drafter, "aux_layer_ids", ()) or ()) if drafter is not None else ()
    need_final = bool(getattr(drafter, "needs_final", False)) if drafter is not None else False
    histories = [list(p) for p in prompts_token_ids]
    out_tokens: list[list[int]] = [[] for _ in range(B)]
    reasons = ["length"] * B
    active = [True] * B
    records: list[StepRecord] = []
    ctx = DraftContext(histories=histories, active=active, device=dev, max_seq=model.max_seq,
                       vocab_size=model.args.vocab_size, sample_drafts=rule == "rejection",
                       temperature=temperature, top_k=top_k, top_p=top_p, generators=gens)

    def emit(b, toks) -> int:
        n = 0
        for t in toks:
            out_tokens[b].append(t)
            histories[b].append(t)
            n += 1
            if t in stops:
                reasons[b], active[b] = "stop", False
                break
            if len(out_tokens[b]) >= max_new_tokens:
                active[b] = False
                break
        return n

    def pick(logits):            # [B, V] -> next tokens (plain sampling, prefill / no drafts)
        if not sampling:
            return logits.argmax(-1)
        p = target_probs(logits, temperature, top_k, top_p)
        return sample_inverse_cdf(p, uniforms(1)[1, :, 0])

    t0 = time.perf_counter()
    # ---- prefill
    model.reset()
    lens = torch.tensor([len(p) for p in prompts_token_ids], device=dev)
    T = int(lens.max())
    ids = torch.zeros(B, T, dtype=torch.long)
    for b, p in enumerate(prompts_token_ids):
        ids[b, :len(p)] = torch.tensor(p)
    ids = ids.to(dev)
    want_states = drafter is not None and (aux_ids or need_final)
    out = model(ids, aux_layer_ids=aux_ids, return_final=need_final,
                logits_index=None if want_states else (lens - 1)[:, None], kv_len=T)
    rows = torch.arange(B, device=dev)
    last_logits = out.logits[rows, lens - 1] if want_states else out.logits[:, 0]
    model.set_lengths(lens)
    first = pick(last_logits).tolist()
    for b in range(B):
        emit(b, [first[b]])
    if drafter is not None:
        drafter.start(ctx)
        nxt = torch.zeros(B, T, dtype=torch.long)
        for b, p in enumerate(prompts_token_ids):
            nxt[b, :len(p)] = torch.tensor(p[1:] + [first[b]])
        drafter.update(Verified(start=torch.zeros(B, dtype=torch.long, device=dev), count=lens,
                                next_tokens=nxt.to(dev), aux=out.aux, final=out.final))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    cache_len = lens.clone()                       # per-row committed lengths (device)
    forwards, steps = 0, [0] * B

    # ---- decode
    while any(active):
        act = torch.tensor(active, device=dev)
        last = torch.tensor([h[-1] for h in histories], device=dev)
        trees = None
        if drafter is None:
            inp = last[:, None]
            K, num = 0, torch.zeros(B, dtype=torch.long, device=dev)
        elif tree is None:
            prop = drafter.propose(ctx, k)
            num = torch.where(act, prop.num, torch.zeros_like(prop.num))
            K = k if graphs else int(num.max())
            drafts = torch.zeros(B, K, dtype=torch.long, device=dev)
            w = min(K, prop.tokens.shape[1])
            drafts[:, :w] = prop.tokens[:, :w]
            inp = torch.cat([last[:, None], drafts], 1)
        else:
            trees = drafter.propose_tree(ctx, tree)
            K = trees.num_nodes
            num = torch.where(act, torch.full((B,), K, device=dev), torch.zeros(B, dtype=torch.long, device=dev))
            inp = torch.cat([last[:, None], trees.tokens], 1)
        Tn = inp.shape[1]
        ar = torch.arange(Tn, device=dev)
        write_pos = cache_len[:, None] + ar
        if trees is None:
            positions, mask = write_pos, None
        else:
            positions, mask = trees.positions(cache_len), trees.ancestor_mask()
        if graphs:
            res = model.graphed_step(inp, positions, write_pos, mask, aux_ids, need_final)
        else:
            res = model(inp, positions, write_pos, mask, aux_layer_ids=aux_ids, return_final=need_final,
                        kv_len=int(cache_len.max()) + Tn)
        forwards += 1
        logits = res.logits
        ua, us = uniforms(Tn)
        p = target_probs(logits, temperature, top_k, top_p) if sampling else logits
        if trees is None:
            if K == 0:
                n_acc = torch.zeros(B, dtype=torch.long, device=dev)
                toks = pick(logits[:, 0])[:, None] if not sampling else sample_inverse_cdf(p[:, 0], us[:, 0])[:, None]
            else:
                q = None
                if rule == "rejection":
                    q = torch.zeros(B, K, p.shape[-1], device=dev)
                    w = min(K, prop.probs.shape[1])
                    q[:, :w] = prop.probs[:, :w]
                n_acc, toks = verify_chain(rule, inp[:, 1:], num, p, q, ua, us)
            path_idx = torch.arange(Tn, device=dev)[None].expand(B, Tn)        # chain: node i at slot i
        else:
            n_acc, path, toks = verify_tree(rule, trees, p, ua, us, thresholds)
            path_idx = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), path], 1)
            # move the accepted path's K/V (root + accepted nodes) into sequence order
            model.compact(cache_len[:, None] + path_idx, cache_len)
        n_acc = torch.where(act, n_acc, torch.zeros_like(n_acc))
        toks = toks.clamp(min=0)                     # -1 padding past the emitted tokens
        n_acc_l, toks_l, num_l = n_acc.tolist(), toks.tolist(), num.tolist()
        depth_prop = [trees.max_depth() if trees is not None else num_l[b] for b in range(B)]
        emitted = [0] * B
        for b in range(B):
            if not active[b]:
                continue
            emitted[b] = emit(b, toks_l[b][:n_acc_l[b] + 1])
            records.append(StepRecord(
                request=b, step=steps[b], num_proposed=num_l[b], num_accepted=n_acc_l[b],
                num_emitted=emitted[b], depth_proposed=depth_prop[b] if num_l[b] else 0,
                accepted_per_pos=[i < n_acc_l[b] for i in range(depth_prop[b] if num_l[b] else 0)]))
            steps[b] += 1
        committed = torch.where(act, n_acc + 1, torch.zeros_like(n_acc))
        if drafter is not None:
            n = int(committed.max())
            sel = path_idx[:, :max(n, 1)]
            nxt = toks[:, :max(n, 1)]
            aux = res.aux.gather(1, sel[..., None].expand(-1, -1, res.aux.shape[-1])) if res.aux is not None else None
            fin = res.final.gather(1, sel[..., None].expand(-1, -1, res.final.shape[-1])) if res.final is not None else None
            drafter.update(Verified(start=cache_len.clone(), count=committed, next_tokens=nxt, aux=aux, final=fin))
        cache_len = cache_len + committed
        model.set_lengths(cache_len)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    return GenerateResult(tokens=out_tokens, finish_reasons=reasons, records=records, elapsed_s=elapsed,
                          prefill_s=prefill_s, target_forwards=forwards)
