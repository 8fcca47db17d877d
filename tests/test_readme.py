"""The README's quick-start code runs as printed."""
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
RUNNABLE = [b for b in BLOCKS if "..." not in b and "MPI" not in b]  # skip templates and MPI snippets


@pytest.mark.parametrize("k", range(len(RUNNABLE)))
def test_readme_block_runs(k, capsys):
    pytest.importorskip("torch")
    namespace: dict = {}
    exec(compile(RUNNABLE[k], f"README block {k}", "exec"), namespace)
    if "res" in namespace:  # the solver quick start: XBraid ex-01's numbers
        assert namespace["res"].converged and namespace["res"].iterations == 4
    if "block" in namespace:  # the training quick start: residuals are reported
        assert len(namespace["block"].forward_residuals) == 2


def test_readme_has_quick_starts():
    assert len(RUNNABLE) >= 2
