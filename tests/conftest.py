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
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not present")
    return SHARED_DATA


@pytest.fixture(scope="session")
def smollm2():
    """The bundled SmolLM2-135M-Instruct target, loaded once per test session (fp32, CPU)."""
    from specheads.target import load_target

    return load_target("smollm2-135m", dtype="float32", device="cpu")
