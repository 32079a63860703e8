"""The run directory: where each stage's output lives, and what it must agree with.

One module for every fact about a run directory, in four parts:

* **paths**: :class:`RunDir` (``RunDir(recipe).rows``, ``.vocab``, ``.dump``, ``.train``,
  ``.export``, ``.eval``, ``.regenerated``, ``.synthesized``): a recipe key's value where set,
  else the output's place under ``run_dir``.
* **recorded inputs**: :func:`stage_inputs` are the recipe settings that decide what a stage
  writes. Each stage records them beside its output; the stage that reads it compares them with
  its own recipe (:func:`check_stage_inputs`, :class:`StaleInputError`), so a changed
  ``data.sources`` can never silently reuse old conversations.
* **resume fields**: :data:`RESUME_FIELDS`, :func:`resume_fingerprint`,
  :func:`compare_fingerprints`, :func:`client_state`, :func:`recipe_hash`: what a checkpoint
  records and what a run resuming it must share (:class:`ResumeMismatchError`).
* **compatibility**: :func:`check_store_identity`, :func:`check_store_compatible`,
  :func:`check_online_target`: whether a hidden-state store or token rows were made for this
  run's target and layers (:class:`DumpMismatchError`).

``config`` is the schema (typed fields, loading, overrides); this module reads recipes and imports
nothing of specheads but ``config`` and ``errors``: every stage depends on it, it on no stage.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from specheads.config import Recipe
from specheads.errors import DumpError, SpecheadsError

__all__ = [
    "BATCH_SPLIT", "DumpMismatchError", "RESUME_FIELDS", "ResumeMismatchError", "RunDir", "StaleInputError",
    "check_online_target", "check_stage_inputs", "check_store_compatible", "check_store_identity", "client_state",
    "client_world_size", "compare_fingerprints", "describe_target", "recipe_hash", "resume_fingerprint",
    "stage_input_diff", "stage_inputs",
]


# ================================================================ paths


@dataclass(frozen=True)
class RunDir:
    """The output paths of a recipe's run (read from the recipe on each access, so they follow its edits)."""

    recipe: Recipe

    @property
    def root(self) -> Path:
        return Path(self.recipe.run_dir)

    def path(self, *parts: str) -> Path:
        return Path(self.recipe.run_dir, *parts)

    @property
    def rows(self) -> Path:
        """Token rows (``data prepare``): ``data.rows_dir``, else ``{run_dir}/data/rows``."""
        d = self.recipe.data.rows_dir
        return Path(d) if d else self.path("data", "rows")

    @property
    def regenerated(self) -> Path:
        """The target's answers (``data regenerate``): ``data.regenerate.out``, else ``{run_dir}/data/regenerated.jsonl``."""
        r = self.recipe.data.regenerate.out
        return Path(r) if r else self.path("data", "regenerated.jsonl")

    @property
    def synthesized(self) -> Path:
        """Prompts the target wrote (``data synthesize``): ``data.synthesize.out``, else ``{run_dir}/data/synthesized.jsonl``."""
        r = self.recipe.data.synthesize.out
        return Path(r) if r else self.path("data", "synthesized.jsonl")

    @property
    def vocab(self) -> Path:
        """The draft vocabulary (``vocab``): ``vocab.out``, else ``{run_dir}/vocab``."""
        r = self.recipe.vocab.out
        return Path(r) if r else self.path("vocab")

    @property
    def dump(self) -> Path:
        """The hidden-state store (``dump``): ``dump.dir``, else ``{run_dir}/dump``."""
        r = self.recipe.dump.dir
        return Path(r) if r else self.path("dump")

    @property
    def train(self) -> Path:
        """Checkpoints, ``final/`` and metrics (``train``): ``train.out``, else ``{run_dir}/train``."""
        r = self.recipe.train.out
        return Path(r) if r else self.path("train")

    @property
    def export(self) -> Path:
        """The exported head (``export``): ``export.out``, else ``{run_dir}/export/{export.format}``."""
        r = self.recipe.export.out
        return Path(r) if r else self.path("export", self.recipe.export.format)

    @property
    def eval(self) -> Path:
        """Reports and plots (``eval``): ``eval.out``, else ``{run_dir}/eval``."""
        r = self.recipe.eval.out
        return Path(r) if r else self.path("eval")


# ================================================================ recorded inputs


class StaleInputError(SpecheadsError, ValueError):
    """An earlier stage's output was made from other recipe settings than this run's."""


def stage_inputs(recipe: Recipe, stage: str) -> dict:
    """The recipe settings that decide what ``stage`` writes (dotted key -> value)."""
    d, t = recipe.data, recipe.target
    keys = {"target.source": t.source, "target.adapter": t.adapter, "target.chat_template": t.chat_template}
    if stage == "regenerate":
        g = d.regenerate
        return {**keys, "data.sources": [x.model_dump() for x in d.sources],
                "data.holdout_fraction": d.holdout_fraction, "data.regenerate.max_new_tokens": g.max_new_tokens,
                "data.regenerate.temperature": g.temperature, "data.regenerate.top_p": g.top_p,
                "data.regenerate.top_k": g.top_k, "data.regenerate.max_prompt_tokens": g.max_prompt_tokens,
                # recorded only when set, so files written before the setting existed still resume
                **({"data.regenerate.dtype": g.dtype} if g.dtype else {}),
                "seed": recipe.seed}
    if stage == "prepare":
        upstream = stage_inputs(recipe, "regenerate") if d.regenerate.enabled else {
            **keys, "data.sources": [x.model_dump() for x in d.sources]}
        return {**upstream, "data.regenerate.enabled": d.regenerate.enabled, "data.max_length": d.max_length,
                "data.holdout_fraction": d.holdout_fraction}
    if stage == "synthesize":
        # not num_prompts (a larger one extends the same file), batch_size, compile or refill_at (the
        # same output up to floating-point near-ties) or out; the seed file's content is recorded by
        # the stage itself
        s = d.synthesize.model_dump(mode="json")
        return {**keys, **{f"data.synthesize.{k}": v for k, v in s.items()
                           if k not in ("num_prompts", "batch_size", "compile", "refill_at", "out")},
                "seed": recipe.seed}
    if stage == "vocab":
        return {**stage_inputs(recipe, "prepare"), "vocab.draft_vocab_size": recipe.vocab.draft_vocab_size}
    raise ValueError(f"no recorded inputs for stage {stage!r}")


def stage_input_diff(recorded: dict | None, recipe: Recipe, stage: str) -> list[str]:
    """The dotted keys whose recorded value differs from ``recipe``'s (none when nothing was recorded)."""
    if recorded is None:
        return []
    want = json.loads(json.dumps(stage_inputs(recipe, stage)))  # the JSON form, as it was recorded
    return [k for k in sorted(set(want) | set(recorded)) if recorded.get(k) != want.get(k)]


def check_stage_inputs(recorded: dict | None, recipe: Recipe, stage: str, where: str | Path, rerun: str) -> None:
    """Refuse ``where`` (written by ``stage``) when it was made from other settings than ``recipe``'s.

    Outputs written before settings were recorded (``recorded`` is None) cannot be checked and pass.
    """
    diff = stage_input_diff(recorded, recipe, stage)
    if diff:
        want = json.loads(json.dumps(stage_inputs(recipe, stage)))
        k = diff[0]
        more = f" (and {len(diff) - 1} more: {', '.join(diff[1:])})" if len(diff) > 1 else ""
        raise StaleInputError(
            f"{where} was made with {k}={json.dumps(recorded.get(k))}, this recipe has {k}={json.dumps(want.get(k))}"
            f"{more}: rerun `{rerun}` (or point this run at another run_dir)")


# ================================================================ resume fields


class ResumeMismatchError(SpecheadsError, ValueError):
    """A checkpoint was written by another recipe, target, vocabulary or global batch than this run's."""


# Recipe fields that change what (or how) a run trains: a checkpoint resumes only when they agree.
RESUME_FIELDS = [
    "seed",
    "head",
    "train.ttt_steps", "train.loss_decay", "train.eagle1_ce_weight", "train.epochs", "train.max_steps",
    "train.micro_batch_size", "train.grad_accum", "train.max_tokens_per_batch", "train.data_fraction", "train.lr",
    "train.min_lr_ratio", "train.warmup_steps", "train.weight_decay", "train.betas", "train.grad_clip",
    "train.scheduler", "train.zero_stage", "train.precision",
    "vocab.draft_vocab_size",
    "data.max_length",
]

# How the global batch is split: each may change on resume as long as their product does not.
BATCH_SPLIT = ("world_size", "train.grad_accum")


def recipe_hash(recipe: Recipe, *sections: str) -> str:
    """Hash of the named sections (all when none), recorded in a checkpoint's client state and meta.json."""
    d = recipe.to_dict()
    if sections:
        d = {k: d[k] for k in sections}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _flatten(d, prefix=""):
    out = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = d
    return out


def resume_fingerprint(recipe: Recipe, target_identity: dict, d2t, world_size: int, precision: str) -> dict:
    """Flat {dotted key: value} of everything a resumed run must share with its checkpoint
    (``d2t``: the draft vocabulary's tensor, or None)."""
    rd = recipe.to_dict()
    fp = {}
    for f in RESUME_FIELDS:
        node = rd
        for part in f.split("."):
            node = node[part]
        fp.update(_flatten(node, f + ".") if isinstance(node, dict) else {f: node})
    fp["target.config_hash"] = target_identity.get("config_hash")
    fp["vocab.d2t_sha256"] = (hashlib.sha256(d2t.cpu().numpy().tobytes()).hexdigest()[:16]
                              if d2t is not None else None)
    fp["world_size"] = int(world_size)
    fp["effective_precision"] = precision
    return json.loads(json.dumps(fp))  # lists/tuples normalised as JSON would


def compare_fingerprints(saved: dict, current: dict, where: str) -> None:
    """Refuse to resume ``where`` when its fingerprint differs from this run's (the global batch may be
    split over another number of ranks, :data:`BATCH_SPLIT`, when its size stays)."""
    keys = sorted((set(saved) | set(current)) - set(BATCH_SPLIT))
    diffs = [f"  {k}: {saved.get(k, '<absent>')!r} (checkpoint) != {current.get(k, '<absent>')!r} (this run)"
             for k in keys if saved.get(k) != current.get(k)]
    hint = ""
    sw, sa = int(saved["world_size"]), int(saved["train.grad_accum"])
    cw, ca = int(current["world_size"]), int(current["train.grad_accum"])
    if sw * sa != cw * ca:
        diffs.append(f"  ranks × train.grad_accum: {sw} × {sa} = {sw * sa} (checkpoint) != "
                     f"{cw} × {ca} = {cw * ca} (this run)")
        hint = ("\nThe global batch (ranks × train.grad_accum × train.micro_batch_size) must stay the same for the "
                "run to continue its loss curve: ")
        hint += (f"on {cw} rank(s) pass train.grad_accum={sw * sa // cw}." if (sw * sa) % cw == 0 else
                 f"no whole train.grad_accum gives {sw * sa} on {cw} rank(s); resume on a number of ranks "
                 f"that divides {sw * sa}.")
    if diffs:
        raise ResumeMismatchError(
            f"cannot resume from {where}: it was written by a different recipe/target/vocab; "
            f"these fields differ:\n" + "\n".join(diffs) + hint +
            "\nSet train.resume=false (or use another run_dir) to start a new run, or restore the recipe.")


def client_state(recipe: Recipe, step: int, fingerprint: dict, target_identity: dict, head_config: dict,
                 world_size: int) -> dict:
    """What a checkpoint records for the run that resumes it (its ``client_state.json``)."""
    return {"step": step, "fingerprint": fingerprint, "recipe_hash": recipe_hash(recipe),
            "target": target_identity, "head_config": head_config, "world_size": world_size}


def client_world_size(client: dict) -> int:
    """The number of ranks that wrote a checkpoint, from its client state."""
    return int(client.get("world_size", client["fingerprint"]["world_size"]))


# ================================================================ compatibility


class DumpMismatchError(DumpError):
    """The store (or the token rows) belongs to another target, layer set, or dump configuration."""


def describe_target(t: dict) -> str:
    return f"{t.get('name')!r} (config_hash {t.get('config_hash')})"


def check_store_identity(manifest: dict, root, *, expected_target: dict | None = None,
                         expected_config_hash: str | None = None, expected_layer_ids=None) -> None:
    """Refuse to read a store whose states come from another target or aux layer set than expected."""
    have = manifest["target"]
    want_hash = expected_target.get("config_hash") if expected_target else expected_config_hash
    if want_hash is not None and want_hash != have.get("config_hash"):
        want = describe_target(expected_target) if expected_target else f"config_hash {want_hash}"
        raise DumpMismatchError(
            f"{root} holds hidden states of target {describe_target(have)}, but the expected target is {want}; "
            f"re-dump with this target (or point dump.dir at the right store)"
        )
    if expected_layer_ids is not None and list(expected_layer_ids) != list(manifest["aux_layer_ids"]):
        raise DumpMismatchError(
            f"{root} holds aux_layer_ids {manifest['aux_layer_ids']}, but the head expects "
            f"{list(expected_layer_ids)}; re-dump with head.aux_layer_ids={list(expected_layer_ids)}"
        )


def check_store_compatible(existing: dict, new: dict, root: Path) -> None:
    """Refuse to add to a store (manifest ``existing``) made for another target / layer set / layout."""
    et, nt = existing["target"], new["target"]
    if et.get("config_hash") != nt.get("config_hash"):
        raise DumpMismatchError(
            f"{root} holds a dump of target {describe_target(et)}; this run's target is "
            f"{describe_target(nt)}. Use another dump.dir (or delete the old store)."
        )
    if list(existing["aux_layer_ids"]) != list(new["aux_layer_ids"]):
        raise DumpMismatchError(
            f"{root} holds a dump with aux_layer_ids {existing['aux_layer_ids']}; this run asks for "
            f"{new['aux_layer_ids']}. Use another dump.dir (or delete the old store)."
        )
    for key, what in (("dtype", "dump.dtype"), ("max_length", "data.max_length"),
                      ("shard_tokens", "dump.shard_tokens"), ("rows_sha256", "token rows (rows_sha256)")):
        if existing.get(key) != new.get(key):
            raise DumpMismatchError(
                f"{root} was written with {what} = {existing.get(key)!r}; this run has {new.get(key)!r}. "
                f"Resume with the same settings, or use another dump.dir."
            )


def check_online_target(rows_target: dict | None, target, rows_dir) -> None:
    """Online training computes the states with ``target`` itself, so nothing on disk records whose states they
    are: refuse a target other than the one the token rows were prepared for (the recipe's, which `data prepare`
    records), naming what differs. Rows given in memory record nothing and pass."""
    if not rows_target:
        return
    have = {**target.identity(), "name": getattr(target, "source", None) or target.name}
    keys = ("name", "model_type", "num_layers", "hidden_size", "vocab_size", "adapter")
    diff = [k for k in keys if k in rows_target and rows_target[k] != have.get(k)]
    if diff:
        raise DumpMismatchError(
            f"online training: the token rows at {rows_dir} were prepared for target "
            + ", ".join(f"{k}={rows_target[k]!r}" for k in diff) + ", but the target given has "
            + ", ".join(f"{k}={have.get(k)!r}" for k in diff)
            + ": train with the recipe's target (target.source, target.adapter) or rerun `specheads data prepare`")
