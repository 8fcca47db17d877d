"""MultiStage: layer-parallel stages separated by shape-changing layers, equal to the serial network.

One rank in this process (float64, converged solves, 1e-9 relative): output,
input gradient and every parameter gradient against ``to_serial()`` and
against a hand-written serial loop; state-dict round trips; optimizer steps;
the builders and their errors. Several ranks: ``tests/mpi_scripts/multistage_ranks.py``
under mpiexec (2 and 3 ranks, and a 2 x 2 layer x data grid).
"""
from __future__ import annotations

import io
from pathlib import Path

import pytest
from launch import assert_all_ok, launch, needs_mpiexec

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from propagators.torch import (LayerError, LayerParallel, MultiStage, ODENet, SpatialCoarsening, Stage,  # noqa: E402
                               load_digits_images, residual_cnn)

TIGHT = dict(fwd_iters=40, bwd_iters=40, fwd_tol=1e-14, bwd_tol=1e-14)
REL = 1e-9


def rel(a, b) -> float:
    return float((a - b).detach().abs().max()) / max(1e-300, float(b.detach().abs().max()))


def loss_fn(y):
    return (y**2).sum() + y.sum()


def small_cnn(seed=0, transition="conv", **kw):
    opts = dict(channels=2, n_layers=(8, 6), cf=2, max_levels=3, transition=transition, seed=seed)
    opts.update(TIGHT)
    opts.update(kw)
    return residual_cnn(**opts).double()


def by_hand(net: MultiStage, x):
    """The serial network written out: replicated pieces, then ``u <- u + h f_i(u)`` for every layer."""
    u = x
    for p in net:
        if isinstance(p, LayerParallel):
            for f in p.layers:
                u = u + p.h * f(u)
        else:
            u = p(u)
    return u


def assert_matches_serial(net, ref, x):
    xp, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y, ys = net(xp), ref(xs)
    loss_fn(y).backward()
    loss_fn(ys).backward()
    assert rel(y, ys) < REL
    assert rel(xp.grad, xs.grad) < REL
    serial = dict(ref.named_parameters())
    mine = dict(net.named_parameters())
    assert list(mine) == list(serial)
    for n, p in mine.items():
        assert p.grad is not None and rel(p.grad, serial[n].grad) < REL, n
    grads = net.gather_gradients()
    assert list(grads) == list(serial)
    for n, g in grads.items():
        assert torch.equal(g, mine[n].grad), n


@pytest.mark.parametrize("transition", ["conv", "pool"])
def test_output_and_every_gradient_equal_the_serial_network(transition):
    net = small_cnn(transition=transition)
    torch.manual_seed(1)
    x = torch.randn(3, 1, 8, 8, dtype=torch.float64)
    assert_matches_serial(net, net.to_serial(), x)
    # the stages really ran MGRIT (several cycles), to convergence
    assert all(len(s.forward_residuals) > 1 for s in net.stages)
    assert max(net.forward_residuals) < 1e-12 and max(net.backward_residuals) < 1e-12


def test_to_serial_is_the_network_written_out_by_hand():
    net = small_cnn(seed=2)
    ser = net.to_serial()
    assert isinstance(ser, nn.Sequential) and isinstance(ser[1], ODENet) and isinstance(ser[3], ODENet)
    assert [type(m) for i, m in enumerate(ser) if i in (0, 2, 4)] == [type(net[i]) for i in (0, 2, 4)]
    torch.manual_seed(3)
    x = torch.randn(2, 1, 8, 8, dtype=torch.float64)
    ref = by_hand(net, x)
    assert rel(ser(x), ref) < REL and rel(net(x), ref) < REL
    assert tuple(net[1](net[0](x)).shape) == (2, 2, 8, 8)       # stage 1: C channels, full resolution
    assert tuple(net[3](net[2](net[1](net[0](x)))).shape) == (2, 4, 4, 4)  # stage 2: 2C channels, half
    # copies: training the serial network leaves the MultiStage alone
    with torch.no_grad():
        ser[1].layers[0][0].weight.add_(1.0)
    assert not torch.equal(ser[1].layers[0][0].weight, net[1].layers[0][0].weight)


def test_state_dict_round_trip_through_the_serial_network():
    net, other = small_cnn(seed=0), small_cnn(seed=1)
    torch.manual_seed(4)
    x = torch.randn(2, 1, 8, 8, dtype=torch.float64)
    assert rel(net(x), other(x)) > 1e-3  # different seeds, different weights
    buf = io.BytesIO()
    torch.save(net.to_serial().state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert list(sd) == list(net.state_dict())
    other.load_serial(sd)
    assert torch.equal(other(x), net(x))
    for k, v in other.state_dict().items():
        assert torch.equal(v, sd[k]), k
    # and the plain torch way on one rank: MultiStage.state_dict() has the serial keys
    third = small_cnn(seed=2)
    third.load_state_dict(net.state_dict())
    assert torch.equal(third(x), net(x))
    with pytest.raises(KeyError, match=r"lacks 1 entries .*\['3.layers.5.0.bias'\]"):  # (the key as given)
        other.load_serial({k: v for k, v in sd.items() if k != "3.layers.5.0.bias"})
    with pytest.raises(KeyError, match="no piece"):
        other.load_serial({**sd, "7.weight": torch.zeros(1)})
    # an extra layer of a stage (a checkpoint of a deeper stage) loaded silently before
    extra = {**sd, "3.layers.99.0.weight": sd["3.layers.5.0.weight"]}
    with pytest.raises(KeyError, match=r"entries the serial network \(\d+ layers\) lacks, e.g. \['3.layers.99"):
        other.load_serial(extra)
    with pytest.raises(KeyError, match=r"other layers\); pass strict=False"):  # (no "keys with a prefix" hint)
        other.load_serial(extra)
    keys = other.load_serial(extra, strict=False)
    assert keys.missing_keys == [] and keys.unexpected_keys == ["3.layers.99.0.weight"]


def test_optimizer_steps_keep_the_equality():
    net = small_cnn(seed=5)
    ref = net.to_serial()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    torch.manual_seed(6)
    x = torch.randn(3, 1, 8, 8, dtype=torch.float64)
    for _ in range(3):
        opt.zero_grad()
        opt_ref.zero_grad()
        assert_matches_serial(net, ref, x)
        opt.step()
        opt_ref.step()
    sd, sd_ref = net.state_dict(), ref.state_dict()
    assert max(rel(sd[k], sd_ref[k]) for k in sd if sd_ref[k].abs().max() > 0) < REL
    net.check_replicas(grads=True)  # one rank: nothing to compare, and nothing raises
    net.sync_replicas()


def test_stage_specs_and_given_layer_parallel_modules_mix():
    torch.manual_seed(7)
    blocks = [[nn.Sequential(nn.Linear(3, 3), nn.Tanh()) for _ in range(9)],
              [nn.Sequential(nn.Linear(2, 2), nn.Tanh()) for _ in range(5)]]
    lp = LayerParallel([nn.Sequential(*m) for m in blocks[0]], T=0.7, cf=2, **TIGHT).double()
    net = MultiStage([lp, nn.Linear(3, 2), Stage(blocks[1], T=0.5, cf=4), nn.Tanh()],
                     cf=2, max_levels=2, **TIGHT).double()
    s0, s1 = net.stages
    assert s0 is lp and s1.T == 0.5 and s1.options["cf"] == 4 and s1.options["max_levels"] == 2  # stage wins
    assert [i for i, _ in net.replicated] == [1, 3] and len(net) == 4 and net[-1] is net[3]
    x = torch.randn(4, 3, dtype=torch.float64)
    assert_matches_serial(net, net.to_serial(), x)
    assert rel(net.to_serial()(x), by_hand(net, x)) < REL


def test_eval_mode_steps_the_layers_exactly_whatever_the_training_settings():
    net = residual_cnn(channels=2, n_layers=(8, 8), cf=2, fwd_iters=1, bwd_iters=1).double()
    torch.manual_seed(8)
    x = torch.randn(2, 1, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        inexact = net(x)
        net.eval()
        exact = net(x)
        ser = net.to_serial()
        assert not ser.training
        assert rel(exact, ser(x)) < 1e-12 and rel(inexact, ser(x)) > 1e-12


def test_the_builder_is_deterministic_per_seed_and_keeps_the_global_random_state():
    torch.manual_seed(9)
    state = torch.random.get_rng_state()
    a, b, c = residual_cnn(seed=1), residual_cnn(seed=1), residual_cnn(seed=2)
    assert torch.equal(state, torch.random.get_rng_state())
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not any(torch.equal(sa[k], sc[k]) for k in sa if k.endswith("weight"))
    # layers of one stage differ from each other
    assert not torch.equal(sa["1.layers.0.0.weight"], sa["1.layers.1.0.weight"])


class FailsBackwardLayer(nn.Module):
    """A convolution whose gradient hook raises (in the backward pass only)."""

    def __init__(self, ch):
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, u):
        z = torch.tanh(self.conv(u))
        if z.requires_grad:
            z.register_hook(self.boom)
        return z

    @staticmethod
    def boom(grad):
        raise RuntimeError("boom in backward")


def test_errors_say_what_to_do():
    lin = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="no layer-parallel stage"):
        MultiStage([lin, nn.Tanh()])
    with pytest.raises(TypeError, match="piece 1 is a int"):
        MultiStage([Stage([lin]), 3])
    with pytest.raises(TypeError, match="contains a LayerParallel"):
        MultiStage([nn.Sequential(nn.Tanh(), LayerParallel([nn.Linear(2, 2)]))])
    with pytest.raises(TypeError, match="communicators are given once"):
        Stage([lin], comm=None)
    with pytest.raises(TypeError, match="no piece is a Stage"):
        MultiStage([LayerParallel([nn.Linear(2, 2)])], cf=2)
    with pytest.raises(TypeError, match="single Linear"):
        MultiStage(lin)
    with pytest.raises(ValueError, match="'conv' or 'pool'"):
        residual_cnn(transition="max")
    # a stage's own error names the stage (the options given once fit one stage and not another)
    with pytest.raises(ValueError, match=r"piece 1, Stage\(n_layers=8\): spatial coarsening of level 1 needs"):
        residual_cnn(n_layers=(8, 6), spatial=SpatialCoarsening())
    # a review: a layer's error in a pass said "layer 0" with no stage: which of several stages?
    net = MultiStage([nn.Conv2d(1, 4, 3, padding=1), Stage(lambda i: nn.Sequential(nn.Conv2d(4, 4, 3, padding=1),
                                                                                    nn.Tanh()), 4),
                      nn.Conv2d(4, 6, 1), Stage(lambda i: nn.Sequential(nn.Conv2d(5, 5, 3, padding=1), nn.Tanh()), 4)])
    with pytest.raises(LayerError, match=r"^piece 3 \(stage 1, layers numbered from 0 in the stage\): layer 0 "):
        net(torch.randn(2, 1, 8, 8))
    # and in its backward pass, as a note of the error (the traceback shows it)
    net = MultiStage([nn.Conv2d(1, 4, 3, padding=1), Stage(lambda i: nn.Sequential(nn.Conv2d(4, 4, 3, padding=1),
                                                                                    nn.Tanh()), 4),
                      nn.Conv2d(4, 4, 1), Stage(lambda i: FailsBackwardLayer(4), 4)])
    with pytest.raises(LayerError, match="boom in backward") as caught:
        net(torch.randn(2, 1, 8, 8)).sum().backward()
    assert "in piece 3 (stage 1, layers numbered from 0 in the stage) of a MultiStage" in caught.value.__notes__


def test_digits_images_are_the_digits_upscaled_bilinearly():
    from propagators.data import load_digits

    X, y, Xt, yt = load_digits_images(size=32)
    X8, y8, Xt8, yt8 = load_digits()
    assert X.shape == (len(X8), 1, 32, 32) and Xt.shape == (len(Xt8), 1, 32, 32)
    assert X.dtype == torch.float32 and y.dtype == torch.int64
    assert torch.equal(y, torch.from_numpy(y8)) and torch.equal(yt, torch.from_numpy(yt8))
    small = torch.from_numpy(X8).reshape(-1, 1, 8, 8)
    assert torch.equal(load_digits_images(size=8)[0], small)
    assert torch.equal(X, nn.functional.interpolate(small, size=(32, 32), mode="bilinear", align_corners=False))


def test_the_example_of_docs_multistage_runs():
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "multistage.md").read_text()
    block = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    namespace: dict = {}
    exec(compile(block, "docs/multistage.md", "exec"), namespace)
    net = namespace["net"]
    assert len(net.stages) == 2 and [i for i, _ in net.replicated] == [0, 2, 4]
    assert net(torch.randn(2, 1, 32, 32)).shape == (2, 10)


# -- several ranks (mpiexec) -------------------------------------------------------

@pytest.mark.mpi
@needs_mpiexec
@pytest.mark.parametrize("n, mode", [(2, ""), (3, ""), (4, "grid")])
def test_multistage_on_ranks_equals_the_serial_network(n, mode):
    pytest.importorskip("mpi4py")
    rc, out = launch(n, "multistage_ranks.py", *([mode] if mode else []))
    assert_all_ok(n, rc, out)



def test_to_serial_keeps_parameters_tied_between_pieces_and_between_layers():
    """Pieces and layers were deep-copied one by one: a stem tied to a stage layer, or layers sharing one
    Linear, came out untied (12 parameters became 14; 4 became 10), and the serial network's gradient of
    the tied weight was 6.27 for the MultiStage's 6.61."""
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    layers = [nn.Sequential(shared, nn.Tanh())] + [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(4)]
    net = MultiStage([shared, Stage(layers), nn.Linear(4, 2)], cf=2, fwd_iters=60, bwd_iters=60, fwd_tol=1e-13,
                     bwd_tol=1e-13).double()
    ser = net.to_serial()
    assert len(list(ser.parameters())) == len(list(net.parameters())) == 12
    x = torch.randn(5, 4, dtype=torch.float64)
    net(x).sum().backward()
    ser(x).sum().backward()
    serial = dict(ser.named_parameters())
    for name, p in net.named_parameters():
        assert torch.allclose(p.grad, serial[name].grad, rtol=1e-9, atol=1e-12), name
    assert serial["0.weight"] is not shared.weight  # (copies)
    lin = nn.Linear(4, 4)
    lp = LayerParallel([nn.Sequential(lin, nn.Tanh()) for _ in range(4)] + [nn.Linear(4, 4)], cf=2)
    assert len(list(lp.to_serial().parameters())) == len(list(lp.parameters())) == 4


def test_multistage_slices_and_indices_as_sequential():
    torch.manual_seed(0)
    net = MultiStage([nn.Linear(3, 4), Stage(lambda i: nn.Sequential(nn.Linear(4, 4), nn.Tanh()), 4),
                      nn.Linear(4, 2)], cf=2)
    part = net[1:]
    assert isinstance(part, nn.Sequential) and list(part) == [net[1], net[2]] and net[-1] is net[2]
    with pytest.raises(IndexError, match="piece index 3 is out of range: this MultiStage has 3 pieces"):
        net[3]
    with pytest.raises(TypeError):
        net["1"]
