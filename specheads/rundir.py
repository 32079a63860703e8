"""The run directory: where each stage's output lives, and what it must agree with.

One module for every fact about a run directory, in four parts:

* **paths**: :class:`RunDir` (``RunDir(recipe).rows``, ``.vocab``, ``.dump``, ``.train``,
  ``.export``, ``.eval``, ``.regenerated``, ``.synthesized``): a recipe key's value where set,
  else the output's place under ``run_dir``.
* **recorded inputs**: :func:`stage_inputs` are the recipe settings that decide what a stage
  writes. Each stage records them beside its output; the stage that reads it compares them with
  its own recipe (:func:`check_stage_inputs`, :class:`StaleInputError`), so a changed
  ``data.sources`` can never silently reuse old conversations.
* **resume fields**: :data:`RESUME_FIELDS`, :func:`resume_fingerprint`,
  :func:`compare_fingerprints`, :func:`client_state`, :func:`recipe_hash`: what a checkpoint
  records and what a run resuming it must share (:class:`ResumeMismatchError`).
* **compatibility**: :func:`check_store_identity`, :func:`check_store_compatible`,
  :func:`check_online_target`: whether a hidden-state store or token rows were made for this
  run's target and layers (:class:`DumpMismatchError`).
* **ownership**: :func:`output_lock`, :func:`stage_lock`: one writer per stage output at a time
  (:class:`RunLockedError` names the other one).

``config`` is the schema (typed fields, loading, overrides); this module reads recipes and imports
nothing of specheads but ``config`` and ``errors``: every stage depends on it, it on no stage.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import functools
import getpass
import hashlib
import inspect
import json
import os
import shlex
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from specheads.config import Recipe
from specheads.errors import DumpError, SpecheadsError

__all__ = [
    "BATCH_SPLIT", "DumpMismatchError", "LOCK_SUFFIX", "RESUME_FIELDS", "ResumeMismatchError", "RunDir",
    "RunLockedError", "STAGE_OUTPUTS", "StaleInputError", "check_online_target", "check_stage_inputs",
    "check_store_compatible", "check_store_identity", "client_state", "client_world_size", "compare_fingerprints",
    "describe_target", "lock_path", "output_lock", "read_lock", "recipe_hash", "resume_fingerprint",
    "stage_input_diff", "stage_inputs", "stage_lock", "stage_output",
]


# ================================================================ paths


@dataclass(frozen=True)
class RunDir:
    """The output paths of a recipe's run (read from the recipe on each access, so they follow its edits)."""

    recipe: Recipe

    @property
    def root(self) -> Path:
        return Path(self.recipe.run_dir)

    def path(self, *parts: str) -> Path:
        return Path(self.recipe.run_dir, *parts)

    @property
    def rows(self) -> Path:
        """Token rows (``data prepare``): ``data.rows_dir``, else ``{run_dir}/data/rows``."""
        d = self.recipe.data.rows_dir
        return Path(d) if d else self.path("data", "rows")

    @property
    def regenerated(self) -> Path:
        """The target's answers (``data regenerate``): ``data.regenerate.out``, else ``{run_dir}/data/regenerated.jsonl``."""
        r = self.recipe.data.regenerate.out
        return Path(r) if r else self.path("data", "regenerated.jsonl")

    @property
    def synthesized(self) -> Path:
        """Prompts the target wrote (``data synthesize``): ``data.synthesize.out``, else ``{run_dir}/data/synthesized.jsonl``."""
        r = self.recipe.data.synthesize.out
        return Path(r) if r else self.path("data", "synthesized.jsonl")

    @property
    def vocab(self) -> Path:
        """The draft vocabulary (``vocab``): ``vocab.out``, else ``{run_dir}/vocab``."""
        r = self.recipe.vocab.out
        return Path(r) if r else self.path("vocab")

    @property
    def dump(self) -> Path:
        """The hidden-state store (``dump``): ``dump.dir``, else ``{run_dir}/dump``."""
        r = self.recipe.dump.dir
        return Path(r) if r else self.path("dump")

    @property
    def train(self) -> Path:
        """Checkpoints, ``final/`` and metrics (``train``): ``train.out``, else ``{run_dir}/train``."""
        r = self.recipe.train.out
        return Path(r) if r else self.path("train")

    @property
    def export(self) -> Path:
        """The exported head (``export``): ``export.out``, else ``{run_dir}/export/{export.format}``."""
        r = self.recipe.export.out
        return Path(r) if r else self.path("export", self.recipe.export.format)

    @property
    def eval(self) -> Path:
        """Reports and plots (``eval``): ``eval.out``, else ``{run_dir}/eval``."""
        r = self.recipe.eval.out
        return Path(r) if r else self.path("eval")


def is_run_dir(path: str | Path) -> bool:
    """A directory laid out as a run (a stage's output folder in it) rather than a model (no config.json):
    the mistake of giving a run where a target model is asked for."""
    p = Path(path)
    return (p.is_dir() and not (p / "config.json").is_file()
            and any((p / d).is_dir() for d in ("train", "export", "dump", "data", "vocab", "eval")))


# ================================================================ recorded inputs


class StaleInputError(SpecheadsError, ValueError):
    """An earlier stage's output was made from other recipe settings than this run's."""


def stage_inputs(recipe: Recipe, stage: str) -> dict:
    """The recipe settings that decide what ``stage`` writes (dotted key -> value)."""
    d, t = recipe.data, recipe.target
    keys = {"target.source": t.source, "target.adapter": t.adapter, "target.chat_template": t.chat_template}
    if stage == "regenerate":
        g = d.regenerate
        return {**keys, "data.sources": [x.model_dump() for x in d.sources],
                "data.holdout_fraction": d.holdout_fraction, "data.regenerate.max_new_tokens": g.max_new_tokens,
                "data.regenerate.temperature": g.temperature, "data.regenerate.top_p": g.top_p,
                "data.regenerate.top_k": g.top_k, "data.regenerate.max_prompt_tokens": g.max_prompt_tokens,
                # recorded only when set, so files written before the setting existed still resume
                **({"data.regenerate.dtype": g.dtype} if g.dtype else {}),
                "seed": recipe.seed}
    if stage == "prepare":
        upstream = stage_inputs(recipe, "regenerate") if d.regenerate.enabled else {
            **keys, "data.sources": [x.model_dump() for x in d.sources]}
        return {**upstream, "data.regenerate.enabled": d.regenerate.enabled, "data.max_length": d.max_length,
                "data.holdout_fraction": d.holdout_fraction}
    if stage == "synthesize":
        # not num_prompts (a larger one extends the same file), batch_size, compile or refill_at (the
        # same output up to floating-point near-ties) or out; the seed file's content is recorded by
        # the stage itself
        s = d.synthesize.model_dump(mode="json")
        return {**keys, **{f"data.synthesize.{k}": v for k, v in s.items()
                           if k not in ("num_prompts", "batch_size", "compile", "refill_at", "out")},
                "seed": recipe.seed}
    if stage == "vocab":
        return {**stage_inputs(recipe, "prepare"), "vocab.draft_vocab_size": recipe.vocab.draft_vocab_size}
    raise ValueError(f"no recorded inputs for stage {stage!r}")


def stage_input_diff(recorded: dict | None, recipe: Recipe, stage: str) -> list[str]:
    """The dotted keys whose recorded value differs from ``recipe``'s (none when nothing was recorded)."""
    if recorded is None:
        return []
    want = json.loads(json.dumps(stage_inputs(recipe, stage)))  # the JSON form, as it was recorded
    return [k for k in sorted(set(want) | set(recorded)) if recorded.get(k) != want.get(k)]


def check_stage_inputs(recorded: dict | None, recipe: Recipe, stage: str, where: str | Path, rerun: str) -> None:
    """Refuse ``where`` (written by ``stage``) when it was made from other settings than ``recipe``'s.

    Outputs written before settings were recorded (``recorded`` is None) cannot be checked and pass.
    """
    diff = stage_input_diff(recorded, recipe, stage)
    if diff:
        want = json.loads(json.dumps(stage_inputs(recipe, stage)))
        k = diff[0]
        more = f" (and {len(diff) - 1} more: {', '.join(diff[1:])})" if len(diff) > 1 else ""
        raise StaleInputError(
            f"{where} was made with {k}={json.dumps(recorded.get(k))}, this recipe has {k}={json.dumps(want.get(k))}"
            f"{more}: rerun `{rerun}` (or point this run at another run_dir)")


# ================================================================ resume fields


class ResumeMismatchError(SpecheadsError, ValueError):
    """A checkpoint was written by another recipe, target, vocabulary or global batch than this run's."""


# Recipe fields that change what (or how) a run trains: a checkpoint resumes only when they agree.
RESUME_FIELDS = [
    "seed",
    "head",
    "train.ttt_steps", "train.loss_decay", "train.eagle1_ce_weight", "train.epochs", "train.max_steps",
    "train.micro_batch_size", "train.grad_accum", "train.max_tokens_per_batch", "train.data_fraction", "train.lr",
    "train.min_lr_ratio", "train.warmup_steps", "train.weight_decay", "train.betas", "train.grad_clip",
    "train.scheduler", "train.zero_stage", "train.precision",
    "vocab.draft_vocab_size",
    "data.max_length",
]

# How the global batch is split: each may change on resume as long as their product does not.
BATCH_SPLIT = ("world_size", "train.grad_accum")


def recipe_hash(recipe: Recipe, *sections: str) -> str:
    """Hash of the named sections (all when none), recorded in a checkpoint's client state and meta.json."""
    d = recipe.to_dict()
    if sections:
        d = {k: d[k] for k in sections}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _flatten(d, prefix=""):
    out = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = d
    return out


def resume_fingerprint(recipe: Recipe, target_identity: dict, d2t, world_size: int, precision: str) -> dict:
    """Flat {dotted key: value} of everything a resumed run must share with its checkpoint
    (``d2t``: the draft vocabulary's tensor, or None)."""
    rd = recipe.to_dict()
    fp = {}
    for f in RESUME_FIELDS:
        node = rd
        for part in f.split("."):
            node = node[part]
        fp.update(_flatten(node, f + ".") if isinstance(node, dict) else {f: node})
    fp["target.config_hash"] = target_identity.get("config_hash")
    fp["vocab.d2t_sha256"] = (hashlib.sha256(d2t.cpu().numpy().tobytes()).hexdigest()[:16]
                              if d2t is not None else None)
    fp["world_size"] = int(world_size)
    fp["effective_precision"] = precision
    return json.loads(json.dumps(fp))  # lists/tuples normalised as JSON would


def compare_fingerprints(saved: dict, current: dict, where: str) -> None:
    """Refuse to resume ``where`` when its fingerprint differs from this run's (the global batch may be
    split over another number of ranks, :data:`BATCH_SPLIT`, when its size stays)."""
    keys = sorted((set(saved) | set(current)) - set(BATCH_SPLIT))
    diffs = [f"  {k}: {saved.get(k, '<absent>')!r} (checkpoint) != {current.get(k, '<absent>')!r} (this run)"
             for k in keys if saved.get(k) != current.get(k)]
    hint = ""
    sw, sa = int(saved["world_size"]), int(saved["train.grad_accum"])
    cw, ca = int(current["world_size"]), int(current["train.grad_accum"])
    if sw * sa != cw * ca:
        diffs.append(f"  ranks × train.grad_accum: {sw} × {sa} = {sw * sa} (checkpoint) != "
                     f"{cw} × {ca} = {cw * ca} (this run)")
        hint = ("\nThe global batch (ranks × train.grad_accum × train.micro_batch_size) must stay the same for the "
                "run to continue its loss curve: ")
        hint += (f"on {cw} rank(s) pass train.grad_accum={sw * sa // cw}." if (sw * sa) % cw == 0 else
                 f"no whole train.grad_accum gives {sw * sa} on {cw} rank(s); resume on a number of ranks "
                 f"that divides {sw * sa}.")
    if diffs:
        raise ResumeMismatchError(
            f"cannot resume from {where}: it was written by a different recipe/target/vocab; "
            f"these fields differ:\n" + "\n".join(diffs) + hint +
            "\nSet train.resume=false (or use another run_dir) to start a new run, or restore the recipe.")


def client_state(recipe: Recipe, step: int, fingerprint: dict, target_identity: dict, head_config: dict,
                 world_size: int) -> dict:
    """What a checkpoint records for the run that resumes it (its ``client_state.json``)."""
    return {"step": step, "fingerprint": fingerprint, "recipe_hash": recipe_hash(recipe),
            "target": target_identity, "head_config": head_config, "world_size": world_size}


def client_world_size(client: dict) -> int:
    """The number of ranks that wrote a checkpoint, from its client state."""
    return int(client.get("world_size", client["fingerprint"]["world_size"]))


# ================================================================ compatibility


class DumpMismatchError(DumpError):
    """The store (or the token rows) belongs to another target, layer set, or dump configuration."""


def describe_target(t: dict) -> str:
    return f"{t.get('name')!r} (config_hash {t.get('config_hash')})"


def check_store_identity(manifest: dict, root, *, expected_target: dict | None = None,
                         expected_config_hash: str | None = None, expected_layer_ids=None) -> None:
    """Refuse to read a store whose states come from another target or aux layer set than expected."""
    have = manifest["target"]
    want_hash = expected_target.get("config_hash") if expected_target else expected_config_hash
    if want_hash is not None and want_hash != have.get("config_hash"):
        want = describe_target(expected_target) if expected_target else f"config_hash {want_hash}"
        raise DumpMismatchError(
            f"{root} holds hidden states of target {describe_target(have)}, but the expected target is {want}; "
            f"re-dump with this target (or point dump.dir at the right store)"
        )
    if expected_layer_ids is not None:
        missing = [i for i in expected_layer_ids if i not in manifest["aux_layer_ids"]]
        if missing:
            raise DumpMismatchError(
                f"{root} holds aux_layer_ids {manifest['aux_layer_ids']}, but the head reads "
                f"{list(expected_layer_ids)}: layer(s) {missing} are not in the store; re-dump with "
                f"dump.aux_layer_ids covering {list(expected_layer_ids)} (or train with dump.mode=online)"
            )


def check_store_compatible(existing: dict, new: dict, root: Path) -> None:
    """Refuse to add to a store (manifest ``existing``) made for another target / layer set / layout."""
    et, nt = existing["target"], new["target"]
    if et.get("config_hash") != nt.get("config_hash"):
        raise DumpMismatchError(
            f"{root} holds a dump of target {describe_target(et)}; this run's target is "
            f"{describe_target(nt)}. Use another dump.dir (or delete the old store)."
        )
    if list(existing["aux_layer_ids"]) != list(new["aux_layer_ids"]):
        raise DumpMismatchError(
            f"{root} holds a dump with aux_layer_ids {existing['aux_layer_ids']}; this run asks for "
            f"{new['aux_layer_ids']}. Use another dump.dir (or delete the old store)."
        )
    for key, what in (("dtype", "dump.dtype"), ("max_length", "data.max_length"),
                      ("shard_tokens", "dump.shard_tokens"), ("rows_sha256", "token rows (rows_sha256)")):
        if existing.get(key) != new.get(key):
            raise DumpMismatchError(
                f"{root} was written with {what} = {existing.get(key)!r}; this run has {new.get(key)!r}. "
                f"Resume with the same settings, or use another dump.dir."
            )


def check_online_target(rows_target: dict | None, target, rows_dir) -> None:
    """Online training computes the states with ``target`` itself, so nothing on disk records whose states they
    are: refuse a target other than the one the token rows were prepared for (the recipe's, which `data prepare`
    records), naming what differs. Rows given in memory record nothing and pass."""
    if not rows_target:
        return
    have = {**target.identity(), "name": getattr(target, "source", None) or target.name}
    keys = ("name", "model_type", "num_layers", "hidden_size", "vocab_size", "adapter")
    diff = [k for k in keys if k in rows_target and rows_target[k] != have.get(k)]
    if diff:
        raise DumpMismatchError(
            f"online training: the token rows at {rows_dir} were prepared for target "
            + ", ".join(f"{k}={rows_target[k]!r}" for k in diff) + ", but the target given has "
            + ", ".join(f"{k}={have.get(k)!r}" for k in diff)
            + ": train with the recipe's target (target.source, target.adapter) or rerun `specheads data prepare`")


# ================================================================ ownership
#
# One writer per stage output. A stage holds an exclusive lock on what it writes for as long as it runs:
# the lock file is ``.{name}.specheads.lock`` *beside* the output (``run/.train.specheads.lock`` for
# ``run/train``, ``run/export/.speculators.specheads.lock`` for ``run/export/speculators``, ...), not inside
# it, so that a stage may delete or replace its whole output (export publishes a new directory with a rename)
# without losing its lock. Locking each output, not the run directory, lets independent stages of one run dir
# proceed together (eval while an export runs, export of a checkpoint while training goes on), while two
# writers of the same output never do: two ``specheads train`` on one run dir, or an export writing into the
# ``eval.out`` of a running eval, are refused at once.
#
# The lock file is created atomically (O_CREAT|O_EXCL) and flock()ed by its holder; it holds JSON naming the
# holder (pid, host, command line, start time). The flock is the proof of life: the kernel drops it when the
# holder dies, however it dies, so a lock whose flock is free on this host is stale even if its pid has been
# reused, and one that is flocked is live and never stolen. A lock written on another host cannot be checked
# from here (its pid means nothing here; flock over network filesystems is not to be trusted): it is reported,
# with how to remove it, never taken. In a multi-rank job (torchrun: RANK, WORLD_SIZE) rank 0 holds the lock
# for the whole job; the other ranks take none.

LOCK_SUFFIX = ".specheads.lock"

# stage -> the RunDir property of the output it writes
STAGE_OUTPUTS = {"synthesize": "synthesized", "regenerate": "regenerated", "prepare": "rows", "vocab": "vocab",
                 "dump": "dump", "train": "train", "export": "export", "eval": "eval"}


class RunLockedError(SpecheadsError, RuntimeError):
    """Another process is writing the same stage output (or left a lock that cannot be proven stale)."""


def stage_output(recipe: Recipe, stage: str) -> Path:
    """The file or directory ``stage`` writes for ``recipe`` (what its lock guards)."""
    try:
        return getattr(RunDir(recipe), STAGE_OUTPUTS[stage])
    except KeyError:
        raise ValueError(f"no output recorded for stage {stage!r}") from None


def lock_path(output: str | Path) -> Path:
    """Where the lock of ``output`` lives: ``.{name}.specheads.lock`` in the same directory. Symbolic links
    are followed, the last one too: two names of one output (a linked run directory, a linked ``final``)
    share one lock."""
    output = Path(os.path.realpath(output))
    return output.parent / f".{output.name}{LOCK_SUFFIX}"


def _process_start(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (Linux), to tell a reused pid; None elsewhere."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2:].split()[19]
    except (OSError, ValueError, IndexError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError):
        return False
    return True


def _holder_info(stage: str, output: Path) -> dict:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in some containers
        user = None
    argv = list(sys.argv) or [sys.executable]
    if argv[0] in ("-c", "-m", ""):
        argv.insert(0, sys.executable)
    return {"pid": os.getpid(), "host": socket.gethostname(), "command": shlex.join(argv),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "stage": stage,
            "output": str(output), "user": user, "pid_start": _process_start(os.getpid()),
            "world_size": int(os.environ.get("WORLD_SIZE", "1"))}


def _read_fd(fd: int) -> dict | None:
    try:
        raw = os.pread(fd, 1 << 16, 0)
        info = json.loads(raw.decode())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return info if isinstance(info, dict) and "pid" in info else None


def read_lock(output: str | Path) -> dict | None:
    """The holder recorded in ``output``'s lock file (None when there is none, or it is unreadable)."""
    try:
        fd = os.open(lock_path(output), os.O_RDONLY)
    except OSError:
        return None
    try:
        return _read_fd(fd)
    finally:
        os.close(fd)


def describe_holder(info: dict | None) -> str:
    if not info:
        return "an unknown process (the lock file holds no readable holder)"
    return (f"pid {info.get('pid')} on host {info.get('host')} (command: {info.get('command')}; "
            f"started {info.get('started')}; stage {info.get('stage')})")


def _flock(fd: int, wait: float) -> bool:
    """Take the exclusive flock of ``fd``, polling up to ``wait`` seconds; False when another holds it."""
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def _same_file(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not unlinked or replaced by its releaser)."""
    try:
        a, b = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _make_parents(d: Path) -> list[Path]:
    """mkdir -p ``d``; the directories it created, deepest first (removed again when left empty)."""
    made, p = [], d
    while not p.exists() and p != p.parent:
        made.append(p)
        p = p.parent
    d.mkdir(parents=True, exist_ok=True)
    return made


_YOUNG_S = 2.0  # a lock file without a holder yet, younger than this, is being created: wait for it


class _Lock:
    def __init__(self, output: Path, stage: str):
        self.output, self.stage = Path(output), stage
        self.path = lock_path(output)
        self.fd: int | None = None
        self.made: list[Path] = []

    def _refuse(self, info: dict | None) -> RunLockedError:
        return RunLockedError(
            f"{self.output} is being written by another specheads process: {describe_holder(info)} "
            f"(lock {self.path}). Wait for it to finish, or write elsewhere (another run_dir or output key)")

    def _stale_verdict(self, info: dict | None, fd: int) -> str:
        """For a lock file whose flock we just got: "young" (its creator is still writing it) or the
        message to print on taking it over; RunLockedError when it may belong to a live process."""
        if info is None:
            try:
                age = time.time() - os.fstat(fd).st_mtime
            except OSError:
                age = 0.0
            if age < _YOUNG_S:
                return "young"
            return (f"specheads: taking over the lock {self.path}: it names no holder (left by a process killed "
                    "while taking it)")
        host = socket.gethostname()
        if info.get("host") != host:
            raise RunLockedError(
                f"{self.output} is locked by {describe_holder(info)}, on another host than this one ({host}): "
                f"whether that process still runs cannot be checked from here. If you know it is no longer "
                f"running, remove {self.path} and rerun")
        try:
            pid = int(info.get("pid"))
        except (TypeError, ValueError):
            pid = -1
        if _pid_alive(pid) and info.get("pid_start") is not None and _process_start(pid) == info.get("pid_start"):
            # the very process that took it is alive yet holds no flock: never steal from a live holder
            raise self._refuse(info)
        why = ("that process is no longer running" if not _pid_alive(pid) else
               f"pid {pid} is now another process")
        return f"specheads: taking over the stale lock {self.path} of {describe_holder(info)}: {why}"

    def acquire(self) -> None:
        self.made = _make_parents(self.path.parent)
        waited_until = time.monotonic() + _YOUNG_S + 1.0
        try:
            while True:
                try:
                    fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                    created = True
                except FileExistsError:
                    try:
                        fd = os.open(self.path, os.O_RDWR)
                    except FileNotFoundError:  # released meanwhile: try to create it again
                        continue
                    created = False
                try:
                    if not _flock(fd, _YOUNG_S if created else 0.0):
                        info = _read_fd(fd)
                        if info is None and time.monotonic() < waited_until:
                            os.close(fd)  # its holder has not written itself in yet: read it again
                            time.sleep(0.05)
                            continue
                        raise self._refuse(info)
                    if not _same_file(self.path, fd):  # its holder released (unlinked) it before our flock
                        os.close(fd)
                        continue
                    if not created:
                        verdict = self._stale_verdict(_read_fd(fd), fd)
                        if verdict == "young":
                            os.close(fd)
                            time.sleep(0.05)
                            continue
                        print(verdict, file=sys.stderr, flush=True)
                    data = (json.dumps(_holder_info(self.stage, self.output), indent=1) + "\n").encode()
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, data, 0)
                    os.fsync(fd)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                    raise
                self.fd = fd
                return
        except BaseException:
            self._remove_made()
            raise

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            if _same_file(self.path, fd):  # unlink first: a waiter that flocks after us sees it gone and retries
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
        finally:
            os.close(fd)
            self._remove_made()

    def _remove_made(self) -> None:
        for d in self.made:  # directories made only for the lock, still empty: as they were
            try:
                d.rmdir()
            except OSError:
                break
        self.made = []


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


@contextlib.contextmanager
def output_lock(output: str | Path, stage: str, *, rank: int | None = None):
    """Hold the exclusive lock of ``output`` (a stage's output file or directory) for the ``with`` block.

    :class:`RunLockedError` at once when a live process holds it, naming it (pid, host, command, start);
    a lock left by a dead process of this host is taken over (and that is printed to stderr); one from
    another host is refused, never taken. Released on leaving the block, exceptions included. Ranks other
    than 0 (``rank``, else ``$RANK``) take none: rank 0 holds it for the job.
    """
    if (rank if rank is not None else _rank()) != 0:
        yield None
        return
    lock = _Lock(Path(output), stage)
    lock.acquire()
    try:
        yield lock
    finally:
        lock.release()


def stage_lock(stage: str):
    """Decorator of a ``run_<stage>(recipe, ...)`` entry: the call holds :func:`output_lock` on the stage's
    output (:func:`stage_output`) from start to end. A ``rank`` argument, when the entry takes one and it
    is given, decides which process holds it (else ``$RANK``)."""
    if stage not in STAGE_OUTPUTS:
        raise ValueError(f"no output recorded for stage {stage!r}")

    def wrap(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def locked(*args, **kwargs):
            bound = sig.bind_partial(*args, **kwargs).arguments
            recipe = bound["recipe"] if "recipe" in bound else args[0]
            with output_lock(stage_output(recipe, stage), stage, rank=bound.get("rank")):
                return fn(*args, **kwargs)

        locked.stage_lock = stage
        return locked

    return wrap
