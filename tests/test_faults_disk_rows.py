"""A full disk at every stage's writes (simulated: the write function raises OSError ENOSPC), and token rows
with checksums: one clean ``DiskFullError`` naming the path and what was kept, the previous artefact intact,
a resume that continues from what was kept; a damaged Arrow file of the rows refused by its readers."""
from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from specheads.config import recipe_from_dict
from specheads.data.prepare import CHECKSUMS_FILE, RowsCorruptError, load_rows, load_summary, prepare_rows
from specheads.errors import SpecheadsError
from specheads.fileio import DiskFullError, disk_full_guard, is_disk_full
from specheads.rundir import RunDir, stage_inputs
from synthetic_target import SyntheticFeed, tiny_recipe

torch.set_num_threads(1)


def enospc(path="x") -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", str(path))


def tree(d: Path) -> dict:
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(d).rglob("*")) if p.is_file()}


def hidden_siblings(d: Path) -> list[str]:
    return sorted(p.name for p in d.parent.iterdir() if p.name.startswith(f".{d.name}."))


# ---------------------------------------------------------------- the shared helper
def test_guard_turns_a_full_disk_into_one_clean_error(tmp_path):
    class StageError(SpecheadsError, ValueError):
        pass

    with pytest.raises(DiskFullError) as ei:
        with disk_full_guard(tmp_path / "out", kept="the old one is kept", needed=12345, error=StageError):
            raise enospc(tmp_path / "out" / "part.bin")
    e = ei.value
    assert isinstance(e, StageError) and type(e).__name__ == "DiskFullError"
    msg = str(e)
    assert msg.startswith(f"disk full while writing {tmp_path / 'out' / 'part.bin'} (about 12345 bytes")
    assert "free)" in msg and "the old one is kept" in msg and "rerun" in msg
    with pytest.raises(DiskFullError, match="disk quota exceeded"):
        with disk_full_guard(tmp_path):
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
    with pytest.raises(PermissionError):  # anything else passes unchanged
        with disk_full_guard(tmp_path):
            raise PermissionError(errno.EACCES, "denied")
    # safetensors' Rust error and torch.save's writer carry no errno attribute
    SafetensorError = type("SafetensorError", (Exception,), {})
    assert is_disk_full(SafetensorError('I/O error: No space left on device (os error 28) at path "x"'))
    assert is_disk_full(RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0: "
                                     "PytorchStreamWriter failed writing file data/0: file write failed"))
    assert not is_disk_full(RuntimeError("shape mismatch"))


# ---------------------------------------------------------------- token rows
@pytest.fixture
def rows_recipe(tmp_path):
    return recipe_from_dict({"run_dir": str(tmp_path / "run"), "seed": 0, "data": {"max_length": 64},
                             "vocab": {"draft_vocab_size": 64}, "head": {"kind": "eagle3"}})


def _prepare(recipe, tok, src: Path, max_length: int = 64) -> dict:
    return prepare_rows([{"path": str(src)}], tok, max_length, RunDir(recipe).rows,
                        extra={"target_vocab_size": tok.vocab_size, "recipe_inputs": stage_inputs(recipe, "prepare")})


@pytest.fixture
def source(tmp_path):
    p = tmp_path / "q.jsonl"
    p.write_text("".join(json.dumps({"question": f"What is {i}+{i}?", "answer": f"{2 * i}"}) + "\n"
                         for i in range(12)))
    return p


def test_rows_carry_checksums_and_a_flipped_byte_is_refused_by_every_reader(rows_recipe, smollm2_tokenizer, source):
    from specheads.data import run_vocab
    from specheads.dump.rows import TokenRows

    rows = RunDir(rows_recipe).rows
    _prepare(rows_recipe, smollm2_tokenizer, source)
    sums = json.loads((rows / CHECKSUMS_FILE).read_text())["files"]
    arrow = sorted(rows.glob("*.arrow"))
    assert arrow and {p.name for p in arrow} | {"summary.json", "state.json", "dataset_info.json"} <= set(sums)
    assert all(sums[p.name]["sha256"] == hashlib.sha256(p.read_bytes()).hexdigest() for p in arrow)
    assert len(load_rows(rows)) == 12
    assert not hidden_siblings(rows)

    b = bytearray(arrow[0].read_bytes())
    b[len(b) // 2] ^= 0x01
    arrow[0].write_bytes(bytes(b))
    have = hashlib.sha256(bytes(b)).hexdigest()
    for read in (lambda: load_rows(rows), lambda: run_vocab(rows_recipe), lambda: TokenRows(rows)):
        with pytest.raises(RowsCorruptError) as ei:
            read()
        msg = str(ei.value)
        assert arrow[0].name in msg and have in msg and sums[arrow[0].name]["sha256"] in msg
        assert "data prepare" in msg


def test_rows_without_checksums_still_load_with_a_warning(rows_recipe, smollm2_tokenizer, source, caplog):
    rows = RunDir(rows_recipe).rows
    _prepare(rows_recipe, smollm2_tokenizer, source)
    (rows / CHECKSUMS_FILE).unlink()  # rows prepared before checksums existed
    assert len(load_rows(rows)) == 12
    assert "not verified" in caplog.text


@pytest.mark.parametrize("fault", ["disk_full", "killed"])
def test_a_prepare_that_fails_mid_write_keeps_the_previous_rows(rows_recipe, smollm2_tokenizer, source, monkeypatch,
                                                                fault):
    import datasets

    rows = RunDir(rows_recipe).rows
    _prepare(rows_recipe, smollm2_tokenizer, source)
    before, summary = tree(rows), load_summary(rows)

    def half_written(self, path, *a, **k):
        Path(path, "data-00000-of-00001.arrow").write_bytes(b"partial")
        if fault == "disk_full":
            raise enospc(Path(path, "data-00000-of-00001.arrow"))
        raise KeyboardInterrupt  # a kill (SIGINT) in the middle of the save

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", half_written)
    if fault == "disk_full":
        with pytest.raises(DiskFullError) as ei:
            _prepare(rows_recipe, smollm2_tokenizer, source, max_length=32)
        msg = str(ei.value)
        assert f"disk full while writing {rows / 'data-00000-of-00001.arrow'}" in msg
        assert f"the previous token rows at {rows} are unchanged" in msg and " free)" in msg
    else:
        with pytest.raises(KeyboardInterrupt):
            _prepare(rows_recipe, smollm2_tokenizer, source, max_length=32)
    assert tree(rows) == before and load_summary(rows) == summary
    assert not hidden_siblings(rows)
    monkeypatch.undo()
    assert len(load_rows(rows)) == 12


def test_prepare_restores_rows_a_killed_replace_had_moved_aside(rows_recipe, smollm2_tokenizer, source):
    rows = RunDir(rows_recipe).rows
    _prepare(rows_recipe, smollm2_tokenizer, source)
    before = tree(rows)
    aside = rows.parent / f".{rows.name}.old-killed"
    rows.rename(aside)  # killed between moving the old rows aside and renaming the new ones in
    (rows.parent / f".{rows.name}.tmp-killed").mkdir()
    from specheads.data.prepare import _clear_leftovers

    _clear_leftovers(rows)
    assert tree(rows) == before and not hidden_siblings(rows)


# ---------------------------------------------------------------- vocab
def test_vocab_full_disk_keeps_the_previous_vocabulary(tmp_path, monkeypatch):
    import safetensors.torch

    from specheads.data.vocab import load_vocab, save_vocab, select_draft_vocab

    out = tmp_path / "vocab"
    rows = [{"input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 1, 1, 1, 1]}]
    save_vocab(out, *select_draft_vocab(rows, 4, 16))
    before = tree(out)

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half")
        raise enospc(filename)

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    d2t, t2d, stats = select_draft_vocab(rows, 8, 16)
    with pytest.raises(DiskFullError) as ei:
        save_vocab(out, d2t, t2d, stats)
    assert f"disk full while writing {out / 'vocab.safetensors'}" in str(ei.value)
    assert "previous vocabulary" in str(ei.value) and "unchanged" in str(ei.value)
    assert tree(out) == before  # no temporary file left, both files as they were
    monkeypatch.undo()
    assert load_vocab(out)[2]["draft_vocab_size"] == 4


# ---------------------------------------------------------------- generating stages
def test_regenerate_append_on_a_full_quota_is_clean(tmp_path):
    from specheads.data.appendlog import append_rows
    from specheads.data.regenerate import RegenerateError

    out = tmp_path / "regenerated.jsonl"

    class Full:
        def write(self, text):
            raise OSError(errno.EDQUOT, "Disk quota exceeded")

    with pytest.raises(RegenerateError) as ei:
        append_rows(Full(), out, [{"id": "a"}], RegenerateError, "3 conversations of this run")
    assert isinstance(ei.value, DiskFullError)
    assert "3 conversations of this run are safely written, rerun the same command to resume" in str(ei.value)


# ---------------------------------------------------------------- train


def train_recipe(run_dir, **train):
    return tiny_recipe(run_dir, **{"max_steps": 8, "save_every": 4, **train})


def train(run_dir, target, vocab, **kw):
    from specheads.train import run_train

    return run_train(train_recipe(run_dir, **kw), target=target, feed=SyntheticFeed(target, seed=3), vocab=vocab,
                     progress=False)


@pytest.mark.parametrize("where", ["rank_state", "deepspeed"])
def test_full_disk_at_a_checkpoint_keeps_the_previous_one_and_resume_continues_from_it(
        target, vocab, tmp_path, monkeypatch, capsys, where):
    from deepspeed.runtime.engine import DeepSpeedEngine

    ck = tmp_path / "train" / "checkpoints"
    if where == "rank_state":
        real = torch.save

        def save(obj, f, *a, **k):
            if "step_8" in str(f):
                Path(f).write_bytes(b"half a file")
                raise enospc(f)
            return real(obj, f, *a, **k)

        monkeypatch.setattr(torch, "save", save)
    else:
        real_ds = DeepSpeedEngine.save_checkpoint

        def ds_save(self, save_dir, tag=None, **k):
            if tag == "step_8":
                Path(save_dir, tag, "mp_rank_00_model_states.pt").write_bytes(b"half")
                raise enospc(Path(save_dir, tag, "mp_rank_00_model_states.pt"))
            return real_ds(self, save_dir, tag=tag, **k)

        monkeypatch.setattr(DeepSpeedEngine, "save_checkpoint", ds_save)
    with pytest.raises(DiskFullError) as ei:
        train(tmp_path, target, vocab)
    msg = str(ei.value)
    assert f"disk full while writing {ck / 'step_8'}" in msg
    assert "the partial step_8 was removed" in msg and "previous checkpoint step_4, which is kept" in msg
    assert "train.resume=true" in msg and "about" in msg  # the bytes step_4 took
    assert (ck / "latest").read_text() == "step_4" and not (ck / "step_8").exists()
    assert not (tmp_path / "train" / "final").exists()

    monkeypatch.undo()
    capsys.readouterr()
    s = train(tmp_path, target, vocab, resume=True)
    out = capsys.readouterr()
    assert s["start_step"] == 4 and s["steps"] == 8
    assert "starting fresh" not in out.out + out.err
    assert (ck / "latest").read_text() == "step_8" and (tmp_path / "train" / "final" / "model.safetensors").is_file()


def test_full_disk_at_final_keeps_the_last_checkpoint_and_resume_writes_final(target, vocab, tmp_path, monkeypatch):
    import safetensors.torch

    def full(tensors, filename, metadata=None):
        raise enospc(filename)

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(DiskFullError) as ei:
        train(tmp_path, target, vocab, max_steps=4, save_every=1000)
    final = tmp_path / "train" / "final"
    msg = str(ei.value)
    assert f"disk full while writing {final}" in msg and f"no {final} was written" in msg
    assert "last checkpoint step_4 is complete" in msg and "train.resume=true" in msg
    assert not final.exists() and not list((tmp_path / "train").glob(".final.*"))
    monkeypatch.undo()
    s = train(tmp_path, target, vocab, max_steps=4, save_every=1000, resume=True)
    assert s["start_step"] == 4 and (final / "model.safetensors").is_file()


def test_full_disk_at_metrics_names_the_file_and_the_kept_checkpoint(target, vocab, tmp_path, monkeypatch):
    import specheads.train.run_log as run_log

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, text):
            if json.loads(text).get("step", 0) >= 6:
                raise enospc(self.f.name)
            return self.f.write(text)

        def close(self):
            self.f.close()

    monkeypatch.setattr(run_log, "open", lambda *a, **k: Full(open(*a, **k)), raising=False)
    with pytest.raises(DiskFullError) as ei:
        train(tmp_path, target, vocab, **{"logging": {"wandb": "disabled", "every": 1}})
    msg = str(ei.value)
    metrics = tmp_path / "train" / "metrics.jsonl"
    assert f"disk full while writing {metrics}" in msg
    assert "holds the rows up to step 5" in msg and "checkpoint step_4 is kept" in msg
    monkeypatch.undo()
    s = train(tmp_path, target, vocab, resume=True, **{"logging": {"wandb": "disabled", "every": 1}})
    assert s["start_step"] == 4 and s["steps"] == 8


# ---------------------------------------------------------------- export
def test_full_disk_during_export_keeps_the_old_export(tmp_path, monkeypatch, capsys):
    import specheads.formats.common as common
    from interop import tiny
    from specheads.cli import main

    tiny.fake_run(tmp_path / "run", tiny.eagle3_head())
    out = tmp_path / "out"
    args = ["export", str(tmp_path / "run" / "train"), "--format", "sglang", "--out", str(out), "--dtype", "float32"]
    assert main(args) == 0
    before = tree(out)
    capsys.readouterr()

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half")
        raise enospc(filename)

    monkeypatch.setattr(common, "save_file", full)
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith(f"specheads: DiskFullError: disk full while writing {out}")
    assert "needed" in err and "was removed and the previous export at" in err and "unchanged" in err
    assert tree(out) == before and not hidden_siblings(out)


# ---------------------------------------------------------------- eval reports
def test_eval_report_is_published_whole_and_a_full_disk_keeps_the_old_one(tmp_path, monkeypatch):
    import specheads.evaluate.report as report_mod

    out = tmp_path / "eval"
    (out / "vllm").mkdir(parents=True)
    (out / "vllm" / "plain.result.json").write_text("{}")
    report_mod.write_report({"title": "first", "runs": []}, out)
    assert json.loads((out / "report.json").read_text())["title"] == "first"
    assert (out / "vllm" / "plain.result.json").is_file() and not hidden_siblings(out)
    before = tree(out)

    real = report_mod._write_durable

    def full(path, text):
        if path.name == "report.md":
            Path(path).write_text(text[:5])
            raise enospc(path)
        return real(path, text)

    monkeypatch.setattr(report_mod, "_write_durable", full)
    with pytest.raises(DiskFullError) as ei:
        report_mod.write_report({"title": "second", "runs": []}, out)
    assert f"disk full while writing {out / 'report.md'}" in str(ei.value)
    assert "previous report" in str(ei.value) and "unchanged" in str(ei.value)
    assert tree(out) == before and not hidden_siblings(out)  # vllm/ carried back, old report intact
    monkeypatch.undo()
    report_mod.write_report({"title": "second", "runs": []}, out)
    assert json.loads((out / "report.json").read_text())["title"] == "second"
    assert (out / "vllm" / "plain.result.json").is_file()


@pytest.mark.parametrize("new_complete", [True, False])
def test_eval_report_killed_between_the_two_renames_is_mended(tmp_path, capsys, new_complete):
    """Where renameat2 cannot swap (other filesystems), publish_dir renames the old report aside, then the new
    one in: a kill between the two left no report at all, only hidden siblings. The next write puts the new
    report in place when it was complete, else the previous one back."""
    import specheads.evaluate.report as report_mod

    out = tmp_path / "eval"
    (out / "vllm").mkdir(parents=True)
    (out / "vllm" / "plain.result.json").write_text("{}")
    report_mod.write_report({"title": "first", "runs": []}, out)
    old, tmp = tmp_path / ".eval.old-999", tmp_path / ".eval.tmp-999"
    if new_complete:   # the state between the renames: vllm/ carried over into the complete new report
        report_mod.write_report({"title": "second", "runs": []}, tmp)
        os.rename(out / "vllm", tmp / "vllm")
    os.rename(out, old)
    assert not out.exists()
    report_mod._recover(out)
    assert json.loads((out / "report.json").read_text())["title"] == ("second" if new_complete else "first")
    assert (out / "vllm" / "plain.result.json").is_file() and not hidden_siblings(out)
    assert ("the new report" if new_complete else "the previous report") in capsys.readouterr().err


def test_eval_report_into_the_working_directory_or_a_link(tmp_path, monkeypatch):
    """eval.out may be the working directory (which cannot be swapped) or a symlink (published where it points)."""
    import specheads.evaluate.report as report_mod

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    paths = report_mod.write_report({"title": "here", "runs": []}, ".")
    assert json.loads((tmp_path / "report.json").read_text())["title"] == "here"
    assert paths["json"] == "report.json" and (tmp_path / "notes.txt").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]

    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    report_mod.write_report({"title": "linked", "runs": []}, "link")
    assert (tmp_path / "link").is_symlink() and json.loads((real / "report.json").read_text())["title"] == "linked"
