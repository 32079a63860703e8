"""Training the parallel drafters (P-EAGLE, DFlash): sampling, alignment, and whole runs on the tiny
synthetic target through the real DeepSpeed path (CPU)."""
from __future__ import annotations

import pytest
import torch

from specheads.config import recipe_from_dict
from specheads.formats.trained import load_trained_head
from specheads.heads import DFlashHead, HeadConfig, PEagleHead
from specheads.layer_ids import default_dflash_layer_ids
from specheads.train import build_head, run_train
from specheads.train.losses import TargetLogits, counted_positions
from specheads.train.parallel_losses import (batch_generator, cod_sample, dflash_anchors, dflash_loss,
                                             dflash_weights, peagle_loss)
from specheads.train.run_log import read_metrics
from synthetic_target import DRAFT_VOCAB as VD, SyntheticFeed, tiny_recipe, tiny_target



def make_recipe(run_dir, kind, **train):
    head = {"kind": kind, "aux_layer_ids": [1, 2, 3], "num_layers": 2, "num_depths": 3, "block_size": 4}
    return tiny_recipe(run_dir, head, **{"ttt_steps": 7, "precision": "bf16", "dflash_anchors": 8, **train})


def test_default_dflash_layers_are_the_published_ones():
    # DFlash's own numbering (output of layer i) is ours minus one: Qwen3-8B's 36 layers give 1, 9, 17, 25, 33
    assert [i - 1 for i in default_dflash_layer_ids(36)] == [1, 9, 17, 25, 33]
    assert [i - 1 for i in default_dflash_layer_ids(30)] == [1, 8, 14, 20, 27]     # SmolLM2
    assert [i - 1 for i in default_dflash_layer_ids(28)] == [1, 7, 13, 19, 25]     # Qwen2.5-1.5B


def test_cod_sampling_keeps_whole_rollouts_and_the_ratio():
    T = 64
    lm = torch.ones(2, T, dtype=torch.long)
    lm[1, :10] = 0
    iv = torch.ones(2, T, dtype=torch.bool)
    anchor, depth = cod_sample(lm, iv, None, 5, 0.5, 0.2, torch.Generator().manual_seed(0))
    for b in range(2):
        a, d = anchor[b][depth[b] >= 0], depth[b][depth[b] >= 0]
        assert torch.equal(a[d == 0], torch.arange(T))
        for k in range(1, 5):
            ak, prev = set(a[d == k].tolist()), set(a[d == k - 1].tolist())
            assert ak <= prev
            ok = counted_positions(lm[b:b + 1], iv[b:b + 1], k)[0]
            assert all(bool(ok[t]) for t in ak)            # only entries whose prediction trains
            pool = [t for t in prev if bool(ok[t])]
            assert len(ak) == min(len(pool), int(int(ok.sum()) * max(0.5 ** k, 0.2)))
    again = cod_sample(lm, iv, None, 5, 0.5, 0.2, torch.Generator().manual_seed(0))
    assert torch.equal(again[0], anchor) and torch.equal(again[1], depth)


def test_dflash_anchors_only_where_the_first_draft_trains():
    lm = torch.zeros(3, 40, dtype=torch.long)
    lm[0, 20:35] = 1
    lm[2, 5:9] = 1
    iv = torch.ones(3, 40, dtype=torch.bool)
    a, ok = dflash_anchors(lm, iv, None, 6, torch.Generator().manual_seed(1))
    assert ok.sum(1).tolist() == [2, 0, 2]           # the micro-batch's budget, 6 // 3 rows a row
    assert a.shape[1] * a.shape[0] <= 6              # so the blocks' tensors stay within it: rows x anchors a row
    assert not ok[1].any()                           # a row with nothing trained gets no block
    for b, lo, hi in ((0, 19, 33), (2, 4, 7)):
        got = a[b][ok[b]]
        assert all(lo <= int(x) <= hi for x in got) and torch.equal(got, got.sort().values)
    a, ok = dflash_anchors(lm, iv, None, 100, torch.Generator().manual_seed(1))
    assert int(ok.sum()) == 15 + 4                   # fewer candidates than the budget: all of them
    assert dflash_weights(4, 4.0)[0] == 1.0 and dflash_weights(4, 4.0)[2] == pytest.approx(2.718281828 ** -0.5)


def _tiny_view(target, feed_batch, d2t):
    return TargetLogits(target.lm_head.weight, d2t)(feed_batch["final"])


@pytest.mark.parametrize("kind", ["peagle", "dflash"])
def test_entry_alignment_against_the_target(kind, target, vocab):
    """A head whose logits are the target's own at the row each entry is trained against scores every
    counted entry a hit: the loss reads row u-1 for a prediction of x_u."""
    feed = SyntheticFeed(target, batch_size=2)
    batch = next(iter(feed))
    d2t = vocab[0]
    tv = _tiny_view(target, batch, d2t)
    cfg = HeadConfig.from_target_config(target.config, kind, draft_vocab_size=VD, aux_layer_ids=[1, 2, 3],
                                        num_layers=1, num_depths=3, block_size=4, mask_token_id=5)
    head = (PEagleHead if kind == "peagle" else DFlashHead)(cfg)
    head.set_vocab_mapping(d2t)

    class Oracle(torch.nn.Module):    # returns the target's logits at the entry's trained row
        def __init__(self):
            super().__init__()
            self.cfg, self.fc = cfg, head.fc

        def parallel_forward(self, ids, aux, anchor, depth, attn):
            rows = (anchor + 1 + depth.clamp(min=0)).clamp(max=ids.shape[1] - 1)
            return tv.logits.gather(1, rows[..., None].expand(*rows.shape, tv.logits.shape[-1])) * 10

        def block_forward_train(self, ids, aux, anchors, attn, attention="dense"):
            S = cfg.block_size
            rows = (anchors[:, :, None] + torch.arange(S) - 1).clamp(0, ids.shape[1] - 1)
            B, A = anchors.shape
            r = rows.reshape(B, A * S)
            return (tv.logits.gather(1, r[..., None].expand(B, A * S, tv.logits.shape[-1])) * 10).view(B, A, S, -1)

    out = (peagle_loss(Oracle(), batch, tv, 3, 0.7, 0.2) if kind == "peagle"
           else dflash_loss(Oracle(), batch, tv, 8, 4.0))
    assert all(int(c) > 0 for c in out.counts)
    assert all(int(h) == int(c) for h, c in zip(out.hits, out.counts))


def test_training_attention_keeps_off_cudnn(target, vocab, monkeypatch):
    """A head's training forward (here P-EAGLE's, whose SDPA calls take an explicit mask) runs on a GPU with cuDNN's
    attention off (its backward's NaN query gradient, pytorch/pytorch#196678), the other kernels on, and the flags
    come back after."""
    import specheads.heads.layers as layers
    import specheads.train.losses as losses

    real_sdpa, real_ctx = layers.F.scaled_dot_product_attention, losses.sdpa_without_cudnn
    seen = []

    def spy(*a, **kw):
        seen.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()))
        return real_sdpa(*a, **kw)

    monkeypatch.setattr(layers.F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(losses, "sdpa_without_cudnn", lambda device: real_ctx(torch.device("cuda")))
    feed = SyntheticFeed(target, batch_size=2)
    batch = next(iter(feed))
    cfg = HeadConfig.from_target_config(target.config, "peagle", draft_vocab_size=VD, aux_layer_ids=[1, 2, 3],
                                        num_layers=2, num_depths=3, mask_token_id=5)
    head = PEagleHead(cfg)
    head.set_vocab_mapping(vocab[0])
    before = torch.backends.cuda.cudnn_sdp_enabled()
    out = losses.Objective(head, "peagle")(batch, _tiny_view(target, batch, vocab[0]))
    out.loss.backward()
    assert len(seen) == 2 and all(s == (False, True) for s in seen)      # one call per decoder layer
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    assert type(real_ctx(torch.device("cpu"))).__name__ == "nullcontext"


@pytest.mark.parametrize("kind", ["peagle", "dflash"])
def test_overfit_parallel_heads(kind, target, vocab, tmp_path):
    r = make_recipe(tmp_path / kind, kind, max_steps=30, eval_every=15, save_every=15)
    s = run_train(r, target=target, feed=SyntheticFeed(target), eval_feed=SyntheticFeed(target, shuffle=False),
                  vocab=vocab, progress=False)
    ev = [m for m in read_metrics(s["metrics"]) if m["split"] == "eval"]
    assert ev[-1]["loss"] < 0.6 * ev[0]["loss"]
    assert ev[-1]["sim_tau"] > ev[0]["sim_tau"] + 0.5
    assert len(ev[-1]["step_acc"]) == (3 if kind == "peagle" else 3)
    head, meta = load_trained_head(tmp_path / kind)
    assert meta["kind"] == kind and head.cfg.mask_token_id == target.vocab_size - 1
    assert torch.equal(head.d2t, vocab[0])
    if kind == "dflash":   # the target's lm_head rows, frozen through training
        ids = head.draft_to_target(torch.arange(VD))
        assert torch.equal(head.lm_head.weight, target.lm_head.weight[ids].to(head.lm_head.weight.dtype))
    else:
        assert head.mask_hidden.shape == (1, 1, 3 * target.hidden_size)


def test_builder_defaults_and_refusals(target, vocab, tmp_path):
    r = recipe_from_dict({"run_dir": str(tmp_path), "head": {"kind": "dflash", "aux_layer_ids": [1, 2, 3]},
                          "vocab": {"draft_vocab_size": VD}})
    built = build_head(r, target, vocab)
    assert built.cfg.num_layers == 5 and built.cfg.qk_norm and built.cfg.block_size == 8
    assert not built.head.lm_head.weight.requires_grad and not built.head.embed_tokens.weight.requires_grad
    r = recipe_from_dict({"run_dir": str(tmp_path), "head": {"kind": "peagle", "mask_token_id": 9999, "aux_layer_ids": [1, 2, 3]}})
    with pytest.raises(Exception, match="mask_token_id=9999 is outside the target vocabulary"):
        build_head(r, target, vocab)


def test_same_batch_same_sample():
    ids = torch.randint(0, 50, (2, 16))
    g1, g2 = batch_generator(3, ids), batch_generator(3, ids)
    assert torch.equal(torch.randperm(10, generator=g1), torch.randperm(10, generator=g2))
    assert not torch.equal(torch.randperm(100, generator=batch_generator(4, ids)),
                           torch.randperm(100, generator=batch_generator(3, ids)))


def test_one_dump_serves_eagle3_and_dflash(tmp_path):
    """dump.aux_layer_ids holds both heads' layers; each head reads its own out of the store, and a
    head reading a layer the store lacks is refused before training, naming it."""
    import numpy as np

    from specheads.dump import make_feed, run_dump
    from specheads.errors import DumpError

    tgt = tiny_target(layers=8)
    g = np.random.default_rng(0)
    rows = [{"input_ids": g.integers(0, 256, int(k)).tolist(), "loss_mask": [1] * int(k)}
            for k in g.integers(8, 24, 12)]
    base = {"run_dir": str(tmp_path), "seed": 0, "data": {"max_length": 32},
            "dump": {"dtype": "float32", "shard_tokens": 128, "batch_tokens": 64, "aux_layer_ids": [2, 3, 4, 5, 6, 7]},
            "vocab": {"draft_vocab_size": None}, "head": {"kind": "dflash", "num_layers": 1, "block_size": 3},
            "train": {"max_steps": 2, "micro_batch_size": 2, "eval_every": 0, "eval_fraction": 0.0, "save_every": 0,
                      "loss_kernel": "torch", "logging": {"wandb": "disabled"}, "dflash_anchors": 4}}
    r = recipe_from_dict(base)
    run_dump(r, target=tgt, rows=rows, progress=False)
    both = make_feed(r, target=tgt)                          # DFlash's default five of eight layers: 2 .. 6
    e3 = make_feed(recipe_from_dict({**base, "head": {"kind": "eagle3"}}), target=tgt)      # [2, 4, 5]
    b_d, b_e = next(iter(both)), next(iter(e3))
    H = tgt.hidden_size
    assert both.info["aux_layer_ids"] == [2, 3, 4, 5, 6] and e3.info["aux_layer_ids"] == [2, 4, 5]
    assert torch.equal(b_d["aux"].view(*b_d["aux"].shape[:2], 5, H)[:, :, 0], b_e["aux"].view(*b_e["aux"].shape[:2], 3, H)[:, :, 0])
    aux, _ = tgt.hidden_states(b_e["input_ids"][:1], aux_layer_ids=[2, 4, 5])
    n = int(b_e["attention_mask"][0].sum())
    assert torch.allclose(aux[0, :n], b_e["aux"][0, :n], atol=1e-5)
    s = run_train(r, target=tgt, progress=False)
    assert s["steps"] == 2
    bad = recipe_from_dict({**base, "head": {"kind": "eagle3", "aux_layer_ids": [1, 3, 6]},
                            "train": {**base["train"], "overwrite": True}})
    with pytest.raises(DumpError, match=r"layer\(s\) \[1\] are not in the store"):
        run_train(bad, target=tgt, progress=False)
    with pytest.raises(DumpError, match=r"lacks layer\(s\) \[1\]"):
        run_dump(recipe_from_dict({**base, "run_dir": str(tmp_path / "b"), "head": {"kind": "eagle3", "aux_layer_ids": [1, 3, 6]}}),
                 target=tgt, rows=rows, progress=False)


def test_dflash_flex_block_attention_matches_the_dense_one():
    # The flex path's block mask is the dense path's visibility: the same logits for every block, in a padded row,
    # a row with unused anchors, and blocks whose queries straddle flex's 128-wide tiles (T and A*S not multiples).
    torch.manual_seed(0)
    cfg = HeadConfig(kind="dflash", hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                     target_hidden_size=32, target_vocab_size=160, draft_vocab_size=160, aux_layer_ids=[1, 3, 5],
                     num_layers=2, block_size=4, mask_token_id=159, qk_norm=True)
    head = DFlashHead(cfg)
    for p in head.parameters():
        p.data.normal_(0, 0.3)
    T, A = 150, 37
    ids = torch.randint(0, 159, (2, T))
    aux = torch.randn(2, T, 3 * 32)
    attn = torch.ones(2, T, dtype=torch.long)
    attn[1, :10] = attn[1, 100:] = 0                              # row 1: masked before 10 and from 100 on
    anchors = torch.stack([torch.randperm(T - 1)[:A] + 1, torch.randperm(89)[:A] + 11]).sort(1).values
    anchors[1, 30:] = 1                                           # unused anchors, as dflash_anchors pads a row
    with torch.no_grad():
        dense = head.block_forward_train(ids, aux, anchors, attn)
        flex = head.block_forward_train(ids, aux, anchors, attn, attention="flex")
    assert dense.shape == flex.shape == (2, A, 4, 160)
    torch.testing.assert_close(flex, dense, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="'dense' or 'flex'"):
        head.block_forward_train(ids, aux, anchors, attn, attention="sdpa")


@pytest.mark.skipif(torch.cuda.is_available(), reason="flex attention trains on CUDA: nothing to refuse there")
def test_flex_block_attention_is_refused_off_cuda(target, vocab, tmp_path):
    # torch's flex attention has no CPU backward: the run stops before any training, naming the setting and the way out
    from specheads.errors import UsageError

    r = make_recipe(tmp_path / "flex", "dflash", max_steps=2, dflash_attention="flex")
    with pytest.raises(UsageError, match="train.dflash_attention=flex needs a CUDA device.*dflash_attention=dense"):
        run_train(r, target=target, feed=SyntheticFeed(target), vocab=vocab, progress=False)
    assert not list((tmp_path / "flex").rglob("metrics.jsonl"))
