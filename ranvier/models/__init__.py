"""Models built on the IR: MLP and a small CNN (Llama and MoE come later)."""

from .cnn import CNN
from .mlp import MLP
from .module import Module

__all__ = ["CNN", "MLP", "Module"]
