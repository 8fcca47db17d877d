"""Training a GRU (or LSTM) classifier with the sequence recursion solved by MGRIT, against torch.nn.GRU.

Data: a multivariate time-series classification set shipped inside the ``aeon``
package (JapaneseVowels by default: 12 channels, 9 speakers, 270 train / 370
test utterances of length 7 to 29, padded with each series' last value to 29;
or BasicMotions), read with ``propagators.timeseries`` and standardised per
channel with the training statistics.

Model: a GRU and a linear classifier on its last hidden state. The serial model
uses ``torch.nn.GRU``; the layer-parallel one ``propagators.torch.ParallelGRU``
(forward and adjoint recursions over the sequence solved by MGRIT with a few
cycles; ``return_sequence=False``), started from the same weights, with the same
optimizer, batches and epochs per seed. Test accuracy is measured in eval mode
(``ParallelGRU`` then steps through the positions exactly, so the difference is
due to training with inexact solves only). Prints one table: test accuracy of
each (mean over seeds), the difference in points, training time, and the mean
MGRIT cycles and final residuals per solve, plus the relative gradient error of
the first step.

Run::

    .venv/bin/python benchmarks/gru_timeseries.py                 # JapaneseVowels, 3 seeds
    .venv/bin/python benchmarks/gru_timeseries.py --quick         # a few seconds
    .venv/bin/python benchmarks/gru_timeseries.py --dataset BasicMotions --epochs 80
    .venv/bin/python benchmarks/gru_timeseries.py --bidirectional --layers 2 --dropout 0.2
    .venv/bin/python benchmarks/gru_timeseries.py --cell lstm    # ParallelLSTM against nn.LSTM
    .venv/bin/python benchmarks/gru_timeseries.py --packed       # each series at its own length

With ``--packed`` both models read each batch as a ``PackedSequence`` of the series at
their own lengths (``nn.utils.rnn.pack_padded_sequence``), so the last hidden state is
the one at each series' end, not after repeating its last value up to the longest.

With ``--bidirectional`` the classifier reads both directions' last hidden states
of the last layer; with ``--dropout`` (and ``--layers`` 2 or more) both models drop
between layers in training, each with its own masks, and the gradient error and the
hidden-state error are measured with dropout off (the same function on both sides).
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from propagators.timeseries import load_aeon_dataset  # noqa: E402
from propagators.torch import ParallelGRU, ParallelLSTM  # noqa: E402
from _cli import nonnegative_int, positive_float, positive_int  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="JapaneseVowels", help="an aeon data set: JapaneseVowels or BasicMotions")
    p.add_argument("--hidden", type=positive_int, default=64)
    p.add_argument("--epochs", type=positive_int, default=60)
    p.add_argument("--batch", type=positive_int, default=32)
    p.add_argument("--lr", type=positive_float, default=3e-3)
    p.add_argument("--seeds", type=positive_int, default=3)
    p.add_argument("--cf", type=positive_int, default=4)
    p.add_argument("--max-levels", type=positive_int, default=3)
    p.add_argument("--relax", default="F,FCF", help="per level, comma separated (last repeats)")
    p.add_argument("--coarse", default="frozen", choices=["frozen", "inject"])
    p.add_argument("--fwd-iters", type=nonnegative_int, default=2)
    p.add_argument("--bwd-iters", type=nonnegative_int, default=1)
    p.add_argument("--cell", choices=["gru", "lstm"], default="gru",
                   help="the recurrent cell: nn.GRU against ParallelGRU, or nn.LSTM against ParallelLSTM")
    p.add_argument("--layers", type=positive_int, default=1, help="recurrent layers")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout between layers (as nn.GRU's)")
    p.add_argument("--bidirectional", action="store_true")
    p.add_argument("--packed", action="store_true",
                   help="batches as PackedSequences of each series at its own length (default: padded with "
                        "each series' last value)")
    p.add_argument("--quick", action="store_true", help="a tiny run (a few seconds)")
    p.add_argument("--json", type=Path, help="also write the curves and the table here")
    a = p.parse_args(argv)
    if a.quick:
        a.hidden, a.epochs, a.seeds = 16, 3, 1
    a.relax = tuple(a.relax.split(","))
    return a


def stratified(y: np.ndarray, n: int | None, seed: int = 0) -> np.ndarray:
    """Indices of ``n`` cases (all for None) taken from the classes in turn, each class in a seeded random
    order (the files are sorted by class: their first 64 cases held 3 of JapaneseVowels' 9 speakers)."""
    if n is None:
        return np.arange(len(y))
    rng = np.random.default_rng(seed)
    groups = [rng.permutation(np.flatnonzero(y == c)) for c in np.unique(y)]
    order = [i for turn in itertools.zip_longest(*groups) for i in turn if i is not None]
    return np.sort(np.array(order[:n], dtype=np.int64))


def load(name: str, quick: bool):
    train = load_aeon_dataset(name, "train")
    if train.y is None or train.y.dtype.kind != "i" or train.n_classes < 2:
        raise SystemExit(f"{name} is not a classification set with two classes or more (its labels: "
                         f"{'none' if train.y is None else train.y.dtype}, {train.n_classes} classes); this "
                         "benchmark trains a classifier: pick one such as JapaneseVowels or BasicMotions")
    test = load_aeon_dataset(name, "test", classes=train.classes)  # both splits numbered alike
    T = max(train.X.shape[2], test.X.shape[2])
    train = load_aeon_dataset(name, "train", length=T)
    test = load_aeon_dataset(name, "test", length=T, classes=train.classes)
    mean = train.X.mean(axis=(0, 2), keepdims=True)
    std = train.X.std(axis=(0, 2), keepdims=True) + 1e-8

    def tensors(ds, n=None):
        keep = stratified(ds.y, n)
        X = torch.as_tensor(((ds.X[keep] - mean) / std).transpose(0, 2, 1), dtype=torch.float32)  # (n, L, C)
        return X.contiguous(), torch.as_tensor(ds.y[keep]), torch.as_tensor(ds.lengths[keep])

    n_tr, n_te = (64, 64) if quick else (None, None)
    return tensors(train, n_tr), tensors(test, n_te), train.n_classes, T


def features(rnn, X, lengths=None):
    """The classifier's input: the last layer's last hidden state (both directions' when bidirectional); with
    ``lengths``, of the batch packed at those lengths."""
    if lengths is not None:
        X = nn.utils.rnn.pack_padded_sequence(X, lengths, batch_first=True, enforce_sorted=False)
    h_n = rnn(X)[1]
    h_n = h_n[0] if isinstance(h_n, tuple) else h_n  # (an LSTM's (h_n, c_n))
    return torch.cat(list(h_n[-2:]), dim=-1) if rnn.bidirectional else h_n[-1]


def make_parallel(gru0, a, dropout=None):
    """The ParallelGRU (ParallelLSTM for an nn.LSTM) of the run's settings with gru0's weights."""
    cls = ParallelLSTM if isinstance(gru0, nn.LSTM) else ParallelGRU
    rnn = cls(gru0.input_size, gru0.hidden_size, num_layers=gru0.num_layers, batch_first=True,
              dropout=gru0.dropout if dropout is None else dropout, bidirectional=gru0.bidirectional,
              cf=a.cf, max_levels=a.max_levels, relax=a.relax, coarse=a.coarse, fwd_iters=a.fwd_iters,
              bwd_iters=a.bwd_iters, return_sequence=False)
    rnn.load_state_dict(gru0.state_dict())
    return rnn


def accuracy(rnn, head, X, y, lengths=None) -> float:
    rnn.eval()
    with torch.no_grad():
        pred = head(features(rnn, X, lengths)).argmax(1)
    rnn.train()
    return 100.0 * float((pred == y).double().mean())


def train_one(kind, gru0, head0, data, a, seed):
    (Xtr, ytr, ltr), (Xte, yte, lte) = data[0], data[1]
    if not a.packed:
        ltr = lte = None
    rnn = copy.deepcopy(gru0) if kind == "serial" else make_parallel(gru0, a)
    head = copy.deepcopy(head0)
    opt = torch.optim.Adam(list(rnn.parameters()) + list(head.parameters()), lr=a.lr)
    gen = torch.Generator().manual_seed(seed)
    curve, losses, fwd_res, bwd_res, fwd_its, bwd_its = [], [], [], [], [], []
    t_train = 0.0
    for epoch in range(a.epochs):
        perm = torch.randperm(len(ytr), generator=gen)
        t0 = time.perf_counter()
        for k in range(0, len(perm), a.batch):
            idx = perm[k:k + a.batch]
            opt.zero_grad()
            loss = F.cross_entropy(head(features(rnn, Xtr[idx], None if ltr is None else ltr[idx])), ytr[idx])
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if kind != "serial":
                fwd_res.append(rnn.forward_residual)
                bwd_res.append(rnn.backward_residual)
                fwd_its.append(rnn.last_forward[0].iterations)
                bwd_its.append(rnn.last_backward[0].iterations)
        t_train += time.perf_counter() - t0
        curve.append(accuracy(rnn, head, Xte, yte, lte))
    h_err = None
    if kind != "serial":  # how far the training-mode solve is from the exact recursion, after training
        p, rnn.dropout = rnn.dropout, 0.0  # (no dropout on either side)
        with torch.no_grad():
            approx = features(rnn, Xte, lte)
            rnn.eval()
            exact = features(rnn, Xte, lte)
            rnn.train()
        rnn.dropout = p
        h_err = float((approx - exact).norm() / exact.norm())
    return dict(acc=curve[-1], curve=curve, losses=losses, time=t_train, fwd_res=fwd_res, bwd_res=bwd_res,
                fwd_its=fwd_its, bwd_its=bwd_its, h_err=h_err)


def gradient_error(gru0, head0, data, a) -> float:
    """Relative error (2-norm over all GRU weights) of ParallelGRU's first-batch gradient (no dropout)."""
    Xtr, ytr, ltr = data[0]
    X, y, lengths = Xtr[: a.batch], ytr[: a.batch], ltr[: a.batch] if a.packed else None
    grads = []
    for kind in ("serial", "mgrit"):
        if kind == "serial":
            rnn = copy.deepcopy(gru0)
            rnn.dropout = 0.0
        else:
            rnn = make_parallel(gru0, a, dropout=0.0)
        head = copy.deepcopy(head0)
        F.cross_entropy(head(features(rnn, X, lengths)), y).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in rnn.parameters()]))
    return float((grads[1] - grads[0]).norm() / grads[0].norm())


def main(argv=None):
    a = parse(argv)
    torch.set_num_threads(1)
    data = load(a.dataset, a.quick)
    (Xtr, _, ltr), (Xte, _, _), n_classes, T = data[0], data[1], data[2], data[3]
    model = f"{a.cell.upper()} hidden {a.hidden}, {a.layers} layer(s)" + (", bidirectional" if a.bidirectional else "")
    model += f", dropout {a.dropout}" if a.dropout else ""
    model += (f", packed at the series' lengths ({int(ltr.min())} to {int(ltr.max())})" if a.packed
              else ", padded with each series' last value")
    print(f"{a.dataset}: {len(Xtr)} train / {len(Xte)} test sequences of length {T}, {Xtr.shape[2]} channels, "
          f"{n_classes} classes; {model}, Adam lr {a.lr}, batch {a.batch}, {a.epochs} epochs, {a.seeds} seed(s)")
    print(f"MGRIT: cf {a.cf}, max_levels {a.max_levels}, relax {','.join(a.relax)}, coarse step {a.coarse!r}, "
          f"{a.fwd_iters} forward / {a.bwd_iters} adjoint cycles, float32, 1 rank, 1 thread\n")
    runs = {"serial": [], "mgrit": []}
    grad_errs = []
    for seed in range(a.seeds):
        torch.manual_seed(seed)
        gru0 = getattr(nn, a.cell.upper())(Xtr.shape[2], a.hidden, num_layers=a.layers, batch_first=True,
                                           dropout=a.dropout, bidirectional=a.bidirectional)
        head0 = nn.Linear(a.hidden * (2 if a.bidirectional else 1), n_classes)
        grad_errs.append(gradient_error(gru0, head0, data, a))
        for kind in runs:
            r = train_one(kind, gru0, head0, data, a, seed)
            runs[kind].append(r)
            print(f"seed {seed} {kind:6s}: test accuracy {r['acc']:6.2f} %, training {r['time']:6.1f} s")
    mean = statistics.fmean
    s, m = runs["serial"], runs["mgrit"]
    acc_s, acc_m = mean(r["acc"] for r in s), mean(r["acc"] for r in m)
    t_s, t_m = mean(r["time"] for r in s), mean(r["time"] for r in m)
    its_f = mean(v for r in m for v in r["fwd_its"])
    its_b = mean(v for r in m for v in r["bwd_its"])
    res_f = mean(v for r in m for v in r["fwd_res"])
    res_b = mean(v for r in m for v in r["bwd_res"])
    sd = (lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0)
    print()
    print("| model | test accuracy | training time | cycles fwd / adj | final residual fwd / adj |")
    print("|---|---|---|---|---|")
    cell = a.cell.upper()
    print(f"| nn.{cell} (serial) | {acc_s:.2f} % (sd {sd([r['acc'] for r in s]):.2f}) | {t_s:.1f} s | - | - |")
    print(f"| Parallel{cell} (MGRIT) | {acc_m:.2f} % (sd {sd([r['acc'] for r in m]):.2f}) | {t_m:.1f} s | "
          f"{its_f:.2f} / {its_b:.2f} | {res_f:.2e} / {res_b:.2e} |")
    print(f"| difference | {acc_m - acc_s:+.2f} points | x{t_m / t_s:.2f} | | |")
    print(f"\nrelative gradient error of the first step (mean over seeds): {mean(grad_errs):.2e}")
    print(f"relative error of the last hidden state, training-mode solve against exact stepping, test set, "
          f"after training (mean over seeds): {mean(r['h_err'] for r in m):.2e}")
    diffs = ", ".join(f"{b['acc'] - c['acc']:+.2f}" for b, c in zip(m, s))
    print(f"per-seed differences (points): {diffs}")
    if a.json:
        a.json.write_text(json.dumps(dict(
            args={k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(a).items() if k != "json"},
            serial=s, mgrit=m, grad_errors=grad_errs, acc_serial=acc_s, acc_mgrit=acc_m, time_serial=t_s,
            time_mgrit=t_m, length=T, n_train=len(Xtr), n_test=len(Xte))))


if __name__ == "__main__":
    main()
