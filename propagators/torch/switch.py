"""Switching layer-parallel training to exact gradients when MGRIT's gradient error dominates.

A few MGRIT cycles give a gradient with a systematic error (bias). Early in
training it is small beside the sampling noise of the minibatch gradient and
costs nothing; near a minimum it can dominate, and the optimizer then follows
the bias instead of the data. :class:`SerialSwitch` measures both every few
steps on the current minibatch and, when the bias dominates, switches the
blocks to serial (exact) gradients or tightens the MGRIT solves. The rule and
its rationale: docs/transformer.md.

* :class:`Switchable` -- wraps a :class:`~propagators.torch.LayerParallel`;
  ``mode`` "parallel" (MGRIT) or "serial" (exact: plain autograd through the
  same layers on one rank, converged solves on several ranks). The
  parameters are the same objects in both modes, so an optimizer keeps working.
* :class:`SerialSwitch` -- the controller, called after ``loss.backward()``.
"""
from __future__ import annotations

import contextlib
import copy
import math
import numbers
from dataclasses import dataclass

import torch
from torch import nn

from mgrit.comm import Call, args_signature, as_communicator

from .data_parallel import param_layout
from .module import LayerParallel, _announced
from .rnn import _ParallelRNN

MODES = ("parallel", "serial")


def _exact_iterations(lp: LayerParallel) -> int:
    """Cycles after which ``lp``'s solves equal sequential stepping (:attr:`Switchable.exact_iterations`)."""
    if len(lp.hierarchy) == 1:
        return 1  # one level: the solve is sequential stepping
    cf = lp.options["cf"]
    try:
        first = int(cf)
    except TypeError:  # one factor per level: the first coarsens the layers to level 1
        first = int(list(cf)[0])
    return math.ceil(lp.n_layers / first) + 2


def _exact_block(m) -> bool:
    """Whether an MGRIT block outside the Switchables gives the serial network's gradients: solves to
    tolerances, one level, or (LayerParallel) at least its exact number of cycles."""
    if m.fwd_tol is not None and m.bwd_tol is not None:
        return True
    if isinstance(m, LayerParallel):
        n = _exact_iterations(m)
        return m.fwd_iters >= n and m.bwd_iters >= n
    return m.options.get("max_levels") == 1


_MEASURING = (" in SerialSwitch.measure (every layer rank must measure at the same steps: the same `every`, "
              "update() called alike)")


@contextlib.contextmanager
def _noted(lp: LayerParallel, note: str):
    """The passes of ``lp`` named with ``note`` in their handshakes, inside the block."""
    old = lp._pass_note
    lp._pass_note = note
    try:
        yield
    finally:
        lp._pass_note = old


def _layer_comm(model: nn.Module, switchables: list):
    """The layer communicator of the model's LayerParallel blocks (Switchable or not): the one their
    ranks split the layers over (blocks on one process each have a communicator of their own: the
    first). Blocks distributed over different communicators are refused: the norms could not sum them."""
    comms = {id(m.comm): m.comm for m in model.modules() if isinstance(m, LayerParallel) and m.comm.size > 1}
    if len(comms) > 1:
        raise ValueError("the LayerParallel blocks of the model are distributed over different communicators: "
                         "SerialSwitch sums each gradient norm over the layer ranks of one communicator; build "
                         "every block with the same `comm`")
    return next(iter(comms.values()), switchables[0].lp.comm)


def _distributed(model: nn.Module) -> set:
    """Ids of the parameters each layer rank holds only its part of: those of the model's LayerParallel
    blocks, Switchable or not (their norms are summed over the layer ranks); on one process none."""
    return {id(p) for m in model.modules() if isinstance(m, LayerParallel) and m.comm.size > 1
            for p in m.parameters()}


class Switchable(nn.Module):
    """A :class:`LayerParallel` that can run serially (exactly) with the same parameters.

    ``mode="parallel"``: ``lp(x)`` (MGRIT forward and adjoint solves as configured).
    ``mode="serial"``: on one rank ``lp.serial(x)`` (the layers in order, plain
    autograd); on several ranks the LayerParallel solves run to convergence
    (``exact_iterations`` cycles, the bound of docs/theory.md §5), which gives
    the serial output and gradients across ranks.
    """

    def __init__(self, lp: LayerParallel):
        super().__init__()
        if not isinstance(lp, LayerParallel):
            raise TypeError(f"Switchable wraps a LayerParallel module, got {type(lp).__name__}")
        self.lp = lp
        self._mode = "parallel"
        self._saved: tuple | None = None
        self._saved_given: tuple | None = None  # (the cycles as given: None follows the tolerance)

    @property
    def ranks(self) -> int:
        return self.lp.comm.size

    @property
    def exact_iterations(self) -> int:
        """Cycles after which a solve equals sequential stepping, whatever the residual
        (F-relaxation moves the exact front one coarse point per cycle; one more for skip)."""
        return _exact_iterations(self.lp)

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}")
        if mode == self._mode:
            return
        lp = self.lp
        if self.ranks > 1:  # several ranks: "serial" is a converged solve
            if mode == "serial":
                self._saved = (lp.fwd_iters, lp.bwd_iters, lp.fwd_tol, lp.bwd_tol, lp.tol_type)
                self._saved_given = (dict(lp._given_iters), dict(lp._tols))
                n = self.exact_iterations
                lp.fwd_iters, lp.bwd_iters, lp.fwd_tol, lp.bwd_tol = n, n, None, None
            else:  # the cycles as given before (a count left unset follows its tolerance again)
                lp._set_cycles(*self._saved_given)
                lp.tol_type = self._saved[4]
        self._mode = mode

    @contextlib.contextmanager
    def exact(self):
        """Serial mode inside the block (forward *and* backward must run inside it)."""
        old = self.mode
        self.mode = "serial"
        try:
            yield self
        finally:
            self.mode = old

    def forward(self, x):
        if self._mode == "serial" and self.ranks == 1:
            return self.lp.serial(x)
        if self._mode == "serial":  # a converged solve: the warm start of the next parallel pass is left as it
            warm = self.lp._warm    # was, as by the serial network on one process (the same on any number of ranks)
            try:
                return self.lp(x)
            finally:
                self.lp._warm = warm
        return self.lp(x)

    def _replica_settings(self) -> tuple:
        """What the data replicas must share (compared by allreduce_gradients): the mode."""
        return (("mode", self._mode),)

    def extra_repr(self) -> str:
        return f"mode={self._mode!r}"


@dataclass(frozen=True)
class SwitchRule:
    """When the gradient error dominates: the decision of :class:`SerialSwitch`.

    Once ``window`` measurements exist (since the start or the last action),
    the mean error of the last ``window`` measurements is compared with
    ``ratio`` times their mean noise (``criterion="noise"``) or mean signal
    (``criterion="signal"``), or with ``threshold`` when one is given; the rule
    acts after ``patience`` consecutive measurements above the limit.
    """

    criterion: str = "noise"
    ratio: float = 1.0
    threshold: float | None = None
    window: int = 3
    patience: int = 1

    def __post_init__(self):
        if self.criterion not in ("signal", "noise"):
            raise ValueError(f"`criterion` must be 'signal' or 'noise', got {self.criterion!r}")
        for name in ("window", "patience"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"`{name}` must be an integer >= 1, got {v!r}")
        if not self.ratio >= 0:
            raise ValueError(f"`ratio` must be >= 0, got {self.ratio!r}")
        t = self.threshold  # (a NaN never fires; a negative one fires at every measurement)
        if t is not None and not (isinstance(t, numbers.Real) and not isinstance(t, bool) and not math.isnan(t)):
            raise ValueError(f"`threshold` must be None or a number (not NaN), got {t!r}")

    def over(self, records) -> bool:
        """True when the mean of the last ``window`` of ``records`` (measurement dicts) is above
        the limit; False while fewer than ``window`` measurements exist."""
        recent = list(records)[-self.window:]
        if len(recent) < self.window:
            return False
        err = sum(r["error"] for r in recent) / len(recent)
        limit = sum(r[self.criterion] for r in recent) / len(recent)
        return err > self.ratio * limit or (self.threshold is not None and err > self.threshold)

    def under(self, records, fraction: float) -> bool:
        """True when each of the last ``window`` records has its error below ``fraction`` times its own
        limit (room to spend fewer cycles); False while fewer than ``window`` measurements exist. (Each, not
        their mean: a mean let an error above the raising limit drop a cycle, after quiet steps.)"""
        recent = list(records)[-self.window:]
        if len(recent) < self.window:
            return False
        return all(r["error"] < fraction * self.ratio * r[self.criterion] for r in recent)

    def first_trigger(self, history) -> int | None:
        """The step at which this rule acts on a recorded history (e.g. of a run monitored
        with ``ratio=inf``: the same run with this rule is identical up to that step), or None."""
        strikes = 0
        for i, rec in enumerate(history):
            strikes = strikes + 1 if self.over(history[: i + 1]) else 0
            if strikes >= self.patience:
                return rec["step"]
        return None


class SerialSwitch:
    """Measure the layer-parallel gradient error against the minibatch statistics; switch when it dominates.

    Call :meth:`update` after ``loss.backward()`` and before ``optimizer.step()``.
    Every ``every`` steps (from the first) it takes the layer-parallel gradient
    ``g_lp`` left in ``.grad`` by your backward pass and, on the same batch of
    ``n`` samples split into ``k = groups`` groups of ``n_i`` samples, computes
    the exact gradient ``g_i`` of each group (the :class:`Switchable` blocks in
    serial mode). Then, all relative to ``|g|``:

    * exact batch gradient ``g = sum_i n_i g_i / n`` (the loss is a mean over samples);
    * gradient error ``e = |g_lp - g| / |g|``;
    * noise ``s = sqrt(sum_i n_i |g_i - g|^2 / ((k - 1) n)) / |g|``: the standard
      deviation of the batch gradient around the full-data gradient (per-sample
      variance estimated from the group means, divided by ``n``);
    * signal ``q = sqrt(max(0, 1 - s^2))``: the norm of the full-data gradient,
      estimated as ``|g|^2 - (s |g|)^2`` (the batch gradient's squared norm less its noise).

    The error dominates (:class:`SwitchRule`) when, averaged over the last
    ``window`` measurements, ``e > ratio * s`` (``criterion="noise"``, the
    default: the bias is larger than the sampling error of the minibatch
    gradient, so it is no longer hidden in the noise SGD tolerates anyway) or
    ``e > ratio * q`` (``criterion="signal"``, stricter: the bias is larger than
    the full-data gradient it perturbs, so the expected step need not descend),
    or ``e > threshold`` when one is given. After ``patience`` consecutive such
    measurements the action runs: ``"serial"`` puts every :class:`Switchable` of the model in
    serial mode for the rest of training; ``"tighten"`` doubles ``fwd_iters``
    and ``bwd_iters`` (at most ``Switchable.exact_iterations``, then serial).
    ``"adapt"`` keeps the error between ``lower * ratio`` and ``ratio`` times the
    noise: one more forward and adjoint cycle when it is above (serial at
    ``Switchable.exact_iterations``), one fewer (not below ``min_iters``) when the
    last ``window`` measurements are all comfortably below, but not within ``hold``
    measurements of a raise (so that it does not drop straight back to a count
    that just failed).
    ``.grad`` is restored to ``g_lp`` afterwards, so the optimizer step is the
    one the layer-parallel training would take. A measurement costs one exact
    forward and backward pass over the batch (in ``k`` pieces; one more over the
    whole batch when the model has BatchNorm in training mode, whose statistics
    couple the samples). It leaves no trace on training: buffers (running
    statistics) and the random state are restored. With dropout the exact passes
    draw their own masks, so the measured error also contains the difference of
    masks. The rule and its rationale: docs/transformer.md.

    Parameters
    ----------
    model : nn.Module
        The network; it must contain at least one :class:`Switchable`, and every other MGRIT block
        in it (a bare LayerParallel, ParallelGRU or ParallelLSTM) must be exact: solves to tolerances
        (``fwd_tol`` and ``bwd_tol``), one level, or (LayerParallel) at least its exact number of
        cycles. A ValueError otherwise, since its error would stay in the exact reference.
    loss_fn : callable
        ``loss_fn(model(x), target)``, a mean over the samples of the batch.
    every : int
        Measure every ``every`` calls of :meth:`update`.
    criterion : {"noise", "signal"}
        What the error is compared with.
    ratio : float
        Switch when the gradient error exceeds ``ratio`` times the noise (or signal).
    threshold : float, optional
        Also switch when the relative gradient error alone exceeds this.
    window : int
        Measurements in each decision: their mean error against their mean limit to act, each error
        below its own limit times ``lower`` to drop a cycle.
    patience : int
        Consecutive decisions above the limit needed to act.
    groups : int
        Groups the batch is split into for the noise estimate (``>= 2``); with ``data_comm``, groups
        of the whole batch: each of the ``D`` data ranks splits its shard into ``ceil(groups / D)``.
    action : {"serial", "tighten", "adapt"}
    lower : float
        With ``action="adapt"``: drop a cycle when each error of the window is below ``lower * ratio`` times its
        noise (of solves at fixed cycles: a solve with a tolerance, ``fwd_tol`` / ``bwd_tol``, keeps its cap).
    min_iters : int
        With ``action="adapt"``: the fewest forward and adjoint cycles.
    hold : int
        With ``action="adapt"``: measurements after a raise during which no cycle is dropped.
    data_comm : optional
        With data parallelism (a layer x data grid, :func:`allreduce_gradients`): the data
        communicator. Each data rank measures on its own shard and the measurement combines them
        (the exact gradient and the layer-parallel one of the whole batch, the noise over all
        groups of all shards), so every replica takes the same decision and keeps the same cycles.
        :meth:`update` is then collective over it: its handshake compares the data ranks' parameter
        layouts and layer ranks (a ValueError on every rank, nothing sent, when they differ: replicas
        that froze different parameters, or the world or layer communicator given as ``data_comm``),
        and a failure inside makes the other data ranks raise :class:`mgrit.RemoteRankError`.
        Default: the ``data_comm`` the Switchable blocks' LayerParallel modules were given; pass it
        when they were given none. ``False``: measure this rank's batch alone, not collective (a
        monitor built on one data rank only; replicas whose switches then change the cycles
        differently are refused by :func:`allreduce_gradients`).
    batch_dim : int or (int, int)
        The axis of the samples in ``x`` and in ``target`` (one for both, or a pair), along which the
        batch is split into groups: 0 by default; 1 for a time-major model (``nn.GRU`` and ``ParallelGRU``
        with ``batch_first=False`` take ``(L, B, C)``), e.g. ``(1, 0)`` with a target of one label per
        sample. Splitting the positions of a sequence instead would restart its recursion in every group.

    Attributes
    ----------
    history : list of dict
        One record per measurement: ``step``, ``error``, ``noise``, ``signal``,
        ``grad_norm``, ``mode``, ``fwd_iters``, ``bwd_iters`` (of the first Switchable), ``triggered``,
        ``lowered``.
    switched_at : int or None
        The step (1-based count of :meth:`update` calls) at which the blocks went serial.
    """

    def __init__(self, model: nn.Module, loss_fn, *, every: int = 10, criterion: str = "noise",
                 ratio: float = 1.0, threshold: float | None = None, window: int = 3, patience: int = 1,
                 groups: int = 4, action: str = "serial", lower: float = 0.25, min_iters: int = 1,
                 hold: int = 5, data_comm=None, batch_dim=0):
        self.switchables = [m for m in model.modules() if isinstance(m, Switchable)]
        if not self.switchables:
            raise ValueError("the model contains no Switchable: wrap its LayerParallel module, "
                             "`Switchable(lp)`, and use that in the model (make_vit does)")
        wrapped = {id(s.lp) for s in self.switchables}
        for name, m in model.named_modules():
            # an MGRIT block the switch cannot put in serial mode: its error would be in the "exact"
            # gradient too, so the measured error would be too small, and switching would not remove it
            # (one whose solves run to tolerances, or are exact, can stay as it is)
            unwrapped = isinstance(m, LayerParallel) and id(m) not in wrapped or isinstance(m, _ParallelRNN)
            if unwrapped and not _exact_block(m):
                advice = "wrap it, `Switchable(lp)`, and use that in the model, or" if isinstance(m, LayerParallel) \
                    else "use the serial module (to_gru() / to_lstm()) or"
                raise ValueError(f"the model's {type(m).__name__} `{name}` is not a Switchable: SerialSwitch "
                                 f"measures the gradient error against the model with its Switchable blocks in "
                                 f"serial mode, and this block's MGRIT error (fixed cycles) would stay in that "
                                 f"reference; {advice} converge its solves (fwd_tol and bwd_tol)")
        if action not in ("serial", "tighten", "adapt"):
            raise ValueError(f"`action` must be 'serial', 'tighten' or 'adapt', got {action!r}")
        if not 0 <= lower < 1:
            raise ValueError(f"`lower` must be in [0, 1), got {lower!r}")
        if isinstance(min_iters, bool) or not isinstance(min_iters, int) or min_iters < 1:
            raise ValueError(f"`min_iters` must be an integer >= 1, got {min_iters!r}")
        if isinstance(hold, bool) or not isinstance(hold, int) or hold < 0:
            raise ValueError(f"`hold` must be an integer >= 0, got {hold!r}")
        self.lower, self.min_iters, self.hold = float(lower), min_iters, hold
        dims = batch_dim if isinstance(batch_dim, tuple) else (batch_dim, batch_dim)
        if len(dims) != 2 or any(isinstance(d, bool) or not isinstance(d, int) for d in dims):
            raise ValueError(f"`batch_dim` must be an int or a pair of ints (x's, target's), got {batch_dim!r}")
        self._batch_dims = dims
        self._raised_at = None  # index in history of the last raise
        for name, v, lo in (("every", every, 1), ("groups", groups, 2)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"`{name}` must be an integer >= {lo}, got {v!r}")
        self.rule = SwitchRule(criterion, float(ratio), threshold, window, patience)
        self.model, self.loss_fn = model, loss_fn
        self.every, self.groups, self.action = every, groups, action
        self.steps = 0
        self.strikes = 0
        self._since = 0  # the window restarts after an action (the cycles changed)
        self.history: list = []
        self.switched_at: int | None = None
        self._comm = _layer_comm(model, self.switchables)
        if data_comm is False:
            data_comm = None
        elif data_comm is None:
            given = {id(s.lp._data_comm): s.lp._data_comm for s in self.switchables if s.lp._data_comm is not None}
            if len(given) > 1:
                raise ValueError("the Switchable blocks of one model were given different data communicators: "
                                 "pass the model's one as SerialSwitch(..., data_comm=)")
            data_comm = next(iter(given.values()), None)
        self._data = None if data_comm is None else as_communicator(data_comm)

    @property
    def mode(self) -> str:
        """"serial" once the switch happened, else "parallel"."""
        return "serial" if all(s.mode == "serial" for s in self.switchables) else "parallel"

    # -- checkpoints -----------------------------------------------------------
    def state_dict(self) -> dict:
        """What the switch has learnt and changed, for a checkpoint beside the model's and the optimizer's:
        its counters and measurements, and every Switchable's mode and cycles (the model's ``state_dict``
        holds the parameters only). The cycles are stored as parallel mode runs them, so a checkpoint taken
        on any number of ranks loads on any other. Plain Python values (``torch.save`` them)."""
        blocks = []
        for s in self.switchables:
            lp = s.lp
            now = (lp.fwd_iters, lp.bwd_iters, lp.fwd_tol, lp.bwd_tol, lp.tol_type)
            parallel = s._saved if s.mode == "serial" and s._saved is not None else now
            blocks.append(dict(zip(("fwd_iters", "bwd_iters", "fwd_tol", "bwd_tol", "tol_type"), parallel),
                               mode=s.mode))
        return dict(steps=self.steps, strikes=self.strikes, since=self._since, raised_at=self._raised_at,
                    switched_at=self.switched_at, history=copy.deepcopy(self.history), blocks=blocks)

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s counters and measurements, and every Switchable's mode and cycles
        (the model's parameters come from its own ``load_state_dict``). Call it on every rank."""
        keys = {"steps", "strikes", "since", "raised_at", "switched_at", "history", "blocks"}
        if not isinstance(state, dict) or set(state) != keys:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a SerialSwitch state_dict (its keys are {sorted(keys)}, got {got})")
        if len(state["blocks"]) != len(self.switchables):
            raise ValueError(f"the checkpoint holds {len(state['blocks'])} Switchable blocks, this model "
                             f"{len(self.switchables)}: load it into the model it was taken from")
        for s, b in zip(self.switchables, state["blocks"]):
            s.mode = "parallel"
            lp = s.lp
            lp._restore_cycles({"fwd": b["fwd_iters"], "bwd": b["bwd_iters"]}, {"fwd": b["fwd_tol"], "bwd": b["bwd_tol"]})
            lp.tol_type = b["tol_type"]
            s.mode = b["mode"]  # (on several ranks serial mode sets the exact cycles, keeping these)
        self.steps, self.strikes, self._since = state["steps"], state["strikes"], state["since"]
        self._raised_at, self.switched_at = state["raised_at"], state["switched_at"]
        self.history = copy.deepcopy(state["history"])

    # -- measurement ---------------------------------------------------------
    def _params(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def _grads(self, params):
        return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]

    def _norm(self, params, vectors, distributed: set) -> float:
        """Euclidean norm over the whole model: layer parameters (``distributed``: their ids, see
        :func:`_distributed`) are summed over the layer ranks (each rank owns some), the others
        (replicated on every rank) counted once."""
        dist = rep = 0.0
        for p, v in zip(params, vectors):
            s = float(v.double().pow(2).sum())
            if id(p) in distributed:
                dist += s
            else:
                rep += s
        if self._comm.size > 1:
            dist = self._comm.allreduce(dist)
        return math.sqrt(dist + rep)

    def measure(self, x, target) -> dict:
        """Gradient error and noise on this batch (the gradients in ``.grad`` are those of
        the layer-parallel pass on ``(x, target)``); ``.grad`` is left unchanged. With a data
        communicator: of the whole batch, all data ranks' shards (collective over it)."""
        data = self._data if self._data is not None and self._data.size > 1 else None
        if not torch.is_grad_enabled():
            raise RuntimeError("SerialSwitch.update measures gradients (it runs the model forward and backward on "
                               "groups of the batch): call it outside torch.no_grad() / torch.inference_mode(), "
                               "after the step's loss.backward()")
        if data is None:
            n = self._samples(x)
            if min(self.groups, n) < 2:
                raise ValueError("the noise estimate splits the batch into groups: use batches of >= 2 samples")
            return self._measure(x, target, min(self.groups, n))
        # one session on the data ranks: its handshake compares what must agree (a rank that failed its
        # local checks makes the others raise there, nothing sent yet) and all-gathers the shards' sizes;
        # a failure inside tells the other data ranks, which raise RemoteRankError
        failure = sig = None
        n = k = 0
        try:
            n = self._samples(x)
            if n < 1:
                raise ValueError("SerialSwitch.measure got an empty shard: give every data rank at least one sample")
            k = min(-(-self.groups // data.size), n)
            params = self._params()
            sig = Call("SerialSwitch.measure (collective over the data ranks: build the switch on every data rank, "
                       "or give it data_comm=False to measure one rank's batch alone)",
                       args_signature(len(params), param_layout(params), self._comm.rank, self._comm.size),
                       "model parameters (number, shapes and dtypes of those that require grad) or layer ranks: "
                       "every data rank must hold the same model, and `data_comm` must be the data communicator "
                       "of the layer x data grid (its ranks hold the same layers), not the world or the layer one")
        except Exception as exc:
            failure = exc
        if failure is not None:
            data.open(failure=failure)
            raise failure
        session = data.session(sig, share=(n, k))
        with session:
            total = sum(q for _, q in session.shared)
            n_all = sum(m for m, _ in session.shared)
            rec = self._measure(x, target, k, (n_all, total)) if total >= 2 else None
        if rec is None:
            raise ValueError(f"the noise estimate needs at least 2 groups over the data ranks' shards, got {total} "
                             f"(shards of {[m for m, _ in session.shared]} samples): use batches of >= 2 samples")
        return rec

    def _loss(self, x, target):
        """``loss_fn(model(x), target)``; a loss that fails on one rank is announced to the others (they raise
        in the backward pass's handshake instead of waiting there)."""
        y = self.model(x)
        with _announced(self._comm):
            return self.loss_fn(y, target)

    def _samples(self, x) -> int:
        """The number of samples of ``x`` (along the batch axis)."""
        try:
            return x.shape[self._batch_dims[0]]
        except (AttributeError, IndexError):
            raise ValueError(f"SerialSwitch.update got `x` of shape {tuple(getattr(x, 'shape', ()))}, which has no "
                             f"batch axis {self._batch_dims[0]} (`batch_dim`)") from None

    def _measure(self, x, target, k, totals=None) -> dict:
        """The measurement on ``k`` groups of this batch; ``totals``: the number of samples and of groups
        of all data ranks (their shards are combined: collective over the data communicator)."""
        n = self._samples(x)
        params = self._params()
        g_lp = self._grads(params)
        missing = [p.grad is None for p in params]
        if params and all(missing):
            raise ValueError("SerialSwitch.update compares the gradients of the layer-parallel pass (in .grad) "
                             "with exact ones, but no parameter has a gradient: call it after the step's "
                             "loss.backward() on the same (x, target), before optimizer.zero_grad()")
        xd, td = self._batch_dims
        bounds = [round(i * n / k) for i in range(k + 1)]
        sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        parts = []
        # no side effects on training: buffers (BatchNorm's running statistics) and the random state
        # (the next dropout masks) are as they were before the measurement
        buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        # and the blocks' warm-start trajectories and solve statistics (on several ranks serial mode is a
        # converged solve; blocks outside the Switchables run their own), which the passes would replace
        kept = [(lp, lp._warm, lp.last_forward, lp.last_backward) for lp in self.model.modules()
                if isinstance(lp, LayerParallel)]
        rng = torch.random.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        batch_stats = any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in self.model.modules())
        try:
            with contextlib.ExitStack() as stack:
                for s in self.switchables:
                    stack.enter_context(s.exact())
                for lp, *_ in kept:  # the passes' handshakes name the measurement: a rank that measures
                    stack.enter_context(_noted(lp, _MEASURING))  # where another trains says so
                for a, b in zip(bounds[:-1], bounds[1:]):
                    for p in params:
                        p.grad = None
                    self._loss(x.narrow(xd, a, b - a), target.narrow(td, a, b - a)).backward()
                    parts.append(self._grads(params))
                if batch_stats:  # statistics of the whole batch: the group gradients do not sum to it
                    for p in params:
                        p.grad = None
                    self._loss(x, target).backward()
                    full = self._grads(params)
        finally:
            with torch.no_grad():
                for b, v in buffers:
                    b.copy_(v)
            for lp, warm, forward, backward in kept:
                lp._warm, lp.last_forward, lp.last_backward = warm, forward, backward
            torch.random.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
        g = full if batch_stats else [sum(m * part[q] for m, part in zip(sizes, parts)) / n
                                      for q in range(len(params))]
        n_all, k_all = (n, k) if totals is None else totals
        # the whole batch: all data ranks' shards
        g_all, lp_all = (g, g_lp) if totals is None else self._combine(params, g, g_lp, n, n_all)
        dist = _distributed(self.model)  # (now: a parameter may have been replaced since the switch was built)
        norm = self._norm(params, g_all, dist)
        err = self._norm(params, [a - b for a, b in zip(lp_all, g_all)], dist)
        # per-sample variance from the group means, then the variance of the batch mean
        spread = sum(m * self._norm(params, [a - b for a, b in zip(part, g_all)], dist) ** 2
                     for m, part in zip(sizes, parts))
        if totals is not None:
            spread = self._data.allreduce(spread)
        noise = math.sqrt(spread / (k_all - 1) / n_all)
        for p, v, none in zip(params, g_lp, missing):
            p.grad = None if none else v
        scale = norm if norm > 0 else 1.0
        first = self.switchables[0].lp
        s = noise / scale
        return dict(step=self.steps, error=err / scale, noise=s, signal=math.sqrt(max(0.0, 1.0 - s * s)),
                    grad_norm=norm, mode=self.mode, fwd_iters=first.fwd_iters, bwd_iters=first.bwd_iters)

    def _combine(self, params, g, g_lp, n, n_all) -> tuple:
        """The exact and the layer-parallel gradient of the whole batch of ``n_all`` samples (the shards'
        gradients weighted by their sizes ``n``), in float64: one reduction over the data ranks, the
        same bits on each."""
        devices = {v.device for v in g}
        dev = devices.pop() if len(devices) == 1 else torch.device("cpu")  # (a reducing engine keeps it there)
        flat = torch.cat([n * torch.cat([v.detach().to(dev, torch.float64).reshape(-1) for v in vs])
                          for vs in (g, g_lp)])
        total = self._data.allreduce_array(flat)
        half = len(total) // 2
        out = []
        for part in (total[:half], total[half:]):
            vs, off = [], 0
            for p in params:
                vs.append((part[off: off + p.numel()] / n_all).view_as(p).to(p.device))  # (float64)
                off += p.numel()
            out.append(vs)
        return out[0], out[1]

    # -- control -------------------------------------------------------------
    def update(self, x, target) -> dict | None:
        """Count a training step; every ``every`` steps measure and maybe act. Returns the
        record of a measurement (also appended to ``history``), else None.

        Call it once per optimizer step, after ``loss.backward()`` and before ``optimizer.step()``,
        with the whole batch ``(x, target)`` whose gradient is in ``.grad``: the measurement compares
        ``.grad`` with the exact gradient of ``loss_fn`` (a mean over the samples) on that batch. With
        gradient accumulation over micro-batches, accumulate the whole batch's mean (each micro-batch's
        loss weighted by its share of the samples: divided by their number for equal sizes) and pass the
        concatenated batch; a call per micro-batch, or with the last micro-batch alone, compares ``.grad``
        with another gradient."""
        self.steps += 1
        if self.mode == "serial" or (self.steps - 1) % self.every:
            return None
        rec = self.measure(x, target)
        self.history.append(rec)
        self.strikes = self.strikes + 1 if self.rule.over(self.history[self._since:]) else 0
        rec["triggered"] = self.strikes >= self.rule.patience
        rec["lowered"] = False
        if rec["triggered"]:
            self.strikes = 0
            self._since = len(self.history)
            self._raised_at = len(self.history)
            self._act()
        elif self.action == "adapt" and self.rule.under(self.history[self._since:], self.lower) and (
                self._raised_at is None or len(self.history) - self._raised_at >= self.hold):
            rec["lowered"] = self._lower()
            self._since = len(self.history)
        return rec

    def _lower(self) -> bool:
        changed = False
        for s in self.switchables:
            # one fewer, down to min_iters; never more (a block that starts below min_iters stays there); the
            # cap of a solve with a tolerance stays (it runs until the tolerance: fewer cycles than it needs
            # would only stop it short, with a ConvergenceWarning that asks for more)
            f, b = (n if tol is not None else max(n - 1, min(n, self.min_iters))
                    for n, tol in ((s.lp.fwd_iters, s.lp.fwd_tol), (s.lp.bwd_iters, s.lp.bwd_tol)))
            for name, n in (("fwd_iters", f), ("bwd_iters", b)):
                if n != getattr(s.lp, name):  # (only a change is given: an unchanged default stays unset)
                    setattr(s.lp, name, n)
                    changed = True
        return changed

    def _act(self) -> None:
        if self.action in ("tighten", "adapt"):
            done = True
            for s in self.switchables:
                cap = s.exact_iterations
                for name in ("fwd_iters", "bwd_iters"):
                    n = getattr(s.lp, name)
                    raised = min(2 * n if self.action == "tighten" else n + 1, cap)
                    if raised != n:  # (only a change is given)
                        setattr(s.lp, name, raised)
                done &= s.lp.fwd_iters >= cap and s.lp.bwd_iters >= cap
            if not done:
                return
        for s in self.switchables:
            s.mode = "serial"
        self.switched_at = self.steps
