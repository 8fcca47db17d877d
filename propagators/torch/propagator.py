"""The forward propagator of an ODE-net: layers are time steps.

Time points are multiples of the layer step ``h``: an interval from
``t0 = i0 h`` to ``t1 = i1 h`` steps with ``dt = (i1 - i0) h`` and the layer
``layer_index(i0, i1)`` (default :func:`~propagators.torch.schemes.inject_layer`:
the layer at ``i0``, parameter injection on coarse levels).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch
from torch import nn

import mgrit

from .kernel import KernelPass, LayerKernel
from .schemes import forward_euler, inject_layer


def as_kernel_pass(layers, scheme=forward_euler, batched: bool = True, streams: int = 0) -> KernelPass:
    """A :class:`KernelPass` from a pass, a kernel, or a sequence / mapping of layer modules."""
    if isinstance(layers, KernelPass):
        return layers
    if isinstance(layers, LayerKernel):
        return layers.bind()
    if hasattr(layers, "layers") and not isinstance(layers, nn.Module):  # a LayerStack
        layers = layers.layers
    if isinstance(layers, Mapping):
        modules = {int(j): m for j, m in layers.items()}
    elif isinstance(layers, (Sequence, nn.ModuleList)):
        modules = dict(enumerate(layers))
    else:
        raise TypeError(f"`layers` must be a sequence or a mapping of nn.Module, got {type(layers).__name__}")
    return LayerKernel(modules, scheme, batched, streams).bind()


def cached_plan(cache: dict, t0, t1, like, make):
    """``make(t0, t1)`` for the time points ``t0 -> t1`` and states like ``like``, kept in ``cache``
    per pattern of time points (a sweep repeats its pattern every cycle and pass)."""
    t0, t1 = np.asarray(t0, dtype=np.float64), np.asarray(t1, dtype=np.float64)
    key = (t0.tobytes(), t1.tobytes(), like.dtype, like.device)
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = make(t0, t1)
    return hit


class LayerStack:
    """Layers for :class:`ODEPropagator` (kept for compatibility: pass the layers directly)."""

    def __init__(self, layers, uniform=None, flat=None):
        self.layers = layers


class ODEPropagator(mgrit.Propagator):
    """Steps a state through a stack of layers: ``u_{i+1} = scheme(f_i, u_i, dt)``.

    Parameters
    ----------
    layers : sequence or mapping of nn.Module, LayerKernel or KernelPass
        The layers by global index.
    h : float
        Layer step (final time / number of layers).
    scheme : callable
        ``scheme(f, u, dt)`` returns the next state (ignored when ``layers``
        is already a kernel, which carries its scheme).
    layer_index : callable, optional
        ``layer_index(i0, i1)`` on integer arrays: which layer steps from fine
        index ``i0`` to ``i1``.
    batched, streams
        See :class:`~propagators.torch.kernel.LayerKernel`.

    Notes
    -----
    Batched steps use stacked copies of the parameters, made at their first
    use: a propagator evaluates the parameter values it first saw. After
    changing parameters (an optimizer step, ``load_state_dict``, ``.to()``),
    call :meth:`refresh` or build a new propagator. ``LayerParallel`` binds
    the current values on every forward pass.
    """

    def __init__(self, layers, h: float, scheme=forward_euler, layer_index=None, batched: bool = True,
                 streams: int = 0):
        self.kernel = as_kernel_pass(layers, scheme, batched, streams)
        self.h = float(h)
        self.layer_index = layer_index or inject_layer
        self._dts: dict = {}
        # layer indices and steps of every pattern of time points, kept across passes by the kernel
        self._plans = self.kernel.k.plan_cache(("forward", self.h, self.layer_index))

    def refresh(self) -> None:
        """Evaluate the layers' current parameter values from now on (see the Notes)."""
        self.kernel = self.kernel.k.bind()

    def ints(self, t) -> np.ndarray:
        """Fine indices of time points (``t / h`` rounded)."""
        return np.rint(np.asarray(t, dtype=np.float64) / self.h).astype(np.int64)

    def dt(self, i0, i1, like):
        """Steps ``(i1 - i0) h`` as a tensor like ``like`` (cached per pattern)."""
        steps = np.atleast_1d(np.asarray(i1 - i0))
        key = (steps.tobytes(), like.dtype, str(like.device))
        dt = self._dts.get(key)
        if dt is None:
            dt = self._dts[key] = torch.as_tensor(steps * self.h, dtype=like.dtype, device=like.device)
        return dt

    def layers_of(self, i0, i1) -> np.ndarray:
        idx = np.asarray(self.layer_index(np.atleast_1d(i0), np.atleast_1d(i1)), dtype=np.int64)
        return idx

    def layer_of(self, i0: int, i1: int) -> int:
        """The layer that steps from fine index ``i0`` to ``i1`` (one interval)."""
        if self.layer_index is inject_layer:
            return i0
        return int(np.asarray(self.layer_index(np.array([i0]), np.array([i1])))[0])

    def step(self, u, t0, t1):
        i0, i1 = round(float(t0) / self.h), round(float(t1) / self.h)
        return self.kernel.step_one(u, self.layer_of(i0, i1), (i1 - i0) * self.h)

    def plan(self, t0, t1, like):
        """``(layers, dt)`` of the intervals ``t0 -> t1``: :meth:`layers_of` and :meth:`dt` of their
        fine indices, worked out once per pattern of time points (sweeps repeat theirs every cycle)."""
        def make(t0, t1):
            i0, i1 = self.ints(t0), self.ints(t1)
            return self.layers_of(i0, i1), self.dt(i0, i1, like)

        return cached_plan(self._plans, t0, t1, like, make)

    def step_batch(self, U, t0, t1):
        # this pass's step function for the pattern (kept by the pass: its parameter values)
        step = cached_plan(self.kernel.steppers(self._plans), t0, t1, U,
                           lambda a, b: self.kernel.stepper(*self.plan(a, b, U)))
        return step(U)
