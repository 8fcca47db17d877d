"""A process that dies while the others wait for it over torch.distributed (gloo).

Run as ``python _launch.py P gone.py WHERE``: the last process raises an uncaught
``RuntimeError`` ``split``: before ``mgrit.split_comm`` (the others waited in ``new_group`` for
ever before), ``between``: between a LayerParallel forward pass and its backward pass (the others
wait in the backward pass). Every other process must raise ``RemoteRankError`` (rank 0: naming the
process that died) instead of waiting, or of torch.distributed's bare error about a port.

``grid`` (4 processes, a 2 x 2 layer x data grid): process 0 raises between the forward and
the backward pass; its layer partner, process 1, dies of the RemoteRankError that follows
(uncaught); processes 2 and 3 finish their backward pass and wait in ``allreduce_gradients``
for processes 0 and 1. Every RemoteRankError must name process 0 as the origin.

``retry``: after one training step the last process dies; the others catch the RemoteRankError of
the next step and try two more steps on the same process group. Every try must raise
RemoteRankError naming the last process on every other process (before, only the processes that
waited for the dead one learned of it, and the others waited for them for ever).
"""
import sys

import torch
import torch.distributed as dist
from torch import nn

import mgrit
from propagators.torch import LayerParallel


def say(line: str) -> None:
    """One line in one write: the processes share the launcher's pipe (print writes the line and its
    newline separately without buffering, and another process's line can come in between)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def grid(rank):
    from propagators.torch import allreduce_gradients

    layer_group, data_group = mgrit.split_comm(dist.group.WORLD, 2)
    torch.manual_seed(0)
    lp = LayerParallel([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(16)], T=1.0, cf=2,
                       max_levels=3, comm=layer_group, data_comm=data_group)
    y = lp(torch.randn(3, 4))
    if rank == 0:
        raise RuntimeError("user code failed on rank 0")
    try:
        y.sum().backward()
        allreduce_gradients(lp, data_group)
    except mgrit.RemoteRankError as exc:
        say(f"rank {rank} raised RemoteRankError: {str(exc)[:300]}")
        if rank == 1:
            raise  # (uncaught: this process dies of it)
        sys.exit(3)
    say(f"rank {rank} was not stopped")


def retry(rank, last):
    torch.manual_seed(0)
    lp = LayerParallel([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(16)], T=1.0, cf=2,
                       max_levels=3, comm=dist.group.WORLD)
    x = torch.randn(3, 4)
    lp(x).sum().backward()
    if last:
        raise RuntimeError(f"user code failed on rank {rank}")
    for step in (2, 3, 4):
        try:
            lp(x).sum().backward()
            say(f"rank {rank} was not stopped")
        except mgrit.RemoteRankError as exc:
            say(f"rank {rank} step {step} raised RemoteRankError: {str(exc)[:100]}")
    say(f"rank {rank} done")


def main():
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    last, where = rank == size - 1, sys.argv[1]
    torch.set_num_threads(1)
    if where == "grid":
        return grid(rank)
    if where == "retry":
        return retry(rank, last)
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
        say(f"rank {rank} was not stopped")
    except mgrit.RemoteRankError as exc:
        say(f"rank {rank} raised RemoteRankError: {str(exc)[:120]}")
        sys.exit(3)


if __name__ == "__main__":
    main()
