"""mgrit: a pure-Python MGRIT / FAS parallel-in-time solver.

The solver runs against the abstract :class:`Propagator` interface: implement
``step(u, t0, t1)`` and call :func:`solve`. See the README for a tour.
"""
from .comm import Communicator, MPIComm, RemoteRankError, SerialComm, Tag, split_comm
from .cycle import DivergenceError
from .hierarchy import Hierarchy, Level, build_hierarchy
from .propagator import Propagator
from .result import IterationInfo, Result, Status
from .solver import gather, solve
from .spatial import SpatialTransfer
from . import model, partition, theory

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
    "Tag",
]
