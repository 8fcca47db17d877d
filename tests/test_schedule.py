"""One schedule: the solver and the cost model run the same cycle (mgrit.cycle.run), and
the settings of a solve are one frozen, validated value (mgrit.options.Options)."""
from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest

import mgrit
from mgrit.cycle import LevelOps, run
from mgrit.model import predict
from mgrit.options import Options
from propagators import Dahlquist


# --------------------------------------------------------------------------- the model replays the solver
@pytest.mark.parametrize("levels, relax, kind, skip, nested, residual, final", [
    c for c in itertools.product([1, 2, 4], ["F", "FCF"], "VF", [True, False], [True, False],
                                 ["xbraid", "cycle_end"], [True, False])
])
def test_model_counts_the_calls_of_every_schedule_variant(levels, relax, kind, skip, nested, residual, final):
    t = np.linspace(0.0, 2.0, 38)
    res = mgrit.solve(Dahlquist(-1.0), np.array(1.0), t, cf=2, max_levels=levels, relax=relax, cycle=kind,
                      skip=skip, nested=nested, residual=residual, final_residual=final, tol=1e-10,
                      max_iter=20, min_coarse=1)
    p = predict(res.hierarchy, 1, res.iterations, cycle=kind, skip=skip, nested=nested, residual=residual,
                final_residual=final)
    assert list(p.rank_calls[0]) == res.counts


class Recorder(LevelOps):
    """Level operations that only write down what the schedule asks for (one rank, every level)."""

    def __init__(self):
        self.log = []

    def owns(self, l):
        return True

    def check(self, l, R=None, iteration=0):
        pass

    def f_relax(self, l):
        self.log.append(("f_relax", l))

    def c_relax(self, l):
        self.log.append(("c_relax", l))

    def c_residual(self, l):
        self.log.append(("c_residual", l))

    def restrict(self, l, R):
        self.log.append(("restrict", l))

    def inject(self, l):
        self.log.append(("inject", l))

    def correct(self, l):
        self.log.append(("correct", l))

    def sequential_solve(self, l):
        self.log.append(("sequential_solve", l))

    def residual_norm(self, R):
        self.log.append(("residual_norm",))

    def finish(self):
        self.log.append(("finish",))


def test_one_two_level_fcf_cycle_is_the_schedule_of_reference_1b():
    """Two levels, FCF, no skip, one cycle: F C F, residual, restrict, coarse solve,
    correct, residual norm, the final F-relaxation and the handshake."""
    h = mgrit.build_hierarchy(np.linspace(0, 1, 9), cf=2, max_levels=2, relax="FCF")
    ops = Recorder()
    run(ops, h, Options(skip=False, max_iter=1, tol=None), lambda k, r: False)
    assert ops.log == [("f_relax", 0), ("c_relax", 0), ("f_relax", 0), ("c_residual", 0), ("restrict", 0),
                       ("sequential_solve", 1), ("correct", 0), ("residual_norm",), ("f_relax", 0), ("finish",)]


class BatchRecorder(Recorder):
    def residual_norms(self, Rs):
        self.log.append(("residual_norms", len(Rs)))
        return [1.0] * len(Rs)

    def residual_norm(self, R):
        self.log.append(("residual_norm",))
        return 1.0


def test_the_final_residual_shares_the_last_cycles_all_reduce():
    """With ``final_residual``, no callback and the residual at XBraid's point, the last cycle's
    norm waits for the final residual: one all-reduce for both, after the final F-relaxation, and
    every cycle still reports its norm. A callback reads the norm at its cycle: two all-reduces."""
    h = mgrit.build_hierarchy(np.linspace(0, 1, 9), cf=2, max_levels=2, relax="FCF")
    for callback, tail in [(None, [("correct", 0), ("f_relax", 0), ("c_residual", 0), ("residual_norms", 2),
                                   ("finish",)]),
                           (lambda info: None, [("correct", 0), ("residual_norm",), ("f_relax", 0),
                                                ("c_residual", 0), ("residual_norm",), ("finish",)])]:
        ops, seen = BatchRecorder(), []
        final = run(ops, h, Options(skip=False, max_iter=3, tol=None, final_residual=True, callback=callback),
                    lambda k, r: seen.append((k, r)))
        assert ops.log[-len(tail):] == tail and seen == [(0, 1.0), (1, 1.0), (2, 1.0)] and final == 1.0
        assert ops.log.count(("residual_norm",)) == (4 if callback else 2)


def test_deferred_norms_equal_the_solve_with_a_callback():
    """The shared all-reduce changes no value: the residual history, the final residual and the
    solution equal those of the same solve with a callback (one all-reduce each)."""
    t = np.linspace(0.0, 4.0, 65)
    kw = dict(cf=2, max_levels=4, relax="FCF", tol=None, max_iter=4, final_residual=True)
    a = mgrit.solve(Dahlquist(-1.0), np.array([1.0, 0.5]), t, **kw)
    b = mgrit.solve(Dahlquist(-1.0), np.array([1.0, 0.5]), t, **kw, callback=lambda info: None)
    assert a.residuals == b.residuals and a.final_residual == b.final_residual and np.array_equal(a.u, b.u)
    assert a.residuals[-1] is not None and a.final_residual > 0


# --------------------------------------------------------------------------- Options
def test_options_are_frozen_and_normalized():
    o = Options(cf=[2, 4], relax=["F", "FCF"], norm="inf", partition=[0, 5])
    assert o.cf == (2, 4) and o.relax == ("F", "FCF") and o.norm == math.inf and o.partition == (0, 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.tol = 1.0
    assert Options(nested=True).skip_first is False and Options().skip_first is True
    assert Options(residual="cycle_end").at_cycle_end


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_levels=True), "max_levels"),
    (dict(min_coarse=0), "min_coarse"),
    (dict(cf=True), "cf"),
    (dict(relax="FC"), "relax"),
    (dict(c_weight=True), "c_weight"),
    (dict(skip="yes"), "skip"),
    (dict(nested=1), "nested"),
    (dict(final_residual=None), "final_residual"),
    (dict(residual="end"), "residual"),
    (dict(norm=3), "norm"),
    (dict(tol=-1.0), "tol"),
    (dict(max_iter=0), "max_iter"),
])
def test_bad_settings_are_rejected_once_by_solve_and_by_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Options(**kwargs)
    with pytest.raises(ValueError, match=match):
        mgrit.solve(Dahlquist(-1.0), np.array(1.0), np.linspace(0, 1, 9), **kwargs)


def test_a_non_callable_callback_is_a_type_error():
    with pytest.raises(TypeError, match="callback"):
        Options(callback=3)
