"""Layer-parallel MGRIT against layer-wise model parallelism and pipeline parallelism, same ranks.

The same deep residual network (``N`` layers ``u <- u + h tanh(Linear(u))``, width
``w``, ``h = 1/N``), the same weights and batch, one training step (forward +
backward of ``loss = sum(u_N ** 2)``) on ``P`` ranks, four ways, all over
torch.distributed (gloo; with ``--device cuda`` NCCL, one GPU per rank), one engine for all:

* ``model parallel``: rank p holds layers [pN/P, (p+1)N/P); the activation is sent
  rank to rank (``dist.send``/``dist.recv``), autograd within each rank's block,
  and the gradient of the block input is sent back in reverse.
* ``GPipe`` and ``1F1B``: PyTorch's own ``torch.distributed.pipelining``
  (``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B``, ``scale_grads=False``)
  on the same split, with ``--microbatches`` micro-batches.
* ``LayerParallel``: ``propagators.torch.LayerParallel(comm=dist.group.WORLD)``,
  cf 4, 4 levels, 2 forward / 1 backward cycles (its defaults, skip on).

Per method it prints the wall time of one step (the slowest rank's, median of
``--repeat`` interleaved repetitions: A B C D A B C D ...), the gradient error
against serial autograd (max over all parameters of |g - g_serial|, divided by
max |g_serial|; float32) and the memory per rank, twice: *counted*, bytes of
parameters the rank holds plus the peak bytes kept for the backward pass (for the
autograd methods: the live tensors saved by autograd, tracked with
``torch.autograd.graph.saved_tensors_hooks``, unique storages; for LayerParallel:
its stored states, one per point it owns on every level, forward and adjoint,
plus owned and halo parameters); and *measured*, the parameters plus the most
bytes of tensors alive at once during the first two steps after construction
(everything: saved tensors, gradients, work arrays, the solver's stacks and caches;
on the CPU from torch's allocation and free events, ``torch.profiler`` with
``profile_memory=True``, on a GPU the CUDA allocator's peak).

Then a critical-path model predicts all of them for P = 8 .. 512 from measured
per-layer forward/backward costs and the measured message time. Its probes run
in the same interleaved loop as the four methods (same processes, same phase of
the machine, whose speed drifts by tens of percent between launches and whose
two cores slow each other down by up to 1.9x when both compute): the *serial
reference* (each rank's own block forward + backward at batch B, no message), run
by all ranks at once and, on P > 1, by one rank after the other; LayerParallel of
the first half of the layers on one process (no message), run by all ranks at once;
the two schedules with one layer per stage; and LayerParallel with trivial layers
(width 1, batch 1), on all P ranks and, the first half, on one process each.
From them, relative to 1 rank, measured on 2 ranks and taken as constant for
more: ``a`` (blocks run in turn), ``s`` (blocks run at once) and ``v``
(LayerParallel's half-net work run at once: its batched tensors, N/2 states per
level, slow down differently from the reference's blocks when both cores
compute); ``c`` is the reference's time per layer on 1 rank:

* model parallel: ``a N c + 2 (P - 1) msg(B)`` plus what the measured 1-rank step has on
  top of the reference (the loss, bookkeeping);
* GPipe / 1F1B with m micro-batches: ``(m + P - 1) (N/P f_mb + c + o)`` for the
  forward plus the same with ``b_mb`` for the backward, where ``f_mb``, ``b_mb`` are the
  per-layer costs at the micro-batch size (measured after the timed steps, brought to the
  reference's level, times ``(P a + (m - 1) s) / (m + P - 1)``: the fill and drain ticks
  run one stage at a time, the others all at once), ``o`` is the schedule's own overhead
  per stage pass (the schedule with a 1-layer stage on 1 rank) and ``c`` its message cost
  per stage pass (the same on 2 ranks, minus ``o``); in the prediction table m is chosen
  best among the powers of two <= B;
* LayerParallel: on P > 1, one rank's work plus a distributed overhead per step. The
  work at P = 2 is measured directly (the half-net probe at once on 2 ranks) and scaled
  to P ranks by ``mgrit.model.predict``'s critical-path work of the forward and adjoint
  solves with measured call costs (as benchmarks/layer_parallel.py) plus the parameter
  VJP over N/P layers, relative to P = 2's. The overhead is the trivial-layer probe's
  2-rank time minus its own half-net at once (the probe is the same for every w and B,
  so its medians over all runs of that N), taken as constant in P, plus the ping-pong
  latency of LayerParallel's communicator for every critical-path message beyond P = 2's.
  On 1 rank the same predicted work times its measured/modelled ratio.

No constant is fitted to the N-layer P = 2 times: those are the check. It is
printed twice: on medians (every constant's median over the launches against the
times' medians) and launch by launch (round j's P = 2 times against the model
from round j's own P = 1 and P = 2 probes, which ran in the same minutes; per
cell the median over the rounds), since a launch's processes may run tens of
percent faster or slower than another's and the medians of the two sides need not
come from the same launch.

Run (do not run it under a launcher: it starts its own gloo ranks)::

    .venv/bin/python benchmarks/vs_model_parallel.py            # ~10 minutes on 2 cores
    .venv/bin/python benchmarks/vs_model_parallel.py --quick    # smoke run, < 1 minute
    python3 benchmarks/vs_model_parallel.py --device cuda --ranks 1,2   # on 2 GPUs (benchmarks/gpu.py step 4)

The ``--device cuda`` path (NCCL, states and layers on the GPUs, timings with
``torch.cuda.synchronize``) has run on one GPU only (``--ranks 1``, an H200, through
benchmarks/gpu.py, 2026-12-04); on 2 GPUs (NCCL between them) it has not run yet.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from _cli import end_worker, nonnegative_int, positive_int, positive_ints  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

METHODS = ["model parallel", "GPipe", "1F1B", "LayerParallel"]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=positive_ints, default="256,1024")
    p.add_argument("--widths", type=positive_ints, default="16,64")
    p.add_argument("--batches", type=positive_ints, default="16,256")
    p.add_argument("--ranks", type=positive_ints, default="1,2")
    p.add_argument("--microbatches", type=positive_int, default=4)
    p.add_argument("--repeat", type=positive_int, default=5, help="interleaved repetitions per launch")
    p.add_argument("--rounds", type=positive_int, default=None,
                   help="launches per rank count, interleaved (P=1, P=2, P=1, ...); default 3 (--quick: 1)")
    p.add_argument("--cf", type=positive_int, default=4)
    p.add_argument("--levels", type=positive_int, default=4)
    p.add_argument("--fwd-iters", type=nonnegative_int, default=2)
    p.add_argument("--bwd-iters", type=nonnegative_int, default=1)
    p.add_argument("--json", default=None, help="also write measured and modelled numbers to this file")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: one GPU per rank, NCCL for every method (benchmarks/gpu.py runs it this way)")
    p.add_argument("--quick", action="store_true", help="N 64, width 16, batch 16, P 1 and 2, 2 repetitions")
    p.add_argument("--worker", type=str, default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-peak", action="store_true", help=argparse.SUPPRESS)  # (the timed launches)
    p.add_argument("--peak-only", action="store_true", help=argparse.SUPPRESS)  # (a launch of its own, untimed)
    a = p.parse_args(argv)
    if a.quick:
        a.layers, a.widths, a.batches, a.repeat, a.levels = "64", "16", "16", 2, 3
    if a.rounds is None:
        a.rounds = 1 if a.quick else 3
    a.configs = [tuple(c) for c in itertools.product(*(map(int, s.split(",")) for s in (a.layers, a.widths,
                                                                                           a.batches)))]
    return a


# -- the worker: P gloo ranks, every configuration ---------------------------------------------


def worker(a):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    torch.set_num_threads(1)
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def allmax(v):
        t = torch.tensor([float(v)], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    class Block(nn.Module):
        """Layers [lo, hi) of the residual network, u <- u + h tanh(W_i u + b_i), written as the plain loop
        ``u = u + h * tanh(F.linear(u, W_i, b_i))`` (the strongest autograd baseline: calling each layer's
        nn.Sequential(Linear, Tanh) costs about 1.15-1.2x that at these sizes)."""

        def __init__(self, layers, h):
            super().__init__()
            self.layers, self.h = nn.ModuleList(layers), h
            # (the parameters themselves, looked up once: f[0].weight per step costs about 8% at N 1024)
            self.wb = [(f[0].weight, f[0].bias) for f in self.layers]

        def forward(self, u):
            for W, b in self.wb:
                u = u + self.h * torch.tanh(F.linear(u, W, b))
            return u

    class Saved:
        """Peak live bytes saved by autograd (unique storages, parameters left out)."""

        def __init__(self, params):
            self.skip = {p.untyped_storage().data_ptr() for p in params}
            self.live, self.count, self.peak = {}, 0, 0

        def pack(self, t):
            key = t.untyped_storage().data_ptr()
            if key not in self.skip:
                n, c = self.live.get(key, (t.untyped_storage().nbytes(), 0))
                if c == 0:
                    self.count += n
                    self.peak = max(self.peak, self.count)
                self.live[key] = (n, c + 1)
            return (key, t)

        def unpack(self, packed):
            key, t = packed
            if key in self.live:
                n, c = self.live[key]
                if c <= 1:
                    del self.live[key]
                    self.count -= n
                else:
                    self.live[key] = (n, c - 1)
            return t

        def hooks(self):
            return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pbytes(mods):
        return sum(p.numel() * p.element_size() for mm in mods for p in mm.parameters())

    def peak_bytes(fn, steps=2):
        """Largest number of bytes of tensors alive at once during ``steps`` calls of ``fn``, counted from
        the start: the CUDA allocator's peak on a GPU; on the CPU the running sum of torch's allocation
        and free events (``torch.profiler`` with ``profile_memory=True``) in time order."""
        if cuda:
            sync()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            for _ in range(steps):
                fn()
            sync()
            return torch.cuda.max_memory_allocated() - base
        return cpu_peak_bytes(fn, steps)

    def timed(fns, repeat):
        for fn in fns:
            fn()
        times = [[] for _ in fns]
        for _ in range(repeat):
            for k, fn in enumerate(fns):
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                times[k].append(allmax(time.perf_counter() - t0))
        return [statistics.median(t) for t in times]

    def pingpong(n, reps=200):
        buf = torch.zeros(n, device=dev)
        ts = []
        for k in range(reps + 20):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            sync()
            if k >= 20:
                ts.append((time.perf_counter() - t0) / 2)
        return allmax(statistics.median(ts)) if rank < 2 else 0.0

    def lp_pingpong(n, reps=200):
        """Half a round trip of one state through LayerParallel's communicator (mgrit.comm)."""
        from mgrit.comm import Tag, as_communicator

        comm = as_communicator(dist.group.WORLD)
        state, ts = torch.zeros(n, device=dev), []
        with comm.session():
            for k in range(reps + 20):
                t0 = time.perf_counter()
                if rank == 0:
                    comm.send(state, 1, Tag.USER)
                    state = comm.recv(state, 1, Tag.USER)
                elif rank == 1:
                    state = comm.recv(state, 0, Tag.USER)
                    comm.send(state, 0, Tag.USER)
                sync()
                if k >= 20:
                    ts.append((time.perf_counter() - t0) / 2)
        return allmax(statistics.median(ts)) if rank < 2 else 0.0

    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from propagators.torch import LayerParallel

    for N, w, B in a.configs:
        h = 1.0 / N
        torch.manual_seed(0)
        all_layers = [nn.Sequential(nn.Linear(w, w), nn.Tanh()).to(dev) for _ in range(N)]
        x = torch.randn(B, w, generator=torch.Generator().manual_seed(1)).to(dev)
        m = min(a.microbatches, B)
        lo, hi = rank * N // P, (rank + 1) * N // P

        # serial reference (float32 autograd; every rank computes it, cheap)
        ref = Block(all_layers, h)
        ref(x).square().sum().backward()
        gref = {i: [p.grad.clone() for p in all_layers[i].parameters()] for i in range(N)}
        gmax = max(float(g.abs().max()) for gs in gref.values() for g in gs)
        for p in ref.parameters():
            p.grad = None

        def error(pairs):
            """pairs: (global layer index, list of grads of that layer) owned here."""
            e = 0.0
            for i, gs in pairs:
                for g, r in zip(gs, gref[i]):
                    e = max(e, float((g - r).abs().max()))
            return allmax(e) / gmax

        def copy_block(lo_, hi_):
            import copy
            return Block([copy.deepcopy(all_layers[i]) for i in range(lo_, hi_)], h)

        # (a) layer-wise model parallelism
        mp = copy_block(lo, hi)
        mp_params = list(mp.parameters())
        mp_saved = Saved(mp_params)

        def mp_step_ordered(hooks=False):
            for p in mp_params:
                p.grad = None
            with mp_saved.hooks() if hooks else contextlib.nullcontext():
                if rank == 0:
                    u = x
                else:
                    u = torch.empty(B, w, device=dev)
                    dist.recv(u, rank - 1)
                    u.requires_grad_(True)
                y = mp(u)
            if rank < P - 1:
                dist.send(y.detach().contiguous(), rank + 1)
                g = torch.empty(B, w, device=dev)
                dist.recv(g, rank + 1)
                y.backward(g)
            else:
                y.square().sum().backward()
            if rank > 0:
                dist.send(u.grad.contiguous(), rank - 1)

        # (b) torch.distributed.pipelining, GPipe and 1F1B
        def make_pipe(kind, lo=lo, hi=hi):
            blk = copy_block(lo, hi)
            stage = PipelineStage(blk, rank, P, dev, group=dist.group.WORLD)
            loss = (lambda y, t: y.square().sum())
            schedule = ScheduleGPipe if kind == "GPipe" else Schedule1F1B
            try:
                sched = schedule(stage, m, loss_fn=loss, scale_grads=False)
            except TypeError:  # torch < 2.7: no scale_grads, and the gradients are not scaled
                sched = schedule(stage, m, loss_fn=loss)
            params = list(blk.parameters())
            saved = Saved(params)
            target = torch.zeros(B, 1, device=dev)

            def step(hooks=False):
                for p in params:
                    p.grad = None
                with saved.hooks() if hooks else contextlib.nullcontext():
                    if P == 1:
                        sched.step(x, target=target)
                    elif rank == 0:
                        sched.step(x)
                    elif rank == P - 1:
                        sched.step(target=target)
                    else:
                        sched.step()

            return blk, step, saved

        gp_blk, gp_step, gp_saved = make_pipe("GPipe")
        fb_blk, fb_step, fb_saved = make_pipe("1F1B")

        # (c) LayerParallel
        def lp_net(width, n, comm=None):
            """LayerParallel of ``n`` layers of ``width`` (h = 1/N), the comparison's settings."""
            return LayerParallel([nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n)], T=n / N,
                                 cf=a.cf, max_levels=a.levels, fwd_iters=a.fwd_iters, bwd_iters=a.bwd_iters,
                                 comm=comm).to(dev)

        torch.manual_seed(0)
        lp = lp_net(w, N, dist.group.WORLD)
        lp_params = list(lp.parameters())

        def lp_step():
            for p in lp_params:
                p.grad = None
            lp(x).square().sum().backward()

        # probes for the model, timed interleaved with the four methods (same processes, same phase of the
        # machine): (1) the serial reference, this rank's own layers forward + backward at batch B with no
        # message (what model parallelism computes; on P ranks all ranks run it at once); (2) the two
        # schedules with one layer per stage (schedule overhead + its messages); (3) LayerParallel with the
        # same hierarchy and trivial layers (width 1, batch 1): its communication and bookkeeping with next
        # to no layer work
        def serial_step(blk, u):
            """Forward + backward of ``blk`` from ``u``, no message."""
            params = list(blk.parameters())

            def step():
                for p in params:
                    p.grad = None
                u.grad = None
                blk(u).square().sum().backward()

            return step

        ref_step = serial_step(copy_block(lo, hi), x.clone().requires_grad_(rank > 0))
        probe_steps = [make_pipe(kind, lo, lo + 1)[1] for kind in ("GPipe", "1F1B")]
        lp_probe_net = lp_net(1, N, dist.group.WORLD)
        x1 = torch.randn(1, 1, device=dev)

        def lp_probe_step():
            lp_probe_net(x1).square().sum().backward()

        # (4) LayerParallel's own work without messages: the first half of the layers on one process (what one
        # rank of 2 holds), run by every rank at once: one rank's work on 2 ranks (its tensors, N/2 states
        # per level, slow down differently from the reference's blocks when both cores compute)
        torch.manual_seed(0)
        lp_half = lp_net(w, -(-N // 2))

        def lp_half_step():
            lp_half.zero_grad(set_to_none=True)
            lp_half(x).square().sum().backward()

        # (5) the same for the trivial layers: the probe's own work on 2 ranks, the rest of its time there is
        # the distributed cost
        lp_probe_half = lp_net(1, -(-N // 2))

        def lp_probe_half_step():
            lp_probe_half(x1).square().sum().backward()

        def ref_alone_step():  # the same blocks one rank after the other, the others idle (as in model parallelism)
            for r in range(P):
                if r:
                    dist.barrier()
                if rank == r:
                    ref_step()

        # peak memory per rank, measured: each method's first two steps after construction (nothing held but
        # its parameters), the largest bytes of tensors alive at once on top of the parameters; in a launch
        # of its own, which times nothing: after torch.profiler has run, every later op of the process is
        # slower (about 14% on the plain loop here), which favoured the method with the fewest ops
        peak = None
        if not a.no_peak:
            peak = [peak_bytes(fn) for fn in (mp_step_ordered, gp_step, fb_step, lp_step)]
            peak = None if None in peak else [allmax(pbytes(mods) + b) for mods, b in zip(
                ([mp], [gp_blk], [fb_blk], list(lp.layers) + list(lp._halo.values())), peak)]
        if a.peak_only:
            if rank == 0:
                print("RESULT " + json.dumps({"N": N, "w": w, "B": B, "P": P, "peak": peak}), flush=True)
            dist.barrier()
            continue

        # (6) on P > 1 the reference in turn
        extra = [ref_alone_step] if P > 1 else []
        times = timed([mp_step_ordered, gp_step, fb_step, lp_step, ref_step, *probe_steps, lp_probe_step,
                       lp_half_step, lp_probe_half_step, *extra], a.repeat)
        t_mp, t_gp, t_fb, t_lp, t_ref = times[:5]
        probe, lp_probe, t_lp_half, t_probe_half = times[5:7], times[7], times[8], times[9]
        t_alone = times[10] if P > 1 else t_ref
        for fn in (mp_step_ordered, gp_step, fb_step):  # one more step each, counting saved bytes
            fn(hooks=True)

        # gradient errors (after the last timed step of each)
        def block_pairs(blk, lo_):
            return [(lo_ + k, [p.grad for p in f.parameters()]) for k, f in enumerate(blk.layers)]

        lp_pairs = [(i, [p.grad for p in f.parameters()]) for i, f in lp.layers.items()]
        err = [error(block_pairs(mp, lo)), error(block_pairs(gp_blk, lo)), error(block_pairs(fb_blk, lo)),
               error(lp_pairs)]

        # memory per rank (counted), max over ranks
        state = B * w * 4
        n_pts = 0
        n_lvl = N
        for _ in range(len(lp.hierarchy)):
            n_pts += -(-(n_lvl + 1) // P)
            n_lvl = max(n_lvl // a.cf, 1)
        lp_mem = pbytes(list(lp.layers) + list(lp._halo.values())) + 2 * n_pts * state
        mem = [allmax(pbytes([mp]) + mp_saved.peak), allmax(pbytes([gp_blk]) + gp_saved.peak),
               allmax(pbytes([fb_blk]) + fb_saved.peak), allmax(lp_mem)]

        # costs for the model: per-layer forward and backward at batch B and B/m; messages
        costs = layer_costs(torch, Block, all_layers[lo:hi] if hi > lo else all_layers[:1], h, w,
                            sorted({B, max(B // m, 1), 1}), sync=sync)
        msg, lpmsg = {}, 0.0
        if P >= 2:
            for n in sorted({B * w, max(B // m, 1) * w, 16, 1 << 18}):
                msg[n] = pingpong(n)
            lpmsg = lp_pingpong(B * w)
        row = {"N": N, "w": w, "B": B, "P": P, "m": m, "time": [t_mp, t_gp, t_fb, t_lp], "err": err, "mem": mem,
               "peak": peak,
               "costs": costs, "msg": msg, "lpmsg": lpmsg,
               "probe": probe, "lp_probe": lp_probe, "ref": t_ref, "lp_half": t_lp_half, "probe_half": t_probe_half,
               "alone": t_alone}
        if P == 1:
            from layer_parallel import measure_costs

            row["lp_costs"] = [[c.single, c.per_state, c.per_call] for c in measure_costs(lp, x, sync=sync)]
            row["skip"] = lp.skip
        if rank == 0:
            print("RESULT " + json.dumps(row), flush=True)
        dist.barrier()
    dist.destroy_process_group()
    return 0


def cpu_peak_bytes(fn, steps=1):
    """Largest number of bytes of torch's CPU tensors alive at once during ``steps`` calls of ``fn``,
    counted from the start: the running sum of the allocation and free events of ``torch.profiler``
    (``profile_memory=True``) in time order; None where this torch has no such event tree."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(steps):
            fn()
    # every allocation and free at its own time (an op's net memory at its start would miss what it
    # allocates and frees again, and so the peak)
    try:
        nodes, events = list(prof.profiler.kineto_results.experimental_event_tree()), []
    except AttributeError:
        return None
    while nodes:
        n = nodes.pop()
        if type(n.extra_fields).__name__ == "_ExtraFields_Allocation":
            events.append((n.start_time_ns, n.extra_fields.alloc_size))
        nodes.extend(n.children)
    live = top = 0
    for _, b in sorted(events):
        live += b
        top = max(top, live)
    return top


def layer_costs(torch, Block, layers, h, w, sizes, reps=5, sync=lambda: None):
    """Seconds per layer of forward (with autograd recording) and backward, per batch size."""
    import copy

    blk = Block([copy.deepcopy(f) for f in layers], h)
    res = {}
    for s in sizes:
        u0 = torch.randn(s, w, device=next(blk.parameters()).device)
        fw, bw = [], []
        for k in range(reps + 1):
            u = u0.clone().requires_grad_(True)
            sync()
            t0 = time.perf_counter()
            y = blk(u)
            sync()
            t1 = time.perf_counter()
            y.backward(torch.ones_like(y))
            sync()
            t2 = time.perf_counter()
            if k:
                fw.append((t1 - t0) / len(layers))
                bw.append((t2 - t1) / len(layers))
        res[s] = [statistics.median(fw), statistics.median(bw)]
    return res


# -- the driver --------------------------------------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(a, P, argv):
    here = str(Path(__file__).resolve())
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               **({"GLOO_SOCKET_IFNAME": "lo"} if a.device == "cuda" else {}),  # the control group: all ranks local
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(P),
               LOCAL_WORLD_SIZE=str(P))
    procs = [subprocess.Popen([sys.executable, here, *argv, "--worker", str(P)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(P)]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"the {P}-rank run failed:\n" + "\n".join(outs))
    rows = [json.loads(ln[7:]) for out in outs for ln in out.splitlines() if ln.startswith("RESULT ")]
    return {(r["N"], r["w"], r["B"]): r for r in rows}


def msg_time(msg, n):
    """Seconds of one message of n float32, interpolated (latency + bytes / bandwidth) from measured sizes."""
    if not msg:
        return 0.0
    sizes = sorted(int(k) for k in msg)
    if n in sizes:
        return msg[str(n)] if str(n) in msg else msg[n]
    lo = [s for s in sizes if s <= n] or sizes[:1]
    hi = [s for s in sizes if s >= n] or sizes[-1:]
    s0, s1 = lo[-1], hi[0]
    t0, t1 = msg[str(s0)], msg[str(s1)]
    return t0 if s1 == s0 else t0 + (t1 - t0) * (n - s0) / (s1 - s0)


def per_layer(costs, s):
    """Forward and backward seconds per layer at micro-batch size s (linear in s between measured sizes)."""
    sizes = sorted(int(k) for k in costs)
    lo = [q for q in sizes if q <= s] or sizes[:1]
    hi = [q for q in sizes if q >= s] or sizes[-1:]
    s0, s1 = lo[-1], hi[0]
    c0, c1 = costs[str(s0)], costs[str(s1)]
    if s1 == s0:
        return c0
    return [c0[k] + (c1[k] - c0[k]) * (s - s0) / (s1 - s0) for k in (0, 1)]


class Model:
    """Critical-path model of the four methods for one (N, w, B), calibrated on P = 1."""

    def __init__(self, a, r1, r2):
        from mgrit.model import StepCost

        self.a, self.N, self.w, self.B, self.m = a, r1["N"], r1["w"], r1["B"], r1["m"]
        self.costs = r1["costs"]
        self.msg = r2["msg"] if r2 else {}
        self.lpmsg = r2["lpmsg"] if r2 else 0.0
        self.fc, self.ac = (StepCost(*c) for c in r1["lp_costs"])
        self.skip = r1["skip"]
        self.h = self._hierarchy()
        t1 = r1["time"]
        f, b = per_layer(self.costs, self.B)
        # the serial reference (this rank's layers forward + backward at batch B, timed interleaved with
        # the methods) sets the level of the per-layer costs, which are measured after the timed steps
        self.c1 = r1["ref"] / self.N                      # seconds per layer, forward + backward, 1 rank
        self.k1 = self.c1 / (f + b)
        # on P > 1 ranks a layer of a block of N/P layers costs what the reference costs per layer there
        # (all ranks compute at once: the processes' own speed, their contention for memory and cores,
        # and a block of fewer layers that fits better in cache), measured on 2 ranks; the pipelines run
        # such blocks at once
        self.s2 = (r2["ref"] / -(-self.N // 2)) / self.c1 if r2 else 1.0
        self.mp_over = t1[0] - r1["ref"]                  # loss etc.: additive, measured on 1 rank
        # model parallelism runs the blocks one rank after the other: the reference run that way on 2 ranks
        # (each rank's block in turn, the others idle) against the whole net on 1
        self.a2 = r2["alone"] / r1["ref"] if r2 else 1.0
        # pipeline: per stage pass, the schedule's own overhead (1-layer probe on 1 rank) and its
        # message cost (1-layer probe on 2 ranks minus that overhead); no fit to the N-layer times
        self.pipe_over = [r1["probe"][k] / (2 * self.m) for k in (0, 1)]
        self.pipe_msg = ([max(r2["probe"][k] / (2 * (self.m + 1)) - self.pipe_over[k], 0.0) for k in (0, 1)]
                         if r2 else [0.0, 0.0])
        self.lp_calib = t1[3] / self._lp_raw(1)
        # LayerParallel on P > 1: one rank's work does not split into such blocks (states and parameters
        # of every level); at P = 2 it is measured directly: LayerParallel of the first half of the layers
        # on one process, every rank at once (its ratio to 1 rank, v, is printed); for more ranks it is
        # scaled by the critical path's modelled work (mgrit.model.predict with the measured call costs).
        # On top, a distributed overhead per step (halo exchange, every level's boundary exchanges,
        # reductions and sessions through gloo's helper threads): the trivial-layer probe on 2 ranks minus
        # its own first half on one process at once; taken as constant in P (each rank talks to its two
        # neighbours), plus the ping-pong latency for every critical-path message beyond P = 2's
        self.v2 = r2["lp_half"] / r1["lp_half"] if r2 else 1.0
        self.lp_per_work = r2["lp_half"] / self._lp_parts(2)[0] if r2 else None   # seconds per modelled second
        self.lp_over = max(r2["lp_probe"] - r2["probe_half"], 0.0) if r2 else 0.0

    def _lp_msgs(self, P):
        from mgrit.model import predict

        n = sum(predict(self.h, P, it, skip=self.skip).path_messages for it in (self.a.fwd_iters, self.a.bwd_iters))
        return n + 2 * math.ceil(math.log2(P)) if P > 1 else 0

    def _hierarchy(self):
        import numpy as np

        from mgrit import build_hierarchy

        t = np.linspace(0.0, 1.0, self.N + 1)
        return build_hierarchy(t, cf=self.a.cf, max_levels=self.a.levels)

    def _lp_parts(self, P):
        """(propagator work on the critical path, message time on it) of a forward + backward step."""
        from mgrit.model import predict

        lat = self.lpmsg if P > 1 else 0.0
        work = comm = 0.0
        for it, cost in ((self.a.fwd_iters, self.fc), (self.a.bwd_iters, self.ac)):
            w0 = predict(self.h, P, it, skip=self.skip, cost=cost).time
            work += w0
            comm += predict(self.h, P, it, skip=self.skip, cost=cost, latency=lat).time - w0
        work += self.ac.batch(-(-self.N // P))             # parameter VJP over this rank's layers
        comm += 2 * lat * math.ceil(math.log2(P)) if P > 1 else 0.0   # output and input-gradient broadcasts
        return work, comm

    def _lp_raw(self, P):
        return sum(self._lp_parts(P))

    def mp(self, P):
        alone = 1.0 if P == 1 else self.a2
        return self.N * self.c1 * alone + 2 * (P - 1) * msg_time(self.msg, self.B * self.w) + self.mp_over

    def pipe(self, P, m=None, k=0):
        m = m or self.m
        # the P fill and drain ticks of the m + P - 1 run one stage at a time, the other m - 1 all at once
        sp = 1.0 if P == 1 else (P * self.a2 + (m - 1) * self.s2) / (m + P - 1)
        f, b = (v * self.k1 * sp for v in per_layer(self.costs, max(self.B // m, 1)))
        c = self.pipe_msg[k] if P > 1 else 0.0
        L = self.N / P
        return (m + P - 1) * (L * f + c + self.pipe_over[k]) + (m + P - 1) * (L * b + c + self.pipe_over[k])

    def best_pipe(self, P, k=0):
        ms = [2 ** j for j in range(int(math.log2(self.B)) + 1)]
        return min((self.pipe(P, m, k), m) for m in ms)

    def lp(self, P):
        work, _ = self._lp_parts(P)
        if P == 1:
            return self.lp_calib * work
        extra = max(self._lp_msgs(P) - self._lp_msgs(2), 0) * self.lpmsg
        return self.lp_per_work * work + self.lp_over + extra


def merge(rows):
    """Medians over launches of every measured number (nested lists and dicts alike)."""
    def med(vals):
        vals = [v for v in vals if v is not None] or [None]  # (measured in some launches only)
        v0 = vals[0]
        if isinstance(v0, dict):
            return {k: med([v[k] for v in vals]) for k in v0}
        if isinstance(v0, list):
            return [med([v[i] for v in vals]) for i in range(len(v0))]
        if isinstance(v0, float):
            return statistics.median(vals)
        return v0
    return med(rows)


def with_probes(rows, launches, configs):
    """``rows`` (config -> measured numbers) with the trivial-layer probes set to their median over
    ``launches`` and every config of the same N: the probe does not depend on w and B."""
    for c in configs:
        for k in ("lp_probe", "probe_half"):
            rows[c][k] = statistics.median(run[d][k] for run in launches for d in configs if d[0] == c[0])
    return rows


def round_check(a, runs) -> dict:
    """The model check launch by launch: round j's P = 2 times against the model built from round j's
    own probes (its P = 1 launch and its P = 2 launch, which ran one after the other), so that a slow
    or fast phase of the machine moves the prediction with the times it predicts. Returns config ->
    per-method list of the rounds' signed differences in percent (model over measured)."""
    out = {c: [] for c in a.configs}
    for run1, run2 in zip(runs[1], runs[2]):
        r1 = with_probes({c: dict(run1[c]) for c in a.configs}, [run1], a.configs)
        r2 = with_probes({c: dict(run2[c]) for c in a.configs}, [run2], a.configs)
        for c in a.configs:
            M = Model(a, r1[c], r2[c])
            pred = [M.mp(2), M.pipe(2, k=0), M.pipe(2, k=1), M.lp(2)]
            out[c].append([100 * (p - t) / t for p, t in zip(pred, r2[c]["time"])])
    return out


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse(argv)
    if a.worker:
        end_worker(worker(a))
    ranks = [int(r) for r in a.ranks.split(",")]
    if len(set(ranks)) != len(ranks) or min(ranks) < 1:
        raise SystemExit(f"--ranks takes distinct rank counts of at least 1, e.g. 1,2; got {a.ranks}")
    if a.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {a.rounds}")
    if a.device == "cuda":
        import torch

        n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if max(ranks) > n_gpu:
            raise SystemExit(f"--device cuda needs one GPU per rank: {n_gpu} GPU(s) here, --ranks {a.ranks}")
    t_start = time.perf_counter()
    peaks = {P: launch(a, P, argv + ["--peak-only"]) for P in ranks}  # (untimed launches: see worker)
    runs = {P: [] for P in ranks}
    for k in range(a.rounds):
        for P in ranks:
            runs[P].append(launch(a, P, argv + ["--no-peak"]))
    res = {P: with_probes({c: merge([run[c] for run in runs[P]]) for c in a.configs}, runs[P], a.configs)
           for P in ranks}
    for P in ranks:
        for c in a.configs:
            res[P][c]["peak"] = peaks[P][c]["peak"]
    engine = "NCCL, one GPU per rank" if a.device == "cuda" else "gloo"
    print(f"deep residual net u <- u + h tanh(Linear(u)), h = 1/N, loss sum(u_N^2), float32, 1 thread per rank, "
          f"torch.distributed {engine} for every method; {a.microbatches} micro-batches for GPipe/1F1B; LayerParallel "
          f"cf {a.cf}, {a.levels} levels, {a.fwd_iters}/{a.bwd_iters} cycles; medians of {a.repeat} interleaved "
          f"repetitions per launch, slowest rank, medians over {a.rounds} interleaved launches per P")
    print("grad err = max|g - g_serial| / max|g_serial| over all parameters; mem = counted bytes per rank "
          "(parameters held + peak bytes kept for backward), largest rank\n")
    head = f"{'N':>5}{'w':>4}{'B':>5}{'P':>3}  " + "".join(f"{m + ' ms':>18}" for m in METHODS)
    print("time per step")
    print(head)
    for (N, w, B) in a.configs:
        for P in ranks:
            r = res[P][(N, w, B)]
            print(f"{N:>5}{w:>4}{B:>5}{P:>3}  " + "".join(f"{1e3 * t:>18.2f}" for t in r["time"]))
    print("\ngradient error against serial autograd / memory per rank [KiB]")
    print(f"{'N':>5}{'w':>4}{'B':>5}{'P':>3}  " + "".join(f"{m:>22}" for m in METHODS))
    for (N, w, B) in a.configs:
        for P in ranks:
            r = res[P][(N, w, B)]
            print(f"{N:>5}{w:>4}{B:>5}{P:>3}  " + "".join(f"{e:>12.1e} /{mm / 1024:>7.0f}"
                                                         for e, mm in zip(r["err"], r["mem"])))
    print("\npeak memory per rank, measured [KiB]: parameters + the most bytes of tensors alive at once in the "
          "first two steps after construction (" + ("the CUDA allocator's peak" if a.device == "cuda" else
                                                    "torch.profiler's allocation and free events") + "), largest rank")
    print(f"{'N':>5}{'w':>4}{'B':>5}{'P':>3}  " + "".join(f"{m:>18}" for m in METHODS))
    for (N, w, B) in a.configs:
        for P in ranks:
            r = res[P][(N, w, B)]
            print(f"{N:>5}{w:>4}{B:>5}{P:>3}  " + ("".join(f"{mm / 1024:>18.0f}" for mm in r["peak"])
                                                  if r.get("peak") else f"{'(not measured)':>18}"))
    models = {c: Model(a, res[1][c], res.get(2, {}).get(c)) for c in a.configs} if 1 in ranks else {}
    per = round_check(a, runs) if 1 in ranks and 2 in ranks else None  # (None: no model check)
    if per is not None:
        print("\nmodel check at P = 2 (constants from probes timed with the steps on 1 and 2 ranks; "
              "nothing fitted to these times): measured / model ms (difference)")
        print(f"{'N':>5}{'w':>4}{'B':>5}  " + "".join(f"{m:>24}" for m in METHODS))
        diffs = []
        for c in a.configs:
            M, r = models[c], res[2][c]
            pred = [M.mp(2), M.pipe(2, k=0), M.pipe(2, k=1), M.lp(2)]
            cells = []
            for t, p in zip(r["time"], pred):
                d = 100 * (p - t) / t
                diffs.append(abs(d))
                cells.append(f"{1e3 * t:>8.1f} /{1e3 * p:>7.1f} ({d:+4.0f}%)")
            print(f"{c[0]:>5}{c[1]:>4}{c[2]:>5}  " + "".join(f"{s:>24}" for s in cells))
        print(f"|difference|: median {statistics.median(diffs):.0f}%, max {max(diffs):.0f}%, "
              f"{sum(d <= 15 for d in diffs)}/{len(diffs)} within 15%")
        if a.rounds > 1:
            print(f"\nthe same check launch by launch (each of the {a.rounds} rounds' P = 2 times against the model "
                  "from that round's own probes): per cell the median over the rounds of the signed difference "
                  "(the model's bias: a round's noise of either sign cancels) and the rounds' range")
            print(f"{'N':>5}{'w':>4}{'B':>5}  " + "".join(f"{m:>24}" for m in METHODS))
            meds, mags = [], []
            for c in a.configs:
                cells = []
                for k in range(len(METHODS)):
                    ds = [d[k] for d in per[c]]
                    meds.append(abs(statistics.median(ds)))
                    mags.append(statistics.median(abs(d) for d in ds))
                    cells.append(f"{statistics.median(ds):+4.0f}% ({min(ds):+4.0f} .. {max(ds):+4.0f})")
                print(f"{c[0]:>5}{c[1]:>4}{c[2]:>5}  " + "".join(f"{s:>24}" for s in cells))
            print(f"|median difference| (bias): median {statistics.median(meds):.0f}%, max {max(meds):.0f}%, "
                  f"{sum(d <= 15 for d in meds)}/{len(meds)} within 15%")
            print(f"median |difference| (one launch against its own model): median {statistics.median(mags):.0f}%, "
                  f"max {max(mags):.0f}%, {sum(d <= 15 for d in mags)}/{len(mags)} within 15%")
            # how far the measurement itself moves between launches of the same processes' code
            spread = [100 * (max(ts) / min(ts) - 1) for c in a.configs
                      for ts in zip(*(run[c]["time"] for run in runs[2]))]
            print(f"the measured P = 2 times themselves, largest over smallest of the {a.rounds} launches per cell: "
                  f"median +{statistics.median(spread):.0f}%, max +{max(spread):.0f}%")
        print(f"\nmessage time ({'NCCL' if a.device == 'cuda' else 'gloo'}, half a ping-pong): " + ", ".join(
            f"{int(n) * 4} B {1e6 * t:.0f} us" for n, t in sorted(res[2][a.configs[0]]["msg"].items(),
                                                                  key=lambda kv: int(kv[0]))))
        print(f"LayerParallel's communicator (mgrit.comm over {'NCCL' if a.device == 'cuda' else 'gloo'}), one state of B x w float32: "
              f"{1e6 * res[2][a.configs[0]]['lpmsg']:.0f} us (ping-pong); distributed overhead per step on 2 ranks "
              f"(trivial-layer probe): " + ", ".join(f"{1e3 * models[c].lp_over:.1f}" for c in a.configs) + " ms; "
              f"messages on the critical path at P = 2: {models[a.configs[0]]._lp_msgs(2)}")
        print("model constants: " + "; ".join(
            f"N {c[0]} w {c[1]} B {c[2]}: MP +{1e3 * models[c].mp_over:.1f} ms, GPipe {1e3 * models[c].pipe_over[0]:.2f} ms/stage "
            f"pass (+{1e3 * models[c].pipe_msg[0]:.2f} ms messages on P > 1), LP x{models[c].lp_calib:.2f}, layer cost on 2 ranks "
            f"x{models[c].a2:.2f} in turn, x{models[c].s2:.2f} in blocks at once, x{models[c].v2:.2f} same work "
            f"at once" for c in a.configs))
        print("\nmodelled time per step [ms] for more ranks (GPipe: best m of the powers of two <= B; "
              "1F1B has GPipe's critical path, less memory)")
        print(f"{'N':>5}{'w':>4}{'B':>5}{'P':>5}{'model par.':>12}{'GPipe (m)':>16}{'LayerParallel':>15}"
              f"{'winner':>16}")
        wins = {}
        for c in a.configs:
            M = models[c]
            for P in (8, 32, 128, 512):
                if P > c[0]:
                    continue
                tp, mbest = M.best_pipe(P)
                t = {"model parallel": M.mp(P), "GPipe": tp, "LayerParallel": M.lp(P)}
                win = min(t, key=t.get)
                wins.setdefault(c, []).append((P, win))
                print(f"{c[0]:>5}{c[1]:>4}{c[2]:>5}{P:>5}{1e3 * t['model parallel']:>12.1f}"
                      f"{1e3 * tp:>11.1f} ({mbest:>2}){1e3 * t['LayerParallel']:>15.1f}{win:>16}")
        print("\nwhere each method wins (modelled, P = 8 .. 512; measured P = 1, 2 above):")
        for c, lst in wins.items():
            print(f"  N {c[0]:>5}, w {c[1]:>3}, B {c[2]:>4}: " + ", ".join(f"P {P}: {wn}" for P, wn in lst))
    if a.json:
        data = {"settings": {k: v for k, v in vars(a).items() if k != "configs"}, "configs": []}
        for c in a.configs:
            d = {"N": c[0], "w": c[1], "B": c[2], "methods": METHODS,
                 "measured": {P: {k: res[P][c][k] for k in ("time", "err", "mem", "peak")} for P in ranks},
                 "probes": {P: res[P][c] for P in ranks},
                 "launches": {P: [run[c]["time"] for run in runs[P]] for P in ranks}}
            if per is not None:
                d["round_check"] = dict(zip(METHODS, map(list, zip(*per[c]))))  # per method, each round's %
                M = models[c]
                Ps = [2 ** j for j in range(10) if 2 ** j <= c[0]]
                d["model"] = {"P": Ps, "model parallel": [M.mp(P) for P in Ps],
                              "GPipe": [M.pipe(P, k=0) for P in Ps], "1F1B": [M.pipe(P, k=1) for P in Ps],
                              "GPipe best m": [M.best_pipe(P)[0] for P in Ps],
                              "LayerParallel": [M.lp(P) for P in Ps]}
            data["configs"].append(d)
        Path(a.json).write_text(json.dumps(data, indent=1))
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
