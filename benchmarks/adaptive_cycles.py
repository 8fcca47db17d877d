"""Training that manages its own inexactness: adaptive MGRIT cycles against fixed 2/1 cycles and serial.

The digits classifier of the demo, ``Linear(64, w) -> tanh -> [N residual layers] ->
Linear(w, 10)``, trained from the same initial weights, seed, batches and Adam
three (or four) ways:

* ``serial``: the residual layers applied in order (exact gradients);
* ``fixed 2/1``: LayerParallel with 2 forward / 1 adjoint cycles throughout;
* ``adaptive``: LayerParallel starting at 1/1 cycles, with
  ``SerialSwitch(action="adapt")``: every ``--every`` steps it measures the
  gradient error against the exact gradient of the batch and the minibatch
  noise (4 groups), adds a cycle when the error exceeds ``--ratio`` times the
  noise, drops one when it stays below a quarter of that, and goes serial at
  the cycle count where a solve is exact (docs/transformer.md, docs/theory.md);
* ``fixed 1/1`` (shown for the deep net): the cheapest setting, never corrected.

Printed per run: test accuracy, mean forward / adjoint cycles per step, the
relative gradient error of the final setting on a test batch (measured the same
way for every run), wall time, and for the adaptive run its cycle schedule.

Run: ``python benchmarks/adaptive_cycles.py`` (about 3 minutes on 2 cores) or
``--quick``.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch import nn

from propagators.data import load_digits
from propagators.torch import LayerParallel
from propagators.torch.switch import SerialSwitch, Switchable
from _cli import nonnegative_float, nonnegative_int, positive_float, positive_int  # noqa: E402


def build(layers: int, width: int, T: float, fwd: int, bwd: int, seed: int):
    torch.manual_seed(seed)
    opening = nn.Sequential(nn.Linear(64, width), nn.Tanh())
    blocks = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)]
    closing = nn.Linear(width, 10)
    lp = LayerParallel(blocks, T=T, cf=4, max_levels=3, fwd_iters=fwd, bwd_iters=bwd)
    return nn.Sequential(opening, Switchable(lp), closing)


def train(kind: str, args, data, layers: int):
    Xtr, ytr, Xte, yte = data
    fwd, bwd = {"serial": (2, 1), "fixed 2/1": (2, 1), "fixed 1/1": (1, 1), "adaptive": (1, 1)}[kind]
    model = build(layers, args.width, args.T, fwd, bwd, args.seed)
    sw = model[1]
    if kind == "serial":
        sw.mode = "serial"
    ctl = None
    if kind == "adaptive":
        ctl = SerialSwitch(model, nn.functional.cross_entropy, every=args.every, ratio=args.ratio, window=2,
                           action="adapt")
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + 1)
    cycles, t0 = [], time.perf_counter()
    for _ in range(args.epochs):
        perm = torch.randperm(len(ytr), generator=gen)
        for k in range(0, len(perm), args.batch):
            idx = perm[k:k + args.batch]
            opt.zero_grad()
            nn.functional.cross_entropy(model(Xtr[idx]), ytr[idx]).backward()
            cycles.append((sw.lp.fwd_iters, sw.lp.bwd_iters) if sw.mode == "parallel" else (0, 0))
            if ctl is not None:
                ctl.update(Xtr[idx], ytr[idx])
            opt.step()
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        model.eval()
        acc = float((model(Xte).argmax(1) == yte).double().mean())
        model.train()
    # gradient error of the final setting on one test batch, measured as the controller does
    probe = SerialSwitch(model, nn.functional.cross_entropy, every=1, ratio=float("inf"))
    opt.zero_grad()
    xb, yb = Xte[:args.batch], yte[:args.batch]
    nn.functional.cross_entropy(model(xb), yb).backward()
    err = probe.measure(xb, yb)
    schedule = []
    if ctl is not None:
        for rec in ctl.history:
            key = (rec["fwd_iters"], rec["bwd_iters"])
            if not schedule or schedule[-1][1] != key:
                schedule.append((rec["step"], key))
        if ctl.switched_at is not None:
            schedule.append((ctl.switched_at, "serial"))
    par = [c for c in cycles if c != (0, 0)]
    mean = (np.mean([c[0] for c in par]), np.mean([c[1] for c in par])) if par else (0.0, 0.0)
    return dict(kind=kind, acc=acc, cycles=mean, serial_steps=len(cycles) - len(par), steps=len(cycles),
                error=err["error"], noise=err["noise"], seconds=seconds, schedule=schedule)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=positive_int, nargs="+", default=[32, 128])
    p.add_argument("--width", type=positive_int, default=32)
    p.add_argument("--T", type=positive_float, default=2.0)
    p.add_argument("--epochs", type=positive_int, default=10)
    p.add_argument("--batch", type=positive_int, default=64)
    p.add_argument("--lr", type=positive_float, default=3e-3)
    p.add_argument("--every", type=positive_int, default=5)
    p.add_argument("--ratio", type=nonnegative_float, default=0.5, help="the error may be this fraction of the noise")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.epochs, args.every = [16], 1, 3
    torch.set_num_threads(1)
    data = [torch.as_tensor(a) for a in load_digits()]
    for n in args.layers:
        kinds = ["serial", "fixed 2/1", "adaptive"] + (["fixed 1/1"] if n >= 64 else [])
        print(f"\nN = {n} layers, width {args.width}, T = {args.T}, {args.epochs} epochs, batch {args.batch}, "
              f"Adam {args.lr}; adaptive: every {args.every} steps, error <= {args.ratio} x noise")
        print(f"{'run':<11} {'test acc':>9} {'fwd/adj cycles':>15} {'serial steps':>13} "
              f"{'grad err':>9} {'noise':>7} {'time s':>7}")
        for kind in kinds:
            r = train(kind, args, data, n)
            cyc = "-" if kind == "serial" else f"{r['cycles'][0]:.2f} / {r['cycles'][1]:.2f}"
            print(f"{kind:<11} {100 * r['acc']:8.2f}% {cyc:>15} {r['serial_steps']:>6}/{r['steps']:<6} "
                  f"{r['error']:9.3f} {r['noise']:7.3f} {r['seconds']:7.1f}")
            if r["schedule"]:
                print("    schedule (step: fwd/adj cycles): " + ", ".join(
                    f"{s}: {c if isinstance(c, str) else f'{c[0]}/{c[1]}'}" for s, c in r["schedule"]))


if __name__ == "__main__":
    main()
