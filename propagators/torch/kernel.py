"""Layer kernels: how a set of intervals is stepped, chosen once per layer class.

An MGRIT sweep advances many independent intervals at once, each with its own
layer (its own parameters). How fast that is depends on the layers:

* **dense**: ``nn.Linear`` or ``nn.Sequential(nn.Linear, <element-wise activation>)``;
  all intervals of a class in one batched matrix product;
* **vmap**: any other layers that are *interchangeable*: ``torch.func.vmap``
  over their stacked parameters, with one layer as the template;
* **loop**: everything else, one call per interval (on CUDA, spread over streams).

Layers are interchangeable only when evaluating one with the parameters and
buffers of the other is the same computation: the same class, the same
non-tensor state (every attribute of every submodule: hyper-parameters,
flags, functions), the same training mode, no hooks, and the same parameter
and buffer names, shapes, dtypes, devices and ``requires_grad``.
:func:`layer_signature` computes that identity; layers whose signatures differ
are never batched together, so a batched sweep can never run one layer's code
with another's settings.

The forward steps, the adjoint's state vector-Jacobian products and the
parameter vector-Jacobian products all go through the same
:class:`LayerKernel`, so they always agree on which computation a layer is.
A :class:`KernelPass` binds the kernel to the parameter values of one forward
pass (looked up live, so replaced parameters, ``.to()`` and
``load_state_dict(assign=True)`` just work) and is kept for the backward pass.
"""
from __future__ import annotations

import contextlib
import enum
import operator
import random
import weakref
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vjp, vmap
from torch.overrides import TorchFunctionMode

from .schemes import dt_aware, forward_euler, heun, rk4

try:  # what functional_call binds with; held around a looped layer's autograd.grad (KernelPass._held)
    from torch.nn.utils.stateless import _reparametrize_module
except ImportError:  # pragma: no cover - older or newer torch: torch.utils.checkpoint in looped layers fails
    _reparametrize_module = None


@contextlib.contextmanager
def own_saved_tensors():
    """Saved-tensor hooks of the user's (``torch.autograd.graph.save_on_cpu()``, offloading) suspended
    while the block runs: the solves' own autograd calls consume what they save at once, and
    ``torch.func`` transforms refuse such hooks (a vmapped class would fall back to the loop for good)."""
    A = torch._C._autograd
    top, pop, push = (getattr(A, f"_{n}_saved_tensors_default_hooks", None) for n in ("top", "pop", "push"))
    held = []
    if None not in (top, pop, push):
        while top(False) is not None:
            held.append(top(False))
            pop()
    try:
        yield
    finally:
        for pack, unpack in reversed(held):
            push(pack, unpack)


@contextlib.contextmanager
def uncached_parametrizations():
    """``torch.nn.utils.parametrize.cached()`` suspended while the block runs: the block evaluates
    every layer many times, with its own (stacked, vmapped) parameter values, which a cached weight
    would ignore, and its values must not enter the cache of the surrounding code."""
    from torch.nn.utils import parametrize

    held = getattr(parametrize, "_cache_enabled", 0)
    if not held:
        yield
        return
    parametrize._cache_enabled = 0
    try:
        yield
    finally:
        parametrize._cache_enabled = held


def _no_recompute():
    """A layer whose dropout LayerParallel fixes must not be re-run by autograd: the re-run would
    draw new masks (a non-reentrant ``torch.utils.checkpoint`` is refused through its saved-tensor hooks).
    Under saved-tensor hooks of the user's that were not suspended (:func:`own_saved_tensors`) nothing is
    refused: refusing would fail them too."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None or top(False) is not None:
        return contextlib.nullcontext()
    return torch.autograd.graph.disable_saved_tensors_hooks(
        "the layer re-runs part of itself in the backward pass (torch.utils.checkpoint) and uses dropout: "
        "the re-run would draw new dropout masks, not the ones LayerParallel fixed for the pass, and give "
        "wrong gradients. Remove the checkpoint from the layer (LayerParallel keeps only the states; "
        "checkpointing is not needed), or put the layer in eval mode")


# attributes of nn.Module that are registries, not configuration
_REGISTRIES = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training",
               "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
               "_backward_pre_hooks", "_is_full_backward_hook", "_state_dict_hooks",
               "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"}
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")

_ELEMENTWISE = (nn.Tanh, nn.ReLU, nn.Sigmoid, nn.SiLU, nn.GELU, nn.ELU, nn.LeakyReLU, nn.Softplus,
                nn.Identity, nn.Mish, nn.Hardtanh, nn.ReLU6, nn.Hardswish, nn.Hardsigmoid, nn.SELU, nn.CELU,
                nn.Softsign, nn.LogSigmoid, nn.Tanhshrink)


class LayerError(RuntimeError):
    """A layer cannot be used as it is; the message names the layer and what to do."""


def _value_key(v):
    """A hashable description of a plain attribute; objects it cannot describe by value
    (functions, tensors, arbitrary objects) are described by identity."""
    if v is None or isinstance(v, (bool, int, str, bytes, enum.Enum)):
        return (type(v).__name__, v)
    if isinstance(v, (float, complex)):
        return (type(v).__name__, repr(v))  # nan == nan here
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_value_key(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple(sorted((repr(k), _value_key(x)) for k, x in v.items())))
    if isinstance(v, (set, frozenset)):
        return ("set", tuple(sorted(repr(_value_key(x)) for x in v)))
    if isinstance(v, (torch.dtype, torch.device, torch.Size)):
        return (type(v).__name__, str(v))
    if isinstance(v, np.ndarray):
        return ("ndarray", v.dtype.str, v.shape, v.tobytes())
    return ("id", id(v))


_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks", "_global_forward_hooks_always_called")


def global_hooks() -> int:
    """Number of hooks registered for every module (``nn.modules.module.register_module_forward_hook``
    and its siblings)."""
    return sum(len(getattr(nn.modules.module, h, None) or ()) for h in _GLOBAL_HOOKS)


def has_hooks(module: nn.Module) -> bool:
    """True when ``module`` or a submodule has forward / backward hooks, or hooks for every module
    are registered (then the layers must be called, not stepped from their traced linear map)."""
    return global_hooks() > 0 or any(getattr(m, h, None) for m in module.modules() for h in _HOOKS)


def layer_signature(module: nn.Module) -> tuple:
    """The identity of a layer's computation, parameters aside.

    Two layers with equal signatures compute the same function of (state,
    parameters, buffers); they may be evaluated batched with one as template.
    Modules with hooks get a unique signature (never batched).
    """
    if has_hooks(module):
        return ("hooks", id(module))
    subs = []
    for name, m in module.named_modules():
        attrs = tuple(sorted((k, _value_key(v)) for k, v in vars(m).items() if k not in _REGISTRIES))
        subs.append((name, _class_of(m), m.training, attrs))
    params = tuple((n, tuple(p.shape), p.dtype, str(p.device), p.requires_grad)
                   for n, p in module.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype, str(b.device)) for n, b in module.named_buffers())
    return (tuple(subs), params, buffers)


def _class_of(m: nn.Module):
    """``type(m)``; for a module under ``torch.nn.utils.parametrize`` (weight_norm, orthogonal), which makes
    a class of its own for every instance, the class it was made from and the names of its parametrized
    tensors: two such classes compute alike (their parametrizations are submodules, compared as any)."""
    cls = type(m)
    if getattr(cls, "__module__", None) == "torch.nn.utils.parametrize" and "parametrizations" in m._modules \
            and len(cls.__bases__) == 1:
        return ("parametrized", cls.__bases__[0], tuple(m._modules["parametrizations"].keys()))
    return cls


_ACTIVATION_FUNCTIONS = {torch.tanh, torch.relu, torch.sigmoid, torch.sin, torch.cos, torch.exp,
                         F.relu, F.gelu, F.silu, F.elu, F.leaky_relu, F.softplus, F.sigmoid, F.tanh,
                         F.mish, F.hardtanh, F.relu6, F.hardswish, F.hardsigmoid, F.selu, F.celu, F.softsign,
                         F.logsigmoid, F.tanhshrink}
_ACTIVATION_METHODS = {"tanh", "relu", "sigmoid", "sin", "cos", "exp"}
_SCALAR_OPS = {operator.mul, operator.add, operator.sub, operator.truediv, torch.mul, torch.add}
#: entries a kernel's pattern caches hold before they start afresh (sweeps repeat a few dozen patterns)
_CACHE_LIMIT = 4096


class DenseRHS:
    """Batched right-hand side of dense layers ``act(W u + b)`` without vmap.

    Recognises (:meth:`of`; None otherwise) layers whose ``forward`` is one
    linear map followed by element-wise operations: ``nn.Linear``,
    ``nn.Sequential(nn.Linear, nn.Tanh())``, and custom modules such as
    ``torch.tanh(self.lin(u))`` or ``F.relu(F.linear(u, self.W, self.b)) * 0.5``
    (found by tracing ``forward`` with ``torch.fx``). Given the parameters of
    ``n`` layers stacked along axis 0 it evaluates all ``n`` layers on their
    own states with one batched matrix product, so a whole sweep (and, through
    autograd on that one graph, its vector-Jacobian products) costs a few
    kernel launches.
    """

    def __init__(self, weight: str, bias: str | None, activation=None, derivative=None, shift=None,
                 transposed: bool = False):
        self.weight, self.bias, self.activation = weight, bias, activation
        #: ``(buffer name, +1 or -1)`` of a buffer the layer adds to (subtracts from) its linear map before
        #: the element-wise operations (``torch.tanh(self.lin(u) + self.t)``): the steps are those of a layer
        #: whose bias is ``bias ± buffer`` (:meth:`fold`), the bias's gradient is unchanged; None: no such buffer
        self.shift = shift
        #: the weight parameter holds ``W^T`` (``u @ self.W + self.b``): :meth:`fold` gives the methods here a
        #: transposed view of it, and :meth:`unfold` transposes its gradient back
        self.transposed = transposed
        #: whether :meth:`fold` changes anything
        self.folds = shift is not None or transposed
        #: ``act'(z)`` for activations whose derivative is known in closed form (tanh, ReLU, sigmoid,
        #: none); None: the vector-Jacobian products go through autograd
        self.derivative = derivative if activation is not None else _ones_like

    @classmethod
    def of(cls, module: nn.Module):
        if any("forward" in vars(m) for m in module.modules()):
            return None  # a forward replaced on an instance (a wrapper, accelerate's hooks): call it
        if type(module) is nn.Linear:
            if module.in_features != module.out_features:
                return None  # an output that broadcasts against the state (Linear(w, 1)): not a dense step
            dense = cls("weight", "bias" if module.bias is not None else None)
        else:
            dense = _trace_dense(module)
        return dense if dense is not None and _agrees(dense, module) else None

    def fold(self, params: dict, buffers: dict) -> dict:
        """``params`` with the bias replaced by ``bias ± buffer`` (:attr:`shift`; ``params`` itself when the
        layer adds no buffer): what every method here takes, for one layer or ``n`` stacked along axis 0
        (a buffer of one entry or of the bias's length; stacked, ``(n,)`` or ``(n, out)``)."""
        if not self.folds:
            return params
        out = dict(params)
        if self.transposed:
            out[self.weight] = params[self.weight].transpose(-1, -2)
        if self.shift is not None:
            name, sign = self.shift
            b = params[self.bias]
            s = buffers[name].reshape(tuple(b.shape[:-1]) + (-1,))
            out[self.bias] = b + s if sign > 0 else b - s
        return out

    def unfold(self, grads: dict) -> dict:
        """Gradients by the parameters :meth:`fold` gave (``grads``, stacked or not) as gradients by the
        layer's own parameters: the weight's transposed back where the layer stores ``W^T``."""
        g = grads.get(self.weight)
        if not self.transposed or g is None:
            return grads
        return {**grads, self.weight: g.transpose(-1, -2)}

    def _z_single(self, params, u):
        """``W x + b`` of one layer (unstacked ``params``) on one state."""
        return F.linear(u, params[self.weight], params.get(self.bias) if self.bias is not None else None)

    def _z(self, params, U):
        """``W_k x + b_k`` of every interval ``k``, shape ``(n, rows, out)`` (rows: all but the last axis)."""
        W = params[self.weight]  # (n, out, in)
        n = U.shape[0]
        X = U.reshape(n, -1, U.shape[-1])
        if self.bias is None:
            return torch.bmm(X, W.transpose(1, 2))
        return torch.baddbmm(params[self.bias].unsqueeze(1), X, W.transpose(1, 2))

    def linearize(self, params, U):
        """``act'(W_k x + b_k)`` of every interval, shape ``(n, rows, out)``: what the adjoint of a
        forward Euler step needs of the forward state ``U[k]`` (its linearization)."""
        Z = self._z(params, U)
        return self.derivative(Z).expand(Z.shape)  # (a linear layer's derivative is a scalar one; Z overwritten)

    def _behind(self, params, U, V, D=None):
        """``act'(z) * V`` per interval, shape ``(n, rows, out)``: the adjoint behind the activation
        (``D``: the derivatives :meth:`linearize` gave for ``U``, else computed here)."""
        if D is None:
            D = self.linearize(params, U)
        return V.reshape(V.shape[0], -1, V.shape[-1]) * D

    @staticmethod
    def scale_weights(rows: int, W) -> bool:
        """Whether ``dt`` scales the weights ``W`` (``(..., out, in)``) rather than the
        ``(rows, out)`` factor ``act'(z) * v`` of a step's VJPs: whichever is smaller (more batch
        rows than inputs: the weights). Decided from the shapes alone, so that every path of the
        same layer and state (:meth:`euler_vjp`, :meth:`euler_vjp_single`, a pass's bound
        steppers, :meth:`euler_param_vjp`) evaluates the same formula on every rank."""
        return rows > W.shape[-1]

    def euler_vjp(self, params, U, V, dt, D=None):
        """``V + dt W^T (act'(z) * V)`` for every interval: the state VJP of a forward Euler step
        ``u + dt act(W u + b)``, in closed form (no autograd graph). ``dt`` has shape ``(n,)``;
        with the derivatives ``D`` of :meth:`linearize`, ``U`` is not read (may be None).
        ``dt`` multiplies the smaller factor (:meth:`scale_weights`)."""
        V3, W = V.reshape(V.shape[0], -1, V.shape[-1]), params[self.weight]
        G, dt3 = self._behind(params, U, V, D), dt.reshape(-1, 1, 1)
        if self.scale_weights(V3.shape[1], W):
            return torch.baddbmm(V3, G, W * dt3).reshape(V.shape)
        return torch.baddbmm(V3, G.mul_(dt3), W).reshape(V.shape)

    def euler_param_vjp(self, params, U, W, dt, D=None, overwrite: bool = False) -> dict:
        """Weight and bias gradients of a forward Euler step for every interval, in closed form:
        ``dt (act'(z) * w) x^T`` and ``dt sum(act'(z) * w)`` over the batch rows (``dt`` multiplies
        the batch-sized factor or the per-layer sums, as :meth:`scale_weights` decides).
        ``overwrite``: ``D`` is not read again, its memory may hold ``act'(z) * w`` (same bits)."""
        n = U.shape[0]
        dt3 = dt.reshape(-1, 1, 1)
        W3 = W.reshape(W.shape[0], -1, W.shape[-1])
        if overwrite and D is not None and D.is_contiguous() and D.shape == W3.shape and D.dtype == W3.dtype:
            G = D.mul_(W3)
        else:
            G = self._behind(params, U, W, D)
        late = self.scale_weights(G.shape[1], params[self.weight])
        if not late:
            G.mul_(dt3)
        gw = torch.bmm(G.transpose(1, 2), U.reshape(n, -1, U.shape[-1]))
        out = {self.weight: gw.mul_(dt3) if late else gw}
        if self.bias is not None:
            out[self.bias] = G.sum(1).mul_(dt3[:, 0]) if late else G.sum(1)
        return out

    def euler_vjp_single(self, params, u, v, dt, d=None):
        """:meth:`euler_vjp` for one layer (unstacked ``params``) and one state (``d``: its
        derivatives from :meth:`linearize`, shape ``(rows, out)``)."""
        if d is None:
            d = self.derivative(self._z_single(params, u))
        elif d.shape != v.shape:
            d = d.reshape(v.shape)
        v2, W = v.reshape(-1, v.shape[-1]), params[self.weight]
        g = (v * d).reshape(v2.shape)
        if self.scale_weights(v2.shape[0], W):
            return torch.addmm(v2, g, W * dt).reshape(v.shape)
        return torch.addmm(v2, g.mul_(dt), W).reshape(v.shape)

    def single(self, params, u, *extra):
        """One layer (unstacked ``params``) on one state: ``act(u W^T + b)``."""
        if extra:
            raise TypeError("a dense layer takes the state only")
        z = self._z_single(params, u)
        return z if self.activation is None else self.activation(z)

    def __call__(self, params, U, *extra):
        if extra:
            raise TypeError("a dense layer takes the state only")
        Z = self._z(params, U).reshape(tuple(U.shape[:-1]) + (params[self.weight].shape[1],))
        return Z if self.activation is None else self.activation(Z)

    def bound(self, params):
        """:meth:`__call__` with the stacked ``params`` bound once: the same operations on the same
        operands (so the same bits), without looking the parameters up again on every call."""
        W = params[self.weight]
        Wt, out, act = W.transpose(1, 2), W.shape[1], self.activation
        b3 = params[self.bias].unsqueeze(1) if self.bias is not None else None

        def f(U):
            if U.dim() == 3:  # (intervals, rows, features) already: the reshapes would be views of it
                Z = torch.bmm(U, Wt) if b3 is None else torch.baddbmm(b3, U, Wt)
            else:
                X = U.reshape(U.shape[0], -1, U.shape[-1])
                Z = torch.bmm(X, Wt) if b3 is None else torch.baddbmm(b3, X, Wt)
                Z = Z.reshape(tuple(U.shape[:-1]) + (out,))
            return Z if act is None else act(Z)

        return f


def _ones_like(z):
    return torch.ones((), dtype=z.dtype, device=z.device)


# the derivatives below overwrite ``z`` (their callers pass pre-activations they do not read again),
# so that the backward pass's linearization holds one array of its layers, not three; the same bits as
# ``1 - tanh(z)**2``, ``s * (1 - s)`` and ``(z > 0)`` in z's dtype
def _tanh_derivative(z):
    a = z.tanh_()
    return a.mul_(a).neg_().add_(1.0)


def _sigmoid_derivative(z):
    s = z.sigmoid_()
    return s.mul_(1.0 - s)


def _relu_derivative(z):
    return z.gt_(0)


#: closed-form derivatives of the single activations that are recognised (module types, functions,
#: method names)
_DERIVATIVES = {nn.Tanh: _tanh_derivative, torch.tanh: _tanh_derivative, F.tanh: _tanh_derivative,
                "tanh": _tanh_derivative, nn.Sigmoid: _sigmoid_derivative, torch.sigmoid: _sigmoid_derivative,
                F.sigmoid: _sigmoid_derivative, "sigmoid": _sigmoid_derivative, nn.ReLU: _relu_derivative,
                torch.relu: _relu_derivative, F.relu: _relu_derivative, "relu": _relu_derivative}


#: activation modules without settings, and the functions they call
_PLAIN = {nn.Tanh: torch.tanh, nn.Sigmoid: torch.sigmoid, nn.ReLU: torch.relu}


class _Call:
    """An element-wise call ``f(z, *consts, **kw)`` (function or method name) found in a traced graph."""

    def __init__(self, target, consts=(), kw=None, method=False):
        self.target, self.consts, self.kw, self.method = target, tuple(consts), dict(kw or {}), method

    def __call__(self, z):
        if self.method:
            return getattr(z, self.target)(*self.consts, **self.kw)
        return self.target(z, *self.consts, **self.kw)


def _derivative(ops):
    """The closed-form derivative of a single plain activation, else None."""
    if len(ops) != 1:
        return None
    op = ops[0]
    if isinstance(op, nn.Module):
        if type(op) is nn.ReLU and op.inplace:
            return None
        return _DERIVATIVES.get(type(op))
    if isinstance(op, _Call) and not op.consts and not op.kw:
        try:
            return _DERIVATIVES.get(op.target)
        except TypeError:  # unhashable target
            return None
    return None


@contextlib.contextmanager
def _functions_called():
    """A list that collects the ``torch.autograd.Function`` classes applied inside the block."""
    Function = torch.autograd.Function
    original, called = Function.__dict__["apply"], []

    def apply(cls, *args, **kwargs):
        called.append(cls)
        return original.__func__(cls, *args, **kwargs)

    Function.apply = classmethod(apply)
    try:
        yield called
    finally:
        Function.apply = original


def _trace_dense(module: nn.Module):
    """A :class:`DenseRHS` for a module whose traced graph is linear -> element-wise ops, or None. The global
    random states are kept (a forward that draws in Python draws while it is traced)."""
    with _random_states_kept(torch.device("cpu")):
        return _traced_dense(module)


def _traced_dense(module: nn.Module):
    before = _random_states()
    attrs = [(m, dict(vars(m))) for m in module.modules()]
    contents = [(v, list(v)) if isinstance(v, list) else (v, dict(v)) for _, d in attrs for k, v in d.items()
                if type(v) in (list, dict) and k not in _REGISTRIES]
    contents += [(m._buffers, dict(m._buffers)) for m in module.modules()]  # (self.calls += 1 stores a proxy)
    tracer = fx.Tracer()
    # buffers read as graph nodes, not as their current values: a value read in Python (float(self.t),
    # self.t.item(), if self.t > 0) would be frozen into the map of every layer of the class
    tracer.proxy_buffer_attributes = True
    try:
        with _functions_called() as functions:
            graph = tracer.trace(module)  # (the graph only: no GraphModule, whose generated source
            #                               torch keeps for the whole process, for every trace)
        if functions:  # a custom autograd.Function: the trace inlines its forward and loses its backward
            return None
    except Exception:  # noqa: BLE001 - anything fx cannot trace is simply not dense
        return None
    finally:  # a forward that stores what it computed (self.last = out, self.hist.append(out)) must not
        for m, d in attrs:  # keep the trace's proxies
            vars(m).clear()
            vars(m).update(d)
        for v, was in contents:
            if isinstance(v, list):
                v[:] = was
            else:
                v.clear()
                v.update(was)
    if _random_moved(before):
        return None  # forward draws random numbers in Python: a trace would freeze one draw
    nodes = list(graph.nodes)
    if len(nodes) < 3 or nodes[0].op != "placeholder" or nodes[-1].op != "output":
        return None
    if any(n.op == "placeholder" for n in nodes[1:]):
        return None  # more than one input (e.g. dt-aware layers)
    subs = dict(module.named_modules())
    params = dict(module.named_parameters())
    x, ops, k = nodes[0], [], 1
    attrs = {}
    while nodes[k].op == "get_attr":  # parameters read directly (F.linear(u, self.W, self.b))
        attrs[nodes[k]] = nodes[k].target
        k += 1
    lin, transposed = nodes[k], False
    if lin.op == "call_module" and type(subs.get(lin.target)) is nn.Linear and lin.args == (x,) and not lin.kwargs:
        weight, W, b = f"{lin.target}.weight", subs[lin.target].weight, subs[lin.target].bias
        bias = f"{lin.target}.bias" if b is not None else None
    else:
        if lin.op == "call_function" and lin.target is F.linear and lin.args and lin.args[0] is x:
            args = list(lin.args[1:]) + [lin.kwargs.get(a) for a in ("weight", "bias") if a in lin.kwargs]
            if not args or args[0] not in attrs or (len(args) > 1 and args[1] is not None and args[1] not in attrs):
                return None
            weight = attrs[args[0]]
            bias = attrs[args[1]] if len(args) > 1 and args[1] is not None else None
        else:  # u @ self.W.T (+ self.b), torch.matmul(u, self.W.t()) (+ ...), torch.addmm(self.b, u, self.W.T)
            found = _matmul_linear(nodes, k, x, attrs)
            if found is None:
                return None
            weight, bias, lin, transposed = found
            k = nodes.index(lin)
        if weight not in params or (bias is not None and bias not in params) or params[weight].dim() != 2:
            return None
        W, b = params[weight], None if bias is None else params[bias]
        if transposed:
            W = W.T
    if W.shape[0] != W.shape[1]:
        return None  # an output that broadcasts against the state (Linear(w, 1)): not a dense step
    if b is not None and tuple(b.shape) != (W.shape[0],):
        return None  # a bias that broadcasts (a 0-d or (1,) parameter): the stacked kernels add one per row
    prev, rest, shift = lin, nodes[k + 1: -1], None
    found = _buffer_shift(rest, lin, attrs, dict(module.named_buffers()), W) if b is not None else None
    if found is not None:  # the element-wise operations start after the addition of the buffer
        shift, prev = found
        rest = rest[rest.index(prev) + 1:]
    for node in rest:
        op = _elementwise(node, prev, subs)
        if op is None:
            return None
        ops.append(op)
        prev = node
    if nodes[-1].args[0] is not prev:
        return None
    if not ops or (len(ops) == 1 and isinstance(ops[0], nn.Module) and type(ops[0]) is nn.Identity):
        return DenseRHS(weight, bias, shift=shift, transposed=transposed)

    def activation(z):
        for op in ops:
            z = op(z)
        return z

    return DenseRHS(weight, bias, activation, _derivative(ops), shift=shift, transposed=transposed)


def _buffer_shift(rest: list, lin, attrs: dict, buffers: dict, W):
    """``((buffer name, +1 or -1), node)`` when the first nodes of ``rest`` (those after the linear map
    ``lin``) read a buffer of the layer and add it to, or subtract it from, ``lin``'s output, and nothing
    else reads it (``self.lin(u) + self.t``, ``self.t + self.lin(u)``, ``self.lin(u) - self.t``); else None.
    The buffer must broadcast as a bias does: a floating tensor of the weight's dtype with one entry or
    one per output."""
    reads = dict(attrs)  # (read before the linear map: self.t + self.lin(u))
    for i, node in enumerate(rest):
        if node.op != "get_attr":
            break
        reads[node] = node.target
    else:
        return None
    op = rest[i]
    if op.kwargs or len(op.args) != 2:
        return None
    a, c = op.args
    adds = (op.op == "call_function" and op.target in _ADD) or (op.op == "call_method" and op.target == "add")
    subs = (op.op == "call_function" and op.target in _SUB) or (op.op == "call_method" and op.target == "sub")
    if a is lin and c in reads and (adds or subs):
        name, sign = reads[c], (1.0 if adds else -1.0)
    elif c is lin and a in reads and adds:
        name, sign = reads[a], 1.0
    else:
        return None
    t = buffers.get(name)
    if (t is None or not t.is_floating_point() or t.dtype != W.dtype or t.dim() > 1
            or t.numel() not in (1, W.shape[0])):
        return None
    if len((c if c in reads else a).users) != 1:
        return None  # the buffer's value is used again later
    return (name, sign), op


_TRANSPOSE = {("call_function", getattr, "T"), ("call_method", "t", None)}
_MATMUL = (operator.matmul, torch.matmul)
_ADD = (operator.add, torch.add)
_SUB = (operator.sub, torch.sub)


def _matmul_linear(nodes: list, k: int, x, attrs: dict):
    """``(weight, bias or None, node, transposed)`` when the nodes from ``k`` on compute ``x W^T (+ b)`` of
    parameters read directly: ``x @ self.W.T``, ``torch.matmul(x, self.W.t())``, either plus ``self.b``, or
    ``torch.addmm(self.b, x, self.W.T)``; or, ``transposed``, the same with the weight stored as ``W^T``
    (``x @ self.W + self.b``, ``torch.addmm(self.b, x, self.W)``); ``node`` is the one holding the result
    (attributes read on the way are added to ``attrs``); else None."""
    t = nodes[k]
    key = (t.op, t.target, t.args[1] if t.op == "call_function" and len(t.args) == 2 else None)
    if t.op == "call_function" and not t.kwargs and (
            (t.target in _MATMUL and len(t.args) == 2 and t.args[0] is x)
            or (t.target is torch.addmm and len(t.args) == 3 and t.args[1] is x)) and t.args[-1] in attrs:
        # the weight stored transposed, read as it is: x @ self.W, torch.addmm(self.b, x, self.W)
        weight, node, transposed = attrs[t.args[-1]], t, True
        if t.target is torch.addmm:
            return (weight, attrs[t.args[0]], t, True) if t.args[0] in attrs else None
    else:
        if key not in _TRANSPOSE or not t.args or t.args[0] not in attrs or t.kwargs or k + 1 >= len(nodes):
            return None
        weight, node, transposed = attrs[t.args[0]], nodes[k + 1], False
        if node.op != "call_function" or node.kwargs:
            return None
        if node.target is torch.addmm and len(node.args) == 3 and node.args[1] is x and node.args[2] is t \
                and node.args[0] in attrs:
            return weight, attrs[node.args[0]], node, False
        if node.target not in _MATMUL or node.args != (x, t):
            return None
    j = nodes.index(node) + 1
    while nodes[j].op == "get_attr":  # (fx reads an attribute where it is first used: the bias after the product)
        attrs[nodes[j]] = nodes[j].target
        j += 1
    add = nodes[j]
    if add.op == "call_function" and add.target in _ADD and not add.kwargs and len(add.args) == 2 \
            and node in add.args:
        other = add.args[1] if add.args[0] is node else add.args[0]
        if other in attrs:
            return weight, attrs[other], add, transposed
    return (weight, None, node, transposed) if j == nodes.index(node) + 1 else None


def _random_states() -> tuple:
    """Torch's (CPU), numpy's and Python's global random states."""
    return torch.random.get_rng_state(), np.random.get_state(), random.getstate()


def _random_moved(before: tuple) -> bool:
    """Whether a global random state moved since :func:`_random_states` gave ``before``."""
    state = np.random.get_state()
    return (not torch.equal(before[0], torch.random.get_rng_state()) or state[2] != before[1][2]
            or not np.array_equal(state[1], before[1][1]) or random.getstate() != before[2])


@contextlib.contextmanager
def _random_states_kept(device):
    """Torch's (CPU and ``device``'s), numpy's and Python's global random states restored on exit."""
    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


def rounding_tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance for two evaluations of one layer that should agree up to the order of their
    floating-point operations: 1e3 units of ``dtype``'s precision, at most 1e-2 (float16 and bfloat16, where
    1e3 eps is 1 and 7.8: no check at all). Integer outputs must agree exactly."""
    if not (dtype.is_floating_point or dtype.is_complex):
        return 0.0
    real = dtype.to_real() if dtype.is_complex else dtype
    return min(1e3 * torch.finfo(real).eps, 1e-2)


def _agrees(dense: DenseRHS, module: nn.Module) -> bool:
    """Whether the traced map gives the module's own output and vector-Jacobian products (by the state and
    every parameter) on a random state: what a trace cannot see (``torch.no_grad()`` or ``detach`` through a
    context inside ``forward``, a Python-level change of a submodule's behaviour) sends the layer to the
    paths that call its ``forward``. Once per layer class; the random numbers come from a generator of
    their own (the global ones are not touched)."""
    params = dict(module.named_parameters())
    W = params.get(dense.weight)
    if W is None:
        return False
    if W.device.type == "meta":
        return True  # no values to compare (a model built on the meta device): the trace alone decides
    gen = torch.Generator().manual_seed(0x5EED)  # (on the CPU: any device's tensors come from there)
    dtype = W.dtype if W.is_floating_point() or W.is_complex() else torch.get_default_dtype()
    x = torch.randn((3, W.shape[1]), generator=gen, dtype=dtype).to(W.device)
    v = torch.randn((3, W.shape[0]), generator=gen, dtype=dtype).to(W.device)
    names = list(params)
    results = []
    try:
        with _random_states_kept(W.device):
            buffers = dict(module.named_buffers())
            for evaluate in (lambda p, u: functional_call(module, p, (u,)),
                             lambda p, u: dense.single(dense.fold(p, buffers), u)):
                leaves = {n: params[n].detach().requires_grad_(True) for n in names}
                u = x.clone().requires_grad_(True)
                with torch.enable_grad():
                    out = evaluate(leaves, u)
                    inputs = [u] + [leaves[n] for n in names]
                    grads = torch.autograd.grad(out, inputs, v, allow_unused=True) if out.requires_grad else \
                        [None] * len(inputs)
                results.append([out.detach()] + [torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs)])
    except Exception:  # noqa: BLE001 - a layer that cannot run on a plain (rows, features) state: call it
        return False
    # the same operations on both sides give the same bits; the tolerance allows for a module that orders
    # them otherwise, far below what a lost or changed term makes of a gradient
    tol = rounding_tolerance(dtype)
    for a, b in zip(*results):
        if a.shape != b.shape or not torch.allclose(a, b, rtol=tol, atol=tol * (1.0 + float(a.abs().max()))):
            return False
    return True


def _elementwise(node, prev, subs):
    """``z -> op(z)`` when ``node`` applies an element-wise operation to ``prev`` only (else None)."""
    if node.op == "call_module":
        m = subs.get(node.target)
        if type(m) in _ELEMENTWISE and node.args == (prev,) and not node.kwargs:
            plain = _PLAIN.get(type(m))
            if plain is not None and not getattr(m, "inplace", False):
                return _Call(plain)  # the function itself: no module call per evaluation
            return m
        return None
    consts = [a for a in node.args if a is not prev]
    if sum(a is prev for a in node.args) != 1 or node.args[0] is not prev and node.target not in _SCALAR_OPS:
        return None
    if any(isinstance(a, fx.Node) for a in consts) or any(isinstance(v, fx.Node) for v in node.kwargs.values()):
        return None
    kw = dict(node.kwargs)
    if node.op == "call_function" and node.target in _ACTIVATION_FUNCTIONS:
        return _Call(node.target, consts, kw)
    if node.op == "call_method" and node.target in _ACTIVATION_METHODS:
        return _Call(node.target, consts, kw, method=True)
    if node.op == "call_function" and node.target in _SCALAR_OPS and len(consts) == 1 \
            and isinstance(consts[0], (int, float)) and not kw:
        c = consts[0]
        if node.args[0] is prev:
            return lambda z, f=node.target: f(z, c)
        return lambda z, f=node.target: f(c, z)
    return None


# -- dropout: masks drawn once per pass ------------------------------------------------
#: the dropout functions whose mask is multiplicative (``out = input * mask``), by name
_DROPOUTS = {"dropout": F.dropout, "dropout1d": F.dropout1d, "dropout2d": F.dropout2d,
             "dropout3d": F.dropout3d}
_DROPOUT_NAMES = {f: n for n, f in _DROPOUTS.items()}
_ALPHA = (F.alpha_dropout, F.feature_alpha_dropout)
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
#: key under which a layer's masks travel with its buffers through vmap
MASKS = "\0masks"


def _dropout_call(func, args, kwargs):
    """``(input, p, training)`` of a call of a dropout function (positional or keyword)."""
    names = ("input", "p", "training", "inplace")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound["input"], float(bound.get("p", 0.5)), bool(bound.get("training", True))


def _alpha_error() -> LayerError:
    return LayerError("alpha dropout (nn.AlphaDropout, nn.FeatureAlphaDropout) in training mode is not supported "
                      "by LayerParallel: its mask is not a plain multiplication. Use nn.Dropout, or put the "
                      "layer in eval mode")


class _DropoutMode(TorchFunctionMode):
    """Intercepts the active dropout calls (training, ``p > 0``) of the code it is entered around and
    hands them to :meth:`dropout`; alpha dropout is an error, everything else runs unchanged."""

    def dropout(self, name: str, u, p: float):
        raise NotImplementedError

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DROPOUT_NAMES:
            u, p, training = _dropout_call(func, args, kwargs)
            if training and p > 0:
                return self.dropout(_DROPOUT_NAMES[func], u, p)
        elif func in _ALPHA and _dropout_call(func, args, kwargs)[2]:
            raise _alpha_error()
        return func(*args, **kwargs)


class DropoutRecorder(_DropoutMode):
    """Records the active dropout calls of one step (name, input shape, p, input strides) and returns
    the input unchanged: the structure from which a pass draws its masks."""

    def __init__(self):
        super().__init__()
        self.calls: list = []

    def dropout(self, name, u, p):
        self.calls.append((name, tuple(u.shape), p, _fill_strides(u)))
        return u


class DropoutMasks(_DropoutMode):
    """Applies the masks drawn for one layer, in call order: ``dropout(u) = u * mask``.

    The masks are what the dropout function itself returns for an input of
    ones (drawn once per forward pass, in serial layer order), so a layer
    evaluated any number of times sees the same mask, and the pass equals the
    serial network evaluated from the same random state.
    """

    def __init__(self, masks):
        super().__init__()
        self.masks = masks
        self.k = 0

    def dropout(self, name, u, p):
        if self.k >= len(self.masks):
            raise LayerError(
                f"the layer calls dropout more often ({self.k + 1}+) than when its masks were drawn "
                f"({len(self.masks)}): LayerParallel needs the dropout calls of a layer to be the same "
                "for every input (no data-dependent dropout)")
        m = self.masks[self.k]
        self.k += 1
        if m.shape != u.shape:
            raise LayerError(f"dropout input of shape {tuple(u.shape)} but its mask was drawn for shape "
                             f"{tuple(m.shape)}: the layer's dropout calls depend on its input")
        return u * m


def _fill_strides(t: torch.Tensor) -> tuple:
    """The strides of the tensor dropout fills its noise into for an input ``t`` (``torch.empty_like``: ``t``'s
    own when it is dense, such as a channels-last or a transposed one; else contiguous or channels-last, for a
    slice with gaps or an expanded tensor)."""
    if t.is_contiguous():
        return tuple(t.stride())
    return tuple(torch.empty_like(t, device="meta").stride())


def memory_layout(t: torch.Tensor) -> tuple:
    """The order in which dropout fills its noise for an input ``t`` (:func:`_fill_strides`), with the strides
    of axes of size 1 (which do not order anything) left out: what its masks follow."""
    return tuple(s if n > 1 else 0 for n, s in zip(t.shape, _fill_strides(t)))


def draw_masks(calls, dtype, device) -> list:
    """Draw the masks of one layer: each dropout function applied to ones of the recorded shape and
    strides (consumes the random generator exactly as the serial layer does: dropout fills its noise in
    its input's memory order, so a channels-last or transposed input gets other masks than a contiguous
    one of the same shape)."""
    return [_DROPOUTS[name](torch.empty_strided(shape, stride, dtype=dtype, device=device).fill_(1), p, True)
            for name, shape, p, stride in calls]


@dataclass(eq=False)
class LayerClass:
    """Interchangeable layers (equal :func:`layer_signature`) and how they are stepped."""

    members: np.ndarray  # global layer indices, ascending
    template: nn.Module
    param_names: tuple
    buffer_names: tuple
    mode: str  # "dense", "vmap" or "loop"
    dense: DenseRHS | None = None
    #: {(state shape, dtype, parameters that require grad): names of the parameters the layers'
    #: output does not depend on through autograd} (found by the first vmapped parameter gradient
    #: for such states): they get no gradient (None), as in serial autograd
    unused: dict = field(default_factory=dict)


def _slots(module: nn.Module):
    """(owner submodule, attribute) of every parameter and buffer, in named order."""
    owners = dict(module.named_modules())

    def split(name):
        path, _, attr = name.rpartition(".")
        return owners[path], attr

    return ([(n,) + split(n) for n, _ in module.named_parameters()],
            [(n,) + split(n) for n, _ in module.named_buffers()])


class LayerKernel:
    """Steps, state VJPs and parameter VJPs of any set of layers.

    Parameters
    ----------
    modules : mapping of int to nn.Module
        The layers this process holds, by global layer index.
    scheme : callable
        ``scheme(f, u, dt)``.
    batched : bool
        Batch interchangeable layers (dense or vmap); False loops over every layer.
    streams : int
        On CUDA, run looped layers concurrently on this many streams.
    """

    def __init__(self, modules: Mapping[int, nn.Module], scheme, batched: bool = True, streams: int = 0):
        self.modules = dict(modules)
        self.scheme = scheme
        self.n_streams = int(streams)
        self._streams = None
        self._group_cache: dict = {}  # (dtype, bytes) of a layer-index array -> its groups (_groups)
        self._plan_caches: dict = {}  # see plan_cache
        n = max(self.modules, default=-1) + 1
        self.class_of = np.full(n, -1, dtype=np.int64)
        self.position = np.full(n, -1, dtype=np.int64)
        self.slots = {j: _slots(m) for j, m in self.modules.items()}
        # flat (registry dict, key) of every parameter / buffer, so that a pass captures the
        # current tensors of all layers with one list comprehension
        self._pflat, self._bflat, self._span, self._flat_index = [], [], {}, {}
        self.p_start = np.full(n, -1, dtype=np.int64)  # flat position of each layer's first parameter
        for j in sorted(self.modules):
            ps, bs = self.slots[j]
            self._span[j] = (len(self._pflat), tuple(n for n, _, _ in ps), len(self._bflat),
                             tuple(n for n, _, _ in bs))
            self.p_start[j] = len(self._pflat)
            self._pflat += [(owner._parameters, a) for _, owner, a in ps]
            self._bflat += [(owner._buffers, a) for _, owner, a in bs]
        groups: dict = {}
        for j in sorted(self.modules):
            key = layer_signature(self.modules[j]) if batched else ("loop", j)
            groups.setdefault(key, []).append(j)
        self.classes = []
        for members in groups.values():
            tpl = self.modules[members[0]]
            pn = tuple(s[0] for s in self.slots[members[0]][0])
            bn = tuple(s[0] for s in self.slots[members[0]][1])
            if not batched or has_hooks(tpl):
                mode, dense = "loop", None
            else:
                dense = DenseRHS.of(tpl) if len(bn) < 2 else None
                if bn and (dense is None or dense.shift is None or bn != (dense.shift[0],)):
                    # buffers other than one added to the linear map: the paths that call forward (a buffer
                    # the trace does not read may still be changed by code a global switches on)
                    dense = None
                mode = "dense" if dense is not None else "vmap"
            cid = len(self.classes)
            self.classes.append(LayerClass(np.array(members), tpl, pn, bn, mode, dense))
            self.class_of[members] = cid
            self.position[members] = np.arange(len(members))

    def plan_cache(self, key) -> dict:
        """A dict that lives as long as this kernel, for propagators to keep what they derive from
        time points (layer indices, step tensors) across passes; ``key`` names its owner."""
        cache = self._plan_caches.get(key)
        if cache is None or len(cache) > _CACHE_LIMIT:
            cache = self._plan_caches[key] = {}
        return cache

    def bind(self, one_pass: bool = False) -> "KernelPass":
        """Bind to the current parameter values (with ``one_pass``: one forward pass and its backward,
        during which no parameter may get new data)."""
        return KernelPass(self, one_pass)

    def describe(self) -> list:
        """One line per layer class: members, mode, template type (for diagnostics)."""
        out = []
        for c in self.classes:
            js = c.members
            span = f"{js[0]}" if len(js) == 1 else f"{len(js)} layers from {js[0]} to {js[-1]}"
            out.append(f"{type(c.template).__name__}: {span}, {c.mode}")
        return out


_PROGRESSIONS: dict = {}  # what _progression found, by the positions' bytes (a pass asks for the same few)
_PROGRESSION_BYTES = [0]  # the keys' bytes held: the cache is emptied beyond _PROGRESSION_LIMIT
_PROGRESSION_LIMIT = 1 << 24


def _progression(pos: np.ndarray):
    """``(first, step)`` when ``pos`` is an arithmetic progression (one entry: step 1), else None."""
    key = (pos.dtype.char, pos.tobytes())
    hit = _PROGRESSIONS.get(key, False)
    if hit is not False:
        return hit
    n = len(pos)
    step = int(pos[1] - pos[0]) if n > 1 else 1
    found = (int(pos[0]), step) if n and step != 0 and (n < 3 or (np.diff(pos) == step).all()) else None
    if len(_PROGRESSIONS) >= _CACHE_LIMIT or _PROGRESSION_BYTES[0] + len(key[1]) > _PROGRESSION_LIMIT:
        _PROGRESSIONS.clear()
        _PROGRESSION_BYTES[0] = 0
    _PROGRESSIONS[key] = found
    _PROGRESSION_BYTES[0] += len(key[1])
    return found


def take_rows(pos: np.ndarray, device):
    """``X -> X[pos]`` along the first dimension: a view (no copy) when ``pos`` is an increasing
    arithmetic progression, as a sweep's layers are on a uniform grid (a residue class, the layers
    a coarse level injects), else ``index_select``."""
    prog = _progression(pos)
    if prog is not None and prog[1] > 0:
        (a, step), n = prog, len(pos)
        return lambda X: X[a: a + (n - 1) * step + 1: step]
    pos = torch.as_tensor(pos, device=device)
    return lambda X: X.index_select(0, pos)


def _new_data_error(j: int) -> LayerError:
    return LayerError(
        f"a parameter of layer {j} got new data during this pass (p.data = ..., .to() or .double(), in a "
        "layer's forward or between the forward pass and its backward): the backward pass would mix the "
        "old and the new values. Layers must not change their parameters in forward; change parameters "
        "after loss.backward() (as optimizer.step() does), or run the forward pass again")


class KernelPass:
    """A :class:`LayerKernel` bound to the parameter values of one forward pass.

    Every operation takes global layer indices ``idx`` (one per interval), the
    stacked states ``U`` of shape ``(n, *state)`` and the steps ``dt`` (shape
    ``(n,)``), groups the intervals by layer class and runs each group with its
    class's mode.
    """

    def __init__(self, kernel: LayerKernel, one_pass: bool = False):
        self.k = kernel
        #: the parameter and buffer tensors of every layer at bind time (flat, layer by layer)
        self.params = [d[a] for d, a in kernel._pflat]
        self.buffers = [d[a] for d, a in kernel._bflat]
        self._values: dict = {}
        self._vmap_widens: dict = {}  # (class, state dtype) -> the layer's own call keeps the dtype (autocast)
        self._detached_values: dict = {}
        #: bound for one forward pass and its backward (LayerParallel): parameters whose data is replaced
        #: in between raise (an ODEPropagator's kernel follows such changes instead)
        self.one_pass = one_pass
        #: where the parameters' data lay at bind time (a pass of LayerParallel: checked by its backward pass)
        try:
            self._param_data = list(map(torch.Tensor.data_ptr, self.params)) if one_pass else None
        except TypeError:  # a parameter set to None since the layers were inspected: inspect them again
            raise KeyError("a parameter was set to None") from None
        self._one_values: dict = {}  # layer -> (its _detached parameters, its bound step on a batch of one)
        self._folded: dict = {}  # layer -> (its _detached parameters, those its dense map takes: _dense_values)
        self._dt_one: dict = {}  # (dt, dtype, device, dims) -> dt as a tensor for a batch of one
        self._req = None
        self._stacked: dict = {}
        self._gathered: dict = {}
        #: id of every stacked or gathered buffer copy -> (class id, buffer name, version when made): a layer
        #: that changes its buffers in a batched call changes these copies, not its own buffers
        self._copies: dict = {}
        self._steppers: dict = {}  # owner -> {pattern: step function} (see steppers)
        #: dropout masks of this pass by layer (a list per layer, in call order); None: no dropout
        self.masks: dict | None = None

    def record_dropout(self, j: int, u, dt) -> tuple:
        """``(calls, out_layout)``: the active dropout calls ``(name, input shape, p, input strides)`` of one step
        of layer ``j`` at ``u``, and the memory layout of the state it returns (:func:`memory_layout`)."""
        p, b = self._detached(j)
        with torch.no_grad(), self._named(j), DropoutRecorder() as rec:
            out = self._single(self.k.modules[j], p, b, u, dt)
        return rec.calls, memory_layout(out) if isinstance(out, torch.Tensor) else None

    def _masked(self, j: int, buffers: dict) -> dict:
        if self.masks is None or j not in self.masks:
            return buffers
        return {**buffers, MASKS: tuple(self.masks[j])}

    def value(self, j: int):
        """``(params, buffers)`` of layer ``j`` as dicts by name (the tensors at bind time)."""
        hit = self._values.get(j)
        if hit is None:
            p0, pn, b0, bn = self.k._span[j]
            hit = self._values[j] = (dict(zip(pn, self.params[p0: p0 + len(pn)])),
                                     dict(zip(bn, self.buffers[b0: b0 + len(bn)])))
        return hit

    # -- parameters ----------------------------------------------------------
    def flat_params(self, layers) -> list:
        """The parameter tensors of the given layers, in order, each once (shared ones too)."""
        key = tuple(layers)
        idx = self.k._flat_index.get(key)
        if idx is None:
            idx = self.k._flat_index[key] = [self.k._span[j][0] + q for j in key
                                             for q in range(len(self.k._span[j][1]))]
        P = self.params
        return list({id(P[i]): P[i] for i in idx}.values())

    def _detached(self, j):
        p, b = self.value(j)
        hit = self._detached_values.get(j)
        # kept per layer while every parameter still has the same data (``p.data = ...`` or a module's
        # ``.to()`` / ``.double()`` give it new data: detach again, or, in a pass of LayerParallel, raise)
        if hit is None or any(d.data_ptr() != v.data_ptr() or d.dtype != v.dtype
                              for d, v in zip(hit[0].values(), p.values())):
            if hit is None or not self.one_pass:
                hit = self._detached_values[j] = ({n: v.detach() for n, v in p.items()}, b)
                return hit
            raise _new_data_error(j)  # (no version counter tells autograd of such a change either)
        return hit

    def check_parameter_data(self) -> None:
        """LayerError unless every parameter's data lies where it lay at bind time (a pass of LayerParallel:
        ``p.data = ...`` or ``.to()`` between its forward and backward passes; the batched sweeps read
        copies stacked in the forward pass and would not see it)."""
        if self._param_data is not None and list(map(torch.Tensor.data_ptr, self.params)) != self._param_data:
            k = next(i for i, (p, d) in enumerate(zip(self.params, self._param_data)) if p.data_ptr() != d)
            raise _new_data_error(next(j for j, (p0, pn, _, _) in self.k._span.items() if p0 <= k < p0 + len(pn)))

    def _dense_values(self, c: LayerClass, j):
        """Layer ``j``'s :meth:`_detached` parameters as its class's dense map takes them
        (:meth:`DenseRHS.fold`; kept with them)."""
        p, b = self._detached(j)
        if not c.dense.folds:
            return p
        hit = self._folded.get(j)
        if hit is None or hit[0] is not p:
            with torch.no_grad():
                hit = self._folded[j] = (p, c.dense.fold(p, b))
        return hit[1]

    def _bound_one(self, c: LayerClass, j, p):
        """``DenseRHS.bound`` of layer ``j``'s :meth:`_detached` parameters ``p`` as a stack of one
        layer (kept with them): the right-hand side of the batched sweeps' fused step for one state."""
        hit = self._one_values.get(j)
        if hit is None or hit[0] is not p:
            hit = self._one_values[j] = (p, c.dense.bound({n: v[None] for n, v in p.items()}))
        return hit[1]

    def _dt_of_one(self, dt: float, U, dims: int | None = None):
        """``dt`` as a tensor of ``U``'s dtype and device with ``dims`` axes of length 1 (None: as many
        as ``U`` has; 0: the 0-d step a scheme gets in :func:`serial_forward` and in the sweeps)."""
        dims = U.dim() if dims is None else dims
        key = (dt, U.dtype, U.device, dims)
        hit = self._dt_one.get(key)
        if hit is None:
            if len(self._dt_one) > 64:
                self._dt_one.clear()
            # (through float64, as the sweeps' steps are made: a step beyond the dtype's range becomes inf, which
            # the solve reports as a divergence, where torch.full raised an overflow error)
            hit = torch.as_tensor(dt, dtype=torch.float64, device=U.device).to(U.dtype).reshape((1,) * dims)
            self._dt_one[key] = hit
        return hit

    def _stack(self, cid: int, reverse: bool = False):
        """The parameters and buffers of class ``cid`` stacked in member order (``reverse``: in
        reverse order, for the adjoint's sweeps, which run down the layers: there its patterns are
        views too). Either order is stacked from the layers' own tensors where the other is not held
        (:meth:`drop_forward_stacks` flips the forward one)."""
        hit = self._stacked.get((cid, reverse))
        if hit is None:
            c = self.k.classes[cid]
            members = c.members[::-1] if reverse else c.members
            spans = [self.k._span[int(j)] for j in members]
            P, B = self.params, self.buffers
            try:
                # stacked copies, outside any graph (no per-parameter detach) and outside autocast (which
                # refuses to stack float16 tensors under bfloat16 autocast and the reverse)
                with torch.no_grad(), _no_autocast(P[0] if P else B[0] if B else None):
                    hit = ({n: torch.stack([P[sp[0] + q] for sp in spans]) for q, n in enumerate(c.param_names)},
                           {n: torch.stack([B[sp[2] + q] for sp in spans]) for q, n in enumerate(c.buffer_names)})
                    if c.mode == "dense":  # (as its map takes them: a weight stored transposed, a buffer in the bias)
                        hit = (c.dense.fold(*hit), hit[1])
                    self._note_copies(cid, hit[1])
                    if self.masks is not None and int(c.members[0]) in self.masks:
                        ms = [self.masks[int(j)] for j in members]
                        hit[1][MASKS] = tuple(torch.stack([m[q] for m in ms]) for q in range(len(ms[0])))
            except RuntimeError as exc:
                raise LayerError(
                    f"the parameters of layers {c.members.tolist()} no longer have equal shapes, dtypes "
                    f"or devices ({exc}): they changed in a way the pass did not see (a tensor written into "
                    "a module's _parameters or _buffers directly, or torch.func.functional_call with tensors "
                    "of other shapes than the layers'); call lp.refresh() after such changes"
                ) from exc
            self._stacked[cid, reverse] = hit
        return hit

    def _gather(self, cid: int, idx: np.ndarray, device):
        key = (cid, idx.tobytes())
        hit = self._gathered.get(key)
        if hit is None:
            pos = self.k.position[idx]
            prog = _progression(pos)
            if prog is not None and len(pos) > 1:
                reverse = prog[1] < 0  # (a view of the stack in the pattern's direction)
            else:  # one layer or no progression: the stack this pass holds (the reversed one only after
                reverse = (cid, False) not in self._stacked and (cid, True) in self._stacked  # drop_forward_stacks)
            p, b = self._stack(cid, reverse)
            take = take_rows(len(self.k.classes[cid].members) - 1 - pos if reverse else pos, device)
            hit = self._gathered[key] = ({n: take(v) for n, v in p.items()},
                                         {n: (tuple(take(m) for m in v) if n == MASKS else take(v))
                                          for n, v in b.items()}, reverse)
            self._note_copies(cid, hit[1])
        return hit[:2]

    def _note_copies(self, cid: int, buffers: dict) -> None:
        for n, v in buffers.items():
            if n != MASKS:
                self._copies[id(v)] = (cid, n, v._version)

    def changed_copy(self):
        """``(class id, buffer name)`` of a stacked or gathered buffer copy changed since it was made (a
        layer that updates its buffers in place in a batched call), or None."""
        for hit in (*self._stacked.values(), *self._gathered.values()):
            for n, v in hit[1].items():
                noted = self._copies.get(id(v))
                if n != MASKS and noted is not None and noted[2] != v._version:
                    return noted[:2]
        return None

    def drop_forward_stacks(self) -> None:
        """Forget the parameters stacked in layer order and what is bound to them (gathered views, the
        step functions of :meth:`steppers`): the backward pass's sweeps and parameter gradients run down
        the layers, on the reversed stacks, so that one copy of the parameters is held, not two
        (anything that asks for the forward order again stacks it again)."""
        self._steppers.clear()
        self._gathered = {k: v for k, v in self._gathered.items() if v[2]}
        for cid, rev in list(self._stacked):
            if not rev:
                if (cid, True) not in self._stacked:  # (a flip is quicker than stacking the layers again)
                    p, b = self._stacked[cid, False]
                    self._stacked[cid, True] = (
                        {n: v.flip(0) for n, v in p.items()},
                        {n: (tuple(m.flip(0) for m in v) if n == MASKS else v.flip(0)) for n, v in b.items()})
                    self._note_copies(cid, self._stacked[cid, True][1])
                del self._stacked[cid, False]

    # -- grouping --------------------------------------------------------------
    def _groups(self, idx: np.ndarray):
        """[(class id, positions in idx or None for all)] for the classes present in ``idx``
        (kept per index pattern: a sweep's pattern recurs in every cycle and pass)."""
        key = (idx.dtype.char, idx.tobytes())
        cache = self.k._group_cache
        hit = cache.get(key)
        if hit is None:
            if len(cache) > _CACHE_LIMIT:
                cache.clear()
            hit = cache[key] = self._find_groups(idx)
        return hit

    def _find_groups(self, idx: np.ndarray):
        if idx.size and (idx.min() < 0 or idx.max() >= self.k.class_of.size
                         or (self.k.class_of[idx] < 0).any()):
            missing = sorted(set(idx.tolist()) - set(self.k.modules))
            raise LayerError(f"layers {missing} are not held by this process (distribution plan bug)")
        cls = self.k.class_of[idx]
        first = cls[0] if cls.size else 0
        if (cls == first).all():
            return [(int(first), None)]
        return [(int(c), np.flatnonzero(cls == c)) for c in np.unique(cls)]

    def _run(self, idx, fn, *arrays):
        """Apply ``fn(cid, idx_part, *array_parts)`` per class and reassemble along axis 0."""
        groups = self._groups(idx)
        if len(groups) == 1:
            return fn(groups[0][0], idx, *arrays)
        out = None
        for cid, pos in groups:
            t = torch.as_tensor(pos, device=arrays[0].device)
            part = fn(cid, idx[pos], *(a.index_select(0, t) for a in arrays))
            if out is None:
                out = part.new_empty((idx.size,) + tuple(part.shape[1:]))
            out.index_copy_(0, t, part)
        return out

    # -- one layer, functionally ----------------------------------------------
    @staticmethod
    def _split_masks(buffers: dict):
        """``(buffers without the dropout masks, the masks or None)``."""
        masks = buffers.get(MASKS)
        if masks is None:
            return buffers, None
        return {n: v for n, v in buffers.items() if n != MASKS}, masks

    def _layer_values(self, j: int, params=None):
        """Layer ``j``'s parameters (the pass's, or ``params``) and buffers, with its dropout masks."""
        p, b = self._detached(j) if params is None else (params, self.value(j)[1])
        return p, self._masked(j, b)

    def _single(self, module, params, buffers, u, dt, bound=False):
        """``scheme(module, u, dt)`` with ``params`` and ``buffers`` bound for each call (``bound``: they
        are bound already, see :meth:`_held`)."""
        scheme = self.k.scheme
        buffers, masks = self._split_masks(buffers)

        def f(*args):
            out = module(*args) if bound else functional_call(module, {**params, **buffers}, args)
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"the layer returned a {type(out).__name__}; a layer must return one tensor")
            return out

        if masks is None:
            return scheme(f, u, dt)
        with DropoutMasks(masks):
            return scheme(f, u, dt)

    def _call_layer(self, j: int, u, dt, params=None, bound=False):
        p, b = self._layer_values(j, params)
        with self._named(j):
            out = self._single(self.k.modules[j], p, b, u, dt, bound)
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"the step returned a {type(out).__name__}; a layer must return one tensor")
            if out.shape != u.shape:
                raise ValueError(f"the step maps a state of shape {tuple(u.shape)} to shape {tuple(out.shape)}; "
                                 "a layer must keep the shape of the state")
            return out

    @contextlib.contextmanager
    def _held(self, j: int, params=None):
        """Layer ``j``'s module bound to the pass's parameters (or ``params``), its buffers and its dropout
        masks while the block runs, as :meth:`_call_layer` binds them for the call: an ``autograd.grad``
        inside the block that re-runs part of the layer (``torch.utils.checkpoint`` recomputes its
        segment in the backward pass, after the call has returned) sees the same layer. Yields whether
        it bound them (then call the layer with ``bound=True``: no second binding per call)."""
        if _reparametrize_module is None:
            yield False
            return
        p, b = self._layer_values(j, params)
        b, masks = self._split_masks(b)
        with _reparametrize_module(self.k.modules[j], {**p, **b}, tie_weights=True), \
                (contextlib.nullcontext() if masks is None else _no_recompute()):
            yield True

    @contextlib.contextmanager
    def _named(self, j: int):
        """Re-raise any error of layer ``j`` as a :class:`LayerError` that names the layer."""
        try:
            yield
        except LayerError:
            raise
        except Exception as exc:
            m = self.k.modules[j]
            text, hint = str(exc), ""
            if "must match the size of tensor" in text:
                hint = (" (a layer must keep the shape of the state; change shapes between layer-parallel "
                        "stages, e.g. with propagators.torch.MultiStage)")
            if "in-place" in text or "inplace" in text:
                hint = (" (a layer must not modify its input in place, e.g. with nn.ReLU(inplace=True) "
                        "as its first operation)")
            if any(t in text for t in ("must have the same dtype", "expected scalar type", "should be the same",
                                       "same dtype", "same device")):
                hint = (" (the state's device differs from the layer's parameters': move the input to the "
                        "block's device, or the block to the input's, e.g. lp.to(x.device))"
                        if "cuda" in text or "device" in text else
                        " (the state's dtype differs from the layer's parameters': convert the input to the "
                        "block's dtype, e.g. x.float(), or the block to the input's, e.g. lp.double())")
            if "doesn't require grad" in text or "does not require grad" in text:
                hint = (" (the forward solve evaluates the layers without autograd, under torch.no_grad: "
                        "guard what needs a graph, e.g. `if z.requires_grad: z.register_hook(...)`)")
            raise LayerError(f"layer {j} ({type(m).__name__}) failed: {type(exc).__name__}: {text}{hint}"
                             f"{scheme_note(self.k.scheme, call=True)}") from exc

    # -- forward steps ----------------------------------------------------------
    def step_one(self, u, j: int, dt: float):
        """``scheme(f_j, u, dt)`` for one state (the sequential coarse solves): no stacking."""
        if j >= self.k.class_of.size or self.k.class_of[j] < 0:
            self._groups(np.array([j]))  # raises the plan-bug error
        c = self.k.classes[int(self.k.class_of[j])]
        version = u._version
        scheme, out = self.k.scheme, None
        if c.mode == "dense" and scheme in _STACKABLE:
            p = self._dense_values(c, j)
            try:
                if scheme is forward_euler and isinstance(dt, float):
                    # the fused step of a batched sweep (stepper) on a batch of one: the same operations,
                    # so a layer stepped here (a coarsest chain) or in a sweep gives the same bits
                    U = u[None]
                    out = torch.addcmul(U, self._dt_of_one(dt, U), self._bound_one(c, j, p)(U))[0]
                else:
                    out = scheme(lambda v: c.dense.single(p, v), u, self._dt_of_one(dt, u, 0))
            except Exception:  # noqa: BLE001 - the looped call below names the layer
                out = None
        if out is None:  # (a scheme gets a 0-d tensor of the state's dtype, as in the sweeps and serial_forward)
            out = self._call_layer(j, u, self._dt_of_one(dt, u, 0) if isinstance(dt, float) else dt)
        if u._version != version:
            raise _inplace_error()
        return self._kept_dtype(out, u, j)

    def _kept_dtype(self, out, u, j: int):
        """``out``, a step of layer ``j`` from ``u``, when it has ``u``'s dtype: a layer whose step promotes the
        state (parameters in float64 for a float32 state, a complex weight for a real state, an upcast in its
        code; a ``dt_aware`` step that is one autocast operation narrows it) is a :class:`LayerError`. The
        serial network would go on in the other dtype from that layer on; the solves keep the input's."""
        if out.dtype == u.dtype:
            return out
        m = self.k.modules[j]
        theirs = str(out.dtype).replace("torch.", "")
        # (complex layers converted to a real dtype would lose their imaginary parts: not offered)
        convert_layers = "" if out.is_complex() and not u.is_complex() else \
            ", or convert the layers to the input's (lp.to(x.dtype))"
        raise LayerError(
            f"layer {j} ({type(m).__name__}) maps a {str(u.dtype).replace('torch.', '')} state to {theirs} (its "
            f"parameters or its code compute in {theirs}): the serial network would go on in {theirs} from this "
            "layer on, while LayerParallel keeps the input's dtype. Give the block an input of the layers' "
            f"dtype (x.to(torch.{theirs})){convert_layers}{scheme_note(self.k.scheme)}")

    def vjp_state_one(self, u, v, j: int, dt: float, d=None):
        """``J^T v`` for one step of layer ``j`` at state ``u`` (the sequential coarse adjoint solves);
        ``d``: the layer's derivatives at ``u`` from :meth:`linearize` (then ``u`` is not read)."""
        if j >= self.k.class_of.size or self.k.class_of[j] < 0:
            self._groups(np.array([j]))  # raises the plan-bug error
        c = self.k.classes[int(self.k.class_of[j])]
        if c.mode == "dense":
            p = self._dense_values(c, j)
            if self._closed_form(c, v):
                return c.dense.euler_vjp_single(p, u, v, dt, d)
            if self.k.scheme in _STACKABLE:
                try:
                    with torch.enable_grad():
                        ua = u.detach().requires_grad_(True)
                        out = self.k.scheme(lambda z: c.dense.single(p, z), ua, self._dt_of_one(dt, u, 0))
                        return torch.autograd.grad(out, ua, v)[0]
                except Exception:  # noqa: BLE001 - the general path below names the layer
                    pass
        return self.vjp_state(u[None], v[None], np.array([j]), self._dt_of_one(dt, u, 1))[0]

    def step(self, U, idx: np.ndarray, dt):
        """``scheme(f_idx[k], U[k], dt[k])`` for every ``k`` (no autograd graph)."""
        version = U._version
        out = self._run(np.asarray(idx), self._step_checked, U, dt)
        if U._version != version:
            raise _inplace_error()
        return out

    def steppers(self, owner) -> dict:
        """A dict that lives as long as this pass, for a propagator (``owner``: its plan cache) to keep
        the step function of each pattern of time points (:meth:`stepper`)."""
        d = self._steppers.get(id(owner))
        if d is None or d[0] is not owner:
            d = self._steppers[id(owner)] = (owner, {})
        return d[1]

    def drop_steppers(self) -> None:
        """Forget the step functions kept for this pass (:meth:`steppers`; made again on demand): frees
        what they bound (the adjoint's gathered derivatives) once the solves that used them are over."""
        self._steppers.clear()

    def _sole_class(self, idx: np.ndarray):
        """The class id of the intervals ``idx`` when they all belong to one class, else None."""
        groups = self._groups(idx)
        return groups[0][0] if len(groups) == 1 else None

    def stepper(self, idx: np.ndarray, dt):
        """``U -> step(U, idx, dt)`` for one pattern of intervals, made once per pass.

        For a sweep of dense forward-Euler layers of one class it is the fused batched step
        with the gathered parameters bound (:meth:`DenseRHS.bound`): the operations of
        :meth:`step`, without the grouping, gathering and dispatch on every call. Anything
        else (and any error, so that :meth:`step` can fall back and name the layer) goes
        through :meth:`step`.
        """
        idx = np.asarray(idx)
        this = weakref.ref(self)  # (the step functions live in this pass's dict: no cycle through it)

        def general(U):
            return this().step(U, idx, dt)

        cid = self._sole_class(idx)
        if cid is None or self.k.classes[cid].mode != "dense" or self.k.scheme is not forward_euler:
            return general
        c = self.k.classes[cid]
        f, shape = c.dense.bound(self._gather(cid, idx, dt.device)[0]), {}

        def fused(U):
            dtb = shape.get(U.dim())
            if dtb is None:
                dtb = shape[U.dim()] = dt.reshape((-1,) + (1,) * (U.dim() - 1))
            try:
                out = torch.addcmul(U, dtb, f(U))
            except Exception:  # noqa: BLE001 - the general path falls back or names the layer
                return general(U)
            return out if out.dtype == U.dtype else general(U)  # (which names a layer that promotes)

        return fused

    def vjp_stepper(self, idx: np.ndarray, dt, D):
        """``V -> vjp_state(None, V, idx, dt, D)`` for one pattern of intervals with its derivatives
        ``D`` (from :meth:`linearize`), made once per pass: for dense forward-Euler layers of one
        class the closed-form product with the gathered weights bound (the operations of
        :meth:`DenseRHS.euler_vjp`, so the same bits)."""
        idx = np.asarray(idx)
        this = weakref.ref(self)

        def general(V):
            return this().vjp_state(None, V, idx, dt, D)

        cid = self._sole_class(idx)
        if cid is None or not self._closed_form(self.k.classes[cid], D):
            return general
        c = self.k.classes[cid]
        W, dt3 = self._gather(cid, idx, dt.device)[0][c.dense.weight], dt.reshape(-1, 1, 1)
        if c.dense.scale_weights(D.shape[1], W):  # dt on the smaller factor, as euler_vjp
            Wdt = W * dt3  # (once per pass)

            def fused(V):
                V3 = V.reshape(V.shape[0], -1, V.shape[-1])
                return torch.baddbmm(V3, V3 * D, Wdt).reshape(V.shape)
        else:
            def fused(V):
                V3 = V.reshape(V.shape[0], -1, V.shape[-1])
                return torch.baddbmm(V3, (V3 * D).mul_(dt3), W).reshape(V.shape)

        return fused

    def _step_checked(self, cid, idx, U, dt):
        out = self._step_class(cid, idx, U, dt)
        if out.dtype != U.dtype and self.k.classes[cid].mode == "vmap" and _autocast_on(U) is not None:
            # under CPU autocast, torch.func.vmap returns float32 where the layer itself returns the autocast
            # dtype (F.linear on a stacked weight): the layer's own call on one state decides
            key = (cid, U.dtype)
            if key not in self._vmap_widens:  # (once per class and pass)
                self._vmap_widens[key] = self._call_layer(int(idx[0]), U[0], dt[0]).dtype == U.dtype
            if self._vmap_widens[key]:
                return out.to(U.dtype)
        return self._kept_dtype(out, U, int(idx[0]))

    def _step_class(self, cid, idx, U, dt):
        c = self.k.classes[cid]
        if c.mode == "loop":
            return self._loop(idx, lambda k, j: self._call_layer(j, U[k], dt[k]))
        p, b = self._gather(cid, idx, U.device)
        if c.mode == "dense":
            return self._batched(cid, lambda: self.dense_step(c, p, U, dt),
                                 lambda: self._step_class(cid, idx, U, dt))
        return self._batched(cid, lambda: vmap(self._vmapped(c))(p, b, U, dt),
                             lambda: self._step_class(cid, idx, U, dt))

    def dense_step(self, c: LayerClass, params, U, dt):
        scheme = self.k.scheme
        if scheme in _STACKABLE:  # on the stack of states at once
            dtb = dt.reshape((-1,) + (1,) * (U.dim() - 1))
            if scheme is forward_euler:  # u + dt f(u) as one fused operation
                return torch.addcmul(U, dtb, c.dense(params, U))
            return scheme(lambda V: c.dense(params, V), U, dtb)
        # a user's scheme sees one state and a 0-d step, as in serial_forward (on the stack it could
        # mix the states, e.g. with u[:, :2] or k.mean(0))
        return vmap(lambda p, u, d: scheme(lambda v: c.dense.single(p, v), u, d))(params, U, dt)

    def _vmapped(self, c: LayerClass):
        def one(p, b, u, dt_):
            return self._single(c.template, p, b, u, dt_)

        return one

    def _batched(self, cid, run, fallback):
        """Run a batched evaluation; layers that cannot be batched (vmap cannot trace
        data-dependent control flow, ...) are looped from then on, which also names the
        layer in a genuine error. Random operations are an error."""
        try:
            return run()
        except Exception as exc:
            if "random" in str(exc).lower():
                raise _random_error(self.k.classes[cid]) from exc
            self.k.classes[cid].mode = "loop"
            return fallback()

    def _loop(self, idx, one):
        n = idx.size
        if n == 0:
            raise LayerError("empty sweep")  # never called with no interval
        devs = next(iter(self.value(int(idx[0]))[0].values()), None)
        on_cuda = devs is not None and devs.is_cuda
        if not (on_cuda and self.k.n_streams > 0):
            return torch.stack([one(k, int(j)) for k, j in enumerate(idx)])
        return _on_streams(self.k, lambda k: one(k, int(idx[k])), n)

    # -- adjoint: linearization ---------------------------------------------------
    def _closed_form(self, c: LayerClass, x) -> bool:
        """Dense forward-Euler layers whose activation has a closed-form derivative, on real states
        ``x`` (complex states go through autograd, which conjugates)."""
        return (c.mode == "dense" and self.k.scheme is forward_euler and c.dense.derivative is not None
                and not x.is_complex())

    def linearize(self, U, idx: np.ndarray):
        """The activation derivatives ``act'(W_j u + b_j)`` of layers ``idx[k]`` at states ``U[k]``.

        Returns a tensor of shape ``(n, rows, out)`` when every layer among ``idx`` is a dense
        forward-Euler layer with a closed-form derivative, else None. Computed once per backward
        pass, they stand in for the states in every adjoint sweep (:meth:`vjp_state` with ``D``)
        and in the parameter gradients: each step is then one product with ``W^T``.
        """
        idx = np.asarray(idx)
        if not idx.size or not all(self._closed_form(self.k.classes[cid], U) for cid, _ in self._groups(idx)):
            return None
        return self._run(idx, self._linearize_class, U)

    def _linearize_class(self, cid, idx, U):
        return self.k.classes[cid].dense.linearize(self._gather(cid, idx, U.device)[0], U)

    # -- adjoint: state VJPs -----------------------------------------------------
    def vjp_state(self, U, V, idx: np.ndarray, dt, D=None):
        """``J_k^T V[k]`` with ``J_k`` the Jacobian of step ``k`` at state ``U[k]`` (with ``D``, the
        derivatives :meth:`linearize` gave for those states and layers, ``U`` is not read)."""
        if D is not None:
            return self._run(np.asarray(idx), self._vjp_state_linearized, V, dt, D)
        return self._run(np.asarray(idx), self._vjp_state_class, U, V, dt)

    def _vjp_state_linearized(self, cid, idx, V, dt, D):
        return self.k.classes[cid].dense.euler_vjp(self._gather(cid, idx, V.device)[0], None, V, dt, D)

    def _vjp_state_class(self, cid, idx, U, V, dt):
        c = self.k.classes[cid]
        if c.mode == "loop":
            def one(k, j):
                with torch.enable_grad(), self._named(j), self._held(j) as bound:
                    u = U[k].detach().requires_grad_(True)
                    out = self._call_layer(j, u, dt[k], bound=bound)
                    g = torch.autograd.grad(out, u, V[k], allow_unused=True)[0]
                return torch.zeros_like(u) if g is None else g

            return self._loop(idx, one)
        p, b = self._gather(cid, idx, U.device)
        if self._closed_form(c, V):
            return c.dense.euler_vjp(p, U, V, dt)
        if c.mode == "dense":
            def run():
                with torch.enable_grad():
                    Ua = U.detach().requires_grad_(True)
                    return torch.autograd.grad(self.dense_step(c, p, Ua, dt), Ua, V)[0]

            return self._batched(cid, run, lambda: self._vjp_state_class(cid, idx, U, V, dt))
        single = self._vmapped(c)

        def vjp_one(p_, b_, u, v, dt_):
            _, pull = vjp(lambda x: single(p_, b_, x, dt_), u)
            return pull(v)[0]

        return self._batched(cid, lambda: vmap(vjp_one)(p, b, U, V, dt),
                             lambda: self._vjp_state_class(cid, idx, U, V, dt))

    def vjp_state_and_params(self, U, V, idx: np.ndarray, dt):
        """:meth:`vjp_state` of the steps ``k`` and, from the same vector-Jacobian product, their
        parameter VJPs ``(d step_k / d theta)^T V[k]``: ``(state VJPs, blocks)``, one block per class,
        ``(rows, cols, grads)``: the rows of ``idx`` it covers (None: all), their flat parameter
        positions ``(len(rows), parameters)`` and ``grads[q]``, the stacked gradients of parameter
        ``q`` (the parameters with a gradient only: as :meth:`vjp_params`, None left out). Only for
        vmapped classes whose layers agree on which parameters require grad; otherwise, or when vmap
        fails, None (the plain paths then run, and handle it)."""
        idx = np.asarray(idx)
        plans = []
        for cid, pos in self._groups(idx):
            c = self.k.classes[cid]
            part = idx if pos is None else idx[pos]
            nq = len(c.param_names)
            cols = self.k.p_start[part][:, None] + np.arange(nq)
            R = self.requires_grad()[cols] if nq else np.zeros((len(part), 0), dtype=bool)
            if c.mode != "vmap" or not len(part) or not (R == R[:1]).all():
                return None
            plans.append((c, cid, pos, part, cols, [n for q, n in enumerate(c.param_names) if R[0, q]]))
        out, blocks = None, []
        for c, cid, pos, part, cols, need in plans:
            if pos is None:
                Up, Vp, dtp = U, V, dt
            else:
                t = torch.as_tensor(pos, device=U.device)
                Up, Vp, dtp = U.index_select(0, t), V.index_select(0, t), dt.index_select(0, t)
            use = self._used(c, int(part[0]), Up[0], Vp[0], dtp[0], need)
            p, b = self._gather(cid, part, U.device)
            single = self._vmapped(c)

            def g(p_, b_, u, v, dt_):
                fixed = {n: x for n, x in p_.items() if n not in use}
                _, pull = vjp(lambda x, q: single({**fixed, **q}, b_, x, dt_), u, {n: p_[n] for n in use})
                return pull(v)

            try:
                gu, G = vmap(g)(p, b, Up, Vp, dtp)
            except Exception:
                return None
            G = _distinct(G)
            blocks.append((pos, cols, {q: G[n] for q, n in enumerate(c.param_names) if n in G}))
            if pos is None:
                out = gu
            else:
                if out is None:
                    out = gu.new_empty((idx.size,) + tuple(gu.shape[1:]))
                out.index_copy_(0, torch.as_tensor(pos, device=gu.device), gu)
        return out, blocks

    # -- parameter VJPs ----------------------------------------------------------
    def vjp_params(self, U, W, idx: np.ndarray, dt, D=None, overwrite: bool = False):
        """``(d step_k / d theta)^T W[k]`` for every interval ``k`` (``D``: optional derivatives
        from :meth:`linearize` for ``U`` and ``idx``; ``overwrite``: they are not read again, and
        their memory may hold products of the closed-form gradients).

        Returns ``(positions, grads)``: flat lists, ``grads[i]`` belongs to the
        parameter ``self.params[positions[i]]``; None for parameters that do not
        require grad or that the step does not use (as autograd). Several
        entries may belong to one parameter (tied parameters, repeated layers):
        the caller sums them.
        """
        idx = np.asarray(idx)
        positions: list = []
        grads: list = []
        for cid, pos in self._groups(idx):
            part = idx if pos is None else idx[pos]
            if pos is None:
                Up, Wp, dtp, Dp = U, W, dt, D
            else:
                t = torch.as_tensor(pos, device=U.device)
                Up, Wp, dtp = U.index_select(0, t), W.index_select(0, t), dt.index_select(0, t)
                Dp = None if D is None else D.index_select(0, t)
            ps, gs = self._vjp_params_class(cid, part, Up, Wp, dtp, Dp, overwrite)
            positions += ps
            grads += gs
        return positions, grads

    def requires_grad(self) -> np.ndarray:
        """``requires_grad`` of every parameter of the pass (flat, as ``self.params``)."""
        if self._req is None:
            self._req = np.fromiter(map(_REQUIRES_GRAD, self.params), dtype=bool, count=len(self.params))
        return self._req

    def _vjp_params_class(self, cid, idx, U, W, dt, D=None, overwrite=False):
        c = self.k.classes[cid]
        nq = len(c.param_names)
        cols = self.k.p_start[idx][:, None] + np.arange(nq)  # flat positions, (intervals, parameters)
        R = self.requires_grad()[cols] if nq else np.zeros((len(idx), 0), dtype=bool)
        need = [n for q, n in enumerate(c.param_names) if R[0, q]] if len(idx) else []
        if c.mode == "loop" or not need or not (R == R[:1]).all():  # (frozen after construction: per layer)
            ps, gs = [], []
            for k, j in enumerate(idx.tolist()):
                one = self._vjp_params_one(j, U[k], W[k], dt[k])
                ps += cols[k].tolist()
                gs += [one[n] for n in c.param_names]
            return ps, gs
        p, b = self._gather(cid, idx, U.device)
        if self._closed_form(c, U):
            G = c.dense.unfold(c.dense.euler_param_vjp(p, U, W, dt, D, overwrite))
            G = {n: G.get(n) for n in need}
        elif c.mode == "dense":
            req = {n: v.detach().requires_grad_(n in need) for n, v in p.items()}
            with torch.enable_grad():
                out = self.dense_step(c, req, U.detach(), dt)
                # (a step that never calls its layer leaves out without a graph: no parameter gradients)
                gs = (torch.autograd.grad(out, [req[n] for n in need], W, allow_unused=True) if out.requires_grad
                      else [None] * len(need))
            G = c.dense.unfold(_distinct(dict(zip(need, gs))))
        else:
            need = self._used(c, int(idx[0]), U[0], W[0], dt[0], need)
            single = self._vmapped(c)

            def g(p_, b_, u, w, dt_):
                fixed = {n: v for n, v in p_.items() if n not in need}
                _, pull = vjp(lambda q: single({**fixed, **q}, b_, u, dt_), {n: p_[n] for n in need})
                return pull(w)[0]

            try:
                G = _distinct(vmap(g)(p, b, U, W, dt)) if need else {}
            except Exception as exc:
                if "random" in str(exc).lower():
                    raise _random_error(c) from exc
                c.mode = "loop"
                return self._vjp_params_class(cid, idx, U, W, dt)
        ps, gs = [], []
        for q, n in enumerate(c.param_names):
            if G.get(n) is None:
                continue
            ps += cols[:, q].tolist()
            gs += G[n].unbind(0)
        return ps, gs

    def _used(self, c: LayerClass, j: int, u, w, dt, need: list) -> list:
        """``need`` without the parameters whose gradient autograd leaves None for class ``c`` (its
        output does not depend on them): ``torch.func.vjp`` gives zeros there, so autograd is asked
        once, on layer ``j`` at state ``u``, per state shape, dtype and ``need``."""
        if not need:
            return []
        key = (tuple(u.shape), u.dtype, tuple(need))
        if key not in c.unused:
            if len(c.unused) >= _CACHE_LIMIT:  # (one entry per state shape: batch sizes, image sizes)
                c.unused.clear()
            one = self._vjp_params_one(j, u, w, dt)
            c.unused[key] = frozenset(n for n in need if one[n] is None)
        return [n for n in need if n not in c.unused[key]]

    def _vjp_params_one(self, j, u, w, dt) -> dict:
        p, _ = self.value(j)
        need = [n for n, v in p.items() if v.requires_grad]
        grads = dict.fromkeys(p)
        if not need:
            return grads
        with torch.enable_grad(), self._named(j):
            req = {n: (v.detach().requires_grad_(True) if n in need else v.detach()) for n, v in p.items()}
            x = u.detach()
            if _backward_hooked(self.k.modules[j]):  # a full backward hook gets the input's gradient, as in serial
                x.requires_grad_(True)
            with self._held(j, req) as bound:
                out = self._call_layer(j, x, dt, params=req, bound=bound)
                if not out.requires_grad:
                    return grads
                gs = torch.autograd.grad(out, [req[n] for n in need], w, allow_unused=True)
        grads.update(zip(need, _distinct(dict(zip(need, gs))).values()))
        return grads


#: built-in schemes that are elementwise in the state, the layer's value and the step: a stack of states
#: (with a step per row) is stepped as each state alone would be
_STACKABLE = (forward_euler, heun, rk4)


def own_scheme(scheme) -> bool:
    """Whether ``scheme`` is the user's own (code that runs in every step besides the layers'), not one of
    the library's."""
    return scheme not in _STACKABLE and scheme is not dt_aware


def scheme_note(scheme, call: bool = False, grad: bool = False) -> str:
    """What an error about a layer's step adds when the step is not the layer's alone: the user's own scheme
    runs around it (``grad``: the error is about a tensor that requires grad), and ``dt_aware`` calls
    ``layer(u, dt)`` (said for a failing ``call`` only)."""
    if scheme is dt_aware:
        return (" (the scheme dt_aware calls layer(u, dt): the layer's forward must take the state and the step "
                "and return the next state)") if call else ""
    if not own_scheme(scheme):
        return ""
    name = getattr(scheme, "__name__", type(scheme).__name__)
    return (f" (the step is your scheme {name}(f, u, dt) around the layer: the cause may be in the scheme's code"
            + ("; a tensor the scheme reads must not require grad: a learnable step size belongs in the layers "
               "as an nn.Parameter)" if grad else ")"))


def _distinct(grads: dict) -> dict:
    """``grads`` (name -> tensor or None) with every tensor that shares its memory with an earlier one
    (autograd may hand two parameters the very same gradient, e.g. ``u + p + q``) replaced by a copy:
    parameters must never share a ``.grad``, or accumulating or clipping one changes the other."""
    seen = set()
    out = {}
    for n, g in grads.items():
        if g is not None and g.numel():
            key = (g.untyped_storage().data_ptr(), g.storage_offset())
            if key in seen:
                g = g.clone()
            else:
                seen.add(key)
        out[n] = g
    return out


def _autocast_on(like):
    """torch.autocast's dtype on the device of ``like`` when it is enabled there, else None."""
    dev = like.device.type
    if dev not in ("cpu", "cuda") or not torch.is_autocast_enabled(dev):
        return None
    return torch.get_autocast_dtype(dev)


def _no_autocast(like):
    """``torch.autocast`` switched off on the device of ``like`` (a pass's own arithmetic keeps its dtypes)."""
    dev = like.device.type if isinstance(like, torch.Tensor) else "cpu"
    return torch.autocast(dev, enabled=False) if dev in ("cpu", "cuda") else contextlib.nullcontext()


def _backward_hooked(module: nn.Module) -> bool:
    """``module`` or a submodule has backward hooks, or backward hooks for every module are registered."""
    return bool(nn.modules.module._global_backward_hooks) or any(
        m._backward_hooks or m._backward_pre_hooks for m in module.modules())


def _inplace_error() -> LayerError:
    return LayerError(
        "a layer modified its input state in place (for example nn.ReLU(inplace=True) as its first "
        "operation); MGRIT keeps every state it passes to a layer, so layers must not change their input")


def _random_error(c: LayerClass) -> LayerError:
    return LayerError(
        f"layer {int(c.members[0])} ({type(c.template).__name__}) draws random numbers other than through "
        "dropout (torch.nn.functional.dropout / dropout1d-3d, which LayerParallel supports: their masks are "
        "drawn once per pass). MGRIT evaluates every layer many times per pass, and each call would draw "
        "again; draw such noise outside the layers, or put the layer in eval mode"
    )


def _on_streams(kernel: LayerKernel, one, n: int):
    """Run ``one(k)`` for ``k < n`` round-robin on CUDA streams, then join."""
    if kernel._streams is None:
        kernel._streams = [torch.cuda.Stream() for _ in range(kernel.n_streams)]
    cur = torch.cuda.current_stream()
    outs = [None] * n
    for s in kernel._streams:
        s.wait_stream(cur)
    for k in range(n):
        s = kernel._streams[k % len(kernel._streams)]
        with torch.cuda.stream(s):
            outs[k] = one(k)
    for s in kernel._streams:
        cur.wait_stream(s)
    for o in outs:
        o.record_stream(cur)
    return torch.stack(outs)
