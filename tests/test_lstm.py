"""ParallelLSTM: an LSTM whose recursion over the sequence is solved by MGRIT, forward and adjoint.

Converged solves equal torch.nn.LSTM with copied weights (output, h_n, c_n and the gradients
of the input, h0, c0 and every weight, float64, 1e-10) on one rank here and on 2 and 3
ranks through mpiexec (tests/mpi_scripts/lstm_ranks.py), one- and two-way, with dropout
between layers equal to the masked stack of one-layer LSTMs; the propagators' steps are
the LSTM cell and the exact vector-Jacobian products of the coarse steps; bad inputs raise
errors that say what to pass.
"""
from __future__ import annotations

import numpy as np
import pytest
from launch import assert_all_ok, launch, needs_mpiexec

torch = pytest.importorskip("torch")

from propagators.torch import ParallelLSTM  # noqa: E402
from propagators.torch.lstm import LSTMAdjointPropagator, LSTMPropagator  # noqa: E402

TIGHT = dict(fwd_iters=60, bwd_iters=60, fwd_tol=1e-14, bwd_tol=1e-14)
TOL = 1e-10
I, H, B = 3, 5, 4


pytestmark = pytest.mark.usefixtures("float64")  # (tests/conftest.py)


def maxdiff(a, b) -> float:
    return float((a.detach() - b.detach()).abs().max())


def run_both(ref, par, x, hx, seed=9):
    """Forward and backward of both with the same random loss on output (when par returns it), h_n and
    c_n; returns
    (output, h_n, c_n, input grad, h0 grad, c0 grad, {name: weight grad}) of each."""
    out = []
    for m in (ref, par):
        xs = x.clone().requires_grad_(True)
        hs = None if hx is None else tuple(v.clone().requires_grad_(True) for v in hx)
        m.zero_grad()
        o, (h, c) = m(xs, hs)
        g = torch.Generator().manual_seed(seed)
        loss = (h * torch.randn(h.shape, generator=g)).sum() + (c * torch.randn(c.shape, generator=g)).sum()
        if par.return_sequence:
            loss = loss + (o * torch.randn(o.shape, generator=g)).sum()
        loss.backward()
        grads = {k: None if p.grad is None else p.grad.clone() for k, p in m.named_parameters()}
        out.append((o, h, c, xs.grad, None if hs is None else hs[0].grad, None if hs is None else hs[1].grad, grads))
    return out


@pytest.mark.parametrize("num_layers, bias, batch_first, bidirectional, with_hx, coarse, L", [
    (1, True, False, False, True, "frozen", 17),
    (2, True, True, False, False, "frozen", 23),
    (2, False, False, True, True, "frozen", 19),
    (3, True, True, True, False, "inject", 13),
    (2, True, False, False, True, "frozen", 1),
    (1, True, False, False, False, "frozen", 200),
])
def test_converged_output_and_gradients_equal_nn_lstm(num_layers, bias, batch_first, bidirectional, with_hx,
                                                      coarse, L):
    torch.manual_seed(num_layers + 2 * bias + L)
    kw = dict(num_layers=num_layers, bias=bias, batch_first=batch_first, bidirectional=bidirectional)
    ref = torch.nn.LSTM(I, H, **kw)
    par = ParallelLSTM(I, H, **kw, coarse=coarse, cf=2, max_levels=4, **TIGHT)
    assert list(par.state_dict()) == list(ref.state_dict())
    par.load_state_dict(ref.state_dict())
    D = 2 if bidirectional else 1
    x = torch.randn(B, L, I) if batch_first else torch.randn(L, B, I)
    hx = (torch.randn(D * num_layers, B, H), torch.randn(D * num_layers, B, H)) if with_hx else None
    a, b = run_both(ref, par, x, hx)
    for k, name in enumerate(("output", "h_n", "c_n", "input gradient", "h0 gradient", "c0 gradient")):
        if a[k] is None:
            assert b[k] is None, name
            continue
        assert b[k].shape == a[k].shape and maxdiff(b[k], a[k]) < TOL, name
    assert set(b[6]) == set(a[6])
    for k in a[6]:
        assert maxdiff(b[6][k], a[6][k]) < TOL, k
    assert par.forward_residual < 1e-12 and par.backward_residual < 1e-12


def test_unbatched_input_return_sequence_false_and_eval_mode():
    """Unbatched (L, input_size) input with (h0, c0) of (D * layers, H); return_sequence=False gives
    (None, (h_n, c_n)); eval() steps through the positions exactly (residual 0) at the default cycles."""
    torch.manual_seed(5)
    ref = torch.nn.LSTM(I, H, num_layers=2, bidirectional=True)
    par = ParallelLSTM(I, H, num_layers=2, bidirectional=True, return_sequence=False, **TIGHT)
    par.load_state_dict(ref.state_dict())
    x, hx = torch.randn(11, I), (torch.randn(4, H), torch.randn(4, H))
    a, b = run_both(ref, par, x, hx)
    assert b[0] is None
    for k in range(1, 6):
        assert maxdiff(b[k], a[k]) < TOL, k
    quick = ParallelLSTM(I, H, num_layers=2, bidirectional=True)
    quick.load_state_dict(ref.state_dict())
    quick.eval()
    with torch.no_grad():
        out, (h, c) = quick(x, hx)
        ro, (rh, rc) = ref(x, hx)
    assert maxdiff(out, ro) < 1e-13 and maxdiff(h, rh) < 1e-13 and maxdiff(c, rc) < 1e-13
    assert quick.forward_residual == 0.0


def test_state_dicts_initialisation_and_to_lstm_are_nn_lstms():
    torch.manual_seed(0)
    par = ParallelLSTM(I, H, num_layers=2, bidirectional=True, dropout=0.25)
    ref = torch.nn.LSTM(I, H, num_layers=2, bidirectional=True, dropout=0.25)
    assert [(k, tuple(v.shape)) for k, v in par.state_dict().items()] == \
        [(k, tuple(v.shape)) for k, v in ref.state_dict().items()]
    assert all(float(p.detach().abs().max()) <= 1 / np.sqrt(H) for p in par.parameters())
    lstm = par.to_lstm()
    assert isinstance(lstm, torch.nn.LSTM) and lstm.dropout == 0.25 and lstm.bidirectional
    x = torch.randn(6, 2, I)
    par.eval()
    lstm.eval()
    with torch.no_grad():
        assert maxdiff(par(x)[0], lstm(x)[0]) < 1e-13
    assert "bidirectional=True" in repr(par) and "dropout=0.25" in repr(par)
    # the attributes code written for torch's modules reads
    assert (par.mode, par.proj_size) == (ref.mode, ref.proj_size) == ("LSTM", 0)
    assert len(par.all_weights) == len(ref._all_weights) == 4
    for w, names in zip(par.all_weights, ref._all_weights):  # the same grouping and order as nn.LSTM's
        assert [id(p) for p in w] == [id(getattr(par, n)) for n in names]


def test_fine_step_is_the_lstm_cell_and_step_batch_mixes_lengths():
    torch.manual_seed(8)
    cell = torch.nn.LSTMCell(I, H)
    x, h, c = torch.randn(6, B, I), torch.randn(B, H), torch.randn(B, H)
    gi = torch.nn.functional.linear(x, cell.weight_ih, cell.bias_ih)
    prop = LSTMPropagator(cell.weight_hh.detach(), cell.bias_hh.detach(), gi.detach(), 0)
    s = torch.cat([h, c], dim=-1)
    with torch.no_grad():
        h1, c1 = cell(x[2], (h, c))
        assert maxdiff(prop.step(s, 2.0, 3.0), torch.cat([h1, c1], dim=-1)) < 1e-14
        S = torch.stack([s, s, s])
        out = prop.step_batch(S, np.array([1.0, 0.0, 1.0]), np.array([2.0, 3.0, 4.0]))  # lengths 1, 3, 3
        assert maxdiff(out[0], torch.cat(cell(x[1], (h, c)), dim=-1)) < 1e-14
        assert maxdiff(out[1], prop.step(s, 0.0, 3.0)) == 0.0
        assert maxdiff(out[2], prop.step(s, 1.0, 4.0)) == 0.0
        assert maxdiff(prop.step(s, 2.0, 2.0), s) == 0.0  # an empty interval


def frozen_states(prop, s0, i0: int, k: int):
    """The forward step over [i0, i0 + k] written out: every intermediate (h, c), the gates frozen at s0."""
    gh = prop.hidden(s0)
    c, hs, cs = s0[..., prop.H:], [], []
    for j in range(k):
        i, f, g, o = prop.gates(prop.gi[i0 + j], gh)
        c = f * c + i * g
        hs.append(o * torch.tanh(c))
        cs.append(c)
    return hs, cs


@pytest.mark.parametrize("coarse, m, forced", [("frozen", 1, True), ("frozen", 4, True), ("frozen", 5, False),
                                               ("inject", 3, True)])
def test_adjoint_step_is_the_vjp_of_the_forward_step(coarse, m, forced):
    """lam_{i0} = [g_{i0}, 0] + (dPhi/ds_{i0})^T [g_{i0+1..i1-1} on h, lam_{i1}], checked against autograd
    through the step written out (and that step is the propagator's)."""
    torch.manual_seed(9 + m)
    L, i0 = 9, 2
    W, b = torch.randn(4 * H, H) * 0.5, torch.randn(4 * H)
    prop = LSTMPropagator(W, b, torch.randn(L, B, 4 * H), 0, coarse)
    s0 = torch.randn(B, 2 * H, requires_grad=True)
    k = prop.span(m)
    hs, cs = frozen_states(prop, s0, i0, k)
    forcing = torch.randn(L + 1, B, H) if forced else None
    lam1 = torch.randn(B, 2 * H)
    outs = hs[:-1] + [hs[-1], cs[-1]]
    cot = ([forcing[i0 + j + 1] for j in range(k - 1)] if forced else [torch.zeros(B, H)] * (k - 1)) \
        + [lam1[:, :H], lam1[:, H:]]
    ref = torch.autograd.grad(outs, s0, cot)[0]
    if forced:
        ref[:, :H] += forcing[i0]
    S = s0.detach()[None]
    adj = LSTMAdjointPropagator(prop, L, S, prop.hidden(S), i0, forcing)
    tau1 = float(L - i0)
    assert maxdiff(adj.step(lam1, tau1 - m, tau1), ref) < 1e-13
    assert maxdiff(prop.step(s0.detach(), float(i0), float(i0 + m)), torch.cat([hs[-1], cs[-1]], dim=-1)) < 1e-14


def held_states(prop, raw, s0, i0: int, k: int, held):
    """The step over [i0, i0 + k] with the positions ``held`` ((k, B) bool) keeping the state, written out
    with the raw input projections ``raw`` (the gates frozen at s0): every intermediate (h, c)."""
    gh = prop.hidden(s0)
    h, c, hs, cs = s0[..., :prop.H], s0[..., prop.H:], [], []
    for j in range(k):
        i, f, g, o = prop.gates(raw[i0 + j], gh)
        cn = f * c + i * g
        keep = held[j][:, None]
        h, c = torch.where(keep, h, o * torch.tanh(cn)), torch.where(keep, c, cn)
        hs.append(h)
        cs.append(c)
    return hs, cs


@pytest.mark.parametrize("pattern", ["suffix", "prefix", "all", "none", "hole"])
@pytest.mark.parametrize("m", [1, 4, 5])
def test_held_positions_keep_the_state_and_the_adjoint_is_the_vjp(pattern, m):
    """Past a packed sequence's end (a suffix of held positions; reversed, a prefix) the steps keep the state:
    the fine and the frozen coarse steps equal the step written out with the state kept there, and the
    adjoint step is that step's vector-Jacobian product (autograd), also with forcing at the held points; the
    gradients of every gate there are exactly zero."""
    torch.manual_seed(11 + m)
    L, i0, k = 9, 2, m
    W, b = torch.randn(4 * H, H) * 0.5, torch.randn(4 * H)
    raw = torch.randn(L, B, 4 * H)
    held = torch.zeros(L, B, dtype=torch.bool)
    cut = {"suffix": [1, 2, 3, 1], "prefix": [1, 2, 3, 1], "all": [0] * B, "none": [m] * B, "hole": [2] * B}[pattern]
    for bb, n in enumerate(cut):  # batch entry bb: n of the window's positions are not held
        w = held[i0: i0 + k, bb]
        if pattern == "prefix":
            w[: k - min(n, k)] = True
        elif pattern == "hole":
            w[min(n, k - 1): k - 1] = True  # (held positions inside the window, then one that is not)
        else:
            w[min(n, k):] = True
    prop = LSTMPropagator(W, b, raw.clone(), 0)
    prop.hold(held)
    s0 = torch.randn(B, 2 * H, requires_grad=True)
    hs, cs = held_states(prop, raw, s0, i0, k, held[i0:])
    forcing = torch.randn(L + 1, B, H)
    lam1 = torch.randn(B, 2 * H)
    cot = [forcing[i0 + j + 1] for j in range(k - 1)] + [lam1[:, :H], lam1[:, H:]]
    ref = torch.autograd.grad(hs[:-1] + [hs[-1], cs[-1]], s0, cot)[0]
    ref[:, :H] += forcing[i0]
    S = s0.detach()[None]
    adj = LSTMAdjointPropagator(prop, L, S, prop.hidden(S), i0, forcing)
    back = adj.step(lam1, float(L - i0 - m), float(L - i0))
    assert maxdiff(back, ref) < 1e-13
    got = prop.step(s0.detach(), float(i0), float(i0 + m))
    assert maxdiff(got, torch.cat([hs[-1], cs[-1]], dim=-1)) < 1e-14
    if pattern == "all":  # (exactly: the state, and lam_c, pass unchanged)
        assert torch.equal(got, s0.detach()) and torch.equal(back[:, H:], lam1[:, H:])
    d, _ = prop.gate_gradients(S.expand(L, B, 2 * H), prop.gi, prop.hidden(S), torch.randn(L, B, 2 * H))
    assert torch.equal(d[held], torch.zeros_like(d[held]))


def packed_run(m, seqs, hx, sort, w_out):
    """Forward and backward of a packed batch of ``seqs`` through ``m``; (output, h_n, c_n, grads of the
    sequences, of h0 and c0, and of every weight)."""
    ss = [q.clone().requires_grad_(True) for q in seqs]
    hh = None if hx is None else tuple(v.clone().requires_grad_(True) for v in hx)
    m.zero_grad()
    o, (h, c) = m(torch.nn.utils.rnn.pack_sequence(ss, enforce_sorted=sort), hh)
    loss = (h * h).sum() + (0.7 * c * c).sum() + ((o.data * w_out[: o.data.shape[0]]).sum() if o is not None else 0)
    loss.backward()
    return (o, h, c, [q.grad for q in ss], None if hh is None else [v.grad for v in hh],
            {k: p.grad for k, p in m.named_parameters()})


@pytest.mark.parametrize("layers, bidirectional, batch_first, with_hx, sort, lengths, cf", [
    (1, False, False, False, False, [7, 3, 9, 3, 1], 2),  # ties and a sequence of one position
    (2, True, True, True, False, [7, 3, 9, 3, 1], 4),
    (2, False, False, True, True, [9, 7, 3, 3, 1], 2),  # enforce_sorted=True: no sort indices
    (1, True, False, True, False, [2, 41, 17], 4),
    (1, False, True, True, False, [6, 6, 6], 2),  # every sequence whole: the padded pass
])
def test_packed_sequences_equal_nn_lstm(layers, bidirectional, batch_first, with_hx, sort, lengths, cf):
    """A PackedSequence input: the steps past a sequence's end keep its (h, c), so converged solves give
    nn.LSTM's packed output (the same batch sizes and sort order), (h_n, c_n) in the caller's order and the
    gradients of every sequence, h0, c0 and weight, also through frozen coarse steps that cross a sequence's
    end; eval mode (exact stepping) and return_sequence=False too."""
    torch.manual_seed(layers + 3 * bidirectional + len(lengths))
    ref = torch.nn.LSTM(I, H, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first)
    par = ParallelLSTM(I, H, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first, cf=cf,
                       max_levels=4, **TIGHT)
    par.load_state_dict(ref.state_dict())
    seqs = [torch.randn(n, I) for n in lengths]
    D = 1 + bidirectional
    hx = tuple(torch.randn(D * layers, len(lengths), H) for _ in range(2)) if with_hx else None
    w_out = torch.randn(sum(lengths), D * H)
    (o_r, h_r, c_r, gx_r, gh_r, gw_r), (o, h, c, gx, gh, gw) = (packed_run(m, seqs, hx, sort, w_out)
                                                                 for m in (ref, par))
    assert isinstance(o, torch.nn.utils.rnn.PackedSequence) and torch.equal(o.batch_sizes, o_r.batch_sizes)
    for a, b in ((o.sorted_indices, o_r.sorted_indices), (o.unsorted_indices, o_r.unsorted_indices)):
        assert (a is None and b is None) or torch.equal(a, b)
    assert maxdiff(o.data, o_r.data) < TOL and maxdiff(h, h_r) < TOL and maxdiff(c, c_r) < TOL
    assert max(maxdiff(a, b) for a, b in zip(gx, gx_r)) < TOL
    if with_hx:
        assert maxdiff(gh[0], gh_r[0]) < TOL and maxdiff(gh[1], gh_r[1]) < TOL
    for k in gw_r:
        assert maxdiff(gw[k], gw_r[k]) < TOL, k
    par.eval(), ref.eval()
    with torch.no_grad():
        pk = torch.nn.utils.rnn.pack_sequence(seqs, enforce_sorted=sort)
        assert maxdiff(par(pk, hx)[0].data, ref(pk, hx)[0].data) < TOL
        par.return_sequence = False
        o, (h, c) = par(pk, hx)
        assert o is None and maxdiff(h, ref(pk, hx)[1][0]) < TOL and maxdiff(c, ref(pk, hx)[1][1]) < TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_packed_padding_keeps_the_state_exactly_in_low_precision(dtype):
    """Many padding steps after a short sequence change nothing, in any precision: a held step, fine or
    coarse, returns its state bit for bit, exact stepping (eval) gives h_n equal to the output at the
    sequence's last position, and the solves' outputs of the short sequence are as close to nn.LSTM's as
    when it is passed alone."""
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(4, 8, bidirectional=True).float()
    seqs = [torch.randn(5, 4).float(), torch.randn(400, 4).float()]
    hx = tuple(0.5 * torch.randn(2, 2, 8).float() for _ in range(2))
    low = tuple(v.to(dtype) for v in hx)
    par = ParallelLSTM(4, 8, bidirectional=True).to(dtype)
    par.load_state_dict(lstm.state_dict())
    packed = torch.nn.utils.rnn.pack_sequence([q.to(dtype) for q in seqs], enforce_sorted=False)
    with torch.no_grad():
        ref, _ = torch.nn.utils.rnn.pad_packed_sequence(lstm(torch.nn.utils.rnn.pack_sequence(seqs, False), hx)[0])
        out, _ = torch.nn.utils.rnn.pad_packed_sequence(par(packed, low)[0])  # (2/1 cycles)
        alone = par(seqs[0][:, None].to(dtype), tuple(v[:, :1] for v in low))[0]
        par.eval()
        o, (h, _) = par(packed, low)
        prop = LSTMPropagator(par.weight_hh_l0, par.bias_hh_l0, torch.randn(6, 2, 32).to(dtype), 0)
        prop.hold(torch.ones(6, 2, dtype=torch.bool))
        s = torch.randn(2, 16).to(dtype)
        assert torch.equal(prop.step(s, 0.0, 1.0), s) and torch.equal(prop.step(s, 1.0, 6.0), s)
    padded, _ = torch.nn.utils.rnn.pad_packed_sequence(o)
    assert torch.equal(h[0, 0], padded[4, 0, :8])
    err = float((out[:5, 0].float() - ref[:5, 0]).abs().max())
    err_alone = float((alone[:, 0].float() - ref[:5, 0]).abs().max())
    assert err < 3 * err_alone + 10 * torch.finfo(dtype).eps, (err, err_alone)


def test_fewer_cycles_approximate_and_more_cycles_improve():
    """At the default 2/1 cycles the output is an approximation; more cycles shrink its error and the
    residual of what was returned."""
    torch.manual_seed(3)
    ref = torch.nn.LSTM(I, H)
    x = torch.randn(64, B, I)
    with torch.no_grad():
        exact = ref(x)[0]
    errs, res = [], []
    for iters in (1, 2, 4):
        par = ParallelLSTM(I, H, fwd_iters=iters)
        par.load_state_dict(ref.state_dict())
        with torch.no_grad():
            errs.append(maxdiff(par(x)[0], exact))
        res.append(par.forward_residual)
    assert errs[0] > 1e-6 and errs[2] < errs[1] < errs[0]
    assert res[2] < res[1] < res[0]


def test_dropout_between_layers_equals_the_masked_serial_stack():
    torch.manual_seed(4)
    par = ParallelLSTM(I, H, num_layers=3, dropout=0.4, bidirectional=True, batch_first=True, **TIGHT)
    x = torch.randn(B, 12, I)
    xp, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out, (h, c) = par(xp)
    masks = par.dropout_masks(par.last_dropout_seed, out)
    inp, hs, cs, grus = xs, [], [], []
    for l in range(3):
        g = torch.nn.LSTM(I if l == 0 else 2 * H, H, batch_first=True, bidirectional=True)
        g.load_state_dict({k.replace(f"_l{l}", "_l0"): v for k, v in par.state_dict().items()
                           if k.endswith(f"_l{l}") or k.endswith(f"_l{l}_reverse")})
        o, (hl, cl) = g(inp)
        hs.append(hl)
        cs.append(cl)
        grus.append(g)
        inp = o * masks[l] if l < 2 else o
    assert maxdiff(out, inp) < TOL and maxdiff(h, torch.cat(hs)) < TOL and maxdiff(c, torch.cat(cs)) < TOL
    w = torch.randn_like(out)
    ((out * w).sum() + c.sum()).backward()
    ((inp * w).sum() + torch.cat(cs).sum()).backward()
    assert maxdiff(xp.grad, xs.grad) < TOL
    params = dict(par.named_parameters())
    for l, g in enumerate(grus):
        for name, q in g.named_parameters():
            assert maxdiff(params[name.replace("_l0", f"_l{l}")].grad, q.grad) < TOL, (l, name)


def test_an_empty_batch_gives_nn_lstms_empty_outputs_and_zero_gradients():
    par = ParallelLSTM(I, H, num_layers=2)
    x = torch.randn(7, 0, I, requires_grad=True)
    out, (h, c) = par(x)
    assert out.shape == (7, 0, H) and h.shape == c.shape == (2, 0, H)
    (out.sum() + h.sum() + c.sum()).backward()
    assert x.grad.shape == x.shape and all(float(p.grad.abs().sum()) == 0.0 for p in par.parameters())


@pytest.mark.parametrize("make, hx, exc, match", [
    (lambda: torch.randn(5, B, I), lambda: torch.randn(1, B, H), TypeError, r"hx must be a tuple \(h0, c0\)"),
    (lambda: torch.randn(5, B, I), lambda: (torch.randn(1, B, H),), TypeError, "tuple"),
    (lambda: torch.randn(5, B, I), lambda: (torch.randn(2, B, H), torch.randn(1, B, H)), ValueError,
     r"h0 must have shape \(1, 4, 5\)"),
    (lambda: torch.randn(5, B, I), lambda: (torch.randn(1, B, H), torch.randn(1, B + 1, H)), ValueError,
     r"c0 must have shape"),
    (lambda: torch.randn(5, B, I), lambda: (torch.randn(1, B, H), torch.randn(1, B, H).float()), TypeError,
     "c0 is torch.float32"),
    (lambda: torch.randn(5, B, I), lambda: (torch.randn(1, B, H), None), TypeError,  # ("a Tensor or None, got None")
     r"c0 must be a torch.Tensor, got NoneType \(pass hx=None for zero initial states"),
    (lambda: torch.randn(5, B, I + 1), lambda: None, ValueError, "input_size"),
])
def test_bad_inputs_raise_and_say_what_to_pass(make, hx, exc, match):
    with pytest.raises(exc, match=match):
        ParallelLSTM(I, H)(make(), hx())


def test_bad_settings_and_unsupported_uses_raise():
    with pytest.raises(ValueError, match="proj_size=2"):
        ParallelLSTM(I, H, proj_size=2)
    with pytest.raises(ValueError, match="`dropout` must be a number in"):
        ParallelLSTM(I, H, dropout=2.0)
    with pytest.warns(UserWarning, match="ParallelLSTM, like nn.LSTM"):
        ParallelLSTM(I, H, dropout=0.5)
    par = ParallelLSTM(I, H)
    x = torch.randn(6, B, I, requires_grad=True)
    out = par(x)[0].sum()
    with pytest.raises(RuntimeError, match="ParallelLSTM does not support double backward.*to_lstm"):
        torch.autograd.grad(out, x, create_graph=True)


@pytest.mark.mpi
@needs_mpiexec
@pytest.mark.parametrize("n", [2, 3])
def test_parallel_lstm_on_ranks_equals_nn_lstm(n):
    pytest.importorskip("mpi4py")
    rc, out = launch(n, "lstm_ranks.py")
    assert_all_ok(n, rc, out)


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.mark.parametrize("device", DEVICES)
def test_on_a_device_equals_nn_lstm_and_the_masked_stack(device):
    """On the device (float64; benchmarks/gpu.py runs the CUDA case): converged, bidirectional, two
    layers, equal to nn.LSTM there; with dropout, the masked stack of one-layer LSTMs, the masks drawn
    by a generator of that device."""
    torch.manual_seed(17)
    kw = dict(num_layers=2, bidirectional=True, batch_first=True)
    ref = torch.nn.LSTM(I, H, **kw).to(device)
    par = ParallelLSTM(I, H, **kw, cf=2, **TIGHT).to(device)
    par.load_state_dict(ref.state_dict())
    x = torch.randn(B, 19, I, device=device)
    hx = (torch.randn(4, B, H, device=device), torch.randn(4, B, H, device=device))
    a, b = run_both(ref, par, x, hx)
    for k in range(6):
        assert b[k].device.type == device and maxdiff(b[k], a[k]) < TOL, k
    for k in a[6]:
        assert maxdiff(b[6][k], a[6][k]) < TOL, k
    drop = ParallelLSTM(I, H, num_layers=2, dropout=0.5, **TIGHT).to(device)
    x = torch.randn(13, B, I, device=device)
    out, _ = drop(x)
    (mask,) = drop.dropout_masks(drop.last_dropout_seed, out)
    assert mask.device.type == device
    first, second = (torch.nn.LSTM(I if l == 0 else H, H).to(device) for l in range(2))
    first.load_state_dict({k: v for k, v in drop.state_dict().items() if k.endswith("_l0")})
    second.load_state_dict({k.replace("_l1", "_l0"): v for k, v in drop.state_dict().items() if k.endswith("_l1")})
    assert maxdiff(out, second(first(x)[0] * mask)[0]) < TOL


@pytest.mark.parametrize("bidirectional", [False, True])
def test_final_states_are_contiguous_like_nn_lstms(bidirectional):
    # h_n and c_n were strided slices of one tensor: code written for nn.LSTM (h_n.view(-1)) raised
    torch.manual_seed(0)
    par = ParallelLSTM(I, H, num_layers=2, bidirectional=bidirectional).double()
    x = torch.randn(6, B, I, dtype=torch.float64)
    (h, c), (hs, cs) = par(x)[1], par.to_lstm()(x)[1]
    assert h.is_contiguous() and c.is_contiguous() and h.stride() == hs.stride() and c.stride() == cs.stride()
    assert h.view(-1).shape == hs.view(-1).shape
