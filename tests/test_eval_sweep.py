"""`specheads eval --sweep`: every drafter at every k and concurrency under continuous batching, and the
configuration to serve with (tiny random target and heads, CPU)."""
import hashlib
import json
from pathlib import Path

import pytest

from specheads.cli import build_parser, eval_recipe, main
from specheads.config import RecipeError, load_recipe
from specheads.evaluate.stage import _update_model_cards, plan_runs, plan_sweep, run_eval
from specheads.evaluate.sweep import recommend
from specheads.evaluate.vllm_compare import speculative_config_for
from specheads.formats import card


def _recipe(tmp_path, *flags, target="smollm2-135m"):
    args = build_parser().parse_args(["eval", "--target", str(target), "--prompts", "builtin:demo_prompts",
                                      "--out", str(tmp_path / "ev"), *flags])
    return eval_recipe(args)


def _digest(d: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


def _save_head(d, kind: str):
    """A random head for the tiny target (hidden 64, SmolLM2's vocabulary) in the speculators layout."""
    import torch

    from specheads.formats import speculators
    from specheads.formats.common import ExportMeta
    from specheads.heads import HeadConfig, build_head

    extra = {"num_depths": 3, "mask_token_id": 0, "num_layers": 1} if kind == "peagle" else {}
    cfg = HeadConfig(kind=kind, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
                     target_hidden_size=64, target_vocab_size=49152, draft_vocab_size=49152, aux_layer_ids=[1, 2, 3],
                     **extra)
    torch.manual_seed(0)
    head = build_head(cfg)
    torch.nn.init.normal_(head.embed_tokens.weight)
    meta = ExportMeta(verifier_name_or_path="org/tiny-target", aux_layer_ids=[1, 2, 3], speculative_tokens=3)
    speculators.save(head, meta, d, dtype=torch.float32)
    return d


# --- the recipe keys and the flag ------------------------------------------------------------------------------


@pytest.mark.parametrize("flags,msg", [
    (["--sweep-k", "0", "--sweep-k", "2"], "eval.sweep.k.0: Input should be greater than or equal to 1"),
    (["--sweep-k", "17"], "eval.sweep.k.0: Input should be less than or equal to 16"),
    (["--sweep-k", "2", "--sweep-k", "2"], "names a value twice"),
    (["--concurrency", "0"], "eval.sweep.concurrency.0: Input should be greater than or equal to 1"),
    (["--concurrency", "2048"], "eval.sweep.concurrency.0: Input should be less than or equal to 1024"),
])
def test_sweep_bounds_are_refused(tmp_path, flags, msg):
    with pytest.raises(RecipeError, match=msg):
        _recipe(tmp_path, "--compare", "ngram", *flags)


@pytest.mark.parametrize("sweep,msg", [
    ({"k": []}, "eval.sweep.k: List should have at least 1 item"),
    ({"concurrency": [1, 8, 8]}, "names a value twice"),
    ({"trees": ["4,4,16"]}, "unknown recipe key 'eval.sweep.trees'"),
])
def test_sweep_recipe_keys_are_checked(tmp_path, sweep, msg):
    (tmp_path / "r.yaml").write_text(json.dumps({"eval": {"compare": ["ngram"], "sweep": sweep}}))
    with pytest.raises(RecipeError, match=msg):
        load_recipe(tmp_path / "r.yaml")


def test_sweep_flag_and_defaults(tmp_path, capsys):
    r = _recipe(tmp_path, "--compare", "ngram", "--sweep", "--sweep-k", "4", "--concurrency", "8", "--concurrency", "1")
    s = r.eval.sweep
    assert (s.enabled, s.k, s.concurrency) == (True, [4], [1, 8])
    (tmp_path / "r.yaml").write_text("eval: {sweep: {enabled: true, k: 5}}\n")
    assert load_recipe(tmp_path / "r.yaml", ["eval.sweep.concurrency=2"]).eval.sweep.model_dump() == {
        "enabled": True, "k": [5], "concurrency": [2], "repeat": 1}
    assert _recipe(tmp_path, "--compare", "ngram", "--sweep", "--sweep-repeat", "3").eval.sweep.repeat == 3
    for off in (["--concurrency", "8"], ["--sweep-repeat", "2"]):
        with pytest.raises(RecipeError, match="the sweep is off: add --sweep"):
            _recipe(tmp_path, "--compare", "ngram", *off)
    d = _recipe(tmp_path, "--compare", "ngram").eval.sweep
    assert (d.enabled, d.k, d.concurrency) == (False, [1, 2, 3, 4, 5, 6], [1, 8, 32])
    with pytest.raises(RecipeError, match="eval.sweep measures greedy decoding"):
        _recipe(tmp_path, "--compare", "ngram", "--sweep", "--rule", "onehot", "--temperature", "0.7")
    # the plan names what is swept, and hybrids and trees are left out with a reason
    cands, notes = plan_sweep(_recipe(tmp_path, "--compare", "ngram", "--compare", "suffix", "--compare", "hybrid",
                                      "--head", str(tmp_path), "--sweep", "--tree", "2,2,4"))
    assert [(c.label, c.drafter) for c in cands] == [("head", str(tmp_path)), ("n-gram (vLLM's rule)", "ngram"),
                                                     ("suffix decoding", "suffix")]
    assert any("hybrid: not swept" in n for n in notes) and any("eval.tree 2,2,4: not swept" in n for n in notes)
    assert main(["eval", "--target", "smollm2-135m", "--prompts", "builtin:demo_prompts", "--out", str(tmp_path),
                 "--compare", "ngram", "--sweep", "--dry-run"]) == 0
    assert "sweep: serve with continuous batching at concurrency [1, 8, 32]" in capsys.readouterr().out


# --- the recommendation ----------------------------------------------------------------------------------------


def _pt(drafter, k, C, speedup):
    return {"drafter": drafter, "k": k, "concurrency": C, "speedup": speedup, "tau": 1.5, "head": None,
            "in_flight": C, "tokens_per_s": 100 * speedup, "lossless": {"kind": "greedy", "identical": 1, "total": 1},
            "serving": {"vllm_flag": f"{drafter}{k}"}}


def test_recommend_is_the_best_point_ties_to_smaller_k():
    plain = [{"concurrency": 1, "in_flight": 1, "tokens_per_s": 100.0},
             {"concurrency": 8, "in_flight": 8, "tokens_per_s": 500.0},
             {"concurrency": 32, "in_flight": 32, "tokens_per_s": 900.0}]
    points = [_pt("head", 4, 1, 1.804), _pt("head", 2, 1, 1.801), _pt("head", 6, 1, 1.7), _pt("ngram", 1, 1, 1.2),
              _pt("head", 3, 8, 1.31), _pt("ngram", 2, 8, 1.42), _pt("head", 1, 32, 0.93), _pt("ngram", 1, 32, 1.004)]
    recs = recommend(points, plain, {"vllm_flag": None})
    assert [(r["concurrency"], r["drafter"], r["k"]) for r in recs] == [
        (1, "head", 2),                       # 1.80 either way (as the report shows it): the smaller k
        (8, "ngram", 2),
        (32, "plain (no drafting)", 0)]       # 1.00 against plain's 1.00: plain, nothing to gain by drafting
    assert recs[0]["serving"] == {"vllm_flag": "head2"} and recs[2]["plain_tokens_per_s"] == 900.0


# --- end to end --------------------------------------------------------------------------------------------------


def test_sweep_end_to_end(tiny_target_dir, tmp_path):
    """Head, n-gram and suffix decoding at two k and two concurrencies: every point lossless, the recommendation
    the best point, its commands exactly the card builders', the plot written, the head left byte-identical; with
    --update-card the card carries the recommendation."""
    head = _save_head(tmp_path / "h", "eagle3")
    before = _digest(head)
    out = tmp_path / "ev"
    rc = main(["eval", "--target", str(tiny_target_dir), "--prompts", "builtin:demo_prompts", "--head", str(head),
               "--compare", "ngram", "--compare", "suffix", "--limit", "3", "--max-new-tokens", "8", "--out", str(out),
               "--sweep", "--sweep-k", "1", "--sweep-k", "3", "--concurrency", "1", "--concurrency", "2"])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    sw = rep["sweep"]
    assert [(p["concurrency"], p["drafter"], p["k"]) for p in sw["points"]] == [
        (C, d, k) for C in (1, 2) for d in ("head", "n-gram (vLLM's rule)", "suffix decoding") for k in (1, 3)]
    for p in sw["points"]:
        assert p["lossless"]["identical"] == p["lossless"]["total"] == 3, p
        assert p["tau"] >= 1.0 and p["speedup"] > 0 and p["in_flight"] == p["concurrency"]
    for r in sw["recommendation"]:
        here = [p for p in sw["points"] if p["concurrency"] == r["concurrency"]]
        best = max([1.0] + [round(p["speedup"], 2) for p in here])
        assert round(r["speedup"], 2) == best
        assert r["k"] == min([0] * (best == 1.0) + [p["k"] for p in here if round(p["speedup"], 2) == best])
    # the commands are the card builders', point by point
    d = card.head_path_for_card(head)
    for p in sw["points"]:
        sv = p["serving"]
        if p["drafter"] == "head":
            assert sv["vllm_speculative_config"] == card.vllm_speculative_config(d, p["k"], "speculators", "eagle3")
            assert sv["sglang_flags"] == card.sglang_flags(d, p["k"], "speculators", "eagle3")
            assert sv["vllm"] == card.launch_lines(sw["target"], d, p["k"], "speculators", "eagle3")["vllm"]
        else:
            kind = "ngram" if p["drafter"].startswith("n-gram") else "suffix"
            assert sv["vllm_speculative_config"] == speculative_config_for(kind, p["k"])[0]
            assert sv["sglang_flags"] is None and sv["sglang_note"]
        assert sv["vllm_flag"] == card.speculative_config_flag(sv["vllm_speculative_config"])
    assert sw["points"][2]["serving"]["vllm_speculative_config"] == {
        "method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    assert sw["points"][5]["serving"]["vllm_speculative_config"]["method"] == "suffix"
    md = (out / "report.md").read_text()
    assert "## Serving sweep (continuous batching)" in md and "### Recommended serving configuration" in md
    assert "| 2 | head | 3 |" in md and (out / "sweep_speedup.png").is_file()
    assert _digest(head) == before                      # without --update-card the head is untouched
    assert not (out / "sweep_partial.json").exists()    # the finished report holds the whole sweep

    _update_model_cards(plan_runs(_recipe(tmp_path, "--head", str(head), target=tiny_target_dir)),
                        str(out / "report.json"))
    text = (head / "README.md").read_text()
    assert "## Recommended serving configuration" in text
    for b in (b for b in sw["best"] if b["drafter"] == "head"):
        lines = card.launch_lines("org/tiny-target", d, b["k"], "speculators", "eagle3")
        assert lines["vllm"] in text and lines["sglang"] in text
        assert f"| {b['concurrency']} | {b['k']} | {b['tau']:.2f} | {b['speedup']:.2f}× |" in text


def test_sweep_repeat_times_each_point_several_times_and_keeps_tau(tiny_target_dir, tmp_path):
    """--sweep-repeat 3: every point (plain included) is timed three times, its rate their median and each pass's
    rate kept; τ and the outputs are those of one pass (suffix decoding forgets the earlier passes' answers, so its
    τ equals a one-pass sweep's), and the report names the passes and their spread."""
    head = _save_head(tmp_path / "h", "eagle3")
    args = ["eval", "--target", str(tiny_target_dir), "--prompts", "builtin:demo_prompts", "--head", str(head),
            "--compare", "suffix", "--limit", "3", "--max-new-tokens", "8", "--sweep", "--sweep-k", "2",
            "--concurrency", "2"]
    assert main(args + ["--out", str(tmp_path / "one")]) == 0
    assert main(args + ["--out", str(tmp_path / "three"), "--sweep-repeat", "3"]) == 0
    one, three = (json.loads((tmp_path / d / "report.json").read_text())["sweep"] for d in ("one", "three"))
    assert three["repeat"] == 3 and one["repeat"] == 1
    for p in three["plain"] + three["points"]:
        passes = p["tokens_per_s_passes"]
        assert len(passes) == 3 and passes == sorted(passes)
        assert p["tokens_per_s"] == pytest.approx(passes[1])          # the median of three
    assert [p["tau"] for p in three["points"]] == [p["tau"] for p in one["points"]]
    assert all(p["tau_passes"] == [p["tau"]] * 3 for p in three["points"])      # no pass drafts from another's answers
    assert all(p["lossless"]["identical"] == p["lossless"]["total"] == 3 for p in three["points"])
    md = (tmp_path / "three" / "report.md").read_text()
    assert "the median of 3 timed passes after an untimed one (slowest–fastest in brackets)" in md
    fast = three["points"][0]["tokens_per_s_passes"]
    assert f"({fast[0]:.1f}–{fast[-1]:.1f})" in md
    assert "one timed pass after an untimed one" in (tmp_path / "one" / "report.md").read_text()


def test_a_sweep_cut_short_keeps_the_eval_and_the_points_measured(tiny_target_dir, tmp_path, monkeypatch):
    """The eval's own report is published before the sweep starts, and each sweep point goes to sweep_partial.json
    as it is measured: a sweep stopped after its second point (a time limit, a lost machine) leaves both."""
    import specheads.evaluate.stage as stage

    real, calls = stage.write_json_atomic, []

    def write_then_stop(path, doc, **kw):
        real(path, doc, **kw)
        calls.append(Path(path).name)
        if len(calls) == 3:                             # plain at concurrency 1, then two points
            raise KeyboardInterrupt

    monkeypatch.setattr(stage, "write_json_atomic", write_then_stop)
    out = tmp_path / "ev"
    with pytest.raises(KeyboardInterrupt):
        main(["eval", "--target", str(tiny_target_dir), "--prompts", "builtin:demo_prompts", "--compare", "ngram",
              "--compare", "suffix", "--limit", "2", "--max-new-tokens", "4", "--out", str(out), "--sweep",
              "--sweep-k", "2", "--concurrency", "1", "--concurrency", "2"])
    assert calls == ["sweep_partial.json"] * 3
    rep = json.loads((out / "report.json").read_text())
    assert "sweep" not in rep and [r["name"] for r in rep["runs"]] == ["ngram k=3 greedy", "suffix k=3 greedy"]
    part = json.loads((out / "sweep_partial.json").read_text())
    assert part["complete"] is False and [p["concurrency"] for p in part["plain"]] == [1]
    assert [(p["drafter"], p["k"]) for p in part["points"]] == [("n-gram (vLLM's rule)", 2), ("suffix decoding", 2)]
    assert part["created"] == rep["created"] and part["settings"] == rep["settings"]
    # the next eval into the same folder, without a sweep: the cut sweep's points are not this report's
    monkeypatch.setattr(stage, "write_json_atomic", real)
    assert main(["eval", "--target", str(tiny_target_dir), "--prompts", "builtin:demo_prompts", "--limit", "2",
                 "--max-new-tokens", "4", "--compare", "ngram", "--out", str(out)]) == 0
    assert not (out / "sweep_partial.json").exists() and (out / "report.json").is_file()


def test_parallel_head_sweeps_only_its_own_k(tiny_target_dir, tmp_path):
    """A P-EAGLE head runs at the k one forward drafts only; --update-card puts its recommendation in its card."""
    head = _save_head(tmp_path / "p", "peagle")
    rep = run_eval(_recipe(tmp_path, "--head", str(head), "--limit", "2", "--max-new-tokens", "6", "--sweep",
                           "--sweep-k", "1", "--sweep-k", "5", "--concurrency", "2", "--update-card",
                           target=tiny_target_dir))
    sw = rep["sweep"]
    assert [(p["drafter"], p["k"]) for p in sw["points"]] == [("head", 3)]     # num_depths = 3; not 1, 2 or 5
    p = sw["points"][0]
    assert p["lossless"]["identical"] == p["lossless"]["total"] == 2
    assert p["serving"]["vllm_speculative_config"] == {"method": "eagle3", "model": card.head_path_for_card(head),
                                                       "num_speculative_tokens": 3, "parallel_drafting": True}
    assert p["serving"]["sglang_flags"] is None and "no reader for a peagle head" in p["serving"]["sglang_note"]
    assert any("swept at k=3 only" in n for n in sw["notes"])
    text = (head / "README.md").read_text()
    lines = card.launch_lines("org/tiny-target", card.head_path_for_card(head), 3, "speculators", "peagle")
    assert "## Recommended serving configuration" in text and f"| 2 | 3 | {p['tau']:.2f} |" in text
    assert lines["vllm"] in text and lines["sglang"] is None and "SGLang has no reader for a peagle head" in text
