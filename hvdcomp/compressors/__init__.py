"""Compression methods, one per module, each registered by name (see :func:`get_compressor`)."""
from .base import Compressor, Payload, world_size
from .registry import available, get_compressor, parse_spec, register
from . import none, fp16, topk, threshold  # noqa: F401  (registration side effects)
from .none import NoneCompressor
from .fp16 import FP16Compressor
from .topk import TopKCompressor
from .threshold import ThresholdCompressor

__all__ = ["Compressor", "Payload", "world_size", "available", "get_compressor", "parse_spec",
           "register", "NoneCompressor", "FP16Compressor", "TopKCompressor", "ThresholdCompressor"]
