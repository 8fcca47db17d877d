"""Array helpers that work on numpy arrays and torch tensors alike.

The solver stores the states of one level as one stacked array of shape
``(n_points, *state_shape)``; these helpers are the only places where the
type of that array matters. torch is never imported here: a tensor is
recognised through ``sys.modules``, so numpy-only users never load torch.
"""
from __future__ import annotations

import math
import sys

import numpy as np


def is_torch(x) -> bool:
    """True when ``x`` is a torch tensor (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def as_state(u):
    """Return ``u`` as an array state: tensors stay tensors, the rest becomes numpy.

    Integer and boolean states become floating point (numpy: float64; torch:
    the default floating dtype, ``torch.get_default_dtype()``), since the
    states of the solve are stored in the dtype of the initial state.
    """
    if is_torch(u):
        if u.is_floating_point() or u.is_complex():
            return u
        import torch

        return u.to(torch.get_default_dtype())
    u = np.asarray(u)
    if u.dtype.kind in "biu":
        u = u.astype(np.float64)
    return u


def arithmetic_dtype(x) -> str | None:
    """None when the solver can compute with states of ``x``'s dtype, else the dtype to convert to: torch's
    ``complex32`` and 8-bit floats have no sums, norms or comparisons on the CPU."""
    if not is_torch(x):
        return None
    if str(x.dtype) == "torch.complex32":
        return "complex64"
    if x.is_floating_point() and x.dtype.itemsize == 1:
        return "float16"
    return None


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


def result_key(raw) -> tuple:
    """``(type, shape, dtype)`` that a later result of a propagator's ``step`` must match to be stored without
    a check: the first result's, as ``step`` returned it (a numpy scalar for 0-d states, another real dtype than
    the states'); ``(None, None, None)`` for a result without them (a Python float: then every one is checked)."""
    if hasattr(raw, "shape") and hasattr(raw, "dtype"):
        return type(raw), raw.shape, raw.dtype
    return None, None, None


def same_values(a, b) -> bool:
    """True when ``a`` and ``b`` (alike in type and shape) hold the same values, NaN matching NaN."""
    if is_torch(a):
        import torch

        return bool(torch.equal(a, b) or ((a == b) | (a.isnan() & b.isnan())).all())
    return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))


def subtract_into(a, b, out):
    """``out = a - b`` without a temporary (``out`` may be ``a`` or ``b``); returns ``out``."""
    if is_torch(out):
        import torch

        return torch.sub(a, b, out=out)
    return np.subtract(a, b, out=out)


def _underflow_bound(fi) -> float:
    """Below this norm (``fi``: the finfo of the dtype it was computed in) squares of the row's
    largest entries may have been subnormal or zero, losing digits: such rows are recomputed scaled."""
    return float(np.sqrt(float(fi.tiny))) * 2.0 ** (int(fi.bits) // 4)


def row_norms(X) -> np.ndarray:
    """Euclidean norm of every state in the stack ``X``, as a float64 numpy array.

    Rows whose plain norm over- or underflows (states near 1e200, or near
    1e-160 and below, where squares are subnormal) are recomputed scaled by
    their largest entry, so a finite state has a nonzero-if-nonzero norm,
    accurate to rounding, finite unless the norm itself exceeds the largest
    float. A C-contiguous float64 numpy stack is reduced in one pass
    (``einsum``, no temporary of squares), each row on its own: a row's norm
    does not depend on the other rows of the stack.
    """
    n = X.shape[0]
    if n == 0 or math.prod(X.shape[1:]) == 0:  # no states, or empty ones: norm 0
        return np.zeros(n)
    if is_torch(X):
        import torch

        Y = X.reshape(n, -1)
        out = torch.linalg.vector_norm(Y, dim=1).double().cpu().numpy()
        real = Y.real.dtype if Y.is_complex() else Y.dtype
        low = _underflow_bound(torch.finfo(real)) if real.is_floating_point else 0.0
        bad = np.flatnonzero(~np.isfinite(out) | (out < low) | (out == 0.0))
        if bad.size:
            sub = Y[torch.as_tensor(bad, device=Y.device)].abs().double()
            s = sub.amax(dim=1, keepdim=True)
            fix = torch.isfinite(s[:, 0]) & (s[:, 0] > 0)
            if bool(fix.any()):
                scaled = s[fix, 0] * torch.linalg.vector_norm(sub[fix] / s[fix], dim=1)
                out[bad[fix.cpu().numpy()]] = scaled.cpu().numpy()
        return out
    Y = X.reshape(n, -1)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        if Y.dtype == np.float64 and Y.flags.c_contiguous and type(Y) is np.ndarray:
            # the sums of squares in one pass, no temporary (2-4x np.linalg.norm)
            out = np.sqrt(np.einsum("ij,ij->i", Y, Y))
        else:
            out = np.linalg.norm(Y, axis=1)
        kind = out.dtype  # the dtype the squares were summed in
        out = out.astype(np.float64, copy=True)
    low = _underflow_bound(np.finfo(kind)) if kind.kind == "f" else 0.0
    bad = np.flatnonzero(~np.isfinite(out) | (out < low) | (out == 0.0))
    if bad.size:
        sub = np.abs(Y[bad]).astype(np.float64)
        s = sub.max(axis=1)
        fix = np.isfinite(s) & (s > 0)
        if fix.any():
            with np.errstate(over="ignore"):  # (a norm beyond the largest float is inf)
                out[bad[fix]] = s[fix] * np.linalg.norm(sub[fix] / s[fix, None], axis=1)
    return out


def all_finite(X) -> bool:
    """True when no entry of ``X`` is NaN or infinite.

    One reduction: the sum of the entries is finite unless an entry is NaN or
    infinite (or the sum overflows, in which case every entry is checked). For
    numpy stacks of 4096 entries or more the rows are summed by one
    matrix-vector product, which streams the memory about twice as fast.
    """
    if is_torch(X):
        import torch

        if X.numel() == 0 or bool(torch.isfinite(X.sum())):
            return True
        return bool(torch.isfinite(X).all())
    if X.size == 0:
        return True
    with np.errstate(over="ignore", invalid="ignore"):  # (finite states whose sum overflows: checked below)
        if X.size >= 4096 and X.ndim > 1 and X.dtype.char in "fdFD" and type(X) is np.ndarray:  # (BLAS types)
            # row sums by one matrix-vector product (memory-bound, about twice np.sum's speed); a NaN
            # or infinite entry makes its row's sum NaN or infinite
            Y = X.reshape(X.shape[0], -1)
            total = (Y @ np.ones(Y.shape[1], dtype=Y.real.dtype)).sum()
        else:
            total = X.sum()
    if np.isfinite(total):
        return True
    return bool(np.isfinite(X).all())


def is_complex(x) -> bool:
    """True when the array or tensor ``x`` has a complex dtype (no per-element work)."""
    if is_torch(x):
        return x.is_complex()
    return x.dtype.kind == "c"


def requires_grad(x) -> bool:
    """True when ``x`` is a torch tensor that autograd tracks."""
    return is_torch(x) and x.requires_grad


def type_name(x) -> str:
    """Short name of the type of ``x`` for messages ("torch.Tensor", "numpy.ndarray", "list")."""
    if is_torch(x):
        return "torch.Tensor"
    if isinstance(x, np.ndarray):
        return "numpy.ndarray"
    return type(x).__name__


def shape_of(x) -> tuple:
    return tuple(x.shape)


def flat_real(x):
    """``x`` as a flat real array or tensor: complex entries as their real and imaginary parts, in C order
    whatever the memory layout; a tensor detached, its conjugate or negative views resolved, on its device."""
    if is_torch(x):
        import torch

        v = x.detach().resolve_conj().resolve_neg().reshape(-1)
        return torch.view_as_real(v).reshape(-1) if v.is_complex() else v
    v = np.asarray(x)
    if v.dtype.kind == "c":
        v = np.ascontiguousarray(v)
        v = v.view(v.real.dtype)
    return v.reshape(-1)


def host_values(x) -> tuple:
    """``(flat real numpy array on the host, machine epsilon of x's dtype)`` of an array or tensor
    (:func:`flat_real`, copied to the host where it is not there, bfloat16 widened to float32): what
    :func:`mgrit._inputs.array_sums` reads."""
    v = flat_real(x)
    if is_torch(x):
        import torch

        return (v.float() if v.dtype == torch.bfloat16 else v).cpu().numpy(), torch.finfo(x.dtype).eps
    return v, float(np.finfo(v.dtype).eps)
