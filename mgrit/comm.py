"""Communicators: the solver is written once against this small interface.

:class:`SerialComm` is the one-process implementation (no messages ever
travel); :class:`MPIComm` wraps an mpi4py communicator. mpi4py is imported
only when an MPI communicator is actually used.

Sessions
--------
Every collective piece of work (one :func:`mgrit.solve`, one halo exchange,
one training step's broadcast ...) runs in a *session*::

    with comm.session(signature):      # open: handshake, take a channel
        comm.send(...); comm.recv(...); comm.allreduce_array(...)
    # normal exit: finish (complete and match every message), release the channel
    # any exception: tell the other ranks, clean the channel up, re-raise

``open(failure, signature)`` / ``close(error)`` are the same two steps
spelled out. A rank whose input is bad must still take part in the handshake,
so a solve reads::

    try:
        check the input, set up                # local work only
    except BaseException as exc:
        comm.open(failure=exc)                 # the others raise RemoteRankError
        raise
    with comm.session(signature):              # = open(signature=...) ... close(...)
        result = run the cycles                # (its comm.finish() is not repeated)

1. **Handshake** (``open``): every rank sends ``(its failure or None, its
   signature, the ids of its clean pooled channels)`` to rank 0 and waits for
   the verdict. If any rank failed, every other rank raises
   :class:`RemoteRankError` (the failed one re-raises its own exception); if
   the signatures differ every rank raises ``ValueError`` (a :class:`Call`
   signature names the collective call, so that the message can say which
   call each rank is in). Otherwise the
   session gets a *channel*: a duplicate of the communicator on which all of
   its messages travel, so that nothing of one session can match a receive of
   another. A channel that every rank holds clean in its pool is reused
   (that is the common case: a loop of sessions costs no ``MPI_Comm_dup``);
   otherwise a new one is duplicated.
2. **Messages**: states (:meth:`~Communicator.send` / :meth:`~Communicator.recv`),
   pickled objects (:meth:`~Communicator.bcast`, :meth:`~Communicator.gather`)
   and reductions, all point to point. Reductions run up a binomial tree to
   rank 0, which combines in a fixed order, and back down: every rank gets the
   same bits. :meth:`~Communicator.sum_exact` and
   :meth:`~Communicator.norm2_exact` reduce exact integer bins, so their values
   do not even depend on the number of ranks. Every channel counts the
   messages it sent to and received from each peer.
3. **Finish** (normal exit): a barrier through rank 0 that also carries the
   counts, so that every rank receives (and discards) any message sent to it
   that it never received; then every own send is completed. Nobody leaves
   while another rank may still fail, and the channel is left empty: it goes
   back to the pool.
4. **Failure** (``close(error)``): a rank whose own code raised sends a
   failure notice to every other rank on the channel (a rank that raised
   :class:`RemoteRankError` sends none). Then every rank runs the *cleanup*:
   it sends each peer the number of messages it sent to it, receives the
   peers' numbers, receives and discards what it has not received yet
   (receives that were interrupted are cancelled; one that had already matched
   a message counts as received), and completes its own sends. The channel
   is then empty and goes back to the pool. The cleanup is bounded by
   :attr:`MPIComm.cleanup_timeout` seconds (and skipped after an alarm, see
   below); past it the channel is abandoned with whatever it still holds
   (it is never freed, so nothing it holds can reach a later channel), and
   :func:`abandoned_channels` counts it. A rank that fails after its block's
   :meth:`~Communicator.finish` (the others may have left their blocks) sends
   its notices and abandons the channel without a cleanup. Channels are
   reused only when every rank released them clean, so that ranks which
   disagree about a channel simply take a new one.

The MPI implementation never blocks without listening: every wait polls for a
failure notice on every open channel (sessions may nest: a solve inside a
session) and for alarms, so an exception on one rank makes every rank raise
:class:`RemoteRankError` within milliseconds instead of hanging. The error
names the failed rank by its rank in ``MPI.COMM_WORLD`` (and in the
communicator, when that differs).

Alarms
------
Outside a session nobody is waiting on a channel, so :meth:`MPIComm.alarm`
tells every other rank "rank r failed" through the communicator's *base
channel*, a private duplicate made once per wrapped communicator (it also
carries the handshakes and the messages sent outside any session). Every wait
of the communicator, handshakes included, raises :class:`RemoteRankError` when
an alarm arrived. An alarm is final: the ranks may have left collective work
half done, so the communicator (the wrapper and its base channel) is unusable
afterwards on every rank; every later call raises. To go on, wrap a new
duplicate of the raw communicator (``as_communicator(raw.Dup())``, collective;
the raw communicator itself never carries any message of this module).

:func:`as_communicator` returns the same :class:`MPIComm` for the same
mpi4py communicator (it is cached as an MPI attribute of that communicator),
so that all parts of a program share its pool and its alarms. Wrapping a
communicator is collective (it duplicates it once).

A rank may fail before it ever wraps the communicator the others are wrapping
(say it cannot read its data before the model is built): it would never join
the duplication. So a process that ends on an unhandled exception also sends
its note to every other rank of ``MPI.COMM_WORLD`` itself, on the one tag
:attr:`Tag.WORLD_ALARM` (the only message of this module on a raw
communicator; a normal exit sends none there, so that programs whose ranks end
at different times are not disturbed). Wrapping listens for it while it
duplicates (``MPI_Comm_idup``) and raises :class:`RemoteRankError` naming the
failed rank when it is a member of the communicator.

Tags
----
See :class:`Tag`: the solver's data tags are level indices (small numbers);
the reserved tags sit at ``0x7A00`` and up; users of the interface take
``Tag.HALO``, ``Tag.GHOST`` or tags from ``Tag.USER`` to :attr:`MPIComm.tag_ub`.
"""
from __future__ import annotations

import atexit
import math
import operator
import os
import pickle
import sys
import time
import weakref
import zlib
from abc import ABC, abstractmethod
from enum import IntEnum
from typing import NamedTuple

import numpy as np

from . import _backend as B


class Tag(IntEnum):
    """Message tags on a communicator's channels.

    ``0 .. Tag.FAILURE - 1``: data; the solver tags its states with the level
    index. ``FAILURE .. GATHER``: reserved for the protocol of this module.
    ``HALO`` and ``GHOST``: for layer-parallel modules (parameter halos and
    ghost states). ``USER`` and above (up to :attr:`MPIComm.tag_ub`, at least
    32767 by the MPI standard): free for users of the interface.
    """

    FAILURE = 0x7A00  #: failure notice of a session (a pickled message)
    BCAST = 0x7A01  #: :meth:`Communicator.bcast`
    REDUCE = 0x7A02  #: reductions (up and down the binomial tree)
    BARRIER = 0x7A03  #: finish: sent-message counts to rank 0 and back
    HANDSHAKE = 0x7A04  #: open / split: (failure, signature, pool) to rank 0, verdict back
    CLEANUP = 0x7A05  #: after a failure: per-peer sent-message counts (not counted themselves)
    ALARM = 0x7A06  #: :meth:`MPIComm.alarm`, on the base channel
    GATHER = 0x7A07  #: :meth:`Communicator.gather`
    WORLD_ALARM = 0x7A08  #: on ``MPI.COMM_WORLD`` itself: a process ended on an unhandled exception
    HALO = 0x7A10  #: layer parameters sent to the ranks that need them
    GHOST = 0x7A11  #: a neighbour's last state
    STATE = 0x7A12  #: :meth:`Communicator.bcast_state`
    USER = 0x7A20  #: first free tag


#: Requests, buffers and channels left behind by failed cleanups. They are
#: kept alive so that MPI never touches freed memory; this only grows on failures.
_ABANDONED: list = []
_N_ABANDONED = [0]


#: MPI communicators of this process with several ranks (weakly held), alarmed when it exits:
#: see :func:`_guard_exit`.
_LIVE: "weakref.WeakSet" = weakref.WeakSet()

#: The note of the alarm a rank sends when its program ends without an unhandled exception.
_EXITED = "<exited>"


def _guard_exit(comm) -> None:
    """Register ``comm`` (MPI, several ranks): when this process ends, every other rank of it
    hears of it (:meth:`MPIComm.alarm`) instead of waiting for it for ever.

    A rank that ends, on an unhandled exception (Python prints the traceback and then
    finalises MPI) or because its program is over (say it skipped a ``backward`` the others
    run), can never answer a rank that waits for it in a handshake or a receive; nobody
    would end the job (``python -m mpi4py`` would, on an exception only: MPI_Abort). The
    alarm of an exception fails the next wait on ``comm``; that of a normal exit only a
    wait in a handshake or inside a session (see :meth:`MPIComm._poll`), or one for a
    message of the rank that ended (:meth:`MPIComm._awaited_exited`), and a rank
    finishing a session ignores both (the rank that left finished that session too): ranks
    that are done with each other exit as before. Over torch.distributed the peers see the
    closed connection instead. (:func:`_alarm_at_exit` is registered when this module is imported.)
    """
    _LIVE.add(comm)


def _alarm_at_exit() -> None:
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)  # set for an unhandled one
    if exc is not None:
        _alarm_world(exc)
    for comm in list(_LIVE):
        try:
            comm.alarm(exc) if exc is not None else comm._alarm(_EXITED)
        except Exception:  # noqa: BLE001 - leaving anyway; the others then see a broken connection
            pass


atexit.register(_alarm_at_exit)  # (mpi4py finalises MPI after every atexit function, whenever registered)

#: World ranks whose process ended on an unhandled exception (received world alarms): see _world_failures.
_WORLD_FAILED: dict = {}


def _alarm_world(exc: BaseException) -> None:
    """Send this process's failure note to every other rank of ``MPI.COMM_WORLD`` (see the module's
    "Alarms"); nothing when mpi4py was never imported, MPI is finalised or the world is one rank."""
    MPI = sys.modules.get("mpi4py.MPI")
    try:
        if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
            return
        world = MPI.COMM_WORLD
        me, size = world.Get_rank(), world.Get_size()
        origin = getattr(exc, "world_rank", None) if isinstance(exc, RemoteRankError) else me
        msg = (me if origin is None else int(origin), _note(exc))
        _ABANDONED.append([world.isend(msg, dest=r, tag=Tag.WORLD_ALARM) for r in range(size) if r != me])
    except Exception:  # noqa: BLE001 - leaving anyway
        pass


def _world_failures(MPI) -> dict:
    """``{world rank: (world rank of the failure it died of, note)}`` of the processes known to have
    ended on an unhandled exception (:data:`_WORLD_FAILED`, after reading the world alarms that
    arrived). A process that died of a RemoteRankError names the rank whose failure it heard of."""
    world, st = MPI.COMM_WORLD, MPI.Status()
    while world.Iprobe(MPI.ANY_SOURCE, Tag.WORLD_ALARM, st):
        src = st.Get_source()
        _WORLD_FAILED[src] = world.recv(source=src, tag=Tag.WORLD_ALARM)
    return _WORLD_FAILED


def _world_failure_note(MPI, members=None, not_of=None) -> tuple | None:
    """``(world rank, note)`` of a known failure among ``members`` (world ranks; None: any), preferring
    a process that failed of its own (not of a RemoteRankError about another's failure); or None.
    ``not_of``: a world rank whose own failure or exit is being reported; processes that died of it
    are its consequences, not news, and are left out."""
    failed = _world_failures(MPI)
    known = [w for w in (failed if members is None else members) if w in failed and failed[w][0] != not_of]
    if not known:
        return None
    w = next((w for w in known if failed[w][0] == w), known[0])
    return w, failed[w][1]


def abandoned_channels() -> int:
    """Number of channels this process abandoned (not freed) after a failure,
    because their cleanup timed out or an alarm made it pointless."""
    return _N_ABANDONED[0]


class _Backoff:
    """Polling rhythm of a wait: for the first 0.5 ms polls that only yield the
    core (low latency), then naps that double from 10 us up to 0.2 ms, so that
    ranks sharing a core (oversubscription) leave it to the ones that work.

    The spell of polling outlasts the longest nap: a rank that answers a
    message is never asleep for longer than its partner keeps polling, so two
    ranks exchanging messages cannot fall into a rhythm of alternate naps.
    """

    SPIN = 5e-4

    def __init__(self):
        self.start = None
        self.nap = 1e-5

    def pause(self) -> None:
        now = time.perf_counter()
        if self.start is None:
            self.start = now
        if now - self.start < self.SPIN:
            os.sched_yield()
        else:
            time.sleep(self.nap)
            self.nap = min(2e-4, 2 * self.nap)


class RemoteRankError(RuntimeError):
    """Raised on every rank when another rank of the same session failed.

    Attributes
    ----------
    rank : int or None
        The failed rank in the communicator of the session.
    world_rank : int or None
        The failed rank in ``MPI.COMM_WORLD``.
    gone : bool
        This rank found the failed rank's process gone itself (over torch.distributed: its
        connection closed), so the other ranks may not know: the library passes it on.
    """

    def __init__(self, message: str = "", rank: int | None = None, world_rank: int | None = None,
                 gone: bool = False):
        super().__init__(message)
        self.rank = rank
        self.world_rank = world_rank
        self.gone = gone

    def __reduce__(self):
        return type(self), (str(self), self.rank, self.world_rank, self.gone)


_NOTE_CHARS = 4000  # a failure note is cut to this: it must travel eagerly (its sender may be gone)


def _note(exc: BaseException) -> str:
    """``"Type: message"`` of ``exc``, at most :data:`_NOTE_CHARS` characters (never raises: an
    exception whose ``__str__`` fails must still reach the other ranks)."""
    try:
        text = str(exc)
    except Exception as err:  # noqa: BLE001 - a user's __str__ may raise anything
        text = f"<its str() failed: {type(err).__name__}>"
    note = f"{type(exc).__name__}: {text}"
    if len(note) > _NOTE_CHARS:
        note = f"{note[:_NOTE_CHARS]}... ({len(note)} characters)"
    return note


# -- reproducible (rank-count independent) summation ------------------------

_BIN_BITS = 24  # bits per bin: up to 2**29 values sum exactly in a float64 bin
_BIN_EMIN = -1080  # exponent of the lowest bin (below the smallest subnormal, 2**-1074)
_N_BINS = -(-(1024 - _BIN_EMIN) // _BIN_BITS)


def exact_bins(values) -> np.ndarray:
    """Split a sum of floats into integer-valued bins that add exactly in any order.

    Every finite ``x`` is cut into pieces ``x = sum_b q_b 2**(E_b)`` with
    fixed bin exponents ``E_b = -1080 + 24 b`` and integers ``|q_b| < 2**24``.
    Adding the ``q_b`` of up to ``2**29`` values in one float64 is exact, so the
    bins of several ranks can be added in any order and :func:`bins_value`
    turns them into the correctly rounded total. The last entry carries the
    sum of the non-finite values (NaN / Inf propagate).

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


# Squares of floats reach 2**2048 and go down to 2**-2200 (the lowest bit of the
# rounded square of the smallest subnormal): the same 24-bit grid, extended.
_SQ_EMIN = _BIN_EMIN - 47 * _BIN_BITS  # -2208
_N_SQ_BINS = (2047 - _SQ_EMIN) // _BIN_BITS + 1  # the top bin holds bit 2047
_SAFE = 2.0 ** 500  # squares of magnitudes in [1/_SAFE, _SAFE] neither overflow nor underflow


def square_bins(values) -> np.ndarray:
    """Exact integer bins of the sum of the rounded squares of ``values``.

    Each ``x = m 2**e`` (``frexp``) contributes ``fl(m**2) 2**(2e)``, which is
    ``fl(x**2)`` whenever that is a normal float, and which never overflows or
    underflows: it is cut into four 24-bit integer pieces on the grid
    ``E_b = -2208 + 24 b`` (wide enough for every square of a double). Like
    :func:`exact_bins`, bins of several ranks add exactly in any order;
    :func:`square_bins_root` gives the square root of the total. The last entry
    carries the sum of the squares of the non-finite values.
    """
    x = np.abs(np.asarray(values, dtype=np.float64).ravel())
    if x.size <= _FEW:
        few = _square_bins_few(x.tolist())
        if few is not None:
            return few
    bins = np.zeros(_N_SQ_BINS + 1)
    finite = np.isfinite(x)
    if not finite.all():
        bins[-1] = np.sum(x[~finite] ** 2)  # inf or NaN
        x = x[finite]
    x = x[x != 0.0]
    if x.size == 0:
        return bins
    m, e = np.frexp(x)
    sq = m * m  # fl(m**2) in [0.25, 1)
    t = 2 * e.astype(np.int64) - _SQ_EMIN  # the square is sq * 2**(t + _SQ_EMIN)
    b = t // _BIN_BITS
    y = np.ldexp(sq, (t - b * _BIN_BITS).astype(np.int32))  # sq 2**r, r < 24: exact, < 2**24
    for k in range(4):  # 53 bits shifted by r < 24 span at most four bins: b, b-1, b-2, b-3
        q = np.floor(y)  # integer < 2**24
        ok = q != 0.0
        bins[:-1] += np.bincount(b[ok] - k, weights=q[ok], minlength=_N_SQ_BINS)  # exact
        y = (y - q) * 2.0 ** _BIN_BITS  # exact
    return bins


_FEW = 64  # up to this many values (a rank's C-point norms, typically) integer arithmetic is faster


def _square_bins_few(values: list) -> np.ndarray | None:
    """:func:`square_bins` of a few finite values with Python integers (None if one is not finite).

    The total of the rounded squares ``fl(m**2) 2**(2e)`` is formed exactly as an integer
    multiple of ``2**_SQ_EMIN`` and cut into 24-bit pieces: other bins than the vectorised
    path's, with the same exact total, so bins of both kinds add up alike.
    """
    n = 0
    for v in values:
        if v == 0.0:
            continue
        if not math.isfinite(v):
            return None
        m, e = math.frexp(v)
        num, den = (m * m).as_integer_ratio()  # den = 2**k, k <= 55: the shift below is >= 7
        n += num << (2 * e - _SQ_EMIN - den.bit_length() + 1)
    bins = np.zeros(_N_SQ_BINS + 1)
    if n:
        b = ((n & -n).bit_length() - 1) // _BIN_BITS  # the lowest nonzero bin
        n >>= b * _BIN_BITS
        while n:
            bins[b] = n & ((1 << _BIN_BITS) - 1)
            n >>= _BIN_BITS
            b += 1
    return bins


def square_bins_root(bins: np.ndarray) -> float:
    """``sqrt`` of the (correctly rounded) total of bins made by :func:`square_bins`.

    The total is formed exactly as an integer and scaled by a power of four
    before rounding, so there is no overflow and, when the total is a normal
    float, the result is exactly ``math.sqrt`` of its correctly rounded value.
    """
    special = float(bins[-1])
    if special != 0.0 or math.isnan(special):
        return math.sqrt(special)  # inf or NaN
    n = 0
    for b in np.flatnonzero(bins[:-1]):
        n += int(bins[b]) << (_BIN_BITS * int(b))  # exact: the bins are integers
    if n == 0:
        return 0.0
    j = (n.bit_length() - 1 + _SQ_EMIN) // 2  # total = n 2**_SQ_EMIN ~ 4**j
    k = _SQ_EMIN - 2 * j
    scaled = float(n << k) if k >= 0 else n / (1 << -k)  # correctly rounded, in [1, 4)
    try:
        return math.ldexp(math.sqrt(scaled), j)
    except OverflowError:
        return math.inf


def _norm2_local(values) -> float:
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size == 0:
        return 0.0
    a = np.abs(x)
    nz = a[a != 0.0]
    if np.isfinite(a).all() and (nz.size == 0 or (nz.max() <= _SAFE and nz.min() >= 1.0 / _SAFE)):
        try:
            total = math.fsum((x * x).tolist())  # the same value, faster
        except OverflowError:
            total = math.inf
        if total < math.inf:
            return math.sqrt(total)
    return square_bins_root(square_bins(x))


# -- interface ----------------------------------------------------------------


class Communicator(ABC):
    """What the solver (and a layer-parallel module) needs from a communicator.

    All methods but :meth:`send`, :meth:`recv`, :meth:`world_rank` and
    :meth:`alarm` are collective: every rank calls them in the same order.
    """

    rank: int = 0
    size: int = 1
    #: Seconds this rank has spent in this communicator's waits for other ranks since it was made:
    #: for a message that has not arrived, a send not yet taken, a handshake or reduction whose
    #: slower ranks have not reached it (views of it, such as a solve's inside a session, add to
    #: it too). Always 0.0 on one process. A diagnostic: read it before and after a pass, on
    #: every rank, and the pass's time minus the difference is the rank's own work.
    waited: float = 0.0

    # -- sessions -------------------------------------------------------------
    def open(self, failure: BaseException | None = None, signature=None, share=None) -> list | None:
        """Start a session (collective): the handshake.

        Every rank calls this after checking its input locally, passing the
        exception it got (``failure``) or None, and a ``signature`` of the
        arguments that must agree on all ranks. If any rank failed, the other
        ranks raise :class:`RemoteRankError` (the failed rank re-raises its own
        exception after this returns, and no session is opened). If the
        signatures differ every rank raises ``ValueError``. Nothing is sent
        before this point.

        ``share`` (any picklable object) travels with the handshake: every
        rank gets the list of all ranks' ``share``, in rank order, as the
        return value (an all-gather that costs no message of its own). The
        rank that failed gets None.
        """
        return None if failure is not None else [share]

    def close(self, error: BaseException | None = None) -> None:
        """End the innermost session.

        ``close()``: :meth:`finish` (if not just done) and release the channel.
        ``close(error)``: tell the other ranks (unless ``error`` is a
        :class:`RemoteRankError`: they know), clean the channel up (bounded
        in time) and release it. Does not raise ``error``.
        """

    def session(self, signature=None, share=None) -> "Session":
        """A context manager around one collective piece of work.

        On entry :meth:`open` (the handshake; raises :class:`RemoteRankError`
        if a rank's handshake was interrupted by a failure). On normal exit
        :meth:`finish` and :meth:`close`. On any exception (``BaseException``:
        interrupts too) inside the block, :meth:`close` with it (the other
        ranks, waiting anywhere in their own block, raise
        :class:`RemoteRankError` within milliseconds), then the exception
        propagates. Sessions nest (a solve inside a session opens its own;
        through :class:`InSession` it runs inside the open one instead).
        The value of the ``with`` statement is the communicator; with a
        ``share`` (see :meth:`open`), the session's ``shared`` attribute holds
        every rank's after entry.

        >>> with SerialComm().session() as c:
        ...     c.allreduce(2.0)
        2.0
        """
        return Session(self, signature, share)

    def _depth(self) -> int:
        """Number of open sessions (the serial communicator keeps none)."""
        return 0

    # -- messages -------------------------------------------------------------
    @abstractmethod
    def send(self, x, dest: int, tag: int) -> None:
        """Start sending a copy of state ``x`` to rank ``dest`` (non-blocking)."""

    @abstractmethod
    def recv(self, like, source: int, tag: int):
        """Receive a state shaped, typed and placed like ``like`` from ``source``."""

    @abstractmethod
    def allreduce(self, value: float, op: str = "sum") -> float:
        """Sum (``op="sum"``) or maximum (``op="max"``) of a float over all ranks
        (the same value on every rank)."""

    def allreduce_array(self, x):
        """Elementwise sum of the array ``x`` over all ranks, the same bits on every rank.

        ``x`` is a numpy array (or a torch tensor, returned as one on its
        device); the result is a new array of the same shape and dtype. Works
        inside and outside a session and listens for failures and alarms
        while it waits.
        """
        if B.is_torch(x):
            return x.detach().clone()
        return np.array(x, copy=True)

    def sum_exact(self, values) -> float:
        """Correctly rounded sum of all ``values`` of all ranks.

        The result does not depend on the number of ranks or on how the
        values are distributed over them (bit for bit).
        """
        x = np.asarray(values, dtype=np.float64).ravel()
        if np.isfinite(x).all():
            return math.fsum(x.tolist())  # correctly rounded too: equals bins_value(exact_bins(x))
        return bins_value(exact_bins(x))

    def norm2_exact(self, values) -> float:
        """``sqrt`` of the sum of the squares of all ``values`` of all ranks, without overflow.

        Equals ``math.sqrt(math.fsum(x * x))`` over all values whenever no
        square over- or underflows (bit for bit, whatever the number of
        ranks); otherwise it is the square root of the correctly rounded sum
        of the squares rounded to 53 bits (finite for values up to the largest
        float; a NaN or Inf anywhere gives NaN or Inf).
        """
        return _norm2_local(values)

    def max(self, values) -> float:
        """Largest of all ``values`` of all ranks (``-inf`` when there are none;
        ``inf`` when any value is NaN or infinite)."""
        return _local_max(values)

    def exact_many(self, parts: list, kind: str) -> list:
        """:meth:`norm2_exact` (``kind="norm2"``), :meth:`sum_exact` (``"sum"``) or
        :meth:`max` (``"max"``) of every entry of ``parts`` (each rank passes as many),
        in one reduction. Each value equals the single call's, bit for bit.
        """
        _check_kind(kind)
        single = {"norm2": self.norm2_exact, "sum": self.sum_exact, "max": self.max}[kind]
        return [single(v) for v in parts]

    def notify_failure(self, exc: BaseException) -> None:
        """Tell the other ranks of the innermost session that this one failed
        (no-op outside a session and on one process)."""

    def finish(self) -> None:
        """Complete every outstanding send, receive (and discard) every message sent
        to this rank but never received, and confirm that every rank got here."""

    def gather(self, obj, root: int | None = 0):
        """Gather a Python object to ``root`` (or to all ranks when ``root`` is None);
        None on the other ranks."""
        return [obj]

    def bcast(self, obj, root: int = 0):
        """``obj`` of rank ``root`` on every rank (pickled; listens for failures while waiting)."""
        return obj

    def bcast_state(self, x, like, root: int = 0):
        """State ``x`` of rank ``root`` on every rank, sent as raw bytes (not pickled).

        ``like`` (any rank) gives the shape, dtype and device of the result on
        the receiving ranks; ``x`` is ignored there. Costs ``size - 1``
        messages from ``root``, each a state; use it inside a session.
        """
        if self.size == 1:
            return x
        if self.rank == root:
            for r in range(self.size):
                if r != root:
                    self.send(x, r, Tag.STATE)
            return x
        return self.recv(like, root, Tag.STATE)

    # -- failures outside sessions -----------------------------------------------
    def alarm(self, exc: BaseException) -> None:
        """Tell every other rank that this one failed with ``exc`` (not collective).

        Their current or next wait on this communicator raises
        :class:`RemoteRankError`. The communicator is unusable afterwards, on
        every rank. No-op on one process.
        """

    # -- communicators -------------------------------------------------------------
    def split(self, color: int, key: int = 0) -> "Communicator | None":
        """Ranks with the same ``color`` form a new communicator, ordered by ``key``
        (collective). None for ``color`` = ``MPI.UNDEFINED`` (or None). Free it with :meth:`free`."""
        color, key, failure = split_arguments(color, key)
        if failure is not None:
            raise failure
        return None if color is None else SerialComm()

    def reversed(self) -> "Communicator":
        """The same ranks in reverse order (collective): rank ``r`` becomes
        ``size - 1 - r``. Free it with :meth:`free`."""
        return self.split(0, self.size - 1 - self.rank)

    def free(self) -> None:
        """Release the MPI resources of this communicator (collective); it is
        unusable afterwards. A communicator made by :meth:`split` or
        :meth:`reversed` frees its MPI communicator too."""

    def world_rank(self, r: int | None = None) -> int:
        """Rank in ``MPI.COMM_WORLD`` of rank ``r`` of this communicator (default: this rank)."""
        return self.rank if r is None else int(r)


class Session:
    """The context manager of :meth:`Communicator.session`."""

    __slots__ = ("comm", "signature", "share", "shared", "depth")

    def __init__(self, comm: Communicator, signature=None, share=None):
        self.comm, self.signature, self.share, self.shared, self.depth = comm, signature, share, None, None

    def __enter__(self) -> Communicator:
        self.depth = self.comm._depth()
        if self.share is None:  # (communicators written before `share` existed keep working)
            self.shared = self.comm.open(signature=self.signature)
        else:
            self.shared = self.comm.open(signature=self.signature, share=self.share)
        return self.comm

    def __exit__(self, exc_type, exc, tb) -> bool:
        c = self.comm
        while c._depth() > self.depth + 1:  # a nested session left open: close it first
            c.close(exc if exc is not None else RuntimeError("a nested session was left open"))
        if c._depth() <= self.depth:
            return False  # closed inside the block
        if exc is None:
            c.close()  # finish + release; on a failure in finish it cleans up and raises
        else:
            c.close(exc)
        return False


class InSession(Communicator):
    """``comm`` seen from inside the session that is open on it.

    A collective call that opens its own session (:func:`mgrit.solve`) runs,
    through this view, inside the caller's session instead: its ``open`` is
    no handshake, its ``finish`` and ``close`` no closing barrier. Its
    messages travel on the caller's channel, and the caller's session does
    both jobs for it: a failure on one rank (in the solve's set-up or its
    cycles) propagates out of the solve on that rank and the enclosing
    session tells every other rank (they raise :class:`RemoteRankError`
    wherever they wait); the enclosing session's finish drains and confirms
    everything. A solve on a communicator of ``P`` ranks saves two
    synchronisations of all ranks this way (``4 (P - 1)`` messages).

    What the view gives up is the solve's own argument check (the signature
    of its handshake): ranks that pass different arguments (another number
    of cycles, state shape or time grid) would wait for messages that never
    come. So the caller opens its session with a ``signature`` covering
    everything the solve needs every rank to agree on (as the layer-parallel
    modules do), and every rank raises ``ValueError`` in that handshake
    instead. A ``share`` given to :meth:`open` (every rank gives one, or none)
    is all-gathered on the open session's channel, since there is no
    handshake to carry it. Everything else is delegated to ``comm``.
    """

    def __init__(self, comm: Communicator):
        self.comm, self.rank, self.size = comm, comm.rank, comm.size

    @property
    def waited(self) -> float:
        """The viewed communicator's :attr:`Communicator.waited` (its waits are this view's)."""
        return self.comm.waited

    def open(self, failure=None, signature=None, share=None):
        if self.size > 1 and self.comm._depth() == 0:
            raise RuntimeError("InSession needs a session open on its communicator (`with comm.session():`)")
        if failure is not None:
            return None
        if share is not None and self.size > 1:  # no handshake to ride on: an all-gather in the open session
            return self.comm.gather(share, root=None)
        return [share]

    def close(self, error=None):
        pass  # the enclosing session closes (and, with ``error``, tells the others)

    def finish(self):
        pass  # the enclosing session's finish

    def _depth(self):
        return self.comm._depth()

    def send(self, x, dest, tag):
        self.comm.send(x, dest, tag)

    def recv(self, like, source, tag):
        return self.comm.recv(like, source, tag)

    def allreduce(self, value, op="sum"):
        return self.comm.allreduce(value, op)

    def allreduce_array(self, x):
        return self.comm.allreduce_array(x)

    def sum_exact(self, values):
        return self.comm.sum_exact(values)

    def norm2_exact(self, values):
        return self.comm.norm2_exact(values)

    def max(self, values):
        return self.comm.max(values)

    def exact_many(self, parts, kind):
        return self.comm.exact_many(parts, kind)

    def notify_failure(self, exc):
        self.comm.notify_failure(exc)

    def gather(self, obj, root=0):
        return self.comm.gather(obj, root)

    def bcast(self, obj, root=0):
        return self.comm.bcast(obj, root)

    def bcast_state(self, x, like, root=0):
        return self.comm.bcast_state(x, like, root)

    def alarm(self, exc):
        self.comm.alarm(exc)

    def split(self, color, key=0):
        return self.comm.split(color, key)

    def free(self):
        raise RuntimeError("free the communicator an InSession view was made from, not the view")

    def world_rank(self, r=None):
        return self.comm.world_rank(r)


class ReversedInSession(InSession):
    """:class:`InSession` with the ranks in reverse order: rank ``r`` of the view is rank
    ``size - 1 - r`` of ``comm``.

    What :meth:`Communicator.reversed` numbers, without a communicator of its
    own: the messages travel on the channel of the session open on ``comm``.
    A solve backwards in time (the adjoint of a layer-parallel module) runs on
    it inside the caller's session, so it needs neither a handshake nor a
    closing barrier of its own, and a failure anywhere in the caller's
    session reaches it. Errors name ranks as ``comm`` numbers them (the
    numbering the caller knows). Reductions are those of ``comm``: their
    values do not depend on the numbering (:meth:`Communicator.sum_exact` and
    :meth:`Communicator.norm2_exact` are exact).
    """

    def __init__(self, comm: Communicator):
        super().__init__(comm)
        self.rank = comm.size - 1 - comm.rank

    def _peer(self, r: int) -> int:
        return self.size - 1 - r

    def send(self, x, dest, tag):
        self.comm.send(x, self._peer(dest), tag)

    def recv(self, like, source, tag):
        return self.comm.recv(like, self._peer(source), tag)

    def gather(self, obj, root=0):
        parts = self.comm.gather(obj, None if root is None else self._peer(root))
        return None if parts is None else parts[::-1]

    def bcast(self, obj, root=0):
        return self.comm.bcast(obj, self._peer(root))

    def bcast_state(self, x, like, root=0):
        return self.comm.bcast_state(x, like, self._peer(root))

    def split(self, color, key=0):
        raise RuntimeError("split the communicator a ReversedInSession view was made from, not the view")

    def world_rank(self, r=None):
        return self.comm.world_rank(None if r is None else self._peer(r))


def _check_kind(kind: str) -> None:
    if kind not in ("norm2", "sum", "max"):
        raise ValueError(f"`kind` must be 'norm2', 'sum' or 'max', got {kind!r}")


def _non_member(obj) -> bool:
    """``obj`` is torch.distributed's stand-in for a group on a rank outside it (an int, -100)."""
    import sys

    dist = sys.modules.get("torch.distributed")
    member = getattr(dist, "GroupMember", None) if dist is not None else None
    return member is not None and isinstance(obj, int) and obj == getattr(member, "NON_GROUP_MEMBER", object())


def _equal(a, b) -> bool:
    """``a == b`` as one bool, False where that raises (arrays): what :meth:`agree` compares."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - not comparable: not the same
        return False


def _local_max(values) -> float:
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size == 0:
        return -math.inf
    if not np.isfinite(x).all():
        return math.inf
    return float(x.max())


class SerialComm(Communicator):
    """The single-process communicator: there is never anyone to talk to.

    Sessions are no-ops, :meth:`split` and :meth:`reversed` return a
    SerialComm, :meth:`alarm` does nothing.
    """

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


class Call(NamedTuple):
    """A session signature that names its collective call.

    ``what`` names the call for a person (``"the backward pass of LayerParallel
    #0 (16 layers)"``), ``args`` is what every rank must agree on within the
    call (compared, never shown: often an :func:`args_signature`), ``agree``
    says in words what that is. When the ranks' handshakes carry different
    ``what`` they are at different collective calls, and the error names the
    call of every rank; with the same ``what`` and different ``args`` it names
    the call and ``agree``.

    >>> Call("mgrit.solve", 7, "the time grid") == Call("mgrit.solve", 7, "the time grid")
    True
    """

    what: str
    args: object = None
    agree: str = ""


def _rank_list(ranks) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _same(a, b) -> bool:
    """``a == b`` for any two signatures (numpy arrays, objects whose ``==`` raises: their pickles)."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a user's signature may compare in any way
        try:
            protocol = pickle.HIGHEST_PROTOCOL
            return pickle.dumps(a, protocol=protocol) == pickle.dumps(b, protocol=protocol)
        except Exception:  # noqa: BLE001
            return False


def _text(x) -> str:
    try:
        return str(x)
    except Exception:  # noqa: BLE001 - a user's object may fail to print
        return object.__repr__(x)


def _groups(values: list) -> list:
    """``[(value, ranks holding it)]`` in order of first appearance (values need not be hashable)."""
    out: list = []
    for r, v in enumerate(values):
        for u, rs in out:
            if _same(u, v):
                rs.append(r)
                break
        else:
            out.append((v, [r]))
    return out


def mismatch_message(signatures: list) -> str | None:
    """The error of a handshake whose ranks' ``signatures`` (in rank order) differ; None when
    they agree. Names each rank's call where the signatures are :class:`Call` values. Never
    raises (rank 0 builds it for every rank: an exception there would leave the others waiting)."""
    try:
        return _mismatch_message(signatures)
    except Exception:  # noqa: BLE001
        return ("the arguments of this collective call differ between ranks (or ranks are at different "
                "collective calls); every rank must make the same calls in the same order, with the same arguments")


def _mismatch_message(signatures: list) -> str | None:
    groups = _groups(signatures)
    if len(groups) == 1:
        return None
    calls = all(isinstance(s, Call) for s in signatures)
    whats = _groups([_text(s.what) if isinstance(s, Call) else None for s in signatures])
    if calls and len(whats) == 1:
        first = signatures[0]
        against = " against ".join(_rank_list(rs) for _, rs in groups)
        agree = _text(first.agree) if first.agree else "arguments"
        return (f"the arguments of {_text(first.what)} differ between ranks ({against}): different "
                f"{agree}; every rank must pass the same")
    if any(w is not None for w, _ in whats):
        where = "; ".join(f"{_rank_list(rs)} in {w or 'another collective call (a session of your own)'}"
                          for w, rs in whats)
        return (f"the collective calls differ between ranks: {where}. Every rank must make the same collective "
                "calls in the same order: one rank skipped a call the others made (a backward pass, an evaluation, "
                "to_serial, a checkpoint) or called another block first. Build the LayerParallel and ParallelGRU "
                "modules in the same order on every rank, keep train() / eval() alike on every rank, and call them "
                "in the same order")
    against = " against ".join(_rank_list(rs) for _, rs in groups)
    return (f"the signatures of this collective call differ between ranks ({against}): every rank must "
            "pass the same signature to its session, or ranks are at different collective calls (one skipped a "
            "call the others made)")


def split_arguments(color, key) -> tuple:
    """``(color, key, failure)`` of :meth:`Communicator.split` as integers, color None for None or a
    negative one (``MPI.UNDEFINED``); ``failure`` the TypeError for arguments that are not integers, the
    ValueError for integers beyond 32 bits (raised by the split after the ranks' exchange, so that no
    rank waits in the engine's split).

    >>> split_arguments(2, 0), split_arguments(-32766, 1)[:2], type(split_arguments(1.5, 0)[2]).__name__
    ((2, 0, None), (None, 1), 'TypeError')
    >>> type(split_arguments(2 ** 40, 0)[2]).__name__, split_arguments(-(2 ** 40), 0)
    ('ValueError', (None, 0, None))
    """
    try:
        c = None if color is None else operator.index(color)
        k = operator.index(key)
    except TypeError:
        return None, 0, TypeError(f"split(color, key) takes integers (color None or negative: no new "
                                  f"communicator), got color {color!r}, key {key!r}")
    if not (-(2 ** 31) <= k < 2 ** 31 and (c is None or c < 2 ** 31)):  # (MPI's are C ints; a negative color
        #                                                                   never reaches MPI: undefined)
        return None, 0, ValueError(f"split(color, key) takes integers of 32 bits (MPI's are C ints), got color "
                                   f"{color!r}, key {key!r}")
    return (None if c is None or c < 0 else c), k, None


def args_signature(*items) -> int:
    """A checksum of the arguments that must be equal on every rank of a solve
    (``bytes`` items, such as a time grid's buffer, enter through their CRC)."""
    parts = [zlib.crc32(x) if isinstance(x, (bytes, bytearray)) else x for x in items]
    return zlib.crc32(repr(parts).encode())


class _Channel:
    """A private duplicate of the communicator and its bookkeeping: the
    messages sent to / received from every peer (all tags but CLEANUP,
    cumulative over the channel's life) and the outstanding sends."""

    __slots__ = ("comm", "id", "sent", "recvd", "sends", "finished")

    def __init__(self, comm, cid: int, size: int):
        self.comm, self.id = comm, cid
        self.sent = [0] * size
        self.recvd = [0] * size
        self.sends: list = []  # (request, buffer) pairs
        self.finished = False  # finish() done and nothing sent or received since


_POOL_SIZE = 4  # clean channels kept per communicator for later sessions
_KEYVAL: list = []  # the MPI attribute key under which as_communicator caches its wrapper


def _keyval(MPI) -> int:
    if not _KEYVAL:
        _KEYVAL.append(MPI.Comm.Create_keyval())  # not copied by Dup
    return _KEYVAL[0]


class _SessionComm(Communicator):
    """The engine-independent half of the session protocol (module docstring):
    the handshake's verdict, ``close``, ``finish``, the reductions built on a
    tree ``_reduce``, and ``send`` / ``recv`` / ``bcast`` / ``gather``.
    :class:`MPIComm` and ``mgrit.torch_dist.TorchDistComm`` supply the engine
    half: ``_stack`` / ``_top`` (open channels), ``_broken`` (an alarm),
    ``_usable``, ``_reduce(x, op)``, ``_finish``, ``_notify``, ``_cleanup``,
    ``_release``, ``_abandon``, ``_isend`` / ``_recv_into`` / ``_isend_obj`` /
    ``_recv_obj`` / ``_send_buffer``, and the hooks ``_before_post``,
    ``_device_buffers`` and ``_after_object_sends``."""

    _finishing = False  # in finish() of the innermost session
    _handshaking = False  # in the handshake of a session (or of split)
    _exited: frozenset = frozenset()  # ranks whose program ended (their exit alarms), see MPIComm._poll

    @staticmethod
    def _verdict(notes: list):
        failed = [(r, n) for r, (n, *_) in enumerate(notes) if n is not None]
        bad = None if failed else mismatch_message([s for _, s, *_ in notes])  # (never raises)
        common = set(notes[0][2]).intersection(*(set(p) for _, _, p, *_ in notes[1:]))
        reuse = max(common) if common else None
        return failed, bad, reuse, max(i for *_, i, _ in notes), [sh for *_, sh in notes]

    def _can_clean(self, ch) -> bool:
        """Whether a failed channel can be cleaned up (False: abandon it)."""
        return True

    def _handshake(self, ch, failure, signature, next_id, share=None):
        """The handshake on channel ``ch``: every rank's (failure, signature, pool,
        next channel id, share) to rank 0, its verdict back. Returns ``(reuse, new_id,
        shares)``: the pooled channel every rank holds clean (or None), the id for a new
        one and every rank's ``share``; None on a rank that failed. Raises when another
        rank failed or the signatures differ."""
        bad_share = None
        if failure is None and share is not None:
            try:  # an object that cannot travel fails this rank here, not in the middle of the handshake
                pickle.dumps(share, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # noqa: BLE001 - pickle raises many kinds
                bad_share = TypeError(f"the `share` of a session must be picklable: {exc}")
                failure, share = bad_share, None
        mine = (None if failure is None else _note(failure), signature, tuple(self._pool), next_id,
                None if failure is not None else share)
        failed, bad, reuse, new_id, shares = self._handshake_round(ch, mine)
        self._after_handshake(ch)
        if bad_share is not None:
            raise bad_share
        if failure is not None:
            return None
        self._raise_verdict(failed, bad)
        return reuse, new_id, shares

    def _handshake_round(self, ch, mine: tuple) -> tuple:
        """Every rank's handshake note ``mine`` (failure, signature, pool, next channel id, share) to rank 0
        on channel ``ch``, and its :meth:`_verdict` back to every rank: what a session's handshake and
        :meth:`_exchange` both send, so that ranks at either read each other's messages."""
        self._handshaking = True  # a rank that exited never comes (MPIComm._poll)
        try:
            notes = self._gather_to_root(ch, mine, Tag.HANDSHAKE)
            return self._from_root(ch, None if notes is None else self._verdict(notes), Tag.HANDSHAKE)
        finally:
            self._handshaking = False

    def _raise_verdict(self, failed: list, bad: str | None) -> None:
        """Raise what a handshake's verdict says (:meth:`_verdict`): RemoteRankError for the first rank
        that failed, ValueError when the calls or signatures differ; nothing when neither."""
        if failed:
            r, n = failed[0]
            more = f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else ""
            raise self._remote(r, n, more)
        if bad:
            raise ValueError(bad)

    def _after_handshake(self, ch) -> None:
        """Engine hook between the verdict and acting on it."""

    def _transpose_via_root(self, ch, row: list, tag: int) -> list:
        """``row[j]`` of every rank ``i`` gathered at rank 0 and sent back transposed:
        returns ``[row_j[me] for every rank j]`` (the barrier of finish)."""
        rows = self._gather_to_root(ch, row, tag)
        if self.rank == 0:
            cols = [[rows[j][i] for j in range(self.size)] for i in range(self.size)]
            for i in range(1, self.size):
                self._isend_obj(ch, cols[i], i, tag)
            return cols[0]
        return self._recv_obj(ch, 0, tag)

    def close(self, error=None):
        if len(self._stack) == 1:
            return
        ch = self._top
        if error is None:
            if not ch.finished:
                try:
                    self.finish()
                except BaseException as exc:
                    self.close(exc)
                    raise
            self._stack.pop()
            self._release(ch)
            return
        self._stack.pop()
        if self.size == 1:
            self._release(ch)
            return
        if self._broken is not None:
            self._abandon(ch)  # an alarm: the failed rank takes no part in any cleanup
            return
        finished, remote = ch.finished, isinstance(error, RemoteRankError)
        if finished and remote:
            self._release(ch)  # finish left it empty here and nothing has moved since
            return
        if not remote or error.gone:  # (a process only this rank found gone: the others may wait for this one)
            self._notify(ch, error)
        # after finish the others may have released the channel: a cleanup would wait
        # for them in vain (the notices' channel is kept, unfreed)
        if finished or not self._can_clean(ch) or not self._cleanup(ch):
            self._abandon(ch)
        else:
            self._release(ch)

    def _before_finish(self) -> None:
        self._usable()

    def finish(self):
        self._before_finish()
        self._finishing = True
        try:
            self._finish()
        finally:
            self._finishing = False

    # -- messages and object collectives, written once for both engines ----------
    def _before_post(self) -> None:
        """Engine hook before a message is posted: raise if the communicator is unusable or a
        failure notice / alarm has arrived."""
        self._usable()

    def _device_buffers(self) -> bool:
        """Engine hook: CUDA tensors travel from and into device memory (else via host memory)."""
        return False

    def _after_object_sends(self, ch) -> None:
        """Engine hook after a collective's pickled sends (e.g. complete them outside sessions)."""

    def agree(self, value=None, what: str = "a value") -> None:
        """Return when every rank has called this: a barrier that listens for failures, before a
        blocking call of the engine that waits for every rank for ever (``MPI_Comm_split``,
        ``torch.distributed.new_group``). ``value`` (picklable, compared with ``==``) must be the same
        on every rank: else a ValueError on every rank naming ``what``."""
        self._before_post()
        values = self._exchange(Call(f"agree ({what})", ()), value)
        odd = next(((r, v) for r, v in enumerate(values) if not _equal(v, values[0])), None)
        if odd is not None:
            raise ValueError(f"{what} differs between ranks: {odd[1]!r} on rank {odd[0]}, {values[0]!r} on rank 0; "
                             "pass the same on every rank")

    def _exchange(self, call: Call, value, failure: BaseException | None = None) -> list:
        """Every rank's ``value`` (picklable), in rank order, on every rank: a collective that speaks a
        session handshake's note and verdict (see :meth:`_handshake`) under the name ``call``, so that
        ranks at different collective calls (this one, a split, a session's handshake) all raise a
        ValueError naming every rank's call, and a rank's failure notice a RemoteRankError. A rank
        with a ``failure`` (a bad argument) takes part, then raises it; the others RemoteRankError."""
        ch = self._top
        mine = (None if failure is None else _note(failure), call, (), 0, None if failure is not None else value)
        failed, bad, _, _, values = self._handshake_round(ch, mine)
        self._after_object_sends(ch)
        if failure is not None:
            raise failure
        self._raise_verdict(failed, bad)
        return values

    def send(self, x, dest, tag):
        self._before_post()
        if Tag.FAILURE <= tag < Tag.HALO:
            raise ValueError(f"tag {tag} is reserved for the protocol of mgrit.comm; use Tag.HALO, "
                             "Tag.GHOST, Tag.STATE, Tag.USER and above, or a level index")
        self._isend(self._top, self._send_buffer(x), dest, tag)

    def recv(self, like, source, tag):
        self._before_post()
        if B.is_torch(like):
            import torch

            on_device = like.is_cuda and self._device_buffers()
            buf = torch.empty(tuple(like.shape), dtype=like.dtype, device=like.device if on_device else "cpu")
        else:
            buf = np.empty(tuple(like.shape), dtype=like.dtype)
        self._recv_into(self._top, buf, source, tag)
        if B.is_torch(like) and buf.device != like.device:
            return buf.to(device=like.device)
        return buf

    def bcast(self, obj, root=0):
        self._before_post()
        ch = self._top
        if self.rank == root:
            for r in range(self.size):
                if r != root:
                    self._isend_obj(ch, obj, r, Tag.BCAST)
            self._after_object_sends(ch)
            return obj
        return self._recv_obj(ch, root, Tag.BCAST)

    def gather(self, obj, root=0):
        self._before_post()
        ch = self._top
        dest = 0 if root is None else root
        if self.rank != dest:
            self._isend_obj(ch, obj, dest, Tag.GATHER)
            parts = None
        else:
            parts = [obj if r == dest else self._recv_obj(ch, r, Tag.GATHER) for r in range(self.size)]
        if root is None:
            parts = self.bcast(parts, root=0)
        self._after_object_sends(ch)
        return parts

    # -- reductions: a tree through rank 0, so every rank gets the same bits ------
    def allreduce(self, value, op="sum"):
        if op not in ("sum", "max"):
            raise ValueError(f"`op` must be 'sum' or 'max', got {op!r}")
        x = np.array([value], dtype=np.float64)
        return float(self._reduce(x, np.add if op == "sum" else np.maximum)[0])

    def _reduce_tensor(self, x):
        """Elementwise sum of a torch tensor over the ranks (default: through host memory). Dtypes numpy
        lacks (bfloat16, the float8 types) are summed in float32 and rounded back once."""
        import torch

        host = x.detach().cpu().contiguous()
        if host.dtype.is_floating_point and host.dtype not in (torch.float16, torch.float32, torch.float64):
            return torch.from_numpy(self._reduce(host.float().numpy(), np.add)).to(device=x.device, dtype=x.dtype)
        return torch.from_numpy(self._reduce(host.numpy(), np.add)).to(x.device)

    def allreduce_array(self, x):
        if B.is_torch(x):
            return self._reduce_tensor(x)
        a = np.asarray(x)
        if a.dtype.kind not in "iufc":
            raise TypeError(f"`allreduce_array` needs a numeric array, got dtype {a.dtype}")
        return self._reduce(a, np.add).reshape(a.shape)

    def sum_exact(self, values):
        return self.exact_many([values], "sum")[0]

    def norm2_exact(self, values):
        return self.exact_many([values], "norm2")[0]

    def max(self, values):
        return self.exact_many([values], "max")[0]

    def exact_many(self, parts, kind):
        _check_kind(kind)
        if kind == "max":
            return self._reduce(np.array([_local_max(v) for v in parts], dtype=np.float64), np.maximum).tolist()
        bins, value = (square_bins, square_bins_root) if kind == "norm2" else (exact_bins, bins_value)
        rows = np.stack([bins(v) for v in parts]) if parts else np.zeros((0, 1))
        total = self._reduce(rows.ravel(), np.add).reshape(rows.shape)
        return [value(b) for b in total]


class MPIComm(_SessionComm):
    """mpi4py communicator along the time axis (see the module docstring).

    States travel as raw bytes (numpy arrays and torch tensors alike, any
    dtype), non-blocking, copied at send time. Sessions use private channels;
    outside sessions, messages use the base channel (a private duplicate made
    here: creating an MPIComm is collective). Nothing ever travels on
    ``comm`` itself.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
        The layer (time) communicator.
    cuda_aware : bool, optional
        Send CUDA tensors directly (the MPI library must be CUDA-aware).
        Default: the environment variable ``MGRIT_CUDA_AWARE_MPI=1``.
        Otherwise CUDA tensors are copied to host memory to be sent and
        copied back to their device when received.

    Attributes
    ----------
    cleanup_timeout : float
        Seconds the cleanup after a failure may take before the channel is
        abandoned (default 3).
    exit_grace : float
        Seconds a wait outside sessions for a message of a rank whose program
        ended goes on after its exit alarm, before it raises (default 1).
    tag_ub : int
        Largest tag the MPI library accepts (user tags: ``Tag.USER .. tag_ub``).
    """

    cleanup_timeout = 3.0
    exit_grace = 1.0

    def __init__(self, comm, cuda_aware: bool | None = None):
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        if cuda_aware is None:
            cuda_aware = os.environ.get("MGRIT_CUDA_AWARE_MPI", "0") == "1"
        self.cuda_aware = bool(cuda_aware)
        self.tag_ub = int(comm.Get_attr(MPI.TAG_UB) or 32767)
        world, group = MPI.COMM_WORLD.Get_group(), comm.Get_group()
        try:
            w = group.Translate_ranks(list(range(self.size)), world)
        finally:
            group.Free()
            world.Free()
        self._world = [r if x == MPI.UNDEFINED else int(x) for r, x in enumerate(w)]
        self._status = MPI.Status()
        self._base = _Channel(self._duplicate(comm), -1, self.size)  # handshakes, alarms, other traffic
        self._stack = [self._base]  # the base channel and one channel per open session
        self._pool: dict = {}  # id -> clean _Channel, oldest first
        self._next_id = 0
        self._broken = None  # (rank, message) of an alarm received or raised here
        self._owns = False  # free() frees ``comm`` too (made by split / reversed)
        self._freed = False
        kv = _keyval(MPI)
        if comm.Get_attr(kv) is None:
            comm.Set_attr(kv, self)
        if self.size > 1:
            _guard_exit(self)

    def _duplicate(self, comm):
        """``comm.Dup()``, listening meanwhile for the world alarm of a member that failed before it
        joined (it never will): RemoteRankError instead of waiting in MPI for ever."""
        if self.size == 1:
            return comm.Dup()
        new, req = comm.Idup()
        backoff = _Backoff()
        others = [w for r, w in enumerate(self._world) if r != self.rank]
        while not req.Test():
            known = _world_failure_note(self._MPI, others)
            if known is not None:
                w, note = known
                r = self._world.index(w)
                raise RemoteRankError(
                    f"{self._who(r)} failed before it joined the wrapping of this communicator (its "
                    f"process ended on an unhandled exception): {note}", rank=r, world_rank=w)
            backoff.pause()
        return new

    # -- naming -----------------------------------------------------------------
    def world_rank(self, r=None):
        return self._world[self.rank if r is None else int(r)]

    def _who(self, r: int) -> str:
        w = self._world[r]
        return f"rank {w}" if w == r else f"rank {w} (rank {r} of this communicator)"

    def _remote(self, r: int, note: str, more: str = "") -> RemoteRankError:
        return RemoteRankError(f"{self._who(r)} failed{more}: {note}", rank=r, world_rank=self._world[r])

    # -- failure detection ------------------------------------------------------
    def _usable(self) -> None:
        if self._freed:
            raise RuntimeError("this communicator was freed")
        if self._broken is not None:
            r, note = self._broken
            if r == self.rank:
                raise RuntimeError(f"this communicator is unusable after this rank's alarm ({note})")
            raise self._remote(r, note, " (alarm)")

    def _poll(self) -> None:
        """Raise RemoteRankError if a failure notice (on any open channel) or an alarm arrived."""
        MPI, st = self._MPI, self._status
        # While this rank finishes its innermost session, a notice on an outer channel
        # comes from a rank that has left the inner session: through its finish (then
        # this finish completes too) or by failing inside it (then its notice on the
        # inner channel arrives too). Either way this finish must not be abandoned for
        # it: the rank that left would never join a cleanup of the inner channel.
        channels = self._stack[-1:] if self._finishing else reversed(self._stack[1:])
        for ch in channels:
            if ch.comm.Iprobe(MPI.ANY_SOURCE, Tag.FAILURE, st):
                src = st.Get_source()
                note = ch.comm.recv(source=src, tag=Tag.FAILURE)
                ch.recvd[src] += 1
                raise self._remote(src, note)
        # (not while finishing: a rank alarms only after leaving every session, and a rank that has
        # left this one owes it nothing more; the alarm is read at the next wait)
        if self._broken is None and not self._finishing and self._base.comm.Iprobe(MPI.ANY_SOURCE, Tag.ALARM, st):
            src = st.Get_source()
            note = self._base.comm.recv(source=src, tag=Tag.ALARM)
            if note == _EXITED:
                self._exited = self._exited | {src}
            else:
                self._broken = (src, note)
        self._usable()
        # A rank whose program ended fails the ranks that wait in a handshake (it never joins one
        # again) or in a session it is not part of; waits outside sessions (a gather to a root, user
        # messages between two other ranks) go on unless they wait for a message of that rank
        # (_awaited_exited): the rank that ended delivered its part before
        if self._exited and not self._finishing and (self._handshaking or self._depth() > 0):
            raise self._exited_error(min(self._exited))

    def _exited_error(self, r: int) -> RemoteRankError:
        # (say it caught the RemoteRankError of that failure; a rank that died of this very exit is no news)
        earlier = _world_failure_note(self._MPI, not_of=self._world[r])
        more = "" if earlier is None else (
            f" (earlier, rank {earlier[0]} of MPI.COMM_WORLD ended on an unhandled exception: {earlier[1]})")
        return RemoteRankError(
            f"{self._who(r)} exited while this rank waits for it (its program ended without an "
            "unhandled exception, or called sys.exit): every rank must make the same collective "
            "calls in the same order, e.g. run backward() through every LayerParallel output and "
            f"every solve, gather and reduction on every rank{more}", rank=r, world_rank=self._world[r])

    def _awaited_exited(self, source: int, since: list) -> None:
        """Outside sessions a wait fails for an exit alarm only when it waits for a message of the rank
        that exited: raise once no such message arrived within :attr:`exit_grace` seconds of the alarm
        (what it sent before it ended is delivered by then). ``since``: a one-item list, the
        time the alarm was first seen in this wait (None before)."""
        if source not in self._exited or self._finishing:
            return
        now = time.perf_counter()
        if since[0] is None:
            since[0] = now
        elif now - since[0] > self.exit_grace:
            raise self._exited_error(source)

    def _wait(self, req, recv=None) -> None:
        """Wait for ``req`` while polling for failures. ``recv = (channel, source)``
        for a receive: it is counted when it completes; when the wait is
        interrupted it is cancelled, and counted if it had matched already."""
        backoff, since, start = _Backoff(), [None], time.perf_counter()
        try:
            while not req.Test():
                self._poll()
                if recv is not None and self._exited:
                    self._awaited_exited(recv[1], since)
                backoff.pause()
        except BaseException:
            self.waited += time.perf_counter() - start
            if recv is not None and req == self._MPI.REQUEST_NULL:  # Test completed it, with an error
                recv[0].recvd[recv[1]] += 1  # (e.g. a message longer than the buffer: it matched)
            elif recv is not None:
                st = self._MPI.Status()
                req.Cancel()
                req.Wait(st)
                if not st.Is_cancelled():
                    recv[0].recvd[recv[1]] += 1
            raise
        self.waited += time.perf_counter() - start
        if recv is not None:
            recv[0].recvd[recv[1]] += 1

    # -- sending and receiving on a channel --------------------------------------
    def _isend(self, ch: _Channel, buf, dest: int, tag: int):
        req = ch.comm.Isend([_byte_view(buf), self._MPI.BYTE], dest=dest, tag=tag)
        self._sent(ch, req, buf, dest)
        return req

    def _isend_obj(self, ch: _Channel, obj, dest: int, tag: int):
        req = ch.comm.isend(obj, dest=dest, tag=tag)  # the request keeps the pickle alive
        self._sent(ch, req, None, dest)
        return req

    @staticmethod
    def _sent(ch: _Channel, req, buf, dest: int) -> None:
        ch.sent[dest] += 1
        ch.finished = False
        ch.sends.append((req, buf))
        if len(ch.sends) > 64:
            ch.sends[:] = [(r, b) for r, b in ch.sends if not r.Test()]

    def _recv_into(self, ch: _Channel, buf, source: int, tag: int):
        ch.finished = False
        req = ch.comm.Irecv([_byte_view(buf), self._MPI.BYTE], source=source, tag=tag)
        self._wait(req, (ch, source))
        return buf

    def _recv_obj(self, ch: _Channel, source: int, tag: int):
        ch.finished = False
        backoff, since, start = _Backoff(), [None], time.perf_counter()
        try:
            while not ch.comm.Iprobe(source=source, tag=tag):
                self._poll()
                if self._exited:
                    self._awaited_exited(source, since)
                backoff.pause()
        finally:
            self.waited += time.perf_counter() - start
        obj = ch.comm.recv(source=source, tag=tag)
        ch.recvd[source] += 1
        return obj

    def _complete_sends(self, ch: _Channel) -> None:
        while ch.sends:
            self._wait(ch.sends[0][0])
            ch.sends.pop(0)

    def _drain_one(self, ch: _Channel, source: int) -> bool:
        """Receive and discard one message from ``source`` if one has arrived."""
        MPI, st = self._MPI, self._status
        msg = ch.comm.Improbe(source=source, tag=MPI.ANY_TAG, status=st)
        if msg is None:
            return False
        msg.Recv([bytearray(st.Get_count(MPI.BYTE)), MPI.BYTE])
        ch.recvd[source] += 1
        return True

    # -- phases of a session -------------------------------------------------------
    def _depth(self):
        return len(self._stack) - 1

    @property
    def _top(self) -> _Channel:
        return self._stack[-1]

    def _gather_to_root(self, ch: _Channel, obj, tag: int):
        """Pickled ``obj`` of every rank on rank 0 (list), None elsewhere."""
        if self.rank != 0:
            self._isend_obj(ch, obj, 0, tag)
            return None
        return [obj] + [self._recv_obj(ch, j, tag) for j in range(1, self.size)]

    def _from_root(self, ch: _Channel, obj, tag: int):
        """``obj`` of rank 0 on every rank."""
        if self.rank == 0:
            for j in range(1, self.size):
                self._isend_obj(ch, obj, j, tag)
            return obj
        return self._recv_obj(ch, 0, tag)

    def open(self, failure=None, signature=None, share=None):
        if failure is not None and self._broken is not None:
            return None  # the caller re-raises its own exception
        self._usable()
        agreed = self._handshake(self._top, failure, signature, self._next_id, share)
        if agreed is None:
            return None
        reuse, new_id, shares = agreed
        if reuse is not None:
            new = self._pool.pop(reuse)
        else:
            new = _Channel(self._base.comm.Dup(), new_id, self.size)
            self._next_id = new_id + 1
        self._stack.append(new)
        return shares

    def _release(self, ch: _Channel) -> None:
        """Put a clean channel into the pool (freeing the oldest beyond its size)."""
        ch.finished = False
        self._pool[ch.id] = ch
        while len(self._pool) > _POOL_SIZE:
            self._pool.pop(next(iter(self._pool))).comm.Free()

    def _abandon(self, ch: _Channel) -> None:
        _ABANDONED.append((ch.comm, ch.sends))
        _N_ABANDONED[0] += 1

    def _notify(self, ch: _Channel, exc: BaseException) -> None:
        note = _note(exc)
        for r in range(self.size):
            if r != self.rank:
                self._isend_obj(ch, note, r, Tag.FAILURE)

    def notify_failure(self, exc):
        if len(self._stack) > 1:
            self._notify(self._top, exc)

    def _cleanup(self, ch: _Channel) -> bool:
        """After a failure: exchange the per-peer message counts, receive and discard
        what was not received, complete the own sends. True when the channel is empty;
        False when the time limit passed or an alarm arrived (abandon it)."""
        MPI = self._MPI
        deadline = time.monotonic() + self.cleanup_timeout
        peers = [r for r in range(self.size) if r != self.rank]
        ctrl = []  # the count messages: never counted themselves
        for r in peers:
            buf = np.array([ch.sent[r]], dtype=np.int64)
            ctrl.append((ch.comm.Isend(buf, dest=r, tag=Tag.CLEANUP), buf))
        bufs = {r: np.zeros(1, dtype=np.int64) for r in peers}
        reqs = {r: ch.comm.Irecv(bufs[r], source=r, tag=Tag.CLEANUP) for r in peers}
        expected: dict = {}
        backoff = _Backoff()
        while True:
            for r in [r for r in reqs if reqs[r].Test()]:
                expected[r] = int(bufs[r][0])
                del reqs[r]
            for r, n in expected.items():
                while ch.recvd[r] < n and self._drain_one(ch, r):
                    pass
            ch.sends[:] = [(q, b) for q, b in ch.sends if not q.Test()]
            ctrl[:] = [(q, b) for q, b in ctrl if not q.Test()]
            if not reqs and not ch.sends and not ctrl and all(ch.recvd[r] == n for r, n in expected.items()):
                return True
            alarm = self._base.comm.Iprobe(MPI.ANY_SOURCE, Tag.ALARM)
            if alarm or time.monotonic() > deadline:
                for q in reqs.values():
                    q.Cancel()
                _ABANDONED.append((list(reqs.values()), bufs, ctrl))
                return False
            backoff.pause()

    # -- point to point ---------------------------------------------------
    def _device_buffers(self):
        return self.cuda_aware

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

    # -- reductions -------------------------------------------------------
    def _reduce(self, x: np.ndarray, op) -> np.ndarray:
        """``op``-reduce ``x`` over all ranks up a binomial tree to rank 0 (a fixed
        order of combination) and broadcast the result down the same tree."""
        self._usable()
        ch, r, P = self._top, self.rank, self.size
        acc = np.ascontiguousarray(x)
        if P == 1:
            return acc.copy()
        waits = []
        mask = 1
        while mask < P:  # up: receive from r + mask, or send to the parent and stop
            if r & mask:
                waits.append(self._isend(ch, acc, r - mask, Tag.REDUCE))
                break
            if r + mask < P:
                acc = op(acc, self._recv_into(ch, np.empty_like(acc), r + mask, Tag.REDUCE))
            mask <<= 1
        if r:
            acc = self._recv_into(ch, np.empty_like(acc), r - (r & -r), Tag.REDUCE)
            mask = (r & -r) >> 1
        else:
            mask = (1 << (P - 1).bit_length()) >> 1
        while mask:  # down: to r + mask for every mask below this rank's lowest bit
            if r + mask < P:
                waits.append(self._isend(ch, acc, r + mask, Tag.REDUCE))
            mask >>= 1
        for q in waits:  # the buffers are the caller's and the result: done before returning
            self._wait(q)
        return acc

    # -- end of a session ---------------------------------------------------
    def _finish(self):
        ch, r, P = self._top, self.rank, self.size
        if P > 1:
            # barrier through rank 0 carrying the counts: col[j] = messages j sent to this
            # rank before its barrier message
            col = self._transpose_via_root(ch, list(ch.sent), Tag.BARRIER)
            for j in range(P):  # receive what was sent here but never received
                if j == r:
                    continue
                target = col[j] + (1 if r == 0 or j == 0 else 0)  # + the barrier message itself
                backoff = _Backoff()
                while ch.recvd[j] < target:
                    if not self._drain_one(ch, j):
                        self._poll()
                        backoff.pause()
        self._complete_sends(ch)
        ch.finished = True

    # -- alarms and communicators ---------------------------------------------
    def alarm(self, exc):
        self._alarm(_note(exc))

    def _alarm(self, note: str) -> None:
        if self.size == 1 or self._broken is not None or self._freed or self._MPI.Is_finalized():
            return
        reqs = [self._base.comm.isend(note, dest=r, tag=Tag.ALARM) for r in range(self.size) if r != self.rank]
        _ABANDONED.append(reqs)  # never waited for; kept alive
        self._broken = (self.rank, note)

    def split(self, color, key=0):
        self._before_post()
        color, key, failure = split_arguments(color, key)
        self._exchange(Call("Communicator.split", ()), None, failure)  # all are here (MPI_Comm_split waits for ever)
        raw = self._base.comm.Split(self._MPI.UNDEFINED if color is None else color, key)
        if raw == self._MPI.COMM_NULL:
            return None
        new = MPIComm(raw, cuda_aware=self.cuda_aware)
        new._owns = True
        return new

    def free(self):
        if self._freed:
            return
        if len(self._stack) > 1:
            raise RuntimeError("free() inside a session: close the session first")
        MPI = self._MPI
        for ch in self._pool.values():
            ch.comm.Free()
        self._pool.clear()
        base = self._base
        base.sends[:] = [(q, b) for q, b in base.sends if not q.Test()]
        if self._broken is None and not base.sends:
            base.comm.Free()
        else:
            self._abandon(base)
        if not MPI.Is_finalized():
            kv = _keyval(MPI)
            if self.comm.Get_attr(kv) is self:
                self.comm.Delete_attr(kv)
            if self._owns:
                self.comm.Free()
        self._freed = True


def as_communicator(comm) -> Communicator:
    """Turn ``None``, a :class:`Communicator`, an mpi4py communicator or a
    ``torch.distributed`` ProcessGroup into a Communicator.

    An mpi4py communicator gets one :class:`MPIComm` wrapper, cached on it; a
    process group gets one :class:`mgrit.torch_dist.TorchDistComm`, cached
    too: the same raw communicator always gives the same wrapper (the first
    call is collective).
    """
    if comm is None:
        return SerialComm()
    if isinstance(comm, Communicator):
        return comm
    if type(comm).__module__.startswith("mpi4py"):
        from mpi4py import MPI

        wrapper = comm.Get_attr(_keyval(MPI))
        if isinstance(wrapper, MPIComm) and not wrapper._freed:
            return wrapper
        wrapper = MPIComm(comm)
        comm.Set_attr(_keyval(MPI), wrapper)
        return wrapper
    if _is_process_group(comm):
        from .torch_dist import wrap

        return wrap(comm)
    if _non_member(comm):
        raise ValueError("this rank is not a member of the process group passed as `comm` (torch.distributed "
                         "gives it GroupMember.NON_GROUP_MEMBER from new_group): build the module or call the "
                         "solver on the ranks of the group only")
    raise TypeError(
        f"`comm` must be None, an mpi4py communicator, a torch.distributed ProcessGroup or an "
        f"mgrit.Communicator, got {type(comm).__name__}"
    )


def _uninitialised_hint() -> str:
    """What to say when None was passed where a process group was meant: under torchrun (WORLD_SIZE > 1)
    with torch.distributed not initialised, dist.group.WORLD is None."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None)
    if dist is None:
        return ""
    try:  # (a value that is no whole number is not a launcher's: nothing to say)
        launched = int(os.environ.get("WORLD_SIZE", "1") or 1) > 1
    except ValueError:
        return ""
    if launched and dist.is_available() and not dist.is_initialized():
        return (f" (this process was launched with WORLD_SIZE={os.environ['WORLD_SIZE']} and torch.distributed is "
                "not initialised: dist.group.WORLD is None until torch.distributed.init_process_group(...) "
                "has been called)")
    return ""


def warn_if_alone(comm, what: str) -> None:
    """Warn (``RuntimeWarning``) when ``what`` was given no communicator (``comm`` None) in a process
    launched as one of several (``WORLD_SIZE > 1``) before torch.distributed was initialised:
    ``comm=dist.group.WORLD`` is None then, and the work would run on every process alone, each doing
    all of it."""
    if comm is not None:
        return
    hint = _uninitialised_hint()
    if hint:
        import warnings

        warnings.warn(f"{what} got comm=None and runs on this process alone{hint}; pass comm=dist.group.WORLD "
                      "after it, or comm=None deliberately with WORLD_SIZE=1", RuntimeWarning, stacklevel=3)


def _is_process_group(obj) -> bool:
    """A ``torch.distributed`` ProcessGroup? (torch is looked up in ``sys.modules``, never imported)."""
    torch = sys.modules.get("torch")
    c10d = getattr(getattr(torch, "distributed", None), "distributed_c10d", None)
    pg = getattr(c10d, "ProcessGroup", None)
    return pg is not None and isinstance(obj, pg)


def split_comm(comm, layer_size: int):
    """Split ``comm`` into a 2-D grid of ranks: (layer communicator, data communicator).

    World rank ``r`` sits at layer index ``r % layer_size`` and data index
    ``r // layer_size``. Ranks with the same data index form one layer
    communicator (pass it to ``solve(..., comm=...)`` to split time / layers);
    ranks with the same layer index form one data communicator (shard the batch
    over it and all-reduce gradients on it).

    With a ``torch.distributed`` ProcessGroup (the world group) this is
    :func:`mgrit.torch_dist.split_group`: it returns process groups and is
    collective over the whole world.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm or torch.distributed.ProcessGroup
        Usually ``MPI.COMM_WORLD`` (or ``torch.distributed.group.WORLD``); its
        size must be a multiple of ``layer_size``.
    layer_size : int
        Number of ranks along the layer (time) dimension.

    Returns
    -------
    layer_comm, data_comm : mpi4py.MPI.Comm (or torch.distributed.ProcessGroup)
    """
    if comm is None:
        raise ValueError("split_comm needs the world communicator, MPI.COMM_WORLD or torch.distributed's "
                         "dist.group.WORLD, got None" + _uninitialised_hint())
    if _is_process_group(comm):
        from .torch_dist import split_group

        return split_group(layer_size, comm)
    size, rank = comm.Get_size(), comm.Get_rank()
    if size > 1:  # every rank is here (or RemoteRankError) with the same layer_size before MPI_Comm_split
        as_communicator(comm).agree(layer_size, "`layer_size` of split_comm")
    if isinstance(layer_size, (bool, np.bool_)) or not isinstance(layer_size, (int, np.integer)) \
            or layer_size < 1 or size % layer_size:
        raise ValueError(
            f"`layer_size` must divide the communicator size {size}, got {layer_size!r}"
        )
    layer_index, data_index = rank % layer_size, rank // layer_size
    layer_comm = comm.Split(color=data_index, key=layer_index)
    data_comm = comm.Split(color=layer_index, key=data_index)
    return layer_comm, data_comm
