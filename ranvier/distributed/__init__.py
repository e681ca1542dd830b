"""Data-parallel training over processes and machines: the world of ranks and its
collectives (MPI through mpi4py), gradient averaging overlapped with the backward pass,
ZeRO-1 optimizer-state sharding, and launching N workers through mpiexec."""

from .reducer import GradientReducer, ReduceTimes
from .sharding import ParameterGather, owners
from .world import MPIWorld, WorkerLost, World, current_world, launched_by_mpi

__all__ = ["GradientReducer", "MPIWorld", "ParameterGather", "ReduceTimes", "WorkerLost", "World", "current_world",
           "launched_by_mpi", "owners"]
