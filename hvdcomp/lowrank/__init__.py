"""Low-rank communication: PowerSGD (a compressor) and AB-training."""
from .orthogonalize import orthogonalize

__all__ = ["orthogonalize"]
