"""Recipe schema: everything a run needs, typed and validated on load.

A recipe is YAML; ``key.sub=value`` overrides on the command line win over
the file. Unknown keys are errors with a did-you-mean, because a misspelt
key silently falling back to a default is the classic way to train the
wrong head.

What a recipe means for its run directory (output paths, the settings each
stage records, resume fingerprints) is :mod:`specheads.rundir`.
"""

from __future__ import annotations

import copy
import difflib
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from specheads.errors import SpecheadsError


class RecipeError(SpecheadsError, ValueError):
    pass


class _Section(BaseModel):
    # allow_inf_nan=False: every float of a recipe is finite (a NaN epoch count or an infinite learning rate is
    # refused on load, naming the key, instead of failing after the target has loaded)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

# Every count, size and rate below carries its bound (Field ge/gt/le): a recipe out of bounds is refused on load,
# before anything loads, as a RecipeError naming the key and the bound ("Input should be greater than 0").


_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _sha256(v: str, key: str) -> str:
    if not isinstance(v, str) or not _SHA256.fullmatch(v):
        raise ValueError(f"{key} must be 64 hex digits (a sha256), got {v!r}")
    return v.lower()


def _template(template: str, key: str, count: int) -> None:
    """A name with {n} in it (the part's number, from 1; {n:02d} pads it) that differs from part to part."""
    try:
        first, second = template.format(n=1), template.format(n=2)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"{key} {template!r}: not a template of the part number {{n}} ({e})") from None
    if count > 1 and first == second:
        raise ValueError(f"{key} {template!r} names every part alike: put the part number {{n}} in it")


class GGUFPartsFiles(_Section):
    # the parts, N = 1..count, joined in that order; {n} is N ({n:02d} zero-pads it)
    count: int = Field(ge=1, le=10000)
    file: str  # the part's path inside its package (or in `folder`), e.g. pkg_part{n}/data/part{n:02d}.bin
    package: str | None = None  # pip package holding part N, e.g. pkg-part{n}; null: the parts come from `folder` only
    version: str | None = None  # the release the checksums are of (pinned: another release is other bytes)
    # one per part, in order: names the exact part that is missing, out of order or damaged, before the joined
    # file's checksum could only say that one of them is
    sha256: list[str] | None = None

    @field_validator("sha256")
    @classmethod
    def _part_shas(cls, v):
        return None if v is None else [_sha256(h, f"target.gguf_parts.parts.sha256[{i}]") for i, h in enumerate(v)]

    @model_validator(mode="after")
    def _check(self):
        _template(self.file, "target.gguf_parts.parts.file", self.count)
        if Path(self.file.format(n=1)).is_absolute() or ".." in Path(self.file.format(n=1)).parts:
            raise ValueError(f"target.gguf_parts.parts.file {self.file!r}: a relative path inside the package")
        if (self.package is None) != (self.version is None):
            raise ValueError("target.gguf_parts.parts.package and .version go together (pip fetches package==version)")
        if self.package is not None:
            _template(self.package, "target.gguf_parts.parts.package", self.count)
            if not _NAME.fullmatch(self.package.format(n=1)):
                raise ValueError(f"target.gguf_parts.parts.package {self.package!r}: not a package name")
            if not re.fullmatch(r"[0-9A-Za-z][0-9A-Za-z.+!_-]*", self.version):
                raise ValueError(f"target.gguf_parts.parts.version {self.version!r}: not a version (e.g. 0.2.0)")
        if self.sha256 is not None and len(self.sha256) != self.count:
            raise ValueError(f"target.gguf_parts.parts.sha256 lists {len(self.sha256)} checksums for "
                             f"{self.count} parts (parts.count)")
        return self


class GGUFPartsConfig(_Section):
    # a GGUF split into parts: fetched with pip (parts.package) or taken from `folder`, joined once, verified
    # against sha256 and kept; target.source is the name the joined file goes by (specheads.gguf_parts)
    sha256: str  # of the joined file
    bytes: int | None = Field(None, ge=1)  # of the joined file: a short or long set of parts is named before hashing
    parts: GGUFPartsFiles
    folder: str | None = None  # the parts' .bin files (or their wheels, or an install of the packages); null: pip

    @field_validator("sha256")
    @classmethod
    def _whole_sha(cls, v):
        return _sha256(v, "target.gguf_parts.sha256")

    @model_validator(mode="after")
    def _somewhere(self):
        if self.folder is None and self.parts.package is None:
            raise ValueError("target.gguf_parts needs parts.package and parts.version (to fetch the parts with pip) "
                             "or folder (where the parts are)")
        return self


class TargetConfig(_Section):
    source: str = "smollm2-135m"  # HF hub id, local dir, .gguf file, or 'smollm2-135m' (bundled)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    adapter: str | None = None  # PEFT LoRA directory merged into the target
    chat_template: str | None = None  # Jinja string or file; required when the tokenizer has none
    gguf_parts: GGUFPartsConfig | None = None  # a GGUF in parts; then source is the joined file's name
    # the model a server loads as the target (an HF id or path): exports name it as their verifier. null: source
    # (the bundled SmolLM2: its HF id); a GGUF's name is no model vLLM or SGLang can load, so name what it quantises
    verifier: str | None = None

    @model_validator(mode="after")
    def _parts_name(self):
        if self.gguf_parts is None:
            return self
        # the name is a file name in the GGUF cache and what string-only callers (target_facts, --target) pass;
        # a '.gguf' suffix would make them look for a file of that name in the working directory
        if (self.source == type(self).model_fields["source"].default or not _NAME.fullmatch(self.source)
                or self.source.endswith(".gguf")):
            raise ValueError(f"target.source {self.source!r}: with target.gguf_parts it names the joined GGUF: "
                             f"a plain name without '.gguf' (e.g. qwen2.5-coder-1.5b-instruct-q4_k_m)")
        return self


class DataSource(_Section):
    path: str  # file path, or 'builtin:demo_prompts'
    format: Literal["auto", "sharegpt", "openai", "alpaca", "prompts"] = "auto"
    limit: int | None = Field(None, ge=1)  # the source's first N conversations; null = all


class RegenerateConfig(_Section):
    # When enabled, `data regenerate` answers the sources' prompts with the target and
    # `data prepare` trains on those answers instead of the sources' own.
    enabled: bool = False
    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0.0)  # 0: greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # 0: off
    batch_size: int = Field(16, ge=1)
    max_prompt_tokens: int = Field(1024, ge=1)
    out: str | None = None  # default: {run_dir}/data/regenerated.jsonl
    head: str | None = None  # optional draft head to speed up generation
    k: int = Field(3, ge=1, le=16)  # draft length with head (the range of eval.k and export.k)
    compile: bool = False  # torch.compile the engine (and the head's step); slower on the H200 (BENCHMARKS.md)
    refill_at: int = Field(1, ge=1)  # continuous batching: free slots gathered before one prefill refills them
    # the engine's dtype (None: target.dtype): bf16 answers under an fp32 target (kept in fp32 for the eval's
    # lossless checks). On the H200 bf16 regeneration ran 54.9k tok/s at batch 1024 (bench_generate), the fp32
    # reference run 13.3k at batch 256; a bf16 answer leaves the fp32 one where their top tokens nearly tie
    dtype: Literal["bfloat16", "float32"] | None = None


CopyTask = Literal["summarize", "rewrite", "translate", "extract", "answer_from_context", "continue_code"]


class SeedCategory(_Section):
    # one kind of prompt the target writes; merged field by field into the seed file's entry of the same name
    weight: float | None = Field(None, ge=0)  # share of the mix; 0 leaves the category out
    systems: list[str] | None = None  # system prompts ("" = none); a non-empty one is kept in the row
    openers: list[str] | None = None  # first words of the user message, continued by the target ({topic} filled)
    topics: list[str] | None = None


class CopyTasksConfig(_Section):
    # requests that wrap a long document (where draft heads lose to n-gram today)
    fraction: float = Field(0.25, ge=0.0, le=1.0)  # share of the synthesized prompts that are copy-heavy
    tasks: list[CopyTask] = Field(default_factory=lambda: ["summarize", "rewrite", "translate", "extract",
                                                           "answer_from_context", "continue_code"])
    documents: str | None = None  # JSON/JSONL rows with 'text', a JSON list of strings, or a directory of
    #                               text files; default: the target writes a document per request
    document_tokens: int = Field(192, ge=8)  # length cap of a document the target writes
    max_prompt_tokens: int = Field(1536, ge=64)  # a document is cut so that the whole request fits


class SynthesizeConfig(_Section):
    # `data synthesize`: user prompts written by the target itself (point data.sources at the output)
    num_prompts: int = Field(64, ge=1)  # prompts to write (after filters); a larger value extends the file
    batch_size: int = Field(16, ge=1)
    max_new_tokens: int = Field(96, ge=1)  # length cap of a user message; one that does not end is dropped
    temperature: float = Field(1.0, gt=0.0)  # sampled: at temperature 0 every seed would write the same prompt
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    turns: int = Field(1, ge=1, le=8)  # user turns per conversation; later ones follow the target's answers
    answer_tokens: int = Field(128, ge=1)  # answers between turns (context only: regenerate answers again)
    seeds: str = "builtin:synthesize_seeds"  # YAML/JSON with categories, documents, copy_tasks
    categories: dict[str, SeedCategory] = Field(default_factory=dict)  # overrides / additions to the seeds'
    copy_tasks: CopyTasksConfig = Field(default_factory=CopyTasksConfig)
    min_chars: int = Field(12, ge=1)  # a user turn shorter than this is dropped
    max_chars: int = Field(12000, ge=1)  # ... and one longer than this
    dedup_threshold: float = Field(0.6, gt=0.0, le=1.0)  # near-duplicate: Jaccard of word 3-grams ≥ this
    compile: bool = False  # torch.compile the engine's layers; slower on the H200 (BENCHMARKS.md)
    refill_at: int = Field(1, ge=1)  # continuous batching: free slots gathered before one prefill refills them
    # the engine's dtype (None: target.dtype). Prompts are sampled, so they need no fp32 even where the
    # recipe keeps the target in fp32 for its lossless checks (100k fp32 prompts took 10.6 min on the H200)
    dtype: Literal["bfloat16", "float32"] | None = None
    out: str | None = None  # default: {run_dir}/data/synthesized.jsonl

    @model_validator(mode="after")
    def _chars_window(self):
        if self.max_chars < self.min_chars:
            raise ValueError(f"data.synthesize.max_chars ({self.max_chars}) must be >= data.synthesize.min_chars "
                             f"({self.min_chars}): no user turn could be kept")
        return self


class DataConfig(_Section):
    sources: list[DataSource] = Field(default_factory=lambda: [DataSource(path="builtin:demo_prompts")])
    max_length: int = Field(1024, ge=1)  # tokens per row
    holdout_fraction: float = Field(0.05, ge=0.0, lt=1.0)  # prompts never trained on, for eval
    regenerate: RegenerateConfig = Field(default_factory=RegenerateConfig)
    synthesize: SynthesizeConfig = Field(default_factory=SynthesizeConfig)
    rows_dir: str | None = None  # default: {run_dir}/data/rows
    # processes that tokenize in `data prepare`; null: up to 8 of this machine's cores from 20,000 conversations on
    # (the stage took 88 s for 41k conversations in one process on an H100 host, 2026-12-07, most of it
    # tokenizing); the rows are the same for any count
    num_proc: int | None = Field(None, ge=1)


class VocabConfig(_Section):
    draft_vocab_size: int | None = Field(32000, ge=1)  # None = the full target vocabulary
    out: str | None = None  # default: {run_dir}/vocab


class DumpConfig(_Section):
    mode: Literal["offline", "online"] = "offline"
    dtype: Literal["bfloat16", "float32", "fp8"] = "bfloat16"
    dir: str | None = None  # default: {run_dir}/dump
    batch_tokens: int = Field(16384, ge=1)  # tokens per target forward (rows are length-sorted)
    shard_tokens: int = Field(262144, ge=1)  # tokens per shard file
    # the target's matmuls while it computes the states, offline and online (autocast; None: target.dtype). An
    # fp32 target's forward ran at 70-91k tok/s on an H100 (GEMMs without tensor cores), the dump's and online
    # training's bound (2026-12-06). bf16 states differ from fp32 ones by less than fp8 storage rounds them, and
    # fp8 states trained a head as good as bf16 ones (τ 1.78 both, BENCHMARKS.md). The eval
    # and its lossless checks keep target.dtype.
    compute_dtype: Literal["bfloat16", "float32"] | None = None
    # the layers the store holds (HF index); default: the head's. A superset serves several heads from one
    # dump (EAGLE-3's three and DFlash's five); a head reads its own layers out of it
    aux_layer_ids: list[Annotated[int, Field(ge=0)]] | None = None


class LoraConfig(_Section):
    enabled: bool = False
    r: int = Field(16, ge=1)
    alpha: int = Field(32, ge=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


class HeadSection(_Section):
    kind: Literal["eagle3", "eagle1", "mtp", "peagle", "dflash"] = "eagle3"
    # HF hidden-state index; default [2, L//2, L-3] (EAGLE-3, P-EAGLE), the outputs of layers 1 .. L-3 spread
    # over five (DFlash)
    aux_layer_ids: list[Annotated[int, Field(ge=0)]] | None = None
    num_layers: int | None = Field(None, ge=1)  # decoder layers; default 1 (EAGLE-3, EAGLE-1), 4 (P-EAGLE), 5 (DFlash)
    num_depths: int = Field(4, ge=1, le=32)  # P-EAGLE: tokens drafted per forward (K)
    block_size: int = Field(8, ge=2, le=32)  # DFlash: the anchor and block_size - 1 drafted tokens
    mask_token_id: int | None = Field(None, ge=0)  # the masked slots' token (P-EAGLE, DFlash); default: the last id
    num_mtp_depths: int = Field(1, ge=1)
    mtp_loss_weights: list[Annotated[float, Field(ge=0.0)]] | None = None
    norm_before_residual: bool = False
    # EAGLE-1's fc bias: null = the original EAGLE layout (with bias); false for a head vLLM serves (vLLM v1's
    # llama_eagle builds fc without bias, and export refuses a non-zero one). EAGLE-3 heads have none.
    fc_bias: bool | None = None
    intermediate_size: int | None = Field(None, ge=1)  # default: the target's
    init_lm_head_from_target: bool = True  # copy target lm_head rows at the draft vocab
    warm_start: str | None = None  # an exported head directory (any supported format)
    lora: LoraConfig = Field(default_factory=LoraConfig)


class LoggingConfig(_Section):
    wandb: Literal["offline", "online", "disabled"] = "offline"
    project: str = "specheads"
    every: int = Field(1, ge=1)  # log every N optimizer steps (and the last)


class TrainConfig(_Section):
    ttt_steps: int = Field(7, ge=1)
    loss_decay: float = Field(0.8, gt=0.0, le=1.0)  # weight of TTT step k: loss_decay^k
    eagle1_ce_weight: float = Field(0.1, ge=0.0)
    # P-EAGLE's conditional drop-token sampling: depth d keeps max(keep_ratio^d, keep_min) of its candidates
    peagle_keep_ratio: float = Field(0.7, gt=0.0, le=1.0)
    peagle_keep_min: float = Field(0.2, ge=0.0, le=1.0)
    # DFlash: blocks per micro-batch (random anchors, an equal share from each row): the blocks' logits, rows x
    # anchors a row x block_size x draft vocabulary, bound the step's memory, and the anchors' share of the positions
    # is how much of the batch supervises the head (the references take up to 512 per sequence; see
    # bench_dflash_anchors.py)
    dflash_anchors: int = Field(512, ge=1)
    dflash_gamma: float = Field(4.0, gt=0.0)  # DFlash: block slot j's loss weight exp(-(j-1)/gamma)
    # DFlash's block attention in training: dense (the blocks' scores against the whole row, materialized; any
    # device) or flex (torch's flex attention with a block mask, as SpecForge trains: no score matrix, and the
    # context past each anchor is skipped; CUDA only, its backward has no CPU kernel)
    dflash_attention: Literal["dense", "flex"] = "dense"
    epochs: float = Field(1.0, gt=0.0)  # passes over the train rows (fractional: a part of one)
    max_steps: int | None = Field(None, ge=1)  # optimizer steps; wins over epochs
    # a wall-clock budget for the loop's steps: the run re-plans its last step from the measured rate (never past
    # epochs / max_steps) and the LR schedule decays by it (specheads/train/budget.py); null: no budget
    max_minutes: float | None = Field(None, gt=0.0)
    micro_batch_size: int = Field(1, ge=1)
    grad_accum: int = Field(1, ge=1)
    max_tokens_per_batch: int | None = Field(None, ge=1)  # micro-batch = rows up to this many padded tokens
    # with max_tokens_per_batch: a micro-batch's length is rounded up to the smallest of these and its rows
    # to max_tokens_per_batch // that length (filler rows count for nothing), so the head sees one shape
    # per bucket and train.compile compiles each once instead of tracing a shape that changes every step
    length_buckets: list[int] | None = None  # checked below: positive, increasing, within max_tokens_per_batch
    data_fraction: float = Field(1.0, gt=0.0, le=1.0)  # train on a fixed, nested subset of the train rows
    lr: float = Field(1e-4, gt=0.0)  # peak learning rate
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)  # the schedule's floor, a fraction of lr
    warmup_steps: int = Field(50, ge=0)  # 0: no warmup
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]] = (0.9, 0.95)
    grad_clip: float = Field(0.5, ge=0.0)  # 0: no clipping
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    zero_stage: int = Field(0, ge=0, le=3)
    precision: Literal["bf16", "fp32"] = "bf16"
    save_every: int = Field(500, ge=0)  # optimizer steps between checkpoints; 0: only the final one
    eval_every: int = Field(200, ge=0)  # optimizer steps between held-out evaluations; 0: no held-out eval
    eval_fraction: float = Field(0.02, ge=0.0, lt=1.0)
    resume: bool = False
    # a run that does not resume refuses a train dir holding another run's checkpoints or final/;
    # overwrite: true removes them (and its metrics, plots) before the new run writes anything
    overwrite: bool = False
    loss_kernel: Literal["auto", "triton", "torch"] = "auto"
    # torch.compile the head's forward (TTT unroll / EAGLE-1 step / MTP depths): fuses its small
    # kernels; the first batches of new shapes compile. Not with ZeRO-3 (its parameter hooks).
    compile: bool = False
    num_workers: int = Field(0, ge=0)
    # [first, last]: torch.profiler over these optimizer steps; the table (by device time) goes to
    # {train.out}/profile.txt. Where a step's time goes, on the real feed, not a synthetic benchmark
    profile_steps: tuple[int, int] | None = None
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    out: str | None = None  # default: {run_dir}/train

    @field_validator("profile_steps")
    @classmethod
    def _profile_window(cls, v):
        if v is not None and not 1 <= v[0] <= v[1]:
            raise ValueError(f"train.profile_steps must be [first, last] with 1 <= first <= last, got {list(v)}")
        return v

    @model_validator(mode="after")
    def _length_buckets(self):
        b = self.length_buckets
        if b is None:
            return self
        if self.max_tokens_per_batch is None:
            raise ValueError("train.length_buckets needs train.max_tokens_per_batch (the token budget each bucket's "
                             "row count is cut from)")
        if not b or any(x < 1 for x in b) or any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError(f"train.length_buckets must be positive and increasing, got {b}")
        if b[-1] > self.max_tokens_per_batch:
            raise ValueError(f"train.length_buckets' largest, {b[-1]}, exceeds train.max_tokens_per_batch "
                             f"{self.max_tokens_per_batch}: a batch of that length would hold no row")
        return self

    @model_validator(mode="after")
    def _compile_not_zero3(self):
        if self.compile and self.zero_stage == 3:
            raise ValueError("train.compile cannot be combined with train.zero_stage 3 (ZeRO-3 gathers parameters "
                             "through module hooks that a compiled forward skips); use zero_stage <= 2 or compile: false")
        return self


class ExportConfig(_Section):
    # dflash_native: the published DFlash layout (DFlashDraftModel, output-of-layer target_layer_ids)
    format: Literal["speculators", "sglang", "eagle", "mtp", "dflash_native"] = "speculators"
    k: int = Field(3, ge=1, le=16)
    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    out: str | None = None  # default: {run_dir}/export/{format}


Rule = Literal["greedy", "rejection", "onehot", "tree_target_only"]


class SweepConfig(_Section):
    # `specheads eval --sweep`: every head (and n-gram / suffix decoding when eval.compare names them) at every k
    # serves the eval conversations with continuous batching at every concurrency, plain decoding beside it; the
    # report and, with eval.update_card, the head's card recommend the fastest configuration per concurrency
    enabled: bool = False
    # draft lengths; a P-EAGLE or DFlash head runs only the k one forward drafts (the k vLLM serves it with)
    k: list[Annotated[int, Field(ge=1, le=16)]] = Field(default_factory=lambda: [1, 2, 3, 4, 5, 6], min_length=1)
    # requests in flight (slots); above the number of conversations, every conversation is in flight at once
    concurrency: list[Annotated[int, Field(ge=1, le=1024)]] = Field(default_factory=lambda: [1, 8, 32],
                                                                     min_length=1)
    # timed passes a point (after its untimed warm-up); its rate is their median, their spread is reported. One
    # pass left neighbouring points of one drafter 0.2x apart on an H100 (Qwen2.5-Coder-1.5B, BENCHMARKS.md)
    repeat: int = Field(1, ge=1, le=10)

    @field_validator("k", "concurrency", mode="before")
    @classmethod
    def _one_or_many(cls, v):  # eval.sweep.k=4 on the command line means [4], as eval.k=4 does
        return [v] if isinstance(v, int) and not isinstance(v, bool) else v

    @field_validator("k", "concurrency")
    @classmethod
    def _distinct(cls, v):
        if len(set(v)) != len(v):
            raise ValueError(f"{sorted(v)} names a value twice")
        return sorted(v)


class EvalConfig(_Section):
    # head, k and rule take one value or a list: every combination becomes a run of the report
    prompts: str = "builtin:demo_prompts"  # or a file; held-out rows when 'holdout'
    split: Literal["all", "holdout"] = "holdout"
    limit: int | None = Field(24, ge=1)  # the first N prompts; null = all
    head: str | list[str] | None = None  # default: the recipe's export; [] = weightless drafters only
    k: int | list[int] = 3
    tree: str | None = None  # "depth,topk,tokens"
    rule: Rule | list[Rule] = "greedy"
    temperature: float = Field(0.0, ge=0.0)
    top_k: int = Field(0, ge=0)  # 0: off
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    thresholds: str | None = None  # "single,acc": also run tree_target_only with these relaxed thresholds
    max_new_tokens: int = Field(128, ge=1)
    batch_size: int = Field(1, ge=1)
    # ngram: the weightless drafter; hybrid: each head with n-gram drafts where the match is long
    # hybrid_fixed: the same hybrid without its per-row score (the n-gram whenever its match is long)
    # suffix: suffix decoding (vLLM's method "suffix"); hybrid_suffix: each head with suffix drafts instead
    compare: list[Literal["ngram", "hybrid", "hybrid_fixed", "suffix", "hybrid_suffix"]] = Field(
        default_factory=lambda: ["ngram"])
    hybrid_min_match: int = Field(3, ge=1)  # shortest n-gram (or suffix) match that wins over the head
    chi_square_draws: int = Field(0, ge=0)  # 0: no χ² check
    engine: Literal["specheads", "vllm"] = "specheads"  # vllm: the same prompts in real vLLM, side by side
    compile: bool = False  # torch.compile the engine's layers and the head's step (faster decode; compiles first)
    # write the measured acceptance into the README.md model card of each evaluated specheads export; off by
    # default: evaluating a head leaves its directory byte-identical
    update_card: bool = False
    sweep: SweepConfig = Field(default_factory=SweepConfig)  # the serving-configuration sweep (--sweep)
    out: str | None = None  # default: {run_dir}/eval

    @field_validator("k")
    @classmethod
    def _k_range(cls, v):
        for k in v if isinstance(v, list) else [v]:
            if not 1 <= k <= 16:
                raise ValueError(f"k={k} out of range 1..16")
        return v

    @field_validator("tree")
    @classmethod
    def _tree_shape(cls, v):
        if v is not None:
            parts = v.split(",")
            if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
                raise ValueError(f"tree {v!r}: expected depth,topk,tokens (e.g. 4,4,16)")
        return v

    @field_validator("thresholds")
    @classmethod
    def _thresholds_shape(cls, v):
        if v is not None:
            try:
                a, b = (float(x) for x in v.split(","))
            except ValueError:
                raise ValueError(f"thresholds {v!r}: expected single,acc (e.g. 0.05,0.5)") from None
            if not (0.0 <= a <= 1.0 and 0.0 <= b <= 1.0):  # also refuses nan
                raise ValueError(f"thresholds {v!r}: single and acc are probabilities, each in [0, 1]")
        return v

    def as_list(self, field: str) -> list:
        v = getattr(self, field)
        return list(v) if isinstance(v, list) else ([] if v is None else [v])


class Recipe(_Section):
    name: str = "run"
    run_dir: str = "runs/run"
    seed: int = Field(0, ge=0, lt=2**32)  # numpy's seed range
    target: TargetConfig = Field(default_factory=TargetConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    vocab: VocabConfig = Field(default_factory=VocabConfig)
    dump: DumpConfig = Field(default_factory=DumpConfig)
    head: HeadSection = Field(default_factory=HeadSection)
    train: TrainConfig = Field(default_factory=TrainConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="after")
    def _check(self):
        for rule in self.eval.as_list("rule"):
            if rule in ("rejection", "onehot") and self.eval.temperature == 0:
                raise ValueError(f"eval.rule={rule!r} samples: it needs eval.temperature > 0")
            if rule == "greedy" and self.eval.temperature > 0:
                raise ValueError("eval.rule='greedy' is for temperature 0: use rejection, onehot or tree_target_only")
        if self.eval.sweep.enabled and self.eval.temperature > 0:
            # its lossless check is token for token, and its speedups are those of greedy serving
            raise ValueError("eval.sweep measures greedy decoding: it needs eval.temperature 0")
        if self.head.kind == "mtp" and self.head.mtp_loss_weights is not None:
            if len(self.head.mtp_loss_weights) != self.head.num_mtp_depths:
                raise ValueError("head.mtp_loss_weights needs one weight per MTP depth")
        return self

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# --- loading ---------------------------------------------------------------------------------


def _model_for(cls: type[BaseModel], dotted: list[str]) -> type[BaseModel] | None:
    """Follow a dotted key path through nested section models (and the entries of a dict of them)."""
    parts = iter(dotted)
    for part in parts:
        f = cls.model_fields.get(part)
        if f is None:
            return None
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            cls = ann
        elif get_origin(ann) is dict and isinstance(get_args(ann)[1], type) and issubclass(get_args(ann)[1], BaseModel):
            cls = get_args(ann)[1]  # data.synthesize.categories.NAME.weight: NAME is a key, not a field
            if next(parts, None) is None:
                return None
        else:
            return None
    return cls


def _all_keys(cls: type[BaseModel] = Recipe, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (``train.resume``, ``data.regenerate.temperature``, ...)."""
    out = []
    for name, f in cls.model_fields.items():
        ann = f.annotation
        out.append(prefix + name)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _all_keys(ann, prefix + name + ".")
    return out


def _unknown_key_message(loc: tuple, source: str) -> str:
    path = [str(p) for p in loc if not isinstance(p, int)]
    parent = _model_for(Recipe, path[:-1]) if path else None
    key = path[-1] if path else "?"
    msg = f"{source}: unknown recipe key {'.'.join(path)!r}"
    if parent is not None:
        close = difflib.get_close_matches(key, list(parent.model_fields), n=1, cutoff=0.5)
        # a key of another section ('resume' for 'train.resume') is the commonest slip
        elsewhere = [k for k in _all_keys() if k.rsplit(".", 1)[-1] == key]
        if close:
            msg += f" — did you mean {'.'.join(path[:-1] + [close[0]])!r}?"
        elif elsewhere:
            msg += f" — did you mean {' or '.join(repr(k) for k in elsewhere)}?"
        else:
            msg += f" (known keys here: {', '.join(parent.model_fields)})"
    return msg


def _parse_value(text: str) -> Any:
    # YAML scalars: true/false/null, numbers, [lists], {maps}; anything else stays a string.
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict, overrides: list[str], source: str = "command line") -> dict:
    for ov in overrides:
        if "=" not in ov:
            raise RecipeError(f"{source}: override {ov!r} is not key=value (e.g. train.lr=3e-4)")
        key, value = ov.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for i, p in enumerate(parts[:-1]):
            if isinstance(node, list):  # list items by index: data.sources.0.limit=100
                if not p.isdigit() or int(p) >= len(node):
                    raise RecipeError(f"{source}: {key!r}: {p!r} is not an index of the list at {'.'.join(parts[:i])!r}")
                nxt = node[int(p)]
            else:
                nxt = node.get(p)
                if nxt is None:
                    nxt = node[p] = {}
            if not isinstance(nxt, (dict, list)):
                raise RecipeError(f"{source}: {key!r}: {p!r} is not a section")
            node = nxt
        last = parts[-1]
        if isinstance(node, list):
            if not last.isdigit() or int(last) >= len(node):
                raise RecipeError(f"{source}: {key!r}: {last!r} is not an index of the list")
            node[int(last)] = _parse_value(value)
        else:
            node[last] = _parse_value(value)
    return data


def recipe_from_dict(data: dict, source: str = "recipe") -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        msgs = []
        for err in e.errors():
            if err["type"] == "extra_forbidden":
                msgs.append(_unknown_key_message(err["loc"], source))
            else:
                where = ".".join(str(p) for p in err["loc"]) or "(recipe)"
                msgs.append(f"{source}: {where}: {err['msg']} (got {err.get('input')!r})")
        raise RecipeError("\n".join(msgs)) from None


def load_recipe(path: str | Path | None, overrides: list[str] | None = None) -> Recipe:
    data: dict = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise RecipeError(f"recipe file not found: {p}")
        source = str(p)
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise RecipeError(f"{p}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise RecipeError(f"{p}: a recipe is a YAML mapping, got {type(data).__name__}")
    if not overrides:
        return recipe_from_dict(data, source)
    # the file alone first, so that a mistake is blamed on where it was made
    recipe_from_dict(copy.deepcopy(data), source)
    where = "command line" + (f" (overriding {source})" if path is not None else "")
    return recipe_from_dict(apply_overrides(data, overrides), where)
