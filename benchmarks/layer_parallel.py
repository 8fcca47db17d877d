"""Layer-parallel forward+backward against the serial network (deep narrow ODE-net).

Measures, side by side in one run (medians of interleaved repetitions), the wall
time of one forward+backward pass of

* the plain loop ``x = x + h * tanh(F.linear(x, W_i, b_i))`` with autograd (the
  strongest serial baseline: no module calls),
* the serial network ``ODENet`` (the same layers as modules, autograd),
* LayerParallel on 1 rank with the layers as ``nn.Sequential(nn.Linear, nn.Tanh)``,
  as a custom module class, as one with its time in a buffer, ``tanh(lin(u) + t)``, and
  as one storing its weight transposed, ``tanh(u @ W + b)`` (all on the batched dense path),
* LayerParallel on 1 rank with looped relaxation (one layer call per interval),
* under ``mpiexec -n 2`` (the script relaunches itself), interleaved: the plain loop and
  a one-process LayerParallel on every rank at once (each on its own core), and
  LayerParallel over both ranks; the 1 -> 2 rank speedup is the ratio of these two
  LayerParallel times, measured side by side (the median of ``--launches`` mpiexec
  launches, 3 by default: each launch draws fresh processes),

then prints where the time of one layer-parallel pass goes (a cProfile of the
pass, per solver operation) and the critical-path model's prediction for 1 to 512 ranks.

Run::

    .venv/bin/python benchmarks/layer_parallel.py            # 1024 layers, width 16, batch 16
    .venv/bin/python benchmarks/layer_parallel.py --quick    # small smoke run
    .venv/bin/python benchmarks/layer_parallel.py --sweep 64 128 256 512 1024   # 1 -> 2 ranks only
    .venv/bin/python benchmarks/layer_parallel.py --layers 64 --batch-sweep 1 16 64 256   # one process
    .venv/bin/python benchmarks/layer_parallel.py --launches 5   # more mpiexec launches (default 3)
    .venv/bin/python benchmarks/layer_parallel.py --breakdown --sweep 64 256 1024   # 2 ranks: waiting, own work, phases
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from propagators.torch import LayerParallel, ODENet  # noqa: E402
from _cli import nonnegative_int, positive_int  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=positive_int, default=1024)
    p.add_argument("--width", type=positive_int, default=16)
    p.add_argument("--batch", type=positive_int, default=16)
    p.add_argument("--cf", type=positive_int, default=4)
    p.add_argument("--levels", type=positive_int, default=4)
    p.add_argument("--fwd-iters", type=nonnegative_int, default=2)
    p.add_argument("--bwd-iters", type=nonnegative_int, default=1)
    p.add_argument("--repeat", type=positive_int, default=15)
    p.add_argument("--launches", type=positive_int, default=3,
                   help="mpiexec launches of the 2-rank measurement (fresh processes each); the median launch "
                        "(by its 1 -> 2 rank ratio) is reported, with every launch's ratio")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-mpi", action="store_true", help="skip the 2-rank measurement")
    p.add_argument("--sweep", type=positive_int, nargs="+", metavar="N",
                   help="only the 1 -> 2 rank comparison under mpiexec, for each of these layer counts")
    p.add_argument("--batch-sweep", type=positive_int, nargs="+", metavar="B",
                   help="only one process, for each of these batch sizes: how much of a pass grows with the "
                        "batch (the arithmetic a second rank would halve) and how much does not")
    p.add_argument("--breakdown", action="store_true",
                   help="only where the two-rank pass goes, per rank: waiting for the other rank (the "
                        "communicator's `waited`) and its own work, beside one process on the whole net and "
                        "on half of it (what a perfect split would leave each rank), and the phases of a pass "
                        "(before, in and between the two solves); with --sweep, per depth")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.batch_sweep and min(a.batch_sweep) < 1:
        p.error("--batch-sweep takes batch sizes of at least 1")
    if a.quick:
        a.layers, a.repeat, a.levels, a.launches = 64, 3, 3, 1
    return a


class TanhLinear(nn.Module):
    """The same layer written as a user's own module class."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, u):
        return torch.tanh(self.lin(u))


class TimedTanhLinear(TanhLinear):
    """The same layer with its time in a buffer, added to the linear map (as the README advises for layer
    times): ``tanh(lin(u) + t)``."""

    def __init__(self, width, t):
        super().__init__(width)
        self.register_buffer("t", torch.tensor(float(t)))

    def forward(self, u):
        return torch.tanh(self.lin(u) + self.t)


class TransposedTanh(nn.Module):
    """The same layer with its weight stored transposed, ``tanh(u @ W + b)`` (as ``x @ W`` code often does)."""

    def __init__(self, width):
        super().__init__()
        lin = nn.Linear(width, width)
        self.W, self.b = nn.Parameter(lin.weight.detach().T.clone()), nn.Parameter(lin.bias.detach().clone())

    def forward(self, u):
        return torch.tanh(u @ self.W + self.b)


def layers(a, custom=False):
    torch.manual_seed(0)
    if custom == "transposed":
        return [TransposedTanh(a.width) for _ in range(a.layers)]
    if custom == "timed":
        return [TimedTanhLinear(a.width, j / a.layers) for j in range(a.layers)]
    if custom:
        return [TanhLinear(a.width) for _ in range(a.layers)]
    return [nn.Sequential(nn.Linear(a.width, a.width), nn.Tanh()) for _ in range(a.layers)]


def interleaved(fns, repeat, barrier=None, joint=None):
    """Median seconds of each function, run in alternation (A B C A B C ...) so that
    machine noise hits all of them alike. With ``barrier`` (MPI) every run starts together on
    all ranks; a function that ``joint[k]`` marks as one job over the ranks counts the slowest
    rank's time, the others (each rank's own job) count every rank's time as a sample."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(repeat):
        for k, fn in enumerate(fns):
            if barrier is not None:
                barrier.Barrier()
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if barrier is None:
                times[k].append(dt)
            elif joint is not None and joint[k]:
                times[k].append(barrier.allreduce(dt, op=__import__("mpi4py").MPI.MAX))
            else:
                times[k] += barrier.allgather(dt)
    return [statistics.median(t) for t in times]


def plain_loop(a, x):
    """``x = x + h tanh(F.linear(x, W_i, b_i))`` with autograd, on tensors of its own."""
    src = layers(a)
    W = [m[0].weight.detach().clone().requires_grad_(True) for m in src]
    B = [m[0].bias.detach().clone().requires_grad_(True) for m in src]
    h = 1.0 / a.layers

    def run():
        for p in W + B:
            p.grad = None
        u = x.clone().requires_grad_(True)
        for i in range(a.layers):
            u = u + h * torch.tanh(F.linear(u, W[i], B[i]))
        u.square().sum().backward()

    return run


def fwd_bwd(model, x):
    params = list(model.parameters())

    def run():
        for p in params:  # (model.zero_grad walks 1000s of modules: same cost for all, left out)
            p.grad = None
        model(x.clone().requires_grad_(True)).square().sum().backward()

    return run


def build_lp(a, batched=True, comm=None, custom=False):
    return LayerParallel(layers(a, custom), T=1.0, cf=a.cf, max_levels=a.levels, fwd_iters=a.fwd_iters,
                         bwd_iters=a.bwd_iters, batched=batched, comm=comm)


def child(a):
    """Under ``mpiexec -n 2``: the plain loop, LayerParallel on one process (each rank runs its own,
    at the same time, on its own core: every rank's time is a sample) and LayerParallel over both
    ranks (the slowest rank's time), interleaved."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    x = torch.randn(a.batch, a.width, generator=torch.Generator().manual_seed(1))
    lp1, lp2 = build_lp(a), build_lp(a, comm=comm)
    t_plain, t_lp1, t_lp2 = interleaved([plain_loop(a, x), fwd_bwd(lp1, x), fwd_bwd(lp2, x)], a.repeat,
                                        barrier=comm, joint=[False, False, True])
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps({"plain": t_plain, "lp1": t_lp1, "lp2": t_lp2,
                                      "modes": lp2.kernel.describe()}))


PHASES = ("before the forward solve", "forward solve: set-up", "forward solve: levels", "forward solve: end",
          "between the solves", "adjoint solve: set-up", "adjoint solve: levels", "adjoint solve: end",
          "after the adjoint solve")


class Phases:
    """The phases of a pass, timed: ``mgrit.solve`` and the level operations of ``mgrit.cycle.Levels``
    wrapped (while installed) to note when the two solves start and end and when their first level
    operation starts and their last ends; :meth:`split` turns one pass's notes into :data:`PHASES`."""

    OPS = ("f_relax", "c_relax", "c_residual", "restrict", "inject", "correct", "sequential_solve",
           "residual_norm", "residual_norms")

    def __init__(self):
        import mgrit
        from mgrit import cycle

        self.notes: list = []
        solve = mgrit.solve

        def timed_solve(*args, **kw):
            self.notes.append(("solve", time.perf_counter()))
            try:
                return solve(*args, **kw)
            finally:
                self.notes.append(("end", time.perf_counter()))

        def timed_op(fn):
            def op(levels, *args, **kw):
                self.notes.append(("op", time.perf_counter()))
                try:
                    return fn(levels, *args, **kw)
                finally:
                    self.notes.append(("op end", time.perf_counter()))
            return op

        mgrit.solve = timed_solve
        for name in self.OPS:
            setattr(cycle.Levels, name, timed_op(getattr(cycle.Levels, name)))

    def split(self, t0: float, t1: float) -> list:
        """Seconds of each of :data:`PHASES` in the pass from ``t0`` to ``t1`` (its notes since the last
        call), or None when the pass did not make two solves."""
        notes, self.notes = self.notes, []
        solves, current = [], None
        for kind, t in notes:
            if kind == "solve":
                current = {"start": t, "first": None, "last": t}
            elif kind == "end" and current is not None:
                current["end"] = t
                solves.append(current)
                current = None
            elif current is not None:
                if kind == "op" and current["first"] is None:
                    current["first"] = t
                if kind == "op end":
                    current["last"] = t
        if len(solves) != 2 or any(q["first"] is None for q in solves):
            return None
        f, b = solves
        return [f["start"] - t0, f["first"] - f["start"], f["last"] - f["first"], f["end"] - f["last"],
                b["start"] - f["end"], b["first"] - b["start"], b["last"] - b["first"], b["end"] - b["last"],
                t1 - b["end"]]


def breakdown_child(a):
    """Under ``mpiexec -n 2``, interleaved: the two-rank pass (each rank's own time and the time it spent
    waiting for the other, from ``lp.comm.waited``), and on every rank at once one process on the whole
    net and on its first ``N // 2`` layers; each pass also split into :data:`PHASES` (:class:`Phases`).
    Rank 0 prints ``RESULT`` with every rank's medians."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    x = torch.randn(a.batch, a.width, generator=torch.Generator().manual_seed(1))
    lp2, whole = build_lp(a, comm=comm), build_lp(a)
    half = build_lp(argparse.Namespace(**{**vars(a), "layers": a.layers // 2}))
    runs = [fwd_bwd(lp2, x), fwd_bwd(whole, x), fwd_bwd(half, x)]
    for fn in runs:
        fn()
    phases = Phases()
    times, waits, parts = [[] for _ in runs], [], [[] for _ in runs]
    for _ in range(a.repeat):
        for k, fn in enumerate(runs):
            comm.Barrier()
            phases.notes = []
            w0, t0 = lp2.comm.waited, time.perf_counter()
            fn()
            t1 = time.perf_counter()
            times[k].append(t1 - t0)
            split = phases.split(t0, t1)
            if split is not None:
                parts[k].append(split)
            if k == 0:
                waits.append(lp2.comm.waited - w0)
    mine = {"pass": statistics.median(times[0]), "waited": statistics.median(waits),
            "busy": statistics.median([t - w for t, w in zip(times[0], waits)]),
            "whole": statistics.median(times[1]), "half": statistics.median(times[2]),
            "phases": [[statistics.median(col) for col in zip(*p)] if p else None for p in parts]}
    every = comm.gather(mine, root=0)
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps({"ranks": every}))


def breakdown(a):
    """Where the two-rank pass goes, per rank, beside one process on the whole net and on half of it."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.exists():
        raise SystemExit(f"--breakdown runs under mpiexec, which is not in {mpiexec.parent} (pip install mpich)")
    print(f"where a two-rank pass goes: width {a.width}, batch {a.batch}, cf {a.cf}, up to {a.levels} levels, "
          f"{a.fwd_iters}/{a.bwd_iters} cycles, float32, 1 thread per rank; medians of {a.repeat} interleaved "
          f"repetitions, {a.launches} mpiexec launches each (one line per launch and rank)")
    print("waiting: the rank's time in its communicator's waits for the other rank (lp.comm.waited); own work: "
          "the pass minus that; half net: one process on the first N/2 layers, what a perfect split would "
          "leave each rank; extra work: own work minus the half net")
    print(f"{'layers':>7}{'rank':>5}{'whole ms':>10}{'half net ms':>13}{'2 ranks ms':>12}{'waiting ms':>12}"
          f"{'own work ms':>13}{'extra work ms':>15}")
    phase_tables = []
    for n in a.sweep or [a.layers]:
        cmd = child_command(argparse.Namespace(**{**vars(a), "layers": n}), "--breakdown")
        for run in mpi_results(cmd, a.launches):
            for r, d in enumerate(run["ranks"]):
                print(f"{n:>7}{r:>5}{1e3 * d['whole']:>10.2f}{1e3 * d['half']:>13.2f}{1e3 * d['pass']:>12.2f}"
                      f"{1e3 * d['waited']:>12.2f}{1e3 * d['busy']:>13.2f}{1e3 * (d['busy'] - d['half']):>15.2f}")
            phase_tables.append((n, run["ranks"]))
    print("\nthe phases of a pass (medians, ms): the solves' set-up runs until their first level operation, their "
          "levels until the last one ends (waits for the other rank included), their end until they return; the "
          "one-process columns are rank 0's")
    for n, ranks in phase_tables:
        cols = [("whole net", ranks[0]["phases"][1]), ("half net", ranks[0]["phases"][2])] + [
            (f"2 ranks: rank {r}", d["phases"][0]) for r, d in enumerate(ranks)]
        if any(c is None for _, c in cols):
            continue
        print(f"{n} layers{'':<17}" + "".join(f"{name:>17}" for name, _ in cols))
        for i, phase in enumerate(PHASES):
            print(f"  {phase:<24}" + "".join(f"{1e3 * c[i]:>17.3f}" for _, c in cols))
        print(f"  {'sum':<24}" + "".join(f"{1e3 * sum(c):>17.3f}" for _, c in cols))
    return 0


OPERATIONS = ["solve", "f_relax", "c_relax", "c_residual", "restrict", "correct", "sequential_solve",
              "_exchange_halo", "_parameter_gradients", "bind", "_check_layers", "_probe"]


def profile(a, lp, x, passes=5):
    """Where the time of one pass goes: cumulative profiled ms per pass of solver operations."""
    run = fwd_bwd(lp, x)
    run()
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    for _ in range(passes):
        run()
    pr.disable()
    total = (time.perf_counter() - t0) / passes
    stats = pstats.Stats(pr).stats
    rows = {}
    for (filename, _, name), (_, _, _, cum, _) in stats.items():
        if name in OPERATIONS and ("mgrit" in filename or "propagators" in filename):
            rows[name] = rows.get(name, 0.0) + cum / passes
    return total, rows


def main(argv=None):
    a = parse(argv)
    if a.child:
        return breakdown_child(a) if a.breakdown else child(a)
    if a.breakdown:
        return breakdown(a)
    if a.sweep:
        return sweep(a)
    if a.batch_sweep:
        return batch_sweep(a)
    torch.set_num_threads(1)
    x = torch.randn(a.batch, a.width, generator=torch.Generator().manual_seed(1))
    serial = ODENet(layers(a), T=1.0)
    lp = build_lp(a)
    lp_custom = build_lp(a, custom=True)
    lp_timed, lp_transposed = build_lp(a, custom="timed"), build_lp(a, custom="transposed")
    looped = build_lp(a, batched=False)
    t_plain, t_serial, t_lp, t_custom, t_timed, t_transposed = interleaved(
        [plain_loop(a, x), fwd_bwd(serial, x), fwd_bwd(lp, x), fwd_bwd(lp_custom, x), fwd_bwd(lp_timed, x),
         fwd_bwd(lp_transposed, x)], a.repeat)
    # the looped one (about 20x slower) in fewer repetitions, interleaved with the batched one for their ratio
    t_lp_pair, t_loop = interleaved([fwd_bwd(lp, x), fwd_bwd(looped, x)], max(1, a.repeat // 5))
    t_lp2 = ranks = None
    if not a.no_mpi and (Path(sys.executable).parent / "mpiexec").exists():
        ranks = run_ranks(a)
        t_lp2 = ranks["lp2"]
    res = lp.last_forward
    print(f"deep narrow ODE-net: {a.layers} layers, width {a.width}, batch {a.batch}; MGRIT cf {a.cf}, "
          f"{len(lp.hierarchy)} levels, relax {lp.options['relax']}, {a.fwd_iters} forward / "
          f"{a.bwd_iters} backward cycles, skip {lp.skip}; float32, 1 thread per rank; medians of "
          f"{a.repeat} interleaved repetitions")
    print(f"propagator calls per forward solve (per level): {res.counts}; layer classes: "
          f"{lp.kernel.describe()} / custom: {lp_custom.kernel.describe()} / time in a buffer: "
          f"{lp_timed.kernel.describe()} / transposed: {lp_transposed.kernel.describe()}")
    print()
    print(f"{'forward+backward':<44}{'time [ms]':>10}{'this / plain loop':>19}")
    rows = [("plain loop x + h tanh(F.linear(x, W, b))", t_plain), ("serial network ODENet (modules)", t_serial),
            ("LayerParallel, 1 rank, nn.Sequential layers", t_lp), ("LayerParallel, 1 rank, custom module", t_custom),
            ("LayerParallel, 1 rank, time in a buffer", t_timed),
            ("LayerParallel, 1 rank, weight transposed", t_transposed), ("LayerParallel, 1 rank, looped", t_loop)]
    for name, t in rows:
        print(f"{name:<44}{1e3 * t:>10.2f}{t / t_plain:>19.3f}")
    print(f"\nbatched vs looped relaxation: {t_loop / t_lp_pair:.1f}x faster (interleaved, "
          f"{max(1, a.repeat // 5)} repetitions)")
    if ranks is not None:
        print("\nunder mpiexec -n 2, interleaved (each rank runs the plain loop and a 1-process LayerParallel of "
              "its own at the same time: every rank's time a sample; then both run one LayerParallel together: "
              "the slowest rank's time):")
        for name, key in (("plain loop", "plain"), ("LayerParallel, 1 process", "lp1"),
                          ("LayerParallel, 2 ranks", "lp2")):
            print(f"{name:<44}{1e3 * ranks[key]:>10.2f}{ranks[key] / ranks['plain']:>19.3f}")
        print(f"1 -> 2 ranks: {ranks['lp1'] / ranks['lp2']:.2f}x (the median of {len(ranks['ratios'])} launches: "
              + ", ".join(f"{q:.2f}x" for q in ranks["ratios"]) + ")")
    print(f"forward residuals of the last solve: {_fmt(lp.forward_residuals)}")
    print(f"backward residuals of the last solve: {_fmt(lp.backward_residuals)}")
    total, ops = profile(a, lp, x)
    print(f"\nwhere one layer-parallel pass goes (cProfile, cumulative, overlapping; {1e3 * total:.1f} ms per "
          "profiled pass):")
    for name in OPERATIONS:
        if name in ops:
            print(f"  {name:<22}{1e3 * ops[name]:>8.2f} ms  {100 * ops[name] / total:5.1f}%")
    print()
    base, one = (ranks["plain"], ranks["lp1"]) if ranks is not None else (t_plain, t_lp)
    print(model_table(a, lp, base, one, t_lp2, [1, 2, 8, 64, 512], sequential_share(lp, x)))
    return 0


def run_ranks(a) -> dict:
    """The 2-rank child's interleaved measurement (plain loop, one-process and two-rank LayerParallel),
    launched ``a.launches`` times: each launch draws fresh processes, and on a shared VM one process
    can run a few percent slower than another for its whole life (the two-rank time follows the
    slower one). Returns the median launch by its 1 -> 2 rank ratio, with every launch's ratio
    under ``"ratios"``."""
    median, runs = median_launch(mpi_results(child_command(a), a.launches))
    best = dict(median)
    best["ratios"] = [r["lp1"] / r["lp2"] for r in runs]
    return best


def child_command(a, *flags: str) -> list:
    """The ``mpiexec -n 2`` command line of the child run with the settings of ``a`` (not the parent's own
    options: what it runs, how often it launches), plus ``flags``."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    return [str(mpiexec), "-n", "2", sys.executable, "-m", "mpi4py", __file__, "--child", *flags] + [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
        if k not in ("quick", "no_mpi", "child", "sweep", "batch_sweep", "launches", "breakdown")]


def median_launch(runs: list) -> tuple:
    """``(the run with the median 1 -> 2 rank ratio lp1 / lp2, all runs sorted by it)``; of an even
    count, the lower of the middle two."""
    runs = sorted(runs, key=lambda r: r["lp1"] / r["lp2"])
    return runs[(len(runs) - 1) // 2], runs


def mpi_results(cmd: list, launches: int, timeout: float = 1800) -> list:
    """Run the ``mpiexec`` command line ``cmd`` ``launches`` times (fresh processes, one thread each);
    rank 0 prints one line ``RESULT <json>``: the parsed results, one per launch."""
    runs = []
    for _ in range(max(1, launches)):
        out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                             timeout=timeout)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if not lines:
            raise SystemExit(f"the {cmd[2]}-rank run failed:\n{out.stdout}\n{out.stderr}")
        runs.append(json.loads(lines[0][7:]))
    return runs


def sweep(a):
    """1 -> 2 ranks for several depths (same width, batch and settings), each side by side under mpiexec."""
    print(f"1 -> 2 ranks, width {a.width}, batch {a.batch}, cf {a.cf}, up to {a.levels} levels, {a.fwd_iters}/"
          f"{a.bwd_iters} cycles, float32, 1 thread per rank; interleaved medians of {a.repeat} (one-process "
          "runs: every rank's time; two ranks: the slowest rank's)")
    print(f"(each row the median of {a.launches} mpiexec launches by its ratio; all launches' ratios last)")
    print(f"{'layers':>7}{'plain loop ms':>15}{'1 process ms':>14}{'2 ranks ms':>12}{'1 -> 2 ranks':>14}   launches")
    for n in a.sweep:
        r = run_ranks(argparse.Namespace(**{**vars(a), "layers": n}))
        print(f"{n:>7}{1e3 * r['plain']:>15.2f}{1e3 * r['lp1']:>14.2f}{1e3 * r['lp2']:>12.2f}"
              f"{r['lp1'] / r['lp2']:>13.2f}x   " + " ".join(f"{q:.2f}" for q in r["ratios"]))
    return 0


def batch_sweep(a):
    """One process, one net, several batch sizes, all interleaved: the plain loop and LayerParallel.

    A pass whose time barely grows with the batch is fixed cost per call (Python, dispatch), which a
    second rank does not halve: each rank makes the same batched calls on half the states."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(b, a.width, generator=g) for b in a.batch_sweep]
    lp = build_lp(a)
    fns = [f for x in xs for f in (plain_loop(a, x), fwd_bwd(lp, x))]
    t = interleaved(fns, a.repeat)
    print(f"one process, {a.layers} layers, width {a.width}, cf {a.cf}, up to {a.levels} levels, {a.fwd_iters}/"
          f"{a.bwd_iters} cycles, float32, 1 thread; interleaved medians of {a.repeat}; growth = time over the "
          f"smallest batch's")
    print(f"{'batch':>6}{'plain loop ms':>15}{'growth':>8}{'LayerParallel ms':>18}{'growth':>8}")
    for k, b in enumerate(a.batch_sweep):
        print(f"{b:>6}{1e3 * t[2 * k]:>15.2f}{t[2 * k] / t[0]:>8.2f}{1e3 * t[2 * k + 1]:>18.2f}"
              f"{t[2 * k + 1] / t[1]:>8.2f}")
    return 0


def _fmt(residuals):
    return ["-" if r is None else "%.2e" % r for r in residuals]


def measure_costs(lp, x, repeat=20, sync=lambda: None):
    """StepCost of the forward and the adjoint propagator, fitted from batches of 1 and n.

    ``sync`` waits for the device (``torch.cuda.synchronize`` for states on a GPU)."""
    from mgrit.model import StepCost
    from propagators.torch import AdjointPropagator, ODEPropagator

    prop = ODEPropagator(lp.kernel.bind(), lp.h, layer_index=lp.layer_index)
    n = lp.n_layers // lp.options["cf"]
    U = x.detach()[None].repeat(n, *([1] * x.dim()))
    states = U  # forward states for the adjoint (values do not change the cost)
    adj = AdjointPropagator(prop, lambda ia: states.index_select(0, torch.as_tensor(ia % n, device=states.device)), lp.n_layers)
    t0, t1 = np.arange(n) * lp.h, (np.arange(n) + 1) * lp.h

    def best(fn):
        fn()
        return min(_time(fn, sync) for _ in range(repeat))

    costs = []
    for P in (prop, adj):
        one = best(lambda: P.step(U[0], t0[0], t1[0]))
        b1 = best(lambda: P.step_batch(U[:1], t0[:1], t1[:1]))
        bn = best(lambda: P.step_batch(U, t0, t1))
        per_state = max((bn - b1) / (n - 1), 0.0)
        costs.append(StepCost(single=one, per_state=per_state, per_call=max(b1 - per_state, 0.0)))
    return costs


def _time(fn, sync=lambda: None):
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def sequential_share(lp, x, passes=10) -> float:
    """The share of a one-process pass spent in the coarsest levels' sequential solves (timed around
    each call of the solver's level operation, not profiled), the median over ``passes`` passes."""
    from mgrit.cycle import Levels

    run = fwd_bwd(lp, x)
    run()
    inner = Levels.sequential_solve
    spent = [0.0]

    def timed(self, l):
        t0 = time.perf_counter()
        try:
            return inner(self, l)
        finally:
            spent[0] += time.perf_counter() - t0

    shares = []
    Levels.sequential_solve = timed
    try:
        for _ in range(passes):
            spent[0] = 0.0
            t0 = time.perf_counter()
            run()
            shares.append(spent[0] / (time.perf_counter() - t0))
    finally:
        Levels.sequential_solve = inner
    return statistics.median(shares)


def model_table(a, lp, t_base, t_lp, t_lp2, ranks, seq_share):
    """Critical-path prediction of a layer-parallel forward+backward on P ranks.

    Forward MGRIT (fwd_iters cycles) + adjoint MGRIT (bwd_iters cycles) as
    replayed by mgrit.model.predict with measured per-call costs, plus the
    batched parameter-gradient call over each rank's layers. The baseline is
    the measured plain loop.

    The per-call costs, timed alone, miss what a pass has on top (Python
    bookkeeping, copies, autograd plumbing), and not alike for its two kinds of
    work: the sequential steps of the coarsest solves (``single``) and the
    batched sweeps (``per_state``, ``per_call``). Two factors carry it over,
    both from one process: the measured time of the sequential solves (their
    share ``seq_share`` of a pass) over their modelled time, and the rest of
    the pass over the rest of the model. The replay with the costs so scaled
    gives the one-process time exactly and predicts P ranks; nothing comes
    from a measured time on several ranks. ("uniform": one factor for all, as
    before: it inflates the sequential chain, which barely shrinks on more ranks,
    with the batched work.)
    """
    from mgrit.model import StepCost, predict

    x = torch.randn(a.batch, a.width, generator=torch.Generator().manual_seed(2))
    fwd_cost, adj_cost = measure_costs(lp, x)
    h = lp.hierarchy

    def model(P, f_seq=1.0, f_rest=1.0):
        f, b = (StepCost(single=f_seq * c.single, per_state=f_rest * c.per_state, per_call=f_rest * c.per_call)
                for c in (fwd_cost, adj_cost))
        return (predict(h, P, a.fwd_iters, skip=lp.skip, cost=f).time
                + predict(h, P, a.bwd_iters, skip=lp.skip, cost=b).time
                + b.batch(-(-a.layers // P)))

    calib = t_lp / model(1)
    seq_model = model(1, 1.0, 0.0)
    f_seq = seq_share * t_lp / seq_model if seq_model > 0 else 0.0
    f_rest = (1 - seq_share) * t_lp / model(1, 0.0, 1.0)
    lines = ["critical-path model (mgrit.model.predict with measured call costs, zero message latency):",
             f"'uniform' = model x {calib:.2f}, the measured / modelled ratio on one process; 'two factors' = the "
             f"model with its sequential steps x {f_seq:.2f} (the coarsest solves: {100 * seq_share:.1f}% of a "
             f"one-process pass, timed) and its batched sweeps x {f_rest:.2f} (the rest)",
             f"{'ranks':>6}{'model ms':>10}{'uniform ms':>12}{'two factors ms':>16}{'measured ms':>13}"
             f"{'two factors / measured':>24}{'plain loop / two factors':>26}"]
    for P in ranks:
        t, t2 = model(P), model(P, f_seq, f_rest)
        meas = {1: t_lp, 2: t_lp2}.get(P)
        ms = "-" if meas is None else f"{1e3 * meas:.2f}"
        vs = "-" if meas is None else f"{t2 / meas:.3f}"
        lines.append(f"{P:>6}{1e3 * t:>10.2f}{1e3 * calib * t:>12.2f}{1e3 * t2:>16.2f}{ms:>13}{vs:>24}"
                     f"{t_base / t2:>26.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
