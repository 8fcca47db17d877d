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


@pytest.mark.parametrize("args, match", [
    (["--batch", "0"], "--batch: must be at least 1"),  # was ZeroDivisionError inside the epoch loop
    (["--ranks", "0"], "--ranks: must be at least 1"),  # was a silent one-process run
    (["--cf", "1"], "--cf: must be at least 2"),
    (["--lr", "nan"], "--lr: must be a finite number > 0"),
    (["--layers", "x"], "--layers: 'x' is not a whole number"),
    (["--seed", "-1"], "--seed: must be at least 0"),  # was numpy's "expected non-negative integer" traceback
    (["--seed", "99999999999999999999"], "--seed: must be at most 18446744073709551614"),  # was an OverflowError traceback
])
def test_bad_demo_arguments_are_usage_errors(args, match, capsys):
    from propagators.demo import parse

    with pytest.raises(SystemExit) as info:
        parse(args)
    assert info.value.code == 2 and f"error: argument {match}" in capsys.readouterr().err
    assert parse([]).layers == 32 and parse(["--T", "1.5"]).T == 1.5
    # --quick is 2 epochs unless --epochs says otherwise (it overrode an explicit --epochs 7 before)
    assert (parse([]).epochs, parse(["--quick"]).epochs, parse(["--quick", "--epochs", "7"]).epochs) == (15, 2, 7)


def test_a_missing_launcher_says_what_to_install(tmp_path, monkeypatch):
    """`--ranks 2` without mpiexec (pip install mpi4py brings no MPI) was a FileNotFoundError traceback."""
    from pathlib import Path

    from propagators import demo

    real = sys.executable
    assert demo._launcher(Path(real), "python", "") == real
    monkeypatch.setenv("PATH", str(tmp_path))  # no launcher on PATH, none beside this interpreter
    monkeypatch.setattr(demo.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setattr(demo, "world", lambda: (None, 0, 1))
    with pytest.raises(SystemExit, match=r"--ranks needs `mpiexec`.*pip install mpich mpi4py"):
        demo.main(["--ranks", "2"])
    with pytest.raises(SystemExit, match=r"--ranks needs `torchrun`.*--launcher mpiexec"):
        demo.main(["--ranks", "2", "--launcher", "torchrun"])


def test_settings_that_diverge_end_with_a_message_not_a_traceback():
    """`--T 1e300` overflows the layers: the demo ended in a DivergenceError traceback; now one line on
    stderr and exit status 1."""
    out = subprocess.run([sys.executable, "-m", "propagators.demo", "--layers", "4", "--epochs", "1", "--T", "1e300"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "the layer-parallel training stopped: MGRIT diverged" in out.stderr
