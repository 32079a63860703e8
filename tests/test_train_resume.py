"""Resuming a training checkpoint on another number of ranks (N -> M, issue #15).

Every run is a ``torchrun`` launch (1 or 2 CPU processes, gloo) of the real trainer on the real
``dump.feed.Feed`` over a small in-memory synthetic store: rank r takes global micro-batches
r, r+W, ... of one shuffled list, so 2 ranks × grad_accum 1 and 1 rank × grad_accum 2 see the same
rows in every optimizer step and must give the same loss curve (fp32 on the CPU). An interrupted run is
simulated as in ``test_train.py``: a new run dir holding only the step-6 checkpoint of a full run.
"""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from specheads.rundir import ResumeMismatchError, compare_fingerprints

STEPS, SAVE_AT = 12, 6

_SCRIPT = '''
import json, os, sys, torch
torch.set_num_threads(1)
sys.path.insert(0, {tests!r})
import numpy as np
from specheads.config import recipe_from_dict
from specheads.dump.feed import Feed
from specheads.train import run_train
from synthetic_target import SyntheticFeed, synthetic_vocab, tiny_target

run_dir, zero, accum, resume = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
tgt = tiny_target()


class Rows:
    """SyntheticFeed's rows as a store the real Feed cuts into micro-batches."""
    kind = "synthetic"

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows["input_ids"])

    def batches(self, batch_lists):
        for ids in batch_lists:
            yield {{**{{k: v[ids] for k, v in self.rows.items()}}, "row_index": torch.tensor(ids)}}


rows = SyntheticFeed(tgt, n_rows=16, seed=3).rows
feed = Feed(Rows(rows), np.arange(16), 2, seed=0, rank=rank, world_size=world)
r = recipe_from_dict({{"run_dir": run_dir, "seed": 0, "head": {{"kind": "eagle3", "aux_layer_ids": [1, 2, 3]}},
                      "vocab": {{"draft_vocab_size": 128}},
                      "train": {{"ttt_steps": 2, "max_steps": {steps}, "save_every": {save_at}, "eval_every": 1000,
                                "lr": 3e-3, "warmup_steps": 3, "scheduler": "cosine", "micro_batch_size": 2,
                                "grad_accum": accum, "zero_stage": zero, "precision": "fp32",
                                "loss_kernel": "torch", "resume": resume, "logging": {{"wandb": "disabled"}}}}}})
s = run_train(r, target=tgt, feed=feed, vocab=synthetic_vocab(tgt, 128), progress=False)
if rank == 0:
    with open(os.path.join(run_dir, "result.json"), "w") as f:
        json.dump({{"world": s["world_size"], "start": s["start_step"], "steps": s["steps"]}}, f)
from specheads.train.engine import finish_process
finish_process(0)   # as the CLI ends a rank: DeepSpeed's gloo threads must not meet the interpreter's teardown
'''


def _launch(tmp_path, run_dir: Path, ranks: int, zero: int, accum: int, resume: bool) -> dict:
    script = tmp_path / "run.py"
    if not script.is_file():
        script.write_text(_SCRIPT.format(tests=str(Path(__file__).resolve().parent), steps=STEPS, save_at=SAVE_AT))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                        "--master_port", str(port), str(script), str(run_dir), str(zero), str(accum),
                        "1" if resume else "0"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    res = json.loads((run_dir / "result.json").read_text())
    res["stderr"] = p.stderr
    res["losses"] = {m["step"]: m["loss"] for m in map(json.loads, (run_dir / "train" / "metrics.jsonl").open())
                     if m["split"] == "train"}
    return res


def _interrupted_copy(src_run: Path, dst_run: Path) -> Path:
    """A run dir holding only ``src_run``'s step-SAVE_AT checkpoint and the metrics logged so far."""
    src, dst = src_run / "train" / "checkpoints", dst_run / "train" / "checkpoints"
    shutil.copytree(src / f"step_{SAVE_AT}", dst / f"step_{SAVE_AT}")
    (dst / "latest").write_text(f"step_{SAVE_AT}")
    metrics = [ln for ln in (src_run / "train" / "metrics.jsonl").read_text().splitlines()
               if json.loads(ln)["step"] <= SAVE_AT]
    (dst_run / "train" / "metrics.jsonl").write_text("".join(ln + "\n" for ln in metrics))
    return dst / f"step_{SAVE_AT}"


def _same_curve(got: dict, want: dict, steps) -> None:
    for s in steps:
        assert got[s] == pytest.approx(want[s], rel=1e-5, abs=1e-6), (s, got[s], want[s])


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_resume_on_another_number_of_ranks(zero, tmp_path):
    """2 ranks × accum 1 -> 1 rank × accum 2, and 1 × 2 -> 2 × 1: the curve goes on as without the change."""
    two = _launch(tmp_path, tmp_path / "two", 2, zero, 1, False)
    one = _launch(tmp_path, tmp_path / "one", 1, zero, 2, False)
    assert sorted(two["losses"]) == list(range(1, STEPS + 1))
    _same_curve(one["losses"], two["losses"], range(1, STEPS + 1))  # the same global batches, step by step

    # 2 -> 1: the user keeps the global batch with train.grad_accum=2
    tag = _interrupted_copy(tmp_path / "two", tmp_path / "two_to_one")
    a = _launch(tmp_path, tmp_path / "two_to_one", 1, zero, 2, True)
    assert (a["world"], a["start"], a["steps"]) == (1, SAVE_AT, STEPS)
    assert "written on 2 rank(s) × train.grad_accum=1, now 1 × 2" in a["stderr"]
    assert sorted(a["losses"]) == list(range(1, STEPS + 1))  # metrics.jsonl continues
    _same_curve(a["losses"], two["losses"], range(SAVE_AT + 1, STEPS + 1))
    universal = tag.with_name(tag.name + ".universal")
    assert universal.is_dir() == (zero > 0)
    assert not list(tag.parent.glob(".*partial"))

    # 1 -> 2
    _interrupted_copy(tmp_path / "one", tmp_path / "one_to_two")
    b = _launch(tmp_path, tmp_path / "one_to_two", 2, zero, 1, True)
    assert (b["world"], b["start"], b["steps"]) == (2, SAVE_AT, STEPS)
    _same_curve(b["losses"], one["losses"], range(SAVE_AT + 1, STEPS + 1))

    if zero == 2:
        # a second resume from the same checkpoint reuses the converted copy
        (tmp_path / "two_to_one" / "train" / "checkpoints" / "latest").write_text(f"step_{SAVE_AT}")
        stamp = (universal / "zero").stat().st_mtime_ns
        c = _launch(tmp_path, tmp_path / "two_to_one", 1, zero, 2, True)
        assert "converting it to a DeepSpeed universal checkpoint" not in c["stderr"]
        assert (universal / "zero").stat().st_mtime_ns == stamp
        _same_curve(c["losses"], a["losses"], range(SAVE_AT + 1, STEPS + 1))


def _fingerprint(world: int, accum: int) -> dict:
    return {"train.lr": 1e-3, "train.micro_batch_size": 2, "world_size": world, "train.grad_accum": accum}


def test_global_batch_must_stay_the_same():
    compare_fingerprints(_fingerprint(2, 1), _fingerprint(1, 2), "ck")  # same global batch: allowed
    compare_fingerprints(_fingerprint(2, 2), _fingerprint(4, 1), "ck")
    with pytest.raises(ResumeMismatchError) as ei:
        compare_fingerprints(_fingerprint(2, 1), _fingerprint(1, 1), "ck")
    msg = str(ei.value)
    assert "2 × 1 = 2 (checkpoint) != 1 × 1 = 1 (this run)" in msg and "pass train.grad_accum=2" in msg
    with pytest.raises(ResumeMismatchError, match="resume on a number of ranks that divides 2"):
        compare_fingerprints(_fingerprint(2, 1), _fingerprint(3, 1), "ck")
    with pytest.raises(ResumeMismatchError) as ei:  # other differences are listed beside it
        compare_fingerprints(_fingerprint(2, 1), {**_fingerprint(1, 1), "train.lr": 2e-3}, "ck")
    assert "train.lr" in str(ei.value) and "train.grad_accum=2" in str(ei.value)


def test_adam_steps_follow_their_parameters_after_a_load():
    """DeepSpeed's universal loader leaves each Adam ``step`` a CPU tensor; torch's fused AdamW (the
    trainer's fallback) refuses a step that is not beside its parameter, as fp32 (seen on 2 H200s)."""
    import torch

    from specheads.train.checkpoint import steps_to_param_device

    class Wrapper:                                       # DeepSpeed's ZeRO optimizers hold torch's as .optimizer
        def __init__(self, opt):
            self.optimizer = opt

    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    fused = torch.optim.AdamW(params, lr=1e-3, fused=True)
    sum(p.sum() for p in params).backward()
    fused.step()
    for p in params:                                     # as the universal loader writes it
        fused.state[p]["step"] = torch.tensor(float(fused.state[p]["step"]), dtype=torch.float64)
    fused.state[params[1]]["step"] = 1                   # or as a plain number
    fused.param_groups[0]["params"] = []                 # and as ZeRO-3 leaves the groups after its load
    assert steps_to_param_device(Wrapper(fused)) == 2
    fused.param_groups[0]["params"] = params
    assert all(fused.state[p]["step"].dtype == torch.float32 and fused.state[p]["step"].device == p.device
               for p in params)
    fused.step()                                         # and the next step runs
    assert steps_to_param_device(Wrapper(fused)) == 0    # nothing left to move
    plain = torch.optim.AdamW(params, lr=1e-3)           # not fused: steps stay where torch keeps them
    plain.step()
    assert steps_to_param_device(plain) == 0
