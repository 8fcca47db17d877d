"""A failure on one process makes every process raise within seconds (torch.distributed, gloo).

Run as ``python _launch.py P failures.py CASE:BAD [CASE:BAD ...]`` or
``python _launch.py 4 failures.py --grid-nan BAD_DATA_RANK``. CASE:

* ``raise``, ``late``, ``final``: ``mgrit.solve``'s propagator raises on rank BAD in cycle
  1, 4 or 6 (6: the final F-relaxation after the last cycle);
* ``nan``: it returns NaN in cycle 2 (a divergence); ``u0``: a NaN initial condition on
  rank BAD (bad input); ``grid``: another time grid on rank BAD (every rank: ValueError);
  ``u0diff``: another initial condition on rank BAD (every rank: ValueError); ``u0ulp``: one
  that differs in the last bit, ``u0layout``: a complex one in a strided view, ``u0half``: a float16
  one a unit in the last place apart (no error);
* ``step``: a layer of LayerParallel's forward solve raises on rank BAD;
* ``adjoint``: a vector-Jacobian product of its adjoint (backward) solve raises;
* ``alarm``: rank BAD calls ``alarm`` on a fresh communicator while the others wait in
  ``allreduce_array`` outside any session;
* ``many``: 30 caught failing solves in a row (the error is checked on the last).

Every rank prints ``case NAME rank r: <TypeName>: <message> [after <s> s]``. Then a
clean solve and a clean layer-parallel step on the same process group must equal the
serial ones (``rank r: recovered OK``); the number of retired channels is printed.
``--grid-nan``: a 2 x 2 layer x data grid; the shard of data rank BAD holds a NaN, so
its layer ranks raise in the forward solve, and the other data rank's processes,
waiting in ``allreduce_gradients``, must raise RemoteRankError (``case grid ...``).
"""
import copy
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import mgrit
from mgrit.comm import as_communicator
from propagators import Dahlquist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "mpi_scripts"))


class Injected(RuntimeError):
    """The error raised on purpose by the failing rank."""


def layers(n=16, seed=0):
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(n)]


def raiser(what):
    def f(*args, **kwargs):
        raise Injected(f"injected failure in {what}")

    return f


def layer_parallel_case(case, bad):
    from propagators.torch import LayerParallel

    lp = LayerParallel(layers(), cf=2, max_levels=3, comm=dist.group.WORLD)
    if dist.get_rank() == bad:
        bind = lp.kernel.bind

        def patched(*args, **kwargs):
            kp = bind(*args, **kwargs)
            if case == "step":
                kp.step = kp.stepper = raiser("a layer of the forward solve")
            else:
                kp.vjp_state = kp.vjp_stepper = raiser("a vector-Jacobian product of the adjoint solve")
            return kp

        lp.kernel.bind = patched
    lp(torch.randn(3, 4)).square().sum().backward()


def run_case(case, bad):
    import failures as mpi_failures  # tests/mpi_scripts/failures.py: the same failing solves

    comm = as_communicator(dist.group.WORLD)
    if case in ("step", "adjoint"):
        return layer_parallel_case(case, bad)
    if case == "alarm":
        c = mgrit.torch_dist.TorchDistComm(dist.group.WORLD)  # a fresh wrapper: the alarm makes it unusable
        if c.rank == bad:
            time.sleep(0.3)
            c.alarm(RuntimeError("NaN in shard"))
            raise Injected("alarm raised here")
        c.allreduce_array(np.ones(3))
        return None
    mode, cycle = {"raise": ("raise", 1), "late": ("raise", 4), "final": ("raise", 6), "nan": ("nan", 2),
                   "u0": ("u0", 1), "grid": ("grid", 1), "many": ("raise", 1), "u0diff": ("u0diff", 1),
                   "u0ulp": ("u0ulp", 1), "u0layout": ("u0layout", 1), "u0half": ("u0half", 1)}[case]
    for _ in range(30 if case == "many" else 1):
        exc = mpi_failures.run_case(comm, mode, bad, cycle)
    if exc is not None:
        raise exc


def recovered():
    comm = as_communicator(dist.group.WORLD)
    prop, t = Dahlquist(-1.0), np.linspace(0.0, 4.0, 65)
    kw = dict(cf=2, max_levels=4, relax="FCF", tol=1e-12, max_iter=30)
    ref = mgrit.solve(prop, np.array([1.0, 0.5]), t, **kw)
    res = mgrit.solve(prop, np.array([1.0, 0.5]), t, comm=dist.group.WORLD, **kw)
    ok = np.array_equal(mgrit.gather(res, root=None), ref.u) and res.residuals == ref.residuals
    from propagators.torch import LayerParallel, ODENet

    ls = layers(12, seed=3)
    tight = dict(fwd_iters=60, bwd_iters=60, fwd_tol=1e-14, bwd_tol=1e-14)
    lp = LayerParallel(copy.deepcopy(ls), cf=2, max_levels=3, comm=dist.group.WORLD, **tight)
    ref_net = ODENet(copy.deepcopy(ls))
    torch.manual_seed(4)
    x = torch.randn(3, 4)
    xp, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    lp(xp).square().sum().backward()
    ref_net(xs).square().sum().backward()
    ok = ok and float((xp.grad - xs.grad).abs().max()) < 1e-10
    return ok and comm.size == dist.get_world_size()


def raises_value_error(case: str, call, text: str) -> bool:
    """Whether ``call()`` raised a ValueError mentioning ``text`` (else the case's failure is printed)."""
    try:
        call()
        print(f"case {case} rank {dist.get_rank()}: no error", flush=True)
        return False
    except ValueError as exc:
        if text not in str(exc):
            print(f"case {case} rank {dist.get_rank()}: {exc}", flush=True)
            return False
    return True


def grid_nan(bad_data):
    from propagators.torch import LayerParallel, allreduce_gradients

    # another layer size on one rank: new_group waited for ever
    if not raises_value_error("split", lambda: mgrit.split_comm(dist.group.WORLD, 1 if dist.get_rank() == 1 else 2),
                              "`layer_size` of split_comm differs between ranks: 1 on rank 1"):
        return 1
    layer_group, data_group = mgrit.split_comm(dist.group.WORLD, 2)
    for wrong in (layer_group, dist.group.WORLD):  # (the layer group or the world as the data one: every rank)
        if not raises_value_error("overlap", lambda: LayerParallel(layers(12), cf=2, max_levels=3, comm=layer_group,
                                                                   data_comm=wrong), "mgrit.split_comm"):
            return 1
    lp = LayerParallel(layers(12), cf=2, max_levels=3, comm=layer_group, data_comm=data_group)
    model = nn.Sequential(nn.Linear(3, 4), lp, nn.Linear(4, 1))
    torch.manual_seed(5)
    X = torch.randn(8, 3)
    d = dist.get_rank(data_group)
    shard = X[4 * d: 4 * d + 4].clone()
    if d == bad_data:
        shard[0, 0] = float("nan")
    start = time.perf_counter()
    try:
        model(shard).square().mean().backward()
        allreduce_gradients(model, data_group)
    except BaseException as exc:  # noqa: BLE001
        print(f"case grid rank {dist.get_rank()}: {type(exc).__name__}: {exc} "
              f"[after {time.perf_counter() - start:.2f} s]", flush=True)
        return 0
    print(f"case grid rank {dist.get_rank()}: no error", flush=True)
    return 1


def main():
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if sys.argv[1] == "--grid-nan":
        rc = grid_nan(int(sys.argv[2]))
        dist.destroy_process_group()
        return rc
    for spec in sys.argv[1:]:
        case, bad = spec.split(":")
        start = time.perf_counter()
        try:
            run_case(case, int(bad))
        except BaseException as exc:  # noqa: BLE001 - report whatever arrived
            print(f"case {case} rank {rank}: {type(exc).__name__}: {exc} [after {time.perf_counter() - start:.2f} s]",
                  flush=True)
        else:
            print(f"case {case} rank {rank}: no error", flush=True)
    ok = recovered()
    print(f"rank {rank}: recovered {'OK' if ok else 'MISMATCH'} "
          f"(retired channels {mgrit.torch_dist.retired_channels()})", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
