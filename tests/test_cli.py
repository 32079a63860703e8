import subprocess
import sys

import pytest

from specheads.cli import main


@pytest.mark.parametrize("argv", [
    ["data", "prepare", "recipes/smollm2_eagle3.yaml", "--dry-run"],
    ["data", "regenerate", "recipes/smollm2_eagle3.yaml", "--dry-run"],
    ["data", "synthesize", "recipes/smollm2_eagle3.yaml", "data.synthesize.num_prompts=1000", "--dry-run"],
    ["vocab", "recipes/smollm2_eagle3.yaml", "--dry-run"],
    ["dump", "recipes/smollm2_eagle3.yaml", "dump.dtype=fp8", "--dry-run"],
    ["train", "recipes/llama8b_eagle3.yaml", "train.lr=2e-4", "--dry-run"],
    ["eval", "recipes/smollm2_eagle3.yaml", "--dry-run"],
])
def test_dry_run_prints_plan_without_loading(argv, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "dry run (nothing loaded)" in out and "# would run:" in out
    if "fp8" in argv[-2]:
        assert "write fp8 shards" in out
    if "train.lr=2e-4" in argv:
        assert "lr 0.0002" in out
    if "data.synthesize.num_prompts=1000" in argv:
        assert "write 1000 user prompts" in out and "runs/smollm2_eagle3/data/synthesized.jsonl" in out


def test_unknown_key_exit_code(capsys):
    assert main(["train", "recipes/smollm2_eagle3.yaml", "train.lrr=1", "--dry-run"]) == 2
    assert "did you mean 'train.lr'" in capsys.readouterr().err


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "specheads.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for cmd in ["data", "dump", "vocab", "train", "export", "eval"]:
        assert cmd in out.stdout
