"""Transformer blocks trained layer-parallel, and the switch to serial gradients.

float64, converged MGRIT settings: the output and every gradient of
LayerParallel(transformer layers) equal serial autograd through the same
layers to 1e-9 relative (batched and looped, causal and not, with dropout, the
three block arrangements, the whole ViT with its embedding and head, one and
two ranks).
The switch controller is tested on real gradients: its error and noise
estimates against direct computations, and its decision against an error of
known size added to a converged gradient.
"""
from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from launch import assert_all_ok, launch, needs_mpiexec

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from propagators.torch import LayerParallel, ODENet  # noqa: E402
from propagators.torch.switch import SerialSwitch, Switchable, SwitchRule  # noqa: E402
from propagators.torch.transformer import (  # noqa: E402
    AttentionLayer, ClassifierHead, MLPLayer, TransformerBlock, make_vit, transformer_layers, with_key_padding,
    without_key_padding)

sys.path.insert(0, str(Path(__file__).parent / "mpi_scripts"))
from layer_zoo import check_equals_serial, loss_fn, rel, serial_reference  # noqa: E402

TIGHT = dict(fwd_iters=40, bwd_iters=40, fwd_tol=1e-14, bwd_tol=1e-14)
REL = 1e-9
pytestmark = pytest.mark.usefixtures("float64")


# -- the layers ----------------------------------------------------------------------------

@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("form", ["sequential", "parallel", "halves"])
def test_transformer_layers_give_serial_output_and_gradients(form, batched):
    torch.manual_seed(3)
    layers = transformer_layers(4, 8, 2, mlp_ratio=2.0, form=form)
    lp = LayerParallel(copy.deepcopy(layers), T=2.0, cf=2, max_levels=3, batched=batched, **TIGHT)
    assert {c.mode for c in lp.kernel.classes} == ({"vmap"} if batched else {"loop"})
    check_equals_serial(lp, layers, torch.randn(3, 5, 8), 2.0)
    assert {c.mode for c in lp.kernel.classes} == ({"vmap"} if batched else {"loop"})  # vmap did not fall back


@pytest.mark.parametrize("batched", [True, False])
def test_causal_blocks_give_serial_output_and_gradients(batched):
    torch.manual_seed(4)
    layers = transformer_layers(6, 8, 4, mlp_ratio=1.0, causal=True)
    lp = LayerParallel(copy.deepcopy(layers), T=1.0, cf=2, max_levels=2, batched=batched, **TIGHT)
    check_equals_serial(lp, layers, torch.randn(2, 6, 8), 1.0)


@pytest.mark.parametrize("batched", [True, False])
def test_blocks_with_dropout_give_the_serial_networks_masks(batched):
    """Attention-weight and output dropout in training mode: LayerParallel draws each mask once per
    pass in serial order (docs/norm_dropout.md), so with the same seed it is the serial network."""
    torch.manual_seed(8)
    layers = transformer_layers(4, 8, 2, mlp_ratio=1.0, dropout=0.2)
    lp = LayerParallel(copy.deepcopy(layers), T=1.0, cf=2, max_levels=2, batched=batched, **TIGHT)
    x = torch.randn(3, 5, 8)
    torch.manual_seed(9)
    y_s, gx_s, gp_s = serial_reference(layers, x, 1.0)
    torch.manual_seed(9)
    xp = x.clone().requires_grad_(True)
    y = lp(xp)
    loss_fn(y).backward()
    assert rel(y.detach(), y_s) < REL and rel(xp.grad, gx_s) < REL
    for p, g in zip(lp.parameters(), gp_s):
        assert rel(p.grad, g) < REL
    torch.manual_seed(10)
    assert rel(lp(x).detach(), y_s) > 1e-3  # other masks: another output


def test_causal_mask_hides_later_tokens():
    torch.manual_seed(5)
    lp = LayerParallel(transformer_layers(4, 8, 2, causal=True), T=1.0, cf=2, **TIGHT)
    x = torch.randn(2, 6, 8)
    x2 = x.clone()
    x2[:, 4:] += torch.randn(2, 2, 8)
    with torch.no_grad():
        y, y2 = lp(x), lp(x2)
    assert rel(y[:, :4], y2[:, :4]) < 1e-12  # tokens 0..3 never see tokens 4, 5
    assert rel(y[:, 4:], y2[:, 4:]) > 1e-3


def test_attention_equals_torch_multihead_attention():
    torch.manual_seed(6)
    att = AttentionLayer(8, 2, causal=True)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight.copy_(att.qkv.weight)
        mha.in_proj_bias.copy_(att.qkv.bias)
        mha.out_proj.weight.copy_(att.proj.weight)
        mha.out_proj.bias.copy_(att.proj.bias)
    u = torch.randn(3, 5, 8)
    z = att.norm(u)
    mask = torch.ones(5, 5, dtype=torch.bool).triu(1)
    ref = mha(z, z, z, attn_mask=mask, need_weights=False)[0]
    assert rel(att(u), ref) < 1e-12


def test_a_block_is_the_standard_pre_norm_block_at_unit_step():
    """u + F(u) = (u + Attn(LN1 u)) then (+ MLP(LN2 .)) for the sequential form; both
    branches read u for the parallel form; two half-step layers compose to the same block."""
    torch.manual_seed(7)
    blk = TransformerBlock(8, 2)
    u = torch.randn(2, 4, 8)
    v = u + blk.attn(u)
    assert rel(u + blk(u), v + blk.mlp(v)) < 1e-14
    par = TransformerBlock(8, 2, form="parallel")
    assert rel(u + par(u), u + par.attn(u) + par.mlp(u)) < 1e-14
    att, mlp = blk.attn, blk.mlp
    halves = ODENet([att, mlp], T=2.0)  # h = 1
    assert rel(halves(u), u + blk(u)) < 1e-14


def padding(lengths, n_tok):
    """The key-padding mask (True at padding) of sequences of ``lengths`` tokens padded to ``n_tok``."""
    return torch.arange(n_tok) >= torch.tensor(lengths)[:, None]


def encoder_layer_of(blk):
    """torch's pre-norm nn.TransformerEncoderLayer (GELU, no dropout) with the weights of ``blk``."""
    dim, hidden = blk.attn.dim, blk.mlp.fc1.out_features
    ref = nn.TransformerEncoderLayer(dim, blk.attn.heads, dim_feedforward=hidden, dropout=0.0, activation="gelu",
                                     norm_first=True, batch_first=True)
    with torch.no_grad():
        ref.self_attn.in_proj_weight.copy_(blk.attn.qkv.weight)
        ref.self_attn.in_proj_bias.copy_(blk.attn.qkv.bias)
        ref.self_attn.out_proj.load_state_dict(blk.attn.proj.state_dict())
        for mine, theirs in ((blk.mlp.fc1, ref.linear1), (blk.mlp.fc2, ref.linear2), (blk.attn.norm, ref.norm1),
                             (blk.mlp.norm, ref.norm2)):
            theirs.load_state_dict(mine.state_dict())
    return ref


@pytest.mark.parametrize("causal", [False, True])
def test_a_block_with_key_padding_is_torchs_encoder_layer_with_a_padding_mask(causal):
    """With a padding channel (with_key_padding) a block at unit step is nn.TransformerEncoderLayer
    (norm_first, GELU) called with src_key_padding_mask (and the causal src_mask) on every token that is
    not padding, and the layer leaves the padding channel unchanged, bit for bit."""
    torch.manual_seed(12)
    blk = TransformerBlock(8, 2, mlp_ratio=2.0, causal=causal, key_padding=True)
    ref = encoder_layer_of(blk)
    x, mask = torch.randn(3, 6, 8), padding([6, 4, 1], 6)
    u = with_key_padding(x, mask)
    y = u + blk(u)
    causal_mask = torch.ones(6, 6, dtype=torch.bool).triu(1) if causal else None
    expect = ref(x, src_mask=causal_mask, src_key_padding_mask=mask)
    assert rel(without_key_padding(y)[~mask], expect[~mask]) < 1e-13
    assert torch.equal(y[..., -1], u[..., -1]) and torch.equal(blk(u)[..., -1], torch.zeros(3, 6))


@pytest.mark.parametrize("form", ["sequential", "parallel", "halves"])
def test_padded_sequences_give_each_sequence_alone(form):
    """Through a serial network of blocks with key_padding=True, every token of a padded batch gets what its
    sequence gives alone, unpadded: the padding changes nothing that is not padding; a sequence of padding
    only stays finite."""
    torch.manual_seed(13)
    net = ODENet(transformer_layers(3, 8, 2, mlp_ratio=1.5, form=form, key_padding=True), T=1.0)
    lengths = [5, 2, 4, 0]
    x = torch.randn(4, 5, 8)
    with torch.no_grad():
        y = without_key_padding(net(with_key_padding(x, padding(lengths, 5))))
        assert torch.isfinite(y).all()
        for b, n in enumerate(lengths[:3]):
            alone = without_key_padding(net(with_key_padding(x[b:b + 1, :n], padding([n], n))))
            assert rel(y[b, :n], alone[0]) < 1e-13, b


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("form, causal", [("sequential", False), ("parallel", True), ("halves", False)])
def test_blocks_with_key_padding_give_serial_output_and_gradients(form, causal, batched):
    """LayerParallel over blocks with a padding channel (sequences of 5, 3, 1 and 0 tokens): converged, the
    output and every gradient equal serial autograd's, batched (vmap) and looped."""
    torch.manual_seed(14)
    layers = transformer_layers(4, 8, 2, mlp_ratio=2.0, form=form, causal=causal, key_padding=True)
    lp = LayerParallel(copy.deepcopy(layers), T=2.0, cf=2, max_levels=3, batched=batched, **TIGHT)
    check_equals_serial(lp, layers, with_key_padding(torch.randn(4, 5, 8), padding([5, 3, 1, 0], 5)), 2.0)
    assert {c.mode for c in lp.kernel.classes} == ({"vmap"} if batched else {"loop"})


def test_a_scheme_of_ones_own_that_scales_the_state_keeps_the_mask():
    """A review: an exponential-Euler scheme multiplies the padding channel by exp(-dt) every step; read as
    "> 0.5" it fell below at T = 2 and the padding reached the real tokens (0.27 off), silently. A channel that
    is not 0 is padding now: each sequence still gets what it gets alone, through LayerParallel too."""
    torch.manual_seed(16)

    def exp_euler(f, u, dt):
        return u * math.exp(-dt) + (1.0 - math.exp(-dt)) * f(u)

    layers = transformer_layers(4, 8, 2, mlp_ratio=1.0, key_padding=True)
    lp = LayerParallel(layers, T=2.0, cf=2, scheme=exp_euler, **TIGHT)
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        y = without_key_padding(lp(with_key_padding(x, padding([5, 2], 5))))
        alone = without_key_padding(lp(with_key_padding(x[1:, :2], padding([2], 2))))
    assert rel(y[1, :2], alone[0]) < 1e-12


def test_layers_pickled_before_key_padding_still_run():
    """A review: modules saved before the option existed have no key_padding attribute (nor MLPLayer's width):
    their first pass raised AttributeError; they read as key_padding=False."""
    torch.manual_seed(17)
    blk, head = TransformerBlock(8, 2), ClassifierHead(8, 3, pool="mean")
    u = torch.randn(2, 4, 8)
    before = (blk(u), head(u))
    for m in (blk.attn, blk.mlp, head):
        del m.__dict__["key_padding"]  # (as unpickled from an older version)
    assert torch.equal(blk(u), before[0]) and torch.equal(head(u), before[1])


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.mark.parametrize("device", DEVICES)
def test_on_a_device_blocks_with_key_padding_give_serial_output_and_gradients(device):
    """On the device (float64; benchmarks/gpu.py runs the CUDA case): batched blocks with a padding channel,
    converged, equal serial autograd there, and the padding channel comes out unchanged."""
    torch.manual_seed(18)
    layers = [m.to(device) for m in transformer_layers(4, 8, 2, mlp_ratio=2.0, causal=True, key_padding=True)]
    lp = LayerParallel(copy.deepcopy(layers), T=2.0, cf=2, max_levels=3, **TIGHT)
    u = with_key_padding(torch.randn(4, 5, 8, device=device), padding([5, 3, 1, 0], 5).to(device))
    check_equals_serial(lp, layers, u, 2.0)
    with torch.no_grad():
        assert torch.equal(lp(u)[..., -1], u[..., -1])


def test_padding_tokens_keep_their_values_and_add_nothing_to_the_residuals():
    """A review: padding tokens attended to the real ones and changed from layer to layer, so they counted in the
    solves' residuals, and with a tolerance the same sequences padded to other lengths stopped after other
    cycle counts (10 against 11) with other predictions. The layers leave padding tokens as they are: the
    residual histories are those of the unpadded batch, and so are the cycles and the real tokens' output."""
    torch.manual_seed(19)
    x, lengths = torch.randn(3, 5, 8), [5, 2, 4]
    runs = []
    for n_tok in (5, 9, 16):
        torch.manual_seed(20)  # (the same weights for each padding)
        lp = LayerParallel(transformer_layers(4, 8, 2, mlp_ratio=1.0, key_padding=True), T=2.0, cf=2, fwd_iters=40,
                           fwd_tol=1e-8)
        padded = torch.cat([x, 100.0 * torch.randn(3, n_tok - 5, 8)], dim=1)
        u = with_key_padding(padded, padding(lengths, n_tok))
        with torch.no_grad():
            y = lp(u)
        assert torch.equal(y[padding(lengths, n_tok)], u[padding(lengths, n_tok)])  # padding tokens unchanged
        runs.append((lp.forward_residuals, without_key_padding(y)[:, :5].masked_fill(padding(lengths, 5)[..., None], 0)))
    (r0, y0), *rest = runs
    for r, y in rest:
        assert len(r) == len(r0) and all(abs(a - b) <= 1e-10 * abs(b) + 1e-13 for a, b in zip(r, r0) if b is not None)
        assert rel(y, y0) < 1e-12


def test_what_the_padding_held_reaches_nothing():
    """A review: padding of 1e30 (float32) or NaN made LayerNorm NaN there and 0 * NaN in the attention reached
    every real token; with_key_padding zeroes the padding tokens, so the output of the real tokens, serial and
    layer-parallel, and their gradients are those of any other padding, and nothing is NaN."""
    torch.manual_seed(21)
    layers = [m.float() for m in transformer_layers(4, 8, 2, mlp_ratio=1.0, key_padding=True)]
    lp = LayerParallel(copy.deepcopy(layers), T=1.0, cf=2)
    net = ODENet(layers, T=1.0)
    x, mask = torch.randn(2, 5, 8, dtype=torch.float32), padding([5, 3], 5)
    results = []
    for fill in (0.0, 1e30, float("nan")):
        xs = x.masked_fill(mask[..., None], fill).requires_grad_(True)
        y = torch.stack([without_key_padding(m(with_key_padding(xs, mask))) for m in (net, lp)])
        y.masked_fill(mask[..., None], 0).sum().backward()
        assert torch.isfinite(y).all() and torch.isfinite(xs.grad).all()
        results.append((y.detach(), xs.grad))
    for y, g in results[1:]:
        assert torch.equal(y, results[0][0]) and torch.equal(g, results[0][1])


def test_the_mean_pooling_head_leaves_the_padding_out():
    torch.manual_seed(15)
    head = ClassifierHead(8, 3, pool="mean", key_padding=True)
    x, mask = torch.randn(3, 5, 8), padding([5, 2, 0], 5)
    out = head(with_key_padding(x, mask))
    z = head.norm(x)
    expect = [z[0].mean(0), z[1, :2].mean(0), torch.zeros(8)]
    assert rel(out, head.fc(torch.stack(expect))) < 1e-14


def test_key_padding_inputs_are_checked():
    blk = TransformerBlock(8, 2, key_padding=True)
    with pytest.raises(ValueError, match=r"expects states of width 9 \(the tokens and a padding channel: "
                                         r"with_key_padding"):
        blk(torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match="width 8 .*build the layers with key_padding=True"):
        TransformerBlock(8, 2)(torch.randn(2, 3, 9))
    with pytest.raises(TypeError, match="key_padding_mask must be a bool tensor"):
        with_key_padding(torch.randn(2, 3, 8), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"key_padding_mask must have the tokens' leading shape \(2, 3\)"):
        with_key_padding(torch.randn(2, 3, 8), torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="`key_padding` must be True or False"):
        AttentionLayer(8, 2, key_padding="yes")
    with pytest.raises(ValueError, match=r"key_padding_mask is on meta, the tokens on cpu: move the mask there"):
        with_key_padding(torch.randn(2, 3, 8), torch.ones(2, 3, dtype=torch.bool, device="meta"))
    with pytest.raises(TypeError, match="make_vit builds a model of images.*takes no key_padding"):
        make_vit(2, 8, 2, key_padding=True)


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="multiple of `heads`"):
        AttentionLayer(6, 4)
    with pytest.raises(ValueError, match="form"):
        transformer_layers(2, 8, 2, form="interleaved")
    with pytest.raises(ValueError, match="halves"):
        TransformerBlock(8, 2, form="halves")
    with pytest.raises(ValueError, match="divide"):
        make_vit(2, 8, 2, patch=3)
    with pytest.raises(ValueError, match="positive whole numbers"):
        make_vit(2, 8, 2, patch=0)
    with pytest.raises(ValueError, match=r"1 channel\(s\) x 8 x 8 = 64 values.*side=28"):
        make_vit(2, 8, 2, seed=0)(torch.randn(3, 784))
    vit = make_vit(2, 8, 2, seed=0)
    dt = next(vit.parameters()).dtype
    other = torch.float32 if dt == torch.float64 else torch.float64
    with pytest.raises(TypeError, match=rf"image tensor of the model's dtype \({dt}\), got dtype torch.uint8"):
        vit(torch.zeros(3, 64, dtype=torch.uint8))
    with pytest.raises(TypeError, match=rf"got dtype {other}; convert it, e.g. x.to\({dt}\)"):
        vit(torch.zeros(3, 64, dtype=other))
    with pytest.raises(TypeError, match=r"got ndarray; convert it, e.g. torch.as_tensor\(x\).float\(\)"):
        vit(np.zeros((3, 64), dtype=np.float32))
    # a dynamically quantized ViT (its Linear's weight is a method) keeps running (the check read it)
    quantized = torch.ao.quantization.quantize_dynamic(make_vit(2, 8, 2, seed=0, parallel=False).float().eval(),
                                                       {nn.Linear}, dtype=torch.qint8)
    assert quantized(torch.zeros(3, 64, dtype=torch.float32)).shape == (3, 10)
    with pytest.raises(TypeError, match="Switchable wraps"):
        Switchable(nn.Linear(2, 2))
    # from a review: inputs of the right size but another shape ran, their pixels in the wrong patches
    # (a (3, 2, 8, 4) batch; a channels-last colour image); a causal ViT with a class token in front
    # ignored its input (the token sees only itself: a constant output, a zero input gradient)
    x = torch.randn(3, 64, dtype=dt)
    for shape in ((3, 1, 8, 8), (3, 8, 8)):
        assert torch.equal(vit(x.reshape(shape)), vit(x))
    for shape in ((3, 2, 8, 4), (3, 1, 4, 16), (3, 16, 4)):
        with pytest.raises(ValueError, match=r"shaped \(batch, 64\) or \(batch, 1, 8, 8\) or \(batch, 8, 8\)"):
            vit(x.reshape(shape))
    with pytest.raises(ValueError, match=r"x.permute\(0, 3, 1, 2\)"):
        make_vit(2, 8, 2, channels=3, seed=0).to(dt)(torch.randn(2, 8, 8, 3, dtype=dt))
    with pytest.raises(ValueError, match="n_blocks"):  # ("`layers` is empty" before)
        make_vit(0, 8, 2)
    with pytest.raises(ValueError, match="causal=True with pool='cls'.*pool='mean'"):
        make_vit(2, 8, 2, causal=True)
    assert make_vit(2, 8, 2, causal=True, pool="mean", seed=0)(torch.randn(2, 64)).shape == (2, 10)


# -- the vision transformer ------------------------------------------------------------------

def vit_pair(**kw):
    mg = {k: kw.pop(k) for k in ("cf", "max_levels")}
    par = make_vit(seed=11, **kw, **mg, **TIGHT)
    ser = make_vit(seed=11, parallel=False, **kw)
    return par, ser


@pytest.mark.parametrize("kw", [dict(n_blocks=4, dim=8, heads=2, patch=4, T=1.0, cf=2, max_levels=2),
                                dict(n_blocks=3, dim=8, heads=2, patch=2, pool="mean", form="halves",
                                     init="independent", cf=2, max_levels=3)],
                         ids=["cls-sequential", "mean-halves"])
def test_vit_end_to_end_gradients_equal_serial(kw):
    par, ser = vit_pair(**kw)
    assert [n.replace("blocks.lp.", "blocks.") for n, _ in par.named_parameters()] == \
        [n for n, _ in ser.named_parameters()]
    torch.manual_seed(12)
    x, y = torch.randn(5, 64), torch.randint(0, 10, (5,))
    out = par(x)
    nn.functional.cross_entropy(out, y).backward()
    ref = ser(x)
    nn.functional.cross_entropy(ref, y).backward()
    assert rel(out.detach(), ref.detach()) < REL
    for (name, p), q in zip(par.named_parameters(), ser.parameters()):
        assert p.grad is not None and rel(p.grad, q.grad) < REL, name
    assert par.open.proj.weight.grad.abs().max() > 0 and par.close.fc.weight.grad.abs().max() > 0


def test_vit_checkpoints_move_between_the_parallel_and_the_serial_build():
    """``to_serial()`` has the keys of ``make_vit(..., parallel=False)`` (its state dict loads there)
    and ``load_serial`` takes such a state dict back; both give the same network."""
    par, ser = vit_pair(n_blocks=3, dim=8, heads=2, patch=4, cf=2, max_levels=2)
    other = make_vit(3, 8, 2, patch=4, seed=99, parallel=False)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    serial = par.to_serial()
    assert list(serial.state_dict()) == list(ser.state_dict())
    ser.load_state_dict(serial.state_dict())
    with torch.no_grad():
        assert rel(ser(x), par(x)) < REL
        par.load_serial(other.state_dict())
        assert rel(par(x), other(x)) < REL
    assert all(torch.equal(p, q) for p, q in zip(par.parameters(), other.parameters()))
    with pytest.raises(KeyError, match="layer-parallel ViT's own state dict"):
        par.load_serial(par.state_dict())  # the parallel build's own keys: not a serial state dict
    # a ViT of more blocks: its extra blocks loaded silently before
    deeper = make_vit(5, 8, 2, patch=4, seed=99, parallel=False).state_dict()
    with pytest.raises(KeyError, match=r"\(3 layers\) lacks, e.g. \['blocks.layers.3"):
        par.load_serial(deeper)
    keys = par.load_serial(deeper, strict=False)
    assert keys.missing_keys == [] and keys.unexpected_keys and all(
        k.startswith(("blocks.layers.3.", "blocks.layers.4.")) for k in keys.unexpected_keys)


def test_repeat_init_starts_every_layer_from_the_same_weights():
    vit = make_vit(4, 8, 2, seed=0)
    first = vit.lp.layers[0].state_dict()
    for f in vit.lp.layers:
        for k, v in f.state_dict().items():
            assert torch.equal(v, first[k])
    halves = make_vit(3, 8, 2, form="halves", seed=0)
    assert torch.equal(halves.lp.layers[4].qkv.weight, halves.lp.layers[0].qkv.weight)
    assert torch.equal(halves.lp.layers[5].fc1.weight, halves.lp.layers[1].fc1.weight)
    assert not torch.equal(make_vit(4, 8, 2, init="independent", seed=0).lp.layers[1].attn.qkv.weight,
                           make_vit(4, 8, 2, init="independent", seed=0).lp.layers[0].attn.qkv.weight)


def test_switchable_serial_mode_is_plain_autograd_through_the_same_parameters():
    vit = make_vit(4, 8, 2, patch=4, seed=1, cf=2, fwd_iters=1, bwd_iters=1)  # inexact on purpose
    x, y = torch.randn(6, 64), torch.randint(0, 10, (6,))
    ids = [id(p) for p in vit.parameters()]
    vit.blocks.mode = "serial"
    assert [id(p) for p in vit.parameters()] == ids
    before = vit.lp.last_forward
    out = vit(x)
    nn.functional.cross_entropy(out, y).backward()
    assert vit.lp.last_forward is before and vit.lp.last_backward is None  # no MGRIT solve in serial mode
    u = vit.open(x)
    for f in vit.lp.layers:
        u = u + vit.lp.h * f(u)
    ref = vit.close(u)
    grads = torch.autograd.grad(nn.functional.cross_entropy(ref, y), list(vit.parameters()))
    assert rel(out, ref) < 1e-14
    for p, g in zip(vit.parameters(), grads):
        assert rel(p.grad, g) < 1e-14
    with pytest.raises(ValueError, match="mode"):
        vit.blocks.mode = "exact"


# -- the switch ------------------------------------------------------------------------------

def lp_gradient(model, x, y):
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def flat(vs):
    return torch.cat([v.reshape(-1) for v in vs])


def _serial_copy(model):
    ref = copy.deepcopy(model)
    ref.blocks.mode = "serial"
    return ref


def exact_group_gradients(model, x, y, k):
    """Gradients of each of the k groups through a serial copy of the model (plain autograd)."""
    ref = _serial_copy(model)
    n = len(x)
    bounds = [round(i * n / k) for i in range(k + 1)]
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        ps = list(ref.parameters())
        out.append((b - a, flat(torch.autograd.grad(nn.functional.cross_entropy(ref(x[a:b]), y[a:b]), ps))))
    return out


@pytest.mark.parametrize("groups", [2, 3])
def test_error_and_noise_estimates_equal_their_definitions(groups):
    vit = make_vit(4, 8, 2, patch=4, seed=2, cf=2, fwd_iters=1, bwd_iters=1, init="independent")
    torch.manual_seed(3)
    x, y = torch.randn(11, 64), torch.randint(0, 10, (11,))
    g_lp = lp_gradient(vit, x, y)
    ctl = SerialSwitch(vit, nn.functional.cross_entropy, every=1, groups=groups)
    rec = ctl.measure(x, y)
    for p, g in zip(vit.parameters(), g_lp):  # .grad is left as it was
        assert torch.equal(p.grad, g)
    parts = exact_group_gradients(vit, x, y, groups)
    n = len(x)
    g = sum(m * v for m, v in parts) / n
    noise = math.sqrt(sum(m * float((v - g).norm()) ** 2 for m, v in parts) / (groups - 1) / n)
    assert abs(rec["error"] - float((flat(g_lp) - g).norm() / g.norm())) < 1e-9 * rec["error"]
    assert abs(rec["noise"] - noise / float(g.norm())) < 1e-9 * rec["noise"]
    assert abs(rec["grad_norm"] - float(g.norm())) < 1e-9 * rec["grad_norm"]
    assert rec["error"] > 1e-3  # one cycle each way: a visible error


def test_group_mean_gradient_is_the_batch_gradient():
    """The exact gradient the switch compares against is the full-batch serial gradient."""
    vit = make_vit(4, 8, 2, patch=4, seed=4, cf=2, **TIGHT)
    torch.manual_seed(5)
    x, y = torch.randn(9, 64), torch.randint(0, 10, (9,))
    g_lp = flat(lp_gradient(vit, x, y))
    ref = _serial_copy(vit)
    g = flat(torch.autograd.grad(nn.functional.cross_entropy(ref(x), y), list(ref.parameters())))
    assert rel(g_lp, g) < REL
    rec = SerialSwitch(vit, nn.functional.cross_entropy, groups=4).measure(x, y)
    assert rec["error"] < 1e-9 and abs(rec["grad_norm"] - float(g.norm())) < 1e-9 * float(g.norm())


def converged_vit(seed=6):
    vit = make_vit(4, 8, 2, patch=4, seed=seed, cf=2, **TIGHT)
    torch.manual_seed(seed)
    return vit, torch.randn(16, 64), torch.randint(0, 10, (16,))


@pytest.mark.parametrize("criterion", ["signal", "noise"])
@pytest.mark.parametrize("factor, switches", [(3.0, True), (0.3, False)])
def test_switch_triggers_when_an_injected_error_exceeds_the_limit(criterion, factor, switches):
    """Converged gradient plus an error of factor * (signal or noise) * |g|: the switch acts iff factor > ratio."""
    vit, x, y = converged_vit()
    opt = torch.optim.SGD(vit.parameters(), lr=0.01)
    ctl = SerialSwitch(vit, nn.functional.cross_entropy, every=1, criterion=criterion, ratio=1.0, window=1)
    g = lp_gradient(vit, x, y)
    probe = ctl.measure(x, y)  # the converged gradient: error ~ 0, and the statistics of this batch
    assert probe["error"] < 1e-9
    assert abs(probe["signal"] ** 2 + probe["noise"] ** 2 - 1) < 1e-12 and probe["signal"] > 0.05
    limit = probe[criterion]
    torch.manual_seed(8)
    d = [torch.randn_like(v) for v in g]
    scale = factor * limit * probe["grad_norm"] / float(flat(d).norm())
    for p, v, dv in zip(vit.parameters(), g, d):
        p.grad = v + scale * dv
    injected = [p.grad.clone() for p in vit.parameters()]
    rec = ctl.update(x, y)
    assert abs(rec["error"] - factor * limit) < 1e-8 * factor * limit
    assert rec["triggered"] is switches
    assert (ctl.mode == "serial") is switches and (vit.blocks.mode == "serial") is switches
    assert ctl.switched_at == (1 if switches else None)
    for p, v in zip(vit.parameters(), injected):  # the optimizer step uses the gradient it was given
        assert torch.equal(p.grad, v)
    opt.step()


def test_patience_needs_consecutive_measurements_and_every_skips_steps():
    vit, x, y = converged_vit(seed=9)
    ctl = SerialSwitch(vit, nn.functional.cross_entropy, every=2, criterion="noise", ratio=1.0, window=1,
                       patience=2)
    g = lp_gradient(vit, x, y)
    probe = ctl.measure(x, y)
    torch.manual_seed(10)
    d = [torch.randn_like(v) for v in g]
    unit = probe["noise"] * probe["grad_norm"] / float(flat(d).norm())

    def step(factor):
        for p, v, dv in zip(vit.parameters(), g, d):
            p.grad = v + factor * unit * dv
        return ctl.update(x, y)

    assert step(3.0)["triggered"] is False  # step 1: measured, first strike
    assert step(3.0) is None  # step 2: not measured
    assert step(0.3)["triggered"] is False  # step 3: below the limit, strikes reset
    assert step(0.0) is None
    assert step(3.0)["triggered"] is False  # step 5: first strike again
    assert step(3.0) is None
    assert ctl.mode == "parallel"
    assert step(3.0)["triggered"] is True  # step 7: second consecutive strike
    assert ctl.mode == "serial" and ctl.switched_at == 7
    assert step(3.0) is None and len(ctl.history) == 4  # serial from now on: nothing measured


def test_real_layer_parallel_error_against_the_noise():
    """Few cycles on independently initialised blocks: the measured error of the real
    layer-parallel gradient decides, with the ratio on either side of error / noise."""
    vit = make_vit(8, 8, 2, patch=4, seed=13, cf=4, max_levels=2, fwd_iters=1, bwd_iters=1,
                   init="independent", T=8.0)
    torch.manual_seed(14)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    lp_gradient(vit, x, y)
    rec = SerialSwitch(vit, nn.functional.cross_entropy).measure(x, y)
    assert rec["error"] > 1e-2
    q = rec["error"] / rec["noise"]
    for ratio, switches in ((0.5 * q, True), (2.0 * q, False)):
        model = copy.deepcopy(vit)
        ctl = SerialSwitch(model, nn.functional.cross_entropy, every=1, criterion="noise", ratio=ratio,
                           window=1)
        lp_gradient(model, x, y)
        assert ctl.update(x, y)["triggered"] is switches and (model.blocks.mode == "serial") is switches


def test_window_averages_the_last_measurements():
    rule = SwitchRule(criterion="noise", ratio=1.0, window=3)
    recs = [dict(step=i + 1, error=e, noise=0.5, signal=0.8) for i, e in enumerate([0.2, 0.2, 1.4, 0.2, 0.9, 1.0])]
    # means of the last <= 3 errors: 0.2, 0.2, 0.6, 0.6, 0.833, 0.7 against the noise 0.5
    assert [rule.over(recs[: i + 1]) for i in range(6)] == [False, False, True, True, True, True]
    assert rule.first_trigger(recs) == 3
    assert SwitchRule(criterion="noise", window=1, patience=2).first_trigger(recs) == 6
    assert SwitchRule(criterion="signal", window=1).first_trigger(recs) == 3
    assert SwitchRule(criterion="signal", window=3).first_trigger(recs) == 5
    assert SwitchRule(threshold=1.3, ratio=float("inf"), window=1).first_trigger(recs) == 3
    assert not SwitchRule(window=3, ratio=0.0).over(recs[:2])  # not before the window is full
    with pytest.raises(ValueError, match="window"):
        SwitchRule(window=0)


def test_a_monitored_run_predicts_the_switch_step_of_the_same_run():
    """Train with the measurement only (ratio inf), replay a rule on its history, then train again
    with that rule: it switches at the predicted step, and the runs agree up to that step."""
    def run(ratio, steps=10):
        vit = make_vit(4, 8, 2, patch=4, seed=17, cf=2, fwd_iters=1, bwd_iters=1, init="independent", T=4.0)
        opt = torch.optim.Adam(vit.parameters(), lr=2e-2)
        ctl = SerialSwitch(vit, nn.functional.cross_entropy, every=1, ratio=ratio, window=1, patience=2)
        gen = torch.Generator().manual_seed(18)
        X, Y = torch.randn(64, 64, generator=gen), torch.randint(0, 10, (64,), generator=gen)
        snapshots = []
        for k in range(steps):
            sl = slice(6 * k, 6 * k + 6)
            opt.zero_grad()
            nn.functional.cross_entropy(vit(X[sl]), Y[sl]).backward()
            ctl.update(X[sl], Y[sl])
            opt.step()
            snapshots.append(flat([p.detach() for p in vit.parameters()]))
        return ctl, snapshots

    monitor, snaps = run(float("inf"))
    r = [rec["error"] / rec["noise"] for rec in monitor.history]
    pairs = [min(r[i - 1], r[i]) for i in range(1, len(r))]
    ratio = 0.99 * max(pairs)  # two consecutive measurements above it: at the best pair, or before
    rule = SwitchRule(ratio=ratio, window=1, patience=2)
    predicted = rule.first_trigger(monitor.history)
    assert predicted == 2 + pairs.index(max(pairs)) and predicted < 10, r
    ctl, snaps2 = run(ratio)
    assert ctl.switched_at == predicted and [h["step"] for h in ctl.history] == list(range(1, predicted + 1))
    for a, b in zip(snaps[:predicted], snaps2[:predicted]):  # identical up to the switching step
        assert torch.equal(a, b)
    if predicted < len(snaps):
        assert not torch.equal(snaps[-1], snaps2[-1])


def test_tighten_doubles_the_cycles_then_goes_serial():
    vit, x, y = converged_vit(seed=15)
    vit.lp.fwd_iters, vit.lp.bwd_iters = 2, 1
    ctl = SerialSwitch(vit, nn.functional.cross_entropy, every=1, threshold=-1.0, window=1, action="tighten")
    cap = vit.blocks.exact_iterations
    seen = []
    while ctl.mode == "parallel":
        lp_gradient(vit, x, y)
        ctl.update(x, y)
        seen.append((vit.lp.fwd_iters, vit.lp.bwd_iters))
    assert seen[:2] == [(4, 2), (min(8, cap), 4)]
    assert seen[-1] == (cap, cap) and ctl.switched_at == len(seen)


def test_adapt_adds_a_cycle_above_the_limit_and_drops_one_far_below():
    vit, x, y = converged_vit(seed=15)
    cap = vit.blocks.exact_iterations
    vit.lp.fwd_iters, vit.lp.bwd_iters = 2, 1
    up = SerialSwitch(vit, nn.functional.cross_entropy, every=1, threshold=-1.0, window=1, action="adapt")
    seen = []
    while up.mode == "parallel":
        lp_gradient(vit, x, y)
        up.update(x, y)
        seen.append((vit.lp.fwd_iters, vit.lp.bwd_iters))
    assert seen[:2] == [(3, 2), (4, 3)] and seen[-1] == (cap, cap) and up.switched_at == len(seen)
    vit, x, y = converged_vit(seed=15)
    vit.lp.fwd_iters, vit.lp.bwd_iters = 3, 2
    vit.lp.fwd_tol = vit.lp.bwd_tol = None  # fixed cycles (the cap of a solve with a tolerance is not lowered)
    down = SerialSwitch(vit, nn.functional.cross_entropy, every=1, ratio=1e12, window=1, action="adapt",
                        min_iters=1)
    for expect in [(2, 1), (1, 1), (1, 1)]:  # the error is far below 1e12 x the noise: one cycle fewer
        lp_gradient(vit, x, y)
        rec = down.update(x, y)
        assert (vit.lp.fwd_iters, vit.lp.bwd_iters) == expect and not rec["triggered"]
        assert rec["error"] > 0 and rec["noise"] > 0
    assert rec["lowered"] is False and down.mode == "parallel"
    with pytest.raises(ValueError, match="lower"):
        SerialSwitch(vit, nn.functional.cross_entropy, action="adapt", lower=1.5)


def test_training_across_the_switch_matches_a_serial_run():
    """torch.optim keeps working: converged layer-parallel steps, a switch, serial steps ==
    the same steps of a serial run (same initial weights, same Adam)."""
    vit, x, y = converged_vit(seed=16)
    ref = _serial_copy(vit)
    opt, opt_ref = torch.optim.Adam(vit.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)
    ctl = SerialSwitch(vit, nn.functional.cross_entropy, every=2, threshold=-1.0, window=1)
    for step in range(4):
        sl = slice(4 * step, 4 * step + 8)
        for model, o in ((vit, opt), (ref, opt_ref)):
            o.zero_grad()
            nn.functional.cross_entropy(model(x[sl]), y[sl]).backward()
            if model is vit:
                ctl.update(x[sl], y[sl])
            o.step()
    assert ctl.switched_at == 1 and vit.blocks.mode == "serial"
    for p, q in zip(vit.parameters(), ref.parameters()):
        assert rel(p, q) < REL


def test_switch_needs_a_switchable_model():
    lp = LayerParallel(transformer_layers(2, 8, 2), T=1.0)
    with pytest.raises(ValueError, match="Switchable"):
        SerialSwitch(nn.Sequential(lp), nn.functional.cross_entropy)
    with pytest.raises(ValueError, match="groups"):
        SerialSwitch(nn.Sequential(Switchable(lp)), nn.functional.cross_entropy, groups=1)
    with pytest.raises(ValueError, match="criterion"):
        SerialSwitch(nn.Sequential(Switchable(lp)), nn.functional.cross_entropy, criterion="variance")
    with pytest.raises(ValueError, match="action"):
        SerialSwitch(nn.Sequential(Switchable(lp)), nn.functional.cross_entropy, action="restart")
    vit = make_vit(2, 8, 2, patch=4, seed=0)
    ctl = SerialSwitch(vit, nn.functional.cross_entropy)
    x = torch.randn(1, 64)
    lp_gradient(vit, x, torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match=">= 2 samples"):
        ctl.measure(x, torch.zeros(1, dtype=torch.long))


def test_mlp_layer_shape_and_hidden_width():
    m = MLPLayer(8, 12)
    assert m.fc1.out_features == 12 and m(torch.randn(2, 3, 8)).shape == (2, 3, 8)


# -- two ranks -------------------------------------------------------------------------------

@pytest.mark.mpi
@needs_mpiexec
def test_transformer_on_two_ranks_equals_serial():
    assert_all_ok(2, *launch(2, "transformer_ranks.py"))


# From a hostile review of the transformer module (its numerics held up to 6e-14 against serial autograd)
@pytest.mark.parametrize("build, match", [
    (lambda: make_vit(2, 10, 2.5), "whole numbers"),  # 2.5 heads: truncated to 2
    (lambda: make_vit(2, 10, True), "whole numbers"),
    (lambda: make_vit(2, -4, -2), "positive multiple of `heads`"),  # (torch's 'negative dimension' before)
    (lambda: make_vit(2, 8.0, 2), "whole numbers"),
    (lambda: make_vit(2, 8, 2, patch=4.0), "positive whole numbers"),
    (lambda: make_vit(2, 8, 2, channels=0), "`channels`"),
    (lambda: make_vit(2, 8, 2, classes=0), "`classes`"),
    (lambda: make_vit(2, 8, 2, mlp_ratio=0.01), "hidden width of 0"),
    (lambda: make_vit(2, 8, 2, mlp_ratio=-1.0), "`mlp_ratio`"),
    (lambda: make_vit(2, 8, 2, parallel=False, T=0), "`T` must be a finite number > 0"),
    (lambda: make_vit(2, 8, 2, parallel=False, T=float("inf")), "`T` must be a finite number > 0"),
    (lambda: make_vit(2, 8, 2, causal="no", pool="mean"), "`causal` must be True or False"),
    (lambda: make_vit(2, 8, 2, parallel="no"), "`parallel` must be True or False"),
    (lambda: transformer_layers(0, 8, 2), "`n_blocks`"),
])
def test_bad_vit_arguments_are_named(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_a_scalar_input_and_a_strict_load_that_fails_change_nothing():
    """vit(tensor(1.0)) raised IndexError; a strict load_serial of a 4-block checkpoint into 3 blocks raised
    KeyError after overwriting the embedding and the head."""
    vit = make_vit(3, 8, 2, seed=0, cf=2, max_levels=2)
    with pytest.raises(ValueError, match="the patch embedding expects images"):
        vit(torch.tensor(1.0))
    other = make_vit(4, 8, 2, seed=1, parallel=False)
    before = {k: v.clone() for k, v in vit.state_dict().items()}
    with pytest.raises(KeyError):
        vit.load_serial(other.state_dict())
    assert all(torch.equal(before[k], v) for k, v in vit.state_dict().items())
