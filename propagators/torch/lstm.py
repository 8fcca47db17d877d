"""``ParallelLSTM``: an LSTM whose recursion over the sequence is solved by MGRIT.

One LSTM layer steps the state ``s = (h, c)`` (hidden state and cell state,
stored side by side, ``h`` first) through the sequence positions:
``s_{i+1} = cell(x_i, s_i)``, a time stepper whose forcing is the input and
whose weights are the same at every step. The module machinery (layers,
directions, dropout, the adjoint solve, the gradients, several ranks) is
:mod:`propagators.torch.rnn`'s, shared with ``ParallelGRU``; this module holds
the LSTM's propagators: the cell, its coarse step and their adjoints. See
docs/gru.md ("ParallelLSTM") and docs/theory.md (the adjoint).
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

__all__ = ["ParallelLSTM", "LSTMPropagator", "LSTMAdjointPropagator"]


class LSTMPropagator(_CellPropagator):
    """The forward propagator of one LSTM layer; time points are sequence positions.

    States are ``s = [h, c]`` (last dimension ``2H``). The fine step over
    ``[i, i + 1]`` is the cell of ``torch.nn.LSTM``::

        i, f, g, o = sigmoid, sigmoid, tanh, sigmoid of  gi[i] + W_h h + b_h   (gate blocks in this order)
        c' = f c + i g
        h' = o tanh(c')

    with the input projections ``gi[i] = W_i x_i + b_i`` computed beforehand. A
    coarse step over ``[i0, i1]`` (``m`` positions) is, with ``coarse="frozen"``
    (default), the same recursion over all ``m`` inputs with the hidden-state
    feedback ``W_h h + b_h`` frozen at the interval's start: the gates then do
    not depend on the state, ``c`` follows the affine recursion
    ``c_{k+1} = f_k c_k + i_k g_k`` (composed in ``log2 m`` rounds) and
    ``h = o_{m-1} tanh(c_m)``. With ``coarse="inject"`` it is one cell at the
    interval's first input. Both are the fine step when ``m = 1``. Past the end of a
    packed sequence (:meth:`hold`) every step keeps the state exactly.

    Parameters
    ----------
    weight_hh : Tensor, shape (4H, H)
    bias_hh : Tensor, shape (4H,), or None
    gi : Tensor, shape (n, B, 4H)
        Input projections of the positions ``offset .. offset + n - 1``.
    offset : int
    coarse : {"frozen", "inject"}
    """

    def hold(self, held) -> None:
        # input gate exactly 0 and forget gate exactly 1 (sigmoid of -inf, +inf) keep c there exactly, through the
        # frozen coarse step's affine composition too; h is kept by choosing (torch.where) the output gate of the
        # last position not held (:meth:`kept`). An output gate of exactly 1 there makes every gate's gradient
        # exactly 0 at the held positions (each carries a factor i, 1 - f or 1 - o)
        self.held = held
        H, mask = self.H, held[..., None]
        self.gi[..., :H].masked_fill_(mask, -math.inf)
        self.gi[..., H:2 * H].masked_fill_(mask, math.inf)
        self.gi[..., 3 * H:].masked_fill_(mask, math.inf)
        # the last position not held up to each one (-1: none), for kept
        pos = torch.arange(self.offset + 1, self.offset + len(held) + 1, device=held.device)[:, None]
        self._last = (pos * ~held).cummax(0).values - 1

    def kept(self, i0, k: int):
        """For windows of ``k`` positions from ``i0``: for each position, the index in the window of the last
        position up to it that is not held, (n, k, B); -1 where every one in the window up to it is held. The
        state after a position is the state after that one (or the window's first state)."""
        last = _windows(self._last, i0, k, self.offset)
        start = torch.as_tensor(np.asarray(i0), device=last.device).view((-1, 1) + (1,) * (last.dim() - 2))
        return (last - start).clamp_(min=-1)

    def hidden(self, S):
        """``W_h h + b_h`` for stacked states ``S`` (..., B, 2H): one matrix product."""
        return _finite_when_held(self, F.linear(S[..., :self.H], self.W, self.b), 4)

    def gates(self, gi, gh):
        """``i, f, g, o`` from input projections ``gi`` and hidden projections ``gh`` (broadcast)."""
        H = self.H
        a = gi + gh
        sig = a.sigmoid()  # (the g block's sigmoid is not used: cheaper than gathering the other three)
        g = a[..., 2 * H:3 * H].tanh_()  # (in place on the fresh sum)
        return sig[..., :H], sig[..., H:2 * H], g, sig[..., 3 * H:]

    def gate_gradients(self, s, gi, gh, lam):
        """One fine step's vector-Jacobian product with ``lam = [lam_h, lam_c]`` (the adjoint at its
        end), at the states ``s``: the gradients of the gates' input and hidden parts (equal: the
        gates read their sum)."""
        H = self.H
        i, f, g, o = self.gates(gi, gh)
        c = s[..., H:]
        tc = torch.tanh(torch.addcmul(f * c, i, g))
        lh, lc = lam[..., :H], lam[..., H:]
        mu = lc + lh * o * (1.0 - tc * tc)  # dL/dc'
        d = torch.cat([mu * g * i * (1.0 - i), mu * c * f * (1.0 - f), mu * i * (1.0 - g * g),
                       lh * tc * o * (1.0 - o)], dim=-1)
        return d, d

    def advance(self, S, i0: np.ndarray, m: int):
        """States ``S`` at positions ``i0`` advanced by ``m`` positions (all intervals alike)."""
        k = self.span(m)
        if k == 0:  # an empty interval: no position to step
            return S
        i, f, g, o = self.gates(self.inputs(i0, k), self.hidden(S)[:, None])
        c0 = S[..., self.H:]
        if k == 1:  # the LSTM cell
            c = torch.addcmul(f[:, 0] * c0, i[:, 0], g[:, 0])
        else:  # frozen gates: c_{j+1} = f_j c_j + i_j g_j is affine in c, composed in log2(k) rounds
            A, Bc = _affine_compose(f, i * g)
            c = torch.addcmul(Bc, A, c0)
        if self.held is None:
            return torch.cat([o[:, -1] * torch.tanh(c), c], dim=-1)
        if k == 1:  # (past a packed sequence's end: h kept)
            return torch.cat([torch.where(self.held_at(i0), S[..., :self.H], o[:, 0] * torch.tanh(c)), c], dim=-1)
        j = self.kept(i0, k)[:, -1]  # (the output gate of the last position not held, or h kept)
        oj = o.gather(1, j.clamp(min=0)[:, None, ..., None].expand((-1, 1) + tuple(o.shape[2:])))[:, 0]
        h = torch.where((j >= 0)[..., None], oj * torch.tanh(c), S[..., :self.H])
        return torch.cat([h, c], dim=-1)


class LSTMAdjointPropagator(_CellAdjoint):
    """The adjoint of an :class:`LSTMPropagator` with forcing on ``h``, in reverse time.

    Reverse point ``s`` is sequence point ``N - s``. A step covering the forward
    interval ``[i0, i1]`` maps ``lam_{i1} = [lam_h, lam_c]`` to ::

        lam_{i0} = [g_{i0}, 0] + (d Phi / d s_{i0})^T [g_{i0+1}, ..., g_{i1-1}, lam_{i1}]

    where ``Phi`` is the forward step over the interval (the cell on the fine
    level, the frozen or injected coarse step on coarse levels, whose
    intermediate hidden states ``h_{i0+1..i1-1}`` receive the forcing ``g``),
    linearised at the stored forward state ``s_{i0}``. For the frozen step the
    cell-state adjoint runs backwards through ``mu_j = f_{j+1} mu_{j+1} +
    dL/dh_{j+1} o_j (1 - tanh^2 c_{j+1})``, an affine recursion scanned in
    ``log2 m`` rounds; every gate's hidden part is the frozen ``W_h h_{i0} +
    b_h``, so ``h_{i0}`` receives ``W_h^T`` times the sum of the gate gradients.

    The arguments are ``GRUAdjointPropagator``'s (``forward`` an
    :class:`LSTMPropagator`, the stored states ``U`` of shape ``(n, B, 2H)``,
    ``GH = forward.hidden(U)`` of shape ``(n, B, 4H)``; the forcing acts on
    ``h`` only: it is the gradient of the output sequence).
    """

    def back(self, V, i0: np.ndarray, m: int):
        f_, H = self.fwd, self.fwd.H
        gh = _windows(self.GH, i0, 1, self.g0)
        k = f_.span(m)
        i, f, g, o = f_.gates(f_.inputs(i0, k), gh)
        c0 = _windows(self.U, i0, 1, self.g0)[:, 0, ..., H:]
        lh, lc = V[..., :H], V[..., H:]
        if k == 1:
            cs = c0[:, None]  # the cell state before each position
            after = torch.addcmul(f * cs, i, g)  # ... and after it
        else:
            A, Bc = _affine_scan(f, i * g)
            after = torch.addcmul(Bc, A, c0[:, None])
            cs = torch.cat([c0[:, None], after[:, :-1]], dim=1)
        tc = torch.tanh(after)
        # dL/dh after each position: the forcing at the intermediate points, lam_h after the last
        dh = lh[:, None]
        if k > 1:
            inner = (_windows(self.g, np.asarray(i0) + 1, k - 1, 0) if self.g is not None
                     else torch.zeros_like(tc[:, :-1]))
            dh = torch.cat([inner, dh], dim=1)
        passed = None
        if f_.held is not None and k == 1:  # a held step keeps h: lam_h passes
            held = f_.held_at(i0)[:, None]
            passed, dh = torch.where(held, dh, 0.0)[:, 0], torch.where(held, 0.0, dh)
        elif f_.held is not None:  # the forcing of the h after a held position belongs to the last one not held
            j = f_.kept(i0, k)[..., None]  # before it (whose h it is), or passes to lam_h where there is none
            passed = torch.where(j < 0, dh, 0.0).sum(1)
            dh = torch.zeros_like(dh).scatter_add_(1, j.clamp(min=0).expand_as(dh), torch.where(j < 0, 0.0, dh))
        direct = dh * o * (1.0 - tc * tc)
        # mu_j = dL/dc after position j, from the last back: mu_{k-1} = lam_c + direct_{k-1},
        # mu_j = f_{j+1} mu_{j+1} + direct_j; affine in mu, scanned in reverse order
        coef = torch.cat([f[:, 1:], torch.ones_like(f[:, :1])], dim=1)
        A, Bc = _affine_scan(coef.flip(1), direct.flip(1))
        mus = torch.addcmul(Bc, A, lc[:, None]).flip(1)
        dgates = torch.cat([(mus * g * i * (1.0 - i)).sum(1), (mus * cs * f * (1.0 - f)).sum(1),
                            (mus * i * (1.0 - g * g)).sum(1), (dh * tc * o * (1.0 - o)).sum(1)], dim=-1)
        lam_h = torch.matmul(dgates, f_.W)
        if passed is not None:
            lam_h = lam_h + passed
        if self.g is not None:
            lam_h = lam_h + _windows(self.g, i0, 1, 0)[:, 0]
        return torch.cat([lam_h, f[:, 0] * mus[:, 0]], dim=-1)


class ParallelLSTM(_ParallelRNN):
    """A multi-layer LSTM whose recursion over the sequence is solved by MGRIT.

    Same constructor, call and parameters as :class:`torch.nn.LSTM` (without
    ``proj_size``): ``output, (h_n, c_n) = model(input, (h0, c0))`` with
    ``input`` of shape ``(L, B, input_size)`` (``(B, L, input_size)`` with
    ``batch_first=True``, or ``(L, input_size)`` unbatched), ``h0`` and ``c0``
    of shape ``(D * num_layers, B, hidden_size)`` (zeros if ``hx`` is None;
    ``D`` is 2 when bidirectional, else 1), ``output`` of shape
    ``(L, B, D * hidden_size)`` (the last layer's hidden states) and ``h_n``,
    ``c_n`` shaped like ``h0``. Parameter names and shapes are ``nn.LSTM``'s
    (``weight_ih_l0`` of shape ``(4H, input_size)``, ...), so
    ``model.load_state_dict(lstm.state_dict())`` works both ways, and
    ``model.to_lstm()`` returns the ``nn.LSTM`` with the current weights.

    Layer by layer (and direction by direction) the forward pass solves the
    recursion of the state ``(h, c)`` with MGRIT over the positions, and
    ``loss.backward()`` solves the adjoint recursion in reverse order, then
    forms the gradients of the weights, the input, ``h0`` and ``c0`` at all
    positions at once. With ``fwd_tol``/``bwd_tol`` small the output and all
    gradients equal ``nn.LSTM``'s; with the defaults (2 forward, 1 adjoint
    cycle) they are approximations, as in layer-parallel training.

    The other arguments (``dropout``, ``bidirectional``, the MGRIT settings,
    ``coarse``, cycles and tolerances, ``exact_eval``, ``return_sequence``,
    ``comm``) are :class:`~propagators.torch.ParallelGRU`'s; the frozen
    coarse step keeps the gates' hidden feedback at the interval's start, so
    the cell state follows an affine recursion over the interval's inputs
    (:class:`LSTMPropagator`). ``return_sequence=False`` returns
    ``(None, (h_n, c_n))``. A ``torch.nn.utils.rnn.PackedSequence`` input gives a packed
    output, as ``nn.LSTM`` does: the steps past each sequence's end keep its ``(h, c)``
    exactly (:meth:`LSTMPropagator.hold`; docs/gru.md, "ParallelLSTM").

    Examples
    --------
    >>> import torch
    >>> torch.manual_seed(0) and None
    >>> lstm = torch.nn.LSTM(3, 5, num_layers=2).double()
    >>> plstm = ParallelLSTM(3, 5, num_layers=2, fwd_iters=30, fwd_tol=1e-13).double()
    >>> plstm.load_state_dict(lstm.state_dict())
    <All keys matched successfully>
    >>> x = torch.randn(20, 4, 3, dtype=torch.float64)
    >>> out, (h_n, c_n) = plstm(x)
    >>> ref, (ref_h, ref_c) = lstm(x)
    >>> all(bool(torch.allclose(a, b, atol=1e-11)) for a, b in ((out, ref), (h_n, ref_h), (c_n, ref_c)))
    True
    """

    _cell = "LSTM"
    _gates = 4
    _propagator = LSTMPropagator
    _adjoint = LSTMAdjointPropagator
    _state_names = ("initial state (h0, c0)", "gradient of the final state (h_n, c_n)")

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False, proj_size: int = 0,
                 device=None, dtype=None, **options):
        comm = options.pop("comm", None)
        warn_if_alone(comm, "ParallelLSTM")
        comm = as_communicator(comm)
        with _announced(comm):  # a bad argument on one rank: the others raise in the build's handshake
            check_options("ParallelLSTM", options)
            if proj_size:
                raise ValueError(f"ParallelLSTM has no projections (proj_size={proj_size!r}): pass proj_size=0, "
                                 "and project the output with an nn.Linear after the module if needed")
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional, device,
                         dtype, comm=comm, **options)

    def to_lstm(self) -> nn.LSTM:
        """A ``torch.nn.LSTM`` with a copy of the current weights (serial reference, inference, checkpoints)."""
        return self._to_serial()

    def _initial_states(self, hx, x, batched: bool):
        units, B, H = self.num_layers * self.num_directions, x.shape[1], self.hidden_size
        if hx is None:
            return x.new_zeros(units, B, 2 * H)
        if not isinstance(hx, (tuple, list)) or len(hx) != 2:
            got = f"a {type(hx).__name__} of {len(hx)}" if isinstance(hx, (tuple, list)) else type(hx).__name__
            raise TypeError(f"hx must be a tuple (h0, c0) of two tensors, as for nn.LSTM, or None; got {got}")
        h0, c0 = (self._checked_state(v, name, x, batched) for v, name in zip(hx, ("h0", "c0")))
        return torch.cat([h0, c0], dim=-1)

    def _final_states(self, states):
        H = self.hidden_size
        # (h_n, c_n) contiguous, as nn.LSTM returns them (code written for it may .view() them)
        return states[..., :H].contiguous(), states[..., H:].contiguous()
