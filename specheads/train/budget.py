"""``train.max_minutes``: a wall-clock budget for the training loop.

A run that must end by a deadline (a rented GPU, a CI slot, "prompts to an evaluated head in 20 minutes")
cannot know its step rate before it starts: the target's forward, compilation and the feed's shapes set it.
Cutting the run when the clock runs out would leave the learning rate high, mid-schedule. Instead the run
re-plans at each logging step after the warmup: from the rate of the steps since the last plan it sets the last
step to what the rest of the budget fits (never past the recipe's own total), and the schedule is re-laid to decay
by that step.
A step that still finds the budget spent (a slower stretch than the last one measured) ends the run there.

The budget covers the optimizer steps of this process's loop; the final held-out eval and the saves come
after it. Every rank takes the earliest last step any rank planned, so that all of them stop together.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from .engine import LRLambda, allreduce


class TimeBudget:
    def __init__(self, minutes: float, planned_total: int, sched: LRLambda, start_step: int, device,
                 clock=time.monotonic):
        self.seconds = float(minutes) * 60.0
        self.planned_total = int(planned_total)  # the recipe's steps: the budget only ever shortens a run
        self.sched, self.device, self.clock = sched, device, clock
        self.t0 = clock()
        self.mark = (start_step, self.t0)  # (step, time) of the last plan: the rate is measured from there
        self.measured = False  # the first window (compilation, the first shapes, a fused op's build) is not a rate
        self.replans: list[dict] = []

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def _agree(self, value: float, op) -> float:
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return value
        return float(allreduce(torch.tensor([value], dtype=torch.float64, device=self.device), op).item())

    def plan(self, step: int, total: int) -> int:
        """The run's last step as the budget now allows, from the rate since the last plan."""
        s0, t0 = self.mark
        now = self.clock()
        self.mark = (step, now)
        if step <= s0 or not self.measured or step <= self.sched.warmup:
            self.measured = True  # warmup's LR does not depend on the last step: nothing to re-lay yet
            return total
        per_step = (now - t0) / (step - s0)
        left = self.seconds - (now - self.t0)
        fits = step + max(0, math.floor(left / per_step)) if per_step > 0 else self.planned_total
        new_total = int(self._agree(float(max(step, min(self.planned_total, fits))), dist.ReduceOp.MIN))
        if new_total != total:
            self.sched.total = new_total  # the cosine / linear decay now ends at the new last step
            self.replans.append({"step": step, "total": new_total, "s_per_step": round(per_step, 4),
                                 "elapsed_s": round(now - self.t0, 1)})
        return new_total

    def spent(self) -> bool:
        return self._agree(float(self.elapsed() >= self.seconds), dist.ReduceOp.MAX) > 0

    def summary(self, steps: int) -> dict:
        return {"max_minutes": self.seconds / 60.0, "planned_steps": self.planned_total, "steps": steps,
                "loop_s": round(self.elapsed(), 1), "replans": self.replans}
