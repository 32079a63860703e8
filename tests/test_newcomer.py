"""What got in a new user's way (stale data, slow failures, wrong README, noise, help, cards): one test each."""
from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import yaml

from specheads.cli import build_parser, main, train_summary
from specheads.config import load_recipe
from specheads.rundir import RunDir, StaleInputError, stage_inputs

ROOT = Path(__file__).resolve().parent.parent


def _no_weights(monkeypatch):
    """Any attempt to load target weights fails the test."""
    import specheads.target as target

    def refuse(*a, **k):
        pytest.fail("weights were loaded")

    monkeypatch.setattr(target, "load_target", refuse)
    monkeypatch.setattr(target, "_load_tokenizer_and_model", refuse)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def convs(tmp_path) -> Path:
    return _jsonl(tmp_path / "convs.jsonl", [
        {"id": f"c{i}", "messages": [{"role": "user", "content": f"What is {i}+{i}?"},
                                     {"role": "assistant", "content": f"It is {2 * i}."}]} for i in range(12)])


# ---------------------------------------------------------------- stale data, refused before any weights load
def test_prepare_refuses_regenerated_data_of_other_sources(tmp_path, convs, monkeypatch, capsys):
    old = load_recipe(None, [f"run_dir={tmp_path}", "data.regenerate.enabled=true",
                             f"data.sources=[{{path: {convs}}}]"])
    out = RunDir(old).regenerated
    out.parent.mkdir(parents=True)
    _jsonl(out, [{"id": "c0", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}])
    out.with_name(out.name + ".meta.json").write_text(json.dumps({"recipe_inputs": stage_inputs(old, "regenerate")}))
    other = _jsonl(tmp_path / "other.jsonl", [{"prompt": "Say hello."}])
    _no_weights(monkeypatch)
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(f"run_dir: {tmp_path}\ndata:\n  regenerate: {{enabled: true}}\n  sources: [{{path: {other}}}]\n")
    rc = main(["data", "prepare", str(recipe_file)])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("specheads: StaleInputError:") and err.count("\n") == 1
    assert "regenerated.jsonl was made with data.sources=" in err and "specheads data regenerate" in err


def test_vocab_dump_and_train_refuse_rows_of_other_settings(tmp_path, convs, monkeypatch, smollm2_tokenizer):
    from specheads.data.prepare import prepare_rows
    from specheads.data.stage import run_vocab
    from specheads.dump.writer import run_dump
    from specheads.train import run_train

    made = load_recipe(None, [f"run_dir={tmp_path}", f"data.sources=[{{path: {convs}}}]", "data.max_length=64"])
    prepare_rows([{"path": str(convs)}], smollm2_tokenizer, 64, RunDir(made).rows,
                 extra={"target_vocab_size": 49152, "recipe_inputs": stage_inputs(made, "prepare")})
    changed = load_recipe(None, [f"run_dir={tmp_path}", f"data.sources=[{{path: {convs}}}]", "data.max_length=128"])
    _no_weights(monkeypatch)
    for stage in (run_vocab, run_dump):
        with pytest.raises(StaleInputError, match=r"was made with data.max_length=64, this recipe has data.max_length=128"):
            stage(changed)
    online = changed.model_copy(update={"dump": changed.dump.model_copy(update={"mode": "online"})})
    with pytest.raises(StaleInputError, match="data.max_length"):
        run_train(online, progress=False)
    assert run_vocab(made)["coverage"] == 1.0  # the recipe that made them still reads them


# ---------------------------------------------------------------- fail fast, load only what a stage needs
def test_missing_inputs_fail_before_weights(tmp_path, monkeypatch, capsys):
    _no_weights(monkeypatch)
    expected = {("data", "prepare", "data.regenerate.enabled=false"): "data file not found: /nonexistent/data.jsonl",
                ("data", "prepare", "data.regenerate.enabled=true"): "regenerated.jsonl not found: run `specheads data "
                                                                      "regenerate` first",
                ("data", "regenerate", "seed=0"): "data file not found: /nonexistent/data.jsonl",
                ("dump", "seed=0"): "no token rows at"}
    for (*cmd, override), msg in expected.items():
        rc = main([*cmd, str(ROOT / "recipes" / "smollm2_eagle3.yaml"), f"run_dir={tmp_path}", override,
                   "data.sources=[{path: /nonexistent/data.jsonl}]"])
        err = capsys.readouterr().err
        assert rc == 1 and err.count("\n") == 1 and msg in err, (cmd, err)
    rc = main(["train", str(ROOT / "recipes" / "smollm2_eagle3.yaml"), f"run_dir={tmp_path}"])
    assert rc == 1 and "no dump at" in capsys.readouterr().err


def test_prepare_loads_only_the_tokenizer(tmp_path, convs, monkeypatch):
    from specheads.data.stage import run_prepare

    _no_weights(monkeypatch)
    recipe = load_recipe(None, [f"run_dir={tmp_path}", f"data.sources=[{{path: {convs}}}]", "data.max_length=64",
                                "data.holdout_fraction=0"])
    summary = run_prepare(recipe)
    assert summary["rows"] == 12 and summary["target_vocab_size"] == 49152
    assert summary["recipe_inputs"]["data.max_length"] == 64


# ---------------------------------------------------------------- the README and the CLI tell the truth
def test_readme_train_resume_works_and_misplaced_keys_are_suggested(capsys):
    readme = (ROOT / "README.md").read_text()
    assert "`specheads train RECIPE [train.resume=true]`" in readme
    assert load_recipe(ROOT / "recipes" / "smollm2_eagle3.yaml", ["train.resume=true"]).train.resume
    assert main(["train", str(ROOT / "recipes" / "smollm2_eagle3.yaml"), "resume=true", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'train.resume'?" in err
    # a mistake on the command line is not blamed on the recipe file
    assert err.startswith("specheads: RecipeError: command line (overriding ")


def test_version_and_every_flag_documented(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("specheads 0.")
    from specheads.cli import EVAL_FLAGS, EXPORT_FLAGS

    parser = build_parser()
    subs = next(a for a in parser._actions if a.dest == "command").choices
    for name, flags in (("eval", EVAL_FLAGS), ("export", EXPORT_FLAGS)):
        for action in subs[name]._actions:
            assert action.help, (name, action.dest)
            if action.dest in flags:  # a flag that sets a recipe key says which, and its default
                assert flags[action.dest] in action.help and "default" in action.help, (name, action.help)


def test_prompts_as_a_json_list_of_strings(tmp_path):
    from specheads.data.formats import load_prompts

    p = tmp_path / "prompts.json"
    p.write_text(json.dumps(["Write a haiku about rain.", "What is 2+2?"]))
    assert [r["turns"] for r in load_prompts(p)] == [["Write a haiku about rain."], ["What is 2+2?"]]


def test_license_is_an_spdx_string():
    """setuptools >= 77 warns on every install about `project.license` as a table."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"


# ---------------------------------------------------------------- quiet, honest output
def test_target_loading_draws_no_bars():
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from specheads.target import _quiet_loading

    plain = gguf_utils.tqdm
    with _quiet_loading():
        assert gguf_utils.tqdm(range(3)).disable and not hf_logging.is_progress_bar_enabled()
    assert gguf_utils.tqdm is plain and hf_logging.is_progress_bar_enabled()


def test_train_summary_is_short_and_counts_the_loop():
    s = {"kind": "eagle3", "steps": 132, "start_step": 0, "total_steps": 132, "tokens": 100_000, "elapsed_s": 300.0,
         "train_loop_s": 200.0, "tokens_per_s": 500.0, "world_size": 1, "precision": "fp32",
         "eval": {"loss": 14.37, "step_acc": [0.215, 0.149], "sim_tau": 1.25}, "final_dir": "runs/x/train/final",
         "metrics": "runs/x/train/metrics.jsonl", "plots": ["loss.png"], "losses": [1.0] * 132}
    text = train_summary(s)
    assert len(text.splitlines()) == 3 and "{" not in text
    assert "500 tok/s (3.3 min training, 5.0 min with set-up" in text and "0.21 · 0.15" in text
    assert "peak device memory" not in text                 # a CPU run has none
    assert "; peak device memory 31.4 GiB (35.0 reserved))" in train_summary({**s, "peak_memory_gib": 31.4,
                                                                              "peak_reserved_gib": 35.0})


def test_model_card_reads_like_a_hub_card(tmp_path):
    import torch

    from interop import tiny
    from specheads.formats import speculators
    from specheads.formats.card import write_card
    from specheads.formats.common import ExportMeta

    recipe = load_recipe(None, []).to_dict()
    meta = ExportMeta(verifier_name_or_path="org/tiny-target", aux_layer_ids=list(tiny.AUX), recipe=recipe,
                      data={"sources": ["a.jsonl"], "regenerated_by_target": True,
                            "draft_vocab": {"draft_vocab_size": 128, "target_vocab_size": 200, "coverage": 0.98765}},
                      training={"step": 1234, "precision": "bf16", "world_size": 1,
                                "eval": {"loss": 3.14159265, "step_acc": [0.5123456, 0.25], "sim_tau": 1.6180339}})
    out = tmp_path / "exp"
    speculators.save(tiny.eagle3_head(), meta, out, dtype=torch.float32)
    text = write_card(out, meta).read_text()
    assert text.startswith("---\nlibrary_name: specheads\nbase_model: org/tiny-target\n")
    assert str(tmp_path) not in text  # no absolute path: the card travels with the head
    report = tmp_path / "eval" / "report.json"
    report.parent.mkdir()
    report.write_text(json.dumps({"runs": [{"name": "head k=3 greedy", "metrics": {"tau": 2.5}}]}))
    with_report = write_card(out, meta, report_json=report).read_text()
    assert "From `report.json`" in with_report and str(tmp_path) not in with_report
    assert "'{\"method\":\"eagle3\",\"model\":\"exp\"" in text  # outside the working directory: its name
    assert "rerun with `specheads train recipe.yaml`" in text
    assert yaml.safe_load((out / "recipe.yaml").read_text()) == recipe  # the file the card's rerun line names
    assert "| coverage of training tokens | 98.8% |" in text and "| held-out loss | 3.14 |" in text
    assert "| optimizer steps | 1,234 |" in text and "3.14159265" not in text and "0.5123456" not in text
    assert '"train": {' not in text and "```yaml" in text  # the recipe is YAML, folded away
