"""``ParallelGRU``: a GRU whose recursion over the sequence is solved by MGRIT.

The hidden state of one GRU layer obeys ``h_{i+1} = cell(x_i, h_i)``: a time
stepper whose time steps are the sequence positions, whose forcing is the
input ``x_i`` and whose parameters are the same at every step. The forward
pass solves this recursion with MGRIT over the positions, and
``loss.backward()`` solves the adjoint recursion
``lam_i = J_i^T lam_{i+1} + dL/dh_i`` with MGRIT in reverse time, then forms
the gradients of every weight and of the input from vector-Jacobian products
at all steps at once. At convergence output and gradients equal
``torch.nn.GRU``'s. This module holds the GRU's propagators (the cell, its
coarse step and their adjoints); the module machinery it shares with
``ParallelLSTM`` is :mod:`propagators.torch.rnn`. See docs/gru.md (semantics,
the coarse step, usage, limitations) and docs/theory.md (the adjoint).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mgrit.comm import as_communicator, warn_if_alone

from .module import _announced
from .rnn import (_affine_compose, _affine_scan, _CellAdjoint, _CellPropagator, _finite_when_held, _ParallelRNN,
                  _windows, check_options)

__all__ = ["ParallelGRU", "GRUPropagator", "GRUAdjointPropagator"]


class GRUPropagator(_CellPropagator):
    """The forward propagator of one GRU layer; time points are sequence positions.

    The fine step over ``[i, i + 1]`` is the GRU cell of ``torch.nn.GRU``::

        r = sigmoid(gi_r[i] + W_hr h + b_hr)
        z = sigmoid(gi_z[i] + W_hz h + b_hz)
        n = tanh(gi_n[i] + r * (W_hn h + b_hn))
        h' = n + z * (h - n)          # = (1 - z) n + z h

    with the input projections ``gi[i] = W_i x_i + b_i`` computed beforehand.
    A coarse step over ``[i0, i1]`` (``m = i1 - i0`` positions) is, with
    ``coarse="frozen"`` (default), the same recursion over all ``m`` inputs of
    the interval with the hidden-state feedback ``W_h h + b_h`` of the gates
    frozen at the interval's start::

        gh = W_h h_{i0} + b_h         # one matrix product per coarse step
        h_{k+1} = n_k + z_k (h_k - n_k),   r_k, z_k, n_k from gi[i0 + k] and gh

    With ``coarse="inject"`` it is one cell at the interval's first input.
    Both are the fine step when ``m = 1``. See docs/gru.md.

    Parameters
    ----------
    weight_hh : Tensor, shape (3H, H)
    bias_hh : Tensor, shape (3H,), or None
    gi : Tensor, shape (n, B, 3H)
        Input projections of the positions ``offset .. offset + n - 1``.
    offset : int
    coarse : {"frozen", "inject"}
    """

    def hold(self, held) -> None:
        # the fine step returns the state itself there (n + 1 (h - n) would round: in bfloat16 a step moved h by
        # 2^-8), and an update gate of exactly 1 (sigmoid(inf)) makes the frozen coarse step's composition
        # (z, n - z n) = (1, 0) the identity exactly, and every gate's gradient there exactly 0
        self.held = held
        self.gi[..., self.H:2 * self.H].masked_fill_(held[..., None], math.inf)

    def hidden(self, U):
        """``W_h h + b_h`` for stacked states ``U`` (..., B, H): one matrix product."""
        return _finite_when_held(self, F.linear(U, self.W, self.b), 2)  # (r, z; n reads r * gh_n, as nn.GRU)

    def gates(self, gi, gh):
        """``r, z, n`` from input projections ``gi`` and hidden projections ``gh`` (broadcast)."""
        H = self.H
        rz = (gi[..., :2 * H] + gh[..., :2 * H]).sigmoid_()  # (in place on the fresh sums)
        r, z = rz[..., :H], rz[..., H:]
        n = (gi[..., 2 * H:] + r * gh[..., 2 * H:]).tanh_()
        return r, z, n

    def gate_gradients(self, h, gi, gh, lam):
        """One fine step's vector-Jacobian product with ``lam`` (the adjoint at its end), at the states
        ``h``: the gradients of the gates' input parts ``gi`` and of their hidden parts ``gh`` (the
        weight gradients are their products with the inputs and the states)."""
        H = self.H
        r, z, n = self.gates(gi, gh)
        dz = lam * (h - n) * z * (1.0 - z)
        dn = lam * (1.0 - z) * (1.0 - n * n)
        dr = dn * gh[..., 2 * H:] * r * (1.0 - r)
        return torch.cat([dr, dz, dn], dim=-1), torch.cat([dr, dz, dn * r], dim=-1)

    def advance(self, U, i0: np.ndarray, m: int):
        """States ``U`` at positions ``i0`` advanced by ``m`` positions (all intervals alike)."""
        k = self.span(m)
        if k == 0:  # an empty interval: no position to step
            return U
        r, z, n = self.gates(self.inputs(i0, k), self.hidden(U)[:, None])
        if k == 1:  # the GRU cell, written as torch.nn.GRU writes it
            out = n[:, 0] + z[:, 0] * (U - n[:, 0])
            if self.held is not None:  # (past a packed sequence's end: hold)
                out = torch.where(self.held_at(i0), U, out)
            return out
        # frozen gates: h_{j+1} = z_j h_j + (1 - z_j) n_j is affine in h, composed in log2(k) rounds
        A, Bc = _affine_compose(z, n - z * n)
        return torch.addcmul(Bc, A, U)


class GRUAdjointPropagator(_CellAdjoint):
    """The adjoint of a :class:`GRUPropagator` with forcing, in reverse time.

    Reverse point ``s`` is sequence point ``N - s``. A step covering the
    forward interval ``[i0, i1]`` maps ``lam_{i1}`` to ::

        lam_{i0} = g_{i0} + (d Phi / d h_{i0})^T [g_{i0+1}, ..., g_{i1-1}, lam_{i1}]

    where ``Phi`` is the forward step over the interval (the GRU cell on the
    fine level; the coarse step of the forward propagator on coarse levels,
    whose intermediate states ``h_{i0+1..i1-1}`` receive the forcing ``g``),
    linearised at the stored forward state ``h_{i0}``. On the fine level this
    is the exact adjoint recursion ``lam_i = J_i^T lam_{i+1} + g_i``.

    Parameters
    ----------
    forward : GRUPropagator
    n_steps : int
        ``N``, the sequence length.
    U : Tensor, shape (n, B, H)
        Forward states at the points ``g0 .. g0 + n - 1`` (the stepping rank's points).
    GH : Tensor, shape (n, B, 3H)
        ``forward.hidden(U)``.
    g0 : int
    forcing : Tensor, shape (N + 1, B, H), or None
        ``g_i = dL/dh_i`` from outside the recursion at every point (None: none
        but the terminal one, which is the solve's initial value).
    """

    def back(self, V, i0: np.ndarray, m: int):
        f, H = self.fwd, self.fwd.H
        gh = _windows(self.GH, i0, 1, self.g0)
        k = f.span(m)
        r, z, n = f.gates(f.inputs(i0, k), gh)
        h0 = _windows(self.U, i0, 1, self.g0)[:, 0]
        if k == 1:
            hs, mus, mu = h0[:, None], V[:, None], z[:, 0] * V
        else:
            # states before each position: h_{j+1} = z_j h_j + (1 - z_j) n_j (affine in h, scanned)
            A, Bc = _affine_scan(z[:, :-1], (n - z * n)[:, :-1])
            hs = torch.cat([h0[:, None], torch.addcmul(Bc, A, h0[:, None])], dim=1)
            # adjoint at each position, from the last back: mu_{j-1} = z_j mu_j (+ g_{i0+j} for j > 0),
            # affine in mu, scanned in reverse order
            zr = z.flip(1)
            if self.g is not None:
                c = _windows(self.g, np.asarray(i0) + 1, k - 1, 0).flip(1)
                c = torch.cat([c, torch.zeros_like(c[:, :1])], dim=1)
            else:
                c = torch.zeros_like(zr)
            A, Bc = _affine_scan(zr, c)
            after = torch.addcmul(Bc, A, V[:, None])  # mu after positions k-1, ..., 0
            mus = torch.cat([V[:, None], after[:, :-1]], dim=1).flip(1)  # mu at positions 0, ..., k-1
            mu = after[:, -1]
        dz = mus * (hs - n) * z * (1.0 - z)  # gradients of the gates' pre-activations
        dn = mus * (1.0 - z) * (1.0 - n * n)
        acc_r, acc_z, acc_n = (dn * r * (1.0 - r)).sum(1), dz.sum(1), (dn * r).sum(1)
        dgh = torch.cat([acc_r * gh[:, 0, ..., 2 * H:], acc_z, acc_n], dim=-1)
        lam = mu + torch.matmul(dgh, f.W)
        if self.g is not None:
            lam = lam + _windows(self.g, i0, 1, 0)[:, 0]
        return lam


class ParallelGRU(_ParallelRNN):
    """A multi-layer GRU whose recursion over the sequence is solved by MGRIT.

    Same constructor, call and parameters as :class:`torch.nn.GRU` (an empty
    batch included): ``output, h_n = model(input, h0)`` with ``input`` of shape
    ``(L, B, input_size)`` (``(B, L, input_size)`` with ``batch_first=True``,
    or ``(L, input_size)`` unbatched), ``h0`` of shape ``(D * num_layers, B,
    hidden_size)`` (zeros if None; ``D`` is 2 when bidirectional, else 1),
    ``output`` of shape ``(L, B, D * hidden_size)`` (the last layer's hidden
    states at every position, the reverse direction's second) and ``h_n`` of
    shape ``(D * num_layers, B, hidden_size)``. A
    ``torch.nn.utils.rnn.PackedSequence`` input gives a packed output, as
    ``nn.GRU`` does: the steps past each sequence's end keep its state (an
    update gate of exactly 1), so converged passes equal ``nn.GRU``'s on it
    (docs/gru.md). Parameter names are
    ``nn.GRU``'s (``weight_ih_l0``, ``weight_hh_l0``, ``bias_ih_l0``,
    ``bias_hh_l0``, ``weight_ih_l0_reverse``, ...), so
    ``model.load_state_dict(gru.state_dict())`` works both ways.

    Layer by layer, the forward pass solves the hidden-state recursion with
    MGRIT over the sequence positions (the layer's input sequence is its
    forcing), and ``loss.backward()`` solves the adjoint recursion with MGRIT
    in reverse order, then forms the gradients of the weights, the input and
    ``h0`` at all positions at once. With ``fwd_tol``/``bwd_tol`` small the
    output and all gradients equal ``nn.GRU``'s; with the defaults (2 forward,
    1 adjoint cycle) they are approximations, as in layer-parallel training.

    Parameters
    ----------
    input_size, hidden_size, num_layers, bias, batch_first
        As in :class:`torch.nn.GRU`.
    dropout : float
        As in :class:`torch.nn.GRU`: in training mode, every element of the
        output of every layer but the last is zeroed with this probability
        (and the rest scaled by ``1 / (1 - dropout)``) before the next layer
        reads it. The masks are drawn once per forward pass, outside the
        solves (every MGRIT step of a layer sees the same forcing); every
        rank draws the same ones (:meth:`dropout_masks`), so the pass on
        several ranks equals the pass on one.
    bidirectional : bool
        As in :class:`torch.nn.GRU`: every layer also runs over the reversed
        sequence with its own weights (``*_reverse``), a second MGRIT solve
        forward and a second adjoint solve backward.
    device, dtype
        Of the parameters, as in :class:`torch.nn.GRU`.
    cf, max_levels, min_coarse, relax, cycle
        MGRIT hierarchy and relaxation (see :func:`mgrit.solve`), the same
        for every layer and for forward and adjoint.
    coarse : {"frozen", "inject"}
        The coarse step: "frozen" (default) runs the GRU update over every
        input of a coarse interval with the gates' hidden-state feedback frozen
        at its start (one matrix product per coarse step); "inject" applies the
        cell once, to the interval's first input. See docs/gru.md.
    fwd_iters, bwd_iters : int, optional
        Largest number of cycles of each forward and adjoint solve: 2 and 1 by
        default, 100 with a tolerance.
    fwd_tol, bwd_tol : float or None
        Residual tolerances (None: run the given number of cycles). A solve that
        stops short of its tolerance warns (``ConvergenceWarning``).
    tol_type : {"abs", "rel"}
    skip : bool
        XBraid's skip for the first cycle of each solve.
    exact_eval : bool
        In eval mode (``model.eval()``) step through the positions in order
        (a one-level solve, also across ranks): inference gives ``nn.GRU``'s output.
    return_sequence : bool
        False: ``forward`` returns ``(None, h_n)``; on several ranks the last
        layer's output sequence is then never gathered (only ``h_n`` is
        broadcast), the cheap path for classifiers of the last hidden state.
    comm : None, mpi4py communicator, torch.distributed group or mgrit.Communicator
        Splits the sequence positions over its ranks. Every rank passes the
        same input and gets the same output, ``h_n`` and gradients (each rank
        keeps a full copy of the weights; the weight gradients are summed over
        the ranks, so optimizers stay in step without further communication).

    Examples
    --------
    >>> import torch
    >>> torch.manual_seed(0) and None
    >>> gru = torch.nn.GRU(3, 5, num_layers=2).double()
    >>> pgru = ParallelGRU(3, 5, num_layers=2, fwd_iters=30, fwd_tol=1e-13).double()
    >>> pgru.load_state_dict(gru.state_dict())
    <All keys matched successfully>
    >>> x = torch.randn(20, 4, 3, dtype=torch.float64)
    >>> out, h_n = pgru(x)
    >>> ref, ref_n = gru(x)
    >>> bool(torch.allclose(out, ref, atol=1e-11)), bool(torch.allclose(h_n, ref_n, atol=1e-11))
    (True, True)
    """

    _cell = "GRU"
    _gates = 3
    _propagator = GRUPropagator
    _adjoint = GRUAdjointPropagator

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False, proj_size: int = 0,
                 device=None, dtype=None, **options):
        comm = options.pop("comm", None)
        warn_if_alone(comm, "ParallelGRU")
        comm = as_communicator(comm)
        with _announced(comm):  # a bad argument on one rank: the others raise in the build's handshake
            check_options("ParallelGRU", options)
            if proj_size:  # (torch's GRU takes the keyword and refuses it, in the same words)
                raise ValueError(f"proj_size argument is only supported for LSTM, not GRU (got {proj_size!r})")
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional, device,
                         dtype, comm=comm, **options)

    def to_gru(self) -> nn.GRU:
        """A ``torch.nn.GRU`` with a copy of the current weights (serial reference, inference, checkpoints)."""
        return self._to_serial()

    def _initial_states(self, hx, x, batched: bool):
        if hx is None:
            return x.new_zeros(self.num_layers * self.num_directions, x.shape[1], self.hidden_size)
        return self._checked_state(hx, "h0", x, batched)

    def _final_states(self, states):
        return states  # h_n
