"""LoRA adapters on a head (peft): the layout the trainer trains and saves, and merging them back.

peft is imported inside the functions: a head without adapters never needs it.
"""
from __future__ import annotations

import copy

from torch import nn


def inject_lora(head: nn.Module, *, r: int, alpha: int, dropout: float, target_modules) -> nn.Module:
    """The head with peft LoRA adapters on ``target_modules`` (the layout the trainer trains and saves)."""
    from peft import LoraConfig, inject_adapter_in_model

    conf = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules), bias="none")
    return inject_adapter_in_model(conf, head)


def merged_state_dict(head: nn.Module) -> dict:
    """The head's weights with LoRA adapters merged in (names as without LoRA)."""
    from peft.tuners.lora import LoraLayer

    if not any(isinstance(m, LoraLayer) for m in head.modules()):
        return {k: v.detach() for k, v in head.state_dict().items()}
    h = copy.deepcopy(head)
    for m in h.modules():
        if isinstance(m, LoraLayer):
            m.merge()
    out = {}
    for k, v in h.state_dict().items():
        if "lora_" in k:
            continue
        out[k.replace(".base_layer.", ".")] = v.detach()
    return out
