"""The speculative decoding loop over a batch (``generate``): draft -> verify -> accept.

Plain decoding is the same loop with no drafter (one token per forward). Each request
finishes on its own (stop token or max_new_tokens); finished rows stay in the batch with
frozen cache lengths until every request is done.

Structure (gpt-fast style): ``generate`` is the loop; the steps are methods of a per-call
``Generation``:

- ``prefill``: the prompts through the target, the first token, the drafter's first update;
- ``draft``: the drafter proposes a chain or a tree (``Draft``);
- ``verify``: one target forward over last token + drafts, then the verify rule
  (``Verdict``: how many drafts each row accepts and the tokens it emits);
- ``commit``: emit the accepted tokens (stop handling), record the step, put an accepted
  tree path's K/V in place, tell the drafter, and set the cache lengths (this both commits
  the accepted tokens and rolls back the rejected drafts).

``Generation.step`` is also the step of continuous batching (``continuous.py``); how it stays
on the device and runs in CUDA graphs is in ``graphs.py``.

Randomness: request b's generator draws, for every step s (s = 0 is the prefill's token),
``2 * (1 + K)`` uniforms (accept, sample) and k more for sampled drafts, in chunks of
``UNIFORM_CHUNK`` steps copied to the device at once; a request's draws do not depend on
the other requests in the batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..drafters import DraftContext, Drafter, Verified
from ..metrics import StepRecord, summarize
from ..model import TargetModel, prefill_attention
from ..tree import TreeConfig
from ..verify import CHAIN_RULES, RULES, TREE_RULES, sample_inverse_cdf, target_probs, verify_chain, verify_tree
from .graphs import UNIFORM_CHUNK, StepLauncher, Workspace, pow2
from .step import Draft, Verdict, chain_draft, commit_rows, fused

MAX_K = 32


@dataclass
class GenerateResult:
    tokens: list[list[int]]                   # generated tokens per request (prompt excluded)
    finish_reasons: list[str]                 # "stop" | "length"
    records: list[StepRecord] = field(default_factory=list)
    elapsed_s: float = 0.0
    prefill_s: float = 0.0
    target_forwards: int = 0                  # batched decode forwards (prefill excluded)
    graph_stats: dict = field(default_factory=dict)   # captured / replayed / eager / failed steps

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
    spec = check_drafter(model, drafter, k, tree, rule)
    longest = max(len(p) for p in prompts)
    need = longest + max_new_tokens + spec + 1
    if longest >= model.max_seq or need > model.max_seq:
        raise ValueError(f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} + {spec} draft slots "
                         f"needs a cache of {need} positions; the engine has max_seq={model.max_seq}")


def check_drafter(model, drafter, k, tree, rule) -> int:
    """The drafter against k, the tree, the rule and the target (``generate`` and continuous
    batching); returns the draft slots a step needs past a row's cache."""
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
            par = parallel_drafter(drafter)
            if par is not None:
                par.check_k(k)
            spec = chain_draft_slots(drafter, k)
    elif rule not in ("greedy", "onehot", "rejection"):
        raise ValueError(f"rule {rule!r} needs a drafter with a tree")
    if drafter is not None and getattr(drafter, "check_target", None) is not None:
        drafter.check_target(model.args.vocab_size)          # a head that does not fit: refused here, named
    return spec


def parallel_drafter(drafter):
    """The drafter, or a hybrid's head drafter, that drafts a block per forward (P-EAGLE, DFlash), if any."""
    for d in (drafter, getattr(drafter, "head", None)):
        if d is not None and hasattr(d, "check_k") and hasattr(d, "draft_slots"):
            return d
    return None


def chain_draft_slots(drafter, k: int) -> int:
    """Slots past a row's cache a chain step of k drafts may write: k, or a parallel drafter's whole
    block (DFlash runs all block_size slots whatever k), which must fit in max_seq as the drafts do."""
    par = parallel_drafter(drafter)
    return k if par is None else max(k, int(par.draft_slots(k)))


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
    gen = Generation(model, prompts_token_ids, max_new_tokens, drafter, k, tree, rule, temperature, top_k, top_p,
                     thresholds, seed, stop_token_ids, use_cuda_graphs)
    t0 = time.perf_counter()
    gen.prefill()
    sync(model.device)
    prefill_s = time.perf_counter() - t0
    gen.run()
    sync(model.device)
    elapsed = time.perf_counter() - t0
    return gen.result(elapsed, prefill_s)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def left_aligned(rows: list[list[int]], width: int) -> torch.Tensor:
    """[len(rows), width] long, row b = rows[b] then zeros."""
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = torch.tensor(r)
    return ids


class Generation(StepLauncher):
    """The state of one ``generate`` call and its steps (prefill, draft, verify, commit).
    ``step()`` is the unit captured in a CUDA graph; ``run()`` is the decode loop."""

    def __init__(self, model: TargetModel, prompts, max_new_tokens, drafter=None, k=3, tree=None, rule="greedy",
                 temperature=0.0, top_k=0, top_p=1.0, thresholds=(1.0, 1.0), seed=0, stop_token_ids=None,
                 use_cuda_graphs=False):
        _check(model, prompts, max_new_tokens, drafter, k, tree, rule, temperature, top_k, top_p, thresholds)
        self.prompts, self.max_new_tokens = [list(p) for p in prompts], max_new_tokens
        B = len(prompts)
        self.stop_ids = sorted(set(int(t) for t in (model.args.eos_token_ids if stop_token_ids is None
                                                     else stop_token_ids)))
        seeds = [seed + i for i in range(B)] if isinstance(seed, int) else list(seed)
        if len(seeds) != B:
            raise ValueError("seed list must have one seed per prompt")
        self._setup(model, B, drafter, k, tree, rule, temperature, top_k, top_p, thresholds, use_cuda_graphs,
                    [torch.Generator().manual_seed(int(s)) for s in seeds], records=pow2(max_new_tokens + 2, 8),
                    max_stops=pow2(len(self.stop_ids), 8), histories=self.prompts)

    def _setup(self, model, B, drafter, k, tree, rule, temperature, top_k, top_p, thresholds, use_cuda_graphs, gens,
               records, max_stops, histories):
        """Everything but the requests: the step's shape, the workspace, the drafter's context."""
        self.model, self.B, self.gens = model, B, gens
        self.drafter, self.k, self.rule = drafter, k, rule
        self.tree = tree if drafter is not None else None
        self.thresholds = tuple(float(t) for t in thresholds)
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.dev = dev = model.device
        self.use_graphs = use_cuda_graphs and dev.type == "cuda"
        self.sampling = temperature > 0
        tr = self.tree
        self.K = 0 if drafter is None else (tr.total_tokens if tr is not None else k)
        self.n_draw = 1 + self.K                                   # accept / sample uniforms per step
        self.n_du = k if (drafter is not None and tr is None and rule == "rejection") else 0
        self.Wu = 2 * self.n_draw + self.n_du if self.sampling else 0
        # what the target's checks and the attention width must cover past a row's cache
        self.spec = self.K if drafter is None or tr is not None else chain_draft_slots(drafter, k)
        draft_slots = (tr.depth - 1) * tr.topk if tr is not None else self.spec
        width = tr.depth + 1 if tr is not None else self.K + 1     # positions a step commits (and re-drafts)
        self.reach = max(self.K + 1, draft_slots + 1, width)       # slots past a row's cache a step may touch
        self.aux_ids = tuple(getattr(drafter, "aux_layer_ids", ()) or ()) if drafter is not None else ()
        self.need_final = bool(getattr(drafter, "needs_final", False)) if drafter is not None else False
        key = (B, self.Wu, records, max_stops)
        ws = model.workspaces.get(key)
        if ws is None:
            ws = model.workspaces[key] = Workspace(B, model.max_seq, self.Wu, *key[2:], dev)
        self.ws = ws
        self.stats = {"captured": 0, "replayed": 0, "eager": 0, "failed": 0}
        self._commit_rows = fused(commit_rows, model.compiled_bookkeeping)
        self._chain_draft = fused(chain_draft, model.compiled_bookkeeping)
        self.graph_safe = self.capture = self.inner_graphs = self.pipelined = False
        self.kv_len = model.cache.slots
        self.known_max, self.known_step, self.steps_run = 0, -1, 0
        self.t, self.done = 0, False                              # decode steps launched; finished
        self._u = None
        # the host view of the histories, pulled from the device when a drafter reads it
        self._hist_host = [list(p) for p in histories]
        self._active_host = [True] * B
        self._version = self._host_version = 0
        self.ctx = DraftContext(self._hist_host, self._active_host, dev, model.max_seq, model.args.vocab_size,
                                sample_drafts=rule == "rejection", temperature=ws.temperature, top_k=ws.top_k,
                                top_p=ws.top_p, generators=self.gens, batch=B, tokens=ws.hist,
                                lengths=ws.hist_len, active_mask=ws.active, pull=self._pull_host)

    # ---- host view, randomness ---------------------------------------------------------
    def _pull_host(self) -> None:
        """Bring ``ctx.histories`` / ``ctx.active`` up to date (a host sync; only drafters that
        are not graph_safe read them)."""
        if self._host_version == self._version:
            return
        ws = self.ws
        lens, act = ws.hist_len.tolist(), ws.active.tolist()
        lo = min(len(h) for h in self._hist_host)
        hi = max(lens)
        rows = ws.hist[:, lo:hi].tolist() if hi > lo else [[] for _ in lens]
        for b, h in enumerate(self._hist_host):
            h.extend(rows[b][len(h) - lo:lens[b] - lo])
        self._active_host[:] = act
        self._host_version = self._version

    def _refill(self) -> None:
        """The next UNIFORM_CHUNK steps of every request's uniforms, drawn on the host, into the
        device chunk (a non-blocking copy from pinned memory on CUDA)."""
        u = torch.stack([torch.rand(UNIFORM_CHUNK, self.Wu, generator=g) for g in self.gens], 1)
        if self.dev.type == "cuda":
            u = u.pin_memory()
            self.ws.uchunk.copy_(u, non_blocking=True)
            self._u_host = u                                       # keep it alive until copied
        else:
            self.ws.uchunk.copy_(u)

    def _pick(self, logits: torch.Tensor, u_sample: torch.Tensor | None) -> torch.Tensor:
        """[B, V] -> next tokens by plain decoding (argmax, or a sample from p)."""
        if not self.sampling:
            return logits.argmax(-1)
        ws = self.ws
        return sample_inverse_cdf(target_probs(logits, ws.temperature, ws.top_k, ws.top_p), u_sample)

    # ---- steps ---------------------------------------------------------------------------
    def _reset_step_state(self) -> None:
        """The workspace's sampling settings, step counter and per-step records for a new call."""
        ws = self.ws
        ws.temperature.fill_(float(self.temperature))
        ws.top_k.fill_(int(self.top_k))
        ws.top_p.fill_(float(self.top_p))
        ws.step.zero_()
        ws.rec.zero_()
        ws.flag.zero_()

    def prefill(self) -> None:
        """Run the prompts (left-aligned, one forward), emit each request's first token, reset
        the device state and give the drafter the prompt's target states."""
        m, dev, B, ws = self.model, self.dev, self.B, self.ws
        m.reset()
        lens_l = [len(p) for p in self.prompts]
        T = max(lens_l)
        lens = torch.tensor(lens_l, device=dev)
        ids = left_aligned(self.prompts, T).to(dev)
        want_states = self.drafter is not None and (self.aux_ids or self.need_final)
        with prefill_attention(m):
            out = m(ids, aux_layer_ids=self.aux_ids, return_final=self.need_final,
                    logits_index=None if want_states else (lens - 1)[:, None], kv_len=T)
        rows = torch.arange(B, device=dev)
        last_logits = out.logits[rows, lens - 1] if want_states else out.logits[:, 0]
        m.set_lengths(lens)
        ws.hist.zero_()
        ws.hist[:, :T] = ids
        ws.prompt_len.copy_(lens)
        ws.hist_len.copy_(lens)
        ws.max_new.fill_(self.max_new_tokens)
        ws.stops.fill_(-1)
        if self.stop_ids:
            ws.stops[:, :len(self.stop_ids)] = torch.tensor(self.stop_ids, device=dev)
        self._reset_step_state()
        if self.Wu:
            self._refill()
        first = self._pick(last_logits, ws.uchunk[0, :, self.n_draw] if self.Wu else None)
        ws.hist.scatter_(1, lens[:, None], first[:, None])
        ws.hist_len += 1
        hit = (first[:, None] == ws.stops).any(1)
        ws.stopped.copy_(hit)
        ws.active.copy_(~hit & (self.max_new_tokens > 1))
        self._version += 1
        if self.drafter is not None:
            self.drafter.start(self.ctx)
            self.ctx.kv_len = T
            self.drafter.update(Verified(start=torch.zeros(B, dtype=torch.long, device=dev), count=lens,
                                         next_tokens=ws.hist[:, 1:T + 1], aux=out.aux, final=out.final))
            self._host_step()
        self.graph_safe = self.drafter is None or bool(getattr(self.drafter, "graph_safe", False))
        self.capture = self.use_graphs and self.graph_safe
        self.inner_graphs = self.use_graphs and not self.graph_safe
        # a drafter with host work waits for every step anyway (host_step): reading the flags a step late would
        # only add a wasted last step
        self.pipelined = dev.type == "cuda" and self.graph_safe and not getattr(self.drafter, "has_host_step", False)
        self.known_max, self.known_step = T, -1

    def draft(self) -> Draft:
        """The drafter's proposal for every row (nothing without a drafter; finished rows
        propose nothing)."""
        B, dev, ws = self.B, self.dev, self.ws
        if self.Wu:
            self._u = ws.uchunk.index_select(0, (ws.step + 1) % UNIFORM_CHUNK)[0]     # [B, Wu] this step's
            self.ctx.draft_u = self._u[:, 2 * self.n_draw:]
        if self.drafter is None:
            last = ws.hist.gather(1, (ws.hist_len - 1)[:, None])
            return Draft(ws.active.clone(), last, torch.zeros(B, dtype=torch.long, device=dev))
        if self.tree is not None:
            act = ws.active.clone()
            last = ws.hist.gather(1, (ws.hist_len - 1)[:, None])
            trees = self.drafter.propose_tree(self.ctx, self.tree)
            num = torch.where(act, trees.num_nodes, 0)
            return Draft(act, torch.cat([last, trees.tokens], 1), num, tree=trees)
        act = ws.active.clone()        # before the drafter runs: the step's active rows
        prop = self.drafter.propose(self.ctx, self.k)
        Kp = prop.tokens.shape[1]
        # one shape per k for graphs and for graph-safe drafters; a host drafter's proposal can be narrower, and
        # so can suffix decoding's where no graph needs the full width (its host_step knows its widest draft)
        K = self.k if (self.use_graphs or self.graph_safe) else min(self.k, Kp)
        if not self.use_graphs and getattr(self.drafter, "host_width", None) is not None:
            K = min(K, self.drafter.host_width)
        tokens, num = self._chain_draft(act, ws.hist, ws.hist_len, prop.tokens.to(dev), prop.num.to(dev), K)
        probs = None
        if self.rule == "rejection" and K > 0:
            w = min(K, Kp)
            probs = torch.zeros(B, K, self.model.args.vocab_size, device=dev)
            probs[:, :w] = prop.probs[:, :w]
        return Draft(act, tokens, num, probs=probs)

    def verify(self, d: Draft) -> Verdict:
        """One target forward over last token + drafts (written after each row's committed
        cache), then the verify rule on p = target_probs(logits)."""
        m, B, dev, ws = self.model, self.B, self.dev, self.ws
        Tn = d.tokens.shape[1]
        cache_len = m.cache.lengths[:B]
        write_pos = cache_len[:, None] + torch.arange(Tn, device=dev)
        if d.tree is None:
            positions, mask = write_pos, None
        else:
            positions, mask = d.tree.positions(cache_len), d.tree.ancestor_mask()
        if self.inner_graphs:
            out = m.graphed_step(d.tokens, positions, write_pos, mask, self.aux_ids, self.need_final,
                                 kv_len=self.kv_len)
        else:
            out = m(d.tokens, positions, write_pos, mask, aux_layer_ids=self.aux_ids, return_final=self.need_final,
                    kv_len=self.kv_len)
        logits = out.logits
        if self.sampling:
            ua, us = self._u[:, :Tn], self._u[:, self.n_draw:self.n_draw + Tn]
            p = target_probs(logits, ws.temperature, ws.top_k, ws.top_p)
        else:
            ua = us = torch.zeros(B, Tn, device=dev)
            p = logits
        if d.tree is not None:
            n_acc, path, toks = verify_tree(self.rule, d.tree, p, ua, us, self.thresholds, max_depth=self.tree.depth)
            slots = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), path], 1)
        else:
            if d.K == 0:                                   # nothing drafted: plain decoding
                n_acc = torch.zeros(B, dtype=torch.long, device=dev)
                toks = (sample_inverse_cdf(p[:, 0], us[:, 0]) if self.sampling else logits[:, 0].argmax(-1))[:, None]
            else:
                n_acc, toks = verify_chain(self.rule, d.tokens[:, 1:], d.num, p, d.probs, ua, us)
            slots = torch.arange(Tn, device=dev)[None].expand(B, Tn)    # chain: position i at slot i
        n_acc = torch.where(d.active, n_acc, 0)
        return Verdict(n_acc, toks.clamp(min=0), slots, out)     # clamp: -1 pads past the emitted tokens

    def commit(self, d: Draft, v: Verdict) -> None:
        """Accept: append each active row's tokens up to a stop token or max_new_tokens (which
        finish the row) and record the step; then commit the KV cache: move an accepted tree
        path into sequence order, set each row's length to what it kept (the rejected drafts'
        slots are rolled back) and tell the drafter what was verified. All on the device, in place."""
        m, B, ws = self.model, self.B, self.ws
        if d.tree is not None:
            cache_len = m.cache.lengths[:B]
            m.compact(cache_len[:, None] + v.slots, cache_len)
        depth = d.tree.depths.amax().expand(B) if d.tree is not None else d.num
        start, committed = self._commit_rows(ws.hist, ws.hist_len, ws.prompt_len, ws.max_new, ws.stops, ws.stopped,
                                             ws.active, ws.rec, ws.step, ws.flag, m.cache.lengths, d.active, d.num,
                                             depth, v.num_accepted, v.tokens)
        if self.drafter is not None:
            W = v.tokens.shape[1]
            sel = v.slots[:, :W, None]
            aux, fin = v.out.aux, v.out.final
            self.drafter.update(Verified(
                start=start, count=committed, next_tokens=v.tokens,
                aux=aux.gather(1, sel.expand(-1, -1, aux.shape[-1])) if aux is not None else None,
                final=fin.gather(1, sel.expand(-1, -1, fin.shape[-1])) if fin is not None else None))

    def step(self) -> None:
        """One speculative step on the device: draft, verify, commit (no host sync for
        graph-safe drafters; this is what a CUDA graph captures)."""
        d = self.draft()
        self.commit(d, self.verify(d))

    # ---- the loop ------------------------------------------------------------------------
    def run(self, max_steps: int | None = None) -> bool:
        """Decode until every request is done (or ``max_steps`` more steps have run; calling
        ``run`` again continues). Returns True when generation is finished."""
        ws = self.ws
        if self.t == 0 and not self.done and not bool(ws.active.any()):
            self.done = True
        limit = self.max_new_tokens + 1
        stop_at = limit if max_steps is None else min(limit, self.t + max_steps)
        while not self.done and self.t < stop_at:
            t = self.t
            self.kv_len = self._bucket(self.known_max + (t - self.known_step) * self.reach)
            self.ctx.kv_len = self.kv_len
            if self.Wu and (t + 1) % UNIFORM_CHUNK == 0:
                self._refill()
            self._launch()
            self._version += 1
            self.t = t = t + 1
            if self.pipelined:            # read step t-2's flag while the device runs step t-1
                slot = (t - 1) % 2
                ws.pinned[slot].copy_(ws.flag, non_blocking=True)
                if ws.events is not None:
                    ws.events[slot].record()
                if t < 2:
                    continue
                if ws.events is not None:
                    ws.events[1 - slot].synchronize()
                alive, longest = ws.pinned[1 - slot].tolist()
                self.known_max, self.known_step = longest, t - 2
            else:
                alive, longest = ws.flag.tolist()
                self.known_max, self.known_step = longest, t - 1
            if not alive:
                self.done = True
        if self.t >= limit:
            self.done = True
        self.steps_run = self.t
        return self.done

    def result(self, elapsed_s: float = 0.0, prefill_s: float = 0.0) -> GenerateResult:
        """Everything back to the host at once: tokens, finish reasons, per-step records."""
        ws, B = self.ws, self.B
        n = min(self.steps_run, ws.rec.shape[0])
        hist_len, prompt_len, stopped = ws.hist_len.tolist(), ws.prompt_len.tolist(), ws.stopped.tolist()
        hist = ws.hist[:, :max(hist_len)].tolist()
        rec = ws.rec[:n].tolist()
        tokens = [hist[b][prompt_len[b]:hist_len[b]] for b in range(B)]
        reasons = ["stop" if stopped[b] else "length" for b in range(B)]
        records, steps, forwards = [], [0] * B, 0
        for r in rec:
            act, num, acc, emit, depth = r
            if not any(act):
                continue
            forwards += 1
            for b in range(B):
                if not act[b]:
                    continue
                records.append(StepRecord(request=b, step=steps[b], num_proposed=num[b], num_accepted=acc[b],
                                          num_emitted=emit[b], depth_proposed=depth[b],
                                          accepted_per_pos=[i < acc[b] for i in range(depth[b])]))
                steps[b] += 1
        return GenerateResult(tokens=tokens, finish_reasons=reasons, records=records, elapsed_s=elapsed_s,
                              prefill_s=prefill_s, target_forwards=forwards, graph_stats=dict(self.stats))
