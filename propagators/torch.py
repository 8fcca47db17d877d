"""Torch-backed propagators and layer-parallel training.

A residual network ``u_{i+1} = u_i + h f(u_i; theta_i)`` is forward Euler on an
ODE, and its layers are time steps (REFERENCE.md section 4). This module
provides

* :class:`ODEPropagator` -- steps a state through a stack of layer modules
  (``scheme(f, u, dt)``, forward Euler by default). Coarse levels step
  ``m h`` with the parameters of the layer at the coarse point (parameter
  injection; pluggable through ``layer_index``). When all layers share one
  architecture, a batched step runs all intervals of a sweep as one
  ``torch.func.vmap`` over stacked parameters; otherwise intervals are looped,
  concurrently on CUDA streams when the state lives on a GPU.
* :class:`AdjointPropagator` -- the adjoint in reverse layer-time, one
  vector-Jacobian product per step at the stored forward state.
* :class:`LayerParallel` -- an ``nn.Module`` whose forward pass is an MGRIT
  solve over layers and whose backward pass is an MGRIT solve of the adjoint;
  ``loss.backward()`` fills ``.grad`` of the layer parameters each rank owns.
"""
from __future__ import annotations

import math
import weakref
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, vjp, vmap

import mgrit
from mgrit.comm import MPIComm, SerialComm, as_communicator
from mgrit.hierarchy import build_hierarchy
from mgrit.solver import _level_ranges, fine_ranges

# --------------------------------------------------------------------------
# time-stepping schemes: scheme(f, u, dt) -> next state; f(*args) is the layer


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
    """Default coarse parameters: the layer at the start of the interval."""
    return i0


# --------------------------------------------------------------------------


class LayerStack:
    """A snapshot of the parameters (and buffers) of ``N`` layers.

    When every layer has the same type and parameter names / shapes
    (``uniform``), the tensors are also stacked along a new leading axis so
    that a batched step can gather the parameters of many layers at once.
    Stacked tensors are detached copies; single steps call the live modules.

    Parameters
    ----------
    layers : nn.ModuleList
    uniform : bool, optional
        Whether the layers share one architecture (computed when omitted).
    flat : (list, list), optional
        ``(list(layers.parameters()), list(layers.buffers()))`` if already known.
    """

    def __init__(self, layers: nn.ModuleList, uniform: bool | None = None, flat=None):
        self.layers = layers
        self.template = layers[0]
        self.param_names = [n for n, _ in layers[0].named_parameters()]
        self.buffer_names = [n for n, _ in layers[0].named_buffers()]
        self.uniform = is_uniform(layers) if uniform is None else uniform
        self.stacked = None
        self._gathered: dict = {}
        if self.uniform:
            k, kb = len(self.param_names), len(self.buffer_names)
            params, buffers = flat if flat is not None else (list(layers.parameters()), list(layers.buffers()))
            flat_p = [p.detach() for p in params]
            self.stacked = {n: torch.stack(flat_p[q::k]) for q, n in enumerate(self.param_names)}
            if kb:
                flat_b = buffers
                self.stacked.update({n: torch.stack(flat_b[q::kb]) for q, n in enumerate(self.buffer_names)})

    def one(self, k: int):
        """Parameters and buffers of layer ``k`` as ``(params, buffers)`` dicts."""
        m = self.layers[k]
        return ({n: p.detach() for n, p in m.named_parameters()}, dict(m.named_buffers()))

    def gather(self, idx: np.ndarray, device):
        """Stacked ``(params, buffers)`` of the layers ``idx`` (uniform stacks only).

        Cached per index pattern: a sweep of a level uses the same layers in
        every cycle of the forward and the adjoint solve.
        """
        key = (np.asarray(idx).tobytes(), str(device))
        hit = self._gathered.get(key)
        if hit is None:
            it = torch.as_tensor(idx, device=device)
            hit = self._gathered[key] = (
                {n: self.stacked[n].index_select(0, it) for n in self.param_names},
                {n: self.stacked[n].index_select(0, it) for n in self.buffer_names})
        return hit

    def module_of(self, k: int) -> nn.Module:
        return self.layers[k]


def is_uniform(layers) -> bool:
    """True when all layers have the same structure (``repr``: types and hyper-parameters)
    and the same parameter / buffer names, shapes and dtypes."""
    def sig(m):
        return (type(m), repr(m), [(n, p.shape, p.dtype) for n, p in m.named_parameters()],
                [(n, b.shape) for n, b in m.named_buffers()])

    ref = sig(layers[0])
    return all(sig(m) == ref for m in layers)


_ELEMENTWISE = (nn.Tanh, nn.ReLU, nn.Sigmoid, nn.SiLU, nn.GELU, nn.ELU, nn.LeakyReLU, nn.Softplus,
                nn.Identity)


class DenseRHS:
    """Batched right-hand side of dense layers ``act(W u + b)`` without vmap.

    Recognises ``nn.Linear`` and ``nn.Sequential(nn.Linear, activation)`` with
    a stateless element-wise activation; :meth:`of` returns None otherwise. Given
    the parameters of ``n`` layers stacked along axis 0 it evaluates all ``n``
    layers on their own states with one batched matrix product, so a whole
    relaxation sweep (and, through autograd on that one graph, its
    vector-Jacobian products) costs a few kernel launches.
    """

    def __init__(self, weight: str, bias: str | None, activation):
        self.weight, self.bias, self.activation = weight, bias, activation

    @classmethod
    def of(cls, module: nn.Module):
        if isinstance(module, nn.Linear):
            return cls("weight", "bias" if module.bias is not None else None, None)
        if (isinstance(module, nn.Sequential) and len(module) == 2 and isinstance(module[0], nn.Linear)
                and type(module[1]) in _ELEMENTWISE):
            return cls("0.weight", "0.bias" if module[0].bias is not None else None, module[1])
        return None

    def __call__(self, params, U):
        W = params[self.weight]  # (n, out, in)
        n = U.shape[0]
        X = U.reshape(n, -1, U.shape[-1])
        if self.bias is None:
            Z = torch.bmm(X, W.transpose(1, 2))
        else:
            Z = torch.baddbmm(params[self.bias].unsqueeze(1), X, W.transpose(1, 2))
        Z = Z.reshape(tuple(U.shape[:-1]) + (W.shape[1],))
        return Z if self.activation is None else self.activation(Z)


class ODEPropagator(mgrit.Propagator):
    """Steps a state through a stack of layers: ``u_{i+1} = scheme(f_i, u_i, dt)``.

    Time points are multiples of the layer step ``h``: an interval from
    ``t0 = i0 h`` to ``t1 = i1 h`` uses ``dt = (i1 - i0) h`` and the layer
    ``layer_index(i0, i1)`` (default: ``i0``, parameter injection).

    Parameters
    ----------
    stack : LayerStack
    h : float
        Layer step (final time / number of layers).
    scheme : callable
        ``scheme(f, u, dt)`` returns the next state; ``f`` calls the layer.
    layer_index : callable, optional
        ``layer_index(i0, i1)`` on integer arrays: which layer's parameters step
        from fine index ``i0`` to ``i1``.
    batched : bool
        Use one vmapped call per sweep when the layers are uniform.
    streams : int
        On CUDA, run looped intervals concurrently on this many streams (0: no streams).
    """

    def __init__(self, stack: LayerStack, h: float, scheme=forward_euler, layer_index=None,
                 batched: bool = True, streams: int = 0):
        self.stack, self.h, self.scheme = stack, float(h), scheme
        self.layer_index = layer_index or inject_layer
        self.batched = bool(batched) and stack.uniform
        self.n_streams = int(streams)
        self._streams = None
        self._vstep = vmap(self._single)
        self._dts: dict = {}
        self.dense = DenseRHS.of(stack.template) if self.batched and not stack.buffer_names else None

    # integer bookkeeping -------------------------------------------------
    def ints(self, t):
        return np.rint(np.asarray(t, dtype=np.float64) / self.h).astype(np.int64)

    def _dt(self, i0, i1, like):
        steps = np.asarray(i1 - i0)
        key = (steps.tobytes(), steps.shape, like.dtype, str(like.device))
        dt = self._dts.get(key)
        if dt is None:
            dt = self._dts[key] = torch.as_tensor(steps * self.h, dtype=like.dtype, device=like.device)
        return dt

    # the step ------------------------------------------------------------
    def _single(self, params, buffers, u, dt, module=None):
        mod = module if module is not None else self.stack.template

        def f(*args):
            return functional_call(mod, {**params, **buffers}, args)

        return self.scheme(f, u, dt)

    def step(self, u, t0, t1):
        i0, i1 = self.ints(t0), self.ints(t1)
        k = int(self.layer_index(np.atleast_1d(i0), np.atleast_1d(i1))[0])
        return self.scheme(self.stack.layers[k], u, self._dt(i0, i1, u))

    def dense_step(self, params, U, dt):
        """All intervals at once through :class:`DenseRHS` (``dt`` has shape (n,))."""
        dtb = dt.reshape((-1,) + (1,) * (U.dim() - 1))
        return self.scheme(lambda V: self.dense(params, V), U, dtb)

    def step_batch(self, U, t0, t1):
        i0, i1 = self.ints(t0), self.ints(t1)
        idx = self.layer_index(i0, i1)
        dt = self._dt(i0, i1, U)
        if self.batched:
            p, b = self.stack.gather(idx, U.device)
            if self.dense is not None:
                return self.dense_step(p, U, dt)
            return self._vstep(p, b, U, dt)
        return self._loop(U, idx, dt)

    def _loop(self, U, idx, dt):
        def one(k):
            p, b = self.stack.one(int(idx[k]))
            return self._single(p, b, U[k], dt[k], self.stack.module_of(int(idx[k])))

        if not (U.is_cuda and self.n_streams > 0):
            return torch.stack([one(k) for k in range(U.shape[0])])
        return _on_streams(self, one, U.shape[0])


def _on_streams(prop: ODEPropagator, one, n: int):
    """Run ``one(k)`` for ``k < n`` round-robin on CUDA streams, then join."""
    if prop._streams is None:
        prop._streams = [torch.cuda.Stream() for _ in range(prop.n_streams)]
    cur = torch.cuda.current_stream()
    outs = [None] * n
    for s in prop._streams:
        s.wait_stream(cur)
    for k in range(n):
        s = prop._streams[k % len(prop._streams)]
        with torch.cuda.stream(s):
            outs[k] = one(k)
    for s in prop._streams:
        cur.wait_stream(s)
    for o in outs:
        o.record_stream(cur)
    return torch.stack(outs)


class AdjointPropagator(mgrit.Propagator):
    """The adjoint of an :class:`ODEPropagator` in reverse layer-time.

    Reverse time ``tau = T - t``. A step from ``tau0`` to ``tau1`` covers the
    forward interval ``[T - tau1, T - tau0]`` (fine indices ``ia < ib``) and
    returns ``J^T v`` with ``J`` the Jacobian of that forward step at the stored
    forward state ``u_ia`` (one vector-Jacobian product).

    Parameters
    ----------
    forward : ODEPropagator
    states : callable
        ``states(ia)`` returns the stacked forward states at fine indices ``ia``.
    n_layers : int
    """

    def __init__(self, forward: ODEPropagator, states: Callable, n_layers: int):
        self.fwd, self.states, self.N = forward, states, int(n_layers)
        self._vvjp = vmap(self._vjp_single)

    def _vjp_single(self, params, buffers, u, v, dt, module=None):
        _, pull = vjp(lambda x: self.fwd._single(params, buffers, x, dt, module), u)
        return pull(v)[0]

    def _intervals(self, tau0, tau1):
        ia = self.N - self.fwd.ints(tau1)
        ib = self.N - self.fwd.ints(tau0)
        return ia, ib

    def step(self, v, tau0, tau1):
        ia, ib = self._intervals(np.atleast_1d(tau0), np.atleast_1d(tau1))
        k = int(self.fwd.layer_index(ia, ib)[0])
        dt = self.fwd._dt(ia[0], ib[0], v)
        module = self.fwd.stack.layers[k]
        _, pull = vjp(lambda x: self.fwd.scheme(module, x, dt), self.states(ia)[0])
        return pull(v)[0]

    def step_batch(self, V, tau0, tau1):
        ia, ib = self._intervals(tau0, tau1)
        idx = self.fwd.layer_index(ia, ib)
        dt = self.fwd._dt(ia, ib, V)
        Ua = self.states(ia)
        st = self.fwd.stack
        if self.fwd.batched:
            p, b = st.gather(idx, V.device)
            if self.fwd.dense is not None:
                with torch.enable_grad():
                    Ua = Ua.detach().requires_grad_(True)
                    return torch.autograd.grad(self.fwd.dense_step(p, Ua, dt), Ua, V)[0]
            return self._vvjp(p, b, Ua, V, dt)
        outs = []
        for k in range(V.shape[0]):
            p, b = st.one(int(idx[k]))
            outs.append(self._vjp_single(p, b, Ua[k], V[k], dt[k], st.module_of(int(idx[k]))))
        return torch.stack(outs)


def parameter_vjp(fwd: ODEPropagator, layers: np.ndarray, U, W):
    """``(d Phi_j / d theta_j)^T w_j`` for the fine steps of the given layers.

    ``U[k]`` is the state entering layer ``layers[k]``, ``W[k]`` the adjoint
    at the state it produces. Returns a dict of stacked gradients.
    """
    st = fwd.stack
    dt = torch.full((len(layers),), fwd.h, dtype=U.dtype, device=U.device)

    def g(params, buffers, u, w, dt_, module=None):
        _, pull = vjp(lambda p: fwd._single(p, buffers, u, dt_, module), params)
        return pull(w)[0]

    if fwd.batched:
        p, b = st.gather(layers, U.device)
        if fwd.dense is not None:
            p = {n: v.detach().requires_grad_(True) for n, v in p.items()}
            with torch.enable_grad():
                grads = torch.autograd.grad(fwd.dense_step(p, U.detach(), dt), list(p.values()), W)
            return dict(zip(p.keys(), grads))
        return vmap(g)(p, b, U, W, dt)
    outs = []
    for k, j in enumerate(layers):
        p, b = st.one(int(j))
        outs.append(g(p, b, U[k], W[k], dt[k], st.module_of(int(j))))
    return {n: torch.stack([o[n] for o in outs]) for n in st.param_names}


# --------------------------------------------------------------------------


class _LayerParallelFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lp, x, *params):
        y, saved = lp._forward_solve(x)
        ctx.lp, ctx.saved = lp, saved
        return y

    @staticmethod
    def backward(ctx, gy):
        gx, gparams = ctx.lp._adjoint_solve(ctx.saved, gy)
        return (None, gx, *gparams)


class LayerParallel(nn.Module):
    """A stack of residual layers evaluated by MGRIT, forward and backward.

    ``y = model(x)`` solves ``u_i = scheme(f_i, u_{i-1}, h)``, ``u_0 = x`` over
    the layers with MGRIT and returns ``u_N``; ``loss.backward()`` solves the
    adjoint with MGRIT in reverse layer-time and fills ``.grad`` of the layer
    parameters this rank owns (parameters of other ranks' layers keep
    ``grad = None``, so optimizers skip them).

    Parameters
    ----------
    layers : sequence of nn.Module, or callable
        The layer modules ``f_i`` (the right-hand side of the ODE, not the
        residual step), or a factory ``layers(i) -> nn.Module`` with ``n_layers``.
    n_layers : int, optional
        Needed with a factory.
    T : float
        Final time; the layer step is ``h = T / n_layers``.
    cf, max_levels, min_coarse, relax, cycle
        MGRIT settings (see :func:`mgrit.solve`); default ``relax=("F", "FCF")``:
        F-relaxation on the layers, FCF on coarse levels.
    fwd_iters, bwd_iters : int
        Cycles of the forward and the adjoint solve (defaults 2 and 1).
    fwd_tol, bwd_tol : float or None
        Absolute residual tolerances (None: run the given number of cycles).
    scheme : callable
        ``scheme(f, u, dt)``; :func:`forward_euler` (ResNet), :func:`heun`,
        :func:`rk4` or :func:`dt_aware`, or your own.
    layer_index : callable, optional
        Which layer's parameters a coarse step uses (default: injection).
    batched : bool
        Batched (vmapped) relaxation when the layers share an architecture.
    streams : int
        CUDA streams for looped (non-uniform) layers on a GPU.
    comm : mpi4py communicator, optional
        The layer communicator: distributes the layers over its ranks.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> torch.manual_seed(0) and None
    >>> lp = LayerParallel([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(16)],
    ...                    T=1.0, cf=4, max_levels=2, fwd_iters=20, fwd_tol=1e-12).double()
    >>> x = torch.randn(3, 4, dtype=torch.float64)
    >>> u = x
    >>> for f in lp.layers:
    ...     u = u + lp.h * f(u)
    >>> bool(torch.allclose(lp(x), u, atol=1e-11))
    True
    """

    def __init__(self, layers, n_layers: int | None = None, T: float = 1.0, *, cf: int = 4,
                 max_levels: int = 3, min_coarse: int = 2, relax=("F", "FCF"), cycle: str = "V",
                 fwd_iters: int = 2, bwd_iters: int = 1, fwd_tol: float | None = None,
                 bwd_tol: float | None = None, scheme=forward_euler, layer_index=None,
                 batched: bool = True, streams: int = 0, comm=None, callback=None):
        super().__init__()
        if callable(layers) and not isinstance(layers, (nn.Module, Sequence)):
            if n_layers is None:
                raise ValueError("`n_layers` is required when `layers` is a factory")
            layers = [layers(i) for i in range(n_layers)]
        layers = list(layers)
        if n_layers is not None and n_layers != len(layers):
            raise ValueError(f"`n_layers`={n_layers} but {len(layers)} layers were given")
        if len(layers) < 1:
            raise ValueError("`layers` is empty")
        self.layers = nn.ModuleList(layers)
        self.n_layers = len(layers)
        self.T = float(T)
        self.h = self.T / self.n_layers
        self.options = dict(cf=cf, max_levels=max_levels, min_coarse=min_coarse, relax=relax, cycle=cycle)
        self.fwd_iters, self.bwd_iters = int(fwd_iters), int(bwd_iters)
        self.fwd_tol, self.bwd_tol = fwd_tol, bwd_tol
        self.scheme, self.layer_index = scheme, layer_index or inject_layer
        self.batched, self.streams = batched, streams
        self.callback = callback
        self.t = np.arange(self.n_layers + 1, dtype=np.float64) * self.h
        self._uniform = is_uniform(self.layers)
        self._param_counts = [sum(1 for _ in m.parameters()) for m in self.layers]
        self._refresh_flat()
        self.hierarchy = build_hierarchy(self.t, cf, max_levels, min_coarse, relax)
        self._setup_comm(comm)
        #: mgrit.Result of the last forward and adjoint solve
        self.last_forward: mgrit.Result | None = None
        self.last_backward: mgrit.Result | None = None

    def _refresh_flat(self):
        """Cache the flat parameter / buffer lists (walking 1000s of modules is slow)."""
        self._flat = (list(self.layers.parameters()), list(self.layers.buffers()))

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self._refresh_flat()  # .to() / .double() may replace parameter tensors
        return out

    # -- distribution -------------------------------------------------------
    def _setup_comm(self, comm):
        self._comm = as_communicator(comm)
        P, r, N = self._comm.size, self._comm.rank, self.n_layers
        self._ranges = fine_ranges(N + 1, P)
        lo, hi = self._ranges[r]
        self.lo, self.hi = lo, hi
        if P == 1:
            self._adj_comm = SerialComm()
        else:
            raw = self._comm.comm
            reversed_comm = raw.Split(0, P - 1 - r)
            self._adj_comm = MPIComm(reversed_comm)
            # free it with the module, or at exit before MPI finalizes (no dangling communicator)
            weakref.finalize(self, _free_comm, reversed_comm)
        # the adjoint runs on the mirrored blocks: reverse index s <-> forward N - s
        self._adj_partition = [N - self._ranges[P - 1 - q][1] for q in range(P)]
        self._adj_partition[0] = 0
        #: indices of the layers whose parameters this rank owns (layer j maps u_j -> u_{j+1})
        self.owned_layers = range(max(lo - 1, 0), max(hi, 0)) if hi >= lo else range(0)
        self._halo = self._halo_plan() if P > 1 else []

    def _layers_used(self, rank: int, fwd_ranges, adj_ranges) -> set:
        """Layers whose parameters ``rank`` needs for its forward and adjoint steps
        (``*_ranges``: the per-level blocks of the forward and the adjoint solve)."""
        P, N, used = self._comm.size, self.n_layers, set()
        for l, lv in enumerate(self.hierarchy):
            s = lv.stride
            lo, hi = fwd_ranges[l][rank]
            k = np.arange(max(lo, 1), hi + 1)
            used.update(np.asarray(self.layer_index((k - 1) * s, k * s)).tolist())
            lo, hi = adj_ranges[l][P - 1 - rank]
            k = np.arange(max(lo, 1), hi + 1)
            used.update(np.asarray(self.layer_index(N - k * s, N - (k - 1) * s)).tolist())
        return used

    def _owner_of_layer(self, j: int) -> int:
        for p, (lo, hi) in enumerate(self._ranges):
            if lo <= j + 1 <= hi:
                return p
        raise AssertionError(j)

    def _halo_plan(self):
        """Deterministic list of (owner, user, layer) for parameters that must travel."""
        P, plan = self._comm.size, []
        fwd_ranges = _level_ranges(self.hierarchy, P)
        adj_ranges = _level_ranges(self.hierarchy, P, self._adj_partition)
        for p in range(P):
            lo, hi = self._ranges[p]
            own = set(range(max(lo - 1, 0), hi)) if hi >= lo else set()
            for j in sorted(self._layers_used(p, fwd_ranges, adj_ranges) - own):
                plan.append((self._owner_of_layer(j), p, j))
        return plan

    def _exchange_halo(self):
        r = self._comm.rank
        for owner, user, j in self._halo:
            if owner == r:
                for p in self.layers[j].parameters():
                    self._comm.send(p.detach(), user, 900)
        for owner, user, j in self._halo:
            if user == r:
                with torch.no_grad():
                    for p in self.layers[j].parameters():
                        p.copy_(self._comm.recv(p.detach(), owner, 900))

    # -- forward --------------------------------------------------------------
    def _propagator(self):
        return ODEPropagator(LayerStack(self.layers, self._uniform, self._flat), self.h, self.scheme, self.layer_index,
                             self.batched, self.streams)

    def forward(self, x):
        params = self._flat[0]
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
            return _LayerParallelFunction.apply(self, x, *params)
        return self._forward_solve(x)[0]

    def _forward_solve(self, x):
        if self._comm.size > 1:
            self._exchange_halo()
        with torch.no_grad():
            prop = self._propagator()
            res = mgrit.solve(prop, x.detach(), self.t, **self.options, tol=self.fwd_tol,
                              max_iter=self.fwd_iters, skip=False, comm=self._comm,
                              callback=self.callback, final_residual=True)
            self.last_forward = res
            U = res.u
            if self._comm.size > 1:
                U = self._with_ghost(U)
                y = self._comm.bcast(U[-1].cpu() if self.hi == self.n_layers else None,
                                     root=self._owner_of_layer(self.n_layers - 1)).to(x.device)
                self._comm.finish()  # complete this pass's sends (halo, ghost, broadcast)
            else:
                y = U[-1].clone()
        return y, (prop, U, x.shape)

    def _with_ghost(self, U):
        """Prepend the left neighbour's last state (u_{lo-1}) to this rank's states."""
        c, r, P = self._comm, self._comm.rank, self._comm.size
        if r + 1 < P and self._ranges[r + 1][0] <= self._ranges[r + 1][1]:
            c.send(U[-1], r + 1, 901)
        if self.lo > 0:
            return torch.cat([c.recv(U[-1], r - 1, 901)[None], U])
        return U

    # -- backward -------------------------------------------------------------
    def _adjoint_solve(self, saved, gy):
        prop, U, xshape = saved
        g0 = self.lo - 1 if self.lo > 0 else 0  # forward index of U[0]
        N = self.n_layers

        def states(ia):
            return U.index_select(0, torch.as_tensor(ia - g0, device=U.device))

        adj = AdjointPropagator(prop, states, N)
        with torch.no_grad():
            res = mgrit.solve(adj, gy.detach().contiguous(), self.t, **self.options, tol=self.bwd_tol,
                              max_iter=self.bwd_iters, skip=False, comm=self._adj_comm,
                              partition=self._adj_partition, initial_guess=0.0, final_residual=True)
        self.last_backward = res
        W = torch.flip(res.u, dims=[0])  # adjoints at forward points lo..hi
        layers = np.arange(max(self.lo - 1, 0), self.hi)
        grads = [None] * sum(self._param_counts)
        if len(layers):
            Win = W[1:] if self.lo == 0 else W  # w_{j+1} for j in layers
            Uin = U[: len(layers)]  # u_j
            with torch.enable_grad():
                G = parameter_vjp(prop, layers, Uin, Win)
            names = prop.stack.param_names
            offs = np.cumsum([0] + self._param_counts)
            for k, j in enumerate(layers):
                for q, n in enumerate(names):
                    grads[offs[j] + q] = G[n][k]
        if self._comm.size > 1:
            gx = self._comm.bcast(W[0].cpu() if self.lo == 0 else None, root=0).to(gy.device)
            self._comm.finish()
        else:
            gx = W[0]
        return gx.reshape(xshape), grads

    # -- diagnostics ----------------------------------------------------------
    @property
    def forward_residuals(self) -> list:
        """Residual history of the last forward solve."""
        return [] if self.last_forward is None else list(self.last_forward.residuals)

    @property
    def backward_residuals(self) -> list:
        """Residual history of the last adjoint solve."""
        return [] if self.last_backward is None else list(self.last_backward.residuals)

    @property
    def forward_residual(self) -> float | None:
        """Residual norm of the output trajectory of the last forward solve (0: exact).

        The histories above follow XBraid: entry k is measured before the
        coarse correction of cycle k, so it lags the returned solution by one
        cycle; this is the residual of what was actually returned.
        """
        return None if self.last_forward is None else self.last_forward.final_residual

    @property
    def backward_residual(self) -> float | None:
        """Residual norm of the adjoint of the last backward solve: the size of the
        gradient's error source (0 when the adjoint was solved exactly)."""
        return None if self.last_backward is None else self.last_backward.final_residual

    def serial(self, x):
        """The same network applied layer by layer with plain autograd (reference)."""
        return serial_forward(self.layers, x, self.h, self.scheme)

    def extra_repr(self) -> str:
        o = self.options
        return (f"n_layers={self.n_layers}, T={self.T}, cf={o['cf']}, max_levels={o['max_levels']}, "
                f"relax={o['relax']}, fwd_iters={self.fwd_iters}, bwd_iters={self.bwd_iters}, "
                f"ranks={self._comm.size}")


def serial_forward(layers, x, h: float, scheme=forward_euler):
    """Apply ``u <- scheme(f_i, u, h)`` for every layer in order (plain autograd)."""
    u = x
    dt = torch.as_tensor(h, dtype=x.dtype, device=x.device)
    for m in layers:
        u = scheme(m, u, dt)
    return u


class ODENet(nn.Module):
    """The serial counterpart of :class:`LayerParallel`: the same layers applied in sequence."""

    def __init__(self, layers, T: float = 1.0, scheme=forward_euler):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.h, self.scheme = float(T) / len(self.layers), scheme

    def forward(self, x):
        return serial_forward(self.layers, x, self.h, self.scheme)


def _free_comm(comm) -> None:
    from mpi4py import MPI

    if not MPI.Is_finalized():
        comm.Free()


def allreduce_gradients(module: nn.Module, data_comm) -> None:
    """Average ``.grad`` of every parameter of ``module`` over the data communicator.

    Call after ``loss.backward()`` when each data rank computed its loss on its
    own shard of the batch (equal shard sizes, mean loss). Parameters whose
    ``grad`` is None (owned by another layer rank) are skipped.
    """
    from mpi4py import MPI

    size = data_comm.Get_size()
    for p in module.parameters():
        if p.grad is None:
            continue
        buf = p.grad.detach().cpu().contiguous().numpy().copy()
        data_comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        p.grad.copy_(torch.from_numpy(buf / size).to(p.grad.device))
