"""Read a hidden-state store: ``DumpDataset`` (memory-mapped rows) and ``collate``."""

from __future__ import annotations

import bisect
import os
import threading
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from specheads.errors import DumpError
from specheads.rundir import check_store_identity

from specheads.dump.store import (
    FP8_DTYPE,
    DumpCorruptError,
    ShardArrays,
    dequantize_fp8,
    file_sha256,
    read_manifest,
    shard_problems,
)

# (realpath, size, mtime_ns) -> sha256 already checked in this process
_VERIFIED: dict[tuple, str] = {}
_LOCK = threading.Lock()


def verify_shard(root: Path, record: dict) -> None:
    """Size + sha256 of one shard against its manifest record (cached per process)."""
    path = Path(root) / record["file"]
    if not path.is_file():
        raise DumpCorruptError(f"shard {record['file']} is missing from {root}; rerun the dump to rewrite it")
    st = path.stat()
    if st.st_size != record["bytes"]:
        raise DumpCorruptError(
            f"shard {record['file']} in {root} is truncated or altered: {st.st_size} bytes, the manifest says "
            f"{record['bytes']}; delete it and rerun the dump to rewrite it"
        )
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    with _LOCK:
        if _VERIFIED.get(key) == record["sha256"]:
            return
    digest = file_sha256(path)
    if digest != record["sha256"]:
        raise DumpCorruptError(
            f"checksum mismatch for shard {record['file']} in {root}: sha256 {digest[:16]}…, the manifest says "
            f"{record['sha256'][:16]}…; the file is corrupt: delete it and rerun the dump to rewrite it"
        )
    with _LOCK:
        _VERIFIED[key] = digest


def open_manifest(root) -> dict:
    root = Path(root)
    m = read_manifest(root)
    if m is None:
        raise DumpError(f"no dump at {root} (manifest.json missing): run `specheads dump` first")
    if not m.get("complete"):
        raise DumpError(f"the dump at {root} is incomplete: rerun the same `specheads dump` command to finish it")
    return m


class DumpDataset(Dataset):
    """Rows of a store as dicts of tensors: ``input_ids`` int64 [T], ``loss_mask`` int64 [T],
    ``aux`` [T, n_aux*H], ``final`` [T, H], ``row_index`` (int).

    ``dtype``: output dtype of aux/final; default the stored one (fp8 → bfloat16).
    ``expected_layer_ids``: the layers the head reads; the store may hold more (one dump for an EAGLE-3
    and a DFlash head), and ``aux`` then holds just these, in this order.
    Every shard's sha256 is checked when the dataset opens (once per process).
    Shards are memory-mapped lazily (per process; safe with DataLoader workers).
    """

    def __init__(self, root, *, expected_target: dict | None = None, expected_config_hash: str | None = None,
                 expected_layer_ids=None, dtype: torch.dtype | None = None, verify: bool = True):
        self.root = Path(root)
        self.manifest = open_manifest(self.root)
        check_store_identity(self.manifest, self.root, expected_target=expected_target,
                             expected_config_hash=expected_config_hash, expected_layer_ids=expected_layer_ids)
        self.shards = self.manifest["shards"]
        if verify:
            for rec in self.shards:
                verify_shard(self.root, rec)
        self.stored = self.manifest["dtype"]
        self.dtype = dtype or (torch.float32 if self.stored == "float32" else torch.bfloat16)
        stored_ids = list(self.manifest["aux_layer_ids"])
        self.layer_ids = list(expected_layer_ids) if expected_layer_ids is not None else stored_ids
        self.n_aux = len(self.layer_ids)
        # the stored columns of each layer read, or None when the head reads the store as it is
        self._pick = None if self.layer_ids == stored_ids else [stored_ids.index(i) for i in self.layer_ids]
        self._starts = [s["row_start"] for s in self.shards]
        self._open: dict[int, tuple[ShardArrays, np.ndarray]] = {}

    # identity facts the trainer may want
    @property
    def target(self) -> dict:
        return self.manifest["target"]

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self.layer_ids)

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["target"]["hidden_size"])

    def __len__(self) -> int:
        return int(self.manifest["counts"]["rows"])

    def row_lengths(self) -> np.ndarray:
        out = []
        for k in range(len(self.shards)):
            out.append(np.diff(self._shard(k)[1]))
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_open"] = {}  # memory maps are reopened in each worker process
        return d

    def _shard(self, k: int) -> tuple[ShardArrays, np.ndarray]:
        got = self._open.get(k)
        if got is None:
            rec = self.shards[k]
            arr = ShardArrays(self.root / rec["file"])
            probs = shard_problems(arr, rec, self.manifest)
            if probs:
                raise DumpCorruptError(f"shard {rec['file']} in {self.root}: " + "; ".join(probs))
            got = (arr, np.array(arr["row_offsets"]))
            self._open[k] = got
        return got

    def __getitem__(self, i: int) -> dict:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range for a dump of {len(self)} rows")
        k = bisect.bisect_right(self._starts, i) - 1
        arr, off = self._shard(k)
        r = i - self._starts[k]
        a, b = int(off[r]), int(off[r + 1])
        out = {
            "input_ids": torch.from_numpy(arr["input_ids"][a:b].astype(np.int64)),
            "loss_mask": torch.from_numpy(arr["loss_mask"][a:b].astype(np.int64)),
            "aux": self._aux(arr, a, b),
            "final": self._values(arr, "final", a, b),
            "row_index": i,
        }
        return out

    def _aux(self, arr: ShardArrays, a: int, b: int) -> torch.Tensor:
        aux = self._values(arr, "aux", a, b)
        if self._pick is None:
            return aux
        T = aux.shape[0]
        return aux.view(T, -1, self.hidden_size)[:, self._pick].reshape(T, -1)

    def _values(self, arr: ShardArrays, name: str, a: int, b: int) -> torch.Tensor:
        raw = np.array(arr[name][a:b])  # copy out of the memory map
        if self.stored == "float32":
            return torch.from_numpy(raw).to(self.dtype)
        if self.stored == "bfloat16":
            return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16).to(self.dtype)
        q = torch.from_numpy(raw).view(FP8_DTYPE)
        scale = torch.from_numpy(np.array(arr[name + "_scale"][a:b]))
        return dequantize_fp8(q, scale if scale.dim() == 2 else scale[:, None], self.dtype)


def collate(rows: list[dict]) -> dict:
    """Pad rows to the longest: input_ids 0, loss_mask 0, attention_mask 0, aux/final 0."""
    if not rows:
        raise DumpError("collate: empty batch")
    width = max(len(r["input_ids"]) for r in rows)
    bsz = len(rows)
    aux0, fin0 = rows[0]["aux"], rows[0]["final"]
    out = {
        "input_ids": torch.zeros(bsz, width, dtype=torch.long),
        "loss_mask": torch.zeros(bsz, width, dtype=torch.long),
        "attention_mask": torch.zeros(bsz, width, dtype=torch.long),
        "aux": torch.zeros(bsz, width, aux0.shape[-1], dtype=aux0.dtype),
        "final": torch.zeros(bsz, width, fin0.shape[-1], dtype=fin0.dtype),
        "row_index": torch.tensor([int(r.get("row_index", -1)) for r in rows], dtype=torch.long),
    }
    for j, r in enumerate(rows):
        n = len(r["input_ids"])
        out["input_ids"][j, :n] = r["input_ids"]
        out["loss_mask"][j, :n] = r["loss_mask"]
        out["attention_mask"][j, :n] = 1
        out["aux"][j, :n] = r["aux"]
        out["final"][j, :n] = r["final"]
    return out
