"""ParallelGRU on several ranks against torch.nn.GRU (run under mpiexec).

Usage: mpiexec -n P python gru_ranks.py
Checks (every rank), float64, converged solves: output, h_n and the gradients of
the input, h0 and every weight equal nn.GRU's with copied weights to 1e-10, for
one and two layers, one- and two-way (bidirectional), batch_first, no bias, h0 given or None, return_sequence=False,
sequences shorter than the number of ranks, eval mode (exact stepping), and after
optimizer steps (the weights stay equal on every rank); a bad input on one rank
makes every rank raise, and so does a failing step of the adjoint solve, with the
failed rank numbered as on the module's communicator, and so do two GRUs called in
another order on one rank, GRUs built differently, and another input or another loss
on one rank (every rank holds the whole sequence); dropout between layers equals the masked stack of
one-layer nn.GRUs, with the same masks on every rank; in bfloat16 and float16 the weight
gradients equal the float64 ones to the dtype's precision, alike on every rank; a PackedSequence
input equals nn.GRU's packed pass, and other sequence lengths on one rank raise on every rank. Prints "rank r OK" on
success and exits 1 otherwise.
"""

import torch

from checks import fail, rank, size, world
from rnn_checks import (TIGHT, check, packed_on_ranks, raised_on_every_rank, same_randn, value_error_everywhere,
                        weights_inputs_and_copies)
import mgrit
from propagators.torch import ParallelGRU

torch.set_default_dtype(torch.float64)
def case(L, layers, bias, batch_first, with_h0, return_sequence, cf, levels, relax, steps=1, bidirectional=False):
    torch.manual_seed(1000 + L + 10 * layers)  # the same weights and data on every rank
    I, H, B = 3, 4, 2
    D = 2 if bidirectional else 1
    ref = torch.nn.GRU(I, H, num_layers=layers, bias=bias, batch_first=batch_first, bidirectional=bidirectional)
    par = ParallelGRU(I, H, num_layers=layers, bias=bias, batch_first=batch_first, cf=cf, max_levels=levels,
                      relax=relax, return_sequence=return_sequence, bidirectional=bidirectional, comm=world,
                      **TIGHT)
    par.load_state_dict(ref.state_dict())
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
    opt = torch.optim.SGD(par.parameters(), lr=0.1, momentum=0.5)
    x = torch.randn(B, L, I) if batch_first else torch.randn(L, B, I)
    h0 = torch.randn(D * layers, B, H) if with_h0 else None
    wo = torch.randn(B, L, D * H) if batch_first else torch.randn(L, B, D * H)
    wn = torch.randn(D * layers, B, H)
    name = (f"L={L} layers={layers} bias={bias} bf={batch_first} h0={with_h0} seq={return_sequence} cf={cf} "
            f"bidirectional={bidirectional}")
    for step in range(steps):
        xs, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        hs = hp = None
        if with_h0:
            hs, hp = h0.clone().requires_grad_(True), h0.clone().requires_grad_(True)
        o_ref, n_ref = ref(xs, hs)
        o, n = par(xp, hp)
        if return_sequence:
            check(f"{name} step {step} output", o, o_ref)
            loss_ref, loss = (o_ref * wo).sum() + (n_ref * wn).sum(), (o * wo).sum() + (n * wn).sum()
        else:
            if o is not None:
                fail(f"{name}: output is not None with return_sequence=False")
            loss_ref, loss = (n_ref * wn).sum(), (n * wn).sum()
        check(f"{name} step {step} h_n", n, n_ref)
        opt_ref.zero_grad()
        opt.zero_grad()
        loss_ref.backward()
        loss.backward()
        check(f"{name} step {step} input grad", xp.grad, xs.grad)
        if with_h0:
            check(f"{name} step {step} h0 grad", hp.grad, hs.grad)
        for (k, p), q in zip(par.named_parameters(), ref.parameters()):
            check(f"{name} step {step} grad {k}", p.grad, q.grad)
        opt_ref.step()
        opt.step()
    # the weights after the steps are the same on every rank
    for k, p in par.named_parameters():
        every = world.allgather(p.detach().numpy())
        if any(float(abs(e - every[0]).max()) != 0.0 for e in every):
            fail(f"{name}: {k} differs between ranks after the optimizer steps")
    # eval mode: exact stepping through the positions, no iterations
    par.eval()
    ref.eval()
    with torch.no_grad():
        o, n = par(x, h0)
        o_ref, n_ref = ref(x, h0)
    check(f"{name} eval h_n", n, n_ref, 1e-12)
    if return_sequence:
        check(f"{name} eval output", o, o_ref, 1e-12)


def raises_everywhere(par, x, error, text: str, what: str) -> None:
    """``par(x)`` raises ``error`` (mentioning ``text``) on the last rank, RemoteRankError (naming
    it) on the others; then the module still works on a good input of the same length."""
    raised_on_every_rank(lambda: par(x), error, text, what)
    y, _ = par(same_randn(x.shape[0], 2, 3))  # the communicator is still usable
    if y.shape != (x.shape[0], 2, 4):
        fail(f"{what}: output shape {tuple(y.shape)} after the failure")


def bad_input_raises_everywhere():
    par = ParallelGRU(3, 4, comm=world, **TIGHT)
    x = same_randn(7, 2, 3 if rank != size - 1 else 5)  # the last rank passes a wrong input size
    raises_everywhere(par, x, ValueError, "input_size", "a bad input")
    # an empty batch on every rank: empty outputs and zero gradients everywhere, no solve; an empty batch
    # on the last rank and zeros (the same sums) on the others: every rank raises, naming the shapes
    x = torch.zeros(7, 0, 3, requires_grad=True)
    y, h_n = par(x)
    (y.sum() + h_n.sum()).backward()
    if y.shape != (7, 0, 4) or h_n.shape != (1, 0, 4) or float(par.weight_hh_l0.grad.abs().sum()) != 0.0:
        fail(f"an empty batch: output {tuple(y.shape)}, h_n {tuple(h_n.shape)}, gradient {par.weight_hh_l0.grad}")
    value_error_everywhere(lambda: par(torch.zeros(7, 0 if rank == size - 1 else 2, 3)), "has shape",
                           "an empty batch on one rank")
    # another sequence length there (values that differ too): named as a shape, not as other values
    value_error_everywhere(lambda: par(same_randn(8 if rank == size - 1 else 7, 2, 3)), "has shape (8, 2, 3)",
                           "another sequence length on one rank")
    still_trains(par, "after an empty batch on one rank")


def solve_failure_raises_everywhere():
    """The forward solve runs inside the layer's session: a step that fails on one rank only
    makes that rank raise its error and every other rank RemoteRankError (no hang)."""
    from propagators.torch import gru as gru_module

    original = gru_module.GRUPropagator.step_batch

    def failing(self, *args):
        raise RuntimeError("injected step failure")

    class Restoring(torch.nn.Module):  # the failing step only for the first call
        def __init__(self):
            super().__init__()
            self.gru, self.calls = ParallelGRU(3, 4, comm=world, **TIGHT), 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 1 and rank == size - 1:
                gru_module.GRUPropagator.step_batch = failing
            try:
                return self.gru(x)
            finally:
                gru_module.GRUPropagator.step_batch = original

    raises_everywhere(Restoring(), same_randn(9, 2, 3), RuntimeError, "injected step failure", "a failing step")


def settings_mismatch_raises_everywhere():
    """The forward solve runs inside the layer's session, whose handshake compares the solve's
    settings: fwd_iters changed on one rank only makes every rank raise ValueError (no hang)."""
    par = ParallelGRU(3, 4, comm=world)
    if rank == size - 1:
        par.fwd_iters = 3
    value_error_everywhere(lambda: par(same_randn(9, 2, 3)), "differ between ranks", "a settings mismatch")
    par.fwd_iters = 2
    y, _ = par(same_randn(9, 2, 3))
    if y.shape != (9, 2, 4):
        fail(f"a settings mismatch: output shape {tuple(y.shape)} afterwards")


def order_and_build_mismatches_raise_everywhere():
    """Two GRUs of the same settings called in another order on the last rank: every handshake compares
    which module it is for, so every rank raises ValueError (no pairing of one rank's GRU with another's);
    GRUs built with another hidden size on the last rank: every rank raises while building."""
    a, b = ParallelGRU(3, 4, comm=world), ParallelGRU(3, 4, comm=world)
    x = same_randn(9, 2, 3)
    value_error_everywhere(lambda: [g(x) for g in ((b, a) if rank == size - 1 else (a, b))], "differ between ranks",
                           "GRUs called in another order")
    value_error_everywhere(lambda: ParallelGRU(3, 5 if rank == size - 1 else 4, comm=world), "built differently",
                           "GRUs built differently")
    still_trains(a, "after calls in another order")
    # every rank holds the whole sequence: another input, or another loss, on the last rank raises everywhere
    for what, scale_x, scale_loss, text in (("input", 2.0, 1.0, "the input of rank"),
                                            ("loss", 1.0, 2.0, "gradient of the output sequence")):
        z = same_randn(9, 2, 3, requires_grad=True)

        def step():
            y, _ = a(z * (scale_x if rank == size - 1 else 1.0))
            (y.square().sum() * (scale_loss if rank == size - 1 else 1.0)).backward()

        value_error_everywhere(step, text, f"another {what} on one rank")
        still_trains(a, f"after another {what} on one rank")


def backward_failure_raises_everywhere():
    """A step of the adjoint solve fails on the last rank: that rank raises its error and every other
    rank RemoteRankError naming it as the module's communicator numbers it (the adjoint solve runs with
    the ranks in reverse; no second numbering); then forward and backward still work. The same for a
    failing adjoint set-up on the last rank (before the layer's session). (A NaN output gradient on one
    rank only: weights_inputs_and_copies.)"""
    from propagators.torch import gru as gru_module

    def failing(self, *args):
        raise RuntimeError("injected adjoint failure")

    def failing_hidden(self, U):
        raise RuntimeError("injected set-up failure")

    par = ParallelGRU(3, 4, comm=world, **TIGHT)
    # (what, the patched method and its replacement, the error on the last rank, its text); the last one
    # fails before the layer's session: the adjoint set-up (the hidden projections at the stored states)
    cases = [("a failing adjoint step", (gru_module.GRUAdjointPropagator, "step_batch", failing), RuntimeError,
              "injected adjoint failure"),
             ("a failing adjoint set-up", (gru_module.GRUPropagator, "hidden", failing_hidden), RuntimeError,
              "injected set-up failure")]
    for what, patch, error, text in cases:
        y, _ = par(same_randn(9, 2, 3, requires_grad=True))
        g = torch.ones_like(y)
        original = getattr(patch[0], patch[1])
        if rank == size - 1:
            setattr(patch[0], patch[1], patch[2])
        try:
            y.backward(g)
        except mgrit.RemoteRankError as exc:
            if rank == size - 1 or exc.rank != size - 1 or text not in str(exc) \
                    or "of this communicator" in str(exc) or f"rank {size - 1} " not in str(exc):
                fail(f"{what}: not raised as RemoteRankError naming rank {size - 1} as the module's communicator "
                     f"numbers it (rank {exc.rank}): {exc}")
        except error as exc:
            if rank != size - 1 or text not in str(exc):
                fail(f"{what}: unexpected {type(exc).__name__}: {exc}")
        else:
            fail(f"{what}: no rank raised")
        finally:
            setattr(patch[0], patch[1], original)
        still_trains(par, what)


def still_trains(par, what: str) -> None:
    """Forward and backward work after a failure: a finite input gradient."""
    x = same_randn(9, 2, 3, requires_grad=True)
    y, _ = par(x)
    y.square().sum().backward()
    if x.grad is None or not bool(torch.isfinite(x.grad).all()):
        fail(f"{what}: no input gradient afterwards")


def low_precision_weight_gradients():
    """bfloat16 and float16 on several ranks: the weight gradients' all-reduce (numpy has no bfloat16:
    summed in float32) gives the float64 module's gradients (same settings, same ranks) to the dtype's
    precision, alike on every rank."""
    for dt, tol in ((torch.bfloat16, 5e-2), (torch.float16, 1e-2)):
        torch.manual_seed(5)
        ref = ParallelGRU(3, 4, comm=world, cf=2)
        low = ParallelGRU(3, 4, comm=world, cf=2).to(dt)
        low.load_state_dict(ref.state_dict())
        x = same_randn(7, 2, 3)
        y, _ = low(x.to(dt))
        y.float().square().sum().backward()
        yr, _ = ref(x)
        yr.square().sum().backward()
        for (name, p), q in zip(low.named_parameters(), ref.parameters()):
            scale = float(q.grad.abs().max())
            err = float((p.grad.double() - q.grad).abs().max()) / scale
            if not err < tol:
                fail(f"{dt} on {size} ranks: gradient of {name} off by {err:.2e} (relative) >= {tol}")
        sums = world.allgather(float(sum(p.grad.double().sum() for p in low.parameters())))
        if len(set(sums)) != 1:
            fail(f"{dt}: the weight gradients differ between ranks: {sums}")


def dropout_on_ranks():
    """Dropout between layers on several ranks: every rank uses rank 0's seed (here the ranks' global
    generators differ on purpose), so the pass is the same on every rank and equals the stack of one-layer
    nn.GRUs with the masks of that seed (one- and two-way, converged, output and all gradients); a rank
    in eval() mode while the others train makes every rank raise."""
    I, H, B, L = 3, 4, 2, 11
    for bidirectional in (False, True):
        D = 2 if bidirectional else 1
        torch.manual_seed(21)
        par = ParallelGRU(I, H, num_layers=3, dropout=0.4, bidirectional=bidirectional, comm=world, cf=2, **TIGHT)
        x = same_randn(L, B, I)
        xp, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        torch.manual_seed(500 + rank)  # other global random states on every rank
        out, hn = par(xp)
        seed = par.last_dropout_seed
        if len(set(world.allgather(seed))) != 1:
            fail(f"dropout (bidirectional={bidirectional}): the seeds differ between ranks")
        masks = par.dropout_masks(seed, torch.empty(L, B, D * H))
        inp, hs, refs = xs, [], []
        for l in range(3):
            g = torch.nn.GRU(I if l == 0 else D * H, H, bidirectional=bidirectional)
            g.load_state_dict({k.replace(f"_l{l}", "_l0"): v for k, v in par.state_dict().items()
                               if k.endswith(f"_l{l}") or k.endswith(f"_l{l}_reverse")})
            o, h = g(inp)
            refs.append(g)
            hs.append(h)
            inp = o * masks[l] if l < 2 else o
        name = f"dropout (bidirectional={bidirectional})"
        check(f"{name} output", out, inp)
        check(f"{name} h_n", hn, torch.cat(hs))
        w = same_randn(L, B, D * H)
        (out * w).sum().backward()
        (inp * w).sum().backward()
        check(f"{name} input grad", xp.grad, xs.grad)
        params = dict(par.named_parameters())
        for l, g in enumerate(refs):
            for k, q in g.named_parameters():
                check(f"{name} grad {k} of layer {l}", params[k.replace("_l0", f"_l{l}")].grad, q.grad)
    par = ParallelGRU(I, H, num_layers=2, dropout=0.4, comm=world, exact_eval=False)
    # a pass that fails on every rank before its solves leaves every rank's global generator where it
    # was: the ranks that drew a seed put it back (here they were seeded alike)
    for what, mode, x, error, text in (
            ("train and eval modes mixed", "eval", same_randn(L, B, I), ValueError, "dropout is drawn on some ranks"),
            ("a bad input on one rank", "train", same_randn(L, B, I if rank != size - 1 else I + 1),
             (ValueError, mgrit.RemoteRankError), "input_size")):
        if rank == size - 1 and mode == "eval":
            par.eval()
        torch.manual_seed(77)
        try:
            par(x)
        except error as exc:
            if text not in str(exc):
                fail(f"{what}: unexpected {type(exc).__name__}: {exc}")
        else:
            fail(f"{what}: no error")
        if len(set(world.allgather(float(torch.rand(()))))) != 1:
            fail(f"{what}: the ranks' global generators differ after the failed pass")
        par.train()
        still_trains(par, f"after {what}")


case(13, 1, True, False, True, True, 2, 3, "FCF", steps=3)
case(13, 2, True, False, True, True, 2, 3, "FCF", steps=2, bidirectional=True)
case(11, 1, True, True, False, False, 2, 4, "F", bidirectional=True)
case(13, 2, True, True, False, True, 4, 2, ("F", "FCF"))
case(11, 2, False, False, True, False, 2, 4, "F")
case(size - 1 if size > 2 else 1, 1, True, False, True, True, 2, 2, "FCF")  # fewer points than ranks
case(2, 1, True, True, True, True, 2, 2, "FCF")
bad_input_raises_everywhere()
solve_failure_raises_everywhere()
settings_mismatch_raises_everywhere()
low_precision_weight_gradients()
dropout_on_ranks()
packed_on_ranks(ParallelGRU, torch.nn.GRU)
if size > 1:
    order_and_build_mismatches_raise_everywhere()
    backward_failure_raises_everywhere()
weights_inputs_and_copies(ParallelGRU)
print(f"rank {rank} OK", flush=True)
