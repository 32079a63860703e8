"""Continuous batching: ``generate_continuous``, ``ContinuousGeneration``, and ``generate_flows``
for multi-step work.

Plain decoding, or chains from a drafter whose state is on the device (or is served between steps,
as suffix decoding's trees are): the same step as
``generate`` over a fixed set of slots, with a finished row's slot refilled by the next
request (a prefill of just the new prompts into their cache rows, and the drafter's first pass
over them into its rows) between steps, so the step's graphs stay valid. Data generation
(regenerate, synthesize) runs this way, and so does the serving benchmark (drafters in a batch
whose finished rows are refilled, as in a server, not held back by the batch's slowest row).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..drafters import Drafter, Verified
from ..model import TargetModel, prefill_attention
from ..verify import CHAIN_RULES
from .graphs import UNIFORM_CHUNK
from .static import Generation, check_drafter, left_aligned, sync


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
        check_drafter(model, drafter, k, None, rule)
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
        safe = True
        if self.drafter is not None:
            self.drafter.start(self.ctx)
            safe = bool(getattr(self.drafter, "graph_safe", False))
            # a host drafter serves here only if it restarts a row's state when a request takes the row over
            if not safe and not getattr(self.drafter, "admits_rows", False):
                raise ValueError(f"{type(self.drafter).__name__} reads a host view of the batch and keeps no state "
                                 f"per request: continuous batching needs a drafter whose state is on the device "
                                 f"(a head, NGramDrafter(backend='device'), a hybrid of the two) or one that "
                                 f"admits rows (SuffixDrafter)")
        self.graph_safe = safe
        self.capture = self.use_graphs and safe        # the step never syncs (plain, or a graph-safe drafter)
        self.inner_graphs = self.use_graphs and not safe   # a host drafter syncs each step: graph the forwards only

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
        need = len(r.prompt) + r.max_new_tokens + self.spec + 1    # spec: the draft slots past a row's cache
        if need > self.model.max_seq:
            raise ValueError(f"prompt of {len(r.prompt)} tokens + max_new_tokens {r.max_new_tokens}"
                             f"{f' + {self.spec} draft slots' if self.spec else ''} needs a cache of {need} positions; "
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
        ids = self._h2d(left_aligned([r.prompt for r in reqs], T))
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
            self._host_step()
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
    sync(model.device)
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
    (BENCHMARKS.md)."""
    # a drafter with host work (suffix decoding) waits for every step: a harvest a block behind would gain nothing
    kw.setdefault("pipeline_harvest", model.device.type == "cuda"
                  and not getattr(kw.get("drafter"), "has_host_step", False))

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
