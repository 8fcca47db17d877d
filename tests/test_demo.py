"""`make demo` runs: the layer-parallel digits demo in its quick form."""
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")


def test_demo_quick_runs_and_reports_both_models():
    out = subprocess.run([sys.executable, "-m", "propagators.demo", "--quick"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    acc = dict(re.findall(r"^(layer-parallel|serial)\s+([\d.]+)%", out.stdout, re.M))
    assert set(acc) == {"layer-parallel", "serial"}, out.stdout
    # two epochs already separate the ten classes far better than chance (10%)
    assert float(acc["layer-parallel"]) > 50 and float(acc["serial"]) > 50
    assert "MGRIT statistics" in out.stdout and "level  points" in out.stdout
