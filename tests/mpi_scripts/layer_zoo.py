"""Layers that differ from each other in the ways a user's layers do, and the comparison of a
LayerParallel module with the serial network (shared by the serial tests and the MPI scripts;
imported, never run)."""
import copy

import torch
from torch import nn

from propagators.torch import ODENet

REL = 1e-9


class Scaled(nn.Module):
    """A layer whose only difference from its siblings is a plain attribute."""

    def __init__(self, width, s):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.s = s

    def forward(self, u):
        return torch.tanh(self.s * self.lin(u))


class Timed(nn.Module):
    """A layer whose time is a buffer added to its linear map (the traced dense path folds it into the bias)."""

    def __init__(self, width, t):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("t", torch.tensor(float(t)))

    def forward(self, u):
        return torch.tanh(self.lin(u) + self.t)


class Transposed(nn.Module):
    """A layer whose weight is stored transposed, ``tanh(u @ W + b)`` (the dense path takes a view of it)."""

    def __init__(self, width):
        super().__init__()
        self.W = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.b = nn.Parameter(torch.randn(width) / 4)

    def forward(self, u):
        return torch.tanh(u @ self.W + self.b)


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


def serial_reference(layers, x, T):
    """Output, input gradient and parameter gradients (None where unused) of the serial network
    ``ODENet(layers)`` (a deep copy) under :func:`loss_fn`."""
    net = ODENet(copy.deepcopy(layers), T=T)
    xs = x.clone().requires_grad_(True)
    y = net(xs)
    loss_fn(y).backward()
    return y.detach(), xs.grad, [p.grad for p in net.parameters()]


def check_equals_serial(lp, layers, x, T, tol=REL):
    """``lp``'s output, input gradient and every parameter gradient equal the serial network's."""
    y_s, gx_s, gp_s = serial_reference(layers, x, T)
    xp = x.clone().requires_grad_(True)
    y = lp(xp)
    loss_fn(y).backward()
    assert rel(y.detach(), y_s) < tol
    assert rel(xp.grad, gx_s) < tol
    ps = list(lp.parameters())
    assert len(ps) == len(gp_s)
    for p, g in zip(ps, gp_s):
        if g is None:
            assert p.grad is None
        else:
            assert p.grad is not None, "a parameter got no gradient"
            assert rel(p.grad, g) < tol
