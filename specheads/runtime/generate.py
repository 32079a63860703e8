"""The speculative decoding loop: draft -> verify -> accept, batched, one engine for all.

Plain decoding is the same loop with no drafter (one token per forward). Each request
finishes on its own (stop token or max_new_tokens); finished rows stay in the batch with
frozen cache lengths until every request is done.

Structure (gpt-fast style): ``generate`` is the loop; the steps are methods of a per-call
``_Generation`` state:

- ``prefill``: the prompts through the target, the first token, the drafter's first update;
- ``draft``: the drafter proposes a chain or a tree (``_Draft``);
- ``verify``: one target forward over last token + drafts, then the verify rule
  (``_Verdict``: how many drafts each row accepts and the tokens it emits);
- ``commit``: emit the accepted tokens (stop handling), record the step, put an accepted
  tree path's K/V in place, tell the drafter, and set the cache lengths (this both commits
  the accepted tokens and rolls back the rejected drafts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .drafters import DraftContext, Drafter, Verified
from .metrics import StepRecord, summarize
from .model import ForwardOutput, TargetModel
from .tree import DraftTree, TreeConfig
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
    gen = _Generation(model, prompts_token_ids, max_new_tokens, drafter, k, tree, rule, temperature, top_k, top_p,
                      thresholds, seed, stop_token_ids, use_cuda_graphs)
    t0 = time.perf_counter()
    gen.prefill()
    _sync(model.device)
    prefill_s = time.perf_counter() - t0
    while any(gen.active):
        draft = gen.draft()
        verdict = gen.verify(draft)
        gen.commit(draft, verdict)
    _sync(model.device)
    return GenerateResult(tokens=gen.out_tokens, finish_reasons=gen.reasons, records=gen.records,
                          elapsed_s=time.perf_counter() - t0, prefill_s=prefill_s, target_forwards=gen.forwards)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _left_aligned(rows: list[list[int]], width: int) -> torch.Tensor:
    """[len(rows), width] long, row b = rows[b] then zeros."""
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = torch.tensor(r)
    return ids


# ---------------------------------------------------------------------------- one step
@dataclass
class _Draft:
    """What the target verifies this step: ``tokens [B, 1+K]`` = each row's last emitted
    token (not in the cache yet) followed by its K drafts (chain) or tree nodes."""
    active: torch.Tensor                  # [B] bool: the rows still generating when the step began
    tokens: torch.Tensor                  # [B, 1+K]
    num: torch.Tensor                     # [B] real drafts per row (0: finished row or no drafter)
    tree: DraftTree | None = None
    probs: torch.Tensor | None = None     # [B, K, V] draft probabilities (rule 'rejection')

    @property
    def K(self) -> int:
        return self.tokens.shape[1] - 1


@dataclass
class _Verdict:
    """The verify rule's answer: row b emits ``tokens[b, :num_accepted[b] + 1]`` (the accepted
    drafts, then the correction or bonus token)."""
    num_accepted: torch.Tensor            # [B] (0 for finished rows)
    tokens: torch.Tensor                  # [B, >= 1]
    slots: torch.Tensor                   # [B, n] slot of accepted position i, as an offset from the
                                          #        row's cache length (chain: i; tree: root + path)
    out: ForwardOutput                    # the verify forward (aux / final for the drafter)


# ---------------------------------------------------------------------------- per-call state
class _Generation:
    """The state of one ``generate`` call and its steps (prefill, draft, verify, commit)."""

    def __init__(self, model: TargetModel, prompts, max_new_tokens, drafter, k, tree, rule, temperature, top_k,
                 top_p, thresholds, seed, stop_token_ids, use_cuda_graphs):
        self.model, self.prompts, self.max_new_tokens = model, prompts, max_new_tokens
        self.drafter, self.k, self.tree, self.rule, self.thresholds = drafter, k, tree, rule, thresholds
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.dev = dev = model.device
        self.B = B = len(prompts)
        self.stops = set(model.args.eos_token_ids if stop_token_ids is None else stop_token_ids)
        seeds = [seed + i for i in range(B)] if isinstance(seed, int) else list(seed)
        if len(seeds) != B:
            raise ValueError("seed list must have one seed per prompt")
        self.gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
        self.graphs = use_cuda_graphs and dev.type == "cuda"
        self.sampling = temperature > 0
        # a fixed number of uniforms per request and step, whatever the batch drafted: a request's
        # random stream (and so its tokens) does not depend on the other requests in the batch
        self.n_draw = 1 + (0 if drafter is None else (tree.total_tokens if tree is not None else k))
        self.aux_ids = tuple(getattr(drafter, "aux_layer_ids", ()) or ()) if drafter is not None else ()
        self.need_final = bool(getattr(drafter, "needs_final", False)) if drafter is not None else False

        self.histories = [list(p) for p in prompts]      # prompt + emitted; shared with the drafter
        self.out_tokens: list[list[int]] = [[] for _ in range(B)]
        self.reasons = ["length"] * B
        self.active = [True] * B
        self.records: list[StepRecord] = []
        self.steps = [0] * B                             # decode steps per request
        self.forwards = 0                                # batched decode forwards
        self.cache_len: torch.Tensor | None = None       # [B] committed cache lengths (device)
        self.ctx = DraftContext(histories=self.histories, active=self.active, device=dev, max_seq=model.max_seq,
                                vocab_size=model.args.vocab_size, sample_drafts=rule == "rejection",
                                temperature=temperature, top_k=top_k, top_p=top_p, generators=self.gens)

    # ---- randomness and emission -------------------------------------------------------
    def _uniforms(self, n: int) -> torch.Tensor:
        """[2, B, n]: (accept, sample) uniforms, row b from request b's generator."""
        return torch.stack([torch.rand(2, self.n_draw, generator=g) for g in self.gens], 1)[:, :, :n].to(self.dev)

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V] -> next tokens by plain decoding (argmax, or a sample from p)."""
        if not self.sampling:
            return logits.argmax(-1)
        p = target_probs(logits, self.temperature, self.top_k, self.top_p)
        return sample_inverse_cdf(p, self._uniforms(1)[1, :, 0])

    def _emit(self, b: int, toks: list[int]) -> int:
        """Append tokens to request b until a stop token or max_new_tokens (which finish the
        request); return how many were emitted."""
        n = 0
        for t in toks:
            self.out_tokens[b].append(t)
            self.histories[b].append(t)
            n += 1
            if t in self.stops:
                self.reasons[b], self.active[b] = "stop", False
                break
            if len(self.out_tokens[b]) >= self.max_new_tokens:
                self.active[b] = False
                break
        return n

    # ---- steps ---------------------------------------------------------------------------
    def prefill(self) -> None:
        """Run the prompts (left-aligned, one forward), emit each request's first token and
        give the drafter the prompt's target states."""
        m, dev, B = self.model, self.dev, self.B
        m.reset()
        lens = torch.tensor([len(p) for p in self.prompts], device=dev)
        T = int(lens.max())
        ids = _left_aligned(self.prompts, T).to(dev)
        want_states = self.drafter is not None and (self.aux_ids or self.need_final)
        out = m(ids, aux_layer_ids=self.aux_ids, return_final=self.need_final,
                logits_index=None if want_states else (lens - 1)[:, None], kv_len=T)
        rows = torch.arange(B, device=dev)
        last_logits = out.logits[rows, lens - 1] if want_states else out.logits[:, 0]
        m.set_lengths(lens)
        first = self._pick(last_logits).tolist()
        for b in range(B):
            self._emit(b, [first[b]])
        if self.drafter is not None:
            self.drafter.start(self.ctx)
            nxt = _left_aligned([p[1:] + [first[b]] for b, p in enumerate(self.prompts)], T)
            self.drafter.update(Verified(start=torch.zeros(B, dtype=torch.long, device=dev), count=lens,
                                         next_tokens=nxt.to(dev), aux=out.aux, final=out.final))
        self.cache_len = lens.clone()

    def draft(self) -> _Draft:
        """The drafter's proposal for every row (nothing without a drafter; finished rows
        propose nothing)."""
        B, dev = self.B, self.dev
        act = torch.tensor(self.active, device=dev)
        last = torch.tensor([h[-1] for h in self.histories], device=dev)[:, None]
        if self.drafter is None:
            return _Draft(act, last, torch.zeros(B, dtype=torch.long, device=dev))
        if self.tree is not None:
            trees = self.drafter.propose_tree(self.ctx, self.tree)
            K = trees.num_nodes
            num = torch.where(act, torch.full((B,), K, device=dev), torch.zeros(B, dtype=torch.long, device=dev))
            return _Draft(act, torch.cat([last, trees.tokens], 1), num, tree=trees)
        prop = self.drafter.propose(self.ctx, self.k)
        num = torch.where(act, prop.num, torch.zeros_like(prop.num))
        K = self.k if self.graphs else int(num.max())      # CUDA graphs want one shape per k
        drafts = torch.zeros(B, K, dtype=torch.long, device=dev)
        w = min(K, prop.tokens.shape[1])
        drafts[:, :w] = prop.tokens[:, :w]
        probs = None
        if self.rule == "rejection" and K > 0:
            probs = torch.zeros(B, K, self.model.args.vocab_size, device=dev)
            w = min(K, prop.probs.shape[1])
            probs[:, :w] = prop.probs[:, :w]
        return _Draft(act, torch.cat([last, drafts], 1), num, probs=probs)

    def verify(self, d: _Draft) -> _Verdict:
        """One target forward over last token + drafts (written after each row's committed
        cache), then the verify rule on p = target_probs(logits)."""
        m, B, dev = self.model, self.B, self.dev
        Tn = d.tokens.shape[1]
        write_pos = self.cache_len[:, None] + torch.arange(Tn, device=dev)
        if d.tree is None:
            positions, mask = write_pos, None
        else:
            positions, mask = d.tree.positions(self.cache_len), d.tree.ancestor_mask()
        if self.graphs:
            out = m.graphed_step(d.tokens, positions, write_pos, mask, self.aux_ids, self.need_final)
        else:
            out = m(d.tokens, positions, write_pos, mask, aux_layer_ids=self.aux_ids, return_final=self.need_final,
                    kv_len=int(self.cache_len.max()) + Tn)
        self.forwards += 1
        logits = out.logits
        ua, us = self._uniforms(Tn)
        p = target_probs(logits, self.temperature, self.top_k, self.top_p) if self.sampling else logits
        if d.tree is not None:
            n_acc, path, toks = verify_tree(self.rule, d.tree, p, ua, us, self.thresholds)
            slots = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), path], 1)
        else:
            if d.K == 0:                                   # nothing drafted: plain decoding
                n_acc = torch.zeros(B, dtype=torch.long, device=dev)
                toks = (sample_inverse_cdf(p[:, 0], us[:, 0]) if self.sampling else logits[:, 0].argmax(-1))[:, None]
            else:
                n_acc, toks = verify_chain(self.rule, d.tokens[:, 1:], d.num, p, d.probs, ua, us)
            slots = torch.arange(Tn, device=dev)[None].expand(B, Tn)    # chain: position i at slot i
        n_acc = torch.where(d.active, n_acc, torch.zeros_like(n_acc))
        return _Verdict(n_acc, toks.clamp(min=0), slots, out)     # clamp: -1 pads past the emitted tokens

    def commit(self, d: _Draft, v: _Verdict) -> None:
        """Accept: emit each active row's tokens (stop handling) and record the step; then
        commit the KV cache: move an accepted tree path into sequence order, tell the
        drafter what was verified, and set each row's length to what it kept (the rejected
        drafts' slots are rolled back)."""
        if d.tree is not None:
            self.model.compact(self.cache_len[:, None] + v.slots, self.cache_len)
        self._accept(d, v)
        committed = torch.where(d.active, v.num_accepted + 1, torch.zeros_like(v.num_accepted))
        if self.drafter is not None:
            n = max(int(committed.max()), 1)
            sel = v.slots[:, :n, None]
            aux, fin = v.out.aux, v.out.final
            self.drafter.update(Verified(
                start=self.cache_len.clone(), count=committed, next_tokens=v.tokens[:, :n],
                aux=aux.gather(1, sel.expand(-1, -1, aux.shape[-1])) if aux is not None else None,
                final=fin.gather(1, sel.expand(-1, -1, fin.shape[-1])) if fin is not None else None))
        self.cache_len = self.cache_len + committed
        self.model.set_lengths(self.cache_len)

    def _accept(self, d: _Draft, v: _Verdict) -> None:
        n_acc, toks, num = v.num_accepted.tolist(), v.tokens.tolist(), d.num.tolist()
        for b in range(self.B):
            if not self.active[b]:
                continue
            depth = (d.tree.max_depth() if d.tree is not None else num[b]) if num[b] else 0
            emitted = self._emit(b, toks[b][:n_acc[b] + 1])
            self.records.append(StepRecord(
                request=b, step=self.steps[b], num_proposed=num[b], num_accepted=n_acc[b], num_emitted=emitted,
                depth_proposed=depth, accepted_per_pos=[i < n_acc[b] for i in range(depth)]))
            self.steps[b] += 1
