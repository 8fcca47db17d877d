"""Launch a script of ``tests/mpi_scripts`` on several MPI ranks, for the tests that need ranks.

``mpiexec`` is looked up next to ``sys.executable`` (the virtual environment's, from the
``mpich`` wheel), then on PATH. A launch that outlives its timeout kills the whole process
group and fails the test (a hang is a failure, never a wait).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "mpi_scripts"


def mpiexec() -> str | None:
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


needs_mpiexec = pytest.mark.skipif(mpiexec() is None, reason="mpiexec not found")


def launch(n: int, script: str | Path, *args: str, timeout: float = 240, timed: bool = False):
    """Run ``script`` (in mpi_scripts/ unless a path; ``"--python"`` runs the interpreter with
    ``args``) on ``n`` ranks; return ``(return code, combined output)``, plus the seconds when
    ``timed``."""
    pytest.importorskip("mpi4py")
    exe = mpiexec()
    if exe is None:
        pytest.skip("mpiexec not found")
    # stdout buffered (PYTHONUNBUFFERED empty): the scripts print with flush=True, so each line leaves in
    # one write and lines of different ranks do not interleave (unbuffered, print writes a line and its
    # newline separately); stderr (tracebacks) is line-buffered anyway
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONUNBUFFERED="")
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # Open MPI's mpiexec refuses root (GPU machines, containers)
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if script == "--python":
        cmd = [exe, "-n", str(n), sys.executable, *args]
    else:
        cmd = [exe, "-n", str(n), sys.executable, str(SCRIPTS / script), *args]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"`{' '.join(cmd)}` did not return within {timeout} s (a rank hangs?)\n{out[-4000:]}")
    return (proc.returncode, out, time.perf_counter() - start) if timed else (proc.returncode, out)


def assert_all_ok(n: int, rc: int, out: str) -> None:
    """Exit status 0 and a "rank r OK" line from every rank."""
    assert rc == 0, out[-6000:]
    for r in range(n):
        assert f"rank {r} OK" in out, out[-6000:]
