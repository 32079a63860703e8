"""What ``bench_runtime.py`` reads from torch's profiler and logs: kernel counts, the graphed steps' device
timeline, and dynamo's recompile-limit warnings."""
from __future__ import annotations

import logging


class RecompileLimitHits(logging.Handler):
    """Counts dynamo's "hit config.recompile_limit" warnings: past that limit a compiled function runs
    new shapes eagerly, and a compiled row then silently measures eager code."""
    def __init__(self):
        super().__init__(logging.WARNING)
        self.hits: list[str] = []
        logging.getLogger("torch._dynamo.convert_frame").addHandler(self)

    def emit(self, record):
        msg = record.getMessage()
        if "recompile_limit" in msg:
            self.hits.append(msg.splitlines()[1].strip() if "\n" in msg else msg)

    def detach(self) -> list[str]:
        logging.getLogger("torch._dynamo.convert_frame").removeHandler(self)
        return self.hits


def sort_key(dev):
    return "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"


def device_events(prof) -> list:
    """The profiler's device-side events (kernels, copies, memsets) in start order."""
    from torch.autograd import DeviceType
    return sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)


def kernel_count(prof) -> dict:
    """Kernels one profiled step launched and their summed device time: in a launch-bound step the
    count is the cost to cut (the table shows only the longest rows)."""
    ev = device_events(prof)
    return {"kernels_per_step": len(ev),
            "kernel_us_per_step": sum(getattr(e, "device_time", 0.0) or 0.0 for e in ev)} if ev else {}


def graph_timeline(prof, steps: int, trace_path: str | None = None) -> dict:
    """Where a graphed step's device time goes: its kernels (and copies) back to back against the span from the
    first one's start to the last one's end, and the longest idle gaps between two of them, summed over the
    profiled steps by the pair of names around them. The eager profile's kernel sum misses what the graph adds:
    on the H200 (2026-12-04) a process's graphed steps slowed by ~0.12 ms once it held more graphs, all of it idle
    time between kernels that ran as fast as before."""
    ev = device_events(prof)
    if trace_path:
        prof.export_chrome_trace(trace_path)
    if not ev:
        return {}
    busy = sum(e.time_range.end - e.time_range.start for e in ev)
    gaps: dict = {}
    for a, b in zip(ev, ev[1:]):
        g = b.time_range.start - a.time_range.end
        if g > 0:
            key = f"{a.name[:60]} -> {b.name[:60]}"
            n, t = gaps.get(key, (0, 0.0))
            gaps[key] = (n + 1, t + g)
    top = sorted(gaps.items(), key=lambda kv: -kv[1][1])[:12]
    return {"graph_kernels_per_step": len(ev) / steps, "graph_busy_us_per_step": busy / steps,
            "graph_span_us_per_step": (ev[-1].time_range.end - ev[0].time_range.start) / steps,
            "graph_gaps": [{"between": k, "count": n, "us_per_step": t / steps} for k, (n, t) in top]}
