"""Start P local processes of a script with torchrun's environment (gloo on localhost).

``python _launch.py P script.py [args...]`` sets ``MASTER_ADDR``, ``MASTER_PORT`` (a free
port), ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` for each process, as ``torchrun`` does,
without torchrun's start-up cost; waits for all and exits with the largest return code.
The scripts call ``torch.distributed.init_process_group("gloo")``.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(n: int, argv: list, env: dict | None = None, stdout=None) -> list:
    """Start ``n`` processes of ``python argv...`` (output to ``stdout``, stderr with it when
    given); return the Popen objects."""
    base = dict(os.environ if env is None else env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                WORLD_SIZE=str(n), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="")  # (see tests/launch.py)
    err = None if stdout is None else subprocess.STDOUT
    return [subprocess.Popen([sys.executable, *argv], env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
                             stdout=stdout, stderr=err) for r in range(n)]


if __name__ == "__main__":
    procs = launch(int(sys.argv[1]), sys.argv[2:])
    sys.exit(max(abs(p.wait()) for p in procs))
