"""Properties of the time-axis distribution (mgrit.partition)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mgrit
from mgrit.partition import all_neighbours, block_range, fine_ranges, level_ranges, neighbours


def owners(ranges, n_points: int) -> list:
    """For every index, the list of ranks whose range contains it."""
    out = [[] for _ in range(n_points)]
    for p, (lo, hi) in enumerate(ranges):
        for i in range(lo, hi + 1):
            out[i].append(p)
    return out


@st.composite
def partitions(draw):
    """``(n_points, size, partition)`` with a random (possibly None) partition."""
    n_points = draw(st.integers(1, 80))
    size = draw(st.integers(1, 12))
    if draw(st.booleans()):
        return n_points, size, None
    cuts = sorted(draw(st.lists(st.integers(0, n_points), min_size=size - 1, max_size=size - 1)))
    return n_points, size, [0] + cuts


@st.composite
def hierarchies(draw):
    """A hierarchy with random size and factors, and a partition of its fine points."""
    n = draw(st.integers(1, 120))
    cf = draw(st.lists(st.integers(2, 5), min_size=1, max_size=4))
    h = mgrit.build_hierarchy(np.arange(n + 1.0), cf=cf, max_levels=draw(st.integers(1, 5)),
                              min_coarse=draw(st.integers(1, 3)))
    size = draw(st.integers(1, 10))
    part = None
    if draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(0, n + 1), min_size=size - 1, max_size=size - 1)))
        part = [0] + cuts
    return h, size, part


@settings(max_examples=200, deadline=None)
@given(partitions())
def test_every_fine_point_is_owned_exactly_once_in_ordered_contiguous_blocks(case):
    n_points, size, part = case
    ranges = fine_ranges(n_points, size, part)
    assert len(ranges) == size
    assert all(len(o) == 1 for o in owners(ranges, n_points))
    # contiguous and in rank order: each block starts where the previous one ended
    nxt = 0
    for lo, hi in ranges:
        assert lo == nxt and hi >= lo - 1
        nxt = hi + 1
    assert nxt == n_points
    if part is not None:
        assert [lo for lo, _ in ranges] == part


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 200), st.integers(1, 40))
def test_balanced_blocks_differ_by_at_most_one_point(n_points, size):
    sizes = [hi - lo + 1 for lo, hi in (block_range(n_points, size, r) for r in range(size))]
    assert sum(sizes) == n_points and max(sizes) - min(sizes) <= 1
    assert fine_ranges(n_points, size) == [block_range(n_points, size, r) for r in range(size)]


@settings(max_examples=200, deadline=None)
@given(hierarchies())
def test_coarse_point_belongs_to_the_owner_of_its_fine_point(case):
    h, size, part = case
    out = level_ranges(h, size, part)
    fine = fine_ranges(h[0].n + 1, size, part)
    assert out[0] == fine and len(out) == len(h)
    for lv, ranges in zip(h, out):
        assert len(ranges) == size
        own = owners(ranges, lv.n + 1)
        assert all(len(o) == 1 for o in own)  # every point of the level, once
        for k, (p,) in enumerate(own):
            lo, hi = fine[p]
            assert lo <= k * lv.stride <= hi  # k lies where its fine point lies


@settings(max_examples=200, deadline=None)
@given(hierarchies())
def test_neighbours_own_the_adjacent_points(case):
    h, size, part = case
    for lv, ranges in zip(h, level_ranges(h, size, part)):
        own = owners(ranges, lv.n + 1)
        for p, (lo, hi) in enumerate(ranges):
            if hi < lo:
                continue
            left, right = neighbours(ranges, p)
            assert left == (own[lo - 1][0] if lo > 0 else None)
            assert right == (own[hi + 1][0] if hi < lv.n else None)
        assert all_neighbours(ranges) == {p: neighbours(ranges, p) for p, (lo, hi) in enumerate(ranges) if lo <= hi}


@pytest.mark.parametrize("part", [[1, 2], [0, 5, 3], [0, 20], [0]])
def test_bad_partition_names_the_argument(part):
    with pytest.raises(ValueError, match="`partition`"):
        fine_ranges(11, 2 if len(part) != 3 else 3, part)


def test_partition_and_model_are_attributes_after_import_mgrit():
    code = "import mgrit; mgrit.partition.level_ranges; mgrit.model.predict"
    subprocess.run([sys.executable, "-c", code], check=True)
    import mgrit.model

    assert mgrit.model.level_ranges is mgrit.partition.level_ranges is level_ranges


@pytest.mark.parametrize("bad", [[0, 2.7, 5.9], [0, True, 5], [0, np.True_, 5], [0, float("nan"), 5], [0, "3", 6]])
def test_partition_entries_must_be_integers(bad):
    """Floats were truncated (2.7 gave a block starting at 2), True counted as 1, NaN raised int()'s own
    error; integers of any kind and integral floats stay accepted."""
    with pytest.raises(ValueError, match="`partition` must list integer start indices"):
        fine_ranges(9, 3, bad)
    want = [(0, 2), (3, 5), (6, 8)]
    assert fine_ranges(9, 3, np.array([0, 3, 6])) == fine_ranges(9, 3, [0, np.int32(3), 6]) == want
    assert fine_ranges(9, 3, np.array([0.0, 3.0, 6.0])) == fine_ranges(9, 3, [0, 3.0, 6]) == want
    torch = pytest.importorskip("torch")
    assert fine_ranges(9, 3, torch.tensor([0, 3, 6])) == want
    with pytest.raises(ValueError, match="integer start indices"):
        fine_ranges(9, 3, torch.tensor([0.0, 2.5, 6.0]))


@pytest.mark.parametrize("size", [0, -1, 2.5, True, "2"])
def test_a_number_of_ranks_below_one_or_not_an_integer_is_refused(size):
    """``level_ranges(h, 0)`` returned empty lists, so ``mgrit.plots.hierarchy(h, size=0)`` drew an empty plot."""
    h = mgrit.build_hierarchy(np.linspace(0, 1, 9), cf=2)
    with pytest.raises(ValueError, match="`size` \\(the number of ranks\\) must be an integer >= 1"):
        level_ranges(h, size)
    with pytest.raises(ValueError, match="`size`"):
        fine_ranges(9, size)
