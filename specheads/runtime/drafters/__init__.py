"""Drafters: who proposes the tokens the target verifies, one module per drafter (``base``: the
protocol and the types they share), and the registry that builds them by name.

A new drafter is its module plus its entry here: in ``HEAD_DRAFTERS`` for a head kind (what
``drafter_for_head`` builds), in ``DRAFTERS`` for a kind ``make_drafter`` builds by name.
"""

from __future__ import annotations

from .base import DraftContext, Drafter, DraftVocabError, Proposal, Verified
from .draft_model import DraftModelDrafter
from .head import DraftCache, Eagle1Drafter, Eagle3Drafter, HeadDrafter, MTPDrafter, head_config
from .hybrid import HybridDrafter
from .ngram import NGramDrafter, ngram_match
from .parallel import DFlashDrafter, PEagleDrafter
from .suffix import SuffixCache, SuffixDrafter, SuffixTree, forget_responses

HEAD_DRAFTERS = {"eagle3": Eagle3Drafter, "eagle1": Eagle1Drafter, "mtp": MTPDrafter,   # by HeadConfig.kind
                 "peagle": PEagleDrafter, "dflash": DFlashDrafter}


def drafter_for_head(head, name: str | None = None, target_vocab_size: int | None = None) -> HeadDrafter:
    """The drafter class for a head's kind (eagle3 / eagle1 / mtp / peagle / dflash). Refuses (``DraftVocabError``)
    a head whose vocabulary mapping is inconsistent, or does not fit ``target_vocab_size``."""
    cls = HEAD_DRAFTERS[head_config(head).kind]
    return cls(head, name=name, target_vocab_size=target_vocab_size)


# make_drafter's builders: (head, **make_drafter's options) -> drafter
def _ngram(head, *, min_ngram, max_ngram, occurrence, ngram_backend, **_) -> Drafter:
    return NGramDrafter(min_ngram, max_ngram, occurrence, ngram_backend)


def _head(head, *, kind, name, target_vocab_size, **_) -> Drafter:
    if head is None:
        raise ValueError(f"drafter {kind!r} needs a head")
    return head if isinstance(head, Drafter) else drafter_for_head(head, name=name, target_vocab_size=target_vocab_size)


def _suffix(head, *, suffix_decoding_max_tree_depth, suffix_decoding_max_cached_requests,
            suffix_decoding_max_spec_factor, suffix_decoding_min_token_prob, **_) -> Drafter:
    return SuffixDrafter(suffix_decoding_max_tree_depth, suffix_decoding_max_cached_requests,
                         suffix_decoding_max_spec_factor, suffix_decoding_min_token_prob)


def _hybrid(head, *, min_match, adaptive, free, **opts) -> Drafter:
    return HybridDrafter(_head(head, **opts), DRAFTERS[free](head, **opts), min_match=min_match, adaptive=adaptive)


DRAFTERS = {"ngram": _ngram, "head": _head, "hybrid": _hybrid, "suffix": _suffix}
DRAFTER_KINDS = tuple(DRAFTERS)
HYBRID_FREE = ("ngram", "suffix")    # what a hybrid's head is paired with


def make_drafter(kind: str, head=None, *, name: str | None = None, target_vocab_size: int | None = None,
                 min_match: int = 3, min_ngram: int = 1, max_ngram: int = 4, occurrence: str = "latest",
                 ngram_backend: str = "auto", adaptive: bool = True, free: str = "ngram",
                 suffix_decoding_max_tree_depth: int = 24, suffix_decoding_max_cached_requests: int = 10000,
                 suffix_decoding_max_spec_factor: float = 1.0, suffix_decoding_min_token_prob: float = 0.1) -> Drafter:
    """A runtime drafter by name (the builder the eval stage calls):

    - ``"ngram"``: ``NGramDrafter(min_ngram, max_ngram, occurrence, ngram_backend)`` (device
      proposer on CUDA, the host reference elsewhere, with ``ngram_backend="auto"``);
    - ``"head"``: ``drafter_for_head(head)`` (``head``: a head module or a HeadDrafter);
    - ``"hybrid"``: ``HybridDrafter(head drafter, free drafter, min_match, adaptive)``, the free
      drafter ``free`` = ``"ngram"`` (the n-gram drafter above) or ``"suffix"``;
    - ``"suffix"``: ``SuffixDrafter`` with vLLM's ``suffix_decoding_*`` settings (its defaults).
    """
    if kind not in DRAFTERS:
        raise ValueError(f"unknown drafter {kind!r}; use one of {DRAFTER_KINDS}")
    if free not in HYBRID_FREE:
        raise ValueError(f"a hybrid pairs its head with one of {HYBRID_FREE}, got free={free!r}")
    return DRAFTERS[kind](head, kind=kind, name=name, target_vocab_size=target_vocab_size, min_match=min_match,
                          min_ngram=min_ngram, max_ngram=max_ngram, occurrence=occurrence,
                          ngram_backend=ngram_backend, adaptive=adaptive, free=free,
                          suffix_decoding_max_tree_depth=suffix_decoding_max_tree_depth,
                          suffix_decoding_max_cached_requests=suffix_decoding_max_cached_requests,
                          suffix_decoding_max_spec_factor=suffix_decoding_max_spec_factor,
                          suffix_decoding_min_token_prob=suffix_decoding_min_token_prob)


__all__ = ["DRAFTERS", "DRAFTER_KINDS", "HEAD_DRAFTERS", "HYBRID_FREE", "DFlashDrafter", "DraftCache",
           "DraftContext", "DraftModelDrafter", "Drafter", "DraftVocabError", "Eagle1Drafter", "Eagle3Drafter",
           "HeadDrafter", "HybridDrafter", "MTPDrafter", "NGramDrafter", "PEagleDrafter", "Proposal", "SuffixCache",
           "SuffixDrafter", "SuffixTree", "Verified", "drafter_for_head", "forget_responses", "make_drafter",
           "ngram_match"]
