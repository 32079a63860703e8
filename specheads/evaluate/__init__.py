"""The eval stage: runs the engine on prompts, writes acceptance reports, compares with vLLM."""

from .stage import run_eval

__all__ = ["run_eval"]
