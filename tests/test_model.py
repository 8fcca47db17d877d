"""The critical-path cost model (mgrit.model) against the solver's own counts and hand counts."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import mgrit
from mgrit.model import StepCost, count_residue, predict, sequential_time
from propagators import Dahlquist


def solve_counts(n, cf, levels, relax, kind, skip):
    t = np.linspace(0.0, 2.0, n + 1)
    return mgrit.solve(Dahlquist(-1.0), np.array(1.0), t, cf=cf, max_levels=levels, relax=relax, cycle=kind,
                       skip=skip, tol=1e-10, max_iter=20, min_coarse=1)


# --------------------------------------------------------------------------- one rank: the solver's counts
@pytest.mark.parametrize("n, cf, levels, relax, kind, skip", [
    c for c in itertools.product([8, 37, 64], [2, 3, 4], [1, 2, 3, 5], ["F", "FCF", "FCFCF"], "VF", [True, False])
    if c[0] != 8 or c[1] != 4  # 8 intervals with cf 4: no more than 2 levels anyway
])
def test_one_rank_predicts_exactly_the_solvers_calls_per_level(n, cf, levels, relax, kind, skip):
    res = solve_counts(n, cf, levels, relax, kind, skip)
    p = predict(res.hierarchy, 1, res.iterations, cycle=kind, skip=skip)
    assert list(p.rank_calls[0]) == res.counts
    assert list(p.path_calls) == res.counts  # one rank: all work is on the path
    assert p.time == sum(res.counts)  # unit costs, no latency: time counts calls
    assert [sum(c) for c in zip(*p.iteration_path_calls)] == res.counts


@pytest.mark.parametrize("size", [2, 3, 4, 7, 40])
@pytest.mark.parametrize("n, cf, levels, relax, kind", [(64, 2, 4, "FCF", "V"), (37, 3, 3, "F", "F"), (50, 4, 2, "FCF", "V")])
def test_work_summed_over_ranks_equals_the_serial_work(size, n, cf, levels, relax, kind):
    """Splitting the time axis moves work between ranks, it neither adds nor loses any."""
    res = solve_counts(n, cf, levels, relax, kind, True)
    p = predict(res.hierarchy, size, res.iterations, cycle=kind)
    assert [sum(col) for col in zip(*p.rank_calls)] == res.counts
    assert all(pc <= c for pc, c in zip(p.path_calls, res.counts))


# --------------------------------------------------------------------------- hand counts
def test_two_ranks_one_cycle_hand_count():
    """N = 8, two levels, F-relaxation, one cycle without skip; ranks own 0..3 and 4..8
    (coarse points 0..1 and 2..4). Batched calls cost 0.5 + 1 per state, single steps 3,
    latency 0.25. Rank 1 is always behind, and its path is:
    F-relax 2 states (then the ghost, 2.5 + 0.25 since rank 0 sent at 2.5), residuals 3,
    Psi 3 (coarse), coarse chain 3 single steps, all-reduce, final F-relax 2 (then the
    ghost from rank 0), all-reduce."""
    h = mgrit.build_hierarchy(np.linspace(0, 1, 9), cf=2, max_levels=2, relax="F")
    c, a = StepCost(single=3.0, per_state=1.0, per_call=0.5), 0.25
    p = predict(h, 2, 1, skip=False, cost=c, latency=a)
    assert p.path_calls == (7, 6)
    assert p.rank_calls == ((5, 2), (7, 6))
    expected = (0.5 + 2) + a + (0.5 + 3) + (0.5 + 3) + 3 * 3.0 + a + (0.5 + 2) + a + a
    assert p.time == pytest.approx(expected) and p.time == pytest.approx(22.0)
    assert p.path_messages == 2
    assert p.sequential_time == 8 * 3.0 and p.speedup == pytest.approx(24.0 / 22.0)


def test_f_relaxation_overlaps_along_a_chain_of_ranks_starting_inside_intervals():
    """N = 14, cf 4, 3 ranks own 0..4, 5..9, 10..14 (coarse 0..1, 2, 3); one skipped cycle
    (injection, coarse chain) and the final F-relaxation; unit costs, latency 1.

    Coarse chain: rank 0 steps once (t=1) and sends; rank 1 waits (2), steps (3),
    sends; rank 2 waits (4), steps (5). Final F-relaxation: rank 1 starts inside an
    interval (point 5, residue 1) and needs rank 0's point 4, a C-point sent before
    any sweep (arrives at 2 < 3); it sends its point 9 (residue 1) after sweep 1 (t=5).
    Rank 2 (point 10, residue 2) does sweep 1 first (t=6), then needs point 9
    (arrives at 6: no wait), sweeps 2 and 3 (t=9). All-reduce: 9 + 2 (log2 3 -> 2)."""
    h = mgrit.build_hierarchy(np.linspace(0, 1, 15), cf=4, max_levels=2, relax="F")
    p = predict(h, 3, 1, skip=True, latency=1.0)
    assert p.time == 11.0
    assert p.path_calls == (4, 3)
    assert p.path_messages == 2
    assert p.rank_calls == ((3, 1), (4, 1), (4, 1))
    assert p.iteration_times == (5.0,)
    assert p.iteration_path_calls == ((0, 3), (4, 0))


def test_one_level_is_a_chain_over_all_ranks():
    """13 points on 4 ranks (blocks 0..2, 3..5, 6..8, 9..12): 12 single steps in a row,
    3 messages and the final handshake (2 latencies for 4 ranks)."""
    h = mgrit.build_hierarchy(np.linspace(0, 1, 13), max_levels=1)
    p = predict(h, 4, 1, cost=StepCost(single=2.0), latency=0.5)
    assert p.path_calls == (12,) and p.path_messages == 3
    assert p.time == 12 * 2.0 + 3 * 0.5 + 2 * 0.5
    assert p.speedup < 1


def test_more_ranks_than_points_is_modelled():
    h = mgrit.build_hierarchy(np.linspace(0, 1, 6), cf=2, max_levels=3, min_coarse=1)
    p = predict(h, 9, 3)
    assert sum(1 for row in p.rank_calls if any(row)) < 9  # some ranks own nothing
    assert [sum(c) for c in zip(*p.rank_calls)] == list(predict(h, 1, 3).rank_calls[0])


def test_count_residue_matches_brute_force():
    for lo, hi, m in itertools.product(range(0, 9), range(-1, 14), (2, 3, 5)):
        for j in range(m):
            assert count_residue(lo, hi, j, m) == sum(1 for i in range(lo, hi + 1) if i % m == j)


# --------------------------------------------------------------------------- behaviour
def test_latency_and_costs_move_the_time_the_right_way():
    h = mgrit.build_hierarchy(np.linspace(0, 1, 257), cf=4, relax="FCF")
    times = [predict(h, 8, 5, latency=a).time for a in (0.0, 1.0, 10.0)]
    assert times[0] < times[1] < times[2]
    cheap_coarse = predict(h, 8, 5, cost=[StepCost(), StepCost(0.1, 0.1, 0.0)]).time
    assert cheap_coarse < times[0]


def test_speedup_grows_with_ranks_for_a_long_horizon():
    h = mgrit.build_hierarchy(np.linspace(0, 1, 16385), cf=8, relax="FCF")
    cost = StepCost(single=35e-6, per_state=12e-6, per_call=40e-6)
    s = [predict(h, P, 8, cost=cost, latency=1e-5).speedup for P in (1, 8, 64, 512)]
    assert s == sorted(s) and s[0] < 1 < s[-1]
    assert sequential_time(h, cost) == pytest.approx(16384 * 35e-6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(size=0), "size"),
    (dict(iterations=0), "iterations"),
    (dict(cycle="W"), "cycle"),
    (dict(latency=-1.0), "latency"),
])
def test_bad_arguments_are_rejected(kwargs, match):
    h = mgrit.build_hierarchy(np.linspace(0, 1, 9), cf=2)
    args = dict(size=2, iterations=1) | kwargs
    with pytest.raises(ValueError, match=match):
        predict(h, args.pop("size"), args.pop("iterations"), **args)


def test_helpers_reject_what_has_no_meaning():
    """From a review: count_residue with modulus 0 raised ZeroDivisionError and with a negative one
    returned -4; zero costs everywhere gave an infinite speedup for 0 / 0; backward Euler's pole
    (z = 1) raised ZeroDivisionError."""
    from mgrit.theory import step_factor

    for j, m in ((0, 0), (0, -2), (3, 2)):
        with pytest.raises(ValueError, match="modulus"):
            count_residue(1, 8, j, m)
    h = mgrit.build_hierarchy(np.linspace(0, 1, 9), cf=2)
    assert math.isnan(predict(h, 2, 1, cost=StepCost(0.0, 0.0, 0.0)).speedup)
    assert predict(h, 2, 1, cost=StepCost(1.0, 0.0, 0.0), latency=0.0).speedup > 0
    for z in (1.0, np.array([0.5, 1.0])):
        with pytest.raises(ValueError, match="pole of backward Euler"):
            step_factor(z, "be")
    assert step_factor(1.0, "fe") == 2.0


def test_step_cost_validates():
    with pytest.raises(ValueError, match="per_state"):
        StepCost(per_state=-1.0)
    with pytest.raises(ValueError, match="single"):
        StepCost(single=math.nan)


@pytest.mark.parametrize("n, cf, levels, relax, kind", [
    (64, 2, 4, "FCF", "V"), (64, 2, 5, "F", "F"), (37, 3, 3, "FCF", "F"), (64, 4, 3, "F", "V"), (37, 2, 2, "F", "V"),
])
def test_one_rank_predicts_the_nested_start_exactly(n, cf, levels, relax, kind):
    t = np.linspace(0.0, 2.0, n + 1)
    res = mgrit.solve(Dahlquist(-1.0), np.array(1.0), t, cf=cf, max_levels=levels, relax=relax, cycle=kind,
                      nested=True, tol=1e-10, max_iter=20, min_coarse=1)
    p = predict(res.hierarchy, 1, res.iterations, cycle=kind, nested=True)
    assert list(p.rank_calls[0]) == res.counts


@pytest.mark.parametrize("max_iter", [3, 100])
def test_the_model_counts_the_reductions_of_a_solve_that_stops_on_its_tolerance(max_iter, monkeypatch):
    """With final_residual the solver reduces the last cycle's norm with the final residual's only at
    max_iter; stopped by its tolerance it reduces them apart. The model merged them always: one all-reduce
    short (3 for the solver's 4)."""
    from mgrit import comm as C
    from mgrit import model as M
    from propagators import Dahlquist

    counts = {"solver": 0, "model": 0}
    exact_many, sync = C.Communicator.exact_many, M._Schedule.sync

    def counted(self, parts, kind):
        counts["solver"] += 1
        return exact_many(self, parts, kind)

    def synced(self):
        counts["model"] += 1
        return sync(self)

    monkeypatch.setattr(C.Communicator, "exact_many", counted)
    monkeypatch.setattr(M._Schedule, "sync", synced)
    res = mgrit.solve(Dahlquist(-1.0), np.array([1.0]), np.linspace(0, 1, 65), cf=2, max_levels=3, tol=1e-6,
                      max_iter=max_iter, final_residual=True)
    assert res.converged == (max_iter == 100)
    M.predict(res.hierarchy, 1, res.iterations, final_residual=True, converged=res.converged)
    assert counts["model"] - 1 == counts["solver"]  # (the model's sync count includes the final handshake)
    with pytest.raises(ValueError, match="`converged` must be True or False"):
        M.predict(res.hierarchy, 1, 2, converged=None)


def test_step_costs_take_numpy_numbers_and_refuse_bools():
    """np.int64(2) and np.float32(0.5) were refused as "not a finite number >= 0"; True was accepted."""
    c = StepCost(single=np.int64(2), per_state=np.float32(0.5), per_call=np.float16(1.0))
    assert (c.single, c.per_state, c.per_call) == (2.0, 0.5, 1.0) and type(c.single) is float
    for bad in (True, np.True_, -1.0, np.nan, "1"):
        with pytest.raises(ValueError, match="must be a finite number >= 0"):
            StepCost(single=bad)


def test_predict_arguments_and_the_callback_reduction():
    """From a review of the model: latency=True ran as 1, latency=inf gave an infinite time, a float cost or a
    time array for the hierarchy raised AttributeError; a solve with a callback makes one all-reduce more with
    final_residual (the model could not say so)."""
    t = np.linspace(0, 1, 17)
    h = mgrit.build_hierarchy(t, cf=2, max_levels=3)
    for bad in (True, math.inf, "1", -1.0):
        with pytest.raises(ValueError, match="`latency` must be a finite number"):
            predict(h, 2, 2, latency=bad)
    with pytest.raises(TypeError, match="StepCost"):
        predict(h, 2, 2, cost=1.0)
    with pytest.raises(TypeError, match="StepCost"):
        sequential_time(h, 2.0)
    with pytest.raises(TypeError, match="`hierarchy` must be"):
        predict(t, 2, 2)
    reductions = []

    class Counting(mgrit.SerialComm):
        def exact_many(self, parts, kind):
            reductions.append(kind)
            return super().exact_many(parts, kind)

    counts, times = [], []
    for callback in (False, True):
        reductions.clear()
        mgrit.solve(Dahlquist(-1.0), np.array([1.0]), t, cf=2, max_levels=3, max_iter=3, tol=None,
                    final_residual=True, callback=(lambda info: None) if callback else None, comm=Counting())
        counts.append(len(reductions))
        times.append(predict(h, 4, 3, final_residual=True, latency=0.0, reduce_latency=1.0, callback=callback).time)
    assert counts[1] == counts[0] + 1 and times[1] == times[0] + 1.0
