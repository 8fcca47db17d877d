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

import functools
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
    # (complex gradients by their magnitudes: .double() of a complex tensor drops the imaginary part)
    return sum(float(torch.linalg.vector_norm(_wide(g.detach()), p) ** p) for g in grads)


def _wide(g: torch.Tensor) -> torch.Tensor:
    return g.to(torch.complex128).abs() if g.is_complex() else g.double()


def _agree_rest(b: LayerParallel, rest: float, rtol: float) -> None:
    """Raise on every rank of ``b``'s communicator when the part of the parameters outside the blocks
    (``rest``: this rank's) differs between its ranks by more than ``rtol``: each rank would scale its
    copies by another factor. One reduction; a part that is NaN or Inf on every rank passes (the norm
    is then that)."""
    bad = not math.isfinite(rest)
    hi, neg_lo, any_bad, neg_all_bad = b.comm.exact_many(
        [[0.0 if bad else rest], [0.0 if bad else -rest], [float(bad)], [-float(bad)]], "max")
    lo = -neg_lo
    if (any_bad and neg_all_bad == 0.0) or hi - lo > rtol * hi:
        ranks = "NaN or Inf on some ranks only" if any_bad and neg_all_bad == 0.0 else f"from {lo!r} to {hi!r}"
        raise ValueError(
            f"the gradients of the parameters outside the LayerParallel blocks differ between the ranks of "
            f"LayerParallel #{b._uid} (their part of the norm ranges {ranks}): every rank must hold the same "
            "gradients for them, or each would clip its copy by another factor. Is a parameter's .grad None on "
            "some ranks only, or are the gradients of a layer x data grid not yet all-reduced "
            "(allreduce_gradients)?")


def _check_model(model, name: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{name} takes the model (the nn.Module that holds the LayerParallel blocks), not its "
                        f"parameters: got {type(model).__name__}; call {name}(model, ...) (it needs the blocks "
                        "to know which parameters are split over the ranks)")
    sparse = next((n for n, q in model.named_parameters() if q.grad is not None and q.grad.is_sparse), None)
    if sparse is not None:
        raise TypeError(f"{name}: parameter `{sparse}` has a sparse gradient (nn.Embedding(sparse=True)), which "
                        "torch's norms (and torch.nn.utils.clip_grad_norm_) do not take: use a dense embedding "
                        "(sparse=False) where the gradients are clipped")


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
    parts, seen = [_part(rest, p)], set()
    # (copies of the same gradients give the same part; 100 units of their precision allow for rounding)
    rtol = min(1e-3, 100 * max((torch.finfo(g.dtype).eps for g in rest), default=0.0))
    for b in blocks:
        # (a parameter two blocks hold, tied on one rank, counts once, as in model.parameters())
        mine = [q for q in b.parameters() if id(q) not in seen]
        seen.update(id(q) for q in mine)
        own = [q.grad for q in mine if q.grad is not None]
        # in a session of the block: a rank that is in another call of the block (a pass) raises
        # instead of waiting
        with b._session("grad_norm / clip_grad_norm_", p, agree="norm types"):
            if b.comm.size > 1:
                _agree_rest(b, parts[0], rtol)
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
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` for a model with LayerParallel
    blocks on several ranks: scales every gradient by ``min(1, max_norm / (norm + 1e-6))`` with the
    norm of :func:`grad_norm` (the serial network's, the same on every rank). Returns the norm as
    torch's function does: a 0-d tensor in the gradients' (real) dtypes promoted, on the first one's
    device (0.0 in torch's default dtype without gradients). ``foreach`` as torch's: False multiplies
    the gradients one by one, otherwise one fused multiply.

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
        if foreach is False:
            for g in grads:
                g.mul_(coef)
        else:
            torch._foreach_mul_(grads, coef)
    if not grads:
        return torch.tensor(0.0)
    # (torch stacks the per-tensor norms: the gradients' real dtypes promoted, on the first one's device)
    dtype = functools.reduce(torch.promote_types, (g.dtype.to_real() if g.is_complex() else g.dtype for g in grads))
    return torch.tensor(total, dtype=dtype, device=grads[0].device)
