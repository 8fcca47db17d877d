"""Measured and modelled speedup of MGRIT split over MPI ranks (1-D heat equation).

What it measures
----------------
The problem is :class:`propagators.Heat1D` (backward Euler, ``nx`` grid points,
PyMGRIT's forced problem) on ``[0, 1]`` with ``N`` uniform time steps; every
level uses the same propagator (rediscretization, no spatial coarsening).
MGRIT: V-cycles, FCF relaxation, factor ``cf``, as many levels as the grid
allows, ``tol = 1e-8``.

* ``sequential``: plain time stepping, ``u = step(u, t[i], t[i+1])``, in this process,
  once before each round of launches (the median of the rounds; the strongest
  baseline: "speedup vs seq" below 1 means MGRIT on those ranks is slower than it).
* ``P ranks``: ``mpiexec -n P`` runs of ``mgrit.solve(..., comm=MPI.COMM_WORLD)``;
  the time is the slowest rank's, the median of ``--repeat`` solves (after one
  warm-up solve that builds the LU caches of every level's step size). The rank
  counts are run in ``--rounds`` interleaved rounds (1, 2, 1, 2, ... ranks) and
  the printed time is the median over the rounds.
* ``model``: :func:`mgrit.model.predict` for the same hierarchy and iteration
  count, with propagator costs measured here (per level: one ``step`` call; the
  fixed and per-state cost of a ``step_batch`` call, fitted from batches of 1
  and of a level's size) and the message latency measured by a ping-pong through
  :class:`mgrit.MPIComm` in the 2-rank run (all-reduces cost
  ``latency * ceil(log2 P)``). The model counts propagator work and messages
  only: the rest of the solver (norms, restriction, copies) is what the
  measured time has in addition.

The last rows are the model's predictions for more ranks with the same
settings (by default ``N = 16384``), where the measured on-node latency is
used; on a cluster with a larger latency the speedups are somewhat lower.

How to run
----------
    .venv/bin/python benchmarks/mpi_speedup.py            # ~1 minute on 2 cores
    .venv/bin/python benchmarks/mpi_speedup.py --quick    # smoke run, a few seconds

The script starts ``mpiexec`` itself (the one next to the Python executable, or
on PATH) for every entry of ``--ranks``; do not run it under ``mpiexec``.
Set ``OMP_NUM_THREADS=1`` (done for the MPI runs) so that ranks do not share
cores with LAPACK threads.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import mgrit
from mgrit.model import StepCost, predict
from propagators import Heat1D
from _cli import positive_int  # noqa: E402


def problem(nx: int, steps: int):
    prop = Heat1D(nx)
    t = np.linspace(0.0, 1.0, steps + 1)
    return prop, prop.initial(), t


def options(cf: int) -> dict:
    return dict(cf=cf, relax="FCF", cycle="V", tol=1e-8, max_iter=50)


# --------------------------------------------------------------------------- worker (under mpiexec)
def ping_pong(comm, state, reps: int = 200) -> float:
    """One-way time of a state-sized message between ranks 0 and 1 through MPIComm."""
    c = mgrit.MPIComm(comm)
    c.open()
    c.send(state, 1 - comm.rank, 0) if comm.rank == 1 else None
    start = time.perf_counter()
    for _ in range(reps):
        if comm.rank == 0:
            c.send(state, 1, 0)
            c.recv(state, 1, 0)
        elif comm.rank == 1:
            x = c.recv(state, 0, 0)
            c.send(x, 0, 0)
    elapsed = time.perf_counter() - start
    if comm.rank == 0:
        c.recv(state, 1, 0)
    c.finish()
    c.close()
    return comm.bcast(elapsed / (2 * reps), root=0)


def worker(args) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    prop, u0, t = problem(args.nx, args.steps)
    kw = options(args.cf)
    mgrit.solve(prop, u0, t, comm=comm, **{**kw, "max_iter": 1})  # warm-up: LU caches, imports
    latency = ping_pong(comm, u0) if comm.size > 1 else 0.0
    times, res = [], None
    for _ in range(args.repeat):
        comm.Barrier()
        start = time.perf_counter()
        res = mgrit.solve(prop, u0, t, comm=comm, **kw)
        times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    median = statistics.median(times)
    U = mgrit.gather(res, root=0)
    if comm.rank == 0:
        ref = prop.exact(1.0)
        print(json.dumps(dict(ranks=comm.size, time=median, iterations=res.iterations, latency=latency,
                              residual=res.residuals[-1], error=float(np.abs(U[-1] - ref).max()))))


# --------------------------------------------------------------------------- driver
def median_time(fn, repeat: int = 5, number: int = 1) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - start) / number)
    return statistics.median(times)


def sequential(prop, u0, t) -> None:
    u = u0
    for i in range(t.shape[0] - 1):
        u = prop.step(u, float(t[i]), float(t[i + 1]))


def calibrate(prop, u0, hierarchy, t_seq: float) -> list:
    """StepCost of every level: one step (from sequential stepping over the level's
    grid; ``t_seq`` on the finest), and the affine fit of batched calls."""
    costs = []
    for lv in hierarchy:
        dt = float(lv.t[1] - lv.t[0])
        if lv.index == 0:
            single = t_seq / lv.n
        else:
            tl = lv.t[: min(lv.n, 2000) + 1]
            sequential(prop, u0, tl)  # factorizations for these step sizes
            single = median_time(lambda: sequential(prop, u0, tl)) / (tl.shape[0] - 1)
        n2 = max(2, lv.n // (lv.cf or 2))
        batch = {}
        for n in (1, n2):
            U, t0, t1 = np.tile(u0, (n, 1)), np.zeros(n), np.full(n, dt)
            batch[n] = median_time(lambda: prop.step_batch(U, t0, t1), number=max(1, 200 // n))
        per_state = (batch[n2] - batch[1]) / (n2 - 1)
        costs.append(StepCost(single=single, per_state=max(per_state, 0.0), per_call=max(batch[1] - per_state, 0.0)))
    return costs


def run_ranks(n: int, args) -> dict:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    mpiexec = str(mpiexec) if mpiexec.exists() else shutil.which("mpiexec")
    if mpiexec is None:
        raise SystemExit("mpiexec not found (install mpi4py and an MPI, e.g. `pip install mpich mpi4py`)")
    cmd = [mpiexec, "-n", str(n), sys.executable, os.path.abspath(__file__), "--worker",
           "--nx", str(args.nx), "--steps", str(args.steps), "--cf", str(args.cf), "--repeat", str(args.repeat)]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nx", type=positive_int, default=513)
    ap.add_argument("--steps", type=positive_int, default=16384)
    ap.add_argument("--cf", type=positive_int, default=8)
    ap.add_argument("--ranks", type=positive_int, nargs="+", default=[1, 2])
    ap.add_argument("--predict", type=positive_int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--repeat", type=positive_int, default=3, help="timed solves per launch (median)")
    ap.add_argument("--rounds", type=positive_int, default=3, help="interleaved launches per rank count (median)")
    ap.add_argument("--quick", action="store_true", help="small problem, smoke run")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.nx, args.steps, args.repeat, args.rounds, args.predict = 65, 512, 1, 1, [8, 64]
    if args.worker:
        worker(args)
        return

    prop, u0, t = problem(args.nx, args.steps)
    kw = options(args.cf)
    hierarchy = mgrit.build_hierarchy(t, cf=args.cf, relax=kw["relax"])
    load = os.getloadavg()[0]
    sequential(prop, u0, t)  # LU factorizations of the step sizes
    t_seq = median_time(lambda: sequential(prop, u0, t), repeat=3)
    costs = calibrate(prop, u0, hierarchy, t_seq)
    rounds: dict = {}
    seqs = []  # sequential stepping again in every round: the baseline in the same phase as the launches
    for _ in range(args.rounds):  # interleaved: sequential, 1, 2, sequential, 1, 2, ... ranks
        seqs.append(median_time(lambda: sequential(prop, u0, t), repeat=1))
        for n in args.ranks:
            rounds.setdefault(n, []).append(run_ranks(n, args))
    t_seq = statistics.median(seqs)
    runs = {n: dict(rs[-1], time=statistics.median(r["time"] for r in rs),
                    latency=statistics.median(r["latency"] for r in rs)) for n, rs in rounds.items()}
    iters = runs[args.ranks[0]]["iterations"]
    latency = max(r["latency"] for r in runs.values())
    model = {n: predict(hierarchy, n, iters, cost=costs, latency=latency if n > 1 else 0.0)
             for n in sorted(set(args.ranks) | set(args.predict))}
    base_meas = runs[min(runs)]["time"]
    base_model = model[min(runs)].time

    print(f"Heat1D(nx={args.nx}), N = {args.steps} steps, cf = {args.cf}, FCF V-cycles, "
          f"{len(hierarchy)} levels, {iters} iterations, tol 1e-8")
    print(f"load average (1 min) before / after: {load:.2f} / {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(f"times: medians of {args.rounds} interleaved launches x {args.repeat} solves each (slowest rank)")
    print(f"sequential stepping: {t_seq:.3f} s ({t_seq / args.steps * 1e6:.1f} us per step; the median of "
          f"{len(seqs)}, one before each round of launches)")
    c0 = costs[0]
    print(f"step costs (level 0): single {c0.single * 1e6:.1f} us, batched {c0.per_call * 1e6:.1f} us per call "
          f"+ {c0.per_state * 1e6:.2f} us per state; message latency {latency * 1e6:.1f} us")
    print()
    print("ranks  measured s  model s  meas/model  speedup vs seq (meas / model)  vs 1 rank (meas / model)")
    for n, p in model.items():
        m = runs.get(n)
        if m is not None:
            print(f"{n:5d}  {m['time']:10.3f}  {p.time:7.3f}  {m['time'] / p.time:10.2f}  "
                  f"{t_seq / m['time']:14.3f} / {t_seq / p.time:<12.3f}  "
                  f"{base_meas / m['time']:9.2f} / {base_model / p.time:.2f}")
        else:
            print(f"{n:5d}  {'-':>10}  {p.time:7.3f}  {'-':>10}  {'-':>14} / {t_seq / p.time:<12.3f}  "
                  f"{'-':>9} / {base_model / p.time:.2f}")
    print()
    for n in sorted(runs):
        r = runs[n]
        print(f"{n} ranks: final residual {r['residual']:.2e}, max error vs exact at t=1: {r['error']:.2e}")
    widest = max(model)
    p = model[widest]
    print(f"model, {widest} ranks: critical path calls per level {p.path_calls}, "
          f"{p.path_messages} messages on the path; per cycle {statistics.mean(np.diff((0,) + p.iteration_times)):.4f} s")


if __name__ == "__main__":
    main()
