"""Data parallelism beside layer parallelism: the gradient all-reduce over the data ranks.

With ``layer_comm, data_comm = mgrit.split_comm(world, layer_size)`` every data
rank computes its loss on its own shard of the batch; after ``loss.backward()``
:func:`allreduce_gradients` turns the shard gradients into the full-batch
gradient on every data rank.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from mgrit.comm import as_communicator


def allreduce_gradients(module: nn.Module, data_comm, shard_size: int | None = None) -> None:
    """Average ``.grad`` of the parameters of ``module`` over the data communicator.

    The gradients travel as one flat buffer per dtype and device (one
    all-reduce each, not one per tensor); over an NCCL process group a CUDA
    buffer is reduced on its device. With ``shard_size`` (the number of
    samples of this rank's shard, for a loss that is a mean over the shard) the
    shards are weighted by their sizes, so uneven shards give the full-batch
    mean gradient; without it every shard weighs the same. A parameter gets a
    gradient when any data rank has one (the others contribute zeros), as
    serial autograd on the whole batch would give.

    The call is collective over ``data_comm`` and failure-aware: when a data
    peer failed (its LayerParallel was given ``data_comm``, or it called
    ``data_comm.alarm(exc)``), this raises :class:`mgrit.RemoteRankError`
    instead of waiting forever.
    """
    comm = as_communicator(data_comm)
    params = [p for p in module.parameters() if p.requires_grad]
    if comm.size == 1:
        return
    if shard_size is not None and (isinstance(shard_size, bool) or not shard_size >= 0):
        raise ValueError(f"`shard_size` must be a number of samples >= 0, got {shard_size!r}")
    weight = 1.0 if shard_size is None else float(shard_size)
    meta = np.array([p.grad is not None for p in params] + [weight], dtype=np.float64)
    meta = comm.allreduce_array(meta)
    total = meta[-1]
    if total <= 0:
        raise ValueError("the shard sizes of all data ranks add up to 0")
    buckets: OrderedDict = OrderedDict()
    for p, has in zip(params, meta[:-1]):
        if has:
            buckets.setdefault((p.dtype, p.device), []).append(p)
    for (dtype, device), ps in buckets.items():
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
                          for p in ps])
        if weight != 1.0:
            flat = flat * weight
        # the tensor itself: a communicator that can reduce on the device (NCCL) keeps it there
        summed = comm.allreduce_array(flat if flat.dtype != torch.bfloat16 else flat.float())
        summed = (summed / total).to(dtype=dtype, device=device)
        off = 0
        for p in ps:
            g = summed[off: off + p.numel()].view_as(p)
            off += p.numel()
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
