"""A transformer classifier of variable-length time series, its blocks trained layer-parallel, against serial.

Data: JapaneseVowels from the ``aeon`` package (12 channels, 9 speakers, 270 train /
370 test utterances of 7 to 29 time steps), loaded and standardised as
``gru_timeseries.py`` does. Each time step is a token: a linear embedding of its 12
values plus a learned position embedding, then ``--blocks`` pre-norm transformer
blocks (``transformer_layers``, every block starting from the first one's weights, as
``make_vit``'s ``init="repeat"``) with step ``h = T / blocks``, then a LayerNorm, the
mean over the tokens and a linear head (``ClassifierHead(pool="mean")``).

Two ways to batch series of different lengths, both trained in every run:

* **masked**: the layers are built with ``key_padding=True`` and the batch carries
  its padding mask as one state channel (``with_key_padding``): no token attends
  to padding and the head averages over each series' own steps;
* **padded**: every series is padded with its last value to the longest and every
  token is read, as a model without masks must.

Per seed, three trainings from the same weights, batch order and optimizer (Adam):
serial (``ODENet``, plain autograd) and layer-parallel (``LayerParallel``, MGRIT with
``--fwd-iters`` / ``--bwd-iters`` cycles) with masks, and serial without masks.
Test accuracy is measured with the serial network of each run's weights. Prints one
table (mean over seeds), the relative error of the layer-parallel gradient of the
blocks at the initial weights on the first ``--batch`` training series, and the time of
each training (one process, one thread). Position embeddings past the longest training
series (the test set holds one of 29 steps, the training set none above 26) get no
gradient in the masked models and keep their initial values.

Run::

    .venv/bin/python benchmarks/transformer_timeseries.py            # 3 seeds, 40 epochs
    .venv/bin/python benchmarks/transformer_timeseries.py --quick    # a few seconds
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gru_timeseries import load  # noqa: E402
from propagators.torch import LayerParallel, ODENet  # noqa: E402
from propagators.torch.transformer import ClassifierHead, transformer_layers, with_key_padding  # noqa: E402
from _cli import positive_float, positive_int  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=positive_int, default=16)
    p.add_argument("--dim", type=positive_int, default=32)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--T", type=positive_float, default=2.0, help="final time; the layer step is h = T / blocks")
    p.add_argument("--epochs", type=positive_int, default=40)
    p.add_argument("--batch", type=positive_int, default=32)
    p.add_argument("--lr", type=positive_float, default=2e-3)
    p.add_argument("--seeds", type=positive_int, default=3)
    p.add_argument("--cf", type=positive_int, default=4)
    p.add_argument("--max-levels", type=positive_int, default=2)
    p.add_argument("--fwd-iters", type=positive_int, default=2)
    p.add_argument("--bwd-iters", type=positive_int, default=1)
    p.add_argument("--quick", action="store_true", help="a tiny run (a few seconds)")
    a = p.parse_args(argv)
    if a.quick:  # (6 blocks at cf 2: 3 coarse intervals, so that 2 / 1 cycles are not exact)
        a.blocks, a.dim, a.epochs, a.seeds, a.cf = 6, 16, 2, 1, 2
    return a


class SeriesClassifier(nn.Module):
    """Embedding of each time step (plus a position embedding), transformer blocks, mean-pooling head.
    ``masked``: the blocks and the head read the padding channel (``with_key_padding``)."""

    def __init__(self, a, channels: int, length: int, classes: int, masked: bool, parallel: bool):
        super().__init__()
        self.masked = masked
        self.embed = nn.Linear(channels, a.dim)
        self.pos = nn.Parameter(0.02 * torch.randn(1, length, a.dim))
        layers = transformer_layers(a.blocks, a.dim, a.heads, mlp_ratio=2.0, key_padding=masked)
        with torch.no_grad():  # every block starts from the first one's weights (make_vit's init="repeat")
            for layer in layers[1:]:
                layer.load_state_dict(layers[0].state_dict())
        self.blocks = (LayerParallel(layers, T=a.T, cf=a.cf, max_levels=a.max_levels, fwd_iters=a.fwd_iters,
                                     bwd_iters=a.bwd_iters) if parallel else ODENet(layers, T=a.T))
        self.head = ClassifierHead(a.dim, classes, pool="mean", key_padding=masked)

    def forward(self, X, lengths):
        u = self.embed(X) + self.pos[:, :X.shape[1]]
        if self.masked:
            u = with_key_padding(u, torch.arange(X.shape[1]) >= lengths[:, None])
        return self.head(self.blocks(u))

    def serial(self) -> "SeriesClassifier":
        """The same network with serial blocks (a deep copy)."""
        out = copy.deepcopy(self)
        if isinstance(out.blocks, LayerParallel):
            out.blocks = out.blocks.to_serial()
        return out


def accuracy(model, X, y, lengths) -> float:
    net = model.serial().eval()
    with torch.no_grad():
        return 100.0 * float((net(X, lengths).argmax(1) == y).double().mean())


def train(model, data, a, seed):
    (Xtr, ytr, ltr), (Xte, yte, lte) = data[0], data[1]
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    gen = torch.Generator().manual_seed(seed)
    t_train = 0.0
    for _ in range(a.epochs):
        perm = torch.randperm(len(ytr), generator=gen)
        t0 = time.perf_counter()
        for k in range(0, len(perm), a.batch):
            idx = perm[k:k + a.batch]
            opt.zero_grad()
            F.cross_entropy(model(Xtr[idx], ltr[idx]), ytr[idx]).backward()
            opt.step()
        t_train += time.perf_counter() - t0
    return accuracy(model, Xte, yte, lte), t_train


def gradient_error(parallel, data, a) -> float:
    """Relative error (2-norm over the blocks' parameters) of the layer-parallel gradient on the first
    ``a.batch`` training series."""
    Xtr, ytr, ltr = data[0]
    X, y, lengths = Xtr[: a.batch], ytr[: a.batch], ltr[: a.batch]
    grads = []
    for model in (parallel.serial(), copy.deepcopy(parallel)):
        F.cross_entropy(model(X, lengths), y).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.blocks.parameters()]))
    return float((grads[1] - grads[0]).norm() / grads[0].norm())


def main(argv=None):
    a = parse(argv)
    torch.set_num_threads(1)
    data = load("JapaneseVowels", a.quick)
    (Xtr, _, ltr), (Xte, _, _), classes, T = data[0], data[1], data[2], data[3]
    print(f"JapaneseVowels: {len(Xtr)} train / {len(Xte)} test series of {int(ltr.min())} to {int(ltr.max())} steps "
          f"(padded to {T}), "
          f"{Xtr.shape[2]} channels, {classes} classes; {a.blocks} blocks, dim {a.dim}, {a.heads} heads, T {a.T}, "
          f"Adam lr {a.lr}, batch {a.batch}, {a.epochs} epochs, {a.seeds} seed(s)")
    print(f"MGRIT: cf {a.cf}, max_levels {a.max_levels}, {a.fwd_iters} forward / {a.bwd_iters} adjoint cycles, "
          "float32, 1 process, 1 thread\n")
    rows = {"serial, masked": [], "layer-parallel, masked": [], "serial, padded (no masks)": []}
    errs = []
    for seed in range(a.seeds):
        torch.manual_seed(seed)
        masked = SeriesClassifier(a, Xtr.shape[2], T, classes, masked=True, parallel=True)
        torch.manual_seed(seed)
        plain = SeriesClassifier(a, Xtr.shape[2], T, classes, masked=False, parallel=False)
        errs.append(gradient_error(masked, data, a))
        for name, model in zip(rows, (masked.serial(), masked, plain)):
            acc, t = train(model, data, a, seed)
            rows[name].append((acc, t))
            print(f"seed {seed} {name:26s}: test accuracy {acc:6.2f} %, training {t:6.1f} s")
    mean = statistics.fmean
    print("\n| model | test accuracy | training time |")
    print("|---|---|---|")
    for name, runs in rows.items():
        accs = [r[0] for r in runs]
        sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
        print(f"| {name} | {mean(accs):.2f} % (sd {sd:.2f}) | {mean(r[1] for r in runs):.1f} s |")
    print(f"\nrelative gradient error of the blocks, layer-parallel with masks, initial weights, first {a.batch} "
          f"training series (mean over seeds): "
          f"{mean(errs):.2e}")


if __name__ == "__main__":
    main()
