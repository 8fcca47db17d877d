"""Torch-backed propagators and layer-parallel training.

A residual network ``u_{i+1} = u_i + h f(u_i; theta_i)`` is forward Euler on
an ODE, and its layers are time steps. One concept per module:

* :mod:`~propagators.torch.schemes` -- ``scheme(f, u, dt)``: forward Euler, Heun, RK4, dt-aware layers;
* :mod:`~propagators.torch.kernel` -- how a set of intervals is stepped: interchangeable
  layers batched (dense fast path or vmap), all others looped; used alike by the
  forward steps, the adjoint and the parameter gradients;
* :mod:`~propagators.torch.propagator` -- :class:`ODEPropagator`, the forward propagator;
* :mod:`~propagators.torch.adjoint` -- :class:`AdjointPropagator` and the parameter VJPs;
* :mod:`~propagators.torch.plan` -- :class:`DistributionPlan`: which layers a rank owns and needs;
* :mod:`~propagators.torch.module` -- :class:`LayerParallel` (the ``nn.Module``), :class:`ODENet`;
* :mod:`~propagators.torch.data_parallel` -- :func:`allreduce_gradients` over data ranks.
"""
from .adjoint import AdjointPropagator, parameter_vjp
from .coarsening import FeatureMapTransfer, SpatialCoarsening, galerkin_weight, rediscretized_weight
from .data_parallel import allreduce_gradients
from .gru import ParallelGRU
from .kernel import DenseRHS, KernelPass, LayerError, LayerKernel, layer_signature
from .module import LayerDict, LayerParallel, ODENet, serial_forward
from .multistage import MultiStage, Stage, load_digits_images, residual_cnn
from .plan import DistributionPlan
from .propagator import LayerStack, ODEPropagator
from .schemes import dt_aware, forward_euler, heun, inject_layer, rk4

__all__ = [
    "forward_euler", "heun", "rk4", "dt_aware", "inject_layer",
    "LayerKernel", "KernelPass", "LayerError", "DenseRHS", "layer_signature",
    "ODEPropagator", "LayerStack", "AdjointPropagator", "parameter_vjp",
    "DistributionPlan", "LayerParallel", "LayerDict", "ODENet", "serial_forward",
    "allreduce_gradients",
    "ParallelGRU",
    "SpatialCoarsening", "FeatureMapTransfer", "galerkin_weight", "rediscretized_weight",
    "MultiStage", "Stage", "residual_cnn", "load_digits_images",
]
