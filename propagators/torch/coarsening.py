"""Spatial coarsening of a convolutional ODE-net between MGRIT time levels.

The states of a conv ODE-net are feature maps ``(..., C, H, W)``. With
``LayerParallel(..., spatial=SpatialCoarsening())`` the coarse time levels work
on coarser maps (docs/cnn_spatial.md):

* level ``l`` holds maps whose sides are divided by ``factor`` once more per
  level from ``coarsen_from`` on (default: the coarsest level only), while
  they stay divisible and at least ``min_size``; the fine level (the network
  itself) is never changed, so at convergence output and gradients are the
  serial network's;
* between a level and a coarsened one, :class:`FeatureMapTransfer` restricts
  by 2 x 2 averaging (``R``) and interpolates (``P``: nearest or bilinear);
* a coarse step applies the layer chosen by ``layer_index`` (injection) to the
  coarse map: a copy of the layer whose ``nn.Conv2d`` weights are replaced by
  kernels rediscretised for the coarse grid (:func:`rediscretized_weight`), by
  the Galerkin kernels ``R conv P`` (:func:`galerkin_weight`, exact for a
  linear stride-1 'same' convolution with zero padding and nearest ``P``), or
  left as they are (``weights="same"``);
* the adjoint solve (the transpose of the linearised forward problem) uses the
  transposed transfers: restriction ``P^T`` and interpolation ``R^T``, and
  coarse vector-Jacobian products at the restricted forward states.

The classes here are used by :class:`~propagators.torch.module.LayerParallel`;
:class:`FeatureMapTransfer` and the weight maps also work on their own
with :func:`mgrit.solve`.
"""
from __future__ import annotations

import copy
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import mgrit

from .adjoint import AdjointPropagator
from .kernel import LayerError, LayerKernel, layer_signature
from .propagator import ODEPropagator

INTERPOLATIONS = ("nearest", "bilinear")
WEIGHTS = ("galerkin", "rediscretize", "same")


class SpatialCoarsening:
    """Settings of spatial coarsening for :class:`~propagators.torch.module.LayerParallel`.

    Parameters
    ----------
    coarsen_from : int, optional
        First time level whose feature maps are coarsened; each level from
        there on divides the map sides by ``factor`` again. None (default):
        only the coarsest level (the sequential solve) works on coarse maps.
    factor : int
        Division of the map sides per coarsened level: 2, 4, 8, ...
    min_size : int
        No map side is coarsened below this many pixels; maps whose sides are
        not divisible are not coarsened further either.
    interpolation : {"bilinear", "nearest"}
        ``P`` of the forward solve: cell-centred bilinear interpolation (edge
        values repeated), or piecewise constant (``R P = I``).
    weights : {"rediscretize", "galerkin", "same"}
        Coarse ``nn.Conv2d`` weights: the kernel rediscretised for the grid of
        twice the spacing (:func:`rediscretized_weight`: the same operator on
        smooth maps), the Galerkin kernel ``R conv P`` of the piecewise-constant
        pair (:func:`galerkin_weight`), both for stride-1 convolutions with odd
        kernels and 'same' padding; or the fine weights applied to the coarse
        map unchanged (any convolution that keeps the map size).

    Notes
    -----
    Features that the coarse maps cannot represent get no coarse-grid
    correction (a coarse propagator ``mu = 0`` for them, docs/theory.md §6):
    they converge at the rate ``|lambda|^(m (r + 1))`` of the layers' own damping
    over a coarse interval, or, for layers that do not damp them, by
    propagation, one coarse interval per C-relaxation. So coarsening many-interval
    levels (``coarsen_from`` small) pays only for layers that smooth their
    features (diffusion-like convolutions); the coarsest level, with few
    intervals, can always be coarsened. Such features are only updated by
    C-relaxation, so every level above a coarsened one needs "FCF"
    (:meth:`check_relax`). See docs/cnn_spatial.md.

    Examples
    --------
    >>> s = SpatialCoarsening(coarsen_from=1)
    >>> s.depths(4, (32, 32)), s.depths(4, (6, 6)), SpatialCoarsening().depths(4, (32, 32))
    ([0, 1, 2, 3], [0, 0, 0, 0], [0, 0, 0, 1])
    >>> SpatialCoarsening(coarsen_from=2, factor=4).depths(4, (32, 32))
    [0, 0, 2, 3]
    >>> SpatialCoarsening().depths(1, (32, 32))  # one level (too few layers to coarsen in time): none
    [0]
    """

    def __init__(self, coarsen_from: int | None = None, factor: int = 2, min_size: int = 4,
                 interpolation: str = "bilinear", weights: str = "rediscretize"):
        checks = [("factor", factor, 2), ("min_size", min_size, 1)]
        if coarsen_from is not None:
            checks.append(("coarsen_from", coarsen_from, 1))
        for name, v, lo in checks:
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"`{name}` must be an integer >= {lo}, got {v!r}")
        if factor & (factor - 1):
            raise ValueError(f"`factor` must be a power of 2 (2, 4, 8, ...), got {factor}")
        if interpolation not in INTERPOLATIONS:
            raise ValueError(f"`interpolation` must be one of {INTERPOLATIONS}, got {interpolation!r}")
        if weights not in WEIGHTS:
            raise ValueError(f"`weights` must be one of {WEIGHTS}, got {weights!r}")
        self.coarsen_from = None if coarsen_from is None else int(coarsen_from)
        self.factor, self.min_size = int(factor), int(min_size)
        self.interpolation, self.weights = interpolation, weights

    def __repr__(self) -> str:
        return (f"SpatialCoarsening(coarsen_from={self.coarsen_from}, factor={self.factor}, "
                f"min_size={self.min_size}, interpolation={self.interpolation!r}, weights={self.weights!r})")

    def first(self, n_levels: int) -> int:
        """The first coarsened level of a hierarchy of ``n_levels`` levels (never level 0, the network's
        own: with one level nothing is coarsened)."""
        return max(1, n_levels - 1) if self.coarsen_from is None else self.coarsen_from

    def depths(self, n_levels: int, hw) -> list:
        """Halvings of the map sides on each time level, for maps of size ``hw = (H, W)``."""
        H, W = (int(s) for s in hw)
        per, first = self.factor.bit_length() - 1, self.first(n_levels)
        out = []
        for level in range(n_levels):
            k = per * max(0, level - first + 1)
            while k > 0 and not (H % 2**k == 0 and W % 2**k == 0
                                 and H // 2**k >= self.min_size and W // 2**k >= self.min_size):
                k -= 1
            out.append(k)
        return out

    def check_relax(self, hierarchy) -> None:
        """Raise unless every level above a coarsened level has C-relaxation; warn when ``coarsen_from`` is
        beyond the hierarchy (a short network, or a shallow stage sharing the settings of deeper ones: its
        levels are not coarsened)."""
        L = len(hierarchy)
        if self.coarsen_from is not None and self.coarsen_from >= L:
            fix = (f"coarsen_from between 1 and {L - 1} coarsens some, None the coarsest" if L > 1 else
                   "a hierarchy of one level has no coarse level")
            warnings.warn(f"SpatialCoarsening(coarsen_from={self.coarsen_from}) on a hierarchy of {L} level(s), 0 "
                          f"to {L - 1}: no level is coarsened ({fix})", UserWarning, stacklevel=4)
        for level in range(self.first(L) - 1, L - 1):
            if hierarchy[level].nrelax < 1:
                raise ValueError(
                    f"spatial coarsening of level {level + 1} needs C-relaxation on level {level} (relax "
                    f"'FCF'), which has relax={hierarchy[level].relax!r}: F-relaxation never changes the "
                    "features of the C-points that the coarse maps cannot represent, so the solve would not "
                    f"converge. Pass relax='FCF' (or one entry per level, 'FCF' from level {level} on), or "
                    f"coarsen later levels only (SpatialCoarsening(coarsen_from=k); by default only the coarsest, "
                    f"here level {self.first(L)} of {L} levels: with more levels, max_levels or a smaller cf, "
                    "the default relax=('F', 'FCF') has C-relaxation where it is needed)")


# --------------------------------------------------------------------------- transfers
def _restriction_1d(n: int) -> np.ndarray:
    """``(n, 2n)``: the mean of each pair of fine pixels."""
    R = np.zeros((n, 2 * n))
    R[np.arange(n), 2 * np.arange(n)] = R[np.arange(n), 2 * np.arange(n) + 1] = 0.5
    return R


def _interpolation_1d(n: int, kind: str) -> np.ndarray:
    """``(2n, n)``: piecewise constant, or cell-centred linear with the edge values repeated
    (``F.interpolate(mode="bilinear", align_corners=False)`` per axis)."""
    P = np.zeros((2 * n, n))
    i = np.arange(n)
    if kind == "nearest":
        P[2 * i, i] = P[2 * i + 1, i] = 1.0
        return P
    np.add.at(P, (2 * i, i), 0.75)
    np.add.at(P, (2 * i, np.maximum(i - 1, 0)), 0.25)
    np.add.at(P, (2 * i + 1, i), 0.75)
    np.add.at(P, (2 * i + 1, np.minimum(i + 1, n - 1)), 0.25)
    return P


class FeatureMapTransfer(mgrit.SpatialTransfer):
    """Halving of feature maps (the last two axes) between two time levels (``times`` halvings).

    Forward (``adjoint=False``): ``restrict`` is 2 x 2 averaging ``R`` and
    ``interpolate`` is ``P`` (``"nearest"`` or ``"bilinear"``). For the adjoint
    solve (``adjoint=True``) the transposes: ``restrict = P^T``,
    ``interpolate = R^T``. Both act separably, ``A X B^T`` on every map of the
    stack, with small matrices cached per size, dtype and device.

    >>> import torch
    >>> tr = FeatureMapTransfer("nearest")
    >>> E = torch.arange(4.0).reshape(1, 2, 2)
    >>> tr.interpolate(E)[0]
    tensor([[0., 0., 1., 1.],
            [0., 0., 1., 1.],
            [2., 2., 3., 3.],
            [2., 2., 3., 3.]])
    >>> bool(torch.equal(tr.restrict(tr.interpolate(E)), E))
    True
    """

    def __init__(self, interpolation: str = "bilinear", adjoint: bool = False, times: int = 1):
        if interpolation not in INTERPOLATIONS:
            raise ValueError(f"`interpolation` must be one of {INTERPOLATIONS}, got {interpolation!r}")
        self.interpolation, self.adjoint, self.times = interpolation, bool(adjoint), int(times)
        self._mats: dict = {}

    def _matrix(self, kind: str, n: int, like) -> torch.Tensor:
        """``kind`` "R" (n x 2n), "P" (2n x n), "RT", "PT" for coarse size ``n``."""
        key = (kind, n, like.dtype, str(like.device))
        A = self._mats.get(key)
        if A is None:
            M = _restriction_1d(n) if kind[0] == "R" else _interpolation_1d(n, self.interpolation)
            A = self._mats[key] = torch.as_tensor(M.T if kind.endswith("T") else M, dtype=like.dtype,
                                                  device=like.device)
        return A

    @staticmethod
    def _apply(A, B, X):
        return torch.matmul(torch.matmul(A, X), B.transpose(0, 1))

    def _down(self, X, kind):
        H, W = X.shape[-2:]
        if H % 2 or W % 2:
            raise ValueError(f"feature maps of size {H} x {W} cannot be halved; spatial coarsening needs even "
                             "sides on every coarsened level")
        return self._apply(self._matrix(kind, H // 2, X), self._matrix(kind, W // 2, X), X)

    def _up(self, X, kind):
        H, W = X.shape[-2:]
        return self._apply(self._matrix(kind, H, X), self._matrix(kind, W, X), X)

    def restrict(self, U):
        for _ in range(self.times):
            U = self._down(U, "PT" if self.adjoint else "R")
        return U

    def interpolate(self, E):
        for _ in range(self.times):
            E = self._up(E, "RT" if self.adjoint else "P")
        return E


def restrict_maps(X, k: int):
    """``R^k X``: the maps (last two axes) averaged over blocks of ``2^k x 2^k`` pixels."""
    if k == 0:
        return X
    H, W = X.shape[-2:]
    s = 2**k
    return X.reshape(*X.shape[:-2], H // s, s, W // s, s).mean(dim=(-3, -1))


# --------------------------------------------------------------------------- coarse weights
def _galerkin_matrix(size: int) -> np.ndarray:
    """``M[D, d] = #{a in (0, 1): floor((a + d) / 2) = D} / 2`` for offsets ``-r..r`` (``size = 2r + 1``)."""
    r = size // 2
    M = np.zeros((size, size))
    for d in range(-r, r + 1):
        for a in (0, 1):
            M[(a + d) // 2 + r, d + r] += 0.5
    return M


def galerkin_weight(weight: torch.Tensor, depth: int = 1) -> torch.Tensor:
    """Coarse ``Conv2d`` kernels ``K_c = M K M^T``, applied ``depth`` times.

    For a stride-1 convolution with an odd ``(2r + 1)``-wide kernel and
    'same' zero padding, ``K_c`` (same size and padding) is exactly the
    Galerkin operator ``R conv P`` with ``R`` the 2 x 2 average and ``P``
    piecewise-constant interpolation; a 3 x 3 kernel becomes
    ``M = [[1/2, 0, 0], [1/2, 1, 1/2], [0, 0, 1/2]]`` per axis, which keeps the
    kernel sum (the response to constant maps) and halves first differences
    as a rediscretisation on the coarse grid does.

    >>> import torch
    >>> K = torch.zeros(1, 1, 3, 3); K[0, 0, 1, 2] = 1.0     # shift by one pixel
    >>> galerkin_weight(K)[0, 0]
    tensor([[0.0000, 0.0000, 0.0000],
            [0.0000, 0.5000, 0.5000],
            [0.0000, 0.0000, 0.0000]])
    """
    return _per_axis(weight, _galerkin_matrix, depth, "Galerkin")


def _per_axis(weight: torch.Tensor, matrix, depth: int, what: str) -> torch.Tensor:
    """``K <- M_h K M_w^T`` applied ``depth`` times, ``M = matrix(kernel size)`` per axis."""
    kh, kw = weight.shape[-2:]
    if kh % 2 == 0 or kw % 2 == 0:
        raise ValueError(f"{what} coarse weights need odd kernel sizes, got {kh} x {kw}; use "
                         "SpatialCoarsening(weights='same')")
    Mh = torch.as_tensor(matrix(kh), dtype=weight.dtype, device=weight.device)
    Mw = torch.as_tensor(matrix(kw), dtype=weight.dtype, device=weight.device)
    for _ in range(depth):
        weight = torch.matmul(torch.matmul(Mh, weight), Mw.transpose(0, 1))
    return weight


def _moment_matrix(size: int) -> np.ndarray:
    """``S = V^-1 diag(2^-p) V`` with ``V[p, d] = d^p`` (offsets ``d = -r..r``, orders ``p = 0..2r``)."""
    r = size // 2
    d = np.arange(-r, r + 1, dtype=np.float64)
    V = d[None, :] ** np.arange(size)[:, None]
    return np.linalg.solve(V, np.diag(0.5 ** np.arange(size)) @ V)


def rediscretized_weight(weight: torch.Tensor, depth: int = 1) -> torch.Tensor:
    """Coarse ``Conv2d`` kernels that act on polynomials on the coarse grid as the fine ones on the fine grid.

    Per axis the moments ``sum_d K[d] d^p`` of an odd ``(2r + 1)``-wide kernel
    are scaled by ``2^-p`` (``K_c = S K S^T``, :func:`_moment_matrix`), applied
    ``depth`` times: a kernel that approximates ``sum_p c_p dx^p D^p`` on the fine
    grid approximates the same differential operator on the grid of twice the
    spacing (identity kept, first differences halved, second differences
    quartered), which is how one rediscretises a PDE on a coarser grid.

    >>> import torch
    >>> lap = torch.tensor([[[[0.0, 1, 0], [1, -4, 1], [0, 1, 0]]]])
    >>> rediscretized_weight(lap)[0, 0]
    tensor([[ 0.0000,  0.2500,  0.0000],
            [ 0.2500, -1.0000,  0.2500],
            [ 0.0000,  0.2500,  0.0000]])
    """
    return _per_axis(weight, _moment_matrix, depth, "rediscretised")


def _check_conv(j: int, conv: nn.Conv2d) -> None:
    kh, kw = conv.kernel_size
    pad = conv.padding if isinstance(conv.padding, str) else tuple(conv.padding)
    if conv.stride != (1, 1) or conv.dilation != (1, 1) or kh % 2 == 0 or kw % 2 == 0 \
            or pad not in ("same", (kh // 2, kw // 2)):
        raise ValueError(
            f"layer {j} has a Conv2d with kernel {conv.kernel_size}, stride {conv.stride}, dilation "
            f"{conv.dilation} and padding {conv.padding!r}; derived coarse weights need stride 1, dilation 1, an "
            "odd kernel and 'same' padding (kernel_size // 2). Use SpatialCoarsening(weights='same') to apply "
            "the fine weights on the coarse maps instead")


# --------------------------------------------------------------------------- coarse layers
def _set_modes(src: nn.Module, dst: nn.Module) -> None:
    """The copy runs as its source, except: dropout off; BatchNorm in training mode normalises
    with the batch statistics of the coarse maps and updates no running statistics."""
    for s, d in zip(src.modules(), dst.modules()):
        d.training = s.training
        if isinstance(d, nn.modules.dropout._DropoutNd):
            d.training = False
        if isinstance(d, nn.modules.batchnorm._BatchNorm):
            d.track_running_stats = False if s.training else s.track_running_stats


class CoarseLayers:
    """Copies of the layers used on coarsened levels, one set per depth, kept by a module.

    Built once per layer computation (:func:`~propagators.torch.kernel.layer_signature`:
    structure, settings, training mode); every forward pass
    copies the current parameters and buffers in (conv weights replaced by
    their coarse kernels) and binds a new :class:`~propagators.torch.kernel.KernelPass`.
    The copies need no gradients: the coarse levels only step and take state VJPs.
    """

    def __init__(self):
        self._kernels: dict = {}  # depth -> (key, LayerKernel, {j: (source, copy)})

    def bind(self, spec: SpatialCoarsening, modules: dict, used: dict, scheme, batched, streams) -> dict:
        """``{depth: KernelPass}`` for the layers ``used[depth]`` that this rank holds (``modules``)."""
        out = {}
        for k, js in used.items():
            held = sorted(j for j in js if j in modules)
            key = tuple((j, id(modules[j]), layer_signature(modules[j])) for j in held) + (spec.weights,)
            hit = self._kernels.get(k)
            if hit is None or hit[0] != key:
                pairs = {}
                for j in held:
                    src = modules[j]
                    if spec.weights != "same":
                        for s in src.modules():
                            if isinstance(s, nn.Conv2d):
                                _check_conv(j, s)
                    dst = copy.deepcopy(src)
                    for p in dst.parameters():
                        p.requires_grad_(False)
                        p.grad = None
                    _set_modes(src, dst)
                    pairs[j] = (src, dst)
                kernel = LayerKernel({j: d for j, (_, d) in pairs.items()}, scheme, batched, streams)
                hit = self._kernels[k] = (key, kernel, pairs)
            _, kernel, pairs = hit
            with torch.no_grad():
                for src, dst in pairs.values():
                    self._sync(src, dst, k, spec.weights)
            out[k] = kernel.bind()
        return out

    @staticmethod
    def _sync(src: nn.Module, dst: nn.Module, k: int, weights: str) -> None:
        for s, d in zip(src.modules(), dst.modules()):
            for name, p in s.named_parameters(recurse=False):
                v = p.detach()
                if weights != "same" and isinstance(s, nn.Conv2d) and name == "weight":
                    v = (galerkin_weight if weights == "galerkin" else rediscretized_weight)(v, k)
                getattr(d, name).copy_(v)
            for name, b in s.named_buffers(recurse=False):
                if b is not None and getattr(d, name, None) is not None:
                    getattr(d, name).copy_(b)


_CONV_1D = (nn.Conv1d, nn.ConvTranspose1d)
_DROPOUTS = (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout)


class _NoDropout(TorchFunctionMode):
    """Dropout functions return their input: coarse levels drop nothing and draw no random numbers."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            return args[0] if args else kwargs["input"]
        return func(*args, **kwargs)


class CoarsePropagator(ODEPropagator):
    """:class:`ODEPropagator` of a coarsened level.

    Dropout is off (also functional dropout in the layers' ``forward``) and a
    layer error says on which maps it happened.
    """

    def __init__(self, kernel, h, layer_index, level: int):
        super().__init__(kernel, h, layer_index=layer_index)
        self.level = level

    def quiet(self):
        """The context of every coarse evaluation (no dropout)."""
        return _NoDropout()

    def _explain(self, exc, shape):
        return LayerError(
            f"{exc} -- on the coarse feature maps {tuple(shape)} of time level {self.level} (spatial "
            "coarsening, which halves the last two axes of the state: (H, W) of (N, C, H, W) maps). Layers must "
            "work on maps of any size: convolutions with 'same' padding, element-wise operations, normalisations "
            "over channels; for layers that need maps of some size (a wide kernel with reflect padding, batch "
            "statistics of a few pixels), keep the coarse maps at least that large with "
            f"SpatialCoarsening(min_size=...) (the smallest side here is {min(tuple(shape)[-2:])}); or pass "
            "spatial=None (also for states whose last two axes are not both spatial, such as (N, tokens, dim))")

    def step(self, u, t0, t1):
        try:
            with self.quiet():
                return super().step(u, t0, t1)
        except LayerError as exc:
            raise self._explain(exc, u.shape) from exc

    def step_batch(self, U, t0, t1):
        try:
            with self.quiet():
                return super().step_batch(U, t0, t1)
        except LayerError as exc:
            raise self._explain(exc, U.shape[1:]) from exc


class CoarseAdjointPropagator(AdjointPropagator):
    """:class:`AdjointPropagator` of a coarsened level (VJPs of a :class:`CoarsePropagator`)."""

    def step(self, v, tau0, tau1):
        try:
            with self.fwd.quiet():
                return super().step(v, tau0, tau1)
        except LayerError as exc:
            raise self.fwd._explain(exc, v.shape) from exc

    def step_batch(self, V, tau0, tau1):
        try:
            with self.fwd.quiet():
                return super().step_batch(V, tau0, tau1)
        except LayerError as exc:
            raise self.fwd._explain(exc, V.shape[1:]) from exc


def used_layers(hierarchy, n_layers: int, layer_index, depths) -> dict:
    """``{depth: layers}`` of the forward and adjoint steps of the levels of each depth ``> 0``."""
    N = int(n_layers)
    used: dict = {}
    for lv, k in zip(hierarchy, depths):
        if k == 0:
            continue
        s = np.arange(lv.n + 1, dtype=np.int64) * lv.stride
        a, b = s[:-1], s[1:]
        js = set(np.asarray(layer_index(a, b)).tolist()) | set(np.asarray(layer_index(N - b, N - a)).tolist())
        used.setdefault(k, set()).update(js)
    return used


class SpatialLevels:
    """The per-level propagators and transfers of one forward pass (and its adjoint).

    Attributes
    ----------
    depths : list of int
        Halvings of the maps on each time level.
    shapes : list of tuple
        State shape on each level.
    propagators, transfers : list
        What :func:`mgrit.solve` takes as ``propagator`` and ``spatial``.
    """

    def __init__(self, spec: SpatialCoarsening, fine: ODEPropagator, coarse: dict, depths, shape):
        self.spec, self.fine, self.depths = spec, fine, list(depths)
        hw = tuple(shape[-2:])
        self.shapes = [tuple(shape[:-2]) + (hw[0] >> k, hw[1] >> k) for k in self.depths]
        self.propagators = [fine if k == 0 else CoarsePropagator(coarse[k], fine.h, fine.layer_index, level)
                            for level, k in enumerate(self.depths)]
        self.transfers = [FeatureMapTransfer(spec.interpolation, times=b - a) if b > a else None
                          for a, b in zip(self.depths[:-1], self.depths[1:])]

    def adjoint(self, adj: AdjointPropagator, states, n_layers: int):
        """``(propagators, transfers)`` of the adjoint solve: coarse VJPs at the restricted
        forward states ``R^k u`` and the transposed transfers."""
        props, coarse_states = [], {}
        for k, fwd in zip(self.depths, self.propagators):
            if k == 0:
                props.append(adj)
                continue
            if k not in coarse_states:  # levels of one depth share the restricted states
                coarse_states[k] = _restricted(states, k)
            props.append(CoarseAdjointPropagator(fwd, coarse_states[k], n_layers))
        return props, [None if tr is None else FeatureMapTransfer(tr.interpolation, adjoint=True, times=tr.times)
                       for tr in self.transfers]


def _restricted(states, k: int):
    """``ia -> R^k states(ia)``, cached per index pattern (the sweeps repeat theirs)."""
    cache: dict = {}

    def coarse_states(ia):
        ia = np.asarray(ia)
        key = ia.tobytes()
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = restrict_maps(states(ia), k)
        return hit

    return coarse_states


def spatial_levels(spec: SpatialCoarsening, cache: CoarseLayers, fine: ODEPropagator, modules: dict, hierarchy,
                   n_layers: int, x, scheme, batched: bool, streams: int) -> SpatialLevels:
    """The levels of one forward pass of a module with ``spec`` on input ``x``."""
    if x.dim() < 3:
        raise ValueError(f"spatial coarsening needs feature maps of shape (..., C, H, W), got an input of shape "
                         f"{tuple(x.shape)}; pass spatial=None for other states")
    one_d = None if x.dim() != 3 else next(
        ((j, s) for j in sorted(modules) for s in modules[j].modules() if isinstance(s, _CONV_1D)), None)
    if one_d is not None:  # (a Conv1d inside a block on (N, C, H, W) maps, as over pooled channels, is fine)
        raise ValueError(
            f"layer {one_d[0]} holds {type(one_d[1]).__name__} and the states have shape {tuple(x.shape)}: "
            "(N, C, L) sequences have one spatial axis, and spatial coarsening halves the last two (it would "
            "average the channels): pass spatial=None (spatial coarsening is for (N, C, H, W) maps)")
    depths = spec.depths(len(hierarchy), x.shape[-2:])
    used = used_layers(hierarchy, n_layers, fine.layer_index, depths)
    coarse = cache.bind(spec, modules, used, scheme, batched, streams) if used else {}
    return SpatialLevels(spec, fine, coarse, depths, tuple(x.shape))
