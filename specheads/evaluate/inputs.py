"""What `specheads eval` reads, checked before anything loads: every missing input named at once."""
from __future__ import annotations

from pathlib import Path

from specheads.rundir import is_run_dir


def target_problem(source: str) -> str | None:
    """Why ``source`` cannot be a target, when that is visible without loading it (a hub id passes)."""
    p = Path(source)
    if source.endswith(".gguf"):
        return None if p.is_file() else f"target.source: GGUF file not found: {source}"
    if not p.exists() or (p / "config.json").is_file():
        return None
    msg = f"target.source: {source} is not a model directory (no config.json)"
    if is_run_dir(p):
        msg += ("; it looks like a specheads run directory: give the target model its head was trained for "
                "(the run's recipe names it in target.source)")
    return msg


def input_problems(recipe, heads: list[str]) -> list[str]:
    """Every missing input of an eval: the target, the prompts and each head directory."""
    from specheads.data.sources import resolve_source
    from specheads.errors import MissingInputError

    problems = []
    if (p := target_problem(recipe.target.source)) is not None:
        problems.append(p)
    try:
        resolve_source(recipe.eval.prompts)
    except MissingInputError as e:
        problems.append(f"eval.prompts: {e}")
    for h in heads:
        if not Path(h).is_dir():
            problems.append(f"eval.head: head directory not found: {h}"
                            + (" (run `specheads export` first?)" if recipe.eval.head is None else ""))
    return problems
