"""Draft-vocabulary selection on a hand-made corpus."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specheads.data.vocab import load_vocab, save_vocab, select_draft_vocab

# masked tokens: row 1 -> 2, 3, 3, 5, 5, 5 (1 and 9 unmasked); row 2 -> 4, 4, 7, 2; row 3 -> nothing
ROWS = [
    ([1, 2, 3, 3, 5, 5, 5, 9], [0, 1, 1, 1, 1, 1, 1, 0]),
    ([4, 4, 7, 2], [1, 1, 1, 1]),
    ([9, 9, 9], [0, 0, 0]),
]
# counts: 2:2, 3:2, 4:2, 5:3, 7:1  (total 10, distinct 5); 9 and 1 never count


def test_top_k_with_ties_to_lower_id():
    d2t, t2d, stats = select_draft_vocab(ROWS, 3, 10)
    # 5 (count 3), then the tie 2/3/4 (count 2) goes to 2 and 3
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert d2t.tolist() == [2 - 0, 3 - 1, 5 - 2]
    assert t2d.tolist() == [False, False, True, True, False, True, False, False, False, False]
    assert stats["coverage"] == pytest.approx(7 / 10)
    assert stats["distinct_tokens"] == 5 and stats["masked_tokens"] == 10
    assert stats["draft_vocab_size"] == 3 and stats["filled"] == 0 and stats["identity"] is False


def test_fill_with_lowest_unseen_ids():
    d2t, t2d, stats = select_draft_vocab(ROWS, 7, 10)
    chosen = (d2t + torch.arange(7)).tolist()
    assert chosen == [0, 1, 2, 3, 4, 5, 7]  # 5 seen + unseen 0 and 1 (not 6, 8 or 9)
    assert d2t.tolist() == [0, 0, 0, 0, 0, 0, 1]
    assert torch.nonzero(t2d).flatten().tolist() == chosen
    assert stats["coverage"] == 1.0 and stats["filled"] == 2


def test_identity_and_dict_rows():
    rows = [{"input_ids": ids, "loss_mask": np.array(m, dtype=np.uint8)} for ids, m in ROWS]
    d2t, t2d, stats = select_draft_vocab(rows, 10, 10)
    assert d2t.tolist() == [0] * 10 and bool(t2d.all())
    assert stats["identity"] is True and "omitted" in stats["note"]


def test_errors():
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        select_draft_vocab([([3, 12], [1, 1])], 2, 10)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        select_draft_vocab(ROWS, 11, 10)
    with pytest.raises(ValueError, match="no loss-masked tokens"):
        select_draft_vocab([([1, 2], [0, 0])], 2, 10)
    with pytest.raises(ValueError, match="loss_mask"):
        select_draft_vocab([([1, 2], [1])], 2, 10)


def test_save_load_roundtrip(tmp_path):
    d2t, t2d, stats = select_draft_vocab(ROWS, 3, 10)
    save_vocab(tmp_path / "vocab", d2t, t2d, stats)
    d2, t2, s2 = load_vocab(tmp_path / "vocab")
    assert torch.equal(d2, d2t) and torch.equal(t2, t2d) and s2 == json.loads(json.dumps(stats))
    assert sorted(p.name for p in (tmp_path / "vocab").iterdir()) == ["vocab.json", "vocab.safetensors"]
    from safetensors.torch import save_file

    save_file({"d2t": torch.tensor([0, 0, 5]), "t2d": t2d}, str(tmp_path / "vocab" / "vocab.safetensors"))
    with pytest.raises(ValueError, match="disagree"):
        load_vocab(tmp_path / "vocab")
