"""`specheads export` (specheads/export/stage.py) on tiny heads: CPU, a few seconds."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specheads.cli import main
from specheads.formats import ExportError, load_any
from specheads.export import stage
from interop import tiny

torch.set_num_threads(1)


@pytest.fixture
def run(tmp_path):
    head = tiny.eagle3_head()
    tiny.fake_run(tmp_path / "run", head, eval_report={"runs": [
        {"name": "head k=3 greedy", "metrics": {"tau": 2.25, "acceptance_rate": 0.61, "alpha": [0.8]}}]})
    return tmp_path / "run", head


def _same_outputs(a, b, atol):
    from specheads.heads import ttt_forward

    if not bool(a.embed_tokens.weight.any()):  # sglang: no embedding in the file (the target's is shared)
        a.embed_tokens.weight.data.copy_(b.embed_tokens.weight)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, tiny.VT, (1, 12), generator=g)
    aux = torch.randn(1, 12, len(tiny.AUX) * tiny.H, generator=g)
    with torch.no_grad():
        for x, y in zip(ttt_forward(a.float(), ids, aux, steps=2), ttt_forward(b.float(), ids, aux, steps=2)):
            assert float((x - y).abs().max()) <= atol


# ---------------------------------------------------------------- export from a run dir
def test_export_run_dir_defaults(run, capsys):
    run_dir, head = run
    assert main(["export", str(run_dir)]) == 0
    out = capsys.readouterr().out
    d = run_dir / "export" / "speculators"  # recipe default format, under the run dir
    assert f"exported speculators head to {d.resolve()}" in out
    assert "validation (vllm, speculators): PASS" in out and "model.safetensors" in out
    assert "vllm serve org/tiny-target --speculative-config" in out and '"num_speculative_tokens":3' in out
    c = json.loads((d / "config.json").read_text())
    assert c["speculators_config"]["verifier"] == {"name_or_path": "org/tiny-target",
                                                   "architectures": ["LlamaForCausalLM"]}
    assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert c["eagle_aux_hidden_state_layer_ids"] == tiny.AUX and c["torch_dtype"] == "bfloat16"
    card = (d / "README.md").read_text()
    assert "Measured acceptance" in card and "2.25" in card and "vllm serve org/tiny-target" in card
    side = json.loads((d / "specheads.json").read_text())
    assert side["meta"]["training"]["target"]["config_hash"] == "0123456789abcdef"
    assert side["meta"]["recipe_hash"] == "feedfacefeedface"
    reloaded, meta, fmt = load_any(d)
    assert fmt == "speculators" and torch.equal(reloaded.d2t, head.d2t)


def test_export_bundled_target_names_the_hf_verifier(tmp_path, capsys):
    tiny.fake_run(tmp_path / "run", tiny.eagle3_head(), target_name="smollm2-135m")
    assert main(["export", str(tmp_path / "run" / "train" / "final"), "--out", str(tmp_path / "o")]) == 0
    c = json.loads((tmp_path / "o" / "config.json").read_text())
    assert c["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "vllm serve HuggingFaceTB/SmolLM2-135M-Instruct" in capsys.readouterr().out


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_export_flags_fp32_exact(run, tmp_path, fmt, capsys):
    run_dir, head = run
    out = tmp_path / fmt
    assert main(["export", str(run_dir / "train"), "--format", fmt, "--out", str(out), "--k", "5",
                 "--dtype", "float32"]) == 0
    out_text = capsys.readouterr().out
    assert ": PASS" in out_text and "differ from the trained head's by at most 0 (tolerance 0.0001" in out_text
    _same_outputs(load_any(out)[0], head, 0.0)
    c = json.loads((out / "config.json").read_text())
    k = c["num_speculative_tokens"] if fmt == "sglang" else c["speculators_config"]["proposal_methods"][0][
        "speculative_tokens"]
    assert k == 5


def test_export_from_recipe_yaml(tmp_path, capsys):
    run_dir = tmp_path / "r"
    tiny.fake_run(run_dir, tiny.eagle3_head())
    rec = tmp_path / "recipe.yaml"
    rec.write_text(f"run_dir: {run_dir}\nexport:\n  format: sglang\n  k: 2\n  dtype: float32\n")
    assert main(["export", str(rec), "export.k=4"]) == 0
    d = run_dir / "export" / "sglang"
    c = json.loads((d / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["num_speculative_tokens"] == 4
    assert "Measured acceptance" not in (d / "README.md").read_text()  # no eval report in this run


def test_export_from_checkpoint_dir_uses_run_root(tmp_path):
    assert stage.run_root(tmp_path / "run" / "train" / "checkpoints" / "step_7") == (tmp_path / "run").resolve()
    assert stage.run_root(tmp_path / "run" / "train" / "final") == (tmp_path / "run").resolve()
    assert stage.run_root(tmp_path / "run" / "train") == (tmp_path / "run").resolve()
    assert stage.run_root(tmp_path / "run") == (tmp_path / "run").resolve()


# ---------------------------------------------------------------- --from
def test_from_conversion_round_trip(run, tmp_path, capsys):
    run_dir, head = run
    spec = tmp_path / "spec"
    assert main(["export", str(run_dir), "--out", str(spec), "--dtype", "float32"]) == 0
    assert main(["export", "--from", str(spec), "--format", "sglang", "--out", str(tmp_path / "sg"),
                 "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "converted" in out and "(speculators) -> sglang" in out and "PASS" in out
    sg, meta, fmt = load_any(tmp_path / "sg")
    assert fmt == "sglang" and meta.verifier_name_or_path == "org/tiny-target"
    _same_outputs(sg, head, 0.0)
    # sglang has no embedding: converting back to speculators would write none -> refused clearly
    rc = main(["export", "--from", str(tmp_path / "sg"), "--format", "speculators", "--out", str(tmp_path / "b")])
    assert rc == 1 and "has no embedding" in capsys.readouterr().err


def test_from_verifies_the_source_checksums_before_converting(run, tmp_path, capsys):
    """Before: --from recorded the source's checksums without checking them, so a flipped byte in the source's
    weights was converted and sealed under new checksums that matched it."""
    run_dir, _ = run
    spec = tmp_path / "spec"
    assert main(["export", str(run_dir), "--out", str(spec), "--dtype", "float32"]) == 0
    weights = spec / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x10
    weights.write_bytes(bytes(data))
    capsys.readouterr()
    rc = main(["export", "--from", str(spec), "--format", "sglang", "--out", str(tmp_path / "sg")])
    err = capsys.readouterr().err
    assert rc == 1 and f"--from {spec}" in err and "model.safetensors: sha256" in err and "differs" in err
    assert not (tmp_path / "sg").exists()


def test_from_needs_format_and_out(run, tmp_path, capsys):
    assert main(["export", "--from", str(tmp_path), "--out", str(tmp_path / "x")]) == 1
    assert "--from DIR needs --format F and --out OUT" in capsys.readouterr().err
    assert main(["export", "--from", str(tmp_path), "--format", "sglang", "--out", str(tmp_path / "x")]) == 1
    assert "not a head directory" in capsys.readouterr().err


# ---------------------------------------------------------------- --check
def test_check_pass_and_target(run, tmp_path, capsys):
    run_dir, _ = run
    verifier = tiny.tiny_verifier(tmp_path / "verifier")
    tiny.fake_run(tmp_path / "run2", tiny.eagle3_head(), target_name=str(verifier))
    assert main(["export", str(tmp_path / "run2"), "--out", str(tmp_path / "e")]) == 0
    capsys.readouterr()
    assert main(["export", "--check", str(tmp_path / "e")]) == 0
    assert ": OK" in capsys.readouterr().out
    assert main(["export", "--check", str(tmp_path / "e"), "--target", str(verifier)]) == 0
    assert "target config" in capsys.readouterr().out
    # the bundled SmolLM2: wrong verifier, vocabulary and hidden size, all reported
    assert main(["export", "--check", str(tmp_path / "e"), "--target", "smollm2-135m"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "HuggingFaceTB/SmolLM2-135M-Instruct" in out
    assert "vocabulary 49152" in out and "hidden_size 576" in out


def test_check_failures(run, tmp_path, capsys):
    run_dir, _ = run
    d = tmp_path / "e"
    assert main(["export", str(run_dir), "--out", str(d)]) == 0
    # d2t removed while the draft vocab is smaller than the target's
    t = load_file(str(d / "model.safetensors"))
    t.pop("d2t")
    save_file(t, str(d / "model.safetensors"))
    capsys.readouterr()
    assert main(["export", "--check", str(d)]) == 1
    assert "missing tensor 'd2t'" in capsys.readouterr().out
    # a shape mismatch
    t["d2t"] = torch.zeros(tiny.VD, dtype=torch.int64)
    t["fc.weight"] = t["fc.weight"][:, :-1].contiguous()
    save_file(t, str(d / "model.safetensors"))
    assert main(["export", "--check", str(d)]) == 1
    assert "'fc.weight' has shape" in capsys.readouterr().out
    # not a head directory at all
    (tmp_path / "empty").mkdir()
    assert main(["export", "--check", str(tmp_path / "empty")]) == 1
    assert "not a head directory" in capsys.readouterr().out


# ---------------------------------------------------------------- bad input
def test_bad_sources(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nope")]) == 1
    assert "no such recipe file or run/checkpoint directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["export", str(tmp_path / "empty")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("specheads: ExportError:") and "not a trained head" in err and err.count("\n") == 1
    with pytest.raises(SystemExit):  # argparse: --format takes one of the four formats
        main(["export", str(tmp_path), "--format", "onnx"])
    assert "invalid choice: 'onnx'" in capsys.readouterr().err
    assert main(["export", "--check", str(tmp_path), "--from", str(tmp_path)]) == 1
    assert main(["export", str(tmp_path), "--target", "smollm2-135m"]) == 1


def test_eagle3_head_cannot_be_mtp(run, tmp_path, capsys):
    run_dir, _ = run
    assert main(["export", str(run_dir), "--format", "mtp", "--out", str(tmp_path / "m")]) == 1
    assert "a eagle3 head cannot be written as 'mtp'" in capsys.readouterr().err


def test_missing_vocab_mapping(tmp_path, capsys):
    head = tiny.eagle3_head()
    head.t2d.zero_(), head.d2t.zero_()  # draft vocab 128 < 200 with no mapping
    tiny.fake_run(tmp_path / "run", head)
    assert main(["export", str(tmp_path / "run")]) == 1
    assert "no d2t/t2d mapping" in capsys.readouterr().err


def test_shape_mismatches(tmp_path, capsys):
    tiny.fake_run(tmp_path / "run", tiny.eagle3_head())
    final = tmp_path / "run" / "train" / "final"
    meta = json.loads((final / "meta.json").read_text())
    meta["target"]["hidden_size"] = 576
    (final / "meta.json").write_text(json.dumps(meta))
    assert main(["export", str(tmp_path / "run")]) == 1
    assert "head expects target hidden size 64, target has 576" in capsys.readouterr().err
    t = load_file(str(final / "model.safetensors"))
    t["lm_head.weight"] = t["lm_head.weight"][:-1].contiguous()
    save_file(t, str(final / "model.safetensors"))
    # a head saved with this shape (its recorded sha256 follows the new weights), not a damaged file
    import hashlib

    meta["checksums"]["model.safetensors"] = hashlib.sha256((final / "model.safetensors").read_bytes()).hexdigest()
    (final / "meta.json").write_text(json.dumps(meta))
    assert main(["export", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert "cannot load the trained head" in err and "lm_head.weight" in err and err.count("\n") == 1


# ---------------------------------------------------------------- dry run
def test_dry_run_loads_nothing(run, tmp_path, capsys, monkeypatch):
    run_dir, _ = run
    monkeypatch.setattr(stage, "load_trained", lambda *a, **k: pytest.fail("dry run loaded the head"))
    assert main(["export", str(run_dir), "--dry-run", "--format", "sglang", "--k", "4"]) == 0
    out = capsys.readouterr().out
    assert "dry run (nothing loaded)" in out and "write sglang (bfloat16, k=4)" in out
    assert not (run_dir / "export").exists()
    recipe = Path(__file__).resolve().parent.parent / "recipes" / "smollm2_eagle3.yaml"
    assert main(["export", str(recipe), "--dry-run"]) == 0
    assert "write speculators (bfloat16, k=3) to runs/smollm2_eagle3/export/speculators" in capsys.readouterr().out
    assert main(["export", "--check", str(tmp_path), "--target", "smollm2-135m", "--dry-run"]) == 0
    assert main(["export", "--from", str(tmp_path), "--format", "eagle", "--out", "x", "--dry-run"]) == 0


def test_target_verifier_names_what_a_server_loads():
    """A GGUF (in parts, say) goes by a file name no server can load: target.verifier names the model it
    quantises, and exports point vLLM / SGLang at that."""
    head = tiny.eagle3_head()
    trained = {"target": {"name": "qwen2.5-coder-1.5b-instruct-q4_k_m", "model_type": "qwen2"}}
    assert stage.build_meta(head, trained, 3, {}).verifier_name_or_path == "qwen2.5-coder-1.5b-instruct-q4_k_m"
    meta = stage.build_meta(head, trained, 3, {"target": {"verifier": "Qwen/Qwen2.5-Coder-1.5B-Instruct"}})
    assert meta.verifier_name_or_path == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
