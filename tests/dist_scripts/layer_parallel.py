"""LayerParallel over a torch.distributed gloo group against serial autograd.

Run as ``python _launch.py P layer_parallel.py [grid]`` (or under ``torchrun``). The
checks of ``tests/mpi_scripts/torch_layer_parallel.py``: forward output, input and
parameter gradients equal serial autograd on P ranks (also after optimizer steps);
with ``grid`` (P = 4): a 2 x 2 layer x data grid of process groups
(:func:`mgrit.torch_dist.split_group`) reproduces the full-batch gradients through
``allreduce_gradients(model, data_group)``, also with uneven shards, and ``SerialSwitch``
measures the whole batch. The comparisons
are bitwise (``torch.equal``) against the serial LayerParallel solve with the same
tolerances: the solve is independent of the number of ranks. Prints ``rank r OK``.
"""
import copy
import sys

import torch
import torch.distributed as dist
from torch import nn

import mgrit
from mgrit.comm import as_communicator

TIGHT = dict(fwd_iters=60, bwd_iters=60, fwd_tol=1e-14, bwd_tol=1e-14)


def fail(msg):
    print(f"rank {dist.get_rank()} FAIL: {msg}", flush=True)
    sys.exit(1)


def check(name, a, b, tol=0.0):
    err = float((a - b).abs().max()) if a.numel() else 0.0
    if not err <= tol:
        fail(f"{name}: max difference {err:.3e} > {tol:.0e}")


def make(n_layers, width, seed):
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n_layers)]


def loss_fn(y):
    return (y**2).sum() + y.sum()


def layer_parallel_vs_serial(group, n_layers, cf, levels, relax):
    from propagators.torch import LayerParallel

    layers = make(n_layers, 5, seed=n_layers)
    kw = dict(T=1.5, cf=cf, max_levels=levels, relax=relax, **TIGHT)
    lp = LayerParallel(copy.deepcopy(layers), comm=group, **kw)
    same = LayerParallel(copy.deepcopy(layers), **kw)  # the same MGRIT on one process: bitwise equal
    ref = LayerParallel(copy.deepcopy(layers), T=1.5, max_levels=1)  # serial autograd
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.5) for m in (lp, same, ref)]
    torch.manual_seed(123)
    x = torch.randn(4, 5)
    for step in range(3):
        xs, x1, xp = (x.clone().requires_grad_(True) for _ in range(3))
        y_s = ref.serial(xs)
        y_1 = same(x1)
        y = lp(xp)
        for o in opts:
            o.zero_grad()
        loss_fn(y_s).backward()
        loss_fn(y_1).backward()
        loss_fn(y).backward()
        check(f"forward vs serial autograd (step {step})", y.detach(), y_s.detach(), 1e-12)
        check(f"input gradient vs serial autograd (step {step})", xp.grad, xs.grad, 1e-10)
        check(f"forward vs one process (step {step})", y.detach(), y_1.detach())
        check(f"input gradient vs one process (step {step})", xp.grad, x1.grad)
        for j in range(n_layers):
            if j not in lp.owned_layers:
                continue
            for p, q, s in zip(lp.layers[j].parameters(), ref.layers[j].parameters(), same.layers[j].parameters()):
                if p.grad is None:
                    fail(f"owned layer {j} has no gradient")
                check(f"gradient of layer {j} vs serial autograd (step {step})", p.grad, q.grad, 1e-10)
                check(f"gradient of layer {j} vs one process (step {step})", p.grad, s.grad)
        for o in opts:
            o.step()
    owned = as_communicator(group).gather(list(lp.owned_layers), root=None)
    if sorted(j for part in owned for j in part) != list(range(n_layers)):
        fail(f"layers are not owned exactly once: {owned}")


def grid_2x2():
    from propagators.torch import LayerParallel, allreduce_gradients

    layer_group, data_group = mgrit.split_comm(dist.group.WORLD, 2)
    d = dist.get_rank(data_group)
    if (dist.get_rank(layer_group), d) != (dist.get_rank() % 2, dist.get_rank() // 2):
        fail("split_comm placed this rank wrongly")
    torch.manual_seed(5)
    layers = make(12, 4, seed=5)
    opening, closing = nn.Linear(3, 4), nn.Linear(4, 2)
    lp = LayerParallel(copy.deepcopy(layers), T=1.0, cf=2, max_levels=3, comm=layer_group, data_comm=data_group,
                       **TIGHT)
    model = nn.Sequential(copy.deepcopy(opening), lp, copy.deepcopy(closing))
    ref = nn.Sequential(copy.deepcopy(opening),
                        LayerParallel(copy.deepcopy(layers), T=1.0, max_levels=1), copy.deepcopy(closing))
    torch.manual_seed(99)
    X, Y = torch.randn(8, 3), torch.randn(8, 2)
    shard = slice(4 * d, 4 * d + 4)
    loss = ((model(X[shard]) - Y[shard]) ** 2).mean()
    loss.backward()
    allreduce_gradients(model, data_group)
    ((ref(X) - Y) ** 2).mean().backward()
    check("opening layer gradient", model[0].weight.grad, ref[0].weight.grad, 1e-10)
    check("closing layer gradient", model[2].weight.grad, ref[2].weight.grad, 1e-10)
    for j in lp.owned_layers:
        for p, q in zip(lp.layers[j].parameters(), ref[1].layers[j].parameters()):
            check(f"grid gradient of layer {j}", p.grad, q.grad, 1e-10)
    with torch.no_grad():
        total = as_communicator(data_group).allreduce(float(model(X[shard]).sum()))
        serial_total = sum(float(ref(X[k: k + 4]).sum()) for k in (0, 4))
    if abs(total - serial_total) > 1e-10 * max(1.0, abs(serial_total)):
        fail(f"data all-reduce {total} != serial {serial_total}")
    model.zero_grad()
    ref.zero_grad()
    shard = slice(0, 5) if d == 0 else slice(5, 8)
    ((model(X[shard]) - Y[shard]) ** 2).mean().backward()
    allreduce_gradients(model, data_group, shard_size=shard.stop - shard.start)
    ((ref(X) - Y) ** 2).mean().backward()
    check("uneven shards: opening layer gradient", model[0].weight.grad, ref[0].weight.grad, 1e-10)
    for j in lp.owned_layers:
        for p, q in zip(lp.layers[j].parameters(), ref[1].layers[j].parameters()):
            check(f"uneven shards: gradient of layer {j}", p.grad, q.grad, 1e-10)
    grid_serial_switch(layer_group, data_group, d)


def grid_serial_switch(layer_group, data_group, d):
    """SerialSwitch over the gloo grid: its record equals one process's on the whole batch, and a parameter
    frozen on one data rank is a ValueError on every rank in the measurement's handshake (as over MPI:
    tests/mpi_scripts/torch_layer_parallel.py)."""
    from propagators.torch import LayerParallel, SerialSwitch, Switchable

    layers = make(8, 4, seed=8)
    opening, closing = nn.Linear(3, 4), nn.Linear(4, 3)

    def build(**comms):
        lp = LayerParallel(copy.deepcopy(layers), T=2.0, cf=2, max_levels=2, fwd_iters=1, bwd_iters=1, **comms)
        return nn.Sequential(copy.deepcopy(opening), Switchable(lp), copy.deepcopy(closing))

    model, ref = build(comm=layer_group, data_comm=data_group), build()
    torch.manual_seed(9)
    X, Y = torch.randn(8, 3), torch.randint(0, 3, (8,))
    loss = nn.functional.cross_entropy
    rows = slice(4 * d, 4 * d + 4)
    loss(model(X[rows]), Y[rows]).backward()
    rec = SerialSwitch(model, loss, groups=4).measure(X[rows], Y[rows])
    loss(ref(X), Y).backward()
    want = SerialSwitch(ref, loss, groups=4).measure(X, Y)
    for key in ("error", "noise", "grad_norm"):
        if not abs(rec[key] - want[key]) <= 1e-10 * abs(want[key]):
            fail(f"grid SerialSwitch {key} {rec[key]!r} != one process on the whole batch {want[key]!r}")
    model[0].bias.requires_grad_(d == 0)
    try:
        SerialSwitch(model, loss, groups=4).measure(X[rows], Y[rows])
    except ValueError as exc:
        if "arguments of SerialSwitch.measure" not in str(exc):
            fail(f"grid SerialSwitch, a parameter frozen on one data rank: unclear error {exc}")
    else:
        fail("grid SerialSwitch measured with a parameter frozen on one data rank")


def main():
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        if len(sys.argv) > 1 and sys.argv[1] == "grid":
            grid_2x2()
        else:
            for n_layers, cf, levels, relax in [(16, 2, 3, ("F", "FCF")), (21, 4, 2, "FCF"), (13, 2, 4, "F")]:
                layer_parallel_vs_serial(dist.group.WORLD, n_layers, cf, levels, relax)
    except SystemExit:
        raise
    except BaseException as exc:  # report, then fail this rank
        fail(f"{type(exc).__name__}: {exc}")
    print(f"rank {dist.get_rank()} OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
