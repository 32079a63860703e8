"""specheads eval and data regenerate on a tiny random target with SmolLM2's tokenizer."""
import json
import random

import pytest

from specheads.cli import build_parser, eval_recipe, main
from specheads.config import RecipeError
from specheads.evaluate.lossless import chi_square_two_sample
from specheads.evaluate.stage import EvalError, plan_runs, run_eval
from specheads.formats import ExportError
from specheads.rundir import RunDir


def _recipe(tmp_path, *flags):
    args = build_parser().parse_args(["eval", "--target", "smollm2-135m", "--prompts", "builtin:demo_prompts",
                                      "--out", str(tmp_path), *flags])
    return eval_recipe(args)


def test_chi_square_two_sample_tells_apart():
    rng = random.Random(0)
    a = [[rng.choice([1, 2, 3, 4])] for _ in range(2000)]
    b = [[rng.choice([1, 2, 3, 4])] for _ in range(2000)]
    c = [[rng.choice([1, 1, 2, 3, 4])] for _ in range(2000)]
    assert chi_square_two_sample(a, b, 1)[0] > 0.01
    assert chi_square_two_sample(a, c, 1)[0] < 1e-6


def test_eval_report_end_to_end(tiny_target_dir, tmp_path):
    out = tmp_path / "ev"
    rc = main(["eval", "--target", str(tiny_target_dir), "--prompts", "builtin:demo_prompts", "--compare", "ngram",
               "--k", "2", "--k", "4", "--limit", "3", "--max-new-tokens", "12", "--batch-size", "2", "--out", str(out)])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert [r["name"] for r in rep["runs"]] == ["ngram k=2 greedy", "ngram k=4 greedy"]
    for r in rep["runs"]:
        assert r["lossless"]["identical"] == r["lossless"]["total"] == 3
        m = r["metrics"]
        assert m["tau"] >= 1.0 and 1 <= len(m["alpha"]) <= r["k"]
    md = (out / "report.md").read_text()
    assert "| ngram k=4 greedy |" in md and "α_1" in md
    assert {p.name for p in out.glob("*.png")} >= {"acceptance_length.png", "alpha_by_position.png"}


def test_eval_sampling_chi_square(tiny_target_dir, tmp_path):
    args = build_parser().parse_args([
        "eval", "--target", str(tiny_target_dir), "--prompts", "builtin:demo_prompts", "--out", str(tmp_path / "ev"),
        "--compare", "ngram", "--k", "2", "--rule", "onehot", "--limit", "1", "--temperature", "1.0",
        "--max-new-tokens", "6", "--chi-square-draws", "200"])
    rep = run_eval(eval_recipe(args))
    assert [r["name"] for r in rep["runs"]] == ["ngram k=2 onehot"]
    ll = rep["runs"][0]["lossless"]
    assert ll["kind"] == "chi_square" and ll["p_values"] and ll["passed"], ll


@pytest.mark.parametrize("flags,msg", [
    (["--compare", "ngram", "--rule", "rejection"], "rule='rejection' samples: it needs eval.temperature > 0"),
    (["--compare", "ngram", "--rule", "greedy", "--temperature", "0.7"], "rule='greedy' is for temperature 0"),
    (["--compare", "ngram", "--k", "40"], "k=40 out of range"),
    (["--compare", "ngram", "--tree", "4,4"], "expected depth,topk,tokens"),
])
def test_eval_bad_flags_are_recipe_errors(flags, msg, tmp_path):
    with pytest.raises(RecipeError, match=msg):
        _recipe(tmp_path, *flags)


def test_eval_bad_plan(tmp_path, capsys):
    with pytest.raises(EvalError, match="head directory not found: /nonexistent/head"):
        plan_runs(_recipe(tmp_path, "--head", "/nonexistent/head"))
    with pytest.raises(EvalError, match="nothing to compare"):
        plan_runs(_recipe(tmp_path))
    with pytest.raises(EvalError, match="tree depth and topk must be >= 1"):
        plan_runs(_recipe(tmp_path, "--compare", "ngram", "--tree", "0,4,16"))
    # flags and the CLI: one line, exit 2 for a recipe error, before anything loads
    assert main(["eval", "--target", "smollm2-135m", "--prompts", "x.jsonl"]) == 2
    assert "eval without a recipe needs --out" in capsys.readouterr().err


def test_eval_flags_become_recipe_keys(tmp_path):
    r = _recipe(tmp_path, "--head", "a", "--head", "b", "--k", "2", "--k", "5", "--rule", "greedy", "--limit", "7",
                "--compare", "ngram", "--max-new-tokens", "9")
    e = r.eval
    assert (e.head, e.k, e.rule, e.limit, e.compare, e.max_new_tokens) == (["a", "b"], [2, 5], ["greedy"], 7, ["ngram"], 9)
    assert r.target.source == "smollm2-135m" and RunDir(r).eval == tmp_path and e.split == "all"


def _export_random_head(d, hidden: int, target_hidden: int):
    """An EAGLE-3 head with random weights in the speculators layout (SmolLM2's vocabulary)."""
    import torch

    from specheads.formats import speculators
    from specheads.formats.common import ExportMeta
    from specheads.heads.config import HeadConfig
    from specheads.heads.eagle3 import Eagle3Head

    cfg = HeadConfig(kind="eagle3", hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=hidden // 16,
                     num_key_value_heads=max(1, hidden // 32), head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=2048, target_hidden_size=target_hidden, target_vocab_size=49152,
                     draft_vocab_size=49152, aux_layer_ids=[1, 2, 3])
    head = Eagle3Head(cfg)
    torch.nn.init.normal_(head.embed_tokens.weight)
    speculators.save(head, ExportMeta(verifier_name_or_path="x", aux_layer_ids=[1, 2, 3]), d, dtype=torch.float32)
    return d


def test_eval_refuses_head_for_another_target(tiny_target_dir, tmp_path):
    _export_random_head(tmp_path / "h", hidden=32, target_hidden=48)
    args = build_parser().parse_args([
        "eval", "--target", str(tiny_target_dir), "--prompts", "builtin:demo_prompts", "--out", str(tmp_path / "ev"),
        "--head", str(tmp_path / "h"), "--limit", "1", "--max-new-tokens", "4"])
    with pytest.raises(ExportError, match="target hidden size 48, target has 64"):
        run_eval(eval_recipe(args))


def test_eval_hybrid_runs_beside_the_head(tiny_target_dir, tmp_path):
    """--compare hybrid puts each head with n-gram drafts beside the head alone; greedy stays lossless."""
    _export_random_head(tmp_path / "h", hidden=64, target_hidden=64)
    with pytest.raises(EvalError, match="compare=hybrid needs a head"):
        plan_runs(_recipe(tmp_path, "--compare", "hybrid"))
    args = build_parser().parse_args([
        "eval", "--target", str(tiny_target_dir), "--prompts", "builtin:demo_prompts", "--out", str(tmp_path / "ev"),
        "--head", str(tmp_path / "h"), "--compare", "hybrid", "--compare", "ngram", "--compare", "hybrid_fixed",
        "--limit", "2", "--max-new-tokens", "12"])
    rep = run_eval(eval_recipe(args))
    names = [r["name"] for r in rep["runs"]]
    assert names == ["head k=3 greedy", "ngram k=3 greedy", "hybrid head k=3 greedy", "hybrid_fixed head k=3 greedy"]
    hybrid, fixed = rep["runs"][2], rep["runs"][3]
    assert hybrid["drafter"].startswith("hybrid: ") and hybrid["lossless"]["identical"] == hybrid["lossless"]["total"] == 2
    assert fixed["drafter"].startswith("hybrid (fixed rule): ") and fixed["lossless"]["identical"] == 2


def test_eval_names_every_missing_input_at_once(tmp_path):
    with pytest.raises(EvalError) as err:
        plan_runs(_recipe(tmp_path, "--head", str(tmp_path / "h1"), "--head", str(tmp_path / "h2"),
                          "--prompts", str(tmp_path / "prompts.jsonl")))
    msg = str(err.value)
    for missing in ("h1", "h2", "prompts.jsonl"):
        assert f"{tmp_path / missing}" in msg, msg


def test_eval_dry_run_refuses_a_run_directory_as_target(tmp_path, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "train" / "final").mkdir(parents=True)
    assert main(["eval", "--target", str(run_dir), "--prompts", "builtin:demo_prompts", "--out", str(tmp_path / "ev"),
                 "--compare", "ngram", "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert f"{run_dir} is not a model directory (no config.json)" in err and "run directory" in err
    # a target that exists passes the same dry run, with a head that the plan's export stage would write later
    assert main(["eval", "--target", "smollm2-135m", "--prompts", "builtin:demo_prompts", "--out", str(tmp_path / "ev"),
                 "--head", str(tmp_path / "later"), "--dry-run"]) == 0
