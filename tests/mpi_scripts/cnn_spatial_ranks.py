"""Spatial coarsening of a conv ODE-net on several ranks against serial autograd (run under mpiexec).

Usage: mpiexec -n P python cnn_spatial_ranks.py
Checks (every rank), for the coarsest level coarsened and for every coarse level
coarsened: converged forward output, input gradient and the gradients of the
owned layers equal the serial network's (relative 1e-9), over three optimizer
steps; the coarse levels stepped coarse maps on some rank; the adjoint's
residual history is the same on every rank. Prints "rank r OK" on success and
exits 1 with a message otherwise.
"""
import copy

import torch
from torch import nn

from checks import fail, rank, world
from propagators.torch import LayerParallel, ODENet, SpatialCoarsening
from propagators.torch import coarsening

torch.set_default_dtype(torch.float64)
TIGHT = dict(fwd_iters=60, bwd_iters=60, fwd_tol=1e-13, bwd_tol=1e-13)



def check(name, a, b, tol=1e-9):
    err = float((a - b).abs().max() / b.abs().max())
    if not err < tol:
        fail(f"{name}: relative difference {err:.3e} >= {tol:.0e}")


def make(n_layers, channels, seed):
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.Tanh()) for _ in range(n_layers)]


def loss_fn(y):
    return (y**2).sum() + y.sum()


stepped = set()
_batch, _one = coarsening.CoarsePropagator.step_batch, coarsening.CoarsePropagator.step


def recording_batch(self, U, t0, t1):
    stepped.add((self.level, tuple(U.shape[1:])))
    return _batch(self, U, t0, t1)


def recording_one(self, u, t0, t1):
    stepped.add((self.level, tuple(u.shape)))
    return _one(self, u, t0, t1)


coarsening.CoarsePropagator.step_batch = recording_batch
coarsening.CoarsePropagator.step = recording_one


def compare(name, spatial, **opts):
    layers = make(16, 3, seed=11)
    lp = LayerParallel(copy.deepcopy(layers), T=1.0, comm=world, spatial=spatial, **opts, **TIGHT)
    net = ODENet(copy.deepcopy(layers), T=1.0)
    opt, opt_ref = torch.optim.SGD(lp.parameters(), lr=0.05), torch.optim.SGD(net.parameters(), lr=0.05)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    for step in range(3):
        xp, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        y, ys = lp(xp), net(xs)
        opt.zero_grad()
        opt_ref.zero_grad()
        loss_fn(y).backward()
        loss_fn(ys).backward()
        check(f"{name}: forward (step {step})", y.detach(), ys.detach())
        check(f"{name}: input gradient (step {step})", xp.grad, xs.grad)
        for j in lp.owned_layers:
            for p, q in zip(lp.layers[j].parameters(), net.layers[j].parameters()):
                check(f"{name}: gradient of layer {j} (step {step})", p.grad, q.grad)
        hist = world.allgather(lp.backward_residuals)
        if any(h != hist[0] for h in hist):
            fail(f"{name}: adjoint residual histories differ between ranks")
        opt.step()
        opt_ref.step()
    depths = spatial.depths(len(lp.hierarchy), (8, 8))
    want = {(level, (2, 3, 8 >> k, 8 >> k)) for level, k in enumerate(depths) if k > 0}
    got = set().union(*world.allgather(stepped))
    if not want <= got or any(s not in want for s in got):
        fail(f"{name}: coarse levels stepped {sorted(got)}, expected {sorted(want)}")
    stepped.clear()


compare("coarsest", SpatialCoarsening(), cf=2, max_levels=4)
compare("every coarse level", SpatialCoarsening(coarsen_from=1), cf=2, max_levels=3, relax="FCF")
print(f"rank {rank} OK", flush=True)
