"""``make_feed``: the one interface the trainer uses for batches, offline (store) or online (target).

Both kinds yield the same batch dicts::

    {"input_ids" [B,T] int64, "loss_mask" [B,T] int64, "attention_mask" [B,T] int64,
     "aux" [B,T,n_aux*H], "final" [B,T,H], "row_index" [B] int64}

(offline batches are on the CPU; online batches are on the target's device: move with
``.to(device)`` either way). Order: the rows of the split are shuffled with
``(recipe.seed, epoch)`` (train) or kept in order (eval), cut into micro-batches of
``recipe.train.micro_batch_size``; the global batch list is truncated to a multiple of
``world_size`` and rank r takes batches r, r+W, r+2W, … (every rank gets the same
count, so collectives never hang). ``state_dict()`` holds (epoch, position): a resumed
run continues at exactly the next batch, also on another number of ranks when the
global batch list divides evenly (see ``load_state_dict``).

Token budget (``recipe.train.max_tokens_per_batch``): a micro-batch is then as many rows
as fit ``rows × longest row <= budget`` (padded size, what the GPU computes), and
``micro_batch_size`` is ignored. The shuffled rows are sorted by length inside windows of
about 64 batches before cutting, so rows of one batch have similar lengths and padding
stays small; the batches are then shuffled again, so lengths do not drift through an
epoch. Each row stays its own sequence (attention never crosses rows), unlike packing
rows into one long sequence, which with dense TTT attention costs O(budget²) per batch
for the masked-out cross-row scores. A row longer than the budget goes alone into its
batch (counted in ``info["rows_over_budget"]``): ``data.max_length`` bounds it already.

Length buckets (``recipe.train.length_buckets``, with a budget): a batch's padded length is the
smallest bucket that holds its longest row, batches are cut by ``rows × bucket <= budget``, and
``pad_batch`` fills each to ``budget // bucket`` rows with filler rows (attention and loss masks
zero). The head then sees one shape per bucket, which a compiled step needs: traced with shapes that
change every step it did not reach its first step in ~4 minutes on the H200 (2026-12-02).

The eval holdout is a deterministic ``recipe.train.eval_fraction`` of rows chosen by a
hash of the row index (independent of seed and of offline/online).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from specheads.dump.online import OnlineFeed
from specheads.dump.reader import DumpDataset, collate, open_manifest
from specheads.errors import DumpError
from specheads.layer_ids import resolve_aux_layer_ids
from specheads.rundir import RunDir, check_online_target, check_stage_inputs


def pad_batch(batch: dict, rows: int, length: int) -> dict:
    """``batch`` grown to [rows, length]: every [B, T, ...] tensor padded with zeros (filler rows and
    positions: attention and loss masks 0, so they count for nothing), a [B] ``row_index`` with -1."""
    B, T = batch["input_ids"].shape
    if (B, T) == (rows, length):
        return batch
    if B > rows or T > length:
        raise ValueError(f"batch [{B}, {T}] does not fit the bucket shape [{rows}, {length}]")
    out = {}
    for k, v in batch.items():
        if torch.is_tensor(v) and v.dim() >= 2 and tuple(v.shape[:2]) == (B, T):
            new = v.new_zeros((rows, length, *v.shape[2:]))
            new[:B, :T] = v
            v = new
        elif torch.is_tensor(v) and v.dim() == 1 and v.shape[0] == B:
            v = torch.cat([v, v.new_full((rows - B,), -1)])
        out[k] = v
    return out


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def holdout_mask(n_rows: int, fraction: float) -> np.ndarray:
    """True for rows in the eval holdout: hash(row index) / 2^64 < fraction."""
    if fraction <= 0:
        return np.zeros(n_rows, dtype=bool)
    u = (_splitmix64(np.arange(n_rows, dtype=np.uint64)) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return u < fraction


def subset_mask(row_ids: np.ndarray, fraction: float) -> np.ndarray:
    """True for a ``fraction`` of rows chosen by another hash of the row index: subsets for
    smaller fractions are nested in larger ones, so a data-size sweep adds rows, never swaps them."""
    if fraction >= 1:
        return np.ones(len(row_ids), dtype=bool)
    salted = np.asarray(row_ids, dtype=np.uint64) ^ np.uint64(0xA5A5_5A5A_1234_4321)
    u = (_splitmix64(salted) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return u < fraction


def split_rows(n_rows: int, fraction: float, split: str) -> np.ndarray:
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    m = holdout_mask(n_rows, fraction)
    return np.nonzero(m if split == "eval" else ~m)[0].astype(np.int64)


class _OfflineSource:
    kind = "offline"

    def __init__(self, ds: DumpDataset, num_workers: int = 0):
        self.ds = ds
        self.num_workers = num_workers

    def __len__(self):
        return len(self.ds)

    def lengths(self) -> np.ndarray:
        return self.ds.row_lengths()

    def batches(self, batch_lists):
        loader = torch.utils.data.DataLoader(
            self.ds, batch_sampler=batch_lists, collate_fn=collate, num_workers=self.num_workers,
            persistent_workers=False, prefetch_factor=4 if self.num_workers else None,
            pin_memory=torch.cuda.is_available(),  # the trainer's copy to the GPU then runs beside the step
        )
        yield from loader


class _OnlineSource:
    kind = "online"

    def __init__(self, feed: OnlineFeed):
        self.feed = feed

    def __len__(self):
        return len(self.feed)

    def lengths(self) -> np.ndarray:
        return self.feed.row_lengths()

    def batches(self, batch_lists):
        for b in batch_lists:
            yield self.feed.batch(b)


class Feed:
    """Iterable over this rank's micro-batches of one epoch; resumable via state_dict."""

    SORT_WINDOW_BATCHES = 64  # batches per length-sorting window: low padding, order still random

    def __init__(self, source, row_ids: np.ndarray, micro_batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 rank: int = 0, world_size: int = 1, split: str = "train", info: dict | None = None,
                 max_tokens: int | None = None, length_buckets: list[int] | None = None):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"train.max_tokens_per_batch must be >= 1, got {max_tokens}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.source = source
        self.kind = source.kind
        self.row_ids = np.asarray(row_ids, dtype=np.int64)
        self.micro_batch_size = int(micro_batch_size)
        self.max_tokens = int(max_tokens) if max_tokens is not None else None
        self.seed, self.shuffle, self.rank, self.world_size, self.split = int(seed), shuffle, rank, world_size, split
        self.info = dict(info or {})
        self.epoch = 0
        self.position = 0
        self._cached: tuple[int, list[list[int]]] | None = None
        self._lengths = source.lengths()[self.row_ids] if self.max_tokens is not None else None
        if self._lengths is not None:
            self.info["rows_over_budget"] = int((self._lengths > self.max_tokens).sum())
        self.length_buckets = [int(b) for b in length_buckets] if length_buckets else None
        if self.length_buckets is not None:
            if self.max_tokens is None:
                raise ValueError("length_buckets need a token budget (train.max_tokens_per_batch)")
            over = np.flatnonzero(self._lengths > self.length_buckets[-1])
            if len(over):
                p = over[np.argmax(self._lengths[over])]
                raise DumpError(f"{split} feed: {len(over)} rows are longer than train.length_buckets' largest "
                                f"bucket {self.length_buckets[-1]} (row {int(self.row_ids[p])}: "
                                f"{int(self._lengths[p])} tokens); add a larger bucket or lower data.max_length")

    @property
    def num_rows(self) -> int:
        return len(self.row_ids)

    def _padded_length(self, longest: int) -> int:
        if self.length_buckets is None:
            return longest
        return next(b for b in self.length_buckets if b >= longest)

    def padded_shape(self, rows: int, longest: int) -> tuple[int, int]:
        """The [rows, length] a batch of ``rows`` rows, the longest ``longest`` tokens, is computed at:
        itself, or with length buckets the bucket's length and ``max_tokens // length`` rows."""
        if self.length_buckets is None:
            return rows, longest
        length = self._padded_length(longest)
        return max(rows, self.max_tokens // length), length

    def _budget_batches(self, order: np.ndarray, rng) -> list[list[int]]:
        """Cut ``order`` (positions into row_ids) into batches of at most max_tokens padded tokens."""
        lens = self._lengths
        # rows per sort window: about SORT_WINDOW_BATCHES batches of rows of the mean length
        mean_len = max(1, int(lens.mean())) if len(lens) else 1
        window = max(1, self.SORT_WINDOW_BATCHES * self.max_tokens // mean_len)
        out: list[list[int]] = []
        for w in range(0, len(order), window):
            chunk = order[w:w + window]
            chunk = chunk[np.argsort(lens[chunk], kind="stable")]
            cur: list[int] = []
            longest = 0
            for p in chunk:
                n = int(lens[p])
                if cur and (len(cur) + 1) * self._padded_length(max(longest, n)) > self.max_tokens:
                    out.append(cur)
                    cur, longest = [], 0
                cur.append(int(self.row_ids[p]))
                longest = max(longest, n)
            if cur:
                out.append(cur)
        if rng is not None:
            out = [out[i] for i in rng.permutation(len(out))]
        return out

    def global_batches(self, epoch: int) -> list[list[int]]:
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        rng = np.random.default_rng([self.seed, epoch, 0x5EED]) if self.shuffle else None
        order = rng.permutation(len(self.row_ids)) if rng is not None else np.arange(len(self.row_ids))
        if self.max_tokens is not None:
            out = self._budget_batches(order, rng)
        else:
            ids = self.row_ids[order]
            mbs = self.micro_batch_size
            out = [ids[i:i + mbs].tolist() for i in range(0, len(ids), mbs)]
        keep = len(out) - len(out) % self.world_size
        self._cached = (epoch, out[:keep])
        return self._cached[1]

    def batches(self, epoch: int | None = None) -> list[list[int]]:
        """This rank's batches (lists of row indices) for an epoch."""
        return self.global_batches(self.epoch if epoch is None else epoch)[self.rank::self.world_size]

    def __len__(self) -> int:
        """This rank's batch count in the current epoch (with a token budget it varies a little by epoch)."""
        if self.max_tokens is not None:
            return len(self.global_batches(self.epoch)) // self.world_size
        n = -(-len(self.row_ids) // self.micro_batch_size)
        return (n - n % self.world_size) // self.world_size

    def padding_fraction(self, epoch: int = 0) -> float:
        """Share of padded token slots in an epoch's batches (rows × longest row, or the bucket's shape)."""
        row_lengths = self._lengths if self._lengths is not None else self.source.lengths()[self.row_ids]
        lengths = dict(zip(self.row_ids.tolist(), row_lengths.tolist()))
        real = padded = 0
        for b in self.global_batches(epoch):
            ls = [lengths[i] for i in b]
            real += sum(ls)
            r, t = self.padded_shape(len(ls), max(ls))
            padded += r * t
        return 1.0 - real / padded if padded else 0.0

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position = int(epoch), 0

    def __iter__(self):
        """The remaining batches of the current epoch; afterwards the feed moves to the next epoch."""
        if self.position >= len(self):
            self.set_epoch(self.epoch + 1)
        mine = self.batches()[self.position:]
        for batch in self.source.batches(mine):
            self.position += 1
            yield batch
        if self.position >= len(self):
            self.set_epoch(self.epoch + 1)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "global_position": self.position * self.world_size,
                "seed": self.seed, "split": self.split, "world_size": self.world_size,
                "micro_batch_size": self.micro_batch_size, "max_tokens": self.max_tokens,
                "length_buckets": self.length_buckets, "num_rows": self.num_rows}

    def load_state_dict(self, state: dict) -> None:
        """Continue at the saved batch. A state saved with another world size continues at the same
        global batch: ``global_position`` (batches all ranks consumed) must divide by this world size,
        which holds when the global batch (ranks × grad_accum) is kept and the save fell on a step."""
        for key, mine in (("seed", self.seed), ("micro_batch_size", self.micro_batch_size),
                          ("max_tokens", self.max_tokens), ("length_buckets", self.length_buckets),
                          ("num_rows", self.num_rows), ("split", self.split)):
            if key in state and state[key] != mine:
                raise DumpError(
                    f"feed state was saved with {key}={state[key]!r}, this run has {mine!r}: the batch order "
                    f"would differ, so the run cannot resume at the same batch"
                )
        saved_world = int(state.get("world_size", self.world_size))
        if saved_world == self.world_size:
            self.epoch, self.position = int(state["epoch"]), int(state["position"])
            return
        if "global_position" not in state:
            raise DumpError(f"feed state was saved with world_size={saved_world} by a version without "
                            f"global_position; it can only resume on {saved_world} ranks, this run has {self.world_size}")
        consumed = int(state["global_position"])
        # a different world size truncates the epoch's batch list to another multiple; the order is the same
        if consumed % self.world_size:
            raise DumpError(
                f"feed state: {consumed} global batches were consumed on {saved_world} ranks, which does not "
                f"divide by this run's {self.world_size} ranks; keep world_size x train.grad_accum equal to the "
                f"saved run's so every optimizer step consumes whole batches on every rank"
            )
        self.epoch, self.position = int(state["epoch"]), consumed // self.world_size


def _expected_layer_ids(recipe, target, num_layers: int | None) -> list[int]:
    """The head's aux layer ids, resolved against the target (or, without one, the store's num_layers)."""
    return resolve_aux_layer_ids(recipe.head.aux_layer_ids, target.num_layers if target is not None else num_layers,
                                 kind=recipe.head.kind)


def make_feed(recipe, target=None, split: str = "train", rank: int = 0, world_size: int = 1, *,
              rows=None, expected_config_hash: str | None = None, dtype: torch.dtype | None = None) -> Feed:
    """Batches of ``recipe.train.micro_batch_size`` rows (or of ``train.max_tokens_per_batch``
    padded tokens) from the store (``dump.mode=offline``)
    or from the target run on the token rows (``online``).

    Offline: the store is checked against ``target.identity()`` when a target is given,
    else against ``expected_config_hash`` (one of the two is required), and against the
    head's aux layer ids. ``dtype`` casts aux/final (default: stored dtype, fp8 → bf16,
    offline; the target's dtype online).
    """
    mode, paths = recipe.dump.mode, RunDir(recipe)
    if mode == "offline":
        if target is None and expected_config_hash is None:
            raise DumpError("an offline feed needs the target (or expected_config_hash) to check the store against")
        manifest = open_manifest(paths.dump)
        check_stage_inputs(manifest.get("recipe_inputs"), recipe, "prepare", paths.dump,
                           "specheads data prepare RECIPE` and `specheads dump RECIPE")
        layer_ids = _expected_layer_ids(recipe, target, manifest["target"]["num_layers"])
        ds = DumpDataset(paths.dump, expected_target=target.identity() if target is not None else None,
                         expected_config_hash=expected_config_hash, expected_layer_ids=layer_ids, dtype=dtype)
        source = _OfflineSource(ds, num_workers=recipe.train.num_workers)
        info = {"target": ds.target, "aux_layer_ids": ds.aux_layer_ids, "hidden_size": ds.hidden_size,
                "dtype": ds.stored}
    elif mode == "online":
        rows_target = None
        if rows is None:
            from specheads.data.stage import check_rows

            rows_target = check_rows(recipe).get("target")
        if target is None:
            from specheads.dump.writer import _device_for
            from specheads.target import load_target_for

            device = _device_for(recipe, int(os.environ.get("LOCAL_RANK", "0")))
            target = load_target_for(recipe, device=str(device), require_chat_template=False)
        check_online_target(rows_target, target, paths.rows)
        online = OnlineFeed(target, rows if rows is not None else paths.rows,
                            aux_layer_ids=_expected_layer_ids(recipe, target, None), dtype=dtype,
                            compute_dtype=recipe.dump.compute_dtype)
        source = _OnlineSource(online)
        info = {"target": target.identity(), "aux_layer_ids": online.aux_layer_ids,
                "hidden_size": target.hidden_size, "dtype": str(target.dtype).replace("torch.", "")}
    else:
        raise DumpError(f"dump.mode must be 'offline' or 'online', got {mode!r}")
    ids = split_rows(len(source), recipe.train.eval_fraction, split)
    if split == "train":
        ids = ids[subset_mask(ids, recipe.train.data_fraction)]
    return Feed(source, ids, recipe.train.micro_batch_size, seed=recipe.seed, shuffle=(split == "train"),
                rank=rank, world_size=world_size, split=split, info=info,
                max_tokens=recipe.train.max_tokens_per_batch, length_buckets=recipe.train.length_buckets)
