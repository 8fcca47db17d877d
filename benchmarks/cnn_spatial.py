"""Spatial coarsening of a conv ODE-net: iterations, cycle cost and the critical-path model.

A conv ODE-net ``u <- u + h tanh(conv_i(u))`` (stride-1 3 x 3 convolutions with
'same' padding) is solved by LayerParallel with and without spatial coarsening
(``SpatialCoarsening``: coarse time levels on coarser feature maps). For two nets,

* **default**: PyTorch's default initialisation of ``nn.Conv2d``, an input of
  unit normal pixels (layers that hardly damp fine features);
* **diffusive**: heat-like layers, ``conv_i = (a / h)`` x 5-point Laplacian per
  channel plus weak random channel mixing (diffusion number ``a = 0.2`` per
  layer), a small input (0.01 x unit normal, the near-linear regime);

and the settings of the table, the script reports

* ``fwd it`` / ``bwd it``: cycles of the forward and the adjoint solve to a
  residual 1e-6 relative to the first one (``tol_type="rel"``);
* ``fwd ms/cyc`` / ``bwd ms/cyc``: the wall time of one cycle on 1 rank, the
  difference of solves of 3 and 1 cycles over 2 (medians of interleaved
  repetitions, all settings alternating);
* ``grad err``: the largest difference of the input and parameter gradients
  from serial autograd, relative to the largest gradient entry, after solves
  to a relative residual 1e-12 (at most 60 cycles: without spatial
  coarsening the diffusive net's forward residual stops at a round-off floor
  near 2e-9 / 2e-10 (F / FCF), see docs/cnn_spatial.md);
* ``P=..``: the speedup over the measured serial network (forward + backward
  with autograd) that ``mgrit.model.predict`` predicts on P ranks for a
  forward and an adjoint solve of ``fwd it`` / ``bwd it`` cycles, with per-level
  step costs measured on each level's own maps (coarse maps are cheaper; the
  fastest of round-robin repetitions, per map size), plus
  the batched parameter VJPs of each rank's layers; zero message latency, and
  the transfers (restriction, interpolation: local, a few per cent of a cycle,
  printed below the table) are not part of the model;

and, below, the cycles of the diffusive net with every level coarsened for the
choices of coarse operators (rediscretised, Galerkin or fine conv weights,
bilinear or piecewise-constant interpolation).

Everything runs in float64 on one thread.

Run::

    .venv/bin/python benchmarks/cnn_spatial.py            # 64 layers, 8 channels, 32 x 32 maps, batch 8
    .venv/bin/python benchmarks/cnn_spatial.py --quick    # small smoke run
"""
from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mgrit.model import StepCost, predict  # noqa: E402
from propagators.torch import (  # noqa: E402
    AdjointPropagator, LayerParallel, ODENet, ODEPropagator, SpatialCoarsening,
)
from _cli import positive_float, positive_int  # noqa: E402

LAPLACE = torch.tensor([[0.0, 1, 0], [1, -4, 1], [0, 1, 0]], dtype=torch.float64)
RANKS = (8, 16, 32, 64)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=positive_int, default=64)
    p.add_argument("--channels", type=positive_int, default=8)
    p.add_argument("--size", type=positive_int, default=32, help="feature maps are size x size")
    p.add_argument("--batch", type=positive_int, default=8)
    p.add_argument("--cf", type=positive_int, default=4)
    p.add_argument("--levels", type=positive_int, default=3)
    p.add_argument("--tol", type=positive_float, default=1e-6)
    p.add_argument("--repeat", type=positive_int, default=7)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.layers, a.channels, a.size, a.batch, a.cf, a.levels, a.repeat = 16, 3, 8, 2, 2, 3, 1
    return a


def default_layers(a):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Conv2d(a.channels, a.channels, 3, padding=1), nn.Tanh()).double()
            for _ in range(a.layers)]


def diffusive_layers(a, diffusion=0.2):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(a.layers):
        conv = nn.Conv2d(a.channels, a.channels, 3, padding=1).double()
        with torch.no_grad():
            eye = torch.eye(a.channels, dtype=torch.float64)[:, :, None, None]
            conv.weight.copy_(diffusion * a.layers * LAPLACE * eye
                              + 0.1 * torch.randn(a.channels, a.channels, 3, 3, generator=g, dtype=torch.float64))
            conv.bias.copy_(0.1 * torch.randn(a.channels, generator=g, dtype=torch.float64))
        out.append(nn.Sequential(conv, nn.Tanh()))
    return out


def nets(a):
    x = torch.randn(a.batch, a.channels, a.size, a.size, generator=torch.Generator().manual_seed(1),
                    dtype=torch.float64)
    return {"default": (default_layers(a), x), "diffusive": (diffusive_layers(a), 0.01 * x)}


def settings(a):
    """(name, spatial, relax) rows; coarsening every coarse level needs FCF on the layers."""
    return [("none", None, ("F", "FCF")),
            ("none, FCF", None, "FCF"),
            ("coarsest /2", SpatialCoarsening(), ("F", "FCF")),
            ("coarsest /4", SpatialCoarsening(factor=4), ("F", "FCF")),
            ("every level /2, FCF", SpatialCoarsening(coarsen_from=1), "FCF")]


def loss_fn(y):
    return (y**2).sum() + y.sum()


def build(a, layers, spatial, relax, **kw):
    return LayerParallel(copy.deepcopy(layers), T=1.0, cf=a.cf, max_levels=a.levels, relax=relax, spatial=spatial,
                         **kw)


def iterations(a, layers, x, spatial, relax):
    lp = build(a, layers, spatial, relax, fwd_iters=200, bwd_iters=200, fwd_tol=a.tol, bwd_tol=a.tol,
               tol_type="rel")
    loss_fn(lp(x.clone().requires_grad_(True))).backward()
    return lp.last_forward.iterations, lp.last_backward.iterations, lp


def gradient_error(a, layers, x, spatial, relax):
    lp = build(a, layers, spatial, relax, fwd_iters=60, bwd_iters=60, fwd_tol=1e-12, bwd_tol=1e-12,
               tol_type="rel")
    net = ODENet(copy.deepcopy(layers), T=1.0)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    loss_fn(lp(xa)).backward()
    loss_fn(net(xb)).backward()
    got = torch.cat([xa.grad.flatten()] + [p.grad.flatten() for p in lp.parameters()])
    ref = torch.cat([xb.grad.flatten()] + [q.grad.flatten() for q in net.parameters()])
    return float((got - ref).abs().max() / ref.abs().max())


def interleaved(fns, repeat):
    """Median seconds of each function, run in alternation so that machine noise hits all alike."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(repeat):
        for k, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def cycle_runs(a, layers, x, spatial, relax):
    """Four timed runs: forward with 1 / 3 cycles, forward (1) + adjoint with 1 / 3 cycles."""
    lp = build(a, layers, spatial, relax)
    params = list(lp.parameters())

    def fwd(k):
        def run():
            lp.fwd_iters = k
            with torch.no_grad():
                lp(x)
        return run

    def fwd_bwd(k):
        def run():
            lp.fwd_iters, lp.bwd_iters = 1, k
            for p in params:
                p.grad = None
            loss_fn(lp(x.clone().requires_grad_(True))).backward()
        return run

    return [fwd(1), fwd(3), fwd_bwd(1), fwd_bwd(3)]


def level_steps(a, layers, x, spatial, relax, n=8):
    """Per level: the key (map side, coarse?) and timed closures of its forward and adjoint propagators
    (``step`` of one state, ``step_batch`` of 1 and of ``m`` states), on the level's own maps."""
    lp = build(a, layers, spatial, relax)
    prop = ODEPropagator(lp.kernel.bind(), lp.h, layer_index=lp.layer_index)
    N, L = lp.n_layers, len(lp.hierarchy)
    with torch.no_grad():
        props, _ = lp._spatial_forward(prop, x)  # the propagators a forward solve uses
    props = props if isinstance(props, list) else [props] * L
    U = x[None].repeat(n, *([1] * x.dim()))
    states = lambda ia: U.index_select(0, torch.as_tensor(ia % n))  # noqa: E731 - values do not change the cost
    adj = AdjointPropagator(prop, states, N)
    adjs, _ = lp._spatial_adjoint(prop, adj, states)
    adjs = adjs if isinstance(adjs, list) else [adjs] * L
    depths = spatial.depths(L, x.shape[-2:]) if spatial is not None else [0] * L
    levels = []
    for lv, P, A, k in zip(lp.hierarchy, props, adjs, depths):
        m = min(n, lv.n)
        t0 = np.arange(m) * lv.stride * lp.h
        t1 = t0 + lv.stride * lp.h
        V = U[:m, ..., :: 2**k, :: 2**k].contiguous()
        timed = {}
        for kind, pr, a0, a1 in (("fwd", P, t0, t1), ("adj", A, N * lp.h - t1, N * lp.h - t0)):
            timed[kind] = (m, [lambda pr=pr, V=V, a0=a0, a1=a1: pr.step(V[0], a0[0], a1[0]),
                               lambda pr=pr, V=V, a0=a0, a1=a1: pr.step_batch(V[:1], a0[:1], a1[:1]),
                               lambda pr=pr, V=V, a0=a0, a1=a1: pr.step_batch(V, a0, a1)])
        levels.append(((a.size >> k, k > 0), timed))
    return lp, levels


def measure_costs(all_levels, repeat):
    """``{(key, kind): StepCost}``: the fastest of ``repeat`` round-robin runs of every closure."""
    todo = {}
    for levels in all_levels:
        for key, timed in levels:
            for kind, (m, fns) in timed.items():
                todo.setdefault((key, kind), (m, fns))
    best = {k: [math.inf] * 3 for k in todo}
    for r in range(repeat + 1):
        for k, (m, fns) in todo.items():
            for q, fn in enumerate(fns):
                t0 = time.perf_counter()
                fn()
                if r:  # the first round warms up
                    best[k][q] = min(best[k][q], time.perf_counter() - t0)
    out = {}
    for k, (m, _) in todo.items():
        one, b1, bn = best[k]
        per_state = max((bn - b1) / max(m - 1, 1), 0.0)
        out[k] = StepCost(single=one, per_state=per_state, per_call=max(b1 - per_state, 0.0))
    return out


def _best(fn, repeat):
    fn()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def transfer_share(a, x):
    """Restriction + interpolation of the C-points of the fine level, against one fine sweep of them."""
    from propagators.torch import FeatureMapTransfer

    n = a.layers // a.cf
    U = x[None].repeat(n, *([1] * x.dim()))
    tr = FeatureMapTransfer()
    lp = LayerParallel(default_layers(a), T=1.0, cf=a.cf, max_levels=a.levels)
    prop = ODEPropagator(lp.kernel.bind(), lp.h)
    t0 = np.arange(n) * lp.h
    t_tr = _best(lambda: tr.interpolate(tr.restrict(U)), 5)
    t_sw = _best(lambda: prop.step_batch(U, t0, t0 + lp.h), 5)
    return t_tr, t_sw


def serial_time(a, layers, x, repeat):
    net = ODENet(copy.deepcopy(layers), T=1.0)

    def run():
        for p in net.parameters():
            p.grad = None
        loss_fn(net(x.clone().requires_grad_(True))).backward()

    return interleaved([run], repeat)[0]


def main(argv=None):
    a = parse(argv)
    torch.set_num_threads(1)
    rows = []
    runs, where = [], []
    for net_name, (layers, x) in nets(a).items():
        for name, spatial, relax in settings(a):
            it_f, it_b, lp = iterations(a, layers, x, spatial, relax)
            err = gradient_error(a, layers, x, spatial, relax)
            lp_c, levels = level_steps(a, layers, x, spatial, relax)
            rows.append(dict(net=net_name, name=name, spatial=spatial, it_f=it_f, it_b=it_b, err=err, lp=lp_c,
                             levels=levels))
            where.append(len(runs))
            runs += cycle_runs(a, layers, x, spatial, relax)
    times = interleaved(runs, a.repeat)
    costs = measure_costs([row["levels"] for row in rows], 2 * a.repeat)
    for row in rows:
        row["fwd_costs"] = [costs[(key, "fwd")] for key, _ in row["levels"]]
        row["adj_costs"] = [costs[(key, "adj")] for key, _ in row["levels"]]
    serial = {net_name: serial_time(a, layers, x, a.repeat) for net_name, (layers, x) in nets(a).items()}
    t_tr, t_sw = transfer_share(a, nets(a)["default"][1])

    lp0 = rows[0]["lp"]
    print(f"conv ODE-net: {a.layers} layers u <- u + h tanh(conv3x3(u)), {a.channels} channels, "
          f"{a.size} x {a.size} maps, batch {a.batch}; MGRIT cf {a.cf}, {len(lp0.hierarchy)} levels "
          f"({[lv.n for lv in lp0.hierarchy]} intervals), V-cycles, skip; float64, 1 thread; "
          f"iterations to a relative residual {a.tol:g}; medians of {a.repeat} interleaved repetitions")
    head = (f"{'net':<10}{'setting':<22}{'maps per level':<26}{'fwd it':>7}{'bwd it':>7}{'fwd ms/cyc':>11}"
            f"{'bwd ms/cyc':>11}{'grad err':>10}" + "".join(f"{f'P={P}':>8}" for P in RANKS))
    print(head)
    print("-" * len(head))
    for row, k in zip(rows, where):
        f1, f3, b1, b3 = times[k: k + 4]
        sp = row["spatial"]
        L = len(row["lp"].hierarchy)
        depths = sp.depths(L, (a.size, a.size)) if sp is not None else [0] * L
        maps = " ".join(f"{a.size >> d}" for d in depths)
        speed = []
        for P in RANKS:
            t = (predict(row["lp"].hierarchy, P, row["it_f"], skip=True, final_residual=True,
                         cost=row["fwd_costs"]).time
                 + predict(row["lp"].hierarchy, P, row["it_b"], skip=True, final_residual=True,
                           cost=row["adj_costs"]).time
                 + row["adj_costs"][0].batch(math.ceil(a.layers / P)))
            speed.append(serial[row["net"]] / t)
        print(f"{row['net']:<10}{row['name']:<22}{maps:<26}{row['it_f']:>7}{row['it_b']:>7}"
              f"{1e3 * (f3 - f1) / 2:>11.2f}{1e3 * (b3 - b1) / 2:>11.2f}{row['err']:>10.1e}"
              + "".join(f"{s:>8.2f}" for s in speed))
    print()
    print("P=..: predicted speedup of forward + backward over the measured serial network "
          f"(default {1e3 * serial['default']:.1f} ms, diffusive {1e3 * serial['diffusive']:.1f} ms)")
    print("measured step costs per state in a batch (forward / adjoint VJP) on maps of side "
          + ", ".join(f"{key[0]}{' (coarse copies)' if key[1] else ''}: {1e3 * costs[(key, 'fwd')].per_state:.3f} / "
                      f"{1e3 * costs[(key, 'adj')].per_state:.3f} ms"
                      for key in sorted({k for k, kind in costs}, key=lambda k: (-k[0], k[1]))))
    print(f"transfers (restrict + interpolate {a.layers // a.cf} fine C-points): {1e3 * t_tr:.2f} ms, "
          f"one fine sweep of them: {1e3 * t_sw:.2f} ms")
    print()
    print(operator_table(a))
    return 0


def operator_table(a):
    """Iterations of the diffusive net with every coarse level coarsened, per choice of operators."""
    layers, x = nets(a)["diffusive"]
    lines = ["coarse operators (diffusive net, every level /2, FCF): cycles to the same tolerance, fwd / bwd",
             f"{'weights':<14}{'bilinear':>12}{'nearest':>12}"]
    for weights in ("rediscretize", "galerkin", "same"):
        cells = []
        for interpolation in ("bilinear", "nearest"):
            sp = SpatialCoarsening(coarsen_from=1, interpolation=interpolation, weights=weights)
            it_f, it_b, _ = iterations(a, layers, x, sp, "FCF")
            cells.append(f"{it_f} / {it_b}")
        lines.append(f"{weights:<14}" + "".join(f"{c:>12}" for c in cells))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
