"""The one base class of every error a user can cause and fix.

The CLI prints a ``SpecheadsError`` as one line (``specheads: Name: message``)
and exits 1; anything else is a bug and keeps its traceback. Each stage
subclasses it next to the code that raises it, so the message can name the
file, row and field that are wrong. ``DumpError`` sits here, not in
``specheads.dump``, because ``specheads.rundir`` raises one of its kinds
(``DumpMismatchError``: a store or token rows made for another target).
"""

from __future__ import annotations


class SpecheadsError(Exception):
    """A bad input, a mismatch between artefacts, or a missing prerequisite: the user can fix it."""


class MissingInputError(SpecheadsError, FileNotFoundError):
    """A file or directory a stage reads is not there (usually: an earlier stage has not run)."""


class UsageError(SpecheadsError):
    """Command-line arguments that do not go together."""


class DumpError(SpecheadsError, RuntimeError):
    """A hidden-state store (or an online feed) cannot be written or read as asked."""
