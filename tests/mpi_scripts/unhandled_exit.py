"""A rank that ends while the others wait for it (run under mpiexec).

Usage: mpiexec -n P python unhandled_exit.py WHERE
``between`` and ``solve``: the last rank raises ``RuntimeError("user code failed on rank r")`` and does not catch it:
``between``: after a LayerParallel forward pass, where the others go on to backward;
``solve``: between two ``mgrit.solve`` calls, before the second one the others enter (the
communicator was wrapped by the first). Python prints the traceback and
finalises MPI; the other ranks, waiting in a handshake for it, must raise RemoteRankError
naming it (the exit guard of mgrit.comm alarms them) instead of waiting for ever.
``build`` and ``split``: the last rank raises before it ever wraps the world communicator, while the
others build a LayerParallel over it (``build``) or split it with ``mgrit.split_comm`` (``split``):
they wait to duplicate it with a rank that never comes, and must raise RemoteRankError naming it
(its world alarm) instead of waiting in MPI_Comm_dup for ever. ``badstr``: the same as ``build``, with
an exception whose ``__str__`` raises.
``skip``: the last rank runs a LayerParallel forward pass and ends without an error, skipping the
backward pass the others enter: they must raise RemoteRankError saying that it exited.
``skipfree``: the same on a duplicate of the world communicator that the last rank frees before it
ends (a version of the library that freed its own duplicates with the user's left the others waiting).
``skiplate``: the same on 3 or more ranks, rank 1 building its error only after rank 0 died of it: rank 1's
error must not cite rank 0's death of this same exit as an earlier failure (a consequence, not news).
``done``: every rank runs forward and backward, and rank 0 is slow to finish the backward pass's
session (it sleeps and then polls inside ``finish``) while the last rank, done, exits: the alarm
of its exit must not fail rank 0's finish; every rank prints "finished" and the job ends cleanly.
``gather``: every rank solves and gathers the result to rank 0, rank 1 late: the last rank, done,
exits while rank 0 waits for rank 1 outside any session: rank 0 gathers, the job ends cleanly.
``forgotten``: every rank solves; the last rank skips the gather to rank 0 and ends without an error:
rank 0, waiting outside any session for its part, must raise RemoteRankError saying that it exited;
the other ranks finish.
"""
import time
import sys

import numpy as np
import torch
from torch import nn

import mgrit
from checks import rank, size, world
from mgrit.comm import MPIComm
from propagators import Dahlquist
from propagators.torch import LayerParallel

where = sys.argv[1]
last = rank == size - 1
if where == "between":
    torch.manual_seed(0)
    lp = LayerParallel([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(16)], T=1.0, cf=2,
                       max_levels=3, comm=world)
    y = lp(torch.randn(3, 4))
    if last:
        raise RuntimeError(f"user code failed on rank {rank}")
    y.sum().backward()
elif where in ("skip", "skiplate", "done", "skipfree"):
    if where == "skiplate" and rank == 1:
        import mgrit.comm as mc
        original_error = MPIComm._exited_error

        def late(self, r):  # wait until rank 0's world alarm (it died of this exit) has arrived
            t = time.perf_counter()
            while 0 not in mc._world_failures(self._MPI) and time.perf_counter() - t < 10.0:
                time.sleep(0.01)
            return original_error(self, r)

        MPIComm._exited_error = late
    if where == "done" and rank == 0:
        original = MPIComm._complete_sends

        def slow(self, ch):  # the last rank has left the session by now, and exits
            if self._depth() == 1 and self._finishing:
                time.sleep(1.0)
                self._poll()
            original(self, ch)

        MPIComm._complete_sends = slow
    torch.manual_seed(0)
    comm = world.Dup() if where == "skipfree" else world
    lp = LayerParallel([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(16)], T=1.0, cf=2,
                       max_levels=3, comm=comm)
    y = lp(torch.randn(3, 4))
    if where == "skipfree" and last:
        comm.Free()  # the user's communicator freed: the block's own duplicates still carry the exit alarm
    if where == "done" or not last:
        y.sum().backward()
    if where == "done":
        print(f"rank {rank} finished", flush=True)
        sys.exit(0)
    if last:
        sys.exit(0)  # ends without an error, the backward pass skipped
elif where == "gather":  # the usual end of a script; rank 1 is slower to get there than the last rank
    res = mgrit.solve(Dahlquist(-1.0), np.array([1.0]), np.linspace(0.0, 1.0, 33), cf=2, comm=world)
    if rank == 1:
        time.sleep(1.0)
    u = mgrit.gather(res, root=0)
    print(f"rank {rank} finished" + (f" {u.shape}" if rank == 0 else ""), flush=True)
    sys.exit(0)
elif where == "forgotten":
    res = mgrit.solve(Dahlquist(-1.0), np.array([1.0]), np.linspace(0.0, 1.0, 33), cf=2, comm=world)
    if not last:
        mgrit.gather(res, root=0)
    print(f"rank {rank} finished", flush=True)
    sys.exit(0)
elif where in ("build", "split", "badstr"):
    if last and where == "badstr":
        class DataError(Exception):
            def __str__(self):  # a typo: no such attribute (Python prints "<exception str() failed>")
                return f"cannot read {self.filename}"

        raise DataError()
    if last:
        raise RuntimeError(f"user code failed on rank {rank}")  # say, its data could not be read
    if where == "build":
        lp = LayerParallel([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(16)], T=1.0, cf=2,
                           max_levels=3, comm=world)
    else:
        mgrit.split_comm(world, size)
elif where == "solve":
    for step in range(2):  # the first solve together; before the second, the last rank fails
        if step and last:
            raise RuntimeError(f"user code failed on rank {rank}")
        mgrit.solve(Dahlquist(-1.0), np.array([1.0]), np.linspace(0.0, 1.0, 65), cf=4, comm=world)
print(f"rank {rank} was not stopped", flush=True)
