"""Low-rank communication: PowerSGD helpers and AB-training."""
from .ab import ABTraining, factorize, kept_rank, matrix_view, model_compression, traffic_summary, unit_singular_values_
from .orthogonalize import orthogonalize

__all__ = ["ABTraining", "factorize", "kept_rank", "matrix_view", "model_compression", "orthogonalize",
           "traffic_summary", "unit_singular_values_"]
