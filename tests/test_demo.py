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
