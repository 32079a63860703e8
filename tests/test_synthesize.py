"""`specheads data synthesize`: prompts written by the target; deterministic, resumable, filtered, refused when stale."""
import errno
import json
import shutil

import pytest
import torch

from specheads.cli import main
from specheads.config import RecipeError, load_recipe
from specheads.rundir import RunDir
from specheads.data.appendlog import append_rows, read_rows, with_checksum
from specheads.data.formats import load_prompts
from specheads.data.sources import resolve_source
from specheads.data.synthesize import (Deduper, SynthesizeError, copy_prompt, dropped_path, load_seeds, plan_item,
                                       run_synthesize, user_turn_stops)
from specheads.target import load_target


@pytest.fixture(scope="module")
def chatty(tiny_target_dir):
    """The tiny random target, nudged to end a message now and then.

    A random model almost never samples the end-of-turn token (1 in 49k), so every message would hit the
    length cap. Here every embedding gets a shared direction d (the final norm then sees mostly d) and the
    untied lm_head row of <|im_end|> gets d too: it ends a message with p ≈ 0.15 per token, so some
    messages end and some run into the cap, as with a real target.

    In float64: the batch-size tests compare sampled text, and this target's flat distributions put sampled
    tokens at nucleus / CDF boundaries, where float32 GEMMs that round a row differently in a batch of 4 and
    one of 8 flip a token (seen on one CPU kind, not on another); float64 leaves no such last-bit flips."""
    t = load_target(str(tiny_target_dir))
    m = t.model
    emb = m.model.embed_tokens.weight.detach().clone()
    d = torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(0))
    d /= d.norm()
    head = emb.clone()
    head[t.tokenizer.convert_tokens_to_ids("<|im_end|>")] += 1.134 * d
    m.model.embed_tokens.weight = torch.nn.Parameter(emb + d, requires_grad=False)
    m.lm_head.weight = torch.nn.Parameter(head, requires_grad=False)
    m.double()
    return t


def _recipe(run_dir, target_dir, *extra, **over):
    ov = [f"run_dir={run_dir}", f"target.source={target_dir}", "target.device=cpu",
          "data.synthesize.num_prompts=6", "data.synthesize.batch_size=4", "data.synthesize.max_new_tokens=16",
          "data.synthesize.copy_tasks.document_tokens=32", "data.synthesize.answer_tokens=8",
          "data.synthesize.min_chars=4", *extra]
    ov += [f"{k}={v}" for k, v in over.items()]
    return load_recipe(None, ov)


def _lines(path):
    return path.read_text().splitlines()


def test_same_seed_same_file_whatever_the_batch_size(chatty, tiny_target_dir, tmp_path):
    # batch sizes 4 and 8, in float64 (see `chatty`): the schedule itself never changes a conversation's draws
    a = _recipe(tmp_path / "a", tiny_target_dir, "data.synthesize.turns=2", "data.synthesize.batch_size=4")
    s = run_synthesize(a, target=chatty)
    b = _recipe(tmp_path / "b", tiny_target_dir, "data.synthesize.turns=2", "data.synthesize.batch_size=8")
    run_synthesize(b, target=chatty)
    out_a, out_b = RunDir(a).synthesized, RunDir(b).synthesized
    assert out_a.read_text() == out_b.read_text()
    assert dropped_path(out_a).read_text() == dropped_path(out_b).read_text()

    rows = [json.loads(x) for x in _lines(out_a)]
    assert s["written"] == len(rows) == 6 and all(len(r["turns"]) == 2 and all(r["turns"]) for r in rows)
    assert all(r["category"] for r in rows) and len({r["id"] for r in rows}) == 6
    # plain prompt records: what data.sources of a regenerate recipe reads
    loaded = load_prompts(out_a)
    assert [(p["id"], p["turns"], p["category"]) for p in loaded] == [(r["id"], r["turns"], r["category"]) for r in rows]
    # every drop is counted with its reason, and the summary and the plot are written beside the output
    drops = [json.loads(x) for x in _lines(dropped_path(out_a))]
    assert sum(s["dropped"].values()) == len(drops) > 0 and s["attempts"] == 6 + len(drops)
    summary = json.loads((out_a.parent / "synthesize_summary.json").read_text())
    assert summary["written"] == 6 and summary["per_category"] and "near_duplicate_rate" in summary
    assert (out_a.parent / "synthesize_categories.png").stat().st_size > 1000

    other = _recipe(tmp_path / "c", tiny_target_dir, "data.synthesize.num_prompts=2", seed=1)
    run_synthesize(other, target=chatty)
    assert [json.loads(x)["turns"][0] for x in _lines(RunDir(other).synthesized)] != [r["turns"][0] for r in rows[:2]]


def test_length_cap_is_counted(chatty, tiny_target_dir, tmp_path):
    r = _recipe(tmp_path, tiny_target_dir, "data.synthesize.max_new_tokens=4", "data.synthesize.copy_tasks.fraction=0",
                "data.synthesize.min_chars=1", "data.synthesize.num_prompts=4")
    s = run_synthesize(r, target=chatty)
    drops = [json.loads(x) for x in _lines(dropped_path(RunDir(r).synthesized))]
    no_end = [d for d in drops if d["reason"] == "no_end"]
    assert s["dropped"]["no_end"] == len(no_end) > 0
    assert all(d["turns"] and d["turns"][0] for d in no_end)  # what it wrote before the cap, for inspection


def test_resume_after_a_torn_line_gives_the_same_file(chatty, tiny_target_dir, tmp_path):
    full = _recipe(tmp_path / "a", tiny_target_dir)
    run_synthesize(full, target=chatty)
    ref, ref_drop = _lines(RunDir(full).synthesized), _lines(dropped_path(RunDir(full).synthesized))
    assert len(ref) == 6 and ref_drop

    # "killed" after 3 prompts, in the middle of the 4th line, the dropped rows of that batch not yet written
    part = _recipe(tmp_path / "b", tiny_target_dir)
    out = RunDir(part).synthesized
    out.parent.mkdir(parents=True)
    shutil.copy(RunDir(full).synthesized.with_name(out.name + ".meta.json"), out.parent)
    out.write_text("\n".join(ref[:3]) + "\n" + ref[3][: len(ref[3]) // 2])
    dropped_path(out).write_text("\n".join(ref_drop[:1]) + "\n")
    s = run_synthesize(part, target=chatty)
    assert s["already_done"] == 3
    assert _lines(out) == ref and _lines(dropped_path(out)) == ref_drop
    assert s["written"] == 6 and s["dropped_total"] == len(ref_drop)

    # a larger num_prompts extends the same file: the first 6 are the same prompts
    s = run_synthesize(_recipe(tmp_path / "b", tiny_target_dir, **{"data.synthesize.num_prompts": 8}), target=chatty)
    assert _lines(out)[:6] == ref and s["written"] == 8


def test_refuses_a_file_of_another_recipe_seed_or_seed_file(chatty, tiny_target_dir, tmp_path):
    seeds = tmp_path / "seeds.yaml"
    shutil.copy(resolve_source("builtin:synthesize_seeds"), seeds)
    base = {"data.synthesize.seeds": seeds, "data.synthesize.num_prompts": 2}
    run_synthesize(_recipe(tmp_path, tiny_target_dir, **base), target=chatty)
    with pytest.raises(SynthesizeError, match=r"other settings \(differing: seed\)"):
        run_synthesize(_recipe(tmp_path, tiny_target_dir, **base, seed=7), target=chatty)
    with pytest.raises(SynthesizeError, match="differing: data.synthesize.temperature"):
        run_synthesize(_recipe(tmp_path, tiny_target_dir, **base, **{"data.synthesize.temperature": 0.7}), target=chatty)
    seeds.write_text(seeds.read_text().replace("weight: 3", "weight: 4"))
    with pytest.raises(SynthesizeError, match="differing: seeds_sha256"):
        run_synthesize(_recipe(tmp_path, tiny_target_dir, **base), target=chatty)
    foreign = tmp_path / "mine.jsonl"
    foreign.write_text('{"id": 1, "prompt": "hello"}\n')
    with pytest.raises(SynthesizeError, match="not written by `specheads data synthesize`"):
        run_synthesize(_recipe(tmp_path, tiny_target_dir, **base, **{"data.synthesize.out": foreign}), target=chatty)
    assert foreign.read_text() == '{"id": 1, "prompt": "hello"}\n'


def test_engine_dtype_is_a_setting_of_the_file(chatty, tiny_target_dir, tmp_path, engine_dtypes):
    """data.synthesize.dtype runs the engine in bf16 under an fp32 target (the H200 recipe's choice), and a
    file written at one dtype is not resumed at another."""
    seen = engine_dtypes
    base = {"data.synthesize.num_prompts": 2, "data.synthesize.dtype": "bfloat16"}
    s = run_synthesize(_recipe(tmp_path, tiny_target_dir, **base), target=chatty)
    assert seen == [torch.bfloat16] and next(chatty.model.parameters()).dtype == torch.float64  # the target's own
    assert s["written"] == 2
    with pytest.raises(SynthesizeError, match="differing: data.synthesize.dtype"):
        run_synthesize(_recipe(tmp_path, tiny_target_dir, **{**base, "data.synthesize.dtype": "float32"}),
                       target=chatty)


def test_a_full_disk_loses_nothing_already_written(tmp_path):
    out = tmp_path / "synthesized.jsonl"
    with open(out, "a") as f:
        append_rows(f, out, [{"id": "a", "turns": ["Hello there"]}], SynthesizeError, "1 prompts")

    class FullDisk:  # half a line reaches the disk, then the write fails
        def write(self, text):
            with open(out, "a") as g:
                g.write(text[:7])
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(SynthesizeError, match=r"disk full while writing .*synthesized.jsonl; 1 prompts are safely "
                                              r"written, rerun the same command to resume"):
        append_rows(FullDisk(), out, [{"id": "b", "turns": ["Hi"]}], SynthesizeError, "1 prompts")
    assert read_rows(out) == [{"id": "a", "turns": ["Hello there"]}]  # the torn line is cut off on resume
    assert [json.loads(x) for x in out.read_text().splitlines(keepends=True)] == [
        with_checksum({"id": "a", "turns": ["Hello there"]})]  # whole lines only, each with its checksum


def test_a_template_without_a_user_turn_fails_before_weights_load(tiny_target_dir, tmp_path, monkeypatch, capsys):
    import specheads.target as target

    monkeypatch.setattr(target, "load_target", lambda *a, **k: pytest.fail("weights were loaded"))
    template = tmp_path / "no_user.jinja"
    template.write_text("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}<|im_end|>"
                        "{% endif %}{% endfor %}")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"run_dir: {tmp_path}\ntarget: {{source: {tiny_target_dir}, chat_template: {template}}}\n")
    assert main(["data", "synthesize", str(recipe)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("specheads: SynthesizeError: the chat template of ") and err.count("\n") == 1
    assert str(template) in err and "has no user turn" in err

    # a user turn that no special token closes: the end of a message cannot be told
    from specheads.target import load_tokenizer

    tok = load_tokenizer(str(tiny_target_dir), chat_template="{% for m in messages %}{{ m['role'] }}: "
                                                             "{{ m['content'] }}\n{% endfor %}")
    with pytest.raises(SynthesizeError, match="writes no special token after a user message"):
        user_turn_stops(tok, "plain.jinja")
    assert user_turn_stops(load_tokenizer(str(tiny_target_dir)), "x") == [tok.convert_tokens_to_ids("<|im_end|>")]


def test_near_duplicates_are_removed_in_order():
    d = Deduper(threshold=0.6)
    story = "Write a short story about a lighthouse keeper who finds a message in a bottle on a stormy winter night."
    assert d.admit("a", story) is None
    assert d.admit("b", "  " + story.upper().replace(" ", "   ")) == "exact_duplicate"
    assert d.admit("c", story.replace("stormy", "windy")) == "near_duplicate"  # one word of twenty changed
    assert d.admit("d", story.replace("lighthouse keeper", "baker")) == "near_duplicate"
    assert d.admit("e", "Write a short story about a dragon that is afraid of the dark and learns to love stars.") is None
    assert d.admit("f", "What is the derivative of x squared times the sine of x?") is None
    assert d.admit("g", "What is 12 times 7?") is None and d.admit("h", "what is 12  times 7?") == "exact_duplicate"
    assert d.admit("h", "What is 12 times 8?") is None  # another problem, not a near duplicate
    # only what was admitted is remembered: a duplicate of a dropped text is judged against the kept one
    assert d.admit("i", story.replace("stormy", "windy").replace("winter", "summer")) == "near_duplicate"


def test_copy_prompts_wrap_documents(tiny_target_dir, chatty, tmp_path):
    tok = chatty.tokenizer
    doc = " ".join(f"Sentence {i} says that the river near the old mill floods every spring." for i in range(400))
    p = copy_prompt("summarize", "Summarize the following text.\n\n{document}", doc, tok, 300)
    assert p.startswith("Summarize the following text.\n\nSentence 0 says")
    assert len(tok(p, add_special_tokens=False)["input_ids"]) <= 300
    body = p.split("\n\n", 1)[1]
    assert doc.startswith(body) and doc[len(body)] == " "  # cut between words
    code = "\n".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(10))
    p = copy_prompt("continue_code", "Continue this code:\n\n```\n{document}\n```", code, tok, 1000)
    shown = p.split("```\n", 1)[1].rsplit("\n```", 1)[0]
    assert code.startswith(shown) and code[len(shown)] == "\n" and 0.4 < len(shown) / len(code) < 0.8

    # every prompt wraps one of the user's documents (each used once while there are enough)
    docs = [f"Report {i}: the council of town number {i} met on Monday to discuss the new bridge, the budget "
            f"of {i * 1000} euros and the opening of a library in the spring." for i in range(12)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    r = _recipe(tmp_path, tiny_target_dir, "data.synthesize.copy_tasks.fraction=1",
                "data.synthesize.copy_tasks.tasks=[summarize,translate]",
                f"data.synthesize.copy_tasks.documents={tmp_path / 'docs.jsonl'}")
    s = run_synthesize(r, target=chatty)
    rows = [json.loads(x) for x in _lines(RunDir(r).synthesized)]
    assert s["written"] == 6 and s["copy_heavy"] == 6 and s["generated_tokens"] == 0
    used = [next(i for i, t in enumerate(docs) if t in row["turns"][0]) for row in rows]
    assert len(set(used)) == 6 and {row["category"] for row in rows} <= {"summarize", "translate"}


def test_categories_steer_the_mix_and_bad_seeds_are_named(tiny_target_dir, tmp_path):
    r = _recipe(tmp_path, tiny_target_dir, "data.synthesize.copy_tasks.fraction=0",
                "data.synthesize.categories={chat: {weight: 0}, reasoning: {weight: 0}, code: {weight: 0}, "
                "writing: {weight: 0}, qa: {weight: 0}, roleplay: {weight: 0}, hypothetical: {weight: 0}, estimate: {weight: 0}, "
                "knowledge: {weight: 0}, advice: {weight: 0}, cooking: {weight: 1, openers: ['Give me a recipe for {topic}'], "
                "topics: [soup], systems: ['You are a chef.']}, math: {weight: 1}}")
    cfg = r.data.synthesize
    seeds = load_seeds(cfg)
    plans = [plan_item(i, 0, seeds, cfg, None) for i in range(60)]
    assert {p.category for p in plans} == {"cooking", "math"}
    cooking = [p for p in plans if p.category == "cooking"]
    assert all(p.opener == "Give me a recipe for soup" and p.system == "You are a chef." for p in cooking)
    assert [plan_item(i, 0, seeds, cfg, None).opener for i in range(60)] == [p.opener for p in plans]

    with pytest.raises(RecipeError, match="did you mean 'data.synthesize.categories.code.weight'"):
        _recipe(tmp_path, tiny_target_dir, "data.synthesize.categories.code.weigth=2")
    bad = _recipe(tmp_path, tiny_target_dir, "data.synthesize.categories={poems: {openers: ['Write a poem']}}")
    with pytest.raises(SynthesizeError, match="category 'poems' .* has no weight"):
        load_seeds(bad.data.synthesize)
    bad = _recipe(tmp_path, tiny_target_dir, "data.synthesize.categories={chat: {openers: ['About {topic}'], topics: []}}")
    with pytest.raises(SynthesizeError, match="category 'chat' .* no topics"):
        load_seeds(bad.data.synthesize)


def test_builtin_topic_openers_leave_their_sentence_open():
    """An opener that names a topic and ends its sentence ("Explain {topic} in simple terms.") came back
    verbatim from SmolLM2 in 85-97% of its uses (100k prompts on the H200, 2026-12-01): the target ends a
    user message where a whole question stands, and every such prompt after the first is a duplicate.
    The built-in seeds' topic openers leave the sentence for the target to finish."""
    from specheads.config import SynthesizeConfig

    seeds = load_seeds(SynthesizeConfig())
    closed = [(c.name, o) for c in seeds.categories for o in c.openers
              if "{topic}" in o and o.rstrip().endswith((".", "?", "!"))]
    assert closed == []


@pytest.mark.slow
def test_smollm2_writes_prompts(smollm2, tmp_path):
    r = load_recipe(None, [f"run_dir={tmp_path}", "data.synthesize.num_prompts=8", "data.synthesize.batch_size=8",
                           "data.synthesize.max_new_tokens=48", "data.synthesize.copy_tasks.document_tokens=64"])
    s = run_synthesize(r, target=smollm2)
    rows = load_prompts(RunDir(r).synthesized)
    assert s["written"] == len(rows) == 8 and all(row["category"] for row in rows)
    texts = [" ".join(row["turns"][0].lower().split()) for row in rows]
    assert all(len(t) >= 12 for t in texts) and len(set(texts)) == 8
    assert sum(c["written"] for c in s["per_category"].values()) == 8
    assert 0.0 <= s["near_duplicate_rate"] < 0.5 and s["generated_tokens"] > 0
