"""Test fixture: a tiny synthetic target and feed, to test the trainer without a dump.

Import it as ``from synthetic_target import ...`` (pytest puts ``tests/`` on ``sys.path``;
scripts insert that directory themselves).

The target is a random Hugging Face Llama (``tiny_target``) whose lm_head rows
are unit vectors ``U[v]`` (scaled). ``SyntheticFeed`` yields rows of a
bigram chain ``x_{i+1} = perm[x_i]`` with ``final_i = a·U[perm[x_i]]`` so the
target's greedy next token after ``x_i`` is exactly ``perm[x_i]`` — a
language a draft head can learn, so loss falls and acceptance rises.
``aux_i`` mixes ``final_i`` and the token embedding through fixed random
projections. The feed follows the ``dump.feed`` contract: batch dicts,
``len()``, ``state_dict()/load_state_dict()`` for exact resume.
"""
from __future__ import annotations

import torch


def tiny_target(hidden: int = 64, vocab: int = 256, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                intermediate: int = 128, seed: int = 0, scale: float = 3.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    from specheads.target import Target

    g = torch.Generator().manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                      max_position_embeddings=512, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        U = torch.randn(vocab, hidden, generator=g)
        U = U / U.norm(dim=-1, keepdim=True)
        model.lm_head.weight.copy_(U * scale)
    model.requires_grad_(False)
    return Target(model=model, tokenizer=None, name=f"tiny-llama-{hidden}x{layers}", source="synthetic")


class SyntheticFeed:
    def __init__(self, target, n_rows: int = 8, seq_len: int = 32, batch_size: int = 2, n_aux: int = 3,
                 seed: int = 0, shuffle: bool = True, prompt_len: int = 4, pad_last: int = 3,
                 final_scale: float = 3.0, nan_batch: int | None = None, aux_width: int | None = None,
                 dtype=torch.float32):
        V, H = int(target.vocab_size), int(target.hidden_size)
        g = torch.Generator().manual_seed(1000 + seed)
        self.perm = torch.randperm(V, generator=g)
        U = target.lm_head.weight.detach().float().cpu()
        U = U / U.norm(dim=-1, keepdim=True)
        E = target.embed_tokens.weight.detach().float().cpu()
        starts = torch.randint(0, V, (n_rows,), generator=g)
        ids = torch.empty(n_rows, seq_len, dtype=torch.int64)
        ids[:, 0] = starts
        for i in range(1, seq_len):
            ids[:, i] = self.perm[ids[:, i - 1]]
        final = U[self.perm[ids]] * final_scale
        proj = [torch.randn(2 * H, H, generator=g) / (2 * H) ** 0.5 for _ in range(n_aux)]
        base = torch.cat([final, E[ids]], dim=-1)
        aux = torch.cat([base @ P for P in proj], dim=-1)
        if aux_width is not None:
            aux = aux[..., :aux_width] if aux_width <= aux.shape[-1] else torch.nn.functional.pad(
                aux, (0, aux_width - aux.shape[-1]))
        loss_mask = torch.ones(n_rows, seq_len, dtype=torch.int64)
        loss_mask[:, :prompt_len] = 0
        attn = torch.ones(n_rows, seq_len, dtype=torch.int64)
        if pad_last:  # every other row is padded at the end
            attn[1::2, seq_len - pad_last:] = 0
            loss_mask[1::2, seq_len - pad_last:] = 0
            ids[1::2, seq_len - pad_last:] = 0
        self.rows = {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": attn,
                     "aux": aux.to(dtype), "final": final.to(dtype)}
        self.n_rows, self.batch_size, self.shuffle, self.seed = n_rows, batch_size, shuffle, seed
        self.nan_batch = nan_batch
        self.epoch = 0
        self.index = 0
        self._served = 0

    def __len__(self) -> int:
        return (self.n_rows + self.batch_size - 1) // self.batch_size

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n_rows)
        return torch.randperm(self.n_rows, generator=torch.Generator().manual_seed(self.seed * 7919 + epoch))

    def __iter__(self):
        order = self._order(self.epoch)
        while self.index < len(self):
            sel = order[self.index * self.batch_size:(self.index + 1) * self.batch_size]
            self.index += 1
            batch = {k: v[sel].clone() for k, v in self.rows.items()}
            batch["row_ids"] = sel.clone()
            if self.nan_batch is not None and self._served == self.nan_batch:
                batch["aux"][:, 5] = float("nan")
                batch["final"][:, 5] = float("nan")
            self._served += 1
            yield batch
        self.epoch += 1
        self.index = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "served": self._served}

    def load_state_dict(self, st: dict) -> None:
        self.epoch, self.index, self._served = int(st["epoch"]), int(st["index"]), int(st.get("served", 0))


def synthetic_vocab(target, draft_vocab_size: int, seed: int = 0):
    """A draft vocabulary of ``draft_vocab_size`` random target ids (sorted), as ``load_vocab`` returns it."""
    V = int(target.vocab_size)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(V, generator=g)[:draft_vocab_size].sort().values
    d2t = ids - torch.arange(draft_vocab_size)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d, {"draft_vocab_size": draft_vocab_size, "target_vocab_size": V, "synthetic": True}


DRAFT_VOCAB = 128  # the draft vocabulary of the trainer tests' tiny target (256 tokens)
TRAIN_DEFAULTS = {"ttt_steps": 2, "max_steps": 30, "lr": 3e-3, "warmup_steps": 2, "save_every": 1000,
                  "eval_every": 1000, "precision": "fp32", "loss_kernel": "torch", "logging": {"wandb": "disabled"}}


def tiny_recipe(run_dir, head: dict | None = None, **train):
    """A training recipe for ``tiny_target``: an EAGLE-3 head on layers 1-3 unless ``head`` says otherwise,
    ``TRAIN_DEFAULTS`` under the given ``train`` fields."""
    from specheads.config import recipe_from_dict

    head = head or {"kind": "eagle3", "aux_layer_ids": [1, 2, 3]}
    return recipe_from_dict({"run_dir": str(run_dir), "seed": 0, "head": head,
                             "vocab": {"draft_vocab_size": DRAFT_VOCAB}, "train": {**TRAIN_DEFAULTS, **train}})
