"""OSCAR 2-bit KV cache: calibration, export and serving."""

__version__ = "0.1.0"
