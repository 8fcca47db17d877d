"""Transformer blocks and the ViT layer-parallel on several ranks (run under mpiexec).

Usage: mpiexec -n P python transformer_ranks.py
Checks on every rank, float64, against the serial network with the same
initial weights built on every rank (plain autograd), 1e-9 relative:

* causal transformer blocks, also with a padding channel (sequences of
  different lengths, one of none): output, input gradient, and the gradients
  of every layer gathered on rank 0;
* the ViT (embedding, blocks, head): logits and every gradient (the blocks'
  gathered on rank 0), also after Adam steps; ``to_serial`` gives the reference's
  weights on rank 0 and ``load_serial`` of a serial ViT's state dict its logits;
* ``Switchable`` in serial mode on several ranks (converged solves, from
  inexact 1 / 1 cycle settings) equals serial autograd;
* ``SerialSwitch.measure``: the gradient norm and noise summed over the ranks
  equal the single-process values, and the error of a converged gradient is 0.

Prints "rank r OK" on success and exits 1 with a message otherwise.
"""
import copy
import math

import torch
from torch import nn

from checks import REL, check, fail, one_rank_fails, rank, world
from propagators.torch import LayerParallel
from propagators.torch.switch import SerialSwitch
from propagators.torch.transformer import make_vit, transformer_layers, with_key_padding

torch.set_default_dtype(torch.float64)
TIGHT = dict(fwd_iters=40, bwd_iters=40, fwd_tol=1e-14, bwd_tol=1e-14)





def gathered(lp):
    """{layer: [grads]} of every layer, on rank 0 (None elsewhere)."""
    mine = {j: [p.grad.clone() for p in lp.layers[j].parameters()] for j in lp.owned_layers}
    parts = world.gather(mine, root=0)
    if parts is None:
        return None
    every = {j: g for part in parts for j, g in part.items()}
    if sorted(every) != list(range(lp.n_layers)):
        fail(f"the ranks own layers {sorted(every)}, not each of {lp.n_layers} once")
    return every


def blocks_equal_serial(key_padding=False):
    torch.manual_seed(1)
    layers = transformer_layers(6, 8, 2, mlp_ratio=1.0, causal=True, key_padding=key_padding)
    lp = LayerParallel(copy.deepcopy(layers), T=1.5, cf=2, max_levels=3, comm=world, **TIGHT)
    ref = copy.deepcopy(layers)
    torch.manual_seed(2)
    x = torch.randn(3, 5, 8)
    if key_padding:  # (sequences of 5, 3 and 0 tokens)
        x = with_key_padding(x, torch.arange(5) >= torch.tensor([[5], [3], [0]]))
    xp, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y = lp(xp)
    ((y**2).sum() + y.sum()).backward()
    u, h = xs, 1.5 / len(ref)
    for f in ref:
        u = u + h * f(u)
    ((u**2).sum() + u.sum()).backward()
    check(f"blocks (key_padding={key_padding}): output", y.detach(), u.detach())
    check(f"blocks (key_padding={key_padding}): input gradient", xp.grad, xs.grad)
    every = gathered(lp)
    if every is not None:
        for j, gs in every.items():
            for g, p in zip(gs, ref[j].parameters()):
                check(f"blocks (key_padding={key_padding}): gathered gradient of layer {j}", g, p.grad)


def vit_equals_serial():
    kw = dict(n_blocks=6, dim=8, heads=2, patch=4, T=2.0, init="independent")
    par = make_vit(seed=3, cf=2, max_levels=2, comm=world, **kw, **TIGHT)
    ser = make_vit(seed=3, parallel=False, **kw)
    opt, opt_ref = torch.optim.Adam(par.parameters(), lr=1e-2), torch.optim.Adam(ser.parameters(), lr=1e-2)
    torch.manual_seed(4)
    X, Y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    for step in range(2):
        opt.zero_grad()
        opt_ref.zero_grad()
        out = par(X)
        nn.functional.cross_entropy(out, Y).backward()
        ref = ser(X)
        nn.functional.cross_entropy(ref, Y).backward()
        check(f"vit: logits (step {step})", out.detach(), ref.detach())
        for mod, mref in ((par.open, ser.open), (par.close, ser.close)):
            for p, q in zip(mod.parameters(), mref.parameters()):
                check(f"vit: embedding / head gradient (step {step})", p.grad, q.grad)
        every = gathered(par.lp)
        if every is not None:
            for j, gs in every.items():
                for g, p in zip(gs, ser.blocks.layers[j].parameters()):
                    check(f"vit: gathered gradient of layer {j} (step {step})", g, p.grad)
        opt.step()
        opt_ref.step()
    # checkpoints: the serial ViT on rank 0 is the reference's, and a serial state dict loads on every rank
    serial = par.to_serial(root=0)
    if (serial is None) != (rank != 0):
        fail("vit: to_serial returned the network on a rank other than the root")
    if serial is not None:
        for (name, p), q in zip(serial.named_parameters(), ser.parameters()):
            check(f"vit: to_serial parameter {name}", p.detach(), q.detach())
    torch.manual_seed(9)
    other = make_vit(seed=9, parallel=False, **kw)
    par.load_serial(other.state_dict())
    par.eval()
    other.eval()
    with torch.no_grad():
        check("vit: logits after load_serial", par(X), other(X))


def serial_mode_and_measure():
    kw = dict(n_blocks=6, dim=8, heads=2, patch=4, T=2.0, init="independent")
    par = make_vit(seed=5, cf=2, max_levels=2, comm=world, fwd_iters=1, bwd_iters=1, **kw)
    ser = make_vit(seed=5, parallel=False, **kw)
    torch.manual_seed(6)
    X, Y = torch.randn(10, 64), torch.randint(0, 10, (10,))
    par.blocks.mode = "serial"  # several ranks: converged solves
    out = par(X)
    nn.functional.cross_entropy(out, Y).backward()
    nn.functional.cross_entropy(ser(X), Y).backward()
    check("serial mode: logits", out.detach(), ser(X).detach())
    for p, q in zip(par.close.parameters(), ser.close.parameters()):
        check("serial mode: head gradient", p.grad, q.grad)
    for j in par.lp.owned_layers:
        for p, q in zip(par.lp.layers[j].parameters(), ser.blocks.layers[j].parameters()):
            check(f"serial mode: gradient of layer {j}", p.grad, q.grad)
    par.blocks.mode = "parallel"
    if (par.lp.fwd_iters, par.lp.bwd_iters, par.lp.fwd_tol) != (1, 1, None):
        fail("leaving serial mode did not restore the cycle settings")
    # the switch's estimates, summed over the ranks, equal the one-process values
    ctl = SerialSwitch(par, nn.functional.cross_entropy, groups=2)
    par.zero_grad()
    par.blocks.mode = "serial"
    nn.functional.cross_entropy(par(X), Y).backward()  # the exact gradient as "layer-parallel" gradient
    par.blocks.mode = "parallel"
    rec = ctl.measure(X, Y)
    gs = []
    for sl in (slice(0, 5), slice(5, 10)):
        ps = list(ser.parameters())
        gs.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(
            nn.functional.cross_entropy(ser(X[sl]), Y[sl]), ps)]))
    g = (gs[0] + gs[1]) / 2
    noise = math.sqrt(5 * 5) / 10 * float((gs[0] - gs[1]).norm()) / float(g.norm())
    if abs(rec["grad_norm"] - float(g.norm())) > REL * float(g.norm()):
        fail(f"switch: gradient norm {rec['grad_norm']} != serial {float(g.norm())}")
    if abs(rec["noise"] - noise) > REL * noise:
        fail(f"switch: noise {rec['noise']} != serial {noise}")
    if not rec["error"] < REL:
        fail(f"switch: error of the exact gradient is {rec['error']:.3e}, not 0")


def measure_keeps_the_warm_start():
    """SerialSwitch.measure leaves no trace on training: on several ranks its exact passes are converged
    solves, which replaced the block's warm-start trajectory (and its last solve statistics) by theirs,
    so the next training pass differed by 0.33 from the one without a measurement."""
    from propagators.torch import Switchable

    def build():
        torch.manual_seed(0)
        layers = [nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(32)]
        lp = LayerParallel(layers, T=4.0, warm_start=True, comm=world)
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(3, 6), Switchable(lp), nn.Linear(6, 2)).double()

    torch.manual_seed(5)
    x1, x2 = torch.randn(16, 3, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64) * 1.01
    y = torch.randint(0, 2, (16,))
    outs = []
    for measure in (False, True):
        model = build()
        nn.functional.cross_entropy(model(x1), y).backward()
        lp = model[1].lp
        before = (lp.last_forward, lp.last_backward)
        if measure:
            SerialSwitch(model, nn.functional.cross_entropy, every=1).measure(x1, y)
            if lp.last_forward is not before[0] or lp.last_backward is not before[1]:
                fail("measure: the block's last solve statistics are the measurement's")
        outs.append(model(x2).detach())
    check("the training pass after a measurement (warm start)", outs[1], outs[0])


def replicas_with_different_cycles_raise():
    """Data replicas (each rank a whole block, the world as data communicator) whose cycles or mode differ
    average the gradients of different approximations: allreduce_gradients raises on every rank alike
    (SerialSwitch changes them alike when given the data communicator). Alike, it averages."""
    from mpi4py import MPI

    from propagators.torch import LayerParallel, Switchable, allreduce_gradients

    for case, iters, mode in (("cycles", 4 if rank == 0 else 1, "parallel"),
                              ("mode", 2, "serial" if rank == 0 else "parallel"), ("alike", 2, "serial")):
        torch.manual_seed(3)
        lp = LayerParallel([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(8)], cf=2,
                           comm=MPI.COMM_SELF, fwd_iters=iters)
        model = nn.Sequential(nn.Linear(3, 4), Switchable(lp)).double()
        model[1].mode = mode
        model(torch.randn(5, 3, dtype=torch.float64)).sum().backward()
        try:
            allreduce_gradients(model, world)
        except ValueError as exc:
            named = {"cycles": "block `1.lp` (LayerParallel): fwd_iters 4 / 1 on the data ranks in order",
                     "mode": "block `1` (Switchable): mode 'serial' / 'parallel' on the data ranks"}.get(case)
            if case == "alike" or f"the first that differs: {named}" not in str(exc):
                fail(f"allreduce_gradients, replicas with {case}: {exc}")
        else:
            if case != "alike":
                fail(f"allreduce_gradients accepted data replicas with different {case}")


def switch_on_one_data_rank_and_bad_shard_size():
    """A SerialSwitch built on one data rank only (as a monitor) waited for ever in its measurement while
    the other data rank was in allreduce_gradients: now both raise, naming the two calls, and with
    data_comm=False it measures that rank's batch alone. A bad shard_size on one rank: ValueError there,
    RemoteRankError on the other (both waited before)."""
    from mpi4py import MPI

    from propagators.torch import LayerParallel, SerialSwitch, Switchable, allreduce_gradients

    for local in (False, True):
        torch.manual_seed(0)
        lp = LayerParallel([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(8)], T=2.0, cf=2,
                           comm=MPI.COMM_SELF, data_comm=world)
        model = nn.Sequential(nn.Linear(3, 4), Switchable(lp), nn.Linear(4, 3))
        x, y = torch.randn(8, 3), torch.randint(0, 3, (8,))
        nn.functional.cross_entropy(model(x), y).backward()
        try:
            if rank == 0:
                SerialSwitch(model, nn.functional.cross_entropy, **({"data_comm": False} if local else {})).update(x, y)
            allreduce_gradients(model, world)
        except ValueError as exc:
            if local or "collective calls differ" not in str(exc) or "SerialSwitch.measure" not in str(exc):
                fail(f"a switch on one data rank (data_comm={'False' if local else 'inferred'}): {exc}")
        else:
            if not local:
                fail("a switch on one data rank measured while the other data rank was in allreduce_gradients")
    one_rank_fails("allreduce_gradients, a bad shard_size on rank 1",
                   lambda: allreduce_gradients(model, world, shard_size=-1 if rank == 1 else 4),
                   rank == 1, ValueError, "shard_size")


def vit_load_with_a_head_entry_missing_on_one_rank():
    """A strict ViT.load_serial whose state dict lacks a head entry on rank 0 only: rank 0 raised KeyError and
    rank 1 loaded, and the ranks' heads differed. Now every rank raises and none loads anything."""
    vit = make_vit(4, 8, 2, seed=0, cf=2, max_levels=2, comm=world)
    sd = make_vit(4, 8, 2, seed=1, parallel=False).state_dict()
    if rank == 0:
        del sd["close.fc.bias"]
    before = {k: v.clone() for k, v in vit.state_dict().items()}
    one_rank_fails("ViT.load_serial with a head entry missing on rank 0", lambda: vit.load_serial(sd),
                   rank == 0, KeyError, "embedding and head")
    if not all(torch.equal(before[k], v) for k, v in vit.state_dict().items()):
        fail("ViT.load_serial that raised changed the model")


blocks_equal_serial()
blocks_equal_serial(key_padding=True)
vit_equals_serial()
vit_load_with_a_head_entry_missing_on_one_rank()
replicas_with_different_cycles_raise()
serial_mode_and_measure()
measure_keeps_the_warm_start()
switch_on_one_data_rank_and_bad_shard_size()
world.Barrier()
print(f"rank {rank} OK", flush=True)
