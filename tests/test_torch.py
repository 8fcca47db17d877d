"""LayerParallel and the torch propagators: MGRIT forward / adjoint against serial autograd."""
from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import mgrit  # noqa: E402
from propagators.torch import (  # noqa: E402
    AdjointPropagator,
    LayerParallel,
    ODEPropagator,
    dt_aware,
    heun,
)



pytestmark = pytest.mark.usefixtures("float64")


def dense(width, n, seed=0):
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n)]


def grads_of(model, x, loss_fn):
    model.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    loss_fn(model(x)).backward()
    return x.grad.clone(), [p.grad.clone() for p in model.parameters()]


def serial_grads(lp, x, loss_fn):
    lp.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    y = lp.serial(x)
    loss_fn(y).backward()
    return y.detach(), x.grad.clone(), [p.grad.clone() for p in lp.parameters()]


def max_diff(a, b):
    return max(float((p - q).detach().abs().max()) for p, q in zip(a, b))


def assert_matches_serial(lp, x, tol_y=1e-12, tol_g=1e-10):
    """Output, input gradient and parameter gradients of ``lp`` equal serial autograd."""
    y_s, gx_s, gp_s = serial_grads(lp, x, loss_fn)
    gx, gp = grads_of(lp, x, loss_fn)
    assert float((lp(x).detach() - y_s).detach().abs().max()) < tol_y
    assert float((gx - gx_s).detach().abs().max()) < tol_g
    assert max_diff(gp, gp_s) < tol_g


def loss_fn(y):
    return (y**2).sum() + y.sum()


TIGHT = dict(fwd_iters=60, bwd_iters=60, fwd_tol=1e-14, bwd_tol=1e-14)


@pytest.mark.parametrize("levels,relax,cf", [(2, "F", 2), (3, ("F", "FCF"), 4), (4, "FCF", 2)])
def test_tight_solve_equals_serial_network(levels, relax, cf):
    lp = LayerParallel(dense(6, 16), T=2.0, cf=cf, max_levels=levels, relax=relax, **TIGHT)
    x = torch.randn(5, 6)
    y_mg = lp(x.clone().requires_grad_(True))
    y_s, gx_s, gp_s = serial_grads(lp, x, loss_fn)
    assert float((y_mg.detach() - y_s).detach().abs().max()) < 1e-12
    gx, gp = grads_of(lp, x, loss_fn)
    assert float((gx - gx_s).detach().abs().max()) < 1e-10
    assert max_diff(gp, gp_s) < 1e-10


def test_one_level_is_serial_to_rounding():
    # Not bitwise: BLAS kernels round differently for differently aligned rows of
    # the stacked trajectory (m(x) != m(U[1]) bitwise even when x == U[1]).
    lp = LayerParallel(dense(5, 12), T=1.0, max_levels=1)
    x = torch.randn(3, 5)
    y_s, gx_s, gp_s = serial_grads(lp, x, loss_fn)
    gx, gp = grads_of(lp, x, loss_fn)
    assert float((lp(x).detach() - y_s).detach().abs().max()) < 1e-14
    assert float((gx - gx_s).detach().abs().max()) < 1e-14
    assert max_diff(gp, gp_s) < 1e-14


def test_gradcheck_small_block():
    lp = LayerParallel(dense(3, 8, seed=3), T=1.0, cf=2, max_levels=3, **TIGHT)
    x = torch.randn(2, 3, requires_grad=True)
    assert torch.autograd.gradcheck(lambda inp: lp(inp), (x,), eps=1e-6, atol=1e-8)


def test_gradient_error_decreases_with_iterations_and_is_reported():
    lp = LayerParallel(dense(6, 64, seed=1), T=3.0, cf=4, max_levels=3)
    x = torch.randn(4, 6)
    _, gx_s, gp_s = serial_grads(lp, x, loss_fn)
    errors, reported = [], []
    for it in (1, 2, 4, 8):
        lp.fwd_iters, lp.bwd_iters = it + 1, it
        _, gp = grads_of(lp, x, loss_fn)
        errors.append(max_diff(gp, gp_s))
        reported.append(lp.backward_residual)
    assert all(b < a for a, b in zip(errors, errors[1:])), errors
    assert all(b < a for a, b in zip(reported, reported[1:])), reported
    # the default inexact training setting reports a non-zero error estimate
    lp.fwd_iters, lp.bwd_iters = 2, 1
    grads_of(lp, x, loss_fn)
    assert len(lp.forward_residuals) == 2 and len(lp.backward_residuals) == 1
    assert lp.backward_residual > 0 and lp.forward_residual > 0
    # with one level everything is exact and reported as such
    exact = LayerParallel(dense(6, 64, seed=1), T=3.0, max_levels=1)
    grads_of(exact, x, loss_fn)
    assert exact.forward_residual == 0 and exact.backward_residual == 0


def test_optimizer_step_then_forward_backward_still_matches_serial():
    lp = LayerParallel(dense(4, 16, seed=2), T=1.0, cf=2, max_levels=3, **TIGHT)
    opt = torch.optim.SGD(lp.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(3, 4)
    for _ in range(3):
        opt.zero_grad()
        loss_fn(lp(x)).backward()
        opt.step()
    assert_matches_serial(lp, x)


def test_batched_relaxation_equals_looped():
    layers = dense(5, 24, seed=4)
    lp_b = LayerParallel(copy.deepcopy(layers), T=1.0, cf=4, max_levels=3, fwd_iters=2, bwd_iters=1)
    lp_l = LayerParallel(copy.deepcopy(layers), T=1.0, cf=4, max_levels=3, fwd_iters=2, bwd_iters=1,
                         batched=False)
    x = torch.randn(3, 5)
    gx_b, gp_b = grads_of(lp_b, x, loss_fn)
    gx_l, gp_l = grads_of(lp_l, x, loss_fn)
    assert float((lp_b(x) - lp_l(x)).detach().abs().max()) < 1e-13
    assert float((gx_b - gx_l).detach().abs().max()) < 1e-13
    assert max_diff(gp_b, gp_l) < 1e-13


def test_propagator_batched_step_equals_single_steps():
    layers = dense(4, 10, seed=5)
    prop = ODEPropagator(layers, h=0.1)
    U = torch.randn(6, 2, 4)
    t0 = np.array([0.0, 0.1, 0.2, 0.4, 0.6, 0.8])
    t1 = t0 + np.array([0.1, 0.1, 0.2, 0.2, 0.1, 0.1])
    batch = prop.step_batch(U, t0, t1)
    singles = torch.stack([prop.step(U[k], t0[k], t1[k]) for k in range(6)])
    assert float((batch - singles).detach().abs().max()) < 1e-14
    # a coarse step uses the layer at its start with step 2h
    k = 2
    f = layers[2]
    assert float((batch[k] - (U[k] + 0.2 * f(U[k]))).detach().abs().max()) < 1e-14


def test_adjoint_step_is_transposed_jacobian():
    layers = dense(3, 8, seed=6)
    prop = ODEPropagator(layers, h=0.125)
    U = torch.randn(9, 3)  # forward states at every point
    adj = AdjointPropagator(prop, lambda ia: U[torch.as_tensor(ia)], 8)
    v = torch.randn(3)
    # reverse interval [0.25, 0.5] is the forward step from point 4 to 6 with layer 4
    J = torch.autograd.functional.jacobian(lambda u: u + 0.25 * layers[4](u), U[4])
    assert float((adj.step(v, 0.25, 0.5) - J.T @ v).detach().abs().max()) < 1e-14
    batch = adj.step_batch(v[None].repeat(2, 1), np.array([0.25, 0.0]), np.array([0.5, 0.125]))
    assert float((batch[0] - J.T @ v).detach().abs().max()) < 1e-14


class ConvLayer(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, u):
        return torch.relu(self.conv(u))


def test_convolutional_layers_and_heun_scheme():
    torch.manual_seed(7)
    lp = LayerParallel([ConvLayer(2) for _ in range(8)], T=1.0, cf=2, max_levels=2, relax="FCF", scheme=heun,
                       **TIGHT)
    x = torch.randn(2, 2, 5, 5)
    assert_matches_serial(lp, x)


class DtLayer(nn.Module):
    """A dt-aware layer: the whole step, here an exponential integrator of a linear ODE."""

    def __init__(self, width):
        super().__init__()
        self.a = nn.Parameter(-torch.rand(width))

    def forward(self, u, dt):
        return u * torch.exp(self.a * dt)


def test_dt_aware_module():
    torch.manual_seed(8)
    lp = LayerParallel([DtLayer(4) for _ in range(16)], T=1.0, cf=4, max_levels=2, scheme=dt_aware, **TIGHT)
    x = torch.randn(3, 4)
    assert_matches_serial(lp, x)


def test_nonuniform_layers_fall_back_to_loop():
    torch.manual_seed(9)
    layers = [nn.Sequential(nn.Linear(3, 3), nn.Tanh()) if i % 2 else nn.Sequential(nn.Linear(3, 3), nn.ReLU())
              for i in range(8)]
    lp = LayerParallel(layers, T=1.0, cf=2, max_levels=2, **TIGHT)
    assert len(lp.kernel.classes) == 2  # tanh and relu layers are never batched together
    x = torch.randn(2, 3)
    assert_matches_serial(lp, x)


def test_module_behaviour_dtype_state_dict_and_factory():
    lp = LayerParallel(lambda i: nn.Sequential(nn.Linear(3, 3), nn.Tanh()), n_layers=8, cf=2).float()
    x = torch.randn(2, 3, dtype=torch.float32)
    assert lp(x).dtype == torch.float32
    lp2 = LayerParallel(lambda i: nn.Sequential(nn.Linear(3, 3), nn.Tanh()), n_layers=8, cf=2).float()
    lp2.load_state_dict(lp.state_dict())
    assert torch.equal(lp2(x), lp(x))
    lp.eval()
    assert not lp.layers[0].training
    with torch.no_grad():
        assert lp(x).shape == x.shape
    assert "n_layers=8" in repr(lp)
    # the layers a rank holds, as a mapping by global index (a review: items() without keys() or values())
    held = lp.layers
    assert held.keys() == held.indices == list(range(8)) and held.values() == list(held)
    assert dict(held) == dict(held.items()) and all(held[j] is m for j, m in held.items())


def test_plain_training_loop_learns():
    torch.manual_seed(10)
    lp = LayerParallel(dense(4, 16, seed=10), T=1.0, cf=4, max_levels=2)
    model = nn.Sequential(nn.Linear(2, 4), lp, nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    X = torch.randn(64, 2)
    Y = (X[:, :1] * X[:, 1:]).sign()
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = ((model(X) - Y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_bad_arguments():
    with pytest.raises(ValueError, match="n_layers"):
        LayerParallel(lambda i: nn.Linear(2, 2))
    with pytest.raises(ValueError, match="empty"):
        LayerParallel([])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_streams_and_batched_match_cpu():
    layers = dense(8, 32, seed=11)
    x = torch.randn(4, 8)
    ref = LayerParallel(copy.deepcopy(layers), cf=4, max_levels=3)
    gx_ref, gp_ref = grads_of(ref, x, loss_fn)
    for batched, streams in ((True, 0), (False, 4)):
        lp = LayerParallel(copy.deepcopy(layers), cf=4, max_levels=3, batched=batched, streams=streams).cuda()
        gx, gp = grads_of(lp, x.cuda(), loss_fn)
        assert float((gx.cpu() - gx_ref).detach().abs().max()) < 1e-10
        assert max_diff([g.cpu() for g in gp], gp_ref) < 1e-10


def test_progression_answers_as_its_definition_and_its_cache_stays_bounded(monkeypatch):
    """``_progression`` (which sweeps take views of the parameter stacks) remembers its answers by
    the positions' bytes: the remembered answer is the computed one, for progressions and for
    everything that is not one, and the cache never holds more than its byte limit."""
    from propagators.torch import kernel

    def direct(pos):
        n = len(pos)
        step = int(pos[1] - pos[0]) if n > 1 else 1
        ok = n and step != 0 and all(int(pos[k + 1] - pos[k]) == step for k in range(n - 1))
        return (int(pos[0]), step) if ok else None

    monkeypatch.setattr(kernel, "_PROGRESSIONS", {})
    monkeypatch.setattr(kernel, "_PROGRESSION_BYTES", [0])
    monkeypatch.setattr(kernel, "_PROGRESSION_LIMIT", 4000)
    rng = np.random.default_rng(0)
    cases = [np.array([], dtype=np.int64), np.array([7]), np.array([3, 3, 3]), np.arange(10, 0, -3),
             np.array([1, 2, 4]), np.arange(5, 400, 4), np.arange(5, 400, 4).astype(np.int32)]
    cases += [rng.integers(0, 6, size=rng.integers(1, 9)) for _ in range(300)]
    cases += [np.arange(a, a + 7 * s, s) for a in range(-3, 4) for s in (-2, -1, 1, 2, 5)]
    for _ in range(2):  # the second round answers from the cache
        for pos in cases:
            assert kernel._progression(pos) == direct(pos), pos
            assert kernel._PROGRESSION_BYTES[0] <= 4000
    assert kernel._progression(np.arange(5, 400, 4)) == (5, 4)
