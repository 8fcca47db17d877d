"""Setup cost of ``mgrit`` versus the number of time points (it should be linear).

What it measures
----------------
For N + 1 = 1025, 4097, 16385, 65537 (and 262145, 1048577) time points on [0, 1] (cf 4, FCF,
levels until the coarsest grid has fewer than 2 * 4 intervals, i.e. the default
``max_levels`` / ``min_coarse`` rule):

* ``build_hierarchy``: building the list of time levels;
* ``solve(max_iter=1)``: a whole one-cycle solve with XBraid's default ``skip``,
  i.e. validation, hierarchy, per-level states, initial guess, one cycle that
  injects the guess to all levels, solves the coarsest level and interpolates up,
  and the final F-relaxation. The propagator is :class:`propagators.Dahlquist`
  (backward Euler, batched ``step_batch``, a scalar-sized state), so the
  propagator costs almost nothing and what is timed is the framework.

Times are medians of repeated runs (wall clock and CPU time of this process;
the CPU time leaves out the time spent waiting for a core). Peak memory is
measured in a separate run under ``tracemalloc`` (numpy reports its buffers to
it), relative to what was allocated before the call. Per-point columns divide by
N + 1; a linear cost shows up as a flat per-point column, and the printed
exponent is the slope of log(time) against log(points) between the two largest
sizes.

How to run
----------
    .venv/bin/python benchmarks/setup_scaling.py           # a few seconds
    .venv/bin/python benchmarks/setup_scaling.py --quick   # smoke run
"""
from __future__ import annotations

import argparse
import os
import math
import statistics
import time
import tracemalloc

import numpy as np

import mgrit
from propagators import Dahlquist

CF = 4


def timed(fn, repeats: int) -> tuple:
    """Median wall and CPU seconds of ``repeats`` calls of ``fn()``."""
    wall, cpu = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def peak_bytes(fn) -> int:
    """Peak of traced allocations during ``fn()``, above what was allocated before."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def row(n_points: int, repeats: int) -> dict:
    t = np.linspace(0.0, 1.0, n_points)
    prop, u0 = Dahlquist(-1.0, "be"), np.array([1.0])

    def hierarchy():
        return mgrit.build_hierarchy(t, cf=CF, relax="FCF")

    def solve_one():
        return mgrit.solve(prop, u0, t, cf=CF, relax="FCF", tol=None, max_iter=1)

    res = solve_one()  # warm-up, and the level count
    return {
        "points": n_points,
        "levels": len(res.hierarchy),
        "hier": timed(hierarchy, repeats),
        "solve": timed(solve_one, repeats),
        "hier_mem": peak_bytes(hierarchy),
        "solve_mem": peak_bytes(solve_one),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny smoke run")
    args = ap.parse_args(argv)
    # 262145 and 1048577 points go past the sizes of interest: below about 10^5 points
    # the fixed costs (argument checks, a few dozen small arrays) hide the linear term
    sizes = [257, 1025, 4097] if args.quick else [1025, 4097, 16385, 65537, 262145, 1048577]
    repeats = 3 if args.quick else 15

    print(f"mgrit setup cost vs time points (cf {CF}, FCF, Dahlquist backward Euler, state shape (1,))")
    print(f"numpy {np.__version__}; median of {repeats} runs; {'quick smoke run' if args.quick else 'full run'}")
    load0 = os.getloadavg()[0]
    rows = [row(n, repeats) for n in sizes]
    print(f"load average (1 min) before / after: {load0:.2f} / {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    head = (f"{'':>14} | {'build_hierarchy':^33} | {'solve(max_iter=1)':^42}\n"
            f"{'points':>7} {'levels':>6} | {'wall ms':>8} {'cpu ms':>8} {'cpu us/pt':>9} {'B/pt':>5} | "
            f"{'wall ms':>8} {'cpu ms':>8} {'cpu us/pt':>9} {'peak MiB':>8} {'B/pt':>5}")
    print(head)
    print("-" * len(head.splitlines()[-1]))
    for r in rows:
        n = r["points"]
        (hw, hc), (sw, sc) = r["hier"], r["solve"]
        print(f"{n:>7d} {r['levels']:>6d} | {hw * 1e3:>8.3f} {hc * 1e3:>8.3f} {hc / n * 1e6:>9.3f} "
              f"{r['hier_mem'] / n:>5.1f} | {sw * 1e3:>8.2f} {sc * 1e3:>8.2f} {sc / n * 1e6:>9.3f} "
              f"{r['solve_mem'] / 2**20:>8.2f} {r['solve_mem'] / n:>5.1f}")
    print("wall: perf_counter; cpu: process_time (leaves out time spent waiting for a core); "
          "B/pt: tracemalloc peak / points")
    a, b = rows[-2], rows[-1]
    for key in ("hier", "solve"):
        # CPU time: the slope is not disturbed by other processes on the machine
        slope = math.log(b[key][1] / a[key][1]) / math.log(b["points"] / a["points"])
        name = "build_hierarchy" if key == "hier" else "solve(max_iter=1)"
        print(f"{name}: time ~ points^{slope:.2f} between {a['points']} and {b['points']} points (CPU time)")
    slope = math.log(b["solve_mem"] / a["solve_mem"]) / math.log(b["points"] / a["points"])
    print(f"solve(max_iter=1): peak memory ~ points^{slope:.2f}")
    for r in rows:
        if r["points"] == 65537:
            wall = r["solve"][0]
            verdict = "met" if wall < 0.5 else "MISSED"
            print(f"target: 65537 points set up (and one cycle run) well under 1 s: "
                  f"{wall * 1e3:.1f} ms wall ({verdict}; checked against 0.5 s)")


if __name__ == "__main__":
    main()
