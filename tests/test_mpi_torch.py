"""LayerParallel over MPI: 2 and 4 ranks, and a 2 x 2 layer x data grid (launches mpiexec)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("mpi4py")

SCRIPT = Path(__file__).parent / "mpi_scripts" / "torch_layer_parallel.py"
MPIEXEC = Path(sys.executable).parent / "mpiexec"


def launch(n, *args, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([str(MPIEXEC), "-n", str(n), sys.executable, str(SCRIPT), *args],
                          capture_output=True, text=True, timeout=timeout, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for r in range(n):
        assert f"rank {r} OK" in out, out


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec not installed next to python")
@pytest.mark.parametrize("n", [2, 4])
def test_layer_parallel_matches_serial_on_ranks(n):
    launch(n)


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec not installed next to python")
def test_layer_by_data_grid_matches_full_batch():
    launch(4, "grid")


@pytest.mark.mpi
@pytest.mark.cuda
@pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec not installed next to python")
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_layer_parallel_on_cuda_over_two_ranks():
    launch(2, "cuda")
