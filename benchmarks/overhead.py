"""Framework overhead of ``mgrit.solve`` on the per-call (loop-only) path, by step cost and state size.

What it measures
----------------
For a propagator whose ``step`` has a known cost, the overhead ratio is::

    ratio = wall time of mgrit.solve / (propagator calls x time of one bare step call)

``calls`` is ``sum(result.counts)`` (every interval advanced, all levels). The
bare-call time is the median of blocks of direct ``step`` calls on one state,
timed just before and just after each solve. A ratio of 1.00 means the solver
adds nothing; everything above 1 is bookkeeping (setup, storing states,
injection, residuals and their norms, corrections, checks).

A bare call on one state keeps that state in the L1/L2 cache; the solve cannot:
it stores every state it computes (1025 of them: 0.5 MB at 64 floats, 33 MB at
4096) and reads each one back later. The column "ratio vs stored" therefore
divides by a second baseline, sequential stepping that stores its trajectory
(``X[i] = step(X[i - 1])`` for the 1024 fine steps, per-call time), i.e. the
same calls plus the one store per state that any time stepper which keeps
its states pays. The difference between the two ratios is the memory traffic
of the states themselves, which grows with the state; what is left above
"ratio vs stored" is the framework.

The propagator does real arithmetic, no ``time.sleep``: ``u' = -K u`` in
blocks of 16 (the state of ``n`` floats is ``n / 16`` independent blocks;
``K`` a symmetric 16 x 16 matrix with eigenvalues in [1, 100]; a 64 x 64
matrix for the 64-float rows of the first table), advanced over ``[t0, t1]``
by ``s`` explicit-Euler sub-steps ``U <- U - h U K``; ``s`` is calibrated at
start-up so that one call costs about the target. It does not override
``step_batch``, so the solver's loop over ``step`` is what runs.

Setting: 1025 time points (257 for the 1 ms step), V-cycles, FCF relaxation,
cf 4, 4 levels (3 for 257 points), 5 cycles (``tol=None``), XBraid's default
``skip``. Table 1: 64 floats, steps of about 10 us, 50 us and 1 ms. Table 2:
a step of about 50 us and states of 64, 736, 2304 and 4096 floats.

Every printed number is a median over ``--repeats`` repetitions, and the
repetitions are interleaved: each repetition measures every row once, in
turn, so that a slow phase of the machine touches all rows alike. Within a
repetition the solve is bracketed by its bare calls. A cross-check that drift
of the core's speed cannot skew: one more solve with ``step`` wrapped in a
timer, comparing the solve's wall time with the time spent inside ``step``
during the same solve (the two timer reads per call, about 0.1 us, count as
overhead there; the states' memory traffic inside ``step`` does not).

How to run
----------
    .venv/bin/python benchmarks/overhead.py              # about two minutes
    .venv/bin/python benchmarks/overhead.py --quick      # smoke run, a few seconds
    .venv/bin/python benchmarks/overhead.py --repeats 9  # more repetitions

The script prints the 1-minute load average before and after the run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import mgrit
from _cli import positive_int  # noqa: E402


class BlockDecay(mgrit.Propagator):
    """``u' = -K u`` on blocks of ``K.shape[0]`` floats, by ``substeps`` explicit-Euler sub-steps."""

    def __init__(self, K: np.ndarray, substeps: int):
        self.K = K
        self.substeps = int(substeps)

    def step(self, u, t0, t1):
        h = (t1 - t0) / self.substeps
        K = self.K
        U = u.reshape(-1, K.shape[0])
        for _ in range(self.substeps):
            U = U - h * (U @ K)
        return U.reshape(u.shape)


class Timed(mgrit.Propagator):
    """Wraps a propagator and adds up the wall time spent inside its ``step``."""

    def __init__(self, prop: mgrit.Propagator):
        self.prop = prop
        self.inside = 0.0

    def step(self, u, t0, t1):
        start = time.perf_counter()
        out = self.prop.step(u, t0, t1)
        self.inside += time.perf_counter() - start
        return out


def decay_matrix(n: int, seed: int = 0) -> np.ndarray:
    """Symmetric ``n x n`` matrix with eigenvalues spread over [1, 100]."""
    rng = np.random.default_rng(seed)
    Q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    return (Q * np.linspace(1.0, 100.0, n)) @ Q.T


def bare_call_time(step, u, dt: float, blocks: int, per_block: int) -> float:
    """Median per-call wall time of ``blocks`` blocks of ``per_block`` direct calls on one state."""
    out = []
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(per_block):
            step(u, 0.0, dt)
        out.append((time.perf_counter() - start) / per_block)
    return statistics.median(out)


def stored_call_time(step, X: np.ndarray, t: np.ndarray) -> float:
    """Per-call wall time of sequential stepping that stores its trajectory in ``X``. The times go in as
    Python floats, as the solver passes them (numpy scalars make every ``h * array`` of a step slower:
    about 4 us per call of this propagator, a baseline slower than the solve's own calls)."""
    tl = t.tolist()
    start = time.perf_counter()
    for i in range(1, len(tl)):
        X[i] = step(X[i - 1], tl[i - 1], tl[i])
    return (time.perf_counter() - start) / (len(tl) - 1)


def vector_floor(floats: int, points: int, cf: int, levels: int, iters: int, counts) -> float:
    """Seconds of the state-sized array work that FAS MGRIT needs beyond the propagator calls,
    done with plain numpy on arrays of the solve's shapes (no solver around it).

    Per cycle and per level ``l`` below the coarsest, on the ``n`` C-points of level ``l``:
    the residual ``r = Phi(u) - u`` (one subtraction; the call's own store is in the
    stored-step baseline), its norms (level 0), the injection ``v = u_C`` and the coarse
    start ``u_c = v`` (two copies), the coarse right-hand side ``g = r + v - Psi(v)`` (two
    operations), and the correction ``u_C += u_c - v`` (two). The first cycle is skipped
    (XBraid's default): injection and correction only. On the coarse levels every step adds
    the right-hand side, ``u_i = Psi(u_{i-1}) + g_i``: one addition per coarse call
    (``counts``: the solve's calls per level). A lower bound of what any FAS implementation
    moves through memory: the solve's "beyond storing" is compared with it.
    """
    sizes, n = [], points
    for _ in range(levels - 1):
        n = (n - 1) // cf + 1
        sizes.append(n)
    fine = [points] + sizes[:-1]
    arrays = [(np.ones((f, floats)), np.ones((c, floats)), np.ones((c, floats)), np.ones((c, floats)),
               np.ones((c, floats))) for f, c in zip(fine, sizes)]
    coarse = [(np.ones((n, floats)), np.ones((n, floats)), int(c)) for n, c in zip(sizes, counts[1:])]
    start = time.perf_counter()
    for A, Gc, calls in coarse:  # + g_i on every coarse call, a level's worth at a time
        for _ in range(calls // A.shape[0]):
            A += Gc
        A[: calls % A.shape[0]] += Gc[: calls % A.shape[0]]
    for k in range(iters):
        for (U, V, Uc, R, G), m in zip(arrays, [cf] * len(sizes)):
            UC = U[::m]
            if k > 0:
                np.subtract(G, UC, out=R)  # residual (Phi(u) stands in G)
                np.sqrt(np.einsum("ij,ij->i", R, R))  # (one pass, as the solver computes them)
            V[...] = UC
            Uc[...] = V
            if k > 0:
                np.subtract(V, G, out=G)
                G += R
            np.subtract(Uc, V, out=V)
            UC += V
    return time.perf_counter() - start


class Row:
    """One row of a table: a calibrated propagator and the measurements of every repetition."""

    def __init__(self, table: int, floats: int, target: float, points: int, levels: int, iters: int,
                 bare_budget: float):
        q = 64 if floats == 64 and table == 1 else 16
        self.table, self.floats, self.target = table, floats, target
        self.points, self.levels, self.iters, self.bare_budget = points, levels, iters, bare_budget
        self.u0 = np.ones(floats) / np.sqrt(floats)
        self.t = np.linspace(0.0, 1.0, points)
        self.dt = float(self.t[1] - self.t[0])
        self.prop = self.calibrate(decay_matrix(q), target)
        self.per_block = max(1, int(0.005 / target))
        self.blocks = max(5, int(bare_budget / (self.per_block * target)))
        self.X = np.full((points, floats), 1.0)  # written: no first-touch page faults in the timed loop
        self.X[0] = self.u0
        self.reps: list = []
        self.calls = 0

    def calibrate(self, K, target: float) -> BlockDecay:
        prop = BlockDecay(K, 20)
        for _ in range(3):
            calls = max(3, int(0.02 / target))
            per_call = bare_call_time(prop.step, self.u0, self.dt, 9, calls)
            prop = BlockDecay(K, max(1, round(target / (per_call / prop.substeps))))
        return prop

    def solve(self, prop):
        return mgrit.solve(prop, self.u0, self.t, cf=4, max_levels=self.levels, relax="FCF", cycle="V",
                           tol=None, max_iter=self.iters)

    def measure_once(self) -> None:
        step = self.prop.step
        before = bare_call_time(step, self.u0, self.dt, self.blocks, self.per_block)
        start = time.perf_counter()
        res = self.solve(self.prop)
        wall = time.perf_counter() - start
        after = bare_call_time(step, self.u0, self.dt, self.blocks, self.per_block)
        stored = stored_call_time(step, self.X, self.t)
        timed = Timed(self.prop)
        start = time.perf_counter()
        self.solve(timed)
        wall_timed = time.perf_counter() - start
        self.calls = int(sum(res.counts))
        floor = vector_floor(self.floats, self.points, 4, self.levels, self.iters, res.counts)
        bare = statistics.median([before, after])
        self.reps.append({"bare": bare, "stored": stored, "wall": wall,
                          "ratio": wall / (self.calls * bare), "ratio_stored": wall / (self.calls * stored),
                          "cross": wall_timed / timed.inside,
                          "per_call": (wall - self.calls * bare) / self.calls,
                          "per_call_stored": (wall - self.calls * stored) / self.calls,
                          "floor": floor / self.calls})

    def median(self, key: str) -> float:
        return statistics.median(r[key] for r in self.reps)


def fmt_time(s: float) -> str:
    return f"{s * 1e6:.2f} us" if abs(s) < 1e-3 else f"{s * 1e3:.3f} ms"


def print_table(rows: list, title: str) -> None:
    print(title)
    head = (f"{'floats':>6} {'step':>10} {'stored step':>11} {'points':>6} {'calls':>6} {'solve [s]':>9} "
            f"{'ratio':>6} {'ratio vs stored':>15} {'cross-check':>11} {'overhead/call':>13} "
            f"{'beyond storing':>14} {'FAS floor':>10}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r.floats:>6d} {fmt_time(r.median('bare')):>10} {fmt_time(r.median('stored')):>11} "
              f"{r.points:>6d} {r.calls:>6d} {r.median('wall'):>9.3f} {r.median('ratio'):>6.3f} "
              f"{r.median('ratio_stored'):>15.3f} {r.median('cross'):>11.3f} {fmt_time(r.median('per_call')):>13} "
              f"{fmt_time(r.median('per_call_stored')):>14} {fmt_time(r.median('floor')):>10}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (seconds)")
    ap.add_argument("--repeats", type=positive_int, default=None, help="interleaved repetitions (default 5; 1 quick)")
    args = ap.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 5)

    if args.quick:
        rows = [Row(1, 64, 20e-6, 65, 3, 2, 0.005), Row(1, 64, 200e-6, 65, 3, 2, 0.005)]
        rows += [Row(2, n, 20e-6, 65, 3, 2, 0.005) for n in (64, 736, 2304, 4096)]
    else:
        # (table, floats, target step cost, time points, levels, cycles, seconds of bare calls per bracket)
        rows = [Row(1, 64, 10e-6, 1025, 4, 5, 0.05), Row(1, 64, 50e-6, 1025, 4, 5, 0.1),
                Row(1, 64, 1e-3, 257, 3, 5, 0.2)]
        rows += [Row(2, n, 50e-6, 1025, 4, 5, 0.1) for n in (64, 736, 2304, 4096)]
    print("mgrit.solve framework overhead: loop-only propagator (no step_batch), V-cycles, FCF, cf 4, tol=None")
    print(f"numpy {np.__version__}; {'quick smoke run' if args.quick else 'full run'}; "
          f"medians of {repeats} interleaved repetitions")
    load0 = os.getloadavg()[0]
    for _ in range(repeats):
        for r in rows:
            r.measure_once()
    print(f"load average (1 min) before / after: {load0:.2f} / {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print()
    print_table([r for r in rows if r.table == 1], "table 1: step cost (64 floats)")
    print()
    print_table([r for r in rows if r.table == 2], "table 2: state size (step of about "
                f"{fmt_time(rows[-1].target)})")
    print()
    print("step = median bare step() call on one state (in cache); stored step = per call of sequential stepping "
          "that stores every state;")
    print("ratio = solve / (calls x step); ratio vs stored = solve / (calls x stored step); cross-check = "
          "solve / time inside step() in one more solve;")
    print("overhead/call = solve / calls - step; beyond storing = solve / calls - stored step;")
    print("FAS floor = per call, the state-sized array work FAS needs beyond the calls (residuals, norms, "
          "injection, coarse right-hand sides, corrections), done with bare numpy on the same shapes")
    if not args.quick:
        worst = max(r.median("ratio_stored") for r in rows if r.table == 2)
        print(f"target ratio <= 1.02 at a ~50 us step up to 4096 floats: ratio vs stored at most {worst:.3f} "
              f"({'met' if worst <= 1.02 else 'MISSED'}); ratio (vs in-cache calls) "
              + ", ".join(f"{r.floats}: {r.median('ratio'):.3f}" for r in rows if r.table == 2))


if __name__ == "__main__":
    main()
