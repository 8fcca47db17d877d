"""Training with an evaluation between steps: the cost of switching the layers between train() and eval().

Every switch of the layers' training flags makes LayerParallel inspect the layers again at the next pass
(group them into classes, trace the dense ones, check the trace). Since 2026-12-07 it inspects each mode
once and takes that kernel again at later switches, when nothing else about the layers changed. This
script measures, one process, side by side (interleaved repetitions, medians), one "round" of ``--steps``
training steps (forward, backward, SGD) followed by one evaluation pass (``torch.no_grad()``) on
``--eval-batch`` rows:

- ``switch``: ``lp.train()`` before the steps, ``lp.eval()`` before the evaluation (what users write);
- ``switch + refresh``: the same, with ``lp.refresh()`` at each switch, which inspects the layers anew
  as every switch did before (the previous behaviour);
- the serial network (``ODENet`` of the same layers) with the same switches, for scale.

The layers are ``nn.Sequential(nn.Linear(w, w), nn.Tanh())`` (the dense path), N layers, T = 1, cf 4,
4 levels, 2 forward / 1 backward cycles, float32, one thread.

Run::

    .venv/bin/python benchmarks/train_eval.py                  # N 32 and 256, 1 and 10 steps per round
    .venv/bin/python benchmarks/train_eval.py --quick          # N 16, a few repetitions (the smoke test)
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from propagators.torch import LayerParallel, ODENet  # noqa: E402
from _cli import positive_int, positive_ints  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=positive_ints, default="32,256", help="comma-separated depths")
    p.add_argument("--steps", type=positive_ints, default="1,10", help="training steps per round")
    p.add_argument("--width", type=positive_int, default=16)
    p.add_argument("--batch", type=positive_int, default=16)
    p.add_argument("--eval-batch", type=positive_int, default=256)
    p.add_argument("--repeat", type=positive_int, default=9, help="interleaved repetitions (median)")
    p.add_argument("--quick", action="store_true", help="N 16, 1 step per round, 3 repetitions")
    a = p.parse_args(argv)
    if a.quick:
        a.layers, a.steps, a.repeat = "16", "1", 3
    return a


def _round(net, opt, x, y, xe, steps: int, switch: bool, refresh: bool):
    """``steps`` training steps and one evaluation pass; returns the evaluation output."""
    if switch:
        net.train()
        if refresh:
            net.refresh()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = (net(x) - y).square().mean()
        loss.backward()
        opt.step()
    if switch:
        net.eval()
        if refresh:
            net.refresh()
    with torch.no_grad():
        return net(xe)


def measure(n: int, steps: int, a) -> dict:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(a.width, a.width), nn.Tanh()) for _ in range(n)]
    x, y = torch.randn(a.batch, a.width), torch.randn(a.batch, a.width)
    xe = torch.randn(a.eval_batch, a.width)
    opts = dict(T=1.0, cf=4, max_levels=4, fwd_iters=2, bwd_iters=1)
    nets = {"switch": (LayerParallel(copy.deepcopy(layers), **opts), True, False),
            "switch + refresh": (LayerParallel(copy.deepcopy(layers), **opts), True, True),
            "serial ODENet, switch": (ODENet(copy.deepcopy(layers), T=1.0), True, False)}
    runs = {k: (net, torch.optim.SGD(net.parameters(), lr=1e-3), sw, rf) for k, (net, sw, rf) in nets.items()}
    times: dict = {k: [] for k in runs}
    outs = {}
    for rep in range(a.repeat + 1):  # the first round of each is a warm-up
        for k, (net, opt, sw, rf) in runs.items():
            t0 = time.perf_counter()
            outs[k] = _round(net, opt, x, y, xe, steps, sw, rf)
            if rep:
                times[k].append(time.perf_counter() - t0)
    # both LayerParallel runs take the same steps from the same weights with kernels inspected alike: their
    # evaluations are bitwise equal
    if not torch.equal(outs["switch"], outs["switch + refresh"]):
        raise SystemExit("the evaluations with and without refresh() differ")
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None):
    a = parse(argv)
    torch.set_num_threads(1)
    print(f"width {a.width}, batch {a.batch}, eval batch {a.eval_batch}, float32, one thread; "
          f"medians of {a.repeat} interleaved repetitions; time per round (steps + one evaluation)")
    print("| layers | steps per round | switch | switch + refresh (as before) | serial ODENet, switch |"
          " refresh / switch | switch / serial |")
    print("|---|---|---|---|---|---|---|")
    for n in (int(v) for v in a.layers.split(",")):
        for steps in (int(v) for v in a.steps.split(",")):
            t = measure(n, steps, a)
            ms = {k: f"{v * 1e3:.2f} ms" for k, v in t.items()}
            print(f"| {n} | {steps} | {ms['switch']} | {ms['switch + refresh']} | {ms['serial ODENet, switch']} | "
                  f"{t['switch + refresh'] / t['switch']:.3f} | {t['switch'] / t['serial ODENet, switch']:.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()
