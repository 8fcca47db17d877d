"""PyTorch's DistributedDataParallel around a model that holds a LayerParallel block (gloo).

Run as ``python _launch.py P ddp.py data`` (every process holds the whole block, ``comm=None``, and
trains on its shard of the batch: data parallelism by DDP alone) or ``python _launch.py 4 ddp.py grid``
(a 2 x 2 grid from :func:`mgrit.split_comm`: the block over the layer group, DDP over the data group).
Three SGD steps; after each backward pass every parameter's gradient equals that of the serial network
on the whole batch (float64, converged solves: 1e-9 relative), and so do the weights after the steps.
Prints ``rank r OK``.
"""
import copy
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import mgrit
from propagators.torch import LayerParallel, ODENet

TIGHT = dict(fwd_iters=80, bwd_iters=80, fwd_tol=1e-14, bwd_tol=1e-14)


def fail(msg):
    print(f"rank {dist.get_rank()} FAIL: {msg}", flush=True)
    sys.exit(1)


def rel(a, b):
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-300)


def main(mode):
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo")
    r, P = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(16)]
    head = nn.Linear(4, 2)
    if mode == "data":
        block = LayerParallel(copy.deepcopy(layers), T=1.0, cf=2, max_levels=3, **TIGHT)
        group, data_rank, replicas = None, r, P
    else:
        layer_group, group = mgrit.split_comm(dist.group.WORLD, 2)
        block = LayerParallel(copy.deepcopy(layers), T=1.0, cf=2, max_levels=3, comm=layer_group, **TIGHT)
        data_rank, replicas = r // 2, P // 2
    model = nn.Sequential(block, copy.deepcopy(head))
    ddp = DistributedDataParallel(model, process_group=group)
    serial = nn.Sequential(ODENet(copy.deepcopy(layers), T=1.0), copy.deepcopy(head))
    reference = dict(serial.named_parameters())
    torch.manual_seed(1)
    X, Y = torch.randn(8, 4), torch.randn(8, 2)
    rows = slice(data_rank * 8 // replicas, (data_rank + 1) * 8 // replicas)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.5)
    opt_serial = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.5)
    for step in range(3):
        opt.zero_grad()
        opt_serial.zero_grad()
        ((ddp(X[rows]) - Y[rows]) ** 2).mean().backward()
        ((serial(X) - Y) ** 2).mean().backward()
        for name, p in model.named_parameters():  # (the block's keep their global layer indices)
            if p.grad is None or rel(p.grad, reference[name].grad) > 1e-9:
                fail(f"step {step}: gradient of {name} differs from the serial network's on the whole batch")
        opt.step()
        opt_serial.step()
    for name, p in model.named_parameters():
        if rel(p.detach(), reference[name].detach()) > 1e-9:
            fail(f"weights of {name} differ from the serial network's after the steps")
    print(f"rank {r} OK", flush=True)
    # leave without the interpreter's shutdown, as the README advises after the last collective call: gloo's
    # threads (DDP's, and the block's failure-notice listener on the layer group) can abort a process that
    # finalises (exit code -6), and destroy_process_group can wait for the listener's receive
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
