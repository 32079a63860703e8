"""The speculative decoding loop: draft -> verify -> accept, batched, one engine for all.

Plain decoding is the same loop with no drafter (one token per forward). Each request
finishes on its own (stop token or max_new_tokens); finished rows stay in the batch with
frozen cache lengths until every request is done.

Structure (gpt-fast style): ``generate`` is the loop; the steps are methods of a per-call
``Generation``:

- ``prefill``: the prompts through the target, the first token, the drafter's first update;
- ``draft``: the drafter proposes a chain or a tree (``_Draft``);
- ``verify``: one target forward over last token + drafts, then the verify rule
  (``_Verdict``: how many drafts each row accepts and the tokens it emits);
- ``commit``: emit the accepted tokens (stop handling), record the step, put an accepted
  tree path's K/V in place, tell the drafter, and set the cache lengths (this both commits
  the accepted tokens and rolls back the rejected drafts).

Everything a step reads and writes lives on the device (issue 14): the token history
``[B, max_seq]``, per-row lengths, the active / stopped flags, the per-step records and the
step's uniforms sit in a ``_Workspace`` kept on the engine per shape and updated in place;
stop detection and max_new_tokens are batched tensor ops. So ``step()`` (draft + verify +
commit) never reads a device value on the host and, with ``use_cuda_graphs`` and a
``graph_safe`` drafter (none, the device n-gram proposer, the heads, the hybrid), is
captured as ONE CUDA graph per (batch, k or tree, rule, attention width) and replayed.
The host reads two numbers per step (any row active, longest cache), copied to pinned
memory and read one step late on CUDA, so the host queues step t+1 while the device runs
step t (one wasted step at the end, which touches no active row). The attention width
``kv_len`` is a host bound on the longest row (from those numbers), rounded up to a power
of two for graphs (>= KV_BUCKET_MIN) or to 16 eagerly. A shape that was not captured
(new k, tree, width) is captured on first use after running eagerly once; a step that
cannot be captured runs eagerly (``GenerateResult.graph_stats['failed']``) - never a wrong
result. Drafters that read the host view (``ctx.histories``) run eagerly with one sync per
step, with the target forward in the engine's per-forward graphs.

Continuous batching (``generate_continuous``, ``ContinuousGeneration``, and ``generate_flows`` for
multi-step work; plain decoding, or chains from a drafter whose state is on the device):
the same step over a fixed set of slots, with a finished row's slot refilled by the next
request (a prefill of just the new prompts into their cache rows, and the drafter's first pass
over them into its rows) between steps, so the step's graphs stay valid. Data generation
(regenerate, synthesize) runs this way, and so does the serving benchmark (drafters in a batch
whose finished rows are refilled, as in a server, not held back by the batch's slowest row).

Randomness: request b's generator draws, for every step s (s = 0 is the prefill's token),
``2 * (1 + K)`` uniforms (accept, sample) and k more for sampled drafts, in chunks of
``UNIFORM_CHUNK`` steps copied to the device at once; a request's draws do not depend on
the other requests in the batch.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .drafters import DraftContext, Drafter, Verified
from .metrics import StepRecord, summarize
from .model import ForwardOutput, TargetModel, prefill_attention, round_up
from .tree import DraftTree, TreeConfig
from .verify import CHAIN_RULES, RULES, TREE_RULES, sample_inverse_cdf, target_probs, verify_chain, verify_tree

MAX_K = 32
KV_BUCKET_MIN = 128           # smallest attention width of a captured step
UNIFORM_CHUNK = 32            # decode steps of uniforms drawn on the host per copy


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
    spec = _check_drafter(model, drafter, k, tree, rule)
    longest = max(len(p) for p in prompts)
    need = longest + max_new_tokens + spec + 1
    if longest >= model.max_seq or need > model.max_seq:
        raise ValueError(f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} + {spec} draft slots "
                         f"needs a cache of {need} positions; the engine has max_seq={model.max_seq}")


def _check_drafter(model, drafter, k, tree, rule) -> int:
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
            spec = k
    elif rule not in ("greedy", "onehot", "rejection"):
        raise ValueError(f"rule {rule!r} needs a drafter with a tree")
    if drafter is not None and getattr(drafter, "check_target", None) is not None:
        drafter.check_target(model.args.vocab_size)          # a head that does not fit: refused here, named
    return spec


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
    _sync(model.device)
    prefill_s = time.perf_counter() - t0
    gen.run()
    _sync(model.device)
    elapsed = time.perf_counter() - t0
    return gen.result(elapsed, prefill_s)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _left_aligned(rows: list[list[int]], width: int) -> torch.Tensor:
    """[len(rows), width] long, row b = rows[b] then zeros."""
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = torch.tensor(r)
    return ids


def _pow2(n: int, least: int = 1) -> int:
    p = least
    while p < n:
        p *= 2
    return p


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
    tokens: torch.Tensor                  # [B, W] (W = K+1 for chains, depth+1 for trees)
    slots: torch.Tensor                   # [B, W] slot of accepted position i, as an offset from the
                                          #        row's cache length (chain: i; tree: root + path)
    out: ForwardOutput                    # the verify forward (aux / final for the drafter)


# ---------------------------------------------------------------------------- device state
class _Workspace:
    """``generate``'s device state for one shape, kept on the engine (``model.workspaces``) and
    reset in place by every call, so that step graphs captured by one call replay in the next.
    ``rec[r]`` holds decode step r: (active at its start, drafts proposed, accepted, emitted,
    depth offered) per row."""

    def __init__(self, B: int, S: int, Wu: int, R: int, NS: int, dev: torch.device):
        L = torch.long
        self.hist = torch.zeros(B, S, dtype=L, device=dev)          # prompt + emitted tokens
        self.hist_len = torch.zeros(B, dtype=L, device=dev)
        self.prompt_len = torch.zeros(B, dtype=L, device=dev)
        self.active = torch.zeros(B, dtype=torch.bool, device=dev)
        self.stopped = torch.zeros(B, dtype=torch.bool, device=dev)
        self.max_new = torch.zeros(B, dtype=L, device=dev)
        self.stops = torch.full((B, NS), -1, dtype=L, device=dev)  # per row: continuous batching mixes requests
        self.step = torch.zeros(1, dtype=L, device=dev)            # decode step index
        self.temperature = torch.zeros((), dtype=torch.float32, device=dev)
        self.top_k = torch.zeros((), dtype=L, device=dev)
        self.top_p = torch.ones((), dtype=torch.float32, device=dev)
        self.uchunk = torch.zeros(UNIFORM_CHUNK, B, Wu, device=dev) if Wu else None
        self.rec = torch.zeros(R, 5, B, dtype=L, device=dev)
        self.row_steps = torch.zeros(B, dtype=L, device=dev)       # steps each row was active in (continuous)
        self.flag = torch.zeros(2, dtype=L, device=dev)             # (any row active, longest cache)
        cuda = dev.type == "cuda"
        self.pinned = torch.zeros(2, 2, dtype=L, pin_memory=cuda)
        self.events = [torch.cuda.Event(), torch.cuda.Event()] if cuda else None
        self.graphs: dict = {}


# ---------------------------------------------------------------------------- step bookkeeping
# Pure tensor functions of a step's bookkeeping. On a compiled engine they run through torch.compile
# (``_fused``): eagerly they are ~60 small kernels a step, about a tenth of a graphed SmolLM2 step at
# batch 1, and they are what a drafted step has more of than a plain one.
def chain_draft(active, hist, hist_len, prop_tokens, prop_num, K: int):
    """A step's input for a chain: (tokens [B, 1+K] = each row's last token and its drafts (0-padded
    past the proposal), num [B] (0 for finished rows))."""
    B = hist.shape[0]
    last = hist.gather(1, (hist_len - 1)[:, None])
    w = min(K, prop_tokens.shape[1])
    drafts = torch.zeros(B, K, dtype=torch.long, device=hist.device)
    drafts[:, :w] = prop_tokens[:, :w]
    num = torch.where(active, prop_num.clamp(max=K), 0)
    return torch.cat([last, drafts], 1), num


def commit_rows(hist, hist_len, prompt_len, max_new, stops, stopped, active, rec, step, flag, lengths,
                act, num, depth, n_acc, toks):
    """The commit's bookkeeping, in place: append each active row's emitted tokens ``toks[:, :n]``
    (n = accepted + 1, cut at a stop token or max_new_tokens) to ``hist``, record the step in
    ``rec``, advance the cache ``lengths`` by what each row kept, finish rows, set ``flag``.
    Returns (start, committed): each row's cache length before the step and the positions it kept."""
    B, W = toks.shape
    cache_len = lengths[:B]
    pos = torch.arange(W, device=toks.device)
    is_stop = (toks[:, :, None] == stops[:, None, :]).any(-1) & (pos <= n_acc[:, None])
    any_stop = is_stop.any(1)
    first_stop = torch.where(any_stop, is_stop.long().argmax(1), W)
    room = max_new - (hist_len - prompt_len)
    n_emit = torch.minimum(torch.minimum(n_acc + 1, room), first_stop + 1)
    n_emit = torch.where(act, n_emit, 0)
    hit = act & any_stop & (first_stop < n_emit)
    idx = (hist_len[:, None] + pos).clamp(max=hist.shape[1] - 1)
    hist.scatter_(1, idx, torch.where(pos < n_emit[:, None], toks, hist.gather(1, idx)))
    row = torch.stack([act.long(), num, n_acc, n_emit, torch.where(num > 0, depth, 0)])
    rec.index_copy_(0, step.clamp(max=rec.shape[0] - 1), row[None])
    committed = torch.where(act, n_acc + 1, 0)
    start = cache_len.clone()
    cache_len += committed
    hist_len += n_emit
    finished = hit | (hist_len - prompt_len >= max_new)
    stopped |= hit
    active &= ~finished
    step += 1
    flag.copy_(torch.stack([active.any().long(), cache_len.max()]))
    return start, committed


_COMPILED: dict = {}


def _fused(fn, on: bool):
    """``fn`` through torch.compile (one compiled function per process; static shapes: a step's
    shapes are fixed per captured graph) when ``on``, else ``fn``."""
    if not on:
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn]


_FAILED = "failed"


class Generation:
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
                    [torch.Generator().manual_seed(int(s)) for s in seeds], records=_pow2(max_new_tokens + 2, 8),
                    max_stops=_pow2(len(self.stop_ids), 8), histories=self.prompts)

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
        draft_slots = (tr.depth - 1) * tr.topk if tr is not None else self.K
        width = tr.depth + 1 if tr is not None else self.K + 1     # positions a step commits (and re-drafts)
        self.reach = max(self.K + 1, draft_slots + 1, width)       # slots past a row's cache a step may touch
        self.aux_ids = tuple(getattr(drafter, "aux_layer_ids", ()) or ()) if drafter is not None else ()
        self.need_final = bool(getattr(drafter, "needs_final", False)) if drafter is not None else False
        key = (B, self.Wu, records, max_stops)
        ws = model.workspaces.get(key)
        if ws is None:
            ws = model.workspaces[key] = _Workspace(B, model.max_seq, self.Wu, *key[2:], dev)
        self.ws = ws
        self.stats = {"captured": 0, "replayed": 0, "eager": 0, "failed": 0}
        self._commit_rows = _fused(commit_rows, model.compiled_bookkeeping)
        self._chain_draft = _fused(chain_draft, model.compiled_bookkeeping)
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
        ids = _left_aligned(self.prompts, T).to(dev)
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
        self.graph_safe = self.drafter is None or bool(getattr(self.drafter, "graph_safe", False))
        self.capture = self.use_graphs and self.graph_safe
        self.inner_graphs = self.use_graphs and not self.graph_safe
        self.pipelined = dev.type == "cuda" and self.graph_safe
        self.known_max, self.known_step = T, -1

    def draft(self) -> _Draft:
        """The drafter's proposal for every row (nothing without a drafter; finished rows
        propose nothing)."""
        B, dev, ws = self.B, self.dev, self.ws
        if self.Wu:
            self._u = ws.uchunk.index_select(0, (ws.step + 1) % UNIFORM_CHUNK)[0]     # [B, Wu] this step's
            self.ctx.draft_u = self._u[:, 2 * self.n_draw:]
        if self.drafter is None:
            last = ws.hist.gather(1, (ws.hist_len - 1)[:, None])
            return _Draft(ws.active.clone(), last, torch.zeros(B, dtype=torch.long, device=dev))
        if self.tree is not None:
            act = ws.active.clone()
            last = ws.hist.gather(1, (ws.hist_len - 1)[:, None])
            trees = self.drafter.propose_tree(self.ctx, self.tree)
            num = torch.where(act, trees.num_nodes, 0)
            return _Draft(act, torch.cat([last, trees.tokens], 1), num, tree=trees)
        act = ws.active.clone()        # before the drafter runs: the step's active rows
        prop = self.drafter.propose(self.ctx, self.k)
        Kp = prop.tokens.shape[1]
        # one shape per k for graphs and for graph-safe drafters; a host drafter's proposal can be narrower
        K = self.k if (self.use_graphs or self.graph_safe) else min(self.k, Kp)
        tokens, num = self._chain_draft(act, ws.hist, ws.hist_len, prop.tokens.to(dev), prop.num.to(dev), K)
        probs = None
        if self.rule == "rejection" and K > 0:
            w = min(K, Kp)
            probs = torch.zeros(B, K, self.model.args.vocab_size, device=dev)
            probs[:, :w] = prop.probs[:, :w]
        return _Draft(act, tokens, num, probs=probs)

    def verify(self, d: _Draft) -> _Verdict:
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
        return _Verdict(n_acc, toks.clamp(min=0), slots, out)     # clamp: -1 pads past the emitted tokens

    def commit(self, d: _Draft, v: _Verdict) -> None:
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
    def _bucket(self, need: int) -> int:
        """The attention width for a step that touches at most ``need`` slots of any row: powers of
        two >= KV_BUCKET_MIN on a GPU (few graph shapes; eager GPU steps use the same widths, so
        they run the very kernels a graph replays), a multiple of 16 on a CPU (cost ~ width)."""
        S = self.model.cache.slots
        if self.capture or self.inner_graphs or self.dev.type == "cuda":
            return min(_pow2(need, KV_BUCKET_MIN), S)
        return min(round_up(need), S)

    def _graph_key(self):
        d = self.drafter
        return (id(d), self.K, self.tree, self.rule, self.sampling, self.thresholds, self.kv_len, self.aux_ids,
                self.need_final, self.n_draw, self.n_du)

    def _launch(self) -> None:
        """Run one step: replay its captured graph, or run it eagerly (and capture it, the first
        time a shape is seen)."""
        if not self.capture:
            self.stats["eager"] += 1
            self.step()
            return
        key = self._graph_key()
        entry = self.ws.graphs.get(key)
        if entry is not None and entry[0] is not _FAILED:
            entry[0].replay()
            self.stats["replayed"] += 1
            return
        self.stats["eager"] += 1
        self.step()                     # the real step (it also compiles kernels and warms cuBLAS up)
        if entry is None:
            self.ws.graphs[key] = self._capture()

    def _capture(self):
        """Capture ``step()`` (nothing runs while capturing: the state is untouched)."""
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, pool=self.model.graph_pool()):
                self.step()
        except Exception as e:         # a drafter that syncs: keep running eagerly, never a wrong result
            warnings.warn(f"speculative step not captured in a CUDA graph ({type(e).__name__}: {e}); "
                          f"this shape runs eagerly", RuntimeWarning, stacklevel=3)
            self.stats["failed"] += 1
            return (_FAILED, None)
        self.stats["captured"] += 1
        return (g, self.drafter)        # holds the drafter: the key has its id

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


# ---------------------------------------------------------------------------- continuous batching
@dataclass
class Request:
    """One sequence for ``generate_continuous``. ``tag`` is the caller's (handed back with the result)."""
    prompt: list[int]
    max_new_tokens: int
    seed: int = 0
    stop_token_ids: Sequence[int] | None = None    # None: the target's EOS ids; (): never stop early
    tag: Any = None
    target_forwards: int = 0                       # set when it finishes: its decode steps (its τ is
                                                   # (len(tokens) - 1) / target_forwards: the first token is the prefill's)


MAX_STOP_IDS = 16             # stop ids one continuous request may have (the workspace's width)


class ContinuousGeneration(Generation):
    """Decoding over a stream of requests: a row that finishes gives its cache slot to the next
    request at once instead of idling until the longest row of its batch is done. Plain (greedy,
    or sampled with the one-hot rule), or speculative with a chain ``drafter`` whose state lives
    on the device row by row (``Drafter.admit``: the heads, the device n-gram proposer, the
    hybrid), greedy or sampled (``rule``: 'onehot', or 'rejection' for drafters with probabilities).

    The decode step is ``Generation.step`` (plus a per-row count of the target forwards; one CUDA
    graph per shape, replayed across refills); what
    happens between steps: every ``sync_every`` steps (fewer when a row must hit its length cap
    sooner) one host read finds the finished rows (``_harvest``); their tokens go to
    ``on_finish``, and free slots are refilled (``_admit``): a batched prefill of just the new
    prompts, written into the static cache at their slots (``TargetModel.forward(rows=...)``),
    first token picked, workspace rows reset, the drafter's first pass over the new prompts
    (``Drafter.admit``) - while the other rows keep their state.

    A request's output does not depend on its neighbours or slot: its prefill and decode rows
    compute the same as alone, and its uniforms come from its own generator in its own order
    (``_join_uniforms``).

    ``refill_at``: free slots wait until at least this many are free (or no row is left) before
    they are refilled. A prefill has a fixed cost (one eager forward through every layer, tens of
    ms on a GPU, against a few ms per graphed decode step), so refilling one slot at a time can
    cost more than the idle slots it saves; outputs do not change.

    ``pipeline_harvest`` (default off): the harvest reads a snapshot of the rows taken one
    block earlier, copied to pinned memory behind that block, while the device runs the next
    block; so neither the read nor the admission's prefill (whose inputs go over pinned and
    non-blocking) waits for the queue to drain. A finished row is seen one block late and its
    slot refilled then: rows that are done stay inactive, and a step leaves inactive rows as they
    were, so the late read sees what an immediate one would; outputs do not change. Off, every
    harvest is a host read of the live state (one drain of the queue each time). Off by default:
    on the H200 (2026-12-03, compiled engine, CUDA graphs, 152 mixed requests) it was slower than the
    live read at 8 slots (3,545 vs 3,779 tok/s plain) and at 48 (16,348 vs 16,698): each row seen one
    block late costs steps (2,018 target steps against 1,946 at 8 slots) that the overlap does not repay.
    ``generate_flows`` (bulk generation through hundreds of slots) turns it on, on a GPU."""

    def __init__(self, model: TargetModel, batch_size: int | None = None, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, use_cuda_graphs: bool = False, sync_every: int = 8,
                 prefill_tokens: int = 32768, refill_at: int = 1, *, drafter: Drafter | None = None, k: int = 3,
                 rule: str | None = None, pipeline_harvest: bool = False):
        B = batch_size or model.max_batch
        if not 1 <= B <= model.max_batch:
            raise ValueError(f"batch_size {B} must be in 1..engine max_batch {model.max_batch}")
        if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
            raise ValueError(f"need temperature >= 0, top_k >= 0 and 0 < top_p <= 1, got {temperature}, {top_k}, {top_p}")
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        if refill_at < 1:
            raise ValueError(f"refill_at must be >= 1, got {refill_at}")
        if rule is None:
            rule = "onehot" if temperature > 0 else "greedy"
        if (rule == "greedy") != (temperature == 0) or rule not in CHAIN_RULES or (drafter is None and rule == "rejection"):
            raise ValueError(f"rule {rule!r} does not fit temperature {temperature}"
                             f"{'' if drafter is not None else ' without a drafter'}: continuous batching takes "
                             f"'greedy' at temperature 0, else 'onehot' (or 'rejection' with a drafter)")
        _check_drafter(model, drafter, k, None, rule)
        self._setup(model, B, drafter, k, None, rule, temperature, top_k, top_p, (1.0, 1.0), use_cuda_graphs,
                    [torch.Generator() for _ in range(B)], records=8, max_stops=MAX_STOP_IDS,
                    histories=[[] for _ in range(B)])
        self.sync_every, self.prefill_tokens, self.refill_at = sync_every, prefill_tokens, min(refill_at, B)
        self.slot_req: list[Request | None] = [None] * B
        self.pipeline_harvest = bool(pipeline_harvest)
        # per slot, what the host knows of its request without a read: cache length before step
        # known_t, tokens it may still emit then, first snapshot that shows this request
        self.known_len, self.known_t, self.known_left = [0] * B, [0] * B, [0] * B
        self.valid_from = [0] * B
        self.n_snap = 0
        self._snaps, self._snap_width = None, [0, 0]
        self.stats.update(requests=0, tokens=0, steps=0, prefills=0, syncs=0, decode_tokens=0, row_steps=0)

    # ---- the loop ------------------------------------------------------------------------
    def serve(self, requests: Iterable[Request], on_finish: Callable[[Request, list[int], str], Request | None]) -> None:
        """Generate for every request of ``requests`` (pulled lazily, in order, as slots free up).
        ``on_finish(request, tokens, reason)`` gets each result ("stop" | "length") as soon as it
        is seen; the request it returns (a conversation's next turn) is served before the rest."""
        self.source, self.on_finish, self.followups = iter(requests), on_finish, deque()
        self._reset()
        if self.pipeline_harvest:
            return self._serve_pipelined()
        while True:
            live, longest, room = self._harvest()
            if self._admit(live):
                continue                 # harvest again: a new row may have finished at its first token
            if not live:
                return
            self._decode(min(self.sync_every, room), longest - (self.t - 1) * self.reach)

    def _serve_pipelined(self) -> None:
        """``serve``'s loop with the harvest one block behind: launch a block of steps and a
        snapshot behind it, then read the snapshot before it (the device runs the new block
        meanwhile), hand out what finished there and admit into the freed slots. The width of
        each step and the block's length come from what the host knows per slot (its last
        snapshot, or its admission), as the synchronous loop's come from its read."""
        B, pending = self.B, deque()       # snapshots recorded, not read: (number, step after them)
        self._admit(0)
        while True:
            live = [b for b in range(B) if self.slot_req[b] is not None]
            left = {b: self.known_left[b] - (self.t - self.known_t[b]) for b in live}
            going = [b for b in live if left[b] > 0]     # the rest are done by now (length cap)
            if going:
                base = max(self.known_len[b] - (self.known_t[b] - 1) * self.reach for b in live)
                self._decode(min(self.sync_every, min(left[b] for b in going)), base)
            if going or (live and not pending):
                pending.append(self._snapshot())
            if not pending:
                if self._admit(0):
                    continue
                return
            if going and len(pending) < 2:
                continue                 # keep a block in flight ahead of the snapshot read
            self._harvest_snapshot(*pending.popleft())
            self._admit(sum(r is not None for r in self.slot_req))

    def _reset(self) -> None:
        ws = self.ws
        self.model.reset()
        ws.hist.zero_()
        ws.hist_len.fill_(1)             # an empty slot decodes token 0 and is never read
        ws.prompt_len.zero_()
        ws.active.zero_()
        ws.stopped.zero_()
        ws.max_new.zero_()
        ws.stops.fill_(-1)
        ws.row_steps.zero_()
        self._reset_step_state()
        self.t = 0
        if self.drafter is not None:
            self.drafter.start(self.ctx)
            if not getattr(self.drafter, "graph_safe", False):
                raise ValueError(f"{type(self.drafter).__name__} reads a host view of the batch: continuous batching "
                                 f"needs a drafter whose state is on the device (a head, NGramDrafter(backend="
                                 f"'device'), a hybrid of the two)")
        self.graph_safe = True
        self.capture = self.use_graphs    # the step never syncs (plain, or a graph-safe drafter)

    def step(self) -> None:
        d = self.draft()
        self.ws.row_steps += d.active     # each request's target forwards, for its τ
        self.commit(d, self.verify(d))

    def _graph_key(self):
        return super()._graph_key() + ("continuous",)     # its step counts row_steps too

    def _decode(self, n: int, base: int) -> None:
        """``n`` steps without reading anything back; step t touches at most ``base + t * reach``
        slots of any live row (a cache length known before some step, plus reach per step since)."""
        for _ in range(n):
            t = self.t
            self.kv_len = self.ctx.kv_len = self._bucket(base + t * self.reach)
            if self.Wu and (t + 1) % UNIFORM_CHUNK == 0:
                self._refill()
            self._launch()
            self.t += 1
        self.stats["steps"] += n

    def _harvest(self) -> tuple[int, int, int]:
        """One host read: hand finished rows to ``on_finish`` and free their slots. Returns the
        live rows, their longest cache and the fewest steps until one must stop (length cap)."""
        ws, B = self.ws, self.B
        act, stopped, plen, hlen, clen, max_new, nsteps = torch.stack([
            ws.active.long(), ws.stopped.long(), ws.prompt_len, ws.hist_len, self.model.cache.lengths[:B],
            ws.max_new, ws.row_steps]).tolist()
        self.stats["syncs"] += 1
        done = [b for b in range(B) if self.slot_req[b] is not None and not act[b]]
        if done:
            lo, hi = min(plen[b] for b in done), max(hlen[b] for b in done)
            rows = ws.hist[torch.tensor(done, device=self.dev), lo:hi].tolist()
            for b, row in zip(done, rows):
                self._finish(b, row[plen[b] - lo:hlen[b] - lo], bool(stopped[b]), nsteps[b])
        live = [b for b in range(B) if self.slot_req[b] is not None]
        longest = max((clen[b] for b in live), default=0)
        room = min((max_new[b] - (hlen[b] - plen[b]) for b in live), default=1)
        return len(live), longest, max(1, room)

    def _finish(self, b: int, tokens: list[int], stopped: bool, row_steps: int) -> None:
        """Slot b's request is done: its tokens to ``on_finish``, its slot free."""
        req, self.slot_req[b] = self.slot_req[b], None
        req.target_forwards = row_steps
        self.stats["tokens"] += len(tokens)
        self.stats["decode_tokens"] += len(tokens) - 1
        self.stats["row_steps"] += row_steps
        nxt = self.on_finish(req, tokens, "stop" if stopped else "length")
        if nxt is not None:
            self.followups.append(nxt)

    def _snapshot(self) -> tuple[int, int]:
        """Record the rows' state behind the queued steps: the status vectors and the token
        history up to the longest a request may reach, into one of two pinned buffers, with an
        event (no wait). Returns (its number, the step that runs next)."""
        ws, B = self.ws, self.B
        if self._snaps is None:
            cuda = self.dev.type == "cuda"
            self._snaps = [(torch.zeros(7, B, dtype=torch.long, pin_memory=cuda),
                            torch.zeros(B * ws.hist.shape[1], dtype=torch.long, pin_memory=cuda),
                            torch.cuda.Event() if cuda else None) for _ in range(2)]
        vec, hist, ev = self._snaps[self.n_snap % 2]
        W = min(ws.hist.shape[1], max((len(r.prompt) + r.max_new_tokens for r in self.slot_req if r is not None),
                                      default=1))
        cuda = self.dev.type == "cuda"
        vec.copy_(torch.stack([ws.active.long(), ws.stopped.long(), ws.prompt_len, ws.hist_len,
                               self.model.cache.lengths[:B], ws.max_new, ws.row_steps]), non_blocking=cuda)
        hist[:B * W].view(B, W).copy_(ws.hist[:, :W], non_blocking=cuda)
        if ev is not None:
            ev.record()
        self._snap_width[self.n_snap % 2] = W
        self.n_snap += 1
        return self.n_snap - 1, self.t

    def _harvest_snapshot(self, n: int, t: int) -> None:
        """Wait for snapshot ``n`` (taken before step ``t``) and hand out the rows done in it; a
        slot admitted after it is not in it and keeps what the host knew at its admission."""
        vec, hist, ev = self._snaps[n % 2]
        if ev is not None:
            ev.synchronize()
        self.stats["syncs"] += 1
        W = self._snap_width[n % 2]
        act, stopped, plen, hlen, clen, max_new, nsteps = vec.tolist()
        hist = hist[:self.B * W].view(self.B, W)
        for b in range(self.B):
            if self.slot_req[b] is None or self.valid_from[b] > n:
                continue
            self.known_len[b], self.known_t[b] = clen[b], t
            self.known_left[b] = max_new[b] - (hlen[b] - plen[b])
            if not act[b]:
                self._finish(b, hist[b, plen[b]:hlen[b]].tolist(), bool(stopped[b]), nsteps[b])

    def _h2d(self, x, dtype=torch.long) -> torch.Tensor:
        """A host list or tensor on the device without draining the queue: on CUDA through pinned
        memory, non-blocking (a copy from pageable memory waits for the queued steps)."""
        t = torch.as_tensor(x, dtype=dtype)
        if self.dev.type != "cuda":
            return t.to(self.dev)
        return t.pin_memory().to(self.dev, non_blocking=True)

    def _next(self) -> Request | None:
        r = self.followups.popleft() if self.followups else next(self.source, None)
        if r is None:
            return None
        stops = self.model.args.eos_token_ids if r.stop_token_ids is None else r.stop_token_ids
        r.stop_token_ids = sorted(set(int(t) for t in stops))
        if not r.prompt or r.max_new_tokens < 1:
            raise ValueError("every request needs a prompt of at least one token and max_new_tokens >= 1")
        need = len(r.prompt) + r.max_new_tokens + self.K + 1       # K: the draft slots past a row's cache
        if need > self.model.max_seq:
            raise ValueError(f"prompt of {len(r.prompt)} tokens + max_new_tokens {r.max_new_tokens}"
                             f"{f' + {self.K} draft slots' if self.K else ''} needs a cache of {need} positions; "
                             f"the engine has max_seq={self.model.max_seq}")
        if len(r.stop_token_ids) > MAX_STOP_IDS:
            raise ValueError(f"{len(r.stop_token_ids)} stop ids > {MAX_STOP_IDS}")
        return r

    def _admit(self, live: int) -> bool:
        """Refill the free slots from the queue (follow-ups first) once ``refill_at`` are free or
        no row is left; False when nothing came in."""
        free = [b for b in range(self.B) if self.slot_req[b] is None]
        if live and len(free) < self.refill_at:
            return False
        new: list[Request] = []
        while len(new) < len(free):
            r = self._next()
            if r is None:
                break
            new.append(r)
        # prefill in groups of bounded padded size: a long prompt among short ones costs memory, not time
        start = 0
        while start < len(new):
            end, longest = start + 1, len(new[start].prompt)
            while end < len(new) and (end + 1 - start) * max(longest, len(new[end].prompt)) <= self.prefill_tokens:
                longest = max(longest, len(new[end].prompt))
                end += 1
            self._prefill(free[start:end], new[start:end])
            start = end
        return bool(new)

    def _prefill(self, slots: list[int], reqs: list[Request]) -> None:
        """The new prompts through the target into their cache slots (from position 0), their
        first tokens, and their rows of the workspace reset; the other rows are untouched."""
        m, dev, ws = self.model, self.dev, self.ws
        rows = self._h2d(slots)
        lens_l = [len(r.prompt) for r in reqs]
        T = max(lens_l)
        lens = self._h2d(lens_l)
        ids = self._h2d(_left_aligned([r.prompt for r in reqs], T))
        m.cache.lengths[rows] = 0
        with prefill_attention(m):
            out = m(ids, logits_index=(lens - 1)[:, None], kv_len=T, rows=rows, aux_layer_ids=self.aux_ids,
                    return_final=self.need_final)
        m.cache.lengths[rows] = lens
        for b, r in zip(slots, reqs):
            self.gens[b] = torch.Generator().manual_seed(int(r.seed))
            self.slot_req[b] = r
            self.known_len[b], self.known_t[b], self.known_left[b] = len(r.prompt), self.t, r.max_new_tokens - 1
            self.valid_from[b] = self.n_snap
        u0 = self._join_uniforms(slots) if self.Wu else None
        first = self._pick(out.logits[:, 0], u0[:, self.n_draw] if u0 is not None else None)
        max_new = self._h2d([r.max_new_tokens for r in reqs])
        stops = torch.full((len(reqs), MAX_STOP_IDS), -1, dtype=torch.long)
        for i, r in enumerate(reqs):
            stops[i, :len(r.stop_token_ids)] = torch.tensor(r.stop_token_ids, dtype=torch.long)
        stops = self._h2d(stops)
        hit = (first[:, None] == stops).any(1)
        ws.hist[rows, :T] = ids
        ws.hist[rows, lens] = first
        ws.prompt_len[rows] = lens
        ws.hist_len[rows] = lens + 1
        ws.max_new[rows] = max_new
        ws.stops[rows] = stops
        ws.stopped[rows] = hit
        ws.active[rows] = ~hit & (max_new > 1)
        ws.row_steps[rows] = 0
        if self.drafter is not None:
            self.drafter.admit(rows, Verified(start=torch.zeros_like(lens), count=lens, next_tokens=ws.hist[rows, 1:T + 1],
                                              aux=out.aux, final=out.final))
        self.stats["requests"] += len(reqs)
        self.stats["prefills"] += 1

    def _join_uniforms(self, slots: list[int]) -> torch.Tensor:
        """Draws of the requests joining ``slots`` from their own generators: the first vector
        (for the first token, returned [n, Wu]) and the rest of the current chunk, written to
        the slots' columns. So a request's j-th decode step reads its j-th vector, as when it
        runs alone, whichever step of the batch that is. (At a chunk boundary the next
        ``_refill`` draws the chunk, already from the new generators.)"""
        pos = (self.t + 1) % UNIFORM_CHUNK            # chunk row of the next step
        rest = (UNIFORM_CHUNK - pos) % UNIFORM_CHUNK
        u = torch.stack([torch.rand(1 + rest, self.Wu, generator=self.gens[b]) for b in slots], 1)  # [1+rest, n, Wu]
        if rest:
            self.ws.uchunk[pos:, self._h2d(slots)] = self._h2d(u[1:], torch.float32)
        return self._h2d(u[0], torch.float32)


@torch.no_grad()
def generate_continuous(model: TargetModel, requests: Iterable[Request],
                        on_finish: Callable[[Request, list[int], str], Request | None], *,
                        batch_size: int | None = None, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                        use_cuda_graphs: bool = False, sync_every: int = 8, refill_at: int = 1,
                        drafter: Drafter | None = None, k: int = 3, rule: str | None = None,
                        pipeline_harvest: bool = False) -> dict:
    """Decoding with continuous batching (see ``ContinuousGeneration``), plain or with a chain
    ``drafter``; returns counts (requests, tokens, steps, prefills, host syncs, graph replays,
    decode tokens and the row-steps they took), ``tau`` (decode tokens per row-step: 1 when
    plain) and ``seconds``.

    Greedy outputs equal ``generate`` of each request alone, drafted or not; sampled ones (the
    request's ``seed``) too, up to the kernels' batch invariance."""
    gen = ContinuousGeneration(model, batch_size, temperature, top_k, top_p, use_cuda_graphs, sync_every,
                               refill_at=refill_at, drafter=drafter, k=k, rule=rule,
                               pipeline_harvest=pipeline_harvest)
    t0 = time.perf_counter()
    gen.serve(requests, on_finish)
    _sync(model.device)
    st = gen.stats
    return {**st, "tau": st["decode_tokens"] / st["row_steps"] if st["row_steps"] else 0.0,
            "seconds": time.perf_counter() - t0}


def generate_flows(model: TargetModel, flows: Iterable[tuple[Any, Generator]], on_done: Callable[[Any], None], *,
                   on_tokens: Callable[[int], None] | None = None, **kw) -> dict:
    """Continuous batching over multi-step work (a conversation's turns; a synthesized item's
    document, message and answers). ``flows``: ``(key, generator)`` pairs, pulled lazily; each
    generator yields the ``Request`` of its next generation and is sent ``(tokens, finish reason)``
    back, so its next request is queued the moment the last one finishes. ``on_done(key)`` when a
    generator returns; ``on_tokens(n)`` per finished generation. ``kw`` go to
    ``generate_continuous``, whose counts this returns; ``pipeline_harvest`` defaults to on a GPU
    here. This is bulk generation (regeneration, synthesis) through hundreds of slots, and on the H200
    regeneration ran at 76.9k tok/s with the harvest one block behind against 65.4k with the live
    read (2026-12-03 against 12-02), where serving through 8-48 slots was faster with the live read
    (BENCHMARKS.md, eighth sitting)."""
    kw.setdefault("pipeline_harvest", model.device.type == "cuda")

    def advance(key, flow, send):
        try:
            req = send()
        except StopIteration:
            on_done(key)
            return None
        req.tag = (key, flow)
        return req

    def first_requests():
        for key, flow in flows:
            r = advance(key, flow, flow.__next__)
            if r is not None:
                yield r

    def on_finish(req, tokens, why):
        if on_tokens is not None:
            on_tokens(len(tokens))
        key, flow = req.tag
        return advance(key, flow, lambda: flow.send((tokens, why)))

    return generate_continuous(model, first_requests(), on_finish, **kw)


_Generation = Generation
