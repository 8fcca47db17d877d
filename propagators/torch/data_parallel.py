"""Data parallelism beside layer parallelism: the gradient all-reduce over the data ranks.

With ``layer_comm, data_comm = mgrit.split_comm(world, layer_size)`` every data
rank computes its loss on its own shard of the batch; after ``loss.backward()``
:func:`allreduce_gradients` turns the shard gradients into the full-batch
gradient on every data rank.
"""
from __future__ import annotations

import math
import zlib
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from mgrit.comm import as_communicator


def allreduce_gradients(module: nn.Module, data_comm, shard_size: int | None = None, buffers: bool = False) -> None:
    """Average ``.grad`` of the parameters of ``module`` over the data communicator.

    The gradients travel as one flat buffer per dtype and device (one
    all-reduce each, not one per tensor); over an NCCL process group a CUDA
    buffer is reduced on its device. With ``shard_size`` (the number of
    samples of this rank's shard, for a loss that is a mean over the shard) the
    shards are weighted by their sizes, so uneven shards give the full-batch
    mean gradient; without it every shard weighs the same. A parameter gets a
    gradient when any data rank has one (the others contribute zeros), as
    serial autograd on the whole batch would give.

    With ``buffers=True`` the floating-point buffers (BatchNorm's running statistics) are averaged
    too, weighted alike: each data rank's running statistics follow its own shard, so without it the
    data replicas drift apart and evaluate differently. The average of the running means is the full
    batch's; that of the running variances leaves out the spread between the shard means (as
    ``SyncBatchNorm`` would not), like the buffers DDP broadcasts from one rank.

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
    floats = [b for b in module.buffers() if b.is_floating_point()] if buffers else []
    _check_alike(comm, params + floats, shard_size is not None, module, params)
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
    if floats:
        with torch.no_grad():
            flat = torch.cat([b.detach().double().reshape(-1) for b in floats]) * weight
            summed = comm.allreduce_array(flat) / total
            off = 0
            for b in floats:
                b.copy_(summed[off: off + b.numel()].view_as(b))
                off += b.numel()


def _check_alike(comm, params, weighted: bool, module, values) -> None:
    """Raise on every data rank alike (one reduction) unless all pass the same parameters (and buffers
    to average; number, shapes, dtypes) and all or none a ``shard_size``: they travel as flat buffers
    matched by position. The MGRIT blocks' settings (n_layers, T, scheme, hierarchy) must agree too, and the
    values of the parameters ``values`` (not the buffers: running statistics differ until averaged):
    replicas built after seeding the ranks differently (or with another T) averaged the gradients of
    different networks, silently. (The cycles and tolerances may differ: SerialSwitch adapts them per data
    rank.)"""
    layout = zlib.crc32(repr([(tuple(p.shape), str(p.dtype)) for p in params]).encode())
    blocks = [(name, m._replica_settings()) for name, m in module.named_modules() if hasattr(m, "_replica_settings")]
    sums, scale = _value_sums(values)
    mine = [float(len(params)), float(layout), float(weighted), float(zlib.crc32(repr(blocks).encode()))] + sums
    got = comm.exact_many([[v] for m in mine for v in (m, -m)], "max")
    if got[0] != -got[1] or got[2] != -got[3]:
        raise ValueError(
            "allreduce_gradients: the data ranks pass modules with different parameters (number, shapes or dtypes, "
            f"of those that require grad; this rank: {len(params)}): every data rank must hold the same model, "
            "built the same way (same layer ranks' share of it), and freeze the same parameters")
    if got[4] != -got[5]:
        raise ValueError("allreduce_gradients: `shard_size` was given on some data ranks and not on others: "
                         "pass it on every data rank (the shards are weighted by it) or on none")
    if got[6] != -got[7]:
        raise ValueError("allreduce_gradients: the data ranks' MGRIT blocks have different settings (n_layers, T, "
                         "scheme, the MGRIT hierarchy; this rank: "
                         f"{blocks[0] if blocks else 'none'}): build and configure them alike on every data rank")
    rtol = max((_rtol(p.dtype) for p in values), default=0.0)
    if got[8] + got[9] > rtol * scale or got[10] + got[11] > rtol * got[10]:
        raise ValueError("allreduce_gradients: the data ranks hold different parameter values (checksums of "
                         f"their parameters differ by {max(got[8] + got[9], got[10] + got[11]):.3g}): seed every "
                         "rank alike before building the model (or load one state dict on every rank), and step "
                         "the same optimizer on every data rank")


def _value_sums(params) -> tuple:
    """Two checksums of the parameter values, equal on data replicas that hold the same values: the sum
    and the 2-norm of all of them, in their dtype, and the 1-norm, for the tolerance. (A float64 copy
    weighted by position cost 87 ms and 7x the parameters' memory per call at 4.2M parameters; norms per
    tensor take 16 ms for 2,048 small tensors, a flat copy 10 ms for four large ones.)"""
    groups: OrderedDict = OrderedDict()
    for p in params:
        if p.numel() and (p.is_floating_point() or p.is_complex()):
            groups.setdefault((p.device, p.dtype), []).append(p.detach().reshape(-1))
    total = square = size = 0.0
    for ts in groups.values():
        # many small tensors: one flat copy and three reductions; a few large ones: three per tensor, no copy
        for flat in ([torch.cat(ts)] if len(ts) > 64 else ts):
            flat = torch.view_as_real(flat).reshape(-1) if flat.is_complex() else flat
            flat = flat.float() if flat.element_size() < 4 else flat  # (half precision: sums in float32)
            parts = torch.stack([flat.sum(), torch.linalg.vector_norm(flat, 2), torch.linalg.vector_norm(flat, 1)])
            parts = parts.double().tolist()
            total, square, size = total + parts[0], square + parts[1] ** 2, size + parts[2]
    if not (math.isfinite(total) and math.isfinite(square)):
        return [0.0, 0.0], 0.0  # (non-finite parameters: not compared here)
    return [total, square], size


def _rtol(dtype) -> float:
    """How far the replicas' sums may differ: rounding of the float64 sums of equal values (none), or of
    parameters computed on other hardware; 100 units of the parameters' precision, at most 1e-4."""
    eps = torch.finfo(dtype).eps if (dtype.is_floating_point or dtype.is_complex) else 0.0
    return min(1e-4, 100 * eps)
