"""Gradient norms of a model whose LayerParallel blocks split their layers over ranks.

On several ranks a rank holds the gradients of the layers it owns only, so a norm
over ``model.parameters()`` (``torch.nn.utils.clip_grad_norm_``) is each rank's own
and differs between ranks: clipping would scale each rank's layers by a different
factor. :func:`grad_norm` and :func:`clip_grad_norm_` sum the owned layers' parts
over each block's layer communicator and add the parameters every rank holds alike
(the layers before and after the blocks), so every rank gets the serial network's
norm and scales by the same factor.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .module import LayerParallel


def _norm_type(norm_type) -> float:
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        raise ValueError(f"`norm_type` must be a number > 0 or inf, got {norm_type!r}") from None
    if not p > 0:
        raise ValueError(f"`norm_type` must be a number > 0 or inf, got {norm_type!r}")
    return p


def _max(values) -> float:
    """The largest of ``values``, NaN when any is NaN (as torch's norms: Python's ``max`` keeps a NaN only
    when it comes first), 0 when there are none."""
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else max(values, default=0.0)


def _part(grads, p: float) -> float:
    """``sum |g|^p`` (the maximum for p = inf) of the gradients ``grads``, in float64."""
    if not grads:
        return 0.0
    if math.isinf(p):
        return _max(float(g.detach().abs().max()) for g in grads)
    return sum(float(torch.linalg.vector_norm(g.detach().double(), p) ** p) for g in grads)


def _check_model(model, name: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{name} takes the model (the nn.Module that holds the LayerParallel blocks), not its "
                        f"parameters: got {type(model).__name__}; call {name}(model, ...) (it needs the blocks "
                        "to know which parameters are split over the ranks)")


def grad_norm(model: nn.Module, norm_type: float = 2.0) -> float:
    """The ``norm_type``-norm of the gradients of all parameters of ``model`` (those with a gradient),
    as the serial network would give it: the same value on every rank.

    The parameters of every :class:`LayerParallel` in ``model`` (the block's own layers, split over
    its communicator) are summed over that communicator (correctly rounded, so the value does not
    depend on the number of ranks); all other parameters count once. Collective over the
    communicator of every block: call it on every rank.
    """
    _check_model(model, "grad_norm")
    p = _norm_type(norm_type)
    blocks = [m for m in model.modules() if isinstance(m, LayerParallel)]
    split = {id(q) for b in blocks for q in b.parameters()}
    rest = [q.grad for q in model.parameters() if id(q) not in split and q.grad is not None]
    parts = [_part(rest, p)]
    for b in blocks:
        own = [q.grad for q in b.parameters() if q.grad is not None]
        # in a session of the block: a rank that is in another call of the block (a pass) raises
        # instead of waiting
        with b._session("grad_norm / clip_grad_norm_", p, agree="norm types"):
            if math.isinf(p):
                local = _part(own, p)  # (the communicator's max takes a NaN for inf: NaNs flagged apart)
                nan, top = b.comm.exact_many([[float(math.isnan(local))], [0.0 if math.isnan(local) else local]],
                                             "max")  # (one reduction)
                parts.append(math.nan if nan else top)
            else:
                parts.append(b.comm.sum_exact([_part([g], p) for g in own]))
    if math.isinf(p):
        return _max(parts)
    return math.fsum(parts) ** (1.0 / p)


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` for a model with LayerParallel
    blocks on several ranks: scales every gradient by ``min(1, max_norm / (norm + 1e-6))`` with the
    norm of :func:`grad_norm` (the serial network's, the same on every rank). Returns the norm (a
    float64 tensor, like torch's function).

    On one process it equals torch's function (up to rounding; norm types > 0 and inf), a NaN or Inf
    gradient included (a NaN norm makes every gradient NaN). Collective: call it on every rank,
    after the gradients are complete (after :func:`allreduce_gradients` on a layer x data grid).
    """
    _check_model(model, "clip_grad_norm_")
    max_norm = float(max_norm)
    if not max_norm >= 0:
        raise ValueError(f"`max_norm` must be a number >= 0, got {max_norm!r}")
    total = grad_norm(model, norm_type)
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is {total}: "
                           "it cannot be clipped (error_if_nonfinite=True)")
    coef = max_norm / (total + 1e-6)
    coef = coef if math.isnan(coef) else min(1.0, coef)  # a NaN norm makes every gradient NaN, as torch's does
    grads = [q.grad for q in model.parameters() if q.grad is not None]
    if grads and not coef >= 1.0:
        torch._foreach_mul_(grads, coef)
    return torch.tensor(total, dtype=torch.float64)
