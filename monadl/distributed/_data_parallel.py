"""Data-parallel training: every rank runs the model on its shard; all step alike.

One `DataParallel.train` is a transaction across ranks, in three exchanges:

1. **Agree.** Each rank runs its forward and backward (`monadl.runtime.entry.gradients`:
   gradients, no step) and all-gathers a small status: whether it failed,
   and per weight of the model whether its gradient is absent, dense or a
   sparse `SparseRows` (and how many rows). If any rank failed (an
   exception, a non-finite gradient), the ranks all-gather the reasons and
   every rank raises the same `RankFailure`; no rank steps.
2. **Reduce.** Dense gradients are packed into buckets (one flat buffer per
   run of same-dtype weights, up to ``bucket_bytes``) and all buckets are
   all-reduced at once (non-blocking, so the library pipelines them); sparse
   gradients are all-gathered as rows, never as dense tables. A weight that
   no rank reached is not stepped, as on one process.
3. **Commit.** Every rank computes every step from the same reduced
   gradients and then writes them (`_commit`): identical weights everywhere.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Iterable, Sequence
from typing import Any, Final, TypeVar, final, overload

import numpy as np
import numpy.typing as npt

from monadl._namespace import is_array, namespace
from monadl.deltas import SparseRows
from monadl.distributed._comm import Communicator, RankFailure, mpi_world
from monadl.layers import Layer, Weight
from monadl.optim import apply_gradients
from monadl.runtime import entry
from monadl.runtime.settings import current_settings

__all__ = ["DataParallel", "find_weights", "shard"]

T = TypeVar("T")
_ABSENT, _DENSE, _SPARSE = 0, 1, 2
BUCKET_BYTES: Final = 25 << 20  # PyTorch DDP's default bucket size


@final
class DataParallel:
    """Train one model on every rank, each on its own shard, as one model.

    ``await dp.train(loss)`` computes this rank's gradients, averages them
    over the ranks (as PyTorch's DDP and Horovod do, so with equal shards the
    step is the full batch's) and steps every weight identically on every
    rank; if any rank failed, no rank steps and each raises `RankFailure`.

    Args:
        model: the weights to keep in sync: a `Weight`, or any object,
            list, tuple or dict holding them (found by `find_weights`, in the
            same order on every rank).
        comm: how ranks talk; by default ``MPI.COMM_WORLD`` (`mpi_world`).
        bucket_bytes: the largest dense bucket reduced as one buffer.
        average: divide the summed gradients by the number of ranks.

    >>> import numpy as np, monadl as ml
    >>> from monadl.distributed import DataParallel, run_local, shard
    >>> x = np.arange(8.0)
    >>> async def main(comm):
    ...     w = ml.Weight(np.zeros(1), optimizer=ml.optim.sgd(0.1))
    ...     dp = DataParallel(w, comm)
    ...     await dp.broadcast()
    ...     await dp.train(ml.mean(w * shard(x, comm.rank, comm.size)))
    ...     return w.data
    >>> run_local(2, main)  # each rank saw half of x; both stepped by the mean of all of x
    [array([-0.35]), array([-0.35])]
    """

    __slots__ = ("_comm", "_index", "_weights", "average", "bucket_bytes")

    def __init__(
        self, model: object, comm: Communicator | None = None, *, bucket_bytes: int = BUCKET_BYTES, average: bool = True
    ) -> None:
        self._comm = mpi_world() if comm is None else comm
        self._weights = find_weights(model)
        self._index = {w: i for i, w in enumerate(self._weights)}
        self.bucket_bytes = bucket_bytes
        self.average = average

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self._comm.rank

    @property
    def size(self) -> int:
        """The number of ranks."""
        return self._comm.size

    @property
    def weights(self) -> tuple[Weight[Any, Any], ...]:
        """The model's weights, in the order every rank exchanges them."""
        return self._weights

    async def broadcast(self, root: int = 0) -> None:
        """Give every rank ``root``'s weights and optimizer state (at start, or after loading a checkpoint)."""
        comm = self._comm
        blob = b""
        if comm.rank == root:
            blob = pickle.dumps([(w._data, w._state) for w in self._weights], protocol=pickle.HIGHEST_PROTOCOL)
        length = await comm.broadcast(np.array([len(blob)], np.int64), root)
        data = await comm.broadcast(np.frombuffer(blob, np.uint8) if blob else np.empty(int(length[0]), np.uint8), root)
        problem = ""
        if comm.rank != root:
            loaded = pickle.loads(data.tobytes())
            problem = _mismatch(self._weights, [d for d, _ in loaded])
            if not problem:
                for weight, (d, state) in zip(self._weights, loaded):
                    weight._data, weight._state = d, state
        await _agree(comm, problem, None)

    async def train(self, loss: Layer[Any, Any]) -> Any:
        """One data-parallel step: local forward and backward, then all ranks step alike.

        Returns this rank's loss value. Raises `RankFailure` (on every rank)
        if any rank failed; then no weight changed on any rank.
        """
        comm, weights, index = self._comm, self._weights, self._index
        grads: dict[Weight[Any, Any], Any] = {}
        value: Any = None
        problem = ""
        cause: Exception | None = None
        try:
            value, grads = await entry.gradients(loss)
        except Exception as error:
            problem, cause = f"{type(error).__name__}: {error}", error
        status = np.zeros(1 + 2 * len(weights), np.int64)
        for weight, grad in grads.items():
            i = index.get(weight)
            if i is None:
                problem = problem or f"the loss reached a weight outside the model: {weight!r:.60}"
            elif not _finite(grad):
                problem = problem or f"non-finite gradient of weight {i} (shape {_shape(weight._data)})"
            elif type(grad) is SparseRows:
                status[1 + i], status[1 + len(weights) + i] = _SPARSE, grad.indices.shape[0]
            else:
                status[1 + i] = _DENSE
        statuses = await _agree(comm, problem, cause, status)
        kinds, rows = statuses[:, 1 : 1 + len(weights)], statuses[:, 1 + len(weights) :]
        scale = 1.0 / comm.size if self.average else 1.0
        reduced: dict[Weight[Any, Any], Any] = {}
        # Dense where any rank's gradient is dense (the other ranks' rows or
        # absences made dense); rows where the ranks that have one have rows.
        any_dense = (kinds == _DENSE).any(axis=0)
        dense = np.flatnonzero(any_dense).tolist()
        sparse = np.flatnonzero((kinds == _SPARSE).any(axis=0) & ~any_dense).tolist()
        buckets = _buckets([weights[i] for i in dense], self.bucket_bytes)
        flats = [_flatten([_dense(grads.get(w), w._data) for w in bucket]) for bucket in buckets]
        for bucket, total in zip(buckets, await comm.allreduce_many(flats)):
            if scale != 1.0:
                total = total * scale
            if not _finite(total):  # sums can overflow where no addend did
                raise RankFailure({}, "the averaged gradient is not finite (an overflow in the sum)")
            reduced.update(zip(bucket, _unflatten(total, [w._data for w in bucket])))
        for i in sparse:  # rows are concatenated, not summed: finite rows stay finite
            weight = weights[i]
            reduced[weight] = await _gather_rows(comm, grads.get(weight), weight._data, rows[:, i], scale)
        _commit(reduced)
        return value


async def _agree(
    comm: Communicator, problem: str, cause: Exception | None, status: npt.NDArray[np.int64] | None = None
) -> npt.NDArray[np.int64]:
    """All-gather each rank's status (element 0: the length of its failure
    message, 0 if none); if any rank failed, all-gather the messages and raise
    the same `RankFailure` everywhere."""
    message = problem.encode()
    if status is None:
        status = np.zeros(1, np.int64)
    status[0] = len(message)
    statuses = (await comm.allgather(status[None], [1] * comm.size)).reshape(comm.size, -1)
    lengths = statuses[:, 0]
    if lengths.any():
        text = await comm.allgather(np.frombuffer(message, np.uint8).copy(), [int(n) for n in lengths])
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        failures = {r: text[bounds[r] : bounds[r + 1]].tobytes().decode() for r in range(comm.size) if lengths[r]}
        raise RankFailure(failures) from cause
    return statuses


def _commit(grads: dict[Weight[Any, Any], Any]) -> None:
    """Step every weight by its gradient, as ``train()`` commits: every step
    computed before any is written, atomically, never NaN into a weight."""
    apply_gradients(grads, finite=current_settings().finite_steps)


async def _gather_rows(
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


def _buckets(weights: Sequence[Weight[Any, Any]], limit: int) -> list[list[Weight[Any, Any]]]:
    buckets: list[list[Weight[Any, Any]]] = []
    size = 0
    for weight in weights:
        nbytes = int(np.asarray(weight._data).nbytes) if not is_array(weight._data) else int(weight._data.nbytes)
        if buckets and size + nbytes <= limit and _dtype(buckets[-1][0]._data) == _dtype(weight._data):
            buckets[-1].append(weight)
            size += nbytes
        else:
            buckets.append([weight])
            size = nbytes
    return buckets


def _dense(grad: Any, data: Any) -> Any:
    """A rank's gradient as a dense array like the weight (zeros where it has none)."""
    if grad is None:
        return np.zeros(_shape(data), _dtype(data)) if not is_array(data) else namespace(data).zeros_like(data)
    if type(grad) is SparseRows:
        return grad.to_dense()
    if not is_array(grad):
        return np.asarray(grad, _dtype(data))
    return grad


def _flatten(arrays: Sequence[Any]) -> Any:
    xp = namespace(arrays[0])
    return xp.concat([xp.reshape(xp.asarray(a), (-1,)) for a in arrays])


def _unflatten(flat: Any, likes: Sequence[Any]) -> list[Any]:
    xp = namespace(flat)
    out, start = [], 0
    for like in likes:
        shape = _shape(like)
        n = int(np.prod(shape))
        out.append(xp.reshape(flat[start : start + n], shape))
        start += n
    return out


def _finite(grad: Any) -> bool:
    values = grad.rows if type(grad) is SparseRows else grad
    if not is_array(values):
        return bool(np.isfinite(values))
    xp = namespace(values)
    return bool(xp.all(xp.isfinite(values)))


def _shape(data: Any) -> tuple[int, ...]:
    return tuple(data.shape) if hasattr(data, "shape") else ()


def _dtype(data: Any) -> Any:
    return data.dtype if hasattr(data, "dtype") else np.dtype(np.float64)


def _mismatch(mine: Sequence[Weight[Any, Any]], theirs: Sequence[Any]) -> str:
    if len(mine) != len(theirs):
        return f"the model has {len(mine)} weights here and {len(theirs)} on the root"
    for i, (w, d) in enumerate(zip(mine, theirs)):
        if _shape(w._data) != _shape(d) or _dtype(w._data) != _dtype(d):
            return (
                f"weight {i} is {_dtype(w._data)}{list(_shape(w._data))} here, {_dtype(d)}{list(_shape(d))} on the root"
            )
    return ""


def find_weights(model: object) -> tuple[Weight[Any, Any], ...]:
    """The distinct weights a model holds, in a deterministic order.

    Walks attributes, dataclass fields, lists, tuples and dict values (in
    insertion order), without recursion.

    >>> import numpy as np, monadl as ml
    >>> a, b = ml.Weight(np.zeros(2)), ml.Weight(1.0)
    >>> find_weights({"layers": [a, (b, a)]}) == (a, b)
    True
    """
    found: dict[int, Weight[Any, Any]] = {}
    seen: set[int] = set()
    stack: list[object] = [model]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, Weight):
            found.setdefault(id(item), item)
            continue
        children: Iterable[object]
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            children = [getattr(item, f.name) for f in dataclasses.fields(item)]
        elif hasattr(item, "__dict__") and not isinstance(item, type) and type(item).__module__ != "builtins":
            children = vars(item).values()
        else:
            continue
        stack.extend(reversed(list(children)))  # popped in their own order
    return tuple(found.values())


@overload
def shard(data: npt.NDArray[Any], rank: int, size: int, *, drop_last: bool = False) -> npt.NDArray[Any]: ...
@overload
def shard(data: Sequence[T], rank: int, size: int, *, drop_last: bool = False) -> Sequence[T]: ...
def shard(data: Any, rank: int, size: int, *, drop_last: bool = False) -> Any:
    """This rank's share of a dataset or batch: every ``size``-th item from ``rank``.

    Shards differ in length by at most one; ``drop_last`` drops the last
    ``len(data) % size`` items so that all are equal (then averaging the
    ranks' mean losses is the full batch's mean, as with PyTorch's
    ``DistributedSampler(drop_last=True)``).

    >>> shard(list(range(7)), 1, 3)
    [1, 4]
    >>> shard(list(range(7)), 0, 3, drop_last=True)
    [0, 3]
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in 0..{size - 1}")
    end = len(data) - len(data) % size if drop_last else len(data)
    return data[rank:end:size]
