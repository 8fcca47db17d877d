"""Smoke runs of the benchmark scripts: they start, run their ``--quick`` setting and exit 0.

No timing is asserted here (timings belong to the benchmarks themselves).
``benchmarks/pymgrit_heat.py`` is left out: it downloads PyMGRIT into its own
virtual environment.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize("script", ["overhead.py", "setup_scaling.py"])
def test_benchmark_quick_run_exits_cleanly(script):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), "--quick"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"{script} --quick failed:\n{proc.stdout}\n{proc.stderr}"
    assert "points" in proc.stdout
