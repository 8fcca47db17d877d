"""Settings from theory: predicted vs measured convergence, chosen vs default settings.

For each problem, ``mgrit.choose_settings`` (target factor 0.1, one rank, measured
step costs) picks cf, levels, relaxation and C-weight. The script prints, for the
chosen settings and for the solver's defaults (cf 2, up to 30 levels, FCF):

* the predicted residual reduction factor per cycle (``bound`` or ``estimate``,
  docs/tuning.md §4; the defaults' prediction comes from ``mgrit.tune.predict_options``);
* the expected factor: the prediction of the measured factor, from the solve
  simulated on an affine model of the problem (``Settings.expected_factor``,
  docs/tuning.md §7; ``*`` where its last residual is at the rounding level);
* the measured factor: the average reduction per cycle of the level-0 residual,
  ``(r_last / r_first)^(1 / (k - 1))`` over the ``k`` cycles that measured one
  (``mgrit.tune.average_factor``), solving to ``tol=1e-8, tol_type="rel"``,
  and the ratio measured / expected;
* predicted (bound), expected (simulated) and measured cycles;
* the time to that tolerance (median of interleaved repetitions: chosen,
  default, chosen, default, ...) and sequential stepping's time.

Problems: heat (Heat1D, backward Euler), advection-diffusion (periodic, upwind,
backward Euler), Van der Pol (RK4, FAS) and ODE-nets (``ODEPropagator`` over
``Linear -> tanh`` layers, float64): one whose weights vary smoothly with depth,
and one with independent random layers (where the frozen-coefficient prediction
is poor; docs/tuning.md §5).

Run::

    .venv/bin/python benchmarks/tune_settings.py            # the full sizes, 5 repetitions
    .venv/bin/python benchmarks/tune_settings.py --quick    # small sizes, 2 repetitions
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mgrit  # noqa: E402
from mgrit.tune import average_factor, predict_options  # noqa: E402
from propagators import AdvectionDiffusion1D, Heat1D, VanDerPol  # noqa: E402
from _cli import positive_float, positive_int  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small problems, 2 repetitions")
    p.add_argument("--repeat", type=positive_int, default=None, help="timed repetitions (default 5, quick 2)")
    p.add_argument("--target", type=positive_float, default=0.1)
    p.add_argument("--problems", default="heat,advdiff,vdp,odenet,odenet-random")
    a = p.parse_args(argv)
    if a.repeat is None:
        a.repeat = 2 if a.quick else 5
    return a


def odenet(n_layers: int, smooth: bool, width: int = 8, batch: int = 2, T: float = 4.0):
    import torch
    from torch import nn

    from propagators.torch import ODEPropagator

    torch.manual_seed(0)
    dtype = torch.float64
    if smooth:  # weights interpolate linearly between two random layers
        a, b = nn.Linear(width, width).to(dtype), nn.Linear(width, width).to(dtype)
        layers = []
        for k in range(n_layers):
            s = k / max(n_layers - 1, 1)
            lin = nn.Linear(width, width).to(dtype)
            with torch.no_grad():
                lin.weight.copy_((1 - s) * a.weight + s * b.weight)
                lin.bias.copy_((1 - s) * a.bias + s * b.bias)
            layers.append(nn.Sequential(lin, nn.Tanh()))
    else:
        layers = [nn.Sequential(nn.Linear(width, width).to(dtype), nn.Tanh()) for _ in range(n_layers)]
    h = T / n_layers
    u0 = torch.randn(batch, width, dtype=dtype)
    return ODEPropagator(layers, h=h), u0, np.arange(n_layers + 1) * h


def problems(a):
    q = a.quick
    out = {}
    heat = Heat1D(17 if q else 65)
    out["heat"] = (heat, heat.initial(), np.linspace(0.0, 1.0, (256 if q else 4096) + 1))
    ad = AdvectionDiffusion1D(16 if q else 64, c=1.0, nu=0.01)
    out["advdiff"] = (ad, ad.initial(), np.linspace(0.0, 1.0, (256 if q else 2048) + 1))
    out["vdp"] = (VanDerPol(mu=3.0), np.array([2.0, 0.0]), np.linspace(0.0, 10.0, (512 if q else 4096) + 1))
    out["odenet"] = odenet(32 if q else 256, smooth=True)
    out["odenet-random"] = odenet(32 if q else 256, smooth=False)
    return {k: out[k] for k in a.problems.split(",")}


def solve(prop, u0, t, opts):
    """One solve to tol 1e-8 (relative): (seconds, residuals, iterations, status)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        start = time.perf_counter()
        try:
            res = mgrit.solve(prop, u0, t, tol=1e-8, tol_type="rel", max_iter=100, **opts)
        except mgrit.DivergenceError:
            return time.perf_counter() - start, [], None, "NaN/Inf"
        elapsed = time.perf_counter() - start
    r = [x for x in res.residuals if x is not None]
    return elapsed, r, res.iterations, res.status.name.lower()


def measured_factor(r) -> float:
    """``(r_last / r_first)^(1 / (k - 1))`` over the ``k`` measured residuals (``mgrit.tune.average_factor``)."""
    if len(r) < 2:
        return float("nan")
    return average_factor(r)


def sequential_seconds(prop, u0, t, repeat):
    ts = []
    for _ in range(repeat):
        start, u = time.perf_counter(), u0
        for a, b in zip(t[:-1].tolist(), t[1:].tolist()):
            u = prop.step(u, a, b)
        ts.append(time.perf_counter() - start)
    return float(np.median(ts))


def fmt_pred(s) -> str:
    c = s.choice
    if not c.stable:
        return "unstable"
    return f"{c.factor:.2e} ({'bound' if s.bound else 'est.'})"


def fmt_expected(s) -> str:
    c = s.choice
    if c.expected is None:
        return "-"
    if not np.isfinite(c.expected):
        return "diverges"
    return f"{c.expected:.2e}" + ("*" if c.expected_floor else "")


def ratio(measured: float, s) -> float:
    e = s.choice.expected
    if e is None or not (np.isfinite(e) and np.isfinite(measured)) or e == 0:
        return float("nan")
    return measured / e


def main(argv=None):
    a = parse(argv)
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:  # pragma: no cover - the ODE-net problems need torch
        a.problems = ",".join(p for p in a.problems.split(",") if not p.startswith("odenet"))
    print(f"target factor {a.target}, 1 rank, measured step costs, tol 1e-8 relative; "
          f"medians of {a.repeat} interleaved repetitions")
    head = (f"{'problem':<14}{'N':>6} {'settings':<30}{'pred. factor':>20}{'exp. factor':>13}{'meas. factor':>14}"
            f"{'meas/exp':>10}{'cycles p/e/m':>14}{'time':>10}{'x seq':>8}")
    print(head)
    print("-" * len(head))
    ratios = []
    for name, (prop, u0, t) in problems(a).items():
        n = len(t) - 1
        start = time.perf_counter()
        try:
            chosen = mgrit.choose_settings(prop, u0, t, target=a.target, ranks=1)
        except ValueError as exc:  # no stable, convergent candidate: report the defaults alone
            chosen, note = None, f"no setting chosen: {str(exc).split(';')[0]}"
        tune_s = time.perf_counter() - start
        default = predict_options(prop, u0, t, target=a.target, ranks=1,
                                  cost=chosen.cost if chosen is not None else None)
        rows = {"default": (default, {})} if chosen is None else {"chosen": (chosen, chosen.options),
                                                                   "default": (default, {})}
        times = {k: [] for k in rows}
        results = {}
        for _ in range(a.repeat):  # interleaved
            for k, (_, opts) in rows.items():
                el, r, it, status = solve(prop, u0, t, opts)
                times[k].append(el)
                results[k] = (r, it, status)
        seq = sequential_seconds(prop, u0, t, a.repeat)
        if chosen is None:
            print(f"{name:<14}{n:>6} {note}")
        for k, (s, _) in rows.items():
            r, it, status = results[k]
            desc = s.choice.describe() if k == "chosen" else "default (" + s.choice.describe() + ")"
            pc = "-" if s.choice.cycles is None else str(s.choice.cycles)
            ec = "-" if s.choice.expected_cycles is None else str(s.choice.expected_cycles)
            mc = "-" if it is None else str(it)
            mf = measured_factor(r)
            q = ratio(mf, s)
            if k == "chosen" and np.isfinite(q):
                ratios.append((name, q, s.choice.expected_floor))
            tm = float(np.median(times[k]))
            ok = status == "converged"
            tcol = f"{tm:9.3f}s" if ok else f"{status:>10}"
            xs = f"{tm / seq:8.2f}" if ok else f"{'-':>8}"
            first = k == "chosen"
            qs = f"{q:10.3f}" if np.isfinite(q) else f"{'-':>10}"
            print(f"{name if first else '':<14}{n if first else '':>6} {desc:<30}"
                  f"{fmt_pred(s):>20}{fmt_expected(s):>13}{mf:>14.2e}{qs}{pc + '/' + ec + '/' + mc:>14}{tcol}{xs}")
        unstable = "" if chosen is None else (f" ({sum(not c.stable for c in chosen.candidates)} of "
                                              f"{len(chosen.candidates)} candidates unstable)")
        print(f"{'':<14}{'':>6} sequential stepping {seq:.3f}s; choose_settings took {tune_s:.2f}s{unstable}")
    if ratios:
        worst = max(ratios, key=lambda x: abs(x[1] - 1.0))
        print(f"chosen settings: measured / expected factor in [{min(q for _, q, _ in ratios):.3f}, "
              f"{max(q for _, q, _ in ratios):.3f}] (worst: {worst[0]}"
              f"{', at the rounding level' if worst[2] else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
