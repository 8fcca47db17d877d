"""What the MPI scripts of the recurrent modules share (gru_ranks.py, lstm_ranks.py): converged
settings, an absolute comparison, the same random input on every rank, the check that an error
on the last rank reaches every rank, and the checks of packed sequences and of shared weights."""
import torch

from checks import fail, one_rank_fails, rank, size, value_error_everywhere, world  # noqa: F401 - (shared)

TIGHT = dict(fwd_iters=60, bwd_iters=60, fwd_tol=1e-14, bwd_tol=1e-14)
TOL = 1e-10


def same_randn(*shape, requires_grad=False):
    """The same random tensor on every rank (every rank passes the whole sequence)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(11)).requires_grad_(requires_grad)


def check(name, a, b, tol=TOL):
    """Fail unless ``a`` and ``b`` are given and differ by less than ``tol`` everywhere."""
    if a is None or b is None:
        fail(f"{name}: missing ({a is None}, {b is None})")
    err = float((a.detach() - b.detach()).abs().max())
    if not err < tol:
        fail(f"{name}: max difference {err:.3e} >= {tol:.0e}")


def raised_on_every_rank(call, error, text: str, what: str) -> None:
    """``call()`` fails on the last rank with ``error`` (mentioning ``text``) and on every other rank
    with RemoteRankError naming the last rank and carrying ``text``."""
    one_rank_fails(what, call, rank == size - 1, error, text, remote_from=size - 1)


def weights_inputs_and_copies(cls):
    """What every rank must share, and copies: a module built after seeding the ranks differently holds
    rank 0's weights on every rank (and equals torch's module with them); a weight changed on one rank
    raises ValueError on every rank, a NaN in one rank's input its ValueError there and RemoteRankError
    on the others, and so do two outputs whose backward passes run in another order on one rank; a NaN loss on every rank gives NaN gradients on
    every rank, as torch's module does (torch.amp.GradScaler skips such a step), and one on one rank only
    raises everywhere; deepcopy is a clear error on several ranks and works on one (COMM_SELF)."""
    import copy
    import warnings

    from mpi4py import MPI

    L, I, H, B = 9, 3, 4, 2
    torch.manual_seed(900 + rank)  # other weights on every rank before the build
    par = cls(I, H, num_layers=2, comm=MPI.COMM_WORLD, cf=2, **TIGHT)
    mine = torch.cat([p.detach().reshape(-1) for p in par.parameters()])
    if size > 1 and max(float((w - mine).abs().max()) for w in MPI.COMM_WORLD.allgather(mine)) != 0.0:
        fail(f"{cls.__name__} built after different seeds: the ranks hold different weights")
    serial = getattr(par, f"to_{par._cell.lower()}")()
    x = same_randn(L, B, I)
    check(f"{cls.__name__} built after different seeds: output", par(x)[0], serial(x)[0])

    if size > 1:
        with torch.no_grad():
            if rank == size - 1:
                par.weight_hh_l1.mul_(1.001)
            value_error_everywhere(lambda: par(x), "parameter weight_hh_l1", "a weight changed on one rank")
            par.load_state_dict(serial.state_dict())
        if rank == size - 1:  # a parameter more on one rank: named on every rank, not an IndexError
            par.register_parameter("extra", torch.nn.Parameter(torch.zeros(2)))
        value_error_everywhere(lambda: par(x), "the parameters of rank", "a parameter more on one rank")
        if rank == size - 1:
            del par.extra
        # the output sequence gathered on some ranks only: both waited for ever (the gather against the
        # session's end); built so, or set after the build
        for flag in ("return_sequence", "batch_first"):
            value_error_everywhere(lambda: cls(I, H, comm=MPI.COMM_WORLD, **{flag: rank == 0}), f"different {flag}",
                                   f"{cls.__name__} built with {flag} on one rank")
        par.return_sequence = rank == 0
        value_error_everywhere(lambda: par(x), "return_sequence", "return_sequence set on one rank only")
        par.return_sequence = True
        # the input requires grad on one rank only: the backward passes compute different gradients; the
        # error named sequence lengths, modes and settings, not the cause
        y = par(x.clone().requires_grad_(rank == size - 1))[0]
        value_error_everywhere(lambda: y.sum().backward(), "require grad", "the input requiring grad on one rank")
        # two outputs whose backward passes run in another order on the last rank, their output gradients
        # equal (linear losses): the adjoint mixed the two passes' trajectories without a word
        ya, yb = par(x.clone().requires_grad_(True))[0], par((2 * x).requires_grad_(True))[0]
        value_error_everywhere(lambda: [y.sum().backward() for y in ((yb, ya) if rank == size - 1 else (ya, yb))],
                               "different forward passes", "two backward passes in another order on one rank")
        bad = x.clone()
        if rank == size - 1:
            bad[3, 0, 1] = float("nan")
        raised_on_every_rank(lambda: par(bad), ValueError, "contains NaN or Inf", "a NaN in one rank's input")

    xp = x.clone().requires_grad_(True)
    par.zero_grad()
    (par(xp)[0].sum() * float("nan")).backward()
    if torch.isfinite(xp.grad).any() or any(torch.isfinite(p.grad).any() for p in par.parameters()):
        fail(f"{cls.__name__}: a NaN loss on every rank gave finite gradients")
    xp = x.clone().requires_grad_(True)
    with warnings.catch_warnings():  # an Inf loss: NaN gradients, and no numpy warning in the ranks' comparison
        warnings.simplefilter("error")
        (par(xp)[0].sum() * float("inf")).backward()
    if torch.isfinite(xp.grad).any():
        fail(f"{cls.__name__}: an Inf loss on every rank gave finite gradients")
    if size > 1:
        y = par(x.clone().requires_grad_(True))[0]
        value_error_everywhere(lambda: (y.sum() * (float("nan") if rank == size - 1 else 1.0)).backward(),
                                   "differs", "a NaN loss on one rank")
    xp, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    par.zero_grad()
    par(xp)[0].square().sum().backward()
    serial(xs)[0].square().sum().backward()
    check(f"{cls.__name__}: the input gradient after the non-finite losses", xp.grad, xs.grad)

    if size > 1:
        try:
            copy.deepcopy(par)
        except TypeError as exc:
            if "state_dict" not in str(exc):
                fail(f"deepcopy of a {cls.__name__} on several ranks: unexpected TypeError: {exc}")
        else:
            fail(f"deepcopy of a {cls.__name__} on several ranks: no error")
    with torch.device("meta"):  # shape inference on several ranks (meta tensors have no sums to compare)
        lazy = cls(I, H, num_layers=2, comm=MPI.COMM_WORLD, cf=2, **TIGHT)
    y = lazy(torch.empty(L, B, I, device="meta"))[0]
    if y.device.type != "meta" or tuple(y.shape) != (L, B, H):
        fail(f"{cls.__name__} on the meta device: output {y.device} {tuple(y.shape)}")
    one = cls(I, H, comm=MPI.COMM_SELF, cf=2, **TIGHT)
    twin = copy.deepcopy(one)
    check(f"deepcopy of a {cls.__name__} on COMM_SELF", twin(x)[0], one(x)[0], tol=1e-15)


def packed_on_ranks(cls, serial):
    """A PackedSequence (unsorted, ties, a sequence of one position) on every rank: converged, the packed
    output, the final states and the gradients of every sequence, initial state and weight equal torch's
    module ``serial``'s, one- and two-way; other sequence lengths on the last rank (the same padded values)
    make every rank raise, naming the lengths."""
    from torch.nn.utils.rnn import pack_sequence

    lstm = cls.__name__ == "ParallelLSTM"
    for layers, bidirectional in ((1, False), (2, True)):
        D = 2 if bidirectional else 1
        torch.manual_seed(31 + layers)
        ref = serial(3, 4, num_layers=layers, bidirectional=bidirectional)
        par = cls(3, 4, num_layers=layers, bidirectional=bidirectional, comm=world, cf=2, max_levels=3, **TIGHT)
        par.load_state_dict(ref.state_dict())
        seqs = [same_randn(n, 3) for n in (9, 4, 13, 4, 1)]
        h0 = [same_randn(D * layers, 5, 4)] + ([0.5 * same_randn(D * layers, 5, 4)] if lstm else [])
        w = same_randn(sum(len(q) for q in seqs), D * 4)
        got = []
        for m in (ref, par):
            ss = [q.clone().requires_grad_(True) for q in seqs]
            hh = [v.clone().requires_grad_(True) for v in h0]
            o, n = m(pack_sequence(ss, enforce_sorted=False), tuple(hh) if lstm else hh[0])
            n = list(n) if lstm else [n]
            ((o.data * w).sum() + sum(v.square().sum() for v in n)).backward()
            got.append((o, n, ss, hh))
        (o_r, n_r, s_r, h_r), (o, n, s, h) = got
        name = f"{cls.__name__} packed (layers={layers}, bidirectional={bidirectional})"
        if not torch.equal(o.batch_sizes, o_r.batch_sizes) or not torch.equal(o.sorted_indices, o_r.sorted_indices):
            fail(f"{name}: not packed as {serial.__name__} packs it")
        check(f"{name} output", o.data, o_r.data)
        for k, (a, b) in enumerate(zip(n, n_r)):
            check(f"{name} final state {k}", a, b)
        for k, (a, b) in enumerate(zip(s, s_r)):
            check(f"{name} grad of sequence {k}", a.grad, b.grad)
        for k, (a, b) in enumerate(zip(h, h_r)):
            check(f"{name} grad of initial state {k}", a.grad, b.grad)
        for (k, p), q in zip(par.named_parameters(), ref.parameters()):
            check(f"{name} grad {k}", p.grad, q.grad)
    x = same_randn(6, 2, 3)  # zeros past position 4 of the second sequence: the same padded values
    x[4:, 1] = 0.0
    lengths = [6, 4] if rank != size - 1 else [6, 5]
    value_error_everywhere(lambda: par(torch.nn.utils.rnn.pack_padded_sequence(x, lengths)), "sequence lengths",
                           "other sequence lengths on one rank")
