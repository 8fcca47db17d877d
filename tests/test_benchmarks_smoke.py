"""Smoke runs of the benchmark scripts: they start, run their ``--quick`` setting and exit 0.

No timing is asserted here (timings belong to the benchmarks themselves).
``benchmarks/pymgrit_heat.py`` is left out: it downloads PyMGRIT into its own
virtual environment.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def run_benchmark(script: str, *args: str, timeout: float = 300) -> str:
    """Run ``benchmarks/<script>`` with one thread; assert it exits 0; return its stdout."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), *args],
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{script} {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.parametrize("script", ["overhead.py", "setup_scaling.py"])
def test_benchmark_quick_run_exits_cleanly(script):
    assert "points" in run_benchmark(script, "--quick")


def test_memory_per_rank_quick_run_splits_the_layers():
    """N/P layers per rank (plus a few halo layers) on 1 and 2 ranks."""
    pytest.importorskip("torch")
    mpiexec = Path(sys.executable).parent / "mpiexec"
    ranks = "1,2" if mpiexec.exists() else "1"
    out = run_benchmark("memory_per_rank.py", "--quick", "--ranks", ranks)
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    for P, _, built, owned, halo, *_ in rows:
        assert int(owned) + int(halo) == int(built)
        assert int(owned) <= -(-64 // int(P)) + 1 and int(halo) <= 4


def test_step_memory_quick_run_prints_both_networks():
    """One row per network, each with a measured peak for the serial and the parallel step."""
    pytest.importorskip("torch")
    out = run_benchmark("step_memory.py", "--quick")
    rows = [line.split() for line in out.splitlines() if line.startswith(("LayerParallel", "ParallelGRU"))]
    assert len(rows) == 2, out
    for row in rows:
        serial, parallel, ratio = float(row[-3]), float(row[-2]), float(row[-1])
        assert serial > 0 and parallel > 0  # (KiB rounded to whole numbers, the ratio to 2 decimals)
        assert (parallel - 0.5) / (serial + 0.5) - 0.005 <= ratio <= (parallel + 0.5) / (serial - 0.5) + 0.005


def test_fixed_cycles_quick_run_warns_where_its_ratios_say():
    """Each network's row: a forward ratio of 0.5 or more warned ('f'), an adjoint ratio of 0.75 or more ('a');
    a warned output or input gradient is far off serial (the warning's "probably far off"), an unwarned one
    within 0.6."""
    pytest.importorskip("torch")
    from propagators.torch.module import LARGE_RESIDUAL

    out = run_benchmark("fixed_cycles.py", "--quick")
    rows = [line.split()[-6:] for line in out.splitlines() if "," in line and line.split()
            and line.split()[-1] in ("-", "f", "a", "fa")]
    assert len(rows) == 4, out
    for fwd, err, adj, dx, _dw, warns in rows:
        fwd, err, adj, dx = map(float, (fwd, err, adj, dx))
        assert ("f" in warns) == (fwd >= LARGE_RESIDUAL["forward"]), out
        assert ("a" in warns) == (adj >= LARGE_RESIDUAL["adjoint"]), out
        assert err >= 0.9 if "f" in warns else err < 0.6, out
        assert dx >= 0.6 if "a" in warns else dx < 0.6, out
    assert [r[-1] for r in rows] == ["-", "fa", "fa", "fa"], out  # (a default network; scaled; unstable; damping)


def test_skip_tradeoff_quick_run_prints_every_setting_and_its_front():
    """Eight settings (skip True / False at four cycle counts), errors that more adjoint cycles reduce (2/2
    against 2/1, either skip) and a Pareto front of at least one setting."""
    pytest.importorskip("torch")
    out = run_benchmark("skip_tradeoff.py", "--quick")
    rows = [line.split() for line in out.splitlines() if line.startswith("N 64,")]
    assert len(rows) == 8, out
    err = {(r[-6], r[-5]): float(r[-3]) for r in rows}  # (skip, cycles) -> parameter-gradient error
    for skip in ("True", "False"):
        assert err[(skip, "2/2")] < err[(skip, "2/1")], out
    assert "Pareto front" in out and "skip " in out.split("Pareto front")[1], out


def test_warm_start_quick_run_exits_cleanly():
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    assert run_benchmark("warm_start.py", "--quick").count("%") == 4  # one accuracy per setting


def test_gpu_script_runs_dry_on_the_cpu_and_skips_cleanly_without_cuda():
    torch = pytest.importorskip("torch")
    out = run_benchmark("gpu.py", "--device", "cpu", "--layers", "16", "--widths", "4", "--batches", "2",
                        "--repeat", "1")
    assert "LP batched ms" in out
    # step 4, the comparison with model parallelism and pipelines, ran (tiny, on the CPU) and printed its table
    assert "benchmarks/vs_model_parallel.py --device cpu" in out and "LayerParallel ms" in out, out
    assert "grad err" in out, out
    if not torch.cuda.is_available():
        assert "no CUDA device" in run_benchmark("gpu.py", timeout=120)


def test_vs_model_parallel_quick_run_prints_the_table(vs_model_parallel_quick):
    """Model parallel, GPipe, 1F1B and LayerParallel on 1 and 2 gloo ranks (N 64): exit 0 and the tables
    (the run is shared with notebook 07's quick run: tests/conftest.py)."""
    out = vs_model_parallel_quick[0]
    assert "time per step" in out and "LayerParallel ms" in out and "model check at P = 2" in out
    # the launch-by-launch check: per method the median of the 2 rounds' differences, inside their range
    per = out.split("the same check launch by launch")[1].splitlines()
    row = next(line for line in per if line.split()[:3] == ["64", "16", "16"])
    cells = re.findall(r"([+-]\s*\d+)% \(\s*([+-]\s*\d+) \.\.\s*([+-]\s*\d+)\)", row)
    assert len(cells) == 4, row
    for med, lo, hi in cells:
        assert int(lo.replace(" ", "")) <= int(med.replace(" ", "")) <= int(hi.replace(" ", "")), row
    assert re.search(r"\d+/4 within 15%", out.split("the same check launch by launch")[1]), out
    rows = [line.split() for line in out.splitlines() if line.split()[:4] in (["64", "16", "16", "1"],
                                                                             ["64", "16", "16", "2"])]
    assert len(rows) == 6  # P 1 and 2, in the time table, the error / memory table and the measured peaks
    peaks = out.split("peak memory per rank, measured")[1].splitlines()
    for line in peaks[2:4]:  # every method's measured peak is at least its parameters (64 layers of 16 x 16 + 16)
        assert line.split()[:4] in (["64", "16", "16", "1"], ["64", "16", "16", "2"]), line
        P = int(line.split()[3])
        assert all(float(v) >= 64 * 272 * 4 / P / 1024 for v in line.split()[4:8]), line
    errors = [float(v) for v in rows[2][4::3]] + [float(v) for v in rows[3][4::3]]
    assert max(errors[0:3] + errors[4:7]) < 1e-5  # model parallel and both pipelines match serial autograd


def test_cnn_spatial_quick_run_prints_the_table():
    pytest.importorskip("torch")
    out = run_benchmark("cnn_spatial.py", "--quick")
    assert "setting" in out and "fwd it" in out and "P=8" in out, out


@pytest.mark.parametrize("script, needle", [("transformer_digits.py", "serial"), ("multistage_digits.py", "serial"),
                                            ("gru_timeseries.py", "nn.GRU"), ("adaptive_cycles.py", "adaptive"),
                                            ("transformer_timeseries.py", "| layer-parallel, masked |")])
def test_training_benchmarks_quick_runs_print_their_tables(script, needle):
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    if script.endswith("timeseries.py"):
        pytest.importorskip("aeon")  # its data files ship inside aeon
    out = run_benchmark(script, "--quick")
    assert needle in out and "%" in out, out


@pytest.mark.parametrize("cell, packed", [("gru", False), ("lstm", True)])
def test_gru_timeseries_quick_run_with_two_bidirectional_layers_and_dropout(cell, packed):
    pytest.importorskip("torch")
    pytest.importorskip("aeon")
    out = run_benchmark("gru_timeseries.py", "--quick", "--cell", cell, "--bidirectional", "--layers", "2",
                        "--dropout", "0.2", *(["--packed"] if packed else []))
    name = cell.upper()
    assert f"{name} hidden 16, 2 layer(s), bidirectional, dropout 0.2" in out, out
    assert ("packed at the series' lengths" if packed else "padded with each series' last value") in out, out
    assert f"| Parallel{name} (MGRIT) |" in out and f"| nn.{name} (serial) |" in out, out


def test_layer_parallel_quick_run_and_rank_sweep():
    """The one-process table, the side-by-side 2-rank rows (when mpiexec is there) and the sweep."""
    pytest.importorskip("torch")
    out = run_benchmark("layer_parallel.py", "--quick")
    assert "LayerParallel, 1 rank, nn.Sequential layers" in out and "critical-path model" in out
    bs = run_benchmark("layer_parallel.py", "--layers", "16", "--levels", "3", "--width", "4", "--repeat", "2",
                       "--batch-sweep", "1", "4")
    rows = [r for r in map(str.split, bs.splitlines()) if len(r) == 5 and r[0].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 4] and rows[0][2] == rows[0][4] == "1.00", bs  # growth from batch 1
    if (Path(sys.executable).parent / "mpiexec").exists():
        assert "1 -> 2 ranks:" in out
        sweep = run_benchmark("layer_parallel.py", "--sweep", "16", "--levels", "3", "--repeat", "2",
                              "--width", "4", "--batch", "2", "--launches", "2")
        rows = [r for r in map(str.split, sweep.splitlines()) if len(r) == 7 and r[0].isdigit()]
        assert [int(r[0]) for r in rows] == [16] and all(r[4].endswith("x") for r in rows)
        # the reported ratio is one of the launches' (the median launch)
        assert all(f"{float(r[4][:-1]):.2f}" in r[5:] for r in rows)
        # the breakdown: per launch and rank, the rank's waiting and its own work, each within its pass
        bd = run_benchmark("layer_parallel.py", "--breakdown", "--sweep", "16", "--levels", "3", "--repeat", "2",
                           "--width", "4", "--batch", "2", "--launches", "1")
        rows = [[float(v) for v in r] for r in map(str.split, bd.splitlines()) if len(r) == 8 and r[0].isdigit()]
        assert [(r[0], r[1]) for r in rows] == [(16, 0), (16, 1)], bd
        assert all(0 <= r[5] <= r[4] + 0.01 and 0 < r[6] <= r[4] + 0.01 for r in rows), bd
        # the phases of a pass: the nine phases and their sum, four columns (whole, half, rank 0, rank 1), none
        # negative, the solves' level work and set-up present in each
        lines = bd.split("the phases of a pass")[1].splitlines()
        phases = {ln[:26].strip(): [float(v) for v in ln[26:].split()] for ln in lines if ln.startswith("  ")}
        assert len(phases) == 10 and all(len(v) == 4 and min(v) >= 0 for v in phases.values()), bd
        assert min(phases["forward solve: levels"]) > 0 and min(phases["adjoint solve: set-up"]) > 0, bd


def test_families_quick_run_two_ranks_give_one_process_gradients():
    """GRU, LSTM, ViT and two-stage CNN: one step serial, layer-parallel on one process and on 2 ranks.
    The 2-rank gradients equal the one-process ones up to float32 rounding of the ranks' partial sums."""
    pytest.importorskip("torch")
    if not (Path(sys.executable).parent / "mpiexec").exists():
        pytest.skip("needs mpiexec (make venv installs mpich)")
    out = run_benchmark("families.py", "--quick", "--only", "gru", "lstm", "vit", "cnn")
    rows = {r[0]: r for r in map(str.split, out.splitlines()) if r and r[0] in ("gru", "lstm", "vit", "cnn")
            and len(r) >= 9}
    assert sorted(rows) == ["cnn", "gru", "lstm", "vit"], out
    for name, r in rows.items():
        serial, lp1, lp2 = map(float, r[1:4])
        assert serial > 0 and lp1 > 0 and lp2 > 0
        assert abs(lp1 / lp2 - float(r[6][:-1])) < 0.011, r  # the ratio printed is that of the times printed
        assert float(r[7]) <= 1e-5, f"{name}: 2-rank gradients differ from one process's: {r}"


def test_train_eval_quick_run_prints_the_table():
    """The run with a refresh() at every switch and the run that takes each mode's kernel again evaluate
    bitwise alike (the script exits non-zero otherwise)."""
    pytest.importorskip("torch")
    out = run_benchmark("train_eval.py", "--quick")
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| 16 |")]
    assert len(rows) == 1, out
    times = [float(c.split()[0]) for c in rows[0][2:5]]
    assert all(t > 0 for t in times), out


@pytest.mark.parametrize("script, args, message", [
    ("overhead.py", ["--repeats", "0"], "argument --repeats: '0' is not an integer >= 1"),
    ("layer_parallel.py", ["--layers", "0"], "argument --layers: '0' is not an integer >= 1"),
    ("memory_per_rank.py", ["--ranks", "1,,2"], "argument --ranks: '1,,2' is not a comma-separated list"),
    ("warm_start.py", ["--T", "nan"], "argument --T: 'nan' is not a finite number > 0"),
    ("multistage_digits.py", ["--seed", "-1"], "argument --seed: '-1' is not an integer >= 0"),
    ("adaptive_cycles.py", ["--ratio", "nan"], "argument --ratio: 'nan' is not a number >= 0 (inf allowed)"),
    ("train_eval.py", ["--steps", "1,0"], "argument --steps: '0' is not an integer >= 1"),
])
def test_benchmark_arguments_out_of_range_are_usage_errors(script, args, message):
    """``--repeats 0`` ran the default 5 repetitions, ``--layers 0`` divided by zero, ``--ranks 0`` too
    (memory_per_rank.py), ``--repeat 0`` took the median of no timings: each is now argparse's usage error."""
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 2 and message in proc.stderr and "usage:" in proc.stderr, proc.stderr


def test_benchmark_list_arguments_are_normalised():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from _cli import nonnegative_float, positive_ints
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert positive_ints(" 16, 64 ") == "16,64"
    assert nonnegative_float("inf") == float("inf") and nonnegative_float("0") == 0.0
    for bad in ("", "16,", "0", "16,-2", "1.5", "x"):
        with pytest.raises(Exception, match="is not"):
            positive_ints(bad)


def test_gru_timeseries_quick_subset_holds_every_class_and_regression_sets_are_refused():
    """--quick kept the first 64 cases of a file sorted by class (JapaneseVowels: 3 of 9 speakers in training,
    2 in testing); a regression set built a head of 0 outputs and failed deep inside torch."""
    pytest.importorskip("torch")
    pytest.importorskip("aeon")
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import gru_timeseries
    finally:
        sys.path.remove(str(BENCHMARKS))
    (Xtr, ytr, ltr), (_, yte, _), n_classes, T = gru_timeseries.load("JapaneseVowels", quick=True)
    assert n_classes == 9 and len(ytr) == len(yte) == 64 and int(ltr.max()) <= T == Xtr.shape[1]
    assert 7 <= int(ltr.min()) < T  # (the series' own lengths, for --packed)
    assert set(ytr.tolist()) == set(yte.tolist()) == set(range(9))
    assert max(np.bincount(ytr.numpy())) - min(np.bincount(ytr.numpy())) <= 1  # classes in turn
    with pytest.raises(SystemExit, match="not a classification set"):
        gru_timeseries.load("Covid3Month", quick=True)
