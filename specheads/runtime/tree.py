"""EAGLE-2 style dynamic draft trees.

A tree is rooted at the last verified token (the "root", not a draft). Level 1 holds
the top-k children of the root. At each further level every *frontier* node (the top-k
nodes of the previous level by cumulative draft log-prob) gets its top-k children;
the top-k of those k*k candidates form the next frontier. After ``depth`` levels the
best ``total_tokens`` of all candidates (by cumulative log-prob; ties go to the node
created first) are kept. A parent's score is never below its child's and a parent is
created before its children, so the kept set is closed under ancestors.

``total_tokens`` counts draft tokens only: the verify forward carries total_tokens + 1
tokens (the root first). Nodes are ordered by creation, so a parent precedes its
children; ``parents`` index nodes (0-based), -1 = the root.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

MAX_TREE_TOKENS = 256


@dataclass(frozen=True)
class TreeConfig:
    depth: int = 4
    topk: int = 4
    total_tokens: int = 16

    def validate(self) -> "TreeConfig":
        if self.depth < 1 or self.topk < 1:
            raise ValueError(f"tree depth and topk must be >= 1, got depth={self.depth} topk={self.topk}")
        most = self.topk + (self.depth - 1) * self.topk * self.topk
        if not 1 <= self.total_tokens <= min(most, MAX_TREE_TOKENS):
            raise ValueError(
                f"tree total_tokens={self.total_tokens} out of range: need 1..{min(most, MAX_TREE_TOKENS)} "
                f"for depth={self.depth}, topk={self.topk} (topk + (depth-1)*topk^2 candidates)")
        return self


@dataclass
class DraftTree:
    tokens: torch.Tensor    # [B, N] target token ids
    parents: torch.Tensor   # [B, N] parent node index, -1 = root
    depths: torch.Tensor    # [B, N] 1-based depth

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def ancestor_mask(self) -> torch.Tensor:
        return ancestor_mask(self.parents)

    def positions(self, root_pos: torch.Tensor) -> torch.Tensor:
        """[B, N+1] RoPE positions of root + nodes."""
        zero = torch.zeros_like(self.depths[:, :1])
        return root_pos[:, None] + torch.cat([zero, self.depths], 1)

    def max_depth(self) -> int:
        return int(self.depths.max()) if self.depths.numel() else 0


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[B, N+1, N+1] bool over root + nodes: entry (i, j) is True iff j is i or an ancestor
    of i. Row 0 / column 0 is the root. Requires parents[b, i] < i."""
    B, N = parents.shape
    m = torch.eye(N + 1, dtype=torch.bool, device=parents.device).repeat(B, 1, 1)
    m[:, :, 0] = True
    rows = torch.arange(B, device=parents.device)
    for i in range(N):
        p = parents[:, i] + 1                      # index in root+nodes numbering
        m[:, i + 1] |= m[rows, p]
    return m


def ancestor_mask_reference(parents: list[int]) -> list[list[bool]]:
    """Explicit reference for one tree: walk each node's chain of parents."""
    N = len(parents)
    m = [[False] * (N + 1) for _ in range(N + 1)]
    m[0][0] = True
    for i in range(N):
        m[i + 1][i + 1] = True
        m[i + 1][0] = True
        p = parents[i]
        while p >= 0:
            m[i + 1][p + 1] = True
            p = parents[p]
    return m


@dataclass
class Expansion:
    """What the builder tells the drafter when it asks for the frontier's children."""
    level: int                   # 1-based level of the frontier nodes being expanded
    tokens: torch.Tensor         # [B, k] frontier tokens (target ids)
    node_ids: torch.Tensor       # [B, k] their candidate ids
    parent_slot: torch.Tensor    # [B, k] index into the previous frontier (-1 on level 1: the root)


ExpandFn = Callable[[Expansion], torch.Tensor]      # -> log-probs [B, k, V_draft]


def build_dynamic_tree(root_logprobs: torch.Tensor, expand: ExpandFn, cfg: TreeConfig,
                       map_ids: Callable[[torch.Tensor], torch.Tensor] | None = None) -> DraftTree:
    """root_logprobs [B, V] (draft log-probs after the root). ``expand`` returns the draft
    log-probs after each frontier node. ``map_ids`` maps draft-vocab ids to target ids."""
    cfg.validate()
    k = cfg.topk
    map_ids = map_ids or (lambda x: x)
    B = root_logprobs.shape[0]
    lp, idx = root_logprobs.float().topk(k, dim=-1)
    tok = map_ids(idx)
    pool_tok, pool_score = [tok], [lp]
    pool_parent = [torch.full_like(tok, -1)]
    pool_depth = [torch.ones_like(tok)]
    front_ids = torch.arange(k, device=tok.device).expand(B, k)
    front_tok, front_score = tok, lp
    parent_slot = torch.full_like(tok, -1)
    n_pool = k
    for level in range(1, cfg.depth):
        child_lp = expand(Expansion(level, front_tok, front_ids, parent_slot)).float()   # [B, k, V]
        c_lp, c_idx = child_lp.topk(k, dim=-1)                                          # [B, k, k]
        c_score = (front_score[:, :, None] + c_lp).reshape(B, k * k)
        c_tok = map_ids(c_idx).reshape(B, k * k)
        c_parent = front_ids[:, :, None].expand(B, k, k).reshape(B, k * k)
        pool_tok.append(c_tok)
        pool_score.append(c_score)
        pool_parent.append(c_parent)
        pool_depth.append(torch.full_like(c_tok, level + 1))
        order = torch.sort(c_score, dim=-1, descending=True, stable=True).indices[:, :k]
        front_tok = c_tok.gather(1, order)
        front_score = c_score.gather(1, order)
        front_ids = n_pool + order
        parent_slot = order // k
        n_pool += k * k
    tokens, scores = torch.cat(pool_tok, 1), torch.cat(pool_score, 1)
    parents, depths = torch.cat(pool_parent, 1), torch.cat(pool_depth, 1)
    keep = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :cfg.total_tokens]
    keep = keep.sort(dim=-1).values                                   # creation order
    new_index = torch.full_like(tokens, -1)
    new_index.scatter_(1, keep, torch.arange(cfg.total_tokens, device=keep.device).expand_as(keep).contiguous())
    kp = parents.gather(1, keep)
    kp = torch.where(kp >= 0, new_index.gather(1, kp.clamp(min=0)), kp)
    return DraftTree(tokens=tokens.gather(1, keep), parents=kp, depths=depths.gather(1, keep))


def build_tree_reference(logprob_fn: Callable[[tuple], list[float]], cfg: TreeConfig) -> list[tuple[tuple, float]]:
    """Plain-Python EAGLE-2 tree for one request: ``logprob_fn(path)`` gives the draft
    log-probs after the root followed by ``path`` (a tuple of token ids). Returns the kept
    nodes as (path, score), in creation order."""
    def topk(lps, k):
        return sorted(range(len(lps)), key=lambda t: (-lps[t], t))[:k]

    cands = []                                  # (path, score), creation order
    root = logprob_fn(())
    frontier = []
    for t in topk(root, cfg.topk):
        cands.append(((t,), root[t]))
        frontier.append(((t,), root[t]))
    for _level in range(1, cfg.depth):
        level_cands = []
        for path, score in frontier:
            lps = logprob_fn(path)
            for t in topk(lps, cfg.topk):
                level_cands.append((path + (t,), score + lps[t]))
        cands.extend(level_cands)
        order = sorted(range(len(level_cands)), key=lambda i: (-level_cands[i][1], i))
        frontier = [level_cands[i] for i in order[:cfg.topk]]
    order = sorted(range(len(cands)), key=lambda i: (-cands[i][1], i))[:cfg.total_tokens]
    return [cands[i] for i in sorted(order)]


def tree_paths(tree: DraftTree, b: int = 0) -> list[tuple]:
    """Token paths (root excluded) of row b's nodes, in node order."""
    toks, par = tree.tokens[b].tolist(), tree.parents[b].tolist()
    out = []
    for i in range(len(toks)):
        p = (toks[i],)
        j = par[i]
        while j >= 0:
            p = (toks[j],) + p
            j = par[j]
        out.append(p)
    return out
