"""Verification rules for the runtime — the one adapter between the engine and ``kernels/``.

Everything the generation loop needs from the kernels passes through here:
``target_probs``, inverse-CDF sampling and the chain / tree verify rules, through the
kernels' dispatcher (``specheads.kernels``: Triton on a GPU, the PyTorch references on a CPU).

Randomness enters as explicit uniforms, two per verified position and row:
``u_accept [B, T]`` (accept tests / tree coins) and ``u_sample [B, T]`` (inverse-CDF
sampling of the correction or bonus token). The engine draws them from per-request
generators, so results do not depend on batching.

Per-row draft counts: ``num_drafts [B]``; drafts at or beyond it are passed as -1 (the
kernels' "no draft here") and never accepted.

Nothing here reads a device value on the host when the sampling parameters come as
device tensors and a tree's depth bound is given: ``generate`` captures these calls in
CUDA graphs.
"""

from __future__ import annotations

import torch

from specheads import kernels
from specheads.kernels import verify_ref

from .tree import DraftTree

CHAIN_RULES = ("greedy", "rejection", "onehot")
TREE_RULES = ("greedy", "tree_target_only")
RULES = ("greedy", "rejection", "onehot", "tree_target_only")


# ---------------------------------------------------------------------------- sampling
def target_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """float32 probs after temperature, top-k, top-p (temperature 0 = one-hot argmax)."""
    return kernels.target_probs(logits, temperature, top_k, top_p)


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row from (unnormalised) probs [B, V] with uniforms u [B] (exact integer CDF)."""
    return verify_ref.sample_inverse_cdf(probs, probs, u)


# ---------------------------------------------------------------------------- chains
def verify_chain(rule: str, draft: torch.Tensor, num_drafts: torch.Tensor, p: torch.Tensor,
                 q: torch.Tensor | None, u_accept: torch.Tensor, u_sample: torch.Tensor):
    """draft [B, K]; num_drafts [B]; p [B, K+1, V] target probs (greedy: logits will do);
    q [B, K, V] draft probs (rule 'rejection'); u_accept [B, >=K], u_sample [B, >=1].
    Returns (num_accepted [B], tokens [B, K+1]): row b emits tokens[b, :num_accepted[b]+1]."""
    K = draft.shape[1]
    pos = torch.arange(K, device=draft.device)
    x = torch.where(pos[None, :] < num_drafts[:, None], draft, -1)
    if rule == "greedy":
        r = kernels.greedy_verify(x, p)
    elif rule == "rejection":
        if q is None:
            raise ValueError("rule 'rejection' needs draft probabilities")
        r = kernels.rejection_verify(x, q, p, u_accept[:, :K].contiguous(), u_sample[:, 0].contiguous())
    elif rule == "onehot":
        r = kernels.onehot_verify(x, p, u_accept[:, :K].contiguous(), u_sample[:, 0].contiguous())
    else:
        raise ValueError(f"unknown chain rule {rule!r}; use one of {CHAIN_RULES}")
    return r.num_accepted, r.out_tokens


# ---------------------------------------------------------------------------- trees
def tree_links(parents: torch.Tensor):
    """SGLang's first-child / next-sibling links over root + nodes ([B, N+1] each, -1 = none);
    children in node order. Computed on the device (no host sync): node i's next sibling is
    the first later node with the same parent; node p's first child the first node whose
    parent is p."""
    B, N = parents.shape
    dev = parents.device
    par = parents.long() + 1                                   # parent in root+nodes numbering
    node = torch.arange(1, N + 1, device=dev)
    none = torch.full((), N + 1, dtype=torch.long, device=dev)
    is_child = par[:, None, :] == torch.arange(N + 1, device=dev)[None, :, None]        # [B, p, i]
    nt = torch.where(is_child, node, none).amin(-1)
    later_sib = (par[:, :, None] == par[:, None, :]) & (node[:, None] < node[None, :])   # [B, i, j]
    ns = torch.where(later_sib, node, none).amin(-1)
    ns = torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=dev), ns], 1)
    return torch.where(nt > N, -1, nt), torch.where(ns > N, -1, ns)


def tree_links_reference(parents: torch.Tensor):
    """The same links by walking each row on the host (the reference of ``tree_links``)."""
    B, N = parents.shape
    nt = torch.full((B, N + 1), -1, dtype=torch.long)
    ns = torch.full((B, N + 1), -1, dtype=torch.long)
    par = (parents.cpu() + 1).tolist()
    for b in range(B):
        last_child = {}
        for i, pa in enumerate(par[b]):
            node = i + 1
            if pa in last_child:
                ns[b, last_child[pa]] = node
            else:
                nt[b, pa] = node
            last_child[pa] = node
    return nt.to(parents.device), ns.to(parents.device)


def verify_tree(rule: str, tree: DraftTree, p: torch.Tensor, u_accept: torch.Tensor, u_sample: torch.Tensor,
                thresholds=(1.0, 1.0), max_depth: int | None = None):
    """p [B, N+1, V] target probs (greedy: logits) at root + nodes. Returns (num_accepted [B],
    path [B, D] accepted node indices in root+nodes numbering (0-padded), tokens [B, D+1]).

    ``max_depth`` (D): the tree's depth bound when the caller knows it (the tree config's
    depth: a static shape, no host sync); None = the deepest node of the batch (a sync).

    tree_target_only is SGLang's rule (kernels.tree_verify): thresholds (single, acc),
    (1, 1) = lossless. greedy is the same walk on the one-hot target argmax with coins 1/2:
    the child equal to the argmax is accepted, every other child rejected."""
    B, N = tree.tokens.shape
    D = tree.max_depth() if max_depth is None else int(max_depth)
    cand = torch.cat([torch.zeros_like(tree.tokens[:, :1]), tree.tokens], 1)
    nt, ns = tree_links(tree.parents)
    if rule == "greedy":
        am = verify_ref.argmax_lowest(p, -1)
        p = torch.zeros(p.shape, dtype=torch.float32, device=p.device).scatter_(-1, am[..., None], 1.0)
        u_accept = torch.full_like(u_accept, 0.5)
        th = (1.0, 1.0)
    elif rule == "tree_target_only":
        th = thresholds
    else:
        raise ValueError(f"unknown tree rule {rule!r}; use one of {TREE_RULES}")
    r = kernels.tree_verify(cand, nt, ns, p, u_accept[:, :N + 1].contiguous(), u_sample[:, 0].contiguous(), D,
                       float(th[0]), float(th[1]))
    path = r.accept_index[:, 1:].clamp(min=0)
    return r.num_accepted, path, r.out_tokens.clamp(min=0)
