"""Low-rank communication: PowerSGD helpers and AB-training."""
from .ab import ABTraining, factorize, kept_rank
from .orthogonalize import orthogonalize

__all__ = ["ABTraining", "factorize", "kept_rank", "orthogonalize"]
