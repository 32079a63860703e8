"""`specheads data regenerate`: resumable, deterministic, refuses another recipe's data."""
import json

import pytest

from specheads.config import load_recipe
from specheads.rundir import stage_inputs
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
    written = json.loads((tmp_path / "a/data/regenerate_summary.json").read_text())
    assert written["conversations"] == s["conversations"] and written["tokens"] == s["tokens"] > 0
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


def test_engine_dtype_is_a_setting_of_the_file(tiny, tiny_target_dir, tmp_path, engine_dtypes):
    """data.regenerate.dtype answers in bf16 under an fp32 target (the H200 recipe's choice); a file written
    at one dtype is not resumed at another, and a file written without the setting still resumes."""
    import torch

    seen = engine_dtypes
    prompts = _prompt_file(tmp_path)
    s = run_regenerate(_recipe(tmp_path / "a", (tiny_target_dir, prompts), **{"data.regenerate.dtype": "bfloat16"}),
                       target=tiny)
    assert seen == [torch.bfloat16] and tiny.dtype == torch.float32
    assert s["dtype"] == "bfloat16" and s["conversations"] > 0
    with pytest.raises(RegenerateError, match="differing: data.regenerate.dtype"):
        run_regenerate(_recipe(tmp_path / "a", (tiny_target_dir, prompts), **{"data.regenerate.dtype": "float32"}),
                       target=tiny)
    plain = _recipe(tmp_path / "b", (tiny_target_dir, prompts))
    assert "data.regenerate.dtype" not in stage_inputs(plain, "regenerate")
    assert run_regenerate(plain, target=tiny)["dtype"] == "float32"


def test_chat_continuous_multi_turn_equals_one_at_a_time(tiny):
    """Continuous batching: each next turn is a new prefill of the conversation so far; answers
    equal the fixed one-conversation batches (greedy), results come back in input order, and an
    overlong prompt is skipped as before."""
    from specheads.runtime.chat import chat_generate
    from specheads.runtime.model import TargetModel

    convs = [{"id": f"c{i}", "turns": [f"Question {i}: " + "why? " * (i % 4), "And then?", "Thanks."][: 1 + i % 3]}
             for i in range(7)]
    convs.append({"id": "long", "turns": ["word " * 200]})
    engine = TargetModel.from_hf(tiny.model, max_batch=8, max_seq=512)
    kw = dict(max_new_tokens=6, max_prompt_tokens=120)
    ref, _ = chat_generate(engine, tiny.tokenizer, convs, batch_size=1, **kw)
    done = []
    got, secs = chat_generate(engine, tiny.tokenizer, convs, batch_size=3, continuous=True, sync_every=2,
                              on_done=lambda r: done.append(r.id), **kw)
    assert [r.id for r in got] == [c["id"] for c in convs] and sorted(done) == sorted(r.id for r in got)
    for a, b in zip(ref, got):
        assert (a.messages, a.answer_tokens, a.finish_reasons) == (b.messages, b.answer_tokens, b.finish_reasons)
    assert got[-1].finish_reasons == ["skipped:overlong"] and secs > 0
    assert [len(r.answer_tokens) for r in got[:3]] == [1, 2, 3]
    # sampled: a conversation's answers do not depend on the batch size
    # (sizes 4 and 8: see test_synthesize's note on CPU GEMMs and small batches)
    s4, _ = chat_generate(engine, tiny.tokenizer, convs, batch_size=4, continuous=True, temperature=0.8, seed=3, **kw)
    s8, _ = chat_generate(engine, tiny.tokenizer, convs, batch_size=8, continuous=True, temperature=0.8, seed=3, **kw)
    assert [r.messages for r in s4] == [r.messages for r in s8]



def test_a_kv_cache_larger_than_the_device_is_refused_naming_the_batch_size(tiny, tiny_target_dir, tmp_path,
                                                                             monkeypatch):
    """On an 80 GB card the H200 recipe's 1,024 regeneration rows asked torch for 2 x 61 GiB of KV cache and died
    with a bare CUDA OutOfMemoryError (2026-12-06): the cache is sized and checked before it is allocated, and
    the error names data.regenerate.batch_size and the largest batch that fits."""
    import torch

    from specheads.runtime import model as engine_model
    from specheads.runtime.model import KVCacheTooLarge, check_kv_cache_fits

    prompts = _prompt_file(tmp_path)
    monkeypatch.setattr(engine_model, "free_device_bytes", lambda device: 1000)
    with pytest.raises(RegenerateError, match=r"data.regenerate.batch_size=3: the KV cache for 3 rows of \d+ tokens "
                                              r".* 0 rows would fit\. .*not one row fits: lower those"):
        run_regenerate(_recipe(tmp_path, (tiny_target_dir, prompts)), target=tiny)
    assert not (tmp_path / "data" / "regenerated.jsonl").exists() or \
        (tmp_path / "data" / "regenerated.jsonl").read_text() == ""

    # the arithmetic: K and V of every layer, slots rounded up to 16, the dtype's bytes, 90% of what is free
    layers, heads, seq, dim = 6, 2, 100, 32
    per_row = 2 * layers * heads * engine_model.round_up(seq) * dim * 2
    monkeypatch.setattr(engine_model, "free_device_bytes", lambda device: int(2.5 * per_row / 0.9))
    check_kv_cache_fits(layers, 2, heads, seq, dim, torch.bfloat16, "cuda")
    with pytest.raises(KVCacheTooLarge, match="2 rows would fit") as e:
        check_kv_cache_fits(layers, 3, heads, seq, dim, torch.bfloat16, "cuda")
    assert (e.value.fits, e.value.needed) == (2, 3 * per_row)
    monkeypatch.undo()
    check_kv_cache_fits(layers, 10 ** 6, heads, seq, dim, torch.float32, "cpu")  # host memory is not checked
