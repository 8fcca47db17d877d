"""What the MPI test scripts share: the world communicator, a failure line, and the comparison
with serial autograd (largest difference relative to ``max(1, max |reference|)``, below 1e-9)."""
import sys

from mpi4py import MPI

from layer_zoo import rel  # noqa: F401 - part of this module's interface

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
REL = 1e-9
TIGHT = dict(fwd_iters=80, bwd_iters=80, fwd_tol=1e-14, bwd_tol=1e-14)  # converged solves


def fail(msg):
    """Print the failure on this rank and exit 1 (mpiexec then ends every rank)."""
    print(f"rank {rank} FAIL: {msg}", flush=True)
    sys.exit(1)


def one_rank_fails(what, run, failing: bool, error, text: str, remote_from: int | None = None) -> None:
    """``run()`` (collective) raises ``error`` naming ``text`` on the ranks where ``failing``, and
    RemoteRankError on the others, which would otherwise wait for ever (with ``remote_from``: naming
    that rank and carrying ``text``); anything else fails."""
    import mgrit

    try:
        run()
    except mgrit.RemoteRankError as exc:  # (a RuntimeError too: caught first)
        if failing or remote_from is not None and (exc.rank != remote_from or text not in str(exc)):
            fail(f"{what}: unexpected RemoteRankError on rank {rank}: {exc}")
    except error as exc:
        if not failing or text not in str(exc):
            fail(f"{what}: rank {rank} raised {exc!r}")
    else:
        fail(f"{what}: rank {rank} returned although a rank failed")


def check(name, a, b, tol=REL):
    err = rel(a, b)
    if not err < tol:
        fail(f"{name}: relative difference {err:.3e} >= {tol:.0e}")


def value_error_everywhere(call, text: str, what: str) -> None:
    """``call()`` raises ValueError mentioning ``text`` on this rank (every rank checks its own: an error
    the ranks agreed on)."""
    try:
        call()
    except ValueError as exc:
        if text not in str(exc):
            fail(f"{what}: unexpected ValueError: {exc}")
    else:
        fail(f"{what}: no error")
