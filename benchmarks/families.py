"""One training step of each network family, serial against layer-parallel on one and two ranks.

What it measures
----------------
For each family, the wall time of one forward + backward pass (``loss.backward()``
of the sum of squares of the output) of the same network, same weights, same batch:

* **gru**: a GRU over a long sequence, ``torch.nn.GRU`` (PyTorch's fused kernel)
  against ``ParallelGRU`` (MGRIT over the sequence positions; ``return_sequence=False``,
  the loss on ``h_n``);
* **lstm** (only with ``--only lstm``): the same with ``torch.nn.LSTM`` (PyTorch's fused
  oneDNN kernel on CPUs) against ``ParallelLSTM``;
* **vit**: the small vision transformer of ``make_vit`` (pre-norm attention + MLP
  blocks on 8 x 8 digit-sized inputs, 4 patch tokens and a class token), the blocks
  run serially (``ODENet``) against ``LayerParallel``;
* **cnn**: the two-stage residual CNN of ``residual_cnn`` on 32 x 32 inputs, serial
  (``to_serial()``) against ``MultiStage`` (both stages ``LayerParallel``).

Under ``mpiexec -n 2`` (the script relaunches itself) every rank runs the serial
network and a one-process layer-parallel network of its own at the same time (every
rank's time a sample), then both ranks run one two-rank layer-parallel network (the
slowest rank's time), then rank 0 runs the serial network and the one-process one alone
while rank 1 waits in a barrier (the strongest baseline, in the same rounds as the
two-rank network), interleaved, medians of ``--repeat``; each family's row is the
median of ``--launches`` launches (fresh processes each) by its 1 -> 2 rank ratio. The
one-process and two-rank networks are built from the same seed; the script prints the
largest difference of their parameter gradients relative to the largest gradient
(float32; the solver's sums are rank-invariant, so it is 0 or rounding), and the
same difference of the one-process layer-parallel gradient from serial autograd's:
the price of the inexact solves (2 forward / 1 backward cycles), not rounding.

MGRIT settings are each family's defaults in this project (2 forward / 1 backward
cycles; cf 4; the levels below), float32, one thread per rank.

Run::

    .venv/bin/python benchmarks/families.py            # about 3 minutes
    .venv/bin/python benchmarks/families.py --quick    # smoke run, small sizes, one launch
    .venv/bin/python benchmarks/families.py --only vit --launches 5
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from layer_parallel import interleaved, median_launch, mpi_results  # noqa: E402
from _cli import positive_int  # noqa: E402

FAMILIES = ("gru", "lstm", "vit", "cnn")
DEFAULT = ("gru", "vit", "cnn")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", choices=FAMILIES, default=list(DEFAULT))
    p.add_argument("--seq", type=positive_int, default=1024, help="GRU and LSTM: sequence length")
    p.add_argument("--hidden", type=positive_int, default=32, help="GRU and LSTM: hidden size")
    p.add_argument("--blocks", type=positive_int, default=64, help="ViT: transformer blocks")
    p.add_argument("--dim", type=positive_int, default=32, help="ViT: model width")
    p.add_argument("--stage", type=positive_int, default=32, help="CNN: residual layers per stage")
    p.add_argument("--channels", type=positive_int, default=4, help="CNN: channels of stage 1 (stage 2: twice)")
    p.add_argument("--batch", type=positive_int, default=16)
    p.add_argument("--repeat", type=positive_int, default=9)
    p.add_argument("--launches", type=positive_int, default=3)
    p.add_argument("--no-onednn", action="store_true",
                   help="torch.backends.mkldnn off: torch's recurrent modules without oneDNN's fused kernels "
                        "(nn.LSTM has one on CPUs, nn.GRU none), to see where nn.LSTM's speed comes from")
    p.add_argument("--quick", action="store_true",
                   help="small sizes, 3 repetitions, one launch (overrides the size options)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for name in ("seq", "hidden", "blocks", "dim", "stage", "channels", "batch", "repeat", "launches"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(a, name)}")
    if a.quick:
        a.seq, a.hidden, a.blocks, a.dim, a.stage, a.channels = 64, 8, 8, 16, 4, 2
        a.batch, a.repeat, a.launches = 4, 3, 1
    return a


def build(family: str, a, comm=None):
    """(network, input, description) of one family; the same weights whatever ``comm``."""
    from propagators.torch import ParallelGRU, ParallelLSTM, make_vit, residual_cnn

    g = torch.Generator().manual_seed(1)
    if family in ("gru", "lstm"):
        torch.manual_seed(0)
        cell = family.upper()
        ref = getattr(torch.nn, cell)(12, a.hidden)
        x = torch.randn(a.seq, a.batch, 12, generator=g)
        if comm == "serial":
            return ref, x, f"{cell}, 12 inputs, hidden {a.hidden}, sequence {a.seq}, batch {a.batch}, 3 levels"
        net = (ParallelGRU if family == "gru" else ParallelLSTM)(12, a.hidden, return_sequence=False, comm=comm)
        net.load_state_dict(ref.state_dict())
        return net, x, None
    if family == "vit":
        x = torch.randn(a.batch, 64, generator=g)
        if comm == "serial":
            net = make_vit(a.blocks, a.dim, 4, seed=0, parallel=False)
            return net, x, f"ViT, {a.blocks} blocks, dim {a.dim}, 4 heads, 5 tokens, batch {a.batch}, 3 levels"
        return make_vit(a.blocks, a.dim, 4, seed=0, cf=4, max_levels=3, comm=comm), x, None
    x = torch.randn(a.batch, 1, 32, 32, generator=g)
    kw = dict(channels=a.channels, n_layers=(a.stage, a.stage), seed=0, cf=4, max_levels=3)
    if comm == "serial":
        return (residual_cnn(**kw).to_serial(), x,
                f"CNN, {a.stage} + {a.stage} layers, {a.channels} / {2 * a.channels} channels, 32 x 32 / "
                f"16 x 16, batch {a.batch}, 3 levels per stage")
    return residual_cnn(comm=comm, **kw), x, None


def output(net, x):
    out = net(x)
    if isinstance(out, tuple):  # a GRU: the last hidden state (an LSTM: its h_n of (h_n, c_n))
        out = out[1][0] if isinstance(out[1], tuple) else out[1]
    return out


def step(net, x):
    params = [p for p in net.parameters() if p.requires_grad]

    def run():
        for p in params:
            p.grad = None
        output(net, x).square().sum().backward()

    return run


def grads(net):
    return {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


def child(a):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    torch.backends.mkldnn.enabled = not a.no_onednn
    result = {}
    for family in a.only:
        serial, x, what = build(family, a, "serial")
        lp1, _, _ = build(family, a, None)
        lp2, _, _ = build(family, a, comm)
        # ... and, in the same rounds, the serial network and the one-process one on rank 0 alone (rank 1 waits
        # in the next barrier): the strongest baseline, side by side with the two-rank network
        t_serial, t_lp1, t_lp2, t_alone, t_lp1_alone = interleaved(
            [step(serial, x), step(lp1, x), step(lp2, x), _on_rank_0(step(serial, x), comm),
             _on_rank_0(step(lp1, x), comm)], a.repeat, barrier=comm, joint=[False, False, True, True, True])
        g1, g2 = grads(lp1), grads(lp2)  # the last run of each: the same weights and input
        scale = max(float(v.abs().max()) for v in g1.values())
        diff = max(float((g2[n] - g1[n]).abs().max()) for n in g1 if n in g2) / scale
        # against serial autograd (the parameters in the same order, with the same shapes and values)
        gs = [p.grad for p in serial.parameters()]
        err = max(float((p.grad - q).abs().max()) for p, q in zip(lp1.parameters(), gs))
        result[family] = {"what": what, "serial": t_serial, "lp1": t_lp1, "lp2": t_lp2, "alone": t_alone,
                          "lp1_alone": t_lp1_alone,
                          "diff": comm.allreduce(diff, op=MPI.MAX),
                          "err": err / max(float(q.abs().max()) for q in gs)}
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps(result))


def _on_rank_0(fn, comm):
    """``fn`` run on rank 0 only (the other ranks return at once and wait in the next barrier)."""
    def run():
        if comm.Get_rank() == 0:
            fn()
    return run


def launch(a) -> list:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    cmd = [str(mpiexec), "-n", "2", sys.executable, "-m", "mpi4py", __file__, "--child", "--only", *a.only]
    cmd += [f"--{k}={getattr(a, k)}" for k in ("seq", "hidden", "blocks", "dim", "stage", "channels", "batch",
                                              "repeat")]
    cmd += ["--no-onednn"] if a.no_onednn else []
    return mpi_results(cmd, a.launches)


def main(argv=None):
    a = parse(argv)
    if a.child:
        return child(a)
    if not (Path(sys.executable).parent / "mpiexec").exists():
        raise SystemExit("mpiexec not found next to this Python: run `make venv` (it installs mpich)")
    runs = launch(a)
    print(f"one training step (forward + backward of sum(output^2)), serial against layer-parallel (2 forward / "
          f"1 backward cycles, cf 4), float32, 1 thread per rank, under mpiexec -n 2; interleaved medians of "
          f"{a.repeat}; each row the median of {len(runs)} launches by its 1 -> 2 rank ratio")
    print(f"{'family':<7}{'serial ms':>11}{'LP 1 process ms':>17}{'LP 2 ranks ms':>15}{'1 proc / serial':>17}"
          f"{'2 ranks / serial':>18}{'1 -> 2 ranks':>14}{'grad diff 2 vs 1':>18}{'grad err':>10}"
          "   launches (1 -> 2)")
    for family in a.only:
        r, rows = median_launch([q[family] for q in runs])
        print(f"{family:<7}{1e3 * r['serial']:>11.2f}{1e3 * r['lp1']:>17.2f}{1e3 * r['lp2']:>15.2f}"
              f"{r['lp1'] / r['serial']:>17.2f}{r['lp2'] / r['serial']:>18.2f}{r['lp1'] / r['lp2']:>13.2f}x"
              f"{r['diff']:>18.1e}{r['err']:>10.1e}   " + " ".join(f"{q['lp1'] / q['lp2']:.2f}" for q in rows))
    print("\nalone (rank 0 runs it while rank 1 waits in a barrier; in the same interleaved rounds as the table "
          "above, whose 2-rank time the last column divides by it)")
    print(f"{'family':<7}{'serial ms':>11}{'LP 1 process ms':>17}{'1 proc / serial':>17}{'2 ranks / serial':>18}")
    for family in a.only:
        r, _ = median_launch([q[family] for q in runs])
        print(f"{family:<7}{1e3 * r['alone']:>11.2f}{1e3 * r['lp1_alone']:>17.2f}{r['lp1_alone'] / r['alone']:>17.2f}"
              f"{r['lp2'] / r['alone']:>18.2f}")
    print()
    for family in a.only:
        print(f"{family}: {runs[0][family]['what']}")
    print("grad diff 2 vs 1 = max |g(2 ranks) - g(1 process)| / max |g(1 process)|; grad err = the same of the "
          "1-process layer-parallel gradient against serial autograd's (the inexact solves at 2/1 cycles)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
