"""Result files hold paths relative to the run that wrote them, not the absolute paths of the machine.

    from run_paths import relative      # benchmarks/ on sys.path
    summary = relative(summary, run_dir)

Every string (and dict key) that names a file under one of ``roots`` becomes relative to that root ("." for the root
itself); other absolute paths under the working directory become relative to it, and those under the home
directory start with "~". Anything else is left as it is.
"""
from __future__ import annotations

import os
from pathlib import Path


def _prefixes(roots) -> list[tuple[str, str]]:
    out = []
    for root in roots:
        if root is None:
            continue
        forms = {str(root).rstrip("/"), str(Path(root).resolve())}
        out += [(f, "") for f in forms if f not in ("", ".")]
    out.append((str(Path.cwd().resolve()), ""))
    out.append((str(Path.home()), "~/"))
    return sorted(out, key=lambda p: -len(p[0]))  # the longest (most specific) root first


def _rewrite(s: str, prefixes) -> str:
    for prefix, repl in prefixes:
        if s == prefix:
            return repl.rstrip("/") or "."
        if s.startswith(prefix + os.sep):
            return repl + s[len(prefix) + 1:]
    return s


def relative(obj, *roots):
    """``obj`` (JSON-like: dicts, lists, strings, numbers) with its paths made relative to ``roots``."""
    prefixes = _prefixes(roots)

    def walk(x):
        if isinstance(x, str):
            return _rewrite(x, prefixes)
        if isinstance(x, dict):
            return {walk(k) if isinstance(k, str) else k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [walk(v) for v in x]
        return x

    return walk(obj)
