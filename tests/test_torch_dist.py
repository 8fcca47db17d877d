"""torch.distributed (gloo on CPU) as the second engine: equality with serial, failures, launch.

Every test starts P local processes of a script in tests/dist_scripts/ with
torchrun's environment (``_launch.py``: a free localhost port, ``RANK``,
``WORLD_SIZE``; the scripts call ``init_process_group("gloo")``) and a timeout;
the demo test goes through ``torchrun`` itself. The scripts compute their
references themselves and print one line per rank.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).parent / "dist_scripts"
sys.path.insert(0, str(SCRIPTS))
from _launch import launch as _start  # noqa: E402


def launch(n: int, script: str, *args: str, timeout: float = 120):
    """Run ``script`` on ``n`` processes; return (largest return code, combined output)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = []
    with tempfile.TemporaryFile("w+") as out:
        procs = _start(n, [str(SCRIPTS / script), *args], env, stdout=out)
        try:
            for p in procs:
                p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGKILL)
            out.seek(0)
            pytest.fail(f"{script} {' '.join(args)} on {n} processes did not return within {timeout} s "
                        f"(a process hangs?)\n{out.read()[-4000:]}")
        out.seek(0)
        log.append(out.read())
    return max(abs(p.returncode) for p in procs), log[0]


def test_readme_torchrun_grid_script_runs(tmp_path):
    """README's layer x data grid script (4 processes, gloo) runs as printed: three training steps whose
    loss (of rank 0's shard) falls."""
    text = (ROOT / "README.md").read_text()
    start = text.index("# grid.py -- run:")
    script = tmp_path / "grid.py"
    script.write_text(text[start: text.index("```", start)])
    rc, out = launch(4, str(script))
    assert rc == 0, out[-3000:]
    losses = [float(m.group(2)) for m in re.finditer(r"^(\d) ([0-9.]+)$", out, re.M)]
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2], out[-3000:]


# --------------------------------------------------------------------------- serial == parallel
@pytest.mark.parametrize("n, torch_states", [(1, True), (2, False), (3, True)])  # (4 ranks: tests/test_mpi.py)
def test_solve_over_gloo_equals_serial_bit_for_bit(n, torch_states):
    """The cases of tests/mpi_scripts/equal_serial.py (linear, FAS, nested, F-cycles, spatial
    coarsening, awkward distributions, torch float64 / float32 states) over a gloo group:
    solution, gathers, residual history, iterations, summed costs equal the serial solve
    (and so the MPI solve, which equals it too)."""
    rc, out = launch(n, "equal_serial.py", *(["--torch"] if torch_states else []))
    assert rc == 0, out[-5000:]
    assert {int(r) for r in re.findall(r"rank (\d+): OK \d+ cases", out)} == set(range(n)), out[-5000:]


@pytest.mark.parametrize("n", [2, 3])  # (4 ranks: tests/test_mpi_torch.py)
def test_layer_parallel_over_gloo_equals_one_process_bit_for_bit(n):
    """Output, input gradient and every parameter gradient equal the same LayerParallel on
    one process exactly, and serial autograd to 1e-12 / 1e-10, over optimizer steps."""
    rc, out = launch(n, "layer_parallel.py")
    assert rc == 0, out[-5000:]
    assert all(f"rank {r} OK" in out for r in range(n)), out[-5000:]


def test_recurrent_modules_over_gloo_equal_torchs_and_one_process():
    """ParallelGRU and ParallelLSTM (bidirectional, two layers) over 2 gloo processes: converged,
    nn.GRU's / nn.LSTM's output, states and gradients; inexact with dropout, the one-process pass
    exactly; a failing adjoint step on one process raises on every one."""
    rc, out = launch(2, "recurrent.py")
    assert rc == 0, out[-5000:]
    assert all(f"rank {r} OK" in out for r in range(2)), out[-5000:]


def test_layer_by_data_grid_of_process_groups_matches_full_batch():
    """split_comm(dist.group.WORLD, 2): a 2 x 2 grid of gloo groups; allreduce_gradients over
    the data group gives the full-batch gradients (also for uneven shards)."""
    rc, out = launch(4, "layer_parallel.py", "grid")
    assert rc == 0, out[-5000:]
    assert all(f"rank {r} OK" in out for r in range(4)), out[-5000:]


@pytest.mark.parametrize("n, mode", [(2, "data"), (4, "grid")])
def test_distributed_data_parallel_around_a_block_matches_the_full_batch(n, mode):
    """PyTorch's DistributedDataParallel around a model holding a block: every process holding the whole
    block (comm=None), or the block over the layer group of a 2 x 2 grid and DDP over the data group, trains
    as the serial network on the whole batch (gradients and weights after three steps, 1e-9)."""
    rc, out = launch(n, "ddp.py", mode)
    assert rc == 0, out[-5000:]
    assert all(f"rank {r} OK" in out for r in range(n)), out[-5000:]


# --------------------------------------------------------------------------- failures
def _reports(out):
    return {(c, int(r)): (kind, msg, float(s)) for c, r, kind, msg, s in
            re.findall(r"case (\w+) rank (\d+): (\w+): (.*?) \[after ([\d.]+) s\]", out)}


def test_failures_reach_every_process_within_seconds_and_the_group_stays_usable():
    """3 processes: an exception in a step of a solve (early, late, in the final relaxation),
    a divergence, bad and inconsistent input, an exception in a layer of LayerParallel's
    forward solve and in its adjoint, an alarm outside any session, and 30 caught failing
    solves in a row. Every process raises within seconds (the others RemoteRankError naming
    the failed rank); afterwards a solve and a layer-parallel step on the same group equal
    the serial ones, and no channel had to be retired (every cleanup emptied its channel)."""
    cases = ["raise:1", "late:0", "final:2", "nan:1", "u0:2", "grid:1", "step:1", "adjoint:2", "alarm:1", "many:0",
             "u0diff:2", "u0ulp:1", "u0layout:2", "u0half:1"]
    alike = ["u0ulp:1", "u0layout:2", "u0half:1"]  # no error
    rc, out = launch(3, "failures.py", *cases, timeout=180)
    rep = _reports(out)
    names = [c.split(":")[0] for c in cases if c not in alike]
    assert set(rep) == {(c, r) for c in names for r in range(3)}, out[-5000:]
    for spec in alike:
        assert {int(r) for r in re.findall(rf"case {spec.split(':')[0]} rank (\d+): no error", out)} == {0, 1, 2}, \
            (spec, out[-5000:])
    for spec in cases[:-len(alike)]:
        case, bad = spec.split(":")
        bad = int(bad)
        for r in range(3):
            kind, msg, seconds = rep[case, r]
            assert seconds < 5.0, (case, r, seconds)
            if case == "grid":
                assert kind == "ValueError" and "differ between ranks" in msg, (case, r, msg)
            elif case == "u0diff":
                assert kind == "ValueError" and "`u0` differs between ranks: rank 2's" in msg, (case, r, msg)
            elif case == "nan":
                assert kind == "DivergenceError" or (kind == "RemoteRankError" and "DivergenceError" in msg)
            elif r == bad:
                assert kind == {"u0": "ValueError"}.get(case, "Injected"), (case, r, kind, msg)
            else:
                assert kind == "RemoteRankError" and f"rank {bad}" in msg, (case, r, kind, msg)
                if case == "alarm":
                    assert "(alarm): RuntimeError: NaN in shard" in msg
    recovered = re.findall(r"rank (\d+): recovered OK \(retired channels (\d+)\)", out)
    assert {int(r) for r, _ in recovered} == {0, 1, 2}, out[-5000:]
    assert all(k == "0" for _, k in recovered), out[-3000:]
    assert rc == 0, out[-5000:]


def test_nan_in_one_data_shard_reaches_the_other_data_ranks():
    """2 x 2 grid: the shard of data rank 1 holds a NaN; its layer processes (world 2, 3) raise
    in the solve and alarm the data group; world 0 and 1, waiting in allreduce_gradients,
    raise RemoteRankError naming them within seconds."""
    rc, out = launch(4, "failures.py", "--grid-nan", "1", timeout=120)
    rep = _reports(out)
    assert {r for _, r in rep} == {0, 1, 2, 3}, out[-5000:]
    for r in (0, 1):
        kind, msg, seconds = rep["grid", r]
        assert kind == "RemoteRankError" and f"rank {r + 2}" in msg and seconds < 10, (r, kind, msg)
    assert rc == 0, out[-5000:]


# --------------------------------------------------------------------------- launch and benchmark
def test_demo_runs_under_torchrun():
    pytest.importorskip("sklearn")
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun not installed next to python")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "propagators.demo", "--ranks", "2", "--launcher", "torchrun",
                           "--quick", "--layers", "16", "--epochs", "1"], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 layer-parallel rank(s) (torch.distributed, gloo)" in proc.stdout, proc.stdout
    assert re.search(r"^layer-parallel\s+[\d.]+%", proc.stdout, re.M), proc.stdout


def test_engines_benchmark_quick_run():
    """benchmarks/engines.py --quick launches its MPI and gloo runs and prints the table."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engines.py"), "--quick"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "torch.distributed (gloo)" in proc.stdout and "latency 64 B" in proc.stdout, proc.stdout
    assert "wait under load" in proc.stdout and "recv posted first" in proc.stdout, proc.stdout
    assert "wait at rest" in proc.stdout, proc.stdout


# --------------------------------------------------------------------------- no process group needed
def test_tags_are_coded_in_ten_bits_and_out_of_range_tags_are_refused():
    from mgrit.comm import Tag
    from mgrit.torch_dist import TorchDistComm, _code

    codes = [_code(t) for t in [0, 511, *Tag, TorchDistComm.tag_ub]]
    assert len(set(codes)) == len(codes) and max(codes) < 1024
    for bad in (512, Tag.USER - 1, TorchDistComm.tag_ub + 1):
        with pytest.raises(ValueError, match="Tag.USER"):
            _code(bad)


def test_process_group_is_recognised_without_initialising_anything():
    from mgrit.comm import as_communicator
    from mgrit.torch_dist import is_process_group

    assert not is_process_group(object()) and not is_process_group(None)
    with pytest.raises(TypeError, match="ProcessGroup"):
        as_communicator("world")


@pytest.mark.parametrize("n, where", [(3, "split"), (2, "between")])
def test_a_process_that_dies_makes_the_others_raise_remote_rank_error(n, where):
    """The last process dies of an uncaught exception before ``split_comm`` (the others waited in
    ``new_group`` for ever) or between forward and backward (they got gloo's bare error about a
    port): every other process raises RemoteRankError, rank 0's naming the process that died."""
    rc, out = launch(n, "gone.py", where, timeout=120)
    last = n - 1
    assert "was not stopped" not in out and f"RuntimeError: user code failed on rank {last}" in out, out[-5000:]
    raised = dict(re.findall(r"rank (\d+) raised RemoteRankError: (.*)", out))
    assert set(raised) == {str(r) for r in range(last)}, out[-5000:]
    assert raised["0"].startswith(f"rank {last} is gone: its connection closed while this rank waited for it"), \
        out[-5000:]


def test_no_process_aborts_at_exit_after_a_cascade_of_failures():
    """A 2 x 2 layer x data grid (gone.py grid): process 0 dies between forward and backward, its
    layer partner dies of the RemoteRankError, the other two raise it in ``allreduce_gradients``.
    A process that left a wait behind used to abort at exit (``terminate called without an active
    exception``, return code -6; in 4 of 6 runs before the fix): the wait returned while Python was
    finalising. Every process now ends with its program's own code, and every error names process 0."""
    rc, out = launch(4, "gone.py", "grid", timeout=120)
    assert "terminate called" not in out and rc == 3, out[-5000:]  # 1 (ranks 0, 1) and 3 (ranks 2, 3)
    assert "RuntimeError: user code failed on rank 0" in out and "was not stopped" not in out, out[-5000:]
    raised = dict(re.findall(r"rank (\d+) raised RemoteRankError: (.*)", out))
    assert set(raised) == {"1", "2", "3"} and all("rank 0 is gone" in v for v in raised.values()), out[-5000:]


def test_processes_that_retry_after_a_process_died_raise_instead_of_waiting():
    """After a process died, the others catch the RemoteRankError and try again on the same group:
    each try raises RemoteRankError naming the dead process on every other process. Before, a root
    that found the process gone raised alone and the others waited for its answer for ever."""
    rc, out = launch(3, "gone.py", "retry", timeout=120)
    assert "was not stopped" not in out and "RuntimeError: user code failed on rank 2" in out, out[-5000:]
    raised = re.findall(r"rank (\d+) step (\d+) raised RemoteRankError: (.*)", out)
    assert sorted((r, k) for r, k, _ in raised) == [(r, k) for r in "01" for k in "234"], out[-5000:]
    assert all(note.startswith("rank 2 is gone") for _, _, note in raised), out[-5000:]
    assert "rank 0 done" in out and "rank 1 done" in out and rc == 1, out[-5000:]


def test_a_process_that_ends_beside_a_busy_peer_exits_cleanly():
    """exits.py busy: process 1 ends while process 0 is stopped for 0.8 s, with no failure anywhere;
    both end with code 0 (an exchange of messages at exit, tried against the late-alarm abort of the
    README's limitations, aborted the exiting process here in 2 and 3 of 3 runs)."""
    rc, out = launch(2, "exits.py", "busy", timeout=120)
    assert "terminate called" not in out and rc == 0, out[-5000:]
    assert sorted(re.findall(r"rank (\d+) ends", out)) == ["0", "1"], out[-5000:]


def test_a_healthy_job_outlives_its_process_groups_timeout():
    """The failure-notice listener's receive is always posted; waited with the group's timeout (30 minutes
    by default, 2 s here) gloo closed the group's connections when it ran out, and both processes raised
    "rank ... is gone" in the middle of a healthy run."""
    rc, out = launch(2, "long_run.py", timeout=120)
    assert rc == 0 and sorted(re.findall(r"rank (\d) ok after", out)) == ["0", "1"], out[-5000:]


def test_a_process_group_that_is_none_before_init_is_named(monkeypatch):
    """Before init_process_group, dist.group.WORLD is None, which means "one process": under torchrun every
    process trained alone and allreduce_gradients averaged nothing (split_comm raised AttributeError)."""
    import torch
    from torch import nn

    import mgrit
    from propagators.torch import allreduce_gradients

    model = nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    allreduce_gradients(model, None)  # no torchrun: one data replica, nothing to average
    with pytest.raises(ValueError, match="got None$"):
        mgrit.split_comm(None, 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2 and torch.distributed is not initialised"):
        allreduce_gradients(model, None)
    with pytest.raises(ValueError, match="dist.group.WORLD is None until torch.distributed.init_process_group"):
        mgrit.split_comm(None, 1)
    # the blocks and the solver with comm=None there (dist.group.WORLD passed too early): each process ran
    # all of the work alone, without a word; now a warning that says so
    import numpy as np

    from propagators import Heat1D
    from propagators.torch import LayerParallel, MultiStage, ParallelGRU, ParallelLSTM, Stage

    prop = Heat1D(9)
    builds = {"LayerParallel": lambda: LayerParallel([nn.Linear(2, 2) for _ in range(4)]),
              "ParallelGRU": lambda: ParallelGRU(2, 3), "ParallelLSTM": lambda: ParallelLSTM(2, 3),
              "MultiStage": lambda: MultiStage([nn.Linear(2, 2), Stage(lambda i: nn.Linear(2, 2), 4)]),
              "mgrit.solve": lambda: mgrit.solve(prop, prop.initial(), np.linspace(0, 1, 9))}
    for name, build in builds.items():
        with pytest.warns(RuntimeWarning, match=rf"^{name} got comm=None and runs on this process alone "
                                                r"\(this process was launched with WORLD_SIZE=2"):
            build()
    for value in ("1", "", "abc", "2.0"):  # (no whole number > 1: no launcher's; "abc" raised ValueError)
        monkeypatch.setenv("WORLD_SIZE", value)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for build in builds.values():
                build()


def test_a_group_this_rank_is_not_in_is_named():
    """torch.distributed gives ranks outside a new_group the int GroupMember.NON_GROUP_MEMBER (-100):
    passing it as comm said "got int"."""
    import torch.distributed as dist

    from mgrit.comm import as_communicator

    with pytest.raises(ValueError, match="this rank is not a member of the process group passed as `comm`"):
        as_communicator(dist.GroupMember.NON_GROUP_MEMBER)
    with pytest.raises(TypeError, match="got int"):
        as_communicator(7)


@pytest.mark.parametrize("case", ["threads", "default", "timeout"])
def test_threads_backend_strings_and_the_groups_timeout(case):
    """A review of the engine: two threads on two groups hung for ever (one helper waited for every gloo
    handle of the process in turn); two threads in one block aborted a process with gloo's size mismatch
    (now a RuntimeError naming the other thread); torch's default init_process_group() and 'cpu:gloo'
    were refused as not gloo; the group's timeout read as "a peer process may have died"
    (tests/dist_scripts/threads.py)."""
    rc, out = launch(2, "threads.py", case, timeout=120)
    lines = {"threads": 2, "default": 2, "timeout": 1}[case]  # (per rank)
    assert rc == 0 and " FAIL " not in out, out[-5000:]
    assert sorted(re.findall(rf"rank (\d) {case} ok", out)) == ["0"] * lines + ["1"] * lines, out[-5000:]
    assert "terminate called" not in out, out[-5000:]
