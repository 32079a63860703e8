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
    ("export", "train", "the export stage reads checkpoints, not trainers"),
    ("formats", "stages", "formats sit below every stage: train, data and evaluate read heads through them"),
    ("formats", "runtime", "formats read and write files, the engine takes modules"),
    ("train", "export", "only the CLI calls the export stage"),
    ("data", "export", "only the CLI calls the export stage"),
    ("evaluate", "export", "only the CLI calls the export stage"),
    ("dump", "export", "only the CLI calls the export stage"),
    ("runtime", "formats", "the engine takes head modules, not files"),
    ("config", "cli", "schema below the CLI"),
    ("target", "stages", "the target loader sits below every stage"),
    ("rundir", "stages", "every stage reads its run directory through rundir; rundir knows no stage"),
    ("rundir", "runtime", "run-directory facts are paths, recorded settings and manifests, not inference"),
    ("rundir", "formats", "rundir checks recorded settings and manifests; head files are the formats' business"),
    ("config", "rundir", "the schema sits below the run directory"),
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
    assert ("train", "formats") in e and ("evaluate", "formats") in e and ("export", "formats") in e


def test_only_the_cli_imports_the_export_stage():
    importers = sorted({a for (a, b) in edges() if b == "export"})
    assert importers == ["cli"], f"the export stage is imported by {importers}; only the CLI may call it"


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


def test_every_stage_is_entered_from_its_package():
    """``run_<stage>(recipe)``, importable from the stage's package, defined once; the CLI's one table names them all."""
    from specheads.cli import STAGE_ENTRIES, STAGES, stage_entry

    assert set(STAGE_ENTRIES) == set(STAGES)
    defined = defaultdict(list)
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("run_"):
                defined[node.name].append(str(path.relative_to(PKG.parent)))
    for stage, (package, name) in STAGE_ENTRIES.items():
        f = stage_entry(stage)
        assert f.__name__ == name and f.__module__.startswith(f"specheads.{package}."), (stage, f.__module__)
        assert len(defined[name]) == 1, f"{name} is defined in {defined[name]}"


# runtime/ is measured separately while it is being split into packages
SIZE_EXEMPT = {"runtime"}


def test_module_and_function_sizes():
    """No module over 700 lines, no function over 100: a file or function that grows past them is split by
    what it holds."""
    big = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.parts[0] in SIZE_EXEMPT:
            continue
        text = path.read_text()
        if len(text.splitlines()) > 700:
            big.append(f"{rel}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 100:
                big.append(f"{rel}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not big, big
