"""``OnlineFeed``: the dump's batch dicts computed by the target inside the training process.

For users who cannot store a dump. A batch is the given rows padded to the longest
(right padding), run through ``Target.hidden_states``; padded positions of aux/final
are zero, exactly as ``reader.collate`` pads stored rows.
"""

from __future__ import annotations

import numpy as np
import torch

from specheads.dump.rows import TokenRows


class OnlineFeed:
    """Row source computing aux/final on the fly. ``batch(indices)`` -> batch dict (on the target's device)."""

    kind = "online"

    def __init__(self, target, rows, aux_layer_ids=None, dtype: torch.dtype | None = None,
                 compute_dtype: str | torch.dtype | None = None):
        self.target = target
        self.compute_dtype = compute_dtype  # the forward under autocast (dump.compute_dtype), as the offline dump
        self.rows = TokenRows(rows)
        self.aux_layer_ids = target.aux_layer_ids(aux_layer_ids, where="head.aux_layer_ids")
        self.dtype = dtype

    def __len__(self) -> int:
        return len(self.rows)

    def row_lengths(self) -> np.ndarray:
        return self.rows.lengths()

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    # no_grad, not inference_mode: the trainer's autograd must be able to save these tensors
    @torch.no_grad()
    def batch(self, indices) -> dict:
        indices = [int(i) for i in indices]
        got = [self.rows.range(i, i + 1)[:2] for i in indices]
        width = max(len(ids) for ids, _ in got)
        bsz = len(got)
        inp = torch.zeros(bsz, width, dtype=torch.long)
        loss = torch.zeros(bsz, width, dtype=torch.long)
        att = torch.zeros(bsz, width, dtype=torch.long)
        for j, (ids, mask) in enumerate(got):
            n = len(ids)
            inp[j, :n] = torch.from_numpy(ids.astype(np.int64))
            loss[j, :n] = torch.from_numpy(mask.astype(np.int64))
            att[j, :n] = 1
        device = self.target.device
        inp, loss, att = inp.to(device), loss.to(device), att.to(device)
        padded = bool(int(att.sum()) != att.numel())
        aux, final = self.target.hidden_states(inp, att if padded else None, aux_layer_ids=self.aux_layer_ids,
                                                 compute_dtype=self.compute_dtype)
        if padded:
            keep = att.unsqueeze(-1).to(aux.dtype)
            aux, final = aux * keep, final * keep
        if self.dtype is not None:
            aux, final = aux.to(self.dtype), final.to(self.dtype)
        return {
            "input_ids": inp, "loss_mask": loss, "attention_mask": att,
            "aux": aux, "final": final,
            "row_index": torch.tensor(indices, dtype=torch.long, device=device),
        }

    def __iter__(self):
        """Every row once, in order, one row per batch (the trainer uses ``make_feed``)."""
        for i in range(len(self)):
            yield self.batch([i])
