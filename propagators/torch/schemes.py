"""Time-stepping schemes of an ODE-net: ``scheme(f, u, dt)`` returns the next state.

``f`` is the layer (the right-hand side of the ODE ``u' = f(u)``), ``dt`` the
step: ``h`` on the layers, ``m h`` on a coarse level with factor ``m``.
A scheme must be a pure function of its arguments (it is evaluated batched,
under ``torch.func.vmap``, and differentiated). It gets one state, shaped as the
layer takes it, and ``dt`` as a 0-d tensor of the state's dtype, as
:class:`ODENet` gives them (the built-in schemes below, elementwise in ``u``,
``f(u)`` and ``dt``, are also applied to a stack of states at once).
"""
from __future__ import annotations

import numpy as np


def forward_euler(f, u, dt):
    """ResNet step ``u + dt f(u)``."""
    return u + dt * f(u)


def heun(f, u, dt):
    """Second-order Runge-Kutta (Heun): ``u + dt/2 (k1 + k2)``."""
    k1 = f(u)
    k2 = f(u + dt * k1)
    return u + 0.5 * dt * (k1 + k2)


def rk4(f, u, dt):
    """Classical fourth-order Runge-Kutta step."""
    k1 = f(u)
    k2 = f(u + 0.5 * dt * k1)
    k3 = f(u + 0.5 * dt * k2)
    k4 = f(u + dt * k3)
    return u + dt / 6.0 * (k1 + 2.0 * k2 + 2.0 * k3 + k4)


def dt_aware(f, u, dt):
    """The layer is the whole step: ``f(u, dt)`` returns the next state."""
    return f(u, dt)


def inject_layer(i0: np.ndarray, i1: np.ndarray) -> np.ndarray:
    """Default coarse parameters: the layer at the start of the interval (parameter injection).

    ``layer_index(i0, i1)`` maps fine indices of interval ends (integer arrays)
    to the index of the layer whose parameters step from ``i0`` to ``i1``.
    """
    return i0
