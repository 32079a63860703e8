"""The training loop: one code path for one CPU process, one GPU, or many GPUs under
``deepspeed`` / ``torchrun``.

``run_train(recipe, target=None, feed=None, eval_feed=None) -> summary``

* Without a launcher the process sets ``MASTER_ADDR/PORT, RANK=0,
  WORLD_SIZE=1, LOCAL_RANK=0`` (only where absent, restored afterwards)
  and calls ``deepspeed.init_distributed``; it destroys the process group
  it created at the end.
* The head and its loss (:class:`~specheads.train.losses.Objective`) are the
  DeepSpeed engine's module; the target (its lm_head, and in online mode the
  whole model inside the feed) runs frozen outside the engine.
* The feed (``dump.feed.make_feed``) yields batch dicts; the trainer does not
  know whether they come from a dump or from the target online.
* Optimizer: DeepSpeed AdamW (betas, weight decay on ≥2-D weights only);
  LR: linear warmup then cosine / linear decay to ``min_lr_ratio·lr`` (or
  constant), a ``LambdaLR`` DeepSpeed steps at each optimizer step.
* bf16 per ``train.precision`` on GPUs that support it; on a CPU the run
  falls back to fp32 and says so.

``_train`` is the loop; its steps are named functions: :func:`_setup` (seeds,
target, head, feeds, engine -> a :class:`Run`), :func:`_resume`,
:func:`_train_step` (one optimizer step), :func:`_log_train`, and the
``Run`` methods ``evaluate`` (held-out eval), ``save_checkpoint`` and ``save_final``.
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import socket
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from specheads.dump.feed import make_feed, pad_batch
from specheads.errors import SpecheadsError
from specheads.export.trained import merged_state_dict
from specheads.target import load_target_for

from . import checkpoint as ckpt
from .builder import BuiltHead, build_head, target_weights
from .losses import Objective, TargetLogits, mtp_weights, simulated_tau
from .run_log import RunLogger

log = logging.getLogger("specheads.train")


class TrainingDivergedError(SpecheadsError, RuntimeError):
    """Loss or gradient norm became NaN/inf. Nothing was saved from the bad state."""

    def __init__(self, msg: str, step: int, rows=None):
        super().__init__(msg)
        self.step = step
        self.rows = rows


class BatchError(SpecheadsError, ValueError):
    pass


def _say(msg: str, rank: int = 0) -> None:
    if rank == 0:
        print(f"[specheads.train] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- distributed
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def distributed():
    """Initialise torch.distributed through DeepSpeed; single-process defaults without a launcher."""
    if dist.is_available() and dist.is_initialized():
        yield False
        return
    set_env = {}
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        defaults = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
                    "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
        for k, v in defaults.items():
            if k not in os.environ:
                os.environ[k] = v
                set_env[k] = v
    import deepspeed

    deepspeed.init_distributed()
    try:
        yield True
    finally:
        if dist.is_initialized():
            # deepspeed.comm's destroy wraps torch.distributed.destroy_process_group and also drops
            # DeepSpeed's cached group handles, so a later run in this process starts clean.
            import deepspeed.comm as ds_comm

            try:
                ds_comm.destroy_process_group()
            except Exception:  # noqa: BLE001
                if dist.is_initialized():
                    dist.destroy_process_group()
        for k in set_env:
            os.environ.pop(k, None)


def _device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _allreduce(t: torch.Tensor, op=None) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t


# ---------------------------------------------------------------- schedule / config
class LRLambda:
    """Multiplier of the peak LR at optimizer step s (a class so LambdaLR can checkpoint it)."""

    def __init__(self, total: int, warmup: int, kind: str, min_ratio: float):
        self.total, self.warmup, self.kind, self.min_ratio = int(total), int(warmup), kind, float(min_ratio)

    def __call__(self, s: int) -> float:
        if self.warmup > 0 and s < self.warmup:
            return (s + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        p = min(1.0, (s - self.warmup) / max(1, self.total - self.warmup))
        if self.kind == "cosine":
            return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * p))
        return 1.0 - (1 - self.min_ratio) * p


def effective_precision(requested: str, device: torch.device, rank: int = 0) -> str:
    if requested == "bf16":
        if device.type != "cuda":
            _say("train.precision=bf16 is not used on a CPU: training in fp32", rank)
            return "fp32"
        if not torch.cuda.is_bf16_supported():
            _say("this GPU has no bf16: training in fp32", rank)
            return "fp32"
    return requested


def deepspeed_config(recipe, precision: str) -> dict:
    t = recipe.train
    return {
        "train_micro_batch_size_per_gpu": int(t.micro_batch_size),
        "gradient_accumulation_steps": int(t.grad_accum),
        "gradient_clipping": float(t.grad_clip),
        "zero_optimization": {"stage": int(t.zero_stage)},
        "bf16": {"enabled": precision == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": float(t.lr), "betas": [float(b) for b in t.betas],
                                                   "eps": 1e-8, "weight_decay": float(t.weight_decay)}},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def param_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for _, p in module.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ValueError("the head has no trainable parameters")
    return groups


def total_steps(recipe, n_batches: int) -> int:
    t = recipe.train
    if t.max_steps is not None:
        return int(t.max_steps)
    return max(1, math.ceil(n_batches * float(t.epochs) / int(t.grad_accum)))


# ---------------------------------------------------------------- batches
def _to_device(batch: dict, device: torch.device) -> dict:
    out = {}
    for k, v in batch.items():
        out[k] = v.to(device, non_blocking=True) if torch.is_tensor(v) else v
    if "attention_mask" not in out or out["attention_mask"] is None:
        out["attention_mask"] = torch.ones_like(out["input_ids"])
    return out


def _bucketed(batch: dict, feed) -> dict:
    """The batch at the feed's bucket shape (``train.length_buckets``), else as it is. Real tokens are
    counted before: filler rows and positions have attention mask 0."""
    shape = getattr(feed, "padded_shape", None)
    if shape is None:
        return batch
    B, T = batch["input_ids"].shape
    return pad_batch(batch, *shape(B, T))


def _row_ids(batch: dict):
    for k in ("row_index", "row_ids", "row_id", "ids", "index", "indices"):
        if k in batch:
            v = batch[k]
            return v.tolist() if torch.is_tensor(v) else v
    return None


def check_batch(batch: dict, built: BuiltHead, target_hidden: int) -> None:
    """Catch a dump written for another target or layer set before it reaches the head."""
    cfg = built.cfg
    missing = [k for k in ("input_ids", "loss_mask", "final") + (("aux",) if cfg.kind == "eagle3" else ())
               if k not in batch]
    if missing:
        raise BatchError(f"training batch lacks {missing} (got keys {sorted(batch)})")
    B, T = batch["input_ids"].shape
    if batch["final"].shape[-1] != target_hidden:
        raise BatchError(f"batch 'final' states have width {batch['final'].shape[-1]} but the target's hidden "
                         f"size is {target_hidden}: the data was produced by another target")
    if cfg.kind == "eagle3":
        want = cfg.num_aux * cfg.target_hidden_size
        got = batch["aux"].shape[-1]
        if got != want:
            raise BatchError(f"batch 'aux' states have width {got} but the head expects {cfg.num_aux} aux layers "
                             f"{cfg.aux_layer_ids} × {cfg.target_hidden_size} = {want}: the dump was written "
                             f"for another target or aux layer set (re-run `specheads dump` or fix "
                             f"head.aux_layer_ids)")
    for k in ("loss_mask", "attention_mask", "aux", "final"):
        if k in batch and batch[k] is not None and tuple(batch[k].shape[:2]) != (B, T):
            raise BatchError(f"batch {k!r} has shape {tuple(batch[k].shape)}, expected [{B}, {T}, ...]")
    if int(batch["input_ids"].max()) >= cfg.target_vocab_size:
        raise BatchError(f"token id {int(batch['input_ids'].max())} ≥ target vocab {cfg.target_vocab_size}: "
                         f"the data was tokenised for another target")


class Window:
    """Sums over the micro-batches of one (or more) optimizer steps."""

    def __init__(self, K: int, device):
        self.K = K
        self.loss = torch.zeros((), dtype=torch.float64, device=device)
        self.step_loss = torch.zeros(K, dtype=torch.float64, device=device)
        self.hits = torch.zeros(K, dtype=torch.float64, device=device)
        self.counts = torch.zeros(K, dtype=torch.float64, device=device)
        self.extra: dict = {}
        self.n = 0
        self.tokens = 0

    def add(self, out, tokens: int) -> None:
        self.loss += out.loss.detach().double()
        self.step_loss += torch.stack([x.double() for x in out.step_losses])
        self.hits += torch.stack([h.double() for h in out.hits])
        self.counts += torch.stack([c.double() for c in out.counts])
        for k, v in out.extra.items():
            self.extra[k] = self.extra.get(k, 0.0) + torch.as_tensor(v, device=self.loss.device).detach().double()
        self.n += 1
        self.tokens += tokens

    def summary(self, reduce: bool = True) -> dict:
        vec = torch.cat([self.loss[None], self.step_loss, self.hits, self.counts,
                         torch.tensor([float(self.n)], dtype=torch.float64, device=self.loss.device)])
        if reduce:
            vec = _allreduce(vec)
        K = self.K
        n = max(1.0, float(vec[-1]))
        hits, counts = vec[1 + K:1 + 2 * K], vec[1 + 2 * K:1 + 3 * K]
        acc = [float(h / c) if c > 0 else 0.0 for h, c in zip(hits, counts)]
        return {"loss": float(vec[0]) / n, "step_loss": [float(x) / n for x in vec[1:1 + K]],
                "step_acc": acc, "sim_tau": simulated_tau(acc), "positions": int(counts[0]),
                **{k: float(v) / max(1, self.n) for k, v in self.extra.items()}}


# ---------------------------------------------------------------- the run
def _check_inputs(recipe) -> None:
    """A missing or stale store, token rows or draft vocabulary fails here, before any weights load."""
    from specheads.config import check_stage_inputs
    from specheads.data.stage import check_rows, check_vocab
    from specheads.dump.reader import open_manifest

    if recipe.dump.mode == "offline":
        manifest = open_manifest(recipe.dump_dir)
        check_stage_inputs(manifest.get("recipe_inputs"), recipe, "prepare", recipe.dump_dir,
                           "specheads data prepare RECIPE` and `specheads dump RECIPE")
    else:
        check_rows(recipe)
    if recipe.head.kind == "eagle3":
        check_vocab(recipe)


def _load_target(recipe, device):
    """The recipe's target: on the training device for online feeds, on the CPU (lm_head only) for dumps."""
    dev = str(device) if recipe.dump.mode == "online" else "cpu"
    _say(f"loading target {recipe.target.source} ({recipe.target.dtype}, {dev})")
    return load_target_for(recipe, device=dev, require_chat_template=False)


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
                "recipe": self.recipe.to_dict(), "recipe_hash": self.recipe.hash(),
                "lora": self.recipe.head.lora.model_dump(mode="json") if built.lora else None,
                "warm_start": built.warm_start and {k: built.warm_start[k] for k in ("path", "format")},
                "precision": self.precision, "world_size": self.world, **(extra or {})}

    def evaluate(self, step: int) -> dict | None:
        """Loss and accuracy over the held-out feed, logged as an ``eval`` row; None without one."""
        if self.eval_feed is None:
            return None
        self.engine.eval()
        win = Window(self.K, self.device)
        with torch.no_grad():
            for b in self.eval_feed:
                check_batch(b, self.built, self.target_hidden)
                b = _bucketed(_to_device(b, self.device), self.eval_feed)
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
        client = {"step": step, "fingerprint": self.fingerprint, "recipe_hash": self.recipe.hash(),
                  "target": self.identity, "head_config": self.head_cfg, "world_size": self.world}
        if feed_state is None and hasattr(self.feed, "state_dict"):
            feed_state = self.feed.state_dict()
        rank_state = {"feed": feed_state,
                      "rng": ckpt.rng_state(), "step": step}
        return ckpt.save_checkpoint(self.engine, self.train_dir, step, client, rank_state, self.rank, self.head_cfg,
                                    self.meta(step, {"eval": last_eval}))

    def save_final(self, step: int, last_eval: dict | None) -> None:
        """``final/``: the head's weights (LoRA merged, gathered under ZeRO-3), written by rank 0."""
        with _gathered(self.engine, self.recipe.train.zero_stage):
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
            _say(f"no held-out eval ({e})", rank)
            eval_feed = None
    return feed, eval_feed


def _setup(recipe, target, feed, eval_feed, vocab) -> Run:
    """Seeds, target, head, feeds, loss and DeepSpeed engine (this order fixes the random stream)."""
    t_start = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device(int(os.environ.get("LOCAL_RANK", "0")))
    tcfg = recipe.train
    train_dir = Path(recipe.train_dir)
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
    built = build_head(recipe, target, vocab)
    cfg = built.cfg
    feed, eval_feed = _feeds(recipe, target, feed, eval_feed, rank, world)
    if len(feed) == 0:
        raise BatchError("the training feed is empty: no rows to train on")

    K = cfg.num_mtp_depths if cfg.kind == "mtp" else (tcfg.ttt_steps if cfg.kind == "eagle3" else 1)
    weights = mtp_weights(recipe.head, cfg.num_mtp_depths, tcfg.loss_decay) if cfg.kind == "mtp" else None
    objective = Objective(built.head, cfg.kind, steps=tcfg.ttt_steps, decay=tcfg.loss_decay,
                          eagle1_ce_weight=tcfg.eagle1_ce_weight, mtp_weights=weights, backend=tcfg.loss_kernel,
                          compile=tcfg.compile, static_shapes=tcfg.length_buckets is not None)
    _, lm_w, lm_b = target_weights(target)
    target_logits = TargetLogits(lm_w, built.d2t if cfg.kind == "eagle3" else None, lm_b,
                                 tf32=precision == "bf16").to(device)

    total = total_steps(recipe, len(feed))
    sched = LRLambda(total, tcfg.warmup_steps, tcfg.scheduler, tcfg.min_lr_ratio)
    ds_cfg = deepspeed_config(recipe, precision)
    if tcfg.resume and ckpt.needs_universal(ckpt.latest_checkpoint(train_dir), world, tcfg.zero_stage):
        ds_cfg["checkpoint"] = {"load_universal": True}  # _resume re-shards ZeRO states written on another world size
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    engine, _, scheduler = _initialize(objective, ds_cfg, sched, tcfg, device, rank)
    # this rank's share of the trained state (ZeRO partitions it), before any activation exists
    state_bytes = torch.cuda.memory_allocated(device) - before if before is not None else None
    identity = dict(target.identity())
    return Run(recipe=recipe, rank=rank, world=world, device=device, train_dir=train_dir, precision=precision,
               built=built, feed=feed, eval_feed=eval_feed, total=total, K=K, target_logits=target_logits,
               target_hidden=int(target.hidden_size), engine=engine, scheduler=scheduler, identity=identity,
               fingerprint=ckpt.resume_fingerprint(recipe, identity, built.d2t, world, precision),
               t_start=t_start, state_bytes=state_bytes)


def _resume(run: Run) -> int | None:
    """With ``train.resume``, load the latest checkpoint (weights, optimizer, scheduler, feed
    position, RNG) after checking its fingerprint; returns its step, or None for a fresh start.
    The checkpoint may come from another number of ranks when ranks × ``train.grad_accum`` is the same
    (see :mod:`specheads.train.checkpoint`)."""
    tag = ckpt.latest_checkpoint(run.train_dir)
    root = ckpt.checkpoint_root(run.train_dir)
    if not run.recipe.train.resume:
        if tag is not None:
            _say(f"{root} holds checkpoints of an earlier run; train.resume=false: "
                 f"starting over (they will be overwritten)", run.rank)
        return None
    if tag is None:
        _say(f"train.resume=true but no checkpoint under {root}: starting fresh", run.rank)
        return None
    saved = ckpt.read_client_state(tag)
    ckpt.compare_fingerprints(saved["fingerprint"], run.fingerprint, str(tag))
    rank_state = ckpt.load_checkpoint(run.engine, tag, run.rank, run.world, run.recipe.train.zero_stage,
                                      say=lambda m: _say(m, run.rank))
    if hasattr(run.feed, "load_state_dict") and rank_state.get("feed") is not None:
        run.feed.load_state_dict(rank_state["feed"])
    ckpt.set_rng_state(rank_state["rng"])
    step = int(saved["step"])
    saved_world = ckpt.saved_world_size(tag)
    moved = (f" (written on {saved_world} rank(s) × train.grad_accum={saved['fingerprint']['train.grad_accum']}, "
             f"now {run.world} × {run.recipe.train.grad_accum})" if saved_world != run.world else "")
    _say(f"resumed from {tag} at optimizer step {step}{moved}", run.rank)
    return step


class Batches:
    """The training feed pass after pass: ``next()`` restarts it at its end and counts the epoch;
    two ends in a row (a pass with no batch) are a :class:`BatchError`."""

    def __init__(self, feed):
        self.feed = feed
        self.epoch = 0
        self._it = iter(feed)

    def next(self) -> dict:
        ends = 0
        while True:
            try:
                return next(self._it)
            except StopIteration:
                ends += 1
                if ends > 1:
                    raise BatchError("the training feed yields no batches") from None
                self.epoch += 1
                self._it = iter(self.feed)


@dataclass
class MicroBatch:
    """One training micro-batch on the device, with what the loop needs of it on the host."""

    data: dict
    tokens: int  # real (unpadded) tokens
    rows: list | None  # row ids, for a divergence report
    shape: tuple
    epoch: int


class DeviceBatches:
    """:class:`Batches`, checked on the host and moved to the device one micro-batch ahead.

    While a micro-batch trains, the next one is checked (``check_batch`` on host tensors: no device
    sync), counted, and copied from pinned memory on a side stream, so the GPU never waits for a
    host-to-device copy of ~150 MB of states. ``feed_state()`` is the feed's position before the
    batch waiting in the copy: a checkpoint resumes at the first batch not trained on."""

    def __init__(self, feed, device: torch.device, check):
        self.batches = Batches(feed)
        self.feed, self.device, self.check = feed, device, check
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pending: MicroBatch | None = None
        self._pending_state = None
        self._epoch = 0

    @property
    def epoch(self) -> int:
        """The epoch of the last batch handed out (the one read ahead may be the next epoch's)."""
        return self._epoch

    def _load(self) -> MicroBatch:
        self._pending_state = self.feed.state_dict() if hasattr(self.feed, "state_dict") else None
        b = self.batches.next()
        self.check(b)
        mask = b.get("attention_mask")
        tokens = int(mask.sum()) if mask is not None else int(b["input_ids"].numel())
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                data = _bucketed(_to_device(b, self.device), self.feed)
        else:
            data = _bucketed(_to_device(b, self.device), self.feed)
        return MicroBatch(data, tokens, _row_ids(b), tuple(data["input_ids"].shape), self.batches.epoch)

    def next(self) -> MicroBatch:
        cur = self._pending if self._pending is not None else self._load()
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            for v in cur.data.values():
                if torch.is_tensor(v) and v.is_cuda:
                    v.record_stream(torch.cuda.current_stream(self.device))  # allocated on the copy stream
        self._pending = self._load()
        self._epoch = cur.epoch
        return cur

    def feed_state(self):
        if self._pending is None:
            return self.feed.state_dict() if hasattr(self.feed, "state_dict") else None
        return self._pending_state


def _train_step(run: Run, batches: DeviceBatches, win: Window, step: int) -> tuple[float | None, float]:
    """Optimizer step ``step + 1``: forward/backward over micro-batches up to the gradient accumulation
    boundary, then ``engine.step()``. Adds each micro-batch to ``win``; returns (grad norm, lr used).

    Nothing is read back per micro-batch: each loss's finiteness stays on the device until the
    boundary, where one read (all-reduced over ranks) checks them all, so the host keeps queueing
    work. A NaN loss has then reached the optimizer; the run stops before anything is saved."""
    engine, tcfg = run.engine, run.recipe.train
    micro = 0
    losses, seen = [], []
    while True:
        mb = batches.next()
        out = engine(mb.data, run.target_logits(mb.data["final"]))
        losses.append(out.loss.detach().float())
        seen.append(mb)
        engine.backward(out.loss)
        win.add(out, mb.tokens * run.world)
        boundary = engine.is_gradient_accumulation_boundary()
        own_gn = None
        if boundary:
            lr = float(run.scheduler.get_last_lr()[0]) if run.scheduler is not None else float(tcfg.lr)
            if tcfg.zero_stage == 0 and run.precision == "fp32":  # DeepSpeed reports no norm here
                own_gn = _grad_norm(engine.module)
        engine.step()
        micro += 1
        if boundary:
            break
    losses = torch.stack(losses)
    bad = _allreduce((~torch.isfinite(losses)).float(), dist.ReduceOp.MAX).tolist()
    if any(bad):
        m = bad.index(1.0)
        raise _diverged(f"loss is {float(losses[m])}", step + 1, m, seen[m].epoch, seen[m].rows, seen[m].shape, run.train_dir)
    gn = engine.get_global_grad_norm()
    gn = float(gn) if gn is not None else own_gn
    if gn is not None and not math.isfinite(gn):
        raise _diverged(f"gradient norm is {gn}", step + 1, None, seen[-1].epoch, seen[-1].rows, seen[-1].shape,
                        run.train_dir)
    return gn, lr


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


def _train(recipe, target, feed, eval_feed, vocab, progress) -> dict:
    """Setup, resume, then optimizer steps (logging, eval and checkpoints on their schedules);
    a last eval, checkpoint and ``final/``. Returns the run's summary."""
    run = _setup(recipe, target, feed, eval_feed, vocab)
    resume_step = _resume(run)
    step = resume_step or 0
    tcfg = recipe.train
    run.logger = RunLogger(recipe, run.train_dir, rank=run.rank, resume_step=resume_step,
                           run_config={"recipe": recipe.to_dict(), "head": run.head_cfg, "target": run.identity})
    pbar = None
    if run.rank == 0 and progress:
        from tqdm.auto import tqdm

        pbar = tqdm(total=run.total, initial=step, desc=f"train {run.cfg.kind}", dynamic_ncols=True,
                    file=sys.stderr)

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
    t_loop = time.time()  # tokens/s counts the training loop (as the progress bar does), not set-up
    try:
        while step < run.total:
            profiler.before(step)
            gn, lr = _train_step(run, batches, win, step)
            step += 1
            profiler.after(step, last=step == run.total)
            tokens_total += win.tokens
            if step % run.logger.every == 0 or step == run.total:
                losses.append(_log_train(run, step, batches.epoch, win, gn, lr, t_window, pbar))
                win = Window(run.K, run.device)
                t_window = time.time()
            if pbar is not None:
                pbar.update(1)
            if tcfg.eval_every and step % tcfg.eval_every == 0 and step < run.total:
                last_eval = run.evaluate(step) or last_eval
            if tcfg.save_every and step % tcfg.save_every == 0 and step < run.total:
                run.save_checkpoint(step, last_eval, batches.feed_state())
                last_saved = step
    except TrainingDivergedError:
        if pbar is not None:
            pbar.close()
        run.logger.close(plot=True)
        raise
    if pbar is not None:
        pbar.close()
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
        "profile": profiler.written,
        # token-budget feeds: padded token slots the step computes and throws away (rows × longest row, or the
        # bucket's shape); a feed of fixed row counts may come from a store that does not list its row lengths
        "padding_fraction": run.feed.padding_fraction(0) if getattr(run.feed, "max_tokens", None) else None,
    }


def _grad_norm(module: torch.nn.Module) -> float:
    sq = [p.grad.detach().float().pow(2).sum() for p in module.parameters() if p.grad is not None]
    return float(torch.stack(sq).sum().sqrt()) if sq else 0.0


def fused_adam_problem() -> str | None:
    """None when DeepSpeed's fused AdamW op loads (JIT-built on first use, then cached), else why not."""
    try:
        from deepspeed.accelerator import get_accelerator

        builder = get_accelerator().create_op_builder("FusedAdamBuilder")
        if builder is None:
            return "no FusedAdam op for this accelerator"
        builder.load(verbose=False)
        return None
    except Exception as e:  # noqa: BLE001 - compiler missing, arch list unparsable, ...
        return f"{type(e).__name__}: {str(e)[:200]}"


def _initialize(objective, ds_cfg: dict, sched: LRLambda, tcfg, device, rank: int):
    """deepspeed.initialize with DeepSpeed's fused AdamW; when that op cannot be built on this
    machine, the same AdamW from torch (fused on CUDA), handed to DeepSpeed as a client optimizer."""
    import deepspeed

    def lr_sched(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, sched)

    groups = param_groups(objective, tcfg.weight_decay)
    problem = fused_adam_problem()
    if problem is None:
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=objective, model_parameters=groups, config=ds_cfg, lr_scheduler=lr_sched)
        return engine, optimizer, scheduler
    _say(f"DeepSpeed's fused AdamW is unavailable here ({problem}); using torch.optim.AdamW", rank)
    cfg = {k: v for k, v in ds_cfg.items() if k != "optimizer"}
    opt = torch.optim.AdamW(groups, lr=float(tcfg.lr), betas=tuple(float(b) for b in tcfg.betas), eps=1e-8,
                            fused=device.type == "cuda")
    engine, optimizer, _, scheduler = deepspeed.initialize(model=objective, optimizer=opt, config=cfg,
                                                           lr_scheduler=lr_sched)
    return engine, optimizer, scheduler


@contextmanager
def _gathered(engine, zero_stage: int):
    if zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
            yield
    else:
        yield


def _diverged(what: str, step: int, micro, epoch: int, rows, shape: tuple, train_dir: Path) -> TrainingDivergedError:
    latest = ckpt.latest_checkpoint(train_dir)
    where = f"optimizer step {step}" + (f", micro-batch {micro}" if micro is not None else "") + f", epoch {epoch}"
    msg = (f"training diverged: {what} at {where}; batch rows: "
           f"{rows if rows is not None else '(the feed gives no row ids)'}; "
           f"input_ids shape {shape}. Nothing was saved from this state; "
           f"last good checkpoint: {latest if latest else 'none'}")
    try:
        if not dist.is_initialized() or dist.get_rank() == 0:
            (train_dir / "diverged.json").write_text(json.dumps(
                {"what": what, "step": step, "micro_batch": micro, "epoch": epoch, "rows": rows,
                 "last_good_checkpoint": str(latest) if latest else None}, indent=2, default=str))
    except OSError:
        pass
    return TrainingDivergedError(msg, step, rows)
