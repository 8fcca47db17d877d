"""The adjoint of an ODE-net in reverse layer-time, and the parameter gradients.

For ``u_{j+1} = Phi_j(u_j)`` and a loss ``L(u_N)`` the adjoint
``w_j = dL/du_j`` satisfies ``w_j = (dPhi_j/du_j)^T w_{j+1}``, ``w_N = dL/du_N``:
a linear recursion backward in layer-time, solved with MGRIT in reverse time
``tau = T - t`` (reverse point ``s`` is forward point ``N - s``). Each step is
one vector-Jacobian product through the layer at its stored forward state.
The parameter gradient of layer ``j`` is ``(dPhi_j/dtheta_j)^T w_{j+1}``.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

import mgrit

from .kernel import take_rows
from .propagator import ODEPropagator, cached_plan


class AdjointPropagator(mgrit.Propagator):
    """The adjoint of an :class:`ODEPropagator` in reverse layer-time.

    A step from ``tau0`` to ``tau1`` covers the forward interval
    ``[T - tau1, T - tau0]`` (fine indices ``ia < ib``) and returns ``J^T v``
    with ``J`` the Jacobian of that forward step at the stored forward state
    ``u_ia``.

    Parameters
    ----------
    forward : ODEPropagator
    states : callable
        ``states(ia)`` returns the stacked forward states at fine indices ``ia``.
    n_layers : int
    linearization : (tensor, int), optional
        ``(D, i_top)``: ``D[k]`` holds the derivatives that
        :meth:`~propagators.torch.kernel.KernelPass.linearize` gave for the state and layer at
        fine index ``i_top - k``, in reverse layer order as the adjoint's sweeps run, so that a
        sweep reads its rows as a view (valid when every interval ``[ia, ib]`` steps with layer
        ``ia``, the default parameter injection). Every step then reuses them instead of
        re-evaluating the layer at its stored state. Derivatives ``D`` of fine indices
        ``i0, i0 + 1, ...`` (forward order) are passed as ``(D.flip(0), i0 + len(D) - 1)``; a step
        outside the rows raises ValueError.
    record : list, optional
        When given (and without ``linearization``), every batched sweep of fine steps also takes
        the parameter VJPs of its layers from the same vector-Jacobian product, where the layers
        allow it (:meth:`~propagators.torch.kernel.KernelPass.vjp_state_and_params`), and appends
        ``(layers, cotangents, blocks)`` to it, in the order of the sweeps (for a layer the last
        entry counts). A gradient is the final one when its cotangent equals the solve's final
        adjoint (:func:`recorded_gradients`).
    """

    def __init__(self, forward: ODEPropagator, states: Callable, n_layers: int, linearization=None,
                 record: list | None = None):
        self.fwd, self.states, self.N = forward, states, int(n_layers)
        self.linearization = linearization
        self.record = record
        self._plans = forward.kernel.k.plan_cache(("adjoint", self.N, forward.h, forward.layer_index))

    def intervals(self, tau0, tau1):
        """Forward fine indices ``(ia, ib)`` of reverse intervals."""
        return self.N - self.fwd.ints(tau1), self.N - self.fwd.ints(tau0)

    def step(self, v, tau0, tau1):
        h, N = self.fwd.h, self.N
        ia, ib = N - round(float(tau1) / h), N - round(float(tau0) / h)
        j = self.fwd.layer_of(ia, ib)
        if self.linearization is not None:
            D, top = self.linearization
            return self.fwd.kernel.vjp_state_one(None, v, j, (ib - ia) * h, D[_rows_of(D, top, ia)])
        return self.fwd.kernel.vjp_state_one(self.states(np.array([ia]))[0], v, j, (ib - ia) * h)

    def plan(self, tau0, tau1, like):
        """``(ia, layers, dt)`` of the reverse intervals, worked out once per pattern of time points."""
        def make(tau0, tau1):
            ia, ib = self.intervals(tau0, tau1)
            return ia, self.fwd.layers_of(ia, ib), self.fwd.dt(ia, ib, like)

        return cached_plan(self._plans, tau0, tau1, like, make)

    def step_batch(self, V, tau0, tau1):
        if self.linearization is None:
            ia, layers, dt = self.plan(tau0, tau1, V)
            if self.record is not None and (self.fwd.ints(tau1) - self.fwd.ints(tau0) == 1).all():
                both = self.fwd.kernel.vjp_state_and_params(self.states(ia), V, layers, dt)
                if both is not None:  # (V cloned: the solver overwrites its rows later)
                    self.record.append((np.asarray(layers), V.detach().clone(), both[1]))
                    return both[0]
            return self.fwd.kernel.vjp_state(self.states(ia), V, layers, dt)
        D, top = self.linearization
        # the step functions are kept by the forward's pass (its parameter values), afresh for a new or
        # changed linearization
        per_pass = self.fwd.kernel.steppers(self._plans)
        held = per_pass.get("linearization")
        if held is None or held[0] is not D or held[1] != (D._version, top):
            held = per_pass["linearization"] = (D, (D._version, top), {})

        def make(a, b):
            ia, layers, dt = self.plan(a, b, V)
            # (the sweep runs down the layers, up D's rows: a view)
            return self.fwd.kernel.vjp_stepper(layers, dt, take_rows(_rows_of(D, top, ia), D.device)(D))

        return cached_plan(held[2], tau0, tau1, V, make)(V)


def _rows_of(D, top: int, ia):
    """The rows of a reversed linearization ``(D, top)`` that hold fine indices ``ia``: ``top - ia``,
    checked (a row outside ``D`` would wrap around to another layer's derivatives)."""
    rows = top - np.asarray(ia)
    if rows.size and (rows.min() < 0 or rows.max() >= D.shape[0]):
        raise ValueError(
            f"AdjointPropagator's linearization (D, i_top) holds fine indices {top - D.shape[0] + 1} to {top} "
            f"(D[k] for fine index i_top - k, in reverse layer order), but a step needs fine indices "
            f"{int(np.min(ia))} to {int(np.max(ia))}. Pass the derivatives of KernelPass.linearize in reverse "
            "order with the last fine index: (D.flip(0), i0 + len(D) - 1) for derivatives D of fine indices "
            "i0, i0 + 1, ... (the forward-order form (D, i0) is no longer accepted)")
    return rows


def recorded_gradients(record: list, layers: np.ndarray, final):
    """The parameter VJPs the adjoint sweeps recorded (:class:`AdjointPropagator` ``record``) for
    ``layers`` whose cotangent equals the final adjoint ``final(rows)`` (the adjoints after the
    layers ``rows``) bitwise: ``(positions, grads, rest)``, ``rest`` the layers without one."""
    last = {}  # layer -> (sweep, row): a later sweep replaces an earlier one
    for s, (lay, _, _) in enumerate(record):
        last.update(zip(lay.tolist(), zip([s] * lay.size, range(lay.size))))
    want = set(np.asarray(layers).tolist())
    positions, grads, done = [], [], set()
    for s, (lay, cot, blocks) in enumerate(record):
        rows = np.array([r for r, j in enumerate(lay.tolist()) if j in want and last[j] == (s, r)], dtype=np.int64)
        if not rows.size:
            continue
        t = torch.as_tensor(rows, device=cot.device)
        same = (cot.index_select(0, t) == final(lay[rows])).reshape(rows.size, -1).all(dim=1).cpu().numpy()
        ok = np.zeros(lay.size, dtype=bool)
        ok[rows[same]] = True
        done.update(lay[ok].tolist())
        for pos, cols, gq in blocks:
            sel = ok if pos is None else ok[pos]
            if not sel.any():
                continue
            every = bool(sel.all())
            ts = None if every else torch.as_tensor(np.flatnonzero(sel), device=cot.device)
            for q, G in gq.items():
                positions += cols[sel, q].tolist()
                grads += (G if every else G.index_select(0, ts)).unbind(0)
    rest = np.asarray([j for j in np.asarray(layers).tolist() if j not in done], dtype=np.int64)
    return positions, grads, rest


def parameter_vjp(fwd: ODEPropagator, layers: np.ndarray, U, W, D=None, overwrite: bool = False):
    """``(d Phi_j / d theta_j)^T w_{j+1}`` for the fine steps of the given layers.

    ``U[k]`` is the state entering layer ``layers[k]``, ``W[k]`` the adjoint
    at the state it produces (``D``: optional derivatives of
    :meth:`~propagators.torch.kernel.KernelPass.linearize` for ``U``; ``overwrite``: they are
    not read again, and their memory may be reused). Returns
    ``(positions, grads)``: the gradient ``grads[i]`` (or None) belongs to the
    parameter ``fwd.kernel.params[positions[i]]`` (see
    :meth:`~propagators.torch.kernel.KernelPass.vjp_params`).
    """
    layers = np.asarray(layers, dtype=np.int64)
    dt = torch.full((len(layers),), fwd.h, dtype=U.dtype, device=U.device)
    return fwd.kernel.vjp_params(U, W, layers, dt, D, overwrite)
