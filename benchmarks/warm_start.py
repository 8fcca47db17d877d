"""Skip and warm start over a training run: forward error and residual per step.

Trains the demo's network (``Linear(64, w) -> tanh -> LayerParallel(N layers) ->
Linear(w, 10)`` on scikit-learn's digits, Adam, 2 forward / 1 backward cycles)
from the same initial weights and batch order with four LayerParallel settings:
skip on / off (XBraid's and TorchBraid's skip of the first down-cycle) and warm
start on / off (each forward solve starts from the previous forward trajectory;
such solves do not skip). At every step it records the residual of the returned
forward trajectory and the relative error of the block's output against the
serial network with the same weights, and prints medians over the run, the
fine-level propagator calls per forward solve and the test accuracy.

Run::

    .venv/bin/python benchmarks/warm_start.py            # 32 layers, width 32, 5 epochs
    .venv/bin/python benchmarks/warm_start.py --quick    # 1 epoch
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from propagators.data import load_digits  # noqa: E402
from propagators.torch import LayerParallel  # noqa: E402
from _cli import positive_float, positive_int  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=positive_int, default=32)
    p.add_argument("--width", type=positive_int, default=32)
    p.add_argument("--T", type=positive_float, default=2.0)
    p.add_argument("--epochs", type=positive_int, default=5)
    p.add_argument("--batch", type=positive_int, default=64)
    p.add_argument("--cf", type=positive_int, default=4)
    p.add_argument("--levels", type=positive_int, default=3)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.epochs = 1
    return a


def run(a, data, skip, warm):
    X, y, Xt, yt = data
    torch.manual_seed(0)
    opening = nn.Sequential(nn.Linear(64, a.width), nn.Tanh())
    layers = [nn.Sequential(nn.Linear(a.width, a.width), nn.Tanh()) for _ in range(a.layers)]
    closing = nn.Linear(a.width, 10)
    lp = LayerParallel(copy.deepcopy(layers), T=a.T, cf=a.cf, max_levels=a.levels, skip=skip, warm_start=warm)
    model = nn.Sequential(opening, lp, closing)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    res, err, calls = [], [], []
    t0 = time.perf_counter()
    for _ in range(a.epochs):
        perm = torch.randperm(len(X), generator=gen)
        for b in range(0, len(X) - a.batch + 1, a.batch):  # full batches: one shape, warm start applies
            idx = perm[b: b + a.batch]
            opt.zero_grad()
            h = opening(X[idx])
            out = lp(h)
            nn.functional.cross_entropy(closing(out), y[idx]).backward()
            opt.step()
            with torch.no_grad():
                ref = lp.serial(h.detach())
                err.append(float((out.detach() - ref).norm() / ref.norm()))
            res.append(lp.forward_residual)
            calls.append(lp.last_forward.counts[0])
    elapsed = time.perf_counter() - t0
    with torch.no_grad():
        acc = float((model(Xt).argmax(1) == yt).float().mean())
    return dict(res=np.median(res), err=np.median(err), err_last=np.median(err[-10:]), calls=np.median(calls),
                acc=acc, time=elapsed)


def main(argv=None):
    a = parse(argv)
    torch.set_num_threads(1)
    data = tuple(torch.from_numpy(v) for v in load_digits(seed=0))
    print(f"digits, {a.layers} layers of width {a.width}, T {a.T}, cf {a.cf}, {a.levels} levels, "
          f"2 forward / 1 backward cycles, {a.epochs} epochs, batch {a.batch}")
    print(f"{'skip':>5}{'warm':>6}{'fwd residual':>14}{'output error':>14}{'(last 10)':>11}"
          f"{'fine calls':>12}{'test acc':>10}{'time':>8}")
    for skip, warm in ((True, False), (False, False), (True, True), (False, True)):
        r = run(a, data, skip, warm)
        print(f"{'on' if skip else 'off':>5}{'on' if warm else 'off':>6}{r['res']:>14.3e}{r['err']:>14.3e}"
              f"{r['err_last']:>11.2e}{r['calls']:>12.0f}{100 * r['acc']:>9.2f}%{r['time']:>7.1f}s")
    print("medians over all steps; output error = |LayerParallel - serial| / |serial| of the block's output")
    return 0


if __name__ == "__main__":
    sys.exit(main())
