"""Helper of ``benchmarks/pymgrit_heat.py``: run PyMGRIT 1.0.6 on its heat-1D problem.

Runs inside the separate virtual environment ``benchmarks/.venv-pymgrit`` (PyMGRIT
needs numpy < 2.4); it imports neither ``mgrit`` nor ``propagators``. It prints
one JSON object on stdout and, with ``--out``, saves the MGRIT trajectory
(shape ``(nt, nx - 2)``) as a ``.npy`` file.

Problem (PyMGRIT's ``examples/example_heat_1d.py``): ``u_t - a u_xx = b(x, t)``
on x in [0, 1], t in [0, t_stop], a = 1, ``b = -sin(pi x)(sin t - a pi^2 cos t)``,
``u(x, 0) = sin(pi x)``, homogeneous Dirichlet boundaries, backward Euler.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import numpy as np


def rhs(x, t):
    return -np.sin(np.pi * x) * (np.sin(t) - np.pi**2 * np.cos(t))


def init_cond(x):
    return np.sin(np.pi * x)


def fast_heat_class(Heat1D, VectorHeat1D):
    """PyMGRIT's Heat1D with the numerics of ``propagators.Heat1D.step``.

    The same backward-Euler step ``(I + dt a L) u1 = u0 + dt b(x, t1)``, but the
    tridiagonal LU factorization is computed once per step size (LAPACK
    ``dgttrf``) and reused (``dgttrs``) instead of building and factoring a sparse
    matrix in every call. This isolates PyMGRIT's per-call framework cost.
    """
    from scipy.linalg import lapack

    class FastHeat1D(Heat1D):
        def step(self, u_start, t_start, t_stop):
            dt = t_stop - t_start
            cache = self.__dict__.setdefault("_lu", {})
            lu = cache.get(dt)
            if lu is None:
                c = self.a * dt / self.dx**2
                off = np.full(self.nx - 1, -c)
                dl, d, du, du2, ipiv, info = lapack.dgttrf(off, np.full(self.nx, 1.0 + 2.0 * c), off.copy())
                lu = cache[dt] = (dl, d, du, du2, ipiv)
            b = u_start.get_values() + dt * self.rhs(self.x, t_stop)
            x, info = lapack.dgttrs(*lu, b.reshape(-1, 1))
            out = VectorHeat1D(self.nx)
            out.set_values(x[:, 0])
            return out

    return FastHeat1D


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nx", type=int, default=65)
    ap.add_argument("--nt", type=int, default=4097)
    ap.add_argument("--t-stop", type=float, default=2.0)
    ap.add_argument("--cf", type=int, default=4)
    ap.add_argument("--levels", type=int, default=4)
    ap.add_argument("--tol", type=float, default=1e-10)
    ap.add_argument("--cycle", default="V")
    ap.add_argument("--cf-iter", type=int, default=1, help="1 = FCF relaxation")
    ap.add_argument("--no-nested", action="store_true", help="nested_iteration=False")
    ap.add_argument("--sequential", action="store_true", help="also time sequential stepping")
    ap.add_argument("--fast-step", action="store_true", help="cached-LU step (see fast_heat_class)")
    ap.add_argument("--out", default=None, help="save the MGRIT trajectory here (.npy)")
    args = ap.parse_args()

    import pymgrit
    from pymgrit import Heat1D, Mgrit, simple_setup_problem
    from pymgrit.heat.heat_1d import VectorHeat1D

    if args.fast_step:
        Heat1D = fast_heat_class(Heat1D, VectorHeat1D)  # noqa: N806

    calls = [0] * args.levels

    def counted(step, level):
        def wrapper(u_start, t_start, t_stop):
            calls[level] += 1
            return step(u_start=u_start, t_start=t_start, t_stop=t_stop)
        return wrapper

    def setup_and_solve():
        heat0 = Heat1D(x_start=0, x_end=1, nx=args.nx, a=1, init_cond=init_cond, rhs=rhs,
                       t_start=0, t_stop=args.t_stop, nt=args.nt)
        problem = simple_setup_problem(problem=heat0, level=args.levels, coarsening=args.cf)
        for level, p in enumerate(problem):
            p.step = counted(p.step, level)  # Mgrit reads problem[l].step when it is built
        solver = Mgrit(problem=problem, tol=args.tol, cf_iter=args.cf_iter, cycle_type=args.cycle,
                       nested_iteration=not args.no_nested, logging_lvl=logging.WARNING)
        return heat0, solver, solver.solve()

    # a warm-up solve first (imports, first-call paths), as ours are timed in a process that already solved:
    # the timed one builds everything anew (its factorization caches too, like ours)
    setup_and_solve()
    calls[:] = [0] * args.levels
    w0, c0 = time.perf_counter(), time.process_time()
    heat0, solver, info = setup_and_solve()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    u = np.array([v.get_values() for v in solver.u[0]])

    out = {
        "pymgrit": getattr(pymgrit, "__version__", None) or _dist_version("pymgrit"),
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "nested_iteration": not args.no_nested,
        "fast_step": args.fast_step,
        "iterations": int(solver.solve_iter),
        "residuals": [float(r) for r in info["conv"]],
        "time_setup": float(info["time_setup"]),
        "time_solve": float(info["time_solve"]),
        "wall": wall,
        "cpu": cpu,
        "calls": list(calls),  # before the sequential loop below, which steps problem[0] too
    }
    if args.sequential:
        w0, c0 = time.perf_counter(), time.process_time()
        step, tt = heat0.step, heat0.t
        v = heat0.vector_t_start.clone()
        seq = [v.get_values()]
        for i in range(1, len(tt)):
            v = step(u_start=v, t_start=tt[i - 1], t_stop=tt[i])
            seq.append(v.get_values())
        out["seq_wall"], out["seq_cpu"] = time.perf_counter() - w0, time.process_time() - c0
        out["err_vs_own_sequential"] = float(np.abs(u - np.array(seq)).max())
    if args.out:
        np.save(args.out, u)
    print(json.dumps(out))


def _dist_version(name):
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    main()
