"""Create (once) the isolated virtual environment holding the real ``speculators`` 0.9.0.

The package pins its own torch/transformers, so it never shares the project's
venv (docs/conventions.md, "Known readers"): torch==2.13.0 first, then speculators with
torch kept as a constraint, then torchvision and torchaudio removed (speculators
never imports them and their mismatched builds break its import).

Usage: ``python tests/interop/speculators_venv.py [VENV_DIR]``; exit 1 (with
pip's last lines) when speculators cannot be installed beside torch 2.13.0.
"""
from __future__ import annotations

from pathlib import Path

try:
    from interop import isolated_venv
except ImportError:  # run as a script
    import isolated_venv
READY, REPO, VenvError, venv_python = (isolated_venv.READY, isolated_venv.REPO, isolated_venv.VenvError,
                                      isolated_venv.venv_python)  # re-exported for the tests

DEFAULT_DIR = REPO / ".cache" / "venvs" / "speculators"
SPECULATORS = "speculators==0.9.0"


def ensure_venv(d: Path | str = DEFAULT_DIR, timeout: float = 3000) -> tuple[Path, float]:
    return isolated_venv.ensure_venv(
        d, SPECULATORS, ["torchvision", "torchaudio"],
        "import importlib.metadata as m, torch; from speculators import SpeculatorModel; "
        "print(m.version('speculators'), torch.__version__)", timeout=timeout)


if __name__ == "__main__":
    isolated_venv.main(ensure_venv, DEFAULT_DIR)
