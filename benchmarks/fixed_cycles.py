"""How far off the serial network a LayerParallel pass with fixed cycles is, against what its residual says.

With the default 2 forward / 1 adjoint cycles a pass is inexact by design. Its only
measure of that at run time is the residual of what it returns (``lp.forward_residual``,
``lp.backward_residual``). This script compares that residual, relative to the size of
the states at the block's ends, with the true relative errors against serial autograd of
the same network (``lp.to_serial()``, the same input and output gradient):

* ``fwd ratio``: forward residual / |y| (the block's output, Frobenius norm);
* ``out err``: |y - y_serial| / |y_serial|;
* ``adj ratio``: adjoint residual / |dL/dx| (the input gradient, the adjoint solve's output);
* ``dx err`` and ``dW err``: the input gradient's and all parameter gradients' relative errors;
* ``warns``: which solves warned (``ConvergenceWarning``: ``f`` forward, ``a`` adjoint). With fixed
  cycles a pass warns when a ratio reaches ``propagators.torch.module.LARGE_RESIDUAL``
  (forward 0.5, adjoint 0.75), or when a solve's residual did not fall.

Networks: residual layers ``u + h f(u)`` with ``f = tanh(W u + b)`` (PyTorch's default
initialisation, weights optionally scaled) and stiff linear layers ``f(u) = A u + b``,
``A = -a I + noise``, whose coarse steps (``cf**l * h * a``) go unstable while the fine ones are not
(``h * a < 2``), or which damp the state by orders of magnitude (the last two rows: ``a < 0``, growing). Default settings otherwise (cf 4,
3 levels, F / FCF, skip).

Run::

    .venv/bin/python benchmarks/fixed_cycles.py            # 32 networks, a few seconds
    .venv/bin/python benchmarks/fixed_cycles.py --quick    # 4 networks
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from propagators.torch import ConvergenceWarning, LayerParallel  # noqa: E402
from propagators.torch.module import LARGE_RESIDUAL  # noqa: E402

#: (N, width, T, batch, weight scale, dtype) of the tanh networks
DENSE = [(32, 32, 1.0, 64, 1, "f32"), (64, 16, 1.0, 16, 1, "f32"), (64, 16, 4.0, 16, 1, "f32"),
         (256, 16, 4.0, 16, 1, "f32"), (1024, 16, 1.0, 16, 1, "f32"), (1024, 16, 8.0, 16, 1, "f32"),
         (64, 16, 8.0, 16, 2, "f32"), (64, 16, 4.0, 16, 3, "f32"), (256, 16, 8.0, 16, 2, "f32"),
         (128, 8, 16.0, 4, 1, "f32"), (64, 16, 4.0, 16, 5, "f32"), (64, 16, 8.0, 16, 5, "f32"),
         (64, 16, 4.0, 16, 1, "f64"), (256, 32, 2.0, 32, 1, "f64")]
#: (a, noise, T, N) of the stiff linear networks (width 8, batch 4, float64)
STIFF = [(1.0, 0.1, 2.0, 64), (1.0, 0.1, 16.0, 64), (1.0, 1.0, 2.0, 64), (1.0, 1.0, 4.0, 64), (5.0, 0.1, 2.0, 64),
         (5.0, 0.1, 4.0, 64), (5.0, 1.0, 2.0, 64), (5.0, 1.0, 4.0, 64), (20.0, 0.1, 2.0, 64), (20.0, 1.0, 2.0, 64),
         (50.0, 0.1, 2.0, 64), (50.0, 1.0, 2.0, 64), (2.0, 0.3, 8.0, 256), (1.0, 0.1, 16.0, 256),
         (1.0, 0.3, 24.0, 1024), (1.0, 0.1, 8.0, 64), (-1.0, 0.1, 4.0, 64), (-1.5, 0.1, 4.0, 64)]
QUICK_DENSE, QUICK_STIFF = [DENSE[1], DENSE[11]], [STIFF[5], STIFF[12]]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="four networks (a smoke run)")
    return p.parse_args(argv)


def dense(N: int, width: int, scale: float, dtype) -> list:
    torch.manual_seed(0)
    layers = []
    for _ in range(N):
        lin = nn.Linear(width, width)
        with torch.no_grad():
            lin.weight.mul_(scale)
        layers.append(nn.Sequential(lin, nn.Tanh()).to(dtype))
    return layers


def stiff(a: float, noise: float, N: int = 64, width: int = 8) -> list:
    torch.manual_seed(0)
    layers = []
    for _ in range(N):
        lin = nn.Linear(width, width)
        with torch.no_grad():
            lin.weight.copy_(-a * torch.eye(width) + noise * torch.randn(width, width))
        layers.append(lin.double())
    return layers


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def measure(layers: list, T: float, x) -> dict:
    """One pass of the block at its defaults and of its serial network; the ratios and errors above."""
    lp = LayerParallel(layers, T=T)
    x1 = x.clone().requires_grad_(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        y = lp(x1)
        gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype)
        y.backward(gy)
    serial = lp.to_serial()
    x2 = x.clone().requires_grad_(True)
    y2 = serial(x2)
    y2.backward(gy)
    grads = torch.cat([p.grad.reshape(-1).double() for p in lp.parameters()])
    ref = torch.cat([p.grad.reshape(-1).double() for p in serial.parameters()])
    said = [str(w.message) for w in caught if issubclass(w.category, ConvergenceWarning)]
    return dict(
        fwd=lp.forward_residual / float(y.detach().norm()), out=rel(y.detach(), y2.detach()),
        adj=lp.backward_residual / float(x1.grad.norm()), dx=rel(x1.grad, x2.grad),
        dw=rel(grads, ref),
        warns=("f" if any("forward" in m for m in said) else "") + ("a" if any("adjoint" in m for m in said) else ""))


def main(argv=None) -> None:
    a = parse(argv)
    torch.set_num_threads(1)
    dense_rows, stiff_rows = (QUICK_DENSE, QUICK_STIFF) if a.quick else (DENSE, STIFF)
    print(f"LayerParallel at 2 forward / 1 adjoint cycles (cf 4, 3 levels) against serial autograd; "
          f"warning thresholds: forward {LARGE_RESIDUAL['forward']}, adjoint {LARGE_RESIDUAL['adjoint']}")
    head = f"{'fwd ratio':>10}{'out err':>10}{'adj ratio':>10}{'dx err':>10}{'dW err':>10}  warns"
    print(f"\n{'tanh network (N, width, T, batch, weights x, dtype)':<52}{head}")
    for N, width, T, batch, scale, dt in dense_rows:
        dtype = torch.float32 if dt == "f32" else torch.float64
        x = torch.randn(batch, width, generator=torch.Generator().manual_seed(0)).to(dtype)
        r = measure(dense(N, width, scale, dtype), T, x)
        print(f"{f'N {N}, w {width}, T {T:g}, B {batch}, x{scale:g}, {dt}':<52}{r['fwd']:>10.3g}{r['out']:>10.2e}"
              f"{r['adj']:>10.3g}{r['dx']:>10.2e}{r['dw']:>10.2e}  {r['warns'] or '-'}")
    print(f"\n{'stiff linear network (a, noise, T, N; h a, coarsest step a)':<52}{head}")
    for s, noise, T, N in stiff_rows:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        r = measure(stiff(s, noise, N), T, x)
        h = T / N
        print(f"{f'a {s:g}, noise {noise:g}, T {T:g}, N {N}; {h * s:.2f}, {16 * h * s:.1f}':<52}{r['fwd']:>10.3g}"
              f"{r['out']:>10.2e}{r['adj']:>10.3g}{r['dx']:>10.2e}{r['dw']:>10.2e}  {r['warns'] or '-'}")


if __name__ == "__main__":
    main()
