"""Array helpers that work on numpy arrays and torch tensors alike.

The solver stores the states of one level as one stacked array of shape
``(n_points, *state_shape)``; these helpers are the only places where the
type of that array matters. torch is never imported here: a tensor is
recognised through ``sys.modules``, so numpy-only users never load torch.
"""
from __future__ import annotations

import sys

import numpy as np


def is_torch(x) -> bool:
    """True when ``x`` is a torch tensor (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def as_state(u):
    """Return ``u`` as an array state: tensors stay tensors, the rest becomes numpy."""
    if is_torch(u):
        return u
    u = np.asarray(u)
    if u.dtype.kind in "biu":
        u = u.astype(np.float64)
    return u


def empty_stack(n: int, like):
    """Uninitialised stack of ``n`` states shaped, typed and placed like ``like``."""
    if is_torch(like):
        import torch

        return torch.empty((n,) + tuple(like.shape), dtype=like.dtype, device=like.device)
    return np.empty((n,) + like.shape, dtype=like.dtype)


def zeros_stack(n: int, like):
    """Stack of ``n`` zero states shaped, typed and placed like ``like``."""
    if is_torch(like):
        import torch

        return torch.zeros((n,) + tuple(like.shape), dtype=like.dtype, device=like.device)
    return np.zeros((n,) + like.shape, dtype=like.dtype)


def stack(states):
    """Stack a list of states along a new leading axis."""
    if is_torch(states[0]):
        import torch

        return torch.stack(states)
    return np.stack(states)


def copy(x):
    """An independent copy of an array or tensor."""
    return x.clone() if is_torch(x) else x.copy()


def row_norms(X) -> np.ndarray:
    """Euclidean norm of every state in the stack ``X``, as a float64 numpy array."""
    n = X.shape[0]
    if n == 0:
        return np.zeros(0)
    if is_torch(X):
        import torch

        return torch.linalg.vector_norm(X.reshape(n, -1), dim=1).double().cpu().numpy()
    return np.linalg.norm(X.reshape(n, -1), axis=1).astype(np.float64, copy=False)


def all_finite(X) -> bool:
    """True when no entry of ``X`` is NaN or infinite.

    One reduction: the sum of the entries is finite unless an entry is NaN or
    infinite (or the sum overflows, in which case every entry is checked).
    """
    if is_torch(X):
        import torch

        if X.numel() == 0 or bool(torch.isfinite(X.sum())):
            return True
        return bool(torch.isfinite(X).all())
    if X.size == 0 or np.isfinite(X.sum()):
        return True
    return bool(np.isfinite(X).all())


def shape_of(x) -> tuple:
    return tuple(x.shape)
