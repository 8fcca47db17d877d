"""ParallelLSTM on several ranks against torch.nn.LSTM (run under mpiexec).

Usage: mpiexec -n P python lstm_ranks.py
Checks (every rank), float64, converged solves: output, h_n, c_n and the gradients of the
input, h0, c0 and every weight equal nn.LSTM's with copied weights to 1e-10, one and two
layers, one- and two-way, batch_first, (h0, c0) given or None, return_sequence=False,
sequences shorter than the number of ranks, over optimizer steps (the weights stay equal on
every rank) and in eval mode; dropout between layers equals the masked stack of one-layer
LSTMs with rank 0's seed although the ranks' random states differ; a PackedSequence equals
nn.LSTM's packed pass (rnn_checks.packed_on_ranks); a bad (h0, c0) on one rank
and a failing adjoint step on one rank make every rank raise (RemoteRankError naming the rank
on the others), after which the module still trains. Prints "rank r OK" on success and exits 1
otherwise.
"""

import torch

from checks import fail, rank, size, world
from rnn_checks import TIGHT, check, packed_on_ranks, raised_on_every_rank, same_randn, weights_inputs_and_copies
from propagators.torch import ParallelLSTM

torch.set_default_dtype(torch.float64)
I, H, B = 3, 4, 2


def case(L, layers, bidirectional, batch_first, with_hx, return_sequence, cf, levels, steps=1):
    torch.manual_seed(2000 + L + 10 * layers)  # the same weights and data on every rank
    D = 2 if bidirectional else 1
    kw = dict(num_layers=layers, batch_first=batch_first, bidirectional=bidirectional)
    ref = torch.nn.LSTM(I, H, **kw)
    par = ParallelLSTM(I, H, **kw, cf=cf, max_levels=levels, return_sequence=return_sequence, comm=world, **TIGHT)
    par.load_state_dict(ref.state_dict())
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
    opt = torch.optim.SGD(par.parameters(), lr=0.1, momentum=0.5)
    x = torch.randn(B, L, I) if batch_first else torch.randn(L, B, I)
    hx = (torch.randn(D * layers, B, H), torch.randn(D * layers, B, H)) if with_hx else None
    wo = torch.randn(B, L, D * H) if batch_first else torch.randn(L, B, D * H)
    wh, wc = torch.randn(D * layers, B, H), torch.randn(D * layers, B, H)
    name = f"L={L} layers={layers} bidirectional={bidirectional} bf={batch_first} hx={with_hx} seq={return_sequence}"
    for step in range(steps):
        xs, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        hs = hp = None
        if with_hx:
            hs = tuple(v.clone().requires_grad_(True) for v in hx)
            hp = tuple(v.clone().requires_grad_(True) for v in hx)
        o_ref, (h_ref, c_ref) = ref(xs, hs)
        o, (h, c) = par(xp, hp)
        loss_ref, loss = (h_ref * wh).sum() + (c_ref * wc).sum(), (h * wh).sum() + (c * wc).sum()
        if return_sequence:
            check(f"{name} step {step} output", o, o_ref)
            loss_ref, loss = loss_ref + (o_ref * wo).sum(), loss + (o * wo).sum()
        elif o is not None:
            fail(f"{name}: output is not None with return_sequence=False")
        check(f"{name} step {step} h_n", h, h_ref)
        check(f"{name} step {step} c_n", c, c_ref)
        opt_ref.zero_grad()
        opt.zero_grad()
        loss_ref.backward()
        loss.backward()
        check(f"{name} step {step} input grad", xp.grad, xs.grad)
        if with_hx:
            check(f"{name} step {step} h0 grad", hp[0].grad, hs[0].grad)
            check(f"{name} step {step} c0 grad", hp[1].grad, hs[1].grad)
        for (k, p), q in zip(par.named_parameters(), ref.parameters()):
            check(f"{name} step {step} grad {k}", p.grad, q.grad)
        opt_ref.step()
        opt.step()
    for k, p in par.named_parameters():
        every = world.allgather(p.detach().numpy())
        if any(float(abs(e - every[0]).max()) != 0.0 for e in every):
            fail(f"{name}: {k} differs between ranks after the optimizer steps")
    par.eval()
    ref.eval()
    with torch.no_grad():
        o, (h, c) = par(x, hx)
        o_ref, (h_ref, c_ref) = ref(x, hx)
    check(f"{name} eval h_n", h, h_ref, 1e-12)
    check(f"{name} eval c_n", c, c_ref, 1e-12)


def dropout_with_rank_0s_seed():
    torch.manual_seed(21)
    par = ParallelLSTM(I, H, num_layers=3, dropout=0.4, bidirectional=True, comm=world, cf=2, **TIGHT)
    x = same_randn(11, B, I)
    xp, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    torch.manual_seed(500 + rank)  # other global random states on every rank
    out, (h, c) = par(xp)
    if len(set(world.allgather(par.last_dropout_seed))) != 1:
        fail("dropout: the seeds differ between ranks")
    masks = par.dropout_masks(par.last_dropout_seed, out)
    inp, cs = xs, []
    for l in range(3):
        g = torch.nn.LSTM(I if l == 0 else 2 * H, H, bidirectional=True)
        g.load_state_dict({k.replace(f"_l{l}", "_l0"): v for k, v in par.state_dict().items()
                           if k.endswith(f"_l{l}") or k.endswith(f"_l{l}_reverse")})
        o, (_, cl) = g(inp)
        cs.append(cl)
        inp = o * masks[l] if l < 2 else o
    check("dropout output", out, inp)
    check("dropout c_n", c, torch.cat(cs))
    (out.square().sum() + c.sum()).backward()
    (inp.square().sum() + torch.cat(cs).sum()).backward()
    check("dropout input grad", xp.grad, xs.grad)


def still_trains(par, what: str) -> None:
    x = same_randn(9, B, I, requires_grad=True)
    y, (h, c) = par(x)
    (y.square().sum() + c.sum()).backward()
    if x.grad is None or not bool(torch.isfinite(x.grad).all()):
        fail(f"{what}: no input gradient afterwards")


def failures_raise_everywhere():
    from propagators.torch import lstm as lstm_module

    par = ParallelLSTM(I, H, comm=world, **TIGHT)
    bad = rank == size - 1
    # a c0 of the wrong shape on the last rank: it raises ValueError, the others RemoteRankError
    hx = (same_randn(1, B, H), same_randn(1, B + (1 if bad else 0), H))
    raised_on_every_rank(lambda: par(same_randn(9, B, I), hx), ValueError, "c0 must have shape", "a bad c0")
    still_trains(par, "after a bad c0")

    def failing(self, *args):
        raise RuntimeError("injected adjoint failure")

    y, _ = par(same_randn(9, B, I, requires_grad=True))
    original = lstm_module.LSTMAdjointPropagator.step_batch
    if bad:
        lstm_module.LSTMAdjointPropagator.step_batch = failing
    try:
        raised_on_every_rank(lambda: y.sum().backward(), RuntimeError, "injected adjoint failure",
                             "a failing adjoint step")
    finally:
        lstm_module.LSTMAdjointPropagator.step_batch = original
    still_trains(par, "after a failing adjoint step")
    # local work of a forward pass that fails on the last rank only: building a layer's propagator, drawing
    # the dropout masks; the others raise RemoteRankError at their next handshake, and all go on alike
    from propagators.torch import rnn as rnn_module

    drop = ParallelLSTM(I, H, num_layers=2, dropout=0.3, comm=world, **TIGHT)
    for what, cls, name in (("a failing propagator set-up", lstm_module.LSTMPropagator, "__init__"),
                            ("failing dropout masks", rnn_module._ParallelRNN, "_masks")):
        original = getattr(cls, name)

        def failing_local(self, *args, **kwargs):
            raise MemoryError(f"injected: {what}")

        if bad:
            setattr(cls, name, failing_local)
        try:
            raised_on_every_rank(lambda: drop(same_randn(9, B, I)), MemoryError, f"injected: {what}", what)
        finally:
            setattr(cls, name, original)
        still_trains(drop, f"after {what}")
    # a c0 that differs between the ranks, and a loss that differs only through c_n: named as such
    x = same_randn(9, B, I)
    c0 = same_randn(1, B, H) * (2.0 if bad else 1.0)
    value_error = "initial state (h0, c0) of rank"
    try:
        par(x, (same_randn(1, B, H), c0))
    except ValueError as exc:
        if value_error not in str(exc):
            fail(f"a c0 that differs: unexpected ValueError: {exc}")
    else:
        fail("a c0 that differs: no error")
    y, (h, c) = par(same_randn(9, B, I, requires_grad=True))
    try:
        (y.sum() + c.sum() * (2.0 if bad else 1.0)).backward()
    except ValueError as exc:
        if "gradient of the final state (h_n, c_n)" not in str(exc):
            fail(f"a loss that differs through c_n: unexpected ValueError: {exc}")
    else:
        fail("a loss that differs through c_n: no error")
    still_trains(par, "after a c0 and a loss that differ")


case(13, 1, False, False, True, True, 2, 3, steps=3)
case(13, 2, True, True, False, True, 4, 2, steps=2)
case(11, 2, False, False, True, False, 2, 4)
case(size - 1 if size > 2 else 1, 1, True, False, True, True, 2, 2)  # fewer points than ranks
dropout_with_rank_0s_seed()
packed_on_ranks(ParallelLSTM, torch.nn.LSTM)
if size > 1:
    failures_raise_everywhere()
weights_inputs_and_copies(ParallelLSTM)
print(f"rank {rank} OK", flush=True)
