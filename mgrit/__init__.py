"""mgrit: a pure-Python MGRIT / FAS parallel-in-time solver.

The solver runs against the abstract :class:`Propagator` interface: implement
``step(u, t0, t1)`` and call :func:`solve`. See the README for a tour.
"""
from .comm import Communicator, MPIComm, RemoteRankError, SerialComm, Tag, as_communicator, split_comm
from .cycle import DivergenceError
from .hierarchy import Hierarchy, Level, build_hierarchy
from .propagator import Propagator
from .result import IterationInfo, Result, Status
from .solver import gather, solve
from .spatial import SpatialTransfer
from . import model, partition, theory
from .tune import Settings, choose_settings

import importlib.metadata as _metadata

try:  # the installed distribution's version (pyproject.toml is the one source)
    __version__ = _metadata.version("mgrit")
except _metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "Propagator",
    "SpatialTransfer",
    "solve",
    "gather",
    "Result",
    "Status",
    "IterationInfo",
    "Hierarchy",
    "Level",
    "build_hierarchy",
    "DivergenceError",
    "Communicator",
    "SerialComm",
    "MPIComm",
    "RemoteRankError",
    "split_comm",
    "as_communicator",
    "Tag",
    "choose_settings",
    "Settings",
]
