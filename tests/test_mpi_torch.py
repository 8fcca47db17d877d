"""LayerParallel over MPI (launches mpiexec): equality with serial autograd on 2, 3 and 4
ranks and a 2 x 2 layer x data grid, any layers, split memory, checkpoints, and a failure
in any phase of a step reaching every rank within seconds."""
from __future__ import annotations

import re

import pytest
from launch import assert_all_ok, launch, needs_mpiexec

pytest.importorskip("torch")
pytest.importorskip("mpi4py")

@pytest.mark.mpi
@needs_mpiexec
@pytest.mark.parametrize("n", [2, 4])
def test_layer_parallel_matches_serial_on_ranks(n):
    assert_all_ok(n, *launch(n, "torch_layer_parallel.py"))


@pytest.mark.mpi
@needs_mpiexec
def test_layer_by_data_grid_matches_full_batch():
    assert_all_ok(4, *launch(4, "torch_layer_parallel.py", "grid"))


@pytest.mark.mpi
@needs_mpiexec
@pytest.mark.parametrize("n", [2, 3])
def test_any_layers_split_memory_and_checkpoints_on_ranks(n):
    assert_all_ok(n, *launch(n, "torch_any_layers.py"))


@pytest.mark.mpi
@needs_mpiexec
@pytest.mark.parametrize("n", [2, 3])
def test_batch_norm_and_dropout_equal_serial_on_ranks(n):
    assert_all_ok(n, *launch(n, "norm_dropout.py"))


CASES = ["check", "empty", "halo", "forward", "ghost", "adjoint", "params", "inplace", "interrupt", "factory", "layout",
         "activation", "tied", "to_serial", "load_serial", "settings", "eval", "batch", "bwd_settings", "outer", "order",
         "shuffled", "loss", "nanloss", "nanin", "n_layers", "shard", "modules", "argument", "calls", "skip",
         "scheme", "replica_values", "replica_T", "replica_swap", "backward_order", "autocast", "switch_loss"]
#: ranks whose handshakes differ: every rank raises ValueError naming the call (the arguments of one call,
#: or each rank's call), none waits
MISMATCH = {"settings": ["the arguments of the forward pass (an MGRIT solve) of LayerParallel #", "fwd_iters"],
            "batch": ["the arguments of the forward pass (an MGRIT solve) of LayerParallel #", "input shapes"],
            "autocast": ["the arguments of the forward pass (an MGRIT solve) of LayerParallel #", "torch.autocast"],
            "bwd_settings": ["the arguments of the backward pass of LayerParallel #", "bwd_iters"],
            "eval": ["the collective calls differ", "in the forward pass (an MGRIT solve) of LayerParallel #",
                     "in the forward pass in eval mode (exact_eval: a serial sweep) of LayerParallel #"],
            "calls": ["the collective calls differ", "in the forward pass (an MGRIT solve) of LayerParallel #",
                      "in to_serial() of LayerParallel #"],
            "skip": ["the collective calls differ", "in the forward pass (an MGRIT solve) of LayerParallel #",
                     "in the backward pass of LayerParallel #"],
            "order": ["the collective calls differ", "in the forward pass (an MGRIT solve) of LayerParallel #"]}
#: ranks that disagree: every rank raises ValueError with this in its message
DISAGREE = {"shuffled": "input of rank", "loss": "gradient of the block's output",
            "nanloss": "gradient of the block's output",
            "n_layers": "different n_layers", "shard": "`shard_size` was given on some", "modules": "different parameters",
            "scheme": "different scheme (propagators.torch.schemes.",
            "replica_values": "hold different parameter values", "replica_T": "have different settings (n_layers, T",
            "replica_swap": "hold different parameter values",
            "backward_order": "the ranks run the backward passes of different forward passes of LayerParallel #"}


def failure_lines(out, name):
    return {int(r): (kind, msg, float(s)) for r, kind, msg, s in
            re.findall(rf"case {name} rank (\d+): (\w+): (.*?) \[after ([\d.]+) s\]", out)}


@pytest.mark.mpi
@needs_mpiexec
@pytest.mark.parametrize("n, bad", [(2, 1), (3, 0)])
def test_failure_in_any_phase_reaches_every_rank(n, bad):
    rc, out = launch(n, "torch_failures.py", *[f"{c}:{bad}" for c in CASES], timeout=240)
    for case in CASES:
        lines = failure_lines(out, case)
        assert set(lines) == set(range(n)), f"{case}: not every rank raised\n{out[-6000:]}"
        for r, (kind, msg, seconds) in lines.items():
            assert seconds < 10, f"{case}: rank {r} took {seconds} s\n{out[-4000:]}"
            if case == "tied":  # every rank sees the tie in the list it was given
                assert kind == "ValueError" and "share a parameter" in msg, (r, kind, msg)
            elif case in MISMATCH:  # the pass's handshake compares the call and the solve's arguments
                assert kind == "ValueError" and all(part in msg for part in MISMATCH[case]), (case, r, kind, msg)
                if case == "order":  # names the two blocks
                    assert len(set(re.findall(r"LayerParallel #(\d+)", msg))) == 2, msg
                else:  # with the rank(s) of the other call
                    assert f"rank {bad}" in msg or f"ranks {bad}" in msg, (case, r, msg)
            elif case in DISAGREE:
                assert kind == "ValueError" and DISAGREE[case] in msg, (case, r, kind, msg)
            elif case in ("layout", "activation"):  # a rank whose layer differs from its owner's: ValueError
                assert kind in ("ValueError", "RemoteRankError"), (r, kind, msg)
                assert any("differs between ranks" in m for _, m, _ in lines.values())
            elif case == "load_serial":  # the last layer's entries are missing: every rank sees it
                assert kind == "KeyError" and "lacks" in msg, (r, kind, msg)
            elif r != bad:
                assert kind == "RemoteRankError", f"{case}: rank {r} got {kind}: {msg}"
                if case == "empty":
                    assert "empty input" in msg, msg  # the failed rank's own error travels with the notice
                assert f"rank {bad}" in msg, f"{case}: rank {r}'s message does not name world rank {bad}: {msg}"
                # the backward pass runs on the reversed communicator: its errors are renumbered as the
                # module's communicator (here the world), so no second numbering appears
                assert "of this communicator" not in msg, f"{case}: rank {r}: {msg}"
    for r in range(n):
        assert f"rank {r}: recovered OK" in out, out[-6000:]
    assert rc == 0, out[-6000:]


@pytest.mark.mpi
@needs_mpiexec
def test_nan_in_one_data_shard_reaches_the_other_data_ranks():
    rc, out = launch(4, "torch_failures.py", "--grid-nan", "1", timeout=120)
    lines = failure_lines(out, "grid")
    assert set(lines) == {0, 1, 2, 3}, out[-6000:]
    # world ranks 2 and 3 hold data shard 1 (the NaN); 0 and 1 wait in allreduce_gradients
    for r in (0, 1):
        kind, msg, seconds = lines[r]
        assert kind == "RemoteRankError" and seconds < 10, lines[r]
        assert f"rank {r + 2}" in msg, msg


@pytest.mark.mpi
@needs_mpiexec
@pytest.mark.parametrize("n, where", [(2, "solve"), (3, "solve"), (2, "backward")])
def test_a_rank_killed_by_a_signal_ends_the_job_instead_of_hanging(n, where):
    """A killed process sends no alarm: the launcher ends the job (MPICH's mpiexec kills the other
    ranks, which were waiting for it inside the solve or in the adjoint's handshake). The launch
    returns within the timeout with a failure code, and no rank got past the step."""
    rc, out = launch(n, "killed_rank.py", where, timeout=120)
    assert all(f"rank {r} ready" in out for r in range(n)), out[-4000:]
    assert rc != 0 and "survived" not in out, (rc, out[-4000:])


@pytest.mark.mpi
@pytest.mark.cuda
@needs_mpiexec
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_layer_parallel_on_cuda_over_two_ranks():
    assert_all_ok(2, *launch(2, "torch_layer_parallel.py", "cuda"))
