"""``LayerParallel``: an ``nn.Module`` whose forward pass is an MGRIT solve over layers.

The forward pass solves ``u_{i+1} = scheme(f_i, u_i, h)``, ``u_0 = x`` with
MGRIT; ``loss.backward()`` solves the adjoint with MGRIT in reverse
layer-time (:mod:`propagators.torch.adjoint`) and fills ``.grad`` of the
parameters of the layers this rank owns. On ``P`` ranks every rank builds and
stores only the layers it owns plus a small halo (:mod:`propagators.torch.plan`).

Every phase that involves several ranks (halo exchange, the solves, the
broadcasts, the parameter vector-Jacobian products) runs inside a
communicator session, so an exception on one rank makes every rank raise
(:class:`mgrit.RemoteRankError` on the others) instead of hanging.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import functools
import math
import operator
import os
import sys
import threading
import warnings
import weakref
import zlib
from typing import Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

import mgrit
from mgrit.comm import Call, InSession, ReversedInSession, Tag, args_signature, as_communicator, warn_if_alone
from mgrit import _backend as B
from mgrit._inputs import WEIGHT_WIDTHS, WIDTH, array_sums as _input_sums_numpy, differing_rank, spread, \
    sums_gap as _input_gap, sums_rtol, weights
from mgrit.options import fits_float
from mgrit.hierarchy import build_hierarchy, check_flag, check_integer, frozen_per_level

from .adjoint import AdjointPropagator, parameter_vjp, recorded_gradients
from .kernel import (_REGISTRIES, DropoutMasks, LayerError, LayerKernel, _autocast_on, _random_error, _random_moved,
                     _random_states, _random_states_kept, draw_masks, global_hooks, memory_layout, own_saved_tensors,
                     own_scheme, rounding_tolerance, scheme_note, take_rows, uncached_parametrizations)
from .plan import DistributionPlan
from .propagator import ODEPropagator
from .schemes import forward_euler, inject_layer


class LayerDict(nn.Module):
    """The layers a rank holds, keyed by their global index.

    Indexing takes the global layer index (``lp.layers[j]``), iteration yields
    the modules in layer order, and parameter names keep the global index
    (``layers.17.0.weight``), so state dicts match the serial network's.
    """

    def __init__(self, modules: dict):
        super().__init__()
        for j in sorted(modules):
            self.add_module(str(j), modules[j])

    def __getitem__(self, j) -> nn.Module:
        try:
            return self._modules[str(int(j))]
        except KeyError:
            raise KeyError(f"layer {j} is not held by this rank; it holds layers {self.indices}") from None

    def __contains__(self, j) -> bool:
        return str(int(j)) in self._modules

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    @property
    def indices(self) -> list:
        return [int(k) for k in self._modules]

    def items(self):
        """``(global index, module)`` pairs in layer order."""
        return [(int(k), m) for k, m in self._modules.items()]

    def keys(self):
        """The global indices of the layers this rank holds, in order (as :attr:`indices`)."""
        return self.indices

    def values(self):
        """The modules in layer order (as iterating)."""
        return list(self._modules.values())


class FixedOptions(dict):
    """The MGRIT settings of a block (``lp.options``): a dict that refuses changes, since the hierarchy, the
    layers' split over ranks and the cached layouts are built from them at construction."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("the MGRIT settings of a block (its `options`: cf, max_levels, min_coarse, relax, ...) are "
                        "fixed at construction (its hierarchy and its layers' split over ranks are built from "
                        "them): build a new block with the settings you want and load the old one's state_dict "
                        "into it, e.g. new.load_state_dict(lp.state_dict())")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = __ior__ = _refuse

    def __reduce__(self):
        return (FixedOptions, (dict(self),))


_STATEFUL = (nn.modules.batchnorm._BatchNorm,)
_RANDOM = (nn.modules.dropout._DropoutNd,)


@contextlib.contextmanager
def _pass_modes(subs, modes, batch_stats, current: bool = False):
    """The layers as they were at the forward pass: the training flags of ``subs`` as recorded in
    ``modes`` (:func:`_modes`), and the BatchNorm modules ``batch_stats`` normalising with batch
    statistics without updating their running ones (``current``: the modes are known to be current)."""
    old = None
    if not current and list(map(_TRAINING, subs)) != modes[0]:  # train() / eval() between forward and backward
        old = [s.training for s in subs]
        for s, t in zip(subs, modes[0]):
            s.training = t
    try:
        with _tracking(batch_stats, False):
            yield
    finally:
        if old is not None:
            for s, t in zip(subs, old):
                s.training = t


@contextlib.contextmanager
def _tracking(batch_stats, on: bool):
    """``track_running_stats = on`` for the BatchNorm modules ``batch_stats`` inside the block."""
    for b in batch_stats:
        b.track_running_stats = on
    try:
        yield
    finally:
        for b in batch_stats:
            b.track_running_stats = not on


def _rng_digest(device) -> int:
    state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.random.get_rng_state()
    return zlib.crc32(state.cpu().numpy().tobytes())


class _LayerParallelFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lp, kp, anchor, x, *params):
        with own_saved_tensors():
            y, saved = lp._forward_solve(kp, x)
        ctx.lp, ctx.saved, ctx.pass_id = lp, saved, lp._pass_id
        ctx.save_for_backward(*params)  # autograd's own check: no in-place change before backward
        # which parameter each gradient belongs to, by identity: saved tensors may come back as other
        # objects (saved-tensor hooks of the user's, e.g. torch.autograd.graph.save_on_cpu())
        ctx.param_ids = list(map(id, params))
        return y

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError(_no_transforms("forward-mode differentiation (torch.autograd.forward_ad, torch.func.jvp)"))

    @staticmethod
    def backward(ctx, gy):
        return _adjoint_pass(ctx, gy)


def _check_warm_tolerance(warm_start: bool, fwd_tol, tol_type: str) -> None:
    """Refuse a warm start with a relative forward tolerance (of 0 it is the cap, relative or not)."""
    if warm_start and fwd_tol and tol_type == "rel":
        raise ValueError(
            "warm_start=True with a relative forward tolerance (fwd_tol with tol_type='rel'): a warm solve's first "
            "residual, the reference of a relative tolerance, can be at the rounding of the states (the same batch "
            "again) and a bound relative to it out of reach (every such solve would run to fwd_iters); use "
            "tol_type='abs' with warm_start, or warm_start=False")


def _is_observer(module) -> bool:
    """``module`` is a torch.ao.quantization observer or fake-quantize module (they update their buffers in
    every call until switched off)."""
    quant = sys.modules.get("torch.ao.quantization")
    kinds = tuple(k for k in (getattr(quant, "ObserverBase", None), getattr(quant, "FakeQuantizeBase", None)) if k)
    return bool(kinds) and isinstance(module, kinds)


#: ``LayerParallel._probed`` after the checks of the layers' graphs ran in a pass without gradients
_PROBED_WITHOUT_GRAD = "without gradients"

#: what the ranks of a pass must agree on (named by the handshake's error when they do not)
_FORWARD_AGREE = ("input shapes or dtypes, torch.autocast (on every rank or on none, with one dtype), or settings "
                  "of the forward solve (fwd_iters, fwd_tol, tol_type, skip, the MGRIT options: set them alike on "
                  "every rank)")
_BACKWARD_AGREE = ("output-gradient shapes or dtypes, or settings of the adjoint solve (bwd_iters, bwd_tol, tol_type, "
                   "the MGRIT options: set them alike on every rank, before the forward pass)")


def _pass_name(exact: bool) -> str:
    """The forward pass, as a rank's handshake names it (the exact inference sweep and the MGRIT solve
    are different calls: train() / eval() differ between ranks when they meet)."""
    if exact:
        return "the forward pass in eval mode (exact_eval: a serial sweep)"
    return "the forward pass (an MGRIT solve)"


_DIFFERENT_LOSS = ("every layer rank must compute the same loss from the same output (the same targets, in the "
                   "same order; the same random state for dropout and other randomness after the block): "
                   "the block's adjoint starts at one rank's gradient while the layers around it would train "
                   "on each rank's own. For data parallelism split the ranks into a layer x data grid "
                   "(README, Several ranks). An optimizer whose step reads all parameters (LBFGS's line search) "
                   "makes the ranks' models differ after its first step: use it on one process")


def _finite_output_gradient(gy, cls: str = "LayerParallel", serial: str = "`lp.to_serial()` or `lp.serial(x)`") -> bool:
    """Whether the gradient of an output is finite. When it is not (an overflow of a scaled loss, which
    ``torch.amp.GradScaler`` then skips, or a NaN loss) the backward pass returns NaN gradients, as
    torch's layers would, instead of running an adjoint solve that could only diverge."""
    try:
        return bool(torch.isfinite(gy).all())
    except RuntimeError as exc:  # the first operation on a gradient batched by torch's legacy vmap
        if "Batching rule" not in str(exc):
            raise
        raise RuntimeError(_no_transforms(
            what="vectorized Jacobians (torch.autograd.functional.jacobian(vectorize=True), "
                 "torch.autograd.grad(is_grads_batched=True))", cls=cls, serial=serial)) from exc


def _nan_like(t):
    """NaN in the shape, dtype and device of ``t`` (None stays None): the gradients of a pass whose
    output gradient was not finite."""
    return None if t is None else torch.full_like(t, math.nan)


#: why torch.func transforms and forward-mode derivatives stop at a LayerParallel
_NO_TRANSFORMS = ("{cls} does not support {what}: its derivative is an MGRIT solve of the adjoint, "
                  "written for loss.backward() and torch.autograd.grad only (a non-vectorized "
                  "torch.autograd.functional.jacobian works too). Use the serial network "
                  "({serial}) for such derivatives")


#: why tracing and export stop at a LayerParallel
_NO_EXPORT = ("{cls} cannot be traced or exported (torch.jit.trace / script, torch.onnx.export, "
              "torch.export): its forward pass is an MGRIT solve with data-dependent control flow and, on "
              "several ranks, messages. Export the serial network instead: {serial}")


def _exporting() -> bool:
    """Whether torch.jit.trace, torch.onnx.export or torch.export is running."""
    export = getattr(torch.compiler, "is_exporting", None)
    return bool(torch.jit.is_tracing() or torch.onnx.is_in_onnx_export() or (export is not None and export()))


def _eager_under_compile(forward):
    """``forward`` of a module that torch.compile must not trace (an MGRIT solve with messages between
    ranks): under compilation it runs eagerly behind a graph break; otherwise it is called as it is,
    without importing ``torch._dynamo`` (a second at import)."""
    compiling = getattr(torch.compiler, "is_compiling", None)
    try:
        from torch._compile import _disable_dynamo  # (imports torch._dynamo at its first call)
    except ImportError:  # pragma: no cover - other torch versions: decided at import
        _disable_dynamo = None
    if compiling is None or _disable_dynamo is None:  # pragma: no cover
        return torch.compiler.disable(forward, recursive=True)
    eager = _disable_dynamo(forward, recursive=True)

    @functools.wraps(forward)
    def call(self, *args, **kwargs):
        if compiling():
            return eager(self, *args, **kwargs)
        return forward(self, *args, **kwargs)

    return call


@_eager_under_compile
def _adjoint_pass(ctx, gy):
    """The backward pass of :class:`_LayerParallelFunction` (eager under torch.compile: a training step
    compiled as a whole calls it from a frame that dynamo would otherwise trace)."""
    lp = ctx.lp
    try:
        with _announced(lp._comm):  # the local checks first: a rank that fails tells the others
            _backward_checks(ctx)
            finite = _finite_output_gradient(gy)  # (the ranks compare their gy's sums, finite or not, below)
            sig = lp._adjoint_signature(gy)
            share = (ctx.pass_id, _input_sums(gy)) if lp._comm.size > 1 else None
        # one session around the whole backward pass on the module's communicator (so that it hears
        # a session the user has open there), the adjoint solve inside it in reverse rank order
        # (ReversedInSession: no handshake or closing barrier of its own; this handshake compares
        # the solve's arguments and the output gradients): a failure of the solve or of the gradients
        # reaches every rank
        session = lp._session("the backward pass" + lp._pass_note, sig, share, _BACKWARD_AGREE)
        with session:
            differ = None if share is None else (
                _differing_passes([sh[0] for sh in session.shared], f"LayerParallel #{lp._uid}")
                or _differing_inputs([sh[1] for sh in session.shared], "gradient of the block's output",
                                     _DIFFERENT_LOSS))
            if differ is None:
                kp = ctx.saved[0].kernel
                # the adjoint calls layers that are not dense: what they set then is not a change, but what
                # was changed since the forward pass is (the next pass inspects the layers again)
                calls = any(c.mode != "dense" for c in kp.k.classes)
                seen = calls and _unchanged(lp._slots, lp._stamp)
                with _pass_modes(kp.subs, kp.modes, kp.batch_stats), own_saved_tensors(), \
                        uncached_parametrizations():
                    gx, grads = lp._adjoint(ctx.saved, gy if finite else torch.zeros_like(gy), ctx.param_ids)
                if not finite:  # (every rank alike: the handshake found the same gy, finite or not, on all)
                    gx, grads = _nan_like(gx), [_nan_like(g) for g in grads]
                if seen:
                    lp._restamp()
        if differ is not None:
            raise differ  # every rank found it in the handshake: raised after the session (no one waits)
    except BaseException as exc:
        lp._alarm(exc)
        stage = getattr(lp, "_stage", None)  # (a MultiStage stage: which one, in its own layer numbering)
        note = f"in {stage} of a MultiStage"
        if stage and isinstance(exc, LayerError) and note not in getattr(exc, "__notes__", ()):
            exc.add_note(note)
        raise
    return (None, None, None, gx if ctx.needs_input_grad[3] else None, *grads)


def _differing_passes(ids: list, block: str) -> ValueError | None:
    """The error to raise when the ranks run the backward passes of different forward passes of the block
    (``ids``: every rank's pass id, agreed in the forward passes' handshakes), else None; alike on every rank.
    Two outputs of one block whose backward passes run in another order on some rank: their output gradients
    may even be equal (a loss such as ``y.sum()``), and the adjoint would combine different trajectories."""
    if len(set(ids)) == 1:
        return None
    return ValueError(
        f"the ranks run the backward passes of different forward passes of {block} "
        f"(forward pass {' / '.join(map(str, ids))} on the ranks in order): when several outputs of the block "
        "wait for their backward pass, every rank must run them in the same order (the same losses, "
        "backward() / torch.autograd.grad in the same order), or sum the losses and call backward() once")


def _no_transforms(what: str, cls: str = "LayerParallel", serial: str = "`lp.to_serial()` or `lp.serial(x)`") -> str:
    return _NO_TRANSFORMS.format(what=what, cls=cls, serial=serial)


@contextlib.contextmanager
def _announced(comm):
    """Local work before a collective handshake on ``comm``: a failure in it is announced to the other
    ranks (they raise RemoteRankError in that handshake instead of waiting), then raised here."""
    try:
        yield
    except BaseException as exc:
        if comm.size > 1:
            comm.open(failure=exc)
        raise


def _functorch_active() -> bool:
    """Whether a torch.func transform (grad, vmap, jacrev, ...) is running."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(active and active())


def _backward_checks(ctx) -> None:
    """The checks of the backward pass that may fail on one rank only."""
    if _functorch_active():
        raise RuntimeError(_no_transforms(what="torch.func transforms"))
    if torch.is_grad_enabled():
        raise RuntimeError(
            "LayerParallel does not support double backward (backward with create_graph=True, "
            "e.g. gradient penalties, Hessian-vector products, or torch.autograd.functional.jvp / hvp / "
            "hessian, which differentiate a backward pass): its backward pass is an MGRIT "
            "solve that is not itself differentiated. Compute such terms on the serial network "
            "(`lp.to_serial()` or `lp.serial(x)`)"
        )
    ctx.saved_tensors  # raises if a parameter was modified in place since forward
    ctx.saved[0].kernel.check_parameter_data()  # ... or given new data (p.data = ..., .to())


def _channels_last_format(x):
    """``torch.channels_last`` (``channels_last_3d``) when ``x`` is a 4-D (5-D) tensor laid out so and not
    plainly contiguous, else None: the block returns its output in that layout, as convolutions do."""
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    if fmt is None or x.is_contiguous() or not x.is_contiguous(memory_format=fmt):
        return None
    return fmt


def _adjoint_dtype(params, state_dtype, autocast):
    """The dtype of the adjoint solve: for a trajectory stored in the dtype of the torch.autocast the forward
    pass ran under (``autocast``), the widest floating dtype of the held parameters where that is wider;
    otherwise the states' own (a layer may hold a wider parameter and cast it itself)."""
    if autocast is None or state_dtype != autocast:
        return state_dtype
    wide = max((p.dtype for p in params if p.is_floating_point()), key=lambda d: torch.finfo(d).bits,
               default=state_dtype)
    return wide if torch.finfo(wide).bits > torch.finfo(state_dtype).bits else state_dtype


def _checked_layer(j: int, m):
    if not isinstance(m, nn.Module):
        raise TypeError(f"layer {j} is a {type(m).__name__}, not an nn.Module")
    if isinstance(m, torch.jit.ScriptModule):
        raise TypeError(f"layer {j} is a TorchScript module; LayerParallel evaluates layers with their "
                        "parameters swapped in (torch.func), which TorchScript does not allow: pass the plain "
                        "nn.Module (before torch.jit.script / trace)")
    lazy = [n for n, t in [*m.named_parameters(), *m.named_buffers()] if nn.parameter.is_lazy(t)]
    if lazy:
        raise TypeError(f"layer {j} ({type(m).__name__}) has uninitialized parameters or buffers {lazy} (a lazy "
                        "module such as nn.LazyLinear): call it once on a state, layer(x), before building "
                        "LayerParallel, so that they get their shapes")
    return m


def _named(fn, depth: int = 0) -> str:
    """What ranks compare of a scheme or a layer_index: a function's module and qualified name with the
    values it closes over, a partial's function and arguments, a callable object's class and attributes
    (``functools.partial(scheme, damping=0.5)`` against ``damping=1.0`` were both "functools.partial").
    Only plain values are spelled out (no repr with a memory address, which differs between processes)."""
    def value(v):
        if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
            return repr(v)
        if isinstance(v, (tuple, list)):
            return "(" + ", ".join(map(value, v)) + ")"
        if isinstance(v, dict):
            items = sorted(v.items(), key=lambda kv: repr(kv[0]))
            return "{" + ", ".join(f"{k!r}: {value(x)}" for k, x in items) + "}"
        if callable(v) and depth < 3:
            return _named(v, depth + 1)
        return type(v).__qualname__
    if isinstance(fn, functools.partial):
        return f"partial({_named(fn.func, depth + 1)}, {value(fn.args)}, {value(fn.keywords)})"
    if hasattr(fn, "__qualname__"):
        cells = [value(c.cell_contents) for c in (getattr(fn, "__closure__", None) or ())
                 if _cell_filled(c)]
        return f"{getattr(fn, '__module__', '')}.{fn.__qualname__}" + (f"[{', '.join(cells)}]" if cells else "")
    attrs = getattr(fn, "__dict__", {})
    return f"{type(fn).__module__}.{type(fn).__qualname__}({value(attrs)})"


def _cell_filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # (an empty cell: a name the function refers to before it is bound)
        return False
    return True


def _layout(m: nn.Module) -> tuple:
    """What must agree between the copies of one layer on different ranks: its classes (every submodule's:
    an activation swapped for another changes no parameter), parameters and buffers."""
    return ([(n, type(s).__name__) for n, s in m.named_modules()],
            [(n, tuple(p.shape), str(p.dtype)) for n, p in m.named_parameters()],
            [(n, tuple(b.shape), str(b.dtype)) for n, b in m.named_buffers()])


def _check_random(before: tuple) -> None:
    if _random_moved(before):
        raise LayerError(
            "a layer drew random numbers (torch's, numpy's or Python's global generators) during the forward "
            "pass other than through dropout "
            "(torch.nn.functional.dropout / dropout1d-3d, whose masks LayerParallel draws once per pass), "
            "or made dropout calls that were not recorded for it (dropout calls must not depend on the "
            "layer's input; after changing a layer's attributes call lp.refresh()). "
            "MGRIT evaluates every layer many times per pass, each time with a different draw; draw such "
            "noise outside the layers, or put the layers in eval mode")


def _same_values(a, b) -> bool:
    """``a`` and ``b`` hold the same values (NaN where the other has NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return False
    na, nb = a.isnan(), b.isnan()
    return torch.equal(na, nb) and torch.equal(a.masked_fill(na, 0), b.masked_fill(nb, 0))


def _input_sums(x) -> tuple:
    """(sum of squares, sum of magnitudes, sum of magnitudes weighted by flat position, sum of values
    weighted by flat position, sum of values with pseudo-random weights, relative tolerance of the dtype) of
    a tensor, summed in float64: compared between the ranks (the weighted sums tell a shuffled batch, the
    fourth signs, the random one another sample or two swapped in a large batch). The position weights come
    from the rows and columns of a 61-wide view, the random ones from those of a 61-wide and a 64-wide view,
    and the last entries of each view are summed on their own (:func:`mgrit._inputs.array_sums`, the same
    sums)."""
    with torch.no_grad():
        v = B.flat_real(x)
        if v.device.type == "cpu" and v.dtype in _NUMPY_SUMS:
            with np.errstate(all="ignore"):  # (an Inf or NaN sums to Inf or NaN, compared as such; no warning)
                return (*_input_sums_numpy(v.numpy()), _input_rtol(x.dtype, v))
        if not v.is_floating_point():  # (integer and bool inputs off the CPU: abs and norms need floats)
            v = v.double()
        n = v.numel()
        body, tail = v[: n - n % WIDTH].view(-1, WIDTH), v[n - n % WIDTH:]
        f64 = dict(dtype=torch.float64, device=v.device)
        cols, rows = torch.arange(1, WIDTH + 1, **f64), torch.arange(body.shape[0], **f64).mul_(WIDTH)
        last = torch.arange(n - n % WIDTH + 1, n + 1, **f64)

        def weighted(b, t):
            return float(b.sum(0, dtype=torch.float64) @ cols + b.sum(1, dtype=torch.float64) @ rows
                         + t.to(torch.float64) @ last)

        def random_sum():  # (mgrit._inputs._random_sum on the tensor's device: the same weights)
            total = 0.0
            for width in WEIGHT_WIDTHS:
                b, t = v[: n - n % width].view(-1, width), v[n - n % width:]
                w_rows, w_cols, w_tail = (torch.tensor(weights(m, (width, part)), **f64)  # (copies: read-only arrays)
                                          for m, part in ((b.shape[0], 1), (width, 2), (len(t), 3)))
                sums = w_rows @ b if v.dtype == torch.float64 else \
                    (b * w_rows.to(v.dtype)[:, None]).sum(0, dtype=torch.float64)  # (narrower types: exact scalings)
                total += float(sums @ w_cols + t.to(torch.float64) @ w_tail)
            return total

        mags = body.abs()
        # (float64: a dot product, which numpy's path matches to far below the tolerance; the norm's own
        # accumulation was 1.5 tolerances off numpy's at 4M entries)
        squares = float(torch.dot(v, v)) if v.dtype == torch.float64 else \
            float(torch.linalg.vector_norm(v, dtype=torch.float64)) ** 2
        total = float(mags.sum(dtype=torch.float64) + tail.abs().sum(dtype=torch.float64))
        return (squares, total, weighted(mags, tail.abs()), weighted(body, tail), random_sum(),
                _input_rtol(x.dtype, v))


_NUMPY_SUMS = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
               torch.uint8, torch.bool}


def _input_rtol(dtype, v) -> float:
    """How far the sums of one input (of ``dtype``; ``v`` its flat real values) may differ between ranks:
    rounding in the layers before the block (computed on other hardware), not a different batch
    (:func:`mgrit._inputs.sums_rtol`; float16 / bfloat16 by the spread of the magnitudes)."""
    return sums_rtol(torch.finfo(dtype).eps if (dtype.is_floating_point or dtype.is_complex) else 1e-7,
                     lambda: spread(v))


def _differing_inputs(sums, what: str = "input", hint: str = "") -> ValueError | None:
    """The error to raise when the ranks' inputs differ (``sums``: every rank's :func:`_input_sums`);
    not for differences in the last bits (the layers before this block computed on different hardware)."""
    r = differing_rank(sums)
    if r is None:
        return None
    s = sums[r]
    return ValueError(
        f"the {what} of rank {r} differs from rank 0's by {_input_gap(s, sums[0]):.2g} relative, more than "
        f"rounding (sum of squares {s[0]:.6g} against "
        f"{sums[0][0]:.6g}, sums weighted by position {s[3]:.6g} against {sums[0][3]:.6g}, sums with "
        f"pseudo-random weights {s[4]:.6g} against {sums[0][4]:.6g}): "
        + (hint or "every layer rank must pass the same input (the same batch in the same order, or the "
           "same output of the layers before this block); seed every rank alike, or broadcast the batch "
           "from one rank"))


def _crc(t: torch.Tensor) -> int:
    """crc32 of the bytes of ``t`` (on the host)."""
    return zlib.crc32(_bytes_of(t).cpu().numpy())


def _halo_rtol(dtype, same_input: bool, spread: float) -> float:
    """How far the checks of a layer and of a rank's copy of it (:meth:`LayerParallel._layer_checks`) may differ,
    relative to the larger norm of the step: when every rank's input has the same bits (``same_input``, known from
    a crc32 of CPU inputs: a device's would be copied to the host in every checking pass), rounding, 1,000 units
    in the last place of ``dtype``, at most 1e-5 (float32 and narrower: a change of 1e-6 in a float64 layer was
    not seen with 1e-5); otherwise 1e-5 and 100 times the inputs' relative ``spread`` (a layer with a large gain,
    such as a LayerNorm of nearly equal entries, magnifies inputs a few units apart)."""
    if same_input:
        return min(1e-5, 1000 * torch.finfo(dtype).eps)
    return 1e-5 + 100 * spread


def _same_check(a, b, rtol: float = 1e-5) -> bool:
    """Two layer checks ``[|s - z|, |s|]`` (:meth:`LayerParallel._layer_checks`) agree to ``rtol`` of the larger
    of their norms (the first cancels when the state outweighs the layer's update: rounding moves it relative
    to ``|s|``), NaN matching NaN."""
    scale = max((abs(v) for v in (*a, *b) if v == v), default=0.0)
    return all(x == y or (x != x and y != y) or abs(x - y) <= rtol * scale for x, y in zip(a, b))


_TRAINING = operator.attrgetter("training")
_FORWARD_HOOKS = operator.attrgetter("_forward_hooks")
_PRE_HOOKS = operator.attrgetter("_forward_pre_hooks")


def _modes(subs, prev: tuple | None = None) -> tuple:
    """Training flags and forward (pre-)hook counts of the submodules, read at every forward pass.

    ``(training flags, hook-handle counter, hook counts)``. Every hook registration takes a new id
    from torch's handle counter, so the hook counts of ``prev`` are reused (not recounted) when
    no hook was registered anywhere since: a C-level map over the flags remains (about 0.2 ms for
    3,000 submodules).
    """
    hid = RemovableHandle.next_id
    if prev is not None and prev[1] == hid:
        hooks = prev[2]
    else:
        hooks = (list(map(len, map(_FORWARD_HOOKS, subs))), list(map(len, map(_PRE_HOOKS, subs))), global_hooks())
    return list(map(_TRAINING, subs)), hid, hooks


def _attribute_slots(modules, count: "_Registrations") -> tuple:
    """Where the plain attributes and the submodules of ``modules`` are kept, and ``count``, which counts
    the parameters, buffers and submodules registered on them from now on, for :func:`_attribute_values`."""
    dicts, keys = [], []
    for m in modules:
        d = vars(m)
        plain = [k for k in d if k not in _REGISTRIES]
        dicts += [d] * len(plain) + [m._modules] * len(m._modules)
        keys += plain + list(m._modules)
        _WATCHED.setdefault(m, weakref.WeakSet()).add(count)
    # submodules added to a module that had some (a container; a leaf's code uses none); attributes
    # added to a module (one set on an instance where only its class had it before)
    # parameters and buffers put into a module's dictionaries directly (``module._parameters[name] = p``,
    # which no registration hook sees)
    return (dicts, keys, [m._modules for m in modules if m._modules], list(modules), count,
            [vars(m) for m in modules] + [m._parameters for m in modules] + [m._buffers for m in modules])


def _attribute_values(slots) -> tuple | None:
    """The values in ``slots`` (:func:`_attribute_slots`), the number of submodules of each module
    that had some, the registrations counted on the modules, the modules' classes and the number of
    attributes, parameters and buffers of each, read by C-level maps (about 0.2 ms for 1,000 layers of
    three modules); None when an attribute or a submodule was deleted."""
    dicts, keys, registries, modules, count, attributes = slots
    try:
        return (list(map(dict.__getitem__, dicts, keys)), list(map(len, registries)), count.n,
                list(map(type, modules)), list(map(len, attributes)))
    except KeyError:
        return None


class _Registrations:
    """The parameters, buffers and submodules registered on the modules a LayerParallel holds (see
    :data:`_WATCHED`)."""

    __slots__ = ("n", "__weakref__")

    def __init__(self):
        self.n = 0


#: the counts (:class:`_Registrations`) of the blocks holding each module, which the registration hooks
#: below advance for a parameter, buffer or submodule registered on it (``register_parameter``,
#: ``register_buffer``, assigning an ``nn.Parameter``, a tensor to a buffer's name or a module to an
#: attribute, also ``load_state_dict(assign=True)``): a pass compares its block's count with what the last
#: one saw, so that a parameter or buffer registered, replaced or set to None between passes is inspected
#: (a parameter set to None, which torch registers without these hooks, is found when the pass binds the
#: parameters). A tensor put into ``module._parameters`` or ``_buffers`` directly (private; ``torch.func``
#: does it while it calls a module) is seen only when it adds a name (:func:`_attribute_slots`).
_WATCHED: "weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet]" = weakref.WeakKeyDictionary()


def _registered(module, name, value):
    counts = _WATCHED.get(module)
    if counts:
        for count in counts:
            count.n += 1


for _register in (nn.modules.module.register_module_parameter_registration_hook,
                  nn.modules.module.register_module_buffer_registration_hook,
                  nn.modules.module.register_module_module_registration_hook):
    _register(_registered)


#: kernels a LayerParallel keeps for the training flags its layers had (see _build_kernel)
_KERNELS_KEPT = 4


def _tensor_layout(subs) -> tuple:
    """The class of each submodule and the name, shape, dtype, device and ``requires_grad`` of each of its
    parameters and buffers (None where one is set to None): what the grouping of the layers depends on
    besides their attributes and training flags (a parameter or buffer registered, replaced by another
    shape or removed, ``.double()``, ``requires_grad_()``, a module's class changed)."""
    def one(t):
        return None if t is None else (t.shape, t.dtype, t.device, t.requires_grad)

    return tuple((type(s), tuple((k, one(t)) for k, t in s._parameters.items()),
                  tuple((k, one(t)) for k, t in s._buffers.items())) for s in subs)


def _unchanged(slots, stamp) -> bool:
    """Whether the attributes and submodules in ``slots`` are (identical or equal to) those of ``stamp``."""
    now = _attribute_values(slots)
    try:
        return now is not None and bool(now == stamp)
    except Exception:  # an attribute replaced by a tensor or an array of several elements: changed
        return False


#: the least bytes of states a piece of LayerParallel's backward per-layer work takes (:func:`_pieces_of`)
PIECE_BYTES = 2 << 20


def _chunks(rows: np.ndarray, least: int, parts: int = 8):
    """``rows`` in consecutive pieces: ``parts`` of them, or fewer of at least ``least`` rows: the
    backward passes' per-step work a piece at a time, so that its temporaries are a piece's, not
    every step's, where that matters, and few calls where it does not."""
    step = max(-(-rows.size // parts), least, 1)
    return [rows[a: a + step] for a in range(0, rows.size, step)]


def _pieces_of(rows: np.ndarray, U):
    """:func:`_chunks` of ``rows`` with pieces of at least :data:`PIECE_BYTES` of states (rows of ``U``)."""
    return _chunks(rows, -(-PIECE_BYTES // max(U[0].numel() * U.element_size(), 1)))


def _rows(X, rows: np.ndarray):
    """``X[rows]``: a view (no copy of the states) where ``rows`` increase evenly (``take_rows``);
    one flipped copy of the run when they are consecutive and decrease (as the backward pass reads
    the layers)."""
    if rows.size and rows.min() < 0:
        rows = np.where(rows < 0, rows + X.shape[0], rows)  # (counted from the end, as X[rows])
    a, b = (int(rows[0]), int(rows[-1])) if rows.size else (0, 0)
    if b < a and a - b == rows.size - 1 and (rows.size < 3 or (np.diff(rows) == -1).all()):
        return X[b: a + 1].flip(0)
    return take_rows(rows, X.device)(X)


def check_root(root, size: int, none_ok: bool = False) -> None:
    """Raise ValueError unless ``root`` is a rank of a communicator of ``size`` ranks (or None where
    ``none_ok``): before a collective call, which would otherwise wait for a rank that does not exist."""
    if root is None and none_ok:
        return
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < size:
        raise ValueError(f"`root` must be a rank of the layer communicator, 0 .. {size - 1}"
                         + (" (or None: every rank)" if none_ok else "") + f", got {root!r}")


def _layer_key_order(key: str) -> tuple:
    """Sort key of a state-dict key: ``layers.<j>.`` keys by ``j``, then the rest by name."""
    parts = key.split(".", 2)
    if len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit():
        return 0, int(parts[1]), key
    return 1, 0, key


_THREADS = threading.Lock()  # (guards the blocks' _in_thread)


class _one_thread:  # noqa: N801 - used like a function
    """``session`` (a block's), entered only when no other thread is in one of ``block``'s sessions: a
    block serves one thread at a time (two threads' passes mixed their messages on one channel: a hang
    over MPI, an abort over gloo). Raises RuntimeError before anything is sent. Nested sessions of one
    thread, and threads that take turns (a backward pass on autograd's thread), pass. ``shared`` is the
    session's."""

    __slots__ = ("block", "session")

    def __init__(self, block, session):
        self.block, self.session = block, session

    @property
    def shared(self):
        return self.session.shared

    def __enter__(self):
        me, block = threading.get_ident(), self.block
        with _THREADS:
            owner, depth = block.__dict__.get("_in_thread", (None, 0))
            if owner is not None and owner != me:
                name = next((t.name for t in threading.enumerate() if t.ident == owner), f"ident {owner}")
                raise RuntimeError(
                    f"this {type(block).__name__} is in a call of another thread ({name!r}): a block serves one "
                    "thread at a time. Call it from one thread, or give each thread its own blocks, on their own "
                    "communicator (MPI: comm.Dup(); torch.distributed: dist.new_group(...), on every rank)")
            block.__dict__["_in_thread"] = (me, depth + 1)
        try:
            return self.session.__enter__()
        except BaseException:
            self._release()
            raise

    def __exit__(self, *exc):
        try:
            return self.session.__exit__(*exc)
        finally:
            self._release()

    def _release(self) -> None:
        with _THREADS:
            owner, depth = self.block.__dict__["_in_thread"]
            self.block.__dict__["_in_thread"] = (None, 0) if depth == 1 else (owner, depth - 1)


def _digests(state_dict) -> dict:
    """A check of every tensor of a state dict, to compare what the ranks were given: its shape and the
    crc32 of its values in the widest type of their kind (a float32 tensor and its float64 copy agree).
    Other entries are left out (a set's pickle, an object's repr differ between processes)."""
    out = {}
    for k, v in state_dict.items():
        if isinstance(v, torch.Tensor) and not v.is_meta:
            t = v.detach()
            wide = (torch.complex128 if t.is_complex() else torch.float64 if t.is_floating_point()
                    else torch.bool if t.dtype == torch.bool else torch.int64)
            try:
                data = t.to("cpu", wide).contiguous().reshape(-1).view(torch.uint8).numpy()
            except (RuntimeError, TypeError):  # (a quantized or other special tensor: its raw bytes)
                data = t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            out[k] = (tuple(t.shape), zlib.crc32(data))
    return out


def _same_state_dicts(digests: list, prefix: str = "") -> None:
    """Raise ValueError (on every rank: each has every rank's ``digests``) when a rank was given another
    state dict than rank 0: each rank would keep its own layers from its own file, and the network would
    mix the two."""
    for r, d in enumerate(digests[1:], 1):  # (entries that both hold: strict=False may load a rank's own share)
        key = next((k for k in sorted(set(d) & set(digests[0]), key=_layer_key_order) if d[k] != digests[0][k]), None)
        if key is not None:
            raise ValueError(f"rank {r} was given another state dict than rank 0 (entry {prefix + key!r} differs): "
                             "load the same checkpoint on every rank")


def _prefix_hint(missing: list, unexpected: list) -> str:
    """When the unexpected keys are the missing ones behind one prefix (a wrapper's ``module.``, a larger
    model's ``net.1.``), how to strip it; else ''."""
    want, counts = set(missing), collections.Counter()
    for u in unexpected:
        for i in (i + 1 for i, ch in enumerate(u) if ch == "."):
            if u[i:] in want:
                counts[u[:i]] += 1
                break
    if not counts:
        return ""
    p = counts.most_common(1)[0][0]
    return (f"; its keys carry the prefix {p!r} (a wrapper's, such as DDP's 'module.', or a larger model's): pass "
            f"{{k[len({p!r}):]: v for k, v in state_dict.items() if k.startswith({p!r})}}")


def _iterations(value, name: str):
    """A solve's cycles as given: None (the default, see :class:`_SolveCycles`) or an integer >= 1."""
    if value is None:
        return None
    check_integer(value, name, 1)
    return int(value)


class _SolveCycles:
    """``fwd_iters`` / ``bwd_iters`` / ``fwd_tol`` / ``bwd_tol`` of a block (LayerParallel, ParallelGRU,
    ParallelLSTM), checked whenever they are set, at construction or later. A cycle count left at None (or
    set to None) follows its direction's tolerance: 2 forward / 1 adjoint cycles without one, at most
    :data:`TOL_ITERS` with one, also when the tolerance is set or removed after construction (the cap was
    fixed at construction: a tolerance set later ran 2 cycles and warned to raise a cap never given)."""

    _DEFAULT_CYCLES = {"fwd": 2, "bwd": 1}

    def _init_cycles(self, fwd_iters, bwd_iters, fwd_tol, bwd_tol) -> None:
        self._given_iters = {"fwd": _iterations(fwd_iters, "fwd_iters"), "bwd": _iterations(bwd_iters, "bwd_iters")}
        self._tols = {"fwd": _tolerance(fwd_tol, "fwd_tol"), "bwd": _tolerance(bwd_tol, "bwd_tol")}

    def _cycles(self, d: str) -> int:
        n = self._given_iters[d]
        return self._default_cycles(d, self._tols[d]) if n is None else n

    @classmethod
    def _default_cycles(cls, d: str, tol) -> int:
        return cls._DEFAULT_CYCLES[d] if tol is None else TOL_ITERS

    def _set_cycles(self, given: dict, tols: dict) -> None:
        """Both directions' counts as given and tolerances, replaced (new dicts: a shallow copy of the block
        keeps its own when one of them is set)."""
        self._given_iters, self._tols = dict(given), dict(tols)

    def _restore_cycles(self, counts: dict, tols: dict) -> None:
        """Counts in use and tolerances, as a checkpoint stores them: a count that is its tolerance's default
        (2 / 1 without one, :data:`TOL_ITERS` with one) is taken as left unset, so that it follows a tolerance
        set later (the values in use are the same either way)."""
        tols = {d: _tolerance(tols[d], f"{d}_tol") for d in ("fwd", "bwd")}
        given = {d: None if counts[d] == self._default_cycles(d, tols[d]) else _iterations(counts[d], f"{d}_iters")
                 for d in ("fwd", "bwd")}
        self._set_cycles(given, tols)

    def __setstate__(self, state):  # (a block pickled before these were properties: its counts in use)
        if "_tols" not in state and "fwd_tol" in state:
            counts = {"fwd": state.pop("fwd_iters"), "bwd": state.pop("bwd_iters")}
            tols = {"fwd": state.pop("fwd_tol"), "bwd": state.pop("bwd_tol")}
            super().__setstate__(state)
            self._restore_cycles(counts, tols)
            return
        super().__setstate__(state)

    def _setter(kind: str, d: str):
        def set_(self, v):
            if kind == "iters":
                self._set_cycles({**self._given_iters, d: _iterations(v, f"{d}_iters")}, self._tols)
            else:
                self._set_cycles(self._given_iters, {**self._tols, d: _tolerance(v, f"{d}_tol")})
        return set_

    fwd_iters = property(lambda self: self._cycles("fwd"), _setter("iters", "fwd"),
                         doc="Cycles of the forward solve (its cap with a tolerance); None restores the default.")
    bwd_iters = property(lambda self: self._cycles("bwd"), _setter("iters", "bwd"),
                         doc="Cycles of the adjoint solve (its cap with a tolerance); None restores the default.")
    fwd_tol = property(lambda self: self._tols["fwd"], _setter("tol", "fwd"),
                       doc="Residual tolerance of the forward solve (None: run fwd_iters cycles).")
    bwd_tol = property(lambda self: self._tols["bwd"], _setter("tol", "bwd"),
                       doc="Residual tolerance of the adjoint solve (None: run bwd_iters cycles).")
    del _setter


def _halo_follows_assign(lp, incompatible_keys) -> None:
    """A load-state-dict post-hook of :class:`LayerParallel`: after ``load_state_dict(..., assign=True)``
    the halo copies take the owned layers' new dtype and device (they kept the old ones, and the next pass
    on several ranks raised that the owner's and the copy's tensors differ)."""
    before = lp.__dict__.pop("_assigned", None)
    if before is not None:
        lp._halo_like_owned(before)


def _grid_fixed(name: str):
    raise AttributeError(
        f"LayerParallel.{name} is fixed at construction (the time grid, the hierarchy and the layers' "
        "distribution over ranks are built from it): build a new LayerParallel with the T you want over "
        "the same layers, e.g. LayerParallel(list(lp.layers), T=...) on one process, or "
        "load_state_dict(lp.state_dict()) into a new one")


def _fixed_function(name: str):
    raise AttributeError(
        f"LayerParallel.{name} is fixed at construction (the layers' kernel, the checks of their steps and the "
        f"copies lent to other ranks are built with it; a new value would reach some passes and not others): "
        f"build a new LayerParallel with the {name} you want, e.g. LayerParallel(list(lp.layers), T=lp.T, "
        f"{name}=...) on one process, or load_state_dict(lp.state_dict()) into a new one")


def _fixed(name: str, doc: str, refuse):
    """A read-only property of LayerParallel: the value of ``_<name>``; setting it calls ``refuse(name)``,
    which raises the error that says what to do instead."""
    return property(lambda self: getattr(self, "_" + name), lambda self, value: refuse(name), doc=doc)


def _loading_strictly() -> bool:
    """The ``strict`` of the ``torch.nn.Module.load_state_dict`` call under way, read from its frame: torch
    passes True to every ``_load_from_state_dict`` whatever the caller asked, and applies ``strict=False`` to
    the unexpected keys afterwards. True when no such call is found."""
    frame, code = sys._getframe(1), nn.Module.load_state_dict.__code__
    while frame is not None:
        if frame.f_code is code:
            return bool(frame.f_locals.get("strict", True))
        frame = frame.f_back
    return True


class LayerParallel(_SolveCycles, nn.Module):
    """A stack of residual layers evaluated by MGRIT, forward and backward.

    ``y = model(x)`` solves ``u_i = scheme(f_i, u_{i-1}, h)``, ``u_0 = x`` over
    the layers with MGRIT and returns ``u_N``; ``loss.backward()`` solves the
    adjoint with MGRIT in reverse layer-time and fills ``.grad`` of the layer
    parameters this rank owns. At convergence (``fwd_tol``/``bwd_tol`` small)
    output and gradients equal the serial network's.

    Any layers work: layers proven interchangeable (same class, same
    non-tensor state, same parameter names and shapes, no hooks) are
    evaluated batched; all others one by one. BatchNorm and dropout work in
    training mode with the serial network's semantics (docs/norm_dropout.md):
    each layer normalises with the batch statistics of its own input state and
    its running statistics advance once per pass, from the returned trajectory;
    each layer's dropout masks are drawn once per pass, in serial layer order,
    and reused by every relaxation and by the adjoint. Other randomness and
    other changes of buffers during the forward pass raise a :class:`LayerError`.

    Parameters
    ----------
    layers : sequence of nn.Module, or callable
        The layer modules ``f_i`` (the right-hand side of the ODE, not the
        residual step), or a factory ``layers(i) -> nn.Module`` with
        ``n_layers``. With ``comm`` of several ranks a factory is called only
        for the layers this rank needs; from a full list the rank keeps only those.
    n_layers : int, optional
        Needed with a factory.
    T : float
        Final time; the layer step is ``h = T / n_layers``.
    cf, max_levels, min_coarse, relax, cycle, c_weight
        MGRIT settings (see :func:`mgrit.solve`; ``mgrit.choose_settings(...).options`` fits them,
        README "Choosing settings from theory"); default ``relax=("F", "FCF")``:
        F-relaxation on the layers, FCF on coarse levels (TorchBraid's).
    fwd_iters, bwd_iters : int, optional
        Cycles of the forward and the adjoint solve: 2 and 1 by default; with a
        tolerance, the most cycles a solve may run (default 100).
    fwd_tol, bwd_tol : float or None
        Residual tolerances (None: run the given number of cycles). A solve that
        stops short of its tolerance warns (:class:`ConvergenceWarning`).
    tol_type : {"abs", "rel"}
        Tolerances absolute, or relative to each solve's first residual (not with
        ``warm_start`` and ``fwd_tol``: the first residual of a warm guess can be
        at the rounding of the states, the same batch again, and a bound relative
        to it out of reach; a ValueError says to use ``tol_type="abs"``).
    skip : bool
        XBraid's and TorchBraid's skip (default on): the first cycle of each
        solve does no fine relaxation on the way down.
    warm_start : bool
        Start each forward solve from the previous forward trajectory (for
        inputs of the same shape), as TorchBraid does; such solves do not skip.
    exact_eval : bool
        In eval mode (``model.eval()``) the forward pass steps through the
        layers in order (a one-level solve, also across ranks): inference gives
        the serial network's output, not the inexact few-cycle MGRIT solve of
        training. False keeps the training solve in eval mode too.
    scheme : callable
        ``scheme(f, u, dt)``: :func:`forward_euler` (ResNet), :func:`heun`,
        :func:`rk4`, :func:`dt_aware`, or your own.
    layer_index : callable, optional
        Which layer's parameters a coarse step uses (default: injection).
    batched : bool
        Batch interchangeable layers (dense fast path or vmap).
    streams : int
        CUDA streams for layers that are looped on a GPU.
    comm : None, mpi4py communicator, torch.distributed group or mgrit.Communicator
        The layer communicator: distributes the layers over its ranks.
    data_comm : None, mpi4py communicator, torch.distributed group or mgrit.Communicator
        The data communicator of layer x data parallelism: a failure of this
        module is announced on it, so that the data peers waiting in
        :func:`allreduce_gradients` raise instead of hanging.
    callback : callable, optional
        Passed to the forward solve (called after every cycle).
    spatial : SpatialCoarsening, optional
        Coarse time levels work on coarser feature maps (conv ODE-nets,
        docs/cnn_spatial.md); the layers themselves are unchanged.

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

    _pass_id = 0  # forward passes on several ranks: the last one's id, agreed in its handshake
    _pass_note = ""  # what the passes' handshakes add to their names (SerialSwitch's measurement says so)

    def __init__(self, layers, n_layers: int | None = None, T: float = 1.0, *, cf: int = 4,
                 max_levels: int = 3, min_coarse: int = 2, relax=("F", "FCF"), cycle: str = "V", c_weight=1.0,
                 fwd_iters: int | None = None, bwd_iters: int | None = None, fwd_tol: float | None = None,
                 bwd_tol: float | None = None, tol_type: str = "abs", skip: bool = True, warm_start: bool = False,
                 exact_eval: bool = True,
                 scheme=forward_euler, layer_index=None, batched: bool = True, streams: int = 0,
                 comm=None, data_comm=None, callback=None, spatial=None):
        super().__init__()
        warn_if_alone(comm, "LayerParallel")
        self._comm = as_communicator(comm)
        self._data_comm = None if data_comm is None else as_communicator(data_comm)
        with _announced(self._comm):  # a bad argument on one rank: the others raise in the handshake below
            _check_grid(self._comm, self._data_comm)
            factory = callable(layers) and not isinstance(layers, (nn.Module, Sequence))
            if factory:
                if n_layers is None:
                    raise ValueError("`n_layers` is required when `layers` is a factory")
                check_integer(n_layers, "n_layers", 1)
                N = int(n_layers)
            else:
                if isinstance(layers, nn.Module) and not isinstance(layers, (nn.ModuleList, nn.Sequential)):
                    raise TypeError("`layers` must be a sequence of nn.Module or a factory `layers(i)`, "
                                    f"got a single {type(layers).__name__}")
                layers = list(layers)
                N = len(layers)
                if n_layers is not None and n_layers != N:
                    raise ValueError(f"`n_layers`={n_layers} but {N} layers were given")
            if N < 1:
                raise ValueError("`layers` is empty")
            self.n_layers = N
            self._T = _check_T(T)
            self._h = self._T / N
            options = dict(cf=frozen_per_level(cf), max_levels=max_levels, min_coarse=min_coarse,
                           relax=frozen_per_level(relax), cycle=cycle)
            if not (np.ndim(c_weight) == 0 and c_weight == 1.0):  # (unweighted: options as before it existed)
                options["c_weight"] = frozen_per_level(c_weight)
            self._options = FixedOptions(options)
            self._init_cycles(fwd_iters, bwd_iters, fwd_tol, bwd_tol)
            if tol_type not in ("abs", "rel"):
                raise ValueError(f"`tol_type` must be 'abs' or 'rel', got {tol_type!r}")
            self.tol_type = tol_type
            self.skip, self.warm_start = check_flag(skip, "skip"), check_flag(warm_start, "warm_start")
            _check_warm_tolerance(self.warm_start, self.fwd_tol, tol_type)
            self.exact_eval, self.batched = check_flag(exact_eval, "exact_eval"), check_flag(batched, "batched")
            for name, fn in (("scheme", scheme), ("layer_index", layer_index), ("callback", callback)):
                if fn is not None and not callable(fn) or fn is None and name == "scheme":
                    named = name == "scheme" and fn in ("forward_euler", "heun", "rk4", "dt_aware")
                    raise TypeError(f"`{name}` must be a function, got {fn!r}"
                                    + (f": pass propagators.torch.{fn}" if named else ""))
            self._scheme, self._layer_index = scheme, layer_index or inject_layer
            check_integer(streams, "streams", 0)
            self.streams = int(streams)
            self.callback = callback
            self.t = np.arange(N + 1, dtype=np.float64) * self.h
            self.hierarchy = build_hierarchy(self.t, cf, max_levels, min_coarse, relax, c_weight)
            self.spatial = self._checked_spatial(spatial)
            P, r = self._comm.size, self._comm.rank
            self.plan = DistributionPlan.build(N, self.hierarchy, self.layer_index, P)
        self._uid = None  # (agreed below: which module a pass is of, compared in every handshake)
        session = self._session("building", share=(_uids[0], *self._network()))
        with session:  # a failure while building the layers on one rank reaches every rank
            if P > 1:
                self._uid = _agreed_build(session.shared, "LayerParallel", (
                    "n_layers (the number of layers)", "T",
                    "MGRIT settings (cf, max_levels, min_coarse, relax, cycle)", "scheme", "layer_index"))
            held = sorted(self.plan.needed[r])
            modules = {j: _checked_layer(j, layers(j) if factory else layers[j]) for j in held}
            if P > 1:
                # tied parameters: over the whole list when given one (every rank sees the same ties)
                self._check_sharing(modules if factory else dict(enumerate(layers)))
                self._check_structure(modules, None if factory else {j: m for j, m in enumerate(layers)
                                                                      if isinstance(m, nn.Module)})
        self.owned_layers = self.plan.owned[r]
        self.lo, self.hi = self.plan.fine[r]
        self.layers = LayerDict({j: modules[j] for j in self.owned_layers})
        self._halo = {j: modules[j] for j in held if j not in self.owned_layers}
        self._owner_flags: dict = {}  # mode -> {halo layer: its owner's flags at the last pass}
        self.register_load_state_dict_post_hook(_halo_follows_assign)
        self._build_kernel()
        self._warm: tuple | None = None
        #: mgrit.Result of the last forward and adjoint solve, without their states (Result.without_states:
        #: residuals, counts, hierarchy), so that the module holds no trajectory between passes
        self.last_forward: mgrit.Result | None = None
        self.last_backward: mgrit.Result | None = None

    # -- pickling: what _build_kernel derives from the layers is rebuilt, not stored --------------
    _DERIVED = ("kernel", "_kernels", "_layout", "_registrations", "_subs", "_modes", "_special", "_shared_subs",
                "_probed", "_repeated", "_checked", "_dropout_key", "_dropout_calls", "_slots", "_stamp",
                "_grad_pass", "_probe_turn")

    def __getstate__(self):
        if self._comm.size > 1 or (self._data_comm is not None and self._data_comm.size > 1):
            raise TypeError(
                "a LayerParallel on several ranks holds communicators and cannot be pickled or deep-copied: save "
                "lp.state_dict() on every rank (or the serial network of lp.to_serial()) and build a new module "
                "to load it into")
        state = dict(self.__dict__)
        state["_comm"] = as_communicator(None)  # (one rank: an MPI communicator of size 1 does not pickle)
        if self._data_comm is not None:
            state["_data_comm"] = as_communicator(None)
        state["last_forward"] = state["last_backward"] = None  # (their communicator too; diagnostics only)
        for k in self._DERIVED:
            state.pop(k, None)
        return state

    def __setstate__(self, state):
        if "options" in state:  # (pickled before the options were fixed)
            state["_options"] = FixedOptions(state.pop("options"))
        for k in ("T", "h", "scheme", "layer_index"):  # (pickled before they became read-only properties)
            if k in state:
                state["_" + k] = state.pop(k)
        super().__setstate__(state)
        self._build_kernel()

    # -- fixed at construction: the time grid, the settings, the scheme -------
    T = _fixed("T", "The final time: the layers are steps of size ``h = T / n_layers`` (read-only).", _grid_fixed)
    h = _fixed("h", "The step size ``T / n_layers`` of every layer (read-only).", _grid_fixed)
    options = _fixed("options", "The MGRIT settings (cf, max_levels, min_coarse, relax, cycle, c_weight), "
                     "read-only (a :class:`FixedOptions`).", lambda name: FixedOptions._refuse(None))
    scheme = _fixed("scheme", "The one-step method ``scheme(f, u, dt)`` of every layer (read-only).", _fixed_function)
    layer_index = _fixed("layer_index", "Which layer steps each coarse interval (read-only).", _fixed_function)

    # -- construction helpers -------------------------------------------------
    def _held(self) -> dict:
        return {**{j: m for j, m in self.layers.items()}, **self._halo}

    def _build_kernel(self, modes_only: bool = False):
        """Inspect the layers (group them into classes, trace the dense ones) and reset the checks of the
        next pass. ``modes_only``: no attribute, submodule or hook changed since the last inspection; then,
        unless a parameter or buffer changed too (:func:`_tensor_layout`), the kernels inspected before are
        kept, and one inspected under the layers' current training flags is taken again (a train()/eval()
        switch every epoch inspects each mode once). Any other change forgets them."""
        modules = self._held()
        kept = self.__dict__.get("_kernels") if modes_only else None
        if kept is None or _tensor_layout(self._subs) != self._layout:
            self._kernels: dict = {}  # training flags -> LayerKernel, latest last
            self._subs = [s for j in sorted(modules) for s in modules[j].modules()]
            self._layout = _tensor_layout(self._subs)
            self._special = [(j, s) for j in sorted(modules) for s in modules[j].modules()
                             if isinstance(s, _STATEFUL + _RANDOM)]
            held_in = collections.Counter(id(s) for m in modules.values() for s in m.modules())
            self._shared_subs = {i for i, n in held_in.items() if n > 1}  # submodules of several held layers
            # the layers' plain attributes and submodules as the kernel saw them: a change (an attribute set,
            # a submodule replaced or deleted) is found at the next forward pass, which inspects them again
            count = self.__dict__.get("_registrations") or _Registrations()
            self._registrations = count
            self._slots = _attribute_slots([self.layers, *self._subs], count)
        key = bytes(map(_TRAINING, self._subs))
        kernel = self._kernels.pop(key, None)
        if kernel is None:
            kernel = LayerKernel(modules, self.scheme, self.batched, self.streams)
        self.kernel = self._kernels[key] = kernel
        while len(self._kernels) > _KERNELS_KEPT:
            del self._kernels[next(iter(self._kernels))]
        self._modes = _modes(self._subs)
        self._restamp()
        self._probed = False  # the layers' autograd graphs are checked at the next forward pass
        self._repeated = False  # ... and, at the next pass that is not exact inference, their repeatability
        self._checked = None  # the lent layers are checked at the next pass (see _exchange_halo)
        self._dropout_key, self._dropout_calls = None, {}  # re-recorded at the next training pass

    def refresh(self):
        """Re-inspect the layers now.

        Every forward pass re-inspects them by itself when a training mode, a hook, an attribute, a
        submodule, a parameter or a buffer of a layer changed since the last pass; call this after changes
        that check cannot see: a container attribute changed in place, a parameter or buffer written into a
        module's ``_parameters`` / ``_buffers`` directly under a name it already holds, or values a layer reads
        from outside itself (a global, a closure). On several ranks make changes with
        :meth:`apply_to_layers`, which calls this.
        """
        self._build_kernel()

    def apply_to_layers(self, fn):
        """Call ``fn(j, layer)`` for every layer this rank holds, then :meth:`refresh`; returns self.

        The layers a rank holds are those it owns (``self.layers``) and, on several ranks, its
        copies of a few of its neighbours' layers, which its coarse levels and the adjoint
        solve step. Change layers after construction through this method (register a hook, set
        an attribute, replace a submodule) on every rank, e.g.
        ``lp.apply_to_layers(lambda j, m: m.register_forward_hook(hook))``: a change made
        through ``self.layers`` alone does not reach the copies, and the next forward pass
        raises :class:`LayerError` naming the layer instead of computing wrong gradients.
        """
        for j, m in sorted(self._held().items(), key=operator.itemgetter(0)):
            fn(j, m)
        self.refresh()
        return self

    def _check_structure(self, modules, listed=None):
        """Every halo layer, and every layer of the list when one was given (``listed``: every rank holds
        all of them), has the classes, parameters and buffers of its owner's layer (collective): ranks whose
        lists differ where neither holds the other's layer trained a network of both, silently."""
        r = self._comm.rank
        mine = {j: _layout(m) for j, m in modules.items() if j in self.plan.owned[r]}
        every = {}
        for part in self._comm.gather(mine, root=None):
            every.update(part)
        for j, m in sorted({**(listed or {}), **modules}.items(), key=operator.itemgetter(0)):
            if j not in self.plan.owned[r] and _layout(m) != every.get(j):
                raise ValueError(
                    f"layer {j} differs between ranks: rank {self.plan.owner(j)} (its owner) builds "
                    f"{every.get(j)}, rank {r} builds {_layout(m)}; every rank must build the same "
                    "layers (the same factory, or the same list)")

    def _check_sharing(self, modules):
        seen = {}
        for j, m in modules.items():
            for p in m.parameters():
                k = seen.setdefault(id(p), j)
                if k != j:
                    raise ValueError(
                        f"layers {k} and {j} share a parameter; shared (tied) parameters across layers are "
                        "supported on one rank only, since each rank would update its own copy. Give every "
                        "layer its own parameters, or run on one rank")

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        for m in self._halo.values():  # halo layers are not submodules (no stale copies in state_dict)
            m._apply(fn, *args, **kwargs)
        # (the warm-start trajectory stays: it is used only for an input of its shape, dtype and device, which a
        # conversion of the block to another dtype or device changes alike on every rank)
        return out

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self._warm = None  # other weights (a rollback, a checkpoint): the next pass starts cold, as a new block's
        # a serial network's entries, as torch saves them: say what loads (torch passes strict=True here whatever
        # the caller asked: a load_state_dict(strict=False) leaves them among the unexpected keys)
        if strict and self._comm.size > 1 and _loading_strictly():
            head = prefix + "layers."
            held = {k[len(head):].split(".", 1)[0] for k in state_dict if k.startswith(head)}
            others = {int(j) for j in held if j.isdigit()} - set(self.owned_layers)
            if others:
                error_msgs.append(
                    f"the LayerParallel {prefix[:-1] or 'block'!r} holds {len(self.owned_layers)} of its "
                    f"{self.n_layers} layers on this rank, and the state dict has entries of {len(others)} others, "
                    "as a serial network's: load those with lp.load_serial(state_dict) on every rank"
                    + (f" (its entries without the prefix {prefix!r}), the rest of the model with strict=False"
                       if prefix else "")
                    + "; load_state_dict(..., strict=False) alone loads the layers each rank owns (the others' "
                    "entries come back as unexpected keys), not a layer's extra state in the copies of neighbours' "
                    "layers a rank keeps, which load_serial fills too")
        # load_state_dict(assign=True) puts the checkpoint's tensors in the owned layers, in its dtype and on its
        # device; once the layers are loaded, _halo_follows_assign brings the halo copies along, as .to() does
        if local_metadata.get("assign_to_params_buffers", False) and self._halo:
            self._assigned = self._owned_kinds()

    def _owned_kinds(self) -> dict:
        """``{name: (device, dtype)}`` of the owned layers' parameters and buffers."""
        return {n: (t.device, t.dtype) for n, t in (*self.layers.named_parameters(), *self.layers.named_buffers())}

    def _halo_like_owned(self, before: dict) -> None:
        """Move the halo copies' tensors as a load with ``assign=True`` moved the owned layers' (``before``:
        their kinds before it): each (device, dtype) that the owned tensors of that kind all left for one
        other goes there in the copies too (their values come from the owners at every pass; a copy on the
        meta device gets storage). Kinds that changed in different ways, or not at all, stay."""
        after, moves = self._owned_kinds(), {}
        for n, old in before.items():
            moves.setdefault(old, set()).add(after.get(n, old))
        moves = {old: next(iter(new)) for old, new in moves.items() if len(new) == 1 and old not in new}
        if not moves:
            return

        def move(t):
            new = moves.get((t.device, t.dtype))
            if new is None:
                return t
            return torch.empty_like(t, device=new[0], dtype=new[1]) if t.is_meta else t.to(new[0], new[1])

        for m in self._halo.values():
            m._apply(move)

    def train(self, mode: bool = True):
        super().train(mode)
        for m in self._halo.values():
            m.train(mode)
        # the halo copies take the flags their owners had at the last pass in this mode (a training loop
        # that calls lp.train() and then puts the same layers in eval each step makes no extra handshake;
        # the pass's handshake checks the flags anyway)
        for j, want in self._owner_flags.get(mode, {}).items():
            self._set_halo_flags(j, want)
        return self

    def _set_halo_flags(self, j, want):
        """The training flags ``want`` (its owner's) on halo copy ``j``, except on the submodules it shares
        with other layers this rank holds (see :meth:`_halo_flags`); left alone when the copy's submodules
        differ in number from its owner's."""
        subs = list(self._halo[j].modules())
        if len(subs) == len(want):
            for sub, w in zip(subs, want):
                if id(sub) not in self._shared_subs:
                    sub.training = bool(w)

    # -- checks ----------------------------------------------------------------
    def _check_layers(self):
        for j, s in self._special:
            if s.training and isinstance(s, nn.SyncBatchNorm):
                raise LayerError(
                    f"layer {j} contains SyncBatchNorm in training mode: LayerParallel computes every layer's "
                    "batch statistics itself (over this process's batch); use nn.BatchNorm1d/2d/3d")

    def _batch_stat_layers(self) -> list:
        """BatchNorm modules in training mode that track running statistics: during the solves they
        normalise with the batch statistics of their input and leave the running ones alone."""
        return [s for _, s in self._special if isinstance(s, _STATEFUL) and s.training and s.track_running_stats]

    def _dropout_note(self, x):
        """``(key, note)``: what the dropout plan of inputs like ``x`` depends on on this rank, and
        what the pass's handshake shares of it with the other ranks (None on one process)."""
        key = (tuple(x.shape), x.dtype, str(x.device),
               tuple(s.p for _, s in self._special if isinstance(s, _RANDOM)), memory_layout(x))  # (masks follow it)
        if self._comm.size == 1:
            return key, None
        return key, (self._comm.rank, key != self._dropout_key, _rng_digest(x.device), (key[0], key[1], key[4]))

    def _dropout_plan(self, kp, x, key, parts=None):
        """The dropout calls of every layer for inputs like ``x`` (collective on several ranks):
        ``{layer: [(function name, input shape, p, input strides), ...]}`` for the layers that drop out.

        Recorded again whenever the input's shape, the dropout rates or the layers' modes changed on
        any rank; on several ranks the random states of all ranks must agree when there are masks.
        ``key`` and ``parts`` (every rank's note, on several ranks) come from :meth:`_dropout_note`.
        """
        stale, digests = key != self._dropout_key, None
        layouts = None
        if parts is not None:
            shapes = {r: k[:2] for r, _, _, k in parts}
            if len(set(shapes.values())) > 1:
                raise ValueError(f"the ranks of the layer communicator pass inputs of different shapes or dtypes "
                                 f"(rank: (shape, dtype) {shapes}); every rank must pass the same input")
            layouts = {r: k[2] for r, _, _, k in parts}
            digests = [(r, f, d) for r, f, d, _ in parts]
            stale = any(f for _, f, _ in digests)
        if stale:
            self._record_dropout(kp, x, key)
        if self._dropout_calls and layouts is not None and len(set(layouts.values())) > 1:
            raise ValueError(
                "the layers use dropout, whose masks follow the memory layout of their input, and the ranks of the "
                f"layer communicator pass inputs in different layouts (rank: strides {layouts}): pass the same "
                "layout on every rank, e.g. x.contiguous() or x.contiguous(memory_format=torch.channels_last) on "
                "each")
        if self._dropout_calls and digests is not None and len({d for _, _, d in digests}) > 1:
            raise ValueError(
                "the layers use dropout, and the ranks of the layer communicator have different torch random "
                f"states (rank, digest: {[(r, d) for r, _, d in digests]}): every rank draws the masks of all "
                "layers, as the serial network would, so seed every rank alike (torch.manual_seed(s) on each) "
                "and draw other random numbers equally on all of them")
        return self._dropout_calls

    def _record_dropout(self, kp, x, key):
        dt = torch.as_tensor(self.h, dtype=x.dtype, device=x.device)
        owned, mine = set(self.owned_layers), {}
        # (a look at the layers: the pass's draws stay the serial ones, their buffers as they were)
        moved = None  # (a layer whose step returns the state in another memory layout than it got)
        with _random_states_kept(x.device), self._buffers_kept(kp):
            for c in self.kernel.classes:
                js = [int(j) for j in c.members if int(j) in owned]
                if js:
                    calls, layout = kp.record_dropout(js[0], x.detach(), dt)  # interchangeable layers: the same
                    mine.update({j: calls for j in js if calls})
                    if moved is None and layout is not None and layout != key[4]:  # (key[4]: x's layout)
                        moved = (js[0], type(c.template).__name__, key[4], layout)
        calls, every = mine, [moved]
        if self._comm.size > 1:
            calls, every = {}, []
            for part, m in self._comm.gather((mine, moved), root=None):
                calls.update(part)
                every.append(m)
        moved = next((m for m in every if m is not None), None)
        if calls and moved is not None:
            j, name, before, after = moved
            raise LayerError(
                f"layer {j} ({name}) returns the state in another memory layout than it gets (strides {before} -> "
                f"{after}, e.g. a .contiguous(memory_format=...) in the layer or the scheme), and the layers use "
                "dropout, whose masks follow the layout of their input: the serial network's later layers would "
                "draw them in the new layout, which LayerParallel, drawing every layer's masks from the block's "
                "input, does not follow. Keep the state's layout in every step, or pass the input in the layout "
                "the steps return")
        self._dropout_key, self._dropout_calls = key, calls

    def _draw_masks(self, kp, calls, x):
        """Each layer's masks, drawn once per pass in serial layer order (every rank draws all,
        keeping those of the layers it holds)."""
        held, masks = kp.k.modules, {}
        for j in sorted(calls):
            m = draw_masks(calls[j], x.dtype, x.device)
            if j in held:
                masks[j] = m
        kp.masks = masks or None

    def _update_running_stats(self, kp, U, g0, x):
        """One plain evaluation of every owned layer that holds BatchNorm, at its input state of the
        returned trajectory: the running statistics advance once per pass, as in the serial network."""
        dt = torch.as_tensor(self.h, dtype=x.dtype, device=x.device)
        ids = {id(b) for b in kp.batch_stats}
        with _tracking(kp.batch_stats, True), torch.no_grad():  # inside the solves' "off"
            for j, m in self.layers.items():
                if not any(id(s) in ids for s in m.modules()):
                    continue
                masks = kp.masks.get(j) if kp.masks else None
                with DropoutMasks(masks) if masks else contextlib.nullcontext():
                    self.scheme(m, U[j - g0], dt)

    def _check_input(self, x):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"LayerParallel expects a torch.Tensor, got {type(x).__name__}")
        if not (x.is_floating_point() or x.is_complex()):
            raise TypeError(f"LayerParallel expects a floating-point input, got dtype {x.dtype}; "
                            "convert it, e.g. x.float()")
        wider = B.arithmetic_dtype(x)
        if wider is not None:
            raise TypeError(f"LayerParallel got an input of dtype {x.dtype}, for which torch has no sums, norms or "
                            f"comparisons (the solves' residuals and checks); convert it and the block, e.g. "
                            f"x.to(torch.{wider}) and lp.to(torch.{wider})")
        if x.numel() == 0:
            what = ("skip empty batches before the block (e.g. `if x.shape[0]: ...`)" if self._data_comm is None else
                    "on a layer x data grid the other data replicas all-reduce their gradients this step, so a "
                    "replica with an empty shard must not skip it: call allreduce_gradients(model, data_comm, "
                    "shard_size=0) instead of its forward and backward pass (or drop the last, short batch: "
                    "DataLoader(..., drop_last=True))")
            raise ValueError(f"LayerParallel got an empty input (shape {tuple(x.shape)}): a solve needs states "
                             f"with at least one element; {what}")
        if not bool(torch.isfinite(x).all()):
            raise ValueError("LayerParallel got an input that contains NaN or Inf: check the data and what "
                             "comes before the block")

    # -- forward --------------------------------------------------------------
    def _no_export(self) -> RuntimeError:
        return RuntimeError(_NO_EXPORT.format(
            cls="LayerParallel", serial="lp.to_serial() holds the same layers and computes what the block "
                                        "computes in eval mode (exact stepping)"))

    def __prepare_scriptable__(self):
        """torch.jit.script calls this first (on every submodule): our error, not its compiler's."""
        raise self._no_export()

    @_eager_under_compile
    def forward(self, x):
        if _exporting():
            raise self._no_export()
        if _functorch_active():
            raise RuntimeError(_no_transforms(what="torch.func transforms (grad, vmap, jacrev, jvp, ...)"))
        if torch.is_inference_mode_enabled():
            # inference tensors carry no version counters, which the solve's checks read: run the pass as
            # under no_grad, on a normal copy of the input (the output is a normal tensor)
            with torch.inference_mode(False), torch.no_grad():
                return self.forward(x.clone() if isinstance(x, torch.Tensor) else x)
        if isinstance(x, torch.Tensor) and x.is_inference():
            # an input made under inference_mode (features computed there before), used outside it: a normal
            # copy, as above (the first pass's checks differentiate a layer by its input; the serial network
            # takes such an input under no_grad and raises torch's own error with grad enabled, which a pass
            # on the copy need not)
            x = x.clone()
        try:
            modes = _modes(self._subs, self._modes)
            same = _unchanged(self._slots, self._stamp)
            if modes != self._modes or not same:
                # train/eval, hooks, attributes or submodules changed for some layers: inspect them again (only
                # the flags, when no hook was registered since the last pass: its hook counts are current)
                self._build_kernel(modes_only=same and modes[1:] == self._modes[1:])
            else:
                self._modes = modes  # the new hook-handle counter
            try:
                kp = self.kernel.bind(one_pass=True)
            except KeyError:  # a parameter or buffer moved since the layers were inspected (a parametrization
                self._build_kernel()  # registered, a parameter deleted): inspect them again
                kp = self.kernel.bind(one_pass=True)
            params = kp.flat_params(self.owned_layers)  # frozen ones too: autograd checks their versions
            needs = any(p.requires_grad for p in params)
            self._called = True  # (the pass says when no code of the layers ran: see _forward_solve_in_modes)
            grads = torch.is_grad_enabled() and (self._comm.size > 1 or getattr(x, "requires_grad", False) or needs)
            if grads and self._probed == _PROBED_WITHOUT_GRAD:
                # the checks of the layers' graphs ran in a pass without gradients (a first validation under
                # no_grad): a tensor from outside a layer (a hook's, a closure's) that requires grad only in
                # training passes was not seen. Check again, once
                self._probed = False
            self._grad_pass = grads  # (read by _probe)
            with uncached_parametrizations():  # (the backward pass suspends it again)
                if grads:
                    # every rank takes the autograd path (and so joins the adjoint solve in backward)
                    anchor = torch.zeros((), requires_grad=self._comm.size > 1)
                    y = _LayerParallelFunction.apply(self, kp, anchor, x, *params)
                else:
                    y = self._forward_solve(kp, x)[0]
            if self._called:  # what the layers set when the pass called them is not a change
                self._restamp()
            return y
        except BaseException as exc:
            self._alarm(exc)
            stage = getattr(self, "_stage", None)  # (a MultiStage stage: "layer 0" is its own numbering)
            if stage and isinstance(exc, LayerError) and exc.args and isinstance(exc.args[0], str) \
                    and not exc.args[0].startswith("piece "):
                exc.args = (f"{stage}: {exc.args[0]}",) + exc.args[1:]
            raise

    def _restamp(self) -> None:
        """Record the layers' attributes and submodules as they are now: the next forward pass compares
        them (``_unchanged``) and inspects the layers again on a change."""
        self._stamp = _attribute_values(self._slots)

    def _session(self, what: str, signature=None, share=None, agree: str = ""):
        """A failure-aware communicator session on several ranks; nothing on one. Its handshake also
        compares the module's id (ranks that call different blocks, in another order, raise) and names
        the call, ``what`` (ranks in different calls raise naming each one's)."""
        if self._comm.size > 1:
            name = "building a LayerParallel" if self._uid is None else \
                f"{what} of LayerParallel #{self._uid} ({self.n_layers} layers)"
            return _one_thread(self, self._comm.session(signature=Call(name, (self._uid, signature), agree),
                                                        share=share))
        return contextlib.nullcontext()

    def _network(self) -> tuple:
        """The network's settings every layer rank must build alike (compared at build): the number of
        layers, T, the MGRIT options, the scheme and the layer index."""
        return self.n_layers, self.T, repr(self.options), _named(self.scheme), _named(self.layer_index)

    def _replica_settings(self) -> tuple:
        """What the data replicas of this block must share (compared by allreduce_gradients): the network
        whose gradients it averages and its solves' cycles and tolerances (SerialSwitch, given the data
        communicator, changes them alike on every replica)."""
        net = dict(zip(("n_layers", "T", "options", "scheme", "layer_index"), self._network()))
        return tuple(net.items()) + (("spatial", self.spatial is not None), ("fwd_iters", self.fwd_iters),
                                     ("bwd_iters", self.bwd_iters), ("fwd_tol", self.fwd_tol),
                                     ("bwd_tol", self.bwd_tol), ("tol_type", self.tol_type), ("skip", self.skip),
                                     ("warm_start", self.warm_start), ("exact_eval", self.exact_eval))

    def _pass_signature(self, x, exact: bool):
        """What every rank must agree on for the forward solve (the pass's session handshake compares
        it, in place of the solve's own check): the input's shape and dtype, autocast, the time grid, and the
        solve's settings (exact inference, or the cycles, tolerance, hierarchy and skip; whether a warm
        start replaces the skip the ranks agree on in the handshake). None on one process (no handshake)."""
        if self._comm.size == 1:
            return None
        common = (exact, tuple(x.shape), str(x.dtype), self.t.tobytes(), str(_autocast_on(x)))
        if exact:
            return args_signature(*common)
        return args_signature(*common, tuple(self.options.items()), self.fwd_iters, self.fwd_tol, self.tol_type,
                              self.skip, self.warm_start, self.spatial is None)

    def _solve_comm(self):
        """The communicator the forward solve runs on: inside the pass's session (InSession), so that
        it adds no handshake and no closing barrier of its own; failures reach every rank through the
        pass's session. (The adjoint solve runs in reverse rank order inside the backward pass's session.)"""
        return InSession(self._comm) if self._comm.size > 1 else self._comm

    def _adjoint_signature(self, gy):
        """What every rank must agree on for the adjoint solve (the backward pass's session handshake
        compares it, in place of the solve's own check): the output gradient's shape and dtype, the
        time grid and the adjoint solve's settings. None on one process (no handshake)."""
        if self._comm.size == 1:
            return None
        return args_signature(tuple(gy.shape), str(gy.dtype), self.t.tobytes(), tuple(self.options.items()),
                              self.bwd_iters, self.bwd_tol, self.tol_type, self.skip, self.spatial is None)

    def _adjoint_comm(self):
        """The communicator the adjoint solve runs on: the module's, in reverse rank order (the solve runs
        backwards in time), inside the backward pass's session."""
        return ReversedInSession(self._comm) if self._comm.size > 1 else self._comm

    def _alarm(self, exc):
        if self._data_comm is not None and self._data_comm.size > 1:
            self._data_comm.alarm(exc)

    def _initial_guess(self, x):
        """Warm start: the previous trajectory, shifted by the change of the input.

        ``u_i ~ x + (u_i_prev - x_prev)``: for a new minibatch the previous
        increments are a better guess than the previous states themselves.
        """
        key = (tuple(x.shape), x.dtype, x.device)
        if not self.warm_start or self._warm is None or self._warm[0] != key:
            return None
        U, g0, x_prev = self._warm[1:]
        shift = x.detach() - x_prev
        h = self.h

        def guess(t):
            return U[int(round(t / h)) - g0] + shift

        return guess

    def _forward_solve(self, kp, x):
        for _ in range(3):
            kp.subs, kp.modes, kp.batch_stats = self._subs, self._modes, self._batch_stat_layers()
            with _pass_modes(kp.subs, kp.modes, kp.batch_stats, current=True):  # forward() just checked them
                out = self._forward_solve_in_modes(kp, x)
            if isinstance(out, Exception):  # found alike on every rank in the pass's handshake
                raise out
            if out is not None:
                return out
            # a halo copy took its owner's training flags (every rank returned None): regroup the layers
            # and run the pass again (collective; the synced flags belong to the copies alone, so once)
            with _announced(self._comm):
                self._build_kernel(modes_only=True)
                kp = self.kernel.bind(one_pass=True)
        raise LayerError(  # every rank decides alike (from the flags all of them shared): no one waits
            "the training flags of the layers' halo copies (kept by the neighbouring ranks) do not settle on "
            "their owners' flags; set train/eval the same way on every rank (lp.train() / lp.eval())")

    def _halo_flags(self) -> dict:
        """``{layer: training flags of its submodules}`` of the layers this rank sends or receives in
        the halo: the owners' flags are the truth, the receivers' copies follow them. A receiver
        marks (2) the submodules its copy shares with other layers it holds: they keep their own
        flags (setting them would change those layers too)."""
        r, halo, own, shared = self._comm.rank, self._halo, self.layers, self._shared_subs
        return {j: (bytes(2 if id(s) in shared else s.training for s in halo[j].modules()) if u == r
                    else bytes(map(_TRAINING, own[j].modules())))
                for o, u, j in self.plan.halo if r in (o, u)}

    def _adopt_halo_modes(self, flags) -> bool:
        """Set this rank's halo copies to their owners' training flags (``flags``: every rank's
        :meth:`_halo_flags`). True on every rank when some copy on some rank differed. Copies whose
        submodules differ in number from their owner's are left alone."""
        r, stale = self._comm.rank, False
        for owner, user, j in self.plan.halo:
            want, have = flags[owner][j], flags[user][j]
            if len(want) != len(have):
                continue
            if user == r:
                self._owner_flags.setdefault(self.training, {})[j] = want  # for train(): see there
            if all(h == 2 or w == h for w, h in zip(want, have)):
                continue
            stale = True
            if user == r:
                self._set_halo_flags(j, want)
        return stale

    def _forward_solve_in_modes(self, kp, x):
        P, r = self._comm.size, self._comm.rank
        exact = self.exact_eval and not self.training  # inference: the serial network's output
        with _announced(self._comm):  # the local checks first: a rank that fails tells the others
            self._check_input(x)
            self._check_layers()
            if not exact:  # (the settings may have changed since the block was built)
                _check_warm_tolerance(self.warm_start, self.fwd_tol, self.tol_type)
            guess = None if exact else self._initial_guess(x)
            sig = self._pass_signature(x, exact=exact)
            key, note = self._dropout_note(x)
            # the lent layers are checked when a rank rebuilt its kernel or registered a hook, and in every
            # pass when some rank holds layers it calls (looped or vmapped: an attribute change shows at once)
            changed = (self._checked != (self.kernel, RemovableHandle.next_id)
                       or any(c.mode != "dense" for c in kp.k.classes))
            pairs = self._halo_pairs(kp) if P > 1 else None
            crc = _crc(x) if P > 1 and changed and x.device.type == "cpu" else None  # (see _halo_rtol)
            share = (note, self._halo_flags(), _input_sums(x), changed,
                     {pair: _packed_size(vs) for pair, (vs, _) in pairs.items()}, self._pass_id,
                     guess is None, crc) if P > 1 else None
        # One session around the whole pass, the solve included (it runs inside it, and the handshake
        # compares what the solve needs every rank to agree on, and shares the ranks' dropout notes and
        # halo layers' training flags): a failure anywhere reaches every rank.
        session = self._session(_pass_name(exact) + self._pass_note, sig, share, _FORWARD_AGREE)
        with session:
            notes = None
            if P > 1:
                notes, flags, sums, changed, nbytes, ids, cold, crcs = zip(*session.shared)
                if any(cold):  # a warm start on every rank or on none (a state dict loaded on some ranks only)
                    guess = None
                # this pass's id, the same on every rank (after a pass that failed on some rank before its
                # handshake the ranks' counts differ: the largest goes on), compared by the backward pass
                self._pass_id = max(ids) + 1
                differ = _differing_inputs(sums) or self._differing_layout(nbytes)
                if differ is not None:
                    return differ  # every rank found it: raised after the session closes (no one waits)
                # layers set to train/eval one by one (not through lp.train()/eval()) on their owner only
                if self._adopt_halo_modes(list(flags)):
                    return None
            calls = self._dropout_plan(kp, x, key, notes)
            if calls:
                self._draw_masks(kp, calls, x)
            if P > 1:
                now = (self.kernel, RemovableHandle.next_id)
                spread = max(_input_gap(s, sums[0]) for s in sums)
                rtol = _halo_rtol(x.dtype, None not in crcs and len(set(crcs)) == 1, spread)
                self._exchange_halo(pairs, kp, x, check=any(changed), rtol=rtol)  # after the masks
                self._checked = now
            repeating = not self._repeated and not exact  # (exact inference calls each layer once, as serial)
            again = self._probe_in_turn(kp) if self._probed is True and self._grad_pass else None
            called = (bool(calls) or (P > 1 and any(changed)) or not self._probed or repeating
                      or again is not None)  # the layers' code ran
            if not self._probed or repeating:
                # (checks: they must not move the generators a pass uses, nor a layer's buffers)
                with _random_states_kept(x.device), self._buffers_kept(kp):
                    if not self._probed:
                        self._probe(kp, x)
                    if repeating:
                        self._check_repeatable(kp, x)
            elif again is not None:  # (the first pass's checks put the buffers back; a layer that changes
                versions = self._buffer_versions(kp)  # them was refused there: only the counters, no copies)
                with _random_states_kept(x.device):
                    self._probe(kp, x, again)
                self._check_buffers(kp, versions)
            prop = ODEPropagator(kp, self.h, layer_index=self.layer_index)
            prop.autocast = _autocast_on(x)  # (the adjoint widens a trajectory stored in this dtype)
            # dense layers are stepped by the traced linear map and activations alone: no code of theirs
            # runs in the solve, so there is nothing to check for side effects
            pure = self.spatial is None and all(c.mode == "dense" for c in kp.k.classes)
            self._called = called or not pure
            versions = None if pure else self._buffer_versions(kp)
            # (exact inference steps every layer once, in order: the serial network's draws; the checks that
            # call layers keep the random states) (a change through .data passes the version counters: the
            # values are compared once, on the first training pass)
            rng = [_random_states()] if not pure and not exact else None
            snapshot = [b.detach().clone() for b in kp.buffers] if not pure and repeating else None
            callback = self.callback
            if rng is not None and callback is not None:  # a callback may draw: the layers' draws are those
                def callback(info, user=self.callback, rng=rng):  # before it, the baseline moves past it
                    _check_random(rng[0])
                    user(info)
                    rng[0] = _random_states()
            with torch.no_grad():
                if exact:
                    res = mgrit.solve(prop, x.detach(), self.t, max_levels=1, comm=self._solve_comm(),
                                      final_residual=True)
                else:
                    props, transfers = self._spatial_forward(prop, x)  # (prop, None) without spatial coarsening
                    res = mgrit.solve(props, x.detach(), self.t, **self.options, tol=self.fwd_tol,
                                      tol_type=self.tol_type, max_iter=self.fwd_iters,
                                      skip=self.skip and guess is None, initial_guess=guess, comm=self._solve_comm(),
                                      callback=callback, final_residual=True, spatial=transfers)
            self.last_forward = res.without_states()
            U, g0 = res.u, self.lo
            if versions is not None:
                self._check_buffers(kp, versions, snapshot)
            if rng is not None:
                _check_random(rng[0])
            if P > 1:
                U, g0 = res.with_ghost() if len(U) else (U, g0)  # the left neighbour's last state in front
            if kp.batch_stats:
                self._update_running_stats(kp, U, g0, x)
            if P == 1:
                y = U[-1].clone()
            else:
                root = self.plan.owner_of_point(self.n_layers)
                y = self._comm.bcast_state(U[-1].clone() if r == root else None, x, root=root)
            fmt = _channels_last_format(x)
            if fmt is not None:  # (the serial network's convolutions keep such an input's memory format)
                y = y.contiguous(memory_format=fmt)
        # after the checks: an error comes first
        _warn_solve(res, "forward", "fwd_iters", None if exact else self.fwd_tol, self.tol_type, x.dtype, (x, y),
                    ends=(y,), compute=_cast_to(x.dtype, prop.autocast))
        if self.warm_start:
            self._warm = ((tuple(x.shape), x.dtype, x.device), U, g0, x.detach().clone())
        return y, (prop, U, g0, x.shape)

    @staticmethod
    def _buffer_versions(kp) -> list:
        """Version counter and memory address of every buffer (``b.data = ...`` keeps the counter and the
        tensor object but not the memory)."""
        return [(b._version, b.data_ptr()) for b in kp.buffers]

    @contextlib.contextmanager
    def _buffers_kept(self, kp):
        """The first pass's checks call layers with their own buffers: one that changes them is a LayerError,
        and the buffers are put back as they were (the checks leave no trace)."""
        versions = self._buffer_versions(kp)
        saved = [b.detach().clone() for b in kp.buffers]
        try:
            yield
            self._check_buffers(kp, versions, saved)  # (the values too: a native batch_norm's update of its
        except LayerError:                               # running statistics leaves the version counter)
            with torch.no_grad():
                for b, v in zip(kp.buffers, saved):
                    if b.shape != v.shape:  # (resized in the call: an observer's empty min_val)
                        b.resize_(v.shape)
                    b.copy_(v)
            raise

    def _check_buffers(self, kp, versions, snapshot=None):
        now = self._buffer_versions(kp)
        current = [d[a] for d, a in kp.k._bflat]
        same = [a == b and c is d and (snapshot is None or _same_values(c, e))
                for a, b, c, d, e in zip(now, versions, kp.buffers, current, snapshot or current)]
        copy = kp.changed_copy() if all(same) else None  # changed in a batched call: the stacked copies
        if not all(same) or copy is not None:
            if copy is None:
                k = same.index(False)
                j = next(j for j, (_, _, b0, bn) in kp.k._span.items() if b0 <= k < b0 + len(bn))
                name, owner, _ = kp.k.slots[j][1][k - kp.k._span[j][2]]
            else:
                j = int(kp.k.classes[copy[0]].members[0])
                name = copy[1]
                owner = next((o for n, o, _ in kp.k.slots[j][1] if n == name), None)
            hint = (f" ({type(owner).__name__} tracks running statistics in training mode: construct it with "
                    "track_running_stats=False; BatchNorm is handled, other running statistics are not)"
                    if getattr(owner, "track_running_stats", False) else
                    f" ({type(owner).__name__} is a quantization observer, which records statistics in eval mode "
                    "too: calibrate with the serial network (lp.to_serial()), then switch the observers off, "
                    "model.apply(torch.ao.quantization.disable_observer), before training the block)"
                    if _is_observer(owner) else "")
            raise LayerError(
                f"layer {j} changed its buffer `{name}` during the forward pass{hint}. MGRIT evaluates every "
                "layer many times per pass; put such layers in eval mode or make them pure functions of "
                "their input")

    def _probe_in_turn(self, kp) -> list | None:
        """After the first pass with gradients, each later one probes one class whose layers' code runs (not
        dense), in turn: a tensor from outside the layers (a hook's, a closure's) that starts to require grad
        later (a conditioning network unfrozen) is caught within as many passes as there are such classes.
        Dense classes read nothing but their parameters, unless the user's own scheme steps them (its code
        runs in every step, and may read such a tensor: a learnable step size). None when there are none."""
        loose = [c for c in kp.k.classes if c.mode != "dense" or own_scheme(self.scheme)]
        if not loose:
            return None
        self._probe_turn = (getattr(self, "_probe_turn", -1) + 1) % len(loose)
        return [loose[self._probe_turn]]

    def _probe(self, kp, x, classes=None):
        """Evaluate one layer of every class (or of ``classes``) with autograd once, and reject layers that
        use tensors requiring grad that are not their own parameters (they would get no gradient)."""
        dt = torch.as_tensor(self.h, dtype=x.dtype, device=x.device)
        for c in self.kernel.classes if classes is None else classes:
            j = int(c.members[0])
            leaves = {n: v.detach().requires_grad_(True) for n, v in kp.value(j)[0].items()}
            u = x.detach().requires_grad_(True)  # (as in the adjoint's VJPs: a layer may differentiate by it)
            with torch.enable_grad():
                out = kp._call_layer(j, u, dt, params=leaves)
            foreign = _foreign_leaves(out, {id(v) for v in leaves.values()} | {id(u)})
            if foreign:
                raise LayerError(
                    f"layer {j} ({type(c.template).__name__}) uses a tensor that requires grad but is not one of "
                    f"its parameters (shape {tuple(foreign[0].shape)}; e.g. a parameter of another module read "
                    "in forward). It would get no gradient: register it in the layer (nn.Parameter), or "
                    f"detach it{scheme_note(self.scheme, grad=True)}")
        if classes is None:
            self._probed = True if getattr(self, "_grad_pass", True) else _PROBED_WITHOUT_GRAD

    def _check_repeatable(self, kp, x):
        """Call one layer of every class twice on the pass's input and reject a layer whose two outputs differ
        (random numbers from generators no check sees, state it changes): MGRIT calls every layer many times."""
        dt = torch.as_tensor(self.h, dtype=x.dtype, device=x.device)
        with torch.no_grad():
            for c in self.kernel.classes:
                j = int(c.members[0])
                before, versions = _random_states(), self._buffer_versions(kp)
                first, again = (kp._call_layer(j, x.detach(), dt) for _ in range(2))
                tol = rounding_tolerance(first.dtype)
                scale = float(first.abs().max()) if first.numel() else 0.0
                if not (_same_values(first, again) or torch.allclose(first, again, rtol=tol,
                                                                      atol=tol * (1.0 + scale))):
                    if _random_moved(before):  # the global generators: the message of the solve's own check
                        raise _random_error(c)
                    self._check_buffers(kp, versions)  # a buffer it changes: that message
                    raise LayerError(
                        f"layer {j} ({type(c.template).__name__}) gave another output when called twice on the "
                        f"same state (largest difference {float((first - again).abs().max()):.3g}): it draws random "
                        "numbers from a source LayerParallel cannot fix for a pass (a numpy Generator, Python's "
                        "random, a torch Generator of its own), or its output depends on state it changes when "
                        "called. MGRIT evaluates every layer many times per pass; draw such noise outside the "
                        f"layers, or make them pure functions of their input{scheme_note(self.scheme)}")
        self._repeated = True

    def _halo_pairs(self, kp) -> dict:
        """``{(owner, user): (parameters and buffers, layers)}`` of the layers lent in this rank's halo
        pairs, in halo order: the owner's tensors, or the copies' that receive them."""
        r, pairs = self._comm.rank, {}
        for owner, user, j in self.plan.halo:
            if r in (owner, user):
                p, b = kp.value(j)
                vs, js = pairs.setdefault((owner, user), ([], []))
                vs.extend(list(p.values()) + list(b.values()))
                js.append(j)
        return pairs

    def _differing_layout(self, nbytes) -> LayerError | None:
        """The error to raise when a lent layer's parameters and buffers differ in size between its owner
        and the copy (``nbytes``: every rank's ``{pair: bytes}`` of :meth:`_halo_pairs`, shared in the
        pass's handshake), else None; alike on every rank."""
        for owner, user, j in self.plan.halo:
            if nbytes[owner].get((owner, user)) != nbytes[user].get((owner, user)):
                return LayerError(
                    f"the layers rank {owner} lends to rank {user} (layer {j} among them) have other parameters or "
                    "buffers on the owner than in the copy: a parametrization, a parameter or a buffer was added, "
                    "removed, resized or converted to another dtype on one of them only (the model converted, e.g. "
                    ".to(torch.bfloat16), on some ranks only; a change through lp.layers, which lists a rank's own "
                    "layers only). Convert the model on every rank, and make changes to layers there with "
                    "lp.apply_to_layers(fn), which reaches the copies too")
        return None

    def _exchange_halo(self, pairs, kp, x, check: bool = True, rtol: float = 1e-5):
        """Owners send the current parameters and buffers of halo layers to their users: one message
        per (owner, user) pair of ``pairs`` (:meth:`_halo_pairs`), the tensors' bytes packed in halo order.

        With ``check`` (see the pass) a check of each layer travels with them: two norms of
        ``step(x)`` for the pass's input ``x`` (:meth:`_layer_checks`; ``rtol`` is made from whether the ranks'
        inputs have the same bits, and else from the relative ``spread`` the handshake measured:
        :func:`_halo_rtol`). The user steps
        its copy, with the parameters just received, and raises :class:`LayerError` (the others
        then raise RemoteRankError) when they differ: a change made to a layer on its
        owner only (a hook, an attribute, a submodule) would give wrong gradients, whereas changes
        that do not alter what the layer computes (a counter, a logging hook, a per-rank device
        attribute) pass."""
        c, r = self._comm, self._comm.rank
        z = x.detach() if check else None
        with torch.no_grad():
            for (owner, user), (vs, js) in pairs.items():
                if owner == r and (vs or check):
                    sent = vs + [self._layer_checks(kp, js, z)] if check else vs
                    c.send(_packed(_halo_order(sent)), user, Tag.HALO)
            for (owner, user), (vs, js) in pairs.items():
                if user == r and (vs or check):
                    got = torch.empty(2 * len(js), dtype=torch.float64, device=x.device)
                    vs = vs + [got] if check else vs
                    like = torch.empty(_packed_size(vs), dtype=torch.uint8, device=x.device)
                    _unpack(c.recv(like, owner, Tag.HALO), _halo_order(vs))
                    if not check:
                        continue
                    mine = self._layer_checks(kp, js, z)
                    for k, j in enumerate(js):
                        if not _same_check(got[2 * k: 2 * k + 2].tolist(), mine[2 * k: 2 * k + 2].tolist(), rtol):
                            raise LayerError(
                                f"layer {j} (owned by rank {owner}) computes differently from the copy rank {r} keeps "
                                "of it for its coarse levels and the adjoint solve (compared on this input): a "
                                "hook, an attribute or a submodule was changed on one of them only, e.g. through "
                                "lp.layers, which lists a rank's own layers only. Make such changes on every rank "
                                "with lp.apply_to_layers(fn), which reaches the copies too")

    @staticmethod
    def _layer_checks(kp, js, z):
        """``[|s_j - z|, |s_j|]`` (2-norms, float64) for ``s_j = step_j(z)`` with step 1, every ``j`` (compared
        relative to the larger, :func:`_same_check`: the first cancels where ``z`` outweighs the layer's
        update; a sign flip of the layer changes the second)."""
        norm, acc = torch.linalg.vector_norm, torch.complex128 if z.is_complex() else torch.float64
        out = []
        for j in js:
            s = kp.step_one(z, j, 1.0)
            out += [norm(s - z, dtype=acc), norm(s, dtype=acc)]
        return torch.stack(out).to(torch.float64)

    # -- backward -------------------------------------------------------------
    def _adjoint(self, saved, gy, param_ids):
        """The adjoint solve, the parameter gradients and the input gradient (inside the backward
        pass's session); ``param_ids``: the ids of the pass's parameters, in the order of the gradients."""
        prop, U, g0, xshape = saved
        N, P, r = self.n_layers, self._comm.size, self._comm.rank
        # under torch.autocast a block whose input is in the autocast dtype (after an autocast layer) stores
        # its trajectory in that dtype; the adjoint runs in the parameters' own (wider) dtype, and the
        # input's gradient is returned in the input's
        given, work = gy.dtype, _adjoint_dtype(prop.kernel.params, U.dtype, getattr(prop, "autocast", None))
        if work != U.dtype:
            U, gy = U.to(work), gy.to(work)

        def states(ia):
            return U.index_select(0, torch.as_tensor(ia - g0, device=U.device))

        # the backward pass reads the parameters in reverse layer order only: one stacked copy of them
        prop.kernel.drop_forward_stacks()
        # a failure here on one rank reaches the others through the backward pass's session
        D = self._linearize(prop, U, g0)
        # without closed-form derivatives, the fine sweeps also take the parameter VJPs of their layers
        # (kept only where their cotangent is the final adjoint: _parameter_gradients checks). With one
        # adjoint cycle that skips the first relaxation (the defaults) every fine step runs once, after
        # the coarse correction: the separate parameter pass is left with nothing to do
        fuse = D is None and self.layer_index is inject_layer and self.bwd_iters == 1 and self.skip
        record = [] if fuse else None
        adj = AdjointPropagator(prop, states, N, D, record=record)
        adjs, transfers = self._spatial_adjoint(prop, adj, states)  # (adj, None) without spatial coarsening
        if transfers is not None:
            adj.record = record = None
        with torch.no_grad():
            res = mgrit.solve(adjs, gy.detach().contiguous(), self.t, **self.options, tol=self.bwd_tol,
                              tol_type=self.tol_type, max_iter=self.bwd_iters, skip=self.skip, comm=self._adjoint_comm(),
                              partition=self.plan.adj_partition if P > 1 else None, initial_guess=0.0,
                              final_residual=True, spatial=transfers)
        self.last_backward = res.without_states()
        dtype = res.u.dtype
        A = res.u  # A[s]: the adjoint at forward point hi - s
        # what the gradients below no longer need, freed before they allocate theirs: the adjoint
        # solve's coarse levels and what its sweeps bound
        del res, adjs
        prop.kernel.drop_steppers()
        grads = self._parameter_gradients(prop, U, g0, A, param_ids, D, record)
        # the adjoint at point 0 (A's last row where this rank holds it), a copy: the input's gradient
        # must not hold every adjoint
        if P == 1:
            gx = A[-1].to(given, copy=True).reshape(xshape)
        else:
            root = self.plan.owner_of_point(0)  # (inside the backward pass's session)
            gx = self._comm.bcast_state(A[-1].clone() if r == root else None, gy, root=root).to(given).reshape(xshape)
        _warn_solve(self.last_backward, "adjoint", "bwd_iters", self.bwd_tol, self.tol_type, dtype, (gy,),
                    ends=(gx,))
        return gx, grads

    def _linearize(self, prop, U, g0):
        """``(D, i_top)``: the derivatives of every held layer at its stored input state (rows of
        ``U``), computed once for the whole backward pass (see KernelPass.linearize), in reverse
        layer order (``D[k]`` for layer ``i_top - k``, as AdjointPropagator reads them); None where
        the layers, the coarse parameters or spatial coarsening need the states themselves."""
        if self.layer_index is not inject_layer or self.spatial is not None:
            return None
        rows = np.arange(g0, g0 + U.shape[0])
        rows = rows[rows < self.n_layers]  # the last point enters no layer
        class_of = prop.kernel.k.class_of  # -1 (or beyond its end): a layer this process does not hold
        if not rows.size or rows[-1] >= class_of.size or (class_of[rows] < 0).any():
            return None
        down, D = rows[::-1], None
        with torch.no_grad():
            for part in _pieces_of(down, U):  # (a piece's temporaries at a time)
                Dc = prop.kernel.linearize(_rows(U, part - g0), part)
                if Dc is None:
                    return None
                if D is None:
                    D = Dc.new_empty((down.size,) + tuple(Dc.shape[1:]))
                k = int(rows[-1] - part[0])
                D[k: k + part.size] = Dc
        return D, int(rows[-1])

    def _parameter_gradients(self, prop, U, g0, A, param_ids, D=None, record=None):
        """The parameter gradients from the forward states ``U`` (row ``k``: point ``g0 + k``), the
        adjoints ``A`` (row ``s``: point ``hi - s``) and the derivatives ``D`` of :meth:`_linearize`,
        in the order of ``param_ids``; the layers are taken in reverse order, a chunk at a time, so
        that the adjoints, the derivatives and the reversed parameter stack are read as views."""
        layers = np.asarray(list(self.owned_layers), dtype=np.int64)[::-1]
        if not len(layers) or not param_ids:
            return [None] * len(param_ids)

        def after(js):  # rows of A: the adjoints after layers js (at points js + 1)
            return self.hi - 1 - js

        positions, grads = [], []
        if record:  # the adjoint sweeps' own parameter VJPs, where they used the final adjoint
            positions, grads, layers = recorded_gradients(
                record, layers, lambda js: _rows(A, after(js)))
        with torch.no_grad():
            for part in _pieces_of(layers, U):
                # (the derivatives' last use: their memory takes the adjoints behind the activations)
                ps, gs = parameter_vjp(prop, part, _rows(U, part - g0), _rows(A, after(part)),
                                       None if D is None else _rows(D[0], D[1] - part), overwrite=True)
                positions += ps
                grads += gs
        flat = prop.kernel.params
        ids = list(map(id, map(flat.__getitem__, positions)))
        if len(set(ids)) == len(ids):  # every gradient belongs to its own parameter (C-level maps)
            total = dict(zip(ids, grads))
        else:  # shared parameters or repeated layers: sum the entries of each
            total = {}
            for key, g in zip(ids, grads):
                if g is not None:
                    total[key] = g if total.get(key) is None else total[key] + g
        return list(map(total.get, param_ids))

    # -- checkpoints ----------------------------------------------------------
    def to_serial(self, root: int = 0):
        """The serial network (:class:`ODENet`) with the current weights of every layer.

        Collective over the layer communicator. Returns the network on rank
        ``root`` (every layer, as a deep copy) and None on the other ranks.
        """
        check_root(root, self._comm.size)
        P = self._comm.size
        session = self._session("to_serial()", root, agree="roots", share=_parametrized(self.layers) if P > 1 else None)
        with session:
            if P > 1:  # every rank raises alike, naming the first such layer of all ranks
                _check_picklable([j for j in session.shared if j is not None], root)
            # one deep copy of all layers: parameters tied between layers (one rank only) stay tied
            mine = copy.deepcopy(dict(self.layers.items()))
            parts = self._comm.gather(mine, root=root) if P > 1 else [mine]
        if parts is None:
            return None
        every = {j: m for part in parts for j, m in part.items()}
        return ODENet([every[j] for j in range(self.n_layers)], T=self.T, scheme=self.scheme)

    def serial_state_dict(self, root: int = 0):
        """The serial network's state dict (what ``lp.to_serial(root).state_dict()`` holds, keyed as
        ``ODENet(layers).state_dict()``), gathered from every rank's layers: on rank ``root``, None on the
        others. Collective over the layer communicator. It sends the tensors only, not the modules, so it
        also serves layers that torch does not pickle (``torch.nn.utils.parametrize``'s)."""
        check_root(root, self._comm.size)
        with self._session("serial_state_dict()", root, agree="roots"):
            mine = self.state_dict()
            parts = self._comm.gather(mine, root=root) if self._comm.size > 1 else [mine]
        if parts is None:
            return None
        out = collections.OrderedDict()
        for part in parts:  # (the ranks hold the layers in order; copies: this rank's are the layers' own)
            out.update(_copied(part).items())
        return out

    def _serial_view(self) -> ODENet:
        """On one rank: the serial network over this block's own layers (not copies), for a caller that
        deep-copies it together with other modules that may share their parameters."""
        assert self._comm.size == 1
        return ODENet([self.layers[j] for j in range(self.n_layers)], T=self.T, scheme=self.scheme)

    def load_serial(self, state_dict: dict, strict: bool = True, *, prefix: str = "", _also=None):
        """Load a full serial state dict (``ODENet.state_dict()`` or ``to_serial().state_dict()``).

        Every rank takes the entries of the layers it holds (owned and halo);
        keys are ``layers.<global index>.<name>``. With ``strict`` a key the
        serial network lacks or has and the state dict lacks is a KeyError on
        every rank (a checkpoint of another network: more layers, other
        layers); otherwise, like ``load_state_dict``, returns the serial
        network's ``missing_keys`` and ``unexpected_keys`` (the same on every rank).
        ``prefix``: where a larger network's state dict holds this block's entries
        (``"1."`` in a MultiStage), for the keys the errors name. (``_also``: a network around the block, its
        ``(check, load)`` of its own entries, run in the same session: checked before anything is loaded.)
        """
        with self._session("load_serial()"):  # collective: every rank raises alike
            if _also is not None:
                _also[0]()
            own = self.state_dict()
            every = set(own)
            if self._comm.size > 1:  # the serial network's keys: every rank's own, and what each was given
                parts = self._comm.gather((sorted(own), _digests(state_dict)), root=None)
                every = {k for part, _ in parts for k in part}
                _same_state_dicts([d for _, d in parts], prefix)
            missing = sorted(every - set(state_dict), key=_layer_key_order)
            unexpected = sorted(set(state_dict) - every, key=_layer_key_order)
            if strict and missing:
                hint = _prefix_hint(missing, unexpected)
                rest = " (pass strict=False to load the others)" if len(missing) < len(every) and not hint else ""
                raise KeyError(f"the state dict lacks {len(missing)} entries of the serial network's layers, "
                               f"e.g. {[prefix + k for k in missing[:3]]}{hint}{rest}")
            if strict and unexpected:
                hint = "" if prefix else (" or keys with a prefix (load_serial takes the block's own serial state "
                                          "dict, ODENet.state_dict() or to_serial().state_dict())")
                raise KeyError(f"the state dict has {len(unexpected)} entries the serial network ({self.n_layers} "
                               f"layers) lacks, e.g. {[prefix + k for k in unexpected[:3]]}: a checkpoint of another "
                               f"network (more layers, other layers){hint}; pass strict=False to load the entries "
                               "that fit")
            self.load_state_dict({k: state_dict[k] for k in own if k in state_dict}, strict=strict)
            with torch.no_grad():
                for j, m in self._halo.items():
                    prefix = f"layers.{j}."
                    sub = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
                    if sub:
                        m.load_state_dict(sub, strict=strict)
            if _also is not None:
                _also[1]()
        self._warm = None
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    # -- diagnostics ----------------------------------------------------------
    @property
    def comm(self):
        """The layer communicator (an :class:`mgrit.Communicator`; serial on one process)."""
        return self._comm

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
        """Residual norm of the output trajectory of the last forward solve (0: exact; an eval-mode pass
        with ``exact_eval`` is one, a sequential solve: read a training pass's before evaluating).

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
        """The same network applied layer by layer with plain autograd (reference; one rank)."""
        if self._comm.size > 1:
            raise RuntimeError("`serial` needs every layer on this rank; on several ranks use "
                               "`to_serial(root)` and apply the returned network on the root")
        return serial_forward(list(self.layers), x, self.h, self.scheme)

    def extra_repr(self) -> str:
        o = self.options
        return (f"n_layers={self.n_layers}, T={self.T}, cf={o['cf']}, max_levels={o['max_levels']}, "
                f"relax={o['relax']}, fwd_iters={self.fwd_iters}, bwd_iters={self.bwd_iters}, "
                f"skip={self.skip}, ranks={self._comm.size}")

    # -- spatial coarsening (propagators/torch/coarsening.py, docs/cnn_spatial.md) --------------
    def _checked_spatial(self, spatial):
        from .coarsening import SpatialCoarsening

        if spatial is None:
            return None
        if not isinstance(spatial, SpatialCoarsening):
            raise TypeError(f"`spatial` must be None or a propagators.torch.SpatialCoarsening, got "
                            f"{type(spatial).__name__}")
        spatial.check_relax(self.hierarchy)
        return spatial

    def _spatial_forward(self, prop, x):
        """``(propagators, transfers)`` of the forward solve; the levels travel with ``prop`` to the adjoint."""
        from .coarsening import CoarseLayers, spatial_levels

        prop.spatial_levels = None
        if self.spatial is None or len(self.hierarchy) < 2:
            return prop, None
        if getattr(self, "_coarse_layers", None) is None:
            self._coarse_layers = CoarseLayers()  # copies of the coarse-level layers, kept between passes
        # a layer that cannot be coarsened on one rank raises on every rank
        with self._session("coarsening the layers in space"):
            levels = spatial_levels(self.spatial, self._coarse_layers, prop, self._held(), self.hierarchy,
                                    self.n_layers, x, self.scheme, self.batched, self.streams)
        prop.spatial_levels = levels
        return levels.propagators, levels.transfers

    def _spatial_adjoint(self, prop, adj, states):
        """``(propagators, transfers)`` of the adjoint solve of the pass that made ``prop``."""
        levels = getattr(prop, "spatial_levels", None)
        if levels is None:
            return adj, None
        return levels.adjoint(adj, states, self.n_layers)


class ConvergenceWarning(RuntimeWarning):
    """A layer-parallel solve stopped short of its tolerance, or made no progress (its returned
    residual is not below its first)."""


#: the id this process proposes for the next module built on several ranks (see _agreed_uid)
_uids = [0]


def _agreed_uid(proposals) -> int:
    """The id of a module built on several ranks: the largest of the ranks' proposals (so that the ranks
    agree whatever other modules each built before); this process proposes a larger one next."""
    uid = max(proposals)
    _uids[0] = max(_uids[0], uid + 1)
    return uid


def _agreed_build(shared, what: str, names) -> int:
    """The id of a module built on several ranks (:func:`_agreed_uid`); ``shared``: every rank's
    ``(id proposal, *settings)``, ``names`` the settings'. Raises alike on every rank, naming the
    setting, when the ranks built different modules."""
    for r, (_, *theirs) in enumerate(shared):
        for name, a, b in zip(names, theirs, shared[0][1:]):
            if a != b:
                raise ValueError(f"{what} was built differently on rank {r} and rank 0: different {name} ({a} "
                                 f"against {b}); every rank of its communicator must build the same {what}")
    return _agreed_uid([u for u, *_ in shared])


def _check_grid(comm, data_comm) -> None:
    """Raise unless the layer and data communicators (both MPI or both torch.distributed) meet in this rank
    alone: a data communicator that shares other ranks with the layer one (the layer communicator itself,
    the world) would average gradients of different layers."""
    if data_comm is None or data_comm.size == 1:
        return
    if all(hasattr(c, "_MPI") for c in (comm, data_comm)):
        MPI = comm._MPI
        mine, theirs = comm.comm.Get_group(), data_comm.comm.Get_group()
        try:  # (groups, not world ranks: communicators of spawned processes have no COMM_WORLD ranks)
            common = MPI.Group.Intersection(mine, theirs)
            overlap = common.Get_size()
            shared = sorted(set(common.Translate_ranks(list(range(overlap)), mine)))
            common.Free()
        finally:
            mine.Free()
            theirs.Free()
    elif all(hasattr(c, "_g") and hasattr(c, "_members") for c in (comm, data_comm)):  # torch.distributed
        ranks = [{c._g.world[m] for m in c._members} for c in (comm, data_comm)]  # (global ranks)
        shared = sorted(ranks[0] & ranks[1])
        overlap = len(shared)
    else:
        return  # (engines mixed: allreduce_gradients compares the replicas' layouts)
    if overlap > 1:
        raise ValueError(
            f"the data communicator shares ranks {shared} with the layer communicator: it must meet it "
            "in this rank alone (each data rank holds the same layers as this one); pass the two parts of "
            "mgrit.split_comm(world, layer_size), not the layer communicator or the world as data_comm")


def _check_T(T) -> float:
    """The final time: a finite number > 0 (not a string or a bool)."""
    if isinstance(T, torch.Tensor) and T.numel() == 1 and not T.requires_grad:
        T = T.item()
    if isinstance(T, (bool, np.bool_, str, bytes)) or not isinstance(T, (int, float, np.number)) \
            or not math.isfinite(T) or not T > 0:
        raise ValueError(f"`T` must be a finite number > 0 (the final time; the layer step is T / n_layers), "
                         f"got {T!r}")
    return float(T)


#: the most cycles of a solve with a tolerance whose iteration count is not given (mgrit.solve's ``max_iter``)
TOL_ITERS = 100


def _tolerance(value, name: str):
    """A solve's tolerance: None, or a number >= 0 (checked when the module is built, not at its first pass)."""
    if value is not None and (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number))
                              or not value >= 0):
        raise ValueError(f"`{name}` must be a number >= 0 or None (a tolerance of the residual), got {value!r}")
    if value is not None and not fits_float(value):
        raise ValueError(f"`{name}` must fit a float (math.inf is the largest), got {value!r:.40}")
    return value if value is None else float(value) + 0.0  # (+ 0.0: -0.0 is 0.0, alike on every rank)


def _cast_to(dtype, autocast):
    """The dtype the layers compute states of ``dtype`` in under ``torch.autocast`` of dtype ``autocast`` (None:
    not enabled): ``autocast``'s for floating states other than float64 (which autocast leaves alone) when
    it is the coarser, else None (their own)."""
    if autocast is None or dtype == torch.float64 or not (dtype.is_floating_point and autocast.is_floating_point):
        return None
    return autocast if torch.finfo(autocast).eps > torch.finfo(dtype).eps else None


def _eps(dtype) -> float:
    """The machine epsilon of ``dtype`` (float32 when not known)."""
    return torch.finfo(torch.float32 if dtype is None else dtype).eps


def _rounding(dtype) -> str:
    """How finely ``dtype`` (float32 when not known) resolves the states, in words."""
    name = str(torch.float32 if dtype is None else dtype).replace("torch.", "")
    return f"{name} rounds at about {_eps(dtype):.0e} of the states"


def _rounding_floor(seen: list, dtype, like=()) -> float:
    """The residual below which a stall is the rounding of the states: 1e4 units in the last place (at most
    a tenth: in float16 / bfloat16 a stall near the largest residual is no rounding floor) of the largest of
    the residuals seen and the sizes of the states ``like`` (each: its largest entry times the square root of
    its entries). All are the same on every rank (the residual norms are reduced over them)."""
    scale = max(seen, default=0.0)
    for v in like:
        if v.numel():
            scale = max(scale, float(v.detach().abs().max()) * math.sqrt(v.numel()))
    return min(1e4 * _eps(dtype), 0.1) * scale


#: with a fixed number of cycles, a returned residual at least this multiple of the size of what the solve
#: returns warns: forward, the block's output; adjoint, the input gradient (both the same on every rank: the
#: root's, broadcast). In ``benchmarks/fixed_cycles.py``'s 32 networks (docs/benchmarks.md, "Fixed cycles")
#: those at or above a threshold were far off serial autograd (output 1.0 to 6e11 times off, relative; input
#: gradient 0.62 to 1e31 times), those below at most 0.42 (output) and 0.87 (input gradient: a growing
#: network); of the default-initialised ones, one warns (T 4 at N 64, its input gradient 108% off)
LARGE_RESIDUAL = {"forward": 0.5, "adjoint": 0.75}


def _size(like) -> float:
    """The largest Frobenius norm of the tensors ``like``, in float64, scaled by the largest entry first (the
    squares of entries near 1e-170 underflow: a review's input gradient had a norm of 0 and went unchecked)."""
    out = 0.0
    for v in like:
        if v.numel():
            w = v.detach().to(torch.complex128 if v.is_complex() else torch.float64)
            top = float(w.abs().max())
            if top > 0 and math.isfinite(top):
                out = max(out, top * float(torch.linalg.vector_norm(w / top)))
    return out


def _largest(like) -> float:
    """The largest magnitude of an entry of the tensors ``like`` (exact in their own dtype, no copy)."""
    return max((float(torch.linalg.vector_norm(v.detach(), ord=math.inf)) for v in like if v.numel()), default=0.0)


_HERE = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (__file__, torch.__file__, mgrit.__file__))


def _user_stacklevel() -> int:
    """``stacklevel`` for a warning raised here that names the user's line: the first caller of the caller
    outside this package, mgrit and torch (a pass is reached through autograd's and nn.Module's frames, as
    many as the way it was called makes); the outermost frame when there is none (autograd's own thread)."""
    frame, level = sys._getframe(2), 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_HERE):
        frame, level = frame.f_back, level + 1
    return level


def _warn_solve(res, which: str, iters: str, tol=None, tol_type: str = "abs", dtype=None, like=(),
                ends=None, compute=None) -> None:
    """Warn (:class:`ConvergenceWarning`) when a solve with a tolerance stopped above it, when the
    residual of the returned trajectory is not below the first residual measured (a diverging or
    stalling solve: its gradients are not worth much), unless both are at the rounding of the states,
    or, with a fixed number of cycles or a relative tolerance met, when the returned residual is
    :data:`LARGE_RESIDUAL` times the size of ``ends`` or more (the block's output; the input gradient, and
    with a tolerance met also the output gradient ``like``) and above the rounding of ``like`` (a relative
    tolerance scales with the first residual measured, which unstable coarse levels can blow up many times
    over the states' size).
    ``dtype``: the states' (named in the advice; their rounding sets the floors); ``compute``: the coarser
    dtype the layers compute them in under ``torch.autocast`` (named instead in the advice), or None;
    ``like``: states that every rank holds alike (the block's input and output, the output gradient), whose
    sizes set the rounding: every rank decides alike (``ends``: the same on every rank, broadcast from one)."""
    seen = [r for r in res.residuals if r is not None]
    first, last = (seen[0] if seen else None), res.final_residual
    if tol is not None and not res.converged:
        bound = tol if tol_type == "abs" else None if first is None else tol * first
        if last is None or bound is None or not last <= bound:
            got = "no residual to compare" if last is None or bound is None else f"residual {last:.3e} > {bound:.3e}"
            stalled = len(seen) >= 4 and seen[-1] > 0.5 * seen[-4]  # three cycles that did not halve it
            finer = (" or run the block outside torch.autocast" if compute is not None else
                     "" if dtype in (torch.float64, torch.complex128) else " or compute in float64")
            named = dtype if compute is None else compute  # (under autocast: the layers' arithmetic)
            if stalled and seen[-1] <= _rounding_floor([] if like else seen, dtype, like):  # ... near the rounding
                #                                                                                 of the states
                what = (f"the residual has stopped decreasing ({seen[-4]:.3e} three cycles before): the tolerance is "
                        f"below what the arithmetic resolves ({_rounding(named)}): raise the tolerance{finer}")
            elif stalled and seen[-1] <= _rounding_floor(seen, dtype, like):  # near the rounding of the largest
                what = (f"the residual has stopped decreasing ({seen[-4]:.3e} three cycles before) near the "  # residual
                        f"rounding of the largest residual measured ({max(seen):.3e}, far larger than the states "
                        f"at the block's ends; {_rounding(named)}): either the states inside the block are that "
                        f"large, and the tolerance is below what the arithmetic resolves (raise it{finer}), "
                        "or unstable coarse levels blew the first cycles' iterate up, and fewer levels "
                        "(max_levels), relax='FCF' or a smaller cf converge further (mgrit.choose_settings picks "
                        "them)")
            elif stalled:  # far above it: the cycles no longer improve the iterate, more of them will not help
                what = (f"the residual has stopped decreasing far above the rounding of the states ({seen[-4]:.3e} "
                        "three cycles before): the coarse levels approximate this problem too poorly for the cycles "
                        "to converge; use fewer levels (max_levels), relax='FCF' or a smaller cf "
                        "(mgrit.choose_settings picks them), or evaluate serially (eval() with exact_eval)")
            else:
                unset = f" (leave it unset for up to {TOL_ITERS})" if res.iterations < TOL_ITERS else ""
                what = (f"raise `{iters}` above {res.iterations}: with a tolerance it is the most cycles a solve may "
                        f"run{unset}")
            warnings.warn(
                f"the {which} MGRIT solve stopped after {res.iterations} cycle(s) short of its tolerance ({got}; "
                f"tol_type={tol_type!r}): its output and gradients are not the serial network's to that tolerance. "
                f"{what[0].upper()}{what[1:]}", ConvergenceWarning, stacklevel=_user_stacklevel())
            return
    if last is None:
        return
    if not res.converged and first is not None and first > 0 and not last < first \
            and max(first, last) > _rounding_floor(seen, dtype, like):
        warnings.warn(  # (from and to the rounding of the states, as a warm start on the same batch: no progress
            f"the {which} MGRIT solve made no progress: its residual went from {first:.3e} (the first measured) "  # to make)
            f"to {last:.3e} (of the output it returned) in {res.iterations} cycle(s). Its output and gradients may "
            f"be far from the serial network's: raise `{iters}`, set a tolerance, use relax='FCF' or fewer levels "
            "(mgrit.choose_settings picks them), or let propagators.torch.SerialSwitch manage the cycles; a residual "
            "that stays where it started can also be the rounding of much larger states between the input and the "
            "output (then compute in float64)", ConvergenceWarning, stacklevel=_user_stacklevel())
        return
    if (tol is not None and tol_type != "rel") or (res.converged and tol is None) or not ends \
            or not last >= LARGE_RESIDUAL[which] * _largest(ends):
        return  # (the norm is at least the largest entry: no warning, and no float64 copy of the output per pass)
    size, of = _size(ends), ("its output" if which == "forward" else "the input gradient")
    if tol is not None and which == "adjoint" and _size(like) > size:
        # (a met tolerance: the adjoint states along the way, which the parameter gradients read, are not
        # smaller than the output gradient, though the input gradient may be, through a damping block)
        size, of = _size(like), "the output gradient (larger than the input gradient)"
    if size > 0 and last >= LARGE_RESIDUAL[which] * size and last > 10 * _eps(dtype) * _size(like):  # (not the
        #                                                     rounding of larger states, for an output or gradient near 0)
        met = "" if tol is None or first is None else (
            f"; it met its relative tolerance only because its first residual ({first:.3e}) was {first / size:.2g} "
            "times that size")
        warnings.warn(  # (a single cycle that skips has no first residual: this is the check it gets)
            f"the {which} MGRIT solve returned a residual of {last:.3e} after {res.iterations} cycle(s), "
            f"{last / size:.2g} times the size of {of} ({size:.3e}){met}: "
            + ("its output and the gradients are" if which == "forward" else "the gradients are")
            + " probably far off the serial network's (docs/benchmarks.md, \"Fixed cycles\"); unstable coarse steps "
            "do that. Use relax='FCF', fewer levels or a smaller cf (mgrit.choose_settings picks them), raise `"
            + iters + "`, set a tolerance, or let propagators.torch.SerialSwitch manage the cycles",
            ConvergenceWarning, stacklevel=_user_stacklevel())


def _copied(state: dict) -> dict:
    """A state dict's entries as copies (tensors cloned, extra state deep-copied), in its order."""
    return collections.OrderedDict((k, v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                                   for k, v in state.items())


def _parametrized(layers):
    """The index of the first of ``layers`` (a :class:`LayerDict`) with a module under
    ``torch.nn.utils.parametrize``, which torch refuses to pickle; None when there is none."""
    from torch.nn.utils import parametrize

    return next((int(j) for j, m in layers.items() if any(parametrize.is_parametrized(sub) for sub in m.modules())),
                None)


def _check_picklable(found: list, root: int) -> None:
    """A ``TypeError`` naming the first of the layers ``found`` (those :func:`_parametrized` found on the
    ranks): :meth:`LayerParallel.to_serial` cannot send them to rank ``root``."""
    if found:
        raise TypeError(
            f"layer {min(found)} is parametrized (torch.nn.utils.parametrize), and torch does not pickle such "
            f"modules, so to_serial() cannot send it to rank {root}: build the serial network on rank {root} "
            f"yourself (ODENet of the same layers, or the model around it) and load serial_state_dict(root={root}) "
            "of this block (or of the model: MultiStage and the ViT have one too) into it")


def _foreign_leaves(out, allowed: set) -> list:
    """Leaf tensors requiring grad that ``out`` depends on, other than those in ``allowed`` (ids)."""
    if not isinstance(out, torch.Tensor) or out.grad_fn is None:
        return []
    found, seen, todo = [], set(), [out.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        var = getattr(fn, "variable", None)
        if var is not None and id(var) not in allowed:
            found.append(var)
        todo.extend(f for f, _ in fn.next_functions)
    return found


def _bytes_of(v):
    v = v.detach()
    if v.is_conj() or v.is_neg():
        v = v.resolve_conj().resolve_neg()
    return v.contiguous().reshape(-1).view(torch.uint8)


def _halo_order(tensors) -> list:
    """Largest elements first: packed in this order, every tensor's bytes start at a multiple of its
    element size, so they can be read back in place (the same order on every rank)."""
    return sorted(tensors, key=lambda v: -v.element_size())


def _packed(tensors):
    """The bytes of ``tensors`` one after the other, as one uint8 tensor (one message)."""
    device = tensors[0].device
    return torch.cat([_bytes_of(v).to(device) for v in tensors])


def _packed_size(tensors) -> int:
    return sum(v.numel() * v.element_size() for v in tensors)


def _unpack(buf, tensors) -> None:
    """Copy the bytes ``_packed`` made back into ``tensors`` (in place). A tensor that does not require grad
    (a frozen parameter, a buffer) is written only when its bytes change: a frozen parameter a halo layer shares
    with a module outside the block (a stem in MultiStage, which may have used it in this forward pass) keeps
    its autograd version."""
    off = 0
    for v in tensors:
        size = v.element_size()
        chunk = buf[off: off + v.numel() * size]
        if off % size or chunk.data_ptr() % size:
            chunk = chunk.clone()  # (not aligned for a view as v's dtype)
        # (bytes compared on one device; a tensor on another is taken as changed)
        if v.requires_grad or v.device != chunk.device or not torch.equal(_bytes_of(v), chunk):
            v.copy_(chunk.view(v.dtype).view(v.shape))
        off += chunk.numel()


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
        if not len(self.layers):
            raise ValueError("ODENet needs at least one layer")
        self.T = T
        self.scheme = scheme

    @property
    def T(self) -> float:
        """The final time; setting it sets the step size ``h = T / len(layers)``."""
        return self._T

    @T.setter
    def T(self, value):
        self._T = _check_T(value)  # (as LayerParallel's: T = 0 or inf built a network that did nothing or NaN)
        self._h = self._T / len(self.layers)

    @property
    def h(self) -> float:
        """The step size, ``T / len(layers)``; setting it sets ``T = h * len(layers)`` (and keeps ``h`` as
        given: ``T / len(layers)`` may round to another float)."""
        return self._h

    @h.setter
    def h(self, value):
        self.T = float(value) * len(self.layers)
        self._h = float(value)

    def __setstate__(self, state):
        if "T" in state:  # (pickled when T and h were attributes)
            state["_T"], state["_h"] = state.pop("T"), state.pop("h", None)
        super().__setstate__(state)
        if self.__dict__.get("_h") is None:
            self._h = self._T / len(self.layers)

    def forward(self, x):
        return serial_forward(self.layers, x, self.h, self.scheme)
