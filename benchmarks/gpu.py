"""The one GPU script: the CUDA tests, then serial against layer-parallel on one GPU.

Runs in a few minutes on one GPU:

1. the CUDA tests (``pytest -m cuda``: LayerParallel on the GPU, batched and
   looped on CUDA streams, against the CPU; the MPI one when mpi4py is there);
2. one forward+backward of a deep narrow ODE-net, N = 1024 layers of
   ``tanh(Linear(w, w))``, widths 16, 64 and 256, batch 16 and 128, float32,
   side by side in one run (medians of interleaved repetitions, with
   ``torch.cuda.synchronize``):

   * ``plain loop``: ``x = x + h * tanh(F.linear(x, W_i, b_i))`` with autograd (the baseline);
   * ``LP batched``: LayerParallel, every sweep one batched matrix product (cf 4, 4 levels,
     F / FCF, 2 forward / 1 backward cycles, skip);
   * ``LP streams``: LayerParallel with the layers looped, spread over 4 CUDA streams
     (N = 128 only: a looped sweep launches one kernel chain per layer).

   and prints ``plain / LP`` (above 1: layer-parallel is faster);
3. with several GPUs, the same LayerParallel over NCCL, one process per GPU
   (``torch.distributed.run``): output and gradients against one process, and
   the time of one forward+backward. With one GPU the single-process path of
   step 2 is the whole story;
4. layer-parallel against layer-wise model parallelism and pipelines (GPipe,
   1F1B): ``benchmarks/vs_model_parallel.py --device cuda`` (NCCL, one GPU per
   rank) on 1 GPU, and on 1 and 2 GPUs where there are two, N = 1024, widths 16
   and 64, batch 16 and 256, one launch per rank count.

Run from the repository root (the GPU machine needs only python3 with torch and numpy;
scipy and pytest for step 1)::

    python3 benchmarks/gpu.py            # everything
    python3 benchmarks/gpu.py --quick    # widths 16 and 64, batch 16, fewer repetitions
    python3 benchmarks/gpu.py --no-tests # timings only

Without a CUDA device it says so and exits 0.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from _cli import positive_int, positive_ints  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=positive_int, default=1024)
    p.add_argument("--widths", type=positive_ints, default="16,64,256")
    p.add_argument("--batches", type=positive_ints, default="16,128")
    p.add_argument("--repeat", type=positive_int, default=7)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-tests", action="store_true")
    p.add_argument("--device", default="cuda", help="'cpu' runs the same measurement on the CPU (a dry run)")
    p.add_argument("--nccl-child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.widths, a.batches, a.repeat = "16,64", "16", 3
    return a


def run_cuda_tests() -> int:
    try:
        import pytest  # noqa: F401
    except ImportError:
        print("pytest is not installed here: CUDA tests skipped")
        return 0
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
           "tests/test_torch.py", "tests/test_any_layers.py", "tests/test_mpi_torch.py"]
    print("$ " + " ".join(cmd[2:]), flush=True)
    return subprocess.call(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def interleaved(fns, repeat, sync):
    """Median seconds of each function, run in alternation (A B C A B C ...)."""
    for fn in fns:
        fn()
    sync()
    times = [[] for _ in fns]
    for _ in range(repeat):
        for k, fn in enumerate(fns):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[k].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def timings(a):
    import torch
    import torch.nn.functional as F
    from torch import nn

    from propagators.torch import LayerParallel

    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = []
    for width in [int(s) for s in a.widths.split(",")]:
        for batch in [int(s) for s in a.batches.split(",")]:
            torch.manual_seed(0)
            N = a.layers
            layers = [nn.Sequential(nn.Linear(width, width), nn.Tanh()).to(dev) for _ in range(N)]
            W = [m[0].weight for m in layers]
            B = [m[0].bias for m in layers]
            h = 1.0 / N
            x = torch.randn(batch, width, device=dev)
            lp = LayerParallel(layers, T=1.0, cf=4, max_levels=4)

            def plain():
                for p in W + B:
                    p.grad = None
                u = x.clone().requires_grad_(True)
                for i in range(N):
                    u = u + h * torch.tanh(F.linear(u, W[i], B[i]))
                u.square().sum().backward()

            def batched():
                for p in W + B:
                    p.grad = None
                lp(x.clone().requires_grad_(True)).square().sum().backward()

            fns = [plain, batched]
            t = interleaved(fns, a.repeat, sync)
            row = {"width": width, "batch": batch, "N": N, "plain": t[0], "batched": t[1]}
            # looped layers on CUDA streams, on a shorter net (one kernel chain per layer and sweep)
            n_s = min(N, 128)
            small = [nn.Sequential(nn.Linear(width, width), nn.Tanh()).to(dev) for _ in range(n_s)]
            Ws, Bs = [m[0].weight for m in small], [m[0].bias for m in small]
            lp_s = LayerParallel(small, T=1.0, cf=4, max_levels=3, batched=False, streams=4)

            def plain_small():
                for p in Ws + Bs:
                    p.grad = None
                u = x.clone().requires_grad_(True)
                for i in range(n_s):
                    u = u + (1.0 / n_s) * torch.tanh(F.linear(u, Ws[i], Bs[i]))
                u.square().sum().backward()

            def streams():
                for p in Ws + Bs:
                    p.grad = None
                lp_s(x.clone().requires_grad_(True)).square().sum().backward()

            ts = interleaved([plain_small, streams], max(1, a.repeat // 2), sync)
            row.update(plain_small=ts[0], streams=ts[1], n_small=n_s)
            rows.append(row)
            print(f"width {width:4d} batch {batch:4d}: plain {1e3 * t[0]:8.2f} ms, LP batched "
                  f"{1e3 * t[1]:8.2f} ms ({t[0] / t[1]:.2f}x); N {n_s}: plain {1e3 * ts[0]:7.2f} ms, "
                  f"LP streams {1e3 * ts[1]:7.2f} ms ({ts[0] / ts[1]:.2f}x)", flush=True)
    return rows


def nccl(a) -> None:
    """Step 3: LayerParallel over NCCL, one process per GPU (several GPUs only)."""
    import torch

    n = torch.cuda.device_count()
    if n < 2:
        print("\none GPU: no NCCL run (one process per GPU needs several GPUs); step 2 is the single-process path")
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", __file__,
           "--nccl-child", f"--layers={a.layers}", f"--repeat={a.repeat}"]
    print(f"\n$ {' '.join(cmd[2:])}", flush=True)
    _run_step(cmd, 300, "step 3")


def _run_step(cmd, timeout: int, what: str, **env) -> int:
    """Run ``cmd`` (a launcher and its ranks, in a session of their own), print the end of its output,
    and kill them all if it has not finished after ``timeout`` seconds. Returns its exit code."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=dict(os.environ, PYTHONPATH=str(ROOT), **env))
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        print(out[-6000:] + f"\n{what} did not finish within {timeout} s", flush=True)
        return 1
    print(out[-6000:] + ("" if proc.returncode == 0 else err[-4000:]), flush=True)
    return proc.returncode


def nccl_child(a) -> int:
    """One process per GPU: LayerParallel over NCCL against one process, then its time."""
    import copy

    import torch
    import torch.distributed as dist
    from torch import nn

    from propagators.torch import LayerParallel

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    rank, size = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()).double() for _ in range(64)]
    tight = dict(fwd_iters=60, bwd_iters=60, fwd_tol=1e-13, bwd_tol=1e-13)
    lp = LayerParallel(copy.deepcopy(layers), cf=4, max_levels=3, comm=dist.group.WORLD, **tight).to(dev)
    ref = LayerParallel(copy.deepcopy(layers), cf=4, max_levels=3, **tight).to(dev)
    x = torch.randn(8, 16, dtype=torch.float64, device=dev)
    xp, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    lp(xp).square().sum().backward()
    ref(xr).square().sum().backward()
    err = float((xp.grad - xr.grad).abs().max())
    errs = [float((p.grad - ref.layers[j].get_parameter(n).grad).abs().max())
            for j in lp.owned_layers for n, p in lp.layers[j].named_parameters()]
    err = max([err] + errs)
    torch.manual_seed(0)
    big = LayerParallel([nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(a.layers)], cf=4,
                        max_levels=4, comm=dist.group.WORLD).to(dev)
    xb = torch.randn(128, 64, device=dev)

    def step():
        big(xb.clone().requires_grad_(True)).square().sum().backward()

    t = interleaved([step], a.repeat, torch.cuda.synchronize)[0]
    if rank == 0:
        print(f"NCCL, {size} processes: max gradient difference to one process {err:.2e} (float64, N 64); "
              f"forward+backward N {a.layers}, width 64, batch 128, float32: {1e3 * t:.2f} ms", flush=True)
    dist.destroy_process_group()
    return 0


def compare(a) -> int:
    """Step 4: benchmarks/vs_model_parallel.py on the GPUs (a tiny CPU run for ``--device cpu``)."""
    import torch

    script = str(Path(__file__).resolve().parent / "vs_model_parallel.py")
    if a.device == "cuda":
        ranks = "1,2" if torch.cuda.device_count() >= 2 else "1"
        size = (["--widths", "16", "--batches", "16"] if a.quick else ["--widths", "16,64", "--batches", "16,256"])
        opts = ["--device", "cuda", "--ranks", ranks, "--layers", str(a.layers), *size, "--rounds", "1",
                "--repeat", "3"]
    else:  # the dry run: the same code path, tiny
        opts = ["--device", "cpu", "--ranks", "1", "--layers", str(a.layers), "--widths", a.widths.split(",")[0],
                "--batches", a.batches.split(",")[0], "--rounds", "1", "--repeat", "1", "--levels", "2"]
    print(f"\n$ {' '.join(['benchmarks/vs_model_parallel.py', *opts])}", flush=True)
    if a.device == "cuda":
        torch.cuda.empty_cache()  # the ranks get the GPUs' memory
    return _run_step([sys.executable, script, *opts], 600, "step 4", OMP_NUM_THREADS="1")


def main(argv=None) -> int:
    a = parse(argv)
    if a.nccl_child:
        return nccl_child(a)
    try:
        import torch
    except ImportError:
        print("torch is not installed: nothing to measure")
        return 0
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: the GPU tests and timings were not run (GPU numbers not measured)")
        return 0
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu (dry run)"
    print(f"device: {name}; torch {torch.__version__}", flush=True)
    rc = 0 if (a.no_tests or a.device != "cuda") else run_cuda_tests()
    rows = timings(a)
    print()
    print(f"forward+backward, float32, medians of {a.repeat} interleaved repetitions; plain / LP > 1: LP faster")
    print(f"{'width':>6}{'batch':>6}{'N':>6}{'plain ms':>10}{'LP batched ms':>15}{'plain/LP':>10}"
          f"{'N':>6}{'plain ms':>10}{'LP streams ms':>15}{'plain/LP':>10}")
    for r in rows:
        print(f"{r['width']:>6}{r['batch']:>6}{r['N']:>6}{1e3 * r['plain']:>10.2f}{1e3 * r['batched']:>15.2f}"
              f"{r['plain'] / r['batched']:>10.2f}{r['n_small']:>6}{1e3 * r['plain_small']:>10.2f}"
              f"{1e3 * r['streams']:>15.2f}{r['plain_small'] / r['streams']:>10.2f}")
    if a.device == "cuda":
        nccl(a)
    rc4 = compare(a)
    rc = 0 if rc in (0, 5) else rc  # 5: pytest collected no CUDA test
    return rc or rc4


if __name__ == "__main__":
    sys.exit(main())
