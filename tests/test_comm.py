"""The communicator interface without MPI: the overflow-free exact 2-norm (and the
solves that need it), the serial communicator's sessions and the tag table.

The MPI side (sessions, cleanup after failures, alarms, world-rank naming) is
tested in tests/test_mpi.py through the scripts tests/mpi_scripts/comm_*.py.
"""
from __future__ import annotations

import math
import pickle
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mgrit
from mgrit.comm import (
    Call,
    RemoteRankError,
    SerialComm,
    Tag,
    as_communicator,
    mismatch_message,
    square_bins,
    square_bins_root,
)
from mgrit.cycle import temporal_norm, temporal_norms

# --------------------------------------------------------------------------- spatial norms and the NaN check
@pytest.mark.parametrize("shape", [(1, 4096), (257, 16), (257, 4096), (9, 8, 64)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.complex128])
def test_row_norms_are_the_euclidean_norms_and_each_row_is_its_own(shape, dtype):
    """Every row's norm to rounding, whatever the other rows (a rank holds some of them), scaled
    rows near 1e200 and 1e-200 included (no overflow to inf, no underflow to 0)."""
    from mgrit._backend import row_norms

    rng = np.random.default_rng(0)
    X = rng.standard_normal(shape).astype(dtype)
    if dtype == np.complex128:
        X = X + 1j * rng.standard_normal(shape)
    if dtype == np.float64 and shape[0] > 3:
        X[1] *= 1e200
        X[2] *= 1e-200  # squares 0
        X[3] *= 1e-160  # squares subnormal
    if dtype == np.float32 and shape[0] > 3:
        X[3] *= np.float32(1e-21)  # squares subnormal in float32
    n = row_norms(X)
    ref = np.array([math.sqrt(sum(abs(complex(v)) ** 2 for v in row.ravel() / np.abs(row).max()))
                    * float(np.abs(row).max()) for row in X])
    np.testing.assert_allclose(n, ref, rtol=1e-6 if dtype == np.float32 else 1e-13)
    parts = np.concatenate([row_norms(X[:1]), row_norms(X[1:])])
    assert np.array_equal(n, parts)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_row_norms_of_torch_stacks_are_accurate_at_every_scale(dtype):
    torch = pytest.importorskip("torch")
    from mgrit._backend import row_norms

    scales = [1.0, 1e30, 1e-19, 1e-30] if dtype == "float32" else [1.0, 1e200, 1e-160, 1e-200]
    X = torch.randn(len(scales), 3, 50, dtype=getattr(torch, dtype), generator=torch.Generator().manual_seed(0))
    X = X * torch.tensor(scales, dtype=X.dtype)[:, None, None]
    n = row_norms(X)
    rows = X.double().reshape(len(scales), -1)
    s = rows.abs().amax(dim=1)
    ref = (s * torch.linalg.vector_norm(rows / s[:, None], dim=1)).numpy()
    np.testing.assert_allclose(n, ref, rtol=1e-6 if dtype == "float32" else 1e-13)


@pytest.mark.parametrize("shape", [(5,), (3, 4), (257, 16), (257, 4096), (9, 8, 64)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.complex128])
def test_all_finite_finds_one_bad_entry_anywhere(shape, dtype):
    from mgrit._backend import all_finite

    X = np.ones(shape, dtype=dtype)
    assert all_finite(X) and all_finite(X[:0])
    flat = X.reshape(-1)
    for pos in (0, flat.size // 2, flat.size - 1):
        for bad in (np.nan, np.inf, -np.inf):
            flat[pos] = bad
            assert not all_finite(X), (pos, bad)
            flat[pos] = 1
    if dtype == np.complex128:
        flat[flat.size // 2] = complex(1.0, np.nan)
        assert not all_finite(X)
        flat[flat.size // 2] = 1
    big = np.finfo(np.dtype(dtype).type(0).real.dtype).max
    X[...] = big  # finite entries whose sums overflow: checked entry by entry, still finite
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no overflow warning reaches the user
        assert all_finite(X)
    M = np.ma.masked_invalid(np.where(np.arange(X.size).reshape(X.shape) == 1, np.nan, 1.0))
    assert all_finite(M) == bool(np.isfinite(M).all())  # numpy's own answer for a masked array


def test_row_norms_of_finite_rows_beyond_the_largest_float_are_inf_without_a_warning():
    from mgrit._backend import row_norms

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        n = row_norms(np.array([[1.5e308, 1.5e308, 1.5e308], [3.0, 4.0, 0.0]]))  # sqrt(3) 1.5e308 > max
    assert n[0] == np.inf and n[1] == 5.0


# --------------------------------------------------------------------------- the exact 2-norm
ordinary = st.floats(min_value=-1e100, max_value=1e100, allow_nan=False).filter(lambda v: v == 0 or abs(v) > 1e-100)


@settings(max_examples=200, deadline=None)
@given(st.lists(ordinary, max_size=50), st.lists(st.integers(0, 50), max_size=5))
def test_norm2_exact_is_todays_value_for_ordinary_magnitudes_whatever_the_split(values, cuts):
    """Without over- or underflowing squares, the value is sqrt(fsum(x * x)) bit for bit,
    also through the bins of any split of the values added in any order (ranks)."""
    x = np.array(values, dtype=np.float64)
    expected = math.sqrt(math.fsum((x * x).tolist()))
    assert SerialComm().norm2_exact(x) == expected
    parts = np.split(x, sorted(set(min(c, len(x)) for c in cuts)))
    total = sum((square_bins(p) for p in reversed(parts)), np.zeros_like(square_bins(x)))
    assert square_bins_root(total) == expected
    assert temporal_norm(x, 2, SerialComm()) == expected


any_finite = st.floats(allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(st.lists(any_finite, max_size=64), st.integers(0, 64))
def test_few_value_bins_hold_the_same_exact_total_as_the_vectorised_ones(values, cut):
    """Up to 64 finite values are binned with Python integers, more with numpy: other bins, the same
    exact total. Bins of both kinds, from any split (ranks with few and with many values), add up
    to the same root bit for bit, over the whole float range (subnormals, squares that overflow)."""
    from mgrit.comm import _FEW

    x = np.array(values, dtype=np.float64)
    pad = np.zeros(_FEW + 1)  # zeros add nothing but send the values down the vectorised path
    few, vectorised = square_bins(x), square_bins(np.concatenate([x, pad]))
    assert square_bins_root(few) == square_bins_root(vectorised)
    k = min(cut, len(x))
    mixed = square_bins(x[:k]) + square_bins(np.concatenate([x[k:], pad]))
    assert square_bins_root(mixed) == square_bins_root(vectorised)
    if len(x) and np.all(np.abs(x[x != 0]) > 1e-150) and np.all(np.abs(x) < 1e150):
        assert square_bins_root(few) == math.sqrt(math.fsum((x * x).tolist()))
    assert math.isnan(square_bins_root(square_bins(np.append(x, np.nan))))  # (a NaN leaves the few-value path)


def test_exact_many_and_temporal_norms_equal_the_single_reductions():
    """One reduction for several parts gives each part's value bit for bit (2-norm, sum, max,
    temporal norms with p = 2, 1 and inf); an unknown kind is a ValueError."""
    rng = np.random.default_rng(3)
    parts = [rng.standard_normal(7) * 1e150, np.zeros(0), np.array([0.1] * 10), np.array([1.0, np.inf])]
    c = SerialComm()
    for kind, single in (("norm2", c.norm2_exact), ("sum", c.sum_exact), ("max", c.max)):
        assert c.exact_many(parts, kind) == [single(v) for v in parts]
    for p in (2, 1, math.inf):
        assert temporal_norms(parts[:3], p, c) == [temporal_norm(v, p, c) for v in parts[:3]]
    with pytest.raises(ValueError, match="kind"):
        c.exact_many(parts, "mean")


@pytest.mark.parametrize("k", [700, -700, 1000, -1000])
def test_norm2_exact_neither_overflows_nor_underflows(k):
    """Scaling by a power of two scales the norm exactly, even where every square
    overflows (k = 700, 1000) or underflows (k = -700, -1000)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal(40)
    ref = SerialComm().norm2_exact(x)
    big = np.ldexp(x, k)
    assert np.all(np.isfinite(big)) and not np.any(big == 0)
    assert SerialComm().norm2_exact(big) == math.ldexp(ref, k)
    assert square_bins_root(square_bins(big)) == math.ldexp(ref, k)


def test_norm2_exact_special_values():
    c = SerialComm()
    assert c.norm2_exact([]) == 0.0 and c.norm2_exact([0.0, -0.0]) == 0.0
    assert c.norm2_exact([3e200, -4e200]) == pytest.approx(5e200, rel=1e-15, abs=0.0)
    assert c.norm2_exact([3e-200, 4e-200]) == pytest.approx(5e-200, rel=1e-15, abs=0.0)
    assert c.norm2_exact([5e-324] * 4) == 1e-323  # subnormals: sqrt(4 * 2**-2148) exactly
    assert c.norm2_exact([1.7e308, 1.7e308]) == math.inf  # the norm itself is too large
    assert c.norm2_exact([1.0, math.inf]) == math.inf and math.isnan(c.norm2_exact([1.0, math.nan]))
    assert math.isnan(c.norm2_exact([math.inf, math.nan]))


# --------------------------------------------------------------------------- solves at extreme scales
class Decay(mgrit.Propagator):
    """Backward Euler for u' = -u; spatial norm |u| (it does not overflow at 1e200)."""

    def step(self, u, t0, t1):
        return u / (1.0 + (t1 - t0))

    def norms(self, U):
        return np.abs(np.asarray(U).reshape(len(U), -1)).max(axis=1)


KW = dict(cf=2, max_levels=3, relax="F", initial_guess=0.0, tol=None, max_iter=4)


@pytest.mark.parametrize("k", [664, -664])
def test_residuals_scale_exactly_with_the_states(k):
    """u0 = 2**664 (~1e200) or 2**-664: the whole solve scales by the power of two, so the
    residual history is the one of u0 = 1 times 2**k, bit for bit (today's squares
    overflow to a false divergence, or underflow to a false zero residual)."""
    t = np.linspace(0.0, 5.0, 33)
    one = mgrit.solve(Decay(), np.array(1.0), t, **KW)
    scaled = mgrit.solve(Decay(), np.array(math.ldexp(1.0, k)), t, **KW)
    assert scaled.residuals[0] is None
    assert scaled.residuals[1:] == [math.ldexp(r, k) for r in one.residuals[1:]]
    assert all(r > 0 for r in scaled.residuals[1:])


def test_solve_with_states_near_1e200_converges_like_the_unit_solve():
    t = np.linspace(0.0, 5.0, 33)
    one = mgrit.solve(Decay(), np.array(1.0), t, **KW)
    big = mgrit.solve(Decay(), np.array(1e200), t, **KW)
    np.testing.assert_allclose(big.residuals[1:], 1e200 * np.array(one.residuals[1:]), rtol=1e-12)
    conv = mgrit.solve(Decay(), np.array(1e200), t, cf=2, max_levels=3, relax="F", initial_guess=0.0,
                       tol=1e-10, tol_type="rel", max_iter=30)
    assert conv.converged
    np.testing.assert_allclose(conv.u, 1e200 * mgrit.solve(Decay(), np.array(1.0), t, cf=2, max_levels=1).u,
                               rtol=1e-9)  # converged to a relative residual of 1e-10


# --------------------------------------------------------------------------- the serial communicator
def test_serial_sessions_are_no_ops_that_let_exceptions_through():
    c = SerialComm()
    with c.session(signature=123) as s:
        assert s is c
        assert c.allreduce(2.5) == 2.5 and c.bcast("x") == "x" and c.gather(1) == [1]
    with pytest.raises(KeyError):
        with c.session():
            raise KeyError("inside")

    class Interrupt(BaseException):
        pass

    with pytest.raises(Interrupt):
        with c.session():
            raise Interrupt()
    with c.session():  # still usable, and sessions nest
        with c.session():
            pass
    assert c.waited == 0.0  # one process never waits for another
    assert isinstance(mgrit.as_communicator(None), SerialComm) and mgrit.as_communicator(c) is c


def test_one_process_layer_parallel_reports_no_waiting():
    """``lp.comm.waited`` reads 0.0 after a one-process pass (the MPI and gloo counters are checked
    by tests/mpi_scripts/comm_session.py and tests/dist_scripts/equal_serial.py)."""
    torch = pytest.importorskip("torch")
    from propagators.torch import LayerParallel

    lp = LayerParallel([torch.nn.Linear(3, 3) for _ in range(8)], T=1.0, cf=2)
    lp(torch.ones(2, 3)).sum().backward()
    assert lp.comm.waited == 0.0


def test_serial_communicator_interface_additions():
    c = as_communicator(None)
    assert isinstance(c, SerialComm)
    assert isinstance(c.split(3, 0), SerialComm) and isinstance(c.reversed(), SerialComm)
    assert c.world_rank() == 0 and c.world_rank(0) == 0
    c.alarm(RuntimeError("nobody to tell"))
    c.free()
    x = np.arange(6.0).reshape(2, 3)
    y = c.allreduce_array(x)
    assert np.array_equal(y, x) and y is not x and y.dtype == x.dtype
    assert c.sum_exact([1e16, 1.0, -1e16]) == 1.0
    assert c.max([1.0, 3.0]) == 3.0


def test_tags_are_distinct_and_within_the_mpi_minimum():
    values = [int(t) for t in Tag]
    assert len(values) == len(set(values))  # no aliases
    assert max(values) <= 32767  # the MPI standard guarantees TAG_UB >= 32767
    reserved = [t for t in Tag if t < Tag.USER]
    assert Tag.USER == max(values) and Tag.HALO in reserved and Tag.GHOST in reserved
    assert min(values) >= 1024  # far above any level index (the solver's data tags)


def test_remote_rank_error_carries_the_ranks():
    e = RemoteRankError("rank 3 (rank 0 of this communicator) failed: boom", rank=0, world_rank=3)
    assert (e.rank, e.world_rank) == (0, 3) and isinstance(e, RuntimeError)
    f = pickle.loads(pickle.dumps(e))
    assert (str(f), f.rank, f.world_rank) == (str(e), 0, 3)
    assert RemoteRankError("plain").world_rank is None


def test_a_handshake_mismatch_names_each_ranks_call_or_the_arguments_of_the_one_call():
    fwd, bwd = Call("the forward pass of A", 1, "input shapes"), Call("the backward pass of A", 1, "gradients")
    assert mismatch_message([fwd, fwd, fwd]) is None and mismatch_message([5, 5]) is None
    msg = mismatch_message([fwd, bwd, fwd, bwd])
    assert "the collective calls differ between ranks: ranks 0, 2 in the forward pass of A; " \
           "ranks 1, 3 in the backward pass of A." in msg
    other = Call("the forward pass of A", 2, "input shapes")
    msg = mismatch_message([fwd, other, other])
    assert msg.startswith("the arguments of the forward pass of A differ between ranks (rank 0 against ranks 1, 2): "
                          "different input shapes")
    assert "in another collective call" in mismatch_message([fwd, 7])  # a plain signature: its call is unnamed
    assert "signatures of this collective call differ between ranks (rank 0 against rank 1)" in \
        mismatch_message([6, 7])  # plain signatures: the generic message
    assert "(rank 0 against rank 1): different input shapes" in mismatch_message(
        [fwd, Call(fwd.what, fwd.args, "another wording")])
    assert pickle.loads(pickle.dumps(fwd)) == fwd


class _Unprintable:
    def __repr__(self):
        raise RuntimeError("no repr")

    __str__ = __repr__


def test_a_handshake_mismatch_message_never_raises_whatever_the_signatures():
    """Rank 0 builds the message for every rank: an exception there would leave the others waiting."""
    a, b = np.arange(3), np.arange(3) + 1
    assert mismatch_message([a, a.copy()]) is None  # equal arrays agree (compared by their pickles)
    assert "(rank 0 against rank 1)" in mismatch_message([a, b])
    assert "ranks 0, 2 in ['step', 0]; rank 1 in ['step', 1]" in mismatch_message(
        [Call(["step", 0]), Call(["step", 1]), Call(["step", 0])])  # an unhashable `what`
    odd = Call("the pass", _Unprintable())
    assert "the arguments of the pass differ between ranks (rank 0 against rank 1)" in \
        mismatch_message([odd, Call("the pass", 2)])
    assert "differ between ranks" in mismatch_message([Call(_Unprintable()), Call("x")])


def test_failure_notes_survive_a_broken_str_and_stay_small():
    """A note must reach the other ranks: an exception whose ``__str__`` raises still gives one
    (no alarm at all was sent before: the others hung), and a huge message is cut so that the note
    travels eagerly (a 2 MB note failed in MPI when its sender had already exited)."""
    from mgrit.comm import _NOTE_CHARS, _note

    class DataError(Exception):
        def __str__(self):
            return f"cannot read {self.filename}"  # no such attribute

    assert _note(DataError()) == "DataError: <its str() failed: AttributeError>"
    assert _note(ValueError("bad x")) == "ValueError: bad x"
    big = _note(RuntimeError("X" * 2_000_000))
    assert len(big) < _NOTE_CHARS + 40 and big.endswith("... (2000014 characters)")


def test_world_failures_name_the_rank_that_failed_of_its_own():
    """Ranks that died of the RemoteRankError of another's failure alarm the world too; a rank that
    hears of several names the one that failed of its own (it named a bystander before)."""
    MPI = pytest.importorskip("mpi4py.MPI")
    from mgrit import comm as C

    saved = dict(C._WORLD_FAILED)
    try:
        C._WORLD_FAILED.clear()
        assert C._world_failure_note(MPI, [0, 1, 2]) is None
        C._WORLD_FAILED[0] = (2, "RemoteRankError: rank 2 failed before it joined ...")
        assert C._world_failure_note(MPI, [0, 1])[0] == 0  # only the bystander is known among these
        C._WORLD_FAILED[2] = (2, "RuntimeError: boom")
        assert C._world_failure_note(MPI, [0, 1, 2]) == (2, "RuntimeError: boom")
        assert C._world_failure_note(MPI) == (2, "RuntimeError: boom")
    finally:
        C._WORLD_FAILED.clear()
        C._WORLD_FAILED.update(saved)
