"""ParallelGRU: a GRU whose recursion over the sequence is solved by MGRIT, forward and adjoint.

Converged solves equal torch.nn.GRU with copied weights (output, h_n and the gradients
of the input, h0 and every weight, float64, 1e-10) on one rank here and on 2 and 3
ranks through mpiexec (tests/mpi_scripts/gru_ranks.py); the propagators' steps are
the GRU cell and the exact vector-Jacobian products of the coarse step; bad inputs
raise errors that say what to pass.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from launch import assert_all_ok, launch, needs_mpiexec

torch = pytest.importorskip("torch")

import mgrit  # noqa: E402
from propagators.torch import ParallelGRU  # noqa: E402
from propagators.torch.gru import GRUAdjointPropagator, GRUPropagator  # noqa: E402

TIGHT = dict(fwd_iters=60, bwd_iters=60, fwd_tol=1e-14, bwd_tol=1e-14)
TOL = 1e-10
I, H, B = 3, 5, 4


pytestmark = pytest.mark.usefixtures("float64")  # (tests/conftest.py)


def pair(num_layers=1, bias=True, batch_first=False, seed=0, **kw):
    torch.manual_seed(seed)
    ref = torch.nn.GRU(I, H, num_layers=num_layers, bias=bias, batch_first=batch_first)
    par = ParallelGRU(I, H, num_layers=num_layers, bias=bias, batch_first=batch_first, **{**TIGHT, **kw})
    par.load_state_dict(ref.state_dict())
    return ref, par


def maxdiff(a, b) -> float:
    return float((a.detach() - b.detach()).abs().max())


def run_both(ref, par, x, h0, wo, wn):
    """Forward and backward of both with the same loss; returns (outputs, grads) of each."""
    out = []
    for m in (ref, par):
        xs = x.clone().requires_grad_(True)
        hs = None if h0 is None else h0.clone().requires_grad_(True)
        m.zero_grad()
        o, n = m(xs, hs)
        loss = (n * wn).sum() + ((o * wo).sum() if o is not None and wo is not None else 0.0)
        loss.backward()
        grads = {k: None if p.grad is None else p.grad.clone() for k, p in m.named_parameters()}
        out.append((o, n, xs.grad, None if hs is None else hs.grad, grads))
    return out


@pytest.mark.parametrize("num_layers, bias, batch_first, with_h0", [
    (1, True, False, True),
    (1, True, True, False),
    (2, True, False, False),
    (2, True, True, True),
    (1, False, False, True),
    (2, False, True, False),
])
def test_converged_output_and_gradients_equal_nn_gru(num_layers, bias, batch_first, with_h0):
    ref, par = pair(num_layers, bias, batch_first, seed=num_layers + 2 * bias, cf=2, max_levels=4)
    L = 17
    x = torch.randn(B, L, I) if batch_first else torch.randn(L, B, I)
    h0 = torch.randn(num_layers, B, H) if with_h0 else None
    wo = torch.randn_like(x[..., :1].expand(*x.shape[:2], H))
    wn = torch.randn(num_layers, B, H)
    (o_r, n_r, gx_r, gh_r, gw_r), (o, n, gx, gh, gw) = run_both(ref, par, x, h0, wo, wn)
    assert o.shape == o_r.shape and n.shape == n_r.shape
    assert maxdiff(o, o_r) < TOL and maxdiff(n, n_r) < TOL
    assert maxdiff(gx, gx_r) < TOL
    if with_h0:
        assert maxdiff(gh, gh_r) < TOL
    assert set(gw) == set(gw_r)  # the same parameter names
    for k in gw_r:
        assert maxdiff(gw[k], gw_r[k]) < TOL, k
    assert par.forward_residual < 1e-12 and par.backward_residual < 1e-12


def test_the_layouts_of_many_sequence_lengths_are_not_all_kept():
    """A review: one layout (the plan of a sequence's time grid) per sequence length was kept for ever: a data
    set with every length up to 3,000 held 436 MB. The module keeps the latest 64; a length met again after
    its layout went gets a new one, and the same result."""
    from propagators.torch.rnn import _LAYOUTS_KEPT

    ref, par = pair(cf=2, max_levels=3)
    x5 = torch.randn(5, 2, I)
    first = par(x5)[1].detach()
    for L in range(6, 6 + _LAYOUTS_KEPT + 10):
        with torch.no_grad():
            par(torch.randn(L, 2, I))
    assert len(par._layouts) == _LAYOUTS_KEPT and 5 not in par._layouts
    assert maxdiff(par(x5)[1], first) == 0.0 and maxdiff(first, ref(x5)[1]) < TOL


def test_parameter_names_and_state_dicts_are_nn_grus():
    ref, par = pair(num_layers=3, bias=True)
    assert list(par.state_dict()) == list(ref.state_dict())
    assert (par.mode, par.proj_size) == (ref.mode, ref.proj_size) == ("GRU", 0)
    assert len(par.all_weights) == len(ref._all_weights) == 3
    for w, names in zip(par.all_weights, ref._all_weights):  # the same grouping and order as nn.GRU's
        assert [id(p) for p in w] == [id(getattr(par, n)) for n in names]
    assert [tuple(p.shape) for p in par.parameters()] == [tuple(p.shape) for p in ref.parameters()]
    back = torch.nn.GRU(I, H, num_layers=3)
    back.load_state_dict(par.state_dict())
    gru = par.to_gru()
    x = torch.randn(6, 2, I)
    assert maxdiff(gru(x)[0], ref(x)[0]) == 0.0 and maxdiff(back(x)[0], ref(x)[0]) == 0.0
    nobias = ParallelGRU(I, H, num_layers=2, bias=False)
    assert list(nobias.state_dict()) == list(torch.nn.GRU(I, H, num_layers=2, bias=False).state_dict())
    # in this module's mode (it came back in training mode: with dropout, a reference that drops out)
    dropping = ParallelGRU(I, H, num_layers=2, dropout=0.5).eval()
    assert not dropping.to_gru().training and dropping.train().to_gru().training


def test_default_initialisation_is_nn_grus_range():
    torch.manual_seed(3)
    par = ParallelGRU(I, 16, num_layers=2)
    bound = 1.0 / np.sqrt(16)
    for p in par.parameters():
        a = float(p.detach().abs().max())
        assert 0.5 * bound < a <= bound


def test_unbatched_input_and_return_sequence_false():
    ref, par = pair(num_layers=2, cf=2, max_levels=3)
    x, h0 = torch.randn(9, I), torch.randn(2, H)
    o_r, n_r = ref(x, h0)
    o, n = par(x, h0)
    assert o.shape == (9, H) and n.shape == (2, H)
    assert maxdiff(o, o_r) < TOL and maxdiff(n, n_r) < TOL
    last = ParallelGRU(I, H, num_layers=2, return_sequence=False, **TIGHT)
    last.load_state_dict(ref.state_dict())
    xs = torch.randn(9, B, I)
    (_, n_r, gx_r, _, gw_r), (o, n, gx, _, gw) = run_both(ref, last, xs, None, torch.zeros(9, B, H),
                                                          torch.randn(2, B, H))
    assert o is None
    assert maxdiff(n, n_r) < TOL and maxdiff(gx, gx_r) < TOL
    for k in gw_r:
        assert maxdiff(gw[k], gw_r[k]) < TOL, k


@pytest.mark.parametrize("L", [1, 2, 5, 200])
def test_short_sequences(L):
    """Converged, two layers deep, nn.GRU's output and gradients; over 200 positions the weight
    gradients are summed over four pieces of the sequence (at least 64 positions, the last 8)."""
    from propagators.torch import rnn
    from propagators.torch.module import _chunks

    assert [len(p) for p in _chunks(np.arange(200), rnn._PIECE_STEPS)] == [64, 64, 64, 8]
    ref, par = pair(num_layers=2, cf=2, max_levels=3)
    x, h0 = torch.randn(L, B, I), torch.randn(2, B, H)
    (o_r, n_r, gx_r, gh_r, gw_r), (o, n, gx, gh, gw) = run_both(ref, par, x, h0, torch.randn(L, B, H),
                                                                torch.randn(2, B, H))
    assert maxdiff(o, o_r) < TOL and maxdiff(gx, gx_r) < TOL and maxdiff(gh, gh_r) < TOL
    for k in gw_r:
        assert maxdiff(gw[k], gw_r[k]) < TOL, k


def test_optimizer_steps_follow_nn_gru():
    ref, par = pair(num_layers=2, cf=2, max_levels=3)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(par.parameters(), lr=0.05, momentum=0.9)
    x, target = torch.randn(12, B, I), torch.randn(B, H)
    for _ in range(3):
        for m, o in ((ref, opt_r), (par, opt)):
            o.zero_grad()
            loss = ((m(x)[1][-1] - target) ** 2).sum()
            loss.backward()
            o.step()
    for (k, p), q in zip(par.named_parameters(), ref.parameters()):
        assert maxdiff(p, q) < TOL, k


def test_eval_mode_steps_exactly_without_iterations():
    ref, par = pair(num_layers=2, fwd_iters=1, bwd_iters=1, fwd_tol=None, bwd_tol=None)
    x = torch.randn(20, B, I)
    par.eval()
    with torch.no_grad():
        o, n = par(x)
    o_r, n_r = ref(x)
    assert maxdiff(o, o_r) < 1e-12 and maxdiff(n, n_r) < 1e-12
    assert all(res.status is mgrit.Status.SEQUENTIAL for res in par.last_forward)
    par.train()
    with torch.no_grad():
        o1, _ = par(x)  # one inexact cycle in training mode
    assert maxdiff(o1, o_r) > 1e-6


@pytest.mark.parametrize("coarse", ["frozen", "inject"])
def test_coarse_steps_converge_to_the_serial_gru(coarse):
    """Both coarse steps converge; their residuals fall by a factor per cycle well below 1."""
    torch.manual_seed(5)
    ref = torch.nn.GRU(I, 8)
    par = ParallelGRU(I, 8, cf=4, max_levels=3, relax="FCF", coarse=coarse, fwd_iters=30, bwd_iters=30,
                      fwd_tol=1e-12, bwd_tol=1e-12)
    par.load_state_dict(ref.state_dict())
    x = torch.randn(64, B, I)
    o, n = par(x)
    n[-1].sum().backward()
    for res in (par.last_forward[0], par.last_backward[0]):
        assert res.status is mgrit.Status.CONVERGED
        r = [v for v in res.residuals if v is not None]
        assert r[-1] <= 1e-12
        assert (r[-1] / r[0]) ** (1.0 / (len(r) - 1)) < 0.5
    assert maxdiff(o, ref(x)[0]) < 1e-10


def test_frozen_coarse_step_beats_injection_after_one_cycle():
    """The frozen-feedback coarse step reads every input of its interval: after one forward
    cycle its output is closer to the serial GRU than with the injected first input."""
    torch.manual_seed(6)
    ref = torch.nn.GRU(I, 8)
    x = torch.randn(64, B, I)
    err = {}
    for coarse in ("frozen", "inject"):
        par = ParallelGRU(I, 8, cf=4, max_levels=3, coarse=coarse, fwd_iters=1)
        par.load_state_dict(ref.state_dict())
        with torch.no_grad():
            err[coarse] = maxdiff(par(x)[0], ref(x)[0])
    assert err["frozen"] < 0.5 * err["inject"]


def test_fewer_cycles_approximate_and_more_cycles_improve():
    torch.manual_seed(7)
    ref = torch.nn.GRU(I, 8)
    x = torch.randn(48, B, I)
    w = torch.randn(48, B, 8)
    ref.zero_grad()
    (ref(x)[0] * w).sum().backward()
    g_ref = ref.weight_hh_l0.grad.clone()
    errs = []
    for k in (1, 2, 4):
        par = ParallelGRU(I, 8, cf=4, max_levels=3, relax="FCF", fwd_iters=30, fwd_tol=1e-13, bwd_iters=k)
        par.load_state_dict(ref.state_dict())
        (par(x)[0] * w).sum().backward()
        errs.append(float((par.weight_hh_l0.grad - g_ref).norm() / g_ref.norm()))
    assert errs[0] < 1.0 and errs[1] < errs[0] and errs[2] < errs[1] and errs[2] < 1e-3


def test_fine_step_is_the_gru_cell_and_step_batch_mixes_lengths():
    torch.manual_seed(8)
    cell = torch.nn.GRUCell(I, H)
    x, h = torch.randn(6, B, I), torch.randn(B, H)
    gi = torch.nn.functional.linear(x, cell.weight_ih, cell.bias_ih)
    prop = GRUPropagator(cell.weight_hh.detach(), cell.bias_hh.detach(), gi.detach(), 0)
    with torch.no_grad():
        assert maxdiff(prop.step(h, 2.0, 3.0), cell(x[2], h)) < 1e-14
        seq = h
        for i in range(1, 4):
            seq = prop.step(seq, float(i), float(i + 1))
        U = torch.stack([h, h, h])
        out = prop.step_batch(U, np.array([1.0, 0.0, 1.0]), np.array([2.0, 3.0, 4.0]))  # lengths 1, 3, 3
        assert maxdiff(out[0], cell(x[1], h)) < 1e-14
        assert maxdiff(out[0], prop.step(h, 1.0, 2.0)) == 0.0
        assert maxdiff(out[1], prop.step(h, 0.0, 3.0)) == 0.0
        assert maxdiff(out[2], prop.step(h, 1.0, 4.0)) == 0.0


@pytest.mark.parametrize("coarse, m", [("frozen", 1), ("frozen", 4), ("inject", 3)])
def test_adjoint_step_is_the_vjp_of_the_forward_step_with_forcing(coarse, m):
    """lam_{i0} = g_{i0} + (dPhi/dh_{i0})^T [g_{i0+1..i1-1}, lam_{i1}], checked against autograd."""
    torch.manual_seed(9)
    L = 7
    W, b = torch.randn(3 * H, H) * 0.5, torch.randn(3 * H)
    gi = torch.randn(L, B, 3 * H)
    prop = GRUPropagator(W, b, gi, 0, coarse)
    i0 = 2
    h0 = torch.randn(B, H, requires_grad=True)
    k = prop.span(m)
    # the forward step over [i0, i0 + m] written out with its intermediate states
    gh = torch.nn.functional.linear(h0, W, b)
    hs, h = [], h0
    for j in range(k):
        r, z, n = prop.gates(gi[i0 + j], gh)
        h = n + z * (h - n)
        hs.append(h)
    forcing = torch.randn(L + 1, B, H)
    lam1 = torch.randn(B, H)
    cot = [forcing[i0 + j + 1] for j in range(k - 1)] + [lam1]
    ref = torch.autograd.grad(hs, h0, cot)[0] + forcing[i0]
    U = h0.detach()[None]
    adj = GRUAdjointPropagator(prop, L, U, prop.hidden(U), i0, forcing)
    tau1 = float(L - i0)
    got = adj.step(lam1, tau1 - m, tau1)
    assert maxdiff(got, ref) < 1e-13
    assert maxdiff(prop.step(h0.detach(), float(i0), float(i0 + m)), hs[-1]) < 1e-14


def test_double_backward_raises():
    _, par = pair(cf=2, max_levels=2)
    x = torch.randn(6, B, I, requires_grad=True)
    out = par(x)[0].sum()
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out, x, create_graph=True)
    par(x)[0].sum().backward()  # a plain backward still works afterwards
    assert x.grad is not None


@pytest.mark.parametrize("make_input, h0, exc, match", [
    (lambda: torch.randn(5, B, I + 1), None, ValueError, "input_size"),
    (lambda: torch.randn(5, I + 2), None, ValueError, "input_size"),
    (lambda: torch.randn(2, 5, B, I), None, ValueError, "3-D"),
    (lambda: torch.randn(I), None, ValueError, "3-D"),
    (lambda: torch.randn(0, B, I), None, ValueError, "empty"),
    (lambda: torch.ones(5, B, I, dtype=torch.int64), None, TypeError, "floating-point"),
    (lambda: np.ones((5, B, I)), None, TypeError, "torch.Tensor"),
    (lambda: torch.randn(5, B, I, dtype=torch.float32), None, TypeError, "parameters"),
    (lambda: torch.randn(5, B, I), torch.randn(2, B, H), ValueError, r"h0 must have shape \(1, 4, 5\)"),
    (lambda: torch.randn(5, B, I), torch.randn(1, B + 1, H), ValueError, "h0 must have shape"),
    (lambda: torch.randn(5, I), torch.randn(1, B, H), ValueError, r"h0 must have shape \(1, 5\)"),
    (lambda: torch.randn(5, B, I), torch.randn(1, B, H, dtype=torch.float32), TypeError, "same dtype"),
])
def test_bad_inputs_raise_and_say_what_to_pass(make_input, h0, exc, match):
    par = ParallelGRU(I, H)
    with pytest.raises(exc, match=match):
        par(make_input(), h0)


@pytest.mark.parametrize("batch_first, bidirectional, seq, with_h0", [
    (False, False, True, False), (True, True, True, True), (False, True, False, True)])
def test_an_empty_batch_gives_nn_grus_empty_outputs_and_zero_gradients(batch_first, bidirectional, seq, with_h0):
    """As nn.GRU: outputs with a batch of 0 (no solve), and after backward zero gradients of every
    weight (not None, so that optimizers see them), of the input and of h0."""
    torch.manual_seed(4)
    ref = torch.nn.GRU(I, H, num_layers=2, batch_first=batch_first, bidirectional=bidirectional)
    par = ParallelGRU(I, H, num_layers=2, batch_first=batch_first, bidirectional=bidirectional,
                      return_sequence=seq)
    D = 2 if bidirectional else 1
    x = torch.randn(0, 29, I) if batch_first else torch.randn(29, 0, I)
    h0 = torch.randn(2 * D, 0, H) if with_h0 else None
    (o_r, n_r, gx_r, gh_r, gw_r), (o, n, gx, gh, gw) = run_both(ref, par, x, h0, None, torch.ones(2 * D, 0, H))
    assert (o is None) != seq and n.shape == n_r.shape == (2 * D, 0, H)
    if seq:
        assert o.shape == o_r.shape == ((0, 29, D * H) if batch_first else (29, 0, D * H))
    assert gx.shape == gx_r.shape == x.shape and (gh is None or gh.shape == h0.shape)
    assert set(gw) == set(gw_r) and all(g is not None and float(g.abs().sum()) == 0.0 for g in gw.values())
    assert all(r is None for r in par.last_forward)  # (no solve ran)


@pytest.mark.parametrize("kw, match", [
    (dict(dropout=-0.1), r"`dropout` must be a number in \[0, 1\]"),
    (dict(dropout=1.5), "dropout"),
    (dict(dropout=True), "dropout"),
    (dict(dropout="0.2"), "dropout"),
    (dict(coarse="mean"), "coarse"),
    (dict(fwd_iters=0), "fwd_iters"),
    (dict(num_layers=0), "num_layers"),
    (dict(hidden_size=True), "hidden_size"),
    (dict(tol_type="max"), "tol_type"),
    (dict(cf=1), "cf"),
    (dict(relax="C"), "relax"),
    (dict(skip="no"), "`skip` must be True or False"),
    (dict(return_sequence="False"), "`return_sequence` must be True or False"),
])
def test_bad_settings_raise(kw, match):
    args = dict(input_size=I, hidden_size=H)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        ParallelGRU(**args)


# -- bidirectional and dropout ---------------------------------------------------------
@pytest.mark.parametrize("num_layers, bias, batch_first, with_h0, seq", [
    (1, True, False, True, True),
    (2, True, True, False, True),
    (2, False, False, True, True),
    (3, True, False, False, False),
])
def test_bidirectional_converged_equals_nn_gru(num_layers, bias, batch_first, with_h0, seq):
    """Both directions of every layer (the reverse one an MGRIT solve on the flipped sequence) and
    every gradient equal a bidirectional nn.GRU's with copied weights."""
    torch.manual_seed(7 + num_layers)
    ref = torch.nn.GRU(I, H, num_layers=num_layers, bias=bias, batch_first=batch_first, bidirectional=True)
    par = ParallelGRU(I, H, num_layers=num_layers, bias=bias, batch_first=batch_first, bidirectional=True,
                      return_sequence=seq, cf=2, max_levels=4, **TIGHT)
    assert list(par.state_dict()) == list(ref.state_dict())
    par.load_state_dict(ref.state_dict())
    L = 19
    x = torch.randn(B, L, I) if batch_first else torch.randn(L, B, I)
    h0 = torch.randn(2 * num_layers, B, H) if with_h0 else None
    wo = torch.randn(*x.shape[:2], 2 * H) if seq else None
    wn = torch.randn(2 * num_layers, B, H)
    (o_r, n_r, gx_r, gh_r, gw_r), (o, n, gx, gh, gw) = run_both(ref, par, x, h0, wo, wn)
    if seq:
        assert o.shape == o_r.shape and maxdiff(o, o_r) < TOL
    else:
        assert o is None
    assert n.shape == n_r.shape and maxdiff(n, n_r) < TOL
    assert maxdiff(gx, gx_r) < TOL
    if with_h0:
        assert maxdiff(gh, gh_r) < TOL
    assert set(gw) == set(gw_r)
    for k in gw_r:
        assert maxdiff(gw[k], gw_r[k]) < TOL, k
    assert len(par.last_forward) == len(par.last_backward) == 2 * num_layers
    assert all(r is not None for r in par.last_forward + par.last_backward)
    assert par.forward_residual < 1e-12 and par.backward_residual < 1e-12


def masked_reference(par, x, h0, seed):
    """The stack of one-layer nn.GRUs with par's weights and layout, the masks of ``seed`` (in the
    layout of the output, as ``dropout_masks`` gives them) between the layers; returns the output,
    h_n, the masks and the one-layer GRUs."""
    D = par.num_directions
    like = torch.empty(*x.shape[:-1], D * H)
    masks = par.dropout_masks(seed, like)
    inp, hs, grus = x, [], []
    for l in range(par.num_layers):
        g = torch.nn.GRU(I if l == 0 else D * H, H, bias=par.bias, batch_first=par.batch_first,
                         bidirectional=par.bidirectional)
        g.load_state_dict({k.replace(f"_l{l}", "_l0"): v for k, v in par.state_dict().items()
                           if k.endswith(f"_l{l}") or k.endswith(f"_l{l}_reverse")})
        o, h = g(inp, None if h0 is None else h0[l * D:(l + 1) * D])
        hs.append(h)
        grus.append(g)
        inp = o * masks[l] if l < par.num_layers - 1 else o
    return inp, torch.cat(hs), masks, grus


@pytest.mark.parametrize("bidirectional, p, batch_first, bias, unbatched, with_h0", [
    (False, 0.3, False, True, False, False),
    (True, 0.3, False, True, False, True),
    (True, 0.3, True, False, False, False),
    (False, 0.5, True, True, False, True),
    (True, 0.4, False, True, True, True),
    (False, 1.0, False, True, False, False),
    (True, 1.0, True, True, False, False),
])
def test_dropout_between_layers_equals_the_masked_serial_stack(bidirectional, p, batch_first, bias, unbatched,
                                                               with_h0):
    """In training mode the output of every layer but the last is multiplied by a mask of zeros and
    1/(1-p) (all zeros for p = 1) before the next layer reads it; the converged pass and every gradient
    (input, h0, each weight) equal the stack of one-layer nn.GRUs with the masks that ``dropout_masks``
    gives in the output's layout."""
    torch.manual_seed(3)
    par = ParallelGRU(I, H, num_layers=3, dropout=p, bidirectional=bidirectional, batch_first=batch_first,
                      bias=bias, **TIGHT)
    D = 2 if bidirectional else 1
    L = 13
    x = torch.randn(L, I) if unbatched else (torch.randn(B, L, I) if batch_first else torch.randn(L, B, I))
    h0 = (torch.randn(3 * D, H) if unbatched else torch.randn(3 * D, B, H)) if with_h0 else None
    xp, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    hp = hs = None
    if with_h0:
        hp, hs = h0.clone().requires_grad_(True), h0.clone().requires_grad_(True)
    out, hn = par(xp, hp)
    seed = par.last_dropout_seed
    assert isinstance(seed, int)
    ref, ref_n, masks, grus = masked_reference(par, xs, hs, seed)
    assert len(masks) == 2 and masks[0].shape == out.shape
    for m in masks:
        vals = set(torch.unique(m).tolist())
        assert vals <= {0.0, 1.0 / (1.0 - p)} if p < 1 else vals == {0.0}
    if p < 1:  # about p of the elements dropped (at least 260 of them: far from 0 and 1)
        assert 0.1 < float((masks[0] == 0).double().mean()) < 0.7
    assert maxdiff(out, ref) < TOL and maxdiff(hn, ref_n) < TOL
    w, wn = torch.randn_like(out), torch.randn_like(hn)
    ((out * w).sum() + (hn * wn).sum()).backward()
    ((ref * w).sum() + (ref_n * wn).sum()).backward()
    assert maxdiff(xp.grad, xs.grad) < TOL
    if with_h0:
        assert maxdiff(hp.grad, hs.grad) < TOL
    params = dict(par.named_parameters())
    for l, g in enumerate(grus):
        for name, q in g.named_parameters():
            assert maxdiff(params[name.replace("_l0", f"_l{l}")].grad, q.grad) < TOL, (l, name)


def test_dropout_masks_are_drawn_once_per_pass_from_the_global_generator():
    """A new seed (new masks) every training pass, the same ones after the same torch.manual_seed;
    none in eval mode, where the pass is exact stepping without dropout (nn.GRU's output)."""
    torch.manual_seed(0)
    par = ParallelGRU(I, H, num_layers=2, dropout=0.5, **TIGHT)
    x = torch.randn(9, B, I)
    torch.manual_seed(5)
    a = par(x)[0]
    s1 = par.last_dropout_seed
    b = par(x)[0]
    assert par.last_dropout_seed != s1 and maxdiff(a, b) > 1e-3
    torch.manual_seed(5)
    assert maxdiff(par(x)[0], a) == 0.0 and par.last_dropout_seed == s1
    par.eval()
    out = par(x)[0]
    assert par.last_dropout_seed is None
    ref = par.to_gru().eval()
    assert ref.dropout == 0.5 and maxdiff(out, ref(x)[0]) < 1e-12
    with torch.no_grad():  # training mode drops under no_grad too, as nn.GRU does
        par.train()
        par(x)
        assert par.last_dropout_seed is not None


def test_bidirectional_odd_cases_equal_nn_gru():
    """Unbatched input with h0, the injection coarse step, frozen reverse weights (their gradients stay
    None, the others equal nn.GRU's) and ``bidirectional=1`` as nn.GRU takes it."""
    torch.manual_seed(11)
    ref = torch.nn.GRU(I, H, num_layers=2, bidirectional=True)  # (nn.GRU builds with 1 but fails to run)
    par = ParallelGRU(I, H, num_layers=2, bidirectional=1, coarse="inject", cf=3, **TIGHT)
    assert par.bidirectional is True
    par.load_state_dict(ref.state_dict())
    for m in (ref, par):
        for name, q in m.named_parameters():
            q.requires_grad_(not name.endswith("_reverse"))
    x, h0 = torch.randn(14, I), torch.randn(4, H)
    (o_r, n_r, gx_r, gh_r, gw_r), (o, n, gx, gh, gw) = run_both(ref, par, x, h0, torch.randn(14, 2 * H),
                                                                 torch.randn(4, H))
    assert maxdiff(o, o_r) < TOL and maxdiff(n, n_r) < TOL
    assert maxdiff(gx, gx_r) < TOL and maxdiff(gh, gh_r) < TOL
    for name, q in par.named_parameters():
        if name.endswith("_reverse"):
            assert q.grad is None, name
        else:
            assert maxdiff(gw[name], gw_r[name]) < TOL, name


def test_a_differentiated_pass_clears_the_last_adjoint_results():
    """last_backward holds the adjoint solves of the last differentiated pass only: a direction that
    pass did not differentiate (frozen reverse weights, an input without gradient) has no entry, so
    backward_residual is not a mix of two passes."""
    torch.manual_seed(2)
    par = ParallelGRU(I, H, bidirectional=True)
    x = torch.randn(9, B, I)
    par(x)[0].sum().backward()
    assert all(r is not None for r in par.last_backward)
    for name, q in par.named_parameters():
        q.requires_grad_(not name.endswith("_reverse"))
    par(x)[0].sum().backward()
    assert par.last_backward[0] is not None and par.last_backward[1] is None
    assert par.backward_residual == par.last_backward[0].final_residual
    assert par.backward_residuals[1] == []
    with torch.no_grad():  # a pass that is not differentiated keeps them
        par(x)
    assert par.last_backward[0] is not None


def test_dropout_with_one_layer_warns_as_nn_gru_does():
    with pytest.warns(UserWarning, match="num_layers=1 does nothing"):
        par = ParallelGRU(I, H, dropout=0.5)
    par(torch.randn(5, B, I))
    assert par.last_dropout_seed is None


def packed_run(m, seqs, h0, sort, w_out):
    """Forward and backward of a packed batch of ``seqs`` through ``m``; (output, h_n, grads of the
    sequences, of h0 and of every weight)."""
    ss = [q.clone().requires_grad_(True) for q in seqs]
    hh = None if h0 is None else h0.clone().requires_grad_(True)
    m.zero_grad()
    o, n = m(torch.nn.utils.rnn.pack_sequence(ss, enforce_sorted=sort), hh)
    loss = (n * n).sum() + ((o.data * w_out[: o.data.shape[0]]).sum() if o is not None else 0.0)
    loss.backward()
    return o, n, [q.grad for q in ss], None if hh is None else hh.grad, {k: p.grad for k, p in m.named_parameters()}


@pytest.mark.parametrize("layers, bidirectional, batch_first, with_h0, sort, lengths", [
    (1, False, False, False, False, [7, 3, 9, 3, 1]),  # ties and a sequence of one position
    (2, True, True, True, False, [7, 3, 9, 3, 1]),
    (2, False, False, True, True, [9, 7, 3, 3, 1]),  # enforce_sorted=True: no sort indices
    (1, True, False, False, False, [2, 11]),
    (1, False, True, True, False, [6, 6, 6]),  # every sequence whole: the padded pass
])
def test_packed_sequences_equal_nn_gru(layers, bidirectional, batch_first, with_h0, sort, lengths):
    """A PackedSequence input: the steps past a sequence's end keep its state (an update gate of exactly 1),
    so converged solves give nn.GRU's packed output (the same batch sizes and sort order), h_n in the
    caller's order and the gradients of every sequence, h0 and weight, also through the frozen coarse steps
    that cross a sequence's end (cf 2, 4 levels)."""
    torch.manual_seed(layers + 3 * bidirectional + len(lengths))
    ref = torch.nn.GRU(I, H, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first)
    par = ParallelGRU(I, H, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first, cf=2,
                      max_levels=4, **TIGHT)
    par.load_state_dict(ref.state_dict())
    seqs = [torch.randn(n, I) for n in lengths]
    h0 = torch.randn((1 + bidirectional) * layers, len(lengths), H) if with_h0 else None
    w_out = torch.randn(sum(lengths), (1 + bidirectional) * H)
    (o_r, n_r, gx_r, gh_r, gw_r), (o, n, gx, gh, gw) = (packed_run(m, seqs, h0, sort, w_out) for m in (ref, par))
    assert isinstance(o, torch.nn.utils.rnn.PackedSequence) and torch.equal(o.batch_sizes, o_r.batch_sizes)
    for a, b in ((o.sorted_indices, o_r.sorted_indices), (o.unsorted_indices, o_r.unsorted_indices)):
        assert (a is None and b is None) or torch.equal(a, b)
    assert maxdiff(o.data, o_r.data) < TOL and maxdiff(n, n_r) < TOL
    assert max(maxdiff(a, b) for a, b in zip(gx, gx_r)) < TOL
    if with_h0:
        assert maxdiff(gh, gh_r) < TOL
    for k in gw_r:
        assert maxdiff(gw[k], gw_r[k]) < TOL, k
    # eval mode (exact stepping) and return_sequence=False (h_n alone)
    par.eval(), ref.eval()
    with torch.no_grad():
        pk = torch.nn.utils.rnn.pack_sequence(seqs, enforce_sorted=sort)
        assert maxdiff(par(pk, h0)[0].data, ref(pk, h0)[0].data) < TOL
        par.return_sequence = False
        o, n = par(pk, h0)
        assert o is None and maxdiff(n, ref(pk, h0)[1]) < TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_packed_padding_keeps_the_state_exactly_in_low_precision(dtype):
    """A review: the held step n + 1 (h - n) rounds; in bfloat16 each of the 2,000 padding steps moved the state
    of a 5-position sequence by about 2^-8, and its reverse outputs came out 1.28 off nn.GRU's (0.003 when passed
    alone), with no error. The fine step now keeps the state itself there: exact stepping (eval) gives h_n equal
    to the output at the sequence's last position, bit for bit, and the solves' outputs of the short sequence are
    as close to nn.GRU's as when it is passed alone."""
    torch.manual_seed(0)
    gru = torch.nn.GRU(4, 8, bidirectional=True).float()
    seqs = [torch.randn(5, 4).float(), torch.randn(400, 4).float()]
    h0 = 0.5 * torch.randn(2, 2, 8).float()
    par = ParallelGRU(4, 8, bidirectional=True).to(dtype)
    par.load_state_dict(gru.state_dict())
    packed = torch.nn.utils.rnn.pack_sequence([q.to(dtype) for q in seqs], enforce_sorted=False)
    with torch.no_grad():
        ref, _ = torch.nn.utils.rnn.pad_packed_sequence(gru(torch.nn.utils.rnn.pack_sequence(seqs, False), h0)[0])
        out, _ = torch.nn.utils.rnn.pad_packed_sequence(par(packed, h0.to(dtype))[0])  # (2/1 cycles)
        alone = par(seqs[0][:, None].to(dtype), h0[:, :1].to(dtype))[0]
        par.eval()
        o, n = par(packed, h0.to(dtype))
    padded, _ = torch.nn.utils.rnn.pad_packed_sequence(o)
    assert torch.equal(n[0, 0], padded[4, 0, :8])  # the forward direction's h_n: its last position's state
    err = float((out[:5, 0].float() - ref[:5, 0]).abs().max())
    err_alone = float((alone[:, 0].float() - ref[:5, 0]).abs().max())
    assert err < 3 * err_alone + 10 * torch.finfo(dtype).eps, (err, err_alone)


@pytest.mark.parametrize("cell", ["GRU", "LSTM"])
def test_dropout_masks_of_a_packed_pass_are_in_its_padded_layout(cell):
    """With a PackedSequence, dropout_masks(seed, output) gives the masks in the padded layout where the pass
    applied them: layer 1 of the converged pass equals torch's module on the packed, masked output of layer 0
    (ParallelGRU and ParallelLSTM)."""
    from torch.nn.utils.rnn import pack_padded_sequence, pack_sequence, pad_packed_sequence

    import propagators.torch as pt

    torch.manual_seed(4)
    par = getattr(pt, f"Parallel{cell}")(I, H, num_layers=2, dropout=0.5, cf=2, **TIGHT)
    seqs = [torch.randn(n, I) for n in (6, 3, 9)]
    out, _ = par(pack_sequence(seqs, enforce_sorted=False))
    (mask,) = par.dropout_masks(par.last_dropout_seed, out)
    layers = [getattr(torch.nn, cell)(I if l == 0 else H, H) for l in range(2)]
    for l, g in enumerate(layers):
        g.load_state_dict({k.replace(f"_l{l}", "_l0"): v for k, v in par.state_dict().items() if k.endswith(f"_l{l}")})
    first, lengths = pad_packed_sequence(layers[0](pack_sequence(seqs, enforce_sorted=False))[0])
    ref = layers[1](pack_padded_sequence(first * mask, lengths, enforce_sorted=False))[0]
    assert maxdiff(pad_packed_sequence(out)[0], pad_packed_sequence(ref)[0]) < TOL


@pytest.mark.parametrize("cell", ["GRU", "LSTM"])
def test_a_packed_pass_with_an_overflowing_hidden_projection_saturates_as_torchs(cell):
    """A review: with W_hh h + b_hh overflowing to +-inf (finite float32 weights of 3e38), a held gate's input
    projection (+-inf) plus it was NaN, and the packed pass raised a misleading DivergenceError where torch's
    module saturates its gates; now the held gates' hidden projections stay finite and the pass is torch's."""
    import propagators.torch as pt

    ref = getattr(torch.nn, cell)(1, 4).float()
    with torch.no_grad():
        for p in ref.parameters():
            p.zero_()
        if cell == "LSTM":
            ref.weight_hh_l0.fill_(3e38)
        else:  # (z's projection to -inf, against the +inf of a held z; an overflowing W_hn h with r = 0 would be
            #      NaN at a held position, which torch never steps: docs/gru.md says so)
            ref.weight_hh_l0[4:8].fill_(-3e38)
    par = getattr(pt, f"Parallel{cell}")(1, 4, cf=2, **TIGHT).float()
    par.load_state_dict(ref.state_dict())
    f32 = dict(dtype=torch.float32)
    pk = torch.nn.utils.rnn.pack_sequence([torch.zeros(12, 1, **f32), torch.zeros(1, 1, **f32)])
    h0 = torch.full((1, 2, 4), 0.9, **f32)
    hx = (h0, torch.ones(1, 2, 4, **f32)) if cell == "LSTM" else h0
    for train in (True, False):
        par.train(train)
        with torch.no_grad():
            (o, n), (o_r, n_r) = par(pk, hx), ref(pk, hx)
        for a, b in zip(*(((x,) if cell == "GRU" else x) for x in (n, n_r))):
            assert torch.isfinite(a).all() and float((a - b).abs().max()) < 1e-6, (a, b)
        assert float((o.data - o_r.data).abs().max()) < 1e-6


def test_a_packed_pass_with_few_cycles_approximates():
    """With few forward cycles a packed batch's h_n is an approximation that more cycles improve (to
    nn.GRU's)."""
    torch.manual_seed(5)
    ref = torch.nn.GRU(I, H)
    seqs = [torch.randn(n, I) for n in (40, 13, 27)]
    pk = torch.nn.utils.rnn.pack_sequence(seqs, enforce_sorted=False)
    errs = []
    for iters in (1, 3, 30):
        par = ParallelGRU(I, H, fwd_iters=iters)
        par.load_state_dict(ref.state_dict())
        with torch.no_grad():
            errs.append(maxdiff(par(pk)[1], ref(pk)[1]))
    assert errs[0] > errs[1] > errs[2] and errs[2] < TOL


def test_reverse_weights_of_a_one_way_gru_raise_clearly():
    par = ParallelGRU(I, H)
    with pytest.raises(ValueError, match="not bidirectional"):
        par.layer_weights(0, reverse=True)
    bi = ParallelGRU(I, H, bidirectional=True)
    assert bi.layer_weights(0, reverse=True)[0] is bi.weight_ih_l0_reverse
    with pytest.raises(ValueError, match=r"h0 must have shape \(2, 4, 5\) \(num_layers \* 2"):
        bi(torch.randn(5, B, I), torch.randn(1, B, H))


DOCS = Path(__file__).resolve().parents[1] / "docs" / "gru.md"


@pytest.mark.parametrize("k", range(6))
def test_docs_examples_run(k):
    """The one-rank examples of docs/gru.md run as printed (their asserts included)."""
    import re

    blocks = [b for b in re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S) if "MPI" not in b]
    assert len(blocks) == 6
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)  # the examples build float32 models, as written
    try:
        exec(compile(blocks[k], f"docs/gru.md block {k}", "exec"), {})
    finally:
        torch.set_default_dtype(old)


# -- several ranks ---------------------------------------------------------------------
@pytest.mark.mpi
@needs_mpiexec
@pytest.mark.parametrize("n", [2, 3])
def test_parallel_gru_on_ranks_equals_nn_gru(n):
    pytest.importorskip("mpi4py")
    rc, out = launch(n, "gru_ranks.py")
    assert_all_ok(n, rc, out)


def test_a_gru_solve_without_progress_warns_and_a_converging_one_does_not():
    import warnings

    from propagators.torch import ConvergenceWarning

    def model(scale):
        torch.manual_seed(0)
        m = ParallelGRU(4, 8, coarse="inject", fwd_iters=2, bwd_iters=1).double()
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(scale)  # large weights: two cycles do not reduce the residual
        return m

    x = torch.randn(64, 3, 4, dtype=torch.float64)
    strong = model(10.0)
    with pytest.warns(ConvergenceWarning, match="forward \\(GRU layer 0\\) MGRIT solve made no progress"):
        strong(x)
    assert strong.last_forward[0].final_residual >= strong.forward_residuals[0][-1]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        model(1.0)(x)


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8, 9])
def test_affine_scan_and_composition_equal_the_recurrence(k):
    """The frozen coarse step's log-depth evaluation: h_{j+1} = a_j h_j + b_j at every j (scan) and at
    the end (composition), for lengths with and without an odd carry."""
    from propagators.torch.rnn import _affine_compose, _affine_scan

    torch.manual_seed(10)
    a, b, h0 = torch.rand(3, k, B, H), torch.randn(3, k, B, H), torch.randn(3, B, H)
    hs, h = [], h0
    for j in range(k):
        h = a[:, j] * h + b[:, j]
        hs.append(h)
    A, Bc = _affine_scan(a, b)
    assert maxdiff(A * h0[:, None] + Bc, torch.stack(hs, 1)) < 1e-14
    A, Bc = _affine_compose(a, b)
    assert maxdiff(A * h0 + Bc, hs[-1]) < 1e-14


@pytest.mark.parametrize("m", [3, 5])
def test_adjoint_step_without_forcing_is_the_vjp_of_the_forward_step(m):
    torch.manual_seed(11)
    L, i0 = 9, 1
    W, b = torch.randn(3 * H, H) * 0.5, torch.randn(3 * H)
    prop = GRUPropagator(W, b, torch.randn(L, B, 3 * H), 0, "frozen")
    h0 = torch.randn(B, H, requires_grad=True)
    gh = torch.nn.functional.linear(h0, W, b)
    h = h0
    for j in range(m):
        r, z, n = prop.gates(prop.gi[i0 + j], gh)
        h = n + z * (h - n)
    lam1 = torch.randn(B, H)
    ref = torch.autograd.grad(h, h0, lam1)[0]
    U = h0.detach()[None]
    adj = GRUAdjointPropagator(prop, L, U, prop.hidden(U), i0)
    assert maxdiff(adj.step(lam1, float(L - i0 - m), float(L - i0)), ref) < 1e-13


@pytest.mark.parametrize("i0, k", [([3], 4), ([0, 2, 4, 6], 2), ([1, 4, 7], 4), ([2, 2, 2], 3), ([0, 1, 5], 2),
                                   ([6, 4, 2], 1), ([], 3)])
def test_input_windows_equal_indexing(i0, k):
    """The windows of inputs a step reads: a strided view where the starts are evenly spaced, else an
    indexed copy; the same values either way, and rows outside the array raise as indexing does."""
    from propagators.torch.rnn import _positions, _windows

    x = torch.randn(12, 2, 3)
    i0 = np.array(i0, dtype=np.int64)
    got = _windows(x, i0 + 1, k, 1)
    assert got.shape == (len(i0), k, 2, 3)
    assert torch.equal(got, x[_positions(i0, k, 0)] if len(i0) else x[:0, None].expand(0, k, 2, 3))
    with pytest.raises(IndexError):
        _windows(x, np.array([8, 10]), 3, 0)  # the second window ends past row 11
    with pytest.raises(IndexError, match="before the first row"):
        _windows(x, np.array([0, 1]), 2, 1)  # position 0 lies before row 0 (offset 1): no wrap-around


def test_an_empty_interval_returns_the_state():
    prop = GRUPropagator(torch.randn(3 * H, H), torch.randn(3 * H), torch.randn(6, B, 3 * H), 0)
    h = torch.randn(B, H)
    assert torch.equal(prop.step(h, 2.0, 2.0), h)


def test_a_tolerance_alone_runs_the_cycles_it_needs():
    torch.manual_seed(0)
    ref = torch.nn.GRU(I, H, num_layers=2)
    par = ParallelGRU(I, H, num_layers=2, fwd_tol=1e-12, bwd_tol=1e-12)
    par.load_state_dict(ref.state_dict())
    assert (par.fwd_iters, par.bwd_iters) == (100, 100)
    assert (ParallelGRU(I, H).fwd_iters, ParallelGRU(I, H).bwd_iters) == (2, 1)
    x = torch.randn(40, 3, I)
    (o, n, gx, _, grads), (op, np_, gxp, _, gradsp) = run_both(ref, par, x, None, torch.randn(40, 3, H),
                                                               torch.randn(2, 3, H))
    assert maxdiff(o, op) < 1e-10 and maxdiff(n, np_) < 1e-10 and maxdiff(gx, gxp) < 1e-10
    assert all(maxdiff(grads[k], gradsp[k]) < 1e-10 for k in grads)


def test_torch_func_transforms_are_a_clear_error_and_compile_runs_eagerly():
    torch.manual_seed(0)
    ref = torch.nn.GRU(I, H)
    par = ParallelGRU(I, H, **TIGHT)
    par.load_state_dict(ref.state_dict())
    x = torch.randn(6, 2, I)
    with pytest.raises(RuntimeError, match="ParallelGRU does not support torch.func"):
        torch.func.grad(lambda v: par(v)[1].sum())(x)
    compiled = torch.compile(par, backend="eager")
    assert maxdiff(compiled(x)[1], ref(x)[1]) < 1e-10
    with pytest.raises(RuntimeError, match="ParallelGRU cannot be traced or exported.*to_gru"):
        torch.jit.trace(par, x)
    # a training step compiled as a whole (backward inside it): the adjoint runs eagerly too
    x.requires_grad_(True)

    def step(v):
        loss = par(v)[1].square().sum()
        loss.backward()
        return loss.detach()

    torch.compile(step, backend="eager")(x)
    gx = x.grad.clone()
    x.grad = None
    ref(x)[1].square().sum().backward()
    assert maxdiff(gx, x.grad) < 1e-10
    assert all(maxdiff(p.grad, q.grad) < 1e-10 for p, q in zip(par.parameters(), ref.parameters()))


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.mark.parametrize("device", DEVICES)
def test_on_a_device_bidirectional_and_dropout_equal_nn_gru_and_the_masked_stack(device):
    """On the device (float64; benchmarks/gpu.py runs the CUDA case): converged, bidirectional, two
    layers, output and every gradient equal nn.GRU's there; with dropout, the masked stack of one-layer
    GRUs, the masks drawn by a generator of that device."""
    torch.manual_seed(18)
    ref = torch.nn.GRU(I, H, num_layers=2, bidirectional=True).to(device)
    par = ParallelGRU(I, H, num_layers=2, bidirectional=True, cf=2, **TIGHT).to(device)
    par.load_state_dict(ref.state_dict())
    x, h0 = torch.randn(19, B, I, device=device), torch.randn(4, B, H, device=device)
    wo, wn = torch.randn(19, B, 2 * H, device=device), torch.randn(4, B, H, device=device)
    (o_r, n_r, gx_r, gh_r, gw_r), (o, n, gx, gh, gw) = run_both(ref, par, x, h0, wo, wn)
    assert o.device.type == device and maxdiff(o, o_r) < TOL and maxdiff(n, n_r) < TOL
    assert maxdiff(gx, gx_r) < TOL and maxdiff(gh, gh_r) < TOL
    for k in gw_r:
        assert maxdiff(gw[k], gw_r[k]) < TOL, k
    drop = ParallelGRU(I, H, num_layers=3, dropout=0.3, **TIGHT).to(device)
    x = torch.randn(13, B, I, device=device)
    out, _ = drop(x)
    masks = drop.dropout_masks(drop.last_dropout_seed, out)
    assert all(m.device.type == device for m in masks)
    inp = x
    for l in range(3):
        g = torch.nn.GRU(I if l == 0 else H, H).to(device)
        g.load_state_dict({k.replace(f"_l{l}", "_l0"): v for k, v in drop.state_dict().items() if k.endswith(f"_l{l}")})
        inp = g(inp)[0] * masks[l] if l < 2 else g(inp)[0]
    assert maxdiff(out, inp) < TOL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cell", ["GRU", "LSTM"])
def test_on_a_device_a_packed_pass_equals_torchs(cell, device):
    """On the device (float64; benchmarks/gpu.py runs the CUDA case): a bidirectional two-layer packed pass,
    converged, gives torch's packed output, final states and every gradient there."""
    import propagators.torch as pt

    torch.manual_seed(19)
    kw = dict(num_layers=2, bidirectional=True)
    ref = getattr(torch.nn, cell)(I, H, **kw).to(device)
    par = getattr(pt, f"Parallel{cell}")(I, H, cf=2, **kw, **TIGHT).to(device)
    par.load_state_dict(ref.state_dict())
    seqs = [torch.randn(n, I, device=device) for n in (11, 4, 1, 8)]
    w = torch.randn(sum(len(q) for q in seqs), 2 * H, device=device)
    got = []
    for m in (ref, par):
        ss = [q.clone().requires_grad_(True) for q in seqs]
        o, n = m(torch.nn.utils.rnn.pack_sequence(ss, enforce_sorted=False))
        finals = list(n) if cell == "LSTM" else [n]
        ((o.data * w).sum() + sum(v.square().sum() for v in finals)).backward()
        got.append((o.data, finals, [q.grad for q in ss], [p.grad for p in m.parameters()]))
    (o_r, n_r, gx_r, gw_r), (o, n, gx, gw) = got
    assert o.device.type == device and maxdiff(o, o_r) < TOL
    for a, b in zip(n + gx + gw, n_r + gx_r + gw_r):
        assert maxdiff(a, b) < TOL


@pytest.mark.parametrize("cls", ["GRU", "LSTM"])
def test_a_non_finite_loss_gives_non_finite_gradients_as_torch_and_the_scaler_skips_it(cls):
    """A NaN loss, or an overflowing scaled one (torch.amp.GradScaler's first steps), gives NaN
    gradients as torch's module gives non-finite ones: the scaler skips the step and lowers its scale
    alike for both, and the next steps train alike."""
    from propagators.torch import ParallelLSTM

    torch.manual_seed(23)
    ref = getattr(torch.nn, cls)(I, H, num_layers=2).float()
    par = {"GRU": ParallelGRU, "LSTM": ParallelLSTM}[cls](I, H, num_layers=2, cf=2, fwd_iters=60, bwd_iters=60,
                                                          fwd_tol=1e-6, bwd_tol=1e-6, tol_type="rel").float()
    par.load_state_dict(ref.state_dict())
    x = torch.randn(9, B, I, dtype=torch.float32)
    xp = x.clone().requires_grad_(True)
    (par(xp)[0].sum() * float("nan")).backward()
    assert not torch.isfinite(xp.grad).any() and not any(torch.isfinite(p.grad).any() for p in par.parameters())
    runs = []
    for model in (ref, par):
        model.zero_grad()
        opt = torch.optim.SGD(model.parameters(), lr=1e-7)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127, backoff_factor=2.0 ** -120)
        scales = []
        for _ in range(3):
            opt.zero_grad()
            scaler.scale(1e6 * model(x)[0].square().sum()).backward()  # (2**127 x 1e6 overflows float32)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        runs.append((scales, [p.detach().clone() for p in model.parameters()]))
    (s_ref, p_ref), (s_par, p_par) = runs
    assert s_ref == s_par == [2.0 ** 7] * 3
    assert all(maxdiff(a, b) < 1e-5 for a, b in zip(p_ref, p_par))


@pytest.mark.parametrize("cls", ["GRU", "LSTM"])
def test_shapes_on_the_meta_device_bad_weights_and_bad_arguments(cls):
    """As torch's modules: shape inference on the meta device, torch's TypeError for a bias or
    batch_first that is not a bool; a replaced weight of another shape or a deleted one is named before
    any solve; a bad tolerance is an error when the module is built."""
    from propagators.torch import ParallelLSTM

    make = {"GRU": ParallelGRU, "LSTM": ParallelLSTM}[cls]
    x = torch.empty(7, B, I, device="meta")
    got, want = make(I, H, num_layers=2, bidirectional=True).to("meta")(x), \
        getattr(torch.nn, cls)(I, H, num_layers=2, bidirectional=True).to("meta")(x)
    assert got[0].shape == want[0].shape and got[0].is_meta
    assert [t.shape for t in torch.utils._pytree.tree_leaves(got[1])] == \
        [t.shape for t in torch.utils._pytree.tree_leaves(want[1])]
    for flag in ("bias", "batch_first"):
        with pytest.raises(TypeError, match=f"{flag} should be of type bool"):
            make(I, H, **{flag: 1})
    for kw in ({"fwd_tol": -1.0}, {"bwd_tol": float("nan")}, {"fwd_tol": "1e-8"}, {"bwd_tol": True}):
        with pytest.raises(ValueError, match=f"`{next(iter(kw))}` must be a number >= 0"):
            make(I, H, **kw)
    m = make(I, H)
    m.bias_hh_l0 = torch.nn.Parameter(torch.zeros(1, m._gates * H))
    with pytest.raises(ValueError, match=r"bias_hh_l0 must be a tensor of shape \(\d+,\)"):
        m(torch.randn(5, B, I))
    m = make(I, H)
    del m.weight_ih_l0
    with pytest.raises(ValueError, match="weight_ih_l0 must be a tensor of shape"):
        m(torch.randn(5, B, I))


@pytest.mark.parametrize("cls", ["GRU", "LSTM"])
def test_under_autocast_a_pass_computes_in_the_autocast_dtype(cls):
    """Under torch.autocast (bfloat16 on the CPU) a pass computes in the autocast dtype, as torch's
    recurrent modules on CUDA: the outputs are the same bits as the module converted to bfloat16 (its
    weights rounded alike), and the gradients reach the float32 weights and input as those of that
    module, converted; float64 parameters are not cast (autocast leaves float64 alone)."""
    from propagators.torch import ParallelLSTM

    make = {"GRU": ParallelGRU, "LSTM": ParallelLSTM}[cls]
    torch.manual_seed(31)
    par = make(I, H, num_layers=2, bidirectional=True, cf=2, fwd_iters=4, bwd_iters=4).float()
    low = make(I, H, num_layers=2, bidirectional=True, cf=2, fwd_iters=4, bwd_iters=4).bfloat16()
    low.load_state_dict({k: v.bfloat16() for k, v in par.state_dict().items()})
    x = torch.randn(11, B, I, dtype=torch.float32)
    h0 = torch.randn(4, B, H, dtype=torch.float32)
    hx = h0 if cls == "GRU" else (h0, h0.flip(0))
    xp, xl = x.clone().requires_grad_(True), x.bfloat16().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, last = par(xp, hx)
    ref, ref_last = low(xl, h0.bfloat16() if cls == "GRU" else (h0.bfloat16(), h0.flip(0).bfloat16()))
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    for a, b in zip(torch.utils._pytree.tree_leaves(last), torch.utils._pytree.tree_leaves(ref_last)):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    out.float().square().sum().backward()
    ref.float().square().sum().backward()
    assert xp.grad.dtype == torch.float32 and torch.equal(xp.grad, xl.grad.float())
    for p, q in zip(par.parameters(), low.parameters()):
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, q.grad.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert par.double()(x.double())[0].dtype == torch.float64


@pytest.mark.parametrize("cls", ["GRU", "LSTM"])
def test_a_nan_in_the_input_or_the_initial_state_is_named(cls):
    """NaN or Inf in the input or the initial state: a ValueError naming it (not a solver divergence),
    in training and in eval mode, as LayerParallel's input check."""
    from propagators.torch import ParallelLSTM

    m = {"GRU": ParallelGRU, "LSTM": ParallelLSTM}[cls](I, H)
    x = torch.randn(5, B, I)
    bad = x.clone()
    bad[2, 1, 0] = float("nan")
    h0 = torch.zeros(1, B, H)
    h0[0, 0, 1] = float("inf")
    for mode in (m.train, m.eval):
        mode()
        with pytest.raises(ValueError, match="got an input that contains NaN or Inf"):
            m(bad)
        with pytest.raises(ValueError, match="got an initial .*contains NaN or Inf"):
            m(x, h0 if cls == "GRU" else (h0, torch.zeros(1, B, H)))
    big = x.float()
    big[1, 0, 2] = 1e6  # finite in float32, Inf after autocast's cast to float16: the message says so
    with torch.autocast("cpu", dtype=torch.float16):
        with pytest.raises(ValueError, match=r"contains NaN or Inf \(after the cast to torch.float16 under"):
            m.float()(big)


@pytest.mark.parametrize("cls", ["GRU", "LSTM"])
def test_review_of_the_recurrent_modules(cls):
    """A NaN weight raised a DivergenceError advising smaller steps (torch's module returns NaN: now a
    ValueError naming the weight); to_gru() / to_lstm() of a parametrized weight (weight_norm) failed in
    load_state_dict; torch.jit.script failed in its compiler ("Only a single generator"), and
    ParallelGRU(proj_size=2) named a private class."""
    from torch.nn.utils.parametrizations import weight_norm

    from propagators.torch import ParallelLSTM

    make = {"GRU": ParallelGRU, "LSTM": ParallelLSTM}[cls]
    torch.manual_seed(3)
    par = make(I, H, num_layers=2, cf=2, fwd_iters=60, bwd_iters=60, fwd_tol=1e-13, bwd_tol=1e-13).double()
    x = torch.randn(9, B, I, dtype=torch.float64)
    weight_norm(par, "weight_hh_l1")
    serial = getattr(par, f"to_{cls.lower()}")()
    assert type(serial) is getattr(torch.nn, cls) and maxdiff(par(x)[0], serial(x)[0]) < TOL
    assert torch.equal(serial.weight_hh_l1, par.weight_hh_l1.detach())
    with pytest.raises(RuntimeError, match=f"{make.__name__} cannot be traced or exported.*to_{cls.lower()}"):
        torch.jit.script(torch.nn.Sequential(par))
    with torch.no_grad():
        par.weight_ih_l0[1, 2] = float("nan")
    for mode in (par.train, par.eval):
        mode()
        with pytest.raises(ValueError, match=f"{make.__name__}.weight_ih_l0 contains NaN or Inf"):
            par(x)
    with pytest.raises(ValueError, match="proj_size argument is only supported for LSTM, not GRU"):
        ParallelGRU(I, H, proj_size=2)
    assert ParallelGRU(I, H, proj_size=0).hidden_size == H
    # the positional order is torch's (proj_size before device and dtype): the 8th argument was `device` and a
    # dtype in 10th place was taken for proj_size
    args = (I, H, 1, True, False, 0.0, False, 0, "cpu", torch.float64)
    for made in (make(*args), getattr(torch.nn, cls)(*args)):
        assert made.weight_hh_l0.dtype == torch.float64 and made.proj_size == 0
    with pytest.raises(TypeError, match=rf"{make.__name__}\(\) got an unexpected keyword argument 'foo'; .* takes cf,"):
        make(I, H, foo=1)  # (Python's own message named the private class _ParallelRNN)
