"""Bundled runtime: the target model (static KV cache), drafters, generation engines, trees, verification, metrics."""
from .drafters import (DRAFTER_KINDS, DraftContext, DraftModelDrafter, Drafter, DraftVocabError, Eagle1Drafter,
                       Eagle3Drafter, HybridDrafter, MTPDrafter, NGramDrafter, Proposal, Verified, drafter_for_head,
                       make_drafter, ngram_match)
from .engines.continuous import ContinuousGeneration, Request, generate_continuous, generate_flows
from .engines.static import GenerateResult, Generation, generate
from .metrics import StepRecord, summarize
from .model import ForwardOutput, ModelArgs, TargetModel
from .tree import DraftTree, TreeConfig, build_dynamic_tree

__all__ = ["TargetModel", "ModelArgs", "ForwardOutput", "generate", "Generation", "GenerateResult", "Request",
           "generate_continuous", "generate_flows", "ContinuousGeneration", "Drafter", "DraftContext", "Verified",
           "Proposal", "NGramDrafter", "Eagle3Drafter", "Eagle1Drafter", "MTPDrafter", "DraftModelDrafter",
           "HybridDrafter", "DraftVocabError", "drafter_for_head", "make_drafter", "DRAFTER_KINDS", "ngram_match",
           "TreeConfig", "DraftTree", "build_dynamic_tree", "StepRecord", "summarize"]
