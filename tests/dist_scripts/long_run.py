"""A healthy job that runs past its process group's timeout (torch.distributed, gloo).

Run as ``python _launch.py 2 long_run.py``. The group's timeout is 2 s; the processes train for about
4 s, idle for 3 s, then train once more. The failure-notice listener keeps a receive posted all the
time: with the group's timeout on its wait, gloo closed every connection of the group when it ran out
and the next pass raised "rank 1 is gone" on both processes (after 2 s of training, or at the first
pass after the idle spell).
"""
import datetime
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from propagators.torch import LayerParallel


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=2))
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    lp = LayerParallel([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(8)], cf=2, max_levels=2,
                       comm=dist.group.WORLD)
    opt = torch.optim.SGD(lp.parameters(), lr=1e-3)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))

    def step():
        opt.zero_grad()
        lp(x).square().sum().backward()
        opt.step()

    start = time.monotonic()
    for _ in range(50):  # (a count, not a clock: both processes make the same calls) about 4 s
        step()
        time.sleep(0.08)
    time.sleep(3.0)
    step()
    print(f"rank {rank} ok after 51 steps in {time.monotonic() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
