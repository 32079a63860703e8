"""Faults: one writer per stage output (specheads.rundir's locks) and an export published whole, with checksums
(specheads/export/stage.py). Tiny heads on the CPU; a few CLI/holder subprocesses."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specheads import fileio
from specheads.cli import STAGE_ENTRIES, main, stage_entry
from specheads.config import load_recipe
from specheads.export import stage
from specheads.rundir import RunDir, RunLockedError, lock_path, output_lock, read_lock, stage_output
from interop import tiny

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"),
                                                    os.environ.get("PYTHONPATH", "")])}
# cli stage command -> the rundir stage whose output it writes
RUNDIR_STAGE = {"data prepare": "prepare", "data regenerate": "regenerate", "data synthesize": "synthesize",
                "vocab": "vocab", "dump": "dump", "train": "train", "export": "export", "eval": "eval"}

HOLD = """
import sys
from specheads.rundir import output_lock
with output_lock(sys.argv[1], sys.argv[2]):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes our stdin
"""


@contextlib.contextmanager
def held_by_another_process(output, stage_name="train"):
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(output), stage_name], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=ENV, cwd=REPO)
    try:
        assert p.stdout.readline().strip() == "held"
        yield p
    finally:
        p.stdin.close()
        p.wait(timeout=60)


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def recipe_of(run_dir, *overrides):
    return load_recipe(None, [f"run_dir={run_dir}", *overrides])


def snapshot(d: Path) -> dict:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def write_lock(output, **holder) -> Path:
    path = lock_path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    info = {"pid": 1, "host": socket.gethostname(), "command": "specheads train old.yaml",
            "started": "2020-01-01T00:00:00+00:00", "stage": "train", "output": str(output), **holder}
    path.write_text(json.dumps(info))
    return path


@pytest.fixture
def run(tmp_path):
    head = tiny.eagle3_head()
    tiny.fake_run(tmp_path / "run", head)
    return tmp_path / "run", head


# ================================================================ one writer per output


def test_second_writer_refused_naming_the_holder(run, tmp_path, capsys):
    run_dir, _ = run
    recipe = recipe_of(run_dir)
    yaml = tmp_path / "r.yaml"
    yaml.write_text(f"run_dir: {run_dir}\n")
    with held_by_another_process(RunDir(recipe).train, "train") as holder:
        info = read_lock(RunDir(recipe).train)
        assert info["pid"] == holder.pid and info["host"] == socket.gethostname() and info["stage"] == "train"
        with pytest.raises(RunLockedError) as e:
            stage_entry("train")(recipe)
        msg = str(e.value)
        assert f"pid {holder.pid} on host {socket.gethostname()}" in msg
        assert "command: " in msg and "-c" in msg and f"started {info['started']}" in msg
        assert str(lock_path(RunDir(recipe).train)) in msg
        # the CLI: exit 1, one line naming the holder
        assert main(["train", str(yaml)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("specheads: RunLockedError:") and f"pid {holder.pid}" in err and err.count("\n") == 1
        # --dry-run takes no lock
        assert main(["train", str(yaml), "--dry-run"]) == 0
        # another output of the same run dir is free: the export of the trained head goes ahead meanwhile
        assert main(["export", str(run_dir)]) == 0
        assert (run_dir / "export" / "speculators" / "config.json").is_file()
    assert not lock_path(RunDir(recipe).train).exists()  # released with its holder
    assert not lock_path(RunDir(recipe).export).exists()  # and ours on return


def test_cli_subprocess_refused_while_this_process_holds_it(run):
    run_dir, _ = run
    out = RunDir(recipe_of(run_dir)).export
    before = sorted(p.name for p in out.parent.iterdir()) if out.parent.exists() else None
    with output_lock(out, "export"):
        r = subprocess.run([sys.executable, "-m", "specheads.cli", "export", str(run_dir)], capture_output=True,
                           text=True, env=ENV, cwd=REPO, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "RunLockedError" in r.stderr and f"pid {os.getpid()} on host {socket.gethostname()}" in r.stderr
    assert not out.exists()  # the refused export wrote nothing
    assert (sorted(p.name for p in out.parent.iterdir()) if out.parent.exists() else None) == before


@pytest.mark.parametrize("command", list(STAGE_ENTRIES))
def test_every_writing_stage_takes_its_lock(tmp_path, command):
    recipe = recipe_of(tmp_path / "run", "eval.out=" + str(tmp_path / "run" / "eval"))
    entry = stage_entry(command)
    assert entry.stage_lock == RUNDIR_STAGE[command]
    with output_lock(stage_output(recipe, RUNDIR_STAGE[command]), "holder"):
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()} on host"):
            entry(recipe)  # refused before reading or loading anything


def test_independent_outputs_and_rank_zero(tmp_path, monkeypatch):
    recipe = recipe_of(tmp_path / "run")
    outputs = {s: stage_output(recipe, s) for s in RUNDIR_STAGE.values()}
    assert len({lock_path(o) for o in outputs.values()}) == len(outputs)  # one lock per output
    assert lock_path(outputs["train"]) == tmp_path / "run" / ".train.specheads.lock"
    with contextlib.ExitStack() as stack:  # every stage of one run dir may hold its own at once
        for s, o in outputs.items():
            stack.enter_context(output_lock(o, s))
    # torchrun: rank 0 holds it for the job, the other ranks take none
    monkeypatch.setenv("RANK", "1")
    with output_lock(outputs["train"], "train") as lk:
        assert lk is None and not lock_path(outputs["train"]).exists()
    monkeypatch.setenv("RANK", "0")
    with output_lock(outputs["train"], "train") as lk:
        assert lk is not None and read_lock(outputs["train"])["pid"] == os.getpid()
    assert not lock_path(outputs["train"]).exists()
    assert not (tmp_path / "run").exists()  # the directories made for the locks alone are gone again


def test_released_on_exception(tmp_path):
    out = tmp_path / "x" / "train"
    with pytest.raises(KeyError):
        with output_lock(out, "train"):
            raise KeyError("boom")
    assert not lock_path(out).exists()
    with output_lock(out, "train"):
        pass


def test_two_names_of_one_output_share_its_lock(tmp_path):
    """Before: a linked output (runs/b/train -> runs/a/train) and a linked run directory each had a lock of
    their own, so two writers of one directory both went ahead."""
    real = tmp_path / "a" / "train"
    real.mkdir(parents=True)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "train").symlink_to(real)          # the output itself is a link
    (tmp_path / "c").symlink_to(tmp_path / "a")          # a directory above it is
    with output_lock(real, "train"):
        for alias in (tmp_path / "b" / "train", tmp_path / "c" / "train"):
            assert lock_path(alias) == lock_path(real)
            with pytest.raises(RunLockedError, match=f"pid {os.getpid()}"):
                with output_lock(alias, "train"):
                    pass
    with output_lock(tmp_path / "b" / "train", "train"):  # released: the other name takes it
        assert read_lock(real)["pid"] == os.getpid()


def test_stale_lock_of_dead_pid_taken_over(run, capsys):
    run_dir, _ = run
    recipe = recipe_of(run_dir)
    pid = dead_pid()
    lock = write_lock(RunDir(recipe).export, pid=pid, stage="export")
    assert stage.run_export(recipe, echo=False) == RunDir(recipe).export
    err = capsys.readouterr().err
    assert f"taking over the stale lock {lock}" in err and f"pid {pid} on host {socket.gethostname()}" in err
    assert "no longer running" in err
    assert not lock.exists()


def test_stale_lock_of_reused_pid_taken_over(tmp_path, capsys):
    out = tmp_path / "train"
    # a live pid (ours) that is not the process that wrote the lock (another start time), and no flock held
    lock = write_lock(out, pid=os.getpid(), pid_start="1")
    with output_lock(out, "train"):
        assert read_lock(out)["command"] != "specheads train old.yaml"
    assert "is now another process" in capsys.readouterr().err and not lock.exists()


def test_lock_of_another_host_refused_not_taken(run):
    run_dir, _ = run
    recipe = recipe_of(run_dir)
    out = RunDir(recipe).export
    lock = write_lock(out, pid=4242, host="gpu-node-17.example")
    before = lock.read_bytes()
    with pytest.raises(RunLockedError) as e:
        stage.run_export(recipe, echo=False)
    msg = str(e.value)
    assert "pid 4242 on host gpu-node-17.example" in msg and "another host" in msg
    assert f"remove {lock}" in msg
    assert lock.read_bytes() == before and not out.exists()


# ================================================================ the export is published whole


def test_export_killed_midway_leaves_the_old_export(run, monkeypatch, capsys):
    run_dir, _ = run
    out = stage.run_export(recipe_of(run_dir), echo=False)
    old = snapshot(out)
    listing = sorted(p.name for p in out.parent.iterdir())

    def killed(d, *a, **k):  # the new weights, config and side file are written by now
        assert (Path(d) / "model.safetensors").is_file() and Path(d) != out
        raise RuntimeError("killed")

    monkeypatch.setattr(stage.card, "write_card", killed)
    with pytest.raises(RuntimeError, match="killed"):
        stage.run_export(recipe_of(run_dir, "export.k=5", "export.dtype=float32"), echo=False)
    assert snapshot(out) == old
    assert sorted(p.name for p in out.parent.iterdir()) == listing  # no temporary sibling, no lock
    monkeypatch.undo()
    capsys.readouterr()
    assert main(["export", "--check", str(out)]) == 0
    text = capsys.readouterr().out
    assert ": OK" in text and "warning" not in text and "sha256 of every file" in text


KILL = """
import os, sys
from specheads.config import load_recipe
from specheads.export import stage
real = stage.save
def save_then_die(*a, **k):
    real(*a, **k)
    os._exit(9)  # SIGKILL-like: no finally, no atexit
stage.save = save_then_die
stage.run_export(load_recipe(None, [f"run_dir={sys.argv[1]}", "export.k=5"]), echo=False)
"""


def test_export_killed_for_real_then_rerun(run, capsys):
    run_dir, _ = run
    out = stage.run_export(recipe_of(run_dir), echo=False)
    old = snapshot(out)
    r = subprocess.run([sys.executable, "-c", KILL, str(run_dir)], env=ENV, cwd=REPO, timeout=300,
                       capture_output=True, text=True)
    assert r.returncode == 9, r.stderr
    left = sorted(p.name for p in out.parent.iterdir())
    assert ".speculators.tmp-" in " ".join(left) and ".speculators.specheads.lock" in left
    assert snapshot(out) == old  # the previous export, byte for byte
    capsys.readouterr()
    assert main(["export", "--check", str(out)]) == 0
    assert "warning" not in capsys.readouterr().out  # the leftover sibling is not read as part of it
    # the next export takes the dead run's lock over, removes its leftovers and publishes the new head
    stage.run_export(recipe_of(run_dir, "export.k=5"), echo=False)
    err = capsys.readouterr().err
    assert "taking over the stale lock" in err and "left by a killed export" in err
    assert sorted(p.name for p in out.parent.iterdir()) == ["speculators"]
    c = json.loads((out / "config.json").read_text())
    assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5


def test_publish_without_an_atomic_swap(run, monkeypatch, capsys):
    """Where the filesystem cannot swap two directories the old export is renamed aside first; killed between
    the two renames, the next export puts it back before anything else."""
    run_dir, _ = run
    out = stage.run_export(recipe_of(run_dir), echo=False)
    monkeypatch.setattr(fileio, "exchange_dirs", lambda a, b: False)
    stage.run_export(recipe_of(run_dir, "export.k=4"), echo=False)
    assert json.loads((out / "config.json").read_text())["speculators_config"]["proposal_methods"][0][
        "speculative_tokens"] == 4
    assert sorted(p.name for p in out.parent.iterdir()) == ["speculators"]
    old = snapshot(out)
    aside = out.parent / ".speculators.old-999999"
    out.rename(aside)  # as a kill between the two renames leaves it
    (out.parent / ".speculators.tmp-999999").mkdir()
    stage.clear_leftovers(out)
    assert snapshot(out) == old and sorted(p.name for p in out.parent.iterdir()) == ["speculators"]
    assert "restored" in capsys.readouterr().err


def test_failed_validation_is_not_published(run, monkeypatch):
    run_dir, _ = run
    out = stage.run_export(recipe_of(run_dir), echo=False)
    old = snapshot(out)
    real = stage.validate.check

    def failing(d, **kw):
        rep = real(d, **kw)
        rep.errors.append(f"{d}: made up")
        return rep

    monkeypatch.setattr(stage.validate, "check", failing)
    with pytest.raises(stage.ExportError, match="not published") as e:
        stage.run_export(recipe_of(run_dir, "export.k=6"), echo=False)
    assert f"{out}: made up" in str(e.value) and ".tmp-" not in str(e.value)
    assert snapshot(out) == old and sorted(p.name for p in out.parent.iterdir()) == ["speculators"]


def test_output_that_is_not_an_export_is_never_replaced(run, tmp_path):
    run_dir, _ = run
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(stage.ExportError, match="not an export directory"):
        stage.run_export(recipe_of(run_dir, f"export.out={mine}"), echo=False)
    with pytest.raises(stage.ExportError, match="not an export directory"):
        stage.run_convert(stage.run_export(recipe_of(run_dir), echo=False), "sglang", mine, echo=False)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


# ================================================================ checksums and lineage


def test_checksums_and_lineage_recorded(run, tmp_path):
    run_dir, _ = run
    out = stage.run_export(recipe_of(run_dir), echo=False)
    side = json.loads((out / "specheads.json").read_text())
    files = sorted(p.name for p in out.iterdir() if p.name != "specheads.json")
    assert sorted(side["checksums"]) == files and "model.safetensors" in files and "README.md" in files
    for name, sha in side["checksums"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == sha
    assert ".tmp-" not in (out / "README.md").read_text()  # the card names the published folder
    final = run_dir / "train" / "final"
    lin = side["lineage"]
    assert lin["source"] == str(final.resolve()) and lin["kind"] == "final" and lin["step"] == 7
    assert lin["sha256"]["model.safetensors"] == hashlib.sha256((final / "model.safetensors").read_bytes()).hexdigest()
    recorded = json.loads((final / "meta.json").read_text()).get("checksums")
    assert lin["sha256_by"] == ("train" if recorded else "export")  # the trainer's digest is read, not redone
    # a conversion records the export it was made from, and that export's own lineage
    sg = stage.run_convert(out, "sglang", tmp_path / "sg", dtype="float32", echo=False)
    sside = json.loads((sg / "specheads.json").read_text())
    assert sside["lineage"]["kind"] == "export" and sside["lineage"]["made_from"] == lin
    assert sside["lineage"]["sha256"]["model.safetensors"] == side["checksums"]["model.safetensors"]
    assert sorted(sside["checksums"]) == sorted(p.name for p in sg.iterdir() if p.name != "specheads.json")


def test_check_names_a_flipped_byte(run, capsys):
    run_dir, _ = run
    out = stage.run_export(recipe_of(run_dir), echo=False)
    w = out / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 0x01  # in the tensor data: the file still parses and every shape still fits
    w.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["export", "--check", str(out)]) == 1
    text = capsys.readouterr().out
    assert "FAILED" in text and f"error: {w}: sha256" in text and "differs from the" in text
    # a file the export did not write is only reported
    w.write_bytes(bytes(data[:-1] + bytes([data[-1] ^ 0x01])))
    (out / "model.safetensors.tmp").write_bytes(b"stray")
    assert main(["export", "--check", str(out)]) == 0
    text = capsys.readouterr().out
    assert "OK" in text and "model.safetensors.tmp: not written by the export" in text
    # a missing file is named too
    (out / "README.md").unlink()
    assert main(["export", "--check", str(out)]) == 1
    assert f"{out / 'README.md'}: missing" in capsys.readouterr().out


def test_card_rewritten_later_keeps_the_checksums_true(run, tmp_path, capsys):
    """``specheads eval --update-card`` rewrites README.md of a sealed export: its sha256 follows."""
    from specheads.formats.card import write_card

    run_dir, _ = run
    out = stage.run_export(recipe_of(run_dir), echo=False)
    card_before = (out / "README.md").read_bytes()
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"runs": [{"name": "head k=3 greedy", "metrics": {"tau": 2.5}}]}))
    write_card(out, report_json=report)
    assert (out / "README.md").read_bytes() != card_before
    capsys.readouterr()
    assert main(["export", "--check", str(out)]) == 0
