"""Sparse gradients between ranks: an embedding table's `SparseRows` travel
as indices and rows, all-gathered (concatenated, not summed: finite rows stay
finite), never as dense tables."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from monadl._namespace import namespace
from monadl.deltas import SparseRows
from monadl.distributed._comm import Communicator

__all__ = ["gather_rows"]


async def gather_rows(
    comm: Communicator, grad: Any, data: Any, counts: npt.NDArray[np.int64], scale: float
) -> SparseRows:
    """A sparse delta of every rank as one `SparseRows`: indices and rows, not tables."""
    xp = namespace(data)
    if type(grad) is SparseRows:
        mine = grad
    else:
        mine = SparseRows(xp.zeros(0, dtype=xp.int64, device=data.device), data[:0], data.shape)
    sizes = [int(c) for c in counts]
    indices = await comm.allgather(xp.astype(mine.indices, xp.int64), sizes)
    rows = await comm.allgather(xp.astype(mine.rows, data.dtype), sizes)
    return SparseRows(indices, rows * scale, data.shape)
