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
* :mod:`~propagators.torch.data_parallel` -- :func:`allreduce_gradients` over data ranks;
* :mod:`~propagators.torch.grad_norm` -- :func:`grad_norm`, :func:`clip_grad_norm_`: the serial network's
  gradient norm when blocks split their layers over ranks;
* :mod:`~propagators.torch.coarsening` -- :class:`SpatialCoarsening`: coarse levels on coarser feature maps;
* :mod:`~propagators.torch.multistage` -- :class:`MultiStage`: stages separated by shape-changing layers;
* :mod:`~propagators.torch.transformer` -- transformer blocks as ODE steps, :func:`make_vit`;
* :mod:`~propagators.torch.switch` -- :class:`SerialSwitch` (its rule: :class:`SwitchRule`): gradient error
  against minibatch noise, switching to serial or adapting the cycles;
* :mod:`~propagators.torch.gru` -- :class:`ParallelGRU`: a GRU parallel over the sequence.
* :mod:`~propagators.torch.lstm` -- :class:`ParallelLSTM`: an LSTM parallel over the sequence (both on the
  machinery of :mod:`~propagators.torch.rnn`).
"""
from .adjoint import AdjointPropagator, parameter_vjp
from .coarsening import FeatureMapTransfer, SpatialCoarsening, galerkin_weight, rediscretized_weight
from .data_parallel import allreduce_gradients
from .grad_norm import clip_grad_norm_, grad_norm
from .gru import ParallelGRU
from .lstm import ParallelLSTM
from .kernel import DenseRHS, KernelPass, LayerError, LayerKernel, layer_signature
from .module import ConvergenceWarning, LayerDict, LayerParallel, ODENet, serial_forward
from .multistage import MultiStage, Stage, load_digits_images, residual_cnn
from .optim_state import gather_optimizer_state, load_optimizer_state
from .plan import DistributionPlan
from .propagator import LayerStack, ODEPropagator
from .schemes import dt_aware, forward_euler, heun, inject_layer, rk4
from .switch import SerialSwitch, Switchable, SwitchRule
from .transformer import (AttentionLayer, ClassifierHead, MLPLayer, PatchEmbedding, TransformerBlock, ViT, make_vit,
                          transformer_layers, with_key_padding, without_key_padding)

__all__ = [
    "forward_euler", "heun", "rk4", "dt_aware", "inject_layer",
    "LayerKernel", "KernelPass", "LayerError", "DenseRHS", "layer_signature",
    "ODEPropagator", "LayerStack", "AdjointPropagator", "parameter_vjp",
    "DistributionPlan", "LayerParallel", "LayerDict", "ConvergenceWarning", "ODENet", "serial_forward",
    "allreduce_gradients", "grad_norm", "clip_grad_norm_", "gather_optimizer_state", "load_optimizer_state",
    "ParallelGRU", "ParallelLSTM",
    "SpatialCoarsening", "FeatureMapTransfer", "galerkin_weight", "rediscretized_weight",
    "MultiStage", "Stage", "residual_cnn", "load_digits_images",
    "AttentionLayer", "MLPLayer", "TransformerBlock", "transformer_layers", "ViT", "make_vit",
    "ClassifierHead", "PatchEmbedding", "with_key_padding", "without_key_padding",
    "Switchable", "SerialSwitch", "SwitchRule",
]
