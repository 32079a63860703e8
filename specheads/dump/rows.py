"""Uniform, fast access to token rows (``input_ids`` + ``loss_mask``) for the dump and the feeds.

Accepts a ``datasets.Dataset`` (read through Arrow, in chunks), a list of dicts, or a
directory written by ``specheads.data.prepare``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specheads.data.prepare import load_rows
from specheads.errors import DumpError

_CHUNK = 8192


def load_token_rows(path: str | Path):
    """The token rows written by ``specheads data prepare`` (``load_rows``), as a Dataset."""
    path = Path(path)
    if not path.exists():
        raise DumpError(f"token rows not found at {path}: run `specheads data prepare` first (or set data.rows_dir)")
    return load_rows(path)


class TokenRows:
    """Read-only view of token rows: lengths, and flat (ids, mask, offsets) for row ranges."""

    def __init__(self, rows):
        self._ds = None
        self._list = None
        if isinstance(rows, TokenRows):
            self._ds, self._list = rows._ds, rows._list
        elif isinstance(rows, (str, Path)):
            self._ds = load_token_rows(rows)
        elif hasattr(rows, "with_format") and hasattr(rows, "column_names"):
            missing = {"input_ids", "loss_mask"} - set(rows.column_names)
            if missing:
                raise DumpError(f"token rows lack column(s) {sorted(missing)} (have {rows.column_names})")
            self._ds = rows
        else:
            self._list = list(rows)
        self._lengths: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self._ds) if self._ds is not None else len(self._list)

    def _arrow(self, a: int, b: int):
        import pyarrow.compute as pc

        tbl = self._ds.with_format("arrow")[a:b]
        ids_col = tbl.column("input_ids")
        mask_col = tbl.column("loss_mask")
        lens = pc.list_value_length(ids_col).to_numpy(zero_copy_only=False).astype(np.int64)
        mlens = pc.list_value_length(mask_col).to_numpy(zero_copy_only=False).astype(np.int64)
        ids = pc.list_flatten(ids_col).to_numpy(zero_copy_only=False)
        mask = pc.list_flatten(mask_col).to_numpy(zero_copy_only=False)
        return ids, mask, lens, mlens

    def _py(self, a: int, b: int):
        sel = self._list[a:b]
        lens = np.array([len(r["input_ids"]) for r in sel], dtype=np.int64)
        mlens = np.array([len(r["loss_mask"]) for r in sel], dtype=np.int64)
        ids = np.concatenate([np.asarray(r["input_ids"], dtype=np.int64) for r in sel]) if sel else np.zeros(0, np.int64)
        mask = np.concatenate([np.asarray(r["loss_mask"], dtype=np.int64) for r in sel]) if sel else np.zeros(0, np.int64)
        return ids, mask, lens, mlens

    def _fetch(self, a: int, b: int):
        return self._arrow(a, b) if self._ds is not None else self._py(a, b)

    def lengths(self) -> np.ndarray:
        """Token count of every row (int64 [rows]); also checks loss_mask lengths."""
        if self._lengths is None:
            n = len(self)
            out = np.zeros(n, dtype=np.int64)
            for a in range(0, n, _CHUNK):
                b = min(n, a + _CHUNK)
                if self._ds is not None:
                    import pyarrow.compute as pc

                    tbl = self._ds.with_format("arrow")[a:b]
                    lens = pc.list_value_length(tbl.column("input_ids")).to_numpy(zero_copy_only=False)
                    mlens = pc.list_value_length(tbl.column("loss_mask")).to_numpy(zero_copy_only=False)
                else:
                    _, _, lens, mlens = self._py(a, b)
                bad = np.nonzero(lens != mlens)[0]
                if len(bad):
                    r = a + int(bad[0])
                    raise DumpError(f"row {r}: input_ids has {lens[bad[0]]} tokens but loss_mask has {mlens[bad[0]]}")
                out[a:b] = lens
            self._lengths = out
        return self._lengths

    def range(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows a..b-1 packed: (ids int32 [N], mask uint8 [N], offsets int64 [b-a+1])."""
        ids, mask, lens, mlens = self._fetch(a, b)
        bad = np.nonzero(lens != mlens)[0]
        if len(bad):
            raise DumpError(f"row {a + int(bad[0])}: input_ids has {lens[bad[0]]} tokens but loss_mask has {mlens[bad[0]]}")
        offsets = np.zeros(b - a + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        if len(mask) and (mask.min() < 0 or mask.max() > 1):
            r = a + int(np.searchsorted(offsets, int(np.nonzero((mask < 0) | (mask > 1))[0][0]), side="right") - 1)
            raise DumpError(f"row {r}: loss_mask holds values other than 0/1")
        if len(ids) and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
            raise DumpError(f"rows {a}..{b - 1}: token id out of range")
        return ids.astype(np.int32, copy=False), mask.astype(np.uint8, copy=False), offsets

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        ids, mask, off = self.range(i, i + 1)
        return ids, mask
