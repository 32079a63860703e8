"""Faults in training outputs: damaged checkpoints, a damaged final/, a new run over an old one's outputs,
inputs that changed under a checkpoint or a dump (tiny heads, synthetic feeds, the real DeepSpeed path on CPU)."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from specheads.config import recipe_from_dict
from specheads.errors import SpecheadsError
from specheads.formats.trained import TrainedHeadError, load_trained_head
from specheads.rundir import ResumeMismatchError
from specheads.train import TrainingDivergedError, run_train
from specheads.train.checkpoint import CheckpointError, PreviousRunError
from specheads.train.run_log import read_metrics
from synthetic_target import SyntheticFeed, tiny_recipe, tiny_target

STEPS, EVERY = 8, 4
KW = dict(max_steps=STEPS, save_every=EVERY, scheduler="cosine", warmup_steps=2)


def make_recipe(run_dir, **train):
    return tiny_recipe(run_dir, **train)


def train(run_dir, target, vocab, **kw):
    return run_train(make_recipe(run_dir, **kw), target=target, feed=SyntheticFeed(target, seed=3), vocab=vocab,
                     progress=False)


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def flip(p: Path, at: int | None = None) -> None:
    b = bytearray(p.read_bytes())
    i = len(b) // 2 if at is None else at
    b[i] ^= 0x01
    p.write_bytes(bytes(b))


def truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def losses(metrics) -> dict:
    return {m["step"]: m["loss"] for m in read_metrics(metrics) if m["split"] == "train"}


@pytest.fixture(scope="module")
def full(tmp_path_factory, target, vocab):
    """An uninterrupted run: checkpoints at steps 4 and 8, final/."""
    d = tmp_path_factory.mktemp("full")
    s = train(d, target, vocab, **KW)
    return d, s


def interrupted(full_dir: Path, dst: Path) -> Path:
    """A run dir as a run killed after its step-8 checkpoint leaves it: step_4, step_8 (latest), metrics."""
    src, ck = full_dir / "train" / "checkpoints", dst / "train" / "checkpoints"
    for t in ("step_4", "step_8"):
        shutil.copytree(src / t, ck / t)
    (ck / "latest").write_text("step_8")
    shutil.copy(full_dir / "train" / "metrics.jsonl", dst / "train" / "metrics.jsonl")
    return ck


# ---------------------------------------------------------------- what the artefacts record
def test_checkpoints_and_final_record_checksums_and_lineage(full):
    d, s = full
    ck = d / "train" / "checkpoints"
    assert (ck / "latest").read_text() == "step_8"
    for t in ("step_4", "step_8"):
        doc = json.loads((ck / t / "checksums.json").read_text())
        files = doc["files"]
        assert doc["algorithm"] == "sha256" and "checksums.json" not in files
        assert {"client_state.json", "rank_0.pt", "meta.json", "head_config.json",
                "mp_rank_00_model_states.pt"} <= set(files)
        for name, rec in files.items():
            assert rec["sha256"] == sha(ck / t / name) and rec["bytes"] == (ck / t / name).stat().st_size
        fp = json.loads((ck / t / "client_state.json").read_text())["fingerprint"]
        # in-memory feed and vocabulary: no input files to digest, recorded as such
        assert fp["inputs.dump_manifest_sha256"] is None and fp["inputs.vocab_sha256"] is None
    final = d / "train" / "final"
    meta = json.loads((final / "meta.json").read_text())
    assert meta["checksums"] == {"model.safetensors": sha(final / "model.safetensors"),
                                 "head_config.json": sha(final / "head_config.json")}
    assert meta["inputs"] == {"dump_manifest": None, "vocab": None}
    assert not list((d / "train").glob(".final*"))  # the temporary sibling is gone


# ---------------------------------------------------------------- damaged checkpoints
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(full, target, vocab, tmp_path, capsys, damage):
    d, a = full
    ck = interrupted(d, tmp_path)
    bad = ck / "step_8" / "mp_rank_00_model_states.pt"
    want = sha(bad)
    (flip if damage == "flip" else truncate)(bad)
    have, size = sha(bad), bad.stat().st_size
    capsys.readouterr()
    b = train(tmp_path, target, vocab, resume=True, **KW)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"skipping checkpoint {ck / 'step_8'}" in err and str(bad) in err and want in err
    if damage == "flip":
        assert f"sha256 {have}, expected {want}" in err
    else:
        assert f"{size} bytes, expected" in err
    assert f"resuming from {ck / 'step_4'}" in err
    # the run continues from step 4 exactly as the uninterrupted one did
    assert b["start_step"] == 4 and b["steps"] == STEPS
    la, lb = losses(a["metrics"]), losses(b["metrics"])
    assert sorted(lb) == list(range(1, STEPS + 1))
    for s in range(5, STEPS + 1):
        assert lb[s] == pytest.approx(la[s], rel=1e-5, abs=1e-6), s
    ha, _ = load_trained_head(d)
    hb, _ = load_trained_head(tmp_path)
    for (n, x), (_, y) in zip(ha.state_dict().items(), hb.state_dict().items()):
        assert torch.allclose(x, y, atol=1e-6), n
    # the damaged step_8 was replaced by a good one, and latest names it
    assert (ck / "latest").read_text() == "step_8"
    assert sha(bad) == json.loads((ck / "step_8" / "checksums.json").read_text())["files"][bad.name]["sha256"]


def test_no_checkpoint_verifies_is_a_clean_error(full, target, vocab, tmp_path):
    d, _ = full
    ck = interrupted(d, tmp_path)
    flip(ck / "step_8" / "rank_0.pt")
    (ck / "step_4" / "client_state.json").unlink()
    with pytest.raises(CheckpointError) as ei:
        train(tmp_path, target, vocab, resume=True, **KW)
    msg = str(ei.value)
    assert isinstance(ei.value, SpecheadsError)
    assert str(ck / "step_8" / "rank_0.pt") in msg and str(ck / "step_4" / "client_state.json") in msg


def test_checkpoints_without_checksums_are_the_last_resort(full, target, vocab, tmp_path, capsys):
    """Written before checksums: resumed (with a warning) only when nothing verifies, and only when their
    files pass the zip CRC check; a damaged one is skipped, naming the file."""
    d, a = full
    ck = interrupted(d, tmp_path)
    for t in ("step_4", "step_8"):  # as an older version wrote them: no checksums, no input digests
        (ck / t / "checksums.json").unlink()
        client = json.loads((ck / t / "client_state.json").read_text())
        client["fingerprint"] = {k: v for k, v in client["fingerprint"].items() if not k.startswith("inputs.")}
        (ck / t / "client_state.json").write_text(json.dumps(client))
    truncate(ck / "step_8" / "mp_rank_00_model_states.pt")
    capsys.readouterr()
    b = train(tmp_path, target, vocab, resume=True, **KW)
    err = capsys.readouterr().err
    assert str(ck / "step_8" / "mp_rank_00_model_states.pt") in err and "Traceback" not in err
    assert "WARNING: no checkpoint" in err and f"resuming from {ck / 'step_4'}" in err
    assert b["start_step"] == 4
    la, lb = losses(a["metrics"]), losses(b["metrics"])
    for s in range(5, STEPS + 1):
        assert lb[s] == pytest.approx(la[s], rel=1e-5, abs=1e-6), s


def test_a_first_save_that_did_not_finish_is_not_taken_for_an_old_checkpoint(full, target, vocab, tmp_path, capsys):
    """A checkpoint of this version without its checksums (killed before they were written, no `latest` yet)
    is an interrupted save: refused, not resumed as an unverified old one."""
    d, _ = full
    ck = interrupted(d, tmp_path)
    for t in ("step_4", "step_8"):
        (ck / t / "checksums.json").unlink()
    (ck / "latest").unlink()
    with pytest.raises(CheckpointError, match="a save that did not finish"):
        train(tmp_path, target, vocab, resume=True, **KW)


def test_a_checkpoint_newer_than_latest_is_an_interrupted_save(full, target, vocab, tmp_path, capsys):
    d, _ = full
    ck = interrupted(d, tmp_path)
    (ck / "latest").write_text("step_4")
    (ck / "step_8" / "checksums.json").unlink()  # killed before its checksums
    capsys.readouterr()
    b = train(tmp_path, target, vocab, resume=True, **KW)
    assert b["start_step"] == 4
    assert f"skipping checkpoint {ck / 'step_8'}: newer than" in capsys.readouterr().err


# ---------------------------------------------------------------- damaged final/
def test_damaged_final_is_a_clean_error(full, tmp_path):
    d, _ = full
    final = tmp_path / "final"
    shutil.copytree(d / "train" / "final", final)
    w = final / "model.safetensors"
    want = sha(w)
    flip(w, at=w.stat().st_size - 3)  # in the tensor data, past the header
    with pytest.raises(TrainedHeadError) as ei:
        load_trained_head(final)
    assert str(w) in str(ei.value) and want in str(ei.value) and sha(w) in str(ei.value)
    # truncated: named, with both digests
    shutil.copy(d / "train" / "final" / "model.safetensors", w)
    truncate(w)
    with pytest.raises(TrainedHeadError) as ei:
        load_trained_head(final)
    assert f"{w}: sha256 {sha(w)}, expected {want}" in str(ei.value)
    # a final/ written before checksums: a truncated file is still named, not a raw SafetensorError
    meta = json.loads((final / "meta.json").read_text())
    del meta["checksums"]
    (final / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(TrainedHeadError, match="unreadable safetensors file") as ei:
        load_trained_head(final)
    assert str(w) in str(ei.value)
    # a damaged checkpoint read as a head: named too
    ck = tmp_path / "ck"
    shutil.copytree(d / "train" / "checkpoints" / "step_8", ck)
    flip(ck / "mp_rank_00_model_states.pt")
    with pytest.raises(TrainedHeadError, match="mp_rank_00_model_states.pt: sha256"):
        load_trained_head(ck)


# ---------------------------------------------------------------- a new run over a finished one
def test_new_run_over_a_finished_one_is_refused_unless_overwrite(target, vocab, tmp_path):
    train(tmp_path, target, vocab, **KW)
    td = tmp_path / "train"
    old_final = sha(td / "final" / "model.safetensors")
    with pytest.raises(PreviousRunError) as ei:
        train(tmp_path, target, vocab, max_steps=6)
    msg = str(ei.value)
    assert str(td / "checkpoints") in msg and str(td / "final") in msg and "train.overwrite=true" in msg
    assert sha(td / "final" / "model.safetensors") == old_final  # nothing touched
    # resume=true with no checkpoint left, but the old final/: refused as well
    shutil.rmtree(td / "checkpoints")
    with pytest.raises(PreviousRunError, match="no checkpoint"):
        train(tmp_path, target, vocab, resume=True, max_steps=6)
    assert sha(td / "final" / "model.safetensors") == old_final


def test_overwrite_removes_the_old_outputs_before_the_first_write(target, vocab, tmp_path):
    train(tmp_path, target, vocab, **KW)
    td = tmp_path / "train"
    # the new run diverges at step 3 (a "killed" run): the old final/ and checkpoints must be gone
    r = make_recipe(tmp_path, overwrite=True, max_steps=6, save_every=2)
    with pytest.raises(TrainingDivergedError):
        run_train(r, target=target, feed=SyntheticFeed(target, seed=3, nan_batch=2), vocab=vocab, progress=False)
    assert not (td / "final").exists()
    assert sorted(p.name for p in (td / "checkpoints").iterdir()) == ["latest", "step_2"]
    assert [m["step"] for m in read_metrics(td / "metrics.jsonl") if m["split"] == "train"] == [1, 2]
    # a full overwrite run: only its own outputs
    s = train(tmp_path, target, vocab, overwrite=True, max_steps=6, save_every=1000)
    assert sorted(p.name for p in (td / "checkpoints").iterdir()) == ["latest", "step_6"]
    _, meta = load_trained_head(tmp_path)
    assert meta["step"] == 6 and s["start_step"] == 0


# ---------------------------------------------------------------- inputs: the dump and its token rows
def _write_rows(rows_dir: Path, seed: int, recipe) -> None:
    import datasets
    import numpy as np

    from specheads.rundir import stage_inputs

    g = np.random.default_rng(seed)
    ids = [g.integers(0, 256, int(k)).tolist() for k in g.integers(8, 24, 16)]
    mask = [[0, 0] + [1] * (len(x) - 2) for x in ids]
    if rows_dir.exists():
        shutil.rmtree(rows_dir)
    datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": mask}).save_to_disk(str(rows_dir))
    (rows_dir / "summary.json").write_text(json.dumps(
        {"rows": len(ids), "tokens": sum(map(len, ids)), "seed": seed,
         "recipe_inputs": stage_inputs(recipe, "prepare")}, indent=2) + "\n")


def test_dump_of_other_rows_and_changed_inputs_are_refused(tmp_path):
    from specheads.data.vocab import save_vocab, select_draft_vocab
    from specheads.dump import run_dump
    from specheads.train.loop import StaleDumpError

    tgt = tiny_target(layers=8)
    base = {"run_dir": str(tmp_path), "seed": 0, "data": {"max_length": 32},
            "dump": {"dtype": "float32", "shard_tokens": 128, "batch_tokens": 64},
            "vocab": {"draft_vocab_size": 64}, "head": {"kind": "eagle3"},
            "train": {"ttt_steps": 2, "max_steps": 4, "micro_batch_size": 2, "eval_every": 1000, "eval_fraction": 0,
                      "save_every": 2, "precision": "fp32", "loss_kernel": "torch", "logging": {"wandb": "disabled"}}}
    r = recipe_from_dict(base)
    rows, dump = tmp_path / "data" / "rows", tmp_path / "dump"
    _write_rows(rows, 0, r)
    import datasets

    ds = datasets.load_from_disk(str(rows))
    save_vocab(tmp_path / "vocab", *select_draft_vocab([dict(x) for x in ds], 64, 256))
    run_dump(r, target=tgt, progress=False)
    manifest = json.loads((dump / "manifest.json").read_text())
    assert manifest["rows_summary_sha256"] == sha(rows / "summary.json")

    s = run_train(r, target=tgt, progress=False)
    assert s["steps"] == 4
    meta = json.loads((tmp_path / "train" / "final" / "meta.json").read_text())
    assert meta["inputs"]["dump_manifest"] == {"path": str(dump / "manifest.json"),
                                               "sha256": sha(dump / "manifest.json")}
    assert meta["inputs"]["vocab"]["sha256"] == sha(tmp_path / "vocab" / "vocab.safetensors")
    fp = json.loads((tmp_path / "train" / "checkpoints" / "step_4" / "client_state.json").read_text())["fingerprint"]
    assert fp["inputs.dump_manifest_sha256"] == sha(dump / "manifest.json")

    # a resume whose dump manifest changed: refused, both digests named
    old_manifest = sha(dump / "manifest.json")
    (dump / "manifest.json").write_text(json.dumps(manifest) + "\n")  # same facts, other bytes
    resumed = recipe_from_dict({**base, "train": {**base["train"], "resume": True}})
    with pytest.raises(ResumeMismatchError) as ei:
        run_train(resumed, target=tgt, progress=False)
    msg = str(ei.value)
    assert "inputs.dump_manifest_sha256" in msg and old_manifest in msg and sha(dump / "manifest.json") in msg

    # the rows are prepared again (the source data changed) but the dump is not: refused naming both digests
    before = sha(rows / "summary.json")
    _write_rows(rows, 1, r)
    fresh = recipe_from_dict({**base, "train": {**base["train"], "overwrite": True}})
    with pytest.raises(StaleDumpError) as ei:
        run_train(fresh, target=tgt, progress=False)
    msg = str(ei.value)
    assert before in msg and sha(rows / "summary.json") in msg and "specheads dump" in msg
    assert (tmp_path / "train" / "final").is_dir()  # refused before anything was removed
