"""MPI runs: the parallel solve equals the serial one bit for bit, layer x data grids,
and a failure on one rank reaches every rank; plus the pieces of the communicator
layer that need no MPI (the rank-count independent residual sum).

Every ``mpi``-marked test launches ``mpiexec -n P python tests/mpi_scripts/<script>.py`` (mpiexec
is looked up next to ``sys.executable``, then on PATH) with a timeout; the
scripts compute their serial references themselves, print one line per rank and
exit non-zero on any mismatch. Ranks may outnumber the cores (oversubscription
is fine for these small problems).
"""
from __future__ import annotations

import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mgrit
from mgrit.comm import SerialComm, args_signature, bins_value, exact_bins

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).parent / "mpi_scripts"
TIMEOUT = 120  # seconds per launch


def _mpiexec() -> str | None:
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


def launch(n: int, script: str | Path, *args: str, timeout: float = TIMEOUT):
    """Run ``script`` (in mpi_scripts/ unless a path) on ``n`` ranks; return
    (return code, combined output, seconds).

    On timeout the whole process group of the launcher is killed and the test fails.
    """
    pytest.importorskip("mpi4py")
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("mpiexec not found")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [mpiexec, "-n", str(n), sys.executable, str(SCRIPTS / script), *args]
    if script == "--python":  # run the Python executable itself (args are its arguments)
        cmd = [mpiexec, "-n", str(n), sys.executable, *args]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"`{' '.join(cmd)}` did not return within {timeout} s (a rank hangs?)\n{out[-3000:]}")
    return proc.returncode, out, time.perf_counter() - start


# --------------------------------------------------------------------------- serial == parallel
@pytest.mark.mpi
@pytest.mark.parametrize("n, torch", [(1, False), (2, True), (3, False), (4, True), (7, False)])
def test_parallel_equals_serial_bit_for_bit(n, torch):
    """Solution, residual history, iteration count, dtype, gathers and summed cost
    equal the serial run on every rank (Dahlquist real / complex / float32, FE,
    Lorenz, Brusselator, heat with spatial coarsening, V and F cycles, 1..5 levels,
    F / FCF / FCFCF, awkward distributions; torch float64 / float32 states)."""
    rc, out, _ = launch(n, "equal_serial.py", *(["--torch"] if torch else []))
    assert rc == 0, out[-5000:]
    ok = {int(r) for r in re.findall(r"rank (\d+): OK \d+ cases", out)}
    assert ok == set(range(n)), out[-5000:]


@pytest.mark.mpi
def test_split_comm_grid_layer_by_data():
    """2 x 2 grid: each data shard solves its own initial condition over its layer
    communicator; the all-reduce over the data communicator equals the serial sum."""
    rc, out, _ = launch(4, "split_grid.py")
    assert rc == 0, out[-5000:]
    assert {int(r) for r in re.findall(r"rank (\d+): OK shard", out)} == {0, 1, 2, 3}, out


# --------------------------------------------------------------------------- failures
_CASE = re.compile(r"case (\d+) rank (\d+): (\w+): (.*?) \[after ([0-9.]+) s\]")


def _reports(out: str) -> dict:
    """{(case, rank): (error type, message, seconds)} from the failure script's output."""
    return {(int(c), int(r)): (kind, msg, float(s)) for c, r, kind, msg, s in _CASE.findall(out)}


@pytest.mark.mpi
def test_exception_on_one_rank_makes_every_rank_exit_with_an_error():
    """Rank 2's propagator raises in cycle 3: rank 2 reports its own exception, every
    other rank a RemoteRankError naming rank 2, all within seconds, and every process
    exits (MPI_Finalize copes with what the failed solve left pending: the states are
    1.6 MB, so unmatched sends are rendezvous sends)."""
    rc, out, seconds = launch(4, "failures.py", "--exit", "--big", "raise:2:3", timeout=60)
    assert rc != 0
    rep = _reports(out)
    assert set(rep) == {(0, r) for r in range(4)}, out
    assert rep[0, 2][0] == "Injected"
    for r in (0, 1, 3):
        kind, msg, _ = rep[0, r]
        assert kind == "RemoteRankError" and msg.startswith("rank 2 failed: Injected"), out
    assert max(s for _, _, s in rep.values()) < 10.0, out
    assert seconds < 60


@pytest.mark.mpi
def test_failures_reach_every_rank_and_mpi_stays_usable():
    """Failures on one rank in several places, in one launch on 3 ranks: an exception
    early, late and in the final F-relaxation after the last cycle (when the other
    ranks may already be done), a NaN (divergence), bad input (NaN u0, a failing
    initial guess) and inconsistent input (another time grid). Afterwards a solve on
    the same communicator still equals the serial one."""
    cases = ["raise:1:1", "raise:0:4", "raise:2:6", "raise:1:0", "nan:1:2", "u0:2", "guess:0", "grid:1"]
    rc, out, _ = launch(3, "failures.py", *cases, timeout=90)
    assert rc == 1, out[-5000:]
    rep = _reports(out)
    assert set(rep) == {(c, r) for c in range(len(cases)) for r in range(3)}, out
    for c, spec in enumerate(cases):
        mode, bad = spec.split(":")[:2]
        bad = int(bad)
        for r in range(3):
            kind, msg, seconds = rep[c, r]
            assert seconds < 10.0, (spec, r, out)
            if mode == "grid":  # every rank sees the inconsistency itself
                assert kind == "ValueError" and "differ between ranks" in msg, (spec, r, msg)
            elif mode == "nan":  # the NaN may reach a neighbour, and be detected there, first
                assert kind == "DivergenceError" or (
                    kind == "RemoteRankError" and "DivergenceError: MGRIT diverged" in msg), (spec, r, kind, msg)
            elif r == bad:
                expected = {"raise": "Injected", "guess": "Injected", "u0": "ValueError"}
                assert kind == expected[mode], (spec, r, kind, msg)
            else:
                assert kind == "RemoteRankError" and msg.startswith(f"rank {bad} failed"), (spec, r, kind, msg)
    assert {int(r) for r in re.findall(r"rank (\d+): recovered OK", out)} == {0, 1, 2}, out


# --------------------------------------------------------------------------- benchmark smoke run
@pytest.mark.mpi
def test_mpi_speedup_benchmark_quick_run():
    """benchmarks/mpi_speedup.py --quick launches its own 1- and 2-rank runs and prints the table."""
    rc, out, _ = launch(1, "--python", str(ROOT / "benchmarks" / "mpi_speedup.py"), "--quick")
    assert rc == 0, out[-5000:]
    assert "speedup vs seq" in out and "\n   64" in out, out


# --------------------------------------------------------------------------- no MPI needed
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)


@settings(max_examples=200, deadline=None)
@given(st.lists(finite, min_size=0, max_size=60), st.lists(st.integers(0, 60), max_size=6))
def test_exact_sum_is_correctly_rounded_whatever_the_split(values, cuts):
    """Bins of any split of the values, added in any order, give math.fsum of all of them."""
    x = np.array(values, dtype=np.float64)
    cuts = sorted(set(min(c, len(x)) for c in cuts))
    parts = np.split(x, cuts)
    total = sum((exact_bins(p) for p in reversed(parts)), np.zeros_like(exact_bins(x)))
    try:
        expected = math.fsum(values)
    except OverflowError:
        return  # the true sum is outside the float range
    assert bins_value(total) == expected
    assert bins_value(exact_bins(x)) == expected


def test_exact_sum_special_values():
    assert bins_value(exact_bins([])) == 0.0
    assert bins_value(exact_bins([1e308, 1e308])) == math.inf
    assert math.isnan(bins_value(exact_bins([1.0, math.nan])))
    assert bins_value(exact_bins([math.inf, 1.0])) == math.inf
    assert bins_value(exact_bins([5e-324, 5e-324])) == 1e-323  # subnormals are exact too
    assert SerialComm().sum_exact(np.array([0.1] * 10)) == math.fsum([0.1] * 10)
    assert SerialComm().max(np.zeros(0)) == -math.inf and SerialComm().max([1.0, math.nan]) == math.inf


def test_communicator_argument_is_checked_and_signature_sees_time_grids():
    with pytest.raises(TypeError, match="`comm`"):
        mgrit.solve(mgrit_decay(), np.array(1.0), np.linspace(0, 1, 5), comm="world")
    a = args_signature([1, 2], np.linspace(0, 1, 5).tobytes(), "V")
    assert a == args_signature([1, 2], np.linspace(0, 1, 5).tobytes(), "V")
    assert a != args_signature([1, 2], np.linspace(0, 1.0000001, 5).tobytes(), "V")


def mgrit_decay():
    from propagators import Dahlquist

    return Dahlquist(-1.0)
