"""Bundled runtime: target engine (static KV cache), drafters, trees, verification, metrics."""
from .drafters import (DraftContext, DraftModelDrafter, Drafter, Eagle1Drafter, Eagle3Drafter, MTPDrafter,
                       NGramDrafter, Proposal, Verified, drafter_for_head)
from .generate import GenerateResult, generate
from .metrics import StepRecord, summarize
from .model import ForwardOutput, ModelArgs, TargetModel
from .tree import DraftTree, TreeConfig, build_dynamic_tree

__all__ = ["TargetModel", "ModelArgs", "ForwardOutput", "generate", "GenerateResult", "Drafter", "DraftContext",
           "Verified", "Proposal", "NGramDrafter", "Eagle3Drafter", "Eagle1Drafter", "MTPDrafter",
           "DraftModelDrafter", "drafter_for_head", "TreeConfig", "DraftTree", "build_dynamic_tree",
           "StepRecord", "summarize"]
