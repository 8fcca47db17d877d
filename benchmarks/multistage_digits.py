"""A two-stage residual CNN on 32 x 32 digits: layer-parallel (MultiStage) against serial.

The network (``propagators.torch.residual_cnn``) is ``conv3x3(1 -> C) + tanh ->
stage 1: N residual layers u + h tanh(conv3x3(u)) at C channels, 32 x 32 ->
strided conv3x3 to 2C channels, 16 x 16 -> stage 2: N layers at 2C channels ->
average pool to 4 x 4 -> Linear(32 C, 10)``, on scikit-learn's 8 x 8 digits upscaled
bilinearly to 32 x 32. Both stages are LayerParallel modules (forward and
backward MGRIT) on the same layer communicator; stem, transition and head are
replicated on every rank. The same network from the same initial weights, with
the same batch order and optimizer (Adam), is trained serially (``to_serial()``).
Prints the test accuracy after every epoch and at the end, training times,
and MGRIT statistics: the residual of every step's forward and adjoint solve
per stage, and the relative difference of the layer-parallel output (training
mode, the inexact solve) from the serial network with the same weights.

Run::

    .venv/bin/python benchmarks/multistage_digits.py              # C 4, 16 + 16 layers, 3 epochs
    .venv/bin/python benchmarks/multistage_digits.py --quick      # 1 epoch on 512 images
    .venv/bin/python benchmarks/multistage_digits.py --ranks 2    # stages split over 2 MPI ranks
    .venv/bin/python benchmarks/multistage_digits.py --json out.json   # also write the numbers
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from propagators.demo import world  # noqa: E402
from propagators.torch import load_digits_images, residual_cnn  # noqa: E402
from _cli import nonnegative_int, positive_float, positive_int  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--channels", type=positive_int, default=4, help="channels of stage 1 (stage 2 has twice as many)")
    p.add_argument("--layers", type=positive_int, default=16, help="residual layers per stage")
    p.add_argument("--T", type=positive_float, default=1.0, help="final time of each stage")
    p.add_argument("--transition", choices=("conv", "pool"), default="conv")
    p.add_argument("--head-pool", type=positive_int, default=4, help="the head pools stage 2 to this size")
    p.add_argument("--size", type=positive_int, default=32, help="image size")
    p.add_argument("--epochs", type=positive_int, default=3)
    p.add_argument("--batch", type=positive_int, default=64)
    p.add_argument("--lr", type=positive_float, default=1e-2)
    p.add_argument("--cf", type=positive_int, default=4)
    p.add_argument("--levels", type=positive_int, default=3)
    p.add_argument("--fwd-iters", type=nonnegative_int, default=2)
    p.add_argument("--bwd-iters", type=nonnegative_int, default=1)
    p.add_argument("--train-size", type=nonnegative_int, default=0, help="use the first n training images (0: all)")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--ranks", type=positive_int, default=1, help="relaunch under mpiexec with this many ranks")
    p.add_argument("--json", type=Path, default=None, help="write the numbers to this file (rank 0)")
    p.add_argument("--quick", action="store_true", help="1 epoch on 512 training images (smoke run)")
    a = p.parse_args(argv)
    if a.quick:
        a.epochs, a.train_size = 1, a.train_size or 512
    return a


def accuracy(model, X, y, batch=256):
    was = model.training
    model.eval()  # a MultiStage's stages step their layers exactly in eval mode
    with torch.no_grad():
        right = sum(int((model(X[i: i + batch]).argmax(1) == y[i: i + batch]).sum()) for i in range(0, len(X), batch))
    model.train(was)
    return right / len(X)


def output_difference(par, probe):
    """Relative difference of the layer-parallel output (training mode) from the serial
    network with the same weights, on a probe batch (collective; a number on rank 0)."""
    with torch.no_grad():
        y = par(probe)
        net = par.to_serial(root=0)
        if net is None:
            return None
        ys = net(probe)
        return float((y - ys).abs().max() / ys.abs().max())


def train(model, data, a, label, show, par=None, probe=None):
    X, y, Xt, yt = data
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    gen = torch.Generator().manual_seed(a.seed + 1)
    n_batches = (len(X) + a.batch - 1) // a.batch
    stats = {"loss": [], "acc": [], "time": 0.0, "fwd": [], "bwd": [], "out_diff": []}
    elapsed = 0.0
    for epoch in range(a.epochs):
        perm = torch.randperm(len(X), generator=gen)
        t0 = time.perf_counter()
        for b in range(n_batches):
            idx = perm[b * a.batch: (b + 1) * a.batch]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(X[idx]), y[idx])
            loss.backward()
            opt.step()
            stats["loss"].append(loss.item())
            if par is not None:
                stats["fwd"].append(par.forward_residuals)
                stats["bwd"].append(par.backward_residuals)
        elapsed += time.perf_counter() - t0
        stats["acc"].append(accuracy(model, Xt, yt))
        if par is not None:
            stats["out_diff"].append(output_difference(par, probe))
        if show:
            extra = "" if par is None or stats["out_diff"][-1] is None else \
                f"  output vs serial {stats['out_diff'][-1]:.1e}"
            print(f"{label:>16} epoch {epoch + 1}/{a.epochs}  loss {stats['loss'][-1]:.4f}  "
                  f"test accuracy {100 * stats['acc'][-1]:.2f}%{extra}", flush=True)
    stats["time"] = elapsed
    return stats


def main(argv=None) -> int:
    a = parse(argv)
    if a.ranks > 1 and world()[2] == 1:
        mpiexec = Path(sys.executable).parent / "mpiexec"
        raw = list(argv if argv is not None else sys.argv[1:])
        rest = [x for i, x in enumerate(raw) if not x.startswith("--ranks") and not (i > 0 and raw[i - 1] == "--ranks")]
        cmd = [str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", str(a.ranks), sys.executable, "-m", "mpi4py",
               str(Path(__file__).resolve())] + rest
        return subprocess.call(cmd)
    comm, rank, size = world()
    torch.set_num_threads(1)
    show = rank == 0
    X, y, Xt, yt = load_digits_images(size=a.size, seed=a.seed)
    if a.train_size:
        X, y = X[: a.train_size], y[: a.train_size]
    data = (X, y, Xt, yt)
    opts = dict(channels=a.channels, n_layers=a.layers, transition=a.transition, head_pool=a.head_pool, T=a.T,
                seed=a.seed,
                cf=a.cf, max_levels=a.levels, fwd_iters=a.fwd_iters, bwd_iters=a.bwd_iters)
    par = residual_cnn(comm=comm, **opts)
    serial = residual_cnn(comm=None, **opts).to_serial() if rank == 0 else None  # the same initial weights
    start = par.to_serial(root=0)
    if show:
        sd, ref = start.state_dict(), serial.state_dict()
        assert list(sd) == list(ref) and all(torch.equal(sd[k], ref[k]) for k in sd), "different initial weights"
        lp = par.stages[0]
        print(f"digits {a.size}x{a.size}: {len(X)} training / {len(Xt)} test images; two stages of {a.layers} "
              f"residual conv layers ({a.channels} channels at {a.size}x{a.size}, {2 * a.channels} at "
              f"{a.size // 2}x{a.size // 2}), T = {a.T} each; {size} layer-parallel rank(s)")
        print(f"MGRIT per stage: cf {a.cf}, {len(lp.hierarchy)} levels, relax {lp.options['relax']}, "
              f"{a.fwd_iters} forward / {a.bwd_iters} backward cycles per step; Adam lr {a.lr}, batch {a.batch}, "
              f"{a.epochs} epoch(s)", flush=True)
    torch.manual_seed(a.seed + 2)
    probe = X[: min(64, len(X))]
    s_par = train(par, data, a, "layer-parallel", show, par=par, probe=probe)
    s_ser = train(serial, data, a, "serial", show) if rank == 0 else None
    if not show:
        return 0
    fwd, bwd = np.array(s_par["fwd"], dtype=float), np.array(s_par["bwd"], dtype=float)
    print()
    print(f"{'model':<26}{'test accuracy':>14}{'train time':>12}")
    print(f"{f'layer-parallel ({size} rank' + ('s)' if size > 1 else ')'):<26}{100 * s_par['acc'][-1]:>13.2f}%"
          f"{s_par['time']:>11.1f}s")
    print(f"{'serial':<26}{100 * s_ser['acc'][-1]:>13.2f}%{s_ser['time']:>11.1f}s")
    print(f"accuracy difference: {100 * (s_par['acc'][-1] - s_ser['acc'][-1]):+.2f} percentage points")
    print()
    print("MGRIT residual of the returned solution, over all training steps:")
    print(f"{'stage':<8}{'fwd median':>12}{'fwd max':>12}{'bwd median':>12}{'bwd max':>12}")
    for k in range(fwd.shape[1]):
        print(f"{k + 1:<8}{np.median(fwd[:, k]):>12.2e}{fwd[:, k].max():>12.2e}"
              f"{np.median(bwd[:, k]):>12.2e}{bwd[:, k].max():>12.2e}")
    print("relative difference of the training-mode output from the serial network with the same weights, "
          "per epoch: " + ", ".join(f"{d:.1e}" for d in s_par["out_diff"]))
    for k, s in enumerate(par.stages):
        print(f"last forward solve of stage {k + 1}: residuals "
              + ", ".join("-" if r is None else f"{r:.2e}" for r in s.forward_residuals))
    if a.json is not None:
        a.json.write_text(json.dumps({
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}, "ranks": size,
            "parallel": s_par, "serial": s_ser,
            "last_forward": [list(s.forward_residuals) for s in par.stages],
            "last_backward": [list(s.backward_residuals) for s in par.stages]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
