"""Layer x data parallelism on a 2 x 2 grid of ranks (``mpiexec -n 4``).

``mgrit.split_comm(world, 2)`` makes two layer communicators (time split over
2 ranks) and two data communicators. Data shard ``d`` solves its own initial
condition over its layer communicator; an all-reduce over the data
communicator then sums the shards' trajectories point by point, which must
equal (bit for bit) the sum of the serial solutions computed in a loop.
Every rank prints ``rank r: OK ...`` or ``rank r: MISMATCH ...`` and exits 0 only on success.
"""
from __future__ import annotations

import sys

import numpy as np

import mgrit
from propagators import heat_hierarchy

LAYER_SIZE = 2


def initial_condition(props, shard: int) -> np.ndarray:
    return (1.0 + shard) * props[0].initial()


def main() -> int:
    from mpi4py import MPI  # here, so that importing this file (pytest collection) starts no MPI

    world = MPI.COMM_WORLD
    bad = []
    try:
        mgrit.split_comm(world, 3)
        bad.append("split_comm accepted a layer size that does not divide the communicator")
    except ValueError:
        pass
    try:  # another layer size on one rank: the grids would differ (and torch's new_group waited for ever)
        mgrit.split_comm(world, 1 if world.rank == 1 else LAYER_SIZE)
        bad.append("split_comm accepted a layer size that differs between ranks")
    except ValueError as exc:
        if "`layer_size` of split_comm differs between ranks: 1 on rank 1" not in str(exc):
            bad.append(f"split_comm with a layer size differing between ranks: {exc}")
    layer, data = mgrit.split_comm(world, LAYER_SIZE)
    shard, n_shards = data.Get_rank(), data.Get_size()
    if layer.Get_size() != LAYER_SIZE or n_shards != world.size // LAYER_SIZE:
        bad.append(f"grid shape: layer size {layer.Get_size()}, data size {n_shards}")
    if layer.Get_rank() != world.rank % LAYER_SIZE or shard != world.rank // LAYER_SIZE:
        bad.append("grid coordinates do not follow world rank = data index * layer_size + layer index")

    props, transfers = heat_hierarchy(33, 3)
    t = np.linspace(0.0, 1.0, 41)
    kw = dict(cf=2, max_levels=3, relax="FCF", tol=1e-10, max_iter=30, spatial=transfers)
    res = mgrit.solve(props, initial_condition(props, shard), t, comm=layer, **kw)
    local_sum = np.empty_like(res.u)
    data.Allreduce(np.ascontiguousarray(res.u), local_sum, op=MPI.SUM)

    # the serial loop over the shards
    refs = [mgrit.solve(props, initial_condition(props, d), t, **kw) for d in range(n_shards)]
    expected = refs[0].u.copy()
    for r in refs[1:]:
        expected += r.u
    idx = np.array(res.index)
    if not np.array_equal(res.u, refs[shard].u[idx]):
        bad.append("this shard's solution differs from its serial solve")
    if not np.array_equal(local_sum, expected[idx]):
        bad.append("the data all-reduce differs from the serial sum")
    if res.residuals != refs[shard].residuals:
        bad.append("residual history differs from the serial one")
    whole = mgrit.gather(res, root=None)
    if not np.array_equal(whole, refs[shard].u):
        bad.append("gathered trajectory over the layer communicator differs")
    for b in bad:
        print(f"rank {world.rank}: MISMATCH {b}", flush=True)
    if not bad:
        print(f"rank {world.rank}: OK shard {shard} points {res.index.start}..{res.index.stop - 1}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
