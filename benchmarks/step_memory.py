"""Peak memory of one training step, one process: LayerParallel against the plain autograd loop,
ParallelGRU against torch.nn.GRU.

The peak is the most bytes of torch's CPU tensors alive at once during the step (forward and
backward of ``sum(out**2)``, gradients set to None before), from ``torch.profiler``'s allocation
and free events in time order (``cpu_peak_bytes`` of ``vs_model_parallel.py``), after one warm-up
step; parameters are not counted. float32, one thread, LayerParallel cf 4, 4 levels, 2/1 cycles;
ParallelGRU with its defaults.

Run::

    .venv/bin/python benchmarks/step_memory.py           # N 1024; widths 16, 64; batches 16, 64; GRU L 1024
    .venv/bin/python benchmarks/step_memory.py --quick   # N 64, GRU L 64
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _cli import positive_int, positive_ints  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=positive_int, default=1024)
    p.add_argument("--widths", type=positive_ints, default="16,64")
    p.add_argument("--batches", type=positive_ints, default="16,64")
    p.add_argument("--gru-length", type=positive_int, default=1024)
    p.add_argument("--hidden", type=positive_int, default=32)
    p.add_argument("--gru-batch", type=positive_int, default=16)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.layers, a.widths, a.batches, a.gru_length = 64, "8", "4", 64
    return a


def main(argv=None) -> int:
    import torch
    from torch import nn

    from propagators.torch import LayerParallel, ParallelGRU
    from vs_model_parallel import cpu_peak_bytes

    a = parse(argv)
    torch.set_num_threads(1)

    def peak(module, run):
        def step():
            module.zero_grad(set_to_none=True)
            run().square().sum().backward()

        step()
        return cpu_peak_bytes(step)

    print(f"{'network':<44}{'serial KiB':>12}{'parallel KiB':>14}{'ratio':>8}")
    for w in map(int, a.widths.split(",")):
        for B in map(int, a.batches.split(",")):
            torch.manual_seed(0)
            layers = [nn.Sequential(nn.Linear(w, w), nn.Tanh()) for _ in range(a.layers)]
            x = torch.randn(B, w)
            h = 1.0 / a.layers
            plain = nn.ModuleList(layers)

            def loop():
                u = x
                for f in plain:
                    u = u + h * f(u)
                return u

            lp = LayerParallel(layers, T=1.0, cf=4, max_levels=4, fwd_iters=2, bwd_iters=1)
            s, p = peak(plain, loop), peak(lp, lambda: lp(x))
            print(f"{f'LayerParallel N {a.layers} w {w} B {B}':<44}{s / 1024:>12.0f}{p / 1024:>14.0f}{p / s:>8.2f}")
    torch.manual_seed(0)
    L, H, B, n_in = a.gru_length, a.hidden, a.gru_batch, 12
    x = torch.randn(B, L, n_in)
    ref = nn.GRU(n_in, H, batch_first=True)
    par = ParallelGRU(n_in, H, batch_first=True, return_sequence=False)
    par.load_state_dict(ref.state_dict())
    s, p = peak(ref, lambda: ref(x)[1]), peak(par, lambda: par(x)[1])
    print(f"{f'ParallelGRU L {L} H {H} B {B} (nn.GRU)':<44}{s / 1024:>12.0f}{p / 1024:>14.0f}{p / s:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
