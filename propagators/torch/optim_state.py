"""An optimizer's state keyed by the serial network's parameter names: resume on another number of ranks.

On several ranks each rank's optimizer holds the state (Adam's moments, SGD's momentum) of the
parameters that rank holds: the layers it owns and the parameters every rank holds alike. Its
``opt.state_dict()`` numbers them per rank, so it loads only on the same number of ranks.
:func:`gather_optimizer_state` collects every rank's state under the parameters' names in
``model.named_parameters()``, which are the serial network's (a :class:`LayerParallel` names its
layers by their global index: ``1.layers.17.0.weight`` on every rank), and
:func:`load_optimizer_state` gives each rank, on any number of ranks, the state of the parameters it
holds. With the weights moved by ``to_serial`` / ``load_serial``, the resumed run is the
uninterrupted one (to the rounding that differs between numbers of ranks).

>>> import torch
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(3, 4), LayerParallel([nn.Linear(4, 4) for _ in range(4)]))
>>> opt = torch.optim.Adam(model.parameters())
>>> model(torch.ones(2, 3)).sum().backward(); opt.step()
>>> saved = gather_optimizer_state(opt, model)        # on every rank (collective); the dict on rank 0
>>> sorted(saved["state"])[:3]
['0.bias', '0.weight', '1.layers.0.bias']
>>> twin = nn.Sequential(nn.Linear(3, 4), LayerParallel([nn.Linear(4, 4) for _ in range(4)]))
>>> twin_opt = torch.optim.Adam(twin.parameters())
>>> load_optimizer_state(twin_opt, twin, saved)        # on every rank of the new run
>>> torch.equal(twin_opt.state[twin[0].weight]["exp_avg"], opt.state[model[0].weight]["exp_avg"])
True
"""
from __future__ import annotations

from torch import nn

from .module import LayerParallel

__all__ = ["gather_optimizer_state", "load_optimizer_state"]

_PER_RANK = ("params", "param_names")  # what a parameter group lists per rank (the rest are hyperparameters)


def _group_names(opt, model: nn.Module) -> list:
    """The names (in ``model``) of each parameter group's parameters, in the group's order."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"pass the model whose parameters the optimizer updates (an nn.Module), got "
                        f"{type(model).__name__}")
    name_of = {id(p): n for n, p in model.named_parameters()}
    groups = []
    for k, g in enumerate(opt.param_groups):
        names = [name_of.get(id(p)) for p in g["params"]]
        if None in names:
            raise ValueError(f"parameter group {k} of the optimizer holds a parameter that is not in the model "
                             "given: pass the model whose parameters the optimizer was built on")
        groups.append(names)
    return groups


def _blocks(model: nn.Module) -> list:
    return [m for m in model.modules() if isinstance(m, LayerParallel)]


def gather_optimizer_state(opt, model: nn.Module, root: int = 0) -> dict | None:
    """``opt``'s state for the whole network, keyed by parameter name, on rank ``root`` of the layer
    communicator of ``model``'s first :class:`LayerParallel` (None on the other ranks; the dict on the
    one process without blocks or ranks). Collective over that communicator: call it on every rank.

    The result, ``{"state": {name: state}, "param_groups": [{hyperparameters..., "params": [names]}]}``,
    saves with ``torch.save`` and loads with :func:`load_optimizer_state` on any number of ranks. The
    parameter groups must be the same on every rank (as many, with the same hyperparameters); a
    parameter every rank holds takes its state from the first rank that has one. The first block's
    communicator must hold every rank that holds a part of the model (on a layer x data grid, the layer
    communicator: the data replicas hold the same state).
    """
    names = _group_names(opt, model)
    sd = opt.state_dict()
    by_index = {i: n for g, gn in zip(sd["param_groups"], names) for i, n in zip(g["params"], gn)}
    mine = {"state": {by_index[i]: s for i, s in sd["state"].items()},
            "param_groups": [{**{k: v for k, v in g.items() if k not in _PER_RANK}, "params": gn}
                             for g, gn in zip(sd["param_groups"], names)]}
    blocks = _blocks(model)
    if not blocks or blocks[0].comm.size == 1:
        return mine
    b = blocks[0]
    with b._session("gather_optimizer_state()"):  # (a rank elsewhere, or one that fails: every rank raises)
        parts = b.comm.gather(mine, root)
    if parts is None:
        return None
    state, groups = {}, []
    for part in parts:
        for n, s in part["state"].items():
            state.setdefault(n, s)
    for r, part in enumerate(parts):
        if len(part["param_groups"]) != len(parts[0]["param_groups"]):
            raise ValueError(f"rank {r}'s optimizer has {len(part['param_groups'])} parameter groups, rank 0's "
                             f"{len(parts[0]['param_groups'])}: build the optimizer alike on every rank")
    for k, g in enumerate(parts[0]["param_groups"]):
        hyper = {key: v for key, v in g.items() if key != "params"}
        params: list = []
        for r, part in enumerate(parts):
            theirs = {key: v for key, v in part["param_groups"][k].items() if key != "params"}
            if repr(theirs) != repr(hyper):
                raise ValueError(f"parameter group {k} has other hyperparameters on rank {r} than on rank 0 "
                                 f"({theirs} against {hyper})")
            params += [n for n in part["param_groups"][k]["params"] if n not in params]
        groups.append({**hyper, "params": params})
    return {"state": state, "param_groups": groups}


def load_optimizer_state(opt, model: nn.Module, state: dict) -> None:
    """Load a state from :func:`gather_optimizer_state` (saved on any number of ranks) into ``opt``, the
    optimizer of ``model`` on this rank: each of its parameters takes the state saved under its name,
    and each group the saved group's hyperparameters. Local: call it on every rank with the same state.
    A parameter of group ``k`` that the saved group ``k`` lacks is a ``KeyError`` (another network, or
    groups made differently); one without a saved state starts without one, as a new optimizer's."""
    names = _group_names(opt, model)
    saved = state["param_groups"]
    if len(saved) != len(names):
        raise ValueError(f"the saved state has {len(saved)} parameter groups, the optimizer {len(names)}: build "
                         "the optimizer with the groups it was saved with")
    current = opt.state_dict()["param_groups"]
    groups, new, start = [], {}, 0
    for k, (gn, sg, cur) in enumerate(zip(names, saved, current)):
        lacking = [n for n in gn if n not in set(sg["params"])]
        if lacking:
            raise KeyError(f"parameter group {k} of the saved state lacks {len(lacking)} of this optimizer's "
                           f"parameters, e.g. {lacking[:3]}: a state of another network, or groups made otherwise")
        ids = list(range(start, start + len(gn)))
        start += len(gn)
        groups.append({**cur, **{key: v for key, v in sg.items() if key not in _PER_RANK}, "params": ids})
        new.update({i: state["state"][n] for i, n in zip(ids, gn) if n in state["state"]})
    opt.load_state_dict({"state": new, "param_groups": groups})
