"""Execute every notebook in notebooks/ in quick mode; any error fails the test.

The notebooks read ``MGRIT_NB_QUICK=1`` and shrink their sweeps. The kernel is
a temporary kernel spec that runs *this* interpreter (``sys.executable``), so
the test works from a fresh ``make test`` virtual environment whatever kernel
specs the user has installed elsewhere. Each notebook gets one wall-clock budget
(``MGRIT_NB_TIMEOUT`` seconds, default 300) shared by all of its cells.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
TIMEOUT = float(os.environ.get("MGRIT_NB_TIMEOUT", "300"))
KERNEL = "mgrit-tests-python3"


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    """A kernel spec for this interpreter, found first through JUPYTER_PATH."""
    root = tmp_path_factory.mktemp("jupyter")
    spec_dir = root / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (mgrit tests)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    mp = pytest.MonkeyPatch()
    mp.setenv("JUPYTER_PATH", str(root) + os.pathsep + os.environ.get("JUPYTER_PATH", ""))
    mp.setenv("MGRIT_NB_QUICK", "1")
    yield
    mp.undo()


def execute(nb, cwd: Path, budget: float):
    """Run all cells; the per-cell timeout is whatever is left of the notebook's budget."""
    deadline = time.monotonic() + budget

    def remaining(cell):
        return max(1, int(deadline - time.monotonic()))

    client = nbclient.NotebookClient(
        nb,
        kernel_name=KERNEL,
        timeout_func=remaining,
        startup_timeout=120,
        resources={"metadata": {"path": str(cwd)}},
    )
    client.execute()
    return nb


def test_kernel_runs_this_interpreter(kernel_env, tmp_path):
    nb = nbformat.v4.new_notebook()
    source = "import os, sys; print(sys.executable); print(os.environ['MGRIT_NB_QUICK'])"
    nb.cells = [nbformat.v4.new_code_cell(source)]
    execute(nb, tmp_path, 120)
    out = nb.cells[0].outputs[0]["text"].split()
    assert Path(out[0]).resolve() == Path(sys.executable).resolve()
    assert out[1] == "1"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, kernel_env, request, monkeypatch):
    if path.name.startswith("07_"):  # its quick run of the benchmark is the smoke test's (tests/conftest.py)
        monkeypatch.setenv("MGRIT_NB_VS_JSON", str(request.getfixturevalue("vs_model_parallel_quick")[1]))
    nb = nbformat.read(path, as_version=4)  # executed in memory: the committed file is not changed
    t0 = time.monotonic()
    try:
        execute(nb, path.parent, TIMEOUT)
    except nbclient.exceptions.CellTimeoutError as exc:
        pytest.fail(f"{path.name} exceeded its budget of {TIMEOUT:.0f} s: {exc}")
    except nbclient.exceptions.CellExecutionError as exc:
        pytest.fail(f"{path.name} raised an error:\n{exc}")
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: {errors[0]['ename']}: {errors[0]['evalue']}"
    assert time.monotonic() - t0 < TIMEOUT


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_committed_executed(path):
    """Notebooks are committed with the outputs of one complete run, in order and without errors
    (so that readers see the plots), start with a markdown statement and stay small."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.cells and nb.cells[0].cell_type == "markdown"
    counts = [c.execution_count for c in nb.cells if c.cell_type == "code"]
    assert counts and all(c is not None for c in counts), f"{path.name}: run every cell before committing"
    assert counts == sorted(counts) and len(set(counts)) == len(counts), f"{path.name}: run the cells in order"
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: committed with an error output"
    assert path.stat().st_size < 2_000_000, f"{path.name}: {path.stat().st_size} bytes; lower the figures' dpi"
