"""The export stage: a trained head to a checked, deployable directory (stage, validation, --check).

Only the CLI imports this package; the formats themselves live in ``specheads.formats``."""

from .stage import run_check, run_convert, run_export

__all__ = ["run_check", "run_convert", "run_export"]
