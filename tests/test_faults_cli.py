"""Fault injection through the real CLI: every stage killed with SIGKILL and resumed, every kind of artefact
corrupted, two writers at once, on the bundled SmolLM2-135M target with tiny settings.

One uninterrupted reference run is built once (``reference``) and copied for each case. Every case asserts that
nothing is lost, nothing wrong is used silently, and, where it is defined, that the result equals the
reference's; every CLI call (killed ones too) must leave no raw ``Traceback`` on stderr.

The outcome of each case is collected; with ``SPECHEADS_FAULT_TABLE=path`` set, a Markdown table of the cases
and their outcomes is written there at the end of the module (for BENCHMARKS.md's reliability section).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow  # loads SmolLM2 in ~30 CLI subprocesses (a few minutes on 2 cores)

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}

# 6 prompts × ≤8 new tokens, answered one at a time (batch 1: the file's order is the prompts' length order,
# so a resumed file can equal the uninterrupted one line for line); one row per dump shard; 6 training
# steps with a checkpoint every 2
RECIPE = """\
name: faults
run_dir: runs/faults
seed: 0
target: {source: smollm2-135m, dtype: float32, device: cpu}
data:
  sources: [{path: "builtin:demo_prompts", limit: 6}]
  max_length: 64
  holdout_fraction: 0.0
  regenerate: {enabled: true, max_new_tokens: 8, temperature: 0.0, batch_size: 1}
vocab: {draft_vocab_size: 512}
dump: {mode: offline, dtype: bfloat16, batch_tokens: 128, shard_tokens: 64}
head: {kind: eagle3}
train:
  ttt_steps: 2
  max_steps: 6
  micro_batch_size: 2
  lr: 1.0e-3
  warmup_steps: 1
  precision: fp32
  save_every: 2
  eval_every: 0
  eval_fraction: 0.0
  loss_kernel: torch
  logging: {wandb: disabled}
export: {format: speculators, k: 3, dtype: bfloat16}
"""
PIPELINE = [["data", "regenerate"], ["data", "prepare"], ["vocab"], ["dump"], ["train"], ["export"]]
N_PROMPTS, STEPS = 6, 6

# ---------------------------------------------------------------- the table of cases
RESULTS: list[tuple[str, str, str, float]] = []


@pytest.fixture(scope="module", autouse=True)
def fault_table():
    yield
    path = os.environ.get("SPECHEADS_FAULT_TABLE")
    if path and RESULTS:
        lines = ["| case | fault | outcome | s |", "|---|---|---|---:|"]
        lines += [f"| {c} | {f} | {o} | {s:.0f} |" for c, f, o, s in RESULTS]
        Path(path).write_text("\n".join(lines) + "\n")


class Case:
    def __init__(self):
        self.outcome = ""


@contextmanager
def case(name: str, fault: str):
    c, t0 = Case(), time.time()
    try:
        yield c
    except BaseException as e:
        RESULTS.append((name, fault, f"**FAILED**: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}",
                        time.time() - t0))
        raise
    RESULTS.append((name, fault, c.outcome, time.time() - t0))


# ---------------------------------------------------------------- running the CLI
class Missed(Exception):
    """The stage finished before the kill point was reached."""


def _cmd(recipe: Path | None, run_dir: Path | None, args, overrides=()) -> list[str]:
    cmd = [sys.executable, "-m", "specheads.cli", *args]
    if recipe is not None:
        cmd += [str(recipe), f"run_dir={run_dir}", *overrides]
    return cmd


def cli(ref, run_dir: Path | None, *args, overrides=(), rc: int | None = 0, recipe=True):
    """One CLI call to its end: (returncode, stdout, stderr); never a raw traceback."""
    r = subprocess.run(_cmd(ref.recipe if recipe else None, run_dir, args, overrides), capture_output=True,
                       text=True, env=ENV, cwd=REPO, timeout=600)
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    if rc is not None:
        assert r.returncode == rc, (args, r.returncode, r.stderr[-3000:])
    return r.returncode, r.stdout, r.stderr


def kill_when(ref, run_dir: Path, args, ready, overrides=(), poll: float = 0.005, timeout: float = 420) -> str:
    """Start a CLI stage, SIGKILL it as soon as ``ready()`` holds; its stderr. :class:`Missed` when it ended first."""
    log = run_dir.parent / f"{run_dir.name}.{args[-1]}.{time.monotonic_ns()}.err"
    with open(log, "w") as err:
        p = subprocess.Popen(_cmd(ref.recipe, run_dir, args, overrides), stdout=subprocess.DEVNULL, stderr=err,
                             env=ENV, cwd=REPO)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if p.poll() is not None:
                    break
                if ready():
                    os.kill(p.pid, signal.SIGKILL)
                    break
                if time.monotonic() > deadline:
                    pytest.fail(f"{args} never reached its kill point in {timeout} s")
                time.sleep(poll)
        finally:
            if p.poll() is None and time.monotonic() > deadline:
                os.kill(p.pid, signal.SIGKILL)
            p.wait()
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    if p.returncode != -signal.SIGKILL:
        raise Missed(f"{args} ended with {p.returncode} before its kill point:\n{text[-2000:]}")
    return text


def copy_run(ref, dst: Path, keep=("data", "vocab", "dump", "train", "export")) -> Path:
    """A copy of the reference run holding only the top-level outputs in ``keep``."""
    dst.mkdir(parents=True)
    for name in keep:
        if (ref.run / name).exists():
            shutil.copytree(ref.run / name, dst / name)
    return dst


def files(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def locks(d: Path) -> list[str]:
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*.specheads.lock"))


def flip(p: Path, at: int | None = None) -> None:
    b = bytearray(p.read_bytes())
    b[len(b) // 2 if at is None else at] ^= 0x01
    p.write_bytes(bytes(b))


def tensors(p: Path) -> dict:
    return load_file(str(p))


def assert_same_tensors(a: Path, b: Path) -> None:
    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k


def train_losses(run: Path) -> dict[int, float]:
    out = {}
    for line in (run / "train" / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if m.get("split") == "train":
            assert m["step"] not in out, f"step {m['step']} logged twice"
            out[m["step"]] = m["loss"]
    return out


# ---------------------------------------------------------------- the uninterrupted reference
@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    base = tmp_path_factory.mktemp("faults")
    recipe = base / "recipe.yaml"
    recipe.write_text(RECIPE)

    class Ref:
        pass

    r = Ref()
    r.base, r.recipe, r.run = base, recipe, base / "ref"
    t0 = time.time()
    for args in PIPELINE:
        cli(r, r.run, *args)
    r.seconds = time.time() - t0
    r.regenerated = (r.run / "data" / "regenerated.jsonl").read_bytes()
    assert r.regenerated.count(b"\n") == N_PROMPTS
    r.shards = sorted((r.run / "dump").glob("shard-*.safetensors"))
    assert len(r.shards) >= 4, "one row per shard: several shards to kill between"
    assert (r.run / "train" / "checkpoints" / "latest").read_text() == f"step_{STEPS}"
    assert not locks(r.run)
    return r


def nlines(p: Path) -> int:
    return p.read_bytes().count(b"\n") if p.is_file() else 0


# ================================================================ SIGKILL, then resume


def test_regenerate_killed_twice_then_resumed(ref, tmp_path):
    with case("data regenerate", "SIGKILL after ≥1 line, again after 2 more lines, rerun") as c:
        run = tmp_path / "run"
        out = run / "data" / "regenerated.jsonl"
        seen = []
        for more in (1, 2):
            have = nlines(out)
            kill_when(ref, run, ["data", "regenerate"], lambda: nlines(out) >= have + more)
            n = nlines(out)
            seen.append(n)
            assert have + more <= n < N_PROMPTS
            # what a killed run leaves is the reference's first lines (a torn last line at most beside them)
            whole = out.read_bytes()[: out.read_bytes().rindex(b"\n") + 1]
            assert ref.regenerated.startswith(whole)
        _, text, err = cli(ref, run, "data", "regenerate")
        assert "taking over the stale lock" in err and f"{seen[-1]} already done" in text
        assert out.read_bytes() == ref.regenerated  # same rows, same order: none lost, none twice
        assert not (run / "data" / "regenerated.jsonl.bad.jsonl").exists() and not locks(run)
        c.outcome = (f"killed at {seen[0]} and {seen[1]} of {N_PROMPTS} lines; rerun file byte-identical to the "
                     "uninterrupted run's (no duplicate, none lost); stale lock taken over and said")


def test_dump_killed_twice_then_resumed(ref, tmp_path):
    with case("dump", "SIGKILL after the 1st shard, again after 2 more shards, rerun") as c:
        run = copy_run(ref, tmp_path / "run", keep=("data", "vocab"))
        dump = run / "dump"
        n_shards = lambda: len(list(dump.glob("shard-*.safetensors")))  # noqa: E731 (renamed shards only)
        seen = []
        for more in (1, 2):
            have = n_shards()
            kill_when(ref, run, ["dump"], lambda: n_shards() >= have + more)
            seen.append(n_shards())
            assert json.loads((dump / "manifest.json").read_text()).get("complete") is not True
            assert seen[-1] < len(ref.shards)
        _, _, err = cli(ref, run, "dump")
        assert "taking over the stale lock" in err
        assert files(dump) == files(ref.run / "dump")  # manifest and every shard, byte for byte; no leftovers
        c.outcome = (f"killed with {seen[0]} and {seen[1]} of {len(ref.shards)} shards written; rerun store "
                     "byte-identical to the uninterrupted one (manifest + shards, no temporary files)")


def test_train_killed_twice_then_resumed(ref, tmp_path):
    with case("train", "SIGKILL after checkpoint step_2, resume, SIGKILL after step_4, resume") as c:
        run = copy_run(ref, tmp_path / "run", keep=("data", "vocab", "dump"))
        latest = run / "train" / "checkpoints" / "latest"
        for i, step in enumerate((2, 4)):
            kill_when(ref, run, ["train"], lambda: latest.is_file() and latest.read_text() == f"step_{step}",
                      overrides=["train.resume=true"] if i else [])
            assert not (run / "train" / "final").exists()
        _, out, err = cli(ref, run, "train", overrides=["train.resume=true"])
        assert "steps 4 → 6" in out  # from the step-4 checkpoint the second kill left
        # the resumed run's head and loss curve are the uninterrupted run's exactly (fp32 on the CPU)
        assert_same_tensors(run / "train" / "final" / "model.safetensors",
                            ref.run / "train" / "final" / "model.safetensors")
        assert train_losses(run) == train_losses(ref.run)
        assert not locks(run)
        c.outcome = ("killed after step_2 and after step_4 (of 6); resumed final head torch.equal to the "
                     "uninterrupted one, every step's loss logged once and equal")


def test_export_killed_keeps_the_previous_export(ref, tmp_path):
    with case("export", "SIGKILL while loading, SIGKILL with the new export half-published, rerun") as c:
        run = copy_run(ref, tmp_path / "run")
        out = run / "export" / "speculators"
        before = files(out)
        lock = run / "export" / ".speculators.specheads.lock"
        tmp = lambda: any(p.name.startswith(".speculators.tmp-") and (p / "model.safetensors").is_file()  # noqa: E731
                          for p in out.parent.iterdir())
        points = []
        for name, ready in (("lock taken", lock.is_file), ("new files written in the temporary sibling", tmp)):
            for attempt in range(3):
                try:
                    kill_when(ref, run, ["export"], ready, overrides=["export.k=5"], poll=0.002)
                    break
                except Missed:  # published before we saw it: put the reference's back and try again
                    shutil.rmtree(out)
                    shutil.copytree(ref.run / "export" / "speculators", out)
            else:
                pytest.fail(f"export always finished before the kill point ({name})")
            points.append(name)
            assert files(out) == before  # the previous export, byte for byte
            rc, text, err = cli(ref, None, "export", "--check", str(out), recipe=False)
            assert ": OK" in text and "warning" not in text.lower()
        _, _, err = cli(ref, run, "export", overrides=["export.k=5"])
        assert "taking over the stale lock" in err
        assert sorted(p.name for p in out.parent.iterdir()) == ["speculators"]  # no temporary sibling, no lock
        conf = json.loads((out / "config.json").read_text())
        assert conf["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
        rc, text, _ = cli(ref, None, "export", "--check", str(out), recipe=False)
        assert ": OK" in text
        c.outcome = (f"killed at: {'; '.join(points)}; the previous export stayed byte-identical and "
                     "`export --check` passed each time; rerun published a complete new export, no leftovers")


# ================================================================ corrupted artefacts


def test_corrupt_latest_checkpoint_falls_back(ref, tmp_path):
    with case("train resume", "a flipped byte in the latest checkpoint (step_4)") as c:
        run = copy_run(ref, tmp_path / "run", keep=("data", "vocab", "dump", "train"))
        ck = run / "train" / "checkpoints"
        # as a run killed after its step-4 checkpoint leaves it
        shutil.rmtree(run / "train" / "final")
        shutil.rmtree(ck / "step_6")
        (ck / "latest").write_text("step_4")
        bad = ck / "step_4" / "mp_rank_00_model_states.pt"
        flip(bad)
        _, out, err = cli(ref, run, "train", overrides=["train.resume=true"])
        assert f"skipping checkpoint {ck / 'step_4'}" in err and str(bad) in err
        assert f"resuming from {ck / 'step_2'}" in err and "steps 2 → 6" in out
        assert_same_tensors(run / "train" / "final" / "model.safetensors",
                            ref.run / "train" / "final" / "model.safetensors")
        assert train_losses(run) == train_losses(ref.run)
        c.outcome = ("skipped step_4 naming the file and its digests, resumed from step_2; final head "
                     "torch.equal to the uninterrupted one")


def test_corrupt_final_refused_by_export(ref, tmp_path):
    with case("export", "a flipped byte in train/final/model.safetensors") as c:
        run = copy_run(ref, tmp_path / "run")
        weights = run / "train" / "final" / "model.safetensors"
        flip(weights)
        before = files(run / "export")
        _, _, err = cli(ref, run, "export", overrides=["export.k=5"], rc=1)
        last = err.strip().splitlines()[-1]
        assert last.startswith("specheads: ") and str(weights) in last and "sha256" in last
        assert files(run / "export") == before  # nothing published from it
        c.outcome = "refused (exit 1) naming the file and its digests; the previous export untouched"


def test_corrupt_export_fails_check(ref, tmp_path):
    with case("export --check", "a flipped byte in an exported model.safetensors") as c:
        out = tmp_path / "speculators"
        shutil.copytree(ref.run / "export" / "speculators", out)
        flip(out / "model.safetensors")
        rc, text, err = cli(ref, None, "export", "--check", str(out), recipe=False, rc=None)
        assert rc != 0 and str(out / "model.safetensors") in text + err
        c.outcome = f"failed (exit {rc}) naming {out.name}/model.safetensors and the digest it differs from"


def test_corrupt_shard_refused_by_train(ref, tmp_path):
    with case("train", "a flipped byte in a dump shard") as c:
        run = copy_run(ref, tmp_path / "run", keep=("data", "vocab", "dump"))
        shard = run / "dump" / ref.shards[1].name
        flip(shard)
        _, _, err = cli(ref, run, "train", rc=1)
        last = err.strip().splitlines()[-1]  # after the target's loading lines: one line saying why
        assert last.startswith("specheads: ") and shard.name in last and "checksum mismatch" in last
        assert not (run / "train" / "final").exists() and not locks(run)
        c.outcome = f"refused (exit 1) naming {shard.name} as corrupt; nothing trained"


def _lines(b: bytes) -> list[bytes]:
    return b.splitlines(keepends=True)


@pytest.mark.parametrize("damage", ["middle", "flipped", "torn"])
def test_damaged_regenerated_lines(ref, tmp_path, damage):
    fault = {"middle": "a middle line of regenerated.jsonl made invalid JSON",
             "flipped": "a byte flipped inside a JSON string of a middle line of regenerated.jsonl (still valid JSON)",
             "torn": "a torn last line of regenerated.jsonl (cut mid-line)"}[damage]
    with case("data prepare, regenerate" if damage == "flipped" else "data regenerate", fault) as c:
        run = copy_run(ref, tmp_path / "run", keep=("data",))
        out = run / "data" / "regenerated.jsonl"
        lines = _lines(ref.regenerated)
        k = len(lines) // 2
        if damage == "middle":
            bad_line = b"z" + lines[k][1:]  # its opening brace lost: not JSON
            out.write_bytes(b"".join(lines[:k] + [bad_line] + lines[k + 1:]))
        elif damage == "flipped":
            at = lines[k].index(b'"content": "') + len(b'"content": "')
            bad_line = lines[k][:at] + bytes([lines[k][at] ^ 0x01]) + lines[k][at + 1:]
            json.loads(bad_line)
            out.write_bytes(b"".join(lines[:k] + [bad_line] + lines[k + 1:]))
            rc, _, perr = cli(ref, run, "data", "prepare", rc=None)
            assert rc != 0 and f"line {k + 1}, field '_sha256'" in perr and "does not match its content" in perr
        else:
            out.write_bytes(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
        _, _, err = cli(ref, run, "data", "regenerate")
        now = _lines(out.read_bytes())
        if damage == "flipped":
            assert f"set aside 1 bad line(s) (line {k + 1}: _sha256" in err
            assert now == lines[:k] + lines[k + 1:] + [lines[k]]
            c.outcome = (f"prepare refused (exit 1) naming line {k + 1} and its checksum; regenerate set the line aside "
                         f"and said so, kept the {len(lines) - 1} good records and generated that conversation "
                         "again, equal to the reference's")
        elif damage == "middle":
            assert f"set aside 1 bad line(s) (line {k + 1}: not JSON" in err
            aside = [json.loads(x) for x in (run / "data" / "regenerated.jsonl.bad.jsonl").read_text().splitlines()]
            assert len(aside) == 1 and aside[0]["line"] == k + 1 and aside[0]["text"].encode() + b"\n" == bad_line
            # every good record kept in place; the bad one generated again (the same answer) and appended
            assert now == lines[:k] + lines[k + 1:] + [lines[k]]
            c.outcome = (f"line {k + 1} set aside in regenerated.jsonl.bad.jsonl and said; the {len(lines) - 1} good "
                         "records kept; that conversation generated again, equal to the reference's")
        else:
            assert "dropped a torn last line" in err
            assert out.read_bytes() == ref.regenerated
            c.outcome = "torn line dropped and said; that conversation generated again: file byte-identical"
        assert not locks(run)


# ================================================================ two writers


def test_two_trains_at_once(ref, tmp_path):
    with case("train ×2", "a second `train` on the same run_dir while the first runs") as c:
        run = copy_run(ref, tmp_path / "run", keep=("data", "vocab", "dump"))
        lock = run / ".train.specheads.lock"
        err_log = tmp_path / "first.err"
        with open(err_log, "w") as err_f:
            first = subprocess.Popen(_cmd(ref.recipe, run, ["train"]), stdout=subprocess.DEVNULL, stderr=err_f,
                                     env=ENV, cwd=REPO)
            try:
                deadline = time.monotonic() + 300
                while not (lock.is_file() and f'"pid": {first.pid}' in lock.read_text()):
                    assert first.poll() is None, err_log.read_text()[-3000:]
                    assert time.monotonic() < deadline, "the first train never took its lock"
                    time.sleep(0.01)
                _, _, err = cli(ref, run, "train", rc=1)
                assert first.poll() is None, "the first train ended before the second was refused"
                assert err.startswith("specheads: RunLockedError:") and f"pid {first.pid}" in err
                assert first.wait(timeout=600) == 0
            finally:
                if first.poll() is None:
                    first.kill()
                    first.wait()
        assert "Traceback" not in err_log.read_text()
        assert_same_tensors(run / "train" / "final" / "model.safetensors",
                            ref.run / "train" / "final" / "model.safetensors")
        assert not locks(run)
        c.outcome = ("second refused at once (exit 1, RunLockedError naming the holder's pid); the first "
                     "finished normally, final head torch.equal to the reference's")
