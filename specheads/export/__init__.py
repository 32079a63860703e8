"""Exporters: speculators (vLLM), sglang, eagle (EAGLE-1), mtp; validate; card."""
from .common import ExportError, ExportMeta
from .convert import convert, detect_format, load_any, save

__all__ = ["ExportError", "ExportMeta", "convert", "detect_format", "load_any", "save"]
