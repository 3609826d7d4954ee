"""Reducing gradient buckets while the backward pass still runs (as PyTorch's DDP does).

A `Plan` is the same list of dense buckets on every rank: the weights whose
gradient was dense on some rank at the previous step, in the order their
gradients became final there (the earliest rank's), packed up to a size
(the first bucket smaller, so that communication starts early). `Overlap`
carries one step: the runtime tells it each weight's gradient the moment
it is final (`monadl.runtime.entry.gradients`' ``on_gradient``, and
``on_reached`` for the weights this step's graph does not reach, final at
once); once every weight of the next bucket in plan order is final, that
bucket is packed and its all-reduce started, non-blocking
(`Communicator.start_allreduce`: MPI's ``Iallreduce``, NCCL's enqueue on a
stream), and the backward goes on. MPI moves the data inside its calls
(``Test``), which each later final gradient makes; NCCL's on the GPU,
concurrently. Buckets start in plan order on
every rank (collectives must), whatever order a rank's dynamic graph made
its gradients final in; at the end of the backward (or on its failure) every
bucket not started yet starts, a weight this rank never reached contributing
zeros. A failed rank thus still takes part in every collective, and the
agreement round after it makes every rank raise, as without overlap. That
round runs while the buckets are in flight, and they are awaited after it
(before the ranks raise alike, too), so that a rank that came after the
others had given up on it is told so by their statuses, not held in buckets
they left.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Final, final

import numpy as np
import numpy.typing as npt

from monadl._namespace import is_array, namespace
from monadl.deltas import SparseRows
from monadl.distributed._comm import Communicator, Pending
from monadl.layers import Weight

__all__ = [
    "FIRST_BUCKET_BYTES",
    "Overlap",
    "Plan",
    "dense",
    "flatten",
    "nbytes",
    "next_plan",
    "plan_buckets",
    "unflatten",
]

FIRST_BUCKET_BYTES: Final = 1 << 20  # DDP's first bucket: small, so the reduction starts early

Plan = tuple[tuple[Weight[Any, Any], ...], ...]


def plan_buckets(weights: Sequence[Weight[Any, Any]], limit: int, first: int = FIRST_BUCKET_BYTES) -> Plan:
    """Consecutive runs of same-dtype weights, each at most ``limit`` bytes (the first ``first``).

    >>> import numpy as np, monadl as ml
    >>> ws = [ml.Weight(np.zeros(n)) for n in (100, 100, 300)]
    >>> [len(b) for b in plan_buckets(ws, 4000, first=1600)]
    [2, 1]
    """
    buckets: list[list[Weight[Any, Any]]] = []
    size = 0
    for weight in weights:
        n = nbytes(weight._data)
        cap = first if len(buckets) == 1 else limit
        if buckets and size + n <= cap and _dtype(buckets[-1][0]._data) == _dtype(weight._data):
            buckets[-1].append(weight)
            size += n
        else:
            buckets.append([weight])
            size = n
    return tuple(tuple(b) for b in buckets)


def next_plan(
    plan: Plan,
    weights: Sequence[Weight[Any, Any]],
    seen_dense: set[int],
    order: dict[int, int],
    any_dense: npt.NDArray[np.bool_],
    positions: npt.NDArray[np.int64],
    limit: int,
) -> Plan:
    """The buckets of the next steps, the same on every rank (made from statuses all ranks hold).

    Every weight that has had a dense gradient on some rank so far, as
    DDP buckets every parameter (an unreached one contributes zeros, and
    is not stepped; one with rows on every rank steps by its rows), so a
    dynamic network's changing paths keep the same buckets. Ordered by
    when the earliest rank made their gradients
    final, as last seen; rebuilt only when a weight joins.
    """
    late = np.iinfo(np.int64).max
    first = np.where(positions >= 0, positions, late).min(axis=0)
    for i in np.flatnonzero(first < late).tolist():
        order[i] = int(first[i])
    grown = [i for i in np.flatnonzero(any_dense).tolist() if i not in seen_dense]
    if not grown:
        return plan
    seen_dense.update(grown)
    chosen = sorted(seen_dense, key=lambda i: (order.get(i, late), i))
    return plan_buckets([weights[i] for i in chosen], limit, min(limit, FIRST_BUCKET_BYTES))


@final
class Overlap:
    """One step's buckets: filled as gradients become final, started in plan order.

    Use: pass `reached` and `final` to the backward as its listeners, then
    `finish` with every gradient (or none, on failure), then await `wait`
    for `results`. All on the event loop's thread, where the runtime calls
    its listeners: no lock, and no thread to wake (a wake-up costs a time
    slice on a loaded machine, longer than many a backward).
    """

    __slots__ = (
        "_comm",
        "_done",
        "_grads",
        "_launched",
        "_pending",
        "_requests",
        "bucket_of",
        "plan",
        "results",
        "started_at",
    )

    def __init__(self, comm: Communicator, plan: Plan) -> None:
        self._comm = comm
        self.plan = plan
        self.bucket_of = {w: k for k, bucket in enumerate(plan) for w in bucket}
        self._pending = [len(b) for b in plan]
        self._grads: dict[Weight[Any, Any], Any] = {}
        self._requests: list[Pending] = []  # started, in plan order
        self._launched = 0  # == len(self._requests)
        self._done = 0  # requests known to be done
        self.results: list[npt.NDArray[Any]] = []
        self.started_at = 0.0  # when the first bucket started (`time.perf_counter`)

    @property
    def started(self) -> int:
        """How many buckets are in flight or done."""
        return self._launched

    def reached(self, weights: list[Weight[Any, Any]]) -> None:
        """The runtime's listener, before the backward: only ``weights`` will have
        gradients, so every other weight's share is final now (zeros)."""
        for weight in set(self.bucket_of).difference(weights):
            self._final(weight, None)
        self._launch()

    def final(self, weight: Weight[Any, Any], grad: Any) -> None:
        """The runtime's listener: ``weight``'s gradient is final."""
        if weight in self.bucket_of:  # else sparse, or new: reduced after the agreement
            self._final(weight, grad)
            self._launch()
        self._progress()

    def finish(self, grads: Mapping[Weight[Any, Any], Any]) -> None:
        """The backward is over: the buckets not started yet start, with what ``grads`` has."""
        for weight, grad in grads.items():
            if weight in self.bucket_of:
                self._grads.setdefault(weight, grad)
        self._launch(everything=True)

    async def wait(self) -> None:
        """Every bucket reduced, in `results` (raises `RankFailure` if a rank died or hangs)."""
        self.results = [await request.wait() for request in self._requests]

    def reported(self, weight: Weight[Any, Any]) -> Any:
        """The gradient ``weight``'s bucket was packed with (None: zeros)."""
        return self._grads.get(weight)

    def _final(self, weight: Weight[Any, Any], grad: Any) -> None:
        if weight not in self._grads:
            self._grads[weight] = grad
            self._pending[self.bucket_of[weight]] -= 1

    def _launch(self, everything: bool = False) -> None:
        plan = self.plan
        while self._launched < len(plan) and (everything or not self._pending[self._launched]):
            bucket = plan[self._launched]
            flat = flatten([dense(self._grads.get(w), w._data) for w in bucket])
            if not self._launched:
                self.started_at = time.perf_counter()
            self._requests.append(self._comm.start_allreduce(flat))
            self._launched += 1

    def _progress(self) -> None:
        # MPI moves a non-blocking collective's data inside calls like Test:
        # each gradient the backward finishes gives the buckets in flight a turn.
        requests = self._requests
        while self._done < len(requests) and requests[self._done].test():
            self._done += 1


def dense(grad: Any, data: Any) -> Any:
    """A rank's gradient as a dense array like the weight (zeros where it has none)."""
    if grad is None:
        return np.zeros(_shape(data), _dtype(data)) if not is_array(data) else namespace(data).zeros_like(data)
    if type(grad) is SparseRows:
        return grad.to_dense()
    if not is_array(grad):
        return np.asarray(grad, _dtype(data))
    return grad


def flatten(arrays: Sequence[Any]) -> Any:
    """The arrays, raveled and concatenated: one bucket's buffer."""
    xp = namespace(arrays[0])
    return xp.concat([xp.reshape(xp.asarray(a), (-1,)) for a in arrays])


def nbytes(data: Any) -> int:
    """The bytes of a weight's data (a number counts as a float64)."""
    return int(data.nbytes) if is_array(data) else int(np.asarray(data).nbytes)


def unflatten(flat: Any, likes: Sequence[Any]) -> list[Any]:
    """A bucket's buffer cut back into arrays shaped like ``likes`` (`flatten`
    undone), each an array of its like's library: a communicator sums NumPy
    buffers, and a PyTorch or CuPy weight is stepped by its own library's
    gradient (`monadl.optim.apply_gradients` refuses another's)."""
    xp = namespace(flat)
    out, start = [], 0
    for like in likes:
        shape = _shape(like)
        n = int(np.prod(shape))
        piece = xp.reshape(flat[start : start + n], shape)
        if is_array(like) and namespace(like) is not xp:
            import array_api_compat  # (a weight not NumPy's: its library is loaded)

            piece = namespace(like).asarray(piece, device=array_api_compat.device(like))
        out.append(piece)
        start += n
    return out


def _shape(data: Any) -> tuple[int, ...]:
    return tuple(data.shape) if hasattr(data, "shape") else ()


def _dtype(data: Any) -> Any:
    return data.dtype if hasattr(data, "dtype") else np.dtype(np.float64)
