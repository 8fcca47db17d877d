"""The MPI solve must equal the serial solve, bit for bit, whatever the number of ranks.

Run as ``mpiexec -n P python equal_serial.py [--torch]``. Every rank solves each
case twice: serially (``comm=None``) and split over all ranks. It compares this
rank's points, the gathered trajectory (to rank 0 and to all ranks), the
residual history (also as seen by the callback), the iteration count, the
status, the dtype, the propagator calls summed over the ranks and this
rank's calls against :func:`mgrit.model.predict`. Every rank
prints ``rank r: OK n cases`` or one ``rank r: MISMATCH ...`` line per failed
check, and exits 0 only when nothing failed.

The cases include awkward distributions: ``N + 1`` not divisible by ``P``,
more ranks than coarse points (ranks that own no coarse point), more ranks
than fine points (ranks that own nothing), one level (a sequential chain over
the ranks) and explicit partitions with empty ranks.
"""
from __future__ import annotations

import sys

import numpy as np

import mgrit
from mgrit.model import predict
from propagators import Brusselator, Dahlquist, Heat1D, Lorenz, heat_hierarchy


class StepOnly(mgrit.Propagator):
    """A propagator with ``step`` only: the solver relaxes it interval by interval."""

    def __init__(self, inner):
        self.inner = inner

    def step(self, u, t0, t1):
        return self.inner.step(u, t0, t1)


def cases(size: int, with_torch: bool):
    """(name, propagator, u0, t, keyword arguments) of every case."""
    out = []
    # linear: the Dahlquist problem over levels, relaxations and cycles
    t = np.linspace(0.0, 4.0, 65)
    for levels in (2, 3, 4, 5):
        for relax in ("F", "FCF"):
            for kind in ("V", "F"):
                out.append((f"dahlquist L={levels} {relax} {kind}", Dahlquist(-1.0), np.array([1.0, -2.0]), t,
                            dict(cf=2, max_levels=levels, relax=relax, cycle=kind, tol=1e-12, max_iter=40)))
    t37 = np.linspace(0.0, 3.0, 38)  # N = 37: not divisible by cf or by most P
    out += [
        ("complex128 xi", Dahlquist(-0.01 + 0.5j), np.array([1.0 + 0.5j]), t37,
         dict(cf=3, max_levels=3, relax="FCF", cycle="F", tol=1e-12, max_iter=40)),
        ("nested iteration, V and F", Dahlquist(-1.5), np.ones(2), t37,
         dict(cf=2, max_levels=4, relax="FCF", nested=True, tol=1e-12, max_iter=40)),
        ("nested iteration, F-cycles", Dahlquist(-1.5), np.ones(2), t37,
         dict(cf=2, max_levels=4, relax="F", cycle="F", nested=True, tol=1e-12, max_iter=40)),
        ("residual at cycle end, FCF", Dahlquist(-1.5), np.ones(2), t37,
         dict(cf=2, max_levels=3, relax="FCF", residual="cycle_end", tol=1e-12, max_iter=40)),
        ("residual at cycle end, nested F-cycles", Dahlquist(-1.5), np.ones(2), t37,
         dict(cf=2, max_levels=4, relax="F", cycle="F", nested=True, residual="cycle_end", tol=1e-12,
              max_iter=40)),
        ("float32 state", Dahlquist(-1.0), np.array([1.0, 3.0], dtype=np.float32), t37,
         dict(cf=2, max_levels=4, relax="F", tol=None, max_iter=5)),
        ("forward Euler, cf 4, relative tol, 1-norm", Dahlquist(-0.8, "fe"), np.ones(3), t,
         dict(cf=4, max_levels=3, relax="FCF", tol=1e-8, tol_type="rel", norm=1, max_iter=40)),
        ("inf-norm, no skip, F-(CF)^2", Dahlquist(-2.0), np.ones(2), t37,
         dict(cf=2, max_levels=3, relax="FCFCF", norm="inf", skip=False, tol=1e-12, max_iter=40)),
        ("warm start trajectory", Dahlquist(-1.0), np.array(1.0), t,
         dict(cf=2, max_levels=3, tol=1e-12, max_iter=40, initial_guess=np.exp(-t) + 0.1 * np.sin(7 * t))),
        ("callable guess, C weight", Dahlquist(-1.0), np.array([1.0]), t37,
         dict(cf=3, max_levels=3, relax="FCF", c_weight=1.3, tol=1e-12, max_iter=40,
              initial_guess=lambda tk: np.array([np.cos(tk)]))),
    ]
    # nonlinear (FAS) on short horizons
    out += [
        ("lorenz V FCF", Lorenz(), np.array([1.0, 1.0, 1.0]), np.linspace(0.0, 0.5, 51),
         dict(cf=2, max_levels=3, relax="FCF", tol=1e-10, max_iter=30)),
        ("lorenz F-cycle F, 4 levels", Lorenz(), np.array([1.0, 1.0, 1.0]), np.linspace(0.0, 0.3, 41),
         dict(cf=2, max_levels=4, relax="F", cycle="F", tol=1e-10, max_iter=30)),
        ("brusselator cf 4", Brusselator(), np.array([1.0, 2.0]), np.linspace(0.0, 2.0, 41),
         dict(cf=4, max_levels=2, relax="F", tol=1e-10, max_iter=30)),
    ]
    # the heat equation with spatial coarsening (batched LAPACK steps)
    for kind in ("V", "F"):
        props, transfers = heat_hierarchy(33, 3)
        out.append((f"heat spatial coarsening {kind}", props, props[0].initial(), np.linspace(0.0, 1.0, 33),
                    dict(cf=2, max_levels=3, relax="FCF", cycle=kind, tol=1e-10, max_iter=30, spatial=transfers)))
    props, transfers = heat_hierarchy(17, 5)
    out.append(("heat 5 levels cf 2 + spatial", props, props[0].initial(), np.linspace(0.0, 1.0, 50),
                dict(cf=2, max_levels=5, relax="F", tol=None, max_iter=8, spatial=transfers, min_coarse=1)))
    heat = Heat1D(17)
    out.append(("heat no spatial coarsening cf 4", heat, heat.initial(), np.linspace(0.0, 1.0, 30),
                dict(cf=4, max_levels=2, relax="FCF", tol=1e-10, max_iter=30)))
    # awkward distributions
    out += [
        ("N=5: more ranks than coarse points", Dahlquist(-1.0), np.array([1.0]), np.linspace(0, 1, 6),
         dict(cf=2, max_levels=3, min_coarse=1, tol=1e-12, max_iter=10)),
        ("N=2: maybe more ranks than points", Dahlquist(-1.0), np.array([1.0]), np.linspace(0, 1, 3),
         dict(cf=2, max_levels=2, min_coarse=1, tol=1e-12, max_iter=10)),
        ("N=1: one level, one interval", Dahlquist(-1.0), np.array([1.0]), np.linspace(0, 1, 2),
         dict(max_levels=1)),
        ("one level: sequential chain", Heat1D(9), Heat1D(9).initial(), np.linspace(0, 1, 23),
         dict(max_levels=1)),
        ("heat cf 3, N=20, 2 levels", Heat1D(9), Heat1D(9).initial(), np.linspace(0, 1, 21),
         dict(cf=3, max_levels=2, min_coarse=1, relax="F", tol=1e-12, max_iter=20)),
    ]
    n31 = 31
    starts = [0] * size  # every point on the last rank
    out.append(("partition: all on the last rank", Dahlquist(-1.0), np.array([1.0]), np.linspace(0, 1, n31),
                dict(cf=2, max_levels=3, tol=1e-12, max_iter=20, partition=starts)))
    starts = [min(n31, (k * k * n31) // (size * size)) for k in range(size)]  # growing blocks
    if size > 2:
        starts[2] = starts[1]  # and one empty rank in the middle
    out.append(("partition: uneven blocks, an empty rank", Lorenz(), np.array([1.0, 1.0, 1.0]),
                np.linspace(0, 0.3, n31), dict(cf=2, max_levels=3, tol=1e-10, max_iter=20, partition=starts)))
    # step only (F-relaxation interval by interval; blocks start and end inside intervals)
    out += [
        ("step only: lorenz cf 3, N=37, FCF V", StepOnly(Lorenz()), np.array([1.0, 1.0, 1.0]),
         np.linspace(0.0, 0.37, 38), dict(cf=3, max_levels=3, relax="FCF", tol=1e-10, max_iter=30)),
        ("step only: dahlquist cf 4, nested F-cycles", StepOnly(Dahlquist(-1.5)), np.ones(2), t37,
         dict(cf=4, max_levels=3, relax="F", cycle="F", nested=True, tol=1e-12, max_iter=40)),
        ("step only: heat cf 2, 4 levels", StepOnly(Heat1D(9)), Heat1D(9).initial(),
         np.linspace(0, 1, 30), dict(cf=2, max_levels=4, relax="FCF", tol=1e-10, max_iter=30)),
        ("step only: uneven blocks, an empty rank", StepOnly(Lorenz()), np.array([1.0, 1.0, 1.0]),
         np.linspace(0, 0.3, n31), dict(cf=2, max_levels=3, tol=1e-10, max_iter=20, partition=starts)),
    ]
    if with_torch:
        out += torch_cases()
    return out


def torch_cases():
    import torch

    torch.set_num_threads(1)

    class TorchDecay(mgrit.Propagator):
        """``u' = xi u`` with backward Euler on torch tensors (batched)."""

        def __init__(self, xi: float):
            self.xi = xi

        def step(self, u, t0, t1):
            return u / (1.0 - self.xi * (t1 - t0))

        def step_batch(self, U, t0, t1):
            dt = torch.as_tensor(np.asarray(t1) - np.asarray(t0), dtype=U.dtype)
            return U / (1.0 - self.xi * dt).reshape((-1,) + (1,) * (U.ndim - 1))

    t = np.linspace(0.0, 2.0, 30)
    out = []
    for dtype in (torch.float64, torch.float32):
        for relax, kind in (("F", "V"), ("FCF", "F")):
            out.append((f"torch {dtype} {relax} {kind}", TorchDecay(-1.5), torch.tensor([[1.0, 2.0], [3.0, -1.0]], dtype=dtype),
                        t, dict(cf=2, max_levels=3, relax=relax, cycle=kind, tol=1e-7, max_iter=20)))
    return out


def same(a, b) -> bool:
    """Bitwise equality of two arrays or tensors (type, dtype, shape and values)."""
    if type(a) is not type(b):
        return False
    if hasattr(a, "numpy"):  # torch
        return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and bool((a == b).all())
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def check_case(comm, name, prop, u0, t, kw) -> list:
    """Solve one case serially and in parallel; return the failed checks (strings)."""
    rank, size = comm.rank, comm.size
    seen_ref, seen = [], []
    serial_kw = {k: v for k, v in kw.items() if k != "partition"}
    ref = mgrit.solve(prop, u0, t, callback=lambda i: seen_ref.append(i.residual), **serial_kw)
    res = mgrit.solve(prop, u0, t, comm=comm, callback=lambda i: seen.append(i.residual), **kw)
    whole_root = mgrit.gather(res, root=0)
    whole_all = mgrit.gather(res, root=None)
    indices = comm.allgather(list(res.index))
    counts = comm.allreduce(np.array(res.counts, dtype=np.int64))
    bad = []
    idx = np.array(res.index, dtype=int)
    if not same(res.u, ref.u[idx] if len(idx) else ref.u[0:0]):
        bad.append("this rank's points differ from the serial solution")
    if not np.array_equal(res.t, np.asarray(t)[idx]):
        bad.append("res.t is not t[res.index]")
    if sorted(i for part in indices for i in part) != list(range(len(t))):
        bad.append(f"the ranks' indices do not cover 0..N once: {indices}")
    if res.index.step != 1 or len(res.u) != len(res.index):
        bad.append("res.index is not a contiguous range matching res.u")
    if rank == 0 and not same(whole_root, ref.u):
        bad.append("gather(root=0) differs from the serial trajectory")
    if rank != 0 and whole_root is not None:
        bad.append("gather(root=0) returned something on a non-root rank")
    if not same(whole_all, ref.u):
        bad.append("gather(root=None) differs from the serial trajectory")
    if res.residuals != ref.residuals:
        bad.append(f"residuals differ: {res.residuals} vs serial {ref.residuals}")
    if seen != seen_ref:
        bad.append("the callback saw different residuals")
    if (res.iterations, res.converged, res.status) != (ref.iterations, ref.converged, ref.status):
        bad.append(f"iterations/status differ: {res.iterations} {res.status} vs {ref.iterations} {ref.status}")
    if list(counts) != list(ref.counts):
        bad.append(f"propagator calls summed over ranks {list(counts)} != serial {ref.counts}")
    ghosted, first = res.with_ghost()
    want = idx if first == res.index.start else np.concatenate([[first], idx])
    expect = res.index.start - 1 if len(idx) and res.index.start > 0 else res.index.start
    if first != expect or not same(ghosted, ref.u[want] if len(want) else ref.u[0:0]):
        bad.append("with_ghost() is not the serial states from the left neighbour's last point on")
    if (res.rank, res.size) != (rank, size):
        bad.append("res.rank / res.size are wrong")
    model = predict(res.hierarchy, size, res.iterations, cycle=kw.get("cycle", "V"), skip=kw.get("skip", True),
                    nested=kw.get("nested", False), residual=kw.get("residual", "xbraid"),
                    partition=kw.get("partition"))
    if list(model.rank_calls[rank]) != list(res.counts):
        bad.append(f"the cost model predicts calls {model.rank_calls[rank]} on this rank, the solver made {res.counts}")
    return [f"{name}: {b}" for b in bad]


def main() -> int:
    from mpi4py import MPI  # here, so that importing this file (pytest collection) starts no MPI

    comm = MPI.COMM_WORLD
    failures, all_cases = [], cases(comm.size, "--torch" in sys.argv)
    for name, prop, u0, t, kw in all_cases:
        failures += check_case(comm, name, prop, u0, t, kw)
    for f in failures:
        print(f"rank {comm.rank}: MISMATCH {f}", flush=True)
    if not failures:
        print(f"rank {comm.rank}: OK {len(all_cases)} cases", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
