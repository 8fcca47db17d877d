"""Multi-stage networks: layer-parallel stages separated by layers that change the state's shape.

A network such as ``stem -> [residual stage at C channels] -> downsample to 2C
channels -> [residual stage at 2C channels] -> head`` is a sequence of
*pieces*: plain ``nn.Module``s (opening, transition and closing layers) and
layer-parallel stages (:class:`LayerParallel`). :class:`MultiStage` runs them in
order. Every stage lives on the same layer communicator; the plain pieces are
*replicated*: every layer rank holds them and computes them on the same input,
so their parameters get the full gradient on every rank and stay identical
after an optimizer step. The semantics, and why this counts every gradient
exactly once, are in ``docs/multistage.md``.

:func:`residual_cnn` builds a two-stage residual CNN, :func:`load_digits_images`
loads scikit-learn's 8 x 8 digits upscaled to ``size x size`` images.
"""
from __future__ import annotations

import contextlib
import copy
import operator
from typing import Sequence

import torch
from torch import nn

from mgrit.comm import Call, args_signature, as_communicator, warn_if_alone

from .module import _STATEFUL, LayerParallel, _announced, _copied, _crc, _one_thread, check_root

_OWN = ("comm", "data_comm")


class Stage:
    """The specification of one layer-parallel stage; :class:`MultiStage` builds it.

    ``Stage(layers, n_layers=None, **options)`` takes the arguments of
    :class:`LayerParallel` except ``comm`` and ``data_comm``, which the
    :class:`MultiStage` supplies (every stage runs on its layer communicator).
    Options given here override the defaults given to :class:`MultiStage`.
    With a factory ``layers(i)`` each rank builds only the layers it needs.
    """

    def __init__(self, layers, n_layers: int | None = None, **options):
        given = [k for k in _OWN if k in options]
        if given:
            raise TypeError(f"Stage got {given}: the communicators are given once, to MultiStage(..., comm=, "
                            "data_comm=), and every stage runs on them")
        self.layers, self.n_layers, self.options = layers, n_layers, options

    def build(self, comm, data_comm=None, **defaults) -> LayerParallel:
        """The :class:`LayerParallel` of this stage on ``comm`` (collective over ``comm``)."""
        return LayerParallel(self.layers, self.n_layers, comm=comm, data_comm=data_comm,
                             **{**defaults, **self.options})

    def __repr__(self) -> str:
        n = self.n_layers if self.n_layers is not None else len(self.layers) if hasattr(self.layers, "__len__") \
            else None
        return "Stage(" + ", ".join([f"n_layers={n}"] + [f"{k}={v!r}" for k, v in self.options.items()]) + ")"


def _same_ranks(a, b) -> bool:
    if a.size != b.size or a.rank != b.rank:
        return False
    if a.size == 1:
        return True
    return [a.world_rank(r) for r in range(a.size)] == [b.world_rank(r) for r in range(b.size)]


#: what a tie between a stage layer and another piece shares, why it is refused, and what to give each piece
_TIES = {"parameter": ("parameter", "a tied parameter would get different gradients on different ranks",
                       "parameters"),
         "buffer": ("buffer (a BatchNorm's running statistics)", "its updates would reach some ranks' replicas only",
                    "BatchNorm modules (copy.deepcopy)")}


def _updated(module: nn.Module) -> list:
    """The buffers of ``module`` that a training pass updates: the running statistics of its BatchNorms."""
    return [b for m in module.modules() if isinstance(m, _STATEFUL) and m.track_running_stats
            for b in m._buffers.values() if b is not None]


class MultiStage(nn.Module):
    """A network of replicated plain pieces and layer-parallel stages, run in order.

    ``MultiStage([stem, Stage(f1, n1), down, Stage(f2, n2), head], comm=layer_comm)``
    computes ``head(LP2(down(LP1(stem(x)))))``. Output and every gradient equal
    those of :meth:`to_serial` (an ``nn.Sequential`` with each stage replaced by
    its :class:`ODENet`, the same state-dict keys) once the stages' solves have
    converged (``fwd_tol`` / ``bwd_tol`` small); see ``docs/multistage.md``.

    On several ranks every stage splits its layers over ``comm``; every other
    piece is replicated: each rank holds it and evaluates it on the same input
    (every stage returns its output on every rank, and its input gradient in
    backward), so its parameters receive the complete gradient on every rank
    -- not a share to be summed -- and stay identical across ranks after an
    optimizer step. The training loop is the same on every rank, with the same
    ``x``. Over a layer x data grid pass ``data_comm`` and call
    :func:`allreduce_gradients` on the whole model over ``data_comm`` only.

    Parameters
    ----------
    pieces : sequence
        ``nn.Module``s (replicated), :class:`LayerParallel` modules (built on
        ``comm``) and :class:`Stage` specifications (built here on ``comm``),
        in the order they are applied; at least one stage.
    comm : None, mpi4py communicator, process group or mgrit.Communicator
        The layer communicator of every stage (default: the one of the first
        given :class:`LayerParallel`, else one rank).
    data_comm : optional
        The data communicator of layer x data parallelism: passed to the
        stages built here; a failure in a replicated piece is announced on it.
    **defaults
        :class:`LayerParallel` options for the stages built from :class:`Stage`
        specifications (``T``, ``cf``, ``fwd_iters``, ``fwd_tol``, ...).

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> torch.manual_seed(0) and None
    >>> net = MultiStage([nn.Linear(3, 4), Stage(lambda i: nn.Sequential(nn.Linear(4, 4), nn.Tanh()), 8),
    ...                   nn.Linear(4, 2), Stage(lambda i: nn.Linear(2, 2), 4)],
    ...                  cf=2, fwd_iters=20, fwd_tol=1e-13).double()
    >>> x = torch.randn(5, 3, dtype=torch.float64)
    >>> bool(torch.allclose(net(x), net.to_serial()(x), atol=1e-11))
    True
    """

    def __init__(self, pieces: Sequence, comm=None, data_comm=None, **defaults):
        super().__init__()
        if isinstance(pieces, nn.Module) and not isinstance(pieces, (nn.Sequential, nn.ModuleList)):
            raise TypeError("`pieces` must be a sequence of nn.Module, LayerParallel and Stage, "
                            f"got a single {type(pieces).__name__}")
        pieces = list(pieces)
        bad = [(i, type(p).__name__) for i, p in enumerate(pieces) if not isinstance(p, (nn.Module, Stage))]
        if bad:
            raise TypeError(f"piece {bad[0][0]} is a {bad[0][1]}; pieces are nn.Module, LayerParallel or Stage")
        for i, p in enumerate(pieces):
            if isinstance(p, nn.Module) and not isinstance(p, LayerParallel) and \
                    any(isinstance(s, LayerParallel) for s in p.modules()):
                raise TypeError(f"piece {i} ({type(p).__name__}) contains a LayerParallel; pass every "
                                "LayerParallel as a piece of its own, so that its ranks and gradients are "
                                "accounted for")
        if not any(isinstance(p, (LayerParallel, Stage)) for p in pieces):
            raise ValueError("`pieces` has no layer-parallel stage (a LayerParallel or a Stage); for a network "
                             "without one use nn.Sequential")
        if comm is None:
            comm = next((p.comm for p in pieces if isinstance(p, LayerParallel)), None)
        warn_if_alone(comm, "MultiStage")
        self._comm = as_communicator(comm)
        self._data_comm = None if data_comm is None else as_communicator(data_comm)
        if defaults and not any(isinstance(p, Stage) for p in pieces):
            raise TypeError(f"LayerParallel options {sorted(defaults)} were given but no piece is a Stage; "
                            "set them on the LayerParallel modules themselves")
        for k in _OWN:
            if k in defaults:  # pragma: no cover - they are named parameters above
                raise TypeError(f"`{k}` is given once, as MultiStage's own argument")
        for i, p in enumerate(pieces):
            if isinstance(p, Stage):
                try:
                    p = pieces[i] = p.build(self._comm, self._data_comm, **defaults)
                except (ValueError, TypeError) as exc:
                    if type(exc) not in (ValueError, TypeError):
                        raise
                    # (which stage: a setting given once for all of them may fit one and not another)
                    raise type(exc)(f"piece {i}, {p!r}: {exc}") from exc
            if isinstance(p, LayerParallel) and not _same_ranks(p.comm, self._comm):
                raise ValueError(
                    f"piece {i} is a LayerParallel on a communicator of {p.comm.size} rank(s) that differs "
                    f"from this MultiStage's ({self._comm.size} rank(s)); every stage runs on the same layer "
                    "communicator: build each with comm=<that communicator>, or pass Stage specifications")
            self.add_module(str(i), p)
        for k, i in enumerate(i for i, p in enumerate(self) if isinstance(p, LayerParallel)):
            self[i]._stage = f"piece {i} (stage {k}, layers numbered from 0 in the stage)"  # (its errors name it)
        self._frozen_ties: list = []  # (piece, name, parameter): frozen and shared with a stage layer
        if self._comm.size > 1:
            self._refuse_ties()
        # consecutive replicated pieces run in one failure-aware session on several ranks
        self._segments: list = []
        for i, p in enumerate(self):
            if isinstance(p, LayerParallel):
                self._segments.append((True, [i]))
            elif self._segments and not self._segments[-1][0]:
                self._segments[-1][1].append(i)
            else:
                self._segments.append((False, [i]))

    def _refuse_ties(self) -> None:
        """On several ranks a parameter shared by two pieces, one of them a stage, is a ValueError on every
        rank: a stage's layer is held by its owner (and the ranks that lend it as a halo) only, so a replicated
        piece tied to it would get that layer's gradient on those ranks and not on the others, and the
        replicas would drift apart. A frozen parameter shared by a replicated piece and a stage layer gets no
        gradient and is allowed; every pass checks that it is still frozen (:meth:`_check_frozen_ties`). A
        BatchNorm's running statistics so shared (``BatchNorm1d(affine=False)`` in a stage layer and a replicated
        piece) are a ValueError too: the owner's updates would reach the replicas of some ranks only. Other
        buffers may be shared (constant tables: a stage layer that changes a buffer in its forward pass raises a
        LayerError anyway)."""
        first, tie, frozen = {}, None, set()
        names = {id(q): (i, n) for i, p in enumerate(self) if not isinstance(p, LayerParallel)
                 for n, q in p.named_parameters()}
        for i, p in enumerate(self):
            held = [m for _, m in p.layers.items()] + list(p._halo.values()) if isinstance(p, LayerParallel) else [p]
            for what, q in ((w, q) for m in held for w, qs in (("parameter", m.parameters()), ("buffer", _updated(m)))
                            for q in qs):
                k = first.setdefault(id(q), i)
                stage = isinstance(p, LayerParallel) or isinstance(self[k], LayerParallel)
                if k == i or not stage:  # (replicated pieces alone: every rank holds both)
                    continue
                if what == "parameter" and not q.requires_grad and id(q) in names:
                    frozen.add(names[id(q)])
                elif tie is None:
                    tie = (k, i, what)
        seen = self._comm.gather((tie, sorted(frozen)), root=None)  # (a stage layer's ties are seen where held)
        tie = next((t for t, _ in seen if t is not None), None)
        if tie is not None:
            k, i, what = tie
            shared, why, fix = _TIES[what]
            raise ValueError(f"pieces {k} and {i} share a {shared}; on several ranks a stage's layers are held by "
                             f"some ranks only, so {why}. Give every piece its own {fix}, or run on one rank")
        # every rank holds the replicated piece: its own copy of the parameter is checked at each pass
        self._frozen_ties = [(i, n, dict(self[i].named_parameters())[n]) for i, n in sorted({x for _, f in seen
                                                                                              for x in f})]

    def _check_frozen_ties(self) -> None:
        """A frozen parameter shared by a replicated piece and a stage layer must stay frozen on several
        ranks (unfrozen, the replicas' gradients of it would differ: 0.19 apart); raised on every rank."""
        with _announced(self._comm):  # (unfrozen on one rank only: the others raise RemoteRankError)
            for i, n, q in self._frozen_ties:
                if q.requires_grad:
                    raise ValueError(f"parameter `{n}` of piece {i} is shared with a stage layer and was frozen "
                                     "when this MultiStage was built; on several ranks it must stay frozen (only "
                                     "the ranks holding that layer would add its gradient): build the model with "
                                     "separate parameters to train it")

    # -- structure --------------------------------------------------------------
    def __getitem__(self, i) -> nn.Module:
        """Piece ``i`` (negative counts from the end); a slice gives an ``nn.Sequential`` of those pieces
        (the same modules), as ``nn.Sequential`` does."""
        if isinstance(i, slice):
            return nn.Sequential(*list(self)[i])
        try:
            return self._modules[str(range(len(self))[operator.index(i)])]
        except IndexError:
            raise IndexError(f"piece index {i} is out of range: this MultiStage has {len(self)} pieces") from None

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    @property
    def stages(self) -> list:
        """The layer-parallel stages (:class:`LayerParallel`), in order."""
        return [p for p in self if isinstance(p, LayerParallel)]

    @property
    def replicated(self) -> list:
        """``(index, module)`` of every replicated piece (held and computed by every rank)."""
        return [(i, p) for i, p in enumerate(self) if not isinstance(p, LayerParallel)]

    @property
    def comm(self):
        """The layer communicator (an :class:`mgrit.Communicator`)."""
        return self._comm

    def _session(self, what: str, signature=None, agree: str = ""):
        """A failure-aware session on several layer ranks (nothing on one) whose handshake names the call."""
        if self._comm.size > 1:
            ids = tuple(p._uid for p in self.stages)  # (its stages' ids tell two MultiStages apart)
            name = f"{what} of the MultiStage of LayerParallel " + ", ".join(f"#{u}" for u in ids)
            return _one_thread(self, self._comm.session(Call(name, (ids, signature), agree)))
        return contextlib.nullcontext()

    # -- forward ----------------------------------------------------------------
    def forward(self, x):
        if self._frozen_ties:
            self._check_frozen_ties()
        for is_stage, idx in self._segments:
            if is_stage:
                x = self[idx[0]](x)
                continue
            try:
                sig = args_signature(tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else None
                with self._session(f"the replicated pieces {idx} of a forward pass", sig, "input shapes or dtypes"):
                    for i in idx:
                        x = self[i](x)
            except BaseException as exc:
                if self._data_comm is not None and self._data_comm.size > 1:
                    self._data_comm.alarm(exc)
                raise
        return x

    # -- serial network, checkpoints, gradients ------------------------------------
    def to_serial(self, root: int = 0):
        """The serial network with the current weights: an ``nn.Sequential`` of deep copies of
        the replicated pieces and of each stage's :class:`ODENet`, on rank ``root``.

        Collective over the layer communicator; None on the other ranks. Its
        state-dict keys are this module's (``1.layers.17.0.weight``...), its
        training mode this module's.
        """
        check_root(root, self._comm.size)
        if self._comm.size == 1:  # one deep copy of everything: parameters tied between pieces stay tied
            return copy.deepcopy(nn.Sequential(*(p._serial_view() if isinstance(p, LayerParallel) else p
                                                 for p in self))).train(self.training)
        here = self._comm.rank == root
        out, memo = [], {}
        for p in self:
            if isinstance(p, LayerParallel):
                out.append(p.to_serial(root))  # collective
            elif here:  # one memo for all replicated pieces: a module or parameter they share stays shared
                out.append(copy.deepcopy(p, memo))
        if not here:
            return None
        return nn.Sequential(*out).train(self.training)

    def serial_state_dict(self, root: int = 0):
        """:meth:`to_serial`'s state dict (copies), gathered as tensors: on rank ``root``, None on the others.
        Collective over the layer communicator (:meth:`LayerParallel.serial_state_dict`); it also serves
        layers that torch does not pickle."""
        check_root(root, self._comm.size)
        out = {}
        for i, p in enumerate(self):
            part = p.serial_state_dict(root) if isinstance(p, LayerParallel) else \
                (_copied(p.state_dict()) if self._comm.rank == root else None)
            if part is not None:
                out.update((f"{i}.{k}", v) for k, v in part.items())
        return out if self._comm.rank == root else None

    def load_serial(self, state_dict: dict, strict: bool = True):
        """Load a full serial state dict (``to_serial().state_dict()``) on every rank.

        Replicated pieces take their entries, each stage those of the layers it
        holds (:meth:`LayerParallel.load_serial`). Collective: a missing entry
        on one rank raises on every rank. Returns, like ``load_state_dict``, the
        ``missing_keys`` and ``unexpected_keys`` (with ``strict``, either raises).
        """
        known = {str(i) for i in range(len(self))}
        missing, unexpected = [], [k for k in state_dict if k.split(".", 1)[0] not in known]
        if strict and unexpected:
            raise KeyError(f"the state dict has {len(unexpected)} entries of no piece of this network "
                           f"({len(self)} pieces), e.g. {unexpected[:3]}")
        for i, p in enumerate(self):
            prefix = f"{i}."
            sub = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
            if isinstance(p, LayerParallel):
                keys = p.load_serial(sub, strict=strict, prefix=prefix)
            else:
                with self._session("load_serial()"):
                    keys = p.load_state_dict(sub, strict=strict)
            missing += [prefix + k for k in keys.missing_keys]
            unexpected += [prefix + k for k in keys.unexpected_keys]
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def gather_gradients(self, root: int | None = 0) -> dict | None:
        """Every parameter's ``.grad`` under the serial network's names, on rank ``root``.

        Stage parameters come from the rank that owns their layer, replicated
        ones from one rank (every rank holds the same complete gradient; see
        :meth:`check_replicas`), so each gradient appears exactly once. Values
        are CPU tensors (None for a parameter without gradient); keys are in
        ``to_serial().named_parameters()`` order. Collective; None on the other
        ranks (``root=None``: on every rank).
        """
        check_root(root, self._comm.size, none_ok=True)
        first = 0 if root is None else root
        mine: dict = {}
        seen: set = set()  # a parameter that several replicated pieces share: once, under its first name
        for i, p in enumerate(self):
            if isinstance(p, LayerParallel) or self._comm.rank == first:
                for n, q in p.named_parameters():
                    if not isinstance(p, LayerParallel):
                        if id(q) in seen:
                            continue
                        seen.add(id(q))
                    mine[f"{i}.{n}"] = None if q.grad is None else q.grad.detach().cpu().clone()
        with self._session("gather_gradients()", root, agree="roots"):
            parts = self._comm.gather(mine, root=root) if self._comm.size > 1 else [mine]
        if parts is None:
            return None
        every = {k: v for part in parts for k, v in part.items()}

        def order(key):
            i, rest = key.split(".", 1)
            if isinstance(self[int(i)], LayerParallel) and rest.startswith("layers."):
                j = rest.split(".", 2)[1]
                return int(i), int(j)
            return int(i), -1

        keys = sorted(every, key=order)  # stable: a layer's own names keep their order
        return {k: every[k] for k in keys}

    def check_replicas(self, grads: bool = False) -> None:
        """Raise ``ValueError`` (on every rank) if a replicated parameter or buffer
        (and with ``grads``, a gradient) differs between the layer ranks.

        Collective; compares checksums of the bits, so it costs one small
        all-gather. Replicas diverge only if the ranks were given different
        inputs, different random draws (dropout: seed every rank alike) or
        non-deterministic kernels; :meth:`sync_replicas` makes them equal again.
        """
        sums = []
        for i, p in self.replicated:
            for n, t in list(p.named_parameters()) + list(p.named_buffers()):
                sums.append((f"{i}.{n}", _crc(t)))
                if grads and isinstance(t, nn.Parameter):
                    sums.append((f"{i}.{n}.grad", None if t.grad is None else _crc(t.grad)))
        with self._session("check_replicas()"):
            every = self._comm.gather(sums, root=None) if self._comm.size > 1 else [sums]
        for r, part in enumerate(every):
            if part != every[0]:
                bad = next((a[0] for a, b in zip(every[0], part) if a != b), "the list of tensors")
                raise ValueError(
                    f"replicated piece tensor {bad} differs between layer rank 0 and rank {r}. Every layer rank "
                    "must run the same training loop on the same input with the same seed; call "
                    "`sync_replicas()` to copy rank 0's replicated pieces to every rank")

    def sync_replicas(self, root: int = 0) -> None:
        """Copy the parameters and buffers of the replicated pieces from rank ``root`` to
        every layer rank (collective)."""
        if self._comm.size == 1:
            return
        tensors = [t for _, p in self.replicated for t in list(p.parameters()) + list(p.buffers())]
        with self._session("sync_replicas()"):
            values = self._comm.bcast([t.detach().cpu() for t in tensors] if self._comm.rank == root else None,
                                      root=root)
            with torch.no_grad():
                for t, v in zip(tensors, values):
                    t.copy_(v)

    # -- diagnostics --------------------------------------------------------------
    @property
    def forward_residuals(self) -> list:
        """The residual of the returned solution of the last forward solve of every stage."""
        return [s.forward_residual for s in self.stages]

    @property
    def backward_residuals(self) -> list:
        """The residual of the returned adjoint of the last backward solve of every stage."""
        return [s.backward_residual for s in self.stages]


# -- a two-stage residual CNN and its data ---------------------------------------


def _seeded(seed: int, make):
    """``make()`` under its own seed, leaving the global random state as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make()


class _ConvLayer(nn.Sequential):
    """The right-hand side ``f(u) = tanh(conv3x3(u))`` of one residual layer."""

    def __init__(self, channels: int):
        super().__init__(nn.Conv2d(channels, channels, 3, padding=1), nn.Tanh())


def residual_cnn(channels: int = 8, n_layers=(8, 8), *, in_channels: int = 1, classes: int = 10,
                 transition: str = "conv", head_pool: int = 4, T: float = 1.0, seed: int = 0, comm=None,
                 data_comm=None, **options) -> MultiStage:
    """A two-stage residual CNN as a :class:`MultiStage`.

    ``conv3x3(in -> C) + tanh`` -> stage 1: ``n1`` residual layers
    ``u + h tanh(conv3x3(u))`` at ``C`` channels -> transition to ``2C``
    channels at half the resolution (``"conv"``: a strided 3x3 convolution +
    tanh; ``"pool"``: 2x2 average pooling + 1x1 convolution) -> stage 2:
    ``n2`` residual layers at ``2C`` channels -> average pooling to
    ``head_pool x head_pool`` -> ``Linear(2C * head_pool**2, classes)``
    (``head_pool=1``: global average pooling). Works for any even image size
    (32 x 32 digits: stage 1 at 32 x 32, stage 2 at 16 x 16).

    Every piece and every layer is initialised from its own seed derived from
    ``seed``, so the same arguments give the same weights on any number of
    ranks, and each rank builds only the layers it needs. ``T`` is the final
    time of each stage (``h = T / n``); ``options`` are :class:`LayerParallel`
    options of both stages (``cf``, ``max_levels``, ``fwd_iters``, ``fwd_tol``...).
    """
    n1, n2 = (n_layers, n_layers) if isinstance(n_layers, int) else tuple(n_layers)
    C, D = int(channels), 2 * int(channels)
    if transition not in ("conv", "pool"):
        raise ValueError(f"`transition` must be 'conv' or 'pool', got {transition!r}")
    base = 1000003 * int(seed)

    def layer(stage, c):
        return lambda i: _seeded(base + 1000 * stage + 10 + i, lambda: _ConvLayer(c))

    stem = _seeded(base + 1, lambda: nn.Sequential(nn.Conv2d(in_channels, C, 3, padding=1), nn.Tanh()))
    if transition == "conv":
        down = _seeded(base + 2, lambda: nn.Sequential(nn.Conv2d(C, D, 3, stride=2, padding=1), nn.Tanh()))
    else:
        down = _seeded(base + 2, lambda: nn.Sequential(nn.AvgPool2d(2), nn.Conv2d(C, D, 1)))
    k = int(head_pool)
    if k < 1:
        raise ValueError(f"`head_pool` must be a positive output size of the pooling, got {head_pool!r}")
    head = _seeded(base + 3, lambda: nn.Sequential(nn.AdaptiveAvgPool2d(k), nn.Flatten(),
                                                   nn.Linear(D * k * k, classes)))
    return MultiStage([stem, Stage(layer(1, C), n1), down, Stage(layer(2, D), n2), head],
                      comm=comm, data_comm=data_comm, T=T, **options)


def load_digits_images(size: int = 32, test_fraction: float = 0.2, seed: int = 0):
    """scikit-learn's 8 x 8 digits as ``(n, 1, size, size)`` images, upscaled bilinearly.

    The pixels are standardised and split as by :func:`propagators.data.load_digits`
    (stratified, fixed by ``seed``). Returns ``(X_train, y_train, X_test,
    y_test)`` as torch tensors (float32 images, int64 labels).
    """
    from ..data import load_digits

    if int(size) < 1:
        raise ValueError(f"`size` must be a positive number of pixels, got {size!r}")
    X, y, Xt, yt = load_digits(test_fraction=test_fraction, seed=seed)

    def images(a):
        t = torch.from_numpy(a).reshape(-1, 1, 8, 8)
        if int(size) == 8:
            return t.contiguous()
        return nn.functional.interpolate(t, size=(int(size), int(size)), mode="bilinear", align_corners=False)

    return images(X), torch.from_numpy(y), images(Xt), torch.from_numpy(yt)
