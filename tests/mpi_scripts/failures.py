"""A failure on one rank must make every rank raise, quickly, and leave MPI usable.

Run as ``mpiexec -n P python failures.py [--exit] [--big] CASE [CASE ...]`` with
``CASE = MODE:BAD_RANK[:CYCLE]``. For every case, every rank prints one line
``case i rank r: <TypeName>: <message> [after <seconds> s]`` for the error it
got (or ``case i rank r: no error``). With ``--exit`` a rank that got an
error exits 1 right away (leaving MPI_Finalize to cope with whatever the failed
solve left pending). Otherwise the ranks solve once more on the same
communicator and compare with the serial solve (``rank r: recovered OK`` or
``rank r: recovered MISMATCH``), then exit 1 if any case raised on them.
``--big`` uses states of 200 000 entries (1.6 MB), so that messages take MPI's
rendezvous path and a failure leaves unmatched large sends behind.

MODE:

* ``raise``: the propagator of rank BAD_RANK raises in cycle CYCLE (cycle
  ``max_iter`` = 6 is the final F-relaxation after the last cycle);
* ``nan``: the propagator of rank BAD_RANK returns NaN in cycle CYCLE (a divergence);
* ``u0``: rank BAD_RANK passes a NaN initial condition (bad input);
* ``guess``: the initial-guess callable raises on rank BAD_RANK only (bad input);
* ``grid``: rank BAD_RANK passes a different time grid (inconsistent input);
* ``u0diff``: rank BAD_RANK passes another (finite) initial condition (inconsistent input);
* ``u0ulp``: rank BAD_RANK's initial condition differs in the last bit (rounding: no error);
* ``u0layout``: a complex initial condition, on rank BAD_RANK the same values in a strided view (no error);
* ``u0half``: a float16 initial condition, one unit in the last place apart on rank BAD_RANK (no error).
"""
from __future__ import annotations

import sys
import time

import numpy as np

import mgrit
from propagators import Dahlquist

MAX_ITER = 6


class Injected(RuntimeError):
    """The error raised on purpose by the failing rank."""


class Faulty(mgrit.Propagator):
    """Backward-Euler decay that fails on one rank in one cycle (raise or NaN)."""

    def __init__(self, fail: bool, cycle: int, kind: str):
        self.inner = Dahlquist(-1.0)
        self.fail, self.fail_at, self.kind = fail, cycle, kind
        self.cycle = 0  # advanced by the callback of the solve

    def step(self, u, t0, t1):
        return self.step_batch(u[None], np.array([t0]), np.array([t1]))[0]

    def step_batch(self, U, t0, t1):
        if self.fail and self.cycle == self.fail_at:
            if self.kind == "raise":
                raise Injected(f"injected failure in cycle {self.cycle}")
            return np.full_like(U, np.nan)
        return self.inner.step_batch(U, t0, t1)


def run_case(comm, mode: str, bad_rank: int, cycle: int):
    """Run one failing solve; return the exception this rank got (or None)."""
    rank = comm.rank
    t = np.linspace(0.0, 4.0, 65)
    u0 = np.linspace(1.0, 0.5, 200_000 if "--big" in sys.argv else 2)
    guess = None
    prop = Faulty(rank == bad_rank and mode in ("raise", "nan"), cycle, mode)

    def callback(info):
        prop.cycle = info.iteration + 1

    if mode == "u0" and rank == bad_rank:
        u0[0] = np.nan
    if mode == "u0diff" and rank == bad_rank:
        u0 = u0 * 1.001
    if mode == "u0ulp" and rank == bad_rank:
        u0 = np.nextafter(u0, np.inf)
    if mode == "u0layout":
        u0 = u0 * (1 + 2j)
        if rank == bad_rank:
            u0 = np.repeat(u0, 2)[::2]
    if mode == "u0half":
        u0 = u0.astype(np.float16)
        if rank == bad_rank:
            u0 = np.nextafter(u0, np.float16(np.inf))
    if mode == "grid" and rank == bad_rank:
        t = np.linspace(0.0, 4.0, 66)
    if mode == "guessdiff":  # a scalar guess of its own on one rank: the fixed cycles matched no one-rank run
        guess = 1.0 if rank == bad_rank else 0.0
    if mode == "guessalike":  # the same guess, as the state full of the scalar the others give: no error
        guess = np.full(u0.shape, 0.5) if rank == bad_rank else 0.5
    if mode == "guess" and rank == bad_rank:
        def guess(tk):
            raise Injected(f"initial guess undefined at t = {tk}")
    try:
        mgrit.solve(prop, u0, t, comm=comm, callback=callback, initial_guess=guess,
                    cf=2, max_levels=4, relax="FCF", tol=None, max_iter=MAX_ITER)
    except Exception as exc:  # noqa: BLE001 - the point is to report whatever arrived
        return exc
    return None


def main() -> int:
    from mpi4py import MPI  # here, so that importing this file (pytest collection) starts no MPI

    comm = MPI.COMM_WORLD
    got_error = False
    specs = [a for a in sys.argv[1:] if not a.startswith("--")]
    for i, spec in enumerate(specs):
        mode, bad_rank, *rest = spec.split(":")
        start = time.perf_counter()
        exc = run_case(comm, mode, int(bad_rank), int(rest[0]) if rest else 1)
        elapsed = time.perf_counter() - start
        if exc is None:
            print(f"case {i} rank {comm.rank}: no error", flush=True)
        else:
            got_error = True
            print(f"case {i} rank {comm.rank}: {type(exc).__name__}: {exc} [after {elapsed:.2f} s]", flush=True)
            if "--exit" in sys.argv:
                return 1
    # the communicator must still work after the failures, with the serial result
    prop, t = Dahlquist(-1.0), np.linspace(0.0, 4.0, 65)
    kw = dict(cf=2, max_levels=4, relax="FCF", tol=1e-12, max_iter=30)
    ref = mgrit.solve(prop, np.array([1.0, 0.5]), t, **kw)
    res = mgrit.solve(prop, np.array([1.0, 0.5]), t, comm=comm, **kw)
    ok = np.array_equal(mgrit.gather(res, root=None), ref.u) and res.residuals == ref.residuals
    print(f"rank {comm.rank}: recovered {'OK' if ok else 'MISMATCH'}", flush=True)
    if not ok:
        return 2
    return 1 if got_error else 0


if __name__ == "__main__":
    sys.exit(main())
