"""A small vision transformer trained layer-parallel on the digits, against serial training.

Builds ``make_vit`` (patch embedding -> N pre-norm transformer blocks as one
LayerParallel module -> LayerNorm -> class token -> linear head) and trains it
three times from the same initial weights, batch order and optimizer (Adam,
cosine learning-rate decay):

* **serial**: the blocks applied in order with plain autograd (``Switchable`` in serial mode);
* **layer-parallel**: MGRIT forward and adjoint solves (default 2 / 1 cycles) all along;
* **layer-parallel + switch**: the same, with ``SerialSwitch``: every ``--every``
  steps the relative error of the layer-parallel gradient against the exact one
  is measured; when the mean of the last ``--window`` measurements exceeds
  ``--ratio`` times the mean minibatch noise (or signal, ``--criterion``),
  training continues serially (``--action tighten``: doubles the cycles instead).

The first two runs are measured the same way (never acted on), so all three
pay the same monitoring cost (column "monitor s"). Per epoch it prints the
training loss, the test accuracy, the mean estimated gradient error, noise and
signal of the epoch's measurements and the mode; then one table, and the
steps at which other rules would have switched, replayed on the layer-parallel
run's measurements (``SwitchRule.first_trigger``). "LP err @end" is the
relative error of the layer-parallel gradient (with the cycles the run ended
with) at the final weights on the first training batch, whatever mode the run
ended in.

Run::

    .venv/bin/python benchmarks/transformer_digits.py            # 16 blocks, dim 32, 15 epochs
    .venv/bin/python benchmarks/transformer_digits.py --quick    # 8 blocks, 2 epochs (smoke run)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from propagators.data import load_digits  # noqa: E402
from propagators.torch.switch import SerialSwitch, SwitchRule  # noqa: E402
from propagators.torch.transformer import make_vit  # noqa: E402
from _cli import nonnegative_float, nonnegative_int, positive_float, positive_int  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=positive_int, default=16)
    p.add_argument("--dim", type=positive_int, default=32)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--patch", type=positive_int, default=4, help="patch side (4: 4 patch tokens + a class token)")
    p.add_argument("--form", default="sequential", choices=("sequential", "parallel", "halves"))
    p.add_argument("--init", default="repeat", choices=("repeat", "independent"))
    p.add_argument("--T", type=positive_float, default=1.0, help="final time; the layer step is h = T / layers")
    p.add_argument("--epochs", type=positive_int, default=15)
    p.add_argument("--batch", type=positive_int, default=64)
    p.add_argument("--lr", type=positive_float, default=2e-3)
    p.add_argument("--cf", type=positive_int, default=4)
    p.add_argument("--levels", type=positive_int, default=2)
    p.add_argument("--fwd-iters", type=nonnegative_int, default=2)
    p.add_argument("--bwd-iters", type=nonnegative_int, default=1)
    p.add_argument("--every", type=positive_int, default=5, help="steps between gradient-error measurements")
    p.add_argument("--criterion", default="noise", choices=("noise", "signal"),
                   help="compare the gradient error with the estimated noise or signal")
    p.add_argument("--ratio", type=nonnegative_float, default=1.0, help="switch when error > ratio * noise (or signal)")
    p.add_argument("--window", type=positive_int, default=3, help="measurements averaged per decision")
    p.add_argument("--patience", type=positive_int, default=1)
    p.add_argument("--action", default="serial", choices=("serial", "tighten"))
    p.add_argument("--train-samples", type=nonnegative_int, default=0, help="use only this many training samples (0: all)")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--json", help="also write the logs (per epoch and per step) to this file")
    p.add_argument("--quick", action="store_true", help="8 blocks of width 16, 2 epochs on 512 samples")
    a = p.parse_args(argv)
    if a.quick:
        a.blocks, a.dim, a.epochs, a.train_samples = 8, 16, 2, 512
    return a


def build(a):
    return make_vit(a.blocks, a.dim, a.heads, patch=a.patch, form=a.form, init=a.init, T=a.T, seed=a.seed,
                    cf=a.cf, max_levels=a.levels, fwd_iters=a.fwd_iters, bwd_iters=a.bwd_iters)


def accuracy(model, X, y):
    model.eval()
    with torch.no_grad():
        acc = float((model(X).argmax(1) == y).float().mean())
    model.train()
    return acc


def train(a, data, label, mode, switch):
    X, y, Xt, yt = data
    model = build(a)
    model.blocks.mode = mode
    loss_fn = nn.functional.cross_entropy
    ctl = SerialSwitch(model, loss_fn, every=a.every, criterion=a.criterion,
                       ratio=a.ratio if switch else float("inf"), window=a.window, patience=a.patience,
                       action=a.action)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    n_batches = (len(X) + a.batch - 1) // a.batch
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.epochs * n_batches)
    gen = torch.Generator().manual_seed(a.seed + 1)
    log, steps, monitor, t0 = [], [], 0.0, time.perf_counter()
    for epoch in range(a.epochs):
        perm = torch.randperm(len(X), generator=gen)
        total, recs = 0.0, []
        for b in range(n_batches):
            idx = perm[b * a.batch: (b + 1) * a.batch]
            opt.zero_grad()
            loss = loss_fn(model(X[idx]), y[idx])
            loss.backward()
            tm = time.perf_counter()
            if mode == "parallel":
                rec = ctl.update(X[idx], y[idx])  # without the switch: ratio inf, a measurement only
            else:  # serial: the same measurement (its gradient error is 0: it is the exact gradient)
                rec = ctl.measure(X[idx], y[idx]) if (epoch * n_batches + b) % a.every == 0 else None
            monitor += time.perf_counter() - tm
            if rec is not None:
                recs.append(rec)
            opt.step()
            sched.step()
            total += loss.item() * len(idx)
            lp = model.lp
            parallel_step = model.blocks.mode == "parallel" or rec is not None and rec.get("triggered")
            steps.append(dict(loss=loss.item(), fwd=lp.forward_residual if parallel_step else None,
                              bwd=lp.backward_residual if parallel_step else None))
        acc = accuracy(model, Xt, yt)
        err = statistics.fmean(r["error"] for r in recs) if recs else float("nan")
        noise = statistics.fmean(r["noise"] for r in recs) if recs else float("nan")
        signal = statistics.fmean(r["signal"] for r in recs) if recs else float("nan")
        mode_now = model.blocks.mode
        log.append(dict(epoch=epoch + 1, loss=total / len(X), acc=acc, error=err, noise=noise, signal=signal,
                        mode=mode_now))
        print(f"{label:>23} epoch {epoch + 1:3d}  loss {total / len(X):.4f}  test acc {100 * acc:5.1f}%  "
              f"grad err {err:6.3f}  noise {noise:6.3f}  signal {signal:6.3f}  mode {mode_now}", flush=True)
    elapsed = time.perf_counter() - t0
    cycles = (model.lp.fwd_iters, model.lp.bwd_iters)
    # the layer-parallel gradient error at the final weights, on the first training batch
    model.blocks.mode = "parallel"
    xb, yb = X[: a.batch], y[: a.batch]
    model.zero_grad()
    loss_fn(model(xb), yb).backward()
    end = ctl.measure(xb, yb)
    switch_step = ctl.switched_at if switch else None
    return dict(label=label, acc=log[-1]["acc"], best=max(r["acc"] for r in log), loss=log[-1]["loss"],
                time=elapsed, monitor=monitor, switch=switch_step, end_error=end["error"], end_noise=end["noise"],
                end_signal=end["signal"],
                steps=a.epochs * n_batches, log=log, per_step=steps, history=ctl.history, cycles=cycles)


def main(argv=None) -> int:
    a = parse(argv)
    torch.set_num_threads(1)
    X, y, Xt, yt = (torch.from_numpy(v) for v in load_digits(seed=a.seed))
    if a.train_samples:
        X, y = X[: a.train_samples], y[: a.train_samples]
    data = (X, y, Xt, yt)
    layers = 2 * a.blocks if a.form == "halves" else a.blocks
    print(f"ViT on digits: {a.blocks} blocks ({a.form}, init {a.init}), dim {a.dim}, {a.heads} heads, "
          f"{a.patch}x{a.patch} patches, T {a.T} (h {a.T / layers:g}); {len(X)} train / {len(Xt)} test; "
          f"Adam lr {a.lr}, batch {a.batch}, {a.epochs} epochs; MGRIT cf {a.cf}, {a.levels} levels, "
          f"{a.fwd_iters}/{a.bwd_iters} cycles; switch every {a.every} steps when error > {a.ratio:g} x "
          f"{a.criterion} (mean of {a.window}, {a.patience} in a row), action {a.action}", flush=True)
    runs = [train(a, data, "serial", "serial", False),
            train(a, data, "layer-parallel", "parallel", False),
            train(a, data, "layer-parallel + switch", "parallel", True)]
    print()
    print("| run | test acc | best acc | final loss | time s | monitor s | switch step | LP err @end "
          "| noise @end | signal @end |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        sw = "-" if r["switch"] is None else f"{r['switch']} of {r['steps']}"
        if a.action == "tighten" and r["label"].endswith("switch"):
            sw += " (cycles at the end {}/{})".format(*r["cycles"])
        print(f"| {r['label']} | {100 * r['acc']:.1f}% | {100 * r['best']:.1f}% | {r['loss']:.4f} | {r['time']:.1f} | "
              f"{r['monitor']:.1f} | {sw} | {r['end_error']:.3f} | {r['end_noise']:.3f} | {r['end_signal']:.3f} |")
    gap = 100 * (runs[0]["acc"] - max(runs[1]["acc"], runs[2]["acc"]))
    print(f"\nserial - best layer-parallel test accuracy: {gap:+.1f} points")
    print("\nthe same rule with other settings, replayed on the layer-parallel run's measurements "
          "(the run with that rule is identical up to the step shown):")
    print("| criterion | ratio 1 | ratio 0.75 | ratio 0.5 |")
    print("|---|---|---|---|")
    for crit in ("noise", "signal"):
        cells = []
        for ratio in (1.0, 0.75, 0.5):
            step = SwitchRule(crit, ratio, None, a.window, a.patience).first_trigger(runs[1]["history"])
            cells.append("never" if step is None else f"step {step}")
        print(f"| {crit} | " + " | ".join(cells) + " |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(args=vars(a), runs=runs), fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
