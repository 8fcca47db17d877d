"""The two engines side by side: mpi4py (MPI) against torch.distributed (gloo), 2 ranks.

What it measures
----------------
* ``layer-parallel step``: one forward + backward pass of a
  :class:`propagators.torch.LayerParallel` block (``N`` tanh-linear layers of
  width 16, batch 16, ``cf`` 4, 4 levels, 2 forward / 1 backward cycles,
  float32) on 2 ranks, ``comm=MPI.COMM_WORLD`` or ``comm=dist.group.WORLD``:
  the slowest rank's time, median of ``--repeat`` steps after one warm-up step.
* ``latency``: half the round-trip time of a ping-pong of one state between the
  two ranks through the communicator (``comm.send`` / ``comm.recv`` inside a
  session, as the solver sends states), for a small (16 float32) and a large
  (256 K float32 = 1 MiB) message; median of the repetitions.
* ``wait under load``: both ranks send a small state to each other, compute
  for about 1 ms (matrix products, as a relaxation sweep would), then receive:
  the time spent in ``recv`` (median). The message was sent a millisecond
  earlier, so an engine that moves it while both ranks compute waits next to
  nothing.
* ``wait at rest``: the same with both ranks asleep (``time.sleep``) instead of
  computing, so that no core is busy. gloo's point-to-point is a rendezvous
  carried out by a transport thread of each process: a send posted before the
  peer's receive is moved only after the peer's "ready" notice has woken the
  sender's transport thread, and the data then wakes the receiver's; when this
  wait is as long at rest as under load, its cost is these wake-ups in turn, not
  a lack of cores.
* ``... recv posted first``: the same with the engine's own non-blocking calls
  (``Irecv`` / ``dist.irecv`` before ``Isend`` / ``dist.isend``): when the
  receive is already posted when the peer sends, gloo moves the data at once.
* ``exchange after compute``: both ranks compute for 1 ms, then post a send and
  a receive of a small state with the engine's own calls and wait for both: the
  time beyond the 1 ms. This is how the solver's boundary exchanges meet (a
  rank sends its last state when its sweep ends), with no library code in
  between: what it costs is the engine's.

Each engine runs in its own launch (``mpiexec -n 2`` or 2 processes with
torchrun's environment); the launches are interleaved (MPI, gloo, MPI, gloo ...)
for ``--rounds`` rounds and the printed numbers are the medians over all of
them. Both sides produce bit-identical results (tests/test_torch_dist.py); only
the time differs.

How to run
----------
    .venv/bin/python benchmarks/engines.py            # about a minute on 2 cores
    .venv/bin/python benchmarks/engines.py --quick    # smoke run, a few seconds

Do not run it under a launcher: it starts its own. ``OMP_NUM_THREADS=1`` is set
for the workers.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from _cli import end_worker, positive_int  # noqa: E402

SMALL, LARGE = 16, 1 << 18


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=positive_int, default=1024)
    p.add_argument("--repeat", type=positive_int, default=5, help="timed steps per launch")
    p.add_argument("--pings", type=positive_int, default=300, help="round trips per message size and launch")
    p.add_argument("--rounds", type=positive_int, default=3, help="interleaved launches per engine")
    p.add_argument("--quick", action="store_true", help="64 layers, 1 round, few repetitions")
    p.add_argument("--worker", choices=("mpi", "gloo"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.repeat, args.pings, args.rounds = 64, 2, 30, 1
    return args


# -- the worker: one engine, 2 ranks -----------------------------------------------------


def worker(args) -> None:
    import numpy as np
    import torch
    from torch import nn

    from mgrit.comm import Tag, as_communicator
    from propagators.torch import ConvergenceWarning, LayerParallel

    torch.set_num_threads(1)
    if args.worker == "mpi":
        from mpi4py import MPI

        raw = MPI.COMM_WORLD
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        raw = dist.group.WORLD
    comm = as_communicator(raw)
    rank = comm.rank

    def slowest(seconds: float) -> float:
        return comm.allreduce(seconds, "max")

    # the layer-parallel step
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(args.layers)]
    lp = LayerParallel(layers, T=1.0, cf=4, max_levels=4, fwd_iters=2, bwd_iters=1, fwd_tol=0.0, bwd_tol=0.0,
                       comm=raw)
    # (tolerance 0: every cycle measures its residual and none stops early; that it is not met is the point)
    warnings.filterwarnings("ignore", category=ConvergenceWarning)
    x = torch.randn(16, 16)
    steps = []
    for k in range(args.repeat + 1):
        comm.allreduce(0.0)  # start together
        t0 = time.perf_counter()
        lp(x).square().sum().backward()
        t = slowest(time.perf_counter() - t0)
        if k:
            steps.append(t)
    # the ping-pong
    lat = {}
    for n in (SMALL, LARGE):
        state = torch.zeros(n, dtype=torch.float32)
        times = []
        with comm.session():
            for k in range(args.pings + 5):
                t0 = time.perf_counter()
                if rank == 0:
                    comm.send(state, 1, Tag.USER)
                    state = comm.recv(state, 1, Tag.USER)
                else:
                    state = comm.recv(state, 0, Tag.USER)
                    comm.send(state, 0, Tag.USER)
                if k >= 5:
                    times.append((time.perf_counter() - t0) / 2)
        lat[n] = float(np.median(times))
    # the wait for a message sent a millisecond earlier, both ranks computing in between
    A = torch.randn(64, 64)

    def compute(seconds):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            A @ A

    def wait_after(pause):
        """Median time in recv for a state the peer sent before ``pause(1 ms)``, both ranks alike."""
        state, waits = torch.zeros(SMALL), []
        with comm.session():
            for k in range(args.pings // 3 + 5):
                comm.send(state, 1 - rank, Tag.USER)
                pause(1e-3)
                t1 = time.perf_counter()
                state = comm.recv(state, 1 - rank, Tag.USER)
                if k >= 5:
                    waits.append(time.perf_counter() - t1)
        return slowest(float(np.median(waits)))

    loaded = wait_after(compute)
    rest = wait_after(time.sleep)  # the same with both ranks asleep: no core is busy
    # the same with the raw engine, the receive posted before the send
    if args.worker == "mpi":
        raw.Barrier()
        post_recv = (lambda b: raw.Irecv(b.numpy(), source=1 - rank, tag=7))
        post_send = (lambda b: raw.Isend(b.numpy(), dest=1 - rank, tag=7))
        done = (lambda q: q.Wait())
    else:
        import torch.distributed as dist

        dist.barrier()
        post_recv, post_send = (lambda b: dist.irecv(b, 1 - rank)), (lambda b: dist.isend(b, 1 - rank))
        done = (lambda q: q.wait())
    out, into, waits = torch.zeros(SMALL), torch.zeros(SMALL), []
    for k in range(args.pings // 3 + 5):
        r, q = post_recv(into), post_send(out)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 1e-3:
            A @ A
        t1 = time.perf_counter()
        done(r)
        if k >= 5:
            waits.append(time.perf_counter() - t1)
        done(q)
    first = slowest(float(np.median(waits)))
    # an exchange posted after the computation (the raw engine): both ranks compute for 1 ms, then post
    # their send and receive and wait for both; the time beyond the 1 ms is the exchange
    exchanges = []
    for k in range(args.pings // 3 + 5):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 1e-3:
            A @ A
        t1 = time.perf_counter()
        q, r = post_send(out), post_recv(into)
        done(r)
        done(q)
        if k >= 5:
            exchanges.append(time.perf_counter() - t1)
    after = slowest(float(np.median(exchanges)))
    if rank == 0:
        print(json.dumps({"step": steps, "small": lat[SMALL], "large": lat[LARGE], "loaded": loaded,
                          "rest": rest, "first": first, "after": after}), flush=True)
    if args.worker == "gloo":
        import torch.distributed as dist

        dist.destroy_process_group()


# -- the driver ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(engine: str, args) -> dict:
    here = str(Path(__file__).resolve())
    opts = ["--worker", engine, "--layers", str(args.layers), "--repeat", str(args.repeat),
            "--pings", str(args.pings)]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if engine == "mpi":
        mpiexec = Path(sys.executable).parent / "mpiexec"
        mpiexec = str(mpiexec) if mpiexec.exists() else shutil.which("mpiexec")
        procs = [subprocess.Popen([mpiexec, "-n", "2", sys.executable, here, *opts], env=env,
                                  stdout=subprocess.PIPE, text=True)]
    else:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2")
        procs = [subprocess.Popen([sys.executable, here, *opts], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                  stdout=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"the {engine} run failed:\n" + "\n".join(outs))
    line = next(ln for out in outs for ln in out.splitlines() if ln.startswith("{"))
    return json.loads(line)


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        if args.worker == "gloo":
            end_worker(0)
        return 0
    engines = ["mpi", "gloo"]
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        engines = ["gloo"]
    runs: dict = {e: [] for e in engines}
    for _ in range(args.rounds):
        for e in engines:
            runs[e].append(launch(e, args))
    print(f"2 ranks; LayerParallel: {args.layers} layers of width 16, batch 16, cf 4, 4 levels, "
          f"2 forward / 1 backward cycles, float32; medians of {args.rounds} x {args.repeat} steps "
          f"and {args.rounds} x {args.pings} round trips")
    print(f"{'engine':<28}{'fwd+bwd step':>14}{'latency 64 B':>15}{'latency 1 MiB':>15}{'wait under load':>18}"
          f"{'wait at rest':>15}{'... recv posted first':>24}{'exchange after compute':>25}")
    names = {"mpi": "mpi4py (MPICH)", "gloo": "torch.distributed (gloo)"}
    for e in engines:
        step = statistics.median(t for r in runs[e] for t in r["step"])
        small, large, loaded, rest, first, after = (statistics.median(r[k] for r in runs[e])
                                                    for k in ("small", "large", "loaded", "rest", "first", "after"))
        print(f"{names[e]:<28}{step * 1e3:>11.1f} ms{small * 1e6:>12.1f} us{large * 1e6:>12.1f} us"
              f"{loaded * 1e6:>15.1f} us{rest * 1e6:>12.1f} us{first * 1e6:>21.1f} us{after * 1e6:>22.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
