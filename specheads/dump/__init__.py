"""Hidden-state store (offline dump) and the feeds the trainer reads batches from.

- ``run_dump(recipe, target=None, rows=None, rank=None, world_size=None)`` writes the store.
- ``DumpDataset`` / ``collate`` read it; ``OnlineFeed`` computes the same batches live.
- ``make_feed(recipe, target, split, rank, world_size)`` is the trainer's one interface.
- ``inspect_store(dir)`` checks a store.
"""

from specheads.dump.feed import Feed, holdout_mask, make_feed, split_rows
from specheads.dump.inspect import format_report, inspect_store
from specheads.dump.online import OnlineFeed
from specheads.dump.reader import DumpDataset, collate
from specheads.dump.store import (
    DumpCorruptError,
    dequantize_fp8,
    fp8_error_bound,
    quantize_fp8,
    read_manifest,
)
from specheads.dump.writer import run_dump
from specheads.errors import DumpError
from specheads.rundir import DumpMismatchError

__all__ = [
    "DumpCorruptError", "DumpDataset", "DumpError", "DumpMismatchError", "Feed", "OnlineFeed", "collate",
    "dequantize_fp8", "format_report", "fp8_error_bound", "holdout_mask", "inspect_store", "make_feed",
    "quantize_fp8", "read_manifest", "run_dump", "split_rows",
]
