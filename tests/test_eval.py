"""specheads eval and data regenerate on a tiny random target with SmolLM2's tokenizer."""
import json
import random
import types

import pytest

from specheads.cli import main
from specheads.runtime.eval import EvalError, EvalSettings, RunSpec, chi_square_two_sample, run_eval, validate_settings


def _args(**kw):
    base = dict(recipe=None, overrides=[], target=None, head=None, prompts=None, k=None, tree=None, temperature=None,
                rule=None, compare=None, engine="specheads", thresholds=None, chi_square_draws=None, batch_size=None,
                limit=None, max_new_tokens=None, out=None, dry_run=False)
    base.update(kw)
    return types.SimpleNamespace(**base)


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
    s = EvalSettings(target=str(tiny_target_dir), prompts="builtin:demo_prompts", out=tmp_path / "ev",
                     runs=[RunSpec("ngram onehot", "ngram", k=2, rule="onehot")], limit=1, temperature=1.0,
                     max_new_tokens=6, chi_square_draws=200)
    rep = run_eval(s)
    ll = rep["runs"][0]["lossless"]
    assert ll["kind"] == "chi_square" and ll["p_values"] and ll["passed"], ll


@pytest.mark.parametrize("kw,msg", [
    (dict(rule=["rejection"]), "needs --temperature > 0"),
    (dict(rule=["greedy"], temperature=0.7), "rule 'greedy' is for temperature 0"),
    (dict(k=[40]), "k=40 out of range"),
    (dict(tree="4,4"), "expected depth,topk,tokens"),
    (dict(head=["/nonexistent/head"]), "head directory not found"),
])
def test_eval_bad_input(kw, msg, tmp_path):
    from specheads.runtime.eval import settings_from_args

    args = _args(target="smollm2-135m", prompts="builtin:demo_prompts", out=str(tmp_path), compare=["ngram"], **kw)
    with pytest.raises(EvalError, match=msg):
        settings_from_args(args)


def test_eval_refuses_head_for_another_target(tiny_target_dir, tmp_path):
    import torch

    from specheads.export.common import ExportMeta
    from specheads.export import speculators
    from specheads.heads.config import HeadConfig
    from specheads.heads.eagle3 import Eagle3Head

    cfg = HeadConfig(kind="eagle3", hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                     head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
                     target_hidden_size=48, target_vocab_size=49152, draft_vocab_size=49152, aux_layer_ids=[1, 2, 3])
    head = Eagle3Head(cfg)
    torch.nn.init.normal_(head.embed_tokens.weight)
    speculators.save(head, ExportMeta(verifier_name_or_path="x", aux_layer_ids=[1, 2, 3]), tmp_path / "h",
                     dtype=torch.float32)
    s = EvalSettings(target=str(tiny_target_dir), prompts="builtin:demo_prompts", out=tmp_path / "ev",
                     runs=[RunSpec("h", str(tmp_path / "h"))], limit=1, max_new_tokens=4)
    validate_settings(s)
    with pytest.raises(EvalError, match="target hidden size 48, target has 64"):
        run_eval(s)
