"""Data-parallel training across processes and machines, on MPI (NCCL for CuPy arrays).

Every rank (process) runs the same script on its shard of the data;
`DataParallel.train` averages the gradients over the ranks and steps every
weight identically on every rank, or on none if any rank failed. Needs the
``mpi`` extra (``pip install monadl[mpi]``: mpi4py and the MPICH wheel) to run
across processes; `run_local` runs ranks as threads of one process.

Launch: ``mpiexec -n 4 python -m mpi4py train.py`` (or ``srun python -m
mpi4py train.py``): ``-m mpi4py`` aborts the job when a rank's script raises
an error it does not catch; without it, that rank exits and the others wait
for it until their timeout.
"""

from monadl.distributed._comm import Communicator, MpiCommunicator, Pending, RankFailure, mpi_world
from monadl.distributed._data_parallel import DataParallel
from monadl.distributed._local import LocalCommunicator, run_local
from monadl.distributed._nccl import NcclCommunicator, nccl_world
from monadl.distributed._shard import find_weights, shard

__all__ = [
    "Communicator",
    "DataParallel",
    "LocalCommunicator",
    "MpiCommunicator",
    "NcclCommunicator",
    "Pending",
    "RankFailure",
    "find_weights",
    "mpi_world",
    "nccl_world",
    "run_local",
    "shard",
]
