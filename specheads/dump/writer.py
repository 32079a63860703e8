"""``run_dump``: run the target over the token rows and write the hidden-state store.

Determinism and resume
    Shards are consecutive row ranges cut by ``plan_shards`` (row lengths and
    ``dump.shard_tokens`` only). Each shard is computed from its own rows in a fixed
    batching (``pack_batches``: length-sorted, at most ``dump.batch_tokens`` padded
    tokens), so a rerun recomputes exactly the same batches: after ``kill -9`` at any
    moment, rerunning the same command skips finished shards (checked by sha256 against
    their ``.progress`` record) and ends with a store byte-identical to an
    uninterrupted run.

Ranks
    Under ``torchrun`` (RANK / WORLD_SIZE / LOCAL_RANK) shard i belongs to rank
    ``i % world_size``; each rank runs on ``cuda:LOCAL_RANK`` (when CUDA is present) and
    writes its own shards. The shard records are gathered over a gloo group and rank 0
    writes the one manifest: the store equals the one a single process writes. Without
    a launcher it runs as one process.

Overlap
    Per batch everything stays on the device (forward, padding strip, bf16/fp8
    conversion, scatter into the shard buffer): no host synchronisation. A finished
    shard goes to a writer thread (device→host copy on a side stream, sha256, write,
    fsync, rename) while the next shard computes.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import shutil
import sys
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np
import torch

from specheads.dump.rows import TokenRows
from specheads.errors import DumpError
from specheads.fileio import tmp_path_for
from specheads.dump.store import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    PROGRESS_DIR,
    ShardPlan,
    bytes_per_token,
    file_sha256,
    pack_batches,
    plan_shards,
    progress_path,
    quantize_fp8,
    raw_dtype,
    read_manifest,
    rows_digest,
    st_dtype,
    tmp_name,
    write_json_atomic,
    write_safetensors_atomic,
)
from specheads.rundir import RunDir, check_store_compatible, stage_inputs, stage_lock

log = logging.getLogger("specheads.dump")

# Test hook: called in the main thread with each finished shard's record (raise to simulate a crash).
_after_shard = None


# --- distributed -------------------------------------------------------------------------------


class _Dist:
    """Rank bookkeeping; collectives over gloo (object gathers only), no-ops for one process."""

    def __init__(self, rank: int | None, world_size: int | None):
        env_ws = int(os.environ.get("WORLD_SIZE", "1"))
        self.world_size = int(world_size if world_size is not None else env_ws)
        self.rank = int(rank if rank is not None else os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank if self.world_size > 1 else 0))
        if not 0 <= self.rank < self.world_size:
            raise DumpError(f"rank {self.rank} is outside world size {self.world_size}")
        self.group = None
        self.owned = False
        if self.world_size > 1:
            import torch.distributed as dist

            timeout = datetime.timedelta(hours=48)  # ranks wait for the slowest at the end
            if not dist.is_initialized():
                if "MASTER_ADDR" not in os.environ:
                    raise DumpError(
                        f"world_size={self.world_size} needs a launcher (torchrun sets MASTER_ADDR/MASTER_PORT)"
                    )
                dist.init_process_group("gloo", rank=self.rank, world_size=self.world_size, timeout=timeout)
                self.owned = True
            elif dist.get_rank() != self.rank or dist.get_world_size() != self.world_size:
                raise DumpError(
                    f"rank/world_size {self.rank}/{self.world_size} disagree with the process group "
                    f"{dist.get_rank()}/{dist.get_world_size()}"
                )
            elif dist.get_backend() != "gloo":
                self.group = dist.new_group(backend="gloo", timeout=timeout)

    def all_gather(self, obj):
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self):
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def close(self):
        if self.owned:
            import torch.distributed as dist

            dist.destroy_process_group()


def _device_for(recipe, local_rank: int) -> torch.device:
    from specheads.target import resolve_device

    want = recipe.target.device
    if torch.cuda.is_available() and want in ("auto", "cuda"):
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return resolve_device(want)


# --- the manifest header -----------------------------------------------------------------------


def _header(target, layer_ids, recipe, rows_sha: str) -> dict:
    ident = target.identity()
    target_dtype = str(target.dtype).replace("torch.", "")
    doc = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "target": {k: ident.get(k) for k in
                   ("name", "config_hash", "model_type", "num_layers", "hidden_size", "vocab_size", "adapter")},
        "target_dtype": target_dtype,
        # what the forward's matmuls ran in (dump.compute_dtype, else the target's own dtype)
        "compute_dtype": recipe.dump.compute_dtype or target_dtype,
        "aux_layer_ids": list(layer_ids),
        "dtype": recipe.dump.dtype,
        "max_length": int(recipe.data.max_length),
        "shard_tokens": int(recipe.dump.shard_tokens),
        "batch_tokens": int(recipe.dump.batch_tokens),
        "rows_sha256": rows_sha,
        # the recipe settings the token rows were prepared with: training refuses a stale store
        "recipe_inputs": stage_inputs(recipe, "prepare"),
        "layout": {
            "input_ids": "int32 [N]", "loss_mask": "uint8 [N]", "row_offsets": "int64 [rows+1]",
            "aux": f"[N, {len(layer_ids)}*{target.hidden_size}] = cat(output_hidden_states[i] for i in aux_layer_ids)",
            "final": f"[N, {target.hidden_size}] = output of the final norm (output_hidden_states[-1])",
        },
    }
    if recipe.dump.dtype == "fp8":
        doc["fp8"] = {
            "format": "float8_e4m3fn",
            "scales": "aux_scale fp32 [N, n_aux] (per token, per aux layer), final_scale fp32 [N] (per token)",
            "dequant": "x = float(q) * scale; scale = amax(|x|)/448",
            "error_bound": "|x_hat - x| <= 2^-4*|x| + 2^-10*scale",
        }
    return doc


def _final_manifest(header: dict, records: list[dict]) -> dict:
    doc = dict(header)
    doc["complete"] = True
    doc["shards"] = records
    doc["counts"] = {
        "rows": sum(r["rows"] for r in records),
        "tokens": sum(r["tokens"] for r in records),
        "masked_tokens": sum(r["masked_tokens"] for r in records),
        "shards": len(records),
        "bytes": sum(r["bytes"] for r in records),
    }
    return doc


# --- one shard ---------------------------------------------------------------------------------


def _compute_shard(target, plan: ShardPlan, ids: np.ndarray, offsets: np.ndarray, layer_ids, stored: str,
                   batch_tokens: int, device: torch.device, pbar, compute_dtype: str | None = None) -> dict:
    """Run the target over one shard's rows; returns device buffers in shard row order."""
    n = int(offsets[-1])
    hid = target.hidden_size
    n_aux = len(layer_ids)
    rdt = raw_dtype(stored)
    bufs = {
        "aux": torch.empty(n, n_aux * hid, dtype=rdt, device=device),
        "final": torch.empty(n, hid, dtype=rdt, device=device),
    }
    if stored == "fp8":
        bufs["aux_scale"] = torch.empty(n, n_aux, dtype=torch.float32, device=device)
        bufs["final_scale"] = torch.empty(n, dtype=torch.float32, device=device)
    bad = torch.zeros((), dtype=torch.int64, device=device)
    lens = np.diff(offsets)
    ids64 = torch.from_numpy(ids.astype(np.int64))
    for batch in pack_batches(lens.tolist(), batch_tokens):
        width = int(lens[batch[0]])
        inp = torch.zeros(len(batch), width, dtype=torch.long)
        att = torch.zeros(len(batch), width, dtype=torch.long)
        src, dst = [], []
        for j, r in enumerate(batch):
            ln, o = int(lens[r]), int(offsets[r])
            inp[j, :ln] = ids64[o:o + ln]
            att[j, :ln] = 1
            src.append(np.arange(j * width, j * width + ln))
            dst.append(np.arange(o, o + ln))
        padded = bool(int(att.sum()) != att.numel())
        aux, final = target.hidden_states(
            inp.to(device), att.to(device) if padded else None, aux_layer_ids=layer_ids, compute_dtype=compute_dtype
        )
        src_t = torch.from_numpy(np.concatenate(src)).to(device)
        dst_t = torch.from_numpy(np.concatenate(dst)).to(device)
        a = aux.reshape(-1, aux.shape[-1]).index_select(0, src_t)
        f = final.reshape(-1, final.shape[-1]).index_select(0, src_t)
        bad += (~torch.isfinite(a)).sum() + (~torch.isfinite(f)).sum()
        if stored == "fp8":
            qa, sa = quantize_fp8(a, n_aux)
            qf, sf = quantize_fp8(f, 1)
            bufs["aux"].index_copy_(0, dst_t, qa.view(torch.uint8))
            bufs["final"].index_copy_(0, dst_t, qf.view(torch.uint8))
            bufs["aux_scale"].index_copy_(0, dst_t, sa)
            bufs["final_scale"].index_copy_(0, dst_t, sf[:, 0])
        elif stored == "bfloat16":
            bufs["aux"].index_copy_(0, dst_t, a.to(torch.bfloat16).view(torch.int16))
            bufs["final"].index_copy_(0, dst_t, f.to(torch.bfloat16).view(torch.int16))
        else:
            bufs["aux"].index_copy_(0, dst_t, a.float())
            bufs["final"].index_copy_(0, dst_t, f.float())
        if pbar is not None:
            pbar.update(len(src_t))
    bufs["_bad"] = bad
    return bufs


def _write_shard(root: Path, plan: ShardPlan, bufs: dict, ids, mask, offsets, stored: str, n_aux: int,
                 digest: str, meta: dict, device: torch.device, event) -> dict:
    """Writer thread: copy the shard to the host, write it atomically, record it."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            stream = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                stream.wait_event(event)
                host = {k: v.to("cpu") for k, v in bufs.items()}
        bufs.clear()  # the copy is complete: give the device memory back now
    else:
        host = bufs
    bad = int(host.pop("_bad"))
    if bad:
        raise DumpError(
            f"{bad} non-finite values (NaN/inf) in the hidden states of {plan.file} (rows "
            f"{plan.row_start}..{plan.row_end - 1}); a float16 target overflows easily: use "
            f"target.dtype=bfloat16 or float32"
        )
    n = int(offsets[-1])
    hid = host["final"].shape[1]
    sd = st_dtype(stored)
    arrays = {
        "input_ids": ("I32", [n], ids),
        "loss_mask": ("U8", [n], mask),
        "row_offsets": ("I64", [len(offsets)], offsets),
        "aux": (sd, [n, n_aux * hid], host["aux"]),
        "final": (sd, [n, hid], host["final"]),
    }
    if stored == "fp8":
        arrays["aux_scale"] = ("F32", [n, n_aux], host["aux_scale"])
        arrays["final_scale"] = ("F32", [n], host["final_scale"])
    metadata = dict(meta, shard=str(plan.index), row_start=str(plan.row_start), row_end=str(plan.row_end))
    sha, nbytes = write_safetensors_atomic(root / plan.file, arrays, metadata)
    record = {
        "index": plan.index, "file": plan.file, "row_start": plan.row_start, "row_end": plan.row_end,
        "rows": plan.rows, "tokens": plan.tokens, "masked_tokens": int(mask.sum(dtype=np.int64)),
        "bytes": nbytes, "sha256": sha, "rows_sha256": digest,
    }
    write_json_atomic(progress_path(root, plan.index), record)
    return record


def _verify_record(root: Path, plan: ShardPlan, record: dict | None, digest: str) -> bool:
    if not record:
        return False
    path = root / plan.file
    if (record.get("index"), record.get("row_start"), record.get("row_end"), record.get("rows_sha256")) != (
        plan.index, plan.row_start, plan.row_end, digest
    ):
        return False
    if not path.is_file() or path.stat().st_size != record.get("bytes"):
        return False
    return file_sha256(path) == record.get("sha256")


# --- the dump ----------------------------------------------------------------------------------


@stage_lock("dump")
def run_dump(recipe, target=None, rows=None, rank: int | None = None, world_size: int | None = None, *,
             progress: bool = True, writer_threads: int | None = None) -> dict:
    """Dump aux/final hidden states of ``rows`` (default: ``RunDir(recipe).rows``) to ``RunDir(recipe).dump``.

    Returns the manifest (on every rank). Rerunning the same command resumes.
    ``writer_threads``: shards written concurrently while the next computes (default
    2–4 by CPU count); each holds one shard in host memory.
    """
    if writer_threads is None:
        writer_threads = max(2, min(4, (os.cpu_count() or 2) // 4))
    stored = recipe.dump.dtype
    dist = _Dist(rank, world_size)
    if rows is None:
        from specheads.data.stage import check_rows

        summary = check_rows(recipe)  # missing or stale rows fail before the target loads
        if dist.rank == 0:
            check_disk_for_dump(recipe, int(summary.get("tokens") or 0))
    try:
        if target is None:
            from specheads.target import load_target_for

            device = _device_for(recipe, dist.local_rank)
            if device.type == "cuda":
                torch.cuda.set_device(device)
            target = load_target_for(recipe, device=str(device), require_chat_template=False)
        device = target.device
        trows = TokenRows(rows if rows is not None else RunDir(recipe).rows)
        layer_ids = dump_layer_ids(recipe, target)
        root = RunDir(recipe).dump
        # the rows' summary.json, by digest: training refuses this store once the rows are prepared anew
        summary = RunDir(recipe).rows / "summary.json"
        summary_sha = file_sha256(summary) if rows is None and summary.is_file() else None
        return _run(recipe, target, trows, layer_ids, stored, root, device, dist, progress, writer_threads,
                    rows_summary_sha256=summary_sha)
    finally:
        dist.close()


def check_disk_for_dump(recipe, tokens: int) -> None:
    """Refuse, before the target loads, a dump the disk cannot hold: the store's size from the rows' token count,
    the layers and the target's hidden size (its config alone), less the shards a resume keeps."""
    from specheads.layer_ids import resolve_aux_layer_ids
    from specheads.target import target_facts_for

    facts = target_facts_for(recipe)
    n_layers, hidden = int(facts["num_hidden_layers"]), int(facts["hidden_size"])
    ids = resolve_aux_layer_ids(recipe.dump.aux_layer_ids or recipe.head.aux_layer_ids, n_layers,
                                kind=recipe.head.kind)
    root = RunDir(recipe).dump
    needed = tokens * bytes_per_token(recipe.dump.dtype, len(ids), hidden)
    have = sum(p.stat().st_size for p in root.glob("*.safetensors")) if root.is_dir() else 0
    probe = next(p for p in (root, *root.parents) if p.exists())
    free = shutil.disk_usage(probe).free
    if needed - have > free:
        raise DumpError(
            f"{root}: the dump of {tokens:,} tokens ({len(ids)} layers + the final state, hidden {hidden}, "
            f"{recipe.dump.dtype}) needs about {needed / 1e9:.1f} GB ({have / 1e9:.1f} GB of it already written) but "
            f"only {free / 1e9:.1f} GB are free there. Train online instead (dump.mode=online: the target runs "
            f"inside the trainer, nothing is stored), or store fp8 (dump.dtype=fp8), or free space")


def dump_layer_ids(recipe, target) -> list[int]:
    """The layers a store holds: ``dump.aux_layer_ids`` when given (e.g. an EAGLE-3 head's and a DFlash
    head's together), else the head's; the head's must be among them."""
    head = target.aux_layer_ids(recipe.head.aux_layer_ids, kind=recipe.head.kind)
    if recipe.dump.aux_layer_ids is None:
        return head
    ids = target.aux_layer_ids(recipe.dump.aux_layer_ids, where="dump.aux_layer_ids")
    missing = [i for i in head if i not in ids]
    if missing:
        raise DumpError(f"dump.aux_layer_ids {ids} lacks layer(s) {missing} that the {recipe.head.kind} head reads "
                        f"({head}): add them, or leave dump.aux_layer_ids unset to store the head's layers")
    return ids


def _run(recipe, target, trows, layer_ids, stored, root, device, dist, progress, writer_threads, *,
         rows_summary_sha256: str | None = None) -> dict:
    """The dump as a pipeline; every step runs on every rank in the same order (collectives inside)."""
    lengths = trows.lengths()
    _check_row_lengths(lengths, recipe.data.max_length)
    plans = plan_shards(lengths, recipe.dump.shard_tokens)
    digests = _shard_digests(trows, plans, target.vocab_size)
    header = _header(target, layer_ids, recipe, hashlib.sha256("".join(digests).encode()).hexdigest())
    if rows_summary_sha256 is not None:
        header["rows_summary_sha256"] = rows_summary_sha256  # sha256 of the token rows' summary.json
    existing = _open_store(root, header, dist)
    mine = [p for p in plans if p.index % dist.world_size == dist.rank]
    records, todo = _keep_finished_shards(root, mine, existing, digests)
    _start_manifest(root, header, existing, lengths, len(plans), todo, dist)
    _log_plan(root, todo, records, stored, len(layer_ids), target.hidden_size, dist)
    records.update(_compute_and_write_shards(recipe, target, trows, todo, layer_ids, stored, root, device, digests,
                                             _shard_metadata(header, layer_ids, stored, target.hidden_size),
                                             dist, progress, writer_threads))
    return _finish_manifest(root, header, plans, mine, records, dist)


# --- pipeline steps ----------------------------------------------------------------------------


def _check_row_lengths(lengths: np.ndarray, max_length: int) -> None:
    """Refuse an empty row set, empty rows and rows longer than ``data.max_length``."""
    if len(lengths) == 0:
        raise DumpError("no token rows to dump")
    empty = np.nonzero(lengths == 0)[0]
    if len(empty):
        raise DumpError(f"row {int(empty[0])} is empty (0 tokens); drop it in data prepare")
    too_long = np.nonzero(lengths > max_length)[0]
    if len(too_long):
        r = int(too_long[0])
        raise DumpError(
            f"row {r} has {int(lengths[r])} tokens, more than data.max_length={max_length} "
            f"({len(too_long)} row(s) too long); re-run data prepare with this max_length or raise it"
        )


def _shard_digests(trows: TokenRows, plans: list[ShardPlan], vocab_size: int) -> list[str]:
    """``rows_digest`` of each shard's token rows (checking every token id against the vocabulary)."""
    digests = []
    for p in plans:
        ids, mask, off = trows.range(p.row_start, p.row_end)
        if len(ids) and int(ids.max()) >= vocab_size:
            k = int(np.nonzero(ids >= vocab_size)[0][0])
            r = p.row_start + int(np.searchsorted(off, k, side="right") - 1)
            raise DumpError(f"row {r}: token id {int(ids[k])} >= the target's vocab_size {vocab_size}")
        digests.append(rows_digest(ids, mask, off))
    return digests


def _open_store(root: Path, header: dict, dist: _Dist) -> dict | None:
    """Create ``root`` and return its manifest (None for a new store).

    Refuses a store of another target / layer set / layout — on every rank, before
    anything is written.
    """
    root.mkdir(parents=True, exist_ok=True)
    existing = read_manifest(root)
    err = None
    if existing is not None:
        try:
            check_store_compatible(existing, header, root)
        except DumpError as e:
            err = e
    errors = dist.all_gather(str(err) if err else None)
    if err is not None:
        raise err
    if any(errors):
        raise DumpError(next(e for e in errors if e))
    if existing is not None and dist.rank == 0:
        for key in ("batch_tokens", "target_dtype", "compute_dtype"):
            if existing.get(key) != header[key]:
                log.warning("%s: the store was started with %s=%r, this run uses %r; shards computed "
                            "now may differ numerically from an uninterrupted run", root, key,
                            existing.get(key), header[key])
    return existing


def _keep_finished_shards(root: Path, mine: list[ShardPlan], existing: dict | None,
                          digests: list[str]) -> tuple[dict[int, dict], list[ShardPlan]]:
    """Split this rank's shards into verified finished ones (their records) and the ones to compute.

    A shard is finished when its ``.progress`` record (or, for a complete store, its
    manifest record) matches the plan and the file's size and sha256. Anything else of
    an unfinished shard (partial temporary file, file, record) is removed.
    """
    known = {}
    if existing is not None and existing.get("complete"):
        known = {r["index"]: r for r in existing.get("shards", [])}
    records: dict[int, dict] = {}
    todo: list[ShardPlan] = []
    for p in mine:
        tmp = root / tmp_name(p.file)
        if tmp.exists():
            tmp.unlink()
        rec = known.get(p.index)
        pp = progress_path(root, p.index)
        if pp.is_file():
            try:
                rec = json.loads(pp.read_text())
            except ValueError:
                rec = None
        if _verify_record(root, p, rec, digests[p.index]):
            records[p.index] = rec
        else:
            todo.append(p)
            for stale in (root / p.file, pp):
                if stale.exists():
                    stale.unlink()
    return records, todo


def _start_manifest(root: Path, header: dict, existing: dict | None, lengths: np.ndarray, n_shards: int,
                    todo: list[ShardPlan], dist: _Dist) -> None:
    """Rank 0 writes the header manifest (``complete: false``) unless a complete store needs nothing."""
    need = dist.all_gather(len(todo))
    if dist.rank == 0:
        for mtmp in (root / tmp_name(MANIFEST), tmp_path_for(root / MANIFEST)):
            mtmp.unlink(missing_ok=True)
        if existing is None or sum(need) or not existing.get("complete"):
            write_json_atomic(root / MANIFEST, dict(header, complete=False, shards=[], counts={
                "rows": len(lengths), "tokens": int(lengths.sum()), "shards": n_shards}))
    (root / PROGRESS_DIR).mkdir(exist_ok=True)


def _log_plan(root: Path, todo: list[ShardPlan], records: dict, stored: str, n_aux: int, hidden: int,
              dist: _Dist) -> None:
    """Rank 0: warn when the disk looks too small, say how many finished shards were kept."""
    if dist.rank != 0:
        return
    est = sum(p.tokens for p in todo) * bytes_per_token(stored, n_aux, hidden)
    free = shutil.disk_usage(root).free
    if est > free:
        log.warning("%s: this rank alone needs about %.1f GB for its shards but only %.1f GB are free",
                    root, est / 1e9, free / 1e9)
    if len(records):
        log.info("%s: %d finished shard(s) verified and kept", root, len(records))


def _shard_metadata(header: dict, layer_ids, stored: str, hidden: int) -> dict[str, str]:
    """The ``__metadata__`` every shard of this store carries (plus its own index and row range)."""
    return {
        "format": "pt", "specheads_format": FORMAT, "format_version": str(FORMAT_VERSION), "dtype": stored,
        "aux_layer_ids": json.dumps(list(layer_ids)), "config_hash": header["target"]["config_hash"],
        "hidden_size": str(hidden),
    }


def _progress_bar(progress: bool, dist: _Dist, total_tokens: int, stored: str):
    if not (progress and dist.local_rank == 0 and total_tokens):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total_tokens, unit="tok", unit_scale=True, dynamic_ncols=True,
                desc=f"dump {stored}" + (f" rank {dist.rank}/{dist.world_size}" if dist.world_size > 1 else ""),
                file=sys.stderr)


def _compute_and_write_shards(recipe, target, trows: TokenRows, todo: list[ShardPlan], layer_ids, stored: str,
                              root: Path, device: torch.device, digests: list[str], meta: dict, dist: _Dist,
                              progress: bool, writer_threads: int) -> dict[int, dict]:
    """Compute the shards in ``todo`` in order; each finished one goes to a writer thread while the
    next computes (at most ``writer_threads`` in flight). Returns their records by index."""
    done_records: dict[int, dict] = {}
    n_aux = len(layer_ids)
    pbar = _progress_bar(progress, dist, sum(p.tokens for p in todo), stored)
    pool = ThreadPoolExecutor(max_workers=max(1, writer_threads), thread_name_prefix="dump-writer")
    pending: set = set()

    def collect(block_until: int):
        nonlocal pending
        while len(pending) > block_until:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in sorted(done, key=id):
                rec = fut.result()  # re-raises a writer's error (disk full, NaN)
                done_records[rec["index"]] = rec
                if _after_shard is not None:
                    _after_shard(rec)

    try:
        for p in todo:
            ids, mask, off = trows.range(p.row_start, p.row_end)
            with torch.inference_mode():
                bufs = _compute_shard(target, p, ids, off, layer_ids, stored, recipe.dump.batch_tokens, device, pbar,
                                      recipe.dump.compute_dtype)
            event = None
            if device.type == "cuda":
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
            collect(max(1, writer_threads) - 1)
            pending.add(pool.submit(_write_shard, root, p, bufs, ids, mask, off, stored, n_aux,
                                    digests[p.index], meta, device, event))
            del bufs
        collect(0)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        if pbar is not None:
            pbar.close()
    return done_records


def _finish_manifest(root: Path, header: dict, plans: list[ShardPlan], mine: list[ShardPlan],
                     records: dict[int, dict], dist: _Dist) -> dict:
    """Gather every rank's shard records, rank 0 writes the complete manifest, progress records go."""
    gathered = dist.all_gather([records[p.index] for p in mine])
    merged = sorted((r for part in gathered for r in part), key=lambda r: r["index"])
    if [r["index"] for r in merged] != list(range(len(plans))):
        raise DumpError(f"{root}: shard records incomplete after the dump ({len(merged)} of {len(plans)})")
    manifest = _final_manifest(header, merged)
    if dist.rank == 0:
        write_json_atomic(root / MANIFEST, manifest)
    dist.barrier()
    for p in mine:
        pp = progress_path(root, p.index)
        if pp.exists():
            pp.unlink()
    dist.barrier()
    if dist.rank == 0:
        try:
            (root / PROGRESS_DIR).rmdir()
        except OSError:
            pass
    return manifest


def main(argv: list[str] | None = None) -> int:
    """``torchrun --nproc_per_node N -m specheads.dump.writer RECIPE.yaml [key=value ...]``."""
    import argparse

    from specheads.config import load_recipe

    ap = argparse.ArgumentParser(prog="python -m specheads.dump.writer", description=main.__doc__)
    ap.add_argument("recipe", nargs="?")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    recipe = load_recipe(args.recipe, args.overrides)
    m = run_dump(recipe)
    if int(os.environ.get("RANK", "0")) == 0:
        c = m["counts"]
        print(f"dump complete: {RunDir(recipe).dump}: {c['shards']} shards, {c['rows']} rows, {c['tokens']} tokens, "
              f"{c['bytes'] / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
