"""Reading and writing heads: speculators (vLLM), sglang, eagle (EAGLE-1), mtp, conversion between them,
the trainer's checkpoint layout, and the model card. Train, data and evaluate read heads through here;
the export stage (``specheads.export``) is a user of these formats, not their home."""
from .common import ExportError, ExportMeta
from .convert import convert, detect_format, load_any, save

__all__ = ["ExportError", "ExportMeta", "convert", "detect_format", "load_any", "save"]
