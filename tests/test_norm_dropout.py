"""BatchNorm and dropout inside LayerParallel layers, against the plain serial network.

Semantics (docs/norm_dropout.md):

* BatchNorm in training mode normalises every layer with the batch statistics of
  its own input states; its running statistics advance once per forward pass,
  from the returned trajectory. At convergence output, every gradient and the
  running statistics equal the serial network's.
* Dropout draws each layer's masks once per forward pass, in serial layer order,
  from the global generator; every relaxation, cycle and the adjoint reuse them.
  ``torch.manual_seed(s); lp(x)`` equals ``torch.manual_seed(s); serial(x)`` and
  leaves the generator in the same state.

Every comparison is float64 at 1e-9 relative (converged solves).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from propagators.torch import LayerError, LayerParallel, ODENet, heun

TIGHT = dict(fwd_iters=60, bwd_iters=60, fwd_tol=1e-14, bwd_tol=1e-14)
REL = 1e-9


def rel(a, b) -> float:
    """Largest difference relative to the reference's largest entry, or absolute below 1
    (the bias of a Linear before BatchNorm has an exactly zero gradient: rounding only)."""
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / max(float(b.abs().max()), 1.0))


class FunctionalDropout(nn.Module):
    """Calls F.dropout itself (no nn.Dropout submodule), twice, on different shapes."""

    def __init__(self, width, p=0.25):
        super().__init__()
        self.up, self.down, self.p = nn.Linear(width, 2 * width), nn.Linear(2 * width, width), p

    def forward(self, u):
        z = F.dropout(torch.tanh(self.up(u)), self.p, self.training)
        return F.dropout(self.down(z), self.p / 2, training=self.training)


def dense_bn(width=5):
    return nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.Tanh())


def dense_bn_dropout(width=5):
    return nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.Tanh(), nn.Dropout(0.3))


def conv_bn_dropout(ch=3):
    return nn.Sequential(nn.Conv2d(ch, ch, 3, padding=1), nn.BatchNorm2d(ch), nn.Tanh(), nn.Dropout2d(0.25))


def pair(make, n, *, T=1.0, scheme=None, **kw):
    """A LayerParallel module and the serial network with the same initial weights."""
    torch.manual_seed(11)
    layers = [make() for _ in range(n)]
    extra = {} if scheme is None else {"scheme": scheme}
    serial = ODENet(copy.deepcopy(layers), T=T, **extra).double()
    lp = LayerParallel(layers, T=T, cf=2, max_levels=3, **extra, **{**TIGHT, **kw}).double()
    return lp, serial


def one_step(model, x, seed):
    """Forward with a seeded generator, backward of a fixed loss; (output, input gradient, state)."""
    xg = x.clone().requires_grad_(True)
    torch.manual_seed(seed)
    y = model(xg)
    rng = torch.random.get_rng_state()
    (y.pow(2).sum() + y.sum()).backward()
    return y.detach(), xg.grad, rng


def assert_step_equal(lp, serial, x, seed):
    y, gx, rng = one_step(lp, x, seed)
    ys, gxs, rngs = one_step(serial, x, seed)
    assert rel(y, ys) < REL
    assert rel(gx, gxs) < REL
    assert torch.equal(rng, rngs), "the forward pass must consume the generator exactly as the serial one"
    for (n, p), (_, q) in zip(lp.named_parameters(), serial.named_parameters()):
        assert rel(p.grad, q.grad) < REL, n
    for (n, b), (_, c) in zip(lp.named_buffers(), serial.named_buffers()):
        assert b.dtype == c.dtype and (torch.equal(b, c) if not b.is_floating_point() else rel(b, c) < REL), n


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("make, shape", [(dense_bn, (6, 5)), (dense_bn_dropout, (6, 5)),
                                         (conv_bn_dropout, (4, 3, 5, 5))])
def test_training_steps_equal_serial(make, shape, batched):
    lp, serial = pair(make, 8, batched=batched)
    opt, opt_s = torch.optim.SGD(lp.parameters(), lr=0.05), torch.optim.SGD(serial.parameters(), lr=0.05)
    torch.manual_seed(1)
    for step in range(3):
        x = torch.randn(*shape, dtype=torch.float64)
        for o in (opt, opt_s):
            o.zero_grad()
        assert_step_equal(lp, serial, x, seed=100 + step)
        opt.step()
        opt_s.step()
    assert int(lp.layers[4][1].num_batches_tracked) == 3  # once per pass, not once per relaxation
    lp.eval()
    serial.eval()
    x = torch.randn(*shape, dtype=torch.float64)
    assert rel(lp(x), serial(x)) < REL  # inference with the running statistics


def test_functional_dropout_with_two_calls_and_a_multi_stage_scheme():
    # Heun evaluates each layer twice per step: four masks per layer, drawn in the serial order
    lp, serial = pair(lambda: FunctionalDropout(4), 6, scheme=heun)
    x = torch.randn(3, 4, dtype=torch.float64)
    assert_step_equal(lp, serial, x, seed=7)
    masks = lp.kernel.bind()  # a new pass has no masks until its forward draws them
    assert masks.masks is None


class TransposedDropout(nn.Module):
    """Dropout on a transposed view of a convolution's output (a non-contiguous input to dropout)."""

    def __init__(self, ch=3):
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, u):
        return torch.tanh(F.dropout(self.conv(u).transpose(-1, -2), 0.2, self.training).transpose(-1, -2))


@pytest.mark.parametrize("make", [lambda: nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.Dropout(0.2), nn.Tanh()),
                                  TransposedDropout, conv_bn_dropout])
def test_masks_follow_the_memory_layout_of_the_dropout_input(make):
    """A review: dropout fills its noise in its input's memory order, so a channels-last input (or dropout on
    a transposed view) draws other masks than a contiguous one; the masks were drawn on contiguous ones, and
    such a pass was 14-19% off the serial network with the same seed. The masks are now drawn with the
    recorded strides of each dropout input, and recorded again when the input's layout changes (contiguous,
    channels-last, contiguous on the same block)."""
    lp, serial = pair(make, 6)
    torch.manual_seed(3)
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    for k, fmt in enumerate((torch.channels_last, torch.contiguous_format, torch.channels_last)):
        for m in (lp, serial):
            m.zero_grad()
        assert_step_equal(lp, serial, x.contiguous(memory_format=fmt), seed=20 + k)


def test_a_step_that_changes_the_memory_layout_is_an_error_with_dropout_only():
    """A review: a scheme (or a dt_aware layer) that returns the state in another layout makes the serial
    network's later layers draw their masks in that layout; the masks, recorded on the block's input, were
    then 0.49 off the serial network's, with no error. Now a LayerError says so; without dropout such a step is
    fine (the values are the same in any layout)."""
    def to_channels_last(f, u, dt):
        return (u + dt * f(u)).contiguous(memory_format=torch.channels_last)

    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 5, dtype=torch.float64)
    drop = [nn.Sequential(nn.Dropout(0.3), nn.Conv2d(3, 3, 3, padding=1), nn.Tanh()).double() for _ in range(8)]
    lp = LayerParallel(drop, T=1.0, cf=2, max_levels=3, scheme=to_channels_last, **TIGHT)
    with pytest.raises(LayerError, match=r"layer 0 \(Sequential\) returns the state in another memory layout.*"
                                         r"layers use dropout"):
        lp(x)
    plain = [nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.Tanh()).double() for _ in range(8)]
    lp = LayerParallel(copy.deepcopy(plain), T=1.0, cf=2, max_levels=3, scheme=to_channels_last, **TIGHT)
    assert rel(lp(x), ODENet(plain, T=1.0, scheme=to_channels_last)(x)) < REL


@pytest.mark.parametrize("view", ["a token of a sequence", "a slice of features", "expanded"])
def test_inputs_that_are_views_with_gaps_are_not_taken_for_another_layout(view):
    """A review of the layout check: a sliced or expanded input (x[:, 0], x[..., :8], z.expand(...)) comes back
    from u + h f(u) contiguous, and the check raised a LayerError; dropout fills its noise in the same
    contiguous order for such inputs (torch.empty_like), so the masks are the serial network's."""
    lp, serial = pair(lambda: nn.Sequential(nn.Dropout(0.3), nn.Linear(4, 4), nn.Tanh()), 8)
    torch.manual_seed(5)
    base = torch.randn(6, 3, 8, dtype=torch.float64)
    x = {"a token of a sequence": base[:, 0, :4], "a slice of features": base[:, 1, 2:6],
         "expanded": base[:1, 0, :4].expand(6, 4)}[view]
    assert not x.is_contiguous()
    assert_step_equal(lp, serial, x, seed=31)


def test_masks_are_drawn_once_per_pass_and_differ_between_layers():
    lp, _ = pair(lambda: nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)), 6)
    x = torch.randn(8, 4, dtype=torch.float64)
    kp = lp.kernel.bind()
    calls = lp._dropout_plan(kp, x, lp._dropout_note(x)[0])
    assert sorted(calls) == list(range(6)) and all(c == [("dropout", (8, 4), 0.5, (4, 1))] for c in calls.values())
    torch.manual_seed(0)
    lp._draw_masks(kp, calls, x)
    m = [kp.masks[j][0] for j in range(6)]
    assert all(not torch.equal(m[0], m[j]) for j in range(1, 6))
    assert set(torch.unique(m[0]).tolist()) <= {0.0, 2.0}


def test_inexact_training_solve_is_deterministic_under_a_seed():
    # with 2/1 cycles the result is not the serial one, but every evaluation of a layer uses one mask
    lp, _ = pair(dense_bn_dropout, 16, fwd_iters=2, bwd_iters=1, fwd_tol=None, bwd_tol=None)
    x = torch.randn(6, 5, dtype=torch.float64)
    a, ga, _ = one_step(lp, x, 5)
    b, gb, _ = one_step(lp, x, 5)
    assert torch.equal(a, b) and torch.equal(ga, gb)


def test_backward_uses_the_modes_of_its_forward_pass():
    lp, serial = pair(dense_bn_dropout, 8)
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(3)
    y = lp(x)
    lp.eval()  # switched before backward: the gradient is still the training-mode one
    y.sum().backward()
    torch.manual_seed(3)
    xs = x.detach().clone().requires_grad_(True)
    serial(xs).sum().backward()
    assert rel(x.grad, xs.grad) < REL
    assert not lp.training and all(not s.training for s in lp.modules())
    assert all(m[1].track_running_stats for m in lp.layers)


def test_no_grad_training_forward_updates_running_stats_once():
    lp, serial = pair(dense_bn, 8)
    x = torch.randn(6, 5, dtype=torch.float64)
    with torch.no_grad():
        lp(x)
        serial(x)
    for b, c in zip(lp.buffers(), serial.buffers()):
        assert torch.equal(b, c) if not b.is_floating_point() else rel(b, c) < REL


def test_momentum_none_and_untracked_statistics():
    for make in (lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None), nn.Tanh()),
                 lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, track_running_stats=False), nn.Tanh())):
        lp, serial = pair(make, 6)
        for step in range(2):
            assert_step_equal(lp, serial, torch.randn(5, 4, dtype=torch.float64), seed=step)


def test_unsupported_randomness_is_a_clear_error():
    lp = LayerParallel([nn.Sequential(nn.Linear(4, 4), nn.AlphaDropout(0.2)) for _ in range(4)], cf=2)
    with pytest.raises(LayerError, match="alpha dropout"):
        lp(torch.randn(3, 4))

    class Changing(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.twice = nn.Linear(4, 4), False

        def forward(self, u):
            z = F.dropout(self.lin(u), 0.2, self.training)
            return F.dropout(z, 0.2, self.training) if self.twice else z

    lp, serial = pair(Changing, 6, batched=False)
    x = torch.randn(3, 4, dtype=torch.float64)
    assert_step_equal(lp, serial, x, seed=0)  # masks recorded: one dropout call per layer
    for net in (lp, serial):  # an attribute changed without refresh(): found at the next pass, which
        net.layers[2].twice = True  # records two calls of that layer
    assert_step_equal(lp, serial, x, seed=1)

    class Drifting(nn.Module):  # its dropout calls change from one evaluation to the next
        def __init__(self):
            super().__init__()
            self.lin, self.calls = nn.Linear(4, 4), 0

        def forward(self, u):
            self.calls += 1
            z = F.dropout(self.lin(u), 0.2, self.training)
            return F.dropout(z, 0.2, self.training) if self.calls > 1 else z

    lp = LayerParallel([Drifting() for _ in range(6)], cf=2, batched=False)
    with pytest.raises(LayerError, match="calls dropout more often"):
        lp(torch.randn(3, 4))


def test_sync_batch_norm_in_training_is_a_clear_error():
    lp = LayerParallel([nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4)) for _ in range(4)], cf=2)
    with pytest.raises(LayerError, match="SyncBatchNorm"):
        lp(torch.randn(3, 4))


def test_other_running_statistics_and_shape_changes_name_the_fix():
    lp = LayerParallel([nn.Sequential(nn.Conv1d(3, 3, 3, padding=1), nn.InstanceNorm1d(3, track_running_stats=True))
                        for _ in range(4)], cf=2)
    with pytest.raises(LayerError, match="InstanceNorm1d tracks running statistics.*track_running_stats=False"):
        lp(torch.randn(2, 3, 8))
    lp = LayerParallel([nn.Linear(4, 5) for _ in range(4)], cf=2)
    with pytest.raises(LayerError, match="must keep the shape of the state.*MultiStage"):
        lp(torch.randn(2, 4))


class CustomRunningStats(nn.Module):
    """Keeps running statistics of its own through F.batch_norm (no nn.BatchNorm submodule): its native
    update leaves the buffers' version counters as they were."""

    def __init__(self, ch=3):
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)
        self.register_buffer("rm", torch.zeros(ch))
        self.register_buffer("rv", torch.ones(ch))

    def forward(self, u):
        return torch.tanh(F.batch_norm(self.conv(u), self.rm, self.rv, training=self.training, momentum=0.1))


def _instance_norm_in_odd_layers(j):
    if j % 2:
        return nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.InstanceNorm2d(3, track_running_stats=True), nn.Tanh())
    return nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.Tanh())


@pytest.mark.parametrize("spatial", [False, True])
@pytest.mark.parametrize("make, layer, fix", [
    (lambda j: nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.InstanceNorm2d(3, track_running_stats=True),
                             nn.Tanh()), 0, "InstanceNorm2d tracks running statistics.*track_running_stats=False"),
    (_instance_norm_in_odd_layers, 1, "InstanceNorm2d tracks running statistics"),
    (lambda j: CustomRunningStats(), 0, "`rm` during the forward pass"),
])
def test_running_statistics_other_than_batch_norm_are_an_error_in_every_configuration(make, layer, fix, spatial):
    # in batched sweeps the layers update stacked copies of their buffers: the updates were lost without an
    # error (running statistics 100% off the serial network's, eval outputs 1e-2 off) whenever no layer of
    # the class was stepped singly: with spatial coarsening, or in layers that no coarse level steps; the
    # first pass's checks had updated layer 0's statistics 4 times
    from propagators.torch import SpatialCoarsening

    torch.manual_seed(0)
    extra = dict(relax="FCF", spatial=SpatialCoarsening(coarsen_from=1)) if spatial else {}
    lp = LayerParallel([make(j) for j in range(8)], cf=2, max_levels=3, **TIGHT, **extra).double()
    before = [b.clone() for b in lp.buffers()]
    with pytest.raises(LayerError, match=f"layer {layer} changed its buffer .*{fix}"):
        lp(torch.randn(4, 3, 8, 8, dtype=torch.float64))
    assert all(torch.equal(a, b) for a, b in zip(lp.buffers(), before)), "the checks must leave no trace"


def test_a_buffer_changed_in_batched_calls_after_the_first_pass_is_an_error():
    # a layer that starts updating a buffer after the first pass's checks (a global it reads) changes only the
    # stacked copies of a batched sweep: their version counters show it
    state = {"on": False}

    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("seen", torch.zeros(4))

        def forward(self, u):
            if state["on"]:
                self.seen.copy_(self.seen + 1)
            return torch.tanh(self.lin(u)) * 0.5

    lp = LayerParallel([Counting() for _ in range(8)], cf=2, max_levels=3).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    lp(x).sum().backward()
    state["on"] = True
    with pytest.raises(LayerError, match="layer 0 changed its buffer `seen`"):
        lp(x)
