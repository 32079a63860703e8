"""Token-budget micro-batches (``train.max_tokens_per_batch``): every row once, within budget,
little padding, deterministic, resumable, and trainable end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specheads.dump.feed import Feed
from specheads.errors import DumpError


class _Lengths:
    """A feed source that only knows its rows' lengths (batches are the row lists themselves)."""

    kind = "offline"

    def __init__(self, lengths):
        self._lengths = np.asarray(lengths, dtype=np.int64)

    def __len__(self):
        return len(self._lengths)

    def lengths(self):
        return self._lengths

    def batches(self, batch_lists):
        yield from batch_lists


def _lengths(n=500, seed=0):
    g = np.random.default_rng(seed)
    return np.clip(g.lognormal(4.5, 0.8, n).astype(np.int64), 4, 1024)


def test_every_row_once_within_budget_and_little_padding():
    lens = _lengths()
    src = _Lengths(lens)
    ids = np.arange(len(lens))
    feed = Feed(src, ids, 1, seed=3, max_tokens=4096)
    batches = feed.global_batches(0)
    seen = [i for b in batches for i in b]
    assert sorted(seen) == ids.tolist()
    for b in batches:
        assert len(b) * max(lens[b]) <= 4096
    # sorting inside windows keeps padding far below random batches of the same row count
    rows_per_batch = len(lens) // len(batches)
    rng = np.random.default_rng(0).permutation(len(lens))
    random_pad = 1 - lens.sum() / sum(len(c) * lens[c].max() for c in np.array_split(rng, len(lens) // rows_per_batch))
    assert feed.padding_fraction(0) < 0.15 and random_pad > 3 * feed.padding_fraction(0)
    # deterministic for (seed, epoch), reshuffled between epochs, in-order for eval
    assert Feed(src, ids, 1, seed=3, max_tokens=4096).global_batches(0) == batches
    assert feed.global_batches(1) != batches
    ev = Feed(src, ids, 1, shuffle=False, max_tokens=4096, split="eval").global_batches(0)
    assert sorted(i for b in ev for i in b) == ids.tolist()


def test_row_over_budget_goes_alone_and_is_counted():
    lens = np.array([10, 10, 300, 10, 10, 10])
    feed = Feed(_Lengths(lens), np.arange(6), 1, max_tokens=64)
    assert feed.info["rows_over_budget"] == 1
    assert [2] in feed.global_batches(0)
    with pytest.raises(ValueError, match="max_tokens_per_batch must be >= 1"):
        Feed(_Lengths(lens), np.arange(6), 1, max_tokens=0)


def test_resume_and_world_size_change_continue_the_global_order():
    lens = _lengths(300, 1)
    src = _Lengths(lens)
    ids = np.arange(len(lens))
    one = Feed(src, ids, 1, seed=1, max_tokens=2048)
    whole = list(one)
    two = [Feed(src, ids, 1, seed=1, max_tokens=2048, rank=r, world_size=2) for r in (0, 1)]
    its = [iter(f) for f in two]
    for _ in range(3):
        for it in its:
            next(it)
    state = two[0].state_dict()
    assert state["global_position"] == 6
    resumed = Feed(src, ids, 1, seed=1, max_tokens=2048)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert rest == whole[6:]
    other = Feed(src, ids, 1, seed=1, max_tokens=1024)
    with pytest.raises(DumpError, match="max_tokens"):
        other.load_state_dict(state)


def test_offline_and_online_training_on_token_budget_batches(tmp_path):
    """One switch (dump.mode) between a stored dump and the target inside the trainer: on the same
    rows and token-budget batches, the two loss curves are the same, and the loss goes down."""
    from test_dump import make_recipe, make_rows, make_tiny_target

    from specheads.dump import make_feed, run_dump
    from specheads.train import run_train

    tiny = make_tiny_target(0)
    rows = make_rows(n=48, lo=4, hi=30)
    recipe = make_recipe(tmp_path)
    t = recipe.train
    t.max_tokens_per_batch, t.max_steps, t.lr, t.warmup_steps, t.ttt_steps = 96, 12, 3e-3, 2, 2
    t.eval_every = t.save_every = 0
    t.precision, t.loss_kernel, t.logging.wandb = "fp32", "torch", "disabled"
    recipe.head.num_layers = 1
    recipe.vocab.draft_vocab_size = None
    run_dump(recipe, target=tiny, rows=rows, progress=False)
    feed = make_feed(recipe, target=tiny)
    for b in feed.batches():
        assert len(b) == 1 or len(b) * max(len(rows[i]["input_ids"]) for i in b) <= 96
    offline = run_train(recipe, target=tiny, progress=False)

    recipe.dump.mode = "online"
    recipe.train.out = str(tmp_path / "train_online")
    online = run_train(recipe, target=tiny, feed=make_feed(recipe, target=tiny, rows=rows), progress=False)
    assert offline["steps"] == online["steps"] == 12
    assert np.isfinite(offline["final_loss"]) and offline["final_loss"] < offline["losses"][0]
    torch.testing.assert_close(torch.tensor(online["losses"]), torch.tensor(offline["losses"]), rtol=1e-4, atol=1e-5)

    # length buckets: batches padded to two shapes with filler rows; it trains, and counts only real tokens
    recipe.dump.mode = "offline"
    t.length_buckets, recipe.train.out = [16, 32], str(tmp_path / "train_buckets")
    feed = make_feed(recipe, target=tiny)
    shapes = {feed.padded_shape(len(b), max(len(rows[i]["input_ids"]) for i in b)) for b in feed.batches()}
    assert shapes <= {(6, 16), (3, 32)}
    bucketed = run_train(recipe, target=tiny, progress=False)
    assert bucketed["steps"] == 12 and np.isfinite(bucketed["final_loss"])
    # the summary reports the padding the buckets cost (more than batches cut at their own longest row)
    assert bucketed["padding_fraction"] == pytest.approx(feed.padding_fraction(0))
    assert 0 <= offline["padding_fraction"] < bucketed["padding_fraction"] < 1
    assert bucketed["final_loss"] < bucketed["losses"][0]
    first = next(iter(make_feed(recipe, target=tiny)))
    from specheads.train.run_log import read_metrics

    step1 = next(m for m in read_metrics(bucketed["metrics"]) if m["split"] == "train")
    assert step1["tokens"] == int(first["attention_mask"].sum())


def test_data_fraction_subsets_are_nested():
    from specheads.dump.feed import subset_mask

    ids = np.arange(5000)
    small, mid, full = (set(ids[subset_mask(ids, f)].tolist()) for f in (0.1, 0.3, 1.0))
    assert small < mid < full and len(full) == 5000
    assert abs(len(small) / 5000 - 0.1) < 0.02 and abs(len(mid) / 5000 - 0.3) < 0.03


def test_length_buckets_cut_by_the_bucket_and_give_few_shapes():
    lens = _lengths(600, 2)
    src = _Lengths(lens)
    ids = np.arange(len(lens))
    buckets = [64, 128, 256, 512, 1024]
    feed = Feed(src, ids, 1, seed=3, max_tokens=4096, length_buckets=buckets)
    plain = Feed(src, ids, 1, seed=3, max_tokens=4096)
    batches = feed.global_batches(0)
    assert sorted(i for b in batches for i in b) == ids.tolist()
    shapes = set()
    for b in batches:
        longest = int(max(lens[b]))
        L = next(x for x in buckets if x >= longest)
        assert len(b) * L <= 4096
        shapes.add(feed.padded_shape(len(b), longest))
    # one shape per bucket, rows cut from the budget; without buckets a shape is the batch itself
    assert shapes <= {(4096 // L, L) for L in buckets} and len(shapes) <= len(buckets)
    assert plain.padded_shape(3, 77) == (3, 77)
    assert len({plain.padded_shape(len(b), int(max(lens[b]))) for b in plain.global_batches(0)}) > 3 * len(shapes)
    # the price: more padding than batches at their own longest row (still well under a half here)
    assert plain.padding_fraction(0) < feed.padding_fraction(0) < 0.5
    # the batch order depends on the buckets: a resume must have the same
    state = feed.state_dict()
    assert state["length_buckets"] == buckets
    with pytest.raises(DumpError, match="length_buckets"):
        plain.load_state_dict(state)
    # a row longer than the largest bucket is named before any batch is cut
    with pytest.raises(DumpError, match=r"1 rows are longer .* bucket 32 \(row 2: 300 tokens\)"):
        Feed(_Lengths([10, 10, 300, 10]), np.arange(4), 1, max_tokens=512, length_buckets=[16, 32])
    with pytest.raises(ValueError, match="token budget"):
        Feed(_Lengths([10, 10]), np.arange(2), 1, length_buckets=[16, 32])


def test_length_buckets_in_the_recipe_are_checked():
    from specheads.config import recipe_from_dict

    def recipe(**t):
        return recipe_from_dict({"run_dir": "r", "train": t})

    assert recipe(max_tokens_per_batch=4096, length_buckets=[256, 512]).train.length_buckets == [256, 512]
    with pytest.raises(Exception, match="needs train.max_tokens_per_batch"):
        recipe(length_buckets=[256, 512])
    with pytest.raises(Exception, match="positive and increasing"):
        recipe(max_tokens_per_batch=4096, length_buckets=[512, 256])
    with pytest.raises(Exception, match="exceeds train.max_tokens_per_batch"):
        recipe(max_tokens_per_batch=1024, length_buckets=[512, 2048])
