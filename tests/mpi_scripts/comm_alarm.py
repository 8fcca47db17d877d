"""Failures outside sessions: ``alarm`` reaches a rank that waits in ``allreduce_array``.

Run as ``mpiexec -n 2 python comm_alarm.py``. Checks, on three communicators
(an alarm makes a communicator unusable, so each case takes a fresh one):

1. ``as_communicator`` gives the same wrapper for the same raw communicator,
   and ``allreduce_array`` outside a session sums over the ranks (same bits
   on both).
2. Rank 1 calls ``alarm(RuntimeError("NaN in shard"))`` and leaves its step;
   rank 0 waits in ``allreduce_array`` outside any session and must raise
   RemoteRankError naming world rank 1 within a few seconds. Afterwards the
   communicator refuses work on both ranks (quickly, no hang).
3. The alarm reaches a rank waiting in a session's handshake.
4. The alarm reaches a rank waiting in ``recv`` inside a session (the other rank
   raises out of its session after the alarm).

Every rank prints ``rank r: alarm OK`` or ``rank r: MISMATCH ...`` lines and
exits 0 only on success (MPI_Finalize must return despite what the alarms
left behind).
"""
from __future__ import annotations

import sys
import time

import numpy as np

from mgrit.comm import RemoteRankError, as_communicator

LIMIT = 5.0  # seconds within which the alarm must arrive


def expect_alarm(fn, label: str, bad: list) -> None:
    """``fn()`` must raise RemoteRankError naming world rank 1 within LIMIT seconds."""
    start = time.perf_counter()
    try:
        fn()
    except RemoteRankError as exc:
        elapsed = time.perf_counter() - start
        if exc.world_rank != 1 or not str(exc).startswith("rank 1 failed") or "NaN in shard" not in str(exc):
            bad.append(f"{label}: wrong error {exc!r} (world_rank {exc.world_rank})")
        if elapsed > LIMIT:
            bad.append(f"{label}: the alarm took {elapsed:.1f} s")
        print(f"rank 0: {label}: RemoteRankError: {exc} [after {elapsed:.2f} s]", flush=True)
        return
    except Exception as exc:  # noqa: BLE001
        bad.append(f"{label}: got {type(exc).__name__}: {exc}")
        return
    bad.append(f"{label}: no error")


def expect_refusal(fn, label: str, bad: list, kind=Exception) -> None:
    start = time.perf_counter()
    try:
        fn()
    except kind:
        if time.perf_counter() - start > LIMIT:
            bad.append(f"{label}: refusing took too long")
        return
    except Exception as exc:  # noqa: BLE001
        bad.append(f"{label}: got {type(exc).__name__}: {exc}")
        return
    bad.append(f"{label}: the communicator still worked after an alarm")


def main() -> int:
    from mpi4py import MPI  # here, so that importing this file (pytest collection) starts no MPI

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    raws = [world.Dup() for _ in range(3)]
    c = as_communicator(world)
    bad: list = []

    # 1. one wrapper per raw communicator; the sum outside a session
    if as_communicator(world) is not c or as_communicator(raws[0]) is not as_communicator(raws[0]):
        bad.append("as_communicator made two wrappers for one communicator")
    x = np.arange(5.0) * (rank + 1) + 0.1
    total = c.allreduce_array(x)
    expected = sum(np.arange(5.0) * (r + 1) + 0.1 for r in range(world.Get_size()))
    if not np.array_equal(total, expected) or total.shape != x.shape:
        bad.append(f"allreduce_array gave {total}, expected {expected}")
    if not np.array_equal(c.allreduce_array(np.eye(2, dtype=np.int32) * rank), np.eye(2) * 1):
        bad.append("allreduce_array of int32")

    # 2. rank 1 alarms and leaves; rank 0 waits in allreduce_array outside any session
    a = as_communicator(raws[0])
    if rank == 1:
        time.sleep(0.2)  # rank 0 is waiting in the reduction by now
        a.alarm(RuntimeError("NaN in shard"))
        expect_refusal(lambda: a.allreduce_array(np.zeros(3)), "after own alarm", bad, RuntimeError)
    else:
        expect_alarm(lambda: a.allreduce_array(np.zeros(3)), "allreduce_array", bad)
        expect_refusal(lambda: a.bcast(1), "after the alarm", bad, RemoteRankError)

    # 3. the alarm reaches a handshake
    h = as_communicator(raws[1])
    if rank == 1:
        time.sleep(0.2)  # rank 0 is waiting in the handshake by now
        h.alarm(RuntimeError("NaN in shard (before the session)"))
    else:
        def enter():
            with h.session():
                pass

        expect_alarm(enter, "session handshake", bad)

    # 4. the alarm reaches a recv inside a session
    s = as_communicator(raws[2])
    try:
        with s.session():
            if rank == 1:
                s.alarm(RuntimeError("NaN in shard (inside a session)"))
                raise KeyError("leaving the session")
            expect_alarm(lambda: s.recv(np.zeros(2), 1, 5), "recv in a session", bad)
    except KeyError:
        pass
    except RemoteRankError:
        pass  # rank 0 leaves its session with the alarm's error (already checked)

    for line in bad:
        print(f"rank {rank}: MISMATCH {line}", flush=True)
    if not bad:
        print(f"rank {rank}: alarm OK", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
