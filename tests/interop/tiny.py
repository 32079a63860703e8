"""Tiny heads, fake run directories and a tiny Llama verifier for export tests (CPU, seconds)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

H, I, NH, KV = 64, 96, 4, 2
VT, VD = 200, 128
L = 8  # verifier layers; default EAGLE-3 aux ids [2, L//2, L-3] = [2, 4, 5]
AUX = [2, L // 2, L - 3]


def rnd(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in module.named_parameters():
            p.copy_((1.0 if "norm" in n else 0.0) + 0.2 * torch.randn(p.shape, generator=g))
    return module


def eagle3_head(draft_vocab=VD, norm_before_residual=False, embed=None, seed=0, archs=("LlamaForCausalLM",)):
    from specheads.heads import Eagle3Head, HeadConfig

    cfg = HeadConfig(kind="eagle3", hidden_size=H, intermediate_size=I, num_attention_heads=NH,
                     num_key_value_heads=KV, target_vocab_size=VT, draft_vocab_size=draft_vocab,
                     aux_layer_ids=list(AUX), norm_before_residual=norm_before_residual, rms_norm_eps=1e-5,
                     target_num_layers=L, target_architectures=list(archs))
    h = rnd(Eagle3Head(cfg), seed)
    if embed is not None:
        with torch.no_grad():
            h.embed_tokens.weight.copy_(embed)
    if draft_vocab < VT:
        sel = torch.randperm(VT, generator=torch.Generator().manual_seed(3))[:draft_vocab].sort().values
        h.set_vocab_mapping(sel - torch.arange(draft_vocab))
    return h.eval()


def identity(name="org/tiny-target"):
    return {"name": name, "config_hash": "0123456789abcdef", "model_type": "llama", "num_layers": L,
            "hidden_size": H, "vocab_size": VT, "adapter": None}


def fake_run(run_dir, head, target_name="org/tiny-target", recipe_overrides: dict | None = None,
             eval_report: dict | None = None) -> Path:
    """A run directory as the trainer leaves it: ``train/final/`` (+ optional ``eval/report.json``)."""
    from specheads.config import load_recipe

    run_dir = Path(run_dir)
    recipe = load_recipe(None, [f"run_dir={run_dir}"]).to_dict()
    for k, v in (recipe_overrides or {}).items():
        sec, key = k.split(".")
        recipe[sec][key] = v
    meta = {"format": "specheads-train", "version": 1, "kind": head.cfg.kind, "step": 7,
            "target": identity(target_name), "aux_layer_ids": list(head.cfg.aux_layer_ids),
            "draft_vocab_size": head.cfg.draft_vocab_size,
            "vocab": {"draft_vocab_size": head.cfg.draft_vocab_size, "coverage": 0.97},
            "recipe": recipe, "recipe_hash": "feedfacefeedface", "lora": None, "warm_start": None,
            "precision": "fp32", "world_size": 1, "eval": {"loss": 1.23}}
    train_dir = run_dir / "train"
    from specheads.train.checkpoint import save_final

    save_final(train_dir, head.state_dict(), head.cfg.to_dict(), meta)
    if eval_report is not None:
        (run_dir / "eval").mkdir(parents=True, exist_ok=True)
        (run_dir / "eval" / "report.json").write_text(json.dumps(eval_report))
    return run_dir


def tiny_verifier(d, seed=0) -> Path:
    """A random Llama with the head's hidden size and vocabulary, saved as a HF directory (fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d = Path(d)
    cfg = LlamaConfig(vocab_size=VT, hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                      num_attention_heads=NH, num_key_value_heads=KV, head_dim=H // NH, rms_norm_eps=1e-5,
                      max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.add_(0.1 * torch.randn(H))  # not all ones: a wrong norm would show
    model.save_pretrained(d, safe_serialization=True)
    return d
