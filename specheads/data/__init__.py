"""Data stage: formats -> conversations, chat template + loss mask -> token rows,
draft-vocabulary selection. See docs/ARCHITECTURE.md (data/)."""

from .formats import DataError, load_conversations, load_prompts, resolve_data_path
from .sources import split_holdout
from .prepare import load_rows, load_summary, prepare_rows
from .template import TemplateError, tokenize_conversation
from .vocab import load_vocab, save_vocab, select_draft_vocab
from .stage import run_prepare, run_vocab
from .regenerate import run_regenerate
from .synthesize import run_synthesize

__all__ = [
    "run_prepare",
    "run_regenerate",
    "run_synthesize",
    "run_vocab",
    "DataError",
    "TemplateError",
    "load_conversations",
    "load_prompts",
    "resolve_data_path",
    "split_holdout",
    "tokenize_conversation",
    "prepare_rows",
    "load_rows",
    "load_summary",
    "select_draft_vocab",
    "save_vocab",
    "load_vocab",
]
