"""LayerParallel on several ranks against the serial network (run under mpiexec).

Usage: mpiexec -n P python torch_layer_parallel.py [grid]
Checks (every rank): forward output and input / parameter gradients equal serial
autograd (to 1e-12 / 1e-10) on P ranks, also after optimizer steps; with the default
2 / 1 cycles (far from converged) and a step size that is not a power of two, dense
tanh layers give the same bits as the same LayerParallel on one process; with
``grid`` (P = 4): a 2 x 2 layer x data grid reproduces the full-batch gradients.
Prints "rank r OK" on success and exits 1 with a message otherwise.
"""
import copy
import math
import sys

import torch
from mpi4py import MPI
from torch import nn

import mgrit
from propagators.torch import LayerParallel, allreduce_gradients

from checks import value_error_everywhere

torch.set_default_dtype(torch.float64)
world = MPI.COMM_WORLD
rank = world.Get_rank()
TIGHT = dict(fwd_iters=60, bwd_iters=60, fwd_tol=1e-14, bwd_tol=1e-14)


def fail(msg):
    print(f"rank {rank} FAIL: {msg}", flush=True)
    sys.exit(1)


def check(name, a, b, tol):
    err = float((a - b).abs().max())
    if not err < tol:
        fail(f"{name}: max difference {err:.3e} >= {tol:.0e}")


def make(n_layers, width, seed):
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n_layers)]


def loss_fn(y):
    return (y**2).sum() + y.sum()


def layer_parallel_vs_serial(comm, n_layers, cf, levels, relax):
    layers = make(n_layers, 5, seed=n_layers)
    lp = LayerParallel(copy.deepcopy(layers), T=1.5, cf=cf, max_levels=levels, relax=relax, comm=comm, **TIGHT)
    ref = LayerParallel(copy.deepcopy(layers), T=1.5, max_levels=1)  # serial reference, no MPI
    opt = torch.optim.SGD(lp.parameters(), lr=0.05, momentum=0.5)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.5)
    torch.manual_seed(123)
    x = torch.randn(4, 5)
    for step in range(3):
        xs = x.clone().requires_grad_(True)
        y_s = ref.serial(xs)
        opt_ref.zero_grad()
        loss_fn(y_s).backward()
        xp = x.clone().requires_grad_(True)
        y = lp(xp)
        opt.zero_grad()
        loss_fn(y).backward()
        check(f"forward (step {step})", y.detach(), y_s.detach(), 1e-12)
        check(f"input gradient (step {step})", xp.grad, xs.grad, 1e-10)
        for j in range(n_layers):
            if j not in lp.owned_layers:
                if j in lp.layers:
                    fail(f"layer {j} is not owned but registered on this rank")
                continue
            for p, q in zip(lp.layers[j].parameters(), ref.layers[j].parameters()):
                if p.grad is None:
                    fail(f"owned layer {j} has no gradient")
                check(f"gradient of layer {j} (step {step})", p.grad, q.grad, 1e-10)
        opt.step()
        opt_ref.step()
    owned = comm.allgather(list(lp.owned_layers))
    if sorted(j for part in owned for j in part) != list(range(n_layers)):
        fail(f"layers are not owned exactly once: {owned}")


def unconverged_equals_one_process(n_layers, cf, levels, relax, rows):
    """Default cycles: output and every gradient bitwise those of one process (the coarsest chain's
    single-state steps and the batched sweeps take the same operations)."""
    layers = make(n_layers, 5, seed=n_layers + 1)
    kw = dict(T=0.3, cf=cf, max_levels=levels, relax=relax)
    lp = LayerParallel(copy.deepcopy(layers), comm=world, **kw)
    one = LayerParallel(copy.deepcopy(layers), **kw)
    torch.manual_seed(5)
    x = torch.randn(rows, 5)
    xp, x1 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y, y1 = lp(xp), one(x1)
    loss_fn(y).backward()
    loss_fn(y1).backward()
    case = f"{n_layers} layers, cf {cf}, {levels} levels, {relax}, {rows} rows"
    check(f"unconverged forward vs one process ({case})", y.detach(), y1.detach(), 1e-300)
    check(f"unconverged input gradient vs one process ({case})", xp.grad, x1.grad, 1e-300)
    for j in lp.owned_layers:
        for p, q in zip(lp.layers[j].parameters(), one.layers[j].parameters()):
            if not torch.equal(p.grad, q.grad):
                fail(f"unconverged gradient of layer {j} differs from one process ({case})")


def grid_2x2():
    layer_comm, data_comm = mgrit.split_comm(world, 2)
    torch.manual_seed(5)
    layers = make(12, 4, seed=5)
    opening, closing = nn.Linear(3, 4), nn.Linear(4, 2)
    lp = LayerParallel(copy.deepcopy(layers), T=1.0, cf=2, max_levels=3, comm=layer_comm, data_comm=data_comm,
                       **TIGHT)
    model = nn.Sequential(copy.deepcopy(opening), lp, copy.deepcopy(closing))
    ref = nn.Sequential(copy.deepcopy(opening),
                        LayerParallel(copy.deepcopy(layers), T=1.0, max_levels=1), copy.deepcopy(closing))
    torch.manual_seed(99)
    X, Y = torch.randn(8, 3), torch.randn(8, 2)
    shard = slice(4 * data_comm.Get_rank(), 4 * data_comm.Get_rank() + 4)
    # the plain training loop, identical on every rank
    loss = ((model(X[shard]) - Y[shard]) ** 2).mean()
    loss.backward()
    allreduce_gradients(model, data_comm)
    ((ref(X) - Y) ** 2).mean().backward()
    check("opening layer gradient", model[0].weight.grad, ref[0].weight.grad, 1e-10)
    check("closing layer gradient", model[2].weight.grad, ref[2].weight.grad, 1e-10)
    for j in lp.owned_layers:
        for p, q in zip(lp.layers[j].parameters(), ref[1].layers[j].parameters()):
            check(f"grid gradient of layer {j}", p.grad, q.grad, 1e-10)
    # each data shard solves its own initial condition; the all-reduced sum equals a serial loop
    with torch.no_grad():
        total = data_comm.allreduce(float(model(X[shard]).sum()))
        serial_total = sum(float(ref(X[k : k + 4]).sum()) for k in (0, 4))
    if abs(total - serial_total) > 1e-10 * max(1.0, abs(serial_total)):
        fail(f"data all-reduce {total} != serial {serial_total}")
    # uneven shards (5 and 3 samples), weighted by their sizes: the full-batch mean gradient
    model.zero_grad()
    ref.zero_grad()
    shard = slice(0, 5) if data_comm.Get_rank() == 0 else slice(5, 8)
    ((model(X[shard]) - Y[shard]) ** 2).mean().backward()
    allreduce_gradients(model, data_comm, shard_size=shard.stop - shard.start)
    ((ref(X) - Y) ** 2).mean().backward()
    check("uneven shards: opening layer gradient", model[0].weight.grad, ref[0].weight.grad, 1e-10)
    for j in lp.owned_layers:
        for p, q in zip(lp.layers[j].parameters(), ref[1].layers[j].parameters()):
            check(f"uneven shards: gradient of layer {j}", p.grad, q.grad, 1e-10)
    grid_batch_norm_buffers(layer_comm, data_comm)
    grid_serial_switch(layer_comm, data_comm)
    grid_replicas_alike(layer_comm, data_comm)


def grid_replicas_alike(layer_comm, data_comm):
    """allreduce_gradients refuses replicas in different modes (one left in eval() after its validation)
    or with blocks built with another skip (their gradients averaged silently: 53% and 9% off); averages
    float16 gradients weighted by large shards without overflow, and sparse gradients (nn.Embedding)."""
    d = data_comm.Get_rank()
    layers = make(8, 4, seed=8)
    lp = LayerParallel(copy.deepcopy(layers), T=1.0, cf=2, max_levels=2, comm=layer_comm, data_comm=data_comm)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(8))
    if d == 1:
        lp.eval()
        with torch.no_grad():
            lp(x)  # (validation on this replica; it forgets train())
    lp(x).square().sum().backward()
    value_error_everywhere(lambda: allreduce_gradients(lp, data_comm), "in different modes", "a replica in eval()")
    lp.train()
    allreduce_gradients(lp, data_comm)  # (usable)
    odd = LayerParallel(copy.deepcopy(layers), T=1.0, cf=2, max_levels=2, comm=layer_comm, data_comm=data_comm,
                        skip=d == 0)
    odd(x).square().sum().backward()
    value_error_everywhere(lambda: allreduce_gradients(odd, data_comm),
                           "block (the module itself) (LayerParallel): skip True / False", "a replica with another skip")
    half = nn.Linear(2, 1).half()
    for p in half.parameters():
        p.grad = torch.full_like(p, 100.0)
    allreduce_gradients(half, data_comm, shard_size=1000)
    check("float16 gradient, shards of 1000", half.weight.grad.float(), torch.full((1, 2), 100.0), 1e-12)
    emb = nn.Embedding(6, 2, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(torch.arange(12.0).view(6, 2))
    ref = copy.deepcopy(emb)
    rows = torch.tensor([[0, 2], [2, 5]])
    emb(rows[d]).square().sum().backward()
    allreduce_gradients(emb, data_comm)
    ref(rows).square().sum().backward()
    if not emb.weight.grad.is_sparse or emb.weight.grad.sparse_dim() != 1:
        fail("a sparse gradient came back dense, or with other sparse dimensions than nn.Embedding's (1)")
    check("sparse gradient (the mean over the replicas)", emb.weight.grad.to_dense() * 2, ref.weight.grad.to_dense(),
          1e-15)
    # a row looked up with a gradient of zero (a masked padding token) stays in the sparse gradient, as in one
    # process (SparseAdam moves it on its momentum); the nonzero entries of the sum dropped it
    emb.zero_grad()
    ref.zero_grad()
    masks = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    (emb(rows[d]).sum(1) * masks[d]).sum().backward()
    allreduce_gradients(emb, data_comm)
    (ref(rows).sum(2) * masks).sum().backward()
    mine, want = emb.weight.grad.coalesce().indices(), ref.weight.grad.coalesce().indices()
    if sorted(set(mine[0].tolist())) != sorted(set(want[0].tolist())):
        fail(f"sparse gradient rows {mine[0].tolist()} against one process's {want[0].tolist()}")


def grid_serial_switch(layer_comm, data_comm):
    """SerialSwitch over a layer x data grid measures the whole batch (all data shards): its record equals
    one process's on the whole batch (same groups), bit for bit the same on every data replica, so the
    replicas take the same decisions (each measured its own shard, and could switch alone, before)."""
    from checks import one_rank_fails
    from propagators.torch import SerialSwitch, Switchable

    torch.manual_seed(8)
    layers = make(8, 4, seed=8)
    opening, closing = nn.Linear(3, 4), nn.Linear(4, 3)
    settings = dict(T=2.0, cf=2, max_levels=2, fwd_iters=1, bwd_iters=1)

    def build(**comms):
        return nn.Sequential(copy.deepcopy(opening), Switchable(LayerParallel(copy.deepcopy(layers), **settings,
                                                                              **comms)), copy.deepcopy(closing))

    model, ref = build(comm=layer_comm, data_comm=data_comm), build()
    torch.manual_seed(9)
    X, Y = torch.randn(8, 3), torch.randint(0, 3, (8,))
    d = data_comm.Get_rank()
    loss = nn.functional.cross_entropy
    loss(model(X[4 * d: 4 * d + 4]), Y[4 * d: 4 * d + 4]).backward()
    allreduce_gradients(model, data_comm)
    rec = SerialSwitch(model, loss, groups=4).measure(X[4 * d: 4 * d + 4], Y[4 * d: 4 * d + 4])  # 2 per shard
    loss(ref(X), Y).backward()
    want = SerialSwitch(ref, loss, groups=4).measure(X, Y)
    for key in ("error", "noise", "grad_norm"):
        if not abs(rec[key] - want[key]) <= 1e-10 * abs(want[key]):
            fail(f"grid SerialSwitch {key} {rec[key]!r} != one process on the whole batch {want[key]!r}")
    if not want["error"] > 1e-3:
        fail(f"grid SerialSwitch: one cycle gave error {want['error']:.2e}; the check needs an inexact gradient")
    others = data_comm.allgather(tuple(rec[k] for k in ("error", "noise", "grad_norm")))
    if others[0] != others[1]:
        fail(f"grid SerialSwitch: the data replicas measured different records {others}")
    # a one-sample shard is one group of the whole batch (3 groups in all)
    rows = slice(0, 1) if d == 1 else slice(0, 4)
    rec = SerialSwitch(model, loss, groups=4).measure(X[rows], Y[rows])
    others = data_comm.allgather(tuple(rec[k] for k in ("error", "noise", "grad_norm")))
    if others[0] != others[1] or not all(map(math.isfinite, others[0])):
        fail(f"grid SerialSwitch, shards of 4 and 1 samples: records {others}")
    # what must agree is compared in the measurement's handshake: every rank raises alike, nothing is sent,
    # and the communicator stays usable (a parameter frozen on one data rank; the world as data communicator)
    for case in ("frozen", "world"):
        frozen = case == "frozen" and d == 1
        model[0].bias.requires_grad_(not frozen)
        comm = world if case == "world" else data_comm
        try:
            SerialSwitch(model, loss, groups=4, data_comm=comm).measure(X[4 * d: 4 * d + 4], Y[4 * d: 4 * d + 4])
        except ValueError as exc:
            if "arguments of SerialSwitch.measure" not in str(exc) or "data communicator" not in str(exc):
                fail(f"grid SerialSwitch, {case}: unclear error {exc}")
        else:
            fail(f"grid SerialSwitch measured with {case} (the data ranks' layouts differ)")
        model[0].bias.requires_grad_(True)
    model.zero_grad()
    loss(model(X[4 * d: 4 * d + 4]), Y[4 * d: 4 * d + 4]).backward()
    allreduce_gradients(model, data_comm)  # (usable after the refused measurements)
    # a data rank whose loss fails in the measurement: the other data rank raises instead of hanging
    def bad_loss(out, target):
        if d == 1:
            raise RuntimeError("this data rank's loss failed")
        return loss(out, target)

    one_rank_fails("grid SerialSwitch, a loss failing on data rank 1",
                   lambda: SerialSwitch(model, bad_loss, groups=4).measure(X[4 * d: 4 * d + 4], Y[4 * d: 4 * d + 4]),
                   d == 1, RuntimeError, "loss failed")


def switch_beside_other_blocks(comm):
    """SerialSwitch on the layer ranks of a model with a bare (converged) LayerParallel beside its
    Switchable: the bare block's parameters are each rank's own layers, summed over the ranks like the
    Switchable's (they were counted as if every rank held them: each rank measured another error, and a
    threshold between them switched one rank alone); the same after load_state_dict(assign=True), which
    replaces every parameter; and a Switchable with warm_start switched to serial mode and back gives the
    one-process results (on several ranks its serial pass replaced the warm-start trajectory)."""
    from propagators.torch import SerialSwitch, Switchable

    torch.manual_seed(11)
    first, second = make(16, 5, seed=11), make(16, 5, seed=12)
    opening, closing = nn.Linear(3, 5), nn.Linear(5, 3)

    def build(c):
        lp1 = LayerParallel(copy.deepcopy(first), T=2.0, cf=2, max_levels=3, fwd_iters=1, bwd_iters=1, comm=c)
        lp2 = LayerParallel(copy.deepcopy(second), T=2.0, cf=2, max_levels=3, fwd_tol=1e-13, bwd_tol=1e-13, comm=c)
        return nn.Sequential(copy.deepcopy(opening), Switchable(lp1), lp2, copy.deepcopy(closing))

    torch.manual_seed(12)
    X, Y = torch.randn(8, 3), torch.randint(0, 3, (8,))
    loss = nn.functional.cross_entropy
    ref = build(None)
    loss(ref(X), Y).backward()
    want = SerialSwitch(ref, loss, groups=4).measure(X, Y)
    model = build(comm)
    switch = SerialSwitch(model, loss, groups=4)
    for case in ("built", "assigned"):
        if case == "assigned":  # every parameter replaced after the switch was built
            model.load_state_dict(copy.deepcopy(model.state_dict()), assign=True)
        model.zero_grad()
        loss(model(X), Y).backward()
        rec = switch.measure(X, Y)
        for key in ("error", "noise", "grad_norm"):
            if not abs(rec[key] - want[key]) <= 1e-10 * abs(want[key]):
                fail(f"SerialSwitch beside a bare block ({case}): {key} {rec[key]!r} != one process {want[key]!r}")
    if not want["error"] > 1e-3:
        fail(f"SerialSwitch beside a bare block: error {want['error']:.2e}; the check needs an inexact gradient")
    # the switch's checkpoint holds the parallel cycles: taken in serial mode here (a converged solve, the
    # exact cycles set), it loads on one process with the same mode and cycles, and back
    block = model[1]
    block.mode = "serial"
    state = switch.state_dict()
    if state["blocks"][0]["mode"] != "serial" or state["blocks"][0]["fwd_iters"] != 1:
        fail(f"SerialSwitch.state_dict in serial mode on {comm.Get_size()} ranks: {state['blocks']}")
    ref_switch = SerialSwitch(ref, loss, groups=4)
    ref_switch.load_state_dict(state)
    if (ref[1].mode, ref[1].lp.fwd_iters, ref[1].lp.bwd_iters) != ("serial", 1, 1):
        fail(f"a checkpoint of {comm.Get_size()} ranks on one process: {ref[1].mode}, {ref[1].lp.fwd_iters}")
    block.mode = "parallel"
    switch.load_state_dict(ref_switch.state_dict())
    if block.mode != "serial" or block.lp.fwd_iters != block.exact_iterations:
        fail(f"a one-process checkpoint on {comm.Get_size()} ranks: {block.mode}, {block.lp.fwd_iters}")
    block.mode = "parallel"
    if (block.lp.fwd_iters, block.lp.bwd_iters) != (1, 1):
        fail(f"a one-process checkpoint on {comm.Get_size()} ranks: parallel cycles {block.lp.fwd_iters}")
    # layer ranks that measure at different steps: every rank raises, and the message names the measurement
    # (it said that the forward passes' arguments differ)
    odd = SerialSwitch(model, loss, groups=4, every=1 if comm.Get_rank() == 0 else 2)
    try:
        for _ in range(3):  # (the second update measures on rank 0 only; the others train on meanwhile)
            model.zero_grad()
            loss(model(X), Y).backward()
            odd.update(X, Y)
    except ValueError as exc:
        if "in SerialSwitch.measure (every layer rank must measure at the same steps" not in str(exc):
            fail(f"SerialSwitch measuring at different steps: unclear error {exc}")
    else:
        fail("SerialSwitch measuring at different steps on the layer ranks: no error")
    model.zero_grad()
    loss(model(X), Y).backward()  # (usable afterwards)

    def warm_run(c):
        torch.manual_seed(13)
        block = Switchable(LayerParallel(copy.deepcopy(first), T=2.0, cf=2, max_levels=3, warm_start=True, comm=c))
        opt = torch.optim.SGD(block.parameters(), lr=0.05)
        outs = []
        for mode in ("parallel", "parallel", "serial", "parallel", "parallel"):
            block.mode = mode
            opt.zero_grad()
            y = block(torch.randn(6, 5))
            y.square().sum().backward()
            opt.step()
            outs.append(y.detach())
        return outs

    for k, (a, b) in enumerate(zip(warm_run(comm), warm_run(None))):
        check(f"warm start around a serial-mode step, step {k}", a, b, 1e-10)


def grid_batch_norm_buffers(layer_comm, data_comm):
    """``allreduce_gradients(..., buffers=True)``: every data replica ends with the average of the running
    statistics that each shard's serial network would have."""
    torch.manual_seed(6)
    layers = [nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh()) for _ in range(8)]
    lp = LayerParallel(copy.deepcopy(layers), T=1.0, cf=2, max_levels=2, comm=layer_comm, data_comm=data_comm,
                       **TIGHT)
    refs = [LayerParallel(copy.deepcopy(layers), T=1.0, max_levels=1) for _ in range(2)]
    torch.manual_seed(7)
    X = torch.randn(8, 4) * 2 + 1
    d = data_comm.Get_rank()
    lp(X[4 * d: 4 * d + 4]).square().mean().backward()
    allreduce_gradients(lp, data_comm, buffers=True)
    for k, ref in enumerate(refs):
        ref(X[4 * k: 4 * k + 4]).square().mean().backward()
    for j in lp.owned_layers:
        for name in ("running_mean", "running_var"):
            mine = getattr(lp.layers[j][1], name)
            want = sum(getattr(ref.layers[j][1], name) for ref in refs) / 2
            check(f"grid {name} of layer {j}", mine, want, 1e-10)
            other = data_comm.allgather(mine.clone())
            if not torch.equal(other[0], other[1]):
                fail(f"grid {name} of layer {j} differs between the data replicas")
    # a review: a replica with an empty shard (no forward) left its num_batches_tracked a step behind
    lp.zero_grad()
    if d == 1:
        lp(X[:4]).square().mean().backward()
    allreduce_gradients(lp, data_comm, shard_size=4 if d == 1 else 0, buffers=True)
    counts = data_comm.allgather([int(lp.layers[j][1].num_batches_tracked) for j in lp.owned_layers])
    if counts[0] != counts[1] or any(c != 2 for c in counts[0]):
        fail(f"num_batches_tracked after a step with an empty shard on one replica: {counts} (want 2 on both)")
    # the layer communicator (or the world) passed as the data one: an error at build, naming split_comm
    for what, wrong in (("the layer communicator", layer_comm), ("the world", world)):
        try:
            LayerParallel(copy.deepcopy(layers), T=1.0, cf=2, comm=layer_comm, data_comm=wrong)
        except ValueError as exc:
            if "mgrit.split_comm" not in str(exc):
                fail(f"{what} as data_comm: unexpected message: {exc}")
        else:
            fail(f"{what} as data_comm was accepted")
    # and to allreduce_gradients: its error names the possibility
    try:
        allreduce_gradients(lp, layer_comm)
    except ValueError as exc:
        if "not the data communicator" not in str(exc):
            fail(f"allreduce_gradients over the layer communicator: unexpected message: {exc}")
    else:
        fail("allreduce_gradients over the layer communicator was accepted")


def warm_start_warns_alike(comm):
    """Strongly decaying states, warm start on the same batch, fixed cycles: once the solves converge to rounding
    the "made no progress" warning is left out, and every rank decides alike (the rounding floor came from each
    rank's own states: the rank of the small late states warned alone, and with warnings as errors it left the
    pass while the others went on to the backward pass)."""
    import warnings

    torch.manual_seed(1)
    layers = [nn.Linear(4, 4) for _ in range(32)]
    with torch.no_grad():
        for layer in layers:
            layer.weight.copy_(-12.0 * torch.eye(4) + 0.1 * torch.randn(4, 4))
            layer.bias.zero_()
    lp = LayerParallel(layers, T=2.0, cf=4, max_levels=3, fwd_iters=1, bwd_iters=1, skip=False, warm_start=True,
                       comm=comm).requires_grad_(False)
    x = torch.randn(3, 4)
    counts = []
    for _ in range(12):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lp(x)
        counts.append(sum("made no progress" in str(w.message) for w in caught))
    every = comm.allgather(counts)
    if any(c != every[0] for c in every):
        fail(f"the ranks warn differently, pass by pass: {every}")
    if sum(counts[-4:]):
        fail(f"warnings once the solves converged to rounding: {counts}")


def warm_start_after_a_load_on_some_ranks(comm):
    """Weights loaded on rank 0 only (the same weights: only its warm trajectory goes): with skip the ranks'
    settings "differed" (an error naming fwd_iters, skip, ...), without it they mixed a warm and a cold guess (the
    output matched neither one-process run). Every rank now starts cold when one does."""
    for skip in (True, False):
        torch.manual_seed(0)
        layers = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(16)]
        kw = dict(T=1.0, cf=4, max_levels=2, fwd_iters=1, warm_start=True, skip=skip)
        x = torch.randn(3, 4)
        lp = LayerParallel(copy.deepcopy(layers), comm=comm, **kw).requires_grad_(False)
        cold = LayerParallel(copy.deepcopy(layers), **kw).requires_grad_(False)
        lp(x)
        if comm.Get_rank() == 0:
            lp.load_state_dict(lp.state_dict())
        check(f"a pass after a load on rank 0 only (skip {skip}) against one process's cold pass", lp(x + 0.1),
              cold(x + 0.1), 1e-15)


def swapped_samples_are_another_input(comm):
    """The last rank's batch of 256 samples of 64 in float32 with two neighbouring samples swapped: the sums of
    magnitudes and positions moved by less than their tolerance and the pass went on with rank 0's batch; the
    sum with pseudo-random signs tells it (ValueError on every rank)."""
    for batch, width, k in ((256, 64, 100), (1024, 1, 1)):  # (the second: samples whose +-1 weights tied)
        torch.manual_seed(4)
        lp = LayerParallel([nn.Sequential(nn.Linear(width, width), nn.Tanh()).float() for _ in range(8)], cf=2,
                           comm=comm)
        x = torch.randn(batch, width, generator=torch.Generator().manual_seed(5), dtype=torch.float32)
        if comm.Get_rank() == comm.Get_size() - 1:
            x[[k, k + 1]] = x[[k + 1, k]]
        value_error_everywhere(lambda: lp(x), "the input of rank",
                               f"two neighbouring samples of {width} swapped on one rank")


def cuda_ranks():
    """The same comparison with the states and layers on the GPU (staged or CUDA-aware sends)."""
    layers = make(16, 5, seed=3)
    lp = LayerParallel(copy.deepcopy(layers), T=1.0, cf=2, max_levels=3, comm=world, **TIGHT).cuda()
    ref = LayerParallel(copy.deepcopy(layers), T=1.0, max_levels=1)
    torch.manual_seed(7)
    x = torch.randn(4, 5)
    xs = x.clone().requires_grad_(True)
    loss_fn(ref.serial(xs)).backward()
    xp = x.cuda().requires_grad_(True)
    y = lp(xp)
    loss_fn(y).backward()
    check("cuda forward", y.detach().cpu(), ref.serial(x).detach(), 1e-12)
    check("cuda input gradient", xp.grad.cpu(), xs.grad, 1e-10)
    for j in lp.owned_layers:
        for p, q in zip(lp.layers[j].parameters(), ref.layers[j].parameters()):
            check(f"cuda gradient of layer {j}", p.grad.cpu(), q.grad, 1e-10)


try:
    if len(sys.argv) > 1 and sys.argv[1] == "cuda":
        cuda_ranks()
    elif len(sys.argv) > 1 and sys.argv[1] == "grid":
        grid_2x2()
    else:
        for n_layers, cf, levels, relax in [(16, 2, 3, ("F", "FCF")), (21, 4, 2, "FCF"), (13, 2, 4, "F")]:
            layer_parallel_vs_serial(world, n_layers, cf, levels, relax)
        for n_layers, cf, levels, relax, rows in [(31, 3, 2, "F", 9), (31, 2, 4, "FCF", 3), (50, 4, 3, "F", 7)]:
            unconverged_equals_one_process(n_layers, cf, levels, relax, rows)
        switch_beside_other_blocks(world)
        warm_start_warns_alike(world)
        warm_start_after_a_load_on_some_ranks(world)
        swapped_samples_are_another_input(world)
except SystemExit:
    raise
except BaseException as exc:  # report, then fail this rank
    fail(f"{type(exc).__name__}: {exc}")
print(f"rank {rank} OK", flush=True)
