"""The training run: one code path for one CPU process, one GPU, or many GPUs under
``deepspeed`` / ``torchrun``.

``run_train(recipe, target=None, feed=None, eval_feed=None) -> summary``

* The head and its loss (:class:`~specheads.train.losses.Objective`) are the
  DeepSpeed engine's module (:mod:`specheads.train.engine`: process group,
  optimizer, LR schedule, precision); the target (its lm_head, and in online
  mode the whole model inside the feed) runs frozen outside the engine.
* The feed (``dump.feed.make_feed``) yields batch dicts; the trainer does not
  know whether they come from a dump or from the target online.
* One optimizer step, its metrics and the divergence check are
  :mod:`specheads.train.step`.

``_train`` is the loop; its steps are named functions: :func:`_setup` (seeds,
target, head, feeds, engine -> a :class:`Run`), :func:`_resume`,
:func:`~specheads.train.step.train_step` (one optimizer step), :func:`_log_train`,
and the ``Run`` methods ``evaluate`` (held-out eval), ``save_checkpoint`` and
``save_final``.
"""
from __future__ import annotations

import logging
import os
import random
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from specheads.dump.feed import make_feed
from specheads.errors import SpecheadsError, UsageError
from specheads.fileio import DiskFullError
from specheads.formats.trained import file_sha256
from specheads.heads.lora import merged_state_dict
from specheads.rundir import (RunDir, check_stage_inputs, client_state, compare_fingerprints, recipe_hash,
                              resume_fingerprint, stage_lock)
from specheads.target import load_target_for

from . import checkpoint as ckpt
from .budget import TimeBudget
from .builder import DRAFT_VOCAB_KINDS, BuiltHead, build_head, target_weights
from .engine import (LRLambda, deepspeed_config, device_for, distributed, effective_precision, gathered, initialize,
                     say, total_steps)
from .losses import Objective, TargetLogits, mtp_weights
from .run_log import RunLogger
from .step import (BatchError, DeviceBatches, TrainingDivergedError, Window, bucketed, check_batch, to_device,
                   train_step)

log = logging.getLogger("specheads.train")


# ---------------------------------------------------------------- the run
def _input_files(recipe) -> dict:
    """The input files a run's lineage records, by name (those that exist): the dump's ``manifest.json``
    (offline) or the token rows' ``summary.json`` (online), and the draft vocabulary (EAGLE-3)."""
    from specheads.data.prepare import SUMMARY_FILE
    from specheads.data.vocab import VOCAB_TENSORS
    from specheads.dump.store import MANIFEST

    rd = RunDir(recipe)
    files = ({"dump_manifest": rd.dump / MANIFEST} if recipe.dump.mode == "offline"
             else {"rows_summary": rd.rows / SUMMARY_FILE})
    if recipe.head.kind in DRAFT_VOCAB_KINDS:
        files["vocab"] = rd.vocab / VOCAB_TENSORS
    return files


def input_digests(recipe) -> dict:
    """{name: {path, sha256} or None} of :func:`_input_files`: ``final/meta.json``'s ``inputs``; the
    sha256 values also join the resume fingerprint as ``inputs.<name>_sha256``."""
    return {k: ({"path": str(f), "sha256": file_sha256(f)} if f.is_file() else None)
            for k, f in _input_files(recipe).items()}


class StaleDumpError(SpecheadsError, ValueError):
    """The hidden-state store was made from other token rows than the ones at ``RunDir(recipe).rows`` now."""


def _check_dump_rows(recipe) -> None:
    """Refuse a dump whose manifest records another digest of the token rows' ``summary.json`` than the
    rows now have (the rows were prepared anew after the dump). Stores that record none, or rows that are
    gone, cannot be compared and pass."""
    from specheads.data.prepare import SUMMARY_FILE
    from specheads.dump.reader import open_manifest

    rd = RunDir(recipe)
    summary = rd.rows / SUMMARY_FILE
    recorded = open_manifest(rd.dump).get("rows_summary_sha256")
    if recorded is None or not summary.is_file():
        return
    now = file_sha256(summary)
    if now != recorded:
        raise StaleDumpError(
            f"{rd.dump} was made from token rows whose {SUMMARY_FILE} had sha256 {recorded}, but {summary} now "
            f"has sha256 {now}: the rows were prepared again after the dump; rerun `specheads dump RECIPE` "
            f"(or point dump.dir at a store made from these rows)")


def _check_inputs(recipe) -> None:
    """A missing or stale store, token rows or draft vocabulary fails here, before any weights load."""
    from specheads.data.stage import check_rows, check_vocab
    from specheads.dump.reader import open_manifest
    from specheads.layer_ids import resolve_aux_layer_ids
    from specheads.rundir import check_store_identity

    if recipe.dump.mode == "offline":
        dump = RunDir(recipe).dump
        manifest = open_manifest(dump)
        check_stage_inputs(manifest.get("recipe_inputs"), recipe, "prepare", dump,
                           "specheads data prepare RECIPE` and `specheads dump RECIPE")
        # the head's layers must be in the store (a DFlash head reads five, an EAGLE-3 dump holds three)
        layers = resolve_aux_layer_ids(recipe.head.aux_layer_ids, manifest["target"]["num_layers"],
                                       kind=recipe.head.kind)
        check_store_identity(manifest, dump, expected_layer_ids=layers)
    else:
        check_rows(recipe)
    if recipe.head.kind in DRAFT_VOCAB_KINDS:
        check_vocab(recipe)
    if recipe.dump.mode == "offline":
        _check_dump_rows(recipe)


def _load_target(recipe, device):
    """The recipe's target: on the training device for online feeds, on the CPU (lm_head only) for dumps."""
    dev = str(device) if recipe.dump.mode == "online" else "cpu"
    say(f"loading target {recipe.target.source} ({recipe.target.dtype}, {dev})")
    return load_target_for(recipe, device=dev, require_chat_template=False)


@stage_lock("train")
def run_train(recipe, target=None, feed=None, eval_feed=None, *, vocab=None, progress: bool = True) -> dict:
    """Train the head the recipe describes; returns a summary dict (see :func:`_train`)."""
    with distributed():
        return _train(recipe, target, feed, eval_feed, vocab, progress)


@dataclass
class Run:
    """Everything one training run holds from :func:`_setup` to the end, and what it does besides stepping:
    held-out eval, checkpoints, ``final/``."""

    recipe: object
    rank: int
    world: int
    device: torch.device
    train_dir: Path
    precision: str  # what runs, after effective_precision
    built: BuiltHead
    feed: object
    eval_feed: object | None
    total: int  # optimizer steps of the whole run
    K: int  # TTT steps (EAGLE-3), depths (MTP) or 1 (EAGLE-1): entries of the per-step metrics
    target_logits: TargetLogits
    target_hidden: int
    engine: object  # DeepSpeed engine around the Objective
    scheduler: object
    identity: dict  # Target.identity()
    fingerprint: dict  # what a resumed run must share with its checkpoint
    t_start: float
    resume_from: Path | None = None  # the checkpoint _resume loads (chosen and verified in _setup); None: fresh
    inputs: dict | None = None  # input_digests(recipe): the lineage final/meta.json records
    logger: RunLogger | None = None
    state_bytes: int | None = None  # device memory DeepSpeed's initialize took: head weights, fp32 masters, Adam

    @property
    def cfg(self):
        return self.built.cfg

    @property
    def head_cfg(self) -> dict:
        return self.built.cfg.to_dict()

    def meta(self, step: int, extra: dict | None = None) -> dict:
        """``meta.json`` of a checkpoint or of ``final/``."""
        cfg, built = self.built.cfg, self.built
        return {"format": "specheads-train", "version": 1, "kind": cfg.kind, "step": step,
                "target": self.identity, "aux_layer_ids": list(cfg.aux_layer_ids),
                "draft_vocab_size": cfg.draft_vocab_size, "vocab": built.vocab_stats,
                "recipe": self.recipe.to_dict(), "recipe_hash": recipe_hash(self.recipe),
                "lora": self.recipe.head.lora.model_dump(mode="json") if built.lora else None,
                "warm_start": built.warm_start and {k: built.warm_start[k] for k in ("path", "format")},
                "precision": self.precision, "world_size": self.world, "inputs": self.inputs, **(extra or {})}

    def evaluate(self, step: int) -> dict | None:
        """Loss and accuracy over the held-out feed, logged as an ``eval`` row; None without one."""
        if self.eval_feed is None:
            return None
        self.engine.eval()
        win = Window(self.K, self.device)
        with torch.no_grad():
            for b in self.eval_feed:
                check_batch(b, self.built, self.target_hidden)
                b = bucketed(to_device(b, self.device), self.eval_feed)
                win.add(self.engine(b, self.target_logits(b["final"])), int(b["attention_mask"].sum()))
        self.engine.train()
        if win.n == 0:
            return None
        row = {"split": "eval", "step": step, **win.summary()}
        self.logger.log(row)
        return row

    def save_checkpoint(self, step: int, last_eval: dict | None, feed_state=None) -> Path:
        """A resumable checkpoint (collective: every rank calls it). ``feed_state``: where the feed
        resumes (the trainer's, which has read a batch ahead); default the feed's own position."""
        client = client_state(self.recipe, step, self.fingerprint, self.identity, self.head_cfg, self.world)
        if feed_state is None and hasattr(self.feed, "state_dict"):
            feed_state = self.feed.state_dict()
        rank_state = {"feed": feed_state,
                      "rng": ckpt.rng_state(), "step": step}
        return ckpt.save_checkpoint(self.engine, self.train_dir, step, client, rank_state, self.rank, self.head_cfg,
                                    self.meta(step, {"eval": last_eval}))

    def save_final(self, step: int, last_eval: dict | None) -> None:
        """``final/``: the head's weights (LoRA merged, gathered under ZeRO-3), written by rank 0."""
        with gathered(self.engine, self.recipe.train.zero_stage):
            sd = merged_state_dict(self.engine.module.head) if self.rank == 0 else None
        if self.rank == 0:
            ckpt.save_final(self.train_dir, sd, self.head_cfg, self.meta(step, {"eval": last_eval}))


def _feeds(recipe, target, feed, eval_feed, rank: int, world: int):
    """(train feed, eval feed or None): the given ones, else ``dump.feed.make_feed`` for this rank."""
    if feed is not None:
        return feed, eval_feed
    feed = make_feed(recipe, target=target, split="train", rank=rank, world_size=world)
    if eval_feed is None and recipe.train.eval_every and recipe.train.eval_fraction > 0:
        try:
            eval_feed = make_feed(recipe, target=target, split="eval", rank=rank, world_size=world)
        except (ValueError, FileNotFoundError, RuntimeError) as e:
            say(f"no held-out eval ({e})", rank)
            eval_feed = None
    return feed, eval_feed


def _setup(recipe, target, feed, eval_feed, vocab) -> Run:
    """Seeds, target, head, feeds, loss and DeepSpeed engine (this order fixes the random stream)."""
    t_start = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = device_for(int(os.environ.get("LOCAL_RANK", "0")))
    tcfg = recipe.train
    if recipe.head.kind == "dflash" and tcfg.dflash_attention == "flex" and device.type != "cuda":
        raise UsageError(f"train.dflash_attention=flex needs a CUDA device (this run trains on {device.type}): torch's "
                         f"flex attention has no backward there; use train.dflash_attention=dense")
    train_dir = RunDir(recipe).train
    # which checkpoint to resume (verified), or a refusal, before any weights load
    resume_from = _on_rank0(lambda: _choose_start(recipe, train_dir), rank, world, device)
    if rank == 0:
        train_dir.mkdir(parents=True, exist_ok=True)
    random.seed(recipe.seed)
    np.random.seed(recipe.seed)
    torch.manual_seed(recipe.seed)
    precision = effective_precision(tcfg.precision, device, rank)

    if target is None:
        if feed is None:
            _check_inputs(recipe)
        target = _load_target(recipe, device)
    elif feed is None and recipe.dump.mode == "offline":
        _check_dump_rows(recipe)
    built = build_head(recipe, target, vocab)
    cfg = built.cfg
    feed, eval_feed = _feeds(recipe, target, feed, eval_feed, rank, world)
    if len(feed) == 0:
        raise BatchError("the training feed is empty: no rows to train on")

    weights = mtp_weights(recipe.head, cfg.num_mtp_depths, tcfg.loss_decay) if cfg.kind == "mtp" else None
    objective = Objective(built.head, cfg.kind, steps=tcfg.ttt_steps, decay=tcfg.loss_decay,
                          eagle1_ce_weight=tcfg.eagle1_ce_weight, mtp_weights=weights, backend=tcfg.loss_kernel,
                          compile=tcfg.compile, static_shapes=tcfg.length_buckets is not None,
                          peagle_keep=(tcfg.peagle_keep_ratio, tcfg.peagle_keep_min),
                          dflash_anchors=tcfg.dflash_anchors, dflash_gamma=tcfg.dflash_gamma,
                          dflash_attention=tcfg.dflash_attention, seed=recipe.seed)
    K = objective.num_steps
    _, lm_w, lm_b = target_weights(target)
    target_logits = TargetLogits(lm_w, built.d2t if cfg.kind in DRAFT_VOCAB_KINDS else None, lm_b,
                                 tf32=precision == "bf16").to(device)

    total = total_steps(recipe, len(feed))
    sched = LRLambda(total, tcfg.warmup_steps, tcfg.scheduler, tcfg.min_lr_ratio)
    ds_cfg = deepspeed_config(recipe, precision)
    if ckpt.needs_universal(resume_from, world, tcfg.zero_stage):
        ds_cfg["checkpoint"] = {"load_universal": True}  # _resume re-shards ZeRO states written on another world size
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    engine, _, scheduler = initialize(objective, ds_cfg, sched, tcfg, device, rank)
    # this rank's share of the trained state (ZeRO partitions it), before any activation exists
    state_bytes = torch.cuda.memory_allocated(device) - before if before is not None else None
    identity = dict(target.identity())
    inputs = input_digests(recipe)
    fingerprint = {**resume_fingerprint(recipe, identity, built.d2t, world, precision),
                   **{f"inputs.{k}_sha256": v and v["sha256"] for k, v in inputs.items()}}
    return Run(recipe=recipe, rank=rank, world=world, device=device, train_dir=train_dir, precision=precision,
               built=built, feed=feed, eval_feed=eval_feed, total=total, K=K, target_logits=target_logits,
               target_hidden=int(target.hidden_size), engine=engine, scheduler=scheduler, identity=identity,
               fingerprint=fingerprint, t_start=t_start, state_bytes=state_bytes, resume_from=resume_from,
               inputs=inputs)


def _on_rank0(fn, rank: int, world: int, device):
    """``fn()`` run on rank 0 only; its result, or the error it raised, on every rank."""
    if world == 1 or not dist.is_initialized():
        return fn()
    box = [None]
    if rank == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as e:  # every failure reaches the other ranks, which would otherwise wait forever
            box[0] = ("error", e)
    dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value


def _choose_start(recipe, train_dir: Path) -> Path | None:
    """The verified checkpoint to resume (``train.resume``), or None for a fresh start.

    A fresh start over another run's checkpoints or ``final/`` is refused naming them, unless
    ``train.overwrite`` (they are then removed in :func:`_train`, just before the first write): a new run
    killed before it ends must not leave the old ``final/`` for ``specheads export`` to publish."""
    ckpt.recover_final(train_dir)
    if recipe.train.resume:
        tag = ckpt.select_checkpoint(train_dir, say=lambda m: say(m, 0))
        if tag is not None:
            named = ckpt.latest_checkpoint(train_dir)
            if named is None or named.resolve() != tag.resolve():
                ckpt.write_latest(train_dir, tag.name)  # `latest` names the newest checkpoint that verifies
            return tag
    old = ckpt.previous_outputs(train_dir)
    if old and not recipe.train.overwrite:
        why = ("train.resume=false" if not recipe.train.resume
               else f"train.resume=true but there is no checkpoint under {ckpt.checkpoint_root(train_dir)}")
        raise ckpt.PreviousRunError(
            f"{train_dir} holds another run's outputs: {', '.join(str(p) for p in old)}; {why} would start a new "
            f"run over them. Pass train.overwrite=true to remove them first, train.resume=true to continue "
            f"that run, or use another train.out / run_dir.")
    if recipe.train.resume:
        say(f"train.resume=true but no checkpoint under {ckpt.checkpoint_root(train_dir)}: starting fresh", 0)
    return None


def _resume(run: Run) -> int | None:
    """Load the checkpoint :func:`_choose_start` chose and verified (``train.resume``: the one ``latest``
    names, or the newest that verifies; see :func:`~specheads.train.checkpoint.select_checkpoint`) -- weights,
    optimizer, scheduler, feed position, RNG -- after checking its fingerprint (settings and the digests
    of its inputs); returns its step, or None for a fresh start.
    The checkpoint may come from another number of ranks when ranks × ``train.grad_accum`` is the same
    (see :mod:`specheads.train.checkpoint`)."""
    tag = run.resume_from
    if tag is None:
        return None
    saved = ckpt.read_client_state(tag)
    fp = dict(saved["fingerprint"])
    legacy = [k for k in run.fingerprint if k.startswith("inputs.") and k not in fp]
    if legacy:  # written before input digests were recorded: nothing to compare them with
        say(f"{tag} records no digests of its inputs ({', '.join(legacy)}): resuming without checking them",
            run.rank)
        fp.update({k: run.fingerprint[k] for k in legacy})
    compare_fingerprints(fp, run.fingerprint, str(tag))
    rank_state = ckpt.load_checkpoint(run.engine, tag, run.rank, run.world, run.recipe.train.zero_stage,
                                      say=lambda m: say(m, run.rank))
    if hasattr(run.feed, "load_state_dict") and rank_state.get("feed") is not None:
        run.feed.load_state_dict(rank_state["feed"])
    ckpt.set_rng_state(rank_state["rng"])
    step = int(saved["step"])
    saved_world = ckpt.saved_world_size(tag)
    moved = (f" (written on {saved_world} rank(s) × train.grad_accum={saved['fingerprint']['train.grad_accum']}, "
             f"now {run.world} × {run.recipe.train.grad_accum})" if saved_world != run.world else "")
    say(f"resumed from {tag} at optimizer step {step}{moved}", run.rank)
    return step


def _replan(run: Run, budget: TimeBudget, step: int, pbar) -> int:
    total = budget.plan(step, run.total)
    if total != run.total:
        say(f"train.max_minutes={run.recipe.train.max_minutes:g}: the run now ends at step {total} "
            f"(planned {budget.planned_total}); the LR schedule decays by then", run.rank)
        if pbar is not None:
            pbar.total = total
            pbar.refresh()
    return total


def _log_train(run: Run, step: int, epoch: int, win: Window, gn, lr: float, t_window: float, pbar) -> float:
    """Log the ``train`` row of the window ending at ``step``; returns its loss."""
    now = time.time()
    s = win.summary()
    row = {"split": "train", "step": step, "epoch": epoch, **s, "lr": lr, "grad_norm": gn, "tokens": win.tokens,
           "tokens_per_s": win.tokens / max(1e-9, now - t_window), "elapsed_s": now - run.t_start}
    run.logger.log(row)
    if pbar is not None:
        pbar.set_postfix(loss=f"{s['loss']:.3f}", acc0=f"{s['step_acc'][0]:.2f}",
                         tau=f"{s['sim_tau']:.2f}", tok_s=f"{row['tokens_per_s']:.0f}")
    return s["loss"]


class StepProfiler:
    """``train.profile_steps`` [first, last]: torch.profiler over those optimizer steps on rank 0,
    the operator table sorted by device time (host time on a CPU) written to
    ``{train_dir}/profile.txt`` when the window closes (or the run ends inside it)."""

    def __init__(self, window, device: torch.device, train_dir: Path, rank: int):
        self.window = tuple(window) if window is not None and rank == 0 else None
        self.device, self.path = device, Path(train_dir) / "profile.txt"
        self.prof, self.first, self.t0, self.written = None, None, 0.0, None

    def before(self, step: int) -> None:
        """Optimizer step ``step + 1`` is about to run."""
        if self.window is None or self.prof is not None or not self.window[0] <= step + 1 <= self.window[1]:
            return
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self.prof, self.first, self.t0 = profile(activities=acts), step + 1, time.time()
        self.prof.__enter__()

    def after(self, step: int, last: bool = False) -> None:
        """Optimizer step ``step`` is done; ``last``: the run ends here."""
        if self.prof is None or not (step >= self.window[1] or last):
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.time() - self.t0
        self.prof.__exit__(None, None, None)
        n = step - self.first + 1
        key = "device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(f"# torch.profiler, optimizer steps {self.first}..{step} ({n} steps, "
                             f"{1000 * wall / n:.1f} ms/step wall with the profiler on), sorted by {key}\n"
                             + self.prof.key_averages().table(sort_by=key, row_limit=40) + "\n")
        self.prof, self.window, self.written = None, None, str(self.path)


@contextmanager
def _progress_bar(run: Run, step: int, enabled: bool):
    """Rank 0's progress bar on stderr (None on other ranks or when ``enabled`` is false), closed on exit.

    DeepSpeed logs to stdout: its CPU-accelerator warning comes with ``import deepspeed`` (in
    :func:`~specheads.train.engine.distributed`, before any bar), so stdout is flushed before the bar
    starts; while the bar is up, DeepSpeed's records go through ``tqdm.write``, which clears the bar,
    writes the line and redraws the bar below it, instead of landing in the middle of the bar's line."""
    if run.rank != 0 or not enabled:
        yield None
        return
    from deepspeed.utils import logger as deepspeed_logger
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    sys.stdout.flush()
    bar = tqdm(total=run.total, initial=step, desc=f"train {run.cfg.kind}", dynamic_ncols=True, file=sys.stderr)
    try:
        with logging_redirect_tqdm(loggers=[deepspeed_logger], tqdm_class=tqdm):
            yield bar
    finally:
        bar.close()


def _train(recipe, target, feed, eval_feed, vocab, progress) -> dict:
    """Setup, resume, then optimizer steps (logging, eval and checkpoints on their schedules);
    a last eval, checkpoint and ``final/``. Returns the run's summary."""
    run = _setup(recipe, target, feed, eval_feed, vocab)
    if run.resume_from is None and recipe.train.overwrite:
        if run.rank == 0:  # the earlier run's outputs go before this run writes anything
            ckpt.remove_previous_outputs(run.train_dir, say=lambda m: say(m, 0))
        if dist.is_initialized():
            dist.barrier()
    resume_step = _resume(run)
    step = resume_step or 0
    tcfg = recipe.train
    run.logger = RunLogger(recipe, run.train_dir, rank=run.rank, resume_step=resume_step,
                           run_config={"recipe": recipe.to_dict(), "head": run.head_cfg, "target": run.identity})

    losses: list[float] = []
    tokens_total = 0
    last_eval = None
    last_saved = resume_step
    batches = DeviceBatches(run.feed, run.device, lambda b: check_batch(b, run.built, run.target_hidden))
    win = Window(run.K, run.device)  # metrics since the last logged step
    t_window = time.time()
    run.engine.train()
    if resume_step is None:
        last_eval = run.evaluate(0)  # the untrained baseline
    profiler = StepProfiler(tcfg.profile_steps, run.device, run.train_dir, run.rank)
    budget = (TimeBudget(tcfg.max_minutes, run.total, run.scheduler.lr_lambdas[0], step, run.device)
              if tcfg.max_minutes else None)
    t_loop = time.time()  # tokens/s counts the training loop (as the progress bar does), not set-up
    try:
        with _progress_bar(run, step, progress) as pbar:
            while step < run.total:
                profiler.before(step)
                gn, lr = train_step(run, batches, win, step)
                step += 1
                profiler.after(step, last=step == run.total)
                tokens_total += win.tokens
                if budget is not None and budget.spent():
                    say(f"train.max_minutes={tcfg.max_minutes:g} spent: the run ends at step {step} of {run.total}",
                        run.rank)
                    run.total = step
                if step % run.logger.every == 0 or step == run.total:
                    losses.append(_log_train(run, step, batches.epoch, win, gn, lr, t_window, pbar))
                    win = Window(run.K, run.device)
                    t_window = time.time()
                    if budget is not None and step < run.total:
                        run.total = _replan(run, budget, step, pbar)
                if pbar is not None:
                    pbar.update(1)
                if tcfg.eval_every and step % tcfg.eval_every == 0 and step < run.total:
                    last_eval = run.evaluate(step) or last_eval
                if tcfg.save_every and step % tcfg.save_every == 0 and step < run.total:
                    run.save_checkpoint(step, last_eval, batches.feed_state())
                    last_saved = step
    except TrainingDivergedError:
        run.logger.close(plot=True)
        raise
    except DiskFullError:
        run.logger.close(plot=False)  # what reached metrics.jsonl stays; no plots on a full disk
        raise
    loop_s = time.time() - t_loop

    last_eval = run.evaluate(step) or last_eval
    if last_saved != step:
        run.save_checkpoint(step, last_eval, batches.feed_state())
    run.save_final(step, last_eval)
    plots = run.logger.close(plot=True)
    if dist.is_initialized():
        dist.barrier()
    elapsed = time.time() - run.t_start
    train_dir = run.train_dir
    cuda = run.device.type == "cuda"
    return {
        "kind": run.cfg.kind, "steps": step, "start_step": resume_step or 0, "total_steps": run.total,
        "losses": losses, "final_loss": losses[-1] if losses else None, "eval": last_eval,
        "train_dir": str(train_dir), "final_dir": str(train_dir / ckpt.FINAL),
        "checkpoint": str(ckpt.checkpoint_root(train_dir) / f"step_{step}"),
        "metrics": str(train_dir / "metrics.jsonl"), "plots": [str(p) for p in plots],
        "tokens": tokens_total, "elapsed_s": elapsed, "train_loop_s": loop_s,
        "tokens_per_s": tokens_total / max(1e-9, loop_s),
        "precision": run.precision, "world_size": run.world, "epochs_seen": batches.epoch + 1,
        "state_memory_gib": run.state_bytes / 2 ** 30 if run.state_bytes is not None else None,
        # this rank's most device memory at once (the online target, activations, a DFlash step's blocks), as
        # tensors and as the allocator's reserve (what an out-of-memory error counts): the headroom a larger
        # micro-batch or more anchors has
        "peak_memory_gib": torch.cuda.max_memory_allocated(run.device) / 2 ** 30 if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(run.device) / 2 ** 30 if cuda else None,
        "profile": profiler.written,
        "time_budget": budget.summary(step) if budget is not None else None,
        # token-budget feeds: padded token slots the step computes and throws away (rows × longest row, or the
        # bucket's shape); a feed of fixed row counts may come from a store that does not list its row lengths
        "padding_fraction": run.feed.padding_fraction(0) if getattr(run.feed, "max_tokens", None) else None,
    }


