"""The README's quick-start code runs as printed."""
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
DOCS = sorted((README.parent / "docs").glob("*.md"))
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
# skip templates, MPI snippets and the torchrun script (tests/test_torch_dist.py launches that one)
RUNNABLE = [b for b in BLOCKS if "..." not in b and "MPI" not in b and "init_process_group" not in b]
DOC_BLOCKS = [(p.name, k, b) for p in DOCS for k, b in enumerate(re.findall(r"```python\n(.*?)```", p.read_text(), re.S))
              if "..." not in b and "MPI" not in b and "mpiexec" not in b]


@pytest.mark.parametrize("k", range(len(RUNNABLE)))
def test_readme_block_runs(k, capsys):
    pytest.importorskip("torch")
    namespace: dict = {}
    exec(compile(RUNNABLE[k], f"README block {k}", "exec"), namespace)
    if "res" in namespace:  # the solver quick start: XBraid ex-01's numbers
        assert namespace["res"].converged and namespace["res"].iterations == 4
    if "block" in namespace:  # the training quick start: residuals are reported
        assert len(namespace["block"].forward_residuals) == 2


@pytest.mark.parametrize("name, k, block", DOC_BLOCKS, ids=[f"{n}-{k}" for n, k, _ in DOC_BLOCKS])
def test_docs_examples_run(name, k, block):
    """Every complete Python example in docs/*.md runs as printed."""
    pytest.importorskip("torch")
    import torch

    old = torch.get_default_dtype()
    try:
        exec(compile(block, f"docs/{name} block {k}", "exec"), {"__name__": "__docs__"})
    finally:
        torch.set_default_dtype(old)


def test_readme_has_quick_starts():
    assert len(RUNNABLE) >= 2


@pytest.mark.parametrize("path", [README] + DOCS, ids=lambda p: p.name)
def test_code_fences_open_and_close(path):
    """A fence line is ```` ``` ```` or ```` ```lang ````, and every block closes: a closing fence followed by a
    comment does not close its block in CommonMark (README's GRU example once rendered the next 100 lines,
    headings included, as code)."""
    fences = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.lstrip().startswith("```")]
    opened = False
    for n, line in fences:
        closing = re.fullmatch(r"\s*```\s*", line) is not None
        assert closing or (not opened and re.fullmatch(r"\s*```[\w+-]+\s*", line)), f"{path.name}:{n}: {line!r}"
        opened = not opened
    assert not opened, f"{path.name}: a block is never closed"
