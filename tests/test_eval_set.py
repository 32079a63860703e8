"""builtin:eval_mixed, the mixed evaluation set (issue #13): it loads with its categories, it is
what benchmarks/build_eval_set.py builds from ../shared/data, and none of it is trained on by a
recipe that reads those files with data.holdout_fraction 0.05."""
import functools
import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from specheads.config import load_recipe
from specheads.data.formats import load_conversations, load_prompts
from specheads.data.regenerate import load_prompt_items
from specheads.data.sources import BUILTIN, is_holdout, split_holdout

REPO = Path(__file__).resolve().parent.parent
ASSET = BUILTIN["builtin:eval_mixed"]
HOLDOUT = 0.05  # the reference recipe's data.holdout_fraction


@functools.cache
def _builder():
    spec = importlib.util.spec_from_file_location("build_eval_set", REPO / "benchmarks" / "build_eval_set.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up while being defined
    spec.loader.exec_module(mod)
    return mod


def _records():
    return [json.loads(line) for line in ASSET.read_text(encoding="utf-8").splitlines()]


def test_asset_loads_with_categories():
    items = load_prompts("builtin:eval_mixed")
    assert len(items) >= 120
    counts = Counter(it["category"] for it in items)
    assert len(counts) >= 7 and min(counts.values()) >= 15, counts
    assert all(it["turns"] and all(t.strip() for t in it["turns"]) for it in items)
    ids = [it["id"] for it in items]
    assert len(set(ids)) == len(ids)
    assert ids == [r["question_id"] for r in _records()]  # the loader takes question_id as the id


def test_every_source_row_is_held_out():
    files = set(_builder().FILES)
    for rec in _records():
        for source in rec["source"].split(";"):
            file, _, row_id = source.partition(":")
            assert file in files, source
            assert is_holdout(row_id, HOLDOUT), f"{rec['question_id']}: {source} is in the training split"


@pytest.fixture(scope="module")
def built(shared_data):
    builder = _builder()
    return builder, builder.build(shared_data)


def test_rebuild_is_byte_identical(built):
    builder, prompts = built
    assert builder.render(prompts) == ASSET.read_text(encoding="utf-8")


def test_no_eval_text_in_training_data(built, shared_data, tmp_path):
    builder, prompts = built
    paths = [str(shared_data / name) for name in builder.FILES]
    recipe = load_recipe(REPO / "recipes" / "smollm2_eagle3.yaml", [
        f"run_dir={tmp_path}", "data.sources=" + json.dumps([{"path": p} for p in paths]),
        f"data.holdout_fraction={HOLDOUT}"])
    # what regeneration sends to the target, and what `data prepare` trains on when it does not
    # regenerate (the files' own answers included)
    train_items, _ = load_prompt_items(recipe)
    texts = [t for it in train_items for t in it["turns"]]
    for p in paths:
        train_convs, _ = split_holdout(load_conversations(p), HOLDOUT)
        texts += [m["content"] for c in train_convs for m in c["messages"]]
    training = "\x00".join(texts).encode()  # bytes: searched several times faster than a non-ASCII str

    train_ids = {it["id"] for it in train_items}
    for prompt in prompts:
        assert not {r.id for r in prompt.rows} & train_ids
        for text in [prompt.text, *prompt.documents, *(r.prompt for r in prompt.rows)]:
            assert text.strip().encode() not in training, f"{prompt.category}: {text[:80]!r} is in the training data"
