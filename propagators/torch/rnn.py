"""The machinery of the sequence-parallel recurrent modules (``ParallelGRU``, ``ParallelLSTM``).

A recurrent layer obeys ``s_{i+1} = cell(x_i, s_i)``: a time stepper whose time
steps are the sequence positions, whose forcing is the input ``x_i`` and whose
weights are the same at every step. :class:`_ParallelRNN` solves this recursion
with MGRIT over the positions in the forward pass and its adjoint in reverse in
``loss.backward()``, then forms the gradients of every weight and of the input
from vector-Jacobian products at all steps at once: layers and directions,
dropout between layers, several ranks, sessions, checks and diagnostics. A cell
brings its forward and adjoint propagators (:mod:`propagators.torch.gru`,
:mod:`propagators.torch.lstm`), the number of its gate blocks and the layout of
its state (the hidden state ``h`` first: the output sequence is the ``h`` part).
See docs/gru.md and docs/theory.md (the adjoint).

Every phase that involves several ranks (input checks, the solves, the ghost
exchange, the gathers, the gradient reduction) runs inside a communicator
session, so an exception on one rank makes every rank raise.
"""
from __future__ import annotations

import contextlib
import math
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import mgrit
from mgrit.comm import Call, InSession, ReversedInSession, args_signature, as_communicator, warn_if_alone
from mgrit.hierarchy import build_hierarchy, check_flag, check_levels, frozen_per_level

from .module import (_DIFFERENT_LOSS, _NO_EXPORT, FixedOptions, _agreed_build, _announced, _autocast_on, _chunks,
                     _differing_inputs, _differing_passes, _eager_under_compile, _exporting, _finite_output_gradient,
                     _functorch_active, _input_sums, _nan_like, _no_transforms, _one_thread, _SolveCycles, _uids,
                     _warn_solve)
from .kernel import _no_autocast
from .plan import DistributionPlan
from .schemes import inject_layer

COARSE_STEPS = ("frozen", "inject")


def _positions(i0: np.ndarray, k: int, offset: int) -> torch.Tensor:
    """Rows ``i0[j] + 0..k-1 - offset`` of a window of precomputed input projections."""
    return torch.as_tensor(np.asarray(i0, dtype=np.int64)[:, None] + np.arange(k) - offset)


def _affine_scan(a, b):
    """All partial compositions of the affine maps ``h -> a_j h + b_j`` along dimension 1.

    Returns ``(A, B)`` with ``A_j h + B_j`` the result of applying maps ``0..j`` in
    order to ``h``: the states of the recurrence ``h_{j+1} = a_j h_j + b_j`` at every
    position, in ``ceil(log2 k)`` rounds of whole-tensor operations (Hillis-Steele)
    instead of ``k`` rounds of small ones. Products and sums only, no division.
    """
    k, d = a.shape[1], 1
    while d < k:
        b = torch.cat([b[:, :d], torch.addcmul(b[:, d:], a[:, d:], b[:, :-d])], dim=1)
        a = torch.cat([a[:, :d], a[:, d:] * a[:, :-d]], dim=1)
        d *= 2
    return a, b


def _affine_compose(a, b):
    """``(A, B)`` of the composition of all the affine maps ``h -> a_j h + b_j`` along dimension 1
    (map 0 applied first): pairs of neighbours composed, ``ceil(log2 k)`` rounds."""
    while a.shape[1] > 1:
        k = a.shape[1]
        e = k - k % 2
        na, nb = a[:, 1:e:2] * a[:, 0:e:2], torch.addcmul(b[:, 1:e:2], a[:, 1:e:2], b[:, 0:e:2])
        if k % 2:
            na, nb = torch.cat([na, a[:, -1:]], dim=1), torch.cat([nb, b[:, -1:]], dim=1)
        a, b = na, nb
    return a[:, 0], b[:, 0]


#: the least steps of a piece of the weight gradients (_ParallelRNN._step_gradients)
_PIECE_STEPS = 64
#: sequence lengths whose layouts (plans of the time grid over the ranks) a module keeps, the oldest dropped first
_LAYOUTS_KEPT = 64
#: what the ranks of a layer's solve must agree on (named by the handshake's error when they do not)
_SOLVE_AGREE = ("sequence lengths, batch sizes or dtypes, train() / eval() modes, return_sequence, or solve "
                "settings (fwd_iters, bwd_iters, tolerances, the MGRIT options: set them alike on every rank)")
#: ... and, in the backward pass, which gradients it computes
_BACKWARD_AGREE = ("which of the input and the initial states require grad (x.requires_grad, h0.requires_grad: "
                   "alike on every rank), " + _SOLVE_AGREE)


def _windows(x: torch.Tensor, i0: np.ndarray, k: int, offset: int) -> torch.Tensor:
    """``x[i0[j] + 0..k-1 - offset]`` stacked: shape ``(len(i0), k) + x.shape[1:]``.

    When the starts are evenly spaced (every batched sweep of MGRIT, and a single
    interval) and the windows lie inside ``x``, a strided view of ``x`` (no copy);
    otherwise an indexed copy. Rows outside ``x`` raise ``IndexError``.
    """
    i0 = np.asarray(i0, dtype=np.int64)
    n = len(i0)
    if n and int(i0.min()) < offset:  # (an indexed copy would wrap around to the last rows)
        raise IndexError(f"a window starts at position {int(i0.min())}, before the first row ({offset})")
    first = int(i0[0]) - offset if n else 0
    stride = int(i0[1] - i0[0]) if n > 1 else 1
    if (n and stride >= 0 and first >= 0 and first + stride * (n - 1) + k <= x.shape[0]
            and (n < 3 or (np.diff(i0) == stride).all())):
        s0 = x.stride(0)
        return x.as_strided((n, k) + tuple(x.shape[1:]), (stride * s0, s0) + tuple(x.stride()[1:]),
                            x.storage_offset() + first * s0)
    return x[_positions(i0, k, offset).to(x.device)]


def _steps(t0, t1) -> tuple:
    """Integer start positions and lengths of intervals on the integer time grid."""
    a = np.rint(np.asarray(t0, dtype=np.float64)).astype(np.int64)
    b = np.rint(np.asarray(t1, dtype=np.float64)).astype(np.int64)
    return a, b - a


def _by_length(fn, S, i0: np.ndarray, m: np.ndarray):
    """``fn(S, i0, m)`` for a batch of intervals of lengths ``m``: one call when they are alike,
    else one per length (the rows written back in place)."""
    if len(m) and (m == m[0]).all():
        return fn(S, i0, int(m[0]))
    out = torch.empty_like(S)
    for mm in np.unique(m):
        sel = np.flatnonzero(m == mm)
        out[torch.as_tensor(sel, device=S.device)] = fn(S[sel], i0[sel], int(mm))
    return out


def _finite_when_held(prop, gh, blocks: int):
    """The fresh hidden projections ``gh`` of a propagator with held positions (:meth:`_CellPropagator.hold`)
    with ``+-inf`` (an overflow of ``W_h h + b_h``) in the first ``blocks`` gate blocks, those of the gates
    that hold, made the dtype's largest finite values, in place: a held gate's infinite input projection plus
    an infinite ``gh`` of the other sign would be NaN, and such a gate is the same otherwise (an input that
    large saturates its sigmoid or tanh to the same 0 or 1). NaN stays NaN."""
    if prop.held is not None and gh.is_floating_point():
        big = torch.finfo(gh.dtype).max
        gh[..., :blocks * prop.H].clamp_(-big, big)
    return gh


class _CellPropagator(mgrit.Propagator):
    """What the forward propagators of the cells share: the weights, the input projections of the
    positions ``offset ..`` (``gi``, shape (n, B, G)), the coarse step's kind, and stepping a batch of
    intervals by ``advance(S, i0, m)`` (the states at positions ``i0`` advanced by ``m``)."""

    def __init__(self, weight_hh, bias_hh, gi, offset: int = 0, coarse: str = "frozen"):
        if coarse not in COARSE_STEPS:
            raise ValueError(f"`coarse` must be one of {COARSE_STEPS}, got {coarse!r}")
        self.W, self.b, self.gi = weight_hh, bias_hh, gi
        self.offset, self.coarse = int(offset), coarse
        self.H = int(weight_hh.shape[1])
        #: bool (n, B) or None: the positions (from ``offset``) whose step keeps the state exactly (past the end
        #: of a packed sequence; :meth:`hold`)
        self.held = None

    def hold(self, held) -> None:
        """Make the steps at the positions ``held`` (bool, (n, B), from ``offset``) keep the state exactly
        (past the end of a packed sequence), through the fine and the coarse steps and their adjoints."""
        raise NotImplementedError  # pragma: no cover - every cell defines it

    def held_at(self, i0: np.ndarray):
        """Whether the step from each position ``i0`` is held (:meth:`hold`), shaped to select states: (n, B, 1)."""
        return _windows(self.held, i0, 1, self.offset)[:, 0, ..., None]

    def span(self, m: int) -> int:
        """Inputs a step over ``m`` positions reads."""
        return m if self.coarse == "frozen" else 1

    def inputs(self, i0: np.ndarray, k: int):
        """Input projections at positions ``i0 + 0..k-1``: shape (n, k, B, G)."""
        return _windows(self.gi, i0, k, self.offset)

    def advance(self, S, i0: np.ndarray, m: int):  # pragma: no cover - every cell defines it
        raise NotImplementedError

    def step_batch(self, S, t0, t1):
        i0, m = _steps(t0, t1)
        return _by_length(self.advance, S, i0, m)

    def step(self, s, t0, t1):
        return self.step_batch(s[None], np.array([t0]), np.array([t1]))[0]


class _CellAdjoint(mgrit.Propagator):
    """What the adjoint propagators of the cells share: reverse point ``s`` is sequence point
    ``N - s``; a batch of reverse intervals is stepped by ``back(V, i0, m)`` (the adjoints at the
    forward positions ``i0 + m`` taken back to ``i0``), linearised at the stored forward states
    ``U`` (points ``g0 ..``) with their hidden projections ``GH``; ``forcing`` (N + 1, B, H) is
    ``dL/dh`` from outside the recursion at every point (None: none but the terminal one)."""

    def __init__(self, forward: _CellPropagator, n_steps: int, U, GH, g0: int, forcing=None):
        self.fwd, self.N, self.U, self.GH, self.g0, self.g = forward, int(n_steps), U, GH, int(g0), forcing

    def back(self, V, i0: np.ndarray, m: int):  # pragma: no cover - every cell defines it
        raise NotImplementedError

    def step_batch(self, V, tau0, tau1):
        s0, m = _steps(tau0, tau1)
        return _by_length(self.back, V, self.N - (s0 + m), m)

    def step(self, v, tau0, tau1):
        return self.step_batch(v[None], np.array([tau0]), np.array([tau1]))[0]


def _unpacked(packed) -> tuple:
    """A PackedSequence as ``(padded (L, B, *) in the caller's batch order, held)``: ``held`` (bool, (L, B),
    on the data's device) marks the positions past each sequence's end, None when every sequence is whole."""
    padded, lengths = nn.utils.rnn.pad_packed_sequence(packed)
    held = torch.arange(padded.shape[0])[:, None] >= lengths[None, :]
    return padded, (held.to(padded.device) if bool(held.any()) else None)


def _input_layout(input, held) -> tuple:
    """What every rank's input must agree on besides its values: its shape, and for a packed one the
    sequence lengths."""
    if held is None:
        return tuple(input.shape)
    return ("packed", tuple(input.shape), tuple((~held).sum(0).tolist()))


def _layout_words(layout: tuple) -> str:
    if layout and layout[0] == "packed":
        return f"shape {layout[1]} (padded) and sequence lengths {list(layout[2])}"
    return f"shape {layout}"


def _packed_like(out, packed):
    """The padded output ``out`` (L, B, *) in the caller's batch order packed as ``packed`` is: the same
    ``batch_sizes``, ``sorted_indices`` and ``unsorted_indices`` (what torch's modules return)."""
    sizes = packed.batch_sizes  # (on the CPU, as torch keeps them)
    order = packed.sorted_indices if packed.sorted_indices is not None else torch.arange(int(sizes[0]))
    steps = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    starts = torch.cumsum(sizes, 0) - sizes
    rows = order.cpu()[torch.arange(int(sizes.sum())) - torch.repeat_interleave(starts, sizes)]
    data = out[steps.to(out.device), rows.to(out.device)]
    return nn.utils.rnn.PackedSequence(data, sizes, packed.sorted_indices, packed.unsorted_indices)


class _Layout:
    """How the positions of a sequence of length ``L`` are split over the ranks (cached per L)."""

    def __init__(self, L: int, options: dict, size: int, rank: int):
        self.L = L
        self.t = np.arange(L + 1, dtype=np.float64)
        self.hierarchy = build_hierarchy(self.t, **options)
        self.plan = DistributionPlan.build(L, self.hierarchy, inject_layer, size)
        self.lo, self.hi = self.plan.fine[rank]
        self.left, self.right = self.plan.left[rank], self.plan.right[rank]
        S = self.hierarchy[-1].stride  # longest interval of any level
        if self.hi >= self.lo:
            self.w_lo, self.w_hi = max(0, self.lo - S), min(L, self.hi + S)  # input positions a rank reads
        else:
            self.w_lo = self.w_hi = 0
        self.steps = np.arange(max(self.lo - 1, 0), self.hi, dtype=np.int64)  # steps whose end point it owns


def _tensor_sums(*tensors) -> tuple:
    """:func:`_input_sums` of every tensor (None for None), compared between the ranks."""
    return tuple(None if t is None else _input_sums(t) for t in tensors)


def _differing_parts(shared, names, hint: str = "") -> ValueError | None:
    """The error when the ranks' :func:`_tensor_sums` (``shared``) differ, naming the part."""
    for k, name in enumerate(names):
        parts = [sh[k] for sh in shared]
        if any(p is None for p in parts):
            if all(p is None for p in parts):
                continue
            return ValueError(f"the {name} is given on some ranks and not on others: every rank must pass the "
                              "same (" + (hint or "the same input, and the same loss from the same output") + ")")
        differ = _differing_inputs(parts, name, hint)
        if differ is not None:
            return differ
    return None


class _LayerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rnn, layer, want_seq, held, anchor, x, h0, *weights):
        ctx.set_materialize_grads(False)
        out, hL, saved = rnn._layer_forward(layer, x, h0, weights, want_seq, keep=True, held=held)
        ctx.rnn, ctx.layer, ctx.saved, ctx.pass_id = rnn, layer, saved, rnn._pass_id
        ctx.save_for_backward(x, *weights)  # autograd's own check: no in-place change before backward
        if not want_seq:
            ctx.mark_non_differentiable(out)
        return out, hL

    @staticmethod
    def jvp(ctx, *tangents):
        rnn = ctx.rnn
        raise RuntimeError(_no_transforms("forward-mode differentiation (torch.autograd.forward_ad, torch.func.jvp)",
                                          type(rnn).__name__, rnn._serial_hint))

    @staticmethod
    def backward(ctx, g_out, g_hL):
        with _no_autocast(g_out if g_out is not None else g_hL):  # (the solves pick their dtypes themselves)
            return _layer_adjoint(ctx, g_out, g_hL)


@_eager_under_compile
def _layer_adjoint(ctx, g_out, g_hL):
    """The backward pass of :class:`_LayerFunction` (eager under torch.compile, like the forward)."""
    rnn, needs = ctx.rnn, ctx.needs_input_grad
    with _announced(rnn._comm):  # everything local before the layer's session (a failure reaches every rank)
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"{type(rnn).__name__} does not support double backward (backward with create_graph=True, which "
                "torch.autograd.functional.jvp / hvp / hessian use too): its "
                "backward pass is an MGRIT solve that is not itself differentiated. Compute such terms "
                f"with {rnn._serial_hint}")
        x, *weights = ctx.saved_tensors
        # a gradient with NaN or Inf (an overflow that torch.amp.GradScaler skips, a NaN loss): NaN gradients,
        # as torch's module gives, after an adjoint solve from zero (the ranks compare the original sums)
        finite = all(g is None or _finite_output_gradient(g, type(rnn).__name__, rnn._serial_hint)
                     for g in (g_out, g_hL))
        share = _tensor_sums(g_out, g_hL) + (ctx.pass_id,) if rnn._comm.size > 1 else None
        if not finite:
            g_out, g_hL = (None if g is None else torch.zeros_like(g) for g in (g_out, g_hL))
        setup = rnn._adjoint_setup(ctx.saved, weights, g_out, g_hL, needs[5], needs[6])
    got = rnn._layer_backward(ctx.layer, ctx.saved, x, setup, need_x=needs[5], need_h0=needs[6], share=share)
    if isinstance(got, Exception):
        raise got
    gx, gh0, gw = got
    if not finite:  # (every rank alike: the backward's handshake found the same sums, finite or not, on all)
        gx, gh0, gw = _nan_like(gx), _nan_like(gh0), [_nan_like(g) for g in gw]
    return (None, None, None, None, None, gx, gh0, *[g if need else None for g, need in zip(gw, needs[7:])])


class _ParallelRNN(_SolveCycles, nn.Module):
    """A multi-layer recurrent module whose recursion over the sequence is solved by MGRIT.

    The shared part of :class:`~propagators.torch.ParallelGRU` and
    :class:`~propagators.torch.ParallelLSTM` (their docstrings describe the
    interface). A subclass sets ``_cell`` (torch's module name), ``_gates``
    (gate blocks per weight matrix), ``_propagator`` and ``_adjoint`` (its
    propagator classes, whose states hold the hidden state first),
    ``_state_names`` when its state is more than ``h``, and defines
    :meth:`_initial_states` and :meth:`_final_states`.
    """

    _pass_id = 0  # forward passes on several ranks: the last one's id, agreed in its input check
    _cell = ""
    _gates = 0
    _propagator = None
    _adjoint = None
    #: how the ranks' comparisons name the initial states and the gradient of the final ones
    _state_names = ("initial hidden state", "gradient of the last hidden state")


    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 device=None, dtype=None, *, cf: int = 4, max_levels: int = 3, min_coarse: int = 2,
                 relax=("F", "FCF"), cycle: str = "V", coarse: str = "frozen", fwd_iters: int | None = None,
                 bwd_iters: int | None = None, fwd_tol: float | None = None, bwd_tol: float | None = None,
                 tol_type: str = "abs", skip: bool = True, exact_eval: bool = True,
                 return_sequence: bool = True, comm=None):
        super().__init__()
        warn_if_alone(comm, type(self).__name__)
        self._comm = as_communicator(comm)
        with _announced(self._comm):  # a bad argument on one rank: the others raise in the handshake below
            for name, v, low in (("input_size", input_size, 1), ("hidden_size", hidden_size, 1),
                                 ("num_layers", num_layers, 1)):
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
                    raise ValueError(f"`{name}` must be an integer >= {low}, got {v!r}")
            if (isinstance(dropout, bool) or not isinstance(dropout, (int, float, np.integer, np.floating))
                    or not 0.0 <= float(dropout) <= 1.0):
                raise ValueError(f"`dropout` must be a number in [0, 1] (the probability of zeroing an element "
                                 f"of the output of every layer but the last, as in nn.{self._cell}), got {dropout!r}")
            if float(dropout) > 0 and num_layers == 1:
                warnings.warn(f"dropout={dropout} with num_layers=1 does nothing: {type(self).__name__}, like "
                              f"nn.{self._cell}, drops elements of the outputs of every layer but the last",
                              UserWarning, stacklevel=2 + (type(self).__init__ is not _ParallelRNN.__init__))
            if coarse not in COARSE_STEPS:
                raise ValueError(f"`coarse` must be one of {COARSE_STEPS}, got {coarse!r}")
            if tol_type not in ("abs", "rel"):
                raise ValueError(f"`tol_type` must be 'abs' or 'rel', got {tol_type!r}")
            if cycle not in ("V", "F"):
                raise ValueError(f"`cycle` must be 'V' or 'F', got {cycle!r}")
            check_levels(cf, max_levels, min_coarse, relax, 1.0)
            self.input_size, self.hidden_size, self.num_layers = int(input_size), int(hidden_size), int(num_layers)
            for flag, value in (("bias", bias), ("batch_first", batch_first)):
                if not isinstance(value, bool):  # (torch's words)
                    raise TypeError(f"{flag} should be of type bool, got: {type(value).__name__}")
            self.bias, self.batch_first = bias, batch_first
            self.dropout = float(dropout)
            self.bidirectional = bool(bidirectional)  # (as torch: any truth value)
            self.num_directions = 2 if self.bidirectional else 1
            self.options = FixedOptions(cf=frozen_per_level(cf), max_levels=max_levels, min_coarse=min_coarse,
                                        relax=frozen_per_level(relax))
            self.cycle, self.coarse = cycle, coarse
            self._init_cycles(fwd_iters, bwd_iters, fwd_tol, bwd_tol)
            self.tol_type = tol_type
            self.skip, self.exact_eval = check_flag(skip, "skip"), check_flag(exact_eval, "exact_eval")
            self.return_sequence = check_flag(return_sequence, "return_sequence")
            factory = {"device": device, "dtype": dtype}
            H, G = self.hidden_size, self._gates * self.hidden_size
            for l in range(self.num_layers):
                n_in = self.input_size if l == 0 else H * self.num_directions
                for sfx in ("", "_reverse")[:self.num_directions]:  # torch's names and order
                    self.register_parameter(f"weight_ih_l{l}{sfx}", nn.Parameter(torch.empty(G, n_in, **factory)))
                    self.register_parameter(f"weight_hh_l{l}{sfx}", nn.Parameter(torch.empty(G, H, **factory)))
                    if self.bias:
                        self.register_parameter(f"bias_ih_l{l}{sfx}", nn.Parameter(torch.empty(G, **factory)))
                        self.register_parameter(f"bias_hh_l{l}{sfx}", nn.Parameter(torch.empty(G, **factory)))
            self.reset_parameters()
        self._uid = None  # (agreed below: which module a pass is of, compared in every handshake)
        if self._comm.size > 1:
            self._agree_on_ranks()
        self._layouts: dict = {}
        #: mgrit.Result of the last forward and adjoint solve of every layer, without their states
        #: (Result.without_states): statistics only, no trajectory held between passes
        #: (one entry per layer and direction, in h_n's order: layer 0, layer 0 reverse, layer 1, ...);
        #: a differentiated forward pass clears last_backward, whose entries its backward pass fills
        self.last_forward: list = [None] * self.num_layers * self.num_directions
        self.last_backward: list = [None] * self.num_layers * self.num_directions
        #: the seed of the dropout masks of the last forward pass in training mode (None: no dropout drawn);
        #: :meth:`dropout_masks` gives its masks
        self.last_dropout_seed: int | None = None

    def _replica_settings(self) -> tuple:
        """What the data replicas of this module must share (compared by allreduce_gradients): the network
        and its solves' cycles and tolerances (replicas that solve differently average gradients of different
        approximations)."""
        return tuple((name, getattr(self, name)) for name in (
            "cycle", "coarse", "dropout", "return_sequence", "fwd_iters", "bwd_iters", "fwd_tol", "bwd_tol",
            "tol_type", "skip", "exact_eval")) + (("options", repr(self.options)),)

    def _agree_on_ranks(self) -> None:
        """Building on several ranks is collective: the ranks agree on the module's id (so that ranks
        calling two modules in different orders raise) and raise alike when they built different ones."""
        params = list(self.parameters())
        settings = (self.input_size, self.hidden_size, self.num_layers, self.bias, repr(self.options), self.cycle,
                    self.coarse, self.bidirectional, self.dropout, self.return_sequence, self.batch_first,
                    str(params[0].dtype))
        name = type(self).__name__
        meta = any(p.is_meta for p in params)
        session = self._comm.session(Call(f"building a {name}"), share=(_uids[0], *settings, meta))
        with session:
            same = all(sh[1:] == session.shared[0][1:] for sh in session.shared)
            if same and not meta:  # rank 0's initial weights on every rank, as DistributedDataParallel's: the
                with torch.no_grad():  # ranks' generators may differ (seeded by rank); all use one copy
                    flat = torch.cat([p.reshape(-1) for p in params])
                    flat = self._comm.bcast_state(flat if self._comm.rank == 0 else None, flat, root=0)
                    for p, v in zip(params, torch.split(flat, [p.numel() for p in params])):
                        p.copy_(v.view_as(p))
        self._uid = _agreed_build(session.shared, name, ("input_size", "hidden_size", "num_layers", "bias",
                                                         "MGRIT settings", "cycle", "coarse", "bidirectional",
                                                         "dropout", "return_sequence", "batch_first",
                                                         "parameter dtype", "meta device"))

    def __getstate__(self):
        """Pickling and ``copy.deepcopy`` (torch.save of the module, AveragedModel, ...): on one rank the
        communicator is replaced by the serial one (an MPI communicator does not pickle); on several ranks
        a clear error, as LayerParallel's."""
        if self._comm.size > 1:
            raise TypeError(
                f"a {type(self).__name__} on several ranks holds a communicator and cannot be pickled or "
                f"deep-copied: save model.state_dict() (or model.to_{self._cell.lower()}()) and build a new "
                "module on every rank to load it into")
        state = dict(self.__dict__)
        state["_comm"] = as_communicator(None)
        state["last_forward"] = [None] * len(self.last_forward)  # (diagnostics only)
        state["last_backward"] = [None] * len(self.last_backward)
        return state

    def reset_parameters(self):
        """torch's initialisation (``nn.GRU``, ``nn.LSTM``): every parameter uniform in
        ``(-1/sqrt(H), 1/sqrt(H))``."""
        stdv = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            nn.init.uniform_(p, -stdv, stdv)

    def flatten_parameters(self):
        """No-op (kept for code written for torch's recurrent modules)."""

    @property
    def mode(self) -> str:
        """torch's name of the cell (``"GRU"``, ``"LSTM"``), as ``nn.GRU.mode``."""
        return self._cell

    @property
    def proj_size(self) -> int:
        """Always 0 (no projections), as torch's recurrent modules report it."""
        return 0

    @property
    def all_weights(self) -> list:
        """The parameters of every layer and direction, in torch's order and grouping
        (``[weight_ih, weight_hh, bias_ih, bias_hh]`` per layer and direction)."""
        return [[v for v in self.layer_weights(l, reverse=d == 1) if v is not None]
                for l in range(self.num_layers) for d in range(self.num_directions)]

    def layer_weights(self, l: int, reverse: bool = False) -> tuple:
        """``(weight_ih, weight_hh, bias_ih, bias_hh)`` of layer ``l`` (biases None without bias);
        ``reverse=True``: of its reverse direction (bidirectional only)."""
        if reverse and not self.bidirectional:
            raise ValueError(f"reverse=True: this {type(self).__name__} is not bidirectional")
        sfx = "_reverse" if reverse else ""
        g = lambda name: getattr(self, f"{name}_l{l}{sfx}", None)  # noqa: E731
        return g("weight_ih"), g("weight_hh"), g("bias_ih"), g("bias_hh")

    def dropout_masks(self, seed: int, like: torch.Tensor) -> list:
        """The dropout masks of a forward pass whose seed was ``seed`` (:attr:`last_dropout_seed`).

        ``like`` is an output sequence as ``forward`` returns it (``(L, B, D * hidden_size)``,
        ``(B, L, D * hidden_size)`` with ``batch_first``, ``(L, D * hidden_size)`` unbatched);
        the masks come in its layout, dtype and device: one per layer but the last, zeros and
        ``1 / (1 - dropout)``, so that layer ``l + 1`` read ``output_l * masks[l]`` (``output_l``
        the output sequence of layer ``l``). Every rank draws the same masks (from a generator
        seeded with ``seed``, which rank 0 draws from torch's global generator), so one and
        several ranks give the same pass; they are not torch's own masks. For a PackedSequence
        ``like`` the masks are in its padded layout, ``nn.utils.rnn.pad_packed_sequence(like)[0]``
        (positions first, the caller's batch order), which is where the pass applied them.
        """
        if isinstance(like, nn.utils.rnn.PackedSequence):
            padded = nn.utils.rnn.pad_packed_sequence(like)[0]
            return self._masks(seed, tuple(padded.shape), padded)
        if like.dim() == 2:  # unbatched
            return [m.squeeze(1) for m in self._masks(seed, (like.shape[0], 1, like.shape[1]), like)]
        if self.batch_first:
            return [m.transpose(0, 1) for m in self._masks(seed, (like.shape[1], like.shape[0], like.shape[2]), like)]
        return self._masks(seed, tuple(like.shape), like)

    def _masks(self, seed: int, shape: tuple, like: torch.Tensor) -> list:
        """:meth:`dropout_masks` in the module's own layout ``shape`` = ``(L, B, D * hidden_size)``."""
        g = torch.Generator(device=like.device)
        g.manual_seed(int(seed))
        q = 1.0 - self.dropout
        masks = []
        for _ in range(self.num_layers - 1):
            keep = torch.empty(shape, dtype=like.dtype, device=like.device).bernoulli_(q, generator=g)
            masks.append(keep / q if q > 0 else keep)
        return masks

    def _to_serial(self):
        """The ``torch.nn`` module of the cell with a copy of the current weights, in this module's mode."""
        p = next(self.parameters())
        serial = getattr(nn, self._cell)(self.input_size, self.hidden_size, self.num_layers, bias=self.bias,
                                         batch_first=self.batch_first, dropout=self.dropout,
                                         bidirectional=self.bidirectional, device=p.device, dtype=p.dtype)
        # the weights' current values by torch's names (a parametrized weight, e.g. weight_norm's, is computed:
        # its state-dict entries are the parametrization's, which the plain module does not have)
        serial.load_state_dict({k: getattr(self, k).detach() for k in serial.state_dict()})
        return serial.train(self.training)  # (in eval mode no dropout between the layers, as this module)

    @property
    def _serial_hint(self) -> str:
        return f"the serial {self._cell}, `model.to_{self._cell.lower()}()`"

    # -- helpers ---------------------------------------------------------------------
    def _session(self, what: str, signature=None, share=None, agree: str = ""):
        """A failure-aware communicator session on several ranks; nothing on one. Its handshake names
        the call, ``what``, and compares the module's id: ranks in different calls raise naming each one's."""
        if self._comm.size > 1:
            name = f"{what} of {type(self).__name__} #{self._uid}"
            return _one_thread(self, self._comm.session(signature=Call(name, (self._uid, signature), agree),
                                                        share=share))
        return contextlib.nullcontext()

    def _layout(self, L: int) -> _Layout:
        lay = self._layouts.get(L)
        if lay is None:
            if len(self._layouts) >= _LAYOUTS_KEPT:  # (one per sequence length: a data set of many lengths
                self._layouts.pop(next(iter(self._layouts)))  # held them all, growing as their squares)
            lay = self._layouts[L] = _Layout(L, self.options, self._comm.size, self._comm.rank)
        return lay

    def _mgrit_options(self, exact: bool, forward: bool) -> dict:
        if exact:
            return dict(max_levels=1)
        return dict(**self.options, cycle=self.cycle, tol=self.fwd_tol if forward else self.bwd_tol,
                    tol_type=self.tol_type, max_iter=self.fwd_iters if forward else self.bwd_iters,
                    skip=self.skip)

    def _autocast_dtype(self, input):
        """The dtype a pass computes in under ``torch.autocast`` on the input's device (None: the
        parameters' own): the autocast dtype, as torch's recurrent modules on CUDA (float64 parameters
        are not cast, as autocast leaves float64 alone)."""
        p = self.weight_ih_l0 if isinstance(getattr(self, "weight_ih_l0", None), torch.Tensor) else None
        if p is None or p.dtype == torch.float64:
            return None
        amp = _autocast_on(input if isinstance(input, torch.Tensor) else torch.empty(0))
        return None if amp == p.dtype else amp

    def _check(self, input, hx, amp=None, time_major: bool = False):
        """Shapes, dtypes and devices as torch's module expects them; returns (x (L,B,in), the initial
        states (num_layers * D, B, S), batched). ``amp``: the autocast dtype of the pass (the input and
        the initial states are cast to it). ``time_major``: a batched input is (L, B, in) whatever
        ``batch_first`` says (a PackedSequence's padded form)."""
        name = type(self).__name__
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"{name} expects a torch.Tensor input, got {type(input).__name__}")
        if not input.is_floating_point():
            raise TypeError(f"{name} expects a floating-point input, got dtype {input.dtype}; "
                            "convert it, e.g. input.float()")
        if input.dim() not in (2, 3):
            raise ValueError(f"{name} expects a 2-D (unbatched) or 3-D (batched) input, got "
                             f"{input.dim()}-D input of shape {tuple(input.shape)}")
        if input.shape[-1] != self.input_size:
            raise ValueError(f"input.size(-1) must equal input_size = {self.input_size}, got input of shape "
                             f"{tuple(input.shape)}")
        batched = input.dim() == 3
        x = input.unsqueeze(1) if not batched else (
            input.transpose(0, 1) if self.batch_first and not time_major else input)
        L = int(x.shape[0])
        if L < 1:
            raise ValueError(f"the input sequence is empty (shape {tuple(input.shape)}); give at least one position")
        self._check_weights()
        p = self.weight_ih_l0
        if amp is not None and x.dtype != torch.float64:  # (autocast casts what is not float64)
            x = x.to(amp)

            def cast(h):
                fp = isinstance(h, torch.Tensor) and h.is_floating_point() and h.dtype != torch.float64
                return h.to(amp) if fp else h

            hx = type(hx)(cast(h) for h in hx) if isinstance(hx, (tuple, list)) else cast(hx)
        want = p.dtype if amp is None else amp
        if x.dtype != want or x.device != p.device:
            raise TypeError(f"input is {x.dtype} on {x.device} but the parameters are {p.dtype} on {p.device}"
                            + ("" if amp is None else f" (computed in {amp} under torch.autocast)")
                            + "; convert one of them (model.to(input) or input.to(...))")
        h0 = self._initial_states(hx, x, batched)
        if not x.is_meta:
            for what, v in (("an input", x), (f"an {self._state_names[0]}", h0)):
                if not bool(torch.isfinite(v).all()):  # (else the solve would report a divergence)
                    cast = "" if amp is None else f" (after the cast to {amp} under torch.autocast)"
                    raise ValueError(f"{type(self).__name__} got {what} that contains NaN or Inf{cast}: check the "
                                     f"data and what comes before the {self._cell}")
        return x, h0, batched

    def _check_weights(self) -> None:
        """Every weight present with torch's shape (a replaced or deleted one is named, before any solve)."""
        H, G = self.hidden_size, self._gates * self.hidden_size
        for l in range(self.num_layers):
            n_in = self.input_size if l == 0 else H * self.num_directions
            for sfx in ("", "_reverse")[:self.num_directions]:
                shapes = {"weight_ih": (G, n_in), "weight_hh": (G, H)}
                if self.bias:
                    shapes.update(bias_ih=(G,), bias_hh=(G,))
                for what, shape in shapes.items():
                    name = f"{what}_l{l}{sfx}"
                    w = getattr(self, name, None)
                    if not isinstance(w, torch.Tensor) or tuple(w.shape) != shape:
                        got = f"shape {tuple(w.shape)}" if isinstance(w, torch.Tensor) else f"{type(w).__name__}"
                        raise ValueError(f"{type(self).__name__}.{name} must be a tensor of shape {shape}, as in "
                                         f"torch's {self._cell} (got {got})")
                    if not w.is_meta and not bool(torch.isfinite(w).all()):  # (else: a "divergence" of MGRIT)
                        raise ValueError(f"{type(self).__name__}.{name} contains NaN or Inf: torch's {self._cell} "
                                         "would return NaN; check the optimizer step that produced it (a "
                                         "learning rate too large, a loss scaler's skipped step)")

    def _checked_state(self, v, name: str, x, batched: bool):
        """One initial state tensor (``h0`` or ``c0``) checked against torch's shape, as (units, B, H)."""
        units, B = self.num_layers * self.num_directions, int(x.shape[1])
        shape = (units, B, self.hidden_size) if batched else (units, self.hidden_size)
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(v).__name__} (pass hx=None for zero initial "
                            "states, or every initial state as a tensor)")
        if tuple(v.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} ("
                             f"{'num_layers * 2' if self.bidirectional else 'num_layers'}, "
                             f"{'batch, ' if batched else ''}hidden_size), got {tuple(v.shape)}")
        if v.dtype != x.dtype or v.device != x.device:
            raise TypeError(f"{name} is {v.dtype} on {v.device}, the input {x.dtype} on {x.device}; "
                            "give both the same dtype and device")
        return v if batched else v.unsqueeze(1)

    # -- forward ---------------------------------------------------------------------
    @_eager_under_compile
    def forward(self, input, hx=None):
        data = input.data if isinstance(input, nn.utils.rnn.PackedSequence) else input
        amp = self._autocast_dtype(data)  # under torch.autocast: the pass computes in its dtype, autocast off
        with _no_autocast(data) if amp is not None else contextlib.nullcontext():
            return self._forward(input, hx, amp)

    def _no_export(self) -> RuntimeError:
        cell = self._cell
        return RuntimeError(_NO_EXPORT.format(
            cls=type(self).__name__, serial=f"model.to_{cell.lower()}() is the nn.{cell} with the same weights "
                                            "(what the solves converge to)"))

    def __prepare_scriptable__(self):
        """torch.jit.script calls this first (on every submodule): our error, not its compiler's."""
        raise self._no_export()

    def _forward(self, input, hx, amp):
        name = type(self).__name__
        if _exporting():
            raise self._no_export()
        if _functorch_active():
            raise RuntimeError(_no_transforms("torch.func transforms (grad, vmap, jacrev, jvp, ...)", name,
                                              self._serial_hint))
        P = self._comm.size
        drop = self.training and self.dropout > 0 and self.num_layers > 1
        rng = torch.random.get_rng_state() if drop else None
        packed = input if isinstance(input, nn.utils.rnn.PackedSequence) else None
        try:
            seed, share, session, held = None, None, None, None
            with _announced(self._comm):  # a bad input on one rank raises on every rank (in the handshake below)
                if packed is not None:  # padded, in the caller's batch order; positions past a sequence's end held
                    input, held = _unpacked(packed)
                x, h0, batched = self._check(input, hx, amp, time_major=packed is not None)
                # every rank draws (the global generators stay in step); rank 0's seed is used on all
                seed = int(torch.randint(0, 2 ** 62, ()).item()) if drop else None
                share = ((None, None) if x.is_meta else _tensor_sums(x, h0)) + (
                    seed, _input_layout(input, held),
                    tuple((n, tuple(p.shape), None if p.is_meta else _input_sums(p))
                          for n, p in self.named_parameters()), self._pass_id) if P > 1 else None
            session = self._session("the input check of a forward pass", share=share)
            with session:  # its handshake all-gathers the ranks' inputs' sums and shapes, compared below alike
                differ = None  # on every rank (every rank holds the whole sequence)
            if share is not None:  # this pass's id, alike on every rank (compared by its backward passes)
                self._pass_id = max(sh[5] for sh in session.shared) + 1
            shapes = [] if share is None else [sh[3] for sh in session.shared]
            if len(set(shapes)) > 1:  # first: another length or batch is named as such, not as other values
                r = next(r for r, sh in enumerate(shapes) if sh != shapes[0])
                differ = ValueError(f"the input of rank {r} has {_layout_words(shapes[r])}, rank 0's "
                                    f"{_layout_words(shapes[0])}: every rank must pass the same whole sequence")
            if differ is None and share is not None:
                differ = _differing_parts(session.shared, ("input", self._state_names[0]))
            if differ is None and share is not None and len({sh[2] is None for sh in session.shared}) > 1:
                differ = ValueError(f"dropout is drawn on some ranks and not on others: put the {name} in the "
                                    "same mode on every rank (model.train() or model.eval() alike)")
            same = ("every rank must hold the same weights (build the module after seeding every rank alike, or "
                    "load the same state_dict on every rank)")
            if differ is None and share is not None:  # the same parameters (names and shapes) on every rank
                layouts = [tuple((n, s) for n, s, _ in sh[4]) for sh in session.shared]
                r = next((r for r, lay in enumerate(layouts) if lay != layouts[0]), None)
                if r is not None:
                    differ = ValueError(f"the parameters of rank {r} ({[f'{n} {s}' for n, s in layouts[r]]}) differ "
                                        f"from rank 0's ({[f'{n} {s}' for n, s in layouts[0]]}): " + same)
            if differ is None and share is not None:  # every rank must hold the same weights
                for j, (n, _, _) in enumerate(session.shared[0][4]):
                    sums = [sh[4][j][2] for sh in session.shared]
                    if any(v is None for v in sums):  # (meta parameters: shapes only)
                        continue
                    differ = _differing_inputs(sums, f"parameter {n}", same)
                    if differ is not None:
                        break
            if differ is not None:
                raise differ
        except BaseException:
            if rng is not None:  # the pass failed on every rank: undo the draw, so the ranks' generators agree
                torch.random.set_rng_state(rng)
            raise
        if drop:
            seed = seed if share is None else session.shared[0][2]
        self.last_dropout_seed = seed
        params = list(self.parameters())
        track = torch.is_grad_enabled() and (
            P > 1 or x.requires_grad or h0.requires_grad or any(p.requires_grad for p in params))
        inp, last, D = x, [], self.num_directions
        if x.is_meta:  # shape inference (torch's modules answer it on the meta device): no solve
            L, B, D = x.shape[0], x.shape[1], self.num_directions
            out = x.new_empty(L, B, D * self.hidden_size) if self.return_sequence else None
            return self._returned(out, h0.new_empty(h0.shape), batched, packed)
        if x.shape[1] == 0:  # an empty batch (on every rank: the input check compared the shapes): no solve
            return self._empty_pass(x, h0, params, track, batched)
        with _announced(self._comm):  # (local work: a failure here reaches every rank in its next handshake)
            masks = self._masks(seed, (x.shape[0], x.shape[1], D * self.hidden_size), x) if drop else None
        if track:  # this pass's adjoint solves replace the last ones (units not differentiated stay None)
            self.last_backward = [None] * len(self.last_backward)
        for l in range(self.num_layers):
            want = self.return_sequence or l < self.num_layers - 1
            outs = []
            for d in range(D):  # the reverse direction solves on the flipped sequence
                k = l * D + d
                with _announced(self._comm):
                    w = [v if amp is None else v.to(amp) for v in self.layer_weights(l, reverse=d == 1) if v is not None]
                    src = inp.flip(0) if d else inp
                    # (reversed, a sequence's padding comes first: the state stays h0 until its last position)
                    hold = None if held is None else (held.flip(0) if d else held)
                if track:  # every rank takes the autograd path (and so joins the adjoint solves in backward)
                    anchor = torch.zeros((), requires_grad=P > 1)
                    out, hL = _LayerFunction.apply(self, k, want, hold, anchor, src, h0[k], *w)
                else:
                    with torch.no_grad():
                        out, hL, _ = self._layer_forward(k, src, h0[k], w, want, keep=False, held=hold)
                last.append(hL)
                outs.append(out)
            with _announced(self._comm):
                outs = [o.flip(0) if d and want else o for d, o in enumerate(outs)]
                inp = torch.cat(outs, dim=-1) if D > 1 and want else outs[0]
                if drop and l < self.num_layers - 1:  # torch's dropout: on the output of every layer but the last
                    inp = inp * masks[l]
        return self._returned(inp if self.return_sequence else None, torch.stack(last), batched, packed)

    def _returned(self, output, states, batched: bool, packed=None) -> tuple:
        """``(output, final states)`` in the caller's layout (``output`` None without ``return_sequence``;
        the final states as :meth:`_final_states` gives them). For a PackedSequence input ``packed``, the
        output is packed as it was (its ``batch_sizes`` and sort order)."""
        if packed is not None:
            return (None if output is None else _packed_like(output, packed)), self._final_states(states)
        if not batched:
            output, states = (None if output is None else output.squeeze(1)), states.squeeze(1)
        elif output is not None and self.batch_first:
            output = output.transpose(0, 1)
        return output, self._final_states(states)

    # -- what each cell defines -------------------------------------------------------
    def _initial_states(self, hx, x, batched: bool):
        """The initial states of every layer and direction, ``(num_layers * D, B, S)``, from ``hx``."""
        raise NotImplementedError

    def _final_states(self, states):
        """What ``forward`` returns after the output for the final states ``(num_layers * D, B, S)``."""
        raise NotImplementedError

    def _empty_pass(self, x, h0, params, track: bool, batched: bool) -> tuple:
        """torch's answer to an empty batch: empty outputs, and zero gradients for the input, the initial
        states and every weight (the outputs depend on all of them through a zero)."""
        L, D, H = x.shape[0], self.num_directions, self.hidden_size
        zero = x.sum() + h0.sum()
        for p in params:
            zero = zero + p.sum()
        zero = zero * 0 if track else 0.0
        output = x.new_zeros(L, 0, D * H) + zero if self.return_sequence else None
        return self._returned(output, h0.new_zeros(h0.shape) + zero, batched)

    def _split(self, weights):
        w_ih, w_hh = weights[0], weights[1]
        b_ih, b_hh = (weights[2], weights[3]) if self.bias else (None, None)
        return w_ih, w_hh, b_ih, b_hh

    def _unit(self, k: int) -> str:
        """The name of solve unit ``k`` (a layer, or one direction of a layer)."""
        l, d = divmod(k, self.num_directions)
        return f"layer {l}" + (" (reverse)" if d else "")

    def _layer_forward(self, k, x, h0, weights, want_seq: bool, keep: bool, held=None):
        """Solve unit ``k`` (layer ``k`` or, bidirectional, one direction of a layer: see :meth:`_unit`) on
        the sequence ``x`` in its own order; returns (output sequence or an empty tensor, h_L, what backward
        needs). ``held`` (bool, (L, B), or None): the positions whose step keeps the state as it is (past the
        end of a packed sequence)."""
        P, r = self._comm.size, self._comm.rank
        L, B = int(x.shape[0]), int(x.shape[1])
        exact = self.exact_eval and not self.training
        with _announced(self._comm):  # local work before the layer's session: a failure reaches every rank
            lay = self._layout(L)
            w_ih, w_hh, b_ih, b_hh = (None if v is None else v.detach() for v in self._split(weights))
            xd = x.detach()
            gi = F.linear(xd[lay.w_lo:lay.w_hi], w_ih, b_ih)  # input projections: one matrix product
            prop = self._propagator(w_hh, b_hh, gi, lay.w_lo, self.coarse)
            if held is not None:
                prop.hold(held[lay.w_lo:lay.w_hi])
        if P == 1:
            res = mgrit.solve(prop, h0.detach().contiguous(), lay.t, **self._mgrit_options(exact, True),
                              comm=self._comm, final_residual=True)
            U, g0 = res.u, lay.lo
            out = U[1:, ..., :self.hidden_size].clone() if want_seq else x.new_zeros(0)
            hL = U[-1].clone()
        else:
            # the solve runs inside this session (InSession): one session per layer and pass, whose
            # handshake compares what the solve needs every rank to agree on
            opts = self._mgrit_options(exact, True)
            # (whether the output sequence is gathered: a rank that gathers while another does not would wait)
            sig = args_signature(tuple(opts.items()), tuple(h0.shape), str(h0.dtype), lay.t.tobytes(), want_seq)
            with self._session(f"the forward solve of {self._unit(k)}", sig, agree=_SOLVE_AGREE):
                res = mgrit.solve(prop, h0.detach().contiguous(), lay.t, **opts, comm=InSession(self._comm),
                                  final_residual=True)
                U, g0 = res.u, lay.lo
                if keep:
                    U, g0 = res.with_ghost() if len(U) else (U, g0)  # the left neighbour's last state in front
                piece = U[max(1, lay.lo) - g0:] if lay.hi >= lay.lo else U[:0]
                out = self._gather_points(piece[..., :self.hidden_size], max(1, lay.lo), L, x) \
                    if want_seq else x.new_zeros(0)
                root = lay.plan.owner_of_point(L)
                hL = self._comm.bcast_state(U[-1].clone() if r == root else None, h0, root=root)
        self.last_forward[k] = res.without_states()  # (statistics only: no trajectory held between passes)
        _warn_solve(res, f"forward ({self._cell} {self._unit(k)})", "fwd_iters", None if exact else self.fwd_tol,
                    self.tol_type, x.dtype, (h0, hL))
        saved = (prop, U, g0, L, B, exact) if keep else None
        return out, hL, saved

    def _gather_points(self, piece, start: int, L: int, like):
        """Rows ``start ..`` of the sequence from every rank, as the full ``(L, ...)`` tensor on every rank.

        ``piece`` holds this rank's points ``start .. start + len(piece) - 1`` (1-based
        points: point ``i`` is output position ``i - 1``)."""
        parts = self._comm.gather((start, piece.detach().cpu()), root=None)
        parts = [p for s, p in sorted(parts, key=lambda sp: sp[0]) if len(p)]
        full = torch.cat(parts).to(like.device)
        if full.shape[0] != L:  # pragma: no cover - the blocks cover every point by construction
            raise RuntimeError(f"gathered {full.shape[0]} positions, expected {L}")
        return full

    # -- backward --------------------------------------------------------------------
    def _adjoint_setup(self, saved, weights, g_out, g_hL, need_x: bool, need_h0: bool):
        """The local part of a layer's backward pass, before its collective part: the adjoint
        propagator, its terminal state, the solve's options and the signature of the layer's session."""
        prop, U, g0, L, B, exact = saved
        H = self.hidden_size
        w_ih = weights[0].detach()
        zeros = U.new_zeros(B, U.shape[-1])  # a state (the hidden state first, then the cell's, if any)
        terminal = zeros
        forcing = None
        if g_out is not None and g_out.numel():  # the output sequence is the hidden states h
            g_out = g_out.detach()
            terminal = zeros.clone()
            terminal[..., :H] = g_out[L - 1]
            forcing = torch.cat([zeros[None, ..., :H], g_out])  # g_i at points 0..L (none at point 0)
        if g_hL is not None:
            terminal = terminal + g_hL.detach()
        GH = prop.hidden(U)  # hidden projections at the stored states: one matrix product
        adj = self._adjoint(prop, L, U, GH, g0, forcing)
        opts = self._mgrit_options(exact, False)
        sig = None if self._comm.size == 1 else args_signature(
            tuple(opts.items()), tuple(terminal.shape), str(terminal.dtype), self._layout(L).t.tobytes(), need_x,
            need_h0)
        return w_ih, zeros, terminal, GH, adj, opts, sig

    def _layer_backward(self, k, saved, x, setup, need_x: bool, need_h0: bool, share=None):
        prop, U, g0, L, B, exact = saved
        P, r = self._comm.size, self._comm.rank
        lay = self._layout(L)
        w_ih, zeros, terminal, GH, adj, opts, sig = setup
        # on several ranks one session per layer and pass around the adjoint solve (in reverse rank order,
        # inside it: no handshake or closing barrier of its own) and the gradients' reductions; its
        # handshake compares what the solve and the reductions need every rank to agree on
        session = self._session(f"the backward pass of {self._unit(k)}", sig, share, _BACKWARD_AGREE)
        with session:
            if share is not None:
                differ = _differing_passes([sh[-1] for sh in session.shared], f"{type(self).__name__} #{self._uid}") \
                    or _differing_parts(session.shared, ("gradient of the output sequence", self._state_names[1]),
                                        _DIFFERENT_LOSS)
                if differ is not None:
                    return differ  # every rank found it: raised after the session (no one waits)
            with torch.no_grad():
                res = mgrit.solve(adj, terminal.contiguous(), lay.t, **opts, initial_guess=0.0,
                                  comm=ReversedInSession(self._comm) if P > 1 else self._comm,
                                  partition=lay.plan.adj_partition if P > 1 else None, final_residual=True)
            self.last_backward[k] = res.without_states()
            _warn_solve(res, f"adjoint ({self._cell} {self._unit(k)})", "bwd_iters", self.bwd_tol, self.tol_type,
                        res.u.dtype, (terminal,))
            lam = torch.flip(res.u, dims=[0])  # adjoints at the points lo..hi
            gw, gx_piece = self._step_gradients(prop, U, GH, g0, lam, lay, x.detach(), w_ih, need_x)
            if P == 1:
                return (gx_piece if need_x else None), (lam[0] if need_h0 else None), gw
            flat = torch.cat([g.reshape(-1) for g in gw])
            flat = self._comm.allreduce_array(flat)  # the weights are shared by all steps of all ranks
            sizes = [g.numel() for g in gw]
            gw = [v.view_as(g) for v, g in zip(torch.split(flat, sizes), gw)]
            gx = self._gather_points(gx_piece, int(lay.steps[0]) + 1 if len(lay.steps) else L + 1, L, x) \
                if need_x else None
            gh0 = None
            if need_h0:
                root = lay.plan.owner_of_point(0)
                gh0 = self._comm.bcast_state(lam[0].clone() if r == root else None, zeros, root=root)
        return gx, gh0, gw

    def _step_gradients(self, prop, U, GH, g0, lam, lay, x, w_ih, need_x: bool):
        """Weight gradients (this rank's steps) and the input gradient at their positions.

        For every fine step ``t`` this rank owns (the step ending at its point
        ``t + 1``), the cell's vector-Jacobian product with ``lam_{t+1}``
        (``prop.gate_gradients``) and three matrix products per piece of at
        least 64 steps, at most eight pieces (so
        that the gates' temporaries are a piece's, not every step's), the weight
        gradients summed over the pieces.
        """
        H = self.hidden_size
        t = lay.steps
        n_in = x.shape[-1]
        if not len(t):
            gw = [torch.zeros_like(w) for w in self._detached_weights(prop, w_ih)]
            return gw, x[:0]
        gw, a = None, 0
        gx = x.new_empty((len(t),) + tuple(x.shape[1:-1]) + (w_ih.shape[1],)) if need_x else x[:0]
        for tp in _chunks(t, _PIECE_STEPS):
            s, gh = _windows(U, tp, 1, g0)[:, 0], _windows(GH, tp, 1, g0)[:, 0]
            gi = _windows(prop.gi, tp, 1, prop.offset)[:, 0]
            lm = _windows(lam, tp + 1, 1, lay.lo)[:, 0]
            dgi, dgh = prop.gate_gradients(s, gi, gh, lm)  # (steps, B, G): of the gates' input and hidden parts
            G = dgi.shape[-1]
            dgi2, dgh2 = dgi.reshape(-1, G), dgh.reshape(-1, G)
            h = s[..., :H]  # (the hidden state: the whole state of a GRU)
            part = [dgi2.t() @ _windows(x, tp, 1, 0)[:, 0].reshape(-1, n_in), dgh2.t() @ h.reshape(-1, H)]
            if self.bias:
                part += [dgi2.sum(0), dgh2.sum(0)]
            gw = part if gw is None else [g.add_(q) for g, q in zip(gw, part)]
            if need_x:
                torch.matmul(dgi, w_ih, out=gx[a: a + len(tp)])
            a += len(tp)
        return gw, gx

    def _detached_weights(self, prop, w_ih):
        out = [w_ih, prop.W]
        if self.bias:
            out += [prop.W.new_zeros(prop.W.shape[0]), prop.W.new_zeros(prop.W.shape[0])]
        return out

    # -- diagnostics -----------------------------------------------------------------
    @property
    def forward_residuals(self) -> list:
        """Residual history of the last forward solve of every layer (and direction: ``last_forward``'s order)."""
        return [[] if res is None else list(res.residuals) for res in self.last_forward]

    @property
    def backward_residuals(self) -> list:
        """Residual history of the last adjoint solve of every layer (and direction); ``[]`` for one that
        the last differentiated pass did not solve (nothing needed its gradient)."""
        return [[] if res is None else list(res.residuals) for res in self.last_backward]

    @property
    def forward_residual(self) -> float | None:
        """Largest residual norm over the layers (and directions) of the trajectories the last forward pass
        returned (0: exact)."""
        vals = [res.final_residual for res in self.last_forward if res is not None]
        return max(vals) if vals else None

    @property
    def backward_residual(self) -> float | None:
        """Largest residual norm over the layers (and directions) of the adjoints of the last backward pass
        (0: exact)."""
        vals = [res.final_residual for res in self.last_backward if res is not None]
        return max(vals) if vals else None

    def extra_repr(self) -> str:
        o = self.options
        s = (f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}, bias={self.bias}, "
             f"batch_first={self.batch_first}, ")
        s += f"dropout={self.dropout}, " if self.dropout else ""
        s += "bidirectional=True, " if self.bidirectional else ""
        s += (f"cf={o['cf']}, max_levels={o['max_levels']}, relax={o['relax']}, "
              f"coarse={self.coarse!r}, fwd_iters={self.fwd_iters}, bwd_iters={self.bwd_iters}")
        if self._comm.size > 1:
            s += f", ranks={self._comm.size}"
        return s


def check_options(cls: str, options: dict) -> None:
    """TypeError naming ``cls`` (the public class) for a keyword that neither torch's module nor
    :class:`_ParallelRNN` takes (Python's own message named the private class)."""
    import inspect

    known = [k for k, q in inspect.signature(_ParallelRNN.__init__).parameters.items() if q.kind is q.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"{cls}() got an unexpected keyword argument {unknown[0]!r}; beyond torch's arguments it "
                        f"takes {', '.join(known)}")
