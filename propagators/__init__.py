"""Propagators for :mod:`mgrit`: reference numpy problems and torch-backed layers.

* :class:`Dahlquist` -- the scalar test equation ``u' = xi u`` (backward or forward Euler).
* :class:`Heat1D`, :class:`HeatTransfer` -- 1-D heat equation, backward Euler, with
  spatial coarsening between time levels.
* :class:`Lorenz`, :class:`Brusselator` -- nonlinear systems with an explicit
  Runge-Kutta step, for FAS.

The torch propagators (ODE-net layers, ``LayerParallel``) live in
:mod:`propagators.torch` and import torch only there.
"""
from .dahlquist import Dahlquist
from .heat import Heat1D, HeatTransfer, heat_hierarchy
from .nonlinear import Brusselator, Lorenz
from .validation import AdvectionDiffusion1D, VanDerPol

__all__ = ["Dahlquist", "Heat1D", "HeatTransfer", "heat_hierarchy", "Lorenz", "Brusselator",
           "AdvectionDiffusion1D", "VanDerPol"]
