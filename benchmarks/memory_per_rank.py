"""Parameter memory per rank of LayerParallel: about N/P layers plus a small halo.

Builds ``LayerParallel`` from a factory (``nn.Sequential(nn.Linear(w, w), nn.Tanh())``,
N layers) on 1, 2 and 4 MPI ranks and prints, per rank, the layers it built, the
layers it owns (registered parameters, in its ``state_dict``), its halo (parameters
received from neighbours before each forward pass, for coarse-level steps) and the
bytes of parameters it holds, against the whole network's bytes.

Run::

    .venv/bin/python benchmarks/memory_per_rank.py              # N 1024, width 16, cf 4, 4 levels
    .venv/bin/python benchmarks/memory_per_rank.py --quick      # N 64
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _cli import positive_int, positive_ints  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=positive_int, default=1024)
    p.add_argument("--width", type=positive_int, default=16)
    p.add_argument("--cf", type=positive_int, default=4)
    p.add_argument("--levels", type=positive_int, default=4)
    p.add_argument("--ranks", type=positive_ints, default="1,2,4")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.layers = 64
    return a


def nbytes(modules) -> int:
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


def measure(a, comm=None):
    import torch
    from torch import nn

    from propagators.torch import LayerParallel

    built = []

    def factory(i):
        built.append(i)
        return nn.Sequential(nn.Linear(a.width, a.width), nn.Tanh())

    torch.manual_seed(0)
    lp = LayerParallel(factory, n_layers=a.layers, cf=a.cf, max_levels=a.levels, comm=comm)
    rank = 0 if comm is None else comm.Get_rank()
    return {"rank": rank, "built": len(built), "owned": len(lp.layers), "halo": len(lp._halo),
            "bytes": nbytes(list(lp.layers) + list(lp._halo.values())),
            "state_dict_bytes": sum(v.numel() * v.element_size() for v in lp.state_dict().values()),
            "full_bytes": a.layers * (a.width * a.width + a.width) * 4}


def child(a):
    from mpi4py import MPI

    rows = MPI.COMM_WORLD.gather(measure(a, MPI.COMM_WORLD), root=0)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print("RESULT " + json.dumps(rows))


def main(argv=None):
    a = parse(argv)
    if a.child:
        return child(a)
    table = {}
    mpiexec = Path(sys.executable).parent / "mpiexec"
    for P in [int(s) for s in a.ranks.split(",")]:
        if P == 1:
            table[1] = [measure(a)]
            continue
        cmd = [str(mpiexec), "-n", str(P), sys.executable, __file__, "--child", f"--layers={a.layers}",
               f"--width={a.width}", f"--cf={a.cf}", f"--levels={a.levels}"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
        line = next((s for s in out.stdout.splitlines() if s.startswith("RESULT ")), None)
        if line is None:
            print(out.stdout, out.stderr)
            return 1
        table[P] = json.loads(line[7:])
    full = table[next(iter(table))][0]["full_bytes"]
    print(f"LayerParallel parameter memory per rank: N {a.layers} layers of Linear({a.width}, {a.width}) + tanh, "
          f"cf {a.cf}, {a.levels} levels, float32; whole network {full} bytes")
    print(f"{'ranks':>5}{'rank':>6}{'built':>7}{'owned':>7}{'halo':>6}{'bytes held':>12}{'of network':>12}"
          f"{'x N/P':>8}")
    for P, rows in table.items():
        for r in rows:
            print(f"{P:>5}{r['rank']:>6}{r['built']:>7}{r['owned']:>7}{r['halo']:>6}{r['bytes']:>12}"
                  f"{r['bytes'] / full:>12.3f}{r['bytes'] / (full / P):>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
