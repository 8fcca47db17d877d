"""What the MPI scripts of the recurrent modules share (gru_ranks.py, lstm_ranks.py): converged
settings, an absolute comparison, the same random input on every rank, and the check that an error
on the last rank reaches every rank."""
import torch

import mgrit
from checks import fail, rank, size

TIGHT = dict(fwd_iters=60, bwd_iters=60, fwd_tol=1e-14, bwd_tol=1e-14)
TOL = 1e-10


def same_randn(*shape, requires_grad=False):
    """The same random tensor on every rank (every rank passes the whole sequence)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(11)).requires_grad_(requires_grad)


def check(name, a, b, tol=TOL):
    """Fail unless ``a`` and ``b`` are given and differ by less than ``tol`` everywhere."""
    if a is None or b is None:
        fail(f"{name}: missing ({a is None}, {b is None})")
    err = float((a.detach() - b.detach()).abs().max())
    if not err < tol:
        fail(f"{name}: max difference {err:.3e} >= {tol:.0e}")


def raised_on_every_rank(call, error, text: str, what: str) -> None:
    """``call()`` fails on the last rank with ``error`` (mentioning ``text``) and on every other rank
    with RemoteRankError naming the last rank and carrying ``text``."""
    bad = rank == size - 1
    try:
        call()
    except mgrit.RemoteRankError as exc:
        if bad or exc.rank != size - 1 or text not in str(exc):
            fail(f"{what}: unexpected RemoteRankError: {exc}")
    except error as exc:
        if not bad or text not in str(exc):
            fail(f"{what}: unexpected {type(exc).__name__}: {exc}")
    else:
        fail(f"{what}: no rank raised")
