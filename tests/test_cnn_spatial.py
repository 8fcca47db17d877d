"""Spatial coarsening of conv ODE-nets (propagators/torch/coarsening.py, docs/cnn_spatial.md).

The fine level is the network itself, so at convergence the output and every
gradient equal serial autograd whatever the coarse levels do; the coarse levels
must really step coarse feature maps, and for layers that damp the features the
coarse maps cannot represent the residual must fall by a bounded factor per cycle.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
from launch import assert_all_ok, launch, needs_mpiexec

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from propagators.torch import (  # noqa: E402
    FeatureMapTransfer, LayerError, LayerParallel, ODENet, SpatialCoarsening, galerkin_weight, rediscretized_weight,
)
from propagators.torch import coarsening  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TIGHT = dict(fwd_iters=60, bwd_iters=60, fwd_tol=1e-13, bwd_tol=1e-13)
LAPLACE = torch.tensor([[0.0, 1, 0], [1, -4, 1], [0, 1, 0]], dtype=torch.float64)


def conv_layers(n, c, seed=0, **conv):
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Conv2d(c, c, 3, padding=1, **conv), nn.Tanh()).double() for _ in range(n)]


def diffusive_layers(n, c, a, T=1.0, seed=0):
    """``tanh(K u + b)`` with ``K = (a / h)`` x 5-point Laplacian per channel + weak channel mixing:
    a heat-like net that damps fine features (diffusion number ``a`` per layer)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        conv = nn.Conv2d(c, c, 3, padding=1).double()
        with torch.no_grad():
            eye = torch.eye(c, dtype=torch.float64)[:, :, None, None]
            conv.weight.copy_(a * n / T * LAPLACE * eye + 0.1 * torch.randn(c, c, 3, 3, generator=g))
            conv.bias.copy_(0.1 * torch.randn(c, generator=g))
        out.append(nn.Sequential(conv, nn.Tanh()))
    return out


def loss_fn(y):
    return (y**2).sum() + y.sum()


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def compare_with_serial(layers, x, **kw):
    """Max relative difference of output, input gradient and every parameter gradient."""
    lp = LayerParallel(copy.deepcopy(layers), T=1.0, **kw)
    net = ODENet(copy.deepcopy(layers), T=1.0)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = lp(xa), net(xb)
    loss_fn(ya).backward()
    loss_fn(yb).backward()
    errs = [rel(ya.detach(), yb.detach()), rel(xa.grad, xb.grad)]
    errs += [rel(p.grad, q.grad) for p, q in zip(lp.parameters(), net.parameters())]
    return lp, max(errs)


def ratios(residuals):
    r = [v for v in residuals if v is not None]
    return [b / a for a, b in zip(r[:-1], r[1:]) if a > 1e-10]


# --------------------------------------------------------------------------- operators
def test_galerkin_weight_is_restriction_conv_interpolation():
    """For a linear stride-1 'same' convolution with zero padding, conv_c = R conv P exactly
    (R: 2 x 2 mean, P: piecewise constant), for 3 x 3 and 5 x 5 kernels, one and two halvings."""
    g = torch.Generator().manual_seed(0)
    for size in (3, 5):
        W = torch.randn(4, 3, size, size, generator=g, dtype=torch.float64)
        uc = torch.randn(2, 3, 4, 6, generator=g, dtype=torch.float64)
        for depth in (1, 2):
            fine = uc.repeat_interleave(2**depth, -2).repeat_interleave(2**depth, -1)  # P^depth
            ref = F.avg_pool2d(F.conv2d(fine, W, padding=size // 2), 2**depth)  # R^depth conv P^depth
            got = F.conv2d(uc, galerkin_weight(W, depth), padding=size // 2)
            assert torch.allclose(got, ref, rtol=0, atol=1e-13)
    K = torch.randn(2, 2, 3, 3, generator=g, dtype=torch.float64)
    assert torch.allclose(galerkin_weight(K).sum((-2, -1)), K.sum((-2, -1)))  # constants keep their response
    assert torch.equal(galerkin_weight(torch.ones(1, 1, 1, 1)), torch.ones(1, 1, 1, 1))  # 1 x 1 unchanged


def test_rediscretized_weight_acts_on_coarse_polynomials_as_the_fine_kernel():
    """K_c on the grid of spacing 2 gives what K gives on spacing 1 for polynomials of degree <= 2r per axis."""
    g = torch.Generator().manual_seed(5)
    for size in (3, 5):
        r = size // 2
        W = torch.randn(2, 3, size, size, generator=g, dtype=torch.float64)
        C = torch.randn(3, size, size, generator=g, dtype=torch.float64)  # polynomial coefficients per channel

        def poly(y, x):
            Y, X = torch.stack([y**i for i in range(size)]), torch.stack([x**j for j in range(size)])
            return torch.einsum("cij,iy,jx->cyx", C, Y, X)[None]

        n = 24
        y, x = torch.arange(n, dtype=torch.float64), torch.arange(n, dtype=torch.float64)
        fine = F.conv2d(poly(y / n, x / n), W)  # valid positions only: no padding
        coarse = F.conv2d(poly(2 * y[: n // 2] / n, 2 * x[: n // 2] / n), rediscretized_weight(W))
        # coarse output I sits at coarse point I + r, i.e. fine point 2 (I + r); fine output i at point i + r
        idx = 2 * torch.arange(coarse.shape[-1]) + r
        assert torch.allclose(coarse, fine[..., idx[:, None], idx], atol=1e-9 * float(fine.abs().max()))
    lap = torch.tensor([[[[0.0, 1, 0], [1, -4, 1], [0, 1, 0]]]], dtype=torch.float64)
    assert torch.allclose(rediscretized_weight(lap, 2), lap / 16)  # second differences: / 4 per halving


def test_transfers_and_their_transposes():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(3, 2, 4, 8, 6, generator=g, dtype=torch.float64)
    Y = torch.randn(3, 2, 4, 4, 3, generator=g, dtype=torch.float64)
    for kind in ("nearest", "bilinear"):
        fwd, adj = FeatureMapTransfer(kind), FeatureMapTransfer(kind, adjoint=True)
        assert torch.allclose(fwd.restrict(X), F.avg_pool2d(X.flatten(0, 1), 2).reshape(Y.shape), atol=1e-15)
        ref = F.interpolate(Y.flatten(0, 1), scale_factor=2, mode=kind if kind == "nearest" else "bilinear",
                            **({} if kind == "nearest" else {"align_corners": False}))
        assert torch.allclose(fwd.interpolate(Y), ref.reshape(X.shape), atol=1e-14)
        # the adjoint's transfers are the transposes: <R x, y> = <x, R^T y>, <P y, x> = <y, P^T x>
        assert abs(float((fwd.restrict(X) * Y).sum() - (X * adj.interpolate(Y)).sum())) < 1e-12
        assert abs(float((fwd.interpolate(Y) * X).sum() - (Y * adj.restrict(X)).sum())) < 1e-12
    near = FeatureMapTransfer("nearest", times=2)
    Z = torch.randn(2, 3, 2, 2, generator=g, dtype=torch.float64)
    assert near.interpolate(Z).shape == (2, 3, 8, 8)
    assert torch.allclose(near.restrict(near.interpolate(Z)), Z, atol=1e-15)  # R P = I


def test_depths_per_level():
    assert SpatialCoarsening().depths(3, (16, 16)) == [0, 0, 1]  # default: the coarsest level only
    assert SpatialCoarsening(coarsen_from=1).depths(4, (16, 16)) == [0, 1, 2, 2]  # min_size 4
    assert SpatialCoarsening(coarsen_from=1, min_size=2).depths(4, (16, 16)) == [0, 1, 2, 3]
    assert SpatialCoarsening(coarsen_from=1).depths(3, (24, 40)) == [0, 1, 2]
    assert SpatialCoarsening(coarsen_from=1).depths(3, (10, 16)) == [0, 1, 1]  # 5 is odd
    assert SpatialCoarsening(factor=4).depths(3, (32, 32)) == [0, 0, 2]


# --------------------------------------------------------------------------- exactness
SETTINGS = {
    "coarsest": (SpatialCoarsening(), dict(cf=2, max_levels=4)),
    "from1_galerkin_bilinear": (SpatialCoarsening(coarsen_from=1, weights="galerkin"),
                                dict(cf=2, max_levels=4, relax="FCF")),
    "from1_same_nearest": (SpatialCoarsening(coarsen_from=1, weights="same", interpolation="nearest"),
                           dict(cf=4, max_levels=3, relax="FCF")),
    "factor4": (SpatialCoarsening(coarsen_from=2, factor=4, min_size=2), dict(cf=2, max_levels=4)),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_converged_output_and_gradients_equal_serial(name):
    spatial, opts = SETTINGS[name]
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    lp, err = compare_with_serial(conv_layers(16, 3), x, spatial=spatial, **opts, **TIGHT)
    assert err < 1e-9, err
    assert lp.last_forward.converged and lp.last_backward.converged
    depths = spatial.depths(len(lp.hierarchy), (8, 8))
    assert max(depths) > 0  # something was coarsened


@pytest.mark.parametrize("n, opts", [(1, {}), (2, dict(cf=2)), (3, dict(cf=4)), (8, dict(cf=2, max_levels=1))])
def test_one_level_hierarchies_take_spatial_coarsening_and_equal_serial(n, opts):
    """Too few layers for a coarse time level (or max_levels=1): nothing to coarsen, the block is built
    (it used to ask for C-relaxation on "level -1") and steps exactly like the serial network."""
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    lp, err = compare_with_serial(conv_layers(n, 3), x, spatial=SpatialCoarsening(), **opts, **TIGHT)
    assert len(lp.hierarchy) == 1 and err < 1e-12, err


def test_coarse_levels_step_coarse_feature_maps(monkeypatch):
    """Record the state shapes every propagator steps: level l works on maps divided by 2^depth."""
    seen: dict = {}
    for cls in (coarsening.CoarsePropagator, coarsening.CoarseAdjointPropagator):
        for meth in ("step", "step_batch"):
            orig = getattr(cls, meth)

            def rec(self, U, t0, t1, _orig=orig, _cls=cls, _meth=meth):
                prop = self if _cls is coarsening.CoarsePropagator else self.fwd
                shape = tuple(U.shape[1:] if _meth == "step_batch" else U.shape)
                seen.setdefault((_cls.__name__, prop.level), set()).add(shape)
                return _orig(self, U, t0, t1)

            monkeypatch.setattr(cls, meth, rec)
    spatial = SpatialCoarsening(coarsen_from=1, min_size=2)
    lp = LayerParallel(conv_layers(16, 3), cf=2, max_levels=4, relax="FCF", fwd_iters=2, bwd_iters=2,
                       spatial=spatial)
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64, requires_grad=True)
    loss_fn(lp(x)).backward()
    want = {1: (2, 3, 8, 8), 2: (2, 3, 4, 4), 3: (2, 3, 2, 2)}
    for kind in ("CoarsePropagator", "CoarseAdjointPropagator"):
        assert {lvl: shapes for (k, lvl), shapes in seen.items() if k == kind} == \
            {lvl: {s} for lvl, s in want.items()}, seen
    assert lp.last_forward.counts[3] > 0 and lp.last_backward.counts[3] > 0


# --------------------------------------------------------------------------- convergence
def test_diffusive_conv_net_converges_with_bounded_factor():
    """Heat-like layers damp the features the coarse maps miss (docs/theory.md §6 with mu = 0
    for them): coarsening every coarse level still reduces the residual by >= 2 per cycle."""
    x = 0.01 * torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for interpolation, weights in (("bilinear", "rediscretize"), ("nearest", "galerkin")):
        lp = LayerParallel(diffusive_layers(32, 3, a=0.2), cf=4, max_levels=3, relax="FCF",
                           fwd_iters=30, bwd_iters=30, fwd_tol=1e-11, bwd_tol=1e-11,
                           spatial=SpatialCoarsening(coarsen_from=1, interpolation=interpolation, weights=weights))
        xr = x.clone().requires_grad_(True)
        loss_fn(lp(xr)).backward()
        assert lp.last_forward.converged and lp.last_backward.converged
        assert max(ratios(lp.forward_residuals)) < 0.5, lp.forward_residuals
        assert max(ratios(lp.backward_residuals)) < 0.5, lp.backward_residuals


def test_coarsest_level_coarsening_of_generic_layers_delays_by_its_intervals():
    """Default-initialised conv layers hardly damp fine features within a coarse interval, so with the
    coarsest level coarsened those features of the next level's C-points converge by propagation, one
    coarsest interval per C-relaxation; after that, the rate is the one without spatial coarsening."""
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    runs = {}
    for name, spatial in (("none", None), ("coarsest", SpatialCoarsening())):
        lp = LayerParallel(conv_layers(64, 4), cf=4, max_levels=3, fwd_iters=40, bwd_iters=40, fwd_tol=1e-9,
                           bwd_tol=1e-9, tol_type="rel", spatial=spatial)
        xr = x.clone().requires_grad_(True)
        loss_fn(lp(xr)).backward()
        assert lp.last_forward.converged and lp.last_backward.converged
        runs[name] = lp
    n_c = runs["none"].hierarchy[-1].n  # coarsest intervals: 4
    for res in ("last_forward", "last_backward"):
        none, coarse = getattr(runs["none"], res), getattr(runs["coarsest"], res)
        assert coarse.iterations <= none.iterations + n_c
        assert max(ratios(coarse.residuals)[n_c:]) < 0.2, coarse.residuals


# --------------------------------------------------------------------------- checks and errors
def test_eval_mode_is_exact_and_skips_the_coarse_levels():
    lp = LayerParallel(conv_layers(8, 2), cf=2, max_levels=3, spatial=SpatialCoarsening()).eval()
    x = torch.randn(1, 2, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        assert rel(lp(x), lp.serial(x)) < 1e-14
    assert lp.last_forward.hierarchy is not None and len(lp.last_forward.hierarchy) == 1


def test_f_relaxation_above_a_coarsened_level_is_rejected():
    with pytest.raises(ValueError, match="relax='FCF'"):
        LayerParallel(conv_layers(8, 2), cf=2, max_levels=3, spatial=SpatialCoarsening(coarsen_from=1))
    with pytest.raises(ValueError, match="C-relaxation on level 0"):
        LayerParallel(conv_layers(8, 2), cf=2, max_levels=2, spatial=SpatialCoarsening())
    with pytest.raises(TypeError, match="SpatialCoarsening"):
        LayerParallel(conv_layers(8, 2), spatial=2)
    for bad in (dict(factor=3), dict(coarsen_from=0), dict(interpolation="cubic"), dict(weights="learned"),
                dict(min_size=0)):
        with pytest.raises(ValueError):
            SpatialCoarsening(**bad)
    # a review: a coarsen_from beyond the hierarchy coarsened nothing, silently; it warns (not an error: a
    # shallow stage may share the settings of deeper ones)
    with pytest.warns(UserWarning, match=r"coarsen_from=7\) on a hierarchy of 3 level.*no level is coarsened"):
        LayerParallel(conv_layers(8, 2), cf=2, max_levels=3, relax="FCF", spatial=SpatialCoarsening(coarsen_from=7))
    with pytest.warns(UserWarning, match="one level has no coarse level"):
        LayerParallel(conv_layers(8, 2), max_levels=1, spatial=SpatialCoarsening(coarsen_from=1))


def test_layers_that_cannot_be_coarsened_say_what_to_do():
    x = torch.randn(2, 2, 8, 8, dtype=torch.float64)
    strided = [nn.Sequential(nn.Conv2d(2, 2, 3, padding=2, dilation=2), nn.Tanh()).double() for _ in range(8)]
    lp = LayerParallel(strided, cf=2, max_levels=3, spatial=SpatialCoarsening())
    with pytest.raises(ValueError, match="weights='same'"):
        lp(x)
    lp = LayerParallel(copy.deepcopy(strided), cf=2, max_levels=3, spatial=SpatialCoarsening(weights="same"),
                       **TIGHT)
    assert rel(lp(x).detach(), lp.serial(x).detach()) < 1e-9  # the fine weights work on any map
    norm = [nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.LayerNorm([2, 8, 8])).double() for _ in range(8)]
    with pytest.raises(LayerError, match="coarse feature maps"):
        LayerParallel(norm, cf=2, max_levels=3, spatial=SpatialCoarsening())(x)
    # a review: a layer that needs maps of some size (reflect padding of a 5-wide kernel) is told about min_size
    reflect = [nn.Sequential(nn.Conv2d(2, 2, 5, padding=2, padding_mode="reflect"), nn.Tanh()).double()
               for _ in range(8)]
    with pytest.raises(LayerError, match=r"SpatialCoarsening\(min_size=\.\.\.\) \(the smallest side here is 2\)"):
        LayerParallel(reflect, cf=2, max_levels=3, relax="FCF", spatial=SpatialCoarsening(coarsen_from=1, min_size=2))(x)
    with pytest.raises(ValueError, match=r"\(\.\.\., C, H, W\)"):
        LayerParallel([nn.Linear(4, 4).double() for _ in range(8)], cf=2, max_levels=3,
                      spatial=SpatialCoarsening())(torch.randn(3, 4, dtype=torch.float64))


@pytest.mark.parametrize("kind", ["batchnorm", "dropout"])
def test_training_mode_batchnorm_and_dropout(kind):
    """Coarse copies drop nothing, normalise with the coarse maps' batch statistics and update no
    running statistics; the fine level (the network) is unchanged: serial output, gradients, buffers."""
    torch.manual_seed(0)
    mid = nn.BatchNorm2d(3) if kind == "batchnorm" else nn.Dropout(0.2)
    layers = [nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), copy.deepcopy(mid), nn.Tanh()).double()
              for _ in range(16)]
    lp = LayerParallel(copy.deepcopy(layers), cf=2, max_levels=3, relax="FCF",
                       spatial=SpatialCoarsening(coarsen_from=1), **TIGHT)
    net = ODENet(copy.deepcopy(layers))
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    torch.manual_seed(5)
    y = lp(x)
    loss_fn(y).backward()
    torch.manual_seed(5)
    ys = net(x)
    loss_fn(ys).backward()
    assert rel(y.detach(), ys.detach()) < 1e-9
    grads = [torch.cat([p.grad.flatten() for p in m.parameters()]) for m in (lp, net)]
    assert rel(*grads) < 1e-9  # (conv biases before BatchNorm get zero gradients: compare all at once)
    for b, c in zip(lp.buffers(), net.buffers()):
        assert torch.allclose(b.double(), c.double(), rtol=1e-9, atol=1e-12)


def test_coarse_copies_follow_the_weights_and_need_no_gradients():
    """After an optimizer step the coarse levels use the new weights (converged gradients stay exact
    after training steps) and the copies are not parameters of the module."""
    layers = conv_layers(16, 2, seed=5)
    spatial = SpatialCoarsening(coarsen_from=1)
    lp = LayerParallel(copy.deepcopy(layers), cf=2, max_levels=3, relax="FCF", spatial=spatial, **TIGHT)
    net = ODENet(copy.deepcopy(layers))
    opt, opt_ref = torch.optim.SGD(lp.parameters(), lr=0.1), torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(2, 2, 8, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    n_params = len(list(lp.parameters()))
    for _ in range(3):
        for model, o in ((lp, opt), (net, opt_ref)):
            o.zero_grad()
            loss_fn(model(x)).backward()
            o.step()
    for p, q in zip(lp.parameters(), net.parameters()):
        assert rel(p.detach(), q.detach()) < 1e-9
    lp(x)  # the copies take the weights of each forward pass
    assert len(list(lp.parameters())) == n_params
    kernels = lp._coarse_layers._kernels
    src, dst = next(iter(kernels[1][2].values()))
    assert torch.allclose(dst[0].weight, rediscretized_weight(src[0].weight.detach(), 1))
    assert not any(p.requires_grad for p in dst.parameters())


# --------------------------------------------------------------------------- ranks, benchmark
@pytest.mark.mpi
@needs_mpiexec
def test_two_ranks_equal_serial():
    assert_all_ok(2, *launch(2, "cnn_spatial_ranks.py"))


@pytest.mark.parametrize("conv", [lambda: nn.Conv1d(8, 8, 3, padding=1), lambda: nn.ConvTranspose1d(8, 8, 3, padding=1)])
def test_one_dimensional_convolutions_are_refused_with_spatial_coarsening(conv):
    # the last two axes of their (N, C, L) states are the channels and the length: the channels were averaged
    # and the error then said the layers must work on maps of any size
    lp = LayerParallel([nn.Sequential(conv(), nn.Tanh()) for _ in range(8)], cf=2, max_levels=3,
                       spatial=SpatialCoarsening())
    with pytest.raises(ValueError, match=r"layer 0 holds Conv.*1d.*\(N, C, L\).*spatial=None"):
        lp(torch.randn(4, 8, 32))


def test_a_conv1d_inside_a_block_on_feature_maps_is_coarsened_as_before():
    # channel attention (ECA-Net: a Conv1d over the pooled channels) on (N, C, H, W) maps: the first version of
    # the Conv1d check refused it, from the layer's modules rather than the state's shape
    class ChannelAttention(nn.Module):
        def __init__(self, ch=4):
            super().__init__()
            self.conv, self.eca = nn.Conv2d(ch, ch, 3, padding=1), nn.Conv1d(1, 1, 3, padding=1, bias=False)

        def forward(self, u):
            v = torch.tanh(self.conv(u))
            return v * torch.sigmoid(self.eca(v.mean((2, 3)).unsqueeze(1))).squeeze(1)[:, :, None, None]

    torch.manual_seed(0)
    lp = LayerParallel([ChannelAttention() for _ in range(8)], cf=2, max_levels=3, relax="FCF", fwd_iters=30,
                       bwd_iters=30, spatial=SpatialCoarsening(coarsen_from=1)).double()
    x = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    assert float((lp(x) - lp.to_serial()(x)).abs().max()) < 1e-12
