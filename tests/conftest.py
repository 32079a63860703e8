import os
from pathlib import Path

import pytest
import torch

# Keep the 2-core CI machine responsive and results repeatable.
torch.set_num_threads(min(2, os.cpu_count() or 1))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent
# The bundled GGUF is de-quantised once and kept in specheads.target's own cache (~/.cache/specheads/gguf,
# or wherever SPECHEADS_GGUF_CACHE points): the tests use the product's location, so `make demo` and
# `make test` share one copy, and every test process and CLI subprocess after the first reads it in under
# a second.
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not present")
    return SHARED_DATA


@pytest.fixture(scope="module")
def target():
    """The trainer tests' tiny random target (synthetic_target.tiny_target)."""
    from synthetic_target import tiny_target

    return tiny_target()


@pytest.fixture(scope="module")
def vocab(target):
    from synthetic_target import DRAFT_VOCAB, synthetic_vocab

    return synthetic_vocab(target, DRAFT_VOCAB)


@pytest.fixture(scope="session")
def smollm2():
    """The bundled SmolLM2-135M-Instruct target, loaded once per test session (fp32, CPU)."""
    from specheads.target import load_target

    return load_target("smollm2-135m", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's real tokenizer and chat template (from the bundled GGUF), without the weights."""
    from transformers import AutoTokenizer

    from specheads.target import bundled_gguf_path

    p = bundled_gguf_path()
    return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny random Llama with SmolLM2's vocabulary, tokenizer and chat template, saved as an HF dir."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny_target")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=smollm2_tokenizer.vocab_size, max_position_embeddings=2048,
                      eos_token_id=smollm2_tokenizer.eos_token_id, bos_token_id=1, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(d)
    smollm2_tokenizer.save_pretrained(d)
    return d


@pytest.fixture
def engine_dtypes(monkeypatch):
    """The dtype of every runtime engine built while the test runs (``TargetModel.from_hf``), in order."""
    import specheads.runtime.model as engine_module

    seen = []
    from_hf = engine_module.TargetModel.from_hf

    def spy(hf, *a, **kw):
        m = from_hf(hf, *a, **kw)
        seen.append(m.dtype)
        return m

    monkeypatch.setattr(engine_module.TargetModel, "from_hf", spy)
    return seen
