"""Communicators: the solver is written once against this small interface.

:class:`SerialComm` is the one-process implementation (no messages ever
travel); :class:`MPIComm` wraps an mpi4py communicator. mpi4py is imported
only when an MPI communicator is actually used.

The MPI implementation never blocks without listening: every wait polls for a
failure notice from any other rank, so that an exception on one rank (bad
input, a failing user propagator, a divergence) makes every rank raise
:class:`RemoteRankError` within milliseconds instead of hanging.
"""
from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod

import numpy as np

from . import _backend as B

#: Tags used by the solver: data tags are ``_TAG_BASE + level``.
_TAG_BASE = 0x4D00
_ERR_TAG = 0x7A00
_BCAST_TAG = 0x7A01


class RemoteRankError(RuntimeError):
    """Raised on every rank when another rank of the same solve failed."""


class Communicator(ABC):
    """What the solver needs from a communicator along the time axis."""

    rank: int = 0
    size: int = 1

    @abstractmethod
    def send(self, x, dest: int, tag: int) -> None:
        """Start sending a copy of state ``x`` to rank ``dest`` (non-blocking)."""

    @abstractmethod
    def recv(self, like, source: int, tag: int):
        """Receive a state shaped, typed and placed like ``like`` from ``source``."""

    @abstractmethod
    def allreduce(self, value: float, op: str = "sum") -> float:
        """Sum (``op="sum"``) or maximum (``op="max"``) of a float over all ranks."""

    def notify_failure(self, exc: BaseException) -> None:
        """Tell the other ranks that this one failed (no-op on one process)."""

    def finish(self) -> None:
        """Complete every outstanding send."""

    def gather(self, obj, root: int | None = 0):
        """Gather a Python object to ``root`` (or to all ranks when ``root`` is None)."""
        return [obj]

    def bcast(self, obj, root: int = 0):
        """``obj`` of rank ``root`` on every rank (pickled; listens for failures while waiting)."""
        return obj


class SerialComm(Communicator):
    """The single-process communicator: there is never anyone to talk to."""

    rank = 0
    size = 1

    def send(self, x, dest, tag):  # pragma: no cover - never called with one rank
        raise RuntimeError("SerialComm cannot send: there is only one rank")

    def recv(self, like, source, tag):  # pragma: no cover
        raise RuntimeError("SerialComm cannot receive: there is only one rank")

    def allreduce(self, value, op="sum"):
        return float(value)


def _numpy_dtype(like):
    if B.is_torch(like):
        import torch

        return torch.empty((), dtype=like.dtype).numpy().dtype
    return like.dtype


class MPIComm(Communicator):
    """mpi4py communicator along the time axis.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
        The layer (time) communicator. Messages use tags from 0x4D00 upwards
        and 0x7A00; avoid those tags for your own traffic on the same
        communicator.
    cuda_aware : bool, optional
        Send CUDA tensors directly (the MPI library must be CUDA-aware).
        Default: the environment variable ``MGRIT_CUDA_AWARE_MPI=1``.
        Otherwise CUDA tensors are staged through pinned host memory.
    """

    def __init__(self, comm, cuda_aware: bool | None = None):
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        if cuda_aware is None:
            cuda_aware = os.environ.get("MGRIT_CUDA_AWARE_MPI", "0") == "1"
        self.cuda_aware = bool(cuda_aware)
        self._pending: list = []

    # -- failure protocol -------------------------------------------------
    def _check_remote_failure(self) -> None:
        MPI = self._MPI
        status = MPI.Status()
        if self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_ERR_TAG, status=status):
            msg = self.comm.recv(source=status.Get_source(), tag=_ERR_TAG)
            raise RemoteRankError(f"rank {status.Get_source()} failed: {msg}")

    def _wait(self, req) -> None:
        spins = 0
        while not req.Test():
            self._check_remote_failure()
            spins += 1
            if spins > 200:
                time.sleep(min(1e-3, 1e-6 * (spins - 200)))

    def notify_failure(self, exc):
        msg = f"{type(exc).__name__}: {exc}"
        for r in range(self.size):
            if r != self.rank:
                self._pending.append((self.comm.isend(msg, dest=r, tag=_ERR_TAG), None))

    # -- point to point ---------------------------------------------------
    def _to_buffer(self, x):
        if B.is_torch(x):
            x = x.detach()
            if x.is_cuda and self.cuda_aware:
                return x.clone().contiguous()
            if x.is_cuda:
                host = torch_pinned_copy(x)
                return host.numpy()
            return x.clone().contiguous().numpy()
        return np.array(x, copy=True, order="C")

    def send(self, x, dest, tag):
        buf = self._to_buffer(x)
        self._pending.append((self.comm.Isend(buf, dest=dest, tag=_TAG_BASE + tag), buf))
        if len(self._pending) > 64:
            self._pending = [(r, b) for r, b in self._pending if not r.Test()]

    def recv(self, like, source, tag):
        if B.is_torch(like) and like.is_cuda and self.cuda_aware:
            import torch

            buf = torch.empty_like(like).contiguous()
        else:
            buf = np.empty(tuple(like.shape), dtype=_numpy_dtype(like))
        self._wait(self.comm.Irecv(buf, source=source, tag=_TAG_BASE + tag))
        if B.is_torch(like):
            import torch

            out = buf if isinstance(buf, torch.Tensor) else torch.from_numpy(buf)
            return out.to(device=like.device, non_blocking=False)
        return buf

    def allreduce(self, value, op="sum"):
        MPI = self._MPI
        send = np.array([value], dtype=np.float64)
        recv = np.empty(1, dtype=np.float64)
        self._wait(self.comm.Iallreduce(send, recv, op=MPI.SUM if op == "sum" else MPI.MAX))
        return float(recv[0])

    def finish(self):
        for req, _ in self._pending:
            self._wait(req)
        self._pending = []

    def bcast(self, obj, root=0):
        if self.rank == root:
            for r in range(self.size):
                if r != root:
                    self._pending.append((self.comm.isend(obj, dest=r, tag=_BCAST_TAG), None))
            return obj
        spins = 0
        while True:
            if self.comm.Iprobe(source=root, tag=_BCAST_TAG):
                return self.comm.recv(source=root, tag=_BCAST_TAG)
            self._check_remote_failure()
            spins += 1
            if spins > 200:
                time.sleep(min(1e-3, 1e-6 * (spins - 200)))

    def gather(self, obj, root=0):
        if root is None:
            return self.comm.allgather(obj)
        return self.comm.gather(obj, root=root)


def torch_pinned_copy(x):
    """Copy a CUDA tensor into pinned host memory (synchronously)."""
    import torch

    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x)
    return host


def as_communicator(comm) -> Communicator:
    """Turn ``None``, a :class:`Communicator` or an mpi4py communicator into a Communicator."""
    if comm is None:
        return SerialComm()
    if isinstance(comm, Communicator):
        return comm
    if type(comm).__module__.startswith("mpi4py"):
        return MPIComm(comm)
    raise TypeError(
        f"`comm` must be None, an mpi4py communicator or an mgrit.Communicator, got {type(comm).__name__}"
    )


def split_comm(comm, layer_size: int):
    """Split ``comm`` into a 2-D grid of ranks: (layer communicator, data communicator).

    World rank ``r`` sits at layer index ``r % layer_size`` and data index
    ``r // layer_size``. Ranks with the same data index form one layer
    communicator (pass it to ``solve(..., comm=...)`` to split time / layers);
    ranks with the same layer index form one data communicator (shard the batch
    over it and all-reduce gradients on it).

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
        Usually ``MPI.COMM_WORLD``; its size must be a multiple of ``layer_size``.
    layer_size : int
        Number of ranks along the layer (time) dimension.

    Returns
    -------
    layer_comm, data_comm : mpi4py.MPI.Comm
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    if not isinstance(layer_size, int) or layer_size < 1 or size % layer_size:
        raise ValueError(
            f"`layer_size` must divide the communicator size {size}, got {layer_size!r}"
        )
    layer_index, data_index = rank % layer_size, rank // layer_size
    layer_comm = comm.Split(color=data_index, key=layer_index)
    data_comm = comm.Split(color=layer_index, key=data_index)
    return layer_comm, data_comm
