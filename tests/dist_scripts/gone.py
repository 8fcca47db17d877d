"""A process that dies while the others wait for it over torch.distributed (gloo).

Run as ``python _launch.py P gone.py WHERE``: the last process raises an uncaught
``RuntimeError`` ``split``: before ``mgrit.split_comm`` (the others waited in ``new_group`` for
ever before), ``between``: between a LayerParallel forward pass and its backward pass (the others
wait in the backward pass). Every other process must raise ``RemoteRankError`` (rank 0: naming the
process that died) instead of waiting, or of torch.distributed's bare error about a port.
"""
import sys

import torch
import torch.distributed as dist
from torch import nn

import mgrit
from propagators.torch import LayerParallel


def main():
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    last, where = rank == size - 1, sys.argv[1]
    torch.set_num_threads(1)
    try:
        if where == "split":
            if last:
                raise RuntimeError(f"user code failed on rank {rank}")
            mgrit.split_comm(dist.group.WORLD, size)
        else:
            torch.manual_seed(0)
            lp = LayerParallel([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(16)], T=1.0, cf=2,
                               max_levels=3, comm=dist.group.WORLD)
            y = lp(torch.randn(3, 4))
            if last:
                raise RuntimeError(f"user code failed on rank {rank}")
            y.sum().backward()
        print(f"rank {rank} was not stopped", flush=True)
    except mgrit.RemoteRankError as exc:
        print(f"rank {rank} raised RemoteRankError: {str(exc)[:120]}", flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
