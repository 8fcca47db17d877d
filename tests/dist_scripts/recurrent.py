"""ParallelGRU and ParallelLSTM over a torch.distributed gloo group against torch's modules.

Run as ``python _launch.py P recurrent.py`` (or under ``torchrun``). Converged (float64):
a bidirectional two-layer ``ParallelGRU`` and ``ParallelLSTM`` give ``nn.GRU``'s / ``nn.LSTM``'s
output, final states and every gradient on every process, to 1e-10; the same modules at the
default inexact cycles, with dropout, give on P processes exactly what they give on one (the
processes' random states differ on purpose: rank 0's seed is used); a failing adjoint step on
the last process makes every other raise RemoteRankError, and the module trains afterwards.
Prints ``rank r OK``.
"""
import sys
from unittest import mock

import torch
import torch.distributed as dist

import mgrit
from propagators.torch import ParallelGRU, ParallelLSTM

TIGHT = dict(fwd_iters=60, bwd_iters=60, fwd_tol=1e-14, bwd_tol=1e-14)
I, H, B, L = 3, 4, 2, 13


def fail(msg):
    print(f"rank {dist.get_rank()} FAIL: {msg}", flush=True)
    sys.exit(1)


def check(name, a, b, tol):
    err = float((a.detach() - b.detach()).abs().max())
    if not err <= tol:
        fail(f"{name}: max difference {err:.3e} > {tol:.0e}")


def step(model, x, hx):
    """Output, final states and gradients of a fixed loss (the same on every process)."""
    model.zero_grad()
    xs = x.clone().requires_grad_(True)
    out, final = model(xs, hx)
    states = final if isinstance(final, tuple) else (final,)
    g = torch.Generator().manual_seed(5)
    loss = (out * torch.randn(out.shape, generator=g)).sum() + sum(s.square().sum() for s in states)
    loss.backward()
    return [out, *states, xs.grad] + [p.grad for p in model.parameters()]


def main():
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_default_dtype(torch.float64)
    group = dist.group.WORLD
    for cell, cls in (("GRU", ParallelGRU), ("LSTM", ParallelLSTM)):
        torch.manual_seed(3)  # the same weights and data on every process
        ref = getattr(torch.nn, cell)(I, H, num_layers=2, bidirectional=True)
        par = cls(I, H, num_layers=2, bidirectional=True, cf=2, comm=group, **TIGHT)
        par.load_state_dict(ref.state_dict())
        x = torch.randn(L, B, I)
        for k, (a, b) in enumerate(zip(step(par, x, None), step(ref, x, None))):
            check(f"{cell} converged, item {k}", a, b, 1e-10)
        one = cls(I, H, num_layers=2, bidirectional=True, dropout=0.3)  # the default cycles, one process
        many = cls(I, H, num_layers=2, bidirectional=True, dropout=0.3, comm=group)
        many.load_state_dict(one.state_dict())
        torch.manual_seed(100 + rank)  # other random states on every process
        got = step(many, x, None)
        seed = many.last_dropout_seed  # rank 0's, on every process
        with mock.patch("torch.randint", lambda *args, **kwargs: torch.tensor(seed)):  # the one-process
            want = step(one, x, None)                                                # pass draws it too
        for k, (a, b) in enumerate(zip(got, want)):
            check(f"{cell} inexact with dropout on {size} processes against one, item {k}", a, b, 1e-12)
        adjoint = cls._adjoint
        original_step = adjoint.step_batch

        def failing(self, *args):
            raise RuntimeError("injected adjoint failure")

        y, _ = par(x.clone().requires_grad_(True))
        if rank == size - 1:
            adjoint.step_batch = failing
        try:
            y.sum().backward()
        except mgrit.RemoteRankError as exc:
            if rank == size - 1 or exc.rank != size - 1 or "injected adjoint failure" not in str(exc):
                fail(f"{cell}: unexpected RemoteRankError: {exc}")
        except RuntimeError as exc:
            if rank != size - 1 or "injected adjoint failure" not in str(exc):
                fail(f"{cell}: unexpected {type(exc).__name__}: {exc}")
        else:
            fail(f"{cell}: a failing adjoint step raised nowhere")
        finally:
            adjoint.step_batch = original_step
        for k, (a, b) in enumerate(zip(step(par, x, None), step(ref, x, None))):
            check(f"{cell} after the failure, item {k}", a, b, 1e-10)
    print(f"rank {rank} OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
