"""Models built on the IR: an MLP, a small CNN (here), and Llama-2 (`ranvier.models.llama`)."""

from .cnn import CNN
from .mlp import MLP
from .module import Module

__all__ = ["CNN", "MLP", "Module"]
