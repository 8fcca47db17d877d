"""Layers that differ from each other in the ways a user's layers do (shared by the
serial tests and the MPI scripts; imported, never run)."""
import torch
from torch import nn


class Scaled(nn.Module):
    """A layer whose only difference from its siblings is a plain attribute."""

    def __init__(self, width, s):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.s = s

    def forward(self, u):
        return torch.tanh(self.s * self.lin(u))


class Conv(nn.Module):
    """A convolution with a kernel size of its own (``same`` padding)."""

    def __init__(self, ch, k):
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, k, padding=k // 2)

    def forward(self, u):
        return torch.tanh(self.conv(u))


def loss_fn(y):
    return (y**2).sum() + y.sum()


def rel(a, b) -> float:
    """Largest difference relative to ``max(1, max |b|)``."""
    return float((a - b).detach().abs().max()) / max(1.0, float(b.detach().abs().max()))
