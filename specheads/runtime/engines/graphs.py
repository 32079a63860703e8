"""A step's device state and its CUDA graphs.

Everything a step reads and writes lives on the device: the token history
``[B, max_seq]``, per-row lengths, the active / stopped flags, the per-step records and the
step's uniforms sit in a ``Workspace`` kept on the engine per shape and updated in place;
stop detection and max_new_tokens are batched tensor ops. So ``step()`` (draft + verify +
commit) never reads a device value on the host and, with ``use_cuda_graphs`` and a
``graph_safe`` drafter (none, the device n-gram proposer, the heads, the hybrid), is
captured as ONE CUDA graph per (batch, k or tree, rule, attention width) and replayed.
The host reads two numbers per step (any row active, longest cache), copied to pinned
memory and read one step late on CUDA, so the host queues step t+1 while the device runs
step t (one wasted step at the end, which touches no active row). The attention width
``kv_len`` is a host bound on the longest row (from those numbers), rounded up to a power
of two for graphs (>= KV_BUCKET_MIN) or to 16 eagerly. A shape that was not captured
(new k, tree, width) is captured on first use after running eagerly once; a step that
cannot be captured runs eagerly (``GenerateResult.graph_stats['failed']``) - never a wrong
result. Drafters that read the host view (``ctx.histories``) run eagerly with one sync per
step, with the target forward in the engine's per-forward graphs. A drafter with host state
that is still graph-safe (suffix decoding, alone or as a hybrid's free half) does its host work
between steps (``_host_step``: one sync a step) and the step itself replays as a graph.
"""

from __future__ import annotations

import warnings

import torch

from ..model import round_up

KV_BUCKET_MIN = 128           # smallest attention width of a captured step
UNIFORM_CHUNK = 32            # decode steps of uniforms drawn on the host per copy


def pow2(n: int, least: int = 1) -> int:
    p = least
    while p < n:
        p *= 2
    return p


class Workspace:
    """``generate``'s device state for one shape, kept on the engine (``model.workspaces``) and
    reset in place by every call, so that step graphs captured by one call replay in the next.
    ``rec[r]`` holds decode step r: (active at its start, drafts proposed, accepted, emitted,
    depth offered) per row."""

    def __init__(self, B: int, S: int, Wu: int, R: int, NS: int, dev: torch.device):
        L = torch.long
        self.hist = torch.zeros(B, S, dtype=L, device=dev)          # prompt + emitted tokens
        self.hist_len = torch.zeros(B, dtype=L, device=dev)
        self.prompt_len = torch.zeros(B, dtype=L, device=dev)
        self.active = torch.zeros(B, dtype=torch.bool, device=dev)
        self.stopped = torch.zeros(B, dtype=torch.bool, device=dev)
        self.max_new = torch.zeros(B, dtype=L, device=dev)
        self.stops = torch.full((B, NS), -1, dtype=L, device=dev)  # per row: continuous batching mixes requests
        self.step = torch.zeros(1, dtype=L, device=dev)            # decode step index
        self.temperature = torch.zeros((), dtype=torch.float32, device=dev)
        self.top_k = torch.zeros((), dtype=L, device=dev)
        self.top_p = torch.ones((), dtype=torch.float32, device=dev)
        self.uchunk = torch.zeros(UNIFORM_CHUNK, B, Wu, device=dev) if Wu else None
        self.rec = torch.zeros(R, 5, B, dtype=L, device=dev)
        self.row_steps = torch.zeros(B, dtype=L, device=dev)       # steps each row was active in (continuous)
        self.flag = torch.zeros(2, dtype=L, device=dev)             # (any row active, longest cache)
        cuda = dev.type == "cuda"
        self.pinned = torch.zeros(2, 2, dtype=L, pin_memory=cuda)
        self.events = [torch.cuda.Event(), torch.cuda.Event()] if cuda else None
        self.graphs: dict = {}


_FAILED = "failed"


class StepLauncher:
    """How a generation runs its ``step()``: replayed from a captured CUDA graph, or eagerly.
    Mixed into ``Generation``, whose state (``capture``, ``ws``, ``stats``, ...) it reads."""

    def _bucket(self, need: int) -> int:
        """The attention width for a step that touches at most ``need`` slots of any row: powers of
        two >= KV_BUCKET_MIN on a GPU (few graph shapes; eager GPU steps use the same widths, so
        they run the very kernels a graph replays), a multiple of 16 on a CPU (cost ~ width)."""
        S = self.model.cache.slots
        if self.capture or self.inner_graphs or self.dev.type == "cuda":
            return min(pow2(need, KV_BUCKET_MIN), S)
        return min(round_up(need), S)

    def _graph_key(self):
        d = self.drafter
        return (id(d), self.K, self.tree, self.rule, self.sampling, self.thresholds, self.kv_len, self.aux_ids,
                self.need_final, self.n_draw, self.n_du)

    def _launch(self) -> None:
        """Run one step: replay its captured graph, or run it eagerly (and capture it, the first
        time a shape is seen); then the drafter's host work for the next step, if it has any."""
        if not self.capture:
            self.stats["eager"] += 1
            self.step()
            self._host_step()
            return
        key = self._graph_key()
        entry = self.ws.graphs.get(key)
        if entry is not None and entry[0] is not _FAILED:
            entry[0].replay()
            self.stats["replayed"] += 1
            self._host_step()
            return
        self.stats["eager"] += 1
        self.step()                     # the real step (it also compiles kernels and warms cuBLAS up)
        self._host_step()               # before the capture: the captured step reads the proposals it wrote
        if entry is None:
            self.ws.graphs[key] = self._capture()

    def _host_step(self) -> None:
        """A drafter with host state (suffix decoding) takes in what the rows emitted and writes its next
        proposals into its device buffers (``Drafter.host_step``): one host sync, outside any graph."""
        if self.drafter is not None and getattr(self.drafter, "has_host_step", False):
            self.drafter.host_step(self.ctx, self.k)

    def _capture(self):
        """Capture ``step()`` (nothing runs while capturing: the state is untouched)."""
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, pool=self.model.graph_pool()):
                self.step()
        except Exception as e:         # a drafter that syncs: keep running eagerly, never a wrong result
            warnings.warn(f"speculative step not captured in a CUDA graph ({type(e).__name__}: {e}); "
                          f"this shape runs eagerly", RuntimeWarning, stacklevel=3)
            self.stats["failed"] += 1
            return (_FAILED, None)
        self.stats["captured"] += 1
        return (g, self.drafter)        # holds the drafter: the key has its id
