"""A rank killed by a signal (the OOM killer, ``kill -9``) while the others wait for it in the library.

Usage: mpiexec -n P python killed_rank.py WHERE, WHERE one of
  solve     the last rank is killed inside the forward MGRIT solve (its second F-relaxation), while
            the others exchange states with it;
  backward  the last rank is killed as its backward pass starts (an output-gradient hook), while the
            others wait in the adjoint solve's handshake.
A killed process sends no alarm; what ends the job is the launcher (MPICH's mpiexec kills the other
ranks when one dies of a signal). The test asserts that the launch returns (no hang) with a failure
code and that no rank finished the step. Every rank prints "rank r survived" if the step returns.
"""
import os
import signal
import sys

import torch
from torch import nn

from checks import rank, size, world
import mgrit.cycle
from propagators.torch import LayerParallel

where = sys.argv[1]
torch.manual_seed(0)
lp = LayerParallel([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(32)], cf=4, max_levels=3, comm=world)
x = torch.randn(4, 8)
lp(x).sum().backward()  # one good step: every rank is in the training loop
print(f"rank {rank} ready", flush=True)


def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


if rank == size - 1 and where == "solve":
    original, calls = mgrit.cycle.Levels.f_relax, [0]

    def f_relax(self, l):
        calls[0] += 1
        if calls[0] == 2:
            die()
        return original(self, l)

    mgrit.cycle.Levels.f_relax = f_relax
y = lp(x)
if rank == size - 1 and where == "backward":
    y.register_hook(die)
y.sum().backward()
print(f"rank {rank} survived", flush=True)
