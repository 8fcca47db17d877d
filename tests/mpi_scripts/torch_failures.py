"""A failure on one rank in any phase of a layer-parallel step raises on every rank (run under mpiexec).

Usage: mpiexec -n P python torch_failures.py CASE:BAD_RANK [CASE:BAD_RANK ...]
       mpiexec -n 4 python torch_failures.py --grid-nan BAD_DATA_RANK

CASE is the phase in which rank BAD_RANK fails:

* ``check``: a bad input on that rank only (an integer tensor); ``nanin``: a NaN in its input;
* ``empty``: an empty batch on that rank only;
* ``halo``: while sending / receiving neighbours' parameters;
* ``forward``: in a layer, inside the forward MGRIT solve;
* ``ghost``: after the forward solve, taking the left neighbour's boundary state, before the output
  is broadcast;
* ``adjoint``: in a vector-Jacobian product, inside the adjoint MGRIT solve;
* ``params``: while computing the parameter gradients;
* ``inplace``: a parameter modified in place between forward and backward on that rank only;
* ``interrupt``: ``KeyboardInterrupt`` in ``mgrit.solve``'s input checks (before its handshake);
* ``switch_loss``: the loss raises inside ``SerialSwitch.update``'s measurement (its other ranks were told the
  collective calls differ, naming the switch's ``every``);
* ``factory``: the layer factory raises (while the module is built); ``argument``: a bad
  argument there (``T=0``), found before the building handshake;
* ``layout``: the factory builds layers of another layout (no bias) on that rank only;
* ``activation``: that rank's list has another activation in a layer it does not hold (the
  network was a silent mix of the ranks' lists);
* ``tied``: the list ties the first and the last layer (every rank raises its own ValueError);
* ``to_serial``: a layer that cannot be copied (it holds a lock) on that rank;
* ``load_serial``: a state dict without the last layer's entries (every rank compares the keys with all
  ranks' and raises KeyError).
* ``settings``: ``fwd_iters`` changed on that rank only; ``eval``: that rank alone in eval
  mode (its forward is the exact one-level solve); ``batch``: another batch size there;
  ``bwd_settings``: ``bwd_iters`` changed there between forward and backward. The solves
  run inside each pass's session, whose handshake compares what they must agree on
  (``autocast``: that rank alone runs the forward pass under ``torch.autocast``):
  every rank raises ValueError ("differ between ranks"), none waits.
* ``outer``: the step runs inside the user's own session on the module's communicator and
  that rank raises between forward and backward (the others wait in the backward pass).
* Ranks that disagree, where every rank raises ValueError (none waits, nothing is computed
  from mixed data): ``order``, two blocks of the same settings called in the other order on
  that rank (each handshake compares which block it is for); ``shuffled``, that rank's batch
  in another row order; ``loss``, another loss there (the adjoint's handshake compares the
  output gradients); ``backward_order``, two outputs of the block whose backward passes run in the
  other order there, their output gradients equal (the handshake compares which forward pass each is of), ``nanloss``, a NaN loss there only (a NaN loss on every rank gives NaN
  gradients everywhere, as serial autograd: checked after the cases); ``n_layers``, a block of 17 layers there, 16 elsewhere; ``scheme``, a block stepped by Heun there;
  ``replica_values`` / ``replica_T``, data replicas (the world as data communicator) whose model differs
  there in a parameter value / in the block's T (the averaged gradients were of no one network);
  ``replica_swap``, two layers of one shape swapped there; ``shard``,
  ``allreduce_gradients`` with ``shard_size`` on that rank only; ``modules``, with a module
  of other parameters there.
* Ranks at different calls of one block: ``calls``, that rank calls ``to_serial()`` where the
  others make a training step; ``skip``, that rank skips the backward pass and runs another
  forward pass. Every rank raises ValueError naming each rank's call.

For every case every rank prints ``case NAME rank r: <TypeName>: <message> [after <s> s]``
(or ``case NAME rank r: no error``). After the cases the ranks run one clean
layer-parallel step and compare it with serial autograd (``rank r: recovered OK``).

``--grid-nan``: 4 ranks as a 2 x 2 layer x data grid; the data shard of data rank
BAD_DATA_RANK holds a NaN, so its layer ranks raise (the block's input check); the other data rank's ranks, waiting in ``allreduce_gradients``,
must raise RemoteRankError (``case grid rank r: ...``).
"""
import copy
import sys
import threading
import time

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

import mgrit
from propagators import Dahlquist
from propagators.torch import LayerParallel, ODENet, allreduce_gradients

torch.set_default_dtype(torch.float64)
world = MPI.COMM_WORLD
rank = world.Get_rank()


class Injected(RuntimeError):
    """The error raised on purpose by the failing rank."""


def raiser(what):
    def f(*args, **kwargs):
        raise Injected(f"injected failure in {what}")

    return f


def layers(n=16, seed=0):
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(n)]


def inject(lp, case):
    if case == "halo":
        lp._exchange_halo = raiser("halo exchange")
    elif case == "ghost":
        original = mgrit.result.Result.with_ghost

        def failing(self):
            mgrit.result.Result.with_ghost = original  # once: the later cases and the clean step use it
            raise Injected("injected failure in taking the boundary state after the forward solve")

        mgrit.result.Result.with_ghost = failing
    elif case == "params":
        lp._parameter_gradients = raiser("parameter gradients")
    elif case in ("forward", "adjoint"):
        bind = lp.kernel.bind

        def patched(*args, **kwargs):
            kp = bind(*args, **kwargs)
            if case == "forward":
                kp.step = kp.stepper = raiser("a layer of the forward solve")
            else:
                kp.vjp_state = kp.vjp_stepper = raiser("a vector-Jacobian product of the adjoint solve")
            return kp

        lp.kernel.bind = patched


def factory(case, bad):
    def make(i):
        if case == "factory" and rank == bad:
            raise Injected(f"injected failure while building layer {i}")
        bias = not (case == "layout" and rank == bad)
        return nn.Sequential(nn.Linear(4, 4, bias=bias), nn.Tanh())

    return make


def run_case(case, bad):
    if case == "argument":
        LayerParallel(layers(), T=0.0 if rank == bad else 1.0, cf=2, max_levels=3, comm=world)
        return
    if case == "switch_loss":  # the loss fails there inside SerialSwitch's measurement (between a pass's halves)
        from propagators.torch import SerialSwitch, Switchable

        torch.manual_seed(3)  # (the same head on every rank)
        model = nn.Sequential(nn.Linear(4, 4), Switchable(LayerParallel(layers(8), cf=2, max_levels=2, comm=world)))
        calls = []

        def loss_fn(out, target):
            calls.append(1)
            if rank == bad and len(calls) == 2:
                raise RuntimeError("injected loss failure")
            return (out - target).square().mean()

        switch = SerialSwitch(model, loss_fn, every=1, groups=2)
        x, target = torch.randn(4, 4, generator=torch.Generator().manual_seed(2)), torch.zeros(4, 4)
        model(x).square().mean().backward()
        switch.update(x, target)
        return
    if case == "n_layers":
        LayerParallel(layers(17 if rank == bad else 16), cf=2, max_levels=3, comm=world)
        return
    if case == "scheme":  # the first pass blamed hooks or attributes changed on one rank
        from propagators.torch import forward_euler, heun

        LayerParallel(layers(), cf=2, max_levels=3, comm=world, scheme=heun if rank == bad else forward_euler)
        return
    if case in ("replica_values", "replica_T"):  # data replicas (world as the data communicator) that differ
        lp = LayerParallel(layers(8), cf=2, max_levels=2, T=2.0 if case == "replica_T" and rank == bad else 1.0)
        model = nn.Sequential(nn.Linear(4, 4), lp)
        if case == "replica_values" and rank == bad:  # (a rank seeded otherwise)
            with torch.no_grad():
                model[0].weight[0, 0] += 1e-3
        model(torch.randn(2, 4)).sum().backward()
        allreduce_gradients(model, world)
        return
    if case == "replica_swap":  # two layers of one shape swapped there: sums and norms agree, the network not
        torch.manual_seed(0)
        a, b, big = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(300, 300)  # (big: checksummed on its own)
        model = nn.Sequential(*((b, a) if rank == bad else (a, b)), nn.Linear(4, 300), big)
        model(torch.randn(2, 4)).sum().backward()
        allreduce_gradients(model, world)
        return
    if case in ("shard", "modules"):
        model = nn.Linear(4, 3, bias=not (case == "modules" and rank == bad))
        model(torch.randn(2, 4)).sum().backward()
        allreduce_gradients(model, world, shard_size=2 if case == "modules" or rank == bad else None)
        return
    if case == "order":
        a, b = (LayerParallel(layers(seed=s), cf=2, max_levels=3, comm=world) for s in (0, 1))
        x = torch.randn(3, 4)
        for lp in ((b, a) if rank == bad else (a, b)):
            lp(x)
        return
    if case in ("factory", "layout"):
        LayerParallel(factory(case, bad), n_layers=16, cf=2, max_levels=3, comm=world)
        return
    if case == "activation":  # that rank's list differs at a layer it does not hold (another activation)
        ls = layers()
        if rank == bad:
            far = 15 if bad == 0 else 0
            ls[far] = nn.Sequential(ls[far][0], nn.ReLU())
        LayerParallel(ls, cf=2, max_levels=3, comm=world)
        return
    if case == "tied":
        ls = layers()
        ls[-1][0].weight = ls[0][0].weight
        LayerParallel(ls, cf=2, max_levels=3, comm=world)
        return
    lp = LayerParallel(layers(), cf=2, max_levels=3, comm=world)
    if case == "to_serial":
        if rank == bad:
            next(iter(lp.layers)).lock = threading.Lock()
        lp.to_serial(root=0)
        return
    if case == "load_serial":
        state = {k: v for k, v in ODENet(layers()).state_dict().items() if not k.startswith("layers.15.")}
        lp.load_serial(state)
        return
    x = torch.randn(3, 4)
    if rank == bad:
        if case == "check":
            x = torch.ones(3, 4, dtype=torch.int64)
        elif case == "empty":
            x = torch.ones(0, 4)
        elif case == "settings":
            lp.fwd_iters = 3
        elif case == "eval":
            lp.eval()
        elif case == "batch":
            x = torch.randn(5, 4)
        elif case == "shuffled":
            x = x.flip(0)
        elif case == "nanin":
            x[1, 2] = float("nan")
        inject(lp, case)
    if case == "interrupt":
        guess = None
        if rank == bad:
            def guess(t):
                raise KeyboardInterrupt("interrupted while checking the input")
        mgrit.solve(Dahlquist(-1.0), np.array([1.0]), np.linspace(0, 1, 17), comm=world, initial_guess=guess)
        return
    if case == "outer":  # the user's own session on the module's communicator around the step
        with lp.comm.session():
            y = lp(x)
            if rank == bad:
                raise Injected("injected failure between forward and backward")
            y.square().sum().backward()
        return
    if case == "calls" and rank == bad:
        lp.to_serial()  # where the others make a training step
        return
    if case == "autocast" and rank == bad:  # (it blamed a layer changed on one rank only)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp(x)
        return
    y = lp(x)
    if case == "backward_order":  # two outputs' backward passes in the other order there, with equal
        y2 = lp(x.flip(0))          # output gradients (linear losses): the handshake compares the passes
        for out in ((y2, y) if rank == bad else (y, y2)):
            out.sum().backward()
        return
    if case == "skip" and rank == bad:
        with torch.no_grad():
            lp(x)  # another forward pass (a validation) where the others run the backward pass
        return
    if case == "inplace" and rank == bad:
        with torch.no_grad():
            next(iter(lp.parameters())).add_(1.0)
    if case == "bwd_settings" and rank == bad:
        lp.bwd_iters = 2
    nan = float("nan") if case == "nanloss" and rank == bad else 1.0
    (y.square().sum() * nan + (y.sum() if case == "loss" and rank == bad else 0)).backward()


def clean_step():
    ls = layers(12, seed=3)
    tight = dict(fwd_iters=60, bwd_iters=60, fwd_tol=1e-14, bwd_tol=1e-14)
    lp = LayerParallel(copy.deepcopy(ls), cf=2, max_levels=3, comm=world, **tight)
    ref = ODENet(copy.deepcopy(ls))
    torch.manual_seed(4)
    x = torch.randn(3, 4)
    xp = x.clone().requires_grad_(True)
    (lp(xp).square().sum() * float("nan")).backward()  # a NaN loss on every rank: NaN gradients everywhere
    if torch.isfinite(xp.grad).any() or any(p.grad is not None and torch.isfinite(p.grad).any()
                                            for p in lp.parameters()):
        return False
    lp.zero_grad()
    xp, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    lp(xp).square().sum().backward()
    ref(xs).square().sum().backward()
    err = float((xp.grad - xs.grad).abs().max())
    return err < 1e-10


def grid_nan(bad_data):
    layer_comm, data_comm = mgrit.split_comm(world, 2)
    lp = LayerParallel(layers(12), cf=2, max_levels=3, comm=layer_comm, data_comm=data_comm)
    model = nn.Sequential(nn.Linear(3, 4), lp, nn.Linear(4, 1))
    torch.manual_seed(5)
    X = torch.randn(8, 3)
    d = data_comm.Get_rank()
    shard = X[4 * d: 4 * d + 4]
    if d == bad_data:
        shard = shard.clone()
        shard[0, 0] = float("nan")
    start = time.perf_counter()
    try:
        model(shard).square().mean().backward()
        allreduce_gradients(model, data_comm)
    except BaseException as exc:  # noqa: BLE001
        print(f"case grid rank {rank}: {type(exc).__name__}: {exc} [after {time.perf_counter() - start:.2f} s]",
              flush=True)
        return 1
    print(f"case grid rank {rank}: no error", flush=True)
    return 0


def main():
    if sys.argv[1] == "--grid-nan":
        return grid_nan(int(sys.argv[2]))
    got = False
    for spec in sys.argv[1:]:
        case, bad = spec.split(":")
        start = time.perf_counter()
        try:
            run_case(case, int(bad))
        except BaseException as exc:  # noqa: BLE001 - report whatever arrived
            got = True
            print(f"case {case} rank {rank}: {type(exc).__name__}: {exc} [after {time.perf_counter() - start:.2f} s]",
                  flush=True)
        else:
            print(f"case {case} rank {rank}: no error", flush=True)
    ok = clean_step()
    print(f"rank {rank}: recovered {'OK' if ok else 'MISMATCH'}", flush=True)
    return 0 if (ok and got) else 1


if __name__ == "__main__":
    sys.exit(main())
