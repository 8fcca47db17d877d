"""The communicator over PyTorch's own distributed engine: ``torch.distributed`` process groups.

:class:`TorchDistComm` implements the :class:`~mgrit.comm.Communicator`
interface over a process group (gloo on CPUs; NCCL for the states on GPUs),
with the semantics of :class:`~mgrit.comm.MPIComm` (read the module docstring
of :mod:`mgrit.comm` first): sessions with a handshake, a finish that matches
every message and a failure protocol; point-to-point states; pickled
objects; reductions up and down a binomial tree combined in a fixed order
(the same bits on every rank, and for :meth:`~TorchDistComm.sum_exact` /
:meth:`~TorchDistComm.norm2_exact` the same bits for any number of ranks and
the same bits as over MPI). ``as_communicator(group)`` and ``comm=group``
everywhere (``mgrit.solve``, ``LayerParallel``, ``allreduce_gradients``)
wrap a process group in one cached TorchDistComm.

Launch with ``torchrun --nproc_per_node P script.py`` and call
``torch.distributed.init_process_group("gloo")`` in the script (the
rendezvous comes from the environment), or spawn the processes yourself.

How it differs from MPI, and why
--------------------------------
gloo has no probe, no cancel, and its send / receive handles cannot be
polled: ``Work.is_completed()`` stays False until somebody calls
``Work.wait()``, and a ``wait`` with a timeout that expires closes the
connection for good. So:

* **Waiting**: every wait hands the handle to one helper thread that blocks
  in ``wait()`` (the GIL is released there); the calling thread waits on
  the helper's event and checks for failure notices in between, so that it
  never blocks without listening. When a wait is interrupted by a failure,
  the helper thread may stay blocked on that handle forever: it is left
  behind and a new one serves the later waits.
* **Failure notices and alarms** travel on one fixed slot of the group
  (receive from any source, always posted): a listener thread per process
  group waits on it, records the notice (the channel it concerns, the
  sender, the message) and posts the receive again. Checking for a failure
  is a dictionary lookup: there is no polling cost.
* **Channels are tag spaces, not new groups**: ``new_group`` is collective
  over the whole world, so a session cannot make one. A message travels with
  the tag ``space << 10 | code`` (``code``: the 10-bit code of the
  :class:`~mgrit.comm.Tag`), and every channel, every communicator made by
  :meth:`~TorchDistComm.split` / :meth:`~TorchDistComm.reversed` and every
  wrapper of a group gets a fresh space, agreed at a handshake (the largest
  counter of the ranks concerned, so that two ranks never reuse a space they
  shared). :meth:`split` and :meth:`reversed` are therefore cheap views of the
  same process group, and need no ``new_group``.
* **Finish** knows the sizes of the messages to drain: each rank logs the
  sizes of the messages it sent on the channel (run-length encoded, per peer
  and tag) and the barrier through rank 0 carries these logs; a rank then
  receives (and discards) whatever was sent to it and not received.
* **After a failure** the channel is cleaned up (``TorchDistComm._cleanup``): a
  posted receive cannot be cancelled, so the peers *fulfil* it instead (every
  rank tells each peer what it sent and posted there; each drains what it did not
  receive and sends a dummy message for every receive a peer posted that it never
  sent), within ``cleanup_timeout`` seconds; the clean channel goes back to the
  pool. Only when that times out or an alarm interrupts it is the channel
  *retired*: a channel on which a receive may still be pending can never carry
  another session, and retiring a tag space costs nothing (MPI communicators are
  a scarce resource; tag spaces are not), so the next session takes a new one.
  What a retired channel left in flight stays alive in this module and is never
  touched again; :func:`retired_channels` counts them. The process group itself
  stays usable.
* **A process that is gone** (its connection closed) is found only by the ranks
  waiting for it: they raise RemoteRankError with ``gone=True``. Inside a
  session such a rank sends the others a failure notice; the root of a
  handshake (or any gather to rank 0) still receives from the other ranks and
  answers them with :class:`_Gone`, on which they raise too. Nobody is left
  waiting for a rank that knows.
* **At exit** a process that sent or received failure messages waits (at most
  3 s) until no helper thread can come back from a blocked gloo wait while
  Python shuts down, which would abort the process (see :func:`_settle_at_exit`).

NCCL
----
With an NCCL group the states (CUDA tensors) travel by NCCL point to point on
the device, with no host staging; everything else (handshakes, notices,
pickled objects, the exact reductions of numpy bins) travels on a gloo
*control group* with the same ranks: pass ``control=`` (a gloo group), or let
:class:`TorchDistComm` make one for the world group, or make both with
:func:`split_group` ``(..., backend="nccl")``. NCCL ignores tags: messages
between two ranks are matched in the order they were issued, so the device
messages of a session form one ordered stream per pair (both sides of the
solver and of LayerParallel issue them in the same order), and NCCL handles
*can* be polled (``is_completed`` queries a CUDA event). A failed session may
leave an unmatched NCCL send on the device stream; NCCL cannot cancel it, so
after a failure with NCCL re-create the process group before the next
multi-rank step. **The NCCL path is untested here (no GPU).**
"""
from __future__ import annotations

import atexit
import datetime
import pickle
import queue
import threading
import time
from typing import NamedTuple

import numpy as np

from . import _backend as B
from .comm import (
    Call,
    RemoteRankError,
    Tag,
    _Backoff,
    _is_process_group,
    _note,
    _SessionComm,
    split_arguments,
)

__all__ = ["TorchDistComm", "split_group", "retired_channels", "is_process_group"]

_CODE_BITS = 10
_MAX_SPACE = 1 << (31 - _CODE_BITS)  # gloo tags are int32
#: the timeout of the always-posted notice receive: ten years, i.e. none (a gloo wait that times out closes
#: the group's connections; a longer one overflows the clock arithmetic of the wait)
_FOREVER = datetime.timedelta(days=3650)
_NOTE_BYTES = 1024  # fixed size of a failure notice / alarm (the message is truncated to fit)
_HEAD = 256  # first chunk of a pickled object: 8 bytes of length, then up to 248 bytes
_DEVICE = -1  # the code of NCCL messages in the finish logs: one ordered stream per pair
_NOTICE_SPACE = 1  # the slot of the failure notices (space 0: the bootstrap of a wrapper)
_POOL_SIZE = 4
_FULFIL = -1  # the space field of a request for a dummy message (see _Group.request_fulfil)

#: Work handles, buffers and threads of retired channels (never touched again; kept
#: alive so that no backend frees memory it may still write to)
_KEEP: list = []
_N_RETIRED = [0]


def retired_channels() -> int:
    """Number of channels this process retired after failed sessions (see the module docstring)."""
    return _N_RETIRED[0]


def is_process_group(obj) -> bool:
    """True for a ``torch.distributed`` ProcessGroup (without importing torch)."""
    return _is_process_group(obj)


#: What gloo's errors say when the process at the other end of a connection has gone.
_CONNECTION_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _lost(text: str) -> str | None:
    """The phrase of :data:`_CONNECTION_LOST` in gloo's error text ``text`` (the peer's process ended), or None."""
    return next((k for k in _CONNECTION_LOST if k in text), None)


def _reason(exc) -> str:
    """gloo's error in a few words: the lost-connection phrase, else its first line (at most 200 characters)
    without the source location (``[.../pair.cc:534] Connection closed by peer [127.0.0.1]:39419``)."""
    text = str(exc)
    lost = _lost(text)
    if lost is not None:
        return f"gloo: {lost}"
    line = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    if line.startswith("[") and "] " in line:
        line = line.split("] ", 1)[1]
    return f"gloo: {line[:200]}"


def _code(tag: int) -> int:
    """The 10-bit code of a tag (level indices below 512, the named tags, user tags)."""
    tag = int(tag)
    if 0 <= tag < 512:
        return tag
    if Tag.FAILURE <= tag <= Tag.WORLD_ALARM:
        return 512 + tag - Tag.FAILURE
    if tag in (Tag.HALO, Tag.GHOST, Tag.STATE):
        return 528 + tag - Tag.HALO
    if Tag.USER <= tag <= TorchDistComm.tag_ub:
        return 544 + tag - Tag.USER
    raise ValueError(f"tag {tag} cannot travel on a torch.distributed communicator: use a level index "
                     f"below 512, Tag.HALO, Tag.GHOST, Tag.STATE or Tag.USER .. Tag.USER + 479 (TorchDistComm.tag_ub)")


def _wire(space: int, tag: int) -> int:
    return (space << _CODE_BITS) | _code(tag)


# -- waiting on gloo handles ----------------------------------------------------------


class _Req:
    """A send or receive handle: waited for once (a gloo handle waited twice blocks)."""

    __slots__ = ("work", "device", "done", "job", "peer")

    def __init__(self, work, device: bool, peer: int | None = None):
        self.work, self.device, self.done, self.job = work, device, False, None
        self.peer = peer  # the rank (of the communicator) at the other end, where known


class _Job:
    __slots__ = ("work", "event", "error")

    def __init__(self, work):
        self.work, self.event, self.error = work, threading.Event(), None


class _Waiter:
    """One thread that blocks in ``Work.wait()`` for the handles it is given, in order."""

    def __init__(self):
        self.q = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="mgrit-torch-dist-waiter", daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            job = self.q.get()
            if job is None:  # left behind (_leave_waiter_behind), and its last wait is over
                return
            try:
                job.work.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                job.error = exc
            job.event.set()

    def submit(self, work) -> _Job:
        job = _Job(work)
        self.q.put(job)
        return job


#: The helper of each thread that waits (by thread ident): a thread's waits return in its own order.
#: One helper for the process made two threads on two groups wait for each other for ever (each
#: process queued their waits in another order, and a wait blocked on one group held up the other's).
_WAITERS: dict = {}
_WAITERS_LOCK = threading.Lock()


def _waiter() -> _Waiter:
    me = threading.get_ident()
    w = _WAITERS.get(me)
    if w is None:
        with _WAITERS_LOCK:
            alive = {t.ident for t in threading.enumerate()}
            for ident in [i for i in _WAITERS if i not in alive]:
                _WAITERS.pop(ident).q.put(None)  # (a thread that ended: its helper ends after its last wait)
            w = _WAITERS[me] = _Waiter()
    return w


def _leave_waiter_behind() -> None:
    """This thread's helper may be blocked forever on an interrupted wait: use a new one. The old one
    ends once that wait returns (the peer sent, answered a request for a dummy, or closed)."""
    with _WAITERS_LOCK:
        w = _WAITERS.pop(threading.get_ident(), None)
    if w is not None:
        w.q.put(None)
        _BEHIND.append(w)


#: Helpers left behind on an interrupted wait (see :func:`_settle_at_exit`)
_BEHIND: list = []

#: ``time.monotonic()`` of the last failure notice, alarm or request for a dummy this process sent
#: or received (None: none ever; see :func:`_settle_at_exit`)
_LAST_SIGNAL: list = [None]

#: At exit, seconds a process that took part in a failure waits at most for the waits it left behind
#: to return, and for a quiet spell of :data:`EXIT_QUIET` seconds without failure messages
EXIT_SETTLE = 3.0
EXIT_QUIET = 1.0


def _signal() -> None:
    _LAST_SIGNAL[0] = time.monotonic()


def _settle_at_exit() -> None:
    """Keep Python running at exit until this process's blocked gloo waits can no longer return.

    The helper threads (a waiter left behind on an interrupted wait, the notice listeners) block in
    ``Work.wait()`` without the GIL. If such a wait returns while Python is finalising (the peer's
    connection closes because that process ended too; a peer sends a failure notice or asks for a
    dummy message in answer to this process's alarm), the thread cannot take the GIL back, Python
    ends it with ``pthread_exit``, and the unwinding through torch's C++ frames aborts the process
    (``terminate called without an active exception``: exit code -6 instead of the program's own).
    So a process that sent or received failure messages waits here, while Python still runs, until
    its left-behind waits have returned and no failure message came for :data:`EXIT_QUIET` seconds,
    at most :data:`EXIT_SETTLE` seconds in all. Processes that saw no failure do not wait at all.
    """
    if _LAST_SIGNAL[0] is None and not _BEHIND:
        return
    deadline = time.monotonic() + EXIT_SETTLE
    for w in _BEHIND:
        w.thread.join(max(0.0, deadline - time.monotonic()))
    while _LAST_SIGNAL[0] is not None:
        left = min(deadline, _LAST_SIGNAL[0] + EXIT_QUIET) - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.05))


atexit.register(_settle_at_exit)


# -- the state shared by all communicators over one process group ------------------------


def _backends(pg) -> dict:
    """The backend of each device type of a process group: ``{"cpu": "gloo", "cuda": "nccl"}`` (from
    ``get_backend_config``: ``get_backend`` says 'undefined' for torch's default group and 'cpu:gloo' for
    a group made with that string)."""
    import torch.distributed as dist

    pairs = (part.split(":", 1) for part in str(dist.get_backend_config(pg)).split(","))
    return {dev.strip(): name.strip() for dev, name in (p for p in pairs if len(p) == 2)}


class _Group:
    """One per process group: its ranks, the space counter, the notice listener."""

    def __init__(self, pg, control):
        import torch.distributed as dist

        self.pg = pg
        backends = _backends(pg)
        # (NCCL for CUDA tensors: a pure NCCL group, or torch's default 'cpu:gloo,cuda:nccl' on GPUs)
        self.nccl = backends.get("cuda") == "nccl"
        if self.nccl and control is None and backends.get("cpu") != "gloo":
            if pg is not dist.group.WORLD and pg is not dist.distributed_c10d._get_default_group():
                raise ValueError("an NCCL process group needs a gloo `control` group with the same ranks for "
                                 "the handshakes and failure notices: pass control=dist.new_group(ranks, "
                                 "backend='gloo') (called on every rank), or make both with "
                                 "mgrit.torch_dist.split_group(..., backend='nccl')")
            control = dist.new_group(backend="gloo")
        self.ctl = pg if control is None else control
        if _backends(self.ctl).get("cpu") != "gloo":
            what = "process group" if control is None else "control group"
            raise ValueError(f"the {what} must use gloo for CPU tensors (backend 'gloo', or torch's default "
                             f"'cpu:gloo,cuda:nccl'), got {dist.get_backend_config(self.ctl)!r}: initialise with "
                             "dist.init_process_group('gloo') on CPUs")
        self.rank = dist.get_rank(pg)
        self.size = dist.get_world_size(pg)
        self.world = list(dist.get_process_group_ranks(pg))
        if list(dist.get_process_group_ranks(self.ctl)) != self.world:
            raise ValueError("the control group must have the same ranks as the process group, in the same order")
        self.next_space = 2
        self.notices: dict = {}  # (space, epoch) -> (sender's rank in the group, message)
        self.listener = None
        if self.size > 1:
            self.listener = threading.Thread(target=self._listen, name="mgrit-torch-dist-notices", daemon=True)
            self.listener.start()

    def _listen(self):
        import torch

        tag = _wire(_NOTICE_SPACE, Tag.FAILURE)
        while True:
            buf = torch.zeros(_NOTE_BYTES, dtype=torch.uint8)
            work = self.ctl.recv_anysource([buf], tag)
            # never freed in this thread: a gloo handle's destructor lets go of the GIL and takes it
            # back, which aborts the process if Python began to shut down meanwhile
            _KEEP.append((work, buf))
            try:
                # with no timeout of its own the wait gets the group's (30 minutes by default), and a gloo
                # receive that times out closes every connection of the group: a healthy job failed then
                work.wait(_FOREVER)
            except BaseException:  # noqa: BLE001 - the group was destroyed: stop listening
                return
            _signal()
            space, epoch, src, n = (int(v) for v in buf[:32].numpy().view(np.int64))
            if space == _FULFIL:  # a peer left a receive from this rank behind: send it a dummy
                dummy = torch.zeros(max(n, 1), dtype=torch.uint8)
                _KEEP.append((self.ctl.send([dummy], src, epoch), dummy))
                continue
            note = bytes(buf[32: 32 + n].numpy()).decode("utf-8", "replace")
            self.notices.setdefault((space, epoch), (src, note))

    def request_fulfil(self, source: int, wire: int, nbytes: int) -> None:
        """Ask ``source`` to send a dummy message for a receive that will never be matched.

        gloo cannot cancel a receive, and a thread left blocked on one when the peer
        process exits during this interpreter's shutdown aborts the process; the
        listener of ``source`` answers with ``nbytes`` zeros (if it is still there).
        """
        import torch

        _signal()
        raw = np.zeros(_NOTE_BYTES, dtype=np.uint8)
        raw[:32] = np.array([_FULFIL, wire, self.rank, nbytes], dtype=np.int64).view(np.uint8)
        buf = torch.from_numpy(raw)
        try:
            _KEEP.append((self.ctl.send([buf], source, _wire(_NOTICE_SPACE, Tag.FAILURE)), buf))
        except RuntimeError:  # that process has exited: the receive fails by itself
            pass

    def send_notice(self, space: int, epoch: int, dest: int, note: str) -> None:
        """Tell ``dest`` (a rank of the group) that this rank failed in session ``epoch`` of ``space``."""
        import torch

        _signal()
        data = note.encode("utf-8")[: _NOTE_BYTES - 32]
        raw = np.zeros(_NOTE_BYTES, dtype=np.uint8)
        raw[:32] = np.array([space, epoch, self.rank, len(data)], dtype=np.int64).view(np.uint8)
        raw[32: 32 + len(data)] = np.frombuffer(data, dtype=np.uint8)
        buf = torch.from_numpy(raw)
        req = _Req(self.ctl.send([buf], dest, _wire(_NOTICE_SPACE, Tag.FAILURE)), False)
        _KEEP.append((req, buf))
        return req


_GROUPS: dict = {}  # id(process group) -> (process group, _Group)
_WRAPPERS: dict = {}  # id(process group) -> (process group, TorchDistComm) made by as_communicator


def _group(pg, control) -> _Group:
    hit = _GROUPS.get(id(pg))
    if hit is not None and hit[0] is pg:
        return hit[1]
    g = _Group(pg, control)
    _GROUPS[id(pg)] = (pg, g)
    return g


class _Channel:
    """A tag space and its bookkeeping: the logs of the sizes sent to every peer
    (``{code: [[nbytes, run], ...]}``), the counts received from every peer
    (``{code: n}``), the outstanding sends."""

    __slots__ = ("space", "sent", "recvd", "sends", "finished", "log", "epoch", "pending")

    def __init__(self, space: int, size: int, log: bool = True):
        if space >= _MAX_SPACE:
            raise RuntimeError(f"torch.distributed tag spaces exhausted ({_MAX_SPACE}): too many failed "
                               "sessions or split communicators in this process group")
        self.space = space
        self.log = log  # the base channel keeps no logs (it is never finished)
        self.sent = [{} for _ in range(size)]
        self.recvd = [{} for _ in range(size)]
        self.sends: list = []
        self.finished = False
        self.epoch = 0  # sessions held on this channel (the same count on every rank)
        self.pending = None  # (request, source, code, bytes) of a receive interrupted by a failure

    def reset(self) -> None:
        self.sent = [{} for _ in self.sent]
        self.recvd = [{} for _ in self.recvd]
        self.finished = False
        self.pending = None


def _expand(runs) -> list:
    """The sizes of a run-length encoded log ``[[nbytes, run], ...]``, in order."""
    return [n for n, k in runs for _ in range(k)]


class _Unreachable(RuntimeError):
    """gloo refused to post a message to a peer whose connection is closed."""


def _post(op, view, peer: int, tag: int):
    """Post a send or receive; a peer process that exited makes gloo raise here."""
    try:
        return op([view], peer, tag)
    except RuntimeError as exc:
        raise _Unreachable(str(exc)) from exc


class _Gone(NamedTuple):
    """What the root of a gather sends the other ranks instead of its answer when a member's process is
    gone: gloo tells only the ranks that wait for a process that ended, and the others wait for the root.
    :meth:`TorchDistComm._recv_obj` raises RemoteRankError naming that member when it receives one."""

    rank: int
    how: str


class _Timeout(Exception):
    """A wait of the cleanup passed its deadline."""


def _bytes_of(buf):
    """A flat uint8 tensor view of a contiguous tensor or numpy array (shares memory)."""
    import torch

    if isinstance(buf, np.ndarray):
        return torch.from_numpy(buf.reshape(-1).view(np.uint8))
    return buf.reshape(-1).view(torch.uint8)


class TorchDistComm(_SessionComm):
    """A ``torch.distributed`` process group along the time axis (see the module docstring).

    Parameters
    ----------
    group : torch.distributed.ProcessGroup, optional
        The layer (time) group; default: the world group of
        ``torch.distributed.init_process_group``. gloo or NCCL.
    control : torch.distributed.ProcessGroup, optional
        A gloo group with the same ranks, for everything but the states when
        ``group`` is an NCCL group (made here for the world group).

    Creating a TorchDistComm is collective over ``group`` (the ranks agree on
    a tag space). Prefer ``mgrit.as_communicator(group)``, which returns the
    same wrapper for the same group.

    Attributes
    ----------
    tag_ub : int
        Largest user tag (``Tag.USER + 479``): tags travel as 10-bit codes.
    cleanup_timeout : float
        Seconds the cleanup after a failure may take before the channel is
        retired (default 3).

    Examples
    --------
    Under ``torchrun --nproc_per_node 2 script.py``::

        import torch.distributed as dist, mgrit
        dist.init_process_group("gloo")
        res = mgrit.solve(prop, u0, t, comm=dist.group.WORLD)   # or comm=TorchDistComm()
    """

    tag_ub = Tag.USER + 479
    cleanup_timeout = 3.0

    def __init__(self, group=None, control=None):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call "
                               "torch.distributed.init_process_group('gloo') first (under torchrun the "
                               "rendezvous comes from the environment)")
        pg = dist.group.WORLD if group is None else group
        if not is_process_group(pg):
            raise TypeError(f"`group` must be a torch.distributed ProcessGroup, got {type(pg).__name__}")
        g = _group(pg, control)
        self._init_view(g, list(range(g.size)), None)
        self._bootstrap()

    @classmethod
    def _view(cls, g: _Group, members: list, space: int) -> "TorchDistComm":
        new = cls.__new__(cls)
        new._init_view(g, members, space)
        return new

    def _init_view(self, g: _Group, members: list, space):
        self._g = g
        self._members = members  # group rank of each rank of this communicator
        self._index = {m: i for i, m in enumerate(members)}
        self.rank = self._index[g.rank]
        self.size = len(members)
        self._base = _Channel(0 if space is None else space, self.size, log=False)  # space 0: bootstrap
        self._stack = [self._base]
        self._pool: dict = {}
        self._broken = None
        self._freed = False
        self._finishing = False

    def _bootstrap(self) -> None:
        """Agree on a fresh tag space for the base channel (on space 0: bootstrap only)."""
        boot = _Channel(0, self.size, log=False)
        self._stack = [boot]
        counters = self._gather_to_root(boot, self._g.next_space, Tag.HANDSHAKE)
        space = self._from_root(boot, None if counters is None else max(counters), Tag.HANDSHAKE)
        self._complete_sends(boot)
        self._g.next_space = max(self._g.next_space, space + 1)
        self._base = _Channel(space, self.size, log=False)
        self._stack = [self._base]

    @property
    def group(self):
        """The process group this communicator sends on."""
        return self._g.pg

    # -- naming -----------------------------------------------------------------
    def world_rank(self, r=None):
        return self._g.world[self._members[self.rank if r is None else int(r)]]

    def _who(self, r: int) -> str:
        w = self.world_rank(r)
        return f"rank {w}" if w == r else f"rank {w} (rank {r} of this communicator)"

    def _remote(self, r: int, note: str, more: str = "") -> RemoteRankError:
        return RemoteRankError(f"{self._who(r)} failed{more}: {note}", rank=r, world_rank=self.world_rank(r))

    # -- failure detection ------------------------------------------------------
    def _usable(self) -> None:
        if self._freed:
            raise RuntimeError("this communicator was freed")
        if self._broken is not None:
            r, note = self._broken
            if r == self.rank:
                raise RuntimeError(f"this communicator is unusable after this rank's alarm ({note}); "
                                   "wrap the process group again: TorchDistComm(group)")
            raise self._remote(r, note, " (alarm)")

    def _poll(self) -> None:
        """Raise RemoteRankError if a failure notice (on an open channel) or an alarm arrived."""
        notices = self._g.notices
        if notices:
            # while finishing the innermost session, only its notices count (as in MPIComm: a
            # rank that left the inner session would never join a cleanup of it)
            channels = self._stack[-1:] if self._finishing and len(self._stack) > 1 else reversed(self._stack[1:])
            for ch in channels:
                hit = notices.get((ch.space, ch.epoch))
                if hit is not None and hit[0] in self._index:
                    raise self._remote(self._index[hit[0]], hit[1])
            hit = notices.get((self._base.space, 0))
            if hit is not None and self._broken is None and hit[0] in self._index:
                self._broken = (self._index[hit[0]], hit[1])
        self._usable()

    def _wait(self, req: _Req, deadline: float | None = None) -> None:
        """Wait for ``req`` while listening for failures (see the module docstring).

        With a ``deadline`` (``time.monotonic()``; used by the cleanup) nobody
        listens for failures and :class:`_Timeout` is raised when it passes.
        """
        if req.done:
            return
        start = time.perf_counter()
        try:
            self._wait_for(req, deadline)
        finally:
            self.waited += time.perf_counter() - start

    def _wait_for(self, req: _Req, deadline: float | None) -> None:
        work = req.work
        if req.device:  # NCCL handles can be polled
            backoff = _Backoff()
            while not work.is_completed():
                if deadline is None:
                    self._poll()
                elif time.monotonic() > deadline:
                    raise _Timeout
                backoff.pause()
            work.wait()
            req.done = True
            return
        if req.job is None:
            req.job = _waiter().submit(work)
        job = req.job
        if not job.event.wait(2e-4):
            try:
                while not job.event.wait(2e-3):
                    if deadline is None:
                        self._poll()
                    elif time.monotonic() > deadline:
                        raise _Timeout
            except BaseException:
                _leave_waiter_behind()
                raise
        if job.error is not None:
            if req.peer is not None and _lost(str(job.error)) is not None:
                raise self._gone(req.peer, f"its connection closed while this rank waited for it "
                                 f"({_reason(job.error)})") from job.error
            if "Timed out" in str(job.error):
                who = "" if req.peer is None else f" for {self._who(req.peer)}"
                raise RuntimeError(
                    f"torch.distributed timed out while this rank waited{who} ({_reason(job.error)}): the process "
                    "group's timeout ran out (a rank slower than it, e.g. a validation on one rank only, or a rank "
                    "that never makes the call); raise it with init_process_group(timeout=...), or make every "
                    "rank take part") from job.error
            raise RuntimeError(f"torch.distributed failed ({job.error}); a peer process may have died") \
                from job.error
        req.done = True

    def _gone(self, r: int, how: str, found: bool = True) -> RemoteRankError:
        """The error of a wait for (or a message to) rank ``r`` whose process is gone. ``found``: this rank
        found it (``gone=True``: the others may not know; a session passes it on, a gather's root tells
        the other ranks), else a root's :class:`_Gone` told it."""
        _signal()  # (a failure message came: settle at exit, see _settle_at_exit)
        return RemoteRankError(f"{self._who(r)} is gone: {how}; its process ended, or its wait for this "
                               "rank timed out (its own error, if any, is in its output)",
                               rank=r, world_rank=self.world_rank(r), gone=found)

    # -- sending and receiving on a channel --------------------------------------
    def _route(self, buf):
        """(process group, device stream?) for a wire buffer."""
        if self._g.nccl and not isinstance(buf, np.ndarray) and buf.is_cuda:
            return self._g.pg, True
        return self._g.ctl, False

    def _isend(self, ch: _Channel, buf, dest: int, tag: int, log: bool = True):
        pg, device = self._route(buf)
        view = _bytes_of(buf)
        if view.numel() == 0:
            view = view.new_zeros(1)  # gloo and NCCL need a byte: the receiver expects one too
        try:
            work = _post(pg.send, view, self._members[dest], 0 if device else _wire(ch.space, tag))
        except _Unreachable as exc:
            raise self._gone(dest, f"torch.distributed could not send to it ({_reason(exc)})") from exc
        req = _Req(work, device, dest)
        if log and ch.log:
            runs = ch.sent[dest].setdefault(_DEVICE if device else _code(tag), [])
            n = view.numel()
            if runs and runs[-1][0] == n:
                runs[-1][1] += 1
            else:
                runs.append([n, 1])
        ch.finished = False
        ch.sends.append((req, buf, view))
        if not ch.log and len(ch.sends) > 64:
            self._complete_sends(ch)  # the base channel is never finished: complete its sends now and then
        return req

    def _recv_into(self, ch: _Channel, buf, source: int, tag: int, count: bool = True):
        pg, device = self._route(buf)
        view = _bytes_of(buf)
        if view.numel() == 0:
            view = view.new_zeros(1)
        ch.finished = False
        key = _DEVICE if device else _code(tag)
        wire = 0 if device else _wire(ch.space, tag)
        try:
            work = _post(pg.recv, view, self._members[source], wire)
        except _Unreachable as exc:
            raise self._gone(source, f"torch.distributed could not receive from it ({_reason(exc)})") from exc
        req = _Req(work, device, source)
        try:
            self._wait(req)
        except BaseException:
            if count and ch.log and self._broken is None:
                ch.pending = (req, source, key, view.numel(), buf)  # the cleanup fulfils it
            elif self._broken is not None and not device:  # an alarm: no cleanup; ask the peer for a dummy
                self._g.request_fulfil(self._members[source], wire, view.numel())
            _KEEP.append((req, buf))
            raise
        if count and ch.log:
            ch.recvd[source][key] = ch.recvd[source].get(key, 0) + 1
        return buf

    def _isend_obj(self, ch: _Channel, obj, dest: int, tag: int, log: bool = True):
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
        head = np.zeros(_HEAD, dtype=np.uint8)
        head[:8] = np.array([data.size], dtype=np.int64).view(np.uint8)
        k = min(data.size, _HEAD - 8)
        head[8: 8 + k] = data[:k]
        self._isend(ch, head, dest, tag, log)
        if data.size > k:
            self._isend(ch, data[k:].copy(), dest, tag, log)

    def _recv_obj(self, ch: _Channel, source: int, tag: int, count: bool = True):
        head = self._recv_into(ch, np.empty(_HEAD, dtype=np.uint8), source, tag, count)
        n = int(head[:8].view(np.int64)[0])
        k = min(n, _HEAD - 8)
        if n > k:
            rest = self._recv_into(ch, np.empty(n - k, dtype=np.uint8), source, tag, count)
            obj = pickle.loads(head[8: 8 + k].tobytes() + rest.tobytes())
        else:
            obj = pickle.loads(head[8: 8 + k].tobytes())
        if isinstance(obj, _Gone):
            raise self._gone(obj.rank, obj.how, found=False)
        return obj

    def _complete_sends(self, ch: _Channel) -> None:
        if not ch.sends:
            return
        sends, ch.sends = ch.sends, []
        try:
            for req, *_ in sends:
                self._wait(req)
        except BaseException:
            ch.sends = sends + ch.sends
            raise

    # -- phases of a session -------------------------------------------------------
    def _depth(self):
        return len(self._stack) - 1

    @property
    def _top(self) -> _Channel:
        return self._stack[-1]

    def _gather_to_root(self, ch: _Channel, obj, tag: int, log: bool = True):
        """Every rank's ``obj`` on rank 0 (a list), None elsewhere. When a member's process is gone the
        root still receives from the others, answers them with :class:`_Gone` (they raise
        RemoteRankError where they wait for its answer) and raises: nobody waits for the root."""
        if self.rank != 0:
            self._isend_obj(ch, obj, 0, tag, log)
            return None
        rows, gone = [obj], []
        for j in range(1, self.size):
            try:
                rows.append(self._recv_obj(ch, j, tag, log))
            except RemoteRankError as exc:
                if not exc.gone or exc.rank != j:
                    raise
                gone.append(exc)
        if gone:
            first = gone[0]
            note = _Gone(first.rank, f"its connection to {self._who(0)} closed while that rank gathered "
                                     "from every rank")
            lost = {e.rank for e in gone}
            for j in range(1, self.size):
                if j not in lost:
                    try:
                        self._isend_obj(ch, note, j, tag, log)
                    except RemoteRankError:
                        pass
            raise first
        return rows

    def _from_root(self, ch: _Channel, obj, tag: int, log: bool = True):
        if self.rank == 0:
            for j in range(1, self.size):
                self._isend_obj(ch, obj, j, tag, log)
            return obj
        return self._recv_obj(ch, 0, tag, log)

    def open(self, failure=None, signature=None, share=None):
        if failure is not None and self._broken is not None:
            return None
        self._poll()  # an alarm that arrived meanwhile: raise before posting to a peer that left
        if self.size == 1:
            if failure is not None:
                return None
            self._stack.append(_Channel(self._base.space, 1))
            return [share]
        ch = self._top
        agreed = self._handshake(ch, failure, signature, self._g.next_space, share)
        if agreed is None:
            return None
        reuse, new_space, shares = agreed
        if reuse is not None:
            new = self._pool.pop(reuse)
        else:
            new = _Channel(new_space, self.size)
            self._g.next_space = max(self._g.next_space, new_space + 1)
        new.epoch += 1
        self._stack.append(new)
        return shares

    def _release(self, ch: _Channel) -> None:
        if self.size == 1:
            return
        ch.reset()
        self._pool[ch.space] = ch
        while len(self._pool) > _POOL_SIZE:
            self._pool.pop(next(iter(self._pool)))

    def _after_handshake(self, ch) -> None:
        if ch is self._base:
            self._complete_sends(ch)

    def _can_clean(self, ch) -> bool:
        return not self._g.nccl  # NCCL receives cannot be fulfilled: retire the channel

    def _before_finish(self) -> None:
        self._poll()  # an alarm that arrived meanwhile: raise before posting to a peer that left

    def _reduce_tensor(self, x):
        if x.is_cuda and self._g.nccl:  # on the device, the same tree and order
            import torch

            return self._reduce(x.detach().clone(), torch.add)
        return super()._reduce_tensor(x)

    def _abandon(self, ch: _Channel) -> None:
        self._retire(ch)

    def _retire(self, ch: _Channel) -> None:
        _KEEP.append(ch.sends)
        _N_RETIRED[0] += 1

    def _notify(self, ch: _Channel, exc: BaseException) -> None:
        self._send_notices(ch.space, ch.epoch, _note(exc))

    def _send_notices(self, space: int, epoch: int, note: str) -> None:
        """A failure notice (or, on the base space with epoch 0, an alarm) to every other rank."""
        reqs = []
        for r in range(self.size):
            if r != self.rank:
                try:
                    reqs.append(self._g.send_notice(space, epoch, self._members[r], note))
                except RuntimeError:  # that process is gone: it needs no notice
                    pass
        self._deliver(reqs)

    def _deliver(self, reqs: list) -> None:
        """Wait (up to 1 s) for notices to go out: the process may exit right after."""
        deadline = time.monotonic() + 1.0
        try:
            for req in reqs:  # the peers' listeners always have a receive posted: this is quick
                self._wait(req, deadline)
        except (_Timeout, RuntimeError):
            pass

    def _cleanup(self, ch: _Channel) -> bool:
        """After a failure: empty the channel, within :attr:`cleanup_timeout` seconds.

        gloo cannot cancel a receive, so the peers *fulfil* it instead: every rank
        sends each peer the log of what it sent there and what it posted (received
        or waiting, with the sizes of the waiting receive). Each rank then receives
        (and discards) what was sent to it and not received, sends a dummy message
        of the right size for every receive a peer posted that it never sent, and
        completes its own sends. True when the channel is empty (it goes back to the
        pool); False on a time-out or an alarm (the channel is retired).
        """
        import torch

        deadline = time.monotonic() + self.cleanup_timeout
        peers = [p for p in range(self.size) if p != self.rank]
        posted = [dict(d) for d in ch.recvd]
        waiting = [{} for _ in range(self.size)]
        if ch.pending is not None:
            _, src, code, nbytes, _ = ch.pending
            posted[src][code] = posted[src].get(code, 0) + 1
            waiting[src][code] = [nbytes]
        reqs = []
        try:
            for p in peers:  # on CLEANUP, neither logged nor counted
                self._isend_obj(ch, (ch.sent[p], posted[p], waiting[p]), p, Tag.CLEANUP, log=False)
            for p in peers:
                their_sent, their_posted, their_waiting = self._recv_obj_until(ch, p, deadline)
                for code, runs in their_sent.items():  # drain
                    for n in _expand(runs)[posted[p].get(code, 0):]:
                        buf = torch.empty(n, dtype=torch.uint8)
                        reqs.append(_Req(self._g.ctl.recv([buf], self._members[p], (ch.space << _CODE_BITS) | code),
                                         False))
                        _KEEP.append(buf)
                for code, k in their_posted.items():  # fulfil
                    extra = k - len(_expand(ch.sent[p].get(code, [])))
                    waiting_there = their_waiting.get(code, [])
                    if extra > len(waiting_there):
                        raise _Timeout  # inconsistent logs: give the channel up
                    for n in waiting_there[len(waiting_there) - extra:] if extra > 0 else []:
                        buf = torch.zeros(n, dtype=torch.uint8)
                        reqs.append(_Req(self._g.ctl.send([buf], self._members[p], (ch.space << _CODE_BITS) | code),
                                         False))
                        _KEEP.append(buf)
            if ch.pending is not None:
                reqs.append(ch.pending[0])
            reqs += [s[0] for s in ch.sends]
            for req in reqs:
                self._wait(req, deadline)
        except (_Timeout, RemoteRankError, RuntimeError):
            _KEEP.append((reqs, ch.sends, ch.pending))
            if ch.pending is not None and not ch.pending[0].device:
                _, src, code, nbytes, _ = ch.pending
                self._g.request_fulfil(self._members[src], (ch.space << _CODE_BITS) | code, nbytes)
            return False
        ch.sends = []
        return True

    def _recv_obj_until(self, ch: _Channel, source: int, deadline: float):
        head = np.empty(_HEAD, dtype=np.uint8)
        wire = _wire(ch.space, Tag.CLEANUP)
        self._wait(_Req(self._g.ctl.recv([_bytes_of(head)], self._members[source], wire), False), deadline)
        n = int(head[:8].view(np.int64)[0])
        k = min(n, _HEAD - 8)
        data = head[8: 8 + k].tobytes()
        if n > k:
            rest = np.empty(n - k, dtype=np.uint8)
            self._wait(_Req(self._g.ctl.recv([_bytes_of(rest)], self._members[source], wire), False), deadline)
            data += rest.tobytes()
        return pickle.loads(data)

    def notify_failure(self, exc):
        if len(self._stack) > 1 and self.size > 1:
            self._notify(self._top, exc)

    # -- point to point ---------------------------------------------------
    def _before_post(self):
        self._poll()  # an alarm that arrived meanwhile: raise before posting to a peer that left

    def _device_buffers(self):
        return self._g.nccl

    def _after_object_sends(self, ch):
        if ch is self._base:  # outside sessions nobody else completes them
            self._complete_sends(ch)

    def _send_buffer(self, x):
        """A private contiguous copy of ``x`` (a tensor on the device only for NCCL)."""
        if B.is_torch(x):
            import torch

            x = x.detach()
            if x.is_cuda and not self._g.nccl:
                return x.cpu()  # gloo: staged through host memory
            return x.clone(memory_format=torch.contiguous_format)
        return np.array(x, copy=True, order="C")

    # -- reductions -------------------------------------------------------
    def _reduce(self, x, op):
        """``op``-reduce ``x`` over all ranks up a binomial tree to rank 0 and back down
        (the order of :meth:`MPIComm._reduce <mgrit.comm.MPIComm._reduce>`: the same bits)."""
        self._poll()  # an alarm that arrived meanwhile: raise before posting to a peer that left
        ch, r, P = self._top, self.rank, self.size
        if isinstance(x, np.ndarray):
            acc = np.ascontiguousarray(x)
            if P == 1:
                return acc.copy()
            empty = np.empty_like
        else:
            acc = x.contiguous()
            if P == 1:
                return acc.clone()
            import torch

            empty = torch.empty_like
        waits = []
        mask = 1
        while mask < P:
            if r & mask:
                waits.append(self._isend(ch, acc, r - mask, Tag.REDUCE))
                break
            if r + mask < P:
                acc = op(acc, self._recv_into(ch, empty(acc), r + mask, Tag.REDUCE))
            mask <<= 1
        if r:
            acc = self._recv_into(ch, empty(acc), r - (r & -r), Tag.REDUCE)
            mask = (r & -r) >> 1
        else:
            mask = (1 << (P - 1).bit_length()) >> 1
        while mask:
            if r + mask < P:
                waits.append(self._isend(ch, acc, r + mask, Tag.REDUCE))
            mask >>= 1
        for req in waits:  # the buffers are the caller's and the result: done before returning
            self._wait(req)
        ch.sends = [s for s in ch.sends if not s[0].done]
        return acc

    # -- end of a session ---------------------------------------------------
    def _finish(self):
        ch, r, P = self._top, self.rank, self.size
        if P > 1 and ch is not self._base:
            # barrier through rank 0 carrying the logs of the sizes sent: col[j] = what j sent here
            # before its barrier message (the barrier messages are logged too: a cleanup after a
            # failure in finish must know them; here they are received explicitly)
            mine = [{code: [list(run) for run in runs] for code, runs in d.items()} for d in ch.sent]
            col = self._transpose_via_root(ch, mine, Tag.BARRIER)
            for j in range(P):  # receive what was sent here but never received
                if j == r:
                    continue
                for code, runs in col[j].items():
                    for n in _expand(runs)[ch.recvd[j].get(code, 0):]:
                        self._drain_one(ch, j, code, n)
        self._complete_sends(ch)
        ch.finished = True

    def _drain_one(self, ch: _Channel, source: int, code: int, nbytes: int) -> None:
        import torch

        if code == _DEVICE:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))
            req = _Req(self._g.pg.recv([buf], self._members[source], 0), True)
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            req = _Req(self._g.ctl.recv([buf], self._members[source], (ch.space << _CODE_BITS) | code), False)
        self._wait(req)
        ch.recvd[source][code] = ch.recvd[source].get(code, 0) + 1

    # -- alarms and communicators ---------------------------------------------
    def alarm(self, exc):
        if self.size == 1 or self._broken is not None or self._freed:
            return
        note = _note(exc)
        self._send_notices(self._base.space, 0, note)
        self._broken = (self.rank, note)

    def split(self, color, key=0):
        """Ranks with the same ``color`` form a new communicator ordered by ``key`` (collective).

        A view of the same process group with a fresh tag space: no
        ``new_group`` (which would be collective over the whole world). None
        for ``color`` None or negative (such as ``MPI.UNDEFINED``).
        """
        self._poll()  # an alarm that arrived meanwhile: raise before posting to a peer that left
        color, key, failure = split_arguments(color, key)
        # every rank's (color, key, next tag space), exchanged as a handshake is (so that a rank here and
        # one in a session's handshake or in agree both get an error naming both calls); every rank then
        # makes the same plan from them
        notes = self._exchange(Call("Communicator.split", ()), (color, key, self._g.next_space), failure)
        top = max(n for _, _, n in notes)
        colors = sorted({c for c, _, _ in notes if c is not None})
        groups = {c: (top + i, [self._members[r] for r in sorted((r for r in range(self.size) if notes[r][0] == c),
                                                                 key=lambda r: (notes[r][1], r))])
                  for i, c in enumerate(colors)}
        self._g.next_space = max(self._g.next_space, top + len(colors))
        if color is None:
            return None
        space, members = groups[color]
        return TorchDistComm._view(self._g, members, space)

    def free(self):
        if self._freed:
            return
        if len(self._stack) > 1:
            raise RuntimeError("free() inside a session: close the session first")
        _KEEP.append(self._base.sends)
        self._pool.clear()
        self._freed = True
        hit = _WRAPPERS.get(id(self._g.pg))
        if hit is not None and hit[1] is self:
            del _WRAPPERS[id(self._g.pg)]


def wrap(group) -> TorchDistComm:
    """The cached :class:`TorchDistComm` of a process group (made on first use: collective)."""
    hit = _WRAPPERS.get(id(group))
    if hit is not None and hit[0] is group and not hit[1]._freed:
        return hit[1]
    wrapper = TorchDistComm(group)
    _WRAPPERS[id(group)] = (group, wrapper)
    return wrapper


def split_group(layer_size: int, group=None, backend: str | None = None):
    """Split the world into a 2-D grid of process groups: (layer group, data group) of this rank.

    The equivalent of :func:`mgrit.split_comm` for ``torch.distributed``:
    world rank ``r`` sits at layer index ``r % layer_size`` and data index
    ``r // layer_size``. Ranks with the same data index form one layer group
    (``comm=`` of ``solve`` / ``LayerParallel``); ranks with the same layer
    index form one data group (shard the batch over it and call
    ``allreduce_gradients(model, data_group)``).

    Collective over the whole world: every rank creates every group, in the
    same order (``torch.distributed.new_group`` requires it).

    Parameters
    ----------
    layer_size : int
        Number of ranks along the layer (time) dimension; it must divide the
        world size.
    group : None
        Reserved: only the world group can be split (``new_group`` is over the world).
    backend : str, optional
        Backend of the new groups (default: the world's). With ``"nccl"`` a
        gloo control group is made beside each group and registered for it.

    Returns
    -------
    layer_group, data_group : torch.distributed.ProcessGroup
    """
    import torch.distributed as dist

    if group is not None and group is not dist.group.WORLD:
        raise ValueError("`split_group` splits the world group only (torch.distributed.new_group is collective "
                         "over the world); pass group=None")
    size, rank = dist.get_world_size(), dist.get_rank()
    if size > 1:  # every rank is here (or an error), with the same layer_size, before new_group, which waits
        wrap(dist.group.WORLD).agree(layer_size, "`layer_size` of split_comm")  # for every rank for ever
    if isinstance(layer_size, (bool, np.bool_)) or not isinstance(layer_size, (int, np.integer)) \
            or layer_size < 1 or size % layer_size:
        raise ValueError(f"`layer_size` must divide the world size {size}, got {layer_size!r}")
    backend = backend or dist.get_backend()
    mine = {}

    def make(kind, index, ranks):
        pg = dist.new_group(ranks, backend=backend)
        ctl = dist.new_group(ranks, backend="gloo") if backend == "nccl" else None
        if rank in ranks:
            mine[kind] = pg
            if ctl is not None:
                _group(pg, ctl)

    for d in range(size // layer_size):  # layer groups
        make("layer", d, [d * layer_size + i for i in range(layer_size)])
    for i in range(layer_size):  # data groups
        make("data", i, list(range(i, size, layer_size)))
    return mine["layer"], mine["data"]
