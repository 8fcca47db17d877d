"""The sums by which ranks compare an array they must share (mgrit._inputs): other data is told from
rounding, in every dtype, at every size."""
from __future__ import annotations

import numpy as np
import pytest

from mgrit._inputs import array_sums, spread, sums_gap, sums_rtol

torch = pytest.importorskip("torch")

SIZES = [2, 16, 1000, 4096, 65536, 262144]


def values(x: torch.Tensor) -> np.ndarray:
    return x.float().numpy().reshape(-1)  # (float16 and bfloat16 values are float32 values)


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return sums_gap(array_sums(values(a)), array_sums(values(b)))


def rtol(a: torch.Tensor) -> float:
    return sums_rtol(torch.finfo(a.dtype).eps, spread(values(a)))


def one_unit_apart(x: torch.Tensor, seed: int) -> torch.Tensor:
    """Every entry moved by one unit in the last place, up or down at random: rounding on other hardware."""
    bits = x.view(torch.int16)
    step = torch.randint(0, 2, x.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int16) * 2 - 1
    return (bits + step).view(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", SIZES)
def test_low_precision_arrays_are_told_apart_from_their_rounding(dtype, n):
    """bfloat16 batches of 4,000 entries or more, and float16 ones of 262,144, passed as 'the same' for
    independent random data under a tolerance of 8 units in the last place; 100 units capped at 1e-4
    (the tolerance before that) called one unit apart in a two-entry u0 a different array."""
    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        a, b = torch.randn(n, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
        if n >= 16:  # (two entries of independent data can agree by chance)
            assert gap(a, b) > rtol(a), (seed, gap(a, b), rtol(a))
        assert gap(a, one_unit_apart(a, seed + 100)) <= rtol(a), (seed, gap(a, one_unit_apart(a, seed + 100)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [64, 4096, 65536])
def test_one_unit_in_an_entry_that_dominates_is_rounding(dtype, n):
    """An activation of 100 among values of about 1 (as in large language models), one unit apart on
    one rank: a tolerance of 32 eps / sqrt(n) called it a different input; the spread of the magnitudes
    sees that one entry carries the sums."""
    a = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    a[7] = 100.0
    b = a.clone()
    b[7:8] = one_unit_apart(a[7:8], 1)
    assert gap(a, b) <= rtol(a), (gap(a, b), rtol(a))


def test_short_low_precision_arrays_keep_eight_units_at_most():
    """A bfloat16 u0 of [1.0] on one rank and [1.1] on another passed under 32 eps / sqrt(n) (0.25 at one
    entry)."""
    for dtype in (torch.float16, torch.bfloat16):
        a, b = torch.tensor([1.0], dtype=dtype), torch.tensor([1.1], dtype=dtype)
        assert gap(a, b) > rtol(a) and gap(a, b) > rtol(b)
        c, d = torch.tensor([0.5, -1.25], dtype=dtype), torch.tensor([0.55, -1.3], dtype=dtype)
        assert gap(c, d) > rtol(c)


@pytest.mark.parametrize("n", [1, 3, 5000])
def test_every_entry_has_a_sign_in_the_weighted_sum(n):
    """The weights started at 0, so a flipped sign of the first entry (a scalar u0 of -1 for +1) passed."""
    a = np.linspace(1.0, 2.0, n)
    b = a.copy()
    b[0] = -b[0]
    assert sums_gap(array_sums(a), array_sums(b)) > sums_rtol(np.finfo(np.float64).eps)


def test_the_float32_and_float64_tolerance_is_100_units_whatever_the_spread():
    for dtype in (np.float32, np.float64):
        eps = float(np.finfo(dtype).eps)
        assert sums_rtol(eps, 1.0) == sums_rtol(eps, 1e-4) == 100 * eps


@pytest.mark.parametrize("dtype, batch, width", [(torch.float64, 4096, 256), (torch.float32, 16, 16),
                                                 (torch.float32, 256, 64), (torch.float32, 256, 61),
                                                 (torch.float32, 256, 122), (torch.float32, 1024, 1),
                                                 (torch.float32, 1024, 2), (torch.float16, 16, 16)])
def test_another_sample_or_two_neighbours_swapped_in_a_batch_is_told(dtype, batch, width):
    """The four sums of magnitudes and positions move by about 1 / batch of themselves when one sample changes,
    and two neighbouring samples swapped moved the weighted ones by less: below the tolerance in float32 from
    256 samples of 64 on (0 of 10 swaps caught), and in float16 at 16 of 16 (7 of 10). The sum with pseudo-random
    weights, about sqrt(n) entries, moves by about sqrt(width) entries (not enough in float16 from about 256 x 64,
    whose tolerance is wider). Samples of 61 or 122 fill whole rows of a 61-wide view, whose weights alone missed
    half and a quarter of such swaps: those of a 64-wide view are added. Samples of one or two entries swapped
    unseen wherever the two had equal weights (+-1 signs: 3 in 8 neighbouring pairs): the column weights are
    drawn from a continuum. Their rounding, one unit in every entry, passes."""
    caught = np.zeros(2, dtype=int)
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(batch, width, generator=gen).to(dtype)
        k = (seed * 37) % (batch - 1)
        swapped, other = x.clone(), x.clone()
        swapped[[k, k + 1]] = x[[k + 1, k]]
        other[k] = torch.randn(width, generator=gen).to(dtype)
        caught += [gap(x, swapped) > rtol(x), gap(x, other) > rtol(x)]
        if dtype in (torch.float16, torch.bfloat16):
            assert gap(x, one_unit_apart(x, seed)) <= rtol(x)
    # (a swap moves the random sum by about sqrt(width) entries against a tolerance of about n entries' rounding:
    # near the limit a few in a hundred pass, at random; a structural blind spot passes many)
    assert caught.min() >= 18, caught


@pytest.mark.parametrize("n", [5, 61, 4096, 4097, 70001])
def test_the_random_sum_is_the_same_in_both_layouts(n):
    """Small arrays are summed in flat order, large ones in views: the same weights at the same places (ranks
    whose arrays take different paths, an integer array and a float one, compare alike)."""
    from mgrit._inputs import flat_weights

    a = np.random.default_rng(n).standard_normal(n)
    assert np.isclose(array_sums(a)[4], a @ flat_weights(n), rtol=0, atol=1e-12 * np.abs(a).sum())
    ints = np.arange(n) % 7 - 3
    assert np.isclose(array_sums(ints)[4], ints @ flat_weights(n), rtol=0, atol=1e-12 * np.abs(ints).sum())
