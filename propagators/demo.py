"""Layer-parallel training demo: an ODE-net classifier on scikit-learn's handwritten digits.

The network is ``Linear(64, w) -> tanh -> [N residual layers] -> Linear(w, 10)``;
the residual block is a :class:`~propagators.torch.LayerParallel` module (forward
and backward MGRIT). The same network, from the same initial weights, is also
trained serially, and both test accuracies are printed with MGRIT statistics.

Run::

    make demo                                  # or: python -m propagators.demo
    python -m propagators.demo --ranks 2       # layers split over 2 MPI ranks
    mpiexec -n 2 python -m propagators.demo    # the same, launched by hand
    python -m propagators.demo --ranks 2 --launcher torchrun   # over torch.distributed (gloo)
    torchrun --standalone --nproc_per_node 2 -m propagators.demo   # the same, launched by hand
"""
from __future__ import annotations

import argparse
import copy
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import mgrit

from .data import load_digits
from .torch import LayerParallel, ODENet


def _at_least(minimum: int):
    """argparse type: an integer >= ``minimum`` (a usage error otherwise, not a traceback from the run)."""
    def parse_int(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return parse_int


def _positive(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


#: the largest seed: torch.manual_seed takes seeds below 2**64, and the demo also uses ``seed + 1``
_MAX_SEED = 2**64 - 2


def _seed(text: str) -> int:
    """argparse type: a whole number from 0 to :data:`_MAX_SEED`."""
    value = _at_least(0)(text)
    if value > _MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be at most {_MAX_SEED}, got {value}")
    return value


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m propagators.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=_at_least(1), default=32, help="residual layers (time steps; default 32)")
    p.add_argument("--width", type=_at_least(1), default=32, help="channels of the residual block (default 32)")
    p.add_argument("--T", type=_positive, default=2.0, help="final time of the ODE (default 2.0)")
    p.add_argument("--epochs", type=_at_least(1), default=None, help="training epochs (default 15; 2 with --quick)")
    p.add_argument("--batch", type=_at_least(1), default=64, help="minibatch size (default 64)")
    p.add_argument("--lr", type=_positive, default=3e-3, help="Adam's learning rate (default 3e-3)")
    p.add_argument("--cf", type=_at_least(2), default=4, help="coarsening factor (>= 2; default 4)")
    p.add_argument("--levels", type=_at_least(1), default=3, help="most time levels (default 3)")
    p.add_argument("--fwd-iters", type=_at_least(1), default=2, help="MGRIT cycles of the forward pass (default 2)")
    p.add_argument("--bwd-iters", type=_at_least(1), default=1, help="MGRIT cycles of the adjoint (default 1)")
    p.add_argument("--seed", type=_seed, default=0,
                   help=f"seed of the weights, the split and the batches (0 to {_MAX_SEED}; default 0)")
    p.add_argument("--ranks", type=_at_least(1), default=1,
                   help="relaunch under the launcher with this many ranks (default 1: this process)")
    p.add_argument("--launcher", choices=("mpiexec", "torchrun"), default="mpiexec",
                   help="engine of --ranks: mpiexec (mpi4py, the default) or torchrun (torch.distributed, gloo)")
    p.add_argument("--quick", action="store_true", help="2 epochs unless --epochs says otherwise (smoke run)")
    args = p.parse_args(argv)
    if args.epochs is None:
        args.epochs = 2 if args.quick else 15
    return args


def world():
    """(communicator or None, rank, size): a gloo process group when launched by torchrun,
    MPI when launched by mpiexec, None otherwise."""
    if "TORCHELASTIC_RUN_ID" in os.environ or {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= set(os.environ):
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("gloo")  # the rendezvous comes from torchrun's environment
            return dist.group.WORLD, dist.get_rank(), dist.get_world_size()
        return None, 0, 1
    if any(k in os.environ for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMI_SIZE")):
        from mpi4py import MPI

        c = MPI.COMM_WORLD
        if c.Get_size() > 1:
            return c, c.Get_rank(), c.Get_size()
    return None, 0, 1


def build(args, comm):
    torch.manual_seed(args.seed)
    opening = nn.Sequential(nn.Linear(64, args.width), nn.Tanh())
    layers = [nn.Sequential(nn.Linear(args.width, args.width), nn.Tanh()) for _ in range(args.layers)]
    closing = nn.Linear(args.width, 10)
    lp = LayerParallel(copy.deepcopy(layers), T=args.T, cf=args.cf, max_levels=args.levels,
                       fwd_iters=args.fwd_iters, bwd_iters=args.bwd_iters, comm=comm)
    parallel = nn.Sequential(copy.deepcopy(opening), lp, copy.deepcopy(closing))
    serial = nn.Sequential(copy.deepcopy(opening), ODENet(copy.deepcopy(layers), T=args.T), copy.deepcopy(closing))
    return parallel, serial, lp


def accuracy(model, X, y):
    with torch.no_grad():
        return float((model(X).argmax(1) == y).float().mean())


def train(model, data, args, label, show, lp=None):
    X, y, Xt, yt = data
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + 1)
    n_batches = (len(X) + args.batch - 1) // args.batch
    stats = {"fwd": [], "bwd": [], "time": 0.0}
    tty = sys.stdout.isatty()
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        perm = torch.randperm(len(X), generator=gen)
        for b in range(n_batches):
            idx = perm[b * args.batch : (b + 1) * args.batch]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(X[idx]), y[idx])
            loss.backward()
            opt.step()
            if lp is not None:
                stats["fwd"].append(lp.forward_residual)
                stats["bwd"].append(lp.backward_residual)
            step = epoch * n_batches + b + 1
            if show and tty and (step * 50 // (args.epochs * n_batches) != (step - 1) * 50 // (args.epochs * n_batches)):
                done = step / (args.epochs * n_batches)
                bar = "#" * int(30 * done)
                print(f"\r{label:>14} [{bar:<30}] {100 * done:5.1f}%  epoch {epoch + 1}/{args.epochs}"
                      f"  loss {loss.item():.4f}", end="", flush=True)
        if show and not tty:  # a log file: one plain line per epoch
            print(f"{label:>14} epoch {epoch + 1}/{args.epochs}  loss {loss.item():.4f}", flush=True)
    stats["time"] = time.perf_counter() - t0
    if show and tty:
        print()
    stats["acc"] = accuracy(model, Xt, yt)
    return stats


def _launcher(beside: Path, name: str, advice: str) -> str:
    """The launcher beside this interpreter, else the one on PATH; SystemExit saying what to do without one."""
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        raise SystemExit(f"--ranks needs `{name}`, which is neither beside {sys.executable} nor on PATH: {advice}")
    return found


def main(argv=None) -> int:
    args = parse(argv)
    if args.ranks > 1 and world()[2] == 1:
        mpiexec = Path(sys.executable).parent / "mpiexec"
        argv = list(argv if argv is not None else sys.argv[1:])
        rest = [x for i, x in enumerate(argv) if not x.startswith(("--ranks", "--launcher"))
                and not (i > 0 and argv[i - 1] in ("--ranks", "--launcher"))]
        if args.launcher == "torchrun":
            torchrun = Path(sys.executable).parent / "torchrun"
            cmd = [_launcher(torchrun, "torchrun", "it comes with torch; or use --launcher mpiexec"),
                   "--standalone", "--nproc_per_node", str(args.ranks), "-m", "propagators.demo"] + rest
            env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
            return subprocess.call(cmd, env=env)
        cmd = [_launcher(mpiexec, "mpiexec", "install MPI, e.g. pip install mpich mpi4py, or use --launcher "
                         "torchrun"), "-n", str(args.ranks), sys.executable, "-m", "mpi4py", "-m", "propagators.demo"]
        return subprocess.call(cmd + rest)
    comm, rank, size = world()
    torch.set_num_threads(1)
    show = rank == 0
    X, y, Xt, yt = (torch.from_numpy(a) for a in load_digits(seed=args.seed))
    data = (X, y, Xt, yt)
    parallel, serial, lp = build(args, comm)
    if show:
        engine = "" if comm is None else (" (torch.distributed, gloo)" if type(comm).__module__.startswith("torch")
                                          else " (MPI)")
        print(f"digits: {len(X)} training / {len(Xt)} test images; {args.layers} residual layers of width "
              f"{args.width}, T = {args.T}; {size} layer-parallel rank(s){engine}")
        levels = len(lp.hierarchy)
        print(f"MGRIT: cf {args.cf}, {levels} level{'s' if levels > 1 else ''}, relax {lp.options['relax']}, "
              f"{args.fwd_iters} forward / {args.bwd_iters} backward iterations per step")
    try:
        s_par = train(parallel, data, args, "layer-parallel", show, lp)
    except (mgrit.DivergenceError, mgrit.RemoteRankError) as exc:  # (settings that diverge: a message, no traceback)
        where = "" if size == 1 else f"rank {rank}: "
        print(f"{where}the layer-parallel training stopped: {exc}", file=sys.stderr)
        return 1
    s_ser = train(serial, data, args, "serial", show)
    if show:
        fwd, bwd = np.array(s_par["fwd"]), np.array(s_par["bwd"])
        res = lp.last_forward
        print()
        print(f"{'model':<16}{'test accuracy':>14}{'train time':>12}")
        print(f"{'layer-parallel':<16}{100 * s_par['acc']:>13.2f}%{s_par['time']:>11.1f}s")
        print(f"{'serial':<16}{100 * s_ser['acc']:>13.2f}%{s_ser['time']:>11.1f}s")
        print(f"accuracy difference: {100 * (s_par['acc'] - s_ser['acc']):+.2f} percentage points")
        print()
        print("MGRIT statistics over all training steps (residual of the returned solution of each solve):")
        print(f"  forward  residual: median {np.median(fwd):.3e}, max {fwd.max():.3e}")
        print(f"  backward residual: median {np.median(bwd):.3e}, max {bwd.max():.3e}")
        print("  last forward solve:")
        print("    " + str(res).replace("\n", "\n    "))
    return 0


if __name__ == "__main__":
    sys.exit(main())
