"""Suffix decoding (SuffixDecoding, arXiv:2411.04975; Arctic Inference's ``SuffixDecodingCache``,
vLLM's ``method: "suffix"``): drafts copied from a suffix tree over the request's own prompt and
output, or from a global suffix tree over the responses of earlier requests, whichever scores higher.

- ``SuffixTree``: the suffixes of a set of token sequences, each cut at ``max_depth`` tokens, in one
  path-compressed trie whose nodes count the suffixes through them; sequences grow a token at a time
  and can be removed.
- ``SuffixCache``: a local tree per active request (prompt + output) and the global tree over the
  responses of up to ``max_cached_requests`` requests, evicted oldest first.
- ``SuffixDrafter``: the runtime's drafter over a ``SuffixCache``; one request per row, chains only.

How a draft is found (``SuffixTree.speculate``, as Arctic's): for each match length m = 1, 2, ...
(up to one token less than the context, its last ``max_tree_depth`` tokens) the last m tokens are
looked up, the loop ending at the first m that does not occur; from the match, the path goes on to
the most frequent child at every branch, a token's probability being the product of child count /
parent count along the way; it stops at ``max_tokens`` tokens, where ``max_tokens = min(k,
floor(m * max_spec_factor))``, or at a token whose probability falls under ``min_token_prob``. The
draft with the highest score (the sum of its tokens' probabilities; a longer match on a tie) is
proposed. The context's own last occurrence counts too: a pattern seen once before and once at the
end continues with probability 1/2.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import Drafter, DraftContext, Proposal, Verified


@dataclass
class SuffixDraft:
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)   # per token: its estimated probability
    score: float = 0.0                                  # sum of probs
    match_len: int = 0                                  # tokens of the context the draft continues


class _Node:
    """A node and the edge into it. The edge spells ``seq[start:start + length]``, where ``seq`` is
    the token list of a sequence whose suffix runs through the node (the last one that reached it)
    and holds the whole path from the root just before ``start``. ``count``: the indexed suffixes
    that run through the edge or end at the node."""

    __slots__ = ("parent", "children", "count", "seq", "start", "length")

    def __init__(self, parent: _Node | None, seq: list[int], start: int, length: int, count: int):
        self.parent, self.seq, self.start, self.length, self.count = parent, seq, start, length, count
        self.children: dict[int, _Node] = {}

    @property
    def token(self) -> int:
        """The edge's first token: the node's key among its parent's children."""
        return self.seq[self.start]


class SuffixTree:
    """Every suffix of every sequence, up to ``max_depth`` tokens of it, in one trie whose chains
    of equal count are single edges (Arctic Inference's suffix tree). A suffix always ends at the
    end of a node, never inside an edge, so every token of an edge has the node's count: the count
    of a pattern is the count of the node its last token falls in.

    Sequences grow with ``append`` / ``extend`` (each new token moves the up to ``max_depth``
    suffixes still growing one token down) and go with ``remove``. Memory grows with the number of
    tokens indexed, not with ``max_depth``: a suffix seen once is one leaf edge."""

    def __init__(self, max_depth: int = 24):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node(None, [], 0, 0, 0)
        self._seqs: dict[int, list[int]] = {}
        self._growing: dict[int, list[_Node]] = {}   # per sequence: where its growing suffixes end, oldest first

    def sequence(self, seq_id: int) -> list[int]:
        """The tokens of a sequence (the tree's own list: read, do not change)."""
        return self._seqs[seq_id]

    def extend(self, seq_id: int, tokens) -> None:
        for t in tokens:
            self.append(seq_id, int(t))

    def append(self, seq_id: int, token: int) -> None:
        """Append ``token`` to sequence ``seq_id`` (a new sequence if unknown)."""
        seq = self._seqs.setdefault(seq_id, [])
        growing = self._growing.setdefault(seq_id, [])
        growing.append(self.root)            # the suffix that starts at the new token
        self.root.count += 1
        if len(growing) > self.max_depth:
            growing.pop(0)                   # max_depth tokens long: it stops where it is
        seq.append(token)
        pos = len(seq) - 1
        for i, node in enumerate(growing):
            growing[i] = self._extend(node, seq, pos)

    def _extend(self, node: _Node, seq: list[int], pos: int) -> _Node:
        """The suffix of ``seq`` that ends at ``node`` takes ``seq[pos]``; returns where it ends now.
        Every node it ends at is pointed at ``seq``, so an edge that grows grows along this sequence."""
        token, root = seq[pos], self.root
        child = node.children.get(token)
        if child is None:
            if node is not root and node.count == 1:
                # only this suffix reaches the node: it is this suffix's leaf, whose edge just grows
                node.seq, node.start = seq, pos - node.length
                node.length += 1
                return node
            leaf = _Node(node, seq, pos, 1, 1)
            node.children[token] = leaf
            return leaf
        if node is not root and node.count == child.count + 1:
            # this suffix is the only one that ends at the node and all the others go on to `child`:
            # once it goes on too, the node's edge and the child's first token have one count
            if child.length == 1:
                key = node.token
                child.seq, child.start = seq, pos - node.length
                child.length = node.length + 1
                child.count += 1
                child.parent = node.parent
                node.parent.children[key] = child          # the child takes the node's place
                return child
            node.seq, node.start = seq, pos - node.length
            node.length += 1                                # the node's edge takes the child's first token
            del node.children[token]
            child.start += 1
            child.length -= 1
            node.children[child.token] = child
            return node
        if child.length == 1:
            child.seq, child.start = seq, pos
            child.count += 1
            return child
        # the suffix would end inside the child's edge: its first token becomes a node of its own
        mid = _Node(node, seq, pos, 1, child.count + 1)
        node.children[token] = mid
        child.parent = mid
        child.start += 1
        child.length -= 1
        mid.children[child.token] = child
        return mid

    def remove(self, seq_id: int) -> None:
        """Take sequence ``seq_id``'s suffixes out of the counts; nodes no suffix reaches go, and a node
        no suffix ends at any more joins its only child. (A surviving edge may still point into the
        removed token list, which then lives on with it: with oldest-first eviction that is rare.)"""
        seq = self._seqs.pop(seq_id, None)
        self._growing.pop(seq_id, None)
        if seq is None:
            return
        for start in range(len(seq)):
            end = min(len(seq), start + self.max_depth)    # each suffix was indexed this far
            node = self.root
            node.count -= 1
            idx = start
            while idx < end:
                child = node.children[seq[idx]]
                child.count -= 1
                if child.count == 0:
                    del node.children[seq[idx]]
                    break
                idx += child.length
                node = child
            self._join_only_child(node)

    def _join_only_child(self, node: _Node) -> None:
        if node is self.root or len(node.children) != 1:
            return
        (child,) = node.children.values()
        if child.count != node.count:
            return                                # some suffix still ends at the node
        key = node.token
        child.start -= node.length                # child.seq holds the node's edge just before its own
        child.length += node.length
        child.parent = node.parent
        node.parent.children[key] = child

    def match(self, pattern) -> tuple[_Node, int] | None:
        """Where ``pattern`` (non-empty) ends: (node, tokens of its edge matched), or None if it does
        not occur."""
        node, idx = self.root, 0
        for t in pattern:
            if idx == node.length:
                node = node.children.get(t)
                if node is None:
                    return None
                idx = 0
            if node.seq[node.start + idx] != t:
                return None
            idx += 1
        return node, idx

    def count(self, pattern) -> int:
        """How often ``pattern`` (1..max_depth tokens) occurs in the indexed sequences."""
        found = self.match(pattern)
        return found[0].count if found is not None else 0

    def speculate(self, context, max_tokens: int, max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
                  every_match: bool = False) -> SuffixDraft:
        """The best draft continuing ``context`` (see the module docstring); empty (match_len 0) when
        nothing fits. As in Arctic, the longest match tried is one token shorter than the context.
        ``every_match``: the rule as SuffixDecoding states it, every longer match until one does not occur,
        without the early stop below: the reference the stop is checked against (tests, bench_suffix.py)."""
        best = SuffixDraft()
        for m in range(1, len(context)):
            found = self.match(context[len(context) - m:])
            if found is None:
                break
            n = min(max_tokens, int(m * max_spec_factor + 1e-6))
            draft = self._follow(*found, n, min_token_prob)
            if draft.tokens and draft.score >= best.score:
                best, best.match_len = draft, m
            node, idx = found
            if not every_match and node.count == 1 and idx == node.length and not node.children:
                # Its one occurrence ends its sequence (a suffix is indexed past it if there is more; a pattern
                # over max_depth long never matches). A longer pattern occurs there or nowhere, so no longer
                # match drafts anything. The context's own end is such an occurrence: without this stop the loop
                # runs to the context's length, and its O(len²) walks were most of a row's host time
                # (benchmarks/bench_suffix.py: 86 -> 24 µs a row and step on new_codealpaca's answers, CPU).
                break
        return best

    @staticmethod
    def _follow(node: _Node, idx: int, max_tokens: int, min_token_prob: float) -> SuffixDraft:
        """Up to ``max_tokens`` tokens from ``idx`` in ``node``'s edge on, taking the most frequent child
        at every branch, while the path's probability stays at least ``min_token_prob``."""
        draft, prob = SuffixDraft(), 1.0
        while len(draft.tokens) < max_tokens and prob >= min_token_prob:
            if idx < node.length:
                draft.tokens.append(node.seq[node.start + idx])
                draft.probs.append(prob)
                draft.score += prob
                idx += 1
                continue
            if not node.children:
                break
            child = max(node.children.values(), key=lambda c: c.count)   # the first seen on a tie
            prob *= child.count / node.count
            node, idx = child, 0
        return draft


class SuffixCache:
    """Arctic Inference's ``SuffixDecodingCache``: a local tree per active request over its prompt and
    output, and one global tree over responses. A response is cached from its request's start, as it
    is generated, so requests running side by side draft from each other's outputs too; once more
    than ``max_cached_requests`` are cached the oldest is evicted (0: no global tree; < 0: no bound)."""

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000):
        self.max_tree_depth, self.max_cached_requests = max_tree_depth, max_cached_requests
        self.global_tree = SuffixTree(max_tree_depth)
        self.local_trees: dict[int, SuffixTree] = {}
        self.cached: dict[int, None] = {}          # requests with a response in the global tree, oldest first

    def start_request(self, req: int, prompt) -> None:
        if req in self.local_trees:
            raise ValueError(f"request {req} is already active")
        tree = self.local_trees[req] = SuffixTree(self.max_tree_depth)
        tree.extend(0, prompt)
        if self.max_cached_requests == 0:
            return
        if req in self.cached:
            self.evict(req)
        self.cached[req] = None
        while 0 < self.max_cached_requests < len(self.cached):
            self.evict(next(iter(self.cached)))

    def add_active_response(self, req: int, tokens) -> None:
        self.local_trees[req].extend(0, tokens)
        if req in self.cached:                     # it may have been evicted while still running
            self.global_tree.extend(req, tokens)

    def stop_request(self, req: int) -> None:
        """The request is done: its local tree goes, its response stays cached until evicted."""
        del self.local_trees[req]

    def evict(self, req: int) -> None:
        del self.cached[req]
        self.global_tree.remove(req)

    def tokens(self, req: int) -> list[int]:
        """An active request's prompt and output so far."""
        return self.local_trees[req].sequence(0)

    def speculate(self, req: int, pattern, max_spec_tokens: int, max_spec_factor: float = 1.0,
                  min_token_prob: float = 0.1, every_match: bool = False) -> SuffixDraft:
        """The local tree's draft, or the global tree's where it scores strictly higher (``every_match``:
        ``SuffixTree.speculate``'s reference rule in both)."""
        pattern = pattern[-self.max_tree_depth:]
        args = (pattern, max_spec_tokens, max_spec_factor, min_token_prob, every_match)
        local = self.local_trees[req].speculate(*args)
        other = self.global_tree.speculate(*args)
        return other if other.score > local.score else local


class SuffixDrafter(Drafter):
    """Suffix decoding with vLLM's settings and defaults (``suffix_decoding_max_tree_depth`` 24,
    ``..._max_cached_requests`` 10000, ``..._max_spec_factor`` 1.0, ``..._min_token_prob`` 0.1): per
    row, up to k tokens continuing the row's context from its own prompt and output, or from the
    responses in the drafter's ``SuffixCache``, which lives as long as the drafter (across
    ``generate`` calls, every request's response, the oldest evicted past ``max_cached_requests``).
    Proposals carry ``match_len`` (for the hybrid's choice); drafts are one-hot (rule 'onehot' when
    sampling).

    The trees live on the host, so the host work is the engine's ``host_step`` call, between steps:
    it reads what the rows emitted from the engine's token buffer (``ctx.tokens`` / ``ctx.lengths``:
    one host sync), speculates every live row and writes the drafts into device buffers of fixed
    shape [B, k]. Inside the step ``propose`` returns those buffers and ``update`` only notes that
    they are out of date, so the step is ``graph_safe``: the static and continuous engines capture
    it in a CUDA graph, a hybrid's head included. (A caller that never runs ``host_step`` still gets
    fresh drafts: ``propose`` runs it itself when the buffers are out of date, eagerly.) A row's
    request starts with its prompt (``generate``'s first update, or ``admit`` when a request takes
    the row over) and stops once the row is inactive, its response staying cached. ``clear()``
    forgets every request and response, as a new engine would."""

    admits_rows = True      # admit() restarts a row's request: continuous batching may hand rows over
    graph_safe = True       # in the step only device buffers; the trees are served by host_step
    has_host_step = True

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1):
        if max_tree_depth < 2:
            raise ValueError(f"max_tree_depth must be >= 2 (a match and a draft token), got {max_tree_depth}")
        if max_spec_factor <= 0:
            raise ValueError(f"max_spec_factor must be > 0, got {max_spec_factor}")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob}")
        self.max_tree_depth, self.max_cached_requests = int(max_tree_depth), int(max_cached_requests)
        self.max_spec_factor, self.min_token_prob = float(max_spec_factor), float(min_token_prob)
        self.cache = SuffixCache(self.max_tree_depth, self.max_cached_requests)
        self._ctx: DraftContext | None = None
        self._req: list[int | None] = []       # per row: its live request (None: none, or finished)
        self._fed: list[int] = []              # per row: tokens of its history given to the cache
        self._prompt_len: list[int] = []
        self._requests = 0                     # request ids handed out
        self._prompt_update = False            # the next update carries the batch's prompts
        self._new: dict[int, int] = {}         # rows whose request starts at the next pull -> prompt length
        self._bufs: dict = {}                  # per (batch, k, device): [B, k + 2] drafts, num, match_len;
                                               # never freed: captured steps read them
        self._stale = True                     # a step or a new request since: the buffer is out of date
        self.host_width: int | None = None     # the widest draft host_step wrote (engines without graphs)

    def clear(self) -> None:
        """Forget every request and cached response: the state of a new engine."""
        self.cache = SuffixCache(self.max_tree_depth, self.max_cached_requests)
        self._req = [None] * len(self._req)
        self._stale = True

    def start(self, ctx: DraftContext) -> None:
        for req in self._req:                  # the last call's requests are over; their responses stay
            if req is not None:
                self.cache.stop_request(req)
        B = ctx.batch
        self._ctx, self._req, self._fed, self._prompt_len = ctx, [None] * B, [0] * B, [0] * B
        self._prompt_update, self._new = True, {}
        self._stale = True

    # The trees take in tokens in one place, host_step: an update or an admit only says what it will find there.
    def update(self, v: Verified) -> None:
        if self._prompt_update:                # generate's first update (the prefill, eager): the prompts
            self._prompt_update = False
            self._new = dict(enumerate(v.count.tolist()))
        self._stale = True                     # a step's update (maybe captured): host_step reads what it emitted

    def admit(self, rows: torch.Tensor, v: Verified) -> None:
        self._prompt_update = False            # continuous batching: prompts come through admit
        self._new.update(zip(rows.tolist(), v.count.tolist()))
        self._stale = True

    def host_step(self, ctx: DraftContext, k: int) -> None:
        """Between steps, on the host: take in what every live row emitted, then each row's draft into the
        [B, k] device buffer ``propose`` returns (one copy)."""
        self._pull(self._new)
        self._new = {}
        B, D = ctx.batch, self.max_tree_depth
        drafts = [SuffixDraft() if req is None else
                  self.cache.speculate(req, self.cache.tokens(req)[-D:], k, self.max_spec_factor, self.min_token_prob)
                  for req in self._req]
        host = torch.tensor([d.tokens + [0] * (k - len(d.tokens)) + [len(d.tokens), d.match_len] for d in drafts],
                            dtype=torch.long).view(B, k + 2)
        key = (B, k, str(ctx.device))
        if key not in self._bufs:
            self._bufs[key] = torch.zeros(B, k + 2, dtype=torch.long, device=ctx.device)
        self._bufs[key].copy_(host)
        self._stale = False
        self.host_width = max([len(d.tokens) for d in drafts] + [0])   # an eager step verifies no more

    def _pull(self, new: dict[int, int]) -> None:
        """Give the cache what each live row emitted since the last pull, after starting the requests
        of ``new`` (row -> prompt length; a row's earlier request is over); stop the requests whose
        rows are no longer active."""
        ctx = self._ctx
        for b, n in new.items():
            if self._req[b] is not None:
                self.cache.stop_request(self._req[b])
            self._req[b], self._fed[b], self._prompt_len[b] = self._requests, 0, n
            self._requests += 1
        lens, active = torch.stack([ctx.lengths, ctx.active_mask.long()]).tolist()
        live = [b for b, r in enumerate(self._req) if r is not None]
        width = max([lens[b] - self._fed[b] for b in live] + [0])
        rows = [[] for _ in lens]
        if width:                              # each row's new tokens: slots fed .. fed + width - 1
            dev = ctx.tokens.device
            at = torch.tensor(self._fed, device=dev)[:, None] + torch.arange(width, device=dev)
            rows = ctx.tokens.gather(1, at.clamp(max=ctx.tokens.shape[1] - 1)).tolist()
        for b in live:
            req, got = self._req[b], rows[b][:lens[b] - self._fed[b]]
            if self._fed[b] == 0:
                self.cache.start_request(req, got[:self._prompt_len[b]])
                got = got[self._prompt_len[b]:]
            self.cache.add_active_response(req, got)
            self._fed[b] = lens[b]
            if not active[b]:
                self.cache.stop_request(req)
                self._req[b] = None

    def propose(self, ctx: DraftContext, k: int) -> Proposal:
        key = (ctx.batch, k, str(ctx.device))
        if self._stale or key not in self._bufs:
            self.host_step(ctx, k)             # no engine ran it (a caller of its own): eagerly, here
        out = self._bufs[key]
        return Proposal(out[:, :k], out[:, k], None, out[:, k + 1])


def forget_responses(drafter) -> None:
    """Suffix decoding drafts from every response it has seen: a ``SuffixDrafter``, alone or as a hybrid's
    free half, forgets them (``clear``), so that a measured run does not draft from the answers an earlier
    run (a warm-up on the same prompts) gave. Any other drafter is left as it is."""
    for d in (drafter, getattr(drafter, "ngram", None)):
        if isinstance(d, SuffixDrafter):
            d.clear()
