"""BatchNorm and dropout in LayerParallel layers on several ranks (run under mpiexec).

Usage: mpiexec -n P python norm_dropout.py
Checks on every rank, against the serial network built from the same weights
(float64, converged solves, 1e-9 relative):

* three training steps with SGD of layers Linear -> BatchNorm1d -> tanh -> Dropout
  and Conv2d -> BatchNorm2d -> tanh -> Dropout2d: output, input gradient, the
  gradient of every owned parameter, the running statistics of every owned
  layer, and the random generator's state after the forward pass;
* eval mode afterwards (running statistics) equals the serial network;
* layers set to train / eval one by one on their owner rank only: converged, the
  serial network; after one cycle each way, the one-process module; also with a
  parameterless module shared by all layers; the usual loop (lp.train(), then the
  same layers in eval) opens no extra session after its first step;
* ranks whose random states differ raise a clear error on every rank, and the
  module works again once they agree.

Prints "rank r OK" on success and exits 1 with a message otherwise.
"""
import copy

import torch
from mpi4py import MPI
from torch import nn

from checks import TIGHT, check, fail, rank, size, value_error_everywhere, world
from propagators.torch import LayerParallel, ODENet

torch.set_default_dtype(torch.float64)




NETWORKS = {
    "dense": (lambda: nn.Sequential(nn.Linear(5, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Dropout(0.3)), 12, (6, 5)),
    "conv": (lambda: nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.BatchNorm2d(2), nn.Tanh(), nn.Dropout2d(0.25)),
             9, (3, 2, 4, 4)),
}


def compare_step(what, lp, ref, x, seed):
    """Forward (masks drawn after ``torch.manual_seed(seed)``) and backward of ``lp`` and ``ref`` from
    ``x``: output, input gradient, generator state after forward, and the gradients and buffers of
    every layer ``lp`` owns agree."""
    outs = []
    for model in (lp, ref):
        xg = x.clone().requires_grad_(True)
        torch.manual_seed(seed)
        y = model(xg)
        rng = torch.random.get_rng_state()
        (y.pow(2).sum() + y.sum()).backward()
        outs.append((y.detach(), xg.grad, rng))
    check(f"{what} output", outs[0][0], outs[1][0])
    check(f"{what} input gradient", outs[0][1], outs[1][1])
    if not torch.equal(outs[0][2], outs[1][2]):
        fail(f"{what}: the generator state after forward differs from the reference's")
    for j in lp.owned_layers:
        for (pn, p), q in zip(lp.layers[j].named_parameters(), ref.layers[j].parameters()):
            check(f"{what} layer {j} {pn} gradient", p.grad, q.grad)
        for (bn, b), c in zip(lp.layers[j].named_buffers(), ref.layers[j].buffers()):
            check(f"{what} layer {j} {bn}", b.double(), c.double())


def run(name):
    make, n, shape = NETWORKS[name]
    torch.manual_seed(3)
    layers = [make() for _ in range(n)]
    serial = ODENet(copy.deepcopy(layers), T=1.0)
    lp = LayerParallel(layers, T=1.0, cf=2, max_levels=3, comm=world, **TIGHT)
    opt, opt_s = torch.optim.SGD(lp.parameters(), lr=0.05), torch.optim.SGD(serial.parameters(), lr=0.05)
    for step in range(3):
        torch.manual_seed(50 + step)  # the same input and the same masks on every rank
        compare_step(f"{name} step {step}", lp, serial, torch.randn(*shape), 500 + step)
        opt.step()
        opt_s.step()
        opt.zero_grad()
        opt_s.zero_grad()
    lp.eval()
    serial.eval()
    x = torch.randn(*shape)
    x = torch.as_tensor(world.bcast(x.numpy(), root=0))
    check(f"{name} eval output", lp(x), serial(x))
    lp.train()
    return lp, shape


def per_layer_modes():
    """Layers put in train or eval mode one by one, on their owner only (``lp.layers[j].eval()``): the
    halo copies other ranks hold follow their owner's modes. Converged: serial's output, gradients
    and running statistics; after one cycle each way: the one-process module's."""
    make, n, shape = NETWORKS["dense"]
    torch.manual_seed(4)
    layers = [make() for _ in range(n)]
    serial = ODENet(copy.deepcopy(layers), T=1.0)
    kw = dict(T=1.0, cf=2, max_levels=3)
    nets = {"converged": (LayerParallel(copy.deepcopy(layers), comm=world, **kw, **TIGHT), serial),
            "one cycle": (LayerParallel(copy.deepcopy(layers), comm=world, **kw, fwd_iters=1, bwd_iters=1),
                          LayerParallel(copy.deepcopy(layers), comm=MPI.COMM_SELF, **kw, fwd_iters=1, bwd_iters=1))}
    for step, evaluated in enumerate([lambda j: j < n // 2, lambda j: j % 2 == 1, lambda j: False]):
        for label, (lp, ref) in nets.items():
            lp.train()
            ref.train()
            for j, m in lp.layers.items():
                m.train(not evaluated(j))
            for j in range(n):
                ref.layers[j].train(not evaluated(j))
            stale = sum(any(s.training != (not evaluated(j)) for s in m.modules()) for j, m in lp._halo.items())
            if step < 2 and world.allreduce(stale) == 0:
                fail(f"per-layer modes, step {step}: no halo copy differs from its owner; the check checks nothing")
            torch.manual_seed(70 + step)
            compare_step(f"per-layer modes ({label}), step {step}", lp, ref, torch.randn(*shape), 700 + step)
            lp.zero_grad()
            ref.zero_grad()


def modes_with_a_shared_activation():
    """Layers sharing one parameterless module (legal: only parameters may not be shared), first
    layers put in eval on their owners: the shared module keeps its flags on every rank (setting
    it in a halo copy would change this rank's own layers: the ranks would flip each other's
    flags for ever), the pass ends and equals serial."""
    torch.manual_seed(6)
    act = nn.Tanh()
    layers = [nn.Sequential(nn.Linear(5, 5), act, nn.Dropout(0.2)) for _ in range(12)]
    serial = ODENet(copy.deepcopy(layers), T=1.0)
    lp = LayerParallel(layers, T=1.0, cf=2, max_levels=3, comm=world, **TIGHT)
    for j in range(12):
        serial.layers[j].train(j >= 6)
        if j in lp.layers:
            lp.layers[j].train(j >= 6)
    compare_step("shared activation, per-layer modes", lp, serial, torch.randn(6, 5), 60)


def steady_training_loop_costs_no_handshake():
    """The usual loop, lp.train() and then the same layers put in eval at every step: after the
    first step (one more handshake, the halo copies take their owners' flags) a step opens as
    many sessions as a step without per-layer modes (a forward and a backward pass: 2)."""
    make, n, shape = NETWORKS["dense"]
    torch.manual_seed(8)
    lp = LayerParallel([make() for _ in range(n)], T=1.0, cf=2, max_levels=3, comm=world)
    opened, open_ = [], lp._comm.open

    def counted(*args, **kwargs):
        opened.append(1)
        return open_(*args, **kwargs)

    lp._comm.open = counted
    try:
        for step in range(4):
            lp.train()
            for j, m in lp.layers.items():
                m.train(j >= n // 2)
            opened.clear()
            torch.manual_seed(80 + step)
            lp(torch.randn(*shape)).square().sum().backward()
            if len(opened) != (3 if step == 0 else 2):
                fail(f"steady training loop, step {step}: {len(opened)} sessions opened")
    finally:
        del lp._comm.open


lp, shape = run("dense")
run("conv")
per_layer_modes()
modes_with_a_shared_activation()
steady_training_loop_costs_no_handshake()

# different random states: every rank raises the same clear error, then the module works again
torch.manual_seed(9)
if rank == size - 1:
    torch.rand(1)
try:
    lp(torch.ones(*shape))
    fail("different random states were not detected")
except ValueError as exc:
    if "different torch random states" not in str(exc):
        fail(f"unexpected error: {exc}")
torch.manual_seed(9)
lp(torch.ones(*shape))


def layouts_on_ranks():
    """Dropout masks follow the memory layout of their input: the same values in another layout on one rank
    (channels-last there, contiguous elsewhere) mixed the ranks' masks, equal to no serial network; now every
    rank raises ValueError naming the layouts. Without dropout the layouts may differ (the values are the same),
    and with the same layout on every rank the pass equals the serial network in that layout."""
    torch.manual_seed(12)
    layers = [nn.Sequential(nn.Dropout(0.3), nn.Conv2d(3, 3, 3, padding=1), nn.Tanh()) for _ in range(8)]
    lp = LayerParallel(copy.deepcopy(layers), T=1.0, cf=2, max_levels=3, comm=world, **TIGHT)
    x0 = torch.randn(2, 3, 6, 5, generator=torch.Generator().manual_seed(3))
    last = x0.contiguous(memory_format=torch.channels_last) if rank == size - 1 else x0.contiguous()
    torch.manual_seed(11)
    value_error_everywhere(lambda: lp(last), "different layouts", "inputs in other memory layouts, with dropout")
    cl = x0.contiguous(memory_format=torch.channels_last)
    compare_step("channels-last on every rank", lp, ODENet(copy.deepcopy(layers), T=1.0), cl, seed=13)
    convs = [nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.Tanh()) for _ in range(8)]
    plain = LayerParallel(copy.deepcopy(convs), T=1.0, cf=2, max_levels=3, comm=world, **TIGHT)
    check("no dropout, other layouts on one rank", plain(last).detach(), ODENet(convs, T=1.0)(x0).detach())


layouts_on_ranks()
print(f"rank {rank} OK", flush=True)
