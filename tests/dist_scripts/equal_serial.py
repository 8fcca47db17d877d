"""``mgrit.solve`` over a torch.distributed gloo group equals the serial solve, bit for bit.

Run as ``python _launch.py P equal_serial.py [--torch]`` (or under ``torchrun``). The
cases and checks are those of ``tests/mpi_scripts/equal_serial.py`` (linear, FAS,
nested, F-cycles, spatial coarsening, awkward distributions; torch states), with
``comm=`` the world process group, and the checks of a session's ``share``, of a
solve on ``ReversedInSession``, of ``exact_many``, ``waited`` and ``agree`` from
``mpi_scripts/comm_session.py``. Every rank prints ``rank r: OK n cases`` or its
``MISMATCH`` lines; exit 0 only when nothing failed.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "mpi_scripts"))


def main() -> int:
    import torch.distributed as dist
    from equal_serial import cases, check_case

    from mgrit.torch_dist import TorchDistComm

    class Checked(TorchDistComm):
        """The communicator plus the two mpi4py calls the checks make."""

        def allgather(self, obj):
            return self.gather(obj, root=None)

        def allreduce(self, value, op="sum"):
            if np.ndim(value):
                return self.allreduce_array(np.asarray(value))
            return super().allreduce(value, op)

    dist.init_process_group("gloo")
    comm = Checked(dist.group.WORLD)
    failures, all_cases = [], cases(comm.size, "--torch" in sys.argv)
    for name, prop, u0, t, kw in all_cases:
        failures += check_case(comm, name, prop, u0, t, kw)
    # the world group itself (as_communicator's cached wrapper) gives the same result
    import mgrit

    name, prop, u0, t, kw = all_cases[0]
    ref = mgrit.solve(prop, u0, t, **kw)
    res = mgrit.solve(prop, u0, t, comm=dist.group.WORLD, **kw)
    if not np.array_equal(mgrit.gather(res, root=None), ref.u) or res.residuals != ref.residuals:
        failures.append("comm=dist.group.WORLD differs from the serial solve")
    # the session's share and a solve on ReversedInSession (the checks of mpi_scripts/comm_session.py)
    from comm_session import check_agree_against_a_session, check_exact_many, check_share_and_reversed, check_waited

    failures += check_share_and_reversed(comm) + check_exact_many(comm)
    check_waited(comm, failures)
    check_agree_against_a_session(comm, failures)
    for f in failures:
        print(f"rank {comm.rank}: MISMATCH {f}", flush=True)
    if not failures:
        print(f"rank {comm.rank}: OK {len(all_cases)} cases", flush=True)
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
