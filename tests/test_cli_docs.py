"""docs/cli.md is the real parser's help: regenerated here and compared, so a changed flag cannot leave it stale."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("cli_docs", ROOT / "scripts" / "cli_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cli_docs_are_current(monkeypatch):
    gen = _generator()
    have = (ROOT / "docs" / "cli.md").read_text()
    recorded = re.search(r"with Python (\d+\.\d+)'s argparse", have.splitlines()[0] if have else "")
    if recorded and recorded.group(1) != gen.python_version():
        pytest.skip(f"docs/cli.md was generated with Python {recorded.group(1)}'s argparse, this is "
                    f"{gen.python_version()} (argparse lays out help a little differently between versions)")
    monkeypatch.setenv("COLUMNS", "37")  # the terminal's width must not matter
    want = gen.render()
    assert have == want, gen.STALE


def test_cli_docs_cover_every_command():
    gen = _generator()
    from specheads.cli import build_parser

    text = gen.render()
    commands = [" ".join(words) for words, _, _ in gen._walk(build_parser(), ["specheads"], None)]
    assert {"specheads data synthesize", "specheads data regenerate", "specheads data prepare", "specheads vocab",
            "specheads dump", "specheads train", "specheads export", "specheads eval"} <= set(commands)
    for c in commands:
        assert f"\n## {c}\n" in text and f"usage: {c} " in text, c
