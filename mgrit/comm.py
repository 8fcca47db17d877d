"""Communicators: the solver is written once against this small interface.

:class:`SerialComm` is the one-process implementation (no messages ever
travel); :class:`MPIComm` wraps an mpi4py communicator. mpi4py is imported
only when an MPI communicator is actually used.

One solve is a collective call over the communicator and runs in three
phases:

1. ``open(failure)``: every rank has checked its input locally; the ranks
   agree that all of them succeeded (otherwise every rank raises before any
   state is exchanged) and open a private channel (a duplicate of the
   communicator, so that nothing of a failed solve can leak into the next one).
2. point-to-point messages (:meth:`~Communicator.send` / :meth:`~Communicator.recv`)
   and reductions (:meth:`~Communicator.sum_exact`, :meth:`~Communicator.max`).
3. ``finish()`` and ``close(error)``: wait for the outstanding sends, confirm
   that every rank got to the end, release the channel.

The MPI implementation never blocks without listening: every wait polls for a
failure notice from any other rank, so that an exception on one rank (a
failing user propagator, a divergence) makes every rank raise
:class:`RemoteRankError` within milliseconds instead of hanging. A failed
solve abandons its private duplicate with whatever it still holds (unmatched
sends, a collective that a rank never joined; receives are cancelled), so the
communicator passed in stays clean for the next solve and ``MPI_Finalize``
returns (checked with MPICH in tests/test_mpi.py).

The residual norm is reduced exactly (:func:`exact_bins`): its value, and
so every convergence decision, does not depend on the number of ranks.
"""
from __future__ import annotations

import math
import os
import time
import zlib
from abc import ABC, abstractmethod

import numpy as np

from . import _backend as B

#: Tags of failure notices and broadcasts; the solver's data tags are level indices.
_ERR_TAG = 0x7A00
_BCAST_TAG = 0x7A01

#: Requests (and the buffers they use) left behind by failed solves. They are
#: kept alive so that MPI never touches freed memory; this only grows on failures.
_ABANDONED: list = []


class _Backoff:
    """Polling rhythm of a wait: a few polls that only yield the core (low
    latency), then naps that double from 10 us up to 0.2 ms, so that ranks
    sharing a core (oversubscription) leave it to the ones that work."""

    def __init__(self):
        self.polls = 0
        self.nap = 1e-5

    def pause(self) -> None:
        self.polls += 1
        if self.polls <= 20:
            os.sched_yield()
        else:
            time.sleep(self.nap)
            self.nap = min(2e-4, 2 * self.nap)


class RemoteRankError(RuntimeError):
    """Raised on every rank when another rank of the same solve failed."""


# -- reproducible (rank-count independent) summation ------------------------

_BIN_BITS = 24  # bits per bin: up to 2**29 values sum exactly in a float64 bin
_BIN_EMIN = -1080  # exponent of the lowest bin (below the smallest subnormal, 2**-1074)
_N_BINS = -(-(1024 - _BIN_EMIN) // _BIN_BITS)


def exact_bins(values) -> np.ndarray:
    """Split a sum of floats into integer-valued bins that add exactly in any order.

    Every finite ``x`` is cut into pieces ``x = sum_b q_b 2**(E_b)`` with
    fixed bin exponents ``E_b = -1080 + 24 b`` and integers ``|q_b| < 2**24``.
    Adding the ``q_b`` of up to ``2**29`` values in one float64 is exact, so the
    bins of several ranks can be added by an ordinary MPI sum in any order and
    :func:`bins_value` turns them into the correctly rounded total. The last
    entry carries the sum of the non-finite values (NaN / Inf propagate).

    Returns a float64 array of shape ``(_N_BINS + 1,)``.

    >>> x = np.array([1e16, 1.0, -1e16])
    >>> bins_value(exact_bins(x)), float(np.sum(x))
    (1.0, 0.0)
    """
    x = np.asarray(values, dtype=np.float64).ravel()
    bins = np.zeros(_N_BINS + 1)
    finite = np.isfinite(x)
    if not finite.all():
        bins[-1] = np.sum(x[~finite])
        x = x[finite]
    x = x[x != 0.0]
    if x.size == 0:
        return bins
    a, sign = np.abs(x), np.sign(x)
    _, e = np.frexp(a)  # a < 2**e, lowest bit >= 2**(e - 53)
    b_lo = max((int(e.min()) - 53 - _BIN_EMIN) // _BIN_BITS, 0)
    b_hi = min((int(e.max()) - 1 - _BIN_EMIN) // _BIN_BITS, _N_BINS - 1)
    for b in range(b_lo, b_hi + 1):
        e_b = _BIN_EMIN + b * _BIN_BITS
        top = e_b + _BIN_BITS
        rem = np.fmod(a, math.ldexp(1.0, top)) if top <= 1023 else a  # exact
        q = np.floor(np.ldexp(rem, -e_b))  # integer in [0, 2**24): exact
        bins[b] = np.sum(sign * q)  # |sum| < 2**53: exact in any order
    return bins


def bins_value(bins: np.ndarray) -> float:
    """The correctly rounded value of bins made by :func:`exact_bins` (and summed)."""
    special = float(bins[-1])
    nz = np.flatnonzero(bins[:-1])
    try:
        total = math.fsum(math.ldexp(float(bins[b]), _BIN_EMIN + int(b) * _BIN_BITS) for b in nz)
    except OverflowError:
        total = math.copysign(math.inf, float(bins[nz[-1]]))
    return total + special if special != 0.0 else total


# -- interface ----------------------------------------------------------------


class Communicator(ABC):
    """What the solver needs from a communicator along the time axis."""

    rank: int = 0
    size: int = 1

    def open(self, failure: BaseException | None = None, signature=None) -> None:
        """Start one solve (collective).

        Every rank calls this after checking its input locally, passing the
        exception it got (``failure``) or None, and a ``signature`` of the
        arguments that must agree on all ranks. If any rank failed, the other
        ranks raise :class:`RemoteRankError` (the failed rank re-raises its own
        exception after this returns). Nothing is sent before this point.
        """

    def close(self, error: BaseException | None = None) -> None:
        """End one solve: release the channel; after an ``error``, tell the other ranks."""

    @abstractmethod
    def send(self, x, dest: int, tag: int) -> None:
        """Start sending a copy of state ``x`` to rank ``dest`` (non-blocking)."""

    @abstractmethod
    def recv(self, like, source: int, tag: int):
        """Receive a state shaped, typed and placed like ``like`` from ``source``."""

    @abstractmethod
    def allreduce(self, value: float, op: str = "sum") -> float:
        """Sum (``op="sum"``) or maximum (``op="max"``) of a float over all ranks."""

    def sum_exact(self, values) -> float:
        """Correctly rounded sum of all ``values`` of all ranks.

        The result does not depend on the number of ranks or on how the
        values are distributed over them (bit for bit).
        """
        x = np.asarray(values, dtype=np.float64).ravel()
        if np.isfinite(x).all():
            return math.fsum(x.tolist())  # correctly rounded too: equals bins_value(exact_bins(x))
        return bins_value(exact_bins(x))

    def max(self, values) -> float:
        """Largest of all ``values`` of all ranks (``-inf`` when there are none;
        ``inf`` when any value is NaN or infinite)."""
        return _local_max(values)

    def notify_failure(self, exc: BaseException) -> None:
        """Tell the other ranks that this one failed (no-op on one process)."""

    def finish(self) -> None:
        """Complete every outstanding send and confirm that every rank got here."""

    def gather(self, obj, root: int | None = 0):
        """Gather a Python object to ``root`` (or to all ranks when ``root`` is None)."""
        return [obj]

    def bcast(self, obj, root: int = 0):
        """``obj`` of rank ``root`` on every rank (pickled; listens for failures while waiting)."""
        return obj


def _local_max(values) -> float:
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size == 0:
        return -math.inf
    if not np.isfinite(x).all():
        return math.inf
    return float(x.max())


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


# -- states as byte buffers ---------------------------------------------------


def _byte_view(x):
    """A flat uint8 view of the contiguous array or CPU / CUDA tensor ``x`` (shares memory)."""
    if B.is_torch(x):
        import torch

        v = x.reshape(-1).view(torch.uint8)
        return v if v.is_cuda else v.numpy()
    return x.reshape(-1).view(np.uint8)


def args_signature(*items) -> int:
    """A checksum of the arguments that must be equal on every rank of a solve
    (``bytes`` items, such as a time grid's buffer, enter through their CRC)."""
    parts = [zlib.crc32(x) if isinstance(x, (bytes, bytearray)) else x for x in items]
    return zlib.crc32(repr(parts).encode())


class MPIComm(Communicator):
    """mpi4py communicator along the time axis.

    States travel as raw bytes (numpy arrays and torch tensors alike, any
    dtype), non-blocking, copied at send time. Each solve works on a private
    duplicate of ``comm`` (all ranks of ``comm`` must call the solve); between
    solves, :meth:`send`, :meth:`recv` and :meth:`bcast` use ``comm`` itself
    (tags 0x7A00 and 0x7A01 are reserved there).

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
        The layer (time) communicator.
    cuda_aware : bool, optional
        Send CUDA tensors directly (the MPI library must be CUDA-aware).
        Default: the environment variable ``MGRIT_CUDA_AWARE_MPI=1``.
        Otherwise CUDA tensors are copied to host memory to be sent and
        copied back to their device when received.
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
        # channel stack: ``comm`` itself at the bottom, one private duplicate per running solve;
        # each with its list of outstanding sends (request, buffer)
        self._channels: list = [comm]
        self._sends: list = [[]]

    # -- phases of a solve ------------------------------------------------
    def open(self, failure=None, signature=None):
        note = None if failure is None else f"{type(failure).__name__}: {failure}"
        notes = self.comm.allgather((note, signature))
        if failure is not None:
            return
        failed = [(r, n) for r, (n, _) in enumerate(notes) if n is not None]
        if failed:
            r, n = failed[0]
            more = f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else ""
            raise RemoteRankError(f"rank {r} failed{more}: {n}")
        sigs = [s for _, s in notes]
        if any(s != sigs[0] for s in sigs):
            bad = [r for r, s in enumerate(sigs) if s != sigs[0]]
            raise ValueError(
                "the arguments of `solve` differ between ranks (time grid, hierarchy, state "
                f"shape or stopping rule): rank 0 and rank(s) {bad}; every rank must pass the same"
            )
        self._channels.append(self.comm.Dup())
        self._sends.append([])

    def close(self, error=None):
        if len(self._channels) == 1:
            return
        if error is None:
            self._sends.pop()
            self._channels.pop().Free()
            return
        if not isinstance(error, RemoteRankError):
            self.notify_failure(error)
        _ABANDONED.extend(self._sends.pop())  # keep buffers alive; MPI may still use them
        self._channels.pop()  # not freed: it may still have unmatched operations

    @property
    def _c(self):
        return self._channels[-1]

    @property
    def _pending(self) -> list:
        return self._sends[-1]

    # -- failure protocol -------------------------------------------------
    def _check_remote_failure(self) -> None:
        MPI = self._MPI
        status = MPI.Status()
        if self._c.Iprobe(source=MPI.ANY_SOURCE, tag=_ERR_TAG, status=status):
            src = status.Get_source()
            msg = self._c.recv(source=src, tag=_ERR_TAG)
            raise RemoteRankError(f"rank {src} failed: {msg}")

    def _wait(self, req, cancel: bool = False) -> None:
        """Wait for ``req`` while listening for failure notices.

        On a failure notice (or an interrupt) a receive is cancelled; any
        other request is kept alive in ``_ABANDONED``.
        """
        backoff = _Backoff()
        try:
            while not req.Test():
                self._check_remote_failure()
                backoff.pause()
        except BaseException:
            if cancel:
                req.Cancel()
                req.Wait()  # returns at once for a cancelled receive
            else:
                _ABANDONED.append(req)
            raise

    def notify_failure(self, exc):
        if len(self._channels) == 1:
            return  # no solve is running
        msg = f"{type(exc).__name__}: {exc}"
        for r in range(self.size):
            if r != self.rank:
                self._pending.append((self._c.isend(msg, dest=r, tag=_ERR_TAG), None))

    # -- point to point ---------------------------------------------------
    def _send_buffer(self, x):
        """A private contiguous copy of ``x`` that MPI can read while we go on."""
        if B.is_torch(x):
            import torch

            x = x.detach()
            if x.is_cuda and self.cuda_aware:
                buf = x.clone(memory_format=torch.contiguous_format)
                torch.cuda.current_stream(buf.device).synchronize()  # the copy must be done
                return buf
            if x.is_cuda:
                return x.cpu()  # synchronous copy to host memory
            return x.clone(memory_format=torch.contiguous_format)
        return np.array(x, copy=True, order="C")

    def send(self, x, dest, tag):
        buf = self._send_buffer(x)
        req = self._c.Isend([_byte_view(buf), self._MPI.BYTE], dest=dest, tag=tag)
        pending = self._pending
        pending.append((req, buf))
        if len(pending) > 64:
            pending[:] = [(r, b) for r, b in pending if not r.Test()]

    def recv(self, like, source, tag):
        if B.is_torch(like):
            import torch

            on_device = like.is_cuda and self.cuda_aware
            buf = torch.empty(tuple(like.shape), dtype=like.dtype, device=like.device if on_device else "cpu")
        else:
            buf = np.empty(tuple(like.shape), dtype=like.dtype)
        self._wait(self._c.Irecv([_byte_view(buf), self._MPI.BYTE], source=source, tag=tag), cancel=True)
        if B.is_torch(like) and buf.device != like.device:
            return buf.to(device=like.device)
        return buf

    # -- reductions -------------------------------------------------------
    def _iallreduce(self, send: np.ndarray, op) -> np.ndarray:
        recv = np.empty_like(send)
        self._wait(self._c.Iallreduce(send, recv, op=op))
        return recv

    def allreduce(self, value, op="sum"):
        MPI = self._MPI
        out = self._iallreduce(np.array([value], dtype=np.float64), MPI.SUM if op == "sum" else MPI.MAX)
        return float(out[0])

    def sum_exact(self, values):
        return bins_value(self._iallreduce(exact_bins(values), self._MPI.SUM))

    def max(self, values):
        return self.allreduce(_local_max(values), "max")

    # -- end of a solve ---------------------------------------------------
    def finish(self):
        pending = self._pending
        while pending:
            self._wait(pending[0][0])
            pending.pop(0)
        self._wait(self._c.Ibarrier())  # nobody returns while another rank may still fail

    def bcast(self, obj, root=0):
        c = self._c
        if self.rank == root:
            for r in range(self.size):
                if r != root:
                    self._pending.append((c.isend(obj, dest=r, tag=_BCAST_TAG), None))
            return obj
        backoff = _Backoff()
        while not c.Iprobe(source=root, tag=_BCAST_TAG):
            self._check_remote_failure()
            backoff.pause()
        return c.recv(source=root, tag=_BCAST_TAG)

    def gather(self, obj, root=0):
        if root is None:
            return self.comm.allgather(obj)
        return self.comm.gather(obj, root=root)


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
    if not isinstance(layer_size, (int, np.integer)) or layer_size < 1 or size % layer_size:
        raise ValueError(
            f"`layer_size` must divide the communicator size {size}, got {layer_size!r}"
        )
    layer_index, data_index = rank % layer_size, rank // layer_size
    layer_comm = comm.Split(color=data_index, key=layer_index)
    data_comm = comm.Split(color=layer_index, key=data_index)
    return layer_comm, data_comm
