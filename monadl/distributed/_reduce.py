"""The reduction of a data-parallel step (`DataParallel.train`'s second
exchange): from the ranks' agreed statuses and this rank's gradients to the
gradients every rank steps by.

A weight is reduced dense where any rank's gradient of it is dense (the
other ranks' rows or absences made dense), as rows where the ranks that have
one have rows, and not at all where no rank reached it. Dense gradients that
the overlap (`monadl.distributed._overlap`) all-reduced during the backward
are cut from its buckets' totals, but only at a step where some rank's
gradient of the weight is dense: where every rank has sparse rows (an
embedding table that was once reached densely), it steps by the rows, as
without overlap. The others are packed into buckets (one
flat buffer per run of same-dtype weights, up to ``bucket_bytes``) and all
reduced at once (non-blocking, so the library pipelines them); sparse
gradients are all-gathered as rows (`monadl.distributed._rows`), never as
dense tables. Every rank computes the same result from the same statuses.
Kept apart from `monadl.distributed._data_parallel`, which runs the step's
exchanges and times them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from monadl.distributed._comm import Communicator, RankFailure
from monadl.distributed._overlap import Overlap, Plan, flatten, plan_buckets, unflatten
from monadl.distributed._overlap import dense as dense_like
from monadl.distributed._rank_status import _SPARSE, _finite
from monadl.distributed._rows import gather_rows
from monadl.layers import Weight

__all__ = ["Packed", "pack_rest", "reduce_overlapped", "reduce_rest"]

# What `reduce_rest` sends: the dense buckets, their flat buffers, the weights (by index) sent as rows.
Packed: TypeAlias = tuple[Plan, list[Any], list[int]]


def reduce_overlapped(
    overlap: Overlap, any_dense: npt.NDArray[np.bool_], index: Mapping[Weight[Any, Any], int], scale: float
) -> dict[Weight[Any, Any], Any]:
    """The planned weights' reduced gradients, cut from the overlap's bucket
    totals (awaited): those of the weights whose gradient is dense on some rank."""
    reduced: dict[Weight[Any, Any], Any] = {}
    for bucket, total in zip(overlap.plan, overlap.results):
        total = _checked(total, scale)
        for weight, grad in zip(bucket, unflatten(total, [w._data for w in bucket])):
            # A planned weight is stepped by its bucket only where some rank's gradient is
            # dense: where every rank has rows (or none), `reduce_rest`'s rows step it, as
            # without overlap (a dense total would step every row: under Adam, the rows
            # no rank looked up would move on their momentum).
            if any_dense[index[weight]]:
                reduced[weight] = grad
    return reduced


def pack_rest(
    weights: Sequence[Weight[Any, Any]],
    grads: Mapping[Weight[Any, Any], Any],
    kinds: npt.NDArray[np.int64],
    any_dense: npt.NDArray[np.bool_],
    planned: Mapping[Weight[Any, Any], Any],
    bucket_bytes: int,
) -> Packed:
    """What `reduce_rest` sends: the dense gradients not in the overlap's plan,
    in buckets (and each bucket's flat buffer), and the weights (by index)
    reduced as rows (sparse on some rank, dense on none)."""
    dense = [i for i in np.flatnonzero(any_dense).tolist() if weights[i] not in planned]
    sparse: list[int] = np.flatnonzero((kinds == _SPARSE).any(axis=0) & ~any_dense).tolist()
    buckets = plan_buckets([weights[i] for i in dense], bucket_bytes, bucket_bytes)
    flats = [flatten([dense_like(grads.get(w), w._data) for w in bucket]) for bucket in buckets]
    return buckets, flats, sparse


async def reduce_rest(
    comm: Communicator,
    weights: Sequence[Weight[Any, Any]],
    grads: Mapping[Weight[Any, Any], Any],
    packed: Packed,
    rows: npt.NDArray[np.int64],
    scale: float,
) -> dict[Weight[Any, Any], Any]:
    """The reduced gradients of `pack_rest`'s buckets (all-reduced at once) and
    sparse weights (all-gathered as rows: ``rows`` holds each rank's count)."""
    buckets, flats, sparse = packed
    reduced: dict[Weight[Any, Any], Any] = {}
    for bucket, total in zip(buckets, await comm.allreduce_many(flats)):
        total = _checked(total, scale)
        reduced.update(zip(bucket, unflatten(total, [w._data for w in bucket])))
    for i in sparse:  # rows are concatenated, not summed: finite rows stay finite
        weight = weights[i]
        reduced[weight] = await gather_rows(comm, grads.get(weight), weight._data, rows[:, i], scale)
    return reduced


def _checked(total: Any, scale: float) -> Any:
    if scale != 1.0:
        total = total * scale
    if not _finite(total):  # sums can overflow where no addend did
        raise RankFailure({}, "the averaged gradient is not finite (an overflow in the sum)")
    return total
