"""XBraid's ``skip`` in training: gradient error against the time of a training step, with and without it.

``skip=True`` (LayerParallel's default, XBraid's too) leaves out the relaxations of the first
cycle's way down: the first coarse solve starts from the injected initial guess. That saves work
in the first cycle of every solve, and with the training default of 2 forward / 1 adjoint cycles
the first cycle is most of the work (the whole adjoint solve). ``skip=False`` relaxes on the way
down in every cycle. This script measures what the choice buys, per network:

* ``ms``: the time of one training step (forward and backward of ``sum(y * w)``, float32, one
  thread), the median of ``--repeat`` repetitions interleaved over all settings of the network;
* ``dW err`` and ``dx err``: the relative errors of all parameter gradients and of the input
  gradient against serial autograd of the same layers (``lp.serial``), float32;
* ``out err``: the output's relative error.

The settings are ``skip`` True / False at 1/1, 2/1, 2/2 and 3/2 forward / adjoint cycles; every
network runs with cf 4, 4 levels (3 below 256 layers) and F / FCF relaxation, LayerParallel's
defaults otherwise. The networks: four of tanh layers ``u + h tanh(W u + b)`` of width 16 (batch
16), and with ``--families`` also 64 pre-norm transformer blocks (``transformer_layers``, dim 32, 4
heads, 17 tokens, batch 8) and 64 convolutional layers ``tanh(conv3x3(u))`` (8 channels, 12 x 12
maps, batch 8). The last lines name, per network, the settings that no other setting beats in both
time and parameter-gradient error (the Pareto front).

Run::

    .venv/bin/python benchmarks/skip_tradeoff.py               # 4 tanh networks, under a minute
    .venv/bin/python benchmarks/skip_tradeoff.py --families    # and a transformer and a conv net
    .venv/bin/python benchmarks/skip_tradeoff.py --quick       # one small network, a smoke run
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _cli import positive_int  # noqa: E402
from propagators.torch import ConvergenceWarning, LayerParallel, transformer_layers  # noqa: E402


def tanh_net(N: int, width: int, T: float, batch: int) -> tuple:
    """(name, layers, T, input shape) of a tanh network u + h tanh(W u + b)."""
    torch.manual_seed(0)
    return (f"N {N}, w {width}, T {T:g}, B {batch}", [nn.Sequential(nn.Linear(width, width), nn.Tanh())
                                                      for _ in range(N)], T, (batch, width))


def transformer_net() -> tuple:
    torch.manual_seed(0)
    return "transformer, 64 blocks, dim 32, T 4", transformer_layers(64, 32, 4), 4.0, (8, 17, 32)


def conv_net() -> tuple:
    torch.manual_seed(0)
    return ("conv, 64 layers, 8 ch, 12 x 12, T 4",
            [nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.Tanh()) for _ in range(64)], 4.0, (8, 8, 12, 12))


NETWORKS = [lambda: tanh_net(1024, 16, 1.0, 16), lambda: tanh_net(1024, 16, 8.0, 16),
            lambda: tanh_net(256, 16, 4.0, 16), lambda: tanh_net(64, 16, 4.0, 16)]
FAMILIES = [transformer_net, conv_net]
QUICK = [lambda: tanh_net(64, 16, 4.0, 16)]
CYCLES = [(1, 1), (2, 1), (2, 2), (3, 2)]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=positive_int, default=9, help="interleaved repetitions of each timing")
    p.add_argument("--quick", action="store_true", help="one small network, 3 repetitions (a smoke run)")
    p.add_argument("--families", action="store_true", help="also a transformer and a convolutional network")
    return p.parse_args(argv)


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def gradients(model, x, w, call=None) -> tuple:
    """(output, input gradient, all parameter gradients) of ``sum(model(x) * w)`` (``call(x)`` in place of
    ``model(x)``: ``lp.serial``, the block's layers one after the other with plain autograd)."""
    model.zero_grad()
    xg = x.clone().requires_grad_(True)
    y = (call or model)(xg)
    (y * w).sum().backward()
    return y.detach(), xg.grad, torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def study(base: list, T: float, shape: tuple, repeat: int) -> list:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    levels = 4 if len(base) >= 256 else 3
    rows = []
    for skip in (True, False):
        for fwd, bwd in CYCLES:
            lp = LayerParallel(copy.deepcopy(base), T=T, cf=4, max_levels=levels, fwd_iters=fwd, bwd_iters=bwd,
                               skip=skip)
            rows.append(dict(skip=skip, fwd=fwd, bwd=bwd, lp=lp, times=[]))
    y_ref, gx_ref, gw_ref = gradients(rows[0]["lp"], x, w, call=rows[0]["lp"].serial)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        for r in rows:
            y, gx, gw = gradients(r["lp"], x, w)
            r.update(out=rel(y, y_ref), dx=rel(gx, gx_ref), dw=rel(gw, gw_ref))
        for _ in range(repeat):
            for r in rows:
                t0 = time.perf_counter()
                gradients(r["lp"], x, w)
                r["times"].append(time.perf_counter() - t0)
    for r in rows:
        r["ms"] = 1e3 * statistics.median(r["times"])
    return rows


def pareto(rows: list) -> list:
    """The rows that no other row beats in both time and parameter-gradient error."""
    return [r for r in rows if not any(o is not r and o["ms"] <= r["ms"] and o["dw"] <= r["dw"]
                                       and (o["ms"] < r["ms"] or o["dw"] < r["dw"]) for o in rows)]


def main(argv=None) -> None:
    a = parse(argv)
    torch.set_num_threads(1)
    nets, repeat = (QUICK, min(a.repeat, 3)) if a.quick else (NETWORKS + (FAMILIES if a.families else []), a.repeat)
    print(f"skip True / False in training: one step (forward + backward), float32, 1 thread, cf 4, F / FCF; "
          f"medians of {repeat} interleaved repetitions; errors relative to serial autograd (lp.serial)")
    print(f"{'network':<38}{'skip':>6}{'cycles':>8}{'ms':>9}{'dW err':>10}{'dx err':>10}{'out err':>10}")
    fronts = []
    for make in nets:
        name, base, T, shape = make()
        rows = study(base, T, shape, repeat)
        for r in rows:
            cycles = f"{r['fwd']}/{r['bwd']}"
            print(f"{name:<38}{str(r['skip']):>6}{cycles:>8}{r['ms']:>9.2f}{r['dw']:>10.3g}{r['dx']:>10.3g}"
                  f"{r['out']:>10.3g}")
        front = sorted(pareto(rows), key=lambda r: r["ms"])
        fronts.append((name, front))
    print("\nPareto front per network (no other setting is both faster and more accurate), fastest first:")
    for name, front in fronts:
        print(f"  {name}: " + ", ".join(f"skip {r['skip']} {r['fwd']}/{r['bwd']} ({r['ms']:.1f} ms, dW {r['dw']:.2g})"
                                         for r in front))


if __name__ == "__main__":
    main()
