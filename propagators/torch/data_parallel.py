"""Data parallelism beside layer parallelism: the gradient all-reduce over the data ranks.

With ``layer_comm, data_comm = mgrit.split_comm(world, layer_size)`` every data
rank computes its loss on its own shard of the batch; after ``loss.backward()``
:func:`allreduce_gradients` turns the shard gradients into the full-batch
gradient on every data rank.
"""
from __future__ import annotations

import zlib
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from mgrit.comm import Call, _uninitialised_hint, as_communicator


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
    ``SyncBatchNorm`` would not), like the buffers DDP broadcasts from one rank. BatchNorm's
    ``num_batches_tracked`` takes the largest count of the data ranks (a rank with an empty shard, which
    skipped the forward pass, did not count the step that the full batch counts).

    The call is collective over ``data_comm`` and failure-aware: when a data
    peer failed (its LayerParallel was given ``data_comm``, or it called
    ``data_comm.alarm(exc)``), this raises :class:`mgrit.RemoteRankError`
    instead of waiting forever.
    """
    hint = _uninitialised_hint() if data_comm is None else ""  # (None alone: one data replica, nothing to average)
    if hint:
        raise RuntimeError("allreduce_gradients got data_comm=None" + hint)
    comm = as_communicator(data_comm)
    params = [p for p in module.parameters() if p.requires_grad]
    if comm.size == 1:
        return
    # one session: its handshake makes a rank at another collective call (a SerialSwitch measuring on
    # one data rank only) raise with the others instead of waiting, and a bad argument on one rank too
    if shard_size is not None and (isinstance(shard_size, bool) or not shard_size >= 0):
        failure = ValueError(f"`shard_size` must be a number of samples >= 0, got {shard_size!r}")
        comm.open(failure=failure)
        raise failure
    floats = [b for b in module.buffers() if b.is_floating_point()] if buffers else []
    counts = [m.num_batches_tracked for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
              and isinstance(getattr(m, "num_batches_tracked", None), torch.Tensor)] if buffers else []
    with comm.session(Call("allreduce_gradients()", None, "")):
        _average(comm, module, params, floats, shard_size)
        if counts:  # (every data rank holds the same modules: _average checked the layout, buffers included)
            top = comm.exact_many([[float(c)] for c in counts], "max")
            with torch.no_grad():
                for c, v in zip(counts, top):
                    c.fill_(int(v))


def _average(comm, module, params, floats, shard_size) -> None:
    """allreduce_gradients' work, inside its session."""
    _check_alike(comm, params + floats, shard_size is not None, module, params)
    weight = 1.0 if shard_size is None else float(shard_size)
    n = len(params)
    # per parameter: a gradient here, and the sparse dimensions of a sparse one (0: dense)
    sparse_dims = [p.grad.sparse_dim() if p.grad is not None and p.grad.is_sparse else 0 for p in params]
    meta = np.array([p.grad is not None for p in params] + [d > 0 for d in sparse_dims] + sparse_dims + [weight],
                    dtype=np.float64)
    meta = comm.allreduce_array(meta)
    total = meta[-1]
    if total <= 0:
        raise ValueError("the shard sizes of all data ranks add up to 0")
    buckets: OrderedDict = OrderedDict()
    for p, has in zip(params, meta[:n]):
        if has:
            buckets.setdefault((p.dtype, p.device), []).append(p)
    # (nn.Embedding(sparse=True): sparse on any data rank, with its sparse dimensions, 1 for an embedding)
    dims = {id(p): round(d / k) for p, k, d in zip(params, meta[n:2 * n], meta[2 * n:3 * n]) if k}
    sparse = {}  # per sparse parameter: the rows that any replica's gradient holds (looked up), kept though
    if dims:     # their sum be zero
        sp = [p for p in params if id(p) in dims]
        touched = comm.allreduce_array(np.concatenate([_touched(p, dims[id(p)]) for p in sp]))
        off = 0
        for p in sp:
            index_shape = p.shape[:dims[id(p)]]
            size = int(np.prod(index_shape))
            sparse[id(p)] = touched[off: off + size].reshape(index_shape) > 0
            off += size
    for (dtype, device), ps in buckets.items():
        flat = torch.cat([_dense_grad(p).reshape(-1) for p in ps])
        if flat.dtype in (torch.float16, torch.bfloat16):  # (a gradient times the shard size overflows float16)
            flat = flat.float()
        if weight != 1.0:
            flat = flat * weight
        # the tensor itself: a communicator that can reduce on the device (NCCL) keeps it there
        summed = comm.allreduce_array(flat)
        summed = (summed / total).to(dtype=dtype, device=device)
        off = 0
        for p in ps:
            g = summed[off: off + p.numel()].view_as(p)
            off += p.numel()
            if id(p) in sparse:  # the replicas' sparse gradients summed dense, sparse again on every data rank
                rows = torch.from_numpy(np.argwhere(sparse[id(p)]).T.copy()).to(device)
                p.grad = torch.sparse_coo_tensor(rows, g[tuple(rows)], p.shape).coalesce()
            elif p.grad is None:
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


def _touched(p, sparse_dim: int) -> np.ndarray:
    """Flat float64 flags over the sparse index space of ``p`` (its first ``sparse_dim`` dimensions): 1
    where this rank's gradient holds an entry (every index for a dense gradient, none without one)."""
    flags = np.zeros(p.shape[:sparse_dim], dtype=np.float64)
    if p.grad is not None and p.grad.is_sparse and p.grad.sparse_dim() == sparse_dim:
        flags[tuple(p.grad.coalesce().indices().cpu().numpy())] = 1.0
    elif p.grad is not None:
        flags[...] = 1.0
    return flags.reshape(-1)


def _dense_grad(p) -> torch.Tensor:
    """``p``'s gradient as a dense tensor (zeros where it has none; a sparse one, such as
    ``nn.Embedding(sparse=True)`` makes, summed into its dense form)."""
    if p.grad is None:
        return torch.zeros_like(p)
    return p.grad.detach().to_dense() if p.grad.is_sparse else p.grad.detach()


def param_layout(params) -> int:
    """A checksum of the parameters' number, shapes and dtypes, in order: what data replicas exchanging
    them as flat buffers matched by position must share."""
    return zlib.crc32(repr([(tuple(p.shape), str(p.dtype)) for p in params]).encode())


def _check_alike(comm, params, weighted: bool, module, values) -> None:
    """Raise on every data rank alike (one reduction) unless all pass the same parameters (and buffers
    to average; number, shapes, dtypes) and all or none a ``shard_size``: they travel as flat buffers
    matched by position. The MGRIT blocks' settings (n_layers, T, scheme, hierarchy) must agree too, and the
    values of the parameters ``values`` (not the buffers: running statistics differ until averaged):
    replicas built after seeding the ranks differently (or with another T) averaged the gradients of
    different networks, silently. So must the blocks' cycles and tolerances (and a Switchable's mode), and every
    module's training mode.)"""
    layout = param_layout(params)
    blocks = [(name, m._replica_settings()) for name, m in module.named_modules() if hasattr(m, "_replica_settings")]
    sums = _value_sums(values)
    # each of the first blocks' settings apart too (padded to a fixed count), so that the error names one
    each = [float(zlib.crc32(repr(b).encode())) for b in blocks[:_NAMED_BLOCKS]]
    each += [-1.0] * (_NAMED_BLOCKS - len(each))
    modes = [m.training for m in module.modules()]  # (a replica left in eval() after its validation)
    mine = ([float(len(params)), float(layout), float(weighted), float(zlib.crc32(repr(blocks).encode()))] + sums
            + each + [float(zlib.crc32(bytes(modes)))])
    got = comm.exact_many([[v] for m in mine for v in (m, -m)], "max")
    if got[0] != -got[1] or got[2] != -got[3]:
        raise ValueError(
            "allreduce_gradients: the data ranks pass modules with different parameters (number, shapes or dtypes, "
            f"of those that require grad; this rank: {len(params)}): every data rank must hold the same model, "
            "built the same way (same layer ranks' share of it), and freeze the same parameters; or `data_comm` is "
            "not the data communicator (the layer communicator or the world passed instead: pass the data part of "
            "mgrit.split_comm, or the data group of mgrit.torch_dist's grid)")
    if got[4] != -got[5]:
        raise ValueError("allreduce_gradients: `shard_size` was given on some data ranks and not on others: "
                         "pass it on every data rank (the shards are weighted by it) or on none")
    if got[6] != -got[7]:
        off = 8 + 2 * len(sums)
        differ = [i for i in range(_NAMED_BLOCKS) if got[off + 2 * i] != -got[off + 2 * i + 1]]
        which = f"{len(blocks)} blocks on this rank"
        if differ:  # (every rank is here, alike: the same reduced numbers) the block's settings on every rank
            i = differ[0]
            every = comm.gather(dict(blocks[i][1]) if i < len(blocks) else {}, root=None)
            fields = sorted({k for d in every for k in d if len({repr(e.get(k)) for e in every}) > 1})
            if i < len(blocks):
                name = f"`{blocks[i][0]}`" if blocks[i][0] else "(the module itself)"
                which = (f"block {name} ({type(module.get_submodule(blocks[i][0])).__name__}): "
                         + "; ".join(f"{k} " + " / ".join(repr(d.get(k)) for d in every) for k in fields)
                         + " on the data ranks in order")
        raise ValueError("allreduce_gradients: the data ranks' MGRIT blocks have different settings (n_layers, T, "
                         "scheme, the MGRIT hierarchy, fwd_iters / bwd_iters / tolerances, skip / warm_start / "
                         "exact_eval, a Switchable's mode; "
                         f"the first that differs: {which}): build and configure them alike on every data rank "
                         "(a SerialSwitch changes them alike when given `data_comm`)")
    if got[-2] != -got[-1]:
        every = comm.gather(sum(modes), root=None)
        raise ValueError("allreduce_gradients: the data ranks' modules are in different modes (train() / eval(); "
                         f"modules in training mode on the data ranks in order: {every} of {len(modes)}): their "
                         "gradients come from different networks (BatchNorm's batch or running statistics, dropout "
                         "on or off); call model.train() on every data rank after an evaluation on some of them")
    if got[8] != -got[9] or got[10] != -got[11]:  # (every rank decides from the same reduced numbers)
        raise ValueError("allreduce_gradients: the data ranks hold different parameter values (the checksums of "
                         "their bits differ): seed every "
                         "rank alike before building the model (or load one state dict on every rank), and step "
                         "the same optimizer on every data rank; or a data rank skipped an allreduce_gradients "
                         "call the others made (every data rank calls it once per step, before the optimizer "
                         "step), and its optimizer stepped with its own shard's gradients")


#: the blocks whose settings are compared one by one (the error names the first that differs)
_NAMED_BLOCKS = 16
#: tensors below this many entries are checksummed together (one copy of them all); larger ones one by one
_SMALL = 1 << 16
#: the checksums are reduced modulo this (exact in float64, as the communicators' reductions carry them)
_MODULUS = (1 << 52) - 1
#: the width of the rows whose column sums weight the words by position (a prime)
_ROW = 251


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as 32-bit integers (a view where it is contiguous; 16- or 8-bit words widened
    where its size is not a multiple of 4 bytes)."""
    t = t.detach()
    t = (torch.view_as_real(t) if t.is_complex() else t).reshape(-1)
    if (t.numel() * t.element_size()) % 4 == 0:
        return t.view(torch.int32)
    return t.view({2: torch.int16, 1: torch.int8}[t.element_size()]).to(torch.int32)


def _word_sums(w: torch.Tensor) -> tuple:
    """``(sum, sum weighted by position)`` of the 32-bit words ``w``: column sums of rows of :data:`_ROW`
    words, wrapping modulo 2^32 (fast, and exact in that arithmetic on every rank), combined in Python."""
    q = w.numel() // _ROW
    cols = w[: q * _ROW].view(q, _ROW).sum(0, dtype=torch.int32).tolist() if q else [0] * _ROW
    tail = w[q * _ROW:].tolist()
    return (sum(cols) + sum(tail), sum((j + 1) * (c + (tail[j] if j < len(tail) else 0)) for j, c in enumerate(cols)))


def _value_sums(params) -> list:
    """Two checksums of the parameters' bits, equal on data replicas exactly when (up to collisions) they
    hold the same values in the same places. Integer sums do not depend on the order of summation, so no
    tolerance is needed (float sums with one of 1e-5 of the 1-norm passed a re-initialised 10 x 64 head
    beside 4M other parameters, and a rank whose tolerance was its own raised alone); the words are
    weighted by their position in rows of 251 and every large tensor by its index (a swapped pair, a
    transposed weight, a negated row). NaN and Inf have bits too. About 1 ms per 4M parameters, plus one
    copy of the small tensors (2 ms for 2,048 of 16 x 16)."""
    one = two = 0
    small: OrderedDict = OrderedDict()
    for k, p in enumerate(params):
        if not p.numel():
            continue
        if p.numel() < _SMALL:
            small.setdefault((p.device, p.dtype), []).append(p.detach().reshape(-1))
            continue
        total, weighted = _word_sums(_words(p))
        one += (k + 1) * total
        two += (2 * k + 3) * weighted
    for m, parts in enumerate(small.values()):  # (one copy per device and dtype, as the gradients' all-reduce)
        total, weighted = _word_sums(_words(torch.cat(parts)))
        one += (m + 1) * total
        two += (m + 2) * weighted
    return [float(one % _MODULUS), float(two % _MODULUS)]
