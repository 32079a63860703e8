"""The import rules of docs/ARCHITECTURE.md, checked on the code (every import, lazy ones too)."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "specheads"
STAGES = {"data", "dump", "train", "export", "evaluate"}

# (importer, imported, why): an import from the first part of the second is a bug
NEVER = [
    ("heads", "*", "a head is a plain nn.Module: it imports nothing of specheads but heads/"),
    ("kernels", "*", "kernels are pure functions: they import nothing of specheads but kernels/"),
    ("runtime", "stages", "the engine imports no stage (it takes head modules, not files or reports)"),
    ("train", "runtime", "training does not depend on inference"),
    ("data", "train", "data knows nothing of training"),
    ("data", "evaluate", "generation uses the engine, not the eval stage"),
    ("export", "train", "formats read checkpoints, not trainers"),
    ("config", "cli", "schema below the CLI"),
    ("target", "stages", "the target loader sits below every stage"),
]


def part_of(module: str) -> str:
    """specheads.<part>[.x] -> part; top-level modules are their own part (cli, config, target, ...)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "specheads"


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every specheads module a file imports, relative imports resolved."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                names = [".".join(base + ([node.module] if node.module else []))]
            else:
                names = [node.module or ""]
        else:
            continue
        found |= {n for n in names if n == "specheads" or n.startswith("specheads.")}
    return found


def edges() -> dict[tuple[str, str], list[str]]:
    """(importer part, imported part) -> the files that make the arrow."""
    out = defaultdict(list)
    for path in sorted(PKG.rglob("*.py")):
        src = part_of(module_name(path))
        for imp in imports_of(path):
            dst = part_of(imp)
            if dst != src and dst != "specheads":
                out[(src, dst)].append(str(path.relative_to(PKG.parent)))
    return out


def test_the_parser_sees_imports():
    e = edges()
    # arrows the design wants; if these vanish the test has stopped reading imports
    assert ("evaluate", "runtime") in e and ("train", "heads") in e and ("cli", "config") in e
    assert ("data", "runtime") in e, "data generation uses the engine"


@pytest.mark.parametrize("src,dst,why", NEVER, ids=[f"{a}->{b}" for a, b, _ in NEVER])
def test_never(src, dst, why):
    bad = {}
    for (a, b), files in edges().items():
        if a != src:
            continue
        if dst == "*" or (dst == "stages" and b in STAGES | {"cli"}) or b == dst:
            bad[b] = files
    assert not bad, f"{src} must not import {dst} ({why}): " + "; ".join(f"{b}: {f}" for b, f in bad.items())


def test_no_two_packages_import_each_other():
    e = edges()
    loops = sorted({tuple(sorted((a, b))) for (a, b) in e if (b, a) in e})
    assert not loops, "packages importing each other: " + "; ".join(
        f"{a}<->{b} ({e[(a, b)][0]} / {e[(b, a)][0]})" for a, b in loops)


def test_no_import_indirection():
    """Every import is plain: no importlib, no ImportError fallbacks for our own modules."""
    users = [str(p.relative_to(PKG.parent)) for p in PKG.rglob("*.py")
             if "importlib.import_module" in p.read_text() or "__import__(" in p.read_text()]
    assert not users, users
    fallbacks = [str(p.relative_to(PKG.parent)) for p in PKG.rglob("*.py") if "except ImportError" in p.read_text()]
    assert not fallbacks, fallbacks
