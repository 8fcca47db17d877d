"""MultiStage on several ranks against the serial network (run under mpiexec).

Usage: mpiexec -n P python multistage_ranks.py [grid]
Checks on every rank, in float64 against plain serial autograd (1e-9 relative):

* a two-stage residual CNN (stem, LP stage, strided-conv transition, LP stage,
  head) and a three-stage network of given LayerParallel modules that starts
  and ends with a stage: output, input gradient, every parameter gradient
  (replicated ones on every rank; all of them gathered on rank 0, each exactly
  once) over optimizer steps; replicated pieces bitwise identical on every rank
  after each step; ``to_serial`` equals the serial network after training;
  ``load_serial`` into a differently initialised model reproduces the output;
* a replicated piece that raises on one rank makes every rank raise within
  seconds, and the next step works;
* with ``grid`` instead (P even): a (P/2 layer) x (2 data) grid with sharded batches
  and ``allreduce_gradients`` gives the full-batch gradients.

Prints "rank r OK" on success and exits 1 with a message otherwise.
"""
import copy
import sys
import time

import torch
from torch import nn

from checks import fail, rank, size, world
import mgrit
from propagators.torch import LayerParallel, MultiStage, allreduce_gradients, residual_cnn

torch.set_default_dtype(torch.float64)
TIGHT = dict(fwd_iters=40, bwd_iters=40, fwd_tol=1e-14, bwd_tol=1e-14)
REL = 1e-9



def rel(a, b) -> float:
    return float((a - b).detach().abs().max()) / max(1e-300, float(b.detach().abs().max()))


def check(name, a, b):
    if a is None or b is None:
        if a is not None or b is not None:
            fail(f"{name}: one gradient is None, the other is not")
        return
    err = rel(a, b)
    if not err < REL:
        fail(f"{name}: relative difference {err:.3e} >= {REL:.0e}")


def loss_fn(y):
    return (y**2).sum() + y.sum()


def compare(par, ref, x, step):
    """One step of the same training loop on both; every comparison this rank can make."""
    xp, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y = par(xp)
    loss_fn(y).backward()
    ys = ref(xs)
    loss_fn(ys).backward()
    check(f"output (step {step})", y, ys)
    check(f"input gradient (step {step})", xp.grad, xs.grad)
    serial = dict(ref.named_parameters())
    local = dict(par.named_parameters())  # replicated pieces and this rank's own stage layers
    for n, p in local.items():
        check(f"local gradient of {n} (step {step})", p.grad, serial[n].grad)
    grads = par.gather_gradients(root=0)
    if rank == 0:
        if list(grads) != list(serial):
            fail(f"gathered gradients have keys {list(grads)[:6]}..., the serial network {list(serial)[:6]}...")
        for n, g in grads.items():
            check(f"gathered gradient of {n} (step {step})", g, serial[n].grad)
    elif grads is not None:
        fail("gather_gradients(root=0) returned something on a rank other than 0")
    # every stage parameter is held by exactly one rank
    owners = world.allgather([n for n in local if not n.startswith(tuple(f"{i}." for i, _ in par.replicated))])
    held = sorted(n for part in owners for n in part)
    stage_names = sorted(n for n in serial if not n.startswith(tuple(f"{i}." for i, _ in par.replicated)))
    if held != stage_names:
        fail(f"stage parameters are not held exactly once: {len(held)} held, {len(stage_names)} exist")
    par.check_replicas(grads=True)


def train_and_compare(par, ref, x, steps=2):
    opt = torch.optim.Adam(par.parameters(), lr=1e-2)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for step in range(steps):
        opt.zero_grad()
        opt_ref.zero_grad()
        compare(par, ref, x, step)
        opt.step()
        opt_ref.step()
        par.check_replicas()  # replicated parameters are still bitwise identical on every rank
    with torch.no_grad():
        check("output after the optimizer steps", par(x), ref(x))
    net = par.to_serial(root=0)
    if rank == 0:
        sd, sd_ref = net.state_dict(), ref.state_dict()
        if list(sd) != list(sd_ref):
            fail("to_serial() has other state-dict keys than the serial network")
        for k in sd:
            check(f"to_serial {k}", sd[k], sd_ref[k])
    elif net is not None:
        fail("to_serial(root=0) returned a network on a rank other than 0")


def cnn_case():
    kw = dict(channels=2, n_layers=(8, 7), cf=2, max_levels=3, **TIGHT)
    par = residual_cnn(comm=world, seed=3, **kw)
    ref = residual_cnn(comm=None, seed=3, **kw).to_serial()  # built independently, on one rank
    torch.manual_seed(11)
    x = torch.randn(3, 1, 8, 8)
    train_and_compare(par, ref, x)
    # checkpoint: a full serial state dict loaded into a differently initialised model
    other = residual_cnn(comm=world, seed=4, **kw)
    other.load_serial(ref.state_dict())
    with torch.no_grad():
        check("output after load_serial", other(x), ref(x))
    return par, ref, x


def three_stage_case():
    """Given LayerParallel modules (not Stage specs), a stage first and last, three stages."""
    torch.manual_seed(21)
    widths = [3, 4, 2]
    blocks = [[nn.Sequential(nn.Linear(w, w), nn.Tanh()) for _ in range(n)] for w, n in zip(widths, (9, 6, 5))]
    glue = [nn.Linear(3, 4), nn.Sequential(nn.Tanh(), nn.Linear(4, 2))]

    def build(comm):
        lps = [LayerParallel(copy.deepcopy(b), T=0.8, cf=2, max_levels=3, comm=comm, **TIGHT) for b in blocks]
        return MultiStage([lps[0], copy.deepcopy(glue[0]), lps[1], copy.deepcopy(glue[1]), lps[2]])

    par, ref = build(world), build(None).to_serial()
    torch.manual_seed(22)
    train_and_compare(par, ref, torch.randn(5, 3))


class FailOn(nn.Module):
    """The identity, except that it raises on one rank while armed."""

    def __init__(self, bad):
        super().__init__()
        self.bad, self.armed = bad, False

    def forward(self, x):
        if self.armed and rank == self.bad:
            raise RuntimeError("injected failure in a replicated piece")
        return x


def failure_case(par, ref, x):
    bad = size - 1
    trap = FailOn(bad)
    net = MultiStage([trap, *par], comm=world)  # the same pieces behind a piece that may fail
    trap.armed = True
    t0 = time.perf_counter()
    try:
        net(x)
    except mgrit.RemoteRankError as exc:
        if rank == bad or f"rank {bad}" not in str(exc):
            fail(f"unexpected RemoteRankError: {exc}")
    except RuntimeError as exc:
        if rank != bad or "injected" not in str(exc):
            fail(f"unexpected {type(exc).__name__}: {exc}")
    else:
        fail("the failure of a replicated piece on one rank did not raise here")
    if time.perf_counter() - t0 > 10:
        fail("the failure took more than 10 s to reach this rank")
    trap.armed = False
    with torch.no_grad():
        check("output after a failure", net(x), ref(x))


def grid_case():
    layer_size = size // 2
    layer_comm, data_comm = mgrit.split_comm(world, layer_size)
    kw = dict(channels=2, n_layers=(6, 6), transition="pool", cf=2, max_levels=2, **TIGHT)
    par = residual_cnn(comm=layer_comm, data_comm=data_comm, seed=7, **kw)
    ref = residual_cnn(comm=None, seed=7, **kw).to_serial()
    torch.manual_seed(31)
    X, labels = torch.randn(7, 1, 8, 8), torch.randint(0, 10, (7,))
    d = data_comm.Get_rank()
    shard = slice(0, 4) if d == 0 else slice(4, 7)  # uneven shards, weighted by their sizes
    opt = torch.optim.SGD(par.parameters(), lr=0.1, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        opt.zero_grad()
        opt_ref.zero_grad()
        nn.functional.cross_entropy(par(X[shard]), labels[shard]).backward()
        allreduce_gradients(par, data_comm, shard_size=shard.stop - shard.start)
        nn.functional.cross_entropy(ref(X), labels).backward()
        serial = dict(ref.named_parameters())
        for n, p in par.named_parameters():
            check(f"grid gradient of {n} (step {step})", p.grad, serial[n].grad)
        opt.step()
        opt_ref.step()
        par.check_replicas(grads=True)
    with torch.no_grad():
        check("grid output after the optimizer steps", par(X[shard]), ref(X[shard]))


def equals_one_rank(name, net, one, x):
    """``net`` (on every rank) and ``one`` (the same network on this rank alone): output, input gradient and the
    gradients of the parameters this rank holds."""
    xs, x1 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y, y1 = net(xs), one(x1)
    y.square().sum().backward()
    y1.square().sum().backward()
    check(f"{name}: output", y, y1)
    check(f"{name}: input gradient", xs.grad, x1.grad)
    mine = dict(net.named_parameters())
    for n, q in one.named_parameters():
        if n in mine and q.grad is not None and mine[n].grad is not None:
            check(f"{name}: gradient {n}", mine[n].grad, q.grad)


class Table(nn.Module):
    """Constant tables (as a rotary embedding's), which no pass changes."""

    def __init__(self, w):
        super().__init__()
        k = torch.arange(w, dtype=torch.get_default_dtype())
        self.register_buffer("cos", torch.cos(k / w), persistent=False)
        self.register_buffer("sin", torch.sin(k / w), persistent=False)

    def forward(self, u):
        return u * self.cos + u.flip(-1) * self.sin


class Tabled(nn.Module):
    def __init__(self, table):
        super().__init__()
        self.lin, self.table = nn.Linear(4, 4), table

    def forward(self, u):
        return torch.tanh(self.lin(self.table(u)))


def tied_pieces_case():
    """A parameter shared by a replicated piece and a stage layer: on several ranks only the ranks that hold
    the layer gave the replicated piece that layer's gradient (6.61 on rank 0, 6.27 on rank 1), so the
    replicas drifted apart. Now a ValueError on every rank; a tie between two replicated pieces is fine, and
    stays a tie in to_serial (gather_gradients lists it once)."""
    from propagators.torch import Stage

    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    layers = [nn.Sequential(shared, nn.Tanh())] + [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(5)]
    try:
        MultiStage([shared, Stage(layers), nn.Linear(4, 2)], cf=2, comm=world)
        fail("a parameter tied between a replicated piece and a stage layer: no error")
    except ValueError as exc:
        if "pieces 0 and 1 share a parameter" not in str(exc):
            fail(f"tied pieces: unexpected ValueError: {exc}")
    frozen = nn.Linear(4, 4).requires_grad_(False)  # a frozen table in the stem and a stage layer: allowed
    layers = [nn.Sequential(frozen, nn.Tanh())] + [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(5)]
    net = MultiStage([frozen, Stage(layers), nn.Linear(4, 2)], cf=2, comm=world)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(3))  # (the same on every rank)
    net(x).sum().backward()
    frozen.requires_grad_(True)  # unfrozen after the build: the ranks' gradients of it would differ (by 0.19)
    try:
        net(x)
        fail("a frozen parameter shared with a stage layer, unfrozen after the build: no error")
    except ValueError as exc:
        if "shared with a stage layer and was frozen" not in str(exc):
            fail(f"unfrozen tie: unexpected ValueError: {exc}")
    # the frozen tie in any stage layer, also one that a rank holds as a halo copy: the halo exchange wrote the
    # owner's (equal) values into it in place, so the stem's saved tensor changed version and that rank's
    # backward raised autograd's "modified by an inplace operation"; output and gradients equal one rank's
    for j in range(5):
        def build(c, j=j):
            torch.manual_seed(0)
            tied = nn.Linear(4, 4)
            tied.weight.requires_grad_(False)

            def layer(i):
                torch.manual_seed(50 + i)
                m = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
                if i == j:
                    m[0].weight = tied.weight
                return m
            return MultiStage([tied, Stage(layer, 5), nn.Linear(4, 2)], comm=c, cf=2, **TIGHT)
        equals_one_rank(f"frozen tie in layer {j}", build(world), build(None), x)
    # a buffer shared so (BatchNorm without parameters in a stage layer and the head): its running statistics
    # were updated on the ranks holding that layer only, and eval outputs differed between ranks (2e-2)
    bn = nn.BatchNorm1d(4, affine=False)
    layers = [nn.Sequential(nn.Linear(4, 4), bn, nn.Tanh())] + [nn.Sequential(nn.Linear(4, 4), nn.Tanh())
                                                               for _ in range(5)]
    try:
        MultiStage([nn.Linear(4, 4), Stage(layers), nn.Sequential(bn, nn.Linear(4, 2))], cf=2, comm=world)
        fail("a buffer shared by a replicated piece and a stage layer: no error")
    except ValueError as exc:
        if "pieces 1 and 2 share a buffer" not in str(exc):
            fail(f"shared buffer: unexpected ValueError: {exc}")
    # a constant buffer so shared (a table no pass updates) is fine: the output and gradients equal one rank's
    for where in ("stem", "two stages"):
        def build(c, where=where):
            torch.manual_seed(2)
            table = Table(4)

            def layer(i):
                torch.manual_seed(60 + i)
                return Tabled(table)
            stage = Stage(layer, 5)
            pieces = [nn.Sequential(nn.Linear(4, 4), table), stage, nn.Linear(4, 2)] if where == "stem" else \
                [nn.Linear(4, 4), stage, nn.Tanh(), Stage(layer, 4), nn.Linear(4, 2)]
            return MultiStage(pieces, comm=c, cf=2, **TIGHT)
        equals_one_rank(f"a constant buffer shared ({where})", build(world), build(None), x)
    head = nn.Linear(4, 4)
    par = MultiStage([head, Stage(lambda i: nn.Sequential(nn.Linear(4, 4), nn.Tanh()), 6), head], cf=2, comm=world,
                     **TIGHT)
    par(x).sum().backward()
    par.check_replicas(grads=True)
    # that tie survives to_serial (on several ranks each replicated piece was copied on its own: the copy's
    # two pieces were untied, its gradients 1.4 apart), and gather_gradients lists the shared gradient once,
    # under its first name, as to_serial().named_parameters() does
    ser = par.to_serial(0)
    grads = par.gather_gradients(0)
    if rank == 0:
        if ser[0].weight is not ser[2].weight:
            fail("to_serial untied a parameter two replicated pieces share")
        if list(grads) != [n for n, _ in ser.named_parameters()]:
            fail(f"gather_gradients keys {list(grads)[:3]}... are not to_serial's {[n for n, _ in ser.named_parameters()][:3]}...")
        xs = x.clone()
        ser(xs).sum().backward()
        for n, q in ser.named_parameters():
            check(f"tied pieces: gathered gradient {n}", grads[n], q.grad)


try:
    if len(sys.argv) > 1 and sys.argv[1] == "grid":
        grid_case()
    else:
        failure_case(*cnn_case())
        three_stage_case()
        tied_pieces_case()
except SystemExit:
    raise
except BaseException as exc:  # report, then fail this rank
    fail(f"{type(exc).__name__}: {exc}")
print(f"rank {rank} OK", flush=True)
