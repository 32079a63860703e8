"""The hidden-state store: a directory of shards plus ``manifest.json``.

Layout of a store directory::

    manifest.json                   written atomically; "complete": true once every shard exists
    shard-00000.safetensors         packed rows, see below
    shard-00001.safetensors
    .progress/shard-00001.json      per-shard record of a dump in progress (removed on completion)

A shard is one ``.safetensors`` file of packed rows (N tokens, R rows):

    input_ids    int32  [N]
    loss_mask    uint8  [N]
    row_offsets  int64  [R+1]      local: row r is tokens row_offsets[r]:row_offsets[r+1]
    aux          dtype  [N, n_aux*H]   cat(output_hidden_states[i] for i in aux_layer_ids)
    final        dtype  [N, H]         output of the final norm (= output_hidden_states[-1])
    aux_scale    fp32   [N, n_aux]     fp8 only: one scale per token and per aux layer
    final_scale  fp32   [N]            fp8 only: one scale per token

``dtype`` is bfloat16, float32, or fp8 (``float8_e4m3fn`` with the scales above).

fp8 quantisation (per token row, per aux layer): ``s = amax(|x|) / 448`` (1.0 when the
row is all zeros), ``q = e4m3(x / s)`` (round to nearest even), ``x̂ = q · s`` in fp32.
e4m3 keeps 3 mantissa bits, so for every element

    |x̂ − x| ≤ 2⁻⁴·|x| + 2⁻¹⁰·s            (s = amax/448 of that row and layer)

(relative error ≤ 1/16 for normal values; absolute ≤ s/1024 in the subnormal range
|x| < 2⁻⁶·s). Dequantising to bfloat16 adds bf16's own rounding (≤ 2⁻⁹ relative).
fp8 takes 1 byte per value plus 4·(n_aux+1) bytes of scales per token: about half of bf16.

The files are written by this module's own safetensors serialiser (standard format,
readable by ``safetensors.safe_open``) so that the bytes are a pure function of the
content: tensors in a fixed order, header JSON with sorted keys, no timestamps.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specheads import fileio
from specheads.errors import DumpError
from specheads.fileio import fsync_dir, sha256_file as file_sha256

FORMAT = "specheads-dump"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PROGRESS_DIR = ".progress"
FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn

STORED_DTYPES = ("bfloat16", "float32", "fp8")

# safetensors dtype names, numpy dtype of the raw bytes, item size
_ST_DTYPES = {
    "I64": (np.int64, 8),
    "F32": (np.float32, 4),
    "I32": (np.int32, 4),
    "BF16": (np.uint16, 2),
    "U8": (np.uint8, 1),
    "F8_E4M3": (np.uint8, 1),
}


class DumpCorruptError(DumpError):
    """A shard's bytes disagree with the manifest (checksum, size, shapes)."""


# --- naming ----------------------------------------------------------------------------------


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def tmp_name(name: str) -> str:
    """The temporary name a shard is written under (``write_safetensors_atomic``)."""
    return name + ".tmp"


def progress_path(root: Path, index: int) -> Path:
    return Path(root) / PROGRESS_DIR / f"shard-{index:05d}.json"


# --- shard plan --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardPlan:
    index: int
    row_start: int
    row_end: int  # exclusive
    tokens: int

    @property
    def file(self) -> str:
        return shard_name(self.index)

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start


def plan_shards(lengths: np.ndarray, shard_tokens: int) -> list[ShardPlan]:
    """Cut rows (in their order) into shards of at most ``shard_tokens`` tokens.

    Depends only on row lengths and ``shard_tokens`` (never on batching, ranks or
    devices), so every run of the same command cuts the same shards. A row longer
    than ``shard_tokens`` gets a shard of its own.
    """
    if shard_tokens < 1:
        raise DumpError(f"dump.shard_tokens must be >= 1, got {shard_tokens}")
    plans: list[ShardPlan] = []
    start, tokens = 0, 0
    for i, n in enumerate(lengths.tolist()):
        if i > start and tokens + n > shard_tokens:
            plans.append(ShardPlan(len(plans), start, i, tokens))
            start, tokens = i, 0
        tokens += n
    if len(lengths) > start:
        plans.append(ShardPlan(len(plans), start, len(lengths), tokens))
    return plans


def pack_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Length-sorted batches of local row indices, each at most ``batch_tokens`` padded tokens.

    Longest rows first (an out-of-memory shows at once), ties by row index; a batch
    takes rows while ``rows * longest <= batch_tokens`` (a row longer than
    ``batch_tokens`` runs alone). Fixed by the shard's rows: a resumed dump recomputes
    exactly the same batches.
    """
    order = sorted(range(len(lengths)), key=lambda r: (-lengths[r], r))
    batches: list[list[int]] = []
    cur: list[int] = []
    for r in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(r)
    if cur:
        batches.append(cur)
    return batches


def rows_digest(ids: np.ndarray, mask: np.ndarray, offsets: np.ndarray) -> str:
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(offsets, dtype="<i8").tobytes())
    h.update(np.ascontiguousarray(ids, dtype="<i4").tobytes())
    h.update(np.ascontiguousarray(mask, dtype=np.uint8).tobytes())
    return h.hexdigest()


# --- fp8 ---------------------------------------------------------------------------------------


def quantize_fp8(x: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [N, groups*H]`` -> (``q`` float8_e4m3fn [N, groups*H], ``scale`` fp32 [N, groups]).

    One scale per token row and group (aux layer): ``scale = amax/448``.
    """
    n, width = x.shape
    xf = x.float().reshape(n, groups, width // groups)
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (xf / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(n, width), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n, width = q.shape
    groups = scale.shape[-1] if scale.dim() == 2 else 1
    scale = scale.reshape(n, groups, 1).float()
    return (q.float().reshape(n, groups, width // groups) * scale).reshape(n, width).to(dtype)


def fp8_error_bound(x: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """The documented per-element bound ``2⁻⁴|x| + 2⁻¹⁰·s`` (s = amax/448 per row and group)."""
    n, width = x.shape
    xf = x.float().reshape(n, groups, width // groups)
    s = xf.abs().amax(-1, keepdim=True) / FP8_MAX
    return (xf.abs() * 2.0**-4 + s * 2.0**-10).reshape(n, width)


# --- stored dtypes -----------------------------------------------------------------------------


def raw_dtype(stored: str) -> torch.dtype:
    """The integer/float torch dtype shard buffers are kept in (bit patterns for bf16/fp8)."""
    return {"bfloat16": torch.int16, "float32": torch.float32, "fp8": torch.uint8}[stored]


def st_dtype(stored: str) -> str:
    return {"bfloat16": "BF16", "float32": "F32", "fp8": "F8_E4M3"}[stored]


def bytes_per_token(stored: str, n_aux: int, hidden: int) -> int:
    """Bytes a token takes in a shard (excluding the per-row offsets)."""
    item = {"bfloat16": 2, "float32": 4, "fp8": 1}[stored]
    b = (n_aux + 1) * hidden * item + 4 + 1
    if stored == "fp8":
        b += 4 * (n_aux + 1)
    return b


# --- safetensors serialisation -----------------------------------------------------------------


def _write_chunk(f, data: memoryview) -> None:
    """One write of shard bytes (a separate function so tests can simulate a full disk)."""
    f.write(data)


def _as_bytes(t: torch.Tensor | np.ndarray) -> memoryview:
    if isinstance(t, torch.Tensor):
        t = t.detach().contiguous()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        elif t.dtype == FP8_DTYPE:
            t = t.view(torch.uint8)
        t = t.numpy()
    return memoryview(np.ascontiguousarray(t)).cast("B")


def build_header(tensors: dict[str, tuple[str, list[int], int]], metadata: dict[str, str]) -> tuple[bytes, list[str]]:
    """``tensors``: name -> (st dtype, shape, nbytes). Returns (8-byte length + header, order)."""
    order = sorted(tensors, key=lambda k: (-_ST_DTYPES[tensors[k][0]][1], k))
    header: dict = {"__metadata__": dict(sorted(metadata.items()))}
    pos = 0
    for name in order:
        dt, shape, nbytes = tensors[name]
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order


def write_safetensors_atomic(
    path: Path, arrays: dict[str, tuple[str, list[int], torch.Tensor | np.ndarray]], metadata: dict[str, str],
    chunk: int = 64 << 20,
) -> tuple[str, int]:
    """Write a safetensors file via ``path.tmp`` + fsync + rename; returns (sha256, bytes).

    On any OSError the temporary file is removed and a ``DumpError`` naming the file
    is raised (ENOSPC says "disk full"); nothing under the final name changes.
    """
    path = Path(path)
    tmp = path.with_name(tmp_name(path.name))
    views = {k: _as_bytes(v[2]) for k, v in arrays.items()}
    spec = {k: (v[0], v[1], views[k].nbytes) for k, v in arrays.items()}
    head, order = build_header(spec, metadata)
    h = hashlib.sha256()
    total = 0
    # sha256 runs in its own thread, chunk by chunk in file order, while this one writes:
    # the shard costs max(hash, write) instead of their sum (both release the GIL).
    hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256")
    try:
        with open(tmp, "wb") as f:
            for mv in [memoryview(head)] + [views[k] for k in order]:
                for off in range(0, mv.nbytes, chunk):
                    part = mv[off:off + chunk]
                    hasher.submit(h.update, part)
                    _write_chunk(f, part)
                    total += part.nbytes
            f.flush()
            os.fsync(f.fileno())
        hasher.shutdown(wait=True)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        hasher.shutdown(wait=True, cancel_futures=True)
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        if e.errno == errno.ENOSPC:
            raise DumpError(
                f"disk full while writing {path.name} in {path.parent} ({total} of {sum(v.nbytes for v in views.values()) + len(head)} "
                f"bytes written): the partial file was removed and finished shards are kept; free space "
                f"(or choose another dump.dir) and rerun the same command to resume"
            ) from e
        raise DumpError(f"could not write {path.name} in {path.parent}: {e}") from e
    return h.hexdigest(), total


def write_json_atomic(path: Path, doc: dict) -> None:
    """``fileio.write_json_atomic`` with sorted keys (manifests are a pure function of their content);
    an OSError becomes a ``DumpError`` saying the previous version is unchanged."""
    path = Path(path)
    try:
        fileio.write_json_atomic(path, doc, sort_keys=True)
    except OSError as e:
        what = "disk full" if e.errno == errno.ENOSPC else "error"
        raise DumpError(f"{what} while writing {path}: {e}; the previous version is unchanged") from e


def read_header(path: Path) -> tuple[dict, int]:
    """(header dict, data start offset) of a safetensors file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise DumpCorruptError(f"{path.name}: truncated (no safetensors header)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20:
            raise DumpCorruptError(f"{path.name}: implausible safetensors header length {n}")
        text = f.read(n)
    if len(text) < n:
        raise DumpCorruptError(f"{path.name}: truncated inside the safetensors header")
    try:
        return json.loads(text), 8 + n
    except ValueError as e:
        raise DumpCorruptError(f"{path.name}: unreadable safetensors header: {e}") from None


class ShardArrays:
    """Memory-mapped, zero-copy numpy views of one shard's tensors."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.header, start = read_header(self.path)
        size = self.path.stat().st_size
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r") if size > start else np.zeros(0, np.uint8)
        self.arrays: dict[str, np.ndarray] = {}
        for name, info in self.header.items():
            if name == "__metadata__":
                continue
            np_dt, item = _ST_DTYPES.get(info["dtype"], (None, None))
            if np_dt is None:
                raise DumpCorruptError(f"{self.path.name}: tensor {name} has unexpected dtype {info['dtype']}")
            a, b = info["data_offsets"]
            if start + b > size:
                raise DumpCorruptError(f"{self.path.name}: truncated ({size} bytes, tensor {name} ends at {start + b})")
            count = int(np.prod(info["shape"])) if info["shape"] else 1
            if (b - a) != count * item:
                raise DumpCorruptError(f"{self.path.name}: tensor {name} has {b - a} bytes for shape {info['shape']}")
            self.arrays[name] = self._mm[start + a:start + b].view(np_dt).reshape(info["shape"])

    @property
    def metadata(self) -> dict:
        return self.header.get("__metadata__", {})

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]

    def __contains__(self, name: str) -> bool:
        return name in self.arrays

    def dtype_of(self, name: str) -> str:
        return self.header[name]["dtype"]


# --- manifest ----------------------------------------------------------------------------------


def read_manifest(root: Path) -> dict | None:
    p = Path(root) / MANIFEST
    if not p.is_file():
        return None
    try:
        doc = json.loads(p.read_text())
    except ValueError as e:
        raise DumpCorruptError(f"{p}: not valid JSON: {e}") from None
    if doc.get("format") != FORMAT:
        raise DumpError(f"{p}: not a specheads dump manifest (format={doc.get('format')!r})")
    if doc.get("format_version", 0) > FORMAT_VERSION:
        raise DumpError(
            f"{p}: format version {doc['format_version']} is newer than this specheads "
            f"(reads up to {FORMAT_VERSION}); upgrade specheads"
        )
    return doc


def shard_problems(arr: "ShardArrays", record: dict, manifest: dict) -> list[str]:
    """Shape/offset checks of one opened shard against its manifest record (empty = fine)."""
    probs: list[str] = []
    n, rows = record["tokens"], record["rows"]
    hid = manifest["target"]["hidden_size"]
    n_aux = len(manifest["aux_layer_ids"])
    stored = manifest["dtype"]
    want = {
        "input_ids": ("I32", [n]), "loss_mask": ("U8", [n]), "row_offsets": ("I64", [rows + 1]),
        "aux": (st_dtype(stored), [n, n_aux * hid]), "final": (st_dtype(stored), [n, hid]),
    }
    if stored == "fp8":
        want["aux_scale"] = ("F32", [n, n_aux])
        want["final_scale"] = ("F32", [n])
    for name, (dt, shape) in want.items():
        if name not in arr:
            probs.append(f"tensor {name} missing")
            continue
        info = arr.header[name]
        if info["dtype"] != dt or list(info["shape"]) != shape:
            probs.append(f"tensor {name} is {info['dtype']} {info['shape']}, expected {dt} {shape}")
    extra = set(arr.arrays) - set(want)
    if extra:
        probs.append(f"unexpected tensors {sorted(extra)}")
    if "row_offsets" in arr and not probs:
        off = np.asarray(arr["row_offsets"])
        if off[0] != 0 or off[-1] != n or np.any(np.diff(off) <= 0):
            probs.append("row_offsets are not strictly increasing from 0 to the token count")
        if "loss_mask" in arr and int(np.asarray(arr["loss_mask"]).sum(dtype=np.int64)) != record.get("masked_tokens"):
            probs.append("masked token count disagrees with the manifest")
    return probs
