"""Create (once) the isolated virtual environment holding the real ``speculators`` 0.9.0.

The package pins its own torch/transformers, so it never shares the project's
venv.  Recipe (DESIGN.md, "Known readers"): ``python3 -m venv``; install
``torch==2.13.0`` first; then ``speculators==0.9.0`` with torch kept at 2.13.0
as a constraint; then uninstall torchvision and torchaudio (speculators never
imports them and their mismatched builds break its import).  Only PyPI (and
the local wheel caches pip is configured with) is needed.

Usage: ``python tests/interop/speculators_venv.py [VENV_DIR]`` — prints the
venv's python and the seconds it took.  Exit 1 (with pip's last lines) when
speculators cannot be installed beside torch 2.13.0.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DIR = REPO / ".cache" / "venvs" / "speculators"
SPECULATORS = "speculators==0.9.0"
TORCH = "torch==2.13.0"
READY = ".specheads-ready"  # written last: a half-built venv is rebuilt, never used


class VenvError(RuntimeError):
    pass


def venv_python(d: Path) -> Path:
    return Path(d) / "bin" / "python"


def _run(cmd: list, log: list[str], timeout: float) -> None:
    t = time.time()
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout)
    log.append(f"$ {' '.join(map(str, cmd))}  ({time.time() - t:.0f}s, rc={p.returncode})")
    if p.returncode != 0:
        tail = (p.stdout + p.stderr).strip().splitlines()[-25:]
        raise VenvError("\n".join(log + tail))


def ensure_venv(d: Path | str = DEFAULT_DIR, timeout: float = 3000) -> tuple[Path, float]:
    """-> (python of the venv, seconds spent building it; 0.0 when it already existed)."""
    d = Path(d)
    py = venv_python(d)
    if (d / READY).is_file() and py.is_file():
        return py, 0.0
    t0 = time.time()
    log: list[str] = []
    if d.exists():
        import shutil

        shutil.rmtree(d)
    d.parent.mkdir(parents=True, exist_ok=True)
    # venv from inside a venv builds on the base interpreter, so sys.executable is fine either way
    _run([sys.executable, "-m", "venv", d], log, 300)
    pip = [py, "-m", "pip", "install", "--no-input", "--progress-bar", "off"]
    _run(pip + [TORCH], log, timeout)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(TORCH + "\n")
        cons = f.name
    try:
        _run(pip + ["-c", cons, SPECULATORS, TORCH], log, timeout)
    finally:
        os.unlink(cons)
    _run([py, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio"], log, 300)
    _run([py, "-c", "import importlib.metadata as m, torch; from speculators import SpeculatorModel; "
                    "print(m.version('speculators'), torch.__version__)"], log, 600)
    (d / READY).write_text("\n".join(log) + "\n")
    return py, time.time() - t0


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR
    try:
        py, secs = ensure_venv(target)
    except VenvError as e:
        print(str(e), file=sys.stderr)
        sys.exit(1)
    print(f"{py} ready in {secs:.0f}s")
    if (target / READY).is_file():
        print((target / READY).read_text())
