"""Processes that end normally while another process is busy or fails (torch.distributed, gloo).

Run as ``python _launch.py P exits.py WHERE``.

``busy`` (2 processes, no failure; tests/test_torch_dist.py): process 1 ends while process 0 is
stopped for 0.8 s (SIGSTOP, as a busy or descheduled process would be); both must end with code 0.
An exchange of messages at exit (tried: each exiting process asking its peers to end its notice
listener) aborted the exiting process here (code -6) when the answer came late.

``late`` and ``eval`` reproduce a known limitation (README, "Two engines"; not asserted by the tests):
a process whose program ended normally aborts (``terminate called without an active exception``, code
-6) when another process's alarm reaches it while Python shuts down. ``late`` (2 processes): both
reduce once; process 1 ends at once; process 0 sleeps 0.3 s, then alarms the communicator (what
LayerParallel does with ``data_comm=`` when a layer fails) and exits with code 1. ``eval`` (4 processes,
a 2 x 2 layer x data grid): one training step on every process; then only the layer group of data rank
0 (processes 0 and 1) evaluates, and a layer raises on process 0: process 1 raises the RemoteRankError
(exit code 3), processes 2 and 3 have ended when LayerParallel's alarm over the data group reaches them.
"""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import mgrit
from mgrit.comm import as_communicator


class Layer(nn.Module):
    fail = False

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if Layer.fail:
            raise RuntimeError("user code failed on rank 0")
        return torch.tanh(self.lin(x))


def late(rank):
    comm = as_communicator(dist.group.WORLD)
    comm.allreduce_array(np.ones(3))
    if rank == 0:
        time.sleep(0.3)
        comm.alarm(RuntimeError("a late failure on rank 0"))
        print("rank 0 alarmed", flush=True)
        sys.exit(1)
    print(f"rank {rank} ends", flush=True)


def busy(rank):
    comm = as_communicator(dist.group.WORLD)
    comm.allreduce_array(np.ones(3))
    if rank == 0:
        subprocess.Popen(["sh", "-c", f"sleep 0.8; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
    print(f"rank {rank} ends", flush=True)


def evaluate(rank):
    from propagators.torch import LayerParallel, allreduce_gradients

    layer_group, data_group = mgrit.split_comm(dist.group.WORLD, 2)
    torch.manual_seed(0)
    lp = LayerParallel([Layer() for _ in range(16)], T=1.0, cf=2, max_levels=3, comm=layer_group,
                       data_comm=data_group)
    x = torch.randn(3, 4)
    lp(x).square().sum().backward()
    allreduce_gradients(lp, data_group)
    if rank in (0, 1):
        Layer.fail = rank == 0
        try:
            with torch.no_grad():
                lp.eval()(x)
        except mgrit.RemoteRankError as exc:
            print(f"rank {rank} raised RemoteRankError: {str(exc)[:200]}", flush=True)
            sys.exit(3)
    print(f"rank {rank} ends", flush=True)


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    {"late": late, "eval": evaluate, "busy": busy}[sys.argv[1]](dist.get_rank())


if __name__ == "__main__":
    main()
