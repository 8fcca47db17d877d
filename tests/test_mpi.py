"""MPI runs: the parallel solve equals the serial one bit for bit, layer x data grids,
a failure on one rank reaches every rank (in solves, in any session, outside sessions
through alarms), failed solves release their channels, sessions are cheap; plus the
pieces of the communicator layer that need no MPI (the rank-count independent residual sum).

Every ``mpi``-marked test launches ``mpiexec -n P python tests/mpi_scripts/<script>.py`` (mpiexec
is looked up next to ``sys.executable``, then on PATH) with a timeout; the
scripts compute their serial references themselves, print one line per rank and
exit non-zero on any mismatch. Ranks may outnumber the cores (oversubscription
is fine for these small problems).
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mgrit
from launch import launch as _launch
from mgrit.comm import SerialComm, args_signature, bins_value, exact_bins

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).parent / "mpi_scripts"
TIMEOUT = 120  # seconds per launch


def launch(n: int, script: str | Path, *args: str, timeout: float = TIMEOUT):
    """(return code, combined output, seconds) of ``script`` on ``n`` ranks (tests/launch.py)."""
    return _launch(n, script, *args, timeout=timeout, timed=True)


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
    initial guess) and inconsistent input (another time grid, another u0, another scalar initial guess; a u0 one bit
    apart, a float16 one a unit apart or a complex one in another memory layout: no error). Afterwards a solve on the same communicator still
    equals the serial one."""
    cases = ["raise:1:1", "raise:0:4", "raise:2:6", "raise:1:0", "nan:1:2", "u0:2", "guess:0", "grid:1", "u0diff:1",
             "u0ulp:2", "u0layout:1", "u0half:2", "guessdiff:2", "guessalike:1"]
    rc, out, _ = launch(3, "failures.py", *cases, timeout=90)
    assert rc == 1, out[-5000:]
    rep = _reports(out)
    alike = {c for c, spec in enumerate(cases)
             if spec.split(":")[0] in ("u0ulp", "u0layout", "u0half", "guessalike")}  # no error
    assert set(rep) == {(c, r) for c in range(len(cases)) if c not in alike for r in range(3)}, out
    for c in alike:
        assert {int(r) for r in re.findall(rf"case {c} rank (\d+): no error", out)} == {0, 1, 2}, (cases[c], out)
    for c, spec in enumerate(cases):
        mode, bad = spec.split(":")[:2]
        bad = int(bad)
        for r in range(3 if c not in alike else 0):
            kind, msg, seconds = rep[c, r]
            assert seconds < 10.0, (spec, r, out)
            if mode == "grid":  # every rank sees the inconsistency itself
                assert kind == "ValueError" and "differ between ranks" in msg, (spec, r, msg)
            elif mode == "u0diff":
                assert kind == "ValueError" and "`u0` differs between ranks: rank 1's" in msg, (spec, r, msg)
            elif mode == "guessdiff":
                assert kind == "ValueError" and "`initial_guess` differs between ranks: rank 2 gives the state" in msg, \
                    (spec, r, msg)
            elif mode == "nan":  # the NaN may reach a neighbour, and be detected there, first
                assert kind == "DivergenceError" or (
                    kind == "RemoteRankError" and "DivergenceError: MGRIT diverged" in msg), (spec, r, kind, msg)
            elif r == bad:
                expected = {"raise": "Injected", "guess": "Injected", "u0": "ValueError"}
                assert kind == expected[mode], (spec, r, kind, msg)
            else:
                assert kind == "RemoteRankError" and msg.startswith(f"rank {bad} failed"), (spec, r, kind, msg)
    assert {int(r) for r in re.findall(r"rank (\d+): recovered OK", out)} == {0, 1, 2}, out


# --------------------------------------------------------------------------- releasing, sessions, alarms
@pytest.mark.mpi
@pytest.mark.parametrize("big", [False, True], ids=["2200-small", "40-rendezvous"])
def test_failed_solves_release_their_channels(big):
    """2,200 caught failing solves on 2 ranks (plus failing handshakes and failing
    non-solve sessions): MPICH has about 2,045 communicators, so a failed solve must
    clean its channel up (drain what was not received, complete its sends) instead of
    abandoning it. Then a solve equals the serial one bit for bit and no channel was
    abandoned. With states of 200 000 float64 the failures leave rendezvous sends behind."""
    rc, out, _ = launch(2, "comm_leak.py", *(["--big"] if big else []), timeout=240)
    assert rc == 0, out[-5000:]
    assert {int(r) for r in re.findall(r"rank (\d+): leak OK", out)} == {0, 1}, out[-5000:]


_SESSION = re.compile(r"case (\w+) rank (\d+): (?:(\w+): (.*?)|no error) \[after ([0-9.]+) s\] "
                      r"rank=(\d+|-) world=(\d+|-) abandoned=(\d+)")


@pytest.mark.mpi
def test_failure_anywhere_in_a_session_reaches_every_rank_naming_its_world_rank():
    """4 ranks, world rank 3 fails while the others wait in recv, bcast, a reduction,
    finish; with a BaseException; in a solve nested in a session; in a solve running inside
    the session (InSession: in its cycles, and in its set-up); after such a solve;
    in a solve on the reversed communicator; in one half of a split. Every rank of
    the session raises within seconds; the error names world rank 3 (and its rank in
    the communicator when that differs) and carries both; no channel is abandoned.
    Then the edge cases of the cleanup: a failure after an explicit finish (the others
    have left: only the failed rank abandons the channel), and a rank busy for 1.5 s
    with a cleanup limit of 0.5 s (the ranks that wait for it give up at the limit).
    Sessions agree on channels and work afterwards."""
    rc, out, _ = launch(4, "comm_session.py", timeout=120)
    assert rc == 0, out[-5000:]
    rep = {(c, int(r)): (kind, msg, float(s), lr, wr, int(a))
           for c, r, kind, msg, s, lr, wr, a in _SESSION.findall(out)}
    cases = ["recv", "bcast", "reduce", "finish", "interrupt", "nested", "in_session", "in_session_setup",
             "after_solve", "reversed", "split"]
    edge = ["after_finish", "slow"]
    assert set(rep) == {(c, r) for c in cases + edge for r in range(4)}, out[-5000:]
    for c in cases:
        kind, msg, seconds, _, _, abandoned = rep[c, 3]
        assert kind == ("Interrupt" if c == "interrupt" else "Injected") and abandoned == 0, (c, kind, msg)
        for r in range(3):
            kind, msg, seconds, lr, wr, abandoned = rep[c, r]
            assert seconds < 5.0 and abandoned == 0, (c, r, seconds, abandoned)
            if c == "split" and r % 2 == 0:  # the other half is not concerned
                assert kind == "", (c, r, kind, msg)
                continue
            local = {"reversed": 0, "split": 1}.get(c, 3)
            who = "rank 3" if local == 3 else f"rank 3 (rank {local} of this communicator)"
            assert kind == "RemoteRankError" and msg.startswith(f"{who} failed: "), (c, r, kind, msg)
            assert (lr, wr) == (str(local), "3"), (c, r, lr, wr)
    assert [rep["after_finish", r][0] for r in range(4)] == ["", "", "", "Injected"], out[-5000:]
    assert [rep["after_finish", r][5] for r in range(4)] == [0, 0, 0, 1], out[-5000:]
    slow = [rep["slow", r] for r in range(4)]
    assert [k for k, *_ in slow] == ["RemoteRankError"] * 3 + ["Injected"], out[-5000:]
    assert slow[1][2] >= 1.4 and max(slow[r][2] for r in (0, 2, 3)) < 1.4, out[-5000:]  # the busy rank: 1
    assert [slow[r][5] for r in (0, 2, 3)] == [1, 1, 1], out[-5000:]  # gave up waiting for rank 1
    assert {int(r) for r in re.findall(r"rank (\d+): sessions OK", out)} == {0, 1, 2, 3}, out[-5000:]


@pytest.mark.mpi
def test_sessions_reuse_their_channel():
    """4,000 sessions (empty ones and ones with a reduction) make one channel, not one
    duplicate each. The per-session times the script prints (about 20-30 us on 2 ranks,
    against 2-3 us for MPI_Barrier) are information, not asserted."""
    rc, out, _ = launch(2, "comm_session.py", "--cost", timeout=120)
    assert rc == 0, out[-3000:]
    made = [int(x) for x in re.findall(r"channels made (\d+)", out)]
    assert made == [1, 1], out


@pytest.mark.mpi
def test_alarm_reaches_a_rank_waiting_outside_a_session():
    """Rank 1 calls alarm(RuntimeError("NaN in shard")) and leaves its step; rank 0, waiting
    in allreduce_array outside any session (then in a session handshake, then in a recv
    inside a session, each on a fresh communicator), raises a RemoteRankError naming world
    rank 1 within seconds; the alarmed communicators refuse further work; MPI_Finalize returns."""
    rc, out, seconds = launch(2, "comm_alarm.py", timeout=60)
    assert rc == 0, out[-5000:]
    assert {int(r) for r in re.findall(r"rank (\d+): alarm OK", out)} == {0, 1}, out
    waits = re.findall(r"rank 0: ([\w ]+): RemoteRankError: rank 1 failed \(alarm\): RuntimeError: NaN in shard"
                       r".*? \[after ([0-9.]+) s\]", out)
    assert [w for w, _ in waits] == ["allreduce_array", "session handshake", "recv in a session"], out
    assert all(float(s) < 5.0 for _, s in waits), out
    assert seconds < 60


@pytest.mark.mpi
@pytest.mark.parametrize("n, where", [(2, "between"), (3, "between"), (2, "solve")])
def test_a_rank_dying_of_an_unhandled_exception_alarms_the_others(n, where):
    """The last rank raises an uncaught exception (between a LayerParallel forward pass and the
    backward pass the others enter; between two solves) and Python finalises MPI there: the
    others, waiting in a handshake for it, raise RemoteRankError naming it, and the job ends
    (it used to hang without ``python -m mpi4py``)."""
    rc, out, _ = launch(n, "unhandled_exit.py", where, timeout=90)
    last = n - 1
    assert rc != 0 and "was not stopped" not in out, out[-5000:]
    assert f"RuntimeError: user code failed on rank {last}" in out, out[-5000:]
    assert re.search(rf"RemoteRankError: rank {last} failed \(alarm\): RuntimeError: user code failed on "
                     rf"rank {last}", out), out[-5000:]


@pytest.mark.mpi
@pytest.mark.parametrize("n, where", [(2, "build"), (3, "build"), (3, "split")])
def test_a_rank_that_fails_before_the_others_wrap_the_communicator_alarms_them(n, where):
    """The last rank raises before it ever wraps the world communicator; the others build a
    LayerParallel over it or split it: they raise RemoteRankError naming it (they waited in
    MPI_Comm_dup for ever before)."""
    rc, out, _ = launch(n, "unhandled_exit.py", where, timeout=90)
    last = n - 1
    assert rc != 0 and "was not stopped" not in out, out[-5000:]
    assert f"RuntimeError: user code failed on rank {last}" in out, out[-5000:]
    found = re.findall(rf"RemoteRankError: rank {last} failed before it joined the wrapping of this "
                       rf"communicator \(its process ended on an unhandled exception\): RuntimeError: user "
                       rf"code failed on rank {last}", out)
    assert len(found) == n - 1, out[-5000:]


@pytest.mark.mpi
def test_an_exception_whose_str_fails_still_alarms_the_others():
    """The last rank dies of an exception whose ``__str__`` raises, before the others build: the
    note could not be made and no alarm went out (they hung); now they raise, naming it."""
    rc, out, _ = launch(2, "unhandled_exit.py", "badstr", timeout=90)
    assert rc != 0 and "was not stopped" not in out, out[-5000:]
    assert "RemoteRankError: rank 1 failed before it joined the wrapping of this communicator (its process " \
           "ended on an unhandled exception): DataError: <its str() failed: AttributeError>" in out, out[-5000:]


@pytest.mark.mpi
@pytest.mark.parametrize("n, where", [(2, "skip"), (3, "skip"), (3, "skiplate"), (2, "skipfree")])
def test_a_rank_that_exits_while_the_others_wait_alarms_them(n, where):
    """The last rank skips the backward pass the others enter and its program ends without an
    error: the others raise RemoteRankError saying that it exited (they hung before). ``skiplate``:
    rank 1 raises after rank 0 died of the same exit; its error does not cite that death as an
    earlier failure (it did, repeating the whole message inside itself: a flaky count in CI)."""
    rc, out, _ = launch(n, "unhandled_exit.py", where, timeout=90)
    last = n - 1
    assert rc != 0 and "was not stopped" not in out, out[-5000:]
    assert len(re.findall(rf"RemoteRankError: rank {last} exited while this rank waits for it", out)) == n - 1, \
        out[-5000:]
    assert "earlier, rank" not in out, out[-5000:]


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_a_rank_that_exits_without_sending_what_another_waits_for_alarms_it(n):
    """The last rank skips the gather to rank 0 and its program ends: rank 0, waiting for its part
    outside any session, raises RemoteRankError saying that it exited (it hung before); the ranks
    that gathered finish."""
    rc, out, _ = launch(n, "unhandled_exit.py", "forgotten", timeout=90)
    last = n - 1
    assert rc != 0, out[-5000:]
    assert len(re.findall(rf"RemoteRankError: rank {last} exited while this rank waits for it", out)) == 1, \
        out[-5000:]
    assert {int(r) for r in re.findall(r"rank (\d+) finished", out)} == set(range(1, n)), out[-5000:]


@pytest.mark.mpi
@pytest.mark.parametrize("n, where", [(2, "done"), (3, "done"), (3, "gather")])
def test_the_exit_alarm_of_a_rank_that_is_done_fails_nobody(n, where):
    """``done``: every rank trains one step; rank 0 is still finishing the backward pass's session
    (it sleeps and polls there) when the last rank, done, exits and alarms it. ``gather``: rank 0
    waits outside any session for rank 1's part of a gather when the last rank, done, exits.
    Rank 0 finishes and the job ends cleanly."""
    rc, out, _ = launch(n, "unhandled_exit.py", where, timeout=90)
    assert rc == 0, out[-5000:]
    assert {int(r) for r in re.findall(r"rank (\d+) finished", out)} == set(range(n)), out[-5000:]
    assert "RemoteRankError" not in out, out[-5000:]


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


@pytest.mark.mpi
def test_readme_waited_example_runs_on_two_ranks(tmp_path):
    """README's "Where the time goes on several ranks" block runs as printed under mpiexec, and every
    rank reports a time it waited (at least 0, less than the whole run)."""
    text = (ROOT / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "comm.waited" in b)
    script = tmp_path / "waited.py"
    script.write_text(block)
    rc, out, seconds = launch(2, script)
    assert rc == 0, out[-3000:]
    waited = {int(r): float(w) for r, w in re.findall(r"^(\d+) waited ([0-9.]+) s$", out, re.M)}
    assert set(waited) == {0, 1} and all(0 <= w < seconds for w in waited.values()), out
