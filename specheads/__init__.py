"""specheads: train, export and measure speculative-decoding draft heads."""

__version__ = "0.1.0"
