"""One optimizer step: micro-batches checked and moved to the device, forward/backward through the
head's objective, the step's metrics (:class:`Window`), and the divergence check that stops a run
before a NaN/inf state is saved."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from specheads.dump.feed import pad_batch
from specheads.errors import SpecheadsError
from specheads.heads.config import AUX_KINDS

from . import checkpoint as ckpt
from .builder import BuiltHead
from .engine import allreduce, grad_norm
from .losses import simulated_tau


class TrainingDivergedError(SpecheadsError, RuntimeError):
    """Loss or gradient norm became NaN/inf. Nothing was saved from the bad state."""

    def __init__(self, msg: str, step: int, rows=None):
        super().__init__(msg)
        self.step = step
        self.rows = rows


class BatchError(SpecheadsError, ValueError):
    pass


# ---------------------------------------------------------------- batches
def to_device(batch: dict, device: torch.device) -> dict:
    out = {}
    for k, v in batch.items():
        out[k] = v.to(device, non_blocking=True) if torch.is_tensor(v) else v
    if "attention_mask" not in out or out["attention_mask"] is None:
        out["attention_mask"] = torch.ones_like(out["input_ids"])
    return out


def bucketed(batch: dict, feed) -> dict:
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
    missing = [k for k in ("input_ids", "loss_mask", "final") + (("aux",) if cfg.kind in AUX_KINDS else ())
               if k not in batch]
    if missing:
        raise BatchError(f"training batch lacks {missing} (got keys {sorted(batch)})")
    B, T = batch["input_ids"].shape
    if batch["final"].shape[-1] != target_hidden:
        raise BatchError(f"batch 'final' states have width {batch['final'].shape[-1]} but the target's hidden "
                         f"size is {target_hidden}: the data was produced by another target")
    if cfg.kind in AUX_KINDS:
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
            vec = allreduce(vec)
        K = self.K
        n = max(1.0, float(vec[-1]))
        hits, counts = vec[1 + K:1 + 2 * K], vec[1 + 2 * K:1 + 3 * K]
        acc = [float(h / c) if c > 0 else 0.0 for h, c in zip(hits, counts)]
        return {"loss": float(vec[0]) / n, "step_loss": [float(x) / n for x in vec[1:1 + K]],
                "step_acc": acc, "sim_tau": simulated_tau(acc), "positions": int(counts[0]),
                **{k: float(v) / max(1, self.n) for k, v in self.extra.items()}}


# ---------------------------------------------------------------- the feed, pass after pass
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
                data = bucketed(to_device(b, self.device), self.feed)
        else:
            data = bucketed(to_device(b, self.device), self.feed)
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


# ---------------------------------------------------------------- the step
def train_step(run, batches: DeviceBatches, win: Window, step: int) -> tuple[float | None, float]:
    """Optimizer step ``step + 1`` of ``run`` (a :class:`~specheads.train.loop.Run`): forward/backward over
    micro-batches up to the gradient accumulation boundary, then ``engine.step()``. Adds each micro-batch to ``win``; returns (grad norm, lr used).

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
                own_gn = grad_norm(engine.module)
        engine.step()
        micro += 1
        if boundary:
            break
    losses = torch.stack(losses)
    bad = allreduce((~torch.isfinite(losses)).float(), dist.ReduceOp.MAX).tolist()
    if any(bad):
        m = bad.index(1.0)
        raise diverged(f"loss is {float(losses[m])}", step + 1, m, seen[m].epoch, seen[m].rows, seen[m].shape, run.train_dir)
    gn = engine.get_global_grad_norm()
    gn = float(gn) if gn is not None else own_gn
    if gn is not None and not math.isfinite(gn):
        raise diverged(f"gradient norm is {gn}", step + 1, None, seen[-1].epoch, seen[-1].rows, seen[-1].shape,
                        run.train_dir)
    return gn, lr


def diverged(what: str, step: int, micro, epoch: int, rows, shape: tuple, train_dir: Path) -> TrainingDivergedError:
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
                 "input_ids_shape": list(shape) if shape is not None else None,
                 "last_good_checkpoint": str(latest) if latest else None}, indent=2, default=str))
    except OSError:
        pass
    return TrainingDivergedError(msg, step, rows)
