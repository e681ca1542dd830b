"""Datasets and batching."""

from .batches import BatchSampler

__all__ = ["BatchSampler"]
