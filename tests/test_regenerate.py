"""`specheads data regenerate`: resumable, deterministic, refuses another recipe's data."""
import json

import pytest

from specheads.config import load_recipe
from specheads.data.regenerate import RegenerateError, run_regenerate
from specheads.target import load_target


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    return load_target(str(tiny_target_dir))


def _recipe(tmp_path, prompts, **over):
    ov = [f"run_dir={tmp_path}", f"target.source={prompts[0]}", f"data.sources.0.path={prompts[1]}",
          "data.regenerate.enabled=true", "data.regenerate.max_new_tokens=8", "data.regenerate.batch_size=3",
          "data.holdout_fraction=0.2", "target.device=cpu"]
    ov += [f"{k}={v}" for k, v in over.items()]
    return load_recipe("recipes/smollm2_eagle3.yaml", ov)


def _prompt_file(tmp_path):
    p = tmp_path / "prompts.jsonl"
    rows = [{"id": f"p{i}", "prompt": f"Question number {i}: what is {i} plus {i}?"} for i in range(10)]
    rows.append({"id": "empty", "prompt": "   "})
    rows.append({"id": "mt", "turns": ["Hello there.", "Tell me more."], "category": "chat"})
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def test_regenerate_resume_is_identical(tiny, tiny_target_dir, tmp_path):
    prompts = _prompt_file(tmp_path)
    full = _recipe(tmp_path / "a", (tiny_target_dir, prompts))
    s = run_regenerate(full, target=tiny)
    assert s["empty"] == 1 and s["conversations"] + s["held_out"] == 11
    ref = (tmp_path / "a/data/regenerated.jsonl").read_text().splitlines()
    mt = [json.loads(x) for x in ref if json.loads(x)["id"] == "mt"]
    if mt:  # multi-turn: both user turns answered in order
        assert [m["role"] for m in mt[0]["messages"]] == ["user", "assistant", "user", "assistant"]

    # "kill" after 4 conversations, leaving a torn last line, then rerun the same command
    part = _recipe(tmp_path / "b", (tiny_target_dir, prompts))
    out = tmp_path / "b/data/regenerated.jsonl"
    out.parent.mkdir(parents=True)
    (tmp_path / "a/data/regenerated.jsonl.meta.json").replace(tmp_path / "b/data/regenerated.jsonl.meta.json")
    out.write_text("\n".join(ref[:4]) + "\n" + ref[4][: len(ref[4]) // 2])
    s2 = run_regenerate(part, target=tiny)
    assert s2["already_done"] == 4
    got = out.read_text().splitlines()
    assert sorted(got) == sorted(ref) and len(set(json.loads(x)["id"] for x in got)) == len(got)


def test_regenerate_refuses_other_recipes_data(tiny, tiny_target_dir, tmp_path):
    prompts = _prompt_file(tmp_path)
    run_regenerate(_recipe(tmp_path, (tiny_target_dir, prompts)), target=tiny)
    with pytest.raises(RegenerateError, match="other settings .*max_new_tokens"):
        run_regenerate(_recipe(tmp_path, (tiny_target_dir, prompts), **{"data.regenerate.max_new_tokens": 9}), target=tiny)
    foreign = tmp_path / "x.jsonl"
    foreign.write_text('{"id": 1}\n')
    with pytest.raises(RegenerateError, match="not written by"):
        run_regenerate(_recipe(tmp_path, (tiny_target_dir, prompts), **{"data.regenerate.out": foreign}), target=tiny)
