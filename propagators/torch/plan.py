"""Which layers a rank owns, which it needs, and which parameters must travel.

With the fine points ``0..N`` split into contiguous blocks over ``P`` ranks
(:func:`mgrit.partition.fine_ranges`), rank ``p`` owns the points
``lo_p..hi_p`` and the layers that produce them: layer ``j`` maps ``u_j`` to
``u_{j+1}``, so rank ``p`` owns layers ``max(lo_p - 1, 0) .. hi_p - 1``; every
layer has exactly one owner, which holds its parameters and gets its
gradient. A rank also *needs* the layers of the steps that end at its points on
every level of the forward and the adjoint hierarchy: on coarse levels these
can lie in a neighbour's block (parameter injection takes the layer at the
start of a coarse interval). Those are the *halo*: their parameters are sent
by the owner before every forward pass.

The adjoint runs in reverse layer-time with the ranks numbered in reverse (rank r
is rank P - 1 - r there), on the mirrored blocks, so that every rank's adjoint
points are its forward points.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mgrit.hierarchy import Hierarchy
from mgrit.partition import fine_ranges, level_ranges


@dataclass(frozen=True)
class DistributionPlan:
    """The distribution of ``n_layers`` layers over ``size`` ranks (a frozen value).

    Attributes
    ----------
    n_layers, size : int
    fine : tuple of (lo, hi)
        Fine points of every rank (``hi < lo``: the rank owns no point).
    adj_partition : tuple of int
        Start of every reversed rank's block in reverse time (the mirror of ``fine``).
    owned : tuple of range
        Layers owned by every rank.
    needed : tuple of frozenset
        Layers every rank evaluates (owned ones and its halo).
    halo : tuple of (owner, user, layer)
        Parameters that travel before each forward pass, in a fixed order.
    left, right : tuple of (int or None)
        Fine-level neighbours (owners of ``lo - 1`` and ``hi + 1``).
    """

    n_layers: int
    size: int
    fine: tuple
    adj_partition: tuple
    owned: tuple
    needed: tuple
    halo: tuple
    left: tuple
    right: tuple

    @classmethod
    def build(cls, n_layers: int, hierarchy: Hierarchy, layer_index, size: int) -> "DistributionPlan":
        N, P = int(n_layers), int(size)
        k = np.arange(N)
        fine_layers = np.asarray(layer_index(k, k + 1))
        if fine_layers.shape != k.shape:
            raise ValueError(
                "`layer_index(i0, i1)` is called with integer arrays of interval ends and must return an integer "
                f"array of their shape (one layer per interval); for {N} intervals it returned shape "
                f"{fine_layers.shape}. Write it with numpy operations on i0 and i1 (e.g. np.zeros_like(i0) for "
                "layer 0, but it must give layer i on the layers themselves)")
        if not np.array_equal(fine_layers, k):
            bad = int(np.flatnonzero(np.asarray(fine_layers).reshape(-1)[:N] != k[: fine_layers.size])[0]) \
                if fine_layers.size else 0
            raise ValueError(
                f"`layer_index(i, i + 1)` must be layer i on the layers themselves (the network being trained); "
                f"it gives {fine_layers.reshape(-1)[bad] if fine_layers.size else None} for i = {bad}. "
                "Only coarse steps (i1 - i0 > 1) may choose another layer")
        for l, lv in enumerate(hierarchy):  # every rank's plan, and every coarse step, rest on the same answer
            s = lv.stride
            i0 = np.arange(0, N - s + 1, s)
            if len(i0) and not np.array_equal(np.asarray(layer_index(i0, i0 + s)), np.asarray(layer_index(i0, i0 + s))):
                raise ValueError(
                    f"`layer_index` gave other layers when called twice on the intervals of level {l}: it must be a "
                    "deterministic function of (i0, i1) (no random choice): every rank plans which layers it "
                    "holds from it, and every coarse step calls it again")
        fine = tuple(fine_ranges(N + 1, P))
        adj = [N - fine[P - 1 - q][1] for q in range(P)]
        adj[0] = 0
        # ranks that own nothing keep the start of the next block (non-decreasing starts)
        for q in range(1, P):
            adj[q] = max(adj[q], adj[q - 1])
        owned = tuple(range(max(lo - 1, 0), hi) if hi >= lo else range(0) for lo, hi in fine)
        fwd_ranges = level_ranges(hierarchy, P)
        adj_ranges = level_ranges(hierarchy, P, adj)
        needed, halo = [], []
        for p in range(P):
            used = set(owned[p])
            for l, lv in enumerate(hierarchy):
                s = lv.stride
                lo, hi = fwd_ranges[l][p]
                k = np.arange(max(lo, 1), hi + 1)
                used.update(np.asarray(layer_index((k - 1) * s, k * s)).tolist())
                lo, hi = adj_ranges[l][P - 1 - p]
                k = np.arange(max(lo, 1), hi + 1)
                used.update(np.asarray(layer_index(N - k * s, N - (k - 1) * s)).tolist())
            bad = sorted(j for j in used if not 0 <= j < N)
            if bad:
                raise ValueError(f"`layer_index` returned layers {bad[:5]} outside 0..{N - 1}")
            needed.append(frozenset(used))
        owner = _owner_table(owned, N)
        for p in range(P):
            for j in sorted(needed[p] - set(owned[p])):
                halo.append((int(owner[j]), p, j))
        left, right = [], []
        starts = [(lo, q) for q, (lo, hi) in enumerate(fine) if hi >= lo]
        for p, (lo, hi) in enumerate(fine):
            if hi < lo:
                left.append(None)
                right.append(None)
                continue
            left.append(next((q for s, q in reversed(starts) if s < lo), None))
            right.append(next((q for s, q in starts if s > hi), None))
        return cls(N, P, fine, tuple(adj), owned, tuple(needed), tuple(halo), tuple(left), tuple(right))

    def owner(self, j: int) -> int:
        """Rank owning layer ``j`` (the owner of point ``j + 1``)."""
        for p, r in enumerate(self.owned):
            if j in r:
                return p
        raise IndexError(f"layer {j} outside 0..{self.n_layers - 1}")

    def owner_of_point(self, i: int) -> int:
        for p, (lo, hi) in enumerate(self.fine):
            if lo <= i <= hi:
                return p
        raise IndexError(f"point {i} outside 0..{self.n_layers}")

    def halo_layers(self, rank: int) -> list:
        """Layers ``rank`` needs from other ranks."""
        return sorted(self.needed[rank] - set(self.owned[rank]))


def _owner_table(owned, n: int) -> np.ndarray:
    out = np.full(n, -1, dtype=np.int64)
    for p, r in enumerate(owned):
        out[list(r)] = p
    return out
