"""The DeepSpeed side of training: the process group, the engine and its optimizer, the LR schedule.

* :func:`distributed`: without a launcher the process sets ``MASTER_ADDR/PORT, RANK=0, WORLD_SIZE=1,
  LOCAL_RANK=0`` (only where absent, restored afterwards) and calls ``deepspeed.init_distributed``;
  it destroys the process group it created at the end.
* :func:`initialize`: DeepSpeed AdamW (betas, weight decay on ≥2-D weights only), or torch's AdamW when
  DeepSpeed's fused op cannot be built; LR: linear warmup then cosine / linear decay to
  ``min_lr_ratio·lr`` (or constant), a ``LambdaLR`` DeepSpeed steps at each optimizer step.
* :func:`effective_precision`: bf16 per ``train.precision`` on GPUs that support it; on a CPU the run
  falls back to fp32 and says so.
"""
from __future__ import annotations

import math
import os
import socket
import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist


def say(msg: str, rank: int = 0) -> None:
    """One line for the user on stderr, from rank 0 only."""
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


def finish_process(code: int) -> None:
    """End a rank of a multi-process run here, without the interpreter's teardown.

    DeepSpeed keeps the engine, and with it the gloo process groups, alive to the end of the process (ZeRO-3's
    ``parameter_offload.FWD_MODULE_STACK`` holds the trained module; its optimizer and parameters hold the groups),
    so ``destroy_process_group`` does not join gloo's worker threads. When such a thread frees its last barrier
    during interpreter shutdown it must take the GIL, Python ends the thread, and the C++ runtime aborts the
    process (``terminate called without an active exception``, SIGABRT): torchrun then reports a run that had
    finished and saved everything as failed. Seen in about 1 in 20 1 -> 2-rank ZeRO-3 resumes on a loaded CPU.
    Every output is flushed and closed before this is called; it only skips the teardown."""
    import logging

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(int(code))


def device_for(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def allreduce(t: torch.Tensor, op=None) -> torch.Tensor:
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
            say("train.precision=bf16 is not used on a CPU: training in fp32", rank)
            return "fp32"
        if not torch.cuda.is_bf16_supported():
            say("this GPU has no bf16: training in fp32", rank)
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


# ---------------------------------------------------------------- engine
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


def initialize(objective, ds_cfg: dict, sched: LRLambda, tcfg, device, rank: int):
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
    say(f"DeepSpeed's fused AdamW is unavailable here ({problem}); using torch.optim.AdamW", rank)
    cfg = {k: v for k, v in ds_cfg.items() if k != "optimizer"}
    opt = torch.optim.AdamW(groups, lr=float(tcfg.lr), betas=tuple(float(b) for b in tcfg.betas), eps=1e-8,
                            fused=device.type == "cuda")
    engine, optimizer, _, scheduler = deepspeed.initialize(model=objective, optimizer=opt, config=cfg,
                                                           lr_scheduler=lr_sched)
    return engine, optimizer, scheduler


@contextmanager
def gathered(engine, zero_stage: int):
    if zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
            yield
    else:
        yield


def grad_norm(module: torch.nn.Module) -> float:
    sq = [p.grad.detach().float().pow(2).sum() for p in module.parameters() if p.grad is not None]
    return float(torch.stack(sq).sum().sqrt()) if sq else 0.0
